//! `bench_decisions`: what a budget decision costs when the budgets live in Redis, measured
//! directly over gRPC (no Envoy), against an ext_proc service that decides nothing.
//!
//! Two questions, answered in one run:
//!
//! 1. **Round trips per admitted request, as Redis sees them.** A `redis-server` of our own
//!    (free loopback port, no persistence) is under `MONITOR` from before tollgate starts. The
//!    release `tollgate` binary (`--redis-url`) then gets `--check-requests` admitted requests, one
//!    at a time. Between the phases of every request a marker `ECHO` goes to Redis on a
//!    connection of our own, so the MONITOR log splits into "request headers and body, up to the
//!    admit answer" and "response headers and body, up to the end of the stream (and of the
//!    settle)". Every command tollgate's own connection sent (not those its scripts ran, which
//!    MONITOR shows as client `lua`) is counted per segment: the requirement is exactly one
//!    `EVALSHA` in each, the same script in every admit segment, another in every settle one,
//!    and nothing in an idle second after the last request. Start-up commands (`SCRIPT LOAD`,
//!    connection setup) are reported separately, and so are the fleet's commands (the budget
//!    the replicas share: a join and, on the leader, a publish, an `EVALSHA` each every
//!    `fleet.sync_ms`, on a connection of their own, and the run-time settings read with one
//!    `HGETALL` as often), told apart by their `tollgate:fleet:` keys, which no request waits
//!    for. Leases are renewed every `store.lease_renew_ms`; the configuration sets it to an hour
//!    so no renewal falls into the run. MONITOR is closed before anything is timed: it slows
//!    Redis down.
//!
//! 2. **Decisions per CPU-second** for three servers (four with `--counting-echo`), one at a
//!    time, in interleaved rounds (echo, tollgate+redis, tollgate+memory, echo, ...), with
//!    medians over the rounds:
//!    - **echo**: `examples/echo_extproc.rs`, a tonic ext_proc server built like tollgate's (one
//!      task and a 2-slot channel per stream, the same server options, listener and allocator)
//!      that answers every message with a CONTINUE of its kind and reads nothing;
//!    - **tollgate+redis**: the release binary with `--redis-url` to our Redis;
//!    - **tollgate+memory**: the same binary and configuration with the embedded store;
//!    - with `--counting-echo`, **counting-echo** after the echo: the echo with
//!      `--count-prompts`, which parses and counts each body with tollgate's code and reads
//!      each response's usage, and does nothing else: the floor of an exact-counting decision.
//!
//!    Both tollgate and the echo set TCP_NODELAY on every accepted connection (tollgate's
//!    `run` does it through tonic's `TcpIncoming`), so neither pays for Nagle's algorithm. Both
//!    run tokio's default worker count (the CPUs they may use), or `--server-threads N` each.
//!
//!    The load is closed loop: `--concurrency` workers over `--connections` HTTP/2 connections,
//!    each repeating one *decision*: open a stream, send request headers (one of `--tenants`
//!    users) and a `--body-bytes` chat body, a different text every time (a serial number starts
//!    its user message; `--shared-system-bytes` adds a system message every body repeats, which
//!    tollgate's count cache answers for), read the body answer (it must admit), send response
//!    headers (200, JSON) and a response body with `usage` and `end_of_stream`, read both
//!    answers, half-close, and wait for the server to end the stream. tollgate ends it after its
//!    settle, so each decision includes one reserve and one settle. CPU time is utime + stime from
//!    `/proc/PID/stat` of each process (all threads) over the run; "per core" is decisions per
//!    CPU-second of the server process, also given with Redis's CPU added. For the tollgate runs
//!    the server's own histograms (`tollgate_decision_duration_seconds`,
//!    `tollgate_store_request_duration_seconds`) and Redis's `INFO commandstats` (calls and µs
//!    of `EVALSHA`) are read around each run, to show where the time goes, and `EVALSHA` calls
//!    per decision (less the fleet's syncs, `tollgate_fleet_store_calls_total`) are checked to
//!    be exactly 2 (a store that timed out would have let decisions
//!    through without Redis and inflated the figures).
//!
//! The budgets are set never to refuse (10^9 tokens an hour, 100,000 concurrent per tenant), the
//! scheduler's limit is 100,000 with the controller off, and `store.timeout_ms` is 1 s so that a
//! slow moment on a shared machine shows up as latency rather than as decisions that skipped
//! Redis. Everything listens on 127.0.0.1 ports picked at start-up. Every child is killed when
//! the program ends, also on an error, a panic, Ctrl-C or SIGTERM. The exit status is 3 when the
//! round-trip check failed or any decision was refused or failed, 1 on any other error.
//!
//! ```text
//! cargo build --release --bin tollgate --example bench_decisions --example echo_extproc
//! cargo run --release --example bench_decisions -- --seconds 10 --rounds 3 --json out.json
//! ```
//!
//! `scripts/bench-decisions.sh` does both; results and how to read them are in
//! `docs/benchmarks.md` ("Budgets in Redis").

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    processing_request::Request as Message, processing_response::Response as Answer,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

use tollgate::config::{MAX_WORKER_THREADS, TOKIO_WORKER_THREADS, worker_threads_variable};
use tollgate::observe::FLEET_STORE_CALLS;
use tollgate_testkit::bench::{SerialNumbered, median};
use tollgate_testkit::host::{Machine, clock_ticks_per_second, cpu_ticks_of, machine_jiffies};
use tollgate_testkit::ports::free_addr;
use tollgate_testkit::process::Proc;
use tollgate_testkit::redis::{RedisOptions, RedisServer};
use tollgate_testkit::tollgate::TollgateCommand;
use tollgate_testkit::{bins, metrics};

/// Start-up budget for each child; generous because the machine may be compiling meanwhile.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// A decision slower than this counts as failed: something is broken, not slow.
const DECISION_TIMEOUT: Duration = Duration::from_secs(10);
/// Quiet time between runs, so the previous run's connections and timers have settled.
const PAUSE_BETWEEN_RUNS: Duration = Duration::from_millis(500);
/// After the last checked request: any command tollgate sends in this idle time (a renewal, a
/// late retry) would be a round trip the per-request count missed.
const CHECK_IDLE: Duration = Duration::from_secs(1);

/// Measures what a budget decision costs with Redis, against an echo ext_proc (see the file
/// header of examples/bench_decisions.rs).
#[derive(Parser, Debug)]
#[command(name = "bench_decisions")]
struct Args {
    /// Length of each measured run, in seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Measured rounds (each round runs echo, tollgate+redis, tollgate+memory once, in that order).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Length of the warm-up run per server, in seconds (discarded).
    #[arg(long, default_value_t = 3.0)]
    warmup_seconds: f64,
    /// Streams in flight at once (closed loop: each worker starts its next decision when the
    /// last one ended).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// HTTP/2 connections the streams are spread over (as Envoy spreads them over its workers).
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Distinct users (`x-user-id`, one tenant each) the decisions cycle over.
    #[arg(long, default_value_t = 100)]
    tenants: usize,
    /// Size of the request body in bytes (the prose is cut to make the JSON exactly this long).
    /// Every body is a different text: its user message starts with the decision's serial
    /// number, so tollgate's count cache never answers for it.
    #[arg(long, default_value_t = 4096)]
    body_bytes: usize,
    /// Bytes of prose in a system message that every body repeats (0: none), as an
    /// application's system prompt or a conversation's earlier turns come back; taken out of
    /// `--body-bytes`, and the user message after it is still different every time.
    #[arg(long, default_value_t = 0)]
    shared_system_bytes: usize,
    /// Admitted requests, one at a time, for the round-trip check under MONITOR (0: skip it).
    #[arg(long, default_value_t = 200)]
    check_requests: usize,
    /// Tokio worker threads of the load generator.
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Worker threads of each server's runtime, the echo's and tollgate's alike, given to both
    /// as `TOKIO_WORKER_THREADS` [default: that variable as this process has it, else tokio's
    /// default: the CPUs they may use].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=MAX_WORKER_THREADS as i64))]
    server_threads: Option<u16>,
    /// Count with a model's own tokenizer, as a deployment serving that model does: one
    /// encoding rule for every model name, `DIR/tokenizer.json`, with the chat template of
    /// `DIR/tokenizer_config.json` (e.g. `.tools/tokenizers/llama3`, which
    /// scripts/install-test-deps.sh installs) [default: the model's OpenAI encoding].
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// tollgate's `store.timeout_ms`: large, so a slow moment is latency, not a skipped store.
    #[arg(long, default_value_t = 1000)]
    store_timeout_ms: u64,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// tollgate binary [default: target/<profile>/tollgate next to this example].
    #[arg(long, value_name = "FILE")]
    tollgate_bin: Option<PathBuf>,
    /// The echo ext_proc's binary [default: target/<profile>/examples/echo_extproc next to this
    /// example], e.g. one built another way, to compare two echoes with one tollgate.
    #[arg(long, value_name = "FILE")]
    echo_bin: Option<PathBuf>,
    /// Also run, in each round right after the echo, the echo with `--count-prompts`
    /// ("counting-echo"): it parses and counts each body with tollgate's code and reads each
    /// response's usage, and does nothing else, so it is the floor of any exact-counting
    /// decision.
    #[arg(long)]
    counting_echo: bool,
    /// redis-server binary [default: redis-server on PATH].
    #[arg(long, value_name = "FILE", default_value = "redis-server")]
    redis_server: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tollgate_testkit::bench::run_bench(
        "bench_decisions",
        args.client_threads,
        "flagged (see FAIL or errors above)",
        bench(&args),
    )
}

