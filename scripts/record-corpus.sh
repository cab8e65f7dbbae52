#!/usr/bin/env bash
# Re-records the ext_proc corpus (tests/fixtures/recorded/<envoy version>/<scenario>.jsonl)
# through real Envoy 1.36, 1.38 and 1.40, with the recorder (tests/it/support/recorder.rs)
# between Envoy and the tollgate binary, then regenerates the "Envoy versions" matrix of
# docs/conformance.md and replays the new corpus.
#
# Usage: scripts/record-corpus.sh [ENVOY_VERSION ...]       (default: all three)
#   TOLLGATE_RECORD_SCENARIOS=chat_json,chat_sse scripts/record-corpus.sh   (some scenarios only)
#
# The recordings are normalized (request ids, dates, ports, `created`) and their times rounded to
# 100 ms, so re-recording an unchanged system gives the same files up to scheduling jitter:
# `git diff --stat tests/fixtures/recorded` shows what changed; format in proto/README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

versions=("$@")
if [[ ${#versions[@]} -eq 0 ]]; then
    versions=(1.36.4 1.38.3 1.40.0)
fi
bash scripts/install-test-deps.sh "${versions[@]}"
# The recording drives the example upstream and the tollgate binary.
cargo build --locked --example upstream --bin tollgate
TOLLGATE_RECORD_ENVOY_VERSIONS="$(IFS=,; echo "${versions[*]}")" \
    cargo test --locked --test it replay::scenarios::record_corpus -- --ignored --exact --nocapture
TOLLGATE_REGENERATE_CONFORMANCE=1 \
    cargo test --locked --test it replay::conformance_doc_has_the_generated_envoy_matrix -- --exact
cargo test --locked --test it replay::
