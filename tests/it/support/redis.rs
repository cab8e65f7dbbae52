//! A real `redis-server` per test, on its own free loopback port (never a system Redis on
//! 6379), with no persistence, killed and reaped on drop.
//!
//! `redis-server` comes from the system (`scripts/install-test-deps.sh` installs it); a missing
//! binary is a test failure with instructions, never a silent skip.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::envoy::free_port;

/// How long a fresh server may take to answer PING: milliseconds when idle, the margin is for
/// a 2-core machine that is also compiling.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

pub struct RedisServer {
    /// `redis://127.0.0.1:<port>`, with the password (`redis://:<password>@...`) if the server
    /// requires one.
    pub url: String,
    pub port: u16,
    /// `--requirepass` (see [`RedisServer::start_with_password`]).
    password: Option<String>,
    /// A one-node Redis Cluster owning every slot (see [`RedisServer::start_cluster`]).
    cluster: bool,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    ///
    /// # Panics
    /// When `redis-server` is not installed, or no server answers in time.
    pub async fn start() -> RedisServer {
        RedisServer::start_with(false, None).await
    }

    /// A server that refuses every command until a client authenticates with `password`
    /// (`--requirepass`). [`RedisServer::url`] carries the password, so the test's own commands
    /// work; [`RedisServer::url_without_password`] does not.
    pub async fn start_with_password(password: &str) -> RedisServer {
        RedisServer::start_with(false, Some(password.to_owned())).await
    }

    /// `redis://127.0.0.1:<port>`, with no credentials.
    pub fn url_without_password(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A one-node Redis Cluster that owns all 16384 slots: plain clients work against it
    /// (every key is served here), and a script whose keys span two slots fails with
    /// `CROSSSLOT` exactly as on a real cluster. `CLUSTER KEYSLOT` works only in cluster mode.
    pub async fn start_cluster() -> RedisServer {
        let server = RedisServer::start_with(true, None).await;
        server.claim_all_slots().await;
        server
    }

    async fn claim_all_slots(&self) {
        self.cmd(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]).await;
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        while !self
            .cmd(&["CLUSTER", "INFO"])
            .await
            .contains("cluster_state:ok")
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the one-node cluster on port {} did not reach cluster_state:ok",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn start_with(cluster: bool, password: Option<String>) -> RedisServer {
        // A free port can be taken by someone else before the server binds it: try a few.
        for _ in 0..5 {
            let port = free_port();
            let url = match &password {
                Some(password) => format!("redis://:{password}@127.0.0.1:{port}"),
                None => format!("redis://127.0.0.1:{port}"),
            };
            let mut server = RedisServer {
                url,
                port,
                password: password.clone(),
                cluster,
                child: None,
                dir: tempfile::tempdir().expect("temp dir for redis-server"),
            };
            if server.spawn_and_wait().await {
                return server;
            }
        }
        panic!("redis-server did not start on any of 5 free ports (see the logs above)");
    }

