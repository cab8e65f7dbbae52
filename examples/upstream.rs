//! `upstream`: a small, fast, deterministic OpenAI-compatible server that stands in for
//! vLLM / TGI behind tollgate in tests and the quickstart demo.
//!
//! It does no inference. By default (`--engine fixed`) each request is answered by a tiny
//! [`Engine`] that decides how many "tokens" to emit and when each becomes ready, every request
//! alone at fixed pacing. With `--engine vllm` the tokens come from a simulated vLLM instead:
//! a continuous-batching step loop with `max_num_seqs`, a KV cache in blocks, preemption of the
//! newest sequences when it runs out, and step times that grow with the batch and with prefill
//! tokens (the pure model and its tests are in `examples/upstream/vllm.rs`, the calibration in
//! docs/lab.md). Everything else in this file is HTTP and OpenAI wire format.
//!
//! The example deliberately does not use the `tollgate` library, so it can be copied or moved
//! on its own.
//!
//! ```text
//! cargo run --example upstream -- --addr 127.0.0.1:8000
//! ```
//!
//! Once the socket is bound it prints exactly one line to stdout, `upstream listening on ADDR`,
//! with the real address (so `--addr 127.0.0.1:0` reports the port it picked).
//!
//! # Flags
//!
//! | flag                      | default          | meaning                                              |
//! |---------------------------|------------------|------------------------------------------------------|
//! | `--addr`                  | `127.0.0.1:8000` | listen address (host names are resolved)             |
//! | `--ttft-ms`               | `0`              | delay before the first token                         |
//! | `--itl-ms`                | `0`              | delay between later tokens                           |
//! | `--default-output-tokens` | `16`             | output length when the request sets no token limit   |
//! | `--engine`                | `fixed`          | `fixed` pacing, or `vllm`: the simulated engine      |
//!
//! With `--engine vllm` (see `--help` for all): `--time-scale S` runs simulated time S times
//! faster than real time; `--api-overhead-ms` (90) delays each request before it reaches the
//! engine; `--stream-interval N` (1) sends tokens after the first in chunks of N;
//! `--max-num-seqs`, `--kv-capacity-tokens`, `--block-size`, `--max-num-batched-tokens`,
//! `--step-base-ms`, `--step-per-seq-ms`, `--prefill-per-token-ms`, `--jitter` and `--seed`
//! override the calibrated engine parameters. The pacing flags and headers are then ignored,
//! and `GET /metrics` serves vLLM's metric names (`vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...); with `--engine fixed` it is
//! a 404 like any unknown path.
//!
//! # Endpoints
//!
//! * `POST /v1/chat/completions`, `POST /v1/completions`: OpenAI request bodies. The output
//!   length is `max_completion_tokens`, else `max_tokens` (capped at 100,000; `finish_reason`
//!   `"length"`), else `--default-output-tokens` (`finish_reason` `"stop"`). The text is
//!   `tok0 tok1 tok2 ...`: one whitespace-separated word per token, so a client can count
//!   tokens by splitting on whitespace. `"stream": true` gives SSE: one chunk per token, a
//!   final chunk with `finish_reason`, a `"choices": []` usage chunk only when
//!   `stream_options.include_usage` is true, then `data: [DONE]`. Non-streaming requests
//!   wait for the same per-token delays before the whole answer is sent.
//!   `usage.prompt_tokens` is an *estimate*, not a real tokenizer: the number of
//!   whitespace-separated words in the message contents or prompt strings, plus one per token
//!   id when the completions prompt is given as token ids.
//! * `GET /health`: `200 ok`. `GET /v1/models`: one model, `upstream-sim`.
//! * `POST` to any other path: `200`, echoing the request body back unchanged with the
//!   request's `content-type`, so tests can check that non-inference traffic passes through
//!   tollgate unchanged.
//! * Anything else: `404` (unknown path) or `405` (known path, wrong method), with an
//!   OpenAI-shaped error body (`{"error":{"message","type","param","code"}}`).
//!   Malformed JSON, and a token limit that is not a positive integer, get `400`.
//!
//! # Test-control request headers
//!
//! | request header                 | effect                                                       |
//! |--------------------------------|--------------------------------------------------------------|
//! | `x-upstream-status: NNN`       | answer status NNN (200..=999) at once with an error body, on any path |
//! | `x-upstream-truncate-after: N` | streaming only: send min(N, output) token chunks, then abort the connection (no final chunk, no `[DONE]`, no chunked-encoding terminator) |
//! | `x-upstream-ttft-ms: MS`       | this request's delay before the first token                  |
//! | `x-upstream-itl-ms: MS`        | this request's delay between tokens                          |
//!
//! An unparsable control header value gets `400`.
//!
//! # The in-flight judge
//!
//! `GET /upstream/in-flight` answers `{"in_flight": N, "peak": M}`: completion requests being
//! served now (from arrival until the response body is sent or dropped) and the most at once
//! since start or the last `POST /upstream/in-flight/reset`. Tests of a budget shared by
//! several gateways read the peak here, where the requests actually land.
//!
//! # Response headers for tests
//!
//! * every response: `x-upstream-saw-<name>: <value>` for each request header whose name
//!   starts with `x-tollgate-` (so tests can see what tollgate injected), and
//!   `x-upstream-body-bytes: N` (length of the request body as received);
//! * completion responses: `x-upstream-request-max-tokens: N` (the output length actually
//!   used, after the default and the cap) and `x-upstream-include-usage: true|false`.

