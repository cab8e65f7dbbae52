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
#             scripts/bench-overhead.sh --configs A,B,R,F,L,D --rates 50,200
#                 (the peers: F Envoy's local_ratelimit, L LiteLLM's proxy, D no proxy; installs
#                 LiteLLM into .tools/litellm first)
#             scripts/bench-overhead.sh --configs A,C,P,V --reports-variant FILE --stream-tokens 64
#                 (V: P with another reports file, in the same rounds: an ablation)
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

# LiteLLM's proxy, for configuration L (the peer): a pinned release in its own virtualenv under
# .tools/ (git-ignored), installed only when L is asked for.
readonly LITELLM_VERSION="1.108.7"
# Not when --litellm-bin names a LiteLLM of the caller's own.
runs_litellm=false
own_litellm=false
previous=""
for arg in "$@"; do
    if [[ "${arg}" == --configs=*L* || ( "${previous}" == "--configs" && "${arg}" == *L* ) ]]; then
        runs_litellm=true
    fi
    if [[ "${arg}" == --litellm-bin || "${arg}" == --litellm-bin=* ]]; then
        own_litellm=true
    fi
    previous="${arg}"
done
litellm_venv="${repo_root}/.tools/litellm"
if [[ "${runs_litellm}" == true && "${own_litellm}" == false ]] \
    && ! "${litellm_venv}/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('litellm') != '${LITELLM_VERSION}')" 2>/dev/null; then
    echo "bench-overhead: installing litellm[proxy]==${LITELLM_VERSION} into ${litellm_venv}" >&2
    rm -rf "${litellm_venv}"
    python3 -m venv "${litellm_venv}"
    "${litellm_venv}/bin/pip" install --quiet "litellm[proxy]==${LITELLM_VERSION}"
fi

# `cargo run --example` builds only the example: build the tollgate binary and the upstream it
# drives too, so the current sources are what gets measured.
echo "bench-overhead: building release binaries (tollgate, upstream, echo_extproc, bench_overhead)" >&2
cargo build --release --bin tollgate --example upstream --example echo_extproc --example bench_overhead

# exec: the example receives Ctrl-C / SIGTERM itself and stops its children.
exec cargo run --release --example bench_overhead -- "$@"
