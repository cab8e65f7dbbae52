//! `bench_tokens`: single-thread token-counting throughput of `tollgate::tokens` (bpe-openai)
//! against tiktoken-rs, on a deterministic mixed corpus and on adversarial bodies.
//!
//! tollgate counts every request body on the request path, so its counter must be both fast on
//! ordinary traffic and bounded on bodies built to hurt it. This example measures both and
//! checks, as it goes, that both implementations agree on every count (a fast wrong counter is
//! worthless). `scripts/bench-tokens.sh` runs it next to Python tiktoken and prints the table in
//! `docs/benchmarks.md`.
//!
//! ```text
//! cargo run --release --example bench_tokens -- [--json] [--write-corpus PATH]
//!     [--tokenizer NAME=DIR ...] [--models-only]
//! ```
//!
//! * `--json`: print one JSON document (for `scripts/bench_tokens.py`) instead of the tables.
//! * `--write-corpus PATH`: also write the corpus, byte for byte, to PATH, so another
//!   implementation can count the identical text.
//! * `--tokenizer NAME=DIR`: also time a model's own tokenizer (`DIR/tokenizer.json`, as a
//!   `tokens.encodings[].tokenizer_file` rule loads it) on the corpus, each kind of text in it,
//!   and the adversarial bodies (`models`, with `mb_per_s_by_kind` and the
//!   `known_pre_tokenizer` whose ASCII cut it uses, and `model_adversarial` in the JSON). `scripts/bench-model-tokens.sh` runs it
//!   next to Hugging Face `tokenizers` (Python) on the same text.
//! * `--models-only`: skip the built-in encodings and tiktoken-rs.
//!
//! The corpus is about 1 MiB of English prose, Rust and Python code, JSON request bodies, CJK
//! text and emoji (ZWJ sequences, flags, skin tones), interleaved in chunks like mixed traffic,
//! generated from a fixed-seed LCG. The adversarial bodies are 1 MiB each with no whitespace:
//! `a` repeated, random lowercase letters (the same LCG, seed 1), and `-` repeated (the slowest
//! single-byte run we found for the backtracking encoder: both vocabularies hold `-` tokens 96
//! and 112 bytes long). They are timed with `count_till_limit(16_000)` and with a full `count`.
//!
//! MB/s is 10^6 bytes per second. Times are this thread's on-CPU time where Linux reports it
//! (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`), else wall time, so that other busy processes on
//! a shared machine do not count against the code measured; each figure is the best of several
//! runs.

use std::process::ExitCode;
use std::time::Duration;

use serde_json::{Value, json};
use tollgate::tokens::{Encoding, ModelVocabulary};
use tollgate_testkit::text::COMMON_WORDS;

/// Size the corpus grows to; chunks are whole, so it ends slightly above.
const CORPUS_TARGET_BYTES: usize = 1 << 20;
/// Size of each adversarial body.
const ADVERSARIAL_BYTES: usize = 1 << 20;
/// The limit the adversarial bodies are counted against: a generous prompt budget.
const ADVERSARIAL_LIMIT: usize = 16_000;
/// The highest ceiling a tier sensibly sets for the open models: their context (Llama 3.1,
/// Qwen 2.5 and Mistral Nemo take 128k tokens).
const CONTEXT_LIMIT: usize = 131_072;
/// Runs per throughput figure; the fastest is reported.
const THROUGHPUT_RUNS: usize = 10;
/// Runs per adversarial figure (tiktoken-rs takes a second or more on each of them).
const ADVERSARIAL_RUNS: usize = 3;

const ENCODINGS: [(Encoding, &str); 2] = [
    (Encoding::Cl100kBase, "cl100k_base"),
    (Encoding::O200kBase, "o200k_base"),
];

