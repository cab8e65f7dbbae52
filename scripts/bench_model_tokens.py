"""Compares Hugging Face `tokenizers` (Python) with tollgate's counter for the open models' own
tokenizers, on the same text in the same run, and prints the Markdown tables docs/benchmarks.md
quotes ("Open models' tokenizers").

Alternates rounds: run `bench_tokens --json --models-only --tokenizer NAME=DIR ...` (which
writes its ~1 MiB corpus byte for byte), then time `Tokenizer.encode(text,
add_special_tokens=False)` single-threaded on that corpus and on the same three 1 MiB
adversarial bodies. Times are on the clock the example reports (this thread's on-CPU time where
Linux has it: time.thread_time). Every figure is the best over all rounds and runs; every count
must equal the Rust one.

Usage: bench_model_tokens.py --bench-binary PATH --work-dir DIR --rounds N NAME=DIR ...
Exits 1 if any count differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tokenizers import Tokenizer

ADVERSARIAL_BYTES = 1 << 20  # as examples/bench_tokens.rs
THROUGHPUT_RUNS = 5
ADVERSARIAL_RUNS = 2
TARGET_ADVERSARIAL_MS = 50.0
CLOCKS = {"thread-cpu": time.thread_time, "wall": time.perf_counter}


def lcg_letters(count: int, seed: int) -> str:
    state, mask, letters = seed, (1 << 64) - 1, []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) & mask
        letters.append(chr(ord("a") + (state >> 33) % 26))
    return "".join(letters)


def best_time(clock, runs: int, work):
    result, best = None, float("inf")
    for _ in range(runs):
        start = clock()
        result = work()
        best = min(best, clock() - start)
    return result, best


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench-binary", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("models", nargs="+", help="NAME=DIR holding tokenizer.json")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    models = dict(m.split("=", 1) for m in args.models)
    corpus_path = os.path.join(args.work_dir, "corpus.txt")
    bodies = {
        "a*1Mi": "a" * ADVERSARIAL_BYTES,
        "random-letters": lcg_letters(ADVERSARIAL_BYTES, 1),
        "-*1Mi": "-" * ADVERSARIAL_BYTES,
        # as examples/bench_tokens.rs: a word Llama 3 makes only in context, repeated
        "talya*": "talya" * (ADVERSARIAL_BYTES // 5),
    }
    hf = {name: Tokenizer.from_file(os.path.join(d, "tokenizer.json")) for name, d in models.items()}
    rust_mbps, rust_adv, py_mbps, py_adv, tokens, mismatches = {}, {}, {}, {}, {}, []
    loads = []
    for _ in range(args.rounds):
        loads.append("%.2f" % os.getloadavg()[0])
        command = [args.bench_binary, "--json", "--models-only", "--write-corpus", corpus_path]
        for name, d in models.items():
            command += ["--tokenizer", f"{name}={d}"]
        report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        clock = CLOCKS[report["clock"]]
        for row in report["models"]:
            rust_mbps[row["model"]] = max(rust_mbps.get(row["model"], 0.0), row["mb_per_s"])
            tokens[row["model"]] = row["tokens"]
        for row in report["model_adversarial"]:
            key = (row["model"], row["input"])
            best = rust_adv.setdefault(key, dict(row))
            for field in ("count_till_limit_ms", "count_till_context_ms", "count_ms"):
                best[field] = min(best[field], row[field])
        with open(corpus_path, encoding="utf-8") as f:
            corpus = f.read()
        for name, tokenizer in hf.items():
            tokenizer.encode("warm up", add_special_tokens=False)
            n, seconds = best_time(clock, THROUGHPUT_RUNS,
                                   lambda: len(tokenizer.encode(corpus, add_special_tokens=False).ids))
            if n != tokens[name]:
                mismatches.append(f"{name} on the corpus: tokenizers {n}, tollgate {tokens[name]}")
            py_mbps[name] = max(py_mbps.get(name, 0.0), len(corpus.encode()) / 1e6 / seconds)
            for body_name, body in bodies.items():
                n, seconds = best_time(clock, ADVERSARIAL_RUNS,
                                       lambda: len(tokenizer.encode(body, add_special_tokens=False).ids))
                if n != rust_adv[(name, body_name)]["tokens"]:
                    mismatches.append(f"{name} on {body_name}: tokenizers {n}, tollgate "
                                      f"{rust_adv[(name, body_name)]['tokens']}")
                key = (name, body_name)
                py_adv[key] = min(py_adv.get(key, float("inf")), seconds * 1e3)
    print(f"Clock: {report['clock']}; rounds: {args.rounds}; load average (1 min) at each round: "
          f"{', '.join(loads)}; corpus {len(corpus.encode())} bytes.")
    print()
    print("| model | tokens | tollgate MB/s | HF tokenizers (Python) MB/s | ratio |")
    print("|---|---|---|---|---|")
    for name in models:
        print(f"| {name} | {tokens[name]} | {rust_mbps[name]:.1f} | {py_mbps[name]:.1f} | "
              f"{rust_mbps[name] / py_mbps[name]:.1f}x |")
    print()
    print("| 1 MiB body | model | tokens | tollgate count_till_limit(16k) ms "
          "| tollgate count_till_limit(128k) ms | tollgate count ms | HF tokenizers ms |")
    print("|---|---|---|---|---|---|---|")
    slow = []
    slow_in_context = []
    for (name, body_name), row in rust_adv.items():
        print(f"| `{body_name}` | {name} | {row['tokens']} | {row['count_till_limit_ms']:.1f} | "
              f"{row['count_till_context_ms']:.1f} | {row['count_ms']:.1f} | "
              f"{py_adv[(name, body_name)]:.1f} |")
        if row["count_till_limit_ms"] > TARGET_ADVERSARIAL_MS:
            slow.append(f"{name} on {body_name}")
        if row["count_till_context_ms"] > TARGET_ADVERSARIAL_MS:
            slow_in_context.append(f"{name} on {body_name}")
    print()
    below = [n for n in models if rust_mbps[n] < py_mbps[n]]
    print(f"Throughput >= HF tokenizers: {'met' if not below else 'NOT met for ' + ', '.join(below)}.")
    print(f"1 MiB bodies refused or counted in under {TARGET_ADVERSARIAL_MS:.0f} ms at the 16k "
          f"limit: {'met' if not slow else 'NOT met for ' + ', '.join(slow)}.")
    print(f"1 MiB bodies refused or counted in under {TARGET_ADVERSARIAL_MS:.0f} ms at a 128k "
          f"limit (the models' context): "
          f"{'met' if not slow_in_context else 'NOT met for ' + ', '.join(slow_in_context)}.")
    for m in mismatches:
        print(f"MISMATCH: {m}", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
