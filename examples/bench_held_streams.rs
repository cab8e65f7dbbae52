//! `bench_held_streams`: what it costs tollgate to hold many queued ext_proc streams at once,
//! and whether every one of them is answered at its queue deadline.
//!
//! A queued request is an open gRPC stream whose body tollgate has not answered yet: Envoy waits
//! (tollgate asked it to, with `override_message_timeout`) while the request sits in its
//! tenant's queue. Under overload thousands of them pile up, so their memory decides how deep a
//! queue one replica can afford, and their deadline is what bounds a client's wait.
//!
//! The program starts the release `tollgate` binary on free 127.0.0.1 ports with a budget of one
//! slot (`scheduler.initial_limit: 1`, controller off) and one tier whose queue is deep enough
//! for every stream, then plays Envoy over `--connections` HTTP/2 connections:
//!
//! 1. a *holder* stream sends request headers and a small chat body, is admitted (a
//!    `request_body` answer) and then simply stays open: it holds the only slot for good;
//! 2. `--streams` more streams each send headers and the same body and must get an
//!    `override_message_timeout` answer, meaning "queued". tollgate's resident memory (VmRSS and
//!    RssAnon from /proc/PID/status) is read once the holder is admitted and again once every
//!    stream is queued; the difference over the number of streams is the memory per held stream.
//!    `tollgate_held_streams` and `tollgate_queued_requests` from /metrics confirm the count;
//! 3. nothing frees the slot, so every queued stream must get an ImmediateResponse 503 with
//!    `x-tollgate-reason: queue_timeout`, at its deadline. Lateness is measured here, on the
//!    client side: answer time − the time its body was sent − `--deadline-ms`. tollgate starts
//!    its clock when it begins deciding on the body, so lateness includes the trip there (and
//!    any wait for a worker) and the trip back; the intake round trip (body sent → "queued"
//!    received) and answer − "queued" received − deadline are shown to tell the two apart. A
//!    stream answered otherwise, or not within the deadline + `--grace-ms`, is a failure.
//!
//! tollgate's CPU time (utime + stime from /proc/PID/stat) is read at each step, so the table
//! shows what opening, holding (the quiet time between the last stream queued and the first
//! deadline) and answering cost. Everything goes to 127.0.0.1 only. tollgate is killed when the
//! program ends, also on an error, a panic, Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo build --release --bin tollgate
//! cargo run --release --example bench_held_streams -- --streams 10000 --deadline-ms 20000 --connections 4
//! ```
//!
//! With `--max-queued-body-bytes N` tollgate runs with `scheduler.max_queued_body_bytes: N`, and
//! streams whose body would take the bytes held by queued requests over it must be refused at
//! once with a 503 `queue_bytes_full`; they are counted, and the figures per held stream are
//! taken over the streams that were queued.
//!
//! `scripts/bench-held-streams.sh` does both; results and how to read them are in
//! `docs/benchmarks.md` ("Held streams"). The program prints a Markdown table and exits with
//! status 3 (after printing the table) if any stream was answered wrongly or not at all, or the
//! gauges did not show every stream held at once and none left afterwards.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::ImmediateResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;

use tollgate_testkit::bench::percentile;
use tollgate_testkit::bins;
use tollgate_testkit::host::{Machine, cpu_seconds, status_kib};
use tollgate_testkit::metrics;
use tollgate_testkit::tollgate::TollgateCommand;

#[path = "shared/extproc_client.rs"]
mod extproc_client;

use extproc_client::{
    Stream, chat_body, chat_body_message, chat_headers, client, connect, describe, reason,
};

