#!/usr/bin/env bash
# What the budget scripts cost Redis, per reserve and per settle: instructions, the whole
# server's, those inside EVALSHA and those inside the commands the scripts call (valgrind's
# callgrind: repeatable, whatever else the machine is doing, but for the server's timers), the
# commands they run,
# and the bytes they add to the append-only file (what a replica is sent too). Compares the
# scripts of a git revision with the working tree's. See docs/benchmarks.md ("What Redis runs
# per decision").
#
# Usage: scripts/redis-script-cost.sh [REV]   (default HEAD)
#
# Each side runs in its own redis-server under callgrind on a free loopback port: 200 reserves
# (two windows and a concurrency limit, one tenant, a new lease id each), then 1000 more, then 200
# settles giving one token back, then 1000 more; per call is the difference between the longer
# and the shorter run divided by 1000, so start-up and script loading cancel out. A third side,
# the floor, runs two trivial scripts the same way. Needs
# redis-server, redis-benchmark and redis-cli (Debian's redis-server and redis-tools) and
# valgrind. About a minute.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
rev="${1:-HEAD}"
for tool in redis-server redis-benchmark redis-cli valgrind; do
    command -v "${tool}" >/dev/null || {
        echo "redis-script-cost: ${tool} is not installed (apt-get install redis-server redis-tools valgrind)" >&2
        exit 1
    }
done
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

