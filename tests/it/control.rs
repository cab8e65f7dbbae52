//! The controller through the whole server, in real time: what it measures (`control.signal`),
//! and requests that have not answered yet. Short ticks and a 150 ms target keep each test
//! around a second; every wait is many ticks longer than the effect it waits for.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingResponse, ProtocolConfiguration};
use tollgate::config::{Config, ControlConfig, ControlSignal};

use crate::support::server::*;

/// Target 150 ms (breach above 180 ms), a 50 ms tick, no slow start, any single sample enough;
/// the budget starts at and cannot grow past `limit`. Free tier, queue deadline 5 s.
fn config(signal: ControlSignal, limit: u32) -> Config {
    let mut config = Config::default();
    config.scheduler.initial_limit = limit;
    config.control = ControlConfig {
        enabled: true,
        signal,
        target_p99_ttft_ms: 150,
        upstream_target_p99_ttft_ms: 150,
        tick_ms: 50,
        window_ms: 5_000,
        cooldown_ticks: 0,
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
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
    matches!(answer.response, Some(Response::RequestBody(_)))
}

/// A chat request from `user`; the body's first answer (admitted, or an extension of Envoy's
/// timeout if it was queued). Without `sends_body`, the request headers carry Envoy's
/// `protocol_config` saying it will not send the response body.
async fn submit(
    server: &TestServer,
    user: &str,
    sends_body: bool,
) -> (ExtProcStream, ProcessingResponse) {
    let mut stream = server.stream().await;
    let mut headers = chat_headers(user);
    if !sends_body {
        headers.protocol_config = Some(ProtocolConfiguration {
            response_body_mode: BodySendMode::None as i32,
            ..ProtocolConfiguration::default()
        });
    }
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
    for (signal, limit_after) in [
        (ControlSignal::Upstream, 2.0),
        (ControlSignal::Gateway, 1.0),
    ] {
        let server = TestServer::start(config(signal, 2)).await;
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
    let server = TestServer::start(config(ControlSignal::Upstream, 4)).await;
    let mut stuck = admit_four(&server, true).await;
    // No first token, no finished sample: the four are overdue 180 ms after dispatch, and that
    // alone is a breach. 4 in flight x 0.9 = 3.6, so 3.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(limit(&server).await, 3.0);
    // They are still stuck, but they were dispatched before the cut: the window restarted
    // without them, so they do not cut again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(limit(&server).await, 3.0);
    // When they do answer, late, they still do not count.
    for stream in &mut stuck {
        first_token(stream).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(limit(&server).await, 3.0);
    drop(stuck);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn without_the_response_body_there_is_no_first_token_to_wait_for() {
    // Envoy says it will not send the response body: these requests will never report a
    // first token, and their age is not a latency.
    let server = TestServer::start(config(ControlSignal::Upstream, 4)).await;
    let open = admit_four(&server, false).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(limit(&server).await, 4.0);
    drop(open);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_request_that_ends_without_a_first_token_stops_counting() {
    // An upstream error before any body byte: the request is over, and must not go on aging
    // in the window as if it were still waiting.
    let server = TestServer::start(config(ControlSignal::Upstream, 4)).await;
    let (mut failed, answer) = submit(&server, "a", true).await;
    assert!(is_admitted(&answer), "{answer:?}");
    let mut headers_only = response_headers(502, "text/plain");
    if let Some(
        envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request::ResponseHeaders(
            h,
        ),
    ) = headers_only.request.as_mut()
    {
        h.end_of_stream = true;
    }
    failed.exchange(headers_only).await;
    drop(failed);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(limit(&server).await, 4.0);
    server.stop().await.unwrap();
}