struct Args {
    json: bool,
    write_corpus: Option<String>,
    /// (name, directory holding tokenizer.json)
    tokenizers: Vec<(String, String)>,
    models_only: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        json: false,
        write_corpus: None,
        tokenizers: Vec::new(),
        models_only: false,
    };
    let mut given = std::env::args().skip(1);
    while let Some(arg) = given.next() {
        match arg.as_str() {
            "--json" => args.json = true,
            "--write-corpus" => {
                args.write_corpus = Some(given.next().ok_or("--write-corpus needs a PATH")?);
            }
            "--tokenizer" => {
                let value = given.next().ok_or("--tokenizer needs NAME=DIR")?;
                let (name, dir) = value
                    .split_once('=')
                    .ok_or_else(|| format!("--tokenizer {value:?}: expected NAME=DIR"))?;
                args.tokenizers.push((name.to_owned(), dir.to_owned()));
            }
            "--models-only" => args.models_only = true,
            "-h" | "--help" => {
                return Err("usage: bench_tokens [--json] [--write-corpus PATH] \
                     [--tokenizer NAME=DIR ...] [--models-only]\n\
                     Token-counting throughput: tollgate::tokens (bpe-openai) vs tiktoken-rs."
                    .to_owned());
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bench_tokens: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let corpus = build_corpus();
    if let Some(path) = &args.write_corpus {
        std::fs::write(path, corpus.text.as_bytes())
            .map_err(|error| format!("cannot write the corpus to {path}: {error}"))?;
    }
    let (models, model_adversarial) = measure_models(&args.tokenizers, &corpus)?;
    let encodings: &[(Encoding, &str)] = if args.models_only { &[] } else { &ENCODINGS };
    let references = [
        tiktoken_rs::cl100k_base().map_err(|error| format!("tiktoken-rs cl100k: {error}"))?,
        tiktoken_rs::o200k_base().map_err(|error| format!("tiktoken-rs o200k: {error}"))?,
    ];

    let mut throughput = Vec::new();
    // tollgate's counter (the `bpe-openai` rows) on each kind of text alone.
    let mut throughput_by_kind = Vec::new();
    for (&(encoding, name), reference) in encodings.iter().zip(&references) {
        encoding.warm_up();
        let (tokens, seconds) = best_time(THROUGHPUT_RUNS, || encoding.count(&corpus.text));
        // The crate's own `Tokenizer::count`, which tollgate::tokens replaces on the request
        // path (same vocabulary and encoder, own splitting loop): what that change gained.
        let crate_tokenizer = match encoding {
            Encoding::Cl100kBase => bpe_openai::cl100k_base(),
            Encoding::O200kBase => bpe_openai::o200k_base(),
            Encoding::Model(_) => unreachable!("ENCODINGS holds the built-in ones"),
        };
        let (crate_tokens, crate_seconds) = best_time(THROUGHPUT_RUNS, || {
            crate_tokenizer.count(corpus.text.as_str())
        });
        let (reference_tokens, reference_seconds) = best_time(THROUGHPUT_RUNS, || {
            reference.encode_ordinary(&corpus.text).len()
        });
        if tokens != reference_tokens || crate_tokens != reference_tokens {
            return Err(format!(
                "{name}: tollgate::tokens counted {tokens} tokens, bpe-openai's Tokenizer                  {crate_tokens}, tiktoken-rs {reference_tokens}"
            ));
        }
        for (kind, text) in &corpus.text_by_kind {
            let (tokens, seconds) = best_time(THROUGHPUT_RUNS, || encoding.count(text));
            // The request path's count of a text that came back: its first two counts keep it
            // (tokens::count_cache), then it is found, compared byte for byte, not counted.
            let scope = tollgate::tokens::CountScope::of("bench_tokens");
            for _ in 0..2 {
                encoding.count_till_limit_cached(scope, text, usize::MAX);
            }
            let (found, found_seconds) = best_time(THROUGHPUT_RUNS, || {
                encoding.count_till_limit_cached(scope, text, usize::MAX)
            });
            if found != Some(tokens) {
                return Err(format!(
                    "{name} {kind}: the count cache gave {found:?}, counting {tokens}"
                ));
            }
            throughput_by_kind.push(json!({
                "encoding": name,
                "kind": kind,
                "bytes": text.len(),
                "tokens": tokens,
                "seconds": seconds,
                "mb_per_s": text.len() as f64 / 1e6 / seconds,
                "found_in_count_cache_seconds": found_seconds,
                "found_in_count_cache_mb_per_s": text.len() as f64 / 1e6 / found_seconds,
            }));
        }
        for (implementation, seconds) in [
            ("bpe-openai", seconds),
            ("bpe-openai-tokenizer", crate_seconds),
            ("tiktoken-rs", reference_seconds),
        ] {
            throughput.push(json!({
                "implementation": implementation,
                "encoding": name,
                "bytes": corpus.text.len(),
                "tokens": tokens,
                "seconds": seconds,
                "mb_per_s": corpus.text.len() as f64 / 1e6 / seconds,
                "tokens_per_s": tokens as f64 / seconds,
            }));
        }
    }

    let mut adversarial = Vec::new();
    for (input, body) in adversarial_bodies() {
        for (&(encoding, name), reference) in encodings.iter().zip(&references) {
            let (limited, limited_seconds) = best_time(ADVERSARIAL_RUNS, || {
                encoding.count_till_limit(&body, ADVERSARIAL_LIMIT)
            });
            let (tokens, count_seconds) = best_time(ADVERSARIAL_RUNS, || encoding.count(&body));
            let (reference_tokens, reference_seconds) =
                best_time(ADVERSARIAL_RUNS, || reference.encode_ordinary(&body).len());
            if tokens != reference_tokens {
                return Err(format!(
                    "{name} on {input}: tollgate counted {tokens} tokens, tiktoken-rs \
                     {reference_tokens}"
                ));
            }
            let expected_limited = (tokens <= ADVERSARIAL_LIMIT).then_some(tokens);
            if limited != expected_limited {
                return Err(format!(
                    "{name} on {input}: count_till_limit gave {limited:?}, count {tokens}"
                ));
            }
            adversarial.push(json!({
                "input": input,
                "encoding": name,
                "bytes": body.len(),
                "tokens": tokens,
                "limit": ADVERSARIAL_LIMIT,
                "count_till_limit": limited,
                "tollgate_count_till_limit_ms": limited_seconds * 1e3,
                "tollgate_count_ms": count_seconds * 1e3,
                "tiktoken_rs_ms": reference_seconds * 1e3,
            }));
        }
    }

    let report = json!({
        "clock": clock(),
        "corpus": {
            "bytes": corpus.text.len(),
            "chars": corpus.text.chars().count(),
            "bytes_by_kind": corpus.bytes_by_kind,
        },
        "throughput": throughput,
        "throughput_by_kind": throughput_by_kind,
        "adversarial": adversarial,
        "models": models,
        "model_adversarial": model_adversarial,
    });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|error| error.to_string())?
        );
    } else {
        print_tables(&report);
    }
    Ok(())
}

