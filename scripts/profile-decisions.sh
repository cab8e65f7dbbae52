#!/usr/bin/env bash
# Where a decision's CPU goes (docs/benchmarks.md, "Where a decision's CPU goes"): runs
# examples/bench_decisions.rs once, short, and attaches `perf` to each server it starts (the echo
# ext_proc, tollgate with Redis, tollgate with its embedded store, in that order):
#   - `perf stat` counts each server's system calls (writev, recvfrom, futex, epoll_wait) and
#     context switches, to divide by the decisions the run reports;
#   - `perf record --call-graph dwarf` samples each server, the echo too, for
#     `perf report --children`: the echo's profile is the plumbing both share, so what tollgate
#     spends beyond it shows side by side;
#   - the self time of each server by crate, in us per decision, with what tollgate with the
#     embedded store spends beyond the echo (docs/benchmarks.md, "By crate, beside the echo");
#     each server's flat profile is left in OUT_DIR/NAME.self.txt.
# Needs perf (linux-perf) and permission to attach to the servers (root, or
# kernel.perf_event_paranoid <= 1). Attaching slows the servers a little; read the profile's
# shares, and take decisions per CPU-second from scripts/bench-decisions.sh. perf attaches
# within 50 ms of a server's start, and the benchmark starts and checks every server before the
# first run, so the counts cover each server's whole measured run (and a few checking requests).
#
# Usage: scripts/profile-decisions.sh [OUT_DIR [BENCH_DECISIONS_ARG ...]]
#            (default target/profile-decisions; the arguments after OUT_DIR go to bench_decisions,
#            e.g. --tokenizer .tools/tokenizers/llama3; perf is attached as each server
#            starts, so with a model's tokenizer each tollgate's profile also holds the loading
#            of its vocabulary, about 0.7 s of CPU against 5 s of run on a 2-core AMD EPYC:
#            about a tenth of the samples, in bpe's and serde_json's symbols)
#        PERF_RECORD_EVENT=syscalls:sys_enter_futex scripts/profile-decisions.sh OUT_DIR
#            (samples where tollgate makes a system call instead of where it spends CPU)
#        scripts/profile-decisions.sh --report-only OUT_DIR
#            (prints the report again from a run's OUT_DIR, measuring nothing)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
report_only=
if [[ "${1:-}" == --report-only ]]; then
    report_only=1
    shift
    [[ -f "${1:-}/bench.txt" ]] || { echo "profile-decisions: --report-only needs a run's OUT_DIR" >&2; exit 1; }
fi
out="${1:-target/profile-decisions}"
if [[ "${out}" == -* ]]; then
    echo "profile-decisions: OUT_DIR comes first, then bench_decisions' arguments" >&2
    exit 1
fi
bench_args=("${@:2}")
readonly SECONDS_PER_SERVER=5

