//! The processes of one run: the simulated vLLM (`examples/upstream.rs --engine vllm`),
//! tollgate (the release binary, or none), and real Envoy in front, with
//! `envoy/front-proxy.yaml` rendered on free loopback ports (or, for "tollgate off", the same
//! file with the ext_proc filter and the tollgate cluster cut out at run time). Every child is
//! killed and reaped on drop.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::front_proxy::{EnvoyPorts, render_config, without_ext_proc};
use crate::host::{Proc, free_port};

/// The Envoy the tests use (tests/it/support/envoy.rs), installed by scripts/install-test-deps.sh.
const ENVOY_VERSION: &str = "1.40.0";
const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Binaries {
    pub envoy: PathBuf,
    pub tollgate: PathBuf,
    pub upstream: PathBuf,
}

impl Binaries {
    /// Flags first, then `ENVOY_BIN`, then the defaults: `.tools/` for Envoy, and the binaries
    /// of this example's own profile (`cargo build --release --bin tollgate --example upstream`).
    pub fn locate(
        envoy: Option<PathBuf>,
        tollgate: Option<PathBuf>,
        upstream: Option<PathBuf>,
    ) -> Result<Binaries> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let exe = std::env::current_exe().context("path of this executable")?;
        let profile = exe
            .parent()
            .and_then(Path::parent)
            .context("the lab should run from target/<profile>/examples")?;
        let envoy = envoy
            .or_else(|| std::env::var_os("ENVOY_BIN").map(PathBuf::from))
            .unwrap_or_else(|| root.join(format!(".tools/envoy-{ENVOY_VERSION}/envoy/_bin/envoy")));
        let tollgate = tollgate.unwrap_or_else(|| profile.join("tollgate"));
        let upstream = upstream.unwrap_or_else(|| profile.join("examples/upstream"));
        ensure!(
            envoy.is_file(),
            "no Envoy at {}: run scripts/install-test-deps.sh (or pass --envoy-bin)",
            envoy.display()
        );
        for (path, build) in [
            (&tollgate, "--bin tollgate"),
            (&upstream, "--example upstream"),
        ] {
            ensure!(
                path.is_file(),
                "{} is missing: run `cargo build --release {build}` first",
                path.display()
            );
        }
        Ok(Binaries {
            envoy,
            tollgate,
            upstream,
        })
    }
}

pub struct Stack {
    pub envoy_listen: SocketAddr,
    pub upstream_addr: SocketAddr,
    pub tollgate_admin: Option<SocketAddr>,
    // Drop order: Envoy first, then tollgate and the upstream; the temp dir (configs, logs) last.
    envoy: Proc,
    tollgate: Option<Proc>,
    upstream: Proc,
    _dir: tempfile::TempDir,
}

impl Stack {
    pub async fn start(
        binaries: &Binaries,
        upstream_args: &[String],
        tollgate_config: Option<&Value>,
        front_proxy: &str,
        client: &reqwest::Client,
    ) -> Result<Stack> {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-lab-")
            .tempdir()
            .context("create a temp dir")?;

        let mut upstream = Proc::spawn(
            "upstream",
            Command::new(&binaries.upstream)
                .args(["--addr", "127.0.0.1:0", "--engine", "vllm"])
                .args(upstream_args)
                .stdout(Stdio::piped()),
            dir.path().join("upstream.log"),
        )?;
        let mut line = String::new();
        BufReader::new(upstream.take_stdout().context("upstream stdout")?)
            .read_line(&mut line)
            .context("read the upstream's first line")?;
        let upstream_addr: SocketAddr = match line.trim().strip_prefix("upstream listening on ") {
            Some(addr) => addr.parse().context("upstream address")?,
            None => {
                upstream.check_alive()?;
                bail!("unexpected first line from the upstream: {line:?}");
            }
        };

        let mut tollgate = None;
        let mut tollgate_admin = None;
        let mut grpc_port = None;
        if let Some(config) = tollgate_config {
            let path = dir.path().join("tollgate.yaml");
            let config = with_upstream(config, &format!("http://{upstream_addr}"));
            // JSON is YAML.
            std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
            let grpc = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
            let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
            let mut command = Command::new(&binaries.tollgate);
            command
                .arg("--config")
                .arg(&path)
                .args(["--grpc-addr", &grpc.to_string()])
                .args(["--admin-addr", &admin.to_string()])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null());
            // The run's configuration must be the file's, whatever the environment holds.
            for (name, _) in std::env::vars_os() {
                if name.to_string_lossy().starts_with("TOLLGATE__") {
                    command.env_remove(name);
                }
            }
            let proc = Proc::spawn("tollgate", &mut command, dir.path().join("tollgate.log"))?;
            let url = format!("http://{admin}/readyz");
            wait_until(&proc, client, &url, |_| true).await?;
            tollgate = Some(proc);
            tollgate_admin = Some(admin);
            grpc_port = Some(grpc.port());
        }

