//! The processes of one run: the simulated vLLM (`examples/upstream.rs --engine vllm`),
//! tollgate (the release binary, or none), and real Envoy in front, with
//! `envoy/front-proxy.yaml` rendered on free loopback ports (or, for "tollgate off", the same
//! file with the ext_proc filter and the tollgate cluster cut out at run time). Every child is
//! killed and reaped on drop.
//!
//! With `replicas: N` (N > 1) there are N tollgate processes on the same configuration plus
//! `store.redis_url` of a redis-server of the lab's own (testkit), so they share one in-flight
//! budget (`src/fleet.rs`), and Envoy's tollgate cluster lists all N with `LEAST_REQUEST`. The
//! run starts once every replica sees all N members and one of them leads.
//!
//! A run that calls tollgate's admin API (`admin_calls`) gets a bearer token in the temp dir
//! and `admin.token_file` pointing at it, unless its configuration names one.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokio::time::Instant;
use tollgate_testkit::bins;
use tollgate_testkit::envoy::{
    self, ENVOY_VERSION, Envoy, EnvoyPorts, render_over_extprocs, without_ext_proc,
};
use tollgate_testkit::redis::{RedisOptions, RedisServer};
use tollgate_testkit::tollgate::{TollgateCommand, TollgateProcess};
use tollgate_testkit::upstream::Upstream;

use crate::scenario::merge;

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
    /// Every replica's admin address (empty: tollgate off).
    pub tollgate_admins: Vec<SocketAddr>,
    // Drop order: Envoy first, then tollgate, Redis and the upstream; the temp dir (configs,
    // logs) last.
    envoy: Envoy,
    tollgates: Vec<TollgateProcess>,
    redis: Option<RedisServer>,
    upstream: Upstream,
    _dir: tempfile::TempDir,
}

/// How long N replicas may take to see each other and elect a leader: a few syncs when idle;
/// the margin is for a shared 2-core machine.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

impl Stack {
    pub async fn start(
        binaries: &Binaries,
        upstream_args: &[String],
        tollgate_config: Option<&Value>,
        admin_token: Option<&str>,
        replicas: u32,
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

        let mut redis = None;
        let mut tollgates = Vec::new();
        if let Some(config) = tollgate_config {
            let path = dir.path().join("tollgate.yaml");
            let mut config = with_upstream(config, &format!("http://{upstream_addr}"));
            if let Some(token) = admin_token
                && config.pointer("/admin/token_file").is_none()
            {
                let token_file = dir.path().join("admin-token");
                std::fs::write(&token_file, token)?;
                merge(
                    &mut config,
                    &json!({"admin": {"token_file": token_file.to_string_lossy()}}),
                );
            }
            if replicas > 1 {
                let server = RedisServer::launch(RedisOptions::default()).await?;
                merge(
                    &mut config,
                    &json!({"store": {"redis_url": server.url_without_password()}}),
                );
                redis = Some(server);
            }
            // JSON is YAML.
            std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
            for index in 0..replicas {
                let name = if replicas > 1 {
                    format!("tollgate-{}", index + 1)
                } else {
                    "tollgate".to_owned()
                };
                tollgates.push(
                    TollgateCommand::new(&binaries.tollgate, &path)
                        .name(&name)
                        .start(dir.path())
                        .await?,
                );
            }
            if replicas > 1 {
                settle(&tollgates).await?;
            }
        }

        let grpc_ports: Vec<u16> = tollgates.iter().map(|t| t.grpc.port()).collect();
        let ports = EnvoyPorts::free_with(upstream_addr.port(), grpc_ports.first().copied());
        let envoy = match &grpc_ports[..] {
            [] => {
                let text = without_ext_proc(front_proxy)?;
                Envoy::launch(&binaries.envoy, "envoy", &text, &ports, Some(dir.path())).await?
            }
            [_] => {
                Envoy::launch(
                    &binaries.envoy,
                    "envoy",
                    front_proxy,
                    &ports,
                    Some(dir.path()),
                )
                .await?
            }
            several => {
                Envoy::launch_with(
                    &binaries.envoy,
                    "envoy",
                    &ports,
                    Some(dir.path()),
                    |ports| render_over_extprocs(front_proxy, ports, several),
                )
                .await?
            }
        };

        Ok(Stack {
            envoy_listen: envoy.listen,
            upstream_addr,
            tollgate_admins: tollgates.iter().map(|t| t.admin).collect(),
            envoy,
            tollgates,
            redis,
            upstream,
            _dir: dir,
        })
    }

    /// Fails if any child has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        self.upstream.proc().check_alive()?;
        for tollgate in &self.tollgates {
            tollgate.proc().check_alive()?;
        }
        if let Some(redis) = &self.redis {
            redis.proc()?.check_alive()?;
        }
        self.envoy.proc().check_alive()
    }
}

/// Waits until every replica counts all of them as members and exactly one leads.
async fn settle(tollgates: &[TollgateProcess]) -> Result<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let mut members = Vec::new();
        let mut leaders = 0.0;
        for tollgate in tollgates {
            let metrics = tollgate.metrics().await?;
            members.push(metrics.value("tollgate_fleet_members", &[]));
            leaders += metrics.value("tollgate_fleet_leader", &[]);
        }
        if members.iter().all(|&m| m == tollgates.len() as f64) && leaders == 1.0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "the {} replicas did not settle within {SETTLE_TIMEOUT:?}: members seen \
                 {members:?}, {leaders} leader(s)",
                tollgates.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
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
