//! `bench_overhead`: how much latency and CPU tollgate adds to a request that goes through Envoy.
//!
//! One Envoy per configuration runs side by side in front of the same example upstream, and the
//! same requests go to each in interleaved rounds (`--configs`, default A,E,B,R):
//!
//! * **A**: Envoy alone, i.e. `envoy/front-proxy.yaml` with the ext_proc HTTP filter and the
//!   `tollgate` cluster cut out (derived from the file at run time, so A can never drift from B);
//! * **E**: `envoy/front-proxy.yaml` as shipped, with `examples/echo_extproc.rs` as its ext_proc
//!   service: an ext_proc that continues everything and reads nothing, the floor any ext_proc
//!   service costs, so B − E is tollgate's own work;
//! * **B**: `envoy/front-proxy.yaml` as shipped, with the release `tollgate` binary as its
//!   ext_proc service, configured by `examples/bench/tollgate.yaml`: the built-in defaults with
//!   the per-user limits lifted out of reach, so every request takes the whole admission path
//!   (count, reserve, settle in the in-memory store) and none is refused;
//! * **R**: B with a second tollgate that keeps its budgets in a `redis-server` of our own
//!   (free loopback port, nothing on disk): one EVALSHA to reserve and one to settle each.
//!
//! Beside them, for what a platform team would deploy instead (`--configs A,B,R,D,F,L`):
//!
//! * **D**: no proxy at all, the client straight to the upstream: the floor every gateway's
//!   added latency is measured from;
//! * **F**: Envoy alone plus Envoy's own `local_ratelimit` filter with a token bucket per
//!   `x-user-id` (A's config with the filter added: `with_local_ratelimit`): the floor for a
//!   per-user decision made inside Envoy, without any RPC;
//! * **L**: LiteLLM's proxy (PyPI `litellm[proxy]`, installed by `scripts/bench-overhead.sh` into
//!   `.tools/litellm`) in front of the same upstream, with per-key rpm/tpm limits on, one worker
//!   per CPU and its rate-limit counters in a `redis-server` of its own, as its production
//!   guide has it (`examples/bench/litellm/`). Each user sends its own key.
//!
//! With `--configs A,B,C` another Envoy runs **C**: B with Envoy's response phases off, so
//! tollgate gets two ext_proc messages per request instead of four; B − C is what observing the
//! response (time to first token, usage) costs. C is the request-only deployment
//! (`envoy/front-proxy-no-response.yaml`); its baseline is **Q** (`--configs A,Q,C`): E with the
//! same response phases off, so C − Q is tollgate's own work there as B − E is in B. **O** is
//! a design experiment: Q plus a second ext_proc filter in `observability_mode` that sends the
//! response to the echo without waiting for answers (`--configs A,E,Q,O --stream-tokens 64`): O −
//! Q is the floor of observing responses that way, against E − Q for every chunk waiting.
//! **P** is B's tollgate behind `envoy/front-proxy-reports.yaml` (the file beside the front proxy
//! B runs): the response reported on instead of streamed through tollgate, a first-token report
//! and a summary through Envoy's access log (`pipeline::reports`). With C and B or P beside it
//! (`--configs A,C,B,P --stream-tokens 64`), an OBSERVING line per observer prints what observing
//! adds over deciding (B − C, P − C) as a ratio to what deciding adds over Envoy alone (C − A),
//! the CPU of Envoy and tollgate per request, each round's and their median. **V** is an
//! ablation: P with the file `--reports-variant` names (another version of the reports file, or
//! one with a part taken out), in the same rounds, and a line with V − P round by round.
//!
//! Every Envoy runs `--concurrency 1 --disable-hot-restart`; everything listens on 127.0.0.1
//! ports picked at start-up, and no request leaves the machine.
//!
//! The load is open loop: request `i` of a run is *due* at `start + i / rate` whatever happened
//! to the earlier ones, and its latency is measured from that due time to the last byte of the
//! response. A slow response therefore cannot delay the next requests and hide itself
//! (coordinated omission). Due times are kept by a dedicated thread with `std::thread::sleep`
//! (typically tens of µs late; the report prints this lag's p99) rather than by tokio's
//! millisecond timer wheel, whose up-to-1-ms rounding would be as large as the effect being
//! measured. Requests go over a pool of HTTP/1.1 keep-alive connections, one pool per Envoy.
//! Every request is the same ~4 KB non-streaming `POST /v1/chat/completions` with
//! `max_tokens: 16`, from one of a few `x-user-id`s in turn. With `--stream-tokens N` they are
//! streamed instead (SSE, N tokens paced by the upstream every `--itl-ms`), and the report adds
//! the gaps between tokens as the client saw them: what Envoy's response-body streaming through
//! ext_proc (one round trip to tollgate per chunk) adds to inter-token latency.
//!
//! For each rate: a warm-up run of every configuration (discarded), then rounds of every
//! configuration in turn, each round starting one configuration later than the one before
//! (A, B, C, then B, C, A, then C, A, B, ...), so that no configuration always runs right
//! after the same one: a place in the round that favours one does not favour it every round.
//! The headline is B − A at p50 and p99, taken per
//! round (A and B of the same round are minutes apart at most, so slow drifts of the machine
//! cancel) and then the median over rounds. CPU per request
//! comes from `/proc/PID/stat` (utime + stime) of every process before and after each run.
//! tollgate's own `tollgate_decision_duration_seconds` histogram and Envoy's ext_proc counters
//! are read around each B run, to tell time spent deciding from time spent getting there.
//!
//! Every response must be a 200; anything else is counted per kind, printed, and makes the
//! program exit with status 3 after the report. Every child process is killed when the program
//! ends, also on an error, a panic, Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo build --release --bin tollgate --example upstream --example echo_extproc
//! cargo run --release --example bench_overhead -- --rates 500,2000 --seconds 10 --rounds 3
//! ```
//!
//! `scripts/bench-overhead.sh` does both (and installs Envoy first); results and how to read them
//! are in `docs/benchmarks.md`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
// The `bytes` crate through axum's re-export: reqwest takes it as a body without copying.
use clap::Parser;
use serde_json::{Value, json};
use tokio::time::Instant;

use tollgate_testkit::bench::{SerialNumbered, median};
use tollgate_testkit::envoy::{
    self, ENVOY_VERSION, Envoy, EnvoyPorts, PER_USER_BUCKET_TOKENS, request_phases_only,
    with_local_ratelimit, with_observer_filter, without_ext_proc,
};
use tollgate_testkit::host::{
    Machine, busy_fraction, clock_ticks_per_second, command_output, cpu_ticks_of, machine_jiffies,
    tree_cpu_ticks,
};
use tollgate_testkit::ports::free_addr;
use tollgate_testkit::process::{Proc, kill_process_group, wait_until};
use tollgate_testkit::redis::{RedisOptions, RedisServer};
use tollgate_testkit::tollgate::{TollgateCommand, TollgateProcess};
use tollgate_testkit::upstream::Upstream;
use tollgate_testkit::{bins, metrics};

/// Start-up budget for each child; generous because the machine may be compiling meanwhile.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// A request slower than this counts as an error: at these rates something is broken.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Quiet time between runs, so the previous run's connections and timers have settled.
const PAUSE_BETWEEN_RUNS: Duration = Duration::from_millis(500);
/// How far ahead of its first due time a run is scheduled, so the dispatcher starts on time.
const SCHEDULE_LEAD: Duration = Duration::from_millis(20);

/// Measures the latency and CPU that tollgate adds to requests through Envoy (see the file
/// header of examples/bench_overhead.rs).
#[derive(Parser, Debug)]
#[command(name = "bench_overhead")]
struct Args {
    /// Offered request rates (requests per second), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![500, 2000])]
    rates: Vec<u32>,
    /// Length of each measured run.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Measured rounds per rate (each round is one run of every configuration, A first).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Length of each warm-up run (per configuration and rate; discarded).
    #[arg(long, default_value_t = 3.0)]
    warmup_seconds: f64,
    /// Size of the request body in bytes (the prose is cut to make the JSON exactly this long).
    #[arg(long, default_value_t = 4096)]
    body_bytes: usize,
    /// Stream the responses (SSE) with this many output tokens each, paced by the upstream at
    /// `--itl-ms`, and report the gaps between tokens as the client sees them: what
    /// response-body streaming through ext_proc adds to inter-token latency. 0: non-streaming
    /// requests with `max_tokens: 16`, answered at once.
    #[arg(long, default_value_t = 0)]
    stream_tokens: u32,
    /// The upstream's delay between tokens in streaming mode (non-streaming answers are not
    /// delayed).
    #[arg(long, default_value_t = 20)]
    itl_ms: u32,
    /// Number of distinct `x-user-id` values the requests cycle over.
    #[arg(long, default_value_t = 8)]
    users: usize,
    /// Tokio worker threads of the load generator (the due-time thread comes on top).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Configurations to compare, comma-separated: A Envoy alone (always run: the baseline),
    /// E Envoy + the echo ext_proc (`examples/echo_extproc.rs`), B Envoy + tollgate with its
    /// embedded store, R Envoy + tollgate with Redis. C is a diagnostic: B with Envoy's
    /// response phases switched off (`response_header_mode: SKIP`, `response_body_mode:
    /// NONE`), so tollgate sees two messages per request instead of four and observes nothing
    /// after its decision. Q is C's baseline: E with the same response phases off. The peers:
    /// D no proxy (the client straight to the upstream), F Envoy with its `local_ratelimit`
    /// filter per user, L LiteLLM's proxy with per-key limits. O (an experiment): Q plus a
    /// second ext_proc filter in `observability_mode` for the response phases, to the echo. P:
    /// B's tollgate behind envoy/front-proxy-reports.yaml (the response reported on). V (an
    /// ablation): P with the file `--reports-variant` names instead, in the same rounds, so
    /// that two reports files are compared against the same A and C.
    #[arg(long, value_delimiter = ',', default_values_t = vec![Config::A, Config::E, Config::B, Config::R])]
    configs: Vec<Config>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// The reports file V runs (required with V): envoy/front-proxy-reports.yaml with
    /// something changed or taken out.
    #[arg(long, value_name = "FILE")]
    reports_variant: Option<PathBuf>,
    /// The Envoy config B runs and A is derived from.
    #[arg(long, value_name = "FILE")]
    envoy_config: Option<PathBuf>,
    /// Envoy binary [default: $ENVOY_BIN, else .tools/envoy-1.40.0/envoy/_bin/envoy].
    #[arg(long, value_name = "FILE")]
    envoy_bin: Option<PathBuf>,
    /// tollgate's configuration [default: examples/bench/tollgate.yaml].
    #[arg(long, value_name = "FILE")]
    tollgate_config: Option<PathBuf>,
    /// tollgate binary [default: target/release/tollgate next to this example].
    #[arg(long, value_name = "FILE")]
    tollgate_bin: Option<PathBuf>,
    /// Example upstream binary [default: target/release/examples/upstream].
    #[arg(long, value_name = "FILE")]
    upstream_bin: Option<PathBuf>,
    /// Echo ext_proc binary, for E [default: target/release/examples/echo_extproc].
    #[arg(long, value_name = "FILE")]
    echo_bin: Option<PathBuf>,
    /// LiteLLM's `litellm` command, for L [default: .tools/litellm/bin/litellm, where
    /// scripts/bench-overhead.sh installs it].
    #[arg(long, value_name = "FILE")]
    litellm_bin: Option<PathBuf>,
    /// redis-server binary, for R [default: redis-server on PATH].
    #[arg(long, value_name = "FILE", default_value = "redis-server")]
    redis_server: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tollgate_testkit::bench::run_bench(
        "bench_overhead",
        args.client_threads,
        "some requests failed; see the flagged runs above",
        async { Ok(matches!(bench(&args).await?, Verdict::Clean)) },
    )
}

