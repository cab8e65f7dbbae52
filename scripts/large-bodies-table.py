#!/usr/bin/env python3
"""The table of docs/benchmarks.md's "Costly text off the async workers" from bench_large_bodies
--json files: one row per text, body size, tollgate's worker threads, tollgate binary and
counting configuration, each column the range of that row's rounds over every file given
(admitted within the answer time, admitted later, 503 counting_backlog, the burst's wall time,
tollgate's CPU, and the small requests answered meanwhile: how many, their median and their
longest wait). `--one-row BIN` merges a binary's two configurations into one row ("both"),
for a build that counts these bodies the same way in either.

Usage: python3 scripts/large-bodies-table.py [--one-row BIN ...] RUN.json [RUN.json ...]
"""
import collections
import json
import statistics
import sys


def number(x, decimals):
    """As the docs print it: thousands separated; below 100, `decimals` places."""
    return f"{x:,.0f}" if x >= 100 or decimals == 0 else f"{x:.{decimals}f}"


def span(values, decimals=0):
    lo, hi = number(min(values), decimals), number(max(values), decimals)
    return lo if lo == hi else f"{lo}–{hi}"


args = sys.argv[1:]
one_row = set()
while args[:1] == ["--one-row"]:
    one_row.add(args[1])
    args = args[2:]
groups = collections.defaultdict(list)
for path in args:
    document = json.load(open(path))
    if document.get("bench") != "bench_large_bodies":
        print(f"{path}: not a bench_large_bodies run, passed over", file=sys.stderr)
        continue
    settings, server = document["args"], document["machine"]["server"]
    for run in document["runs"]:
        counting = "both" if server in one_row else run["counting"]
        key = (settings["text"], settings["body_bytes"], settings.get("server_threads"), server, counting)
        groups[key].append(run)
print("| text | bytes | workers | tollgate | counting | admitted in time | later | 503 "
      "| burst over, ms | tollgate CPU, s | small requests: n, p50 ms, max ms | rounds |")
print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|")
for (text, size, threads, server, counting), runs in groups.items():
    small = [sorted(run["small_ms"]) for run in runs]
    cells = [
        span([run["admitted_within"] for run in runs]),
        span([len(run["admitted_ms"]) - run["admitted_within"] for run in runs]),
        span([len(run["counting_backlog_ms"]) for run in runs]),
        span([run["wall_seconds"] * 1000 for run in runs]),
        span([run["tollgate_cpu_seconds"] for run in runs], 2),
        ", ".join([
            span([len(s) for s in small]),
            span([statistics.median(s) for s in small if s], 1),
            span([s[-1] for s in small if s]),
        ]),
        str(len(runs)),
    ]
    print(f"| {text} | {size} | {threads or 'default'} | {server} | {counting} | "
          + " | ".join(cells) + " |")