/// Runs everything; `Ok(false)` when the round-trip check failed or decisions failed.
async fn bench(args: &Args) -> Result<bool> {
    ensure!(args.seconds > 0.0, "--seconds must be positive");
    ensure!(
        args.warmup_seconds >= 0.0,
        "--warmup-seconds must not be negative"
    );
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    ensure!(
        (1..=args.concurrency).contains(&args.connections),
        "--connections must be between 1 and --concurrency"
    );
    ensure!(args.tenants > 0, "--tenants must be at least 1");

    let tollgate_bin = bins::tollgate(args.tollgate_bin.as_deref())?;
    let stale = bins::stale_warning(
        &tollgate_bin,
        &["src", "Cargo.toml", "Cargo.lock"],
        "cargo build --release --bin tollgate",
    );
    if let Some(warning) = &stale {
        eprintln!("WARNING: {warning}");
    }
    let server_threads = ServerThreads::of(args.server_threads)?;
    let redis_version = tollgate_testkit::redis::version(&args.redis_server)?;
    let machine = Machine::describe_and_sample(("redis_version", redis_version.clone())).await;
    eprintln!("machine: {}; {redis_version}", machine.headline());
    eprintln!("servers' worker threads: {}", server_threads.describe());

    let messages = Arc::new(Messages::new(
        args.tenants,
        args.body_bytes,
        args.shared_system_bytes,
    )?);
    let dir = tempfile::tempdir().context("temp dir for configs and logs")?;
    let clock_ticks = clock_ticks_per_second();

    // Redis first, under MONITOR before tollgate connects, so start-up commands are seen too.
    let redis = RedisServer::launch(RedisOptions {
        binary: Some(args.redis_server.clone()),
        ..RedisOptions::default()
    })
    .await?;
    let monitor = Monitor::start(redis.port).await?;
    let config_path = dir.path().join("tollgate.yaml");
    std::fs::write(
        &config_path,
        tollgate_config(args.store_timeout_ms, args.tokenizer.as_deref())?,
    )
    .context("write tollgate.yaml")?;
    let with_redis = ServerProc::tollgate(
        &tollgate_bin,
        &config_path,
        Some(&redis.url),
        &server_threads,
        dir.path(),
        "tollgate-redis",
    )
    .await?;

    let check = if args.check_requests > 0 {
        let check = round_trip_check(args, &messages, &redis, monitor, &with_redis).await?;
        print!("{}", check.table());
        Some(check)
    } else {
        drop(monitor);
        None
    };
    // MONITOR is closed by now (the check consumed it): let Redis notice before timing anything.
    tokio::time::sleep(PAUSE_BETWEEN_RUNS).await;

    let echo =
        ServerProc::echo(args.echo_bin.as_deref(), false, &server_threads, dir.path()).await?;
    let counting_echo = if args.counting_echo {
        Some(ServerProc::echo(args.echo_bin.as_deref(), true, &server_threads, dir.path()).await?)
    } else {
        None
    };
    let in_memory = ServerProc::tollgate(
        &tollgate_bin,
        &config_path,
        None,
        &server_threads,
        dir.path(),
        "tollgate-memory",
    )
    .await?;
    let mut redis_stats = RawRedis::connect(redis.port).await?;
    let mut targets = Vec::new();
    let servers = std::iter::once(&echo)
        .chain(&counting_echo)
        .chain([&with_redis, &in_memory]);
    for server in servers {
        targets.push(Target::connect(server, args.connections).await?);
    }
    for target in &targets {
        sanity_check(target, &messages).await?;
    }

    let runs_per_round = targets.len();
    let mut runs: Vec<Run> = Vec::new();
    if args.warmup_seconds > 0.0 {
        eprintln!("warm-up: {} s per server", args.warmup_seconds);
        for target in &targets {
            let warm = measure(
                target,
                &messages,
                args,
                args.warmup_seconds,
                &redis,
                &mut redis_stats,
                clock_ticks,
            )
            .await?;
            ensure!(
                warm.errors.is_empty(),
                "warm-up on {} failed: {:?}; end of its log:\n{}",
                target.server.name,
                warm.errors,
                target.server.proc.log_tail(40)
            );
            tokio::time::sleep(PAUSE_BETWEEN_RUNS).await;
        }
    }
    eprintln!(
        "{} rounds of {} x {} s ({} streams over {} connections)",
        args.rounds,
        targets
            .iter()
            .map(|t| t.server.name)
            .collect::<Vec<_>>()
            .join(", "),
        args.seconds,
        args.concurrency,
        args.connections
    );
    for round in 1..=args.rounds {
        for target in &targets {
            let run = measure(
                target,
                &messages,
                args,
                args.seconds,
                &redis,
                &mut redis_stats,
                clock_ticks,
            )
            .await?;
            eprintln!("  round {round} {}", run.line());
            runs.push(run);
            tokio::time::sleep(PAUSE_BETWEEN_RUNS).await;
        }
    }
    for target in &targets {
        target.server.proc.check_alive()?;
    }
    redis.proc()?.check_alive()?;

    let summaries: Vec<Summary> = (0..runs_per_round)
        .map(|i| Summary::of(runs.iter().skip(i).step_by(runs_per_round).collect()))
        .collect();
    let report = Report {
        args,
        machine: &machine,
        server_threads: &server_threads,
        summaries: &summaries,
    };
    print!("{}", report.table());
    let clean = check.as_ref().is_none_or(|c| c.passed) && runs.iter().all(Run::clean);

    if let Some(path) = &args.json {
        let document = json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "unix_time": tollgate_testkit::host::unix_seconds(),
            "machine": machine.json(),
            "stale_binary": stale,
            "settings": {
                "seconds": args.seconds,
                "rounds": args.rounds,
                "warmup_seconds": args.warmup_seconds,
                "concurrency": args.concurrency,
                "connections": args.connections,
                "tenants": args.tenants,
                "body_bytes": args.body_bytes,
                "shared_system_bytes": args.shared_system_bytes,
                "client_threads": args.client_threads,
                "server_threads": server_threads.0,
                "store_timeout_ms": args.store_timeout_ms,
                "tokenizer": args.tokenizer,
                "counting_echo": args.counting_echo,
            },
            "round_trip_check": check.as_ref().map(RoundTripCheck::json),
            "runs": runs.iter().map(Run::json).collect::<Vec<_>>(),
            "medians": summaries.iter().map(Summary::json).collect::<Vec<_>>(),
            "verdicts": report.verdicts_json(),
            "flagged": !clean,
        });
        std::fs::write(path, serde_json::to_string_pretty(&document)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
        eprintln!("JSON written to {}", path.display());
    }
    // Children stop here (Drop), the temp dir with their logs last.
    drop(targets);
    drop((
        echo,
        counting_echo,
        with_redis,
        in_memory,
        redis_stats,
        redis,
    ));
    drop(dir);
    Ok(clean)
}

/// tollgate's configuration for every tollgate run: budgets that never refuse, a scheduler that
/// never queues, no controller, and no lease renewal during the run; with `tokenizer`, every
/// model counted with the tokenizer and chat template in that folder.
fn tollgate_config(store_timeout_ms: u64, tokenizer: Option<&Path>) -> Result<String> {
    let mut config = format!(
        "# Written by examples/bench_decisions.rs.\n\
         default_tier: free\n\
         tiers:\n\
         \x20 free: {{tokens_per_hour: 1000000000, max_concurrent: 100000, queue_max: 1000}}\n\
         scheduler: {{initial_limit: 100000}}\n\
         control: {{enabled: false}}\n\
         # Renewal every hour (TTL two hours): no renewal falls into a run, so every Redis\n\
         # command seen is a reserve or a settle.\n\
         store: {{lease_renew_ms: 3600000, lease_ttl_ms: 7200000, timeout_ms: {store_timeout_ms}}}\n"
    );
    if let Some(dir) = tokenizer {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("--tokenizer {}", dir.display()))?;
        let file = |name: &str| -> Result<String> {
            let path = dir.join(name);
            ensure!(path.is_file(), "--tokenizer: {} is missing", path.display());
            // A JSON string is a YAML scalar, whatever the path holds.
            Ok(serde_json::to_string(&path)?)
        };
        config.push_str(&format!(
            "tokens:\n\
             \x20 encodings:\n\
             \x20   - pattern: \"*\"\n\
             \x20     tokenizer_file: {}\n\
             \x20     chat_template_file: {}\n",
            file("tokenizer.json")?,
            file("tokenizer_config.json")?
        ));
    }
    Ok(config)
}

// ---------------------------------------------------------------------------------------------
// The messages of one decision

/// Every message a decision sends, built once: per-tenant request headers, the body (stamped
/// with a serial number for each decision), and the response.
struct Messages {
    headers: Vec<ProcessingRequest>,
    /// Numbered over every run of the benchmark: a server never sees the same body twice.
    body: SerialNumbered,
    response_headers: ProcessingRequest,
    response_body: ProcessingRequest,
}

