//! `bench_large_bodies`: a burst of large request bodies, counted all at once or a few at a time.
//!
//! tollgate parses and counts a body over 16 KiB, or one whose text the encoder is slow on,
//! off its async workers, on a thread of its own. Taken all at once, a burst of such bodies
//! shares the cores among every one of them, so each takes as long as the whole burst, and
//! behind Envoy's `message_timeout` (1 s in the shipped configs) they can all be answered too
//! late together: Envoy has given up on every one. Taken in turn (`tokens.large_body_threads`,
//! one per worker thread by default), the first ones are answered in the time one count takes,
//! and those that could not start within `tokens.large_body_max_wait_ms` are refused at that
//! moment with a 503 `counting_backlog`, which a client can retry, where Envoy's timeout leaves
//! it nothing.
//!
//! Each round starts the release `tollgate` binary twice on free 127.0.0.1 ports, in turns
//! alternated from round to round:
//! - **all at once**: `tokens.large_body_threads: 512` (every body gets a thread as it comes,
//!   as tollgate did before the threads were bounded) and a wait of 30 s;
//! - **in turn**: the threads and the wait at tollgate's defaults, or `--threads` and
//!   `--max-wait-ms`.
//!
//! Against each, it plays Envoy over `--connections` HTTP/2 connections: `--streams` streams
//! send their request headers, and once every one has its answer, all their bodies go at once,
//! each `--body-bytes` long and each a different text (tollgate keeps the counts of texts that
//! come back): words picked at random from a fixed seed, common English ones (`--text prose`)
//! or made-up ones of random letters (`--text made-up-words`, which cost tollgate about ten
//! times as much to count), or one run of dashes (`--text dashes`, up to a microsecond a
//! byte). A body's answer time is from its send to its answer. A budget of as many slots as
//! streams, and limits above what the bodies hold, leave counting the only thing to wait for.
//! Meanwhile another user sends a small request every 10 ms, each on a stream of its own, whose
//! answer times show how much of the async workers the counting leaves to everyone else: a
//! small body is decided on them.
//!
//! ```text
//! cargo build --release --bin tollgate --example bench_large_bodies
//! target/release/examples/bench_large_bodies --streams 48 --body-bytes 2097152 --rounds 3
//! ```
//!
//! The program prints a Markdown table, and exits with status 3 (after printing it) if any
//! stream got an answer other than an admission or a 503 `counting_backlog`, or none within
//! `ANSWER_TIMEOUT`. Everything goes to 127.0.0.1 only; tollgate is killed when the program
//! ends, also on an error, Ctrl-C or SIGTERM. Results are in `docs/benchmarks.md` ("A burst of
//! large bodies").

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;

use tollgate_testkit::bench::{SerialNumbered, median, percentile};
use tollgate_testkit::host::{Machine, cpu_seconds};
use tollgate_testkit::text::{made_up_words, prose_words};
use tollgate_testkit::tollgate::TollgateCommand;
use tollgate_testkit::{bins, metrics};

#[path = "shared/extproc_client.rs"]
mod extproc_client;

use extproc_client::{
    Stream, chat_body, chat_body_message, chat_headers, client, connect, describe, reason,
};

/// Start-up budget for tollgate; generous because the machine may be compiling meanwhile.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// A stream with no answer this long after its body was sent is a failure.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// The wait "all at once" runs with: the most tollgate accepts (its default
/// `scheduler.envoy_max_message_timeout_ms`), longer than any burst here takes.
const AT_ONCE_MAX_WAIT_MS: u64 = 30_000;
/// The most threads tollgate accepts for large bodies: more than any burst here sends.
const AT_ONCE_THREADS: u32 = 512;
/// How often the other user sends a small request during the burst.
const SMALL_REQUEST_PERIOD: Duration = Duration::from_millis(10);
/// The text a body repeats (`words`).
const FILLER_BYTES: usize = 64 * 1024;

