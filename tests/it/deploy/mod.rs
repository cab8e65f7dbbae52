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

mod dockerfile;
mod envoy_e2e;
mod envoy_validate;
mod grafana;
mod kustomize;
mod manifests;
mod promql;
mod promtool;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const INSTALL: &str = "run scripts/install-test-deps.sh";

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