/// Times each model's own tokenizer on the corpus (throughput, also kind by kind) and on the
/// adversarial bodies (`count_till_limit` at the prompt budget, and a full count).
fn measure_models(
    tokenizers: &[(String, String)],
    corpus: &Corpus,
) -> Result<(Value, Value), String> {
    let mut throughput = Vec::new();
    let mut adversarial = Vec::new();
    // One more body for the models: a word of Llama 3 that merging makes only in context,
    // repeated, so that no pair of neighbouring bytes cuts it: its slow path's worst case.
    let mut bodies = adversarial_bodies().to_vec();
    bodies.push(("talya*", "talya".repeat(ADVERSARIAL_BYTES / 5)));
    for (name, dir) in tokenizers {
        let path = std::path::Path::new(dir).join("tokenizer.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
        let (vocabulary, load_seconds) = best_time(1, || {
            ModelVocabulary::from_json(&path.display().to_string(), &text, None)
        });
        let vocabulary: &'static ModelVocabulary = Box::leak(Box::new(
            vocabulary.map_err(|error| format!("{}: {error}", path.display()))?,
        ));
        let encoding = Encoding::Model(vocabulary);
        encoding.warm_up();
        let (tokens, seconds) = best_time(THROUGHPUT_RUNS, || encoding.count(&corpus.text));
        let mut by_kind = serde_json::Map::new();
        for (kind, text) in &corpus.text_by_kind {
            let (_, seconds) = best_time(THROUGHPUT_RUNS, || encoding.count(text));
            by_kind.insert((*kind).to_owned(), json!(text.len() as f64 / 1e6 / seconds));
        }
        throughput.push(json!({
            "model": name,
            "bytes": corpus.text.len(),
            "tokens": tokens,
            "seconds": seconds,
            "load_seconds": load_seconds,
            "context_only_entries": vocabulary.context_only_entries(),
            "known_pre_tokenizer": vocabulary.known_pre_tokenizer(),
            "mb_per_s": corpus.text.len() as f64 / 1e6 / seconds,
            "mb_per_s_by_kind": by_kind,
        }));
        for (input, body) in &bodies {
            let (limited, limited_seconds) = best_time(ADVERSARIAL_RUNS, || {
                encoding.count_till_limit(body, ADVERSARIAL_LIMIT)
            });
            let (in_context, context_seconds) = best_time(ADVERSARIAL_RUNS, || {
                encoding.count_till_limit(body, CONTEXT_LIMIT)
            });
            let (tokens, count_seconds) = best_time(ADVERSARIAL_RUNS, || encoding.count(body));
            if limited != (tokens <= ADVERSARIAL_LIMIT).then_some(tokens)
                || in_context != (tokens <= CONTEXT_LIMIT).then_some(tokens)
            {
                return Err(format!(
                    "{name} on {input}: count_till_limit gave {limited:?} and {in_context:?}, \
                     count {tokens}"
                ));
            }
            adversarial.push(json!({
                "model": name,
                "input": input,
                "bytes": body.len(),
                "tokens": tokens,
                "limit": ADVERSARIAL_LIMIT,
                "count_till_limit": limited,
                "count_till_limit_ms": limited_seconds * 1e3,
                "context_limit": CONTEXT_LIMIT,
                "count_till_context_ms": context_seconds * 1e3,
                "count_ms": count_seconds * 1e3,
            }));
        }
    }
    Ok((Value::from(throughput), Value::from(adversarial)))
}

