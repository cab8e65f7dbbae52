//! The controller through the whole server, in real time: what it measures (`control.signal`),
//! and requests that have not answered yet. 50 ms ticks keep each test to a few seconds; the
//! margins that matter are the breach thresholds (target + 20 %), and every scripted step that
//! must not breach is expected to take a small fraction of them, on a loaded machine too.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingResponse, ProtocolConfiguration, processing_request::Request,
    processing_response::Response,
};
use tollgate::config::{Config, ControlConfig, ControlSignal};

use crate::support::server::*;

/// The controller on `signal` with a target of `target_ms` (breach above 1.2x), a 50 ms tick,
/// one tick of cooldown (the gateway's signal needs one), no slow start, any single sample
/// enough; the budget starts at and cannot grow past `limit`. Free tier, queue deadline 5 s.
fn config(signal: ControlSignal, target_ms: u64, limit: u32) -> Config {
    let mut config = Config::default();
    config.scheduler.initial_limit = limit;
    // The scheduler's headroom off: its held slots stay above an engine clamp
    // (`control::Aimd::clamp`), and how many it holds depends on how long the requests below
    // have been in flight, where these tests pin the clamp to the peak in flight.
    config.scheduler.headroom.enabled = false;
    let (target_p99_ttft_ms, upstream_target_p99_ttft_ms) = match signal {
        ControlSignal::Gateway => (target_ms, target_ms),
        ControlSignal::Upstream => (target_ms.max(2_000), target_ms),
    };
    config.control = ControlConfig {
        enabled: true,
        signal,
        target_p99_ttft_ms,
        upstream_target_p99_ttft_ms,
        tick_ms: 50,
        window_ms: 5_000,
        cooldown_ticks: 1,
        slow_start: false,
        min_samples: 1,
        floor: 1,
        ceiling: limit,
        ..ControlConfig::default()
    };
    config.shutdown.drain_deadline_ms = 100;
    for tier in config.tiers.values_mut() {
        tier.max_concurrent = None;
        tier.tokens_per_hour = None;
        tier.queue_deadline_ms = 5_000;
    }
    config
}

fn is_admitted(answer: &ProcessingResponse) -> bool {
    matches!(answer.response, Some(Response::RequestBody(_)))
}

/// A chat request from `user`; the body's first answer (admitted, or an extension of Envoy's
/// timeout if it was queued). Its first message carries Envoy's `protocol_config`, as every
/// supported Envoy sends it: the response body STREAMED if `sends_body`, else NONE.
async fn submit(
    server: &TestServer,
    user: &str,
    sends_body: bool,
) -> (ExtProcStream, ProcessingResponse) {
    let mut stream = server.stream().await;
    let mut headers = chat_headers(user);
    let response_body_mode = if sends_body {
        BodySendMode::Streamed
    } else {
        BodySendMode::None
    };
    headers.protocol_config = Some(ProtocolConfiguration {
        response_body_mode: response_body_mode as i32,
        ..ProtocolConfiguration::default()
    });
    stream.exchange(headers).await;
    let answer = stream
        .exchange(request_body(&chat_body(serde_json::json!({}))))
        .await;
    (stream, answer)
}

/// The upstream's first byte for an admitted request; the slot stays held.
async fn first_token(stream: &mut ExtProcStream) {
    stream
        .exchange(response_headers(200, "application/json"))
        .await;
    stream.exchange(response_body(b"{\"id\":", false)).await;
}

/// Four admitted requests (the whole budget of 4), none answered by the upstream yet.
async fn admit_four(server: &TestServer, sends_body: bool) -> Vec<ExtProcStream> {
    let mut admitted = Vec::new();
    for user in ["a", "b", "c", "d"] {
        let (stream, answer) = submit(server, user, sends_body).await;
        assert!(is_admitted(&answer), "{answer:?}");
        admitted.push(stream);
    }
    admitted
}

async fn limit(server: &TestServer) -> f64 {
    server.metrics().await.value("tollgate_inflight_limit", &[])
}

fn ttft_sum(m: &Metrics, name: &str) -> f64 {
    m.sum(&format!("{name}_sum"), &[])
}