/// Whether every request of every run got its 200.
enum Verdict {
    Clean,
    HadErrors,
}

async fn bench(args: &Args) -> Result<Verdict> {
    ensure!(!args.rates.is_empty(), "--rates needs at least one rate");
    ensure!(
        args.rates.iter().all(|&rate| rate > 0),
        "--rates must be positive"
    );
    ensure!(args.seconds > 0.0, "--seconds must be positive");
    ensure!(
        args.warmup_seconds >= 0.0,
        "--warmup-seconds must not be negative"
    );
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(args.users > 0, "--users must be at least 1");

    let root = tollgate_testkit::repo_root();
    let binaries = Binaries::locate(args)?;
    let stale = binaries.stale_warnings();
    for warning in &stale {
        eprintln!("WARNING: {warning}");
    }

    let front_proxy_path = args
        .envoy_config
        .clone()
        .unwrap_or_else(|| root.join("envoy/front-proxy.yaml"));
    let front_proxy = std::fs::read_to_string(&front_proxy_path)
        .with_context(|| format!("read {}", front_proxy_path.display()))?;
    // The declaration order of `Config`: A first (the baseline every other configuration is
    // compared with), the echo's E, Q and O, tollgate's B, C and R, then the peers F and L and
    // D, no proxy.
    let mut configs = args.configs.clone();
    configs.push(Config::A);
    configs.sort_unstable();
    configs.dedup();
    ensure!(
        configs.len() > 1,
        "--configs needs E, Q, O, B, C, P, V, R, F, L or D next to A"
    );
    // P's file sits beside the front proxy B runs.
    let reports_path = front_proxy_path.with_file_name("front-proxy-reports.yaml");
    let reports = if configs.contains(&Config::P) {
        std::fs::read_to_string(&reports_path)
            .with_context(|| format!("read {}", reports_path.display()))?
    } else {
        String::new()
    };
    let variant = match (&args.reports_variant, configs.contains(&Config::V)) {
        (Some(path), true) => {
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?
        }
        (None, true) => bail!("V runs the file --reports-variant names: give one"),
        (_, false) => String::new(),
    };
    let mut envoy_configs = Vec::new();
    for &config in &configs {
        let text = config
            .envoy_config(&front_proxy, &reports, &variant)
            .with_context(|| {
                format!(
                    "derive config {} from {}",
                    config.name(),
                    front_proxy_path.display()
                )
            })?;
        if let Some(text) = text {
            envoy_configs.push((config, text));
        }
    }

    let envoy_version = command_output(&binaries.envoy, &["--version"])
        .and_then(|out| out.split("version: ").nth(1).map(|v| v.trim().to_owned()))
        .unwrap_or_else(|| "?".to_owned());
    let machine = Machine::describe_and_sample(("envoy_version", envoy_version)).await;
    // One numbering over every target and round: no server sees the same body twice.
    let body = Arc::new(SerialNumbered::new(
        chat_body(args.body_bytes, args.stream_tokens)?.into_bytes(),
    )?);
    eprintln!(
        "machine: {}; body {} B; starting processes...",
        machine.headline(),
        args.body_bytes
    );

    let tollgate_config = args
        .tollgate_config
        .clone()
        .unwrap_or_else(|| root.join("examples/bench/tollgate.yaml"));
    ensure!(
        tollgate_config.is_file(),
        "no tollgate config at {}",
        tollgate_config.display()
    );
    let stack = Stack::start(&binaries, &tollgate_config, &configs, &envoy_configs, args).await?;
    let targets = configs
        .iter()
        .map(|&config| Target::new(config, stack.listen(config)?, body.clone()))
        .collect::<Result<Vec<_>>>()?;
    for target in &targets {
        sanity_check(target, &stack).await?;
    }
    let clock_ticks = clock_ticks_per_second();

    let mut rates_json = Vec::new();
    let mut had_errors = false;
    let mut summaries = Vec::new();
    for &rate in &args.rates {
        eprintln!(
            "rate {rate}/s: warm-up {}s per config, then {} rounds of {} x {}s",
            args.warmup_seconds,
            args.rounds,
            configs
                .iter()
                .map(|c| c.name())
                .collect::<Vec<_>>()
                .join(","),
            args.seconds
        );
        let mut warmup_errors = BTreeMap::new();
        if args.warmup_seconds > 0.0 {
            for target in &targets {
                let warm =
                    measure(target, &stack, rate, args, args.warmup_seconds, clock_ticks).await?;
                // Not fatal: a configuration that cannot take this rate fails its measured
                // rounds too, and those are flagged in the report; the other rates still run.
                if !warm.errors.is_empty() {
                    eprintln!(
                        "  warm-up {} at {rate}/s: {} of {} requests failed: {:?}",
                        target.config.name(),
                        warm.error_count(),
                        warm.requests,
                        warm.errors
                    );
                    warmup_errors.insert(target.config.name(), warm.errors);
                }
                tokio::time::sleep(PAUSE_BETWEEN_RUNS).await;
            }
        }
        let mut rounds = Vec::new();
        for round in 1..=args.rounds {
            // Run in a rotated order, kept in the configurations' order.
            let mut runs: Vec<Option<RunSummary>> = targets.iter().map(|_| None).collect();
            for turn in 0..targets.len() {
                let index = (turn + round - 1) % targets.len();
                let target = &targets[index];
                let run = measure(target, &stack, rate, args, args.seconds, clock_ticks).await?;
                eprintln!(
                    "  round {round} {}: p50 {:.3} ms  p99 {:.3} ms  {} errors",
                    target.config.name(),
                    run.latency.p50,
                    run.latency.p99,
                    run.error_count()
                );
                runs[index] = Some(run);
                tokio::time::sleep(PAUSE_BETWEEN_RUNS).await;
            }
            rounds.push(runs.into_iter().flatten().collect());
        }
        let summary = RateSummary {
            rate,
            itl_ms: upstream_itl_ms(args),
            streaming: args.stream_tokens > 0,
            configs: configs.clone(),
            rounds,
            warmup_errors,
        };
        had_errors |= summary.errors() > 0;
        print!("{}", summary.table(args));
        rates_json.push(summary.json());
        summaries.push(summary);
    }
    print!("{}", overall_table(&summaries, &machine, args));

    if let Some(path) = &args.json {
        let report = json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "unix_time": tollgate_testkit::host::unix_seconds(),
            "machine": machine.json(),
            "stale_binaries": stale,
            "settings": {
                "seconds": args.seconds,
                "rounds": args.rounds,
                "warmup_seconds": args.warmup_seconds,
                "body_bytes": args.body_bytes,
                "stream_tokens": args.stream_tokens,
                "itl_ms": upstream_itl_ms(args),
                "users": args.users,
                "client_threads": args.client_threads,
                "envoy_config": front_proxy_path,
                "tollgate_config": tollgate_config,
                // The file itself: a variant is an edited copy that rarely outlives the run.
                "reports_variant": configs.contains(&Config::V).then(|| json!({
                    "path": args.reports_variant,
                    "text": variant,
                })),
                "configs": configs.iter().map(|c| c.label()).collect::<Vec<_>>(),
            },
            "rates": rates_json,
            "flagged": had_errors,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
        eprintln!("JSON written to {}", path.display());
    }
    Ok(if had_errors {
        Verdict::HadErrors
    } else {
        Verdict::Clean
    })
}

// ---------------------------------------------------------------------------------------------
// Binaries and the machine

struct Binaries {
    envoy: PathBuf,
    tollgate: PathBuf,
    upstream: PathBuf,
    echo: PathBuf,
    litellm: PathBuf,
}

impl Binaries {
    /// Flags first, then the defaults: `ENVOY_BIN` or `.tools/` for Envoy (the version the tests
    /// use), and the binaries of this example's own profile, built by `cargo build --release
    /// --bin tollgate --example upstream --example echo_extproc` (`cargo run --example` does not
    /// build them).
    fn locate(args: &Args) -> Result<Binaries> {
        let envoy = match &args.envoy_bin {
            Some(path) => path.clone(),
            None => envoy::binary(ENVOY_VERSION)
                .context("the benchmark runs Envoy (or pass --envoy-bin)")?,
        };
        Ok(Binaries {
            envoy,
            tollgate: bins::tollgate(args.tollgate_bin.as_deref())?,
            upstream: bins::example("upstream", args.upstream_bin.as_deref())?,
            echo: bins::example("echo_extproc", args.echo_bin.as_deref())?,
            litellm: args.litellm_bin.clone().unwrap_or_else(|| {
                tollgate_testkit::repo_root().join(".tools/litellm/bin/litellm")
            }),
        })
    }

