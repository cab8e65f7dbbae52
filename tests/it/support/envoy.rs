//! Real Envoy for end-to-end tests, from the test kit (`tollgate_testkit::envoy`), and which
//! version the end-to-end suite runs against.

use std::path::PathBuf;

pub use tollgate_testkit::envoy::{ENVOY_VERSION, Envoy, EnvoyPorts};
pub use tollgate_testkit::ports::free_port;

/// The Envoy the end-to-end suite (`tests/it/e2e.rs`, through `process::Stack`) runs against:
/// `TOLLGATE_E2E_ENVOY_VERSION` if set (the live matrix, `scripts/test-envoy-matrix.sh`, runs the
/// suite once per supported version), else [`ENVOY_VERSION`].
pub fn e2e_envoy_version() -> String {
    std::env::var("TOLLGATE_E2E_ENVOY_VERSION")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| ENVOY_VERSION.to_owned())
}

/// Path of the Envoy binary for `version` (see `tollgate_testkit::envoy::binary`).
///
/// # Panics
/// When it is missing, saying what to install.
pub fn envoy_binary(version: &str) -> PathBuf {
    tollgate_testkit::envoy::binary(version).unwrap_or_else(|error| panic!("{error:#}"))
}