/// Start-up budget for tollgate; generous because the machine may be compiling meanwhile.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// A single answer during opening (headers, or the queued body) slower than this is a failure:
/// opening is a handful of microseconds of work per message.
const OPEN_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// The holding window stops this long before the first deadline can fire, so no answer
/// falls into it.
const HOLD_MARGIN: Duration = Duration::from_millis(500);
/// How long to wait for tollgate's gauges to settle after the last stream closed.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);
/// tollgate enforces queue_deadline_ms + this ≤ scheduler.envoy_max_message_timeout_ms.
const ENVOY_TIMEOUT_MARGIN_MS: u64 = 500;
/// tollgate's default scheduler.envoy_max_message_timeout_ms.
const DEFAULT_ENVOY_MAX_MESSAGE_TIMEOUT_MS: u64 = 30_000;
/// tollgate's default tokens.max_body_bytes.
const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// The user whose admitted request holds the only slot.
const HOLDER: &str = "holder";

/// Holds many queued ext_proc streams in tollgate at once and measures memory per stream, CPU
/// while holding, and how punctually each is answered at its queue deadline (see the file header
/// of examples/bench_held_streams.rs).
#[derive(Parser, Debug)]
#[command(name = "bench_held_streams")]
struct Args {
    /// Queued streams to hold at once (on top of the one admitted holder).
    #[arg(long, default_value_t = 10_000)]
    streams: usize,
    /// The tier's queue deadline (queue_deadline_ms); must be longer than opening every stream
    /// takes, or the first answers come before the last stream is queued.
    #[arg(long, default_value_t = 20_000)]
    deadline_ms: u64,
    /// HTTP/2 connections the streams are spread over (round robin), as Envoy's cluster would.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Distinct `x-user-id`s of the queued streams: 1 puts every stream in one tenant's queue.
    #[arg(long, default_value_t = 1)]
    users: usize,
    /// Streams being opened (headers and body sent, "queued" not yet received) at any moment.
    #[arg(long, default_value_t = 256)]
    open_concurrency: usize,
    /// Pad the chat message so each request body is this many bytes (default: the small
    /// ~100-byte body), to see whether tollgate keeps body bytes while a request waits.
    #[arg(long)]
    body_bytes: Option<usize>,
    /// A stream not answered within its deadline plus this long counts as unanswered.
    #[arg(long, default_value_t = 5_000)]
    grace_ms: u64,
    /// Tokio worker threads of this client (tollgate runs its own 2 workers).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Run tollgate with `scheduler.max_queued_body_bytes` set to this, so the streams beyond it
    /// are refused with 503 `queue_bytes_full` instead of queued (default: tollgate's own).
    #[arg(long, value_name = "BYTES")]
    max_queued_body_bytes: Option<usize>,
    /// The server to measure [default: target/release/tollgate next to this example]. Anything
    /// that takes tollgate's --config, --grpc-addr and --admin-addr flags and serves /readyz and
    /// /metrics works, e.g. a stripped-down server to compare with.
    #[arg(long, value_name = "FILE")]
    tollgate_bin: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tollgate_testkit::bench::run_bench(
        "bench_held_streams",
        args.client_threads,
        "some streams were not answered as expected; see above",
        bench(&args),
    )
}

