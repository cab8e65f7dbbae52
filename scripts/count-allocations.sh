#!/usr/bin/env bash
# Allocator calls per decision, for each server of one short examples/bench_decisions.rs run (the
# echo ext_proc, tollgate with Redis, tollgate with its embedded store): a count that does not
# depend on what else the machine is doing, where the CPU per decision does (docs/benchmarks.md,
# "Commands built at their size").
#
# `perf probe` puts a uprobe on each of jemalloc's allocating entry points (`_rjem_malloc`,
# `_rjem_mallocx`, `_rjem_calloc`, `_rjem_realloc`, `_rjem_rallocx`) in the echo and in the
# tollgate binary, and `perf stat -I 1000` counts each server's hits per second. The benchmark
# starts and checks every server before the first run, then runs them one after another, so a
# server's one-second counts are its start-up (tens of thousands), idle seconds near zero, and
# its run, at the highest rate. The run is the longest stretch of seconds above half the
# server's busiest, with the second on each side (where the run starts or ends partway); its
# figure is all the calls counted in those seconds over the decisions the run reports. The
# echo's run follows its start-up at once, so its figure also holds the echo's start-up, a few
# thousand calls against the hundreds of thousands of its run. (A median second over the run's
# mean rate was noisier: the rate under the probes swings by a fifth from second to second.)
#
# The probes slow every allocation down a lot, so a run's decisions per second mean nothing here
# beyond that division. A run the benchmark flags (see its `clean`) is reported with why: under
# the probes, a run with Redis has counted one EVALSHA fewer than two per decision with no error
# of any kind (the slowdown stretches the moments between the benchmark's reads of Redis's
# counts and of its own), which the benchmark flags all the same.
#
# Usage: scripts/count-allocations.sh [OUT_DIR] [TOLLGATE_BIN]
#            (default target/count-allocations and target/release/tollgate)
#        scripts/count-allocations.sh --report-only OUT_DIR
#            (prints the figures again from a run's OUT_DIR, measuring nothing)
# Needs perf (linux-perf) with uprobes, as root (or kernel.perf_event_paranoid <= 1 and write
# access to the tracing file system), and python3. About a minute.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
readonly SECONDS_PER_SERVER=6
readonly ENTRY_POINTS=(_rjem_malloc _rjem_mallocx _rjem_calloc _rjem_realloc _rjem_rallocx)

need() { # TOOL PACKAGE
    command -v "$1" >/dev/null || {
        echo "count-allocations: $1 is not installed (apt-get install $2)" >&2
        exit 1
    }
}

# The run's children and the probes go whichever way the script ends.
children=()
clean_up() {
    for child in ${children[@]+"${children[@]}"}; do
        kill "${child}" 2>/dev/null || true
    done
    perf probe -q -d 'probe_tgalloc_tollgate:*' 2>/dev/null || true
    perf probe -q -d 'probe_tgalloc_echo:*' 2>/dev/null || true
}