#[tokio::test]
async fn queue_wait_is_a_breach_for_the_gateway_signal_and_only_demand_for_the_upstream_one() {
    // The gateway's target is 150 ms, which the 600 ms wait breaches; the upstream's 500 ms,
    // which an upstream answering at once does not.
    for (signal, target_ms, limit_after) in [
        (ControlSignal::Upstream, 500, 2.0),
        (ControlSignal::Gateway, 150, 1.0),
    ] {
        let server = TestServer::start(config(signal, target_ms, 2)).await;
        // Two requests hold both slots; their upstream answers at once.
        let (mut first, answer) = submit(&server, "alice", true).await;
        assert!(is_admitted(&answer), "{answer:?}");
        first_token(&mut first).await;
        let (mut second, answer) = submit(&server, "bob", true).await;
        assert!(is_admitted(&answer), "{answer:?}");
        first_token(&mut second).await;
        // A third waits 600 ms for a slot, then its upstream answers at once too.
        let (mut third, answer) = submit(&server, "carol", true).await;
        assert!(!is_admitted(&answer), "queued: {answer:?}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        first.exchange(response_body(b"}", true)).await;
        let admitted = third.recv().await.unwrap().unwrap();
        assert!(is_admitted(&admitted), "{admitted:?}");
        first_token(&mut third).await;
        // Many ticks later: the gateway's TTFT (600 ms) breached; the upstream's (about 0) did
        // not.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let m = server.metrics().await;
        assert_eq!(
            m.value("tollgate_inflight_limit", &[]),
            limit_after,
            "{signal:?}"
        );
        let gateway = ttft_sum(&m, "tollgate_time_to_first_token_seconds");
        let upstream = ttft_sum(&m, "tollgate_upstream_time_to_first_token_seconds");
        assert!(
            gateway >= 0.6 && upstream < 0.3,
            "{signal:?}: TTFT sums: gateway {gateway} s, upstream {upstream} s"
        );
        drop((first, second, third));
        server.stop().await.unwrap();
    }
}