#[path = "upstream/vllm.rs"]
mod vllm;

use std::{
    fmt::Write as _,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{DefaultBodyLimit, Request, State},
    http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    serve::ListenerExt,
};
use clap::Parser;
use futures_util::{Stream, StreamExt, stream};
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::net::{TcpListener, TcpSocket};

/// Largest output one request may ask for; larger limits are clamped, not rejected, so a
/// test asking for "effectively unlimited" does not make us stream for hours.
const MAX_OUTPUT_TOKENS: u32 = 100_000;

/// Largest request body accepted (long-context prompts can be several megabytes).
const MAX_REQUEST_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Pending-connection queue length. Load tests open thousands of connections at once; the
/// usual 1024 would make some of them wait for a SYN retransmit (~1 s).
const LISTEN_BACKLOG: u32 = 4096;

/// The model name used when the request names none, and listed by `/v1/models`.
const DEFAULT_MODEL: &str = "upstream-sim";

const ECHO_HEADER_SOURCE_PREFIX: &str = "x-tollgate-";
const ECHO_HEADER_PREFIX: &str = "x-upstream-saw-";

const STATUS_HEADER: &str = "x-upstream-status";
const TRUNCATE_AFTER_HEADER: &str = "x-upstream-truncate-after";
const TTFT_HEADER: &str = "x-upstream-ttft-ms";
const ITL_HEADER: &str = "x-upstream-itl-ms";

const BODY_BYTES_HEADER: &str = "x-upstream-body-bytes";
const MAX_TOKENS_USED_HEADER: &str = "x-upstream-request-max-tokens";
const INCLUDE_USAGE_HEADER: &str = "x-upstream-include-usage";

#[derive(Debug, Parser)]
#[command(about = "Deterministic OpenAI-compatible upstream for tollgate tests and demos")]
struct Args {
    /// Address to listen on. Port 0 picks a free port; the real address is printed.
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,

    /// Delay before the first token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    ttft_ms: u64,

    /// Delay between consecutive tokens, in milliseconds.
    #[arg(long, default_value_t = 0)]
    itl_ms: u64,

    /// Output length when the request sets neither `max_completion_tokens` nor `max_tokens`.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_OUTPUT_TOKENS)))]
    default_output_tokens: u32,

    /// `fixed`: every request runs alone at `--ttft-ms` / `--itl-ms`. `vllm`: the simulated
    /// continuous-batching engine (examples/upstream/vllm.rs); the pacing flags and headers
    /// are then ignored.
    #[arg(long, value_enum, default_value_t = EngineKind::Fixed)]
    engine: EngineKind,

    #[command(flatten)]
    sim: SimArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum EngineKind {
    Fixed,
    Vllm,
}

/// The simulated engine's knobs (`--engine vllm`). Unset engine parameters take the
/// calibrated defaults of `vllm::Params` (docs/lab.md). Times are simulated time.
#[derive(Debug, clap::Args)]
struct SimArgs {
    /// Simulated seconds per real second: 4 runs everything 4 times faster.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Latency before a request reaches the engine (API server, tokenizer, network), in ms.
    /// It delays the first token without occupying the engine.
    #[arg(long, default_value_t = 90.0)]
    api_overhead_ms: f64,
    /// Tokens per streamed chunk after the first, which is always sent alone at once
    /// (vLLM's `--stream-interval`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    stream_interval: u32,
    /// Most sequences in one batch.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// KV-cache capacity in tokens.
    #[arg(long)]
    kv_capacity_tokens: Option<u64>,
    /// Tokens per KV block.
    #[arg(long)]
    block_size: Option<u64>,
    /// Token budget of one step; longer prefills are chunked.
    #[arg(long)]
    max_num_batched_tokens: Option<u64>,
    /// Fixed time of one step, ms.
    #[arg(long)]
    step_base_ms: Option<f64>,
    /// Step time added per sequence in the batch, ms.
    #[arg(long)]
    step_per_seq_ms: Option<f64>,
    /// Step time added per prefilled token, ms.
    #[arg(long)]
    prefill_per_token_ms: Option<f64>,
    /// Step times vary uniformly by this fraction either way.
    #[arg(long)]
    jitter: Option<f64>,
    /// Seed of the step-time jitter.
    #[arg(long)]
    seed: Option<u64>,
}

impl SimArgs {
    fn params(&self) -> vllm::Params {
        let defaults = vllm::Params::default();
        let ms = |value: Option<f64>, default: Duration| {
            value.map_or(default, |ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0))
        };
        vllm::Params {
            max_num_seqs: self.max_num_seqs.unwrap_or(defaults.max_num_seqs).max(1),
            kv_capacity_tokens: self
                .kv_capacity_tokens
                .unwrap_or(defaults.kv_capacity_tokens),
            block_size: self.block_size.unwrap_or(defaults.block_size).max(1),
            max_batched_tokens: self
                .max_num_batched_tokens
                .unwrap_or(defaults.max_batched_tokens)
                .max(1),
            step_base: ms(self.step_base_ms, defaults.step_base),
            step_per_seq: ms(self.step_per_seq_ms, defaults.step_per_seq),
            prefill_per_token: ms(self.prefill_per_token_ms, defaults.prefill_per_token),
            watermark: defaults.watermark,
            jitter: self.jitter.unwrap_or(defaults.jitter).clamp(0.0, 0.9),
            seed: self.seed.unwrap_or(defaults.seed),
        }
    }
}

