"""Compares Python tiktoken with tollgate's token counter and prints the benchmark tables.

tollgate's token counter (`tollgate::tokens`, on bpe-openai) is only worth having if it is
exact and clearly faster than the reference everyone knows, OpenAI's tiktoken. This script
alternates rounds: run the Rust example `bench_tokens --json` (tollgate::tokens, bpe-openai's own
`Tokenizer::count`, tiktoken-rs), then
time tiktoken's `encode_ordinary`, single-threaded, on the byte-identical corpus the example
wrote and on the same adversarial bodies. Times are on the clock the example reports: the
thread's on-CPU time where Linux has it (here `time.thread_time`, the same scheduler
accounting), else wall time. On a shared machine on-CPU time leaves out the time other processes
hold the core, and alternating rounds lets both sides meet the same background load otherwise
(caches, memory bandwidth), so the ratio means something. Every figure is the best over all
rounds and runs. Every count must equal the Rust one.

`scripts/bench-tokens.sh` is the way to run it: it builds the example, installs tiktoken, and
points it at offline copies of its BPE files.

Usage: bench_tokens.py --bench-binary PATH --work-dir DIR [--rounds N]
Exits 1 if any count differs between implementations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import tiktoken

ENCODINGS = ("cl100k_base", "o200k_base")
# Must match examples/bench_tokens.rs.
ADVERSARIAL_BYTES = 1 << 20
ADVERSARIAL_LIMIT = 16_000
# Runs per round on the Python side (the Rust side has its own, in the example).
THROUGHPUT_RUNS = 10
ADVERSARIAL_RUNS = 2
# The headline targets.
TARGET_RATIO = 2.0
TARGET_ADVERSARIAL_MS = 30.0
# The adversarial bodies the latency target applies to; the others are reported for information.
TARGETED_ADVERSARIAL = ("a*1Mi", "random-letters")
RUST_LABELS = {
    "bpe-openai": "tollgate::tokens (bpe-openai 0.3 encoder, own splitting loop)",
    "bpe-openai-tokenizer": "bpe-openai 0.3 `Tokenizer::count` as shipped",
    "tiktoken-rs": "tiktoken-rs 0.12",
}
RUST_ADVERSARIAL_FIELDS = (
    "tollgate_count_till_limit_ms",
    "tollgate_count_ms",
    "tiktoken_rs_ms",
)


def lcg_letters(count: int, seed: int) -> str:
    """The random-letters body: Knuth's MMIX LCG, exactly as in the Rust example."""
    state = seed
    mask = (1 << 64) - 1
    letters = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) & mask
        letters.append(chr(ord("a") + (state >> 33) % 26))
    return "".join(letters)


def adversarial_bodies() -> dict[str, str]:
    return {
        "a*1Mi": "a" * ADVERSARIAL_BYTES,
        "random-letters": lcg_letters(ADVERSARIAL_BYTES, 1),
        "-*1Mi": "-" * ADVERSARIAL_BYTES,
    }


# Set from the Rust report: "thread-cpu" -> time.thread_time, "wall" -> time.perf_counter.
CLOCKS = {"thread-cpu": time.thread_time, "wall": time.perf_counter}
clock = time.perf_counter


def best_time(runs: int, work) -> tuple[object, float]:
    """Returns work()'s result and the fastest time in seconds over `runs` calls, on `clock`."""
    result = None
    best = float("inf")
    for _ in range(runs):
        start = clock()
        result = work()
        best = min(best, clock() - start)
    return result, best


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


class Results:
    """Best figures over all rounds, plus every count disagreement seen."""

    def __init__(self) -> None:
        self.corpus: dict | None = None
        self.clock = "wall"
        self.rust_seconds: dict[tuple[str, str], float] = {}
        self.python_seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.adversarial: dict[tuple[str, str], dict] = {}
        self.mismatches: list[str] = []

    def add_rust(self, report: dict) -> None:
        global clock
        clock = CLOCKS[report["clock"]]
        self.clock = report["clock"]
        if self.corpus is None:
            self.corpus = report["corpus"]
        elif self.corpus != report["corpus"]:
            self.mismatches.append("the Rust corpus changed between rounds")
        for row in report["throughput"]:
            key = (row["implementation"], row["encoding"])
            self.rust_seconds[key] = min(self.rust_seconds.get(key, float("inf")), row["seconds"])
            self.check_count(f"{row['encoding']} on the corpus", row["implementation"],
                             row["tokens"], self.tokens.setdefault(row["encoding"], row["tokens"]))
        for row in report["adversarial"]:
            best = self.adversarial.setdefault((row["input"], row["encoding"]), dict(row))
            for field in RUST_ADVERSARIAL_FIELDS:
                best[field] = min(best[field], row[field])
            self.check_count(f"{row['encoding']} on {row['input']}", "bpe-openai",
                             row["tokens"], best["tokens"])

    def check_count(self, what: str, who: str, counted: int, expected: int) -> None:
        if counted != expected:
            self.mismatches.append(f"{what}: {who} counted {counted}, expected {expected}")


def measure_python(results: Results, corpus: str, bodies: dict[str, str]) -> None:
    for name in ENCODINGS:
        encoding = tiktoken.get_encoding(name)
        encoding.encode_ordinary("warm up")
        tokens, seconds = best_time(THROUGHPUT_RUNS, lambda: len(encoding.encode_ordinary(corpus)))
        results.python_seconds[name] = min(results.python_seconds.get(name, float("inf")), seconds)
        results.check_count(f"{name} on the corpus", "tiktoken-py", tokens, results.tokens[name])
    for (body_name, name), row in results.adversarial.items():
        encoding = tiktoken.get_encoding(name)
        body = bodies[body_name]
        tokens, seconds = best_time(ADVERSARIAL_RUNS, lambda: len(encoding.encode_ordinary(body)))
        row["tiktoken_py_ms"] = min(row.get("tiktoken_py_ms", float("inf")), seconds * 1e3)
        results.check_count(f"{name} on {body_name}", "tiktoken-py", tokens, row["tokens"])