#[tokio::test]
async fn requests_stuck_without_a_first_token_cut_the_budget_once_before_they_answer() {
    let server = TestServer::start(config(ControlSignal::Upstream, 500, 4)).await;
    let mut stuck = admit_four(&server, true).await;
    // No first token, no finished sample: the four are overdue 600 ms after dispatch, and that
    // alone is a breach. 4 in flight x 0.9 = 3.6, so 3.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(limit(&server).await, 3.0);
    // They are still stuck, but they were dispatched before the cut: the window restarted
    // without them, so they do not cut again.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(limit(&server).await, 3.0);
    // When they do answer, late, they still do not count.
    for stream in &mut stuck {
        first_token(stream).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(limit(&server).await, 3.0);
    drop(stuck);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn without_the_response_body_there_is_no_first_token_to_wait_for() {
    // Envoy says it will not send the response body: these requests will never report a
    // first token, and their age is not a latency.
    let server = TestServer::start(config(ControlSignal::Upstream, 500, 4)).await;
    let open = admit_four(&server, false).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(limit(&server).await, 4.0);
    drop(open);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_request_that_ends_without_a_first_token_stops_counting() {
    // An upstream error before any body byte: the request is over, and must not go on aging
    // in the window as if it were still waiting.
    let server = TestServer::start(config(ControlSignal::Upstream, 500, 4)).await;
    let (mut failed, answer) = submit(&server, "a", true).await;
    assert!(is_admitted(&answer), "{answer:?}");
    let mut headers_only = response_headers(502, "text/plain");
    if let Some(Request::ResponseHeaders(h)) = headers_only.request.as_mut() {
        h.end_of_stream = true;
    }
    failed.exchange(headers_only).await;
    // The ext_proc stream stays open (Envoy closes it when the HTTP stream is done): the
    // headers' end of stream alone must end the wait.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(limit(&server).await, 4.0);
    drop(failed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(limit(&server).await, 4.0);
    server.stop().await.unwrap();
}

/// A stand-in for a vLLM engine's `/metrics`: serves whatever text `set` last gave it.
struct FakeEngine {
    url: String,
    text: std::sync::Arc<std::sync::Mutex<String>>,
}

impl FakeEngine {
    async fn start() -> FakeEngine {
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let served = text.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let served = served.clone();
                async move { served.lock().unwrap().clone() }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        FakeEngine { url, text }
    }

    /// vLLM V1's series for a KV-cache usage and a waiting queue.
    fn set(&self, kv_cache_usage: f64, waiting: u32) {
        *self.text.lock().unwrap() = format!(
            "# TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv_cache_usage}\n"
        );
    }
}

/// Polls the limit until it is `want`.
async fn limit_becomes(server: &TestServer, want: f64) {
    server
        .wait_for_metric("tollgate_inflight_limit", &[], want)
        .await;
}

/// Ticks and scrapes for the engine tests: slow enough that a scrape cannot miss its timeout
/// on a loaded machine (a tick without the engines' answer would fall back to the latency
/// rules and grow the budget), fast enough for a test of a few seconds.
fn scraping(config: &mut Config, urls: Vec<String>) {
    config.control.tick_ms = 250;
    config.control.engine.metrics_urls = urls;
    config.control.engine.scrape_timeout_ms = 200;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_engines_take_the_headroom_above_what_is_in_flight_and_give_it_back() {
    let engine = FakeEngine::start().await;
    engine.set(0.5, 0);
    // A second engine that accepts the connection and never answers: its scrapes time out,
    // and the controller goes on with the engine that does answer.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = config(ControlSignal::Upstream, 500, 8);
    scraping(
        &mut config,
        vec![
            engine.url.clone(),
            format!("http://{}/metrics", hung.local_addr().unwrap()),
        ],
    );
    // The first tokens below stay in the window for the whole test, however slow the machine:
    // without samples the controller would not grow the budget back.
    config.control.window_ms = 60_000;
    let server = TestServer::start(config).await;
    let mut admitted = admit_four(&server, true).await;
    for stream in &mut admitted {
        first_token(stream).await;
    }
    // Half full, fast first tokens, four of eight slots used (no demand): nothing to do.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(limit(&server).await, 8.0);

    // The KV cache at 0.95 against the 0.9 threshold: the four slots above the four in
    // flight go, although every latency is fast, and a fifth request waits.
    engine.set(0.95, 0);
    limit_becomes(&server, 4.0).await;
    let (mut fifth, answer) = submit(&server, "e", true).await;
    assert!(!is_admitted(&answer), "{answer:?}");
    let m = server.metrics().await;
    assert!((m.value("tollgate_engine_saturation_ratio", &[]) - 0.95 / 0.9).abs() < 1e-6);
    assert_eq!(m.value("tollgate_engine_kv_cache_usage_ratio", &[]), 0.95);
    assert_eq!(m.value("tollgate_engine_requests_waiting", &[]), 0.0);
    assert!(m.value("tollgate_engine_scrapes_total", &["result=\"ok\""]) > 0.0);
    assert!(m.value("tollgate_engine_scrapes_total", &["result=\"error\""]) > 0.0);
    assert!(
        m.value(
            "tollgate_controller_actions_total",
            &["action=\"clamp_engine_saturated\""]
        ) >= 1.0
    );

    // Room again: the budget grows, one step a tick (slow start is over), and the fifth
    // request gets its slot.
    engine.set(0.3, 0);
    let answer = fifth.recv().await.unwrap().unwrap();
    assert!(is_admitted(&answer), "{answer:?}");
    first_token(&mut fifth).await;
    // A queue inside the engine at its threshold (5) saturates it just as a full KV cache
    // does: back down to the five in flight, and no growth while it lasts.
    engine.set(0.1, 5);
    limit_becomes(&server, 5.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(limit(&server).await, 5.0);
    drop((admitted, fifth, hung));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_vllms_own_metrics_are_read_with_the_default_names() {
    // vLLM's metric names as the lab's simulated vLLM serves them (examples/upstream.rs), read
    // by tollgate's defaults: nothing configured but the URL.
    let vllm = crate::support::process::Upstream::start(&["--engine", "vllm"]);
    let mut config = config(ControlSignal::Upstream, 500, 8);
    scraping(&mut config, vec![format!("http://{}/metrics", vllm.addr)]);
    let server = TestServer::start(config).await;
    // An idle engine: an empty KV cache and queue, read as numbers (the gauges are NaN until
    // an engine answers).
    let read = |m: &Metrics| {
        [
            "tollgate_engine_kv_cache_usage_ratio",
            "tollgate_engine_requests_waiting",
            "tollgate_engine_saturation_ratio",
        ]
        .map(|name| m.value(name, &[]))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut m = server.metrics().await;
    while (m.value("tollgate_engine_scrapes_total", &["result=\"ok\""]) < 3.0
        || read(&m) != [0.0; 3])
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        m = server.metrics().await;
    }
    assert!(m.value("tollgate_engine_scrapes_total", &["result=\"ok\""]) >= 3.0);
    assert_eq!(read(&m), [0.0; 3]);
    server.stop().await.unwrap();
}