#[tokio::main]
async fn main() -> io::Result<()> {
    let args = Args::parse();
    let engine = Engine {
        default_output_tokens: args.default_output_tokens,
        pacing: Pacing {
            ttft: Duration::from_millis(args.ttft_ms),
            itl: Duration::from_millis(args.itl_ms),
        },
    };

    let sim = (args.engine == EngineKind::Vllm).then(|| {
        let time_scale = if args.sim.time_scale.is_finite() && args.sim.time_scale > 0.0 {
            args.sim.time_scale
        } else {
            1.0
        };
        let sim = Arc::new(sim::Sim::new(
            args.sim.params(),
            time_scale,
            Duration::from_secs_f64(args.sim.api_overhead_ms.max(0.0) / 1000.0),
            args.sim.stream_interval,
        ));
        tokio::spawn(sim::run(Arc::clone(&sim)));
        sim
    });

    let listener = bind(&args.addr).await?;
    // Tests wait for this exact line; println! flushes on the newline.
    println!("upstream listening on {}", listener.local_addr()?);

    // Token chunks are tiny; without TCP_NODELAY Nagle's algorithm would hold them back and
    // distort inter-token latency.
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    axum::serve(listener, router(engine, sim)).await
}

/// Binds the first address `addr` resolves to, with a large accept backlog.
async fn bind(addr: &str) -> io::Result<TcpListener> {
    let mut last_error = None;
    for socket_addr in tokio::net::lookup_host(addr).await? {
        match bind_socket(socket_addr) {
            Ok(listener) => return Ok(listener),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr} resolved to no addresses"),
        )
    }))
}

fn bind_socket(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // Lets a test restart us on the same port while old connections sit in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

#[derive(Clone)]
struct AppState {
    engine: Engine,
    /// The simulated vLLM engine (`--engine vllm`); `None` for fixed pacing.
    sim: Option<Arc<sim::Sim>>,
    /// Source of unique response ids. An atomic, not a lock: it is on every request's path.
    next_response_id: Arc<AtomicU64>,
}

impl AppState {
    fn new_response_id(&self, endpoint: Endpoint) -> String {
        let n = self.next_response_id.fetch_add(1, Ordering::Relaxed);
        format!("{}-upstream-{n}", endpoint.id_prefix())
    }
}

fn router(engine: Engine, sim: Option<Arc<sim::Sim>>) -> Router {
    let state = AppState {
        engine,
        sim,
        next_response_id: Arc::new(AtomicU64::new(1)),
    };
    let judge = InFlight::default();
    let completions_routes = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route_layer(middleware::from_fn_with_state(
            judge.clone(),
            count_in_flight,
        ));
    let judge_routes = Router::new()
        .route("/upstream/in-flight", get(in_flight))
        .route("/upstream/in-flight/reset", post(reset_in_flight))
        .with_state(judge);
    Router::new()
        .merge(completions_routes)
        .merge(judge_routes)
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(echo_post_or_not_found)
        // Must come after the routes: it applies to the routes registered so far.
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        // `layer` (unlike `route_layer`) also covers the fallbacks, so *every* response
        // gets the test-control treatment.
        .layer(middleware::from_fn(apply_test_controls))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES))
}

// ---------------------------------------------------------------------------------------
// The in-flight judge
// ---------------------------------------------------------------------------------------

/// Completion requests being served, and the most at once.
#[derive(Clone, Default)]
struct InFlight {
    now: Arc<AtomicU64>,
    peak: Arc<AtomicU64>,
}

/// Ends one request's count when its response body ends or is dropped (a client gone).
struct Served(InFlight);

impl Drop for Served {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn count_in_flight(State(judge): State<InFlight>, request: Request, next: Next) -> Response {
    let now = judge.now.fetch_add(1, Ordering::SeqCst) + 1;
    judge.peak.fetch_max(now, Ordering::SeqCst);
    let served = Served(judge);
    let response = next.run(request).await;
    let (parts, body) = response.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &served;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

async fn in_flight(State(judge): State<InFlight>) -> Response {
    let body = json!({
        "in_flight": judge.now.load(Ordering::SeqCst),
        "peak": judge.peak.load(Ordering::SeqCst),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn reset_in_flight(State(judge): State<InFlight>) -> Response {
    judge
        .peak
        .store(judge.now.load(Ordering::SeqCst), Ordering::SeqCst);
    StatusCode::NO_CONTENT.into_response()
}

// ---------------------------------------------------------------------------------------
// Test controls that apply to every request
// ---------------------------------------------------------------------------------------

/// Handles `x-upstream-status`, and adds `x-upstream-saw-*` and `x-upstream-body-bytes` to
/// every response. The body is read here (and handed on) because its size must be reported
/// even when the route never looks at it.
async fn apply_test_controls(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let echoed_headers = echoed_tollgate_headers(&parts.headers);

    let (mut response, body_bytes) = match read_body(&parts.headers, body).await {
        Err(error) => (error.into_response(), None),
        Ok(bytes) => {
            let body_bytes = bytes.len();
            let response = match forced_status(&parts.headers) {
                Err(error) => error.into_response(),
                Ok(Some(status)) => ApiError::forced(status).into_response(),
                Ok(None) => {
                    next.run(Request::from_parts(parts, Body::from(bytes)))
                        .await
                }
            };
            (response, Some(body_bytes))
        }
    };

    let response_headers = response.headers_mut();
    for (name, value) in echoed_headers {
        response_headers.append(name, value);
    }
    if let Some(body_bytes) = body_bytes {
        response_headers.insert(BODY_BYTES_HEADER, HeaderValue::from(body_bytes));
    }
    response
}

async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let declared_length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<usize>().ok());
    if declared_length.is_some_and(|length| length > MAX_REQUEST_BODY_BYTES) {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is larger than {MAX_REQUEST_BODY_BYTES} bytes"),
        ));
    }
    axum::body::to_bytes(body, MAX_REQUEST_BODY_BYTES)
        .await
        .map_err(|error| ApiError::bad_request(format!("could not read request body: {error}")))
}

/// `x-tollgate-foo: v` on the request becomes `x-upstream-saw-x-tollgate-foo: v` on the
/// response (every value, if the header is repeated).
fn echoed_tollgate_headers(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| name.as_str().starts_with(ECHO_HEADER_SOURCE_PREFIX))
        .filter_map(|(name, value)| {
            // A valid header name with a valid prefix is always a valid header name.
            let echoed_name = HeaderName::try_from(format!("{ECHO_HEADER_PREFIX}{name}")).ok()?;
            Some((echoed_name, value.clone()))
        })
        .collect()
}