fn print_tables(report: &Value) {
    println!(
        "corpus: {} bytes, {} chars; bytes by kind: {}; clock: {}",
        report["corpus"]["bytes"],
        report["corpus"]["chars"],
        report["corpus"]["bytes_by_kind"],
        report["clock"],
    );
    println!();
    println!(
        "{:<12} {:<12} {:>9} {:>12} {:>9}",
        "impl", "encoding", "tokens", "tokens/s", "MB/s"
    );
    for row in report["throughput"].as_array().into_iter().flatten() {
        println!(
            "{:<12} {:<12} {:>9} {:>12.0} {:>9.1}",
            row["implementation"].as_str().unwrap_or_default(),
            row["encoding"].as_str().unwrap_or_default(),
            row["tokens"],
            row["tokens_per_s"].as_f64().unwrap_or_default(),
            row["mb_per_s"].as_f64().unwrap_or_default(),
        );
    }
    println!();
    println!(
        "{:<12} {:<12} {:>9} {:>9} {:>9} {:>12} {:>16}",
        "tollgate on", "encoding", "kind", "tokens", "MB/s", "counted us", "found again us"
    );
    for row in report["throughput_by_kind"]
        .as_array()
        .into_iter()
        .flatten()
    {
        println!(
            "{:<12} {:<12} {:>9} {:>9} {:>9.1} {:>12.1} {:>16.2}",
            "one kind",
            row["encoding"].as_str().unwrap_or_default(),
            row["kind"].as_str().unwrap_or_default(),
            row["tokens"].as_u64().unwrap_or_default(),
            row["mb_per_s"].as_f64().unwrap_or_default(),
            row["seconds"].as_f64().unwrap_or_default() * 1e6,
            row["found_in_count_cache_seconds"]
                .as_f64()
                .unwrap_or_default()
                * 1e6,
        );
    }
    println!();
    println!(
        "{:<14} {:<12} {:>8} {:>18} {:>12} {:>15}",
        "1 MiB body", "encoding", "tokens", "till_limit(16k) ms", "count ms", "tiktoken-rs ms"
    );
    for row in report["adversarial"].as_array().into_iter().flatten() {
        println!(
            "{:<14} {:<12} {:>8} {:>18.1} {:>12.1} {:>15.1}",
            row["input"].as_str().unwrap_or_default(),
            row["encoding"].as_str().unwrap_or_default(),
            row["tokens"],
            row["tollgate_count_till_limit_ms"]
                .as_f64()
                .unwrap_or_default(),
            row["tollgate_count_ms"].as_f64().unwrap_or_default(),
            row["tiktoken_rs_ms"].as_f64().unwrap_or_default(),
        );
    }
    for row in report["models"].as_array().into_iter().flatten() {
        println!(
            "model {:<14} {:>9} tokens {:>9.1} MB/s (loaded in {:.2} s; {} entries made only in context)",
            row["model"].as_str().unwrap_or_default(),
            row["tokens"],
            row["mb_per_s"].as_f64().unwrap_or_default(),
            row["load_seconds"].as_f64().unwrap_or_default(),
            row["context_only_entries"],
        );
        let kinds: Vec<String> = row["mb_per_s_by_kind"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(kind, mb_per_s)| format!("{kind} {:.1}", mb_per_s.as_f64().unwrap_or_default()))
            .collect();
        println!(
            "model {:<14} MB/s by kind: {}; ASCII cut without the regex as: {}",
            row["model"].as_str().unwrap_or_default(),
            kinds.join(", "),
            row["known_pre_tokenizer"]
                .as_str()
                .unwrap_or("(none: the regex cuts it)"),
        );
    }
    for row in report["model_adversarial"].as_array().into_iter().flatten() {
        println!(
            "model {:<14} {:<14} {:>8} tokens, till_limit(16k) {:>7.1} ms, till_limit(128k) \
             {:>7.1} ms, count {:>7.1} ms",
            row["model"].as_str().unwrap_or_default(),
            row["input"].as_str().unwrap_or_default(),
            row["tokens"],
            row["count_till_limit_ms"].as_f64().unwrap_or_default(),
            row["count_till_context_ms"].as_f64().unwrap_or_default(),
            row["count_ms"].as_f64().unwrap_or_default(),
        );
    }
}