    /// Warns when a binary is older than the sources it is built from: `cargo run --example`
    /// rebuilds only this example, so a stale tollgate would silently be measured.
    fn stale_warnings(&self) -> Vec<String> {
        let rebuild = "cargo build --release --bin tollgate --example upstream";
        [
            bins::stale_warning(
                &self.tollgate,
                &["src", "Cargo.toml", "Cargo.lock"],
                rebuild,
            ),
            bins::stale_warning(&self.upstream, &["examples/upstream.rs"], rebuild),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy configs

// ---------------------------------------------------------------------------------------------
// Child processes

/// Everything the benchmark runs. Fields drop in order, the temp dir (configs, logs) last.
struct Stack {
    /// One Envoy per configuration, in the order of the rounds.
    envoys: Vec<(Config, Envoy)>,
    /// tollgate with its embedded store, for B and C.
    tollgate: Option<TollgateProcess>,
    /// tollgate with its budgets in `redis`, for R.
    tollgate_redis: Option<TollgateProcess>,
    redis: Option<RedisServer>,
    /// The echo ext_proc and its gRPC address, for E and Q.
    echo: Option<(Proc, SocketAddr)>,
    /// LiteLLM's proxy and its Redis, for L.
    litellm: Option<LiteLlm>,
    upstream: Upstream,
    dir: tempfile::TempDir,
}

impl Stack {
    /// Starts the upstream, tollgate, and one Envoy per `(configuration, Envoy config)`.
    async fn start(
        binaries: &Binaries,
        tollgate_config: &Path,
        configs: &[Config],
        envoy_configs: &[(Config, String)],
        args: &Args,
    ) -> Result<Stack> {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-bench-")
            .tempdir()
            .context("create a temp dir")?;
        // Only streamed answers are paced: a non-streaming answer from the fixed engine waits
        // out every token's delay before it is sent (16 × 20 ms), which would bury the
        // sub-millisecond figures this benchmark is for.
        let itl_ms = upstream_itl_ms(args).to_string();
        let upstream =
            Upstream::start(&binaries.upstream, ["--itl-ms", &itl_ms], Some(dir.path()))?;
        let upstream_addr = upstream.addr;

        let needs = |wanted: &[Config]| configs.iter().any(|c| wanted.contains(c));
        let tollgate = if needs(&[Config::B, Config::C, Config::P, Config::V]) {
            let name = "tollgate";
            Some(start_tollgate(binaries, tollgate_config, None, name, dir.path()).await?)
        } else {
            None
        };
        let (redis, tollgate_redis) = if needs(&[Config::R]) {
            let redis = RedisServer::launch(RedisOptions {
                binary: Some(args.redis_server.clone()),
                ..RedisOptions::default()
            })
            .await
            .context("R needs redis-server")?;
            let name = "tollgate_redis";
            let url = Some(redis.url.as_str());
            let tollgate = start_tollgate(binaries, tollgate_config, url, name, dir.path()).await?;
            (Some(redis), Some(tollgate))
        } else {
            (None, None)
        };
        let echo = if needs(&[Config::E, Config::Q, Config::O]) {
            let addr = free_addr();
            let proc = Proc::spawn(
                "echo",
                Command::new(&binaries.echo)
                    .args(["--addr", &addr.to_string()])
                    .stdout(Stdio::null()),
                dir.path().join("echo.log"),
            )?;
            wait_until(&proc, READY_TIMEOUT, || async move {
                tokio::net::TcpStream::connect(addr).await.is_ok()
            })
            .await?;
            Some((proc, addr))
        } else {
            None
        };

        let litellm = if needs(&[Config::L]) {
            Some(LiteLlm::start(&binaries.litellm, upstream_addr, args, dir.path()).await?)
        } else {
            None
        };

        let mut envoys = Vec::new();
        for (config, text) in envoy_configs {
            let extproc = match config {
                Config::A | Config::F | Config::L | Config::D => None,
                Config::E | Config::Q | Config::O => echo.as_ref().map(|(_, addr)| addr.port()),
                Config::B | Config::C | Config::P | Config::V => {
                    tollgate.as_ref().map(|t| t.grpc.port())
                }
                Config::R => tollgate_redis.as_ref().map(|t| t.grpc.port()),
            };
            let ports = EnvoyPorts::free_with(upstream_addr.port(), extproc);
            let name = config.envoy_key();
            let envoy = Envoy::launch(&binaries.envoy, name, text, &ports, Some(dir.path()));
            envoys.push((*config, envoy.await?));
        }
        Ok(Stack {
            envoys,
            tollgate,
            tollgate_redis,
            redis,
            echo,
            litellm,
            upstream,
            dir,
        })
    }

    /// Where `config`'s requests go: its Envoy's listener, LiteLLM's, or the upstream itself.
    fn listen(&self, config: Config) -> Result<SocketAddr> {
        match config {
            Config::D => Ok(self.upstream.addr),
            Config::L => self
                .litellm
                .as_ref()
                .map(|litellm| litellm.addr)
                .context("L runs without LiteLLM"),
            _ => self
                .envoys
                .iter()
                .find(|(c, _)| *c == config)
                .map(|(_, envoy)| envoy.listen)
                .with_context(|| format!("{} runs without its Envoy", config.name())),
        }
    }

    /// Every child, keyed as in the CPU figures.
    fn procs(&self) -> Vec<(&'static str, &Proc)> {
        let mut procs: Vec<(&'static str, &Proc)> = self
            .envoys
            .iter()
            .map(|(config, envoy)| (config.envoy_key(), envoy.proc()))
            .collect();
        if let Some(tollgate) = &self.tollgate {
            procs.push(("tollgate", tollgate.proc()));
        }
        if let Some(tollgate) = &self.tollgate_redis {
            procs.push(("tollgate_redis", tollgate.proc()));
        }
        if let Some(Ok(redis)) = self.redis.as_ref().map(RedisServer::proc) {
            procs.push(("redis", redis));
        }
        if let Some((echo, _)) = &self.echo {
            procs.push(("echo", echo));
        }
        if let Some(litellm) = &self.litellm {
            // Its CPU is its whole process tree's (`cpu_snapshot`); listed for the log tails.
            procs.push(("litellm", &litellm.proc));
            if let Ok(redis) = litellm.redis.proc() {
                procs.push(("litellm_redis", redis));
            }
        }
        procs.push(("upstream", self.upstream.proc()));
        procs
    }

    fn log_tails(&self) -> String {
        let mut out = String::new();
        for (_, proc) in self.procs() {
            let _ = writeln!(out, "--- {} ---\n{}", proc.name(), proc.log_tail(20));
        }
        let _ = writeln!(out, "(logs in {})", self.dir.path().display());
        out
    }

    /// The metrics of the tollgate behind `config`, if one is.
    async fn tollgate_metrics(&self, config: Config) -> Option<String> {
        let tollgate = match config {
            Config::B | Config::C | Config::P | Config::V => self.tollgate.as_ref()?,
            Config::R => self.tollgate_redis.as_ref()?,
            Config::A | Config::E | Config::Q | Config::O | Config::F | Config::L | Config::D => {
                return None;
            }
        };
        Some(metrics::scrape(tollgate.admin).await.ok()?.0)
    }

    /// The ext_proc filter counters (`http.ingress.ext_proc.*`) of `config`'s Envoy.
    async fn ext_proc_stats(&self, config: Config) -> Option<BTreeMap<String, u64>> {
        let (_, envoy) = self.envoys.iter().find(|(c, _)| *c == config)?;
        let stats = envoy.stats(r"^http\.ingress\.ext_proc\.").await?;
        Some(
            stats
                .into_iter()
                .filter_map(|(name, value)| {
                    Some((
                        name.strip_prefix("http.ingress.ext_proc.")?.to_owned(),
                        value,
                    ))
                })
                .collect(),
        )
    }
}

/// LiteLLM's proxy (`litellm --config examples/bench/litellm/config.yaml`) with one worker per
/// CPU and a `redis-server` of its own for its rate-limit counters. Killed with all its workers
/// on drop: they are children of its process, in a process group of their own.
struct LiteLlm {
    proc: Proc,
    addr: SocketAddr,
    redis: RedisServer,
}

/// Each key's limits in LiteLLM (examples/bench/litellm/custom_auth.py reads them from the
/// environment): far above the benchmark's rates, as tollgate's are in
/// examples/bench/tollgate.yaml, so every request takes the whole limiter path and none is
/// refused.
const LITELLM_KEY_RPM_LIMIT: u64 = 10_000_000;
const LITELLM_KEY_TPM_LIMIT: u64 = 10_000_000_000;

/// LiteLLM builds its app and loads its model cost map before it listens: tens of seconds on a
/// busy 2-core machine.
const LITELLM_READY_TIMEOUT: Duration = Duration::from_secs(120);

impl LiteLlm {
    async fn start(
        litellm: &Path,
        upstream: SocketAddr,
        args: &Args,
        dir: &Path,
    ) -> Result<LiteLlm> {
        use std::os::unix::process::CommandExt as _;
        ensure!(
            litellm.is_file(),
            "L runs LiteLLM's proxy, and there is no {}: run scripts/bench-overhead.sh, which \
             installs it (or pass --litellm-bin)",
            litellm.display()
        );
        let redis = RedisServer::launch(RedisOptions {
            binary: Some(args.redis_server.clone()),
            ..RedisOptions::default()
        })
        .await
        .context("L needs redis-server")?;
        let config_dir = tollgate_testkit::repo_root().join("examples/bench/litellm");
        let addr = free_addr();
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let proc = Proc::spawn_logged(
            "litellm",
            Command::new(litellm)
                .current_dir(&config_dir)
                .args(["--config", "config.yaml", "--host"])
                .arg(addr.ip().to_string())
                .args(["--port", &addr.port().to_string()])
                .args(["--num_workers", &workers.to_string()])
                .env("BENCH_UPSTREAM_API_BASE", format!("http://{upstream}/v1"))
                .env("LITELLM_MASTER_KEY", "sk-bench-master")
                .env("BENCH_REDIS_HOST", "127.0.0.1")
                .env("BENCH_REDIS_PORT", redis.port.to_string())
                .env("BENCH_KEY_RPM_LIMIT", LITELLM_KEY_RPM_LIMIT.to_string())
                .env("BENCH_KEY_TPM_LIMIT", LITELLM_KEY_TPM_LIMIT.to_string())
                // Production logging (errors only), and the cost map from the package rather
                // than from GitHub (no network here, and none needed).
                .env("LITELLM_LOG", "ERROR")
                .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
                .env("LITELLM_MODE", "PRODUCTION")
                .process_group(0),
            dir.join("litellm.log"),
        )?;
        let litellm = LiteLlm { proc, addr, redis };
        let url = format!("http://{addr}/health/liveliness");
        tollgate_testkit::process::wait_until_http(
            &litellm.proc,
            LITELLM_READY_TIMEOUT,
            &url,
            |_| true,
        )
        .await?;
        Ok(litellm)
    }
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        // The whole group: killing the first process alone would leave its workers running.
        kill_process_group(self.proc.pid());
    }
}

/// Starts the tollgate binary with `config_file` (and Redis at `redis_url`) on free loopback
/// ports, and waits until it is ready.
async fn start_tollgate(
    binaries: &Binaries,
    config_file: &Path,
    redis_url: Option<&str>,
    name: &'static str,
    dir: &Path,
) -> Result<TollgateProcess> {
    let redis_args = redis_url.map(|url| ["--redis-url", url]);
    TollgateCommand::new(&binaries.tollgate, config_file)
        .name(name)
        .args(redis_args.into_iter().flatten())
        .ready_timeout(READY_TIMEOUT)
        .start(dir)
        .await
}

// ---------------------------------------------------------------------------------------------
// The request and the load generator

/// The upstream's delay between tokens: `--itl-ms` when the responses are streamed, none
/// otherwise ("fast upstream, no simulated latency").
fn upstream_itl_ms(args: &Args) -> u32 {
    if args.stream_tokens > 0 {
        args.itl_ms
    } else {
        0
    }
}

/// What sits between the load generator and the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "UPPER")]
// Declaration order is report order (derived `Ord`): the baselines first. The JSON diffs a
// configuration over a baseline only if it comes later, so Q must stay before C.
#[derive(PartialOrd, Ord)]
enum Config {
    /// Envoy alone: the baseline.
    A,
    /// Envoy + an ext_proc that continues everything: the floor of any ext_proc service.
    E,
    /// E without the response phases: the floor of a request-only ext_proc service, C's baseline.
    Q,
    /// Experiment: Q plus a second ext_proc filter in `observability_mode` for the response.
    O,
    /// Envoy + tollgate with its embedded store, envoy/front-proxy.yaml as shipped.
    B,
    /// Diagnostic: B without the response phases.
    C,
    /// B with the response reported on instead of streamed (envoy/front-proxy-reports.yaml).
    P,
    /// Ablation: P with another reports file (`--reports-variant`).
    V,
    /// Envoy + tollgate with its budgets in Redis.
    R,
    /// Peer floor: Envoy with its own `local_ratelimit` filter, a token bucket per user.
    F,
    /// Peer: LiteLLM's proxy with per-key limits, its counters in Redis.
    L,
    /// No proxy: the client straight to the upstream.
    D,
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::A => "A",
            Config::E => "E",
            Config::Q => "Q",
            Config::O => "O",
            Config::B => "B",
            Config::R => "R",
            Config::C => "C",
            Config::P => "P",
            Config::V => "V",
            Config::F => "F",
            Config::L => "L",
            Config::D => "D",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Config::A => "A  Envoy alone",
            Config::E => "E  Envoy + echo",
            Config::Q => "Q  E, request only",
            Config::O => "O  Q + observer filter",
            Config::B => "B  Envoy + tollgate",
            Config::R => "R  Envoy + tollgate+Redis",
            Config::C => "C  B, request only",
            Config::P => "P  B, response reported",
            Config::V => "V  P, variant file",
            Config::F => "F  Envoy + local_ratelimit",
            Config::L => "L  LiteLLM + Redis",
            Config::D => "D  no proxy",
        }
    }

    /// The key of this configuration's Envoy in the CPU figures (D and L have none: no process
    /// has their key, so their Envoy CPU is 0).
    fn envoy_key(self) -> &'static str {
        match self {
            Config::A => "envoy_a",
            Config::E => "envoy_e",
            Config::Q => "envoy_q",
            Config::O => "envoy_o",
            Config::B => "envoy_b",
            Config::R => "envoy_r",
            Config::C => "envoy_c",
            Config::P => "envoy_p",
            Config::V => "envoy_v",
            Config::F => "envoy_f",
            Config::L | Config::D => "no_envoy",
        }
    }

