//! The tollgate binary as a child process: started on a config file with its gRPC and admin
//! listeners on free loopback ports, and awaited until `/readyz` answers 200.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Result;

use crate::metrics::{self, Metrics};
use crate::ports::{PORT_ATTEMPTS, free_addr, port_was_taken};
use crate::process::{Proc, wait_until_http};

/// How long tollgate may take to answer `/readyz`: milliseconds when idle; the margin is for a
/// 2-core machine that is also compiling.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How to start one tollgate process.
pub struct TollgateCommand {
    binary: PathBuf,
    config: PathBuf,
    name: String,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    rust_log: String,
    ready_timeout: Duration,
}

impl TollgateCommand {
    /// `binary --config <config>`, named "tollgate", logging warnings only (`RUST_LOG=warn`:
    /// nothing per request, so logging costs the request path nothing).
    pub fn new(binary: &Path, config: &Path) -> TollgateCommand {
        TollgateCommand {
            binary: binary.to_path_buf(),
            config: config.to_path_buf(),
            name: "tollgate".to_owned(),
            args: Vec::new(),
            envs: Vec::new(),
            rust_log: "warn".to_owned(),
            ready_timeout: READY_TIMEOUT,
        }
    }

    /// The name in messages, and of its log file.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// Extra command-line arguments (e.g. `--redis-url`).
    pub fn args<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args
            .extend(args.into_iter().map(|arg| arg.as_ref().to_owned()));
        self
    }

    /// An environment variable for the process (e.g. `SSL_CERT_FILE`, or a `TOLLGATE__*`
    /// override on purpose).
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.envs.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn rust_log(mut self, filter: &str) -> Self {
        self.rust_log = filter.to_owned();
        self
    }

    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Starts it with its output in `<log_dir>/<name>.log`, and waits until it is ready.
    ///
    /// The ports are picked free and then bound by the child, so another process can take one
    /// in between (many tests start processes at once): a child that exits saying so is started
    /// again on fresh ports, up to `PORT_ATTEMPTS` times.
    pub async fn start(self, log_dir: &Path) -> Result<TollgateProcess> {
        let mut attempt = 1;
        loop {
            match self.start_once(log_dir).await {
                Err(error) if attempt < PORT_ATTEMPTS && port_was_taken(&error) => {
                    attempt += 1;
                }
                outcome => return outcome,
            }
        }
    }

    async fn start_once(&self, log_dir: &Path) -> Result<TollgateProcess> {
        let grpc = free_addr();
        let admin = free_addr();
        let mut command = Command::new(&self.binary);
        command
            .arg("--config")
            .arg(&self.config)
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--admin-addr", &admin.to_string()])
            .args(&self.args);
        // TOLLGATE__SECTION__KEY variables override the file: the configuration must be the
        // file's (and the caller's `env`), whatever the caller's environment holds.
        for (variable, _) in std::env::vars_os() {
            if variable.to_string_lossy().starts_with("TOLLGATE__") {
                command.env_remove(variable);
            }
        }
        command
            .env("RUST_LOG", &self.rust_log)
            .envs(self.envs.iter().cloned());
        let log = log_dir.join(format!("{}.log", self.name));
        let proc = Proc::spawn_logged(self.name.clone(), &mut command, log)?;
        let url = format!("http://{admin}/readyz");
        wait_until_http(&proc, self.ready_timeout, &url, |_| true).await?;
        Ok(TollgateProcess { grpc, admin, proc })
    }
}

/// A running tollgate; killed (and reaped) on drop.
pub struct TollgateProcess {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    proc: Proc,
}

impl TollgateProcess {
    pub fn proc(&self) -> &Proc {
        &self.proc
    }

    pub fn proc_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }

    /// The process alone, for a caller that keeps the addresses itself.
    pub fn into_proc(self) -> Proc {
        self.proc
    }

    /// One scrape of its `/metrics`.
    pub async fn metrics(&self) -> Result<Metrics> {
        metrics::scrape(self.admin).await
    }

    /// Waits until `name{labels}` equals `want` (see [`metrics::wait_for_metric`]).
    pub async fn wait_for_metric(&self, name: &str, labels: &[&str], want: f64) -> Result<Metrics> {
        metrics::wait_for_metric(self.admin, name, labels, want).await
    }
}