fn forced_status(headers: &HeaderMap) -> Result<Option<StatusCode>, ApiError> {
    let Some(code) = header_u64(headers, STATUS_HEADER)? else {
        return Ok(None);
    };
    // 1xx are not final responses; hyper cannot send them as the answer.
    u16::try_from(code)
        .ok()
        .filter(|code| *code >= 200)
        .and_then(|code| StatusCode::from_u16(code).ok())
        .map(Some)
        .ok_or_else(|| ApiError::bad_request(format!("{STATUS_HEADER} must be 200..=999")))
}

/// A control header parsed as a non-negative integer; absent is `None`, garbage is a 400.
fn header_u64(headers: &HeaderMap, name: &str) -> Result<Option<u64>, ApiError> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| ApiError::bad_request(format!("{name} must be a non-negative integer")))
}

/// Per-request controls read by the completion endpoints.
struct CompletionControls {
    pacing: PacingOverride,
    truncate_after: Option<u32>,
}

impl CompletionControls {
    fn from_headers(headers: &HeaderMap) -> Result<Self, ApiError> {
        let millis =
            |name| Ok::<_, ApiError>(header_u64(headers, name)?.map(Duration::from_millis));
        Ok(Self {
            pacing: PacingOverride {
                ttft: millis(TTFT_HEADER)?,
                itl: millis(ITL_HEADER)?,
            },
            truncate_after: header_u64(headers, TRUNCATE_AFTER_HEADER)?
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    complete(Endpoint::Chat, &state, &headers, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    complete(Endpoint::Completions, &state, &headers, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Shared by both completion endpoints: parse, plan the generation, then answer as one JSON
/// object or as an SSE stream.
async fn complete(
    endpoint: Endpoint,
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let controls = CompletionControls::from_headers(headers)?;
    let request = CompletionRequest::parse(endpoint, body)?;
    let generation = state.engine.plan(request.max_tokens, controls.pacing);
    let tokens: TokenStream = match &state.sim {
        Some(sim) => Box::pin(sim::tokens(
            Arc::clone(sim),
            request.prompt_tokens,
            generation.output_tokens,
        )),
        None => Box::pin(generation.tokens()),
    };
    let shape = ResponseShape {
        endpoint,
        id: state.new_response_id(endpoint),
        created: unix_seconds(),
        model: request.model,
        include_usage: request.include_usage,
        prompt_tokens: request.prompt_tokens,
    };

    let mut response = if request.stream {
        streaming_response(shape, generation, tokens, controls.truncate_after)
    } else {
        complete_response(shape, generation, tokens).await
    };
    let response_headers = response.headers_mut();
    response_headers.insert(
        MAX_TOKENS_USED_HEADER,
        HeaderValue::from(generation.output_tokens),
    );
    let include_usage = if request.include_usage {
        "true"
    } else {
        "false"
    };
    response_headers.insert(
        INCLUDE_USAGE_HEADER,
        HeaderValue::from_static(include_usage),
    );
    Ok(response)
}

async fn models() -> Response {
    let body = json!({
        "object": "list",
        "data": [{
            "id": DEFAULT_MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "tollgate-upstream",
        }],
    });
    json_response(StatusCode::OK, body.to_string())
}

async fn health() -> &'static str {
    "ok"
}

/// vLLM's gauges and counters for the simulated engine; 404 with fixed pacing.
async fn metrics(State(state): State<AppState>, method: Method, uri: Uri) -> Response {
    match &state.sim {
        Some(sim) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            sim.metrics(),
        )
            .into_response(),
        None => ApiError::not_found(&method, &uri).into_response(),
    }
}

/// `POST` to an unknown path echoes the body (pass-through checks); anything else is 404.
async fn echo_post_or_not_found(
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if method != Method::POST {
        return ApiError::not_found(&method, &uri).into_response();
    }
    let mut response = Response::new(Body::from(body));
    if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type.clone());
    }
    response
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("Method not allowed ({method} {})", uri.path()),
    )
    .into_response()
}

// ---------------------------------------------------------------------------------------
// Request parsing
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        }
    }
}