/// Runs the whole benchmark; `Ok(false)` if any stream failed (the table is printed anyway).
async fn bench(args: &Args) -> Result<bool> {
    ensure!(args.streams > 0, "--streams must be at least 1");
    ensure!(args.connections > 0, "--connections must be at least 1");
    ensure!(args.users > 0, "--users must be at least 1");
    ensure!(
        args.open_concurrency > 0,
        "--open-concurrency must be at least 1"
    );
    ensure!(args.deadline_ms > 0, "--deadline-ms must be positive");

    let binary = bins::tollgate(args.tollgate_bin.as_deref())?;
    if let Some(warning) = bins::stale_warning(
        &binary,
        &["src", "Cargo.lock"],
        "cargo build --release --bin tollgate",
    ) {
        eprintln!("WARNING: {warning}");
    }
    let machine = Machine::describe(("server", binary.display().to_string()));
    let body: Arc<[u8]> = chat_body(args.body_bytes, "", "hi ")?.into();

    let dir = tempfile::tempdir().context("create a temporary directory")?;
    let config_path = dir.path().join("tollgate.yaml");
    std::fs::write(&config_path, config_yaml(args)).context("write the tollgate config")?;
    let tollgate = TollgateCommand::new(&binary, &config_path)
        // Info logs are a line per start-up step, none per stream.
        .rust_log("info")
        .ready_timeout(READY_TIMEOUT)
        .start(dir.path())
        .await?;
    let (grpc, admin) = (tollgate.grpc, tollgate.admin);
    let pid = tollgate.proc().pid();
    let idle = Snapshot::take(pid)?;

    let channels = connect(grpc, args.connections).await?;
    let holder = Holder::admit(&channels[0], &body).await?;
    // Let the admitted holder's allocations (and the connections') settle before the baseline.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = Snapshot::take(pid)?;
    let client_before = status_kib(std::process::id(), "VmRSS")?;
    let gauges_before = Gauges::read(admin).await?;

    // Open every queued stream; each task reports once it is queued (or failed to be).
    let opening_started = Instant::now();
    let opening = Arc::new(Semaphore::new(args.open_concurrency));
    let (queued_tx, mut queued_rx) = mpsc::unbounded_channel::<Intake>();
    let deadline = Duration::from_millis(args.deadline_ms);
    let grace = Duration::from_millis(args.grace_ms);
    let mut tasks = JoinSet::new();
    for i in 0..args.streams {
        let client = client(&channels[i % channels.len()]);
        let user = format!("waiter-{}", i % args.users);
        let body = body.clone();
        let opening = opening.clone();
        let queued_tx = queued_tx.clone();
        tasks.spawn(async move {
            queued_stream(client, user, body, opening, queued_tx, deadline, grace).await
        });
    }
    drop(queued_tx);
    let mut reported = 0;
    let mut failed_opening = 0;
    let mut queued_count = 0;
    while reported < args.streams {
        match queued_rx.recv().await {
            Some(intake) => {
                reported += 1;
                match intake {
                    Intake::Queued => queued_count += 1,
                    Intake::RefusedBytesFull => {}
                    Intake::Failed => failed_opening += 1,
                }
            }
            None => bail!("stream tasks ended before all reported whether they were queued"),
        }
    }
    let all_queued = Instant::now();
    let held = Snapshot::take(pid)?;
    let client_held = status_kib(std::process::id(), "VmRSS")?;
    let gauges_held = Gauges::read(admin).await?;

    // Holding: nothing happens until the first deadline, which is at the earliest one deadline
    // after opening started. CPU over this quiet time is what holding costs by itself; it starts
    // after the /metrics read above, so rendering metrics is not counted as holding.
    let hold_start = Snapshot::take(pid)?;
    let hold_end = opening_started + deadline;
    let hold = if hold_end > hold_start.at + HOLD_MARGIN {
        tokio::time::sleep_until(hold_end - HOLD_MARGIN).await;
        Some(Snapshot::take(pid)?)
    } else {
        None
    };

    let mut results = Vec::with_capacity(args.streams);
    while let Some(joined) = tasks.join_next().await {
        results.push(joined.context("a stream task panicked")?);
    }
    // Streams close as soon as their answer is read; wait until tollgate has seen every close.
    let gauges_after = Gauges::settle(admin, 1).await?;
    let after = Snapshot::take(pid)?;
    holder.close().await?;
    tollgate.proc().check_alive()?;

    let report = Report {
        args,
        machine,
        binary,
        body_len: body.len(),
        idle,
        before,
        held,
        hold_start,
        hold,
        after,
        opening_seconds: all_queued.duration_since(opening_started).as_secs_f64(),
        client_before,
        client_held,
        gauges_before,
        gauges_held,
        gauges_after,
        failed_opening,
        queued_count,
        results,
    };
    print!("{}", report.table());
    Ok(report.clean())
}

// ---------------------------------------------------------------------------------------------
// The tollgate config

