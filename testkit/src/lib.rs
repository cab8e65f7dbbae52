//! The harness that tollgate's integration tests (`tests/it/`) and its examples (the
//! benchmarks, the load lab) share: child processes killed on drop with their output kept for
//! failure messages, free loopback ports, real Envoy (located, rendered, started and awaited),
//! real `redis-server`, the tollgate binary and the example binaries in the target dir, and
//! `/metrics` scraped and awaited.
//!
//! It runs the tollgate binary but does not link the tollgate crate. Every function returns
//! `anyhow::Result` so a benchmark can report the error; the few that panic say so (`# Panics`),
//! for tests, which fail with what to install rather than skip.
//!
//! Every address is on 127.0.0.1: nothing here sends traffic off the machine.

pub mod bench;
pub mod bins;
pub mod envoy;
pub mod host;
pub mod metrics;
pub mod ports;
pub mod process;
pub mod redis;
pub mod text;
pub mod tollgate;
pub mod upstream;

use std::path::Path;

/// The repository root (the tollgate crate's directory), where `envoy/`, `.tools/` and `src/`
/// are. The kit lives in `testkit/` right under it.
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ sits in the repository root")
}

/// An HTTP client for loopback endpoints (admin ports, `/metrics`, `/ready`): never through a
/// proxy, since an `http_proxy` in the environment must not capture loopback traffic.
pub fn loopback_client() -> anyhow::Result<reqwest::Client> {
    use anyhow::Context as _;
    reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .context("build the loopback HTTP client")
}