    /// The processes behind this configuration's ext_proc filter, as keyed in the CPU figures;
    /// for L, LiteLLM (all its workers) and its Redis, which stand where Envoy and tollgate do.
    fn ext_proc_processes(self) -> &'static [&'static str] {
        match self {
            Config::A | Config::F | Config::D => &[],
            Config::E | Config::Q | Config::O => &["echo"],
            Config::B | Config::C | Config::P | Config::V => &["tollgate"],
            Config::R => &["tollgate_redis", "redis"],
            Config::L => &["litellm", "litellm_redis"],
        }
    }

    /// The response header a peer's limiter sets, and its value when the per-user limit counted
    /// the request: Envoy's per-user bucket (`with_local_ratelimit`), LiteLLM's per-key limit
    /// (`LITELLM_KEY_RPM_LIMIT`).
    fn limit_header(self) -> Option<(&'static str, String)> {
        match self {
            Config::F => Some(("x-ratelimit-limit", PER_USER_BUCKET_TOKENS.to_string())),
            Config::L => Some((
                "x-ratelimit-api_key-limit-requests",
                LITELLM_KEY_RPM_LIMIT.to_string(),
            )),
            _ => None,
        }
    }

    fn has_ext_proc(self) -> bool {
        matches!(
            self,
            Config::E
                | Config::Q
                | Config::O
                | Config::B
                | Config::C
                | Config::P
                | Config::V
                | Config::R
        )
    }

    /// P and V: the response reported on, by a first-token stream and the access log.
    fn is_reported(self) -> bool {
        matches!(self, Config::P | Config::V)
    }

    fn uses_tollgate(self) -> bool {
        matches!(
            self,
            Config::B | Config::R | Config::C | Config::P | Config::V
        )
    }

    /// The echo configuration with the same ext_proc phases: what a tollgate configuration
    /// adds over it is tollgate's own work, the figure the target over the echo is about.
    /// `None` for the baselines.
    fn echo_baseline(self) -> Option<Config> {
        match self {
            Config::A
            | Config::E
            | Config::Q
            | Config::O
            | Config::P
            | Config::V
            | Config::F
            | Config::L
            | Config::D => None,
            Config::B | Config::R => Some(Config::E),
            Config::C => Some(Config::Q),
        }
    }

    /// This configuration's Envoy config, derived from `front_proxy` (P's is `reports`, the
    /// reports deployment's file as shipped, and V's `variant`); `None` for the two without an
    /// Envoy.
    fn envoy_config(
        self,
        front_proxy: &str,
        reports: &str,
        variant: &str,
    ) -> Result<Option<String>> {
        Ok(Some(match self {
            Config::P => reports.to_owned(),
            Config::V => variant.to_owned(),
            Config::A => without_ext_proc(front_proxy)?,
            Config::E | Config::B | Config::R => front_proxy.to_owned(),
            Config::Q | Config::C => request_phases_only(front_proxy)?,
            Config::O => with_observer_filter(front_proxy)?,
            Config::F => with_local_ratelimit(front_proxy)?,
            Config::L | Config::D => return Ok(None),
        }))
    }
}

/// One Envoy to load, with its own connection pool.
struct Target {
    config: Config,
    url: String,
    /// The body every request is a copy of, with its own serial number (4 KB copied per
    /// request: the client's cost, not a server's).
    body: Arc<SerialNumbered>,
    client: reqwest::Client,
}

impl Target {
    fn new(config: Config, listen: SocketAddr, body: Arc<SerialNumbered>) -> Result<Target> {
        ensure!(listen.ip().is_loopback(), "only loopback targets");
        let client = reqwest::Client::builder()
            .no_proxy()
            // Envoy's downstream here is HTTP/1.1: each in-flight request holds a connection,
            // and idle ones are kept so the steady state opens none.
            .http1_only()
            .pool_max_idle_per_host(4096)
            .pool_idle_timeout(None)
            .tcp_nodelay(true)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .context("build the load client")?;
        Ok(Target {
            config,
            url: format!("http://{listen}/v1/chat/completions"),
            body,
            client,
        })
    }

    fn request(&self, user: &str) -> reqwest::RequestBuilder {
        let request = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("x-user-id", user)
            .body(self.body.next());
        if self.config == Config::L {
            // LiteLLM knows users by their keys (examples/bench/litellm/custom_auth.py).
            request.bearer_auth(format!("sk-bench-{user}"))
        } else {
            request
        }
    }
}

/// A chat request body of exactly `bytes` bytes: ASCII prose (no characters JSON escapes) in
/// one user message, after `SerialNumbered::PLACEHOLDER` and a space (the prose has no digits);
/// `max_tokens: 16`, non-streaming, or with `stream_tokens` > 0 streamed with that many tokens.
fn chat_body(bytes: usize, stream_tokens: u32) -> Result<String> {
    let render = |content: &str| {
        let mut body = json!({
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 16,
        });
        if stream_tokens > 0 {
            body["max_tokens"] = json!(stream_tokens);
            body["stream"] = json!(true);
        }
        body.to_string()
    };
    let serial = format!("{} ", SerialNumbered::PLACEHOLDER);
    let skeleton = render(&serial).len();
    ensure!(
        bytes > skeleton,
        "--body-bytes must be over {skeleton} (the JSON around the prose)"
    );
    const PROSE: &str = "The admission service reads each request before it reaches the model \
        server, estimates how many tokens the prompt will cost, and decides whether the tenant \
        still has budget for it. Most requests are admitted at once; a few wait briefly in a \
        fair queue while the shared capacity recovers, and the rest are told when to retry. \
        Operators watch the time to first token, the queue depth and the share each tenant \
        receives, and they tune the limits so that one busy team cannot starve the others. ";
    let mut content = String::with_capacity(bytes);
    content.push_str(&serial);
    while content.len() < bytes - skeleton + serial.len() {
        content.push_str(PROSE);
    }
    content.truncate(bytes - skeleton + serial.len());
    let body = render(&content);
    ensure!(
        body.len() == bytes,
        "body is {} bytes, not {bytes}",
        body.len()
    );
    Ok(body)
}

/// One request's fate.
struct Sample {
    /// Due time to the last byte of the response.
    latency: Duration,
    /// Due time to when the request task started: the load generator's own lateness.
    lag: Duration,
    /// When the response was complete (for the achieved rate).
    done: Instant,
    /// `None` for a 200, else what went wrong.
    error: Option<String>,
    /// Streaming responses: the time between consecutive SSE events carrying a token, in ns,
    /// as they arrived at the client (events that arrive in one read are 0 apart).
    token_gaps: Vec<u64>,
}

async fn one_request(request: reqwest::RequestBuilder, due: Instant) -> Sample {
    let started = Instant::now();
    let mut token_gaps = Vec::new();
    let error = match request.send().await {
        Ok(response) => {
            let status = response.status();
            // tollgate names the reason of every refusal; without it, the answer is Envoy's own
            // (e.g. status_on_error when the ext_proc stream failed) or the upstream's.
            let reason = response
                .headers()
                .get("x-tollgate-reason")
                .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned());
            // Read the whole body: the latency is to the last byte, as a client sees it.
            match read_body(response, &mut token_gaps).await {
                Ok(()) if status == reqwest::StatusCode::OK => None,
                Ok(()) => Some(match reason {
                    Some(reason) => format!("HTTP {} tollgate {reason}", status.as_u16()),
                    None => format!("HTTP {}", status.as_u16()),
                }),
                Err(error) => Some(classify(&error)),
            }
        }
        Err(error) => Some(classify(&error)),
    };
    let done = Instant::now();
    Sample {
        latency: done.saturating_duration_since(due),
        lag: started.saturating_duration_since(due),
        done,
        error,
        token_gaps,
    }
}

/// Reads a response to its end, noting in `token_gaps` when each SSE token event arrived
/// after the previous one (the first token's wait is the time to first token, not a gap).
async fn read_body(
    mut response: reqwest::Response,
    token_gaps: &mut Vec<u64>,
) -> Result<(), reqwest::Error> {
    let mut last_token: Option<Instant> = None;
    while let Some(chunk) = response.chunk().await? {
        let now = Instant::now();
        // Token events carry `"content":`; the role-only first event, the usage event and
        // `[DONE]` do not.
        for _ in 0..count_token_events(&chunk) {
            if let Some(last) = last_token {
                token_gaps.push(now.saturating_duration_since(last).as_nanos() as u64);
            }
            last_token = Some(now);
        }
    }
    Ok(())
}

fn count_token_events(chunk: &[u8]) -> usize {
    const MARK: &[u8] = b"\"content\":";
    chunk.windows(MARK.len()).filter(|w| *w == MARK).count()
}

fn classify(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "timeout".to_owned()
    } else if error.is_connect() {
        "connect error".to_owned()
    } else if error.is_body() || error.is_decode() {
        "body error".to_owned()
    } else {
        "request error".to_owned()
    }
}