/// One slot, no controller (so the slot count never changes), and one tier deep enough to queue
/// every stream; the cap on queued body bytes if one was asked for.
fn config_yaml(args: &Args) -> String {
    let queue_max = args.streams.max(20_000);
    let envoy_max =
        (args.deadline_ms + ENVOY_TIMEOUT_MARGIN_MS).max(DEFAULT_ENVOY_MAX_MESSAGE_TIMEOUT_MS);
    let mut yaml =
        format!("scheduler:\n  initial_limit: 1\n  envoy_max_message_timeout_ms: {envoy_max}\n");
    if let Some(cap) = args.max_queued_body_bytes {
        // tollgate requires the cap to hold at least one body of tokens.max_body_bytes.
        let _ = write!(
            yaml,
            "  max_queued_body_bytes: {cap}\n\
             tokens:\n  max_body_bytes: {}\n",
            cap.min(DEFAULT_MAX_BODY_BYTES)
        );
    }
    let _ = write!(
        yaml,
        "control:\n  enabled: false\n\
         default_tier: free\n\
         tiers:\n  free:\n    queue_max: {queue_max}\n    queue_deadline_ms: {deadline}\n\
         \x20   max_input_tokens: 1000000\n",
        deadline = args.deadline_ms,
    );
    yaml
}

// ---------------------------------------------------------------------------------------------
// Measurements

/// tollgate's memory and CPU at one instant.
#[derive(Clone, Copy)]
struct Snapshot {
    at: Instant,
    vm_rss_kib: u64,
    rss_anon_kib: u64,
    cpu_seconds: f64,
}

impl Snapshot {
    fn take(pid: u32) -> Result<Snapshot> {
        Ok(Snapshot {
            at: Instant::now(),
            vm_rss_kib: status_kib(pid, "VmRSS")?,
            rss_anon_kib: status_kib(pid, "RssAnon")?,
            cpu_seconds: cpu_seconds(pid)?,
        })
    }
}

/// The gauges that count what tollgate holds.
#[derive(Clone, Copy)]
struct Gauges {
    held_streams: f64,
    queued: f64,
    /// `tollgate_queued_body_bytes`; `None` from a server without it.
    queued_body_bytes: Option<f64>,
}

impl Gauges {
    async fn read(admin: SocketAddr) -> Result<Gauges> {
        let metrics = metrics::scrape(admin).await?;
        let sum = |name: &str| {
            metrics
                .sum_if_any(name, &[])
                .with_context(|| format!("/metrics has no {name}"))
        };
        Ok(Gauges {
            held_streams: sum("tollgate_held_streams")?,
            // One series per tier; the sum is every queued request.
            queued: sum("tollgate_queued_requests")?,
            queued_body_bytes: sum("tollgate_queued_body_bytes").ok(),
        })
    }

