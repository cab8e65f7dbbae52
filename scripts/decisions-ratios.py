#!/usr/bin/env python3
"""Per-round ratios of bench_decisions runs (docs/benchmarks.md): for each `--json` file, each
round's decisions per CPU-second of tollgate with Redis, with Redis's CPU added, and of tollgate
with its embedded store, each as a ratio to the echo of the same round; and Redis's CPU per
decision, split into the two scripts (twice `usec_per_evalsha`, from INFO commandstats) and the
rest (reading the calls, writing the replies, its event loop); each server's own CPU per
decision, and what tollgate with Redis spends beyond tollgate with its embedded store; Redis's
reads from clients per decision (about one a batch of calls; files written before bench_decisions
recorded them print nan); and the latency with Redis: a
reserve's mean and p99 and a settle's mean as tollgate times them, and the streams' p50 and p99
as the load sees them; and Redis's `EVALSHA` less two a decision and the fleet's calls as
tollgate counted them (bench_decisions subtracts the second from Redis's count).
Medians over the rounds first, each round's figure in brackets. For a run with
`--counting-echo`, also the counting echo's decisions per CPU-second as a ratio to the echo's,
its own CPU per decision, and the embedded-store tollgate's ratio to it; given several such
runs, it ends with those ratios' median over all their rounds (docs/benchmarks.md, "What
deciding costs at the least").

Given several files, it ends with the rounds whose `EVALSHA` were not two a decision, and how
many fleet calls the other rounds counted, by their length in seconds (docs/benchmarks.md,
"Rounds an `EVALSHA` short"). A JSON file that is not bench_decisions' is passed over, saying so.

Usage: python3 scripts/decisions-ratios.py RUN.json [RUN.json ...]
"""
import collections
import json
import statistics
import sys


def own_us(run):
    """A server's own CPU-microseconds per decision."""
    return 1e6 / run["decisions_per_server_cpu_s"]


def rounds(runs, path, counting_echo):
    servers = ["echo", "tollgate-redis", "tollgate-memory"]
    if counting_echo:
        servers.insert(1, "counting-echo")
    out = []
    for i in range(0, len(runs), len(servers)):
        group = runs[i : i + len(servers)]
        if [run["server"] for run in group] != servers:
            sys.exit(f"{path}: round {i // len(servers) + 1} is not {', '.join(servers)}")
        echo, redis, memory = group[0], group[-2], group[-1]
        base = echo["decisions_per_server_cpu_s"]
        redis_us = redis["redis_cpu_s"] / redis["decisions"] * 1e6
        scripts_us = 2 * redis["redis"]["usec_per_evalsha"]
        row = {}
        if counting_echo:
            counting = group[1]
            row["counting-echo"] = counting["decisions_per_server_cpu_s"] / base
            row["counting-echo own us"] = own_us(counting)
            row["memory vs counting-echo"] = (
                memory["decisions_per_server_cpu_s"] / counting["decisions_per_server_cpu_s"]
            )
        out.append(
            row
            | {
                "redis": redis["decisions_per_server_cpu_s"] / base,
                "redis+server": redis["decisions_per_server_and_redis_cpu_s"] / base,
                "memory": memory["decisions_per_server_cpu_s"] / base,
                "redis us/dec": redis_us,
                "scripts us": scripts_us,
                "rest us": redis_us - scripts_us,
                "echo own us": own_us(echo),
                "tollgate-redis own us": own_us(redis),
                "tollgate-memory own us": own_us(memory),
                "redis - memory us": own_us(redis) - own_us(memory),
                "redis reads/dec": redis["redis"].get("reads_per_decision", float("nan")),
                "reserve mean us": redis["tollgate"]["reserve_mean_us"],
                "reserve p99 us": redis["tollgate"]["reserve_p99_us"],
                "settle mean us": redis["tollgate"]["settle_mean_us"],
                "p50 ms": redis["latency_p50_ms"],
                "p99 ms": redis["latency_p99_ms"],
                "evalsha less 2/dec": redis["redis"]["evalsha_calls"] - 2 * redis["decisions"],
                "fleet calls": redis["redis"].get("fleet_calls", float("nan")),
                "seconds": round(redis["wall_s"]),
            }
        )
    return out


