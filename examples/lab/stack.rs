//! The processes of one run: the simulated vLLM (`examples/upstream.rs --engine vllm`),
//! tollgate (the release binary, or none), and real Envoy in front, with
//! `envoy/front-proxy.yaml` rendered on free loopback ports (or, for "tollgate off", the same
//! file with the ext_proc filter and the tollgate cluster cut out at run time). Every child is
//! killed and reaped on drop.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use serde_json::Value;
use tollgate_testkit::bins;
use tollgate_testkit::envoy::{self, ENVOY_VERSION, Envoy, EnvoyPorts, without_ext_proc};
use tollgate_testkit::tollgate::{TollgateCommand, TollgateProcess};
use tollgate_testkit::upstream::Upstream;

pub struct Binaries {
    pub envoy: PathBuf,
    pub tollgate: PathBuf,
    pub upstream: PathBuf,
}

impl Binaries {
    /// Flags first, then the defaults: `ENVOY_BIN` or `.tools/` for Envoy (the version the tests
    /// use), and the binaries of this example's own profile (`cargo build --release --bin
    /// tollgate --example upstream`).
    pub fn locate(
        envoy: Option<PathBuf>,
        tollgate: Option<PathBuf>,
        upstream: Option<PathBuf>,
    ) -> Result<Binaries> {
        let envoy = match envoy {
            Some(path) => path,
            None => {
                envoy::binary(ENVOY_VERSION).context("the lab runs Envoy (or pass --envoy-bin)")?
            }
        };
        Ok(Binaries {
            envoy,
            tollgate: bins::tollgate(tollgate.as_deref())?,
            upstream: bins::example("upstream", upstream.as_deref())?,
        })
    }
}

pub struct Stack {
    pub envoy_listen: SocketAddr,
    pub upstream_addr: SocketAddr,
    pub tollgate_admin: Option<SocketAddr>,
    // Drop order: Envoy first, then tollgate and the upstream; the temp dir (configs, logs) last.
    envoy: Envoy,
    tollgate: Option<TollgateProcess>,
    upstream: Upstream,
    _dir: tempfile::TempDir,
}

impl Stack {
    pub async fn start(
        binaries: &Binaries,
        upstream_args: &[String],
        tollgate_config: Option<&Value>,
        front_proxy: &str,
    ) -> Result<Stack> {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-lab-")
            .tempdir()
            .context("create a temp dir")?;

        let upstream_args = ["--engine", "vllm"]
            .into_iter()
            .chain(upstream_args.iter().map(String::as_str));
        let upstream = Upstream::start(&binaries.upstream, upstream_args, Some(dir.path()))?;
        let upstream_addr = upstream.addr;

        let tollgate = match tollgate_config {
            Some(config) => {
                let path = dir.path().join("tollgate.yaml");
                let config = with_upstream(config, &format!("http://{upstream_addr}"));
                // JSON is YAML.
                std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
                Some(
                    TollgateCommand::new(&binaries.tollgate, &path)
                        .start(dir.path())
                        .await?,
                )
            }
            None => None,
        };

        let grpc_port = tollgate.as_ref().map(|tollgate| tollgate.grpc.port());
        let text = match grpc_port {
            Some(_) => front_proxy.to_owned(),
            None => without_ext_proc(front_proxy)?,
        };
        let ports = EnvoyPorts::free_with(upstream_addr.port(), grpc_port);
        let envoy =
            Envoy::launch(&binaries.envoy, "envoy", &text, &ports, Some(dir.path())).await?;

        Ok(Stack {
            envoy_listen: envoy.listen,
            upstream_addr,
            tollgate_admin: tollgate.as_ref().map(|tollgate| tollgate.admin),
            envoy,
            tollgate,
            upstream,
            _dir: dir,
        })
    }

    /// Fails if any child has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        self.upstream.proc().check_alive()?;
        if let Some(tollgate) = &self.tollgate {
            tollgate.proc().check_alive()?;
        }
        self.envoy.proc().check_alive()
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