# The reserve and settle scripts as tollgate sends them: common.lua, a newline, the body. For the
# floor, "reserve" is `return 1` and "settle" is common.lua followed by `return 1`: what any
# EVALSHA costs, and what the shared prelude adds to every script run.
script() { # SIDE NAME
    if [[ "$1" == floor ]]; then
        [[ "$2" == settle ]] && { cat src/budget/redis/common.lua; echo; }
        echo 'return 1'
    elif [[ "$1" == tree ]]; then
        cat src/budget/redis/common.lua; echo; cat "src/budget/redis/$2.lua"
    else
        git show "${rev}:src/budget/redis/common.lua"; echo; git show "${rev}:src/budget/redis/$2.lua"
    fi
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# One tenant: its lease ZSET, a token window (a day of hour buckets, so every call of a run
# writes the same bucket) and a request window (a minute of second buckets); limits never
# reached.
readonly KEYS=(3 'tollgate:{t}:leases' 'tollgate:{t}:w:tokens_day' 'tollgate:{t}:w:requests_minute')
# reserve: lease id, lease TTL, max concurrent; per window cost, window_ms, bucket_ms, limit.
readonly RESERVE_ARGS=(lease__rand_int__ 60000 1000000 1000000 86400000 3600000 1000000000000000
                       1 60000 1000 1000000000)
# settle: lease id, reserved at (far ahead: counts as now, so now's bucket), reserved tokens,
# actual tokens (one given back, never emptying the bucket), refund the request; per window
# quantity, window_ms, bucket_ms.
readonly SETTLE_ARGS=(lease__rand_int__ 99999999999999 1000000 999999 0 t 86400000 3600000
                      r 60000 1000)

# Runs `reserves` reserves then `settles` settles in a fresh server under callgrind; prints
# "instructions inside_evalsha inside_calls aof_bytes" and leaves the command stats in
# ${work}/SIDE-TAG.stats. It runs in a subshell (process substitution): on any failure it
# prints nothing, and the caller's `read` stops the script.
run() { # SIDE TAG RESERVES SETTLES
    local side="$1" tag="$2" reserves="$3" settles="$4" port dir
    port="$(free_port)"
    dir="${work}/${side}-${tag}"
    mkdir -p "${dir}"
    valgrind --tool=callgrind --callgrind-out-file="${dir}/callgrind.out" \
        redis-server --port "${port}" --bind 127.0.0.1 --save '' --appendonly yes \
        --appendfsync no --dir "${dir}" > "${dir}/server.log" 2>&1 &
    local server=$!
    # Whatever way this subshell ends, the server goes with it.
    # shellcheck disable=SC2064 # the pid now: `server` is local, gone when the trap runs.
    trap "kill ${server} 2>/dev/null || true" EXIT
    fail() {
        echo "redis-script-cost: $1" >&2
        cat "${dir}/server.log" >&2
        kill "${server}" 2>/dev/null || true
        exit 1
    }
    local up=""
    for _ in $(seq 100); do
        redis-cli -p "${port}" PING >/dev/null 2>&1 && { up=1; break; }
        sleep 0.2
    done
    [[ -n "${up}" ]] || fail "redis-server under valgrind did not answer on port ${port}"
    local reserve settle
    reserve="$(redis-cli -p "${port}" SCRIPT LOAD "$(script "${side}" reserve)" 2>&1 || true)"
    settle="$(redis-cli -p "${port}" SCRIPT LOAD "$(script "${side}" settle)" 2>&1 || true)"
    [[ "${reserve}" =~ ^[0-9a-f]{40}$ && "${settle}" =~ ^[0-9a-f]{40}$ ]] ||
        fail "SCRIPT LOAD answered '${reserve}' and '${settle}'"
    local before after
    before="$(du -sb "${dir}/appendonlydir" | cut -f1)"
    redis-benchmark -p "${port}" -n "${reserves}" -c 1 -r 100000000 -q \
        EVALSHA "${reserve}" "${KEYS[@]}" "${RESERVE_ARGS[@]}" > /dev/null
    redis-benchmark -p "${port}" -n "${settles}" -c 1 -r 100000000 -q \
        EVALSHA "${settle}" "${KEYS[@]}" "${SETTLE_ARGS[@]}" > /dev/null
    after="$(du -sb "${dir}/appendonlydir" | cut -f1)"
    redis-cli -p "${port}" INFO commandstats > "${work}/${side}-${tag}.stats"
    # A script that failed would still be counted: none may have.
    local errors
    errors="$(redis-cli -p "${port}" INFO errorstats | grep '^errorstat_' || true)"
    [[ -z "${errors}" ]] || fail "the scripts failed: ${errors}"
    redis-cli -p "${port}" SHUTDOWN NOSAVE > /dev/null 2>&1 || true
    wait "${server}" || true
    # The whole server's instructions, and those inside EVALSHA (the scripts themselves: not
    # reading commands off the socket, passing the scripts' writes on to the AOF and replicas,
    # writing the AOF, or the server's timers, which run with wall time).
    # And of those, the ones inside the commands the scripts call (scriptCall: the checks, the
    # lookup and the command itself; not converting its arguments and reply between Lua and
    # Redis, which is counted with the Lua around the calls).
    local total inside calls
    total="$(awk '/^totals:/ {print $2}' "${dir}/callgrind.out")"
    callgrind_annotate --inclusive=yes --threshold=100 "${dir}/callgrind.out" > "${dir}/inclusive.txt"
    inclusive() {
        awk -v name=":$1 " 'index($0, name) && !seen {gsub(",", "", $1); print $1; seen = 1}' \
            "${dir}/inclusive.txt"
    }
    inside="$(inclusive evalShaCommand)"
    calls="$(inclusive scriptCall)"
    [[ -n "${inside}" ]] || fail "no evalShaCommand in the profile (a redis-server without symbols?)"
    [[ -n "${calls}" || "${side}" == floor ]] || fail "no scriptCall in the profile"
    echo "${total} ${inside} ${calls:-0} $((after - before))"
}

# Calls per script run of each command but the scripts themselves, from two runs' stats.
commands_per_call() { # SHORT LONG CALLS
    python3 - "$1" "$2" "$3" <<'EOF'
import re, sys
def calls(path):
    out = {}
    for line in open(path):
        m = re.match(r"cmdstat_([^:]+):calls=(\d+)", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out
short, long, n = calls(sys.argv[1]), calls(sys.argv[2]), int(sys.argv[3])
skip = {"evalsha", "script|load", "info", "ping", "config|get", "config|resetstat"}
rows = [f"{name} {(long[name] - short.get(name, 0)) / n:g}" for name in sorted(long)
        if name not in skip and long[name] != short.get(name, 0)]
print(", ".join(rows))
EOF
}

readonly N=1000
for side in revision tree floor; do
    label="${rev}"
    [[ "${side}" == tree ]] && label="working tree"
    [[ "${side}" == floor ]] && label="floor (reserve: \`return 1\`; settle: the working tree's common.lua, then \`return 1\`)"
    read -r base_i base_e base_c base_aof < <(run "${side}" base 200 200)
    read -r more_r_i more_r_e more_r_c more_r_aof < <(run "${side}" more-reserves $((200 + N)) 200)
    read -r more_s_i more_s_e more_s_c more_s_aof < <(run "${side}" more-settles 200 $((200 + N)))
    echo "== ${label}"
    echo "  reserve: $(((more_r_i - base_i) / N)) instructions, $(((more_r_e - base_e) / N)) inside EVALSHA, $(((more_r_c - base_c) / N)) in its calls, $(((more_r_aof - base_aof) / N)) AOF bytes; commands: $(commands_per_call "${work}/${side}-base.stats" "${work}/${side}-more-reserves.stats" "${N}")"
    echo "  settle:  $(((more_s_i - base_i) / N)) instructions, $(((more_s_e - base_e) / N)) inside EVALSHA, $(((more_s_c - base_c) / N)) in its calls, $(((more_s_aof - base_aof) / N)) AOF bytes; commands: $(commands_per_call "${work}/${side}-base.stats" "${work}/${side}-more-settles.stats" "${N}")"
done
