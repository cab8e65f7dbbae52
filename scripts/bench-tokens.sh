#!/usr/bin/env bash
# Token-counting benchmark: tollgate::tokens (bpe-openai) vs tiktoken-rs vs Python tiktoken, on
# one machine in one run, so the headline ratio (bpe-openai vs tiktoken-py) compares like with
# like. Prints the Markdown tables that docs/benchmarks.md quotes ("## Token counting").
#
# Steps:
#   1. builds examples/bench_tokens.rs (release), which generates the deterministic ~1 MiB
#      corpus, times bpe-openai and tiktoken-rs on it and on adversarial bodies, and reports JSON;
#   2. installs Python tiktoken ${TIKTOKEN_VERSION} into .tools/py (pip --target; .tools/ is
#      git-ignored) unless that exact version is already there;
#   3. tiktoken downloads its BPE files on first use, which cannot work offline, so its cache is
#      seeded with the byte-identical .tiktoken files that ship inside the tiktoken-rs crate,
#      each named by the SHA-1 of its download URL (tiktoken/load.py: read_file_cached) and
#      checked against the SHA-256 that tiktoken_ext/openai_public.py expects;
#   4. scripts/bench_tokens.py alternates rounds of the Rust example and of tiktoken on the same
#      text (so both meet the same machine load), checks every count equals the Rust one, and
#      prints the tables.
#
# Usage: scripts/bench-tokens.sh [ROUNDS]   (default 3)
# Takes a few minutes. Exits non-zero if any count differs between the implementations. Other
# busy processes on the machine slow every figure down; the load average is printed with the
# results so that is on record.
set -euo pipefail

readonly TIKTOKEN_VERSION="0.14.0"
# URL and SHA-256 exactly as in tiktoken 0.14.0's tiktoken_ext/openai_public.py.
readonly -A TIKTOKEN_FILES=(
    [cl100k_base]="https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken 223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
    [o200k_base]="https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken 446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
)

rounds="${1:-3}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools"
python_dir="${tools_dir}/py"
work_dir="${tools_dir}/bench-tokens"
cache_dir="${work_dir}/tiktoken-cache"

die() {
    echo "bench-tokens: ERROR: $*" >&2
    exit 1
}

note() {
    echo "bench-tokens: $*" >&2
}

cd "${repo_root}"
[[ "${rounds}" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, not '${rounds}'"
command -v python3 >/dev/null || die "python3 is not on PATH"
mkdir -p "${work_dir}" "${cache_dir}"

note "building examples/bench_tokens (release)"
cargo build --quiet --release --example bench_tokens

# One cargo metadata call gives both the target directory (which CARGO_TARGET_DIR may move) and
# the tiktoken-rs sources cargo resolved, which hold the .tiktoken files. --filter-platform keeps
# cargo from fetching crates only other platforms use.
host="$(rustc -vV | sed -n 's/^host: //p')"
read -r target_dir tiktoken_rs_manifest < <(
    cargo metadata --format-version 1 --filter-platform "${host}" | python3 -c '
import json, sys
metadata = json.load(sys.stdin)
manifest = next(p["manifest_path"] for p in metadata["packages"] if p["name"] == "tiktoken-rs")
print(metadata["target_directory"], manifest)
'
) || die "cargo metadata does not list tiktoken-rs (is it still a dev-dependency?)"
bench_binary="${target_dir}/release/examples/bench_tokens"
[[ -x "${bench_binary}" ]] || die "${bench_binary} was not built"
assets_dir="$(dirname "${tiktoken_rs_manifest}")/assets"

if PYTHONPATH="${python_dir}" python3 -c \
    "import sys, tiktoken; sys.exit(tiktoken.__version__ != '${TIKTOKEN_VERSION}')" 2>/dev/null; then
    note "tiktoken ${TIKTOKEN_VERSION} already in ${python_dir}"
else
    note "installing tiktoken==${TIKTOKEN_VERSION} into ${python_dir}"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
        --upgrade --target "${python_dir}" "tiktoken==${TIKTOKEN_VERSION}" ||
        die "pip could not install tiktoken==${TIKTOKEN_VERSION} (is PyPI reachable?)"
fi

for name in "${!TIKTOKEN_FILES[@]}"; do
    read -r url sha256 <<<"${TIKTOKEN_FILES[${name}]}"
    source_file="${assets_dir}/${name}.tiktoken"
    [[ -f "${source_file}" ]] || die "${source_file} is missing"
    actual="$(sha256sum "${source_file}" | cut -d' ' -f1)"
    [[ "${actual}" == "${sha256}" ]] ||
        die "${source_file} has SHA-256 ${actual}; tiktoken ${TIKTOKEN_VERSION} expects ${sha256}"
    cache_key="$(printf '%s' "${url}" | sha1sum | cut -d' ' -f1)"
    cp "${source_file}" "${cache_dir}/${cache_key}"
done

cpu_model="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "Machine: nproc $(nproc), ${cpu_model}."
echo
note "running ${rounds} rounds"
TIKTOKEN_CACHE_DIR="${cache_dir}" PYTHONPATH="${python_dir}" python3 scripts/bench_tokens.py \
    --bench-binary "${bench_binary}" --work-dir "${work_dir}" --rounds "${rounds}"
