#!/usr/bin/env bash
# The open models' tokenizers: tollgate's counter (tokens.encodings[].tokenizer_file) against
# Hugging Face `tokenizers` (Python) on the same text, in one run on one machine: throughput on
# bench_tokens' ~1 MiB mixed corpus and time on three 1 MiB adversarial bodies, every count
# checked equal. Prints the tables docs/benchmarks.md quotes ("Open models' tokenizers", and
# "Open models cut and remembered as OpenAI's are" for the current figures).
#
# Uses what scripts/install-test-deps.sh installs: the tokenizer files in .tools/tokenizers/ and
# tokenizers in .tools/py-tokenizers/ (it runs the script first).
#
# Usage: scripts/bench-model-tokens.sh [ROUNDS]   (default 3; a few minutes)
set -euo pipefail
rounds="${1:-3}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
[[ "${rounds}" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer" >&2; exit 1; }
bash scripts/install-test-deps.sh >/dev/null
cargo build --quiet --release --example bench_tokens
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
work_dir=".tools/bench-model-tokens"
mkdir -p "${work_dir}"
cpu_model="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" || cpu_model="unknown CPU"
echo "Machine: nproc $(nproc), ${cpu_model}."
models=()
for model in llama3 qwen2_5 mistral_nemo; do
    models+=("${model}=.tools/tokenizers/${model}")
done
PYTHONPATH=.tools/py-tokenizers python3 scripts/bench_model_tokens.py \
    --bench-binary "${target_dir}/release/examples/bench_tokens" --work-dir "${work_dir}" \
    --rounds "${rounds}" "${models[@]}"