/// Runs `work` `runs` times and returns its (last) result with the fastest time in seconds, on
/// [`clock`]'s clock.
fn best_time<T>(runs: usize, mut work: impl FnMut() -> T) -> (T, f64) {
    let mut result = None;
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let (value, elapsed) = time(&mut work);
        result = Some(value);
        best = best.min(elapsed.as_secs_f64());
    }
    let result = result.expect("runs is a positive constant, so work ran at least once");
    (result, best)
}

/// The clock figures are measured on: `thread-cpu` where the kernel reports this thread's
/// on-CPU time, else `wall`. On a shared machine wall time also counts the time other processes
/// hold the core; on-CPU time is what the counting itself costs, which is what an idle core's
/// wall time would be. Python's `time.thread_time` reads the same scheduler accounting.
fn clock() -> &'static str {
    if thread_cpu_time().is_some() {
        "thread-cpu"
    } else {
        "wall"
    }
}

/// This thread's on-CPU time so far, from `clock_gettime(CLOCK_THREAD_CPUTIME_ID)` (what
/// Python's `time.thread_time` reads). Not `/proc/thread-self/schedstat`: on some kernels its
/// figure for a running thread moves only at scheduler ticks (seen here: steps of 4 ms), which
/// is as long as some of the runs measured; clock_gettime brings the count up to date first.
fn thread_cpu_time() -> Option<Duration> {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    let nanos =
        u64::try_from(now.tv_sec).ok()? * 1_000_000_000 + u64::try_from(now.tv_nsec).ok()?;
    Some(Duration::from_nanos(nanos))
}

// The project bans std's Instant so paused-time tokio tests control the clock; a benchmark
// measures real elapsed time outside any runtime, which is exactly what std's Instant is for.
#[allow(clippy::disallowed_types)]
fn time<T>(work: impl FnOnce() -> T) -> (T, Duration) {
    let cpu_start = thread_cpu_time();
    let wall_start = std::time::Instant::now();
    let value = std::hint::black_box(work());
    let wall = wall_start.elapsed();
    match (cpu_start, thread_cpu_time()) {
        (Some(start), Some(end)) => (value, end.saturating_sub(start)),
        _ => (value, wall),
    }
}