/// The parts of an OpenAI request body this server acts on. Everything else is ignored
/// (including `n`: there is always exactly one choice).
#[derive(Debug)]
struct CompletionRequest {
    model: String,
    max_tokens: Option<u32>,
    stream: bool,
    include_usage: bool,
    prompt_tokens: u64,
}

impl CompletionRequest {
    fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|error| {
            ApiError::bad_request(format!(
                "could not parse the JSON body of the request: {error}"
            ))
        })?;
        let Value::Object(fields) = value else {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ));
        };
        let include_usage = match fields.get("stream_options") {
            Some(Value::Object(options)) => optional_bool(options, "include_usage")?,
            _ => false,
        };
        let prompt_tokens = match endpoint {
            Endpoint::Chat => estimate_chat_prompt_tokens(fields.get("messages")),
            Endpoint::Completions => estimate_completion_prompt_tokens(fields.get("prompt")),
        };
        Ok(Self {
            model: match fields.get("model") {
                Some(Value::String(model)) => model.clone(),
                _ => DEFAULT_MODEL.to_owned(),
            },
            max_tokens: requested_max_tokens(&fields)?,
            stream: optional_bool(&fields, "stream")?,
            include_usage,
            prompt_tokens,
        })
    }
}

/// `max_completion_tokens` (the current chat name) wins over the deprecated `max_tokens`.
/// Zero, negative or fractional is a 400, as on vLLM and OpenAI.
fn requested_max_tokens(fields: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let Some((key, value)) = ["max_completion_tokens", "max_tokens"]
        .into_iter()
        .find_map(|key| Some((key, fields.get(key).filter(|value| !value.is_null())?)))
    else {
        return Ok(None);
    };
    match value.as_u64() {
        // Saturate here; the engine applies MAX_OUTPUT_TOKENS.
        Some(n) if n >= 1 => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
        _ => {
            Err(ApiError::bad_request(format!("{key} must be a positive integer")).with_param(key))
        }
    }
}

fn optional_bool(fields: &Map<String, Value>, key: &'static str) -> Result<bool, ApiError> {
    match fields.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(_) => Err(ApiError::bad_request(format!("{key} must be a boolean")).with_param(key)),
    }
}

/// Word count of every message's text (plain string content or `{"type":"text"}` parts).
/// Deliberately not a real tokenizer: cheap, deterministic, and easy to predict in tests.
fn estimate_chat_prompt_tokens(messages: Option<&Value>) -> u64 {
    let Some(Value::Array(messages)) = messages else {
        return 0;
    };
    messages
        .iter()
        .map(|message| match message.get("content") {
            Some(Value::String(text)) => word_count(text),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .map(word_count)
                .sum(),
            _ => 0,
        })
        .sum()
}

/// Word count of a completions `prompt`: a string, a list of strings, a list of token ids
/// (one token each) or a list of token-id lists.
fn estimate_completion_prompt_tokens(prompt: Option<&Value>) -> u64 {
    match prompt {
        Some(Value::String(text)) => word_count(text),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => word_count(text),
                Value::Number(_) => 1,
                Value::Array(token_ids) => token_ids.len() as u64,
                _ => 0,
            })
            .sum(),
        _ => 0,
    }
}

