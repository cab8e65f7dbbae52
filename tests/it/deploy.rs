//! The deployment files (`k8s/`, `istio/`, the `envoy/` variants, `Dockerfile`), checked with the
//! tools a platform team would use on them, offline:
//! - `kubectl kustomize` builds every kustomization; the output validates (strict) against the
//!   Kubernetes schemas of 1.29 and of the newest version the PyPI package `kubernetes-validate`
//!   ships; custom resources (EnvoyFilter, DestinationRule, VirtualService, ServiceMonitor,
//!   PrometheusRule) against the schemas in `tests/fixtures/deploy/schemas/`;
//! - the ext_proc filter and cluster that each EnvoyFilter patches in are put into a minimal Envoy
//!   bootstrap and validated by real Envoy (1.36 and 1.40), and agree with `envoy/front-proxy.yaml`
//!   and with tollgate's config (timeouts, body limit);
//! - every tollgate config in a ConfigMap passes `tollgate check-config`, with the Deployment's
//!   `TOLLGATE__*` environment applied;
//! - the alert rules pass `promtool check rules` and `promtool test rules`, and the rules and the
//!   Grafana dashboard query only series that a real tollgate exports;
//! - the TLS and response-phases-off Envoy variants carry requests end to end;
//! - the Dockerfile builds like CI and runs as the Deployment's non-root user.
//!
//! The tools come from `scripts/install-test-deps.sh`; a missing one fails the test and says what
//! to install.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::envoy_config::{
    VALIDATED_ENVOY_VERSIONS, envoy_dir, envoy_validate, test_certs, with_test_certs,
};
use crate::support::envoy::{ENVOY_VERSION, Envoy, EnvoyPorts, envoy_binary, free_port};
use crate::support::process::Upstream;
use crate::support::server::{Metrics, TestServer};

/// The oldest Kubernetes the manifests must validate against (native gRPC probes are GA since
/// 1.27, native sidecars on by default since 1.29). The newest is whatever kubernetes-validate
/// ships.
const OLDEST_KUBERNETES: &str = "1.29";

/// Every kustomization a user applies (components are built through the ones that include them).
const KUSTOMIZATIONS: [&str; 6] = [
    "k8s/overlays/dev",
    "k8s/overlays/prod",
    "istio/tollgate",
    "istio/sidecar-inbound",
    "istio/gateway",
    "tests/fixtures/deploy/inference-app",
];

/// tollgate's pause between the drain deadline and exit, at most (`GRPC_CLOSE_GRACE` in
/// src/lib.rs).
const GRPC_CLOSE_GRACE_SECS: u64 = 5;
/// What `tollgate` adds to a queued request's deadline for Envoy (`ENVOY_TIMEOUT_MARGIN`).
const ENVOY_TIMEOUT_MARGIN_MS: u64 = 500;

const EXT_PROC: &str = "envoy.filters.http.ext_proc";
const EXT_PROC_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor";
const HCM: &str = "envoy.filters.network.http_connection_manager";
const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "envoy.filters.http.router";

/// Labels Prometheus adds to every scraped series (target labels); queries may group by them.
const TARGET_LABELS: [&str; 7] = [
    "instance",
    "job",
    "namespace",
    "pod",
    "service",
    "endpoint",
    "container",
];

const INSTALL: &str = "run scripts/install-test-deps.sh";

// ------------------------------------------------------------------------------------------
// Tools
// ------------------------------------------------------------------------------------------

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|err| panic!("read {path}: {err}"))
}

/// `name` on PATH, if it is there.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Runs `command` with `stdin`; panics with its output if it fails.
fn run(mut command: Command, stdin: Option<&str>, what: &str) -> Output {
    command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .unwrap_or_else(|err| panic!("{what}: cannot start {command:?}: {err}"));
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("piped stdin");
        // A writer thread: the child may fill its stdout before it has read all its input.
        let text = text.to_owned();
        let writer = std::thread::spawn(move || pipe.write_all(text.as_bytes()));
        let output = child.wait_with_output().expect("wait for the child");
        writer
            .join()
            .expect("stdin writer")
            .unwrap_or_else(|err| panic!("{what}: write stdin: {err}"));
        return output;
    }
    child.wait_with_output().expect("wait for the child")
}

fn stdout_of(output: Output, what: &str) -> String {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// `tests/fixtures/deploy/check.py ARGS` with `.tools/py` (kubernetes-validate, jsonschema,
/// PyYAML) on the Python path.
fn check_py(args: &[&str], stdin: Option<&str>) -> String {
    let python = on_path("python3")
        .unwrap_or_else(|| panic!("python3 is not installed: apt-get install -y python3"));
    let tools = root().join(".tools/py");
    assert!(
        tools.join("kubernetes_validate").is_dir(),
        "kubernetes-validate is not installed in {}: {INSTALL}",
        tools.display()
    );
    let mut command = Command::new(python);
    command
        .env("PYTHONPATH", &tools)
        .arg(root().join("tests/fixtures/deploy/check.py"))
        .args(args);
    let output = run(command, stdin, "check.py");
    if !output.status.success()
        && String::from_utf8_lossy(&output.stderr).contains("ModuleNotFound")
    {
        panic!(
            "a Python module is missing from .tools/py ({INSTALL}):\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    stdout_of(output, &format!("check.py {args:?}"))
}

/// Every YAML document of `text`, as JSON.
fn yaml_docs(text: &str) -> Vec<Value> {
    serde_json::from_str(&check_py(&["yaml2json", "-"], Some(text))).expect("check.py JSON")
}

/// Every YAML document of the repository file `path`.
fn yaml_file(path: &str) -> Vec<Value> {
    yaml_docs(&read(path))
}

/// The kubectl the tests use: `.tools/bin/kubectl` (installed from PyPI when the one on PATH is
/// missing or too old), else the one on PATH.
fn kubectl() -> PathBuf {
    let local = root().join(".tools/bin/kubectl");
    if local.is_file() {
        return local;
    }
    on_path("kubectl").unwrap_or_else(|| {
        panic!("kubectl is not installed (needed for `kubectl kustomize`): {INSTALL}")
    })
}

/// `kubectl kustomize DIR` (DIR relative to the repository).
fn kustomize(dir: &str) -> String {
    let mut command = Command::new(kubectl());
    command.arg("kustomize").arg(root().join(dir));
    stdout_of(run(command, None, dir), &format!("kubectl kustomize {dir}"))
}

fn build(dir: &str) -> Vec<Value> {
    yaml_docs(&kustomize(dir))
}

fn promtool() -> PathBuf {
    on_path("promtool").unwrap_or_else(|| {
        panic!("promtool is not installed: {INSTALL} (or apt-get install -y prometheus)")
    })
}

// ------------------------------------------------------------------------------------------
// Reading manifests
// ------------------------------------------------------------------------------------------

fn all_of<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|doc| doc["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = all_of(docs, kind)
        .into_iter()
        .filter(|doc| doc["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind}/{name} expected");
    found[0]
}

fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .map(|map| {
            map.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `labels` carry every pair of `selector`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let labels = string_map(labels);
    let selector = string_map(selector);
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn container<'a>(containers: &'a Value, name: &str) -> &'a Value {
    containers
        .as_array()
        .and_then(|list| list.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name} in {containers}"))
}

/// The `TOLLGATE__*` variables a container sets (literal values only).
fn tollgate_env(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|var| {
            let name = var["name"].as_str()?;
            let value = var["value"].as_str()?;
            name.starts_with("TOLLGATE__")
                .then(|| (name.to_owned(), value.to_owned()))
        })
        .collect()
}

/// The port number of the container port named `name`.
fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == name))
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {name} in {}", container["ports"]))
}

/// A tollgate container of a build, with its pod spec.
struct TollgateContainer<'a> {
    pod: &'a Value,
    container: &'a Value,
}

impl<'a> TollgateContainer<'a> {
    /// The tollgate Deployment's container (k8s overlays).
    fn deployment(docs: &'a [Value]) -> Self {
        let pod = &one(docs, "Deployment", "tollgate")["spec"]["template"]["spec"];
        Self {
            pod,
            container: container(&pod["containers"], "tollgate"),
        }
    }

