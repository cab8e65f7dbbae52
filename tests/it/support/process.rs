//! Real processes for end-to-end tests, from the test kit: the tollgate binary and the example
//! upstream, each killed on drop; and `Stack`, the two of them behind a real Envoy. These
//! wrappers give the tests their shape: a config as YAML text, and a panic, with the kit's
//! message, where the kit returns an error.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tollgate_testkit::bins;
use tollgate_testkit::metrics::Metrics;
use tollgate_testkit::tollgate::{TollgateCommand, TollgateProcess};

use super::envoy::{Envoy, EnvoyPorts, e2e_envoy_version};

/// A kit result's value, or a panic with its error (and causes).
fn or_panic<T>(result: anyhow::Result<T>) -> T {
    result.unwrap_or_else(|error| panic!("{error:#}"))
}

/// The example upstream (`examples/upstream.rs`), built by `scripts/test.sh`.
pub struct Upstream {
    pub addr: SocketAddr,
    _process: tollgate_testkit::upstream::Upstream,
}

impl Upstream {
    pub fn start(args: &[&str]) -> Upstream {
        let process = or_panic(tollgate_testkit::upstream::Upstream::start(
            &example_binary("upstream"),
            args,
            None,
        ));
        Upstream {
            addr: process.addr,
            _process: process,
        }
    }
}

/// Path of an example binary next to this test binary (target/<profile>/examples/NAME).
/// `scripts/test.sh` builds the ones the tests run: an example with `test = true` in
/// Cargo.toml is built by `cargo test` only as a test harness, not as this binary.
pub fn example_binary(name: &str) -> PathBuf {
    or_panic(bins::example(name, None))
}

/// The tollgate binary, started with a YAML config on free loopback ports, its log (stderr, at
/// `RUST_LOG=warn`) in a file for [`Tollgate::log`].
pub struct Tollgate {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    process: TollgateProcess,
    /// The config and the log; removed after the process (fields drop in order).
    _dir: tempfile::TempDir,
}

impl Tollgate {
    pub async fn start(config_yaml: &str) -> Tollgate {
        Tollgate::start_with(config_yaml, &[], &[]).await
    }

    /// Like [`Tollgate::start`], with extra command-line arguments (e.g. `--redis-url`) and
    /// environment variables (e.g. `SSL_CERT_FILE`) for the process.
    pub async fn start_with(config_yaml: &str, args: &[&str], envs: &[(&str, &str)]) -> Tollgate {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-test-")
            .tempdir()
            .expect("temp dir for the config and the log");
        let config = dir.path().join("tollgate.yaml");
        std::fs::write(&config, config_yaml).expect("write config");
        let binary = Path::new(env!("CARGO_BIN_EXE_tollgate"));
        let command = envs.iter().fold(
            TollgateCommand::new(binary, &config).args(args),
            |command, (name, value)| command.env(name, value),
        );
        let process = or_panic(command.start(dir.path()).await);
        Tollgate {
            grpc: process.grpc,
            admin: process.admin,
            process,
            _dir: dir,
        }
    }

    /// What the process logged so far.
    pub fn log(&self) -> String {
        self.process.proc().log()
    }

    pub async fn metrics(&self) -> Metrics {
        or_panic(self.process.metrics().await)
    }

    /// Polls until `name{labels}` equals `want`; panics with the last value otherwise.
    pub async fn wait_for_metric(&self, name: &str, labels: &[&str], want: f64) {
        or_panic(self.process.wait_for_metric(name, labels, want).await);
    }

    /// Polls until `ready` accepts a scrape, and returns that scrape; panics with its last
    /// complaint otherwise.
    pub async fn wait_for_metrics(
        &self,
        ready: impl Fn(&Metrics) -> Result<(), String>,
    ) -> Metrics {
        or_panic(tollgate_testkit::metrics::wait_for_metrics(self.process.admin, ready).await)
    }

    /// Sends SIGTERM, as Kubernetes does.
    pub fn terminate(&self) {
        or_panic(self.process.proc().terminate());
    }

    /// SIGKILLs the process (no drain, no settling: a crashed replica) and reaps it.
    pub fn kill(&mut self) {
        self.process.proc_mut().kill();
    }

    /// Waits for the process to exit (bounded).
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        or_panic(self.process.proc().wait_exit(within).await)
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
        Stack::start_on(tollgate_config, upstream_args, |_| {}).await
    }

    /// [`Stack::start`], with Envoy's ports as `choose` leaves them (a test may hand it one
    /// that is taken).
    pub async fn start_on(
        tollgate_config: &str,
        upstream_args: &[&str],
        choose: impl FnOnce(&mut EnvoyPorts),
    ) -> Stack {
        let version = e2e_envoy_version();
        Stack::start_with(
            "front-proxy.yaml",
            &version,
            tollgate_config,
            upstream_args,
            choose,
        )
        .await
    }

    /// [`Stack::start`] with `envoy_config` (a file under `envoy/`, or an absolute path) on
    /// Envoy `version`.
    pub async fn start_with(
        envoy_config: &str,
        version: &str,
        tollgate_config: &str,
        upstream_args: &[&str],
        choose: impl FnOnce(&mut EnvoyPorts),
    ) -> Stack {
        let upstream = Upstream::start(upstream_args);
        let tollgate = Tollgate::start(tollgate_config).await;
        let config = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("envoy")
            .join(envoy_config);
        let mut ports = EnvoyPorts::free(upstream.addr.port(), tollgate.grpc.port());
        choose(&mut ports);
        let envoy = Envoy::start(version, &config, ports).await;
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