fn word_count(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

// ---------------------------------------------------------------------------------------
// Engine: how many tokens a request gets and when each is ready.
// This is the part to replace with a simulated vLLM (batching, KV cache) later.
// ---------------------------------------------------------------------------------------

/// Per-token timing of one generation.
#[derive(Debug, Clone, Copy)]
struct Pacing {
    /// Time to first token.
    ttft: Duration,
    /// Inter-token latency.
    itl: Duration,
}

impl Pacing {
    /// How long token `index` takes after the previous one (after the request, for the first).
    fn delay_before(self, index: u32) -> Duration {
        if index == 0 { self.ttft } else { self.itl }
    }
}

/// Per-request replacements for the server-wide pacing.
#[derive(Debug, Clone, Copy, Default)]
struct PacingOverride {
    ttft: Option<Duration>,
    itl: Option<Duration>,
}

/// A stateless engine: every request runs alone, at fixed pacing.
#[derive(Debug, Clone, Copy)]
struct Engine {
    default_output_tokens: u32,
    pacing: Pacing,
}

impl Engine {
    fn plan(&self, requested_max_tokens: Option<u32>, overrides: PacingOverride) -> Generation {
        let pacing = Pacing {
            ttft: overrides.ttft.unwrap_or(self.pacing.ttft),
            itl: overrides.itl.unwrap_or(self.pacing.itl),
        };
        match requested_max_tokens {
            // The "model" never emits end-of-sequence, so a client limit is always reached.
            Some(limit) => Generation {
                output_tokens: limit.min(MAX_OUTPUT_TOKENS),
                finish_reason: FinishReason::Length,
                pacing,
            },
            // Without a limit the "model" stops on its own after the default length.
            None => Generation {
                output_tokens: self.default_output_tokens,
                finish_reason: FinishReason::Stop,
                pacing,
            },
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the engine will produce for one request.
#[derive(Debug, Clone, Copy)]
struct Generation {
    output_tokens: u32,
    finish_reason: FinishReason,
    pacing: Pacing,
}

impl Generation {
    /// The tokens, each yielded once its delay has passed. Lazy: nothing is produced (and
    /// no time passes) until the HTTP layer asks for the next token.
    fn tokens(self) -> impl Stream<Item = TokenRun> + Send + 'static {
        stream::unfold(0_u32, move |index| async move {
            if index >= self.output_tokens {
                return None;
            }
            let delay = self.pacing.delay_before(index);
            // A zero sleep still goes through the timer wheel; skip it to stay fast.
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            Some((
                TokenRun {
                    first: index,
                    count: 1,
                },
                index + 1,
            ))
        })
    }
}

/// Where a response's tokens come from: fixed pacing, or the simulated vLLM engine.
type TokenStream = Pin<Box<dyn Stream<Item = TokenRun> + Send>>;

/// Consecutive tokens `first..first + count`, sent in one chunk when streaming.
#[derive(Debug, Clone, Copy)]
struct TokenRun {
    first: u32,
    count: u32,
}

impl TokenRun {
    /// One word per token. Tokens after the first carry their leading space (as BPE tokens
    /// do), so concatenating them gives `tok0 tok1 tok2`.
    fn text(self) -> String {
        let mut text = String::new();
        for index in self.first..self.first + self.count {
            if index == 0 {
                text.push_str("tok0");
            } else {
                let _ = write!(text, " tok{index}");
            }
        }
        text
    }
}

// ---------------------------------------------------------------------------------------
// OpenAI response shapes
// ---------------------------------------------------------------------------------------

/// Everything needed to build the JSON objects of one response.
struct ResponseShape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: u64,
}

impl ResponseShape {
    fn usage(&self, completion_tokens: u32) -> Usage {
        let completion_tokens = u64::from(completion_tokens);
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
        }
    }

    /// The non-streaming answer: a `chat.completion` or `text_completion` object.
    fn complete_object(&self, text: &str, generation: Generation) -> String {
        let finish_reason = Some(generation.finish_reason.as_str());
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                Choice {
                    message: Some(Message {
                        role: "assistant",
                        content: text,
                    }),
                    finish_reason,
                    ..Choice::default()
                },
            ),
            Endpoint::Completions => (
                "text_completion",
                Choice {
                    text: Some(text),
                    finish_reason,
                    ..Choice::default()
                },
            ),
        };
        let usage = UsageField::Counts(self.usage(generation.output_tokens));
        serde_json::to_string(&self.envelope(object, &[choice], usage))
            .expect("plain structs with string keys always serialize")
    }

    /// The event for streamed tokens (one, except with the engine's `--stream-interval`).
    /// The first chat chunk also carries `"role": "assistant"`, so every chunk before the
    /// final one holds tokens.
    fn token_event(&self, tokens: TokenRun) -> Bytes {
        let text = tokens.text();
        let choice = match self.endpoint {
            Endpoint::Chat => Choice {
                delta: Some(Delta {
                    role: (tokens.first == 0).then_some("assistant"),
                    content: Some(&text),
                }),
                ..Choice::default()
            },
            Endpoint::Completions => Choice {
                text: Some(&text),
                ..Choice::default()
            },
        };
        self.chunk_event(&[choice], self.usage_on_content_chunks())
    }

    /// The event that closes the choice: no content, just `finish_reason`.
    fn finish_event(&self, finish_reason: FinishReason) -> Bytes {
        let finish_reason = Some(finish_reason.as_str());
        let choice = match self.endpoint {
            Endpoint::Chat => Choice {
                delta: Some(Delta::default()),
                finish_reason,
                ..Choice::default()
            },
            Endpoint::Completions => Choice {
                text: Some(""),
                finish_reason,
                ..Choice::default()
            },
        };
        self.chunk_event(&[choice], self.usage_on_content_chunks())
    }

    /// The extra event sent only with `stream_options.include_usage`: no choices, just usage.
    fn usage_event(&self, completion_tokens: u32) -> Bytes {
        self.chunk_event(&[], UsageField::Counts(self.usage(completion_tokens)))
    }

    /// With `include_usage`, OpenAI sends `"usage": null` on every chunk but the usage one;
    /// without it, chunks have no `usage` field at all.
    fn usage_on_content_chunks(&self) -> UsageField {
        if self.include_usage {
            UsageField::Null
        } else {
            UsageField::Omitted
        }
    }

    fn chunk_event(&self, choices: &[Choice<'_>], usage: UsageField) -> Bytes {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        sse_event(&self.envelope(object, choices, usage))
    }

    fn envelope<'a>(
        &'a self,
        object: &'static str,
        choices: &'a [Choice<'a>],
        usage: UsageField,
    ) -> Envelope<'a> {
        Envelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage,
        }
    }
}

// Typed rather than `serde_json::Value` so fields come out in OpenAI's order and each
// chunk costs one pass of serialization, not a tree of allocations.

/// A response object or stream chunk.
#[derive(Serialize)]
struct Envelope<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [Choice<'a>],
    #[serde(skip_serializing_if = "UsageField::is_omitted")]
    usage: UsageField,
}

/// One choice; exactly one of `message` (chat), `delta` (chat chunk) or `text`
/// (completions) is set.
#[derive(Default, Serialize)]
struct Choice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    /// Always `null`: log probabilities are never produced.
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

/// A chat chunk's increment; both fields absent (`{}`) on the finishing chunk.
#[derive(Default, Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

/// The three forms the `usage` field takes: absent, `null`, or the counts.
enum UsageField {
    Omitted,
    Null,
    Counts(Usage),
}

impl UsageField {
    fn is_omitted(&self) -> bool {
        matches!(self, UsageField::Omitted)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Counts(usage) => usage.serialize(serializer),
            UsageField::Omitted | UsageField::Null => serializer.serialize_none(),
        }
    }
}

