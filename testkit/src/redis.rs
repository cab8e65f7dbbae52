//! A real `redis-server` of our own, on its own free loopback port (never a system Redis on
//! 6379), with nothing kept on disk; killed and reaped on drop, killable and restartable on the
//! same port, pausable with `CLIENT PAUSE` through [`RedisServer::cmd`].
//!
//! `redis-server` comes from the system (`scripts/install-test-deps.sh` installs it); a missing
//! binary is an error that says what to install, never a silent skip.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::ports::free_port;
use crate::process::Proc;

/// How long a fresh server may take to answer: milliseconds when idle, the margin is for a
/// 2-core machine that is also compiling.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// What to install when `redis-server` is missing.
const INSTALL: &str = "run scripts/install-test-deps.sh (or apt-get install redis-server)";

/// How to start a server; `RedisOptions::default()` is a plain one from `redis-server` on PATH.
#[derive(Clone, Debug, Default)]
pub struct RedisOptions {
    /// The `redis-server` binary [default: `redis-server` on PATH].
    pub binary: Option<PathBuf>,
    /// `--requirepass`: every command is refused until a client authenticates.
    pub password: Option<String>,
    /// A one-node Redis Cluster that owns all 16384 slots (see [`RedisServer::start_cluster`]).
    pub cluster: bool,
    /// Listen only on TLS, with these files (clients are not asked for certificates).
    pub tls: Option<RedisTls>,
}

/// The certificate files of a TLS-only server.
#[derive(Clone, Debug)]
pub struct RedisTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

pub struct RedisServer {
    /// `redis://127.0.0.1:<port>` (`rediss://` over TLS), with the password
    /// (`redis://:<password>@...`) if the server requires one.
    pub url: String,
    pub port: u16,
    options: RedisOptions,
    proc: Option<Proc>,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    ///
    /// # Panics
    /// When `redis-server` is not installed (saying what to install), or no server answers in
    /// time.
    pub async fn start() -> RedisServer {
        RedisServer::started(RedisOptions::default()).await
    }

    /// A server that refuses every command until a client authenticates with `password`
    /// (`--requirepass`). [`RedisServer::url`] carries the password, so the test's own commands
    /// work; [`RedisServer::url_without_password`] does not.
    ///
    /// # Panics
    /// As [`RedisServer::start`].
    pub async fn start_with_password(password: &str) -> RedisServer {
        RedisServer::started(RedisOptions {
            password: Some(password.to_owned()),
            ..RedisOptions::default()
        })
        .await
    }

    /// A one-node Redis Cluster that owns all 16384 slots: plain clients work against it
    /// (every key is served here), and a script whose keys span two slots fails with
    /// `CROSSSLOT` exactly as on a real cluster. `CLUSTER KEYSLOT` works only in cluster mode.
    ///
    /// # Panics
    /// As [`RedisServer::start`].
    pub async fn start_cluster() -> RedisServer {
        RedisServer::started(RedisOptions {
            cluster: true,
            ..RedisOptions::default()
        })
        .await
    }

    async fn started(options: RedisOptions) -> RedisServer {
        RedisServer::launch(options)
            .await
            .unwrap_or_else(|error| panic!("{error:#}"))
    }

    /// Starts a server as `options` say and waits until it answers.
    pub async fn launch(options: RedisOptions) -> Result<RedisServer> {
        // A free port can be taken by someone else before the server binds it: try a few.
        for _ in 0..5 {
            let port = free_port();
            let scheme = if options.tls.is_some() {
                "rediss"
            } else {
                "redis"
            };
            let url = match &options.password {
                Some(password) => format!("{scheme}://:{password}@127.0.0.1:{port}"),
                None => format!("{scheme}://127.0.0.1:{port}"),
            };
            let mut server = RedisServer {
                url,
                port,
                options: options.clone(),
                proc: None,
                dir: tempfile::Builder::new()
                    .prefix("tollgate-redis-")
                    .tempdir()
                    .context("create a temp dir for redis-server")?,
            };
            if server.spawn_and_wait().await? {
                if server.options.cluster {
                    server.claim_all_slots().await?;
                }
                return Ok(server);
            }
        }
        bail!("redis-server did not start on any of 5 free ports (see the logs above)");
    }

