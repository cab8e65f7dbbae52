#!/usr/bin/env bash
# The live matrix: the end-to-end suite (tests/it/e2e.rs: client -> real Envoy -> example
# upstream, with the tollgate binary as ext_proc) once per supported Envoy version.
#
# `cargo test` runs e2e against Envoy 1.40.0, and the replay tests (tests/it/replay.rs) hold
# tollgate to traffic recorded from all three versions without Envoy. This script runs the
# suite live against other versions: scripts/test.sh (the README's test command, which CI runs)
# calls it for 1.36.4 and 1.38.3 after the main run, about half a minute each.
#
# Usage: scripts/test-envoy-matrix.sh [ENVOY_VERSION ...]   (default: 1.36.4 1.38.3 1.40.0)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

versions=("$@")
if [[ ${#versions[@]} -eq 0 ]]; then
    versions=(1.36.4 1.38.3 1.40.0)
fi
bash scripts/install-test-deps.sh "${versions[@]}"
cargo build --locked --example upstream --bin tollgate
failed=()
for version in "${versions[@]}"; do
    echo "=== e2e against Envoy ${version}"
    if ! TOLLGATE_E2E_ENVOY_VERSION="${version}" cargo test --locked --test it e2e::; then
        failed+=("${version}")
    fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "e2e failed against Envoy ${failed[*]}" >&2
    exit 1
fi
echo "e2e passed against Envoy ${versions[*]}"