measure() { # OUT_DIR TOLLGATE_BIN
    local out="$1" tollgate echo_bin
    need perf linux-perf
    mkdir -p "${out}"
    rm -f "${out}"/*.stat "${out}/bench.txt" "${out}/bench.json"
    cargo build --release --bin tollgate --example bench_decisions --example echo_extproc
    tollgate="$(realpath "$2")"
    echo_bin="$(realpath target/release/examples/echo_extproc)"

    clean_up
    trap clean_up EXIT
    local entry
    for entry in "${ENTRY_POINTS[@]}"; do
        # perf refuses an event name another group has, so each binary's are prefixed.
        perf probe -q -x "${tollgate}" -a "probe_tgalloc_tollgate:t_${entry#_rjem_}=${entry}"
        perf probe -q -x "${echo_bin}" -a "probe_tgalloc_echo:e_${entry#_rjem_}=${entry}"
    done

    target/release/examples/bench_decisions --tollgate-bin "${tollgate}" --echo-bin "${echo_bin}" \
        --seconds "${SECONDS_PER_SERVER}" --rounds 1 --check-requests 0 --warmup-seconds 0 \
        --json "${out}/bench.json" > "${out}/bench.txt" 2>&1 &
    local bench=$!
    children+=("${bench}")
    local -A seen
    local pid exe name events
    while kill -0 "${bench}" 2>/dev/null; do
        # By the executable, not the command line: the benchmark's own names the echo's path.
        for pid in $(pgrep -f -- "$(basename "${echo_bin}")|$(basename "${tollgate}")" || true); do
            [[ -n "${seen[${pid}]:-}" ]] && continue
            exe="$(readlink "/proc/${pid}/exe" 2>/dev/null || true)"
            # A server caught between fork and exec is still the benchmark: looked at again.
            if [[ "${exe}" == "${echo_bin}" ]]; then
                name=echo events='probe_tgalloc_echo:*'
            elif [[ "${exe}" == "${tollgate}" ]]; then
                events='probe_tgalloc_tollgate:*'
                if grep -qzx -- --redis-url "/proc/${pid}/cmdline" 2>/dev/null; then
                    name=tollgate-redis
                else
                    name=tollgate-memory
                fi
            else
                continue
            fi
            seen[${pid}]=1
            [[ -e "${out}/${name}.stat" ]] && { echo "count-allocations: a second ${name}" >&2; exit 1; }
            perf stat -I 1000 -x, -e "${events}" -p "${pid}" -o "${out}/${name}.stat" &
            children+=($!)
        done
        sleep 0.05
    done
    # 3 is a run the benchmark flagged; the counts stand, and the report says why.
    local status=0
    wait "${bench}" || status=$?
    if [[ "${status}" != 0 && "${status}" != 3 ]]; then
        cat "${out}/bench.txt" >&2
        exit 1
    fi
    # perf stat ends when the process it counts does.
    local child
    for child in "${children[@]}"; do
        wait "${child}" 2>/dev/null || true
    done
    # All ended: none left for the exit's clean-up to stop (their ids may be reused by then).
    children=()
}

if [[ "${1:-}" == --report-only ]]; then
    out="${2:-}"
    [[ -f "${out}/bench.json" ]] || { echo "count-allocations: --report-only needs a run's OUT_DIR" >&2; exit 1; }
else
    out="${1:-target/count-allocations}"
    measure "${out}" "${2:-target/release/tollgate}"
fi
need python3 python3

python3 - "${out}" <<'EOF'
import csv, json, sys
from collections import defaultdict

out = sys.argv[1]
ENTRY_POINTS = ("malloc", "mallocx", "calloc", "realloc", "rallocx")
runs = {run["server"]: run for run in json.load(open(f"{out}/bench.json"))["runs"]}
for name, run in runs.items():
    if not run["clean"]:
        t, r = run.get("tollgate") or {}, run.get("redis") or {}
        # `evalsha_calls` is already less the fleet's own (`fleet_calls`).
        print(f"flagged by the benchmark: {name}: errors {run['errors']}, store errors "
              f"{t.get('store_errors')}, decisions past the store {t.get('degraded')}, "
              f"EVALSHA {r.get('evalsha_calls')} for {run['decisions']} decisions")
print("allocator calls per decision (all counted over the run's seconds / its decisions):")
print(f"  {'server':<18}" + "".join(f"{e:>9}" for e in ENTRY_POINTS) + f"{'all':>9}  seconds")
for name in ("echo", "tollgate-redis", "tollgate-memory"):
    # time -> entry point -> count; a row perf could not count ("<not counted>") counts 0, so
    # every second perf reported is there and a stretch is a stretch of seconds.
    counts = defaultdict(lambda: defaultdict(int))
    for row in csv.reader(l for l in open(f"{out}/{name}.stat") if l.strip() and l[0] != "#"):
        if len(row) > 3:
            entry = row[3].split(":")[-1][2:]
            counts[float(row[0])][entry] = int(row[1]) if row[1].isdigit() else 0
    times = sorted(counts)
    totals = [sum(counts[t].values()) for t in times]
    busy = [total > max(totals) / 2 for total in totals]
    # The longest stretch of busy seconds is the run.
    best, start = (0, 0), None
    for i, b in enumerate(busy + [False]):
        if b and start is None:
            start = i
        elif not b and start is not None:
            best = max(best, (i - start, start))
            start = None
    length, first = best
    if length == 0:
        sys.exit(f"count-allocations: {name}: no second of its run was counted")
    run_times = times[max(first - 1, 0):first + length + 1]
    decisions = runs[name]["decisions"]
    cells = [sum(counts[t][e] for t in run_times) / decisions for e in ENTRY_POINTS]
    print(f"  {name:<18}" + "".join(f"{c:9.1f}" for c in cells) + f"{sum(cells):9.1f}"
          + f"  {len(run_times)}")
EOF