/// Sets the flag when dropped, so the dispatcher thread stops if its run is abandoned.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Sends `rate × seconds` requests open loop and gathers their samples.
async fn open_loop(target: &Target, rate: u32, seconds: f64, users: &[String]) -> Result<Run> {
    let count = (f64::from(rate) * seconds).round() as u64;
    let interval_ns = 1e9 / f64::from(rate);
    let cancel = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    let runtime = tokio::runtime::Handle::current();
    // Requests are built here, not in the thread, so that thread only sleeps and spawns.
    let requests: Vec<reqwest::RequestBuilder> = (0..count)
        .map(|i| target.request(&users[i as usize % users.len()]))
        .collect();
    let dispatcher = tokio::task::spawn_blocking(move || {
        // The clock starts once the requests are built and this thread runs.
        let start = Instant::now() + SCHEDULE_LEAD;
        let mut handles = Vec::with_capacity(requests.len());
        for (i, request) in requests.into_iter().enumerate() {
            if cancel.load(Ordering::Relaxed) {
                break;
            }
            let due = start + Duration::from_nanos((i as f64 * interval_ns) as u64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            handles.push(runtime.spawn(one_request(request, due)));
        }
        (start, handles)
    });
    let (start, handles) = dispatcher.await.context("dispatcher thread")?;
    let mut samples = Vec::with_capacity(handles.len());
    for handle in handles {
        samples.push(handle.await.context("request task")?);
    }
    Ok(Run { start, samples })
}

struct Run {
    start: Instant,
    samples: Vec<Sample>,
}

/// Percentiles of one run, in milliseconds.
#[derive(Clone, Copy, Default)]
struct Latency {
    p50: f64,
    p90: f64,
    p99: f64,
    p999: f64,
    max: f64,
    mean: f64,
}

impl Latency {
    fn of(durations: &mut [u64]) -> Latency {
        durations.sort_unstable();
        let ms = |ns: u64| ns as f64 / 1e6;
        let mean = if durations.is_empty() {
            0.0
        } else {
            ms(durations.iter().sum::<u64>()) / durations.len() as f64
        };
        Latency {
            p50: ms(percentile(durations, 0.50)),
            p90: ms(percentile(durations, 0.90)),
            p99: ms(percentile(durations, 0.99)),
            p999: ms(percentile(durations, 0.999)),
            max: ms(durations.last().copied().unwrap_or(0)),
            mean,
        }
    }

    fn json(&self) -> Value {
        json!({"p50": self.p50, "p90": self.p90, "p99": self.p99, "p99.9": self.p999,
               "max": self.max, "mean": self.mean})
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One measured (or warm-up) run of one configuration, reduced to what the report needs.
struct RunSummary {
    requests: u64,
    ok: u64,
    errors: BTreeMap<String, u64>,
    /// Over successful requests only: an error's latency says nothing about the overhead.
    latency: Latency,
    /// Streaming runs: the gaps between tokens over all successful responses.
    token_gap: Option<Latency>,
    /// p50 / p99 of the load generator's lateness in starting requests, ms.
    lag_p50: f64,
    lag_p99: f64,
    /// Successful responses per second, from the first due time to the last completion.
    achieved_rps: f64,
    /// CPU-seconds per process over the run: envoy_a, envoy_b, tollgate, upstream, loadgen.
    cpu_seconds: BTreeMap<&'static str, f64>,
    /// Fraction of the whole machine's CPU time that was busy during the run.
    machine_busy: Option<f64>,
    /// B runs: tollgate's decision-time histogram over the run.
    decision: Option<HistogramDelta>,
    /// B runs: Envoy's ext_proc counters over the run.
    ext_proc: Option<BTreeMap<String, u64>>,
    /// P runs: tollgate's report counters over the run, by their labels.
    reports: BTreeMap<String, f64>,
}

impl RunSummary {
    fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "latency_ms": self.latency.json(),
            "token_gap_ms": self.token_gap.as_ref().map(Latency::json),
            "generator_lag_ms": {"p50": self.lag_p50, "p99": self.lag_p99},
            "achieved_rps": self.achieved_rps,
            "cpu_seconds": self.cpu_seconds,
            "machine_busy": self.machine_busy,
            "tollgate_decision": self.decision.as_ref().map(HistogramDelta::json),
            "tollgate_response_reports": self.reports,
            "envoy_ext_proc_stats": self.ext_proc,
        })
    }
}

/// Runs `target` for `seconds` at `rate` and reads every process's CPU and the B-side counters
/// around it.
async fn measure(
    target: &Target,
    stack: &Stack,
    rate: u32,
    args: &Args,
    seconds: f64,
    clock_ticks: f64,
) -> Result<RunSummary> {
    let users: Vec<String> = (0..args.users).map(|i| format!("bench-{i}")).collect();
    let metrics_before = stack.tollgate_metrics(target.config).await;
    let stats_before = if target.config.has_ext_proc() {
        stack.ext_proc_stats(target.config).await
    } else {
        None
    };
    let cpu_before = cpu_snapshot(stack);
    let machine_before = machine_jiffies();

    let run = open_loop(target, rate, seconds, &users).await?;

    let cpu_after = cpu_snapshot(stack);
    let machine_after = machine_jiffies();
    let metrics_after = stack.tollgate_metrics(target.config).await;
    let decision = match (&metrics_before, &metrics_after) {
        (Some(before), Some(after)) => {
            HistogramDelta::between(before, after, "tollgate_decision_duration_seconds")
        }
        _ => None,
    };
    let reports = match (&metrics_before, &metrics_after) {
        (Some(before), Some(after)) if target.config.is_reported() => {
            counter_deltas(before, after, "tollgate_response_reports_total")
        }
        _ => BTreeMap::new(),
    };
    let ext_proc = match (stats_before, stack.ext_proc_stats(target.config).await) {
        (Some(before), Some(after)) => Some(
            after
                .into_iter()
                .map(|(name, value)| {
                    let delta = value.saturating_sub(before.get(&name).copied().unwrap_or(0));
                    (name, delta)
                })
                .filter(|(_, delta)| *delta > 0)
                .collect(),
        ),
        _ => None,
    };

    let mut latencies = Vec::with_capacity(run.samples.len());
    let mut lags: Vec<u64> = Vec::with_capacity(run.samples.len());
    let mut token_gaps: Vec<u64> = Vec::new();
    let mut errors = BTreeMap::new();
    let mut last_done = run.start;
    for sample in &run.samples {
        lags.push(sample.lag.as_nanos() as u64);
        match &sample.error {
            None => {
                latencies.push(sample.latency.as_nanos() as u64);
                token_gaps.extend_from_slice(&sample.token_gaps);
                last_done = last_done.max(sample.done);
            }
            Some(error) => *errors.entry(error.clone()).or_insert(0) += 1,
        }
    }
    lags.sort_unstable();
    let ok = latencies.len() as u64;
    let elapsed = last_done.saturating_duration_since(run.start).as_secs_f64();
    let cpu_seconds = cpu_before
        .iter()
        .filter_map(|(name, before)| {
            let after = cpu_after.get(name)?;
            Some((*name, after.saturating_sub(*before) as f64 / clock_ticks))
        })
        .collect();
    let machine_busy = busy_fraction(machine_before, machine_after);
    Ok(RunSummary {
        requests: run.samples.len() as u64,
        ok,
        errors,
        latency: Latency::of(&mut latencies),
        token_gap: (!token_gaps.is_empty()).then(|| Latency::of(&mut token_gaps)),
        lag_p50: percentile(&lags, 0.50) as f64 / 1e6,
        lag_p99: percentile(&lags, 0.99) as f64 / 1e6,
        achieved_rps: if elapsed > 0.0 {
            ok as f64 / elapsed
        } else {
            0.0
        },
        cpu_seconds,
        machine_busy,
        decision,
        ext_proc,
        reports,
    })
}

fn cpu_snapshot(stack: &Stack) -> BTreeMap<&'static str, u64> {
    let mut snapshot: BTreeMap<&'static str, u64> = stack
        .procs()
        .into_iter()
        .filter_map(|(name, proc)| Some((name, proc.cpu_ticks()?)))
        .collect();
    if let Some(litellm) = &stack.litellm
        && let Some(ticks) = tree_cpu_ticks(litellm.proc.pid())
    {
        // LiteLLM serves from worker processes its own process starts.
        snapshot.insert("litellm", ticks);
    }
    if let Some(ticks) = cpu_ticks_of("/proc/self/stat") {
        snapshot.insert("loadgen", ticks);
    }
    snapshot
}

/// Sends one request through `target` and checks it went the way the configuration says: a
/// 200 from the upstream, and tollgate's request headers present exactly on B.
async fn sanity_check(target: &Target, stack: &Stack) -> Result<()> {
    let response = target
        .request("bench-sanity")
        .send()
        .await
        .with_context(|| format!("first request through {}", target.config.label()))?;
    let status = response.status();
    let headers = response.headers().clone();
    // The upstream repeats every x-tollgate-* request header as x-upstream-saw-x-tollgate-*.
    let saw_tollgate = headers
        .keys()
        .any(|name| name.as_str().starts_with("x-upstream-saw-x-tollgate-"));
    let body = response.text().await.unwrap_or_default();
    ensure!(
        status == reqwest::StatusCode::OK,
        "first request through {} got {status}: {body}\n{}",
        target.config.label(),
        stack.log_tails()
    );
    // The peers' own limiters answered: each reports the limit that counted the request.
    if let Some((header, expected)) = target.config.limit_header() {
        let limit = headers
            .get(header)
            .map(|v| String::from_utf8_lossy(v.as_bytes()));
        ensure!(
            limit.as_deref() == Some(expected.as_str()),
            "{}: expected {header}: {expected} on the response (its limiter counted the \
             request), got {limit:?}",
            target.config.label()
        );
    }
    if target.config == Config::P {
        // A reports deployment whose reports go nowhere would still answer every request, and
        // would look cheap: its first request must be timed and settled by its reports. Not V:
        // an ablation may leave a report out on purpose (its reports per request are printed).
        let tollgate = stack
            .tollgate
            .as_ref()
            .context("P runs without B's tollgate")?;
        metrics::wait_for_metrics(tollgate.admin, |m| {
            for report in ["first_token", "summary"] {
                let report_label = format!("report=\"{report}\"");
                let labels = [report_label.as_str(), "outcome=\"matched\""];
                let matched = m.find("tollgate_response_reports_total", &labels);
                if matched.unwrap_or(0.0) < 1.0 {
                    return Err(format!("{report} matched: {matched:?}"));
                }
            }
            Ok(())
        })
        .await
        .with_context(|| {
            format!(
                "{}: tollgate got no first-token report or no summary for the first request\n{}",
                target.config.label(),
                stack.log_tails()
            )
        })?;
    }
    if target.config.uses_tollgate() {
        ensure!(
            saw_tollgate,
            "{}: the request reached the upstream without tollgate's x-tollgate-* headers",
            target.config.label()
        );
    } else {
        ensure!(
            !saw_tollgate,
            "{} should not pass through tollgate",
            target.config.label()
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// tollgate's histogram

/// The change of each series of the counter `name` between two scrapes, keyed by its labels
/// (`report="summary",outcome="matched"`).
fn counter_deltas(before: &str, after: &str, name: &str) -> BTreeMap<String, f64> {
    let series = |text: &str| -> BTreeMap<String, f64> {
        text.lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(name)?.strip_prefix('{')?;
                let (labels, value) = rest.split_once("} ")?;
                Some((labels.to_owned(), value.trim().parse().ok()?))
            })
            .collect()
    };
    let before = series(before);
    series(after)
        .into_iter()
        .map(|(labels, value)| {
            let delta = value - before.get(&labels).copied().unwrap_or(0.0);
            (labels, delta)
        })
        .collect()
}

/// The change of a Prometheus histogram between two scrapes.
struct HistogramDelta {
    /// (upper bound in seconds, cumulative count), ascending; +Inf last.
    buckets: Vec<(f64, u64)>,
    count: u64,
    sum_seconds: f64,
}

impl HistogramDelta {
    fn between(before: &str, after: &str, name: &str) -> Option<HistogramDelta> {
        let before = parse_histogram(before, name)?;
        let after = parse_histogram(after, name)?;
        let buckets = after
            .buckets
            .iter()
            .map(|&(le, count)| {
                let earlier = before
                    .buckets
                    .iter()
                    .find(|(l, _)| *l == le)
                    .map_or(0, |(_, c)| *c);
                (le, count.saturating_sub(earlier))
            })
            .collect();
        Some(HistogramDelta {
            buckets,
            count: after.count.saturating_sub(before.count),
            sum_seconds: after.sum_seconds - before.sum_seconds,
        })
    }

    fn mean_us(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_seconds / self.count as f64 * 1e6)
    }

    /// The upper bound of the bucket holding quantile `q`, in µs; infinite past the last bound.
    fn quantile_bound_us(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let wanted = (q * self.count as f64).ceil() as u64;
        self.buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= wanted)
            .map(|(le, _)| le * 1e6)
    }

    fn json(&self) -> Value {
        json!({
            "count": self.count,
            "mean_us": self.mean_us(),
            "p50_bucket_bound_us": self.quantile_bound_us(0.5),
            "p99_bucket_bound_us": self.quantile_bound_us(0.99),
            "buckets": self.buckets.iter().map(|(le, c)| json!([le, c])).collect::<Vec<_>>(),
        })
    }
}

