#!/usr/bin/env bash
# Budgets in Redis: Redis round trips per admitted request (MONITOR), and decisions per
# CPU-second over gRPC (no Envoy) for an echo ext_proc, tollgate with Redis and tollgate with the
# embedded store, in interleaved rounds. See examples/bench_decisions.rs for the method and
# docs/benchmarks.md ("Budgets in Redis") for results and how to read them.
#
# Usage: scripts/bench-decisions.sh [bench_decisions flags...]
#   no flags: 200 checked requests, then 3 rounds x 10 s per server, 32 streams over 4
#             connections (about 2 minutes after the build)
#   e.g.      scripts/bench-decisions.sh --rounds 5 --json target/bench-decisions.json
#
# The example starts its own redis-server (a free loopback port, no persistence), tollgate twice
# and the echo server, and kills them all when it ends, also on error or Ctrl-C. Everything shares
# this machine's CPUs with the load generator: run it on an otherwise idle machine (the report
# shows how busy the rest of the machine was during each run). Honours CARGO_TARGET_DIR.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

if ! command -v redis-server >/dev/null 2>&1; then
    echo "bench-decisions: redis-server is not installed: run scripts/install-test-deps.sh" >&2
    exit 1
fi

# `cargo run --example` builds only the example: build the tollgate binary it drives too, so the
# current sources are what gets measured.
echo "bench-decisions: building release binaries (tollgate, bench_decisions)" >&2
cargo build --release --bin tollgate --example bench_decisions --example echo_extproc

# exec: the example receives Ctrl-C / SIGTERM itself and stops its children.
exec cargo run --release --example bench_decisions -- "$@"
