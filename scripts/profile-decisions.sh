#!/usr/bin/env bash
# Where a decision's CPU goes (docs/benchmarks.md, "Where a decision's CPU goes"): runs
# examples/bench_decisions.rs once, short, and attaches `perf` to each server it starts (the echo
# ext_proc, tollgate with Redis, tollgate with its embedded store, in that order):
#   - `perf stat` counts each server's system calls (writev, recvfrom, futex, epoll_wait) and
#     context switches, to divide by the decisions the run reports;
#   - `perf record --call-graph dwarf` samples each server, the echo too, for
#     `perf report --children`: the echo's profile is the plumbing both share, so what tollgate
#     spends beyond it shows side by side.
# Needs perf (linux-perf) and permission to attach to the servers (root, or
# kernel.perf_event_paranoid <= 1). Attaching slows the servers a little; read the profile's
# shares, and take decisions per CPU-second from scripts/bench-decisions.sh. perf attaches
# within 50 ms of a server's start, and the benchmark starts and checks every server before the
# first run, so the counts cover each server's whole measured run (and a few checking requests).
#
# Usage: scripts/profile-decisions.sh [OUT_DIR]   (default target/profile-decisions)
#        PERF_RECORD_EVENT=syscalls:sys_enter_futex scripts/profile-decisions.sh OUT_DIR
#            (samples where tollgate makes a system call instead of where it spends CPU)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
out="${1:-target/profile-decisions}"
mkdir -p "${out}"
rm -f "${out}"/*.data "${out}"/*.stat "${out}/servers.txt"

command -v perf >/dev/null || { echo "profile-decisions: perf is not installed (apt-get install linux-perf)" >&2; exit 1; }
cargo build --release --bin tollgate --example bench_decisions --example echo_extproc

# No warm-up run, so each server's counts cover exactly its measured 5 s.
readonly SECONDS_PER_SERVER=5
target/release/examples/bench_decisions --seconds "${SECONDS_PER_SERVER}" --rounds 1 \
    --check-requests 0 --warmup-seconds 0 > "${out}/bench.txt" 2>&1 &
bench=$!
declare -A seen
monitors=()
# The servers start one after another; attach to each as soon as it appears.
while kill -0 "${bench}" 2>/dev/null; do
    for pid in $(pgrep -f 'release/examples/echo_extproc|release/tollgate --config' || true); do
        [[ -n "${seen[${pid}]:-}" ]] && continue
        seen[${pid}]=1
        cmdline="$(tr '\0' ' ' < "/proc/${pid}/cmdline" 2>/dev/null || true)"
        case "${cmdline}" in
            *echo_extproc*) name=echo ;;
            *redis*) name=tollgate-redis ;;
            *) name=tollgate-memory ;;
        esac
        echo "${pid} ${name}" >> "${out}/servers.txt"
        perf stat -e 'syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait,context-switches' \
            -p "${pid}" -o "${out}/${name}.stat" &
        monitors+=($!)
        perf record -q ${PERF_RECORD_EVENT:+-e "${PERF_RECORD_EVENT}"} -F 999 --call-graph dwarf,16384 -p "${pid}" -o "${out}/${name}.data" \
            > /dev/null 2>&1 &
        monitors+=($!)
    done
    sleep 0.05
done
wait "${bench}" || { cat "${out}/bench.txt" >&2; exit 1; }
# perf exits when the process it is attached to does; give it time to write.
for monitor in ${monitors[@]+"${monitors[@]}"}; do
    wait "${monitor}" || true
done

grep -E '^(echo|tollgate-redis|tollgate-memory) ' "${out}/bench.txt"
echo "(columns: decisions/s, p50 / p99 ms, server cores, decisions per server CPU-second, server us per decision, ...)"
echo "system calls and context switches per decision:"
for name in echo tollgate-redis tollgate-memory; do
    rate="$(awk -v n="${name}" '$1 == n { print $2; exit }' "${out}/bench.txt")"
    [[ "${rate}" =~ ^[0-9]+$ ]] || { echo "profile-decisions: no decisions/s for ${name}" >&2; exit 1; }
    awk -v n="${name}" -v decisions="$((rate * SECONDS_PER_SERVER))" '
        /syscalls:sys_enter_|context-switches/ {
            gsub(/,/, "", $1); sub(/syscalls:sys_enter_/, "", $2)
            line = line sprintf("  %s %.2f", $2, $1 / decisions)
        }
        END { printf "  %-16s%s\n", n, line }' "${out}/${name}.stat"
done
echo "profiles: perf report -i ${out}/tollgate-memory.data --children --sort symbol -g none (echo.data, tollgate-redis.data beside it)"