        let text = match grpc_port {
            Some(_) => front_proxy.to_owned(),
            None => without_ext_proc(front_proxy)?,
        };
        let listen = free_port()?;
        let admin = free_port()?;
        let ports = EnvoyPorts {
            listen,
            upstream: upstream_addr.port(),
            extproc: grpc_port,
            admin,
        };
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, render_config(&text, &ports)?)?;
        let envoy = Proc::spawn(
            "envoy",
            Command::new(&binaries.envoy)
                .arg("-c")
                .arg(&config_path)
                // As in the tests and benchmarks: everything shares two cores.
                .args(["--concurrency", "1", "--disable-hot-restart"])
                .args(["--log-level", "warn"])
                .stdout(Stdio::null()),
            dir.path().join("envoy.log"),
        )?;
        let url = format!("http://127.0.0.1:{admin}/ready");
        wait_until(&envoy, client, &url, |body| body.trim() == "LIVE").await?;

        Ok(Stack {
            envoy_listen: SocketAddr::from((Ipv4Addr::LOCALHOST, listen)),
            upstream_addr,
            tollgate_admin,
            envoy,
            tollgate,
            upstream,
            _dir: dir,
        })
    }

    /// Fails if any child has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        self.upstream.check_alive()?;
        if let Some(tollgate) = &mut self.tollgate {
            tollgate.check_alive()?;
        }
        self.envoy.check_alive()
    }
}

/// `config` with `{upstream}` in every string replaced by the simulated vLLM's base URL, so a
/// scenario can point tollgate at its metrics (`control.engine.metrics_urls`).
fn with_upstream(config: &Value, base_url: &str) -> Value {
    match config {
        Value::String(text) => Value::String(text.replace("{upstream}", base_url)),
        Value::Array(items) => {
            Value::Array(items.iter().map(|v| with_upstream(v, base_url)).collect())
        }
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(k, v)| (k.clone(), with_upstream(v, base_url)))
                .collect(),
        ),
        other => other.clone(),
    }
}

async fn wait_until(
    proc: &Proc,
    client: &reqwest::Client,
    url: &str,
    body_ok: impl Fn(&str) -> bool,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    loop {
        proc.check_alive()?;
        if let Ok(response) = client.get(url).send().await
            && response.status().is_success()
            && response.text().await.is_ok_and(|body| body_ok(&body))
        {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{} was not ready at {url} within {READY_TIMEOUT:?}",
            proc.name()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn upstream_placeholders_become_the_simulated_vllms_url() {
        let config = json!({
            "control": {"engine": {"metrics_urls": ["{upstream}/metrics"]}, "floor": 16},
            "note": "no placeholder",
        });
        assert_eq!(
            with_upstream(&config, "http://127.0.0.1:9"),
            json!({
                "control": {"engine": {"metrics_urls": ["http://127.0.0.1:9/metrics"]}, "floor": 16},
                "note": "no placeholder",
            })
        );
    }
}
