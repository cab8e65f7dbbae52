#!/usr/bin/env bash
# Measures what tollgate adds to a request through Envoy: latency (p50/p90/p99, per-round
# differences) and CPU per request, interleaved: Envoy alone (A), Envoy + an echo ext_proc (E),
# Envoy + tollgate (B) and Envoy + tollgate with Redis (R). See examples/bench_overhead.rs for the
# method and docs/benchmarks.md ("Overhead through Envoy") for results and how to read them.
#
# Usage: scripts/bench-overhead.sh [bench_overhead flags...]
#   no flags: --rates 500,2000 --seconds 10 --rounds 3 --configs A,E,B,R (about 7 minutes)
#   e.g.      scripts/bench-overhead.sh --rates 1000 --rounds 5 --json target/bench-overhead.json
#             scripts/bench-overhead.sh --configs B,C   (C: tollgate without the response phases)
#             scripts/bench-overhead.sh --configs E,Q,B,C   (Q: the echo without them, C's baseline)
#
# Everything runs on 127.0.0.1 ports picked at start-up; the example kills every process it
# started when it ends, also on error or Ctrl-C. Run it on an otherwise idle machine: it shares
# the CPUs with two Envoys, tollgate, the upstream and the load generator, and any other load
# (a compile) shows up in the figures.
set -euo pipefail

# Keep in step with ENVOY_VERSION in testkit/src/envoy.rs (the benchmark's default Envoy).
readonly ENVOY_VERSION="1.40.0"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

envoy_bin="${ENVOY_BIN:-${repo_root}/.tools/envoy-${ENVOY_VERSION}/envoy/_bin/envoy}"
# Captured, not piped into `grep -q`: under pipefail, grep exiting at its first match can kill
# envoy with SIGPIPE and fail the check at random.
envoy_version_line="$("${envoy_bin}" --version 2>/dev/null || true)"
if [[ "${envoy_version_line}" != *"/${ENVOY_VERSION}/"* ]]; then
    echo "bench-overhead: Envoy ${ENVOY_VERSION} not found at ${envoy_bin}; installing it" >&2
    scripts/install-test-deps.sh "${ENVOY_VERSION}"
fi

# `cargo run --example` builds only the example: build the tollgate binary and the upstream it
# drives too, so the current sources are what gets measured.
echo "bench-overhead: building release binaries (tollgate, upstream, echo_extproc, bench_overhead)" >&2
cargo build --release --bin tollgate --example upstream --example echo_extproc --example bench_overhead

# exec: the example receives Ctrl-C / SIGTERM itself and stops its children.
exec cargo run --release --example bench_overhead -- "$@"