    /// SIGKILLs the server (no shutdown, no save) and reaps it. The port stays this server's
    /// for [`RedisServer::restart`].
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty (nothing is persisted; a cluster node
    /// claims every slot again).
    ///
    /// # Panics
    /// When it does not answer PING in time.
    pub async fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn_and_wait().await,
            "redis-server did not restart on port {}",
            self.port
        );
        if self.cluster {
            self.claim_all_slots().await;
        }
    }

    /// Runs one command on a fresh raw connection and renders the reply as text: strings as
    /// they are, integers in decimal, nil as "", arrays one element per line.
    ///
    /// # Panics
    /// When the command fails or the server does not answer.
    pub async fn cmd(&self, args: &[&str]) -> String {
        render(&self.value(args).await)
    }

    /// Like [`RedisServer::cmd`], returning the raw reply.
    pub async fn value(&self, args: &[&str]) -> redis::Value {
        let (name, rest) = args.split_first().expect("a command");
        let mut command = redis::cmd(name);
        command.arg(rest);
        let mut connection = self.connection().await;
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            command.query_async::<redis::Value>(&mut connection),
        )
        .await
        .unwrap_or_else(|_| panic!("redis-server on {} did not answer {args:?}", self.port));
        reply.unwrap_or_else(|e| panic!("{args:?} on redis-server {}: {e}", self.port))
    }

    /// `cmdstat_<command>`'s `calls` from `INFO commandstats` (0 if never called). The INFO
    /// itself is counted only by the next INFO.
    pub async fn command_calls(&self, command: &str) -> u64 {
        self.command_stats()
            .await
            .get(&command.to_ascii_lowercase())
            .copied()
            .unwrap_or(0)
    }

    /// Every command's `calls` from `INFO commandstats`, by lowercase name (subcommands as
    /// `client|setinfo`).
    pub async fn command_stats(&self) -> BTreeMap<String, u64> {
        parse_commandstats(&self.cmd(&["INFO", "commandstats"]).await)
    }

    /// Every key matching `pattern` (`KEYS`: fine on a test server), sorted.
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .cmd(&["KEYS", pattern])
            .await
            .lines()
            .map(str::to_owned)
            .collect();
        keys.sort();
        keys
    }

    /// Starts `MONITOR` on a raw connection of its own: from now on it sees every command the
    /// server runs, telling clients' commands from those scripts run.
    pub async fn monitor(&self) -> Monitor {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .unwrap_or_else(|e| panic!("connect to redis-server {} for MONITOR: {e}", self.port));
        let mut monitor = Monitor {
            lines: BufReader::new(stream),
            marks: 0,
        };
        monitor
            .lines
            .get_mut()
            .write_all(b"MONITOR\r\n")
            .await
            .expect("send MONITOR");
        assert_eq!(monitor.next_line().await, "+OK", "MONITOR's answer");
        monitor
    }

    /// A plain connection that sends nothing of its own (no `CLIENT SETINFO`), so it adds only
    /// the test's commands to `INFO commandstats`.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        let info = redis::IntoConnectionInfo::into_connection_info(self.url.as_str())
            .expect("test server URL");
        let redis_settings = info.redis_settings().clone().set_skip_set_lib_name();
        let client = redis::Client::open(info.set_redis_settings(redis_settings))
            .expect("client for the test server");
        tokio::time::timeout(
            Duration::from_secs(10),
            client.get_multiplexed_async_connection(),
        )
        .await
        .unwrap_or_else(|_| panic!("connecting to redis-server {} timed out", self.port))
        .unwrap_or_else(|e| panic!("connecting to redis-server {}: {e}", self.port))
    }

    /// Spawns the server on `self.port` and waits for PING; false if it exited (the port was
    /// taken).
    async fn spawn_and_wait(&mut self) -> bool {
        let port = self.port.to_string();
        let log = self.dir.path().join("redis.log");
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(&log);
        if let Some(password) = &self.password {
            command.args(["--requirepass", password]);
        }
        if self.cluster {
            // A restart must not find the old node's config (it would keep its slots).
            let _ = std::fs::remove_file(self.dir.path().join("nodes.conf"));
            command.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ]);
        }
        let spawned = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == ErrorKind::NotFound => panic!(
                "redis-server is not installed: run scripts/install-test-deps.sh (or apt-get \
                 install redis-server)"
            ),
            Err(e) => panic!("spawn redis-server: {e}"),
        };
        self.child = Some(child);

        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten())
            {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                eprintln!("redis-server on port {port} exited with {status}:\n{log}");
                self.child = None;
                return false;
            }
            if self.pings().await {
                return true;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "redis-server on port {port} did not answer PING within {READY_TIMEOUT:?}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn pings(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url.as_str()) else {
            return false;
        };
        let ping = async {
            let mut connection = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(1), ping).await,
            Ok(Ok(pong)) if pong == "PONG"
        )
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `MONITOR` connection (see [`RedisServer::monitor`]).
pub struct Monitor {
    lines: BufReader<tokio::net::TcpStream>,
    marks: u64,
}

impl Monitor {
    /// The names (uppercase) of the commands clients sent since the last call, in order,
    /// leaving out the commands scripts ran (`EVALSHA` counts once, not its `HSET`s). Knows
    /// where "now" is by sending a marker `ECHO` through `server` and reading up to it.
    pub async fn client_commands(&mut self, server: &RedisServer) -> Vec<String> {
        self.marks += 1;
        let mark = format!("tollgate-monitor-mark-{}", self.marks);
        server.cmd(&["ECHO", &mark]).await;
        let mut commands = Vec::new();
        loop {
            let line = tokio::time::timeout(Duration::from_secs(10), self.next_line())
                .await
                .expect("MONITOR shows the marker");
            if line.contains(&mark) {
                return commands;
            }
            // `+<time> [<db> <client>] "<COMMAND>" "<arg>" ...`; a script's calls show the
            // client `lua`.
            let Some((source, command)) = line.split_once("] ") else {
                continue;
            };
            if source.ends_with(" lua") {
                continue;
            }
            let name = command.split('"').nth(1).unwrap_or(command);
            commands.push(name.to_ascii_uppercase());
        }
    }

    async fn next_line(&mut self) -> String {
        let mut line = String::new();
        let read = self.lines.read_line(&mut line).await.expect("read MONITOR");
        assert!(read > 0, "the MONITOR connection closed");
        line.trim_end().to_owned()
    }
}

fn render(value: &redis::Value) -> String {
    use redis::Value;
    match value {
        Value::Nil => String::new(),
        Value::Int(i) => i.to_string(),
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Okay => "OK".to_owned(),
        Value::Array(items) | Value::Set(items) => {
            items.iter().map(render).collect::<Vec<_>>().join("\n")
        }
        Value::VerbatimString { text, .. } => text.clone(),
        Value::Double(d) => d.to_string(),
        Value::Boolean(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// `cmdstat_evalsha:calls=3,usec=...` lines to `{"evalsha": 3}`.
fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_ascii_lowercase(), calls))
        })
        .collect()
}