/// Knuth's MMIX LCG: deterministic input without a rand dependency. `scripts/bench_tokens.py`
/// reimplements it to rebuild the random-letters body.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        // The high bits of an LCG are the well-mixed ones.
        (self.0 >> 33) as u32
    }

    fn below(&mut self, bound: usize) -> usize {
        self.next() as usize % bound
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

fn adversarial_bodies() -> [(&'static str, String); 3] {
    let mut rng = Lcg(1);
    let random_letters = (0..ADVERSARIAL_BYTES)
        .map(|_| char::from(b'a' + rng.below(26) as u8))
        .collect();
    [
        ("a*1Mi", "a".repeat(ADVERSARIAL_BYTES)),
        ("random-letters", random_letters),
        ("-*1Mi", "-".repeat(ADVERSARIAL_BYTES)),
    ]
}

struct Corpus {
    text: String,
    bytes_by_kind: serde_json::Map<String, Value>,
    /// Each kind's chunks on their own, in corpus order: where counting's time goes by kind.
    text_by_kind: Vec<(&'static str, String)>,
}

/// Makes one chunk of corpus text of some kind.
type ChunkGenerator = fn(&mut Lcg) -> String;

/// Chunk generators and their weights: roughly the mix of a multi-tenant chat gateway.
const KINDS: [(&str, u32, ChunkGenerator); 5] = [
    ("prose", 40, prose),
    ("code", 25, code),
    ("json", 15, json_body),
    ("cjk", 12, cjk),
    ("emoji", 8, emoji),
];

fn build_corpus() -> Corpus {
    let mut rng = Lcg(0x0062_656e_6368);
    let total_weight: u32 = KINDS.iter().map(|(_, weight, _)| weight).sum();
    let mut text = String::with_capacity(CORPUS_TARGET_BYTES + 4096);
    let mut text_by_kind: Vec<(&'static str, String)> = KINDS
        .iter()
        .map(|(name, _, _)| (*name, String::new()))
        .collect();
    while text.len() < CORPUS_TARGET_BYTES {
        let mut roll = rng.below(total_weight as usize) as u32;
        let kind = KINDS
            .iter()
            .position(|(_, weight, _)| {
                let hit = roll < *weight;
                roll = roll.saturating_sub(*weight);
                hit
            })
            .expect("roll is below the total weight, so some kind matches");
        let chunk = (KINDS[kind].2)(&mut rng);
        text.push_str(&chunk);
        text.push_str("\n\n");
        text_by_kind[kind].1.push_str(&chunk);
        text_by_kind[kind].1.push_str("\n\n");
    }
    Corpus {
        text,
        bytes_by_kind: text_by_kind
            .iter()
            .map(|(name, text)| ((*name).to_owned(), json!(text.len())))
            .collect(),
        text_by_kind,
    }
}

fn prose(rng: &mut Lcg) -> String {
    let mut paragraph = String::new();
    for _ in 0..3 + rng.below(5) {
        let words = 6 + rng.below(20);
        for index in 0..words {
            let word = rng.pick(COMMON_WORDS);
            if index == 0 {
                let mut chars = word.chars();
                if let Some(first) = chars.next() {
                    paragraph.extend(first.to_uppercase());
                    paragraph.push_str(chars.as_str());
                }
            } else {
                paragraph.push(' ');
                paragraph.push_str(word);
            }
            if index + 1 < words && rng.below(9) == 0 {
                paragraph.push_str(rng.pick(&[",", ";", " —", ":"]));
            }
            if rng.below(40) == 0 {
                paragraph.push_str(&format!(" {}", rng.below(100_000)));
            }
        }
        paragraph.push_str(rng.pick(&[". ", "! ", "? ", ". ", ". "]));
    }
    paragraph
}

const IDENTIFIERS: &[&str] = &[
    "request",
    "tenant_id",
    "queue",
    "budget",
    "tokens",
    "deadline",
    "limit",
    "count",
    "state",
    "config",
    "encoder",
    "buffer",
    "index",
    "result",
    "value",
    "policy",
    "shard",
    "weight",
];

fn code(rng: &mut Lcg) -> String {
    let a = rng.pick(IDENTIFIERS);
    let b = rng.pick(IDENTIFIERS);
    let c = rng.pick(IDENTIFIERS);
    let n = rng.below(1_000);
    if rng.below(2) == 0 {
        format!(
            "/// Returns the {a} for the given {b}, or `None` when it is over {n}.\n\
             pub fn {a}_for_{b}(&self, {b}: &{B}) -> Option<usize> {{\n    \
                 let mut {c} = self.{c}.lock().expect(\"not poisoned\");\n    \
                 if {b}.len() > {n} {{\n        return None;\n    }}\n    \
                 for (i, item) in {b}.iter().enumerate() {{\n        \
                     *{c}.entry(item.key()).or_insert(0) += i * {n};\n    }}\n    \
                 Some({c}.len())\n}}\n",
            B = camel(b),
        )
    } else {
        format!(
            "def {a}_for_{b}(self, {b}: list[dict[str, int]], {c}: int = {n}) -> int | None:\n    \
                 \"\"\"Return the {a} for the given {b}.\"\"\"\n    \
                 total = 0\n    \
                 for i, item in enumerate({b}):\n        \
                     if item.get(\"{c}\", 0) > {c}:\n            \
                         raise ValueError(f\"{{i}}: {c} too large ({{item!r}})\")\n        \
                     total += item[\"{a}\"] * i\n    \
                 return total if total else None\n"
        )
    }
}

fn camel(snake: &str) -> String {
    snake
        .split('_')
        .flat_map(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase())
                .into_iter()
                .chain(chars)
        })
        .collect()
}

fn json_body(rng: &mut Lcg) -> String {
    let model = rng.pick(&["gpt-4o-mini", "gpt-4.1", "llama-3.1-70b", "o3-mini"]);
    let user = prose(rng);
    let messages = json!([
        {"role": "system", "content": "You are a concise assistant. Answer in English."},
        {"role": "user", "content": user},
    ]);
    json!({
        "model": model,
        "messages": messages,
        "max_tokens": 64 + rng.below(4_000),
        "temperature": rng.below(100) as f64 / 100.0,
        "stream": rng.below(2) == 0,
        "user": format!("tenant-{:05}", rng.below(100_000)),
        "metadata": {"trace_id": format!("{:016x}{:016x}", rng.next(), rng.next())},
    })
    .to_string()
}

const CJK_SENTENCES: &[&str] = &[
    "我们的服务器会在请求到达模型之前决定是否放行。",
    "公平意味着每个租户都能获得自己的份额，而不是先到先得。",
    "长文本的分词必须是线性时间，否则攻击者可以拖垮网关。",
    "吾輩は猫である。名前はまだ無い。",
    "どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所でニャーニャー泣いていた事だけは記憶している。",
    "推論サーバーの待ち行列は、優先度と締め切りに従って並べ替えられる。",
    "다람쥐 헌 쳇바퀴에 타고파.",
    "요청이 모델에 도달하기 전에 토큰 수를 정확하게 세어야 합니다.",
    "공정한 스케줄링은 모든 테넌트에게 자신의 몫을 보장합니다.",
];

fn cjk(rng: &mut Lcg) -> String {
    (0..2 + rng.below(8))
        .map(|_| rng.pick(CJK_SENTENCES))
        .collect()
}

const EMOJI: &[&str] = &[
    "😀",
    "😂",
    "🥲",
    "🤖",
    "🚀",
    "🔥",
    "✅",
    "❤️",
    "👍🏽",
    "👍🏿",
    "👨‍👩‍👧‍👦",
    "👩🏽‍💻",
    "🏳️‍🌈",
    "🧑🏿‍🤝‍🧑🏻",
    "🇺🇸",
    "🇯🇵",
    "🇩🇪",
    "🇧🇷",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "1️⃣",
    "#️⃣",
];

fn emoji(rng: &mut Lcg) -> String {
    let mut message = String::new();
    for _ in 0..3 + rng.below(10) {
        if rng.below(3) == 0 {
            message.push_str(rng.pick(COMMON_WORDS));
            message.push(' ');
        }
        for _ in 0..1 + rng.below(3) {
            message.push_str(rng.pick(EMOJI));
        }
        message.push(' ');
    }
    message
}