    /// The tollgate native sidecar in the inference Deployment (istio/sidecar-container).
    fn sidecar(docs: &'a [Value]) -> Self {
        let pod = &one(docs, "Deployment", "vllm")["spec"]["template"]["spec"];
        Self {
            pod,
            container: container(&pod["initContainers"], "tollgate"),
        }
    }

    /// The config file the container reads: the ConfigMap key behind `--config PATH`.
    fn config_file(&self, docs: &[Value]) -> String {
        let args: Vec<&str> = self.container["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(args.len(), 2, "args should be --config FILE: {args:?}");
        assert_eq!(args[0], "--config");
        let path = Path::new(args[1]);
        let (dir, key) = (
            path.parent().expect("a directory").to_str().expect("UTF-8"),
            path.file_name().expect("a file").to_str().expect("UTF-8"),
        );
        let mount = self.container["volumeMounts"]
            .as_array()
            .and_then(|mounts| mounts.iter().find(|m| m["mountPath"] == dir))
            .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
        let volume = self.pod["volumes"]
            .as_array()
            .and_then(|volumes| volumes.iter().find(|v| v["name"] == mount["name"]))
            .expect("the mounted volume");
        let config_map = volume["configMap"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("{dir} is not a ConfigMap volume: {volume}"));
        one(docs, "ConfigMap", config_map)["data"][key]
            .as_str()
            .unwrap_or_else(|| panic!("ConfigMap {config_map} has no key {key}"))
            .to_owned()
    }
}

/// The effective configuration a container runs with: `tollgate check-config` must accept its
/// ConfigMap file with its `TOLLGATE__*` environment, and `tollgate print-config` shows the
/// result.
fn effective_config(docs: &[Value], tollgate: &TollgateContainer) -> Value {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp config file");
    std::fs::write(file.path(), tollgate.config_file(docs)).expect("write config");
    let env = tollgate_env(tollgate.container);
    let tollgate_cli = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        command.args(args).arg(file.path()).env("RUST_LOG", "error");
        for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("TOLLGATE__")) {
            command.env_remove(key);
        }
        command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        run(command, None, "tollgate")
    };
    let checked = tollgate_cli(&["check-config"]);
    assert!(
        checked.status.success(),
        "tollgate check-config rejects the ConfigMap's config with env {env:?}:\n{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let printed = stdout_of(tollgate_cli(&["print-config", "--config"]), "print-config");
    serde_json::from_str(&printed).expect("print-config prints JSON")
}

fn prod() -> Vec<Value> {
    build("k8s/overlays/prod")
}

/// The prod overlay's effective tollgate configuration.
fn prod_config() -> Value {
    let docs = prod();
    effective_config(&docs, &TollgateContainer::deployment(&docs))
}

/// k8s/base/config.yaml as a runnable config: the embedded store instead of Redis.
fn base_config() -> tollgate::config::Config {
    let mut config = tollgate::config::load(
        Some(&root().join("k8s/base/config.yaml")),
        std::iter::empty(),
    )
    .expect("k8s/base/config.yaml loads");
    config.store.redis_url = None;
    config.store.redis_password_file = None;
    config
}

/// An Envoy duration ("30s", "0.5s") in milliseconds.
fn duration_ms(value: &Value) -> Option<u64> {
    let seconds: f64 = value.as_str()?.strip_suffix('s')?.parse().ok()?;
    Some((seconds * 1000.0).round() as u64)
}

fn port_of(address: &str) -> u64 {
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address}"))
}

// ------------------------------------------------------------------------------------------
// Kubernetes manifests
// ------------------------------------------------------------------------------------------