impl Messages {
    fn new(tenants: usize, body_bytes: usize, shared_system_bytes: usize) -> Result<Messages> {
        let headers = (0..tenants)
            .map(|tenant| {
                let user = format!("tenant-{tenant:03}");
                message(Message::RequestHeaders(HttpHeaders {
                    headers: Some(header_map(&[
                        (":method", "POST"),
                        (":path", "/v1/chat/completions"),
                        (":authority", "bench.local"),
                        ("content-type", "application/json"),
                        ("content-length", &body_bytes.to_string()),
                        ("x-user-id", &user),
                    ])),
                    end_of_stream: false,
                    ..HttpHeaders::default()
                }))
            })
            .collect();
        let response = serde_json::to_vec(&json!({
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "model": "gpt-4o-mini",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"},
                "finish_reason": "length",
            }],
            "usage": {"prompt_tokens": 900, "completion_tokens": 8, "total_tokens": 908},
        }))?;
        Ok(Messages {
            headers,
            body: SerialNumbered::new(chat_body(body_bytes, shared_system_bytes)?)?,
            response_headers: message(Message::ResponseHeaders(HttpHeaders {
                headers: Some(header_map(&[
                    (":status", "200"),
                    ("content-type", "application/json"),
                ])),
                end_of_stream: false,
                ..HttpHeaders::default()
            })),
            response_body: message(Message::ResponseBody(HttpBody {
                body: response,
                end_of_stream: true,
                ..HttpBody::default()
            })),
        })
    }
}

impl Messages {
    /// The next decision's request body: the body with a serial number no earlier one had.
    fn body(&self) -> ProcessingRequest {
        message(Message::RequestBody(HttpBody {
            body: self.body.next(),
            end_of_stream: true,
            ..HttpBody::default()
        }))
    }
}

/// A non-streaming chat request of exactly `bytes` bytes: English prose (no digits),
/// `max_tokens: 16`, so tollgate counts real tokens and rewrites nothing. `shared_system_bytes`
/// of the prose go in a system message, the same in every body; the user message holds the
/// rest, after `SerialNumbered::PLACEHOLDER` and a space.
fn chat_body(bytes: usize, shared_system_bytes: usize) -> Result<Vec<u8>> {
    const PROSE: &str = "The quick brown fox jumps over the lazy dog while the committee reviews \
        the quarterly budget, weighing every request against the tokens it may spend. ";
    let skeleton = |system: &str, user: &str| {
        let user = json!({
            "role": "user",
            "content": format!("{} {user}", SerialNumbered::PLACEHOLDER),
        });
        let messages = if shared_system_bytes == 0 {
            json!([user])
        } else {
            json!([{"role": "system", "content": system}, user])
        };
        serde_json::to_vec(&json!({
            "model": "gpt-4o-mini",
            "messages": messages,
            "max_tokens": 16,
        }))
    };
    let overhead = skeleton("", "")?.len();
    ensure!(
        bytes >= overhead + shared_system_bytes,
        "--body-bytes must be at least {overhead} (the JSON around the prose) plus \
         --shared-system-bytes"
    );
    let prose = |len| PROSE.chars().cycle().take(len).collect::<String>();
    let body = skeleton(
        &prose(shared_system_bytes),
        &prose(bytes - overhead - shared_system_bytes),
    )?;
    ensure!(
        body.len() == bytes,
        "chat body is {} bytes, not {bytes}",
        body.len()
    );
    Ok(body)
}