    /// `redis://127.0.0.1:<port>`, with no credentials.
    pub fn url_without_password(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The running process (its CPU time, whether it is alive); an error after
    /// [`RedisServer::kill`].
    pub fn proc(&self) -> Result<&Proc> {
        self.proc
            .as_ref()
            .with_context(|| format!("redis-server on port {} was killed", self.port))
    }

    async fn claim_all_slots(&self) -> Result<()> {
        self.try_cmd(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
            .await?;
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        while !self
            .try_cmd(&["CLUSTER", "INFO"])
            .await?
            .contains("cluster_state:ok")
        {
            ensure!(
                tokio::time::Instant::now() < deadline,
                "the one-node cluster on port {} did not reach cluster_state:ok",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILLs the server (no shutdown, no save) and reaps it. The port stays this server's
    /// for [`RedisServer::restart`].
    pub fn kill(&mut self) {
        self.proc = None;
    }

    /// Starts the server again on the same port, empty (nothing is persisted; a cluster node
    /// claims every slot again).
    ///
    /// # Panics
    /// When it does not answer in time.
    pub async fn restart(&mut self) {
        self.kill();
        let restarted = async {
            ensure!(
                self.spawn_and_wait().await?,
                "redis-server did not restart on port {}",
                self.port
            );
            if self.options.cluster {
                self.claim_all_slots().await?;
            }
            Ok(())
        };
        restarted.await.unwrap_or_else(|error| panic!("{error:#}"));
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
    ///
    /// # Panics
    /// When the command fails or the server does not answer.
    pub async fn value(&self, args: &[&str]) -> redis::Value {
        self.try_value(args)
            .await
            .unwrap_or_else(|error| panic!("{error:#}"))
    }

    async fn try_cmd(&self, args: &[&str]) -> Result<String> {
        Ok(render(&self.try_value(args).await?))
    }

    async fn try_value(&self, args: &[&str]) -> Result<redis::Value> {
        let (name, rest) = args.split_first().context("a command")?;
        let mut command = redis::cmd(name);
        command.arg(rest);
        let mut connection = self.try_connection().await?;
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            command.query_async::<redis::Value>(&mut connection),
        )
        .await
        .with_context(|| format!("redis-server on {} did not answer {args:?}", self.port))?;
        reply.with_context(|| format!("{args:?} on redis-server {}", self.port))
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
    ///
    /// # Panics
    /// When it cannot connect in time.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        self.try_connection()
            .await
            .unwrap_or_else(|error| panic!("{error:#}"))
    }

    async fn try_connection(&self) -> Result<redis::aio::MultiplexedConnection> {
        let info = redis::IntoConnectionInfo::into_connection_info(self.url.as_str())
            .context("test server URL")?;
        let redis_settings = info.redis_settings().clone().set_skip_set_lib_name();
        let client = redis::Client::open(info.set_redis_settings(redis_settings))
            .context("client for the test server")?;
        tokio::time::timeout(
            Duration::from_secs(10),
            client.get_multiplexed_async_connection(),
        )
        .await
        .with_context(|| format!("connecting to redis-server {} timed out", self.port))?
        .with_context(|| format!("connecting to redis-server {}", self.port))
    }

    /// Spawns the server on `self.port` and waits until it answers; false if it exited (the
    /// port was taken).
    async fn spawn_and_wait(&mut self) -> Result<bool> {
        let port = self.port.to_string();
        let binary = self
            .options
            .binary
            .clone()
            .unwrap_or_else(|| PathBuf::from("redis-server"));
        let mut command = Command::new(&binary);
        match &self.options.tls {
            None => command.args(["--port", &port]),
            Some(tls) => command
                .args(["--port", "0", "--tls-port", &port])
                .args(["--tls-auth-clients", "no"])
                .arg("--tls-cert-file")
                .arg(&tls.cert)
                .arg("--tls-key-file")
                .arg(&tls.key)
                .arg("--tls-ca-cert-file")
                .arg(&tls.ca),
        };
        command
            .args(["--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path());
        if let Some(password) = &self.options.password {
            command.args(["--requirepass", password]);
        }
        if self.options.cluster {
            // A restart must not find the old node's config (it would keep its slots).
            let _ = std::fs::remove_file(self.dir.path().join("nodes.conf"));
            command.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ]);
        }
        // Without --logfile, redis-server logs on stdout: into the log with stderr.
        let log = self.dir.path().join("redis.log");
        let proc = match Proc::spawn_logged("redis-server", &mut command, log) {
            Ok(proc) => proc,
            Err(error) if not_found(&error) => {
                bail!("{} is not installed: {INSTALL}", binary.display())
            }
            Err(error) => return Err(error),
        };
        self.proc = Some(proc);

        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            let proc = self.proc.as_ref().expect("spawned above");
            if let Some(status) = proc.try_wait()? {
                eprintln!(
                    "redis-server on port {port} exited with {status}:\n{}",
                    proc.log()
                );
                self.proc = None;
                return Ok(false);
            }
            if self.answers().await {
                return Ok(true);
            }
            let proc = self.proc.as_ref().expect("spawned above");
            ensure!(
                tokio::time::Instant::now() < deadline,
                "redis-server on port {port} did not answer within {READY_TIMEOUT:?}: {}",
                proc.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the server answers: PING for a plain server; for a TLS one (whose certificate
    /// a plain client cannot check), its log says it is ready and its port accepts.
    async fn answers(&self) -> bool {
        if self.options.tls.is_some() {
            let ready = self
                .proc
                .as_ref()
                .is_some_and(|proc| proc.log().contains("Ready to accept connections"));
            // The log line can precede the listening socket by a moment.
            return ready
                && tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .is_ok();
        }
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

fn not_found(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == ErrorKind::NotFound)
}

/// `redis-server --version`, shortened to `Redis server v=7.0.15`; fails with what to install
/// when `binary` is missing.
pub fn version(binary: &Path) -> Result<String> {
    match Command::new(binary)
        .arg("--version")
        .stderr(Stdio::null())
        .output()
    {
        Ok(output) => Ok(String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            bail!("{} is not installed: {INSTALL}", binary.display())
        }
        Err(e) => Err(e).with_context(|| format!("run {} --version", binary.display())),
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