# Rounds whose EVALSHA were not two a decision: (file, round, off by, fleet calls).
off_rounds = []
# The rounds of the runs with a counting echo, over every file given.
counting_rounds = []
# Fleet calls of the other rounds, by the round's length in seconds.
fleet_of_clean = collections.defaultdict(collections.Counter)
for path in sys.argv[1:]:
    document = json.load(open(path))
    runs = document.get("runs")
    # Other benchmarks' files have runs too (bench_large_bodies'): bench_decisions' runs each
    # name their server.
    if not runs or "decisions_per_server_cpu_s" not in runs[0]:
        print(f"{path}: not a bench_decisions run, passed over", file=sys.stderr)
        continue
    counting_echo = any(run["server"] == "counting-echo" for run in runs)
    rows = rounds(runs, path, counting_echo)
    if counting_echo:
        counting_rounds.extend(rows)
    for number, row in enumerate(rows, 1):
        if row["evalsha less 2/dec"] != 0:
            off_rounds.append((path, number, row["evalsha less 2/dec"], row["fleet calls"]))
        elif row["fleet calls"] == row["fleet calls"]:  # not nan: files before it was kept
            fleet_of_clean[row["seconds"]][row["fleet calls"]] += 1
    cells = []
    counting_cells = [
        ("counting-echo", "{:.3f}"),
        ("counting-echo own us", "{:.1f}"),
        ("memory vs counting-echo", "{:.3f}"),
    ]
    for key, form in (counting_cells if counting_echo else []) + [
        ("redis", "{:.3f}"),
        ("redis+server", "{:.3f}"),
        ("memory", "{:.3f}"),
        ("redis us/dec", "{:.1f}"),
        ("scripts us", "{:.1f}"),
        ("rest us", "{:.1f}"),
        ("echo own us", "{:.1f}"),
        ("tollgate-redis own us", "{:.1f}"),
        ("tollgate-memory own us", "{:.1f}"),
        ("redis - memory us", "{:.1f}"),
        ("redis reads/dec", "{:.3f}"),
        ("reserve mean us", "{:.0f}"),
        ("reserve p99 us", "{:.0f}"),
        ("settle mean us", "{:.0f}"),
        ("p50 ms", "{:.2f}"),
        ("p99 ms", "{:.2f}"),
        ("evalsha less 2/dec", "{:.0f}"),
        ("fleet calls", "{:.0f}"),
    ]:
        values = [row[key] for row in rows]
        each = " ".join(form.format(v) for v in values)
        cells.append(f"{key} {form.format(statistics.median(values))} [{each}]")
    print(f"{path}\n  " + "\n  ".join(cells))

if len(sys.argv) > 2 and counting_rounds:
    print(f"all {len(counting_rounds)} rounds with a counting echo, median [lowest highest]:")
    for key in ["counting-echo", "memory", "memory vs counting-echo"]:
        values = [row[key] for row in counting_rounds]
        line = f"  {key} {statistics.median(values):.3f} [{min(values):.3f} {max(values):.3f}]"
        if key != "memory vs counting-echo":
            # Against the echo: issue 17's target for the embedded store.
            line += f", at or above 0.85x in {sum(v >= 0.85 for v in values)}"
        print(line)

if len(sys.argv) > 2:
    print("rounds whose EVALSHA were not two a decision (file, round, off by, fleet calls):")
    for path, number, off, fleet in off_rounds:
        print(f"  {path} round {number}: {off:+d}, {fleet:.0f} fleet calls")
    print("fleet calls in the other rounds, by the round's seconds (calls: rounds):")
    for seconds, counts in sorted(fleet_of_clean.items()):
        each = ", ".join(f"{calls:.0f}: {n}" for calls, n in sorted(counts.items()))
        print(f"  {seconds} s: {each}")