/// Proves: every kustomization builds, and every object in it validates strictly (unknown fields
/// are errors) against Kubernetes 1.29 and the newest schemas kubernetes-validate ships, or, for a
/// custom resource, against its schema in tests/fixtures/deploy/schemas. No object goes unchecked.
#[test]
fn every_kustomization_builds_and_validates() {
    let mut failures = Vec::new();
    for dir in KUSTOMIZATIONS {
        let yaml = kustomize(dir);
        let docs = yaml_docs(&yaml);
        assert!(!docs.is_empty(), "{dir} builds to nothing");
        let report: Value = serde_json::from_str(&check_py(
            &["validate", OLDEST_KUBERNETES, "latest"],
            Some(&yaml),
        ))
        .expect("a JSON report");
        let versions = report["versions"].as_array().expect("versions");
        assert_eq!(versions[0], OLDEST_KUBERNETES);
        let newest = versions[1].as_str().expect("newest version");
        let minor: u32 = newest
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .expect("a version like 1.37.0");
        assert!(
            minor >= 37,
            "kubernetes-validate ships schemas up to {newest}; expected 1.37+"
        );
        for error in report["errors"].as_array().expect("errors") {
            failures.push(format!("{dir}: {}", error.as_str().unwrap_or_default()));
        }
        for unchecked in report["unchecked"].as_array().expect("unchecked") {
            failures.push(format!(
                "{dir}: unchecked {}",
                unchecked.as_str().unwrap_or_default()
            ));
        }
        let checked: BTreeSet<&str> = report["checked"]
            .as_array()
            .expect("checked")
            .iter()
            .filter_map(|entry| entry[0].as_str())
            .collect();
        for doc in &docs {
            let what = format!(
                "{}/{}",
                doc["kind"].as_str().unwrap_or("?"),
                doc["metadata"]["name"].as_str().unwrap_or("?")
            );
            if !checked.contains(what.as_str()) {
                failures.push(format!("{dir}: {what} was not validated"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Proves, for the dev and prod overlays: tollgate runs as the Dockerfile's non-root user on a
/// read-only root filesystem with no capabilities; its probes use grpc.health.v1 (readiness) and
/// /healthz (liveness) on the ports its config listens on; the pod's grace period outlasts the
/// preStop pause, the drain deadline and closing; the Services declare gRPC and select the pods
/// (one of them headless); the PDB and HPA point at them; and each overlay's Redis is wired.
#[test]
fn overlays_run_tollgate_safely_and_consistently() {
    let (uid, gid) = dockerfile_user();
    for overlay in ["k8s/overlays/dev", "k8s/overlays/prod"] {
        let docs = build(overlay);
        let deployment = one(&docs, "Deployment", "tollgate");
        let tollgate = TollgateContainer::deployment(&docs);
        let (pod, c) = (tollgate.pod, tollgate.container);
        let config = effective_config(&docs, &tollgate);
        let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        assert!(
            selects(&deployment["spec"]["selector"]["matchLabels"], pod_labels),
            "{overlay}: the Deployment's selector must match its pods"
        );
        assert!(
            deployment["spec"].get("replicas").is_none(),
            "{overlay}: the HPA owns the replica count"
        );

        // Security.
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{overlay}");
        assert_eq!(
            pod["securityContext"]["runAsUser"], uid,
            "{overlay}: Dockerfile USER"
        );
        assert_eq!(
            pod["securityContext"]["runAsGroup"], gid,
            "{overlay}: Dockerfile USER"
        );
        assert_eq!(pod["automountServiceAccountToken"], false, "{overlay}");
        let security = &c["securityContext"];
        assert_eq!(security["readOnlyRootFilesystem"], true, "{overlay}");
        assert_eq!(security["allowPrivilegeEscalation"], false, "{overlay}");
        assert_eq!(
            security["capabilities"]["drop"],
            json!(["ALL"]),
            "{overlay}"
        );
        assert!(
            c["resources"]["requests"]["cpu"].is_string()
                && c["resources"]["requests"]["memory"].is_string()
                && c["resources"]["limits"]["memory"].is_string(),
            "{overlay}: CPU and memory requests and a memory limit: {}",
            c["resources"]
        );

        // Ports and probes agree with the config.
        let grpc_port = container_port(c, "grpc");
        let admin_port = container_port(c, "admin");
        assert_eq!(
            grpc_port,
            port_of(config["listen"]["grpc_addr"].as_str().expect("grpc_addr"))
        );
        assert_eq!(
            admin_port,
            port_of(config["listen"]["admin_addr"].as_str().expect("admin_addr"))
        );
        assert_eq!(c["readinessProbe"]["grpc"]["port"], grpc_port, "{overlay}");
        assert_eq!(
            c["livenessProbe"]["httpGet"]["path"], "/healthz",
            "{overlay}"
        );
        assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin", "{overlay}");

        // Graceful termination.
        let pre_stop: Vec<&str> = c["lifecycle"]["preStop"]["exec"]["command"]
            .as_array()
            .expect("a preStop command")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(pre_stop[0], "/bin/sleep", "{overlay}: preStop sleeps");
        let pause: u64 = pre_stop[1].parse().expect("seconds");
        let drain_ms = config["shutdown"]["drain_deadline_ms"]
            .as_u64()
            .expect("drain");
        let grace = pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace");
        assert!(
            grace * 1000 > pause * 1000 + drain_ms + GRPC_CLOSE_GRACE_SECS * 1000,
            "{overlay}: terminationGracePeriodSeconds {grace} must exceed the preStop pause \
             {pause} s + drain_deadline_ms {drain_ms} + {GRPC_CLOSE_GRACE_SECS} s"
        );

        // Services.
        let service = one(&docs, "Service", "tollgate");
        let headless = one(&docs, "Service", "tollgate-headless");
        assert_eq!(headless["spec"]["clusterIP"], "None", "{overlay}");
        for svc in [service, headless] {
            assert!(
                selects(&svc["spec"]["selector"], pod_labels),
                "{overlay}: {} must select the tollgate pods",
                svc["metadata"]["name"]
            );
            let grpc = svc["spec"]["ports"]
                .as_array()
                .and_then(|ports| ports.iter().find(|p| p["targetPort"] == "grpc"))
                .expect("a port to the grpc container port");
            assert_eq!(
                grpc["appProtocol"], "grpc",
                "{overlay}: Istio must speak HTTP/2"
            );
            assert!(
                grpc["name"].as_str().is_some_and(|n| n.starts_with("grpc")),
                "{overlay}: Istio before appProtocol support reads the port name's prefix"
            );
        }

        let pdb = one(&docs, "PodDisruptionBudget", "tollgate");
        assert!(selects(&pdb["spec"]["selector"]["matchLabels"], pod_labels));
        let hpa = one(&docs, "HorizontalPodAutoscaler", "tollgate");
        assert_eq!(
            hpa["spec"]["scaleTargetRef"],
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "tollgate"})
        );
        let (min, max) = (
            hpa["spec"]["minReplicas"].as_u64().expect("min"),
            hpa["spec"]["maxReplicas"].as_u64().expect("max"),
        );
        assert!(min >= 1 && min <= max, "{overlay}: HPA range {min}..{max}");

        let redis_url = config["store"]["redis_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{overlay}: budgets must be in Redis"));
        if overlay.ends_with("dev") {
            let redis = one(&docs, "Service", "redis");
            let port = redis["spec"]["ports"][0]["port"].as_u64().expect("port");
            assert_eq!(redis_url, format!("redis://redis:{port}"));
            assert!(selects(
                &redis["spec"]["selector"],
                &one(&docs, "Deployment", "redis")["spec"]["template"]["metadata"]["labels"]
            ));
        } else {
            assert!(
                redis_url.starts_with("rediss://"),
                "prod talks TLS to Redis"
            );
            assert!(min >= 3, "prod runs at least three replicas");
            let password = config["store"]["redis_password_file"]
                .as_str()
                .expect("a password file in prod");
            let mount = c["volumeMounts"]
                .as_array()
                .and_then(|mounts| {
                    mounts
                        .iter()
                        .find(|m| password.starts_with(m["mountPath"].as_str().unwrap_or("\0")))
                })
                .expect("the password file is mounted");
            let volume = pod["volumes"]
                .as_array()
                .and_then(|v| v.iter().find(|v| v["name"] == mount["name"]))
                .expect("its volume");
            assert!(volume["secret"]["secretName"].is_string(), "from a Secret");
            assert!(
                pod["topologySpreadConstraints"].is_array(),
                "spread over nodes"
            );
        }
    }
}

/// Proves: the ServiceMonitor scrapes exactly one Service (not the headless one too), through a
/// port that reaches the admin port; the PrometheusRule carries the rule file's groups verbatim;
/// the dashboard ConfigMap carries grafana-dashboard.json verbatim.
#[test]
fn monitoring_objects_point_at_tollgate() {
    let docs = prod();
    let monitor = one(&docs, "ServiceMonitor", "tollgate");
    let selected: Vec<&Value> = all_of(&docs, "Service")
        .into_iter()
        .filter(|svc| {
            selects(
                &monitor["spec"]["selector"]["matchLabels"],
                &svc["metadata"]["labels"],
            )
        })
        .collect();
    assert_eq!(
        selected.len(),
        1,
        "the ServiceMonitor must select one Service, or every pod is scraped more than once"
    );
    let endpoint = &monitor["spec"]["endpoints"][0];
    let port = selected[0]["spec"]["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == endpoint["port"]))
        .expect("the ServiceMonitor's port exists on the Service");
    assert_eq!(port["targetPort"], "admin", "scrapes the admin port");
    assert_eq!(endpoint["path"], "/metrics");

    let rules = &yaml_file("k8s/components/monitoring/tollgate.rules.yaml")[0];
    let rule = one(&docs, "PrometheusRule", "tollgate");
    assert_eq!(
        rule["spec"]["groups"], rules["groups"],
        "prometheusrule.yaml and tollgate.rules.yaml must carry the same groups"
    );

    let dashboards: Vec<&Value> = all_of(&docs, "ConfigMap")
        .into_iter()
        .filter(|cm| cm["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    assert_eq!(dashboards.len(), 1);
    let shipped: Value = serde_json::from_str(
        dashboards[0]["data"]["tollgate.json"]
            .as_str()
            .expect("JSON"),
    )
    .expect("the dashboard is JSON");
    let file: Value =
        serde_json::from_str(&read("k8s/components/monitoring/grafana-dashboard.json"))
            .expect("grafana-dashboard.json is JSON");
    assert_eq!(shipped, file);
}

/// Proves: every tollgate config shipped in a ConfigMap passes `tollgate check-config` with its
/// container's environment (dev, prod, and the sidecar in the inference pod), and the settings
/// Envoy must agree with are what envoy/ and istio/ use.
#[test]
fn configmap_configs_pass_check_config() {
    for (dir, sidecar) in [
        ("k8s/overlays/dev", false),
        ("k8s/overlays/prod", false),
        ("tests/fixtures/deploy/inference-app", true),
    ] {
        let docs = build(dir);
        let tollgate = if sidecar {
            TollgateContainer::sidecar(&docs)
        } else {
            TollgateContainer::deployment(&docs)
        };
        let config = effective_config(&docs, &tollgate);
        assert_eq!(
            config["scheduler"]["envoy_max_message_timeout_ms"], 30_000,
            "{dir}: Envoy's max_message_timeout in envoy/ and istio/ is 30s"
        );
        assert_eq!(config["tokens"]["max_body_bytes"], 8_388_608, "{dir}");
        if sidecar {
            assert_eq!(
                config["listen"]["grpc_addr"], "127.0.0.1:50051",
                "in the inference pod, ext_proc listens on loopback only (the EnvoyFilter's \
                 tollgate_local cluster)"
            );
            assert_eq!(
                tollgate.container["readinessProbe"]["httpGet"]["path"], "/readyz",
                "the loopback gRPC port cannot be probed by the kubelet"
            );
            assert_eq!(
                tollgate.container["restartPolicy"], "Always",
                "a native sidecar"
            );
        }
    }
}

// ------------------------------------------------------------------------------------------
// Envoy configs and EnvoyFilters
// ------------------------------------------------------------------------------------------

/// Checks an ext_proc filter against tollgate's contract with Envoy; returns the problems.
fn ext_proc_problems(
    what: &str,
    filter: &Value,
    response_phases: bool,
    config: &Value,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut expect = |field: &str, got: &Value, want: Value| {
        if *got != want {
            problems.push(format!("{what}: {field} is {got}, expected {want}"));
        }
    };
    expect("name", &filter["name"], json!(EXT_PROC));
    let tc = &filter["typed_config"];
    expect("@type", &tc["@type"], json!(EXT_PROC_TYPE));
    let mode = &tc["processing_mode"];
    expect(
        "request_header_mode",
        &mode["request_header_mode"],
        json!("SEND"),
    );
    expect(
        "request_body_mode",
        &mode["request_body_mode"],
        json!("BUFFERED"),
    );
    expect(
        "request_trailer_mode",
        &mode["request_trailer_mode"],
        json!("SKIP"),
    );
    let (headers, body) = if response_phases {
        ("SEND", "STREAMED")
    } else {
        ("SKIP", "NONE")
    };
    expect(
        "response_header_mode",
        &mode["response_header_mode"],
        json!(headers),
    );
    expect(
        "response_body_mode",
        &mode["response_body_mode"],
        json!(body),
    );
    expect(
        "response_trailer_mode",
        &mode["response_trailer_mode"],
        json!("SKIP"),
    );
    expect(
        "allow_mode_override",
        &tc["allow_mode_override"],
        json!(true),
    );
    expect(
        "failure_mode_allow",
        &tc["failure_mode_allow"],
        json!(false),
    );
    expect(
        "status_on_error",
        &tc["status_on_error"]["code"],
        json!("ServiceUnavailable"),
    );
    let (Some(message_timeout), Some(max)) = (
        duration_ms(&tc["message_timeout"]),
        duration_ms(&tc["max_message_timeout"]),
    ) else {
        problems.push(format!(
            "{what}: message_timeout and max_message_timeout must be durations like 30s: {tc}"
        ));
        return problems;
    };
    expect("message_timeout (ms)", &json!(message_timeout), json!(1000));
    expect(
        "max_message_timeout (ms)",
        &json!(max),
        config["scheduler"]["envoy_max_message_timeout_ms"].clone(),
    );
    for (tier, settings) in config["tiers"].as_object().expect("tiers") {
        let deadline = settings["queue_deadline_ms"].as_u64().expect("deadline");
        if deadline + ENVOY_TIMEOUT_MARGIN_MS > max {
            problems.push(format!(
                "{what}: tier {tier}'s queue deadline {deadline} ms + {ENVOY_TIMEOUT_MARGIN_MS} ms \
                 is over max_message_timeout ({max} ms)"
            ));
        }
    }
    problems
}

/// The HTTP filter chains of an Envoy bootstrap's listeners: (listener, http_filters).
fn http_filter_chains(bootstrap: &Value) -> Vec<(&Value, &Vec<Value>)> {
    let mut chains = Vec::new();
    for listener in bootstrap["static_resources"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for chain in listener["filter_chains"].as_array().into_iter().flatten() {
            for filter in chain["filters"].as_array().into_iter().flatten() {
                if filter["name"] == HCM {
                    chains.push((
                        listener,
                        filter["typed_config"]["http_filters"]
                            .as_array()
                            .expect("http_filters"),
                    ));
                }
            }
        }
    }
    chains
}

fn cluster<'a>(bootstrap: &'a Value, name: &str) -> &'a Value {
    bootstrap["static_resources"]["clusters"]
        .as_array()
        .and_then(|clusters| clusters.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no cluster {name}"))
}

fn endpoint_address(cluster: &Value) -> (&str, u64) {
    let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"];
    (
        address["address"].as_str().expect("address"),
        address["port_value"].as_u64().expect("port"),
    )
}

/// Proves, for every config under envoy/: its ext_proc filter keeps tollgate's contract (modes,
/// fail closed with 503, 1 s message timeout, max_message_timeout = the config's, every queue
/// deadline + margin under it) and sits before the router; the body limit is tollgate's
/// max_body_bytes; the tollgate cluster's stream limit is raised. The variants differ from
/// front-proxy.yaml only where they mean to: the processing mode (no-response), the clusters
/// (TLS), and the TLS names and ports line up with the TLS sidecar and the headless Service.
#[test]
fn envoy_variants_keep_the_front_proxy_contract() {
    let config = prod_config();
    let docs = prod();
    let load = |name: &str| yaml_file(&format!("envoy/{name}")).remove(0);
    let front = load("front-proxy.yaml");
    let mut problems = Vec::new();
    for name in [
        "front-proxy.yaml",
        "front-proxy-no-response.yaml",
        "front-proxy-tls.yaml",
    ] {
        let bootstrap = load(name);
        let chains = http_filter_chains(&bootstrap);
        assert_eq!(chains.len(), 1, "{name}: one HTTP listener");
        let (listener, filters) = chains[0];
        let position = |wanted: &str| filters.iter().position(|f| f["name"] == wanted);
        let (ext_proc, router) = (
            position(EXT_PROC).unwrap_or_else(|| panic!("{name}: no ext_proc")),
            position(ROUTER).unwrap_or_else(|| panic!("{name}: no router")),
        );
        assert!(
            ext_proc < router,
            "{name}: ext_proc must run before the router"
        );
        problems.extend(ext_proc_problems(
            name,
            &filters[ext_proc],
            name != "front-proxy-no-response.yaml",
            &config,
        ));
        assert_eq!(
            listener["per_connection_buffer_limit_bytes"], config["tokens"]["max_body_bytes"],
            "{name}: Envoy's body limit is tollgate's"
        );
        let target =
            &filters[ext_proc]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"];
        let tollgate = cluster(&bootstrap, target.as_str().expect("cluster name"));
        let limit = tollgate["circuit_breakers"]["thresholds"][0]["max_requests"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            limit >= 100_000,
            "{name}: every request holds a stream; max_requests {limit}"
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // No-response: the front proxy but for the processing mode.
    let strip_mode = |mut bootstrap: Value| {
        let filters = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
            [0]["typed_config"]["http_filters"][0]["typed_config"];
        filters
            .as_object_mut()
            .expect("ext_proc config")
            .remove("processing_mode");
        bootstrap
    };
    assert_eq!(
        strip_mode(load("front-proxy-no-response.yaml")),
        strip_mode(front.clone()),
        "front-proxy-no-response.yaml must differ from front-proxy.yaml only in processing_mode"
    );

    // TLS: same admin and listener; the tollgate cluster reaches the TLS sidecar through the
    // headless Service, over TLS to the name the sidecar's certificate carries.
    let tls = load("front-proxy-tls.yaml");
    assert_eq!(tls["admin"], front["admin"]);
    assert_eq!(
        tls["static_resources"]["listeners"], front["static_resources"]["listeners"],
        "front-proxy-tls.yaml must keep front-proxy.yaml's listener"
    );
    let tollgate = cluster(&tls, "tollgate");
    assert_eq!(tollgate["type"], "STRICT_DNS");
    let headless = one(&docs, "Service", "tollgate-headless");
    let namespace = headless["metadata"]["namespace"]
        .as_str()
        .expect("namespace");
    let (host, port) = endpoint_address(tollgate);
    assert_eq!(
        host,
        format!("tollgate-headless.{namespace}.svc.cluster.local"),
        "the headless Service of k8s/overlays/prod"
    );
    let socket = &tollgate["transport_socket"]["typed_config"];
    assert_eq!(
        socket["sni"],
        format!("tollgate.{namespace}.svc.cluster.local")
    );
    assert_eq!(
        socket["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"][0]["matcher"]
            ["exact"],
        socket["sni"]
    );
    assert_eq!(
        socket["common_tls_context"]["alpn_protocols"],
        json!(["h2"])
    );
    assert_eq!(tollgate["health_checks"][0]["grpc_health_check"], json!({}));

    let sidecar = load("tollgate-tls-sidecar.yaml");
    let listener = &sidecar["static_resources"]["listeners"][0];
    assert_eq!(
        listener["address"]["socket_address"]["port_value"], port,
        "the front proxy's TLS port is the sidecar's"
    );
    assert_eq!(
        listener["filter_chains"][0]["transport_socket"]["typed_config"]["require_client_certificate"],
        true,
        "only trusted clients may open ext_proc streams"
    );
    let (host, port) = endpoint_address(cluster(&sidecar, "tollgate"));
    assert_eq!(host, "127.0.0.1");
    assert_eq!(
        port,
        port_of(config["listen"]["grpc_addr"].as_str().expect("grpc_addr")),
        "the sidecar forwards to tollgate's gRPC port"
    );
}

/// An EnvoyFilter's patches, sorted by what they patch.
#[derive(Default)]
struct Patches<'a> {
    http_filters: Vec<&'a Value>,
    listener_merges: Vec<&'a Value>,
    cluster_adds: Vec<&'a Value>,
}

fn patches(filter: &Value) -> Patches<'_> {
    let mut sorted = Patches::default();
    for patch in filter["spec"]["configPatches"]
        .as_array()
        .expect("configPatches")
    {
        match (
            patch["applyTo"].as_str().unwrap_or_default(),
            patch["patch"]["operation"].as_str().unwrap_or_default(),
        ) {
            ("HTTP_FILTER", "INSERT_BEFORE") => sorted.http_filters.push(patch),
            ("LISTENER", "MERGE") => sorted.listener_merges.push(patch),
            ("CLUSTER", "ADD") => sorted.cluster_adds.push(patch),
            other => panic!("unexpected patch {other:?}"),
        }
    }
    sorted
}

/// A minimal Envoy bootstrap with what an EnvoyFilter patches in: its HTTP filter before the
/// router of an HTTP listener (with the listener fields it merges), the clusters it adds, and,
/// for a cluster Istio generates from a Service (`outbound|PORT||FQDN`), a stand-in of that
/// name speaking HTTP/2, as Istio's does for a gRPC port.
fn bootstrap_for(patches: &Patches) -> Value {
    let filter = &patches.http_filters[0]["patch"]["value"];
    let mut listener = json!({
        "name": "virtualInbound",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 15006}},
        "filter_chains": [{"filters": [{
            "name": HCM,
            "typed_config": {
                "@type": HCM_TYPE,
                "stat_prefix": "inbound",
                "route_config": {"name": "inbound", "virtual_hosts": [{
                    "name": "inference", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "inference"}}]
                }]},
                "http_filters": [
                    filter,
                    {"name": ROUTER, "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    }}
                ]
            }
        }]}]
    });
    for merge in &patches.listener_merges {
        for (key, value) in merge["patch"]["value"]
            .as_object()
            .expect("a listener fragment")
        {
            listener[key] = value.clone();
        }
    }
    let static_cluster = |name: &str, port: u16, http2: bool| {
        let mut cluster = json!({
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{
                "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}
            }]}]}
        });
        if http2 {
            cluster["typed_extension_protocol_options"] = json!({
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }
            });
        }
        cluster
    };
    let mut clusters = vec![static_cluster("inference", 8000, false)];
    clusters.extend(
        patches
            .cluster_adds
            .iter()
            .map(|p| p["patch"]["value"].clone()),
    );
    let target = filter["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .expect("ext_proc cluster");
    if !clusters.iter().any(|c| c["name"] == target) {
        assert!(
            target.starts_with("outbound|"),
            "the ext_proc cluster {target} is neither added by the EnvoyFilter nor an Istio \
             Service cluster"
        );
        clusters.push(static_cluster(target, 50051, true));
    }
    json!({"static_resources": {"listeners": [listener], "clusters": clusters}})
}