/// Sends a burst of large bodies to tollgate, counted all at once and in turn, and reports how
/// many were answered in time (see the file header of examples/bench_large_bodies.rs).
#[derive(Parser, Debug)]
#[command(name = "bench_large_bodies")]
struct Args {
    /// Bodies in each burst, one stream each.
    #[arg(long, default_value_t = 48)]
    streams: usize,
    /// Each body's size: over 16 KiB (or any size with `--text dashes`), so each is counted off
    /// the async workers; a smaller body of other text is decided on them.
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    body_bytes: usize,
    /// What the bodies' text is made of (see `words`).
    #[arg(long, value_enum, default_value_t = TextKind::Prose)]
    text: TextKind,
    /// Rounds; each runs both configurations, in turns alternated from round to round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// An answer later than this after its body was sent counts as too late: Envoy's
    /// `message_timeout` in the shipped configs.
    #[arg(long, default_value_t = 1000)]
    answer_within_ms: u64,
    /// "in turn" with `tokens.large_body_threads` set to this [default: tollgate's, one per
    /// worker thread].
    #[arg(long)]
    threads: Option<u32>,
    /// "in turn" with `tokens.large_body_max_wait_ms` set to this [default: tollgate's].
    #[arg(long)]
    max_wait_ms: Option<u64>,
    /// HTTP/2 connections the streams are spread over (round robin), as Envoy's cluster would.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// tollgate's async worker threads (`--worker-threads`) [default: tollgate's, which reads
    /// `TOKIO_WORKER_THREADS`, else one per CPU]. The manifests run one.
    #[arg(long, value_name = "N")]
    server_threads: Option<u16>,
    /// Tokio worker threads of this client (tollgate runs its own).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// The server to measure [default: target/release/tollgate next to this example].
    #[arg(long, value_name = "FILE")]
    tollgate_bin: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tollgate_testkit::bench::run_bench(
        "bench_large_bodies",
        args.client_threads,
        "some streams were not answered as expected; see above",
        bench(&args),
    )
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum TextKind {
    Prose,
    MadeUpWords,
    /// One run of `-` after the serial number: the text OpenAI's encoders are slowest on,
    /// about a microsecond a byte.
    Dashes,
}

/// How the large bodies' threads are set in one run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Counting {
    AtOnce,
    InTurn,
}

impl Counting {
    fn name(self) -> &'static str {
        match self {
            Counting::AtOnce => "all at once",
            Counting::InTurn => "in turn",
        }
    }

    /// The `tokens:` lines this configuration adds to tollgate's config.
    fn tokens_yaml(self, args: &Args) -> String {
        let (threads, wait) = match self {
            Counting::AtOnce => (Some(AT_ONCE_THREADS), Some(AT_ONCE_MAX_WAIT_MS)),
            Counting::InTurn => (args.threads, args.max_wait_ms),
        };
        let mut yaml = String::new();
        if let Some(threads) = threads {
            let _ = writeln!(yaml, "  large_body_threads: {threads}");
        }
        if let Some(wait) = wait {
            let _ = writeln!(yaml, "  large_body_max_wait_ms: {wait}");
        }
        yaml
    }
}

