//! Building and reading the manifests: `kubectl kustomize`, YAML through
//! `tests/fixtures/deploy/check.py`, the objects and containers of a build, and the effective
//! tollgate configuration a container runs with (`tollgate check-config` / `print-config`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::{INSTALL, on_path, read, root, run, stdout_of};

/// `tests/fixtures/deploy/check.py ARGS` with `.tools/py` (kubernetes-validate, jsonschema,
/// PyYAML) on the Python path.
pub(super) fn check_py(args: &[&str], stdin: Option<&str>) -> String {
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
pub(super) fn yaml_docs(text: &str) -> Vec<Value> {
    serde_json::from_str(&check_py(&["yaml2json", "-"], Some(text))).expect("check.py JSON")
}

/// Every YAML document of the repository file `path`.
pub(super) fn yaml_file(path: &str) -> Vec<Value> {
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
pub(super) fn kustomize(dir: &str) -> String {
    let mut command = Command::new(kubectl());
    command.arg("kustomize").arg(root().join(dir));
    stdout_of(run(command, None, dir), &format!("kubectl kustomize {dir}"))
}

pub(super) fn build(dir: &str) -> Vec<Value> {
    yaml_docs(&kustomize(dir))
}

pub(super) fn all_of<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|doc| doc["kind"] == kind).collect()
}

pub(super) fn one<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
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
pub(super) fn selects(selector: &Value, labels: &Value) -> bool {
    let labels = string_map(labels);
    let selector = string_map(selector);
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

pub(super) fn container<'a>(containers: &'a Value, name: &str) -> &'a Value {
    containers
        .as_array()
        .and_then(|list| list.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name} in {containers}"))
}

/// The variable `name` as `container` sets it (`name` with `value` or `valueFrom`), if it does.
pub(super) fn env_var<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()
        .and_then(|env| env.iter().find(|var| var["name"] == name))
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
pub(super) fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == name))
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {name} in {}", container["ports"]))
}

/// A tollgate container of a build, with its pod spec.
pub(super) struct TollgateContainer<'a> {
    pub(super) pod: &'a Value,
    pub(super) container: &'a Value,
}

impl<'a> TollgateContainer<'a> {
    /// The tollgate Deployment's container (k8s overlays).
    pub(super) fn deployment(docs: &'a [Value]) -> Self {
        let pod = &one(docs, "Deployment", "tollgate")["spec"]["template"]["spec"];
        Self {
            pod,
            container: container(&pod["containers"], "tollgate"),
        }
    }

    /// The tollgate native sidecar in the inference Deployment (istio/sidecar-container).
    pub(super) fn sidecar(docs: &'a [Value]) -> Self {
        let pod = &one(docs, "Deployment", "vllm")["spec"]["template"]["spec"];
        Self {
            pod,
            container: container(&pod["initContainers"], "tollgate"),
        }
    }

    /// The inference pod's sidecar if `sidecar`, else the Deployment's container.
    pub(super) fn of(docs: &'a [Value], sidecar: bool) -> Self {
        if sidecar {
            Self::sidecar(docs)
        } else {
            Self::deployment(docs)
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
pub(super) fn effective_config(docs: &[Value], tollgate: &TollgateContainer) -> Value {
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

pub(super) fn prod() -> Vec<Value> {
    build("k8s/overlays/prod")
}

/// The prod overlay's effective tollgate configuration.
pub(super) fn prod_config() -> Value {
    let docs = prod();
    effective_config(&docs, &TollgateContainer::deployment(&docs))
}

/// k8s/base/config.yaml as a runnable config: the embedded store instead of Redis.
pub(super) fn base_config() -> tollgate::config::Config {
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
pub(super) fn duration_ms(value: &Value) -> Option<u64> {
    let seconds: f64 = value.as_str()?.strip_suffix('s')?.parse().ok()?;
    Some((seconds * 1000.0).round() as u64)
}

pub(super) fn port_of(address: &str) -> u64 {
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address}"))
}