command -v perf >/dev/null || { echo "profile-decisions: perf is not installed (apt-get install linux-perf)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "profile-decisions: python3 is not installed (apt-get install python3)" >&2; exit 1; }

if [[ -z "${report_only}" ]]; then
mkdir -p "${out}"
rm -f "${out}"/*.data "${out}"/*.stat "${out}/servers.txt"
cargo build --release --bin tollgate --example bench_decisions --example echo_extproc

# No warm-up run, so each server's counts cover exactly its measured 5 s.
target/release/examples/bench_decisions --seconds "${SECONDS_PER_SERVER}" --rounds 1 \
    --check-requests 0 --warmup-seconds 0 ${bench_args[@]+"${bench_args[@]}"} \
    > "${out}/bench.txt" 2>&1 &
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
fi

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

# Where each server's CPU goes by crate: self time (perf report --no-children --sort dso,symbol),
# each symbol's share of the samples read (their sum taken as the whole) times the server's us
# per decision, summed by the crate (the first path segment) its symbol is in; the kernel, libc
# (with libm) and jemalloc (the binary's C symbols) each as one. Sorted by what tollgate with the
# embedded store spends beyond the echo: the plumbing both share nets out. A symbol counts where
# its name puts it: the token counting loop, a closure inlined into std's `LocalKey::with` (its
# scratch space is per thread), shows as std. Only for CPU samples: with PERF_RECORD_EVENT the
# samples are events, and a share of them is no share of the time.
if [[ -n "${PERF_RECORD_EVENT:-}" ]]; then
    exit 0
fi
for name in echo tollgate-redis tollgate-memory; do
    perf report -i "${out}/${name}.data" --no-children --sort dso,symbol -g none \
        > "${out}/${name}.self.txt" 2> "${out}/${name}.self.err" \
        || { cat "${out}/${name}.self.err" >&2; exit 1; }
done
echo "self time by crate, us per decision (perf attached; the shares are the reading):"
python3 - "${out}" <<'PY'
import collections, re, sys
out = sys.argv[1]
names = ["echo", "tollgate-redis", "tollgate-memory"]
us = {}
for line in open(f"{out}/bench.txt"):
    fields = line.split()
    # The table's row, the first line naming the server (later ones are its histograms'):
    # us per decision from its decisions per server CPU-second, which has more digits.
    if fields and fields[0] in names and fields[0] not in us:
        us[fields[0]] = 1e6 / float(fields[6])
def crate(dso, kind, symbol):
    if kind == "k":
        return "kernel"
    if dso.startswith(("libc.so", "libc-", "libm.so", "libm-")):
        return "libc"
    if dso == "[vdso]":
        return "vdso"
    symbol = re.sub(r"^(core::ptr::drop_in_place<|<)+", "", symbol)
    if "::" not in symbol:
        # The servers' binaries hold no C but jemalloc's (`_rjem_*` and its static functions).
        return "jemalloc" if dso in ("tollgate", "echo_extproc") else "other"
    head = symbol.split("::")[0]
    return head if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head) else "other"
by_crate = {}
# Per server: (crate, (us, share, symbol)) for every symbol, its us from its share.
symbols = {}
for name in names:
    read = []
    for line in open(f"{out}/{name}.self.txt"):
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)", line)
        if m:
            share, dso, kind, symbol = m.groups()
            symbol = re.sub(r"\s+-\s+-\s*$", "", symbol.strip())
            read.append((crate(dso, kind, symbol), float(share), symbol))
    whole = sum(share for _, share, _ in read)
    if whole < 50:
        sys.exit(f"profile-decisions: {out}/{name}.self.txt holds {whole:.1f} % of the samples")
    symbols[name] = [(c, (share / whole * us[name], share, symbol)) for c, share, symbol in read]
    shares = collections.Counter()
    for c, (symbol_us, _, _) in symbols[name]:
        shares[c] += symbol_us
    by_crate[name] = dict(shares)
crates = sorted(set().union(*by_crate.values()),
                key=lambda c: by_crate["echo"].get(c, 0) - by_crate["tollgate-memory"].get(c, 0))
print(f"  {'crate':<22}{'echo':>8}{'tollgate-redis':>16}{'tollgate-memory':>17}{'memory - echo':>15}")
for c in crates:
    row = [by_crate[n].get(c, 0) for n in names]
    if max(row) >= 0.5:
        print(f"  {c:<22}{row[0]:>8.1f}{row[1]:>16.1f}{row[2]:>17.1f}{row[2] - row[0]:>15.1f}")
print(f"  {'(all)':<22}" + "".join(f"{sum(by_crate[n].values()):>{w}.1f}" for n, w in zip(names, (8, 16, 17))))
# What the docs split tollgate's own column into, symbol by symbol.
def show(title, picked, top=None):
    print(f"{title}: {len(picked)} symbols, {sum(us for us, _, _ in picked):.1f} us" + (", the largest:" if top else ""))
    for us, share, symbol in sorted(picked, reverse=True)[:top]:
        print(f"  {share:5.2f} %  {us:5.2f} us  {symbol}")
rows = symbols["tollgate-memory"]
# The loop's own symbols, wherever the compiler left them out of line: cutting pieces
# (`Counter::next_piece`, `tokens::ascii::*`) and the count cache's lookup.
counting = re.compile(r"LocalKey<T>::with|tokens::Counter::next_piece|tokens::ascii::|CountCache::count_till_limit")
show("tollgate-memory, the counting loop", [r[1] for r in rows if counting.search(r[1][2])])
show("tollgate-memory, tollgate's other symbols",
     [r[1] for r in rows if r[0] == "tollgate" and not counting.search(r[1][2])], 3)
show("tollgate-memory, libc", [r[1] for r in rows if r[0] == "libc"], 4)
PY