async fn bench(args: &Args) -> Result<bool> {
    ensure!(args.streams > 0, "--streams must be at least 1");
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(args.connections > 0, "--connections must be at least 1");
    let binary = bins::tollgate(args.tollgate_bin.as_deref())?;
    let stale = bins::stale_warning(
        &binary,
        &["src", "Cargo.lock"],
        "cargo build --release --bin tollgate",
    );
    if let Some(warning) = &stale {
        eprintln!("WARNING: {warning}");
    }
    let machine = Machine::describe(("server", binary.display().to_string()));
    let body = SerialNumbered::new(chat_body(
        Some(args.body_bytes),
        SerialNumbered::PLACEHOLDER,
        &words(args.text, FILLER_BYTES),
    )?)?;

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        let order = if round % 2 == 1 {
            [Counting::AtOnce, Counting::InTurn]
        } else {
            [Counting::InTurn, Counting::AtOnce]
        };
        for counting in order {
            eprintln!("bench_large_bodies: round {round}, {}", counting.name());
            let run = burst(args, &binary, counting, &body)
                .await
                .with_context(|| format!("round {round}, {}", counting.name()))?;
            runs.push((round, counting, run));
        }
    }

    let report = report(args, &machine, &runs);
    println!("{report}");
    if let Some(path) = &args.json {
        let value = json(args, &machine, stale.as_deref(), &runs);
        std::fs::write(path, serde_json::to_string_pretty(&value)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(runs.iter().all(|(_, _, run)| run.failures.is_empty()))
}

/// How one stream's body was answered.
enum Answer {
    Admitted { ms: f64 },
    Backlog { ms: f64 },
    Failed(String),
}

/// One burst against one tollgate.
struct Burst {
    /// Answer times of the admitted bodies and of those refused with `counting_backlog`,
    /// sorted, in ms after each body was sent.
    admitted_ms: Vec<f64>,
    backlog_ms: Vec<f64>,
    /// The small requests sent every 10 ms during the burst: each one's time from
    /// opening its stream to its body's answer, sorted.
    small_ms: Vec<f64>,
    failures: Vec<String>,
    /// tollgate's CPU from just before the bodies are sent until the small requests stop (the
    /// last of them is answered after the burst is over).
    cpu_seconds: f64,
    /// From the signal that sends every body to the last stream's end (the burst is over).
    wall_seconds: f64,
    /// `tollgate_large_bodies_waiting` once every body was answered (`None`: the server has no
    /// such gauge).
    waiting_after: Option<f64>,
}

impl Burst {
    fn admitted_within(&self, ms: f64) -> usize {
        self.admitted_ms.iter().filter(|&&t| t <= ms).count()
    }
}

async fn burst(
    args: &Args,
    binary: &Path,
    counting: Counting,
    body: &SerialNumbered,
) -> Result<Burst> {
    let dir = tempfile::tempdir().context("create a temporary directory")?;
    let config_path = dir.path().join("tollgate.yaml");
    // Every large body and the small request being sent.
    let slots = args.streams + 1;
    let yaml = format!(
        "scheduler:\n  initial_limit: {slots}\n\
         control:\n  enabled: false\n\
         tokens:\n  max_body_bytes: {max_body}\n{tokens}\
         default_tier: free\n\
         tiers:\n  free:\n    max_input_tokens: 10000000\n",
        max_body = args.body_bytes.max(8 * 1024 * 1024),
        tokens = counting.tokens_yaml(args),
    );
    std::fs::write(&config_path, yaml).context("write the tollgate config")?;
    let threads = args.server_threads.map(|n| n.to_string());
    let tollgate = TollgateCommand::new(binary, &config_path)
        .args(
            threads
                .iter()
                .flat_map(|n| ["--worker-threads", n.as_str()]),
        )
        .rust_log("warn")
        .ready_timeout(READY_TIMEOUT)
        .start(dir.path())
        .await?;
    let channels = connect(tollgate.grpc, args.connections).await?;

    // Every stream sends its headers first; the bodies wait for `go`.
    let (go_tx, go) = watch::channel(false);
    let (opened_tx, mut opened) = tokio::sync::mpsc::channel::<()>(args.streams);
    let mut tasks = JoinSet::new();
    for i in 0..args.streams {
        let client = client(&channels[i % channels.len()]);
        let body = body.next();
        let mut go = go.clone();
        let opened = opened_tx.clone();
        tasks.spawn(async move {
            let mut stream = match Stream::open(client).await {
                Ok(stream) => stream,
                Err(error) => return Answer::Failed(format!("{error:#}")),
            };
            let headers = async {
                stream.send(chat_headers(&format!("user-{i}"))).await?;
                stream.recv().await
            };
            match headers.await {
                Ok(answer) if matches!(answer.response, Some(Response::RequestHeaders(_))) => {}
                Ok(answer) => return Answer::Failed(format!("headers: {}", describe(&answer))),
                Err(error) => return Answer::Failed(format!("headers: {error:#}")),
            }
            // Dropped once sent: the channel closes when every stream is ready or has failed.
            let _ = opened.send(()).await;
            drop(opened);
            if go.wait_for(|&go| go).await.is_err() {
                return Answer::Failed("the burst was called off".to_owned());
            }
            let sent = Instant::now();
            let answer = async {
                stream.send(chat_body_message(&body)).await?;
                stream.recv().await
            };
            let answer = tokio::time::timeout(ANSWER_TIMEOUT, answer).await;
            let ms = sent.elapsed().as_secs_f64() * 1e3;
            match answer {
                Ok(Ok(answer)) => classify(&answer, ms),
                Ok(Err(error)) => Answer::Failed(format!("body: {error:#}")),
                Err(_) => Answer::Failed(format!("body: no answer within {ANSWER_TIMEOUT:?}")),
            }
            // Dropping the stream ends the request, as Envoy's reset does.
        });
    }
    drop(opened_tx);
    let mut ready = 0;
    while opened.recv().await.is_some() {
        ready += 1;
    }
    ensure!(
        ready == args.streams,
        "only {ready} of {} streams got their headers answered",
        args.streams
    );

    let pid = tollgate.proc().pid();
    let cpu_before = cpu_seconds(pid)?;
    let started = Instant::now();
    go_tx.send_replace(true);
    let (over_tx, over) = watch::channel(false);
    let small = tokio::spawn(small_requests(client(&channels[0]), over));
    let (mut admitted_ms, mut backlog_ms, mut failures) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(answer) = tasks.join_next().await {
        match answer.context("a stream's task panicked")? {
            Answer::Admitted { ms } => admitted_ms.push(ms),
            Answer::Backlog { ms } => backlog_ms.push(ms),
            Answer::Failed(why) => failures.push(why),
        }
    }
    let wall_seconds = started.elapsed().as_secs_f64();
    over_tx.send_replace(true);
    let mut small_ms = Vec::new();
    for answer in small.await.context("the small requests' task panicked")? {
        match answer {
            Answer::Admitted { ms } => small_ms.push(ms),
            Answer::Backlog { .. } => failures.push("a small request: counting_backlog".to_owned()),
            Answer::Failed(why) => failures.push(format!("a small request: {why}")),
        }
    }
    small_ms.sort_by(f64::total_cmp);
    let cpu_seconds = cpu_seconds(pid)? - cpu_before;
    admitted_ms.sort_by(f64::total_cmp);
    backlog_ms.sort_by(f64::total_cmp);
    let waiting_after = metrics::scrape(tollgate.admin)
        .await?
        .sum_if_any("tollgate_large_bodies_waiting", &[]);
    if let Some(waiting) = waiting_after
        && waiting != 0.0
    {
        failures.push(format!(
            "tollgate_large_bodies_waiting is {waiting} after every body was answered"
        ));
    }
    Ok(Burst {
        admitted_ms,
        backlog_ms,
        small_ms,
        failures,
        cpu_seconds,
        wall_seconds,
        waiting_after,
    })
}

/// `bytes` of words from a fixed seed: every run counts the same text (see `testkit::text`).
fn words(text_kind: TextKind, bytes: usize) -> String {
    match text_kind {
        TextKind::Prose => prose_words(bytes),
        TextKind::MadeUpWords => made_up_words(bytes),
        TextKind::Dashes => "-".repeat(bytes),
    }
}

/// Small requests of another user, one every `SMALL_REQUEST_PERIOD` until the burst is `over`:
/// what everyone else's requests wait while the large bodies are counted. A small body is
/// decided on the async workers, so this is how much of them the counting leaves.
async fn small_requests(
    client: ExternalProcessorClient<Channel>,
    mut over: watch::Receiver<bool>,
) -> Vec<Answer> {
    let small = match chat_body(None, "", "hi ") {
        Ok(body) => body,
        Err(error) => return vec![Answer::Failed(format!("{error:#}"))],
    };
    let mut answers = Vec::new();
    // Paced, not back to back: as many in either configuration, so they take the same CPU
    // from the counting; one that takes longer than the period delays the next.
    let mut every = tokio::time::interval(SMALL_REQUEST_PERIOD);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !*over.borrow_and_update() {
        every.tick().await;
        // Timed whole, from opening its stream: the headers wait for the workers too.
        let sent = Instant::now();
        let one = async {
            let mut stream = Stream::open(client.clone()).await?;
            stream.send(chat_headers("small")).await?;
            stream.recv().await?;
            stream.send(chat_body_message(&small)).await?;
            let answer = stream.recv().await?;
            anyhow::Ok(classify(&answer, sent.elapsed().as_secs_f64() * 1e3))
        };
        answers.push(
            one.await
                .unwrap_or_else(|error| Answer::Failed(format!("{error:#}"))),
        );
    }
    answers
}

fn classify(answer: &ProcessingResponse, ms: f64) -> Answer {
    match &answer.response {
        Some(Response::RequestBody(_)) => Answer::Admitted { ms },
        Some(Response::ImmediateResponse(reply))
            if reply.status.as_ref().map(|s| s.code) == Some(503)
                && reason(reply) == Some(b"counting_backlog".as_slice()) =>
        {
            Answer::Backlog { ms }
        }
        _ => Answer::Failed(format!("body: {}", describe(answer))),
    }
}

/// Milliseconds to `decimals` places, or a dash for none.
fn ms_to(value: f64, decimals: usize) -> String {
    if value.is_nan() {
        "–".to_owned()
    } else {
        format!("{value:.decimals$}")
    }
}

fn ms(value: f64) -> String {
    ms_to(value, 0)
}

fn report(args: &Args, machine: &Machine, runs: &[(usize, Counting, Burst)]) -> String {
    let within = args.answer_within_ms as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## bench_large_bodies: {} bodies of {} bytes ({:?}) at once, {} rounds, tollgate's \
         worker threads: {}\n\n{}\n",
        args.streams,
        args.body_bytes,
        args.text,
        args.rounds,
        args.server_threads
            .map_or_else(|| "its default".to_owned(), |n| n.to_string()),
        machine.headline()
    );
    let _ = writeln!(
        out,
        "| round | counting | admitted ≤ {0} ms | admitted later | 503 counting_backlog | \
         admitted p50 / max ms | 503s' max ms | burst over ms | tollgate CPU s | \
         small requests: n, p50 / p99 / max ms | failures |\n\
         |---|---|---:|---:|---:|---|---:|---:|---:|---|---:|",
        args.answer_within_ms
    );
    for (round, counting, run) in runs {
        let in_time = run.admitted_within(within);
        let _ = writeln!(
            out,
            "| {round} | {} | {in_time} | {} | {} | {} / {} | {} | {:.0} | {:.2} | {}, {} / {} / {} | {} |",
            counting.name(),
            run.admitted_ms.len() - in_time,
            run.backlog_ms.len(),
            ms(percentile(&run.admitted_ms, 0.5).unwrap_or(f64::NAN)),
            ms(run.admitted_ms.last().copied().unwrap_or(f64::NAN)),
            ms(run.backlog_ms.last().copied().unwrap_or(f64::NAN)),
            run.wall_seconds * 1e3,
            run.cpu_seconds,
            run.small_ms.len(),
            ms_to(percentile(&run.small_ms, 0.5).unwrap_or(f64::NAN), 1),
            ms_to(percentile(&run.small_ms, 0.99).unwrap_or(f64::NAN), 1),
            ms_to(run.small_ms.last().copied().unwrap_or(f64::NAN), 1),
            run.failures.len(),
        );
    }
    for counting in [Counting::AtOnce, Counting::InTurn] {
        let mut in_time: Vec<f64> = runs
            .iter()
            .filter(|(_, c, _)| *c == counting)
            .map(|(_, _, run)| run.admitted_within(within) as f64)
            .collect();
        let spread = format!(
            "{}–{}",
            in_time.iter().copied().fold(f64::INFINITY, f64::min),
            in_time.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        );
        let _ = writeln!(
            out,
            "\n{}: admitted within {} ms, median over rounds {} of {} (rounds {spread})",
            counting.name(),
            args.answer_within_ms,
            median(&mut in_time),
            args.streams
        );
    }
    for (round, counting, run) in runs {
        for failure in run.failures.iter().take(5) {
            let _ = writeln!(out, "FAILED round {round}, {}: {failure}", counting.name());
        }
    }
    out
}

fn json(
    args: &Args,
    machine: &Machine,
    stale: Option<&str>,
    runs: &[(usize, Counting, Burst)],
) -> Value {
    json!({
        "bench": "bench_large_bodies",
        "machine": machine.json(),
        "stale_binary": stale,
        "args": {
            "streams": args.streams,
            "body_bytes": args.body_bytes,
            "text": format!("{:?}", args.text),
            "rounds": args.rounds,
            "answer_within_ms": args.answer_within_ms,
            "threads": args.threads,
            "max_wait_ms": args.max_wait_ms,
            "connections": args.connections,
            "server_threads": args.server_threads,
        },
        "runs": runs.iter().map(|(round, counting, run)| json!({
            "round": round,
            "counting": counting.name(),
            "admitted_within": run.admitted_within(args.answer_within_ms as f64),
            "admitted_ms": run.admitted_ms,
            "counting_backlog_ms": run.backlog_ms,
            "small_ms": run.small_ms,
            "failures": run.failures,
            "tollgate_cpu_seconds": run.cpu_seconds,
            "wall_seconds": run.wall_seconds,
            "large_bodies_waiting_after": run.waiting_after,
        })).collect::<Vec<_>>(),
    })
}