/// Reads `name_bucket{...le="X"...} N`, `name_sum S` and `name_count N` from Prometheus text,
/// adding up series that differ in other labels.
fn parse_histogram(text: &str, name: &str) -> Option<HistogramDelta> {
    let mut buckets: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    let mut count = None;
    let mut sum = None;
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let (series_name, labels) = series.split_once('{').unwrap_or((series, ""));
        if series_name == format!("{name}_bucket") {
            let Some(le) = labels
                .split(',')
                .find_map(|label| label.trim().strip_prefix("le=\""))
                .and_then(|le| le.split('"').next())
            else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            buckets.entry(le.to_owned()).or_insert((bound, 0)).1 += value as u64;
        } else if series_name == format!("{name}_count") {
            *count.get_or_insert(0) += value as u64;
        } else if series_name == format!("{name}_sum") {
            *sum.get_or_insert(0.0) += value;
        }
    }
    let mut buckets: Vec<(f64, u64)> = buckets.into_values().collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Some(HistogramDelta {
        buckets,
        count: count?,
        sum_seconds: sum?,
    })
}

// ---------------------------------------------------------------------------------------------
// Summaries and tables

/// All runs at one offered rate: `rounds[r][k]` is round `r` of `configs[k]`.
struct RateSummary {
    rate: u32,
    /// The upstream's pacing between tokens (streaming mode).
    itl_ms: u32,
    /// Streamed responses (`--stream-tokens`): the targets do not apply.
    streaming: bool,
    configs: Vec<Config>,
    rounds: Vec<Vec<RunSummary>>,
    /// Failed warm-up requests per configuration (reported, not counted in the rounds).
    warmup_errors: BTreeMap<&'static str, BTreeMap<String, u64>>,
}

impl RateSummary {
    fn runs(&self, config: Config) -> impl Iterator<Item = &RunSummary> {
        let index = self.configs.iter().position(|c| *c == config);
        self.rounds
            .iter()
            .filter_map(move |round| round.get(index?))
    }