fn header_map(headers: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(key, value)| HeaderValue {
                key: (*key).to_owned(),
                value: String::new(),
                raw_value: value.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn message(request: Message) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

// ---------------------------------------------------------------------------------------------
// One decision, as Envoy drives it

type Client = ExternalProcessorClient<Channel>;

/// A stream whose request has been admitted; its response phases are still to come.
struct Admitted {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

/// Opens a stream and plays the request phases; returns the stream once the body was admitted.
async fn admit(
    client: &mut Client,
    messages: &Messages,
    tenant: usize,
) -> Result<Admitted, String> {
    let (tx, rx) = mpsc::channel(4);
    // Queued before the call, so the headers go out with the stream's opening as Envoy's do.
    send(&tx, messages.headers[tenant].clone()).await?;
    let mut rx = client
        .process(ReceiverStream::new(rx))
        .await
        .map_err(|status| grpc_error("open", &status))?
        .into_inner();
    expect(&mut rx, "request_headers").await?;
    send(&tx, messages.body()).await?;
    expect(&mut rx, "request_body").await?;
    Ok(Admitted { tx, rx })
}

/// Plays the response phases of an admitted stream, half-closes it, and waits until the server
/// ends it (tollgate does after settling).
async fn finish(admitted: Admitted, messages: &Messages) -> Result<(), String> {
    let Admitted { tx, mut rx } = admitted;
    send(&tx, messages.response_headers.clone()).await?;
    expect(&mut rx, "response_headers").await?;
    send(&tx, messages.response_body.clone()).await?;
    expect(&mut rx, "response_body").await?;
    drop(tx);
    match rx.message().await {
        Ok(None) => Ok(()),
        Ok(Some(_)) => Err("an answer after the last one".to_owned()),
        Err(status) => Err(grpc_error("close", &status)),
    }
}

async fn send(
    tx: &mpsc::Sender<ProcessingRequest>,
    request: ProcessingRequest,
) -> Result<(), String> {
    tx.send(request)
        .await
        .map_err(|_| "the stream stopped taking messages".to_owned())
}

/// Reads the next answer and checks it continues the `phase` it answers; a local reply is a
/// refusal, named by its status and `x-tollgate-reason`.
async fn expect(rx: &mut tonic::Streaming<ProcessingResponse>, phase: &str) -> Result<(), String> {
    let answer = match rx.message().await {
        Ok(Some(answer)) => answer,
        Ok(None) => return Err(format!("stream ended before the {phase} answer")),
        Err(status) => return Err(grpc_error(phase, &status)),
    };
    let kind = match &answer.response {
        Some(Answer::RequestHeaders(_)) => "request_headers",
        Some(Answer::RequestBody(_)) => "request_body",
        Some(Answer::ResponseHeaders(_)) => "response_headers",
        Some(Answer::ResponseBody(_)) => "response_body",
        Some(Answer::ImmediateResponse(reply)) => {
            let status = reply.status.as_ref().map_or(0, |s| s.code);
            let reason = reply
                .headers
                .iter()
                .flat_map(|m| &m.set_headers)
                .filter_map(|option| option.header.as_ref())
                .find(|h| h.key == "x-tollgate-reason")
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
                .unwrap_or_default();
            return Err(format!("refused at {phase}: {status} {reason}"));
        }
        _ => "other",
    };
    if kind == phase {
        Ok(())
    } else {
        Err(format!("{kind} answer to {phase}"))
    }
}

fn grpc_error(phase: &str, status: &Status) -> String {
    format!("gRPC {:?} at {phase}", status.code())
}

// ---------------------------------------------------------------------------------------------
// The round-trip check

/// What MONITOR showed while tollgate served admitted requests one at a time.
struct RoundTripCheck {
    requests: usize,
    /// tollgate's commands before the first request: `NAME` or `NAME SUBCOMMAND`, with counts.
    startup: BTreeMap<String, u64>,
    /// Per request, tollgate's commands up to the admit answer, and then up to the settle.
    admit_segments: Vec<Vec<RedisCommand>>,
    settle_segments: Vec<Vec<RedisCommand>>,
    /// tollgate's commands in the idle second after the last request.
    idle: Vec<RedisCommand>,
    /// `cmdstat_evalsha` calls over the checked requests, from `INFO commandstats`.
    evalsha_calls: u64,
    /// Of those, the fleet's syncs (one a `fleet.sync_ms`, on their own connection).
    fleet_calls: u64,
    /// The fleet's other commands over the checked requests, by name (its settings reads).
    fleet_other: BTreeMap<String, u64>,
    passed: bool,
}

/// A command as MONITOR shows it: its name and first argument (an `EVALSHA`'s script).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct RedisCommand {
    name: String,
    arg: String,
}

impl RedisCommand {
    fn label(&self) -> String {
        match self.name.as_str() {
            "EVALSHA" => format!("EVALSHA {}", &self.arg[..self.arg.len().min(8)]),
            _ => self.name.clone(),
        }
    }
}

async fn round_trip_check(
    args: &Args,
    messages: &Messages,
    redis: &RedisServer,
    monitor: Monitor,
    tollgate: &ServerProc,
) -> Result<RoundTripCheck> {
    let requests = args.check_requests;
    eprintln!("round-trip check: {requests} admitted requests one at a time, Redis under MONITOR");
    let mut marks = RawRedis::connect(redis.port).await?;
    let own = marks.local_addr.clone();
    let admin = tollgate.admin.context("tollgate has an admin address")?;
    let mut client = Target::connect(tollgate, 1).await?.clients.remove(0);

    // Start-up is over once tollgate has been quiet on Redis for a while (its scripts load in
    // the background after the connection is made).
    let quiet_deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let seen = monitor.len();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if monitor.len() == seen || Instant::now() > quiet_deadline {
            break;
        }
    }
    let settles_before = scrape(admin).await?.sum(
        "tollgate_store_request_duration_seconds_count",
        &[("op", "settle")],
    );
    let evalsha_before = marks.command_calls("evalsha").await?;
    marks.mark("startup").await?;
    for i in 0..requests {
        let tenant = i % messages.headers.len();
        let admitted = tokio::time::timeout(DECISION_TIMEOUT, admit(&mut client, messages, tenant))
            .await
            .map_err(|_| anyhow!("request {i}: no admit answer within {DECISION_TIMEOUT:?}"))?
            .map_err(|e| anyhow!("request {i}: {e}"))?;
        marks.mark(&format!("admitted-{i}")).await?;
        tokio::time::timeout(DECISION_TIMEOUT, finish(admitted, messages))
            .await
            .map_err(|_| anyhow!("request {i}: stream not ended within {DECISION_TIMEOUT:?}"))?
            .map_err(|e| anyhow!("request {i}: {e}"))?;
        // The stream's end follows the settle in tollgate today, but do not rely on it: wait
        // until tollgate has counted the settle as done, so its EVALSHA precedes the marker.
        let target = settles_before + (i + 1) as f64;
        let deadline = Instant::now() + DECISION_TIMEOUT;
        loop {
            let settled = scrape(admin).await?.sum(
                "tollgate_store_request_duration_seconds_count",
                &[("op", "settle")],
            );
            if settled >= target {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "request {i}: tollgate never settled it"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        marks.mark(&format!("settled-{i}")).await?;
    }
    tokio::time::sleep(CHECK_IDLE).await;
    marks.mark("idle").await?;
    let evalsha_calls = marks.command_calls("evalsha").await? - evalsha_before;
    let log = monitor.until_mark("idle").await?;

    // Split the log at our markers; keep tollgate's own commands (not ours, not its scripts').
    let mut segments: Vec<(String, Vec<RedisCommand>)> = vec![("before".to_owned(), Vec::new())];
    let mut fleet_calls = 0u64;
    let mut fleet_other: BTreeMap<String, u64> = BTreeMap::new();
    for entry in log {
        if entry.client == own {
            if entry.command.name == "ECHO"
                && let Some(mark) = entry.command.arg.strip_prefix(MARK_PREFIX)
            {
                segments.push((mark.to_owned(), Vec::new()));
            }
            continue;
        }
        if entry.client == "lua" {
            continue;
        }
        if entry.fleet {
            // Counted once start-up is over, the syncs like the EVALSHA calls from INFO.
            if segments.len() > 1 {
                if entry.command.name == "EVALSHA" {
                    fleet_calls += 1;
                } else {
                    *fleet_other.entry(entry.command.name).or_insert(0) += 1;
                }
            }
            continue;
        }
        if let Some((_, commands)) = segments.last_mut() {
            commands.push(entry.command);
        }
    }
    // Segment i holds what came *before* marker i: shift so each marker names what preceded it.
    let mut named: BTreeMap<String, Vec<RedisCommand>> = BTreeMap::new();
    for pair in segments.windows(2) {
        named.insert(pair[1].0.clone(), pair[0].1.clone());
    }
    let mut startup = BTreeMap::new();
    for command in named.remove("startup").unwrap_or_default() {
        let key = match command.name.as_str() {
            "SCRIPT" | "CLIENT" | "CONFIG" => {
                format!("{} {}", command.name, command.arg.to_uppercase())
            }
            _ => command.name.clone(),
        };
        *startup.entry(key).or_insert(0) += 1;
    }
    let admit_segments: Vec<Vec<RedisCommand>> = (0..requests)
        .map(|i| named.remove(&format!("admitted-{i}")).unwrap_or_default())
        .collect();
    let settle_segments: Vec<Vec<RedisCommand>> = (0..requests)
        .map(|i| named.remove(&format!("settled-{i}")).unwrap_or_default())
        .collect();
    let idle = named.remove("idle").unwrap_or_default();

    let single_script = |segments: &[Vec<RedisCommand>]| -> Option<String> {
        let first = segments.first()?.first()?.clone();
        segments
            .iter()
            .all(|s| s.len() == 1 && s[0].name == "EVALSHA" && s[0] == first)
            .then_some(first.arg)
    };
    let reserve_sha = single_script(&admit_segments);
    let settle_sha = single_script(&settle_segments);
    let passed = matches!((&reserve_sha, &settle_sha), (Some(r), Some(s)) if r != s)
        && idle.is_empty()
        && evalsha_calls == 2 * requests as u64 + fleet_calls;
    Ok(RoundTripCheck {
        requests,
        startup,
        admit_segments,
        settle_segments,
        idle,
        evalsha_calls,
        fleet_calls,
        fleet_other,
        passed,
    })
}

impl RoundTripCheck {
    /// Counts of each distinct command list over `segments`, e.g. `200 x [EVALSHA 1a2b3c4d]`.
    fn shapes(segments: &[Vec<RedisCommand>]) -> BTreeMap<String, usize> {
        let mut shapes = BTreeMap::new();
        for segment in segments {
            let labels: Vec<String> = segment.iter().map(RedisCommand::label).collect();
            *shapes
                .entry(format!("[{}]", labels.join(", ")))
                .or_insert(0) += 1;
        }
        shapes
    }

    fn describe(segments: &[Vec<RedisCommand>]) -> String {
        Self::shapes(segments)
            .iter()
            .map(|(shape, count)| format!("{count} x {shape}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Commands by name with their counts, e.g. `SCRIPT LOAD x4, HGETALL x2`; `none`.
    fn counted(counts: &BTreeMap<String, u64>) -> String {
        if counts.is_empty() {
            return "none".to_owned();
        }
        counts
            .iter()
            .map(|(name, count)| format!("{name} x{count}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nRedis round trips per admitted request (MONITOR: commands of tollgate's own \
             connection; script-internal calls excluded)"
        );
        let idle = if self.idle.is_empty() {
            "none".to_owned()
        } else {
            Self::describe(std::slice::from_ref(&self.idle))
        };
        let rows = [
            ("start-up, once".to_owned(), Self::counted(&self.startup)),
            (
                format!("{} requests: headers + body -> admit answer", self.requests),
                Self::describe(&self.admit_segments),
            ),
            (
                format!("{} requests: response -> end + settle", self.requests),
                Self::describe(&self.settle_segments),
            ),
            (format!("idle {CHECK_IDLE:?} after the last request"), idle),
            (
                "INFO commandstats cmdstat_evalsha calls".to_owned(),
                format!(
                    "{} for {} requests: {} fleet syncs (off the request path) and {:.3} per \
                     request",
                    self.evalsha_calls,
                    self.requests,
                    self.fleet_calls,
                    (self.evalsha_calls - self.fleet_calls) as f64 / self.requests.max(1) as f64
                ),
            ),
            (
                "the fleet's other commands (off the path)".to_owned(),
                Self::counted(&self.fleet_other),
            ),
            (
                "exactly 1 round trip to admit, 1 to settle".to_owned(),
                if self.passed { "PASS" } else { "FAIL" }.to_owned(),
            ),
        ];
        for (label, value) in rows {
            let _ = writeln!(out, "  {:<46} {value}", format!("{label}:"));
        }
        out
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.requests,
            "startup": self.startup,
            "admit_segments": Self::shapes(&self.admit_segments),
            "settle_segments": Self::shapes(&self.settle_segments),
            "idle": self.idle.iter().map(RedisCommand::label).collect::<Vec<_>>(),
            "evalsha_calls": self.evalsha_calls,
            "fleet_calls": self.fleet_calls,
            "fleet_other_commands": self.fleet_other,
            "passed": self.passed,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Redis: raw connections, MONITOR

/// A plain RESP connection: no client library, so it sends only the commands written here
/// (redis-rs would add `CLIENT SETINFO`), and its address tells its commands apart in MONITOR.
struct RawRedis {
    stream: BufReader<tokio::net::TcpStream>,
    local_addr: String,
}

const MARK_PREFIX: &str = "bench-decisions-mark:";

impl RawRedis {
    async fn connect(port: u16) -> Result<RawRedis> {
        let stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .with_context(|| format!("connect to redis-server on port {port}"))?;
        stream.set_nodelay(true)?;
        let local_addr = stream.local_addr()?.to_string();
        Ok(RawRedis {
            stream: BufReader::new(stream),
            local_addr,
        })
    }

    /// Sends one command and returns its reply as text (simple, integer or bulk string).
    async fn command(&mut self, args: &[&str]) -> Result<String> {
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            let _ = write!(request, "${}\r\n{arg}\r\n", arg.len());
        }
        self.stream.get_mut().write_all(request.as_bytes()).await?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await?;
        let line = line.trim_end();
        let (kind, rest) = line.split_at(line.len().min(1));
        match kind {
            "+" | ":" => Ok(rest.to_owned()),
            "-" => bail!("Redis answered {args:?} with an error: {rest}"),
            "$" => {
                let length: usize = rest.parse().context("bulk length")?;
                let mut data = vec![0; length + 2];
                self.stream.read_exact(&mut data).await?;
                data.truncate(length);
                Ok(String::from_utf8_lossy(&data).into_owned())
            }
            _ => bail!("unexpected Redis reply to {args:?}: {line:?}"),
        }
    }

    /// A marker in the MONITOR log.
    async fn mark(&mut self, name: &str) -> Result<()> {
        self.command(&["ECHO", &format!("{MARK_PREFIX}{name}")])
            .await
            .map(drop)
    }

    /// Every command's `calls` and `usec` from `INFO commandstats`, by lowercase name. On Redis
    /// 7.0 these count commands scripts ran too; `evalsha` is only ever a client's.
    async fn command_stats(&mut self) -> Result<BTreeMap<String, (u64, u64)>> {
        let info = self.command(&["INFO", "commandstats"]).await?;
        Ok(info
            .lines()
            .filter_map(|line| {
                let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
                let field = |key: &str| {
                    fields
                        .split(',')
                        .find_map(|f| f.strip_prefix(key))
                        .and_then(|v| v.parse().ok())
                };
                Some((
                    name.to_ascii_lowercase(),
                    (field("calls=")?, field("usec=")?),
                ))
            })
            .collect())
    }

    /// `total_reads_processed` from `INFO stats` (Redis 6 and later): how many times Redis read
    /// from a client's socket. A batch of calls written at once is read at once unless it is
    /// longer than Redis's 16 KiB read buffer, so over a run this counts the store's batches
    /// (and the fleet's calls, each a read of its own).
    async fn reads_processed(&mut self) -> Result<u64> {
        let info = self.command(&["INFO", "stats"]).await?;
        info.lines()
            .find_map(|line| line.trim().strip_prefix("total_reads_processed:"))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("INFO stats has no total_reads_processed (Redis before 6?)"))
    }

    async fn command_calls(&mut self, name: &str) -> Result<u64> {
        Ok(self
            .command_stats()
            .await?
            .get(name)
            .map_or(0, |&(calls, _)| calls))
    }
}

/// One entry of the MONITOR log.
struct MonitorEntry {
    /// `ip:port` of the client, or `lua` for a command a script ran.
    client: String,
    command: RedisCommand,
    /// A command on the fleet's keys (`tollgate:fleet:{...}`): its syncs (`EVALSHA`, on a
    /// connection of their own) and its reads of the run-time settings (`HGETALL`, one per
    /// `fleet.sync_ms`): the replicas' coordination, off every request's path.
    fleet: bool,
}

/// A MONITOR connection read by a task of its own into a shared log; closed on drop.
struct Monitor {
    log: Arc<Mutex<Vec<MonitorEntry>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Monitor {
    async fn start(port: u16) -> Result<Monitor> {
        let mut connection = RawRedis::connect(port).await?;
        ensure!(
            connection.command(&["MONITOR"]).await? == "OK",
            "MONITOR was not accepted"
        );
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let task = tokio::spawn(async move {
            let mut line = String::new();
            loop {
                line.clear();
                match connection.stream.read_line(&mut line).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if let Some(entry) = parse_monitor_line(line.trim_end()) {
                            lock(&sink).push(entry);
                        }
                    }
                }
            }
        });
        Ok(Monitor { log, task })
    }

    /// Entries so far, the fleet's periodic syncs left out (they never go quiet).
    fn len(&self) -> usize {
        lock(&self.log).iter().filter(|entry| !entry.fleet).count()
    }

    /// Waits until the marker `name` shows in the log, then stops monitoring and returns the log.
    async fn until_mark(self, name: &str) -> Result<Vec<MonitorEntry>> {
        let wanted = format!("{MARK_PREFIX}{name}");
        let deadline = Instant::now() + READY_TIMEOUT;
        while !lock(&self.log)
            .iter()
            .any(|e| e.command.name == "ECHO" && e.command.arg == wanted)
        {
            ensure!(
                Instant::now() < deadline,
                "MONITOR never showed marker {name}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.task.abort();
        Ok(std::mem::take(&mut *lock(&self.log)))
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        // The task owns the connection: ending it closes MONITOR, which slows Redis down.
        self.task.abort();
    }
}

/// `+1700000000.123456 [0 127.0.0.1:41234] "EVALSHA" "1a2b..." "2" ...` → client and command.
fn parse_monitor_line(line: &str) -> Option<MonitorEntry> {
    let rest = line.strip_prefix('+')?;
    let open = rest.find('[')?;
    let close = open + rest[open..].find("] ")?;
    let source = &rest[open + 1..close];
    let client = source.split_once(' ').map_or(source, |(_, client)| client);
    let mut tokens = quoted_tokens(&rest[close + 2..], 4).into_iter();
    let name = tokens.next()?.to_ascii_uppercase();
    let arg = tokens.next().unwrap_or_default();
    // EVALSHA sha numkeys key... names its first key third; other commands name it first.
    let fleets = |key: &str| key.starts_with("tollgate:fleet:");
    let fleet = if name == "EVALSHA" {
        tokens.nth(1).is_some_and(|key| fleets(&key))
    } else {
        fleets(&arg)
    };
    Some(MonitorEntry {
        client: client.to_owned(),
        command: RedisCommand { name, arg },
        fleet,
    })
}

/// The first `n` double-quoted tokens of a MONITOR line (escapes kept as written).
fn quoted_tokens(text: &str, n: usize) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut chars = text.chars();
    while tokens.len() < n {
        if !chars.by_ref().any(|c| c == '"') {
            break;
        }
        let mut token = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    token.push(c);
                    token.extend(chars.next());
                }
                '"' => break,
                _ => token.push(c),
            }
        }
        tokens.push(token);
    }
    tokens
}

// ---------------------------------------------------------------------------------------------
// Servers and their clients

/// A server under test: its process, gRPC address and (tollgate) admin address.
struct ServerProc {
    name: &'static str,
    proc: Proc,
    grpc: SocketAddr,
    admin: Option<SocketAddr>,
    /// Keeps its budgets in our Redis.
    uses_redis: bool,
}

impl ServerProc {
    async fn tollgate(
        binary: &Path,
        config: &Path,
        redis_url: Option<&str>,
        threads: &ServerThreads,
        dir: &Path,
        name: &'static str,
    ) -> Result<ServerProc> {
        let redis_args = redis_url.map(|url| ["--redis-url", url]);
        let command = TollgateCommand::new(binary, config)
            .name(name)
            .args(redis_args.into_iter().flatten())
            .ready_timeout(READY_TIMEOUT);
        let command = match threads.0 {
            Some(count) => command.env(TOKIO_WORKER_THREADS, &count.to_string()),
            None => command,
        };
        let tollgate = command.start(dir).await?;
        Ok(ServerProc {
            name,
            grpc: tollgate.grpc,
            admin: Some(tollgate.admin),
            proc: tollgate.into_proc(),
            uses_redis: redis_url.is_some(),
        })
    }

    /// `examples/echo_extproc.rs` (`explicit` if given, else the one built next to this
    /// example): the echo, or with `counting` the counting echo (`--count-prompts`).
    async fn echo(
        explicit: Option<&Path>,
        counting: bool,
        threads: &ServerThreads,
        dir: &Path,
    ) -> Result<ServerProc> {
        let grpc = free_addr();
        let echo = bins::example("echo_extproc", explicit)?;
        let name = if counting { "counting-echo" } else { "echo" };
        let mut command = Command::new(echo);
        command
            .args(["--addr", &grpc.to_string()])
            .stdout(Stdio::null());
        if counting {
            command.arg("--count-prompts");
        }
        if let Some(count) = threads.0 {
            command.env(TOKIO_WORKER_THREADS, count.to_string());
        }
        let proc = Proc::spawn(name, &mut command, dir.join(format!("{name}.log")))?;
        Ok(ServerProc {
            name,
            proc,
            grpc,
            admin: None,
            uses_redis: false,
        })
    }
}

/// The worker threads every server runs: `--server-threads`, else `TOKIO_WORKER_THREADS` as the
/// servers would inherit it (the echo's `#[tokio::main]` and tollgate both read it), held to
/// tollgate's bounds so a count it would refuse fails here, by name; `None`: tokio's default.
struct ServerThreads(Option<u16>);

impl ServerThreads {
    fn of(flag: Option<u16>) -> Result<ServerThreads> {
        if flag.is_some() {
            return Ok(ServerThreads(flag));
        }
        let variable = std::env::var_os(TOKIO_WORKER_THREADS);
        Ok(ServerThreads(worker_threads_variable(variable.as_deref())?))
    }

    fn describe(&self) -> String {
        match &self.0 {
            Some(count) => format!("{count} ({TOKIO_WORKER_THREADS})"),
            None => "tokio's default, the CPUs they may use".to_owned(),
        }
    }
}

/// A server and the HTTP/2 connections the load goes over.
struct Target<'a> {
    server: &'a ServerProc,
    clients: Vec<Client>,
}

impl<'a> Target<'a> {
    /// Opens `connections` HTTP/2 connections (one tonic `Channel` each), retrying until the
    /// server accepts.
    async fn connect(server: &'a ServerProc, connections: usize) -> Result<Target<'a>> {
        let endpoint = Endpoint::from_shared(format!("http://{}", server.grpc))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(1));
        let mut clients = Vec::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        while clients.len() < connections {
            match endpoint.connect().await {
                Ok(channel) => clients.push(ExternalProcessorClient::new(channel)),
                Err(e) => {
                    server.proc.check_alive()?;
                    ensure!(
                        Instant::now() < deadline,
                        "cannot connect to {} at {}: {e}",
                        server.name,
                        server.grpc
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        Ok(Target { server, clients })
    }
}

/// One decision on every connection, so a broken server fails before anything is timed.
async fn sanity_check(target: &Target<'_>, messages: &Messages) -> Result<()> {
    for client in &target.clients {
        let mut client = client.clone();
        let decided = async {
            let admitted = admit(&mut client, messages, 0).await?;
            finish(admitted, messages).await
        };
        tokio::time::timeout(DECISION_TIMEOUT, decided)
            .await
            .map_err(|_| {
                anyhow!(
                    "{}: no answer within {DECISION_TIMEOUT:?}",
                    target.server.name
                )
            })?
            .map_err(|e| {
                anyhow!(
                    "{}: the first decision failed: {e}; end of its log:\n{}",
                    target.server.name,
                    target.server.proc.log_tail(40)
                )
            })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Measuring a run

/// One timed run against one server.
struct Run {
    server: &'static str,
    decisions: u64,
    wall_s: f64,
    errors: BTreeMap<String, u64>,
    server_cpu_s: f64,
    redis_cpu_s: f64,
    client_cpu_s: f64,
    /// Busy CPU-seconds of the whole machine not spent by the server, Redis or this client:
    /// other work sharing the cores (a compile, another benchmark).
    other_cpu_s: Option<f64>,
    /// Decision latency seen by the client: stream opened to body answer, in ms.
    latency_p50_ms: f64,
    latency_p99_ms: f64,
    tollgate: Option<TollgateStats>,
    redis: Option<RedisStats>,
}

/// tollgate's own view of a run, from its /metrics before and after.
struct TollgateStats {
    admitted: f64,
    /// `tollgate_decision_duration_seconds`: the body's arrival to the answer, in µs.
    decision_mean_us: f64,
    decision_p50_us: f64,
    decision_p99_us: f64,
    /// `tollgate_store_request_duration_seconds{op}`, in µs.
    reserve_mean_us: f64,
    reserve_p99_us: f64,
    settle_mean_us: f64,
    settle_p99_us: f64,
    /// `tollgate_store_batch_calls`: calls per batch the Redis store sent (NaN with none).
    batch_calls_mean: f64,
    store_errors: f64,
    degraded: f64,
}

/// Redis's view of a run, from `INFO commandstats` before and after.
struct RedisStats {
    /// `EVALSHA` calls of the decisions: Redis's count less the fleet's syncs (tollgate's
    /// `tollgate_fleet_store_calls_total`), which run on their own: with the default
    /// `fleet.sync_ms` of 200 ms, about ten a second from a replica that leads, as one alone
    /// does.
    evalsha_calls: u64,
    fleet_calls: u64,
    /// Readings of the run's start and end taken again because a fleet call ended during one
    /// (`read_edge`'s tries after the first, both edges together).
    edge_rereadings: u64,
    /// Time Redis spent executing them (its main thread), µs per call.
    usec_per_evalsha: f64,
    /// Reads from client sockets (`total_reads_processed`): about one per batch of calls.
    reads: u64,
}

impl Run {
    fn per_server_cpu(&self) -> f64 {
        self.decisions as f64 / self.server_cpu_s
    }

    fn per_server_and_redis_cpu(&self) -> f64 {
        self.decisions as f64 / (self.server_cpu_s + self.redis_cpu_s)
    }

    fn throughput(&self) -> f64 {
        self.decisions as f64 / self.wall_s
    }

    fn evalsha_per_decision(&self) -> Option<f64> {
        self.redis
            .as_ref()
            .map(|r| r.evalsha_calls as f64 / self.decisions as f64)
    }

    /// Redis's reads from clients per decision: about one a batch of calls.
    fn reads_per_decision(&self) -> Option<f64> {
        self.redis
            .as_ref()
            .map(|r| r.reads as f64 / self.decisions.max(1) as f64)
    }

    /// No failed decisions, no store errors, and (with Redis) exactly two scripts per decision.
    fn clean(&self) -> bool {
        self.errors.is_empty()
            && self
                .tollgate
                .as_ref()
                .is_none_or(|t| t.store_errors == 0.0 && t.degraded == 0.0)
            && self.evalsha_per_decision().is_none_or(|e| e == 2.0)
    }

    fn line(&self) -> String {
        let mut line = format!(
            "{:<23} {:>7.0} decisions/s  {:>7.0} per server CPU-s  server {:.2} cores  redis {:.2}  \
             client {:.2}  p50 {:.2} ms  p99 {:.2} ms",
            self.server,
            self.throughput(),
            self.per_server_cpu(),
            self.server_cpu_s / self.wall_s,
            self.redis_cpu_s / self.wall_s,
            self.client_cpu_s / self.wall_s,
            self.latency_p50_ms,
            self.latency_p99_ms,
        );
        if let Some(other) = self.other_cpu_s {
            let _ = write!(line, "  other {:.2} cores", other / self.wall_s);
        }
        if let Some(per) = self.evalsha_per_decision() {
            let _ = write!(line, "  EVALSHA/decision {per:.3}");
        }
        if let Some(reads) = self.reads_per_decision() {
            let _ = write!(line, "  Redis reads/decision {reads:.3}");
        }
        if !self.errors.is_empty() {
            let _ = write!(line, "  ERRORS {:?}", self.errors);
        }
        if let Some(t) = &self.tollgate
            && (t.store_errors > 0.0 || t.degraded > 0.0)
        {
            let _ = write!(
                line,
                "  STORE ERRORS {} degraded {}",
                t.store_errors, t.degraded
            );
        }
        line
    }

    fn json(&self) -> Value {
        json!({
            "server": self.server,
            "decisions": self.decisions,
            "wall_s": self.wall_s,
            "errors": self.errors,
            "server_cpu_s": self.server_cpu_s,
            "redis_cpu_s": self.redis_cpu_s,
            "client_cpu_s": self.client_cpu_s,
            "other_cpu_s": self.other_cpu_s,
            "decisions_per_s": self.throughput(),
            "decisions_per_server_cpu_s": self.per_server_cpu(),
            "decisions_per_server_and_redis_cpu_s": self.per_server_and_redis_cpu(),
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p99_ms": self.latency_p99_ms,
            "tollgate": self.tollgate.as_ref().map(|t| json!({
                "admitted": t.admitted,
                "decision_mean_us": t.decision_mean_us,
                "decision_p50_us": t.decision_p50_us,
                "decision_p99_us": t.decision_p99_us,
                "reserve_mean_us": t.reserve_mean_us,
                "reserve_p99_us": t.reserve_p99_us,
                "settle_mean_us": t.settle_mean_us,
                "settle_p99_us": t.settle_p99_us,
                "batch_calls_mean": t.batch_calls_mean,
                "store_errors": t.store_errors,
                "degraded": t.degraded,
            })),
            "redis": self.redis.as_ref().map(|r| json!({
                "evalsha_calls": r.evalsha_calls,
                "fleet_calls": r.fleet_calls,
                "edge_rereadings": r.edge_rereadings,
                "usec_per_evalsha": r.usec_per_evalsha,
                "reads": r.reads,
                "reads_per_decision": self.reads_per_decision(),
            })),
            "clean": self.clean(),
        })
    }
}

#[derive(Default)]
struct WorkerResult {
    decisions: u64,
    latencies_us: Vec<u32>,
    errors: BTreeMap<String, u64>,
}

/// What a run's start or its end reads of tollgate and Redis.
struct Edge {
    /// tollgate's metrics (`None` for the echo).
    metrics: Option<Scrape>,
    /// Redis's `INFO commandstats`.
    commands: BTreeMap<String, (u64, u64)>,
    /// Redis's `total_reads_processed`, read after `commands`.
    reads: u64,
    /// How many times the pair of `INFO`s was read (`read_edge`): more than once when a fleet
    /// call ended between tollgate's two scrapes.
    tries: u64,
}

impl Edge {
    /// The `INFO`s this edge sent Redis, each a read of its own (`reads`' too, which Redis
    /// counts before it answers): two a try.
    fn info_reads(&self) -> u64 {
        2 * self.tries
    }
}

/// Reads tollgate's metrics on both sides of Redis's `INFO`s, again until no fleet call ended
/// in between, at most `TRIES` times (the last reading is kept then; a miscount shows in the
/// round's check).
///
/// Why: the fleet syncs on while the readings are taken (a join and, on the leader, a publish,
/// an `EVALSHA` each every `fleet.sync_ms`, off the request path), and Redis counts a call when
/// it runs it, tollgate when its answer comes. Read once, tollgate scraped then `INFO` at a
/// run's start and `INFO` then scrape at its end, a call Redis ran before the first `INFO` and
/// tollgate counted after the first scrape, or ran after the last `INFO` and was counted before
/// the last scrape, was in the run's fleet calls and not in Redis's: a round one `EVALSHA` short
/// of two per decision less the fleet's (docs/benchmarks.md, "Rounds an `EVALSHA` short").
/// Scraped on both sides of the `INFO`s, such a call shows as a change between the two scrapes.
/// Only a call Redis runs before the `INFO`s whose answer tollgate counts after the second
/// scrape still escapes: one short at a run's start, one over at its end.
async fn read_edge(admin: Option<SocketAddr>, redis_stats: &mut RawRedis) -> Result<Edge> {
    const TRIES: u64 = 10;
    let fleet_calls = |metrics: &Option<Scrape>| {
        metrics
            .as_ref()
            .map(|scrape| scrape.sum(FLEET_STORE_CALLS, &[]))
    };
    let scrape_of = |admin: Option<SocketAddr>| async move {
        match admin {
            Some(admin) => scrape(admin).await.map(Some),
            None => Ok(None),
        }
    };
    let mut first = scrape_of(admin).await?;
    let mut tries = 0;
    loop {
        tries += 1;
        let commands = redis_stats.command_stats().await?;
        let reads = redis_stats.reads_processed().await?;
        let second = scrape_of(admin).await?;
        if tries == TRIES || fleet_calls(&first) == fleet_calls(&second) {
            return Ok(Edge {
                metrics: second,
                commands,
                reads,
                tries,
            });
        }
        first = second;
    }
}

async fn measure(
    target: &Target<'_>,
    messages: &Arc<Messages>,
    args: &Args,
    seconds: f64,
    redis: &RedisServer,
    redis_stats: &mut RawRedis,
    clock_ticks: f64,
) -> Result<Run> {
    let server = target.server;
    // Scrapes and INFO before the CPU readings, so their cost falls outside the run.
    let before = read_edge(server.admin, redis_stats).await?;
    let server_pid = server.proc.pid();
    let ticks = |pid: Option<u32>| {
        let path = pid.map_or_else(
            || "/proc/self/stat".to_owned(),
            |p| format!("/proc/{p}/stat"),
        );
        cpu_ticks_of(&path)
    };
    let (server0, redis0, client0, machine0) = (
        ticks(Some(server_pid)),
        ticks(Some(redis.proc()?.pid())),
        ticks(None),
        machine_jiffies(),
    );

    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let mut workers = JoinSet::new();
    for worker in 0..args.concurrency {
        let mut client = target.clients[worker % target.clients.len()].clone();
        let messages = messages.clone();
        let (concurrency, tenants) = (args.concurrency, args.tenants);
        workers.spawn(async move {
            let mut result = WorkerResult::default();
            let mut n = 0;
            while Instant::now() < deadline {
                // Worker w's n-th decision: tenants spread evenly over workers and time.
                let tenant = (worker + n * concurrency) % tenants;
                n += 1;
                let begun = Instant::now();
                let decided = async {
                    let admitted = admit(&mut client, &messages, tenant).await?;
                    let decided_at = Instant::now();
                    finish(admitted, &messages).await?;
                    Ok::<_, String>(decided_at)
                };
                match tokio::time::timeout(DECISION_TIMEOUT, decided).await {
                    Ok(Ok(decided_at)) => {
                        result.decisions += 1;
                        let micros = decided_at.duration_since(begun).as_micros();
                        result
                            .latencies_us
                            .push(u32::try_from(micros).unwrap_or(u32::MAX));
                    }
                    Ok(Err(error)) => *result.errors.entry(error).or_insert(0) += 1,
                    Err(_) => *result.errors.entry("timeout".to_owned()).or_insert(0) += 1,
                }
            }
            result
        });
    }
    let mut total = WorkerResult::default();
    while let Some(joined) = workers.join_next().await {
        let result = joined.context("a load worker panicked")?;
        total.decisions += result.decisions;
        total.latencies_us.extend(result.latencies_us);
        for (error, count) in result.errors {
            *total.errors.entry(error).or_insert(0) += count;
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let (server1, redis1, client1, machine1) = (
        ticks(Some(server_pid)),
        ticks(Some(redis.proc()?.pid())),
        ticks(None),
        machine_jiffies(),
    );
    server.proc.check_alive()?;
    ensure!(
        total.decisions > 0,
        "{}: no decision completed",
        server.name
    );

    let cpu = |before: Option<u64>, after: Option<u64>| -> Result<f64> {
        let (Some(before), Some(after)) = (before, after) else {
            bail!("cannot read CPU time from /proc");
        };
        Ok(after.saturating_sub(before) as f64 / clock_ticks)
    };
    let server_cpu_s = cpu(server0, server1)?;
    let redis_cpu_s = cpu(redis0, redis1)?;
    let client_cpu_s = cpu(client0, client1)?;
    let other_cpu_s = match (machine0, machine1) {
        (Some((busy0, _)), Some((busy1, _))) => {
            let busy = busy1.saturating_sub(busy0) as f64 / clock_ticks;
            Some((busy - server_cpu_s - redis_cpu_s - client_cpu_s).max(0.0))
        }
        _ => None,
    };
    total.latencies_us.sort_unstable();
    let percentile = |q: f64| {
        let index = ((total.latencies_us.len() as f64 - 1.0) * q).round() as usize;
        f64::from(total.latencies_us[index]) / 1000.0
    };

    let after = read_edge(server.admin, redis_stats).await?;
    // Less our own INFO reads at the end (those at the start came before its reading).
    let reads = (after.reads - before.reads).saturating_sub(after.info_reads());
    let evalsha =
        |stats: &BTreeMap<String, (u64, u64)>| stats.get("evalsha").copied().unwrap_or_default();
    let (calls0, usec0) = evalsha(&before.commands);
    let (calls1, usec1) = evalsha(&after.commands);
    let evalsha_calls = calls1 - calls0;
    let mut fleet_calls = 0;

    let edge_rereadings = (before.tries - 1) + (after.tries - 1);
    let tollgate = match (after.metrics, before.metrics) {
        (Some(after), Some(before)) => {
            let delta = after.minus(&before);
            fleet_calls = delta.sum(FLEET_STORE_CALLS, &[]) as u64;
            let store = "tollgate_store_request_duration_seconds";
            let micros = |seconds: f64| seconds * 1e6;
            Some(TollgateStats {
                admitted: delta.sum(
                    "tollgate_requests_total",
                    &[("route_class", "inference"), ("outcome", "admitted")],
                ),
                decision_mean_us: micros(delta.mean("tollgate_decision_duration_seconds", &[])),
                decision_p50_us: micros(delta.quantile(
                    "tollgate_decision_duration_seconds",
                    &[],
                    0.5,
                )),
                decision_p99_us: micros(delta.quantile(
                    "tollgate_decision_duration_seconds",
                    &[],
                    0.99,
                )),
                reserve_mean_us: micros(delta.mean(store, &[("op", "reserve")])),
                reserve_p99_us: micros(delta.quantile(store, &[("op", "reserve")], 0.99)),
                settle_mean_us: micros(delta.mean(store, &[("op", "settle")])),
                settle_p99_us: micros(delta.quantile(store, &[("op", "settle")], 0.99)),
                batch_calls_mean: delta.mean("tollgate_store_batch_calls", &[]),
                store_errors: delta.sum("tollgate_store_errors_total", &[]),
                degraded: delta.sum("tollgate_degraded_decisions_total", &[]),
            })
        }
        _ => None,
    };
    let redis_view = server.uses_redis.then(|| RedisStats {
        evalsha_calls: evalsha_calls.saturating_sub(fleet_calls),
        fleet_calls,
        edge_rereadings,
        usec_per_evalsha: (usec1 - usec0) as f64 / evalsha_calls.max(1) as f64,
        reads,
    });
    Ok(Run {
        server: server.name,
        decisions: total.decisions,
        wall_s,
        errors: total.errors,
        server_cpu_s,
        redis_cpu_s,
        client_cpu_s,
        other_cpu_s,
        latency_p50_ms: percentile(0.5),
        latency_p99_ms: percentile(0.99),
        tollgate,
        redis: redis_view,
    })
}

// ---------------------------------------------------------------------------------------------
// Prometheus text

/// One scrape of /metrics.
struct Scrape(Vec<Sample>);

/// One line of the exposition: `name{key="value",...} value`.
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

async fn scrape(admin: SocketAddr) -> Result<Scrape> {
    Ok(Scrape::parse(&metrics::scrape(admin).await?.0))
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let value: f64 = value.parse().ok()?;
                let (name, labels) = match series.split_once('{') {
                    Some((name, labels)) => (name, labels.trim_end_matches('}')),
                    None => (series, ""),
                };
                let labels = labels
                    .split(',')
                    .filter_map(|pair| {
                        let (key, value) = pair.split_once('=')?;
                        Some((key.to_owned(), value.trim_matches('"').to_owned()))
                    })
                    .collect();
                Some(Sample {
                    name: name.to_owned(),
                    labels,
                    value,
                })
            })
            .collect();
        Scrape(samples)
    }

    /// Every sample's increase since `before` (counters and histograms only grow).
    fn minus(&self, before: &Scrape) -> Scrape {
        Scrape(
            self.0
                .iter()
                .map(|sample| {
                    let old = before
                        .0
                        .iter()
                        .find(|s| s.name == sample.name && s.labels == sample.labels)
                        .map_or(0.0, |s| s.value);
                    Sample {
                        name: sample.name.clone(),
                        labels: sample.labels.clone(),
                        value: sample.value - old,
                    }
                })
                .collect(),
        )
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&str, &str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0.iter().filter(move |sample| {
            sample.name == name
                && filter
                    .iter()
                    .all(|(k, v)| sample.labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
    }

    /// The sum of every series `name` whose labels include `filter`.
    fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.matching(name, filter).map(|s| s.value).sum()
    }

    fn mean(&self, histogram: &str, filter: &[(&str, &str)]) -> f64 {
        self.sum(&format!("{histogram}_sum"), filter)
            / self.sum(&format!("{histogram}_count"), filter)
    }

    /// The `q` quantile of a histogram, interpolated within its bucket as Prometheus's
    /// `histogram_quantile` does (so only as fine as the buckets).
    fn quantile(&self, histogram: &str, filter: &[(&str, &str)], q: f64) -> f64 {
        let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for sample in self.matching(&format!("{histogram}_bucket"), filter) {
            let Some(le) = sample
                .labels
                .iter()
                .find(|(k, _)| k == "le")
                .and_then(|(_, v)| v.parse::<f64>().ok())
            else {
                continue;
            };
            buckets.entry(le.to_bits()).or_insert((le, 0.0)).1 += sample.value;
        }
        let mut sorted: Vec<(f64, f64)> = buckets.into_values().collect();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let Some(&(_, total)) = sorted.last() else {
            return f64::NAN;
        };
        if total <= 0.0 {
            return f64::NAN;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for (le, cumulative) in sorted {
            if cumulative >= rank {
                if le.is_infinite() {
                    return lower;
                }
                let inside = cumulative - below;
                return lower + (le - lower) * ((rank - below) / inside.max(f64::MIN_POSITIVE));
            }
            (lower, below) = (le, cumulative);
        }
        lower
    }
}

// ---------------------------------------------------------------------------------------------
// Medians and the report

/// One server's runs, by round, and their medians.
struct Summary<'a> {
    runs: Vec<&'a Run>,
}

impl<'a> Summary<'a> {
    fn of(runs: Vec<&'a Run>) -> Summary<'a> {
        Summary { runs }
    }

    fn name(&self) -> &'static str {
        self.runs[0].server
    }

    fn median(&self, field: impl Fn(&Run) -> f64) -> f64 {
        let mut values: Vec<f64> = self.runs.iter().map(|r| field(r)).collect();
        median(&mut values)
    }

    fn median_tollgate(&self, field: impl Fn(&TollgateStats) -> f64) -> Option<f64> {
        let mut values: Vec<f64> = self
            .runs
            .iter()
            .filter_map(|r| r.tollgate.as_ref().map(&field))
            .collect();
        (!values.is_empty()).then(|| median(&mut values))
    }

    fn errors(&self) -> u64 {
        self.runs.iter().flat_map(|r| r.errors.values()).sum()
    }

    fn json(&self) -> Value {
        json!({
            "server": self.name(),
            "decisions_per_s": self.median(Run::throughput),
            "decisions_per_server_cpu_s": self.median(Run::per_server_cpu),
            "decisions_per_server_and_redis_cpu_s": self.median(Run::per_server_and_redis_cpu),
            "server_cores": self.median(|r| r.server_cpu_s / r.wall_s),
            "redis_cores": self.median(|r| r.redis_cpu_s / r.wall_s),
            "client_cores": self.median(|r| r.client_cpu_s / r.wall_s),
            "other_cores": self.median(|r| r.other_cpu_s.unwrap_or(f64::NAN) / r.wall_s),
            "latency_p50_ms": self.median(|r| r.latency_p50_ms),
            "latency_p99_ms": self.median(|r| r.latency_p99_ms),
            "decision_mean_us": self.median_tollgate(|t| t.decision_mean_us),
            "decision_p99_us": self.median_tollgate(|t| t.decision_p99_us),
            "reserve_mean_us": self.median_tollgate(|t| t.reserve_mean_us),
            "settle_mean_us": self.median_tollgate(|t| t.settle_mean_us),
            "errors": self.errors(),
        })
    }
}

struct Report<'a> {
    args: &'a Args,
    machine: &'a Machine,
    server_threads: &'a ServerThreads,
    summaries: &'a [Summary<'a>],
}

/// The per-core target (decisions per CPU-second) and the echo ratio bound.
const TARGET_PER_CORE: f64 = 5000.0;
const TARGET_RATIO: f64 = 3.0;

impl Report<'_> {
    fn find(&self, name: &str) -> Option<&Summary<'_>> {
        self.summaries.iter().find(|s| s.name() == name)
    }

    fn table(&self) -> String {
        let args = self.args;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nDecisions over gRPC, no Envoy: {} streams over {} HTTP/2 connections, {} B chat \
             bodies, {} tenants; medians of {} rounds x {} s",
            args.concurrency,
            args.connections,
            args.body_bytes,
            args.tenants,
            args.rounds,
            args.seconds
        );
        let _ = writeln!(
            out,
            "machine: {} CPUs ({}); load average at start {}; client, servers and Redis share them; \
             servers' worker threads: {}",
            self.machine.cpus,
            self.machine.cpu_model,
            self.machine.loadavg_at_start,
            self.server_threads.describe()
        );
        let _ = writeln!(
            out,
            "\n{:<23} {:>11} {:>15} {:>9} {:>13} {:>10} {:>11} {:>12} {:>21} {:>12} {:>11} {:>6}",
            "server",
            "decisions/s",
            "p50 / p99 ms",
            "srv cores",
            "dec/srv-CPU-s",
            "srv us/dec",
            "redis cores",
            "redis us/dec",
            "dec/(srv+redis)-CPU-s",
            "client cores",
            "other cores",
            "errors"
        );
        for s in self.summaries {
            let redis_us = s.median(|r| r.redis_cpu_s / r.decisions as f64 * 1e6);
            let _ = writeln!(
                out,
                "{:<23} {:>11.0} {:>15} {:>9.2} {:>13.0} {:>10.0} {:>11.2} {:>12} {:>21.0} {:>12.2} \
                 {:>11.2} {:>6}",
                s.name(),
                s.median(Run::throughput),
                format!(
                    "{:.2} / {:.2}",
                    s.median(|r| r.latency_p50_ms),
                    s.median(|r| r.latency_p99_ms)
                ),
                s.median(|r| r.server_cpu_s / r.wall_s),
                s.median(Run::per_server_cpu),
                s.median(|r| r.server_cpu_s / r.decisions as f64 * 1e6),
                s.median(|r| r.redis_cpu_s / r.wall_s),
                if s.runs[0].redis.is_some() {
                    format!("{redis_us:.0}")
                } else {
                    "-".to_owned()
                },
                s.median(Run::per_server_and_redis_cpu),
                s.median(|r| r.client_cpu_s / r.wall_s),
                s.median(|r| r.other_cpu_s.unwrap_or(f64::NAN) / r.wall_s),
                s.errors(),
            );
        }
        let _ = writeln!(
            out,
            "\ndec/...-CPU-s: decisions per CPU-second of that process (per core); us/dec: its \
             CPU-microseconds per decision;\ncores: CPU-seconds per wall second; other: busy CPU of \
             the machine outside these processes (other work sharing the cores)"
        );

        let _ = writeln!(
            out,
            "\nwhere tollgate's time goes (tollgate's histograms and Redis's INFO commandstats; \
             medians over rounds; quantiles bucket-interpolated):"
        );
        for s in self
            .summaries
            .iter()
            .filter(|s| s.runs[0].tollgate.is_some())
        {
            let us = |f: fn(&TollgateStats) -> f64| s.median_tollgate(f).unwrap_or(f64::NAN);
            let _ = writeln!(
                out,
                "  {:<23} decision (body in -> answer) mean {:.0} us, p50 {:.0} us, p99 {:.0} us",
                s.name(),
                us(|t| t.decision_mean_us),
                us(|t| t.decision_p50_us),
                us(|t| t.decision_p99_us),
            );
            if s.runs[0].redis.is_some() {
                let _ = writeln!(
                    out,
                    "  {:<23} store reserve mean {:.0} us (p99 {:.0}), settle mean {:.0} us (p99 \
                     {:.0}); EVALSHA per decision {:.3}, {:.1} us each inside Redis; Redis \
                     reads (about one a batch) per decision {:.3}; calls per batch {:.1}",
                    "",
                    us(|t| t.reserve_mean_us),
                    us(|t| t.reserve_p99_us),
                    us(|t| t.settle_mean_us),
                    us(|t| t.settle_p99_us),
                    s.median(|r| r.evalsha_per_decision().unwrap_or(f64::NAN)),
                    s.median(|r| r.redis.as_ref().map_or(f64::NAN, |x| x.usec_per_evalsha)),
                    s.median(|r| r.reads_per_decision().unwrap_or(f64::NAN)),
                    s.median_tollgate(|t| t.batch_calls_mean)
                        .unwrap_or(f64::NAN),
                );
            }
        }

        let _ = writeln!(out);
        for line in self.verdicts() {
            let _ = writeln!(out, "{line}");
        }
        out
    }

    /// The pairs the targets are judged on: the binary against the echo built like it.
    const PAIRS: [(&'static str, &'static str); 1] = [("echo", "tollgate-redis")];

    /// (echo per CPU-s, tollgate per its CPU-s, per tollgate+Redis CPU-s, wall ratio).
    fn figures(&self, echo: &str, tollgate: &str) -> Option<(f64, f64, f64, f64)> {
        let echo = self.find(echo)?;
        let redis = self.find(tollgate)?;
        Some((
            echo.median(Run::per_server_cpu),
            redis.median(Run::per_server_cpu),
            redis.median(Run::per_server_and_redis_cpu),
            echo.median(Run::throughput) / redis.median(Run::throughput),
        ))
    }

    fn verdicts(&self) -> Vec<String> {
        let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
        let mut lines = Vec::new();
        for (echo_name, name) in Self::PAIRS {
            let Some((echo, own, with_redis, wall_ratio)) = self.figures(echo_name, name) else {
                continue;
            };
            lines.push(format!(
                "{name}: target >= {TARGET_PER_CORE:.0} decisions/s per core: {own:.0} per \
                 tollgate CPU-second {}; {with_redis:.0} per CPU-second of tollgate and Redis \
                 together {}",
                verdict(own >= TARGET_PER_CORE),
                verdict(with_redis >= TARGET_PER_CORE)
            ));
            lines.push(format!(
                "{name}: target within {TARGET_RATIO:.0}x of {echo_name}: {echo:.0} per \
                 CPU-second is {:.2}x tollgate's own {}, {:.2}x counting Redis {}; wall \
                 throughput {echo_name} / {name} {wall_ratio:.2}x",
                echo / own,
                verdict(echo / own <= TARGET_RATIO),
                echo / with_redis,
                verdict(echo / with_redis <= TARGET_RATIO),
            ));
        }
        lines
    }

    fn verdicts_json(&self) -> Value {
        let mut verdicts = serde_json::Map::new();
        for (echo_name, name) in Self::PAIRS {
            if let Some((echo, own, with_redis, wall_ratio)) = self.figures(echo_name, name) {
                verdicts.insert(
                    name.to_owned(),
                    json!({
                        "echo": echo_name,
                        "echo_per_cpu_s": echo,
                        "per_tollgate_cpu_s": own,
                        "per_tollgate_and_redis_cpu_s": with_redis,
                        "ratio_echo_to_tollgate_cpu": echo / own,
                        "ratio_echo_to_tollgate_and_redis_cpu": echo / with_redis,
                        "ratio_echo_to_tollgate_wall": wall_ratio,
                        "per_core_target_met": own >= TARGET_PER_CORE,
                        "per_core_target_met_counting_redis": with_redis >= TARGET_PER_CORE,
                        "ratio_target_met": echo / own <= TARGET_RATIO,
                        "ratio_target_met_counting_redis": echo / with_redis <= TARGET_RATIO,
                    }),
                );
            }
        }
        Value::Object(verdicts)
    }
}

// ---------------------------------------------------------------------------------------------
// Processes, binaries and the machine

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