async fn complete_response(
    shape: ResponseShape,
    generation: Generation,
    tokens: TokenStream,
) -> Response {
    let text: String = tokens.map(TokenRun::text).collect().await;
    json_response(StatusCode::OK, shape.complete_object(&text, generation))
}

/// An SSE response that produces each event as its token becomes ready, one body frame per
/// event.
fn streaming_response(
    shape: ResponseShape,
    generation: Generation,
    tokens: TokenStream,
    truncate_after: Option<u32>,
) -> Response {
    let shape = Arc::new(shape);
    let token_events = {
        let shape = Arc::clone(&shape);
        tokens.map(move |run| shape.token_event(run))
    };
    let body = match truncate_after {
        Some(limit) => Body::from_stream(
            token_events
                .take(limit as usize)
                .map(Ok)
                .chain(stream::once(abort_connection())),
        ),
        None => Body::from_stream(
            token_events
                .chain(stream::iter(closing_events(&shape, generation)))
                .map(Ok::<_, io::Error>),
        ),
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("static status and valid header values always build a response")
}

/// The last item of a truncated stream. A body error makes hyper cut the connection
/// without the chunked-encoding terminator, so the client sees an incomplete response,
/// exactly like an upstream that crashed mid-stream.
async fn abort_connection() -> Result<Bytes, io::Error> {
    // hyper writes buffered frames out only once the body stops being ready, and discards
    // them on error. Yield once so the headers and token chunks reach the client first.
    tokio::task::yield_now().await;
    Err(io::Error::new(
        io::ErrorKind::ConnectionAborted,
        format!("stream truncated by {TRUNCATE_AFTER_HEADER}"),
    ))
}

/// What follows the last token: the finish chunk, the usage chunk if asked for, `[DONE]`.
fn closing_events(shape: &ResponseShape, generation: Generation) -> Vec<Bytes> {
    let mut events = vec![shape.finish_event(generation.finish_reason)];
    if shape.include_usage {
        events.push(shape.usage_event(generation.output_tokens));
    }
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    events
}

fn sse_event(data: &impl Serialize) -> Bytes {
    let mut event = b"data: ".to_vec();
    serde_json::to_writer(&mut event, data)
        .expect("plain structs with string keys always serialize into memory");
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// OpenAI's `created`: wall-clock seconds, as the real API reports them.
#[allow(clippy::disallowed_methods)]
fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// An error answered as OpenAI does: `{"error":{"message","type","param","code"}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn not_found(method: &Method, uri: &Uri) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("Invalid URL ({method} {})", uri.path()),
        )
    }

    fn forced(status: StatusCode) -> Self {
        Self::new(
            status,
            format!(
                "upstream answered {} because of {STATUS_HEADER}",
                status.as_u16()
            ),
        )
    }

    fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    /// OpenAI's `type` and `code` for a status, so clients that branch on them behave as
    /// they would against the real API.
    fn type_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self.status.as_u16() {
            401 => ("invalid_request_error", Some("invalid_api_key")),
            404 => ("invalid_request_error", Some("unknown_url")),
            429 => ("rate_limit_error", Some("rate_limit_exceeded")),
            500.. => ("server_error", None),
            _ => ("invalid_request_error", None),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (kind, code) = self.type_and_code();
        let body = json!({
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": code,
            }
        });
        json_response(self.status, body.to_string())
    }
}

// ---------------------------------------------------------------------------------------
// The simulated vLLM: drives `vllm::Engine` in (scaled) real time and hands each request its
// tokens as the steps that produce them end.
// ---------------------------------------------------------------------------------------

mod sim {
    use std::collections::HashMap;
    use std::fmt::Write as _;
    use std::sync::{Arc, Mutex, MutexGuard};
    use std::time::Duration;

    use futures_util::{Stream, stream};
    use tokio::sync::{Notify, mpsc};
    use tokio::time::Instant;

    use super::{DEFAULT_MODEL, TokenRun, vllm};

    /// The engine, the channels of the requests in it, and the clock conversion.
    pub struct Sim {
        state: Mutex<State>,
        /// Wakes the step loop when a request arrives at an idle engine.
        wake: Notify,
        /// Simulated seconds per real second.
        time_scale: f64,
        /// Simulated delay before a request reaches the engine.
        api_overhead: Duration,
        stream_interval: u32,
    }

    struct State {
        engine: vllm::Engine,
        outputs: HashMap<vllm::SeqId, mpsc::UnboundedSender<vllm::Emitted>>,
    }

    impl Sim {
        pub fn new(
            params: vllm::Params,
            time_scale: f64,
            api_overhead: Duration,
            stream_interval: u32,
        ) -> Sim {
            Sim {
                state: Mutex::new(State {
                    engine: vllm::Engine::new(params),
                    outputs: HashMap::new(),
                }),
                wake: Notify::new(),
                time_scale,
                api_overhead,
                stream_interval: stream_interval.max(1),
            }
        }

        fn lock(&self) -> MutexGuard<'_, State> {
            // A panic while holding the lock leaves plain data behind; keep serving.
            self.state
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }

        fn real(&self, simulated: Duration) -> Duration {
            simulated.div_f64(self.time_scale)
        }