    /// The configurations compared with A.
    fn others(&self) -> impl Iterator<Item = Config> + '_ {
        self.configs.iter().copied().filter(|c| *c != Config::A)
    }

    /// The `(configuration, baseline)` pairs of the per-round difference columns: every
    /// configuration over A, then C over Q when both ran, so the spread over rounds of the
    /// request-only deployment's figure over the echo shows beside its TARGETS line.
    fn per_round_pairs(&self) -> Vec<(Config, Config)> {
        let mut pairs: Vec<(Config, Config)> = self.others().map(|c| (c, Config::A)).collect();
        if self.configs.contains(&Config::C) && self.configs.contains(&Config::Q) {
            pairs.push((Config::C, Config::Q));
        }
        pairs
    }

    fn errors(&self) -> u64 {
        self.rounds
            .iter()
            .flatten()
            .map(RunSummary::error_count)
            .sum()
    }

    fn has_token_gaps(&self, config: Config) -> bool {
        self.runs(config).any(|run| run.token_gap.is_some())
    }

    /// Median over rounds of one figure of one configuration.
    fn median_of(&self, config: Config, figure: impl Fn(&RunSummary) -> f64) -> f64 {
        median(&mut self.runs(config).map(figure).collect::<Vec<_>>())
    }

    /// `config` − A of one latency figure, per round (the two runs were minutes apart at most).
    fn added_per_round(&self, config: Config, figure: impl Fn(&Latency) -> f64) -> Vec<f64> {
        self.added_over_per_round(config, Config::A, figure)
    }

    /// `config` − `baseline` of one latency figure, per round.
    fn added_over_per_round(
        &self,
        config: Config,
        baseline: Config,
        figure: impl Fn(&Latency) -> f64,
    ) -> Vec<f64> {
        self.runs(config)
            .zip(self.runs(baseline))
            .map(|(run, baseline)| figure(&run.latency) - figure(&baseline.latency))
            .collect()
    }

    /// The headline: median over rounds of the per-round `config` − A differences.
    fn added(&self, config: Config, figure: impl Fn(&Latency) -> f64) -> f64 {
        median(&mut self.added_per_round(config, figure))
    }

    /// Median over rounds of the per-round `config` − `baseline` differences; NaN when
    /// `baseline` was not run.
    fn added_over(
        &self,
        config: Config,
        baseline: Config,
        figure: impl Fn(&Latency) -> f64,
    ) -> f64 {
        if !self.configs.contains(&baseline) {
            return f64::NAN;
        }
        median(&mut self.added_over_per_round(config, baseline, figure))
    }

    /// CPU-seconds per request, in µs, of everything behind `config`'s ext_proc filter.
    fn ext_proc_cpu_us_per_request(&self, config: Config) -> f64 {
        config
            .ext_proc_processes()
            .iter()
            .map(|process| self.cpu_us_per_request(config, process))
            .sum()
    }

    /// The targets a tollgate configuration is held to: over A (issue 2: p50 < 1 ms; the load
    /// lab's: p50 < 0.5 ms, p99 < 1.5 ms) and over the echo ext_proc with the same phases, its
    /// `echo_baseline` (p50 < 0.25 ms), when that ran: C over E would charge tollgate with
    /// response phases C does not have. The verdict is the median's; beside it, how many
    /// rounds were under the target and the range of the per-round differences, because on a
    /// shared machine one run's median can fall on either side of a target that sits inside
    /// the rounds' spread.
    fn verdicts(&self, config: Config) -> Vec<String> {
        let over_a_p50 = PerRound::new(self.added_per_round(config, |l| l.p50));
        let over_a_p99 = PerRound::new(self.added_per_round(config, |l| l.p99));
        let mut lines = vec![format!(
            "{}: over A p50 {} {} {}; p99 {} {}",
            config.name(),
            over_a_p50.spread(),
            over_a_p50.verdict(1.0),
            over_a_p50.verdict(P50_OVER_ENVOY_TARGET_MS),
            over_a_p99.spread(),
            over_a_p99.verdict(1.5),
        )];
        if let Some(echo) = config.echo_baseline()
            && self.configs.contains(&echo)
        {
            let over_echo_p50 = PerRound::new(self.added_over_per_round(config, echo, |l| l.p50));
            lines.push(format!(
                "{}: over {} p50 {} {}; p99 {:+.3} ms",
                config.name(),
                echo.name(),
                over_echo_p50.spread(),
                over_echo_p50.verdict(0.25),
                self.added_over(config, echo, |l| l.p99),
            ));
        }
        lines
    }

    /// The echo configurations to print a FLOOR for: those that are the echo baseline of a
    /// tollgate configuration that ran (the line is about the room they leave tollgate).
    fn floors(&self) -> Vec<Config> {
        self.others()
            .filter(|&echo| {
                self.others()
                    .any(|config| config.echo_baseline() == Some(echo))
            })
            .collect()
    }

    /// What the echo ext_proc alone (`config`: E or Q) adds over A at p50: the floor of any
    /// ext_proc service with its phases on this machine, which the over-A target must leave
    /// room above for the service's own work.
    fn floor(&self, config: Config) -> String {
        let over_a = PerRound::new(self.added_per_round(config, |l| l.p50));
        // Medians of differences do not add up exactly, hence "about".
        let room = P50_OVER_ENVOY_TARGET_MS - over_a.median;
        format!(
            "{}: an ext_proc that does nothing adds p50 {} over A; under the \
             {P50_OVER_ENVOY_TARGET_MS} ms target that leaves about {room:+.3} ms for everything \
             tollgate does with these phases",
            config.name(),
            over_a.spread(),
        )
    }

    /// CPU-seconds of `process` over all of `config`'s runs, per request, in µs.
    fn cpu_us_per_request(&self, config: Config, process: &str) -> f64 {
        let (seconds, requests) = self.runs(config).fold((0.0, 0u64), |(s, n), run| {
            (
                s + run.cpu_seconds.get(process).copied().unwrap_or(0.0),
                n + run.requests,
            )
        });
        if requests == 0 {
            f64::NAN
        } else {
            seconds / requests as f64 * 1e6
        }
    }

    /// tollgate's decision histogram summed over `config`'s runs.
    fn decision(&self, config: Config) -> Option<HistogramDelta> {
        let mut total: Option<HistogramDelta> = None;
        for run in self.runs(config) {
            let delta = run.decision.as_ref()?;
            match &mut total {
                None => {
                    total = Some(HistogramDelta {
                        buckets: delta.buckets.clone(),
                        count: delta.count,
                        sum_seconds: delta.sum_seconds,
                    })
                }
                Some(total) => {
                    total.count += delta.count;
                    total.sum_seconds += delta.sum_seconds;
                    for (bucket, (_, count)) in total.buckets.iter_mut().zip(&delta.buckets) {
                        bucket.1 += count;
                    }
                }
            }
        }
        total
    }

    /// Envoy's ext_proc counters summed over `config`'s runs.
    fn ext_proc(&self, config: Config) -> BTreeMap<String, u64> {
        let mut total = BTreeMap::new();
        for stats in self.runs(config).filter_map(|run| run.ext_proc.as_ref()) {
            for (name, value) in stats {
                *total.entry(name.clone()).or_insert(0) += value;
            }
        }
        total
    }

    fn table(&self, args: &Args) -> String {
        let mut out = String::new();
        let w = &mut out;
        let names: Vec<&str> = self.configs.iter().map(|c| c.name()).collect();
        let _ = writeln!(
            w,
            "\n== {} req/s offered: {} rounds x {} s per config ({} interleaved), body {} B, {} \
             users ==",
            self.rate,
            self.rounds.len(),
            args.seconds,
            names.join(","),
            args.body_bytes,
            args.users
        );
        let _ = writeln!(
            w,
            "{:<24}{:>9}{:>9}{:>9}{:>9}{:>12}{:>8}",
            "latency (ms)", "p50", "p90", "p99", "max", "achieved/s", "errors"
        );
        for &config in &self.configs {
            let max = self.runs(config).map(|r| r.latency.max).fold(0.0, f64::max);
            let errors: u64 = self.runs(config).map(RunSummary::error_count).sum();
            let _ = writeln!(
                w,
                "{:<24}{:>9.3}{:>9.3}{:>9.3}{:>9.2}{:>12.1}{:>8}{}",
                config.label(),
                self.median_of(config, |r| r.latency.p50),
                self.median_of(config, |r| r.latency.p90),
                self.median_of(config, |r| r.latency.p99),
                max,
                self.median_of(config, |r| r.achieved_rps),
                errors,
                if errors > 0 { "  <-- FLAGGED" } else { "" }
            );
        }
        let _ = writeln!(
            w,
            "(p50, p90, p99, achieved: median over rounds; max: over all rounds)"
        );
        for &config in &self.configs {
            let mut errors: BTreeMap<&str, u64> = BTreeMap::new();
            for run in self.runs(config) {
                for (kind, count) in &run.errors {
                    *errors.entry(kind.as_str()).or_insert(0) += count;
                }
            }
            if !errors.is_empty() {
                let kinds: Vec<String> = errors
                    .iter()
                    .map(|(kind, count)| format!("{count} x {kind}"))
                    .collect();
                let _ = writeln!(w, "FLAGGED {}: {}", config.label(), kinds.join(", "));
            }
        }
        for (config, errors) in &self.warmup_errors {
            let kinds: Vec<String> = errors
                .iter()
                .map(|(kind, count)| format!("{count} x {kind}"))
                .collect();
            let _ = writeln!(w, "(warm-up of {config}, discarded: {})", kinds.join(", "));
        }

        let mut header = format!("{:<24}", "per round (ms)");
        for name in &names {
            let _ = write!(
                header,
                "{:>9}{:>9}",
                format!("{name} p50"),
                format!("{name} p99")
            );
        }
        let pairs = self.per_round_pairs();
        for (config, baseline) in &pairs {
            let _ = write!(
                header,
                "{:>9}{:>9}",
                format!("{config}-{baseline} p50"),
                format!("{config}-{baseline} p99")
            );
        }
        let _ = writeln!(w, "{header}");
        for (i, round) in self.rounds.iter().enumerate() {
            let mut line = format!("{:<24}", format!("round {}", i + 1));
            for run in round {
                let _ = write!(line, "{:>9.3}{:>9.3}", run.latency.p50, run.latency.p99);
            }
            for &(config, baseline) in &pairs {
                let p50 = self.added_over_per_round(config, baseline, |l| l.p50);
                let p99 = self.added_over_per_round(config, baseline, |l| l.p99);
                let _ = write!(line, "{:>+9.3}{:>+9.3}", p50[i], p99[i]);
            }
            let _ = writeln!(w, "{line}");
        }
        for config in self.others() {
            let _ = writeln!(
                w,
                "ADDED BY {} over A (median of per-round differences): p50 {:+.3} ms, p90 \
                 {:+.3} ms, p99 {:+.3} ms",
                config.label(),
                self.added(config, |l| l.p50),
                self.added(config, |l| l.p90),
                self.added(config, |l| l.p99),
            );
        }
        if self.configs.iter().any(|&c| self.has_token_gaps(c)) {
            let _ = writeln!(
                w,
                "{:<24}{:>9}{:>9}{:>9}{:>12}{:>12}",
                "gap between tokens (ms)", "p50", "p90", "p99", "-A p50", "-A p99"
            );
            for &config in &self.configs {
                let gap = |figure: fn(&Latency) -> f64| {
                    self.median_of(config, |r| r.token_gap.as_ref().map_or(f64::NAN, figure))
                };
                let added = |figure: fn(&Latency) -> f64| {
                    if config == Config::A {
                        f64::NAN
                    } else {
                        median(
                            &mut self
                                .runs(config)
                                .zip(self.runs(Config::A))
                                .filter_map(|(run, baseline)| {
                                    Some(
                                        figure(run.token_gap.as_ref()?)
                                            - figure(baseline.token_gap.as_ref()?),
                                    )
                                })
                                .collect::<Vec<_>>(),
                        )
                    }
                };
                let _ = writeln!(
                    w,
                    "{:<24}{:>9.3}{:>9.3}{:>9.3}{:>+12.3}{:>+12.3}",
                    config.label(),
                    gap(|l| l.p50),
                    gap(|l| l.p90),
                    gap(|l| l.p99),
                    added(|l| l.p50),
                    added(|l| l.p99),
                );
            }
            let _ = writeln!(
                w,
                "(as the client saw them, median over rounds; the upstream sends one token every \
                 {} ms; -A: median of per-round differences with Envoy alone)",
                self.itl_ms
            );
        }
        // The latency targets are for the non-streaming requests; a streamed response's
        // duration is mostly the upstream's pacing.
        if !self.streaming {
            for config in self.floors() {
                let _ = writeln!(w, "FLOOR {}", self.floor(config));
            }
            for config in self.others().filter(|c| c.uses_tollgate()) {
                for line in self.verdicts(config) {
                    let _ = writeln!(w, "TARGETS {line}");
                }
            }
        }

        let _ = writeln!(
            w,
            "{:<24}{:>9}{:>10}{:>10}{:>10}{:>14}{:>14}",
            "CPU per request (us)",
            "Envoy",
            "ext_proc",
            "upstream",
            "load gen",
            "machine busy",
            "gen lag p99"
        );
        for &config in &self.configs {
            let _ = writeln!(
                w,
                "{:<24}{:>9.1}{:>10.1}{:>10.1}{:>10.1}{:>13.0}%{:>11.3} ms",
                config.label(),
                self.cpu_us_per_request(config, config.envoy_key()),
                self.ext_proc_cpu_us_per_request(config),
                self.cpu_us_per_request(config, "upstream"),
                self.cpu_us_per_request(config, "loadgen"),
                self.median_of(config, |r| r.machine_busy.unwrap_or(f64::NAN)) * 100.0,
                self.median_of(config, |r| r.lag_p99),
            );
        }
        let _ = writeln!(
            w,
            "(CPU-seconds from /proc over all rounds / requests; ext_proc: the echo, tollgate, or \
             tollgate and Redis; machine busy: all CPUs, median over rounds)"
        );
        for config in self.others() {
            let _ = write!(w, "{}", self.tollgate_view(config));
        }
        let _ = write!(w, "{}", self.peers());
        let _ = write!(w, "{}", self.observing());
        out
    }

    /// CPU-seconds per request, in µs, of everything between the client and the upstream:
    /// Envoy and what its ext_proc filter calls, or LiteLLM and its Redis.
    fn gateway_cpu_us_per_request(&self, config: Config) -> f64 {
        self.cpu_us_per_request(config, config.envoy_key())
            + self.ext_proc_cpu_us_per_request(config)
    }

    /// tollgate side by side with what a platform team would deploy instead, when D ran: what
    /// each gateway adds over no proxy and the CPU it spends per request, then tollgate's
    /// figures as ratios to LiteLLM's (L) and its decision's to Envoy's local_ratelimit (F).
    fn peers(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        if !self.configs.contains(&Config::D) {
            return out;
        }
        let gateways: Vec<Config> = self
            .configs
            .iter()
            .copied()
            .filter(|&c| c != Config::D)
            .collect();
        let _ = writeln!(
            w,
            "{:<27}{:>40}{:>40}{:>16}",
            "PEERS: over D (no proxy)", "added p50 ms", "added p99 ms", "gateway CPU us"
        );
        for &config in &gateways {
            let p50 = PerRound::new(self.added_over_per_round(config, Config::D, |l| l.p50));
            let p99 = PerRound::new(self.added_over_per_round(config, Config::D, |l| l.p99));
            let _ = writeln!(
                w,
                "{:<27}{:>40}{:>40}{:>16.1}",
                config.label(),
                p50.spread(),
                p99.spread(),
                self.gateway_cpu_us_per_request(config),
            );
        }
        let _ = writeln!(
            w,
            "(added: median of per-round differences with D, and their range; gateway CPU: Envoy \
             and its ext_proc service, or LiteLLM's processes and its Redis, over all rounds / \
             requests)"
        );
        let over_d = |config: Config, figure: fn(&Latency) -> f64| {
            self.added_over(config, Config::D, figure)
        };
        if self.configs.contains(&Config::L) {
            for config in [Config::B, Config::R]
                .into_iter()
                .filter(|c| self.configs.contains(c))
            {
                let _ = writeln!(
                    w,
                    "PEERS {} over L: added p50 {:.3}x, added p99 {:.3}x, gateway CPU {:.3}x",
                    config.name(),
                    over_d(config, |l| l.p50) / over_d(Config::L, |l| l.p50),
                    over_d(config, |l| l.p99) / over_d(Config::L, |l| l.p99),
                    self.gateway_cpu_us_per_request(config)
                        / self.gateway_cpu_us_per_request(Config::L),
                );
            }
        }
        if self.configs.contains(&Config::F) {
            // The decision alone: what each adds to Envoy alone, in latency and in CPU (Envoy's
            // own extra work included: the ext_proc filter's for tollgate, the filter's for F).
            let decision_cpu = |config: Config| {
                self.gateway_cpu_us_per_request(config) - self.gateway_cpu_us_per_request(Config::A)
            };
            for config in [Config::B, Config::R]
                .into_iter()
                .filter(|c| self.configs.contains(c))
            {
                let _ = writeln!(
                    w,
                    "PEERS {} over F, the decision alone (each minus A): added p50 {:+.3} ms \
                     against {:+.3} ms, CPU {:+.1} us against {:+.1} us per request",
                    config.name(),
                    self.added(config, |l| l.p50),
                    self.added(Config::F, |l| l.p50),
                    decision_cpu(config),
                    decision_cpu(Config::F),
                );
            }
        }
        out
    }

    /// Envoy's and its ext_proc service's CPU per request of each of `config`'s runs, in µs.
    fn gateway_cpu_per_round(&self, config: Config) -> Vec<f64> {
        self.runs(config)
            .map(|run| {
                let seconds: f64 = std::iter::once(config.envoy_key())
                    .chain(config.ext_proc_processes().iter().copied())
                    .map(|process| run.cpu_seconds.get(process).copied().unwrap_or(0.0))
                    .sum();
                seconds / run.requests.max(1) as f64 * 1e6
            })
            .collect()
    }

    /// What `config` adds over `baseline`, round by round (the same round's runs).
    fn gateway_cpu_added_per_round(&self, config: Config, baseline: Config) -> Vec<f64> {
        let baseline = self.gateway_cpu_per_round(baseline);
        self.gateway_cpu_per_round(config)
            .iter()
            .zip(&baseline)
            .map(|(x, b)| x - b)
            .collect()
    }

    /// What observing the response costs, when C ran beside B, P or V (issue 17): per round,
    /// the CPU (Envoy and tollgate) that deciding adds over Envoy alone (C − A) and that
    /// observing adds over deciding (B − C streamed, P − C and V − C reported), with the ratio
    /// the issue holds to at most 1; streamed runs add the inter-token p99 over A. With P and V,
    /// also V − P per round, with or without C.
    fn observing(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        let observers: Vec<Config> = [Config::B, Config::P, Config::V]
            .into_iter()
            .filter(|c| self.configs.contains(c))
            .collect();
        let us = |values: &[f64]| {
            let rounds = PerRound::new(values.to_vec());
            let (low, high) = rounds.range();
            format!("{:.0} us (rounds {low:.0} to {high:.0})", rounds.median)
        };
        if self.configs.contains(&Config::P) && self.configs.contains(&Config::V) {
            // The two files against each other, round by round: steadier than either's
            // difference with C, which carries C's own noise as well.
            let variant = self.gateway_cpu_added_per_round(Config::V, Config::P);
            let _ = writeln!(
                w,
                "OBSERVING V - P (the variant file against the shipped one): {}",
                us(&variant)
            );
        }
        if !self.configs.contains(&Config::C) || observers.is_empty() {
            return out;
        }
        let deciding = self.gateway_cpu_added_per_round(Config::C, Config::A);
        let _ = writeln!(
            w,
            "OBSERVING: deciding (C - A) costs {} of Envoy + tollgate CPU per request",
            us(&deciding)
        );
        for config in observers {
            let observing = self.gateway_cpu_added_per_round(config, Config::C);
            let ratios: Vec<f64> = observing
                .iter()
                .zip(&deciding)
                .map(|(o, d)| o / d)
                .collect();
            let ratio = PerRound::new(ratios);
            let (low, high) = ratio.range();
            let within = ratio.values.iter().filter(|&&r| r <= 1.0).count();
            let mut line = format!(
                "OBSERVING {} - C: {}, {:.2}x deciding (rounds {low:.2} to {high:.2}) [<= 1x: {}, {within}/{} rounds]",
                config.name(),
                us(&observing),
                ratio.median,
                if ratio.median <= 1.0 {
                    "met"
                } else {
                    "NOT met"
                },
                ratio.values.len(),
            );
            if self.has_token_gaps(config) {
                let gaps: Vec<f64> = self
                    .runs(config)
                    .zip(self.runs(Config::A))
                    .filter_map(|(run, baseline)| {
                        Some(run.token_gap.as_ref()?.p99 - baseline.token_gap.as_ref()?.p99)
                    })
                    .collect();
                let gaps = PerRound::new(gaps);
                let _ = write!(
                    line,
                    "; inter-token p99 over A {} {}",
                    gaps.spread(),
                    gaps.verdict(1.0)
                );
            }
            let _ = writeln!(w, "{line}");
        }
        out
    }

    /// What tollgate's histogram and Envoy's ext_proc counters say about `config`'s runs.
    fn tollgate_view(&self, config: Config) -> String {
        let mut out = String::new();
        if let Some(decision) = self.decision(config) {
            let bound = |q: f64| match decision.quantile_bound_us(q) {
                Some(b) if b.is_finite() => format!("<= {b:.0} us"),
                Some(_) => "above the last bucket".to_owned(),
                None => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                "{}: tollgate_decision_duration_seconds: {} decisions, mean {:.1} us, p50 {}, \
                 p99 {}",
                config.name(),
                decision.count,
                decision.mean_us().unwrap_or(f64::NAN),
                bound(0.5),
                bound(0.99),
            );
        }
        let mut reports: BTreeMap<&str, f64> = BTreeMap::new();
        for run in self.runs(config) {
            for (labels, delta) in &run.reports {
                *reports.entry(labels.as_str()).or_default() += delta;
            }
        }
        if !reports.is_empty() {
            let requests: u64 = self.runs(config).map(|r| r.requests).sum();
            let counted: Vec<String> = reports
                .iter()
                .filter(|(_, count)| **count > 0.0)
                .map(|(labels, count)| format!("{labels} {:.3}", count / requests.max(1) as f64))
                .collect();
            let _ = writeln!(
                out,
                "{}: tollgate_response_reports_total per request: {}",
                config.name(),
                counted.join(", ")
            );
        }
        let ext_proc = self.ext_proc(config);
        if !ext_proc.is_empty() {
            let requests: u64 = self.runs(config).map(|r| r.requests).sum();
            let per_request = |name: &str| {
                ext_proc.get(name).copied().unwrap_or(0) as f64 / requests.max(1) as f64
            };
            let others: Vec<String> = ext_proc
                .iter()
                .filter(|(name, _)| {
                    !matches!(
                        name.as_str(),
                        "streams_started"
                            | "stream_msgs_sent"
                            | "stream_msgs_received"
                            | "streams_closed"
                    )
                })
                .map(|(name, value)| format!("{name}={value}"))
                .collect();
            let _ = writeln!(
                out,
                "{}: Envoy ext_proc per request: {:.2} streams, {:.2} messages to tollgate, {:.2} \
                 answers{}",
                config.name(),
                per_request("streams_started"),
                per_request("stream_msgs_sent"),
                per_request("stream_msgs_received"),
                if others.is_empty() {
                    String::new()
                } else {
                    format!("; other counters: {}", others.join(", "))
                }
            );
        }
        out
    }

    fn json(&self) -> Value {
        let mut configs = serde_json::Map::new();
        for &config in &self.configs {
            let mut cpu = serde_json::Map::new();
            let processes = [config.envoy_key(), "upstream", "loadgen"];
            for process in processes.iter().chain(config.ext_proc_processes()) {
                cpu.insert(
                    (*process).to_owned(),
                    json!(self.cpu_us_per_request(config, process)),
                );
            }
            let added_over = |baseline: Config| {
                (config > baseline && self.configs.contains(&baseline)).then(|| {
                    json!({
                        "p50": self.added_over(config, baseline, |l| l.p50),
                        "p90": self.added_over(config, baseline, |l| l.p90),
                        "p99": self.added_over(config, baseline, |l| l.p99),
                        "p50_per_round": self.added_over_per_round(config, baseline, |l| l.p50),
                        "p99_per_round": self.added_over_per_round(config, baseline, |l| l.p99),
                    })
                })
            };
            configs.insert(
                config.name().to_owned(),
                json!({
                    "label": config.label(),
                    "median_over_rounds_ms": {
                        "p50": self.median_of(config, |r| r.latency.p50),
                        "p90": self.median_of(config, |r| r.latency.p90),
                        "p99": self.median_of(config, |r| r.latency.p99),
                    },
                    "added_over_a_ms": added_over(Config::A),
                    "added_over_e_ms": added_over(Config::E),
                    // Only where Q is the like-for-like echo: B − Q or R − Q would mix phases.
                    "added_over_q_ms": added_over(Config::Q)
                        .filter(|_| config.echo_baseline() == Some(Config::Q)),
                    "cpu_us_per_request": cpu,
                    "gateway_cpu_us_per_request": self.gateway_cpu_us_per_request(config),
                    // D, no proxy, is declared last: every gateway over it.
                    "added_over_d_ms": (config != Config::D && self.configs.contains(&Config::D))
                        .then(|| json!({
                            "p50": self.added_over(config, Config::D, |l| l.p50),
                            "p99": self.added_over(config, Config::D, |l| l.p99),
                            "p50_per_round": self.added_over_per_round(config, Config::D, |l| l.p50),
                            "p99_per_round": self.added_over_per_round(config, Config::D, |l| l.p99),
                        })),
                    "tollgate_decision": self.decision(config).as_ref().map(HistogramDelta::json),
                    "envoy_ext_proc_stats": config.has_ext_proc().then(|| self.ext_proc(config)),
                    "runs": self.runs(config).map(RunSummary::json).collect::<Vec<_>>(),
                }),
            );
        }
        json!({
            "offered_rps": self.rate,
            "errors": self.errors(),
            "warmup_errors": self.warmup_errors,
            "configs": configs,
        })
    }
}

