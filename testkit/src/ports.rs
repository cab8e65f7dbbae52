//! Free loopback ports for the processes a test or benchmark starts.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

/// A TCP port on 127.0.0.1 that was free a moment ago. The port is released before returning,
/// so another process could take it before the child that gets it binds it; on a test machine
/// that race is rare enough (`redis::RedisServer` retries it).
///
/// # Panics
/// When 127.0.0.1:0 cannot be bound: the machine has no loopback, and nothing here would work.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// `127.0.0.1:<a free port>` (see [`free_port`]).
pub fn free_addr() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()))
}

/// How many times a child that lost a picked port (another process bound it first) is started
/// again on fresh ports (`TollgateCommand::start`, `Envoy::launch_with`, which
/// `Envoy::launch` goes through).
pub const PORT_ATTEMPTS: u32 = 3;

/// Whether a child's start failed because a port it was given was taken in between.
pub fn port_was_taken(error: &anyhow::Error) -> bool {
    format!("{error:#}").contains("Address already in use")
}

/// `127.0.0.1:<port>`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}