def print_tables(results: Results, rounds: int, loads: list[str]) -> None:
    """Prints the Markdown tables and the verdicts on the targets."""
    corpus = results.corpus
    corpus_bytes = corpus["bytes"]
    print(f"Load average (1/5/15 min) before each round: {'; '.join(loads)}.")
    print()
    print(f"Corpus: {corpus_bytes} bytes, {corpus['chars']} chars (bytes by kind: "
          f"{json.dumps(corpus['bytes_by_kind'], sort_keys=True)}). One thread; MB = 10^6 bytes; "
          f"clock: {results.clock}; best of {rounds} rounds, each the best of several runs, "
          f"Rust and Python alternating.")
    print()
    print("| implementation | encoding | tokens | MB/s | tokens/s | vs tiktoken-py |")
    print("|---|---|---:|---:|---:|---:|")
    ratios = {}
    for name in ENCODINGS:
        tokens = results.tokens[name]
        python_rate = corpus_bytes / 1e6 / results.python_seconds[name]
        for implementation, label in RUST_LABELS.items():
            seconds = results.rust_seconds[(implementation, name)]
            rate = corpus_bytes / 1e6 / seconds
            ratio = rate / python_rate
            if implementation == "bpe-openai":
                ratios[name] = ratio
            print(f"| {label} | {name} | {tokens} | {rate:.1f} | {tokens / seconds:,.0f} | "
                  f"{ratio:.2f}x |")
        print(f"| tiktoken-py {tiktoken.__version__} | {name} | {tokens} | {python_rate:.1f} | "
              f"{tokens / results.python_seconds[name]:,.0f} | 1.00x |")

    print()
    print(f"Adversarial 1 MiB bodies without whitespace, milliseconds; `count_till_limit` is "
          f"against a {ADVERSARIAL_LIMIT}-token limit (None for all of these bodies).")
    print()
    print("| body | encoding | tokens | tollgate count_till_limit | tollgate count "
          "| tiktoken-rs | tiktoken-py |")
    print("|---|---|---:|---:|---:|---:|---:|")
    worst_ms = {"count_till_limit": 0.0, "count": 0.0}
    for (body_name, name), row in results.adversarial.items():
        limited_ms = row["tollgate_count_till_limit_ms"]
        count_ms = row["tollgate_count_ms"]
        if body_name in TARGETED_ADVERSARIAL:
            worst_ms["count_till_limit"] = max(worst_ms["count_till_limit"], limited_ms)
            worst_ms["count"] = max(worst_ms["count"], count_ms)
        print(f"| `{body_name}` | {name} | {row['tokens']} | {limited_ms:.1f} | {count_ms:.1f} | "
              f"{row['tiktoken_rs_ms']:.1f} | {row['tiktoken_py_ms']:.1f} |")

    print()
    ratio_met = all(ratio >= TARGET_RATIO for ratio in ratios.values())
    ratio_text = ", ".join(f"{name} {ratio:.3f}x" for name, ratio in ratios.items())
    print(f"Headline: tollgate::tokens vs tiktoken-py: {ratio_text} "
          f"(target >= {TARGET_RATIO:.0f}x: {'met' if ratio_met else 'NOT met'}).")
    bodies_text = " and ".join(f"`{body}`" for body in TARGETED_ADVERSARIAL)
    for measurement, worst in worst_ms.items():
        verdict = "met" if worst < TARGET_ADVERSARIAL_MS else "NOT met"
        print(f"Adversarial {bodies_text}, tollgate {measurement}: worst {worst:.1f} ms "
              f"(target < {TARGET_ADVERSARIAL_MS:.0f} ms: {verdict}).")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-binary", required=True, help="built examples/bench_tokens")
    parser.add_argument("--work-dir", required=True, help="where the corpus is written")
    parser.add_argument("--rounds", type=int, default=3, help="Rust/Python rounds (default 3)")
    args = parser.parse_args()

    corpus_path = os.path.join(args.work_dir, "corpus.txt")
    results = Results()
    bodies = adversarial_bodies()
    corpus = None
    loads = []
    for round_index in range(args.rounds):
        loads.append(load_average())
        print(f"bench-tokens: round {round_index + 1}/{args.rounds}: Rust", file=sys.stderr)
        rust = subprocess.run(
            [args.bench_binary, "--json", "--write-corpus", corpus_path],
            capture_output=True, text=True,
        )
        if rust.returncode != 0:
            # The example checks bpe-openai against tiktoken-rs itself and says what differed.
            print(rust.stderr, end="", file=sys.stderr)
            return 1
        results.add_rust(json.loads(rust.stdout))
        if corpus is None:
            with open(corpus_path, "rb") as f:
                corpus = f.read().decode("utf-8")
            if len(corpus.encode("utf-8")) != results.corpus["bytes"]:
                results.mismatches.append("the corpus file and the Rust report differ in size")
        print(f"bench-tokens: round {round_index + 1}/{args.rounds}: Python", file=sys.stderr)
        measure_python(results, corpus, bodies)

    print_tables(results, args.rounds, loads)
    if results.mismatches:
        print("\nCOUNT MISMATCH:", *results.mismatches, sep="\n  ", file=sys.stderr)
        return 1
    print("All counts equal across tollgate, bpe-openai, tiktoken-rs and tiktoken-py.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