/// Proves, for each EnvoyFilter (sidecar inbound, gateway, sidecar container): it inserts
/// tollgate's ext_proc filter (same contract as envoy/front-proxy.yaml) before the router of the
/// inference port's HTTP connection manager, raises the listener's body limit to tollgate's
/// max_body_bytes, and reaches tollgate: through the cluster Istio generates for the prod
/// overlay's gRPC Service port, or through the 127.0.0.1 cluster it adds for the container in the
/// pod. The patched-in filter, listener fields and clusters load in real Envoy 1.36 and 1.40.
#[test]
fn envoy_filters_patch_in_valid_envoy_config() {
    let prod_docs = prod();
    let config = prod_config();
    let service = one(&prod_docs, "Service", "tollgate");
    let grpc_port = service["spec"]["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["appProtocol"] == "grpc"))
        .and_then(|p| p["port"].as_u64())
        .expect("the gRPC port");
    let service_cluster = format!(
        "outbound|{grpc_port}||tollgate.{}.svc.cluster.local",
        service["metadata"]["namespace"]
            .as_str()
            .expect("namespace")
    );
    let inference = build("tests/fixtures/deploy/inference-app");
    let inference_pod = &one(&inference, "Deployment", "vllm")["spec"]["template"];
    let inference_port = container_port(
        container(&inference_pod["spec"]["containers"], "vllm"),
        "http",
    );
    let sidecar_config = effective_config(&inference, &TollgateContainer::sidecar(&inference));

    let dir = tempfile::Builder::new()
        .prefix("tollgate-envoyfilter-")
        .tempdir()
        .expect("temp dir");
    let mut failures = Vec::new();
    for (source, context) in [
        ("istio/sidecar-inbound", "SIDECAR_INBOUND"),
        ("istio/gateway", "GATEWAY"),
        ("tests/fixtures/deploy/inference-app", "SIDECAR_INBOUND"),
    ] {
        let docs = build(source);
        let filters = all_of(&docs, "EnvoyFilter");
        assert_eq!(filters.len(), 1, "{source}: one EnvoyFilter");
        let envoy_filter = filters[0];
        let patches = patches(envoy_filter);
        assert_eq!(
            patches.http_filters.len(),
            1,
            "{source}: one HTTP filter patch"
        );
        let http = patches.http_filters[0];
        let listener = &http["match"]["listener"];
        assert_eq!(http["match"]["context"], context, "{source}");
        assert_eq!(listener["filterChain"]["filter"]["name"], HCM, "{source}");
        assert_eq!(
            listener["filterChain"]["filter"]["subFilter"]["name"], ROUTER,
            "{source}"
        );
        let selector = &envoy_filter["spec"]["workloadSelector"]["labels"];
        if context == "SIDECAR_INBOUND" {
            assert_eq!(
                listener["portNumber"], inference_port,
                "{source}: the inference port"
            );
            assert!(
                selects(selector, &inference_pod["metadata"]["labels"]),
                "{source}: the workload selector must pick the inference pods"
            );
        } else {
            assert!(
                selector.is_object(),
                "{source}: a workload selector for the gateway pods"
            );
        }
        let value = &http["patch"]["value"];
        let filter_config = if source.starts_with("tests/") {
            &sidecar_config
        } else {
            &config
        };
        failures.extend(ext_proc_problems(source, value, true, filter_config));
        let target = value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
            .as_str()
            .expect("cluster name");
        if patches.cluster_adds.is_empty() {
            assert_eq!(
                target, service_cluster,
                "{source}: Istio names the cluster of k8s/overlays/prod's gRPC Service port so"
            );
        } else {
            let added = &patches.cluster_adds[0]["patch"]["value"];
            assert_eq!(
                added["name"], target,
                "{source}: ext_proc uses the added cluster"
            );
            let (host, port) = endpoint_address(added);
            assert_eq!(
                format!("{host}:{port}"),
                sidecar_config["listen"]["grpc_addr"]
                    .as_str()
                    .expect("grpc_addr"),
                "{source}: the added cluster reaches the tollgate container"
            );
            let limit = added["circuit_breakers"]["thresholds"][0]["max_requests"]
                .as_u64()
                .unwrap_or(0);
            assert!(limit >= 100_000, "{source}: max_requests {limit}");
        }
        assert_eq!(patches.listener_merges.len(), 1, "{source}: the body limit");
        assert_eq!(
            patches.listener_merges[0]["patch"]["value"]["per_connection_buffer_limit_bytes"],
            filter_config["tokens"]["max_body_bytes"],
            "{source}: Envoy's body limit is tollgate's max_body_bytes"
        );

        let bootstrap = bootstrap_for(&patches);
        let path = dir
            .path()
            .join(format!("{}.json", source.replace('/', "_")));
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&bootstrap).expect("JSON"),
        )
        .expect("write bootstrap");
        for version in VALIDATED_ENVOY_VERSIONS {
            if let Err(failure) = envoy_validate(version, &path) {
                failures.push(format!("{source}: {failure}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ------------------------------------------------------------------------------------------
// Envoy variants, end to end
// ------------------------------------------------------------------------------------------

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from:?} must occur once");
    text.replacen(from, to, 1)
}

/// An Envoy started on a config text whose ports the caller rendered (for configs outside the
/// front proxy's port scheme, like the TLS sidecar). Killed on drop.
struct RenderedEnvoy {
    child: Child,
    dir: tempfile::TempDir,
}

impl RenderedEnvoy {
    async fn start(version: &str, config: &str, admin: u16) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-envoy-")
            .tempdir()
            .expect("temp dir");
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, config).expect("write config");
        let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log file");
        let child = Command::new(envoy_binary(version))
            .arg("-c")
            .arg(&path)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("spawn Envoy");
        let mut envoy = Self { child, dir };
        let url = format!("http://127.0.0.1:{admin}/ready");
        let client = http_client();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = envoy.child.try_wait().expect("poll Envoy") {
                panic!("Envoy exited ({status}):\n{}", envoy.log());
            }
            if let Ok(response) = client.get(&url).send().await
                && response
                    .text()
                    .await
                    .is_ok_and(|body| body.trim() == "LIVE")
            {
                return envoy;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Envoy not LIVE within 20 s:\n{}",
                envoy.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for RenderedEnvoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("HTTP client")
}

const CHAT: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":8}"#;

/// Polls tollgate's /metrics until `name{labels}` is `want`.
async fn wait_for_metric(server: &TestServer, name: &str, labels: &[&str], want: f64) -> Metrics {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = server.metrics().await;
        let got = metrics.find(name, labels);
        if got == Some(want) {
            return metrics;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name}{labels:?} never reached {want}; last {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Proves: envoy/front-proxy-tls.yaml reaches tollgate over mutual TLS through
/// envoy/tollgate-tls-sidecar.yaml (certificates from a private CA, the server name checked), its
/// grpc.health.v1 checks pass through the TLS hop, and a chat request is admitted by tollgate
/// and answered by the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_front_proxy_reaches_tollgate_through_the_tls_sidecar() {
    let certs = test_certs();
    let tollgate = TestServer::start(base_config()).await;
    let upstream = Upstream::start(&[]);

    let (tls_port, sidecar_admin) = (free_port(), free_port());
    let sidecar = with_test_certs(&read("envoy/tollgate-tls-sidecar.yaml"), certs.path());
    let sidecar = replace_once(
        &sidecar,
        "port_value: 50443",
        &format!("port_value: {tls_port}"),
    );
    let sidecar = replace_once(
        &sidecar,
        "port_value: 50051",
        &format!("port_value: {}", tollgate.grpc.port()),
    );
    let sidecar = replace_once(
        &sidecar,
        "port_value: 9902",
        &format!("port_value: {sidecar_admin}"),
    );
    let sidecar = replace_once(&sidecar, "address: 0.0.0.0", "address: 127.0.0.1");
    let _sidecar = RenderedEnvoy::start(ENVOY_VERSION, &sidecar, sidecar_admin).await;

    // Into the front proxy's port scheme (support::envoy): the Kubernetes names become loopback,
    // the TLS port the ext_proc placeholder.
    let front = with_test_certs(&read("envoy/front-proxy-tls.yaml"), certs.path());
    let front = replace_once(
        &front,
        "address: tollgate-headless.tollgate.svc.cluster.local",
        "address: 127.0.0.1",
    );
    let front = replace_once(
        &front,
        "address: vllm.inference.svc.cluster.local",
        "address: 127.0.0.1",
    );
    let front = replace_once(&front, "port_value: 50443", "port_value: 50051");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("front-proxy-tls.yaml");
    std::fs::write(&path, front).expect("write config");
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &path,
        EnvoyPorts::free(upstream.addr.port(), tls_port),
    )
    .await;

    let response = http_client()
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .header("x-user-id", "alice")
        .body(CHAT)
        .send()
        .await
        .expect("POST through Envoy");
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{body}\nEnvoy log:\n{}", envoy.log_tail(30));
    assert!(
        body.contains("\"choices\""),
        "the upstream answered: {body}"
    );
    wait_for_metric(
        &tollgate,
        "tollgate_requests_total",
        &[r#"outcome="admitted""#],
        1.0,
    )
    .await;
    assert!(
        envoy.stat("cluster.tollgate.health_check.success").await >= Some(1),
        "grpc.health.v1 checks pass over TLS"
    );
    assert_eq!(
        envoy
            .stat("cluster.tollgate.ssl.handshake")
            .await
            .map(|n| n >= 1),
        Some(true),
        "the ext_proc connection is TLS"
    );
}

/// Proves what docs/deploy.md says of envoy/front-proxy-no-response.yaml: requests are admitted
/// and answered; tollgate sees no response (no time to first token, the stream ends as
/// `no_response`); the request keeps its slot until the HTTP request ends (the upstream takes
/// 1.5 s to answer), then releases it; and, its output unseen, it is charged its input tokens
/// and all the output tokens it reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_phases_off_admit_hold_the_slot_and_charge_the_reserved_output() {
    let tollgate = TestServer::start(base_config()).await;
    let upstream = Upstream::start(&["--ttft-ms", "1500"]);
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &envoy_dir().join("front-proxy-no-response.yaml"),
        EnvoyPorts::free(upstream.addr.port(), tollgate.grpc.port()),
    )
    .await;

    let url = format!("http://{}/v1/chat/completions", envoy.listen);
    let request = tokio::spawn(
        http_client()
            .post(url)
            .header("content-type", "application/json")
            .header("x-user-id", "alice")
            .body(CHAT)
            .send(),
    );
    // Admitted at once; the slot stays taken while the upstream works.
    wait_for_metric(&tollgate, "tollgate_inflight_requests", &[], 1.0).await;
    let response = request.await.expect("join").expect("POST through Envoy");
    assert_eq!(response.status(), 200, "Envoy log:\n{}", envoy.log_tail(30));
    // The request ended: Envoy closes the ext_proc stream, the slot comes back.
    wait_for_metric(&tollgate, "tollgate_held_streams", &[], 0.0).await;
    let metrics = wait_for_metric(&tollgate, "tollgate_inflight_requests", &[], 0.0).await;

    assert_eq!(
        metrics.value("tollgate_requests_total", &[r#"outcome="admitted""#]),
        1.0
    );
    assert_eq!(
        metrics.value(
            "tollgate_stream_completions_total",
            &[r#"result="no_response""#]
        ),
        1.0
    );
    assert_eq!(
        metrics.value(
            "tollgate_time_to_first_token_seconds_count",
            &[r#"tier="free""#]
        ),
        0.0,
        "no response phase, no time to first token"
    );
    let budget = |kind: &str, stage: &str| {
        metrics.value(
            "tollgate_budget_tokens_total",
            &[
                r#"tier="free""#,
                &format!(r#"kind="{kind}""#),
                &format!(r#"stage="{stage}""#),
            ],
        )
    };
    assert!(budget("input", "reserved") > 0.0);
    assert_eq!(budget("input", "settled"), budget("input", "reserved"));
    assert_eq!(
        budget("output", "reserved"),
        8.0,
        "max_tokens is reserved up front"
    );
    assert_eq!(
        (budget("output", "settled"), budget("output", "refunded")),
        (8.0, 0.0),
        "Envoy reports that it sends no response body, so the output cannot be counted and \
         what the request asked for (its max_tokens) is charged (docs/deploy.md says so)"
    );
}

// ------------------------------------------------------------------------------------------
// Alert rules and the dashboard
// ------------------------------------------------------------------------------------------

/// Proves: the rule file passes `promtool check rules`, and its unit tests (every alert fires on
/// its situation and stays quiet on its near misses) pass `promtool test rules`.
#[test]
fn alert_rules_pass_promtool() {
    let dir = root().join("k8s/components/monitoring");
    for args in [
        ["check", "rules", "tollgate.rules.yaml"],
        ["test", "rules", "tollgate.rules.test.yaml"],
    ] {
        let mut command = Command::new(promtool());
        command.args(args).current_dir(&dir);
        stdout_of(
            run(command, None, "promtool"),
            &format!("promtool {args:?}"),
        );
    }
    // Every alert has a unit test.
    let rules = &yaml_file("k8s/components/monitoring/tollgate.rules.yaml")[0];
    let tests = read("k8s/components/monitoring/tollgate.rules.test.yaml");
    for rule in rules["groups"][0]["rules"].as_array().expect("rules") {
        let alert = rule["alert"].as_str().expect("alerts only");
        assert!(
            tests.contains(&format!("alertname: {alert}\n")),
            "{alert} has no promtool unit test"
        );
    }
}

/// A series selector in a query: the metric name and its matchers (label, operator, value).
#[derive(Debug)]
struct Selector {
    metric: String,
    matchers: Vec<(String, String, String)>,
}

/// The `tollgate_*` selectors of a PromQL expression, and the label names of its `by`, `without`,
/// `on` and `ignoring` clauses. A small scanner, enough for the queries in this repository.
fn scan_promql(expr: &str) -> (Vec<Selector>, Vec<String>) {
    let bytes = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let (mut selectors, mut grouping) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'"' {
            // Skip string literals (label values, label_values() arguments are not strings).
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += 1 + usize::from(bytes[i] == b'\\');
            }
            i += 1;
            continue;
        }
        if !ident(bytes[i]) || (i > 0 && ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && ident(bytes[i]) {
            i += 1;
        }
        let word = &expr[start..i];
        let rest = expr[i..].trim_start();
        if word.starts_with("tollgate_") {
            let mut matchers = Vec::new();
            if let Some(inner) = rest.strip_prefix('{') {
                let end = inner.find('}').expect("closing brace");
                for matcher in inner[..end].split(',').filter(|m| !m.trim().is_empty()) {
                    let op_at = matcher.find(['=', '!']).expect("an operator");
                    let label = matcher[..op_at].trim().to_owned();
                    let after = &matcher[op_at..];
                    let op_len = if after.starts_with("=~")
                        || after.starts_with("!~")
                        || after.starts_with("!=")
                    {
                        2
                    } else {
                        1
                    };
                    let value = after[op_len..].trim().trim_matches('"').to_owned();
                    matchers.push((label, after[..op_len].to_owned(), value));
                }
            }
            selectors.push(Selector {
                metric: word.to_owned(),
                matchers,
            });
        } else if matches!(word, "by" | "without" | "on" | "ignoring")
            && let Some(inner) = rest.strip_prefix('(')
        {
            let end = inner.find(')').expect("closing parenthesis");
            grouping.extend(
                inner[..end]
                    .split(',')
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    (selectors, grouping)
}

/// Series of a Prometheus text exposition: metric name -> label sets.
fn series_of(exposition: &str) -> BTreeMap<String, Vec<BTreeMap<String, String>>> {
    let mut series: BTreeMap<String, Vec<BTreeMap<String, String>>> = BTreeMap::new();
    for line in exposition.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (head, _value) = line.rsplit_once(' ').expect("name value");
        let (name, labels) = match head.split_once('{') {
            Some((name, labels)) => (name, labels.trim_end_matches('}')),
            None => (head, ""),
        };
        let labels = labels
            .split(',')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (k, v) = pair.split_once('=').expect("label=value");
                (k.to_owned(), v.trim_matches('"').to_owned())
            })
            .collect();
        series.entry(name.to_owned()).or_default().push(labels);
    }
    series
}

/// Problems of one query against a real exposition: unknown metrics, unknown labels, label values
/// no series has (every series exists from start-up, so a value missing now never appears).
fn query_problems(
    what: &str,
    expr: &str,
    series: &BTreeMap<String, Vec<BTreeMap<String, String>>>,
) -> Vec<String> {
    let (selectors, grouping) = scan_promql(expr);
    let mut problems = Vec::new();
    if selectors.is_empty() {
        problems.push(format!("{what}: no tollgate metric in {expr}"));
    }
    let mut labels_seen = BTreeSet::new();
    for selector in &selectors {
        let Some(sets) = series.get(&selector.metric) else {
            problems.push(format!("{what}: tollgate exports no {}", selector.metric));
            continue;
        };
        labels_seen.extend(sets.iter().flat_map(|set| set.keys().cloned()));
        for (label, op, value) in &selector.matchers {
            if !sets.iter().any(|set| set.contains_key(label)) {
                problems.push(format!("{what}: {} has no label {label}", selector.metric));
                continue;
            }
            if value.contains('$') || value.contains(".*") || op.starts_with('!') {
                continue;
            }
            let alternatives: Vec<&str> = if op == "=~" {
                value.split('|').collect()
            } else {
                vec![value.as_str()]
            };
            for alternative in alternatives {
                if !sets
                    .iter()
                    .any(|set| set.get(label).map(String::as_str) == Some(alternative))
                {
                    problems.push(format!(
                        "{what}: no {}{{{label}=\"{alternative}\"}} series",
                        selector.metric
                    ));
                }
            }
        }
    }
    for label in grouping {
        if !labels_seen.contains(&label) && !TARGET_LABELS.contains(&label.as_str()) {
            problems.push(format!(
                "{what}: groups by {label}, which none of its series has"
            ));
        }
    }
    problems
}

/// The dashboard's panels (rows' nested panels included) and their queries.
fn dashboard() -> Value {
    serde_json::from_str(&read("k8s/components/monitoring/grafana-dashboard.json"))
        .expect("grafana-dashboard.json is JSON")
}

fn dashboard_panels(dashboard: &Value) -> Vec<&Value> {
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        panels.push(panel);
        panels.extend(panel["panels"].as_array().into_iter().flatten());
    }
    panels
}

/// Proves: every metric, label and label value that the alert rules and the dashboard query exists
/// in a real scrape of tollgate's /metrics, run with the prod overlay's configuration (so the tier
/// names agree); no series carries a user or tenant label; and the rules' and the dashboard's TTFT
/// thresholds are the controller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_and_dashboard_query_only_real_series() {
    let config_json = prod_config();
    let mut config: tollgate::config::Config =
        serde_json::from_value(config_json.clone()).expect("print-config output is a Config");
    config.store.redis_url = None;
    config.store.redis_password_file = None;
    let server = TestServer::start(config).await;
    // Ready once the admin server answers.
    let mut exposition = String::new();
    for _ in 0..200 {
        if let Ok(response) = http_client()
            .get(format!("http://{}/metrics", server.admin))
            .send()
            .await
            && response.status().is_success()
        {
            exposition = response.text().await.expect("metrics text");
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let series = series_of(&exposition);
    assert!(series.len() > 20, "a real scrape:\n{exposition}");

    // No label may name a user (README, ARCHITECTURE invariant); tiers are the config's.
    let mut tiers = BTreeSet::new();
    for (name, sets) in &series {
        for set in sets {
            for forbidden in ["user", "user_id", "tenant", "tenant_id", "api_key"] {
                assert!(
                    !set.contains_key(forbidden),
                    "{name} has a {forbidden} label"
                );
            }
            if let Some(tier) = set.get("tier") {
                tiers.insert(tier.clone());
            }
        }
    }
    let mut expected: BTreeSet<String> = config_json["tiers"]
        .as_object()
        .expect("tiers")
        .keys()
        .cloned()
        .collect();
    expected.insert("none".to_owned());
    assert_eq!(
        tiers, expected,
        "tier label values are the config's tiers (and none)"
    );

    let mut problems = Vec::new();
    let rules = &yaml_file("k8s/components/monitoring/tollgate.rules.yaml")[0];
    for rule in rules["groups"][0]["rules"].as_array().expect("rules") {
        let alert = rule["alert"].as_str().expect("alert");
        problems.extend(query_problems(
            alert,
            rule["expr"].as_str().expect("expr"),
            &series,
        ));
    }
    let dashboard = dashboard();
    for panel in dashboard_panels(&dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let what = format!("panel {:?}", panel["title"].as_str().unwrap_or_default());
            problems.extend(query_problems(
                &what,
                target["expr"].as_str().expect("expr"),
                &series,
            ));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if let Some(definition) = variable["definition"].as_str() {
            // label_values(metric, label)
            let inner = definition
                .strip_prefix("label_values(")
                .and_then(|d| d.strip_suffix(')'))
                .expect("label_values(metric, label)");
            let (metric, label) = inner.split_once(',').expect("metric, label");
            let has = series
                .get(metric.trim())
                .is_some_and(|sets| sets.iter().any(|set| set.contains_key(label.trim())));
            if !has {
                problems.push(format!("variable {definition}: no such series or label"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // Thresholds: the controller's target (dashboard) and its decrease point (alert).
    let target_s = config_json["control"]["target_p99_ttft_ms"]
        .as_f64()
        .expect("target")
        / 1000.0;
    let band = config_json["control"]["band"].as_f64().expect("band");
    let ttft_panel = dashboard_panels(&dashboard)
        .into_iter()
        .find(|p| p["title"] == "p99 time to first token vs target")
        .expect("the TTFT panel");
    assert_eq!(
        ttft_panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"].as_f64(),
        Some(target_s),
        "the dashboard's target line is control.target_p99_ttft_ms"
    );
    let ttft_alert = rules["groups"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["alert"] == "TollgateTTFTAboveTarget")
        .expect("the TTFT alert");
    let threshold: f64 = ttft_alert["expr"]
        .as_str()
        .and_then(|e| e.trim().rsplit_once('>'))
        .and_then(|(_, t)| t.trim().parse().ok())
        .expect("expr ends with > THRESHOLD");
    assert!(
        (threshold - target_s * (1.0 + band)).abs() < 1e-9,
        "TollgateTTFTAboveTarget fires at target x (1 + band) = {}, not {threshold}",
        target_s * (1.0 + band)
    );
    server.stop().await.expect("tollgate shuts down cleanly");
}

/// Proves: the dashboard has the panels of seeds 000 and 001 (per-tier submitted, admitted and
/// shed; p99 TTFT against the target; global limit and in flight; controller actions), every
/// panel queries through the dashboard's data source variable, panel ids are unique, and the
/// layout has no overlapping panels.
#[test]
fn grafana_dashboard_has_the_seed_panels() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "tollgate");
    let panels = dashboard_panels(&dashboard);
    let titles: BTreeSet<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in [
        "Submitted per tier",
        "Admitted per tier",
        "Shed per tier (503)",
        "Refused per tier (429)",
        "p99 time to first token vs target",
        "Global in-flight budget",
        "Controller actions",
        "Stream completions",
    ] {
        assert!(
            titles.contains(wanted),
            "no panel {wanted:?}; have {titles:?}"
        );
    }
    let mut ids = BTreeSet::new();
    let mut boxes = Vec::new();
    for panel in &panels {
        let id = panel["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "panel id {id} is used twice");
        let grid = &panel["gridPos"];
        let (x, y, w, h) = (
            grid["x"].as_u64().expect("x"),
            grid["y"].as_u64().expect("y"),
            grid["w"].as_u64().expect("w"),
            grid["h"].as_u64().expect("h"),
        );
        assert!(w > 0 && h > 0 && x + w <= 24, "panel {id}: gridPos {grid}");
        for &(other, ox, oy, ow, oh) in &boxes {
            let overlap = x < ox + ow && ox < x + w && y < oy + oh && oy < y + h;
            assert!(!overlap, "panels {other} and {id} overlap");
        }
        boxes.push((id, x, y, w, h));
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {id}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {id} has no query");
        let refs: BTreeSet<&str> = targets.iter().filter_map(|t| t["refId"].as_str()).collect();
        assert_eq!(
            refs.len(),
            targets.len(),
            "panel {id}: refIds must be unique"
        );
    }
    assert!(
        dashboard["templating"]["list"]
            .as_array()
            .expect("variables")
            .iter()
            .any(|v| v["name"] == "datasource" && v["type"] == "datasource"),
        "a data source variable"
    );
}

// ------------------------------------------------------------------------------------------
// Dockerfile
// ------------------------------------------------------------------------------------------

/// The final stage's `USER uid:gid`.
fn dockerfile_user() -> (u64, u64) {
    let dockerfile = read("Dockerfile");
    let final_stage = dockerfile.rsplit_once("\nFROM ").expect("stages").1;
    let user = final_stage
        .lines()
        .find_map(|line| line.strip_prefix("USER "))
        .expect("the final stage sets USER");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    (
        uid.parse().expect("a numeric uid"),
        gid.parse().expect("a numeric gid"),
    )
}

/// Proves, without Docker (base images cannot be pulled here; see docs/deploy.md): the Dockerfile
/// builds in a Rust stage with `cargo build --release --locked`, as CI does, on a toolchain no
/// older than Cargo.toml's rust-version; the runtime stage is Debian slim of the builder's release
/// (so the glibc the binary was linked against is there), runs as a numeric non-root user,
/// exposes the config's ports and starts the copied binary; the build context keeps everything
/// cargo reads; and the tollgate binary needs no shared library beyond glibc and libgcc.
#[test]
fn dockerfile_builds_like_ci_and_runs_as_non_root() {
    let dockerfile = read("Dockerfile");
    assert!(
        dockerfile.starts_with("# syntax=docker/dockerfile:1\n"),
        "BuildKit syntax line"
    );
    let froms: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .collect();
    assert_eq!(froms.len(), 2, "two stages: {froms:?}");
    let (builder_image, builder_name) = froms[0].split_once(" AS ").expect("FROM image AS name");
    let rust = builder_image
        .strip_prefix("rust:")
        .expect("the builder is the official Rust image");
    let (toolchain, builder_release) = rust.split_once('-').expect("rust:X.Y-release");
    let minor = |version: &str| -> u32 {
        version
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("not a version: {version}"))
    };
    let cargo_toml = read("Cargo.toml");
    let rust_version = cargo_toml
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .expect("rust-version")
        .trim_matches('"');
    assert!(
        minor(toolchain) >= minor(rust_version),
        "toolchain {toolchain} < {rust_version}"
    );
    let runtime = froms[1].split(' ').next().expect("runtime image");
    assert_eq!(
        runtime,
        format!("debian:{builder_release}-slim"),
        "the runtime is the builder's Debian release, slim"
    );
    assert!(
        dockerfile.contains("cargo build --release --locked"),
        "built as CI builds: the committed Cargo.lock, release profile"
    );
    let final_stage = dockerfile.rsplit_once("\nFROM ").expect("stages").1;
    let copy = final_stage
        .lines()
        .find_map(|l| l.strip_prefix(&format!("COPY --from={builder_name} ")))
        .expect("the binary is copied from the builder");
    let installed = copy.split_whitespace().last().expect("destination");
    assert!(
        final_stage.contains(&format!("ENTRYPOINT [\"{installed}\"]")),
        "the entrypoint is the copied binary, in exec form"
    );
    let (uid, gid) = dockerfile_user();
    assert!(uid != 0 && gid != 0, "not root");
    let exposed: BTreeSet<u64> = final_stage
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|ports| ports.split_whitespace().map(|p| p.parse().expect("a port")))
        .collect();
    let config = base_config();
    assert_eq!(
        exposed,
        BTreeSet::from([
            port_of(&config.listen.grpc_addr),
            port_of(&config.listen.admin_addr)
        ])
    );
    for line in dockerfile.lines() {
        assert!(
            !(line.starts_with("ADD ") && line.contains("://")),
            "no downloads outside package managers: {line}"
        );
    }

    let dockerignore = read(".dockerignore");
    let ignored: Vec<&str> = dockerignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for needed in [".git", "target", ".tools"] {
        assert!(
            ignored.contains(&needed),
            ".dockerignore should leave out {needed}"
        );
    }
    for kept in [
        "Cargo.toml",
        "Cargo.lock",
        "src",
        "tests",
        "examples",
        "tests/it/main.rs",
    ] {
        assert!(
            !ignored
                .iter()
                .any(|pattern| kept.starts_with(pattern.trim_end_matches('/'))),
            ".dockerignore must keep {kept} (cargo reads it)"
        );
    }

    if cfg!(target_os = "linux") {
        let ldd =
            on_path("ldd").unwrap_or_else(|| panic!("ldd is missing: apt-get install libc-bin"));
        let mut command = Command::new(ldd);
        command.arg(env!("CARGO_BIN_EXE_tollgate"));
        let libraries = stdout_of(run(command, None, "ldd"), "ldd tollgate");
        let allowed = [
            "linux-vdso.so.1",
            "libc.so.6",
            "libm.so.6",
            "libgcc_s.so.1",
            "libpthread.so.0",
            "libdl.so.2",
            "librt.so.1",
        ];
        for line in libraries.lines() {
            let library = line.split_whitespace().next().unwrap_or_default();
            let library = Path::new(library)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            assert!(
                allowed.contains(&library) || library.starts_with("ld-linux"),
                "tollgate links {library}, which debian:{builder_release}-slim may not have \
                 (ldd: {line})"
            );
        }
    }
}

#[test]
fn promql_scanner_reads_selectors_and_grouping() {
    let (selectors, grouping) = scan_promql(
        r#"sum by (tier, le) (rate(tollgate_x_bucket{tier=~"a|b", outcome!="c"}[5m])) / on() max(tollgate_y) > 0"#,
    );
    assert_eq!(selectors.len(), 2);
    assert_eq!(selectors[0].metric, "tollgate_x_bucket");
    assert_eq!(
        selectors[0].matchers,
        vec![
            ("tier".to_owned(), "=~".to_owned(), "a|b".to_owned()),
            ("outcome".to_owned(), "!=".to_owned(), "c".to_owned()),
        ]
    );
    assert_eq!(selectors[1].metric, "tollgate_y");
    assert_eq!(grouping, vec!["tier", "le"]);
}
