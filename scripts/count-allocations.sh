#!/usr/bin/env bash
# Allocator calls per decision, for each server of one short examples/bench_decisions.rs run (the
# echo ext_proc, tollgate with Redis, tollgate with its embedded store): a count that does not
# depend on what else the machine is doing, where the CPU per decision does (docs/benchmarks.md,
# "Commands built at their size").
#
# `perf probe` puts a uprobe on each jemalloc entry point (`_rjem_malloc`, `_rjem_mallocx`,
# `_rjem_calloc`, `_rjem_realloc`) of the binaries the benchmark runs, and `perf stat -I 1000`
# counts each server's hits per second. The benchmark starts and checks every server before the
# first run, and each then idles while the others run, so a server's one-second counts are its
# start-up (building tables allocates a few hundred thousand times), idle seconds near zero, and
# the seconds of its own run. Its figure is the median of its busiest SECONDS_PER_SERVER seconds
# after the first two, divided by the decisions per second its run reports: the run's seconds,
# the median leaving out the partial ones at its ends and a first count's burst.
# The probes slow every allocation down a lot, so the run's decisions per second mean nothing
# here beyond that division; they are removed on exit.
#
# Usage: scripts/count-allocations.sh [OUT_DIR] [TOLLGATE_BIN]
#            (default target/count-allocations and target/release/tollgate)
#        scripts/count-allocations.sh --report-only OUT_DIR
#            (prints the figures again from a run's OUT_DIR, measuring nothing)
# Needs perf (linux-perf) with uprobes, as root (or kernel.perf_event_paranoid <= 1 and write
# access to the tracing file system), and python3.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
report_only=
if [[ "${1:-}" == --report-only ]]; then
    report_only=1
    shift
    [[ -f "${1:-}/bench.json" ]] || { echo "count-allocations: --report-only needs a run's OUT_DIR" >&2; exit 1; }
fi
out="${1:-target/count-allocations}"
tollgate="${2:-target/release/tollgate}"
echo_bin=target/release/examples/echo_extproc
readonly SECONDS_PER_SERVER=6

if [[ -z "${report_only}" ]]; then
command -v perf >/dev/null || { echo "count-allocations: perf is not installed (apt-get install linux-perf)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "count-allocations: python3 is not installed (apt-get install python3)" >&2; exit 1; }
mkdir -p "${out}"
rm -f "${out}"/*.stat "${out}/bench.txt"
cargo build --release --bin tollgate --example bench_decisions --example echo_extproc
tollgate="$(realpath "${tollgate}")"
echo_bin="$(realpath "${echo_bin}")"

readonly ENTRY_POINTS=(_rjem_malloc _rjem_mallocx _rjem_calloc _rjem_realloc)
remove_probes() {
    perf probe -q -d 'probe_tgalloc_tollgate:*' 2>/dev/null || true
    perf probe -q -d 'probe_tgalloc_echo:*' 2>/dev/null || true
}
remove_probes
trap remove_probes EXIT
for entry in "${ENTRY_POINTS[@]}"; do
    # perf refuses an event name already taken in another group, so each binary's are prefixed.
    perf probe -q -x "${tollgate}" -a "probe_tgalloc_tollgate:t_${entry#_rjem_}=${entry}"
    perf probe -q -x "${echo_bin}" -a "probe_tgalloc_echo:e_${entry#_rjem_}=${entry}"
done

target/release/examples/bench_decisions --tollgate-bin "${tollgate}" --echo-bin "${echo_bin}" \
    --seconds "${SECONDS_PER_SERVER}" --rounds 1 --check-requests 0 --warmup-seconds 0 \
    --json "${out}/bench.json" > "${out}/bench.txt" 2>&1 &
bench=$!
declare -A seen
monitors=()
while kill -0 "${bench}" 2>/dev/null; do
    for pid in $(pgrep -f "${echo_bin}|${tollgate} --config" || true); do
        [[ -n "${seen[${pid}]:-}" ]] && continue
        seen[${pid}]=1
        cmdline="$(tr '\0' ' ' < "/proc/${pid}/cmdline" 2>/dev/null || true)"
        case "${cmdline}" in
            *echo_extproc*) name=echo events='probe_tgalloc_echo:*' ;;
            *redis*) name=tollgate-redis events='probe_tgalloc_tollgate:*' ;;
            *) name=tollgate-memory events='probe_tgalloc_tollgate:*' ;;
        esac
        perf stat -I 1000 -x, -e "${events}" -p "${pid}" -o "${out}/${name}.stat" &
        monitors+=($!)
    done
    sleep 0.05
done
# 3 is a run the benchmark flagged: the probes slow tollgate down enough that a store call can
# time out. The counts stand; what was flagged is printed with them.
status=0
wait "${bench}" || status=$?
if [[ "${status}" != 0 && "${status}" != 3 ]]; then
    cat "${out}/bench.txt" >&2
    exit 1
fi
for monitor in ${monitors[@]+"${monitors[@]}"}; do
    wait "${monitor}" || true
done
fi

python3 - "${out}" "${SECONDS_PER_SERVER}" <<'EOF'
import csv, re, statistics, sys
from collections import defaultdict
out, SECONDS = sys.argv[1], int(sys.argv[2])
ENTRY_POINTS = ("malloc", "mallocx", "calloc", "realloc")
rates = {}
for line in open(f"{out}/bench.txt"):
    m = re.match(r"^(echo|tollgate-redis|tollgate-memory)\s+(\d+)\s", line)
    if m:
        rates[m.group(1)] = int(m.group(2))
import json
for run in json.load(open(f"{out}/bench.json"))["runs"]:
    t = run.get("tollgate") or {}
    if run.get("errors") or t.get("store_errors") or t.get("degraded"):
        print(f"flagged: {run.get('server')}: errors {run.get('errors')}, store errors "
              f"{t.get('store_errors')}, decisions that skipped the store {t.get('degraded')}")
print("allocator calls per decision (median one-second count / decisions per second):")
print(f"  {'server':<18}{'malloc':>9}{'mallocx':>9}{'calloc':>9}{'realloc':>9}{'all':>9}")
for name in ("echo", "tollgate-redis", "tollgate-memory"):
    per_second = defaultdict(list)
    for row in csv.reader(line for line in open(f"{out}/{name}.stat") if line.strip() and not line.startswith("#")):
        if len(row) > 3 and row[1].replace(".", "").isdigit():
            per_second[row[3].split(":")[-1][2:]].append(float(row[1]))
    # The busiest seconds after start-up are the run's (see the top of this script); they are
    # told apart by the sum over the entry points.
    seconds = [sum(c) for c in zip(*(per_second[e] for e in ENTRY_POINTS))][2:]
    busiest = sorted(range(len(seconds)), key=lambda i: seconds[i])[-SECONDS:]
    cells = [statistics.median(per_second[e][2:][i] for i in busiest) / rates[name]
             for e in ENTRY_POINTS]
    print(f"  {name:<18}" + "".join(f"{c:9.1f}" for c in cells) + f"{sum(cells):9.1f}")
EOF