fn overall_table(summaries: &[RateSummary], machine: &Machine, args: &Args) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "\n== summary: added latency (median of per-round differences) and CPU per request =="
    );
    let _ = writeln!(
        w,
        "{:<10}{:<27}{:>11}{:>11}{:>11}{:>11}{:>14}{:>14}{:>8}",
        "offered/s",
        "config",
        "-A p50",
        "-A p90",
        "-A p99",
        "-E p50",
        "ext_proc CPU",
        "CPU vs echo",
        "errors"
    );
    for summary in summaries {
        let echo_cpu = summary
            .configs
            .contains(&Config::E)
            .then(|| summary.ext_proc_cpu_us_per_request(Config::E));
        for config in summary.others() {
            let errors: u64 = summary
                .runs(config)
                .chain(summary.runs(Config::A))
                .map(RunSummary::error_count)
                .sum();
            let cpu = summary.ext_proc_cpu_us_per_request(config);
            let _ = writeln!(
                w,
                "{:<10}{:<27}{:>8.3} ms{:>8.3} ms{:>8.3} ms{:>8.3} ms{:>8.1} us/rq{:>13}{:>8}",
                summary.rate,
                config.label(),
                summary.added(config, |l| l.p50),
                summary.added(config, |l| l.p90),
                summary.added(config, |l| l.p99),
                if config == Config::E {
                    f64::NAN
                } else {
                    summary.added_over(config, Config::E, |l| l.p50)
                },
                cpu,
                echo_cpu.map_or_else(|| "-".to_owned(), |echo| format!("{:.2}x", cpu / echo)),
                errors
            );
        }
        if !summary.streaming {
            for config in summary.floors() {
                let _ = writeln!(w, "{:<10}FLOOR {}", summary.rate, summary.floor(config));
            }
        }
        for config in summary
            .others()
            .filter(|c| !summary.streaming && c.uses_tollgate())
        {
            for line in summary.verdicts(config) {
                let _ = writeln!(w, "{:<10}TARGETS {line}", summary.rate);
            }
        }
    }
    let _ = writeln!(
        w,
        "machine: {} CPUs, {}, kernel {}; Envoy {}; tollgate at {}; {} rounds x {} s, warm-up {} \
         s; machine busy before start {}",
        machine.cpus,
        machine.cpu_model,
        machine.kernel,
        machine.software.1,
        machine.git,
        args.rounds,
        args.seconds,
        args.warmup_seconds,
        machine
            .busy_before_start
            .map_or_else(|| "?".to_owned(), |b| format!("{:.0}%", b * 100.0)),
    );
    out
}

/// The load lab's p50 target over Envoy alone, in ms.
const P50_OVER_ENVOY_TARGET_MS: f64 = 0.5;

/// One figure's per-round differences, and their median.
struct PerRound {
    values: Vec<f64>,
    median: f64,
}

impl PerRound {
    fn new(values: Vec<f64>) -> PerRound {
        let median = median(&mut values.clone());
        PerRound { values, median }
    }

    /// The median with the range it was taken from: `+0.300 ms (rounds +0.250 to +0.380)`.
    fn spread(&self) -> String {
        let (low, high) = self.range();
        format!("{:+.3} ms (rounds {low:+.3} to {high:+.3})", self.median)
    }

    /// The lowest and the highest round.
    fn range(&self) -> (f64, f64) {
        let low = self.values.iter().copied().fold(f64::INFINITY, f64::min);
        let high = self
            .values
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        (low, high)
    }

    /// Held to `< target` ms: the median's verdict, and in how many rounds it held.
    /// "met"/"NOT met" is the median's, as before; "k/n rounds" says whether that verdict
    /// would survive another run: a target met in some rounds only sits inside the machine's
    /// noise.
    fn verdict(&self, target: f64) -> String {
        let under = self.values.iter().filter(|&&v| v < target).count();
        format!(
            "[< {target} ms: {}, {under}/{} rounds]",
            if self.median < target {
                "met"
            } else {
                "NOT met"
            },
            self.values.len()
        )
    }
}