    /// Reads until `held_streams` is down to `held` (stream closes reach tollgate
    /// asynchronously) or SETTLE_TIMEOUT passes, then returns the last reading.
    async fn settle(admin: SocketAddr, held: u32) -> Result<Gauges> {
        let started = Instant::now();
        loop {
            let gauges = Gauges::read(admin).await?;
            if gauges.held_streams <= f64::from(held) || started.elapsed() > SETTLE_TIMEOUT {
                return Ok(gauges);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Playing Envoy

/// The admitted request that holds the only slot for the whole run.
struct Holder(Stream);

impl Holder {
    async fn admit(channel: &Channel, body: &[u8]) -> Result<Holder> {
        let mut stream = Stream::open(client(channel)).await?;
        stream.send(chat_headers(HOLDER)).await?;
        let answer = stream.recv().await.context("holder: request headers")?;
        ensure!(
            matches!(answer.response, Some(Response::RequestHeaders(_))),
            "holder: request headers got {}",
            describe(&answer)
        );
        stream.send(chat_body_message(body)).await?;
        let answer = stream.recv().await.context("holder: request body")?;
        ensure!(
            matches!(answer.response, Some(Response::RequestBody(_))),
            "holder: expected admission (a request_body answer), got {}",
            describe(&answer)
        );
        Ok(Holder(stream))
    }

    /// Half-closes as Envoy does when the request ends; tollgate then ends the stream with OK.
    async fn close(self) -> Result<()> {
        let Stream { tx, mut rx } = self.0;
        drop(tx);
        match tokio::time::timeout(Duration::from_secs(5), rx.message()).await {
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(answer))) => {
                bail!("holder: unexpected answer at close: {}", describe(&answer))
            }
            Ok(Err(status)) => bail!("holder: closed with {:?}", status.code()),
            Err(_) => bail!("holder: tollgate did not end the stream within 5 s of the half-close"),
        }
    }
}

/// How a stream's opening went, reported as soon as it is known.
enum Intake {
    /// Answered "queued" (override_message_timeout).
    Queued,
    /// Refused at once with 503 `queue_bytes_full`: the cap on queued body bytes was reached.
    RefusedBytesFull,
    /// Anything else: a failure.
    Failed,
}

/// One queued stream's story, as this client saw it.
struct StreamResult {
    /// Body sent → "queued" received, if it was queued. tollgate starts its deadline clock
    /// within this round trip (when it begins deciding on the body), so it bounds how much
    /// earlier than tollgate the client started its own.
    intake_ms: Option<f64>,
    outcome: Outcome,
}

/// How one queued stream ended.
enum Outcome {
    /// 503 `queue_timeout`. `lateness_ms` = answer − body sent − deadline, what a client sees;
    /// `after_queued_ms` = answer − "queued" answer − deadline, close to tollgate's own
    /// punctuality (its clock starts just before it sends "queued").
    AtDeadline {
        lateness_ms: f64,
        after_queued_ms: f64,
    },
    /// Not queued: refused at once with 503 `queue_bytes_full` (expected only with
    /// `--max-queued-body-bytes`).
    RefusedBytesFull,
    /// Not queued: the headers or the body got something other than the expected answer.
    NotQueued(String),
    /// Queued, but then answered with something other than a 503 `queue_timeout`.
    Wrong(String),
    /// Queued, and no answer within the deadline plus the grace time.
    Unanswered,
}

/// One queued stream from start to finish. Reports on `queued` once it is queued (true) or has
/// failed to be (false), then waits for its answer.
async fn queued_stream(
    client: ExternalProcessorClient<Channel>,
    user: String,
    body: Arc<[u8]>,
    opening: Arc<Semaphore>,
    queued: mpsc::UnboundedSender<Intake>,
    deadline: Duration,
    grace: Duration,
) -> StreamResult {
    // The permit bounds how many streams are mid-opening; it is released once this one is
    // queued, so it does not limit how many are held.
    let permit = opening.acquire_owned().await;
    let opened = tokio::time::timeout(OPEN_ANSWER_TIMEOUT, open_queued(client, &user, &body)).await;
    drop(permit);
    let not_queued = |why: String| {
        let _ = queued.send(Intake::Failed);
        StreamResult {
            intake_ms: None,
            outcome: Outcome::NotQueued(why),
        }
    };
    let (mut stream, sent, queued_at) = match opened {
        Ok(Ok(Some(opened))) => opened,
        Ok(Ok(None)) => {
            let _ = queued.send(Intake::RefusedBytesFull);
            return StreamResult {
                intake_ms: None,
                outcome: Outcome::RefusedBytesFull,
            };
        }
        Ok(Err(error)) => return not_queued(format!("{error:#}")),
        Err(_) => return not_queued(format!("no answer within {OPEN_ANSWER_TIMEOUT:?}")),
    };
    let _ = queued.send(Intake::Queued);
    let answer = tokio::time::timeout_at(sent + deadline + grace, stream.recv()).await;
    let answered = Instant::now();
    let late_ms = |since: Instant| {
        (answered.duration_since(since).as_secs_f64() - deadline.as_secs_f64()) * 1e3
    };
    let outcome = match answer {
        Err(_) => Outcome::Unanswered,
        Ok(Err(error)) => Outcome::Wrong(format!("{error:#}")),
        Ok(Ok(answer)) => match &answer.response {
            Some(Response::ImmediateResponse(reply)) if is_queue_timeout(reply) => {
                Outcome::AtDeadline {
                    lateness_ms: late_ms(sent),
                    after_queued_ms: late_ms(queued_at),
                }
            }
            _ => Outcome::Wrong(describe(&answer)),
        },
    };
    // Dropping `stream` here resets it, as Envoy does once it has sent the local reply.
    StreamResult {
        intake_ms: Some(queued_at.duration_since(sent).as_secs_f64() * 1e3),
        outcome,
    }
}

/// Sends headers and body and waits for "queued"; returns the stream, when its body was sent and
/// when "queued" came back, or `None` if it was refused at once with 503 `queue_bytes_full`.
async fn open_queued(
    client: ExternalProcessorClient<Channel>,
    user: &str,
    body: &[u8],
) -> Result<Option<(Stream, Instant, Instant)>> {
    let mut stream = Stream::open(client).await?;
    stream.send(chat_headers(user)).await?;
    let answer = stream.recv().await.context("request headers")?;
    ensure!(
        matches!(answer.response, Some(Response::RequestHeaders(_))),
        "request headers got {}",
        describe(&answer)
    );
    let sent = Instant::now();
    stream.send(chat_body_message(body)).await?;
    let answer = stream.recv().await.context("request body")?;
    if let Some(Response::ImmediateResponse(reply)) = &answer.response
        && reply.status.as_ref().map(|s| s.code) == Some(503)
        && reason(reply) == Some(b"queue_bytes_full".as_slice())
    {
        return Ok(None);
    }
    ensure!(
        answer.override_message_timeout.is_some() && answer.response.is_none(),
        "request body: expected override_message_timeout (queued), got {}",
        describe(&answer)
    );
    Ok(Some((stream, sent, Instant::now())))
}

fn is_queue_timeout(reply: &ImmediateResponse) -> bool {
    reply.status.as_ref().map(|s| s.code) == Some(503)
        && reason(reply) == Some(b"queue_timeout".as_slice())
}

// ---------------------------------------------------------------------------------------------
// The report

struct Report<'a> {
    args: &'a Args,
    machine: Machine,
    binary: PathBuf,
    body_len: usize,
    /// tollgate ready, nothing connected.
    idle: Snapshot,
    /// The holder admitted; nothing queued.
    before: Snapshot,
    /// Every stream queued.
    held: Snapshot,
    /// Right after the count was read from /metrics: holding starts.
    hold_start: Snapshot,
    /// Just before the first deadline; `None` if opening took so long that there was no quiet
    /// time before it.
    hold: Option<Snapshot>,
    /// Every queued stream closed (only the holder left).
    after: Snapshot,
    opening_seconds: f64,
    client_before: u64,
    client_held: u64,
    gauges_before: Gauges,
    gauges_held: Gauges,
    gauges_after: Gauges,
    failed_opening: usize,
    /// Streams answered "queued"; all of them unless a cap refused some.
    queued_count: usize,
    results: Vec<StreamResult>,
}

impl Report<'_> {
    /// One figure of every stream that has it, sorted.
    fn sorted(&self, figure: impl Fn(&StreamResult) -> Option<f64>) -> Vec<f64> {
        let mut values: Vec<f64> = self.results.iter().filter_map(figure).collect();
        values.sort_by(f64::total_cmp);
        values
    }

