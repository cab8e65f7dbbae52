//! Real processes for end-to-end tests: the tollgate binary and the example upstream, each
//! killed on drop; and `Stack`, the three of them behind a real Envoy.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use super::envoy::{Envoy, EnvoyPorts, e2e_envoy_version, free_port};
use super::server::{Metrics, http_get};

/// The example upstream (`examples/upstream.rs`), built by `cargo test` with the examples.
pub struct Upstream {
    pub addr: SocketAddr,
    child: Child,
}

impl Upstream {
    pub fn start(args: &[&str]) -> Upstream {
        let binary = example_binary("upstream");
        let mut child = Command::new(&binary)
            .args(["--addr", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", binary.display()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("read the upstream's first line");
        let addr = line
            .trim()
            .strip_prefix("upstream listening on ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first line from the upstream: {line:?}"));
        Upstream { addr, child }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Path of an example binary next to this test binary (target/<profile>/examples/NAME).
/// `scripts/test.sh` builds the ones the tests run: an example with `test = true` in
/// Cargo.toml is built by `cargo test` only as a test harness, not as this binary.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.is_file(),
        "example {name} is not built at {}: run the tests with `bash scripts/test.sh`, or \
         `cargo build --example {name}` first",
        path.display()
    );
    path
}

/// The tollgate binary, started with a YAML config on free loopback ports.
pub struct Tollgate {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    child: Child,
    _config: tempfile::NamedTempFile,
    /// Where stderr goes, if captured (see [`Tollgate::start_logged`]).
    log: Option<tempfile::NamedTempFile>,
}

impl Tollgate {
    pub async fn start(config_yaml: &str) -> Tollgate {
        Tollgate::start_with(config_yaml, &[], &[]).await
    }

    /// Like [`Tollgate::start`], with extra command-line arguments (e.g. `--redis-url`) and
    /// environment variables (e.g. `SSL_CERT_FILE`) for the process.
    pub async fn start_with(config_yaml: &str, args: &[&str], envs: &[(&str, &str)]) -> Tollgate {
        Tollgate::spawn(config_yaml, args, envs, false).await
    }

    /// Like [`Tollgate::start_with`], with stderr (the log, at `RUST_LOG=warn`) captured in a
    /// file for [`Tollgate::log`] instead of the test's output.
    pub async fn start_logged(config_yaml: &str, args: &[&str], envs: &[(&str, &str)]) -> Tollgate {
        Tollgate::spawn(config_yaml, args, envs, true).await
    }

    /// What the process logged so far (empty unless started with [`Tollgate::start_logged`]).
    pub fn log(&self) -> String {
        self.log
            .as_ref()
            .map(|log| std::fs::read_to_string(log.path()).expect("read the tollgate log"))
            .unwrap_or_default()
    }

    async fn spawn(
        config_yaml: &str,
        args: &[&str],
        envs: &[(&str, &str)],
        capture_log: bool,
    ) -> Tollgate {
        let config = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("temp config file");
        std::fs::write(config.path(), config_yaml).expect("write config");
        let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let log = capture_log.then(|| tempfile::NamedTempFile::new().expect("temp log file"));
        let stderr = match &log {
            Some(log) => Stdio::from(log.reopen().expect("open the log file")),
            None => Stdio::inherit(),
        };
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("--config")
            .arg(config.path())
            .args([
                "--grpc-addr",
                &grpc.to_string(),
                "--admin-addr",
                &admin.to_string(),
            ])
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn the tollgate binary");
        let mut tollgate = Tollgate {
            grpc,
            admin,
            child,
            _config: config,
            log,
        };
        tollgate.wait_ready().await;
        tollgate
    }

    async fn wait_ready(&mut self) {
        for _ in 0..400 {
            if let Some(status) = self.child.try_wait().expect("poll tollgate") {
                panic!("tollgate exited during start-up: {status}");
            }
            if let Ok(response) = reqwest::get(format!("http://{}/readyz", self.admin)).await
                && response.status().is_success()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("tollgate did not become ready on {}", self.admin);
    }

    pub async fn metrics(&self) -> Metrics {
        Metrics(http_get(self.admin, "/metrics").await.1)
    }

    /// Polls until `name{labels}` equals `want`; panics with the last value otherwise.
    pub async fn wait_for_metric(&self, name: &str, labels: &[&str], want: f64) {
        let mut last = None;
        for _ in 0..500 {
            last = self.metrics().await.find(name, labels);
            if last == Some(want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{name}{labels:?} never reached {want}; last {last:?}");
    }

    /// Sends SIGTERM, as Kubernetes does.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// SIGKILLs the process (no drain, no settling: a crashed replica) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit (bounded).
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll tollgate") {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "tollgate did not exit within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Client → real Envoy (front-proxy.yaml) → example upstream, with the tollgate binary as the
/// ext_proc service.
pub struct Stack {
    pub envoy: Envoy,
    pub tollgate: Tollgate,
    pub upstream: Upstream,
    pub client: reqwest::Client,
}

impl Stack {
    pub async fn start(tollgate_config: &str, upstream_args: &[&str]) -> Stack {
        let upstream = Upstream::start(upstream_args);
        let tollgate = Tollgate::start(tollgate_config).await;
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/front-proxy.yaml");
        let ports = EnvoyPorts::free(upstream.addr.port(), tollgate.grpc.port());
        let envoy = Envoy::start(&e2e_envoy_version(), &config, ports).await;
        Stack {
            envoy,
            tollgate,
            upstream,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("HTTP client"),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.envoy.listen)
    }

    pub fn upstream_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.upstream.addr)
    }
}