        fn submit(
            &self,
            prompt_tokens: u64,
            output_tokens: u64,
        ) -> (vllm::SeqId, mpsc::UnboundedReceiver<vllm::Emitted>) {
            let (tx, rx) = mpsc::unbounded_channel();
            let id = {
                let mut state = self.lock();
                let id = state.engine.submit(prompt_tokens, output_tokens);
                state.outputs.insert(id, tx);
                id
            };
            self.wake.notify_one();
            (id, rx)
        }

        fn cancel(&self, id: vllm::SeqId) {
            let mut state = self.lock();
            state.engine.cancel(id);
            state.outputs.remove(&id);
        }

        /// Prometheus text with vLLM's metric names (V1, plus the deprecated
        /// `vllm:gpu_cache_usage_perc` that older dashboards read).
        pub fn metrics(&self) -> String {
            let (running, waiting, kv, totals) = {
                let state = self.lock();
                let e = &state.engine;
                (e.running(), e.waiting(), e.kv_usage(), e.totals())
            };
            let label = format!("{{model_name=\"{DEFAULT_MODEL}\"}}");
            let mut out = String::new();
            let mut metric = |name: &str, kind: &str, help: &str, value: String| {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{label} {value}"
                );
            };
            metric(
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                running.to_string(),
            );
            metric(
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                waiting.to_string(),
            );
            metric(
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                kv.to_string(),
            );
            metric(
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "GPU KV-cache usage. 1 means 100 percent usage (deprecated name).",
                kv.to_string(),
            );
            metric(
                "vllm:num_preemptions_total",
                "counter",
                "Cumulative number of preemptions from the engine.",
                totals.preemptions.to_string(),
            );
            metric(
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed (recomputation included).",
                totals.prompt_tokens.to_string(),
            );
            metric(
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                totals.generation_tokens.to_string(),
            );
            metric(
                "vllm:request_success_total",
                "counter",
                "Count of successfully processed requests.",
                totals.finished.to_string(),
            );
            out
        }
    }

    /// The step loop: plan a step, sleep until it ends (in scaled time), hand out its tokens.
    pub async fn run(sim: Arc<Sim>) {
        let start = Instant::now();
        let mut now = Duration::ZERO;
        loop {
            let step = {
                let mut state = sim.lock();
                // Steps follow each other on the simulated clock, whatever the timer's
                // rounding: a step that ends late is followed by a shorter sleep. Only after
                // idling (or after falling more than a second behind, on a starved machine)
                // does simulated time jump to the real clock.
                let real = start.elapsed().mul_f64(sim.time_scale);
                if real > now + Duration::from_secs(1) {
                    now = real;
                }
                state.engine.step(now)
            };
            let Some(step) = step else {
                sim.wake.notified().await;
                now = start.elapsed().mul_f64(sim.time_scale);
                continue;
            };
            now += step.duration;
            tokio::time::sleep_until(start + sim.real(now)).await;
            let mut state = sim.lock();
            for emitted in step.emitted {
                let delivered = state
                    .outputs
                    .get(&emitted.seq)
                    .is_some_and(|tx| tx.send(emitted).is_ok());
                if emitted.finished || !delivered {
                    state.outputs.remove(&emitted.seq);
                    if !delivered {
                        state.engine.cancel(emitted.seq);
                    }
                }
            }
        }
    }

    /// Cancels the sequence when the response stream is dropped (client gone), unless it
    /// already finished.
    struct Guard {
        sim: Arc<Sim>,
        id: vllm::SeqId,
        done: bool,
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            if !self.done {
                self.sim.cancel(self.id);
            }
        }
    }

    /// One request's tokens: after the API overhead it joins the engine; the first token
    /// comes alone, later ones in runs of `stream_interval` (and whatever is left at the end).
    pub fn tokens(
        sim: Arc<Sim>,
        prompt_tokens: u64,
        output_tokens: u32,
    ) -> impl Stream<Item = TokenRun> + Send + 'static {
        struct Pending {
            sim: Arc<Sim>,
            prompt_tokens: u64,
            output_tokens: u32,
        }
        enum Phase {
            Before(Pending),
            Running {
                guard: Guard,
                rx: mpsc::UnboundedReceiver<vllm::Emitted>,
                next: u32,
            },
            Done,
        }
        stream::unfold(
            Phase::Before(Pending {
                sim,
                prompt_tokens,
                output_tokens,
            }),
            |phase| async move {
                let (mut guard, mut rx, next) = match phase {
                    Phase::Done => return None,
                    Phase::Before(p) => {
                        tokio::time::sleep(p.sim.real(p.sim.api_overhead)).await;
                        let (id, rx) = p.sim.submit(p.prompt_tokens, u64::from(p.output_tokens));
                        let guard = Guard {
                            sim: p.sim,
                            id,
                            done: false,
                        };
                        (guard, rx, 0)
                    }
                    Phase::Running { guard, rx, next } => (guard, rx, next),
                };
                let want = if next == 0 {
                    1
                } else {
                    guard.sim.stream_interval
                };
                let mut count = 0;
                let mut finished = false;
                while count < want && !finished {
                    // The sender lives as long as the sequence; a closed channel means the
                    // engine dropped it, which only happens once it is finished.
                    let emitted = rx.recv().await?;
                    count += 1;
                    finished = emitted.finished;
                }
                let run = TokenRun { first: next, count };
                let phase = if finished {
                    guard.done = true;
                    Phase::Done
                } else {
                    Phase::Running {
                        guard,
                        rx,
                        next: next + count,
                    }
                };
                Some((run, phase))
            },
        )
    }
}