    fn lateness(&self) -> Vec<f64> {
        self.sorted(|r| match r.outcome {
            Outcome::AtDeadline { lateness_ms, .. } => Some(lateness_ms),
            _ => None,
        })
    }

    fn count(&self, kind: fn(&Outcome) -> bool) -> usize {
        self.results.iter().filter(|r| kind(&r.outcome)).count()
    }

    fn clean(&self) -> bool {
        let queued = self.queued_count as f64;
        let refused = self.count(|o| matches!(o, Outcome::RefusedBytesFull));
        // Refusals are expected only where a cap was set, and then only for streams over it.
        let refusals_expected = refused == 0 || self.args.max_queued_body_bytes.is_some();
        refusals_expected
            && self.lateness().len() == self.queued_count
            && self.queued_count + refused == self.args.streams
            && self.gauges_held.queued == queued
            && self.gauges_held.held_streams == queued + 1.0
            && self.gauges_after.queued == 0.0
            && self.gauges_after.queued_body_bytes.unwrap_or(0.0) == 0.0
    }

    fn table(&self) -> String {
        let args = self.args;
        // Figures per held stream are over the streams that were queued.
        let streams = self.queued_count.max(1) as f64;
        // Opening covers every stream, queued or refused.
        let opened = args.streams as f64;
        let per_stream =
            |after: u64, before: u64| (after as f64 - before as f64) * 1024.0 / streams;
        let mib = |kib: u64| kib as f64 / 1024.0;
        let lateness = self.lateness();
        let cpu = |to: Snapshot, from: Snapshot| to.cpu_seconds - from.cpu_seconds;
        let not_queued = self.count(|o| matches!(o, Outcome::NotQueued(_)));
        let refused = self.count(|o| matches!(o, Outcome::RefusedBytesFull));
        let wrong = self.count(|o| matches!(o, Outcome::Wrong(_)));
        let unanswered = self.count(|o| matches!(o, Outcome::Unanswered));

        let mut out = String::new();
        let _ = writeln!(
            out,
            "Held streams: {} queued ext_proc streams ({} user{}, {}-byte bodies) over {} HTTP/2 \
             connection{}, queue deadline {} ms, one slot held by an admitted request.",
            args.streams,
            args.users,
            if args.users == 1 { "" } else { "s" },
            self.body_len,
            args.connections,
            if args.connections == 1 { "" } else { "s" },
            args.deadline_ms,
        );
        let _ = writeln!(
            out,
            "Machine: nproc {}, {}; load average {} at start. Server: {}.",
            self.machine.cpus,
            self.machine.cpu_model,
            self.machine.load_averages_at_start(),
            self.binary.display(),
        );
        let _ = writeln!(out);
        let _ = writeln!(out, "| measure | value |");
        let _ = writeln!(out, "|---|---|");
        let mut row = |name: &str, value: String| {
            let _ = writeln!(out, "| {name} | {value} |");
        };
        row(
            "held at once: `tollgate_held_streams` / `tollgate_queued_requests`",
            format!(
                "{} / {} (before opening: {} / {})",
                self.gauges_held.held_streams,
                self.gauges_held.queued,
                self.gauges_before.held_streams,
                self.gauges_before.queued
            ),
        );
        if let Some(cap) = args.max_queued_body_bytes {
            row(
                &format!(
                    "`scheduler.max_queued_body_bytes: {cap}`: queued / refused at once with 503 \
                     `queue_bytes_full`"
                ),
                format!("{} / {refused}", self.queued_count),
            );
        }
        if let Some(bytes) = self.gauges_held.queued_body_bytes {
            row(
                "`tollgate_queued_body_bytes` with every stream queued",
                format!("{bytes} ({:.1} MiB)", bytes / (1024.0 * 1024.0)),
            );
        }
        row(
            "time to open and queue every stream",
            format!(
                "{:.2} s ({:.0} streams/s, {} at a time)",
                self.opening_seconds,
                opened / self.opening_seconds,
                args.open_concurrency
            ),
        );
        row(
            "tollgate VmRSS: ready / holder admitted / all queued / all answered and closed",
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1} MiB",
                mib(self.idle.vm_rss_kib),
                mib(self.before.vm_rss_kib),
                mib(self.held.vm_rss_kib),
                mib(self.after.vm_rss_kib)
            ),
        );
        row(
            "**memory per held stream** (VmRSS all queued − holder admitted) / streams",
            format!(
                "**{:.0} B** ({:.2} KiB)",
                per_stream(self.held.vm_rss_kib, self.before.vm_rss_kib),
                per_stream(self.held.vm_rss_kib, self.before.vm_rss_kib) / 1024.0
            ),
        );
        row(
            "same from RssAnon (heap only, no binary pages)",
            format!(
                "{:.0} B",
                per_stream(self.held.rss_anon_kib, self.before.rss_anon_kib)
            ),
        );
        if let Some(hold) = self.hold {
            row(
                "VmRSS growth while holding (all queued → just before the first deadline)",
                format!(
                    "{:+.1} MiB",
                    (hold.vm_rss_kib as f64 - self.held.vm_rss_kib as f64) / 1024.0
                ),
            );
        }
        row(
            "client (this program) VmRSS per stream",
            format!("{:.0} B", per_stream(self.client_held, self.client_before)),
        );
        row(
            "tollgate CPU opening (headers + body + queued answer)",
            format!(
                "{:.2} s ({:.0} µs per stream)",
                cpu(self.held, self.before),
                cpu(self.held, self.before) * 1e6 / opened
            ),
        );
        row(
            "tollgate CPU while holding",
            match self.hold {
                Some(hold) => {
                    let seconds = hold.at.duration_since(self.hold_start.at).as_secs_f64();
                    format!(
                        "{:.2} s over {seconds:.1} s ({:.2} % of one core)",
                        cpu(hold, self.hold_start),
                        cpu(hold, self.hold_start) * 100.0 / seconds.max(1e-9)
                    )
                }
                None => "n/a: opening took longer than the deadline allows".to_owned(),
            },
        );
        row(
            "tollgate CPU answering at the deadlines (503s + closes)",
            format!(
                "{:.2} s ({:.0} µs per stream)",
                cpu(self.after, self.hold.unwrap_or(self.hold_start)),
                cpu(self.after, self.hold.unwrap_or(self.hold_start)) * 1e6 / streams
            ),
        );
        row(
            "answered 503 `queue_timeout`",
            format!("{} / {}", lateness.len(), self.queued_count),
        );
        row(
            "lateness (answer − body sent − deadline) min / p50 / p99 / max",
            spread(&lateness),
        );
        row(
            "intake round trip (body sent → \"queued\" received) min / p50 / p99 / max",
            spread(&self.sorted(|r| r.intake_ms)),
        );
        row(
            "answer − \"queued\" received − deadline, min / p50 / p99 / max",
            spread(&self.sorted(|r| match r.outcome {
                Outcome::AtDeadline {
                    after_queued_ms, ..
                } => Some(after_queued_ms),
                _ => None,
            })),
        );
        row(
            &format!(
                "not queued / answered otherwise / unanswered within deadline + {} ms",
                args.grace_ms
            ),
            format!("{not_queued} / {wrong} / {unanswered}"),
        );
        row(
            "after: `tollgate_held_streams` / `tollgate_queued_requests`",
            format!(
                "{} / {}",
                self.gauges_after.held_streams, self.gauges_after.queued
            ),
        );
        debug_assert_eq!(not_queued, self.failed_opening);

        // The first few failures of each kind say what went wrong.
        let failures: Vec<String> = self
            .results
            .iter()
            .filter_map(|r| match &r.outcome {
                Outcome::NotQueued(why) => Some(format!("not queued: {why}")),
                Outcome::Wrong(what) => Some(format!("answered otherwise: {what}")),
                Outcome::Unanswered | Outcome::AtDeadline { .. } | Outcome::RefusedBytesFull => {
                    None
                }
            })
            .take(5)
            .collect();
        if !failures.is_empty() {
            let _ = writeln!(out, "\nFirst failures:");
            for failure in failures {
                let _ = writeln!(out, "- {failure}");
            }
        }
        out
    }
}

/// "min / p50 / p99 / max ms" of sorted values.
fn spread(sorted: &[f64]) -> String {
    let at = |q: f64| percentile(sorted, q).map_or("-".to_owned(), |v| format!("{v:.1}"));
    format!("{} / {} / {} / {} ms", at(0.0), at(0.5), at(0.99), at(1.0))
}
