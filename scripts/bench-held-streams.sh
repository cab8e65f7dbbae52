#!/usr/bin/env bash
# Held-streams benchmark: the release tollgate holding many queued ext_proc streams at once
# (10,000 by default, one tenant, queue deadline 20 s, one slot taken by an admitted request),
# driven by examples/bench_held_streams.rs playing Envoy over 4 HTTP/2 connections on 127.0.0.1.
# Prints the Markdown table that docs/benchmarks.md quotes ("## Held streams"): memory per held
# stream, tollgate's CPU while holding, and how late each 503 queue_timeout came after its
# deadline.
#
# Usage: scripts/bench-held-streams.sh [bench_held_streams flags, e.g. --streams 20000]
# Exits 3 if any stream was not queued (with --max-queued-body-bytes N, refused with 503
# queue_bytes_full instead), or not answered with 503 queue_timeout within its deadline + 5 s.
# Other heavy processes on the machine (a build, say) skew the lateness figures; the load
# average is printed with the machine so it is on record.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

# `cargo run --example` builds the example but not the tollgate binary it starts, so build both:
# a stale binary would be measured silently otherwise.
echo "bench-held-streams: building tollgate and examples/bench_held_streams (release)" >&2
cargo build --quiet --release --bin tollgate --example bench_held_streams
echo "bench-held-streams: running (about 25 s with the defaults)" >&2
exec cargo run --quiet --release --example bench_held_streams -- "$@"
