//! Level 4: a client → real Envoy (envoy/front-proxy.yaml) → the example upstream, with the
//! tollgate binary as Envoy's ext_proc service. What a platform engineer's users would see.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::support::process::Stack;

/// The built-in defaults, as `tollgate` with no config runs.
const DEFAULTS: &str = "{}\n";

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Write a haiku about fair queues."}],
        "max_tokens": 8,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The response as the client received it: status, headers, body text.
async fn send(
    stack: &Stack,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut request = stack.client.post(stack.url(path)).body(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request.send().await.expect("Envoy answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.expect("body"))
}

fn header<'a>(headers: &'a reqwest::header::HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Request headers as (name, value) pairs.
type Headers<'a> = &'a [(&'a str, &'a str)];

const USER: [(&str, &str); 2] = [("content-type", "application/json"), ("x-user-id", "alice")];

/// Drops the fields that differ between two answers by the upstream (id, created).
fn stable(mut response: Value) -> Value {
    for field in ["id", "created"] {
        response.as_object_mut().unwrap().remove(field);
    }
    response
}

/// The text a stream's SSE events carried, their `delta.content`s joined.
fn streamed_text(events: &[&str]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e.trim_start_matches("data: ")).ok())
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test]
async fn chat_json_passes_and_reaches_the_client_unchanged() {
    let stack = Stack::start(DEFAULTS, &[]).await;
    let body = serde_json::to_vec(&chat(json!({}))).unwrap();
    let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, body.clone()).await;
    assert_eq!(status, 200, "{text}");
    // What tollgate told the upstream, echoed back by it.
    assert_eq!(
        header(&headers, "x-upstream-saw-x-tollgate-tenant"),
        Some("alice")
    );
    assert_eq!(
        header(&headers, "x-upstream-saw-x-tollgate-tier"),
        Some("free")
    );
    let counted: u32 = header(&headers, "x-upstream-saw-x-tollgate-input-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(counted > 10, "input tokens counted: {counted}");
    assert_eq!(
        header(&headers, "x-upstream-body-bytes"),
        Some(body.len().to_string().as_str())
    );

    // The same request straight to the upstream gives the same answer.
    let direct = stack
        .client
        .post(stack.upstream_url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let direct: Value = direct.json().await.unwrap();
    let via_envoy: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(stable(via_envoy.clone()), stable(direct));
    assert_eq!(via_envoy["usage"]["completion_tokens"], 8);

    stack
        .tollgate
        .wait_for_metric(
            "tollgate_stream_completions_total",
            &["result=\"complete\""],
            1.0,
        )
        .await;
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value(
            "tollgate_usage_tokens_total",
            &["tier=\"free\"", "kind=\"completion\""]
        ),
        8.0
    );
    assert_eq!(
        m.value(
            "tollgate_time_to_first_token_seconds_count",
            &["tier=\"free\""]
        ),
        1.0
    );
}

#[tokio::test]
async fn streamed_chat_passes_with_usage_requested_and_observed() {
    let stack = Stack::start(DEFAULTS, &[]).await;
    let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": 5}))).unwrap();
    let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(header(&headers, "content-type"), Some("text/event-stream"));
    // tollgate asked the upstream for a usage chunk; the body was rewritten and its length fixed.
    assert_eq!(header(&headers, "x-upstream-include-usage"), Some("true"));
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let usage: Value =
        serde_json::from_str(events[events.len() - 2].trim_start_matches("data: ")).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    let content = streamed_text(&events);
    assert_eq!(
        content.split_whitespace().count(),
        5,
        "every token arrived: {content:?}"
    );

    stack
        .tollgate
        .wait_for_metric(
            "tollgate_stream_completions_total",
            &["result=\"complete\""],
            1.0,
        )
        .await;
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value(
            "tollgate_usage_tokens_total",
            &["tier=\"free\"", "kind=\"completion\""]
        ),
        5.0
    );
    assert_eq!(m.value("tollgate_held_streams", &[]), 0.0);
}

#[tokio::test]
async fn refusals_reach_the_client_as_openai_errors() {
    let stack = Stack::start(DEFAULTS, &[]).await;
    let cases: [(Headers<'_>, Vec<u8>, u16, &str); 4] = [
        (
            &[("content-type", "application/json")],
            serde_json::to_vec(&chat(json!({}))).unwrap(),
            401,
            "missing_identity",
        ),
        (
            &USER,
            b"{\"model\": \"gpt-4o\", \"messages\": [".to_vec(),
            400,
            "malformed_json",
        ),
        (
            &USER,
            serde_json::to_vec(&chat(json!({"max_tokens": 50_000}))).unwrap(),
            400,
            "output_tokens_exceeded",
        ),
        (
            &USER,
            serde_json::to_vec(&chat(json!({"max_tokens": -3}))).unwrap(),
            400,
            "invalid_max_tokens",
        ),
    ];
    for (headers, body, want_status, want_reason) in cases {
        let (status, response_headers, text) =
            send(&stack, "/v1/chat/completions", headers, body).await;
        assert_eq!(status, want_status, "{text}");
        assert_eq!(
            header(&response_headers, "x-tollgate-reason"),
            Some(want_reason)
        );
        assert_eq!(
            header(&response_headers, "content-type"),
            Some("application/json")
        );
        let error: Value = serde_json::from_str(&text).unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{text}"
        );
        // The upstream never saw it.
        assert!(header(&response_headers, "x-upstream-body-bytes").is_none());
    }
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"rejected\""]),
        4.0
    );
}

#[tokio::test]
async fn oversized_max_tokens_is_clamped_under_the_clamp_policy() {
    let config = "tiers:\n  free:\n    max_output_tokens: 64\n    output_limit: clamp\n";
    let stack = Stack::start(config, &[]).await;
    let body = serde_json::to_vec(&chat(json!({"max_tokens": 50_000}))).unwrap();
    let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        header(&headers, "x-upstream-request-max-tokens"),
        Some("64")
    );
    let response: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(response["usage"]["completion_tokens"], 64);
}

#[tokio::test]
async fn non_inference_paths_pass_through_untouched() {
    let stack = Stack::start(DEFAULTS, &[]).await;
    // Not JSON, no identity: tollgate has no business with it.
    let body = b"\x00\x01 arbitrary bytes, not an OpenAI request".to_vec();
    let (status, headers, text) = send(
        &stack,
        "/echo",
        &[
            ("content-type", "application/octet-stream"),
            ("x-tollgate-tenant", "spoofed"),
        ],
        body.clone(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(text.as_bytes(), body.as_slice());
    assert_eq!(
        header(&headers, "x-upstream-saw-x-tollgate-tenant"),
        Some("spoofed")
    );
    let health = stack.client.get(stack.url("/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"passed_through\""]),
        2.0
    );
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"admitted\""]),
        0.0
    );
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_leaves_no_held_stream() {
    let stack = Stack::start(DEFAULTS, &["--itl-ms", "200"]).await;
    let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": 100}))).unwrap();
    let mut request = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .body(body);
    for (k, v) in USER {
        request = request.header(k, v);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let mut chunks = response.bytes_stream();
    let first = chunks.next().await.expect("a first chunk").unwrap();
    assert!(!first.is_empty());
    stack
        .tollgate
        .wait_for_metric("tollgate_held_streams", &[], 1.0)
        .await;
    drop(chunks);

    stack
        .tollgate
        .wait_for_metric("tollgate_held_streams", &[], 0.0)
        .await;
    stack
        .tollgate
        .wait_for_metric(
            "tollgate_stream_completions_total",
            &["result=\"truncated\""],
            1.0,
        )
        .await;
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value(
            "tollgate_stream_completions_total",
            &["result=\"complete\""]
        ),
        0.0
    );
    assert_eq!(
        m.value(
            "tollgate_time_to_first_token_seconds_count",
            &["tier=\"free\""]
        ),
        1.0
    );
}

/// The testkit's own guard, on every Envoy version of the matrix: a listener port another
/// process took between being picked and being bound makes Envoy exit saying so, and
/// `Envoy::launch` starts it again on fresh ports (as for its admin port; a clean-clone run
/// lost an e2e test to a taken port before the guard).
#[tokio::test]
async fn envoy_is_started_again_when_its_listener_port_was_taken() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let taken_port = taken.local_addr().unwrap().port();
    let stack = Stack::start_on(DEFAULTS, &[], |ports| ports.listen = taken_port).await;
    assert_ne!(stack.envoy.listen.port(), taken_port, "fresh ports");
    let body = serde_json::to_vec(&chat(json!({}))).unwrap();
    let (status, _, _) = send(&stack, "/v1/chat/completions", &USER, body).await;
    assert_eq!(status, 200);
    drop(taken);
}

#[tokio::test]
async fn an_upstream_that_cuts_the_stream_is_counted_as_truncated() {
    // Tokens 50 ms apart, so the 200 reaches the client before the upstream aborts (an abort
    // before Envoy forwarded the headers becomes Envoy's own 502).
    let stack = Stack::start(DEFAULTS, &["--itl-ms", "50"]).await;
    let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": 20}))).unwrap();
    let mut request = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .body(body);
    for (k, v) in USER.iter().chain(&[("x-upstream-truncate-after", "3")]) {
        request = request.header(*k, *v);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200, "the 200 was already sent");
    assert!(
        response.text().await.is_err(),
        "the client sees an incomplete body"
    );
    stack
        .tollgate
        .wait_for_metric(
            "tollgate_stream_completions_total",
            &["result=\"truncated\""],
            1.0,
        )
        .await;
    stack
        .tollgate
        .wait_for_metric("tollgate_held_streams", &[], 0.0)
        .await;
}

#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    let mut stack = Stack::start(
        "shutdown:\n  drain_deadline_ms: 3000\n",
        &["--itl-ms", "100"],
    )
    .await;
    let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": 10}))).unwrap();
    let mut request = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .body(body);
    for (k, v) in USER {
        request = request.header(k, v);
    }
    let response = request.send().await.unwrap();
    stack
        .tollgate
        .wait_for_metric("tollgate_held_streams", &[], 1.0)
        .await;
    stack.tollgate.terminate();
    // The admitted stream finishes normally while tollgate drains.
    let text = response
        .text()
        .await
        .expect("the in-flight response completes");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let status = stack.tollgate.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "exit status {status}");
}

#[tokio::test]
async fn a_body_over_envoys_buffer_limit_gets_envoys_413() {
    let stack = Stack::start(DEFAULTS, &[]).await;
    // 9 MiB: over the front proxy's 8 MiB per-connection buffer.
    let content = "x".repeat(9 * 1024 * 1024);
    let body = serde_json::to_vec(&chat(
        json!({"messages": [{"role": "user", "content": content}]}),
    ))
    .unwrap();
    let (status, _, _) = send(&stack, "/v1/chat/completions", &USER, body).await;
    assert_eq!(status, 413);
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value("tollgate_protocol_errors_total", &["kind=\"out_of_order\""]),
        0.0
    );
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"admitted\""]),
        0.0
    );
}

/// One slot and no controller, so a second request must wait for the first.
const ONE_SLOT: &str = "scheduler:\n  initial_limit: 1\ncontrol:\n  enabled: false\n\
tiers:\n  free:\n    queue_max: 2\n    queue_deadline_ms: 1000\n  premium:\n    weight: 4\n    queue_max: 8\n    queue_deadline_ms: 5000\n";

/// Starts a request that holds the only slot for `hold_ms` (the upstream's first token comes
/// that late), and waits until tollgate has admitted it.
async fn hold_the_slot(stack: &Stack, hold_ms: &str) -> tokio::task::JoinHandle<u16> {
    let request = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-user-id", "holder")
        .header("x-upstream-ttft-ms", hold_ms)
        .body(serde_json::to_vec(&chat(json!({}))).unwrap());
    let holder = tokio::spawn(async move { request.send().await.unwrap().status().as_u16() });
    stack
        .tollgate
        .wait_for_metric("tollgate_requests_total", &["outcome=\"admitted\""], 1.0)
        .await;
    holder
}

#[tokio::test]
async fn a_request_queued_longer_than_envoys_message_timeout_is_admitted_and_completes() {
    let stack = Stack::start(ONE_SLOT, &[]).await;
    // Envoy's message_timeout is 1 s; the slot is busy for 2.5 s.
    let holder = hold_the_slot(&stack, "2500").await;
    let headers = [
        ("content-type", "application/json"),
        ("x-user-id", "bob"),
        ("x-user-tier", "premium"),
    ];
    let (status, _, text) = send(
        &stack,
        "/v1/chat/completions",
        &headers,
        serde_json::to_vec(&chat(json!({}))).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(holder.await.unwrap(), 200);
    let m = stack.tollgate.metrics().await;
    assert_eq!(
        m.value(
            "tollgate_scheduler_outcomes_total",
            &["tier=\"premium\"", "outcome=\"admitted_after_wait\""]
        ),
        1.0
    );
    // It cannot have waited less than the holder held the slot minus its head start.
    assert!(m.value("tollgate_queue_wait_seconds_sum", &["tier=\"premium\""]) > 1.0);
}

#[tokio::test]
async fn a_queue_timeout_reaches_the_client_as_503_with_retry_after() {
    let stack = Stack::start(ONE_SLOT, &[]).await;
    let holder = hold_the_slot(&stack, "3000").await;
    let (status, headers, text) = send(
        &stack,
        "/v1/chat/completions",
        &USER,
        serde_json::to_vec(&chat(json!({}))).unwrap(),
    )
    .await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(header(&headers, "x-tollgate-reason"), Some("queue_timeout"));
    assert_eq!(header(&headers, "retry-after"), Some("1"));
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["type"], "server_error");
    assert_eq!(holder.await.unwrap(), 200);
}

/// One request at a time per user, with a token window: the tier of the concurrency 429 tests.
const ONE_AT_A_TIME: &str = "tiers:\n  free:\n    max_concurrent: 1\n    tokens_per_hour: 100000\n";

/// The user `hold_the_slot` sends as.
const HOLDER: [(&str, &str); 2] = [
    ("content-type", "application/json"),
    ("x-user-id", "holder"),
];

/// A second request of the holder's while its first holds its one concurrent slot
/// (`ONE_AT_A_TIME`): refused with a 429 that names its concurrency and its token window.
/// Its headers and body.
async fn refused_beside_the_holder(
    stack: &Stack,
    body: Vec<u8>,
) -> (reqwest::header::HeaderMap, String) {
    let (status, headers, text) = send(stack, "/v1/chat/completions", &HOLDER, body).await;
    assert_eq!(status, 429, "{text}");
    assert_eq!(
        header(&headers, "x-tollgate-reason"),
        Some("concurrency_limit_reached")
    );
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("100000"));
    assert!(
        header(&headers, "ratelimit").is_some_and(|r| r.contains("\"concurrency\";r=0")),
        "no slot left: {headers:?}"
    );
    (headers, text)
}

#[tokio::test]
async fn a_429_carries_rate_limit_headers_and_a_client_honouring_retry_after_gets_through() {
    // The first request holds its lease for 1.5 s.
    let stack = Stack::start(ONE_AT_A_TIME, &[]).await;
    let holder = hold_the_slot(&stack, "1500").await;
    let body = serde_json::to_vec(&chat(json!({}))).unwrap();

    let (headers, text) = refused_beside_the_holder(&stack, body.clone()).await;
    assert_eq!(header(&headers, "retry-after"), Some("1"));
    assert!(header(&headers, "x-ratelimit-remaining-tokens").is_some());
    assert!(header(&headers, "x-ratelimit-reset-tokens").is_some());
    for absent in [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    ] {
        assert_eq!(
            header(&headers, absent),
            None,
            "no requests_per_minute configured, so no {absent}"
        );
    }
    assert!(
        header(&headers, "ratelimit-policy")
            .unwrap()
            .contains("\"concurrency\";q=1")
    );
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");

    // A well-behaved client waits as told and tries again.
    let mut attempts = 1;
    let status = loop {
        let (status, headers, _) =
            send(&stack, "/v1/chat/completions", &HOLDER, body.clone()).await;
        attempts += 1;
        if status != 429 || attempts > 10 {
            break status;
        }
        let wait: u64 = header(&headers, "retry-after").unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_secs(wait)).await;
    };
    assert_eq!(status, 200, "got through after {attempts} attempts");
    assert_eq!(holder.await.unwrap(), 200);
}

/// A tier with a request-rate window and a token window, both per minute: 1,000 tokens hold two
/// requests reserving ~420 each (and the example upstream really generates `max_tokens`, so
/// settling leaves them charged); a third is refused by the token window. The hard limits are
/// lowered so the largest single request (500 + 500) fits the window, as the policy requires.
const RATE_AND_TOKENS: &str = "tiers:\n  free:\n    requests_per_minute: 50\n    \
tokens_per_minute: 1000\n    max_input_tokens: 500\n    max_output_tokens: 500\n";

#[tokio::test]
async fn a_token_window_429_through_envoy_carries_every_rate_limit_header() {
    let stack = Stack::start(RATE_AND_TOKENS, &[]).await;
    let body =
        |max_tokens: u64| serde_json::to_vec(&chat(json!({"max_tokens": max_tokens}))).unwrap();
    for i in 0..2 {
        let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, body(400)).await;
        assert_eq!(status, 200, "request {i}: {text}");
        assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("50"));
    }

    let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, body(400)).await;
    assert_eq!(status, 429, "{text}");
    assert_eq!(
        header(&headers, "x-tollgate-reason"),
        Some("token_budget_exhausted")
    );
    // The six OpenAI headers: a requests window is configured, so its three are there too.
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("50"));
    assert_eq!(
        header(&headers, "x-ratelimit-remaining-requests"),
        Some("48"),
        "two requests counted; the refused one consumes nothing"
    );
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("1000"));
    let remaining: u64 = header(&headers, "x-ratelimit-remaining-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        remaining < 420,
        "{remaining} left: the request does not fit"
    );
    for reset in ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"] {
        let value = header(&headers, reset).unwrap_or_else(|| panic!("{reset} missing"));
        assert!(
            value.ends_with('s') && value.len() > 1,
            "{reset}: a duration like 59s or 1m0s: {value:?}"
        );
    }
    let policy = header(&headers, "ratelimit-policy").unwrap();
    assert!(
        policy.contains("\"requests_minute\";q=50;w=60")
            && policy.contains("\"tokens_minute\";q=1000;w=60;qu=\"tokens\""),
        "{policy}"
    );
    let ratelimit = header(&headers, "ratelimit").unwrap();
    assert!(
        ratelimit.contains("\"requests_minute\";r=48;t=")
            && ratelimit.contains(&format!("\"tokens_minute\";r={remaining};t=")),
        "{ratelimit}"
    );
    // When enough of the window frees: computed, so more than the constant 1 s a concurrency
    // refusal gets (the charged tokens are seconds old at most), and within the 60 s window.
    let retry_after: u64 = header(&headers, "retry-after").unwrap().parse().unwrap();
    assert!(
        (2..=60).contains(&retry_after),
        "Retry-After {retry_after} s for a 60 s token window"
    );
    assert_eq!(header(&headers, "x-should-retry"), None);
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");

    // Larger than the whole window's budget (three choices of 400 tokens each): it can never
    // pass, and the client is told so.
    let oversized = serde_json::to_vec(&chat(json!({"max_tokens": 400, "n": 3}))).unwrap();
    let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, oversized).await;
    assert_eq!(status, 429, "{text}");
    assert_eq!(
        header(&headers, "x-tollgate-reason"),
        Some("request_exceeds_budget")
    );
    assert_eq!(header(&headers, "x-should-retry"), Some("false"));
    assert_eq!(header(&headers, "retry-after"), None);
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
}

// ---------------------------------------------------------------------------------------------
// envoy/front-proxy-reports.yaml: the response reported on instead of streamed through tollgate

/// Client → Envoy with envoy/front-proxy-reports.yaml → the example upstream, on the suite's
/// Envoy (the matrix runs it on 1.36.4, 1.38.3 and 1.40.0).
async fn reports_stack() -> Stack {
    let version = crate::support::envoy::e2e_envoy_version();
    Stack::start_with("front-proxy-reports.yaml", &version, DEFAULTS, &[], |_| {}).await
}

/// tollgate's metrics once `want` responses have ended as `result`.
async fn once_ended(stack: &Stack, result: &str, want: f64) -> tollgate_testkit::metrics::Metrics {
    let label = format!("result=\"{result}\"");
    stack
        .tollgate
        .wait_for_metrics(|m| {
            let ended = m.value("tollgate_stream_completions_total", &[&label]);
            (ended == want)
                .then_some(())
                .ok_or(format!("{result}: {ended}"))
        })
        .await
}

/// `tollgate_response_reports_total{report, outcome}`.
fn reports_of(m: &tollgate_testkit::metrics::Metrics, report: &str, outcome: &str) -> f64 {
    m.value(
        "tollgate_response_reports_total",
        &[
            &format!("report=\"{report}\""),
            &format!("outcome=\"{outcome}\""),
        ],
    )
}

/// A streamed chat of `max_tokens` sent with `headers`, its response not read yet.
async fn stream_with(stack: &Stack, headers: Headers<'_>, max_tokens: u32) -> reqwest::Response {
    let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": max_tokens})));
    let mut request = stack
        .client
        .post(stack.url("/v1/chat/completions"))
        .body(body.unwrap());
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    request.send().await.expect("Envoy answers")
}

/// Proves: with the response reported on, a streamed answer reaches the client
/// whole although tollgate closes the first-token stream after its first chunk; tollgate times
/// the first token from that report, settles the budget with the usage Envoy's Lua script read
/// from the last chunk, counts the stream complete, and frees the slot. A JSON answer's usage comes through
/// json_to_metadata the same way. Envoy's own counters show the cost: the decision's two
/// messages and one chunk per response, not one per token.
#[tokio::test]
async fn reported_responses_are_timed_and_settled_with_their_usage() {
    let stack = reports_stack().await;
    let tokens = 12;
    let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": tokens}))).unwrap();
    let (status, headers, text) = send(&stack, "/v1/chat/completions", &USER, body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(header(&headers, "x-upstream-include-usage"), Some("true"));
    // The budget headers, added by Envoy from the admission's metadata: tollgate is not shown
    // the response headers. Only the windows configured (no requests_per_minute here).
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("100000"));
    assert!(header(&headers, "x-ratelimit-remaining-tokens").is_some());
    assert!(header(&headers, "x-ratelimit-reset-tokens").is_some());
    assert_eq!(header(&headers, "x-ratelimit-limit-requests"), None);
    assert!(header(&headers, "ratelimit-policy").is_some_and(|p| p.contains("q=100000")));
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let content = streamed_text(&events);
    assert_eq!(
        content.split_whitespace().count(),
        tokens,
        "every token arrived after the first-token stream closed: {content:?}"
    );

    once_ended(&stack, "complete", 1.0).await;
    // A scrape is not atomic across series: each figure is awaited, not read once.
    let settled = ["tier=\"free\"", "kind=\"output\"", "stage=\"settled\""];
    let completion = ["tier=\"free\"", "kind=\"completion\""];
    let tollgate = &stack.tollgate;
    tollgate
        .wait_for_metric("tollgate_usage_tokens_total", &completion, tokens as f64)
        .await;
    tollgate
        .wait_for_metric("tollgate_budget_tokens_total", &settled, tokens as f64)
        .await;
    // The whole answer came at once: its summary can overtake its first token, which is still
    // recorded (after the settlement).
    let matched = ["report=\"first_token\"", "outcome=\"matched\""];
    tollgate
        .wait_for_metric("tollgate_response_reports_total", &matched, 1.0)
        .await;
    // The summary is counted once handed to the request's end, which may settle first.
    let summary = ["report=\"summary\"", "outcome=\"matched\""];
    tollgate
        .wait_for_metric("tollgate_response_reports_total", &summary, 1.0)
        .await;
    let m = tollgate.metrics().await;
    assert_eq!(reports_of(&m, "summary", "missing"), 0.0);
    assert_eq!(reports_of(&m, "first_token", "missing"), 0.0);
    assert_eq!(
        m.value(
            "tollgate_time_to_first_token_seconds_count",
            &["tier=\"free\""]
        ),
        1.0
    );
    // Published each control tick.
    tollgate
        .wait_for_metric("tollgate_inflight_requests", &[], 0.0)
        .await;

    // A JSON answer: its usage read by json_to_metadata; the client gets the body unchanged.
    let body = serde_json::to_vec(&chat(json!({"max_tokens": 5}))).unwrap();
    let (status, _, text) = send(&stack, "/v1/chat/completions", &USER, body).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).expect("the JSON answer, whole");
    assert_eq!(answer["usage"]["completion_tokens"], 5);
    once_ended(&stack, "complete", 2.0).await;
    tollgate
        .wait_for_metric(
            "tollgate_usage_tokens_total",
            &completion,
            (tokens + 5) as f64,
        )
        .await;

    // Per response: the decision's request headers and body, and the chunks Envoy sent before
    // tollgate's close reached it: here the upstream sends its whole answer at once, so that is
    // the body and its end, two. Not one per token (17 tokens in all).
    let stats = stack
        .envoy
        .stats(r"^http\.ingress\.ext_proc\.stream_msgs_sent$")
        .await
        .expect("Envoy's stats");
    let sent = stats["http.ingress.ext_proc.stream_msgs_sent"];
    assert!((6..=8).contains(&sent), "{stats:?}");
}

/// Proves: with the response reported on, a stream the upstream cuts off is
/// counted truncated (its summary has no usage) and charged its reserved output; a client that
/// leaves mid-stream the same; an upstream error refunds the request. Each frees its slot.
/// Responses to requests tollgate did not admit (a refusal, a path it lets through) open no
/// first-token stream and send no summary.
#[tokio::test]
async fn reported_responses_that_end_badly_are_told_apart() {
    let stack = reports_stack().await;
    // Requests tollgate lets through untimed (a non-inference path, the model list): no tag,
    // so no first-token stream and no summary.
    for path in ["/health", "/v1/models"] {
        let response = stack.client.get(stack.url(path)).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 200, "{path}");
        assert!(
            !response.bytes().await.unwrap().is_empty(),
            "{path} has a body"
        );
    }
    // A refusal: not admitted, so no tag; the access log sends nothing for it, and the
    // first-token filter skips its body.
    let no_identity = [("content-type", "application/json")];
    let refused = serde_json::to_vec(&chat(json!({"stream": true}))).unwrap();
    let (status, _, _) = send(&stack, "/v1/chat/completions", &no_identity, refused).await;
    assert_eq!(status, 401);
    let max_tokens = 10;
    // Paced, so the response headers reach the client before the upstream aborts.
    let truncate = [
        USER[0],
        USER[1],
        ("x-upstream-truncate-after", "3"),
        ("x-upstream-itl-ms", "20"),
    ];
    let response = stream_with(&stack, &truncate, max_tokens).await;
    assert_eq!(response.status(), 200);
    // The body ends in an error: the upstream aborted the connection.
    let _ = response.text().await;
    once_ended(&stack, "truncated", 1.0).await;
    // A truncated stream is charged its reserved output.
    let settled = ["tier=\"free\"", "kind=\"output\"", "stage=\"settled\""];
    stack
        .tollgate
        .wait_for_metric(
            "tollgate_budget_tokens_total",
            &settled,
            f64::from(max_tokens),
        )
        .await;

    // A client that goes away after the second token. Its slot is held until then: the
    // decision's stream, shown nothing of the response, lives as long as the response.
    let slow = [USER[0], USER[1], ("x-upstream-itl-ms", "200")];
    let mut body = stream_with(&stack, &slow, max_tokens).await.bytes_stream();
    for _ in 0..2 {
        body.next().await.expect("a chunk").expect("its bytes");
    }
    // The gauge is published each control tick: awaited, not read once.
    stack
        .tollgate
        .wait_for_metric("tollgate_inflight_requests", &[], 1.0)
        .await;
    drop(body);
    once_ended(&stack, "truncated", 2.0).await;

    // An upstream error: the request is refunded.
    let failing = [USER[0], USER[1], ("x-upstream-status", "500")];
    assert_eq!(
        stream_with(&stack, &failing, max_tokens).await.status(),
        500
    );
    once_ended(&stack, "upstream_error", 1.0).await;
    // Awaited too: a summary is counted once it has been handed to the request's end, which
    // may count its completion first, on another worker.
    let m = stack
        .tollgate
        .wait_for_metrics(|m| {
            let matched = reports_of(m, "summary", "matched");
            (matched == 3.0)
                .then_some(())
                .ok_or(format!("summaries matched: {matched}"))
        })
        .await;
    assert_eq!(reports_of(&m, "summary", "missing"), 0.0);
    assert_eq!(
        reports_of(&m, "summary", "untagged"),
        0.0,
        "only admitted requests are logged"
    );
    assert_eq!(
        reports_of(&m, "first_token", "untagged"),
        0.0,
        "a response to a request not admitted opens no first-token stream (the filter skips it)"
    );
    // Awaited: the in-flight gauge is published each control tick, and the summary comes as
    // the response ends, so the last first-token stream may still be closing when the ending
    // is counted.
    for gauge in ["tollgate_inflight_requests", "tollgate_held_streams"] {
        stack.tollgate.wait_for_metric(gauge, &[], 0.0).await;
    }
}

/// Proves: with the response reported on, a refusal keeps its own rate-limit headers (the
/// route adds the admitted request's from the metadata, and a refused one has none there), and
/// the admitted request whose slot it waited for gets its own, with the concurrency it used.
#[tokio::test]
async fn reported_responses_and_refusals_carry_their_own_rate_limit_headers() {
    let version = crate::support::envoy::e2e_envoy_version();
    // A request's end waits up to 30 s for its summary here (2 s by default), so a lease held
    // until a missing summary gave up would outlast this test's waits.
    let one_at_a_time = format!("{ONE_AT_A_TIME}response:\n  summary_wait_ms: 30000\n");
    // The file as shipped but for its access log's flush interval, a minute here: a summary
    // that waited for a flush would come after this test's waits give up.
    let shipped =
        std::fs::read_to_string(crate::envoy_config::envoy_dir().join("front-proxy-reports.yaml"))
            .unwrap();
    let flush = "buffer_flush_interval: 0.1s";
    assert_eq!(shipped.matches(flush).count(), 1);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("front-proxy-reports.yaml");
    std::fs::write(
        &config,
        shipped.replace(flush, "buffer_flush_interval: 60s"),
    )
    .unwrap();
    let stack = Stack::start_with(
        config.to_str().unwrap(),
        &version,
        &one_at_a_time,
        &[],
        |_| {},
    )
    .await;
    let holder = hold_the_slot(&stack, "1500").await;
    let body = serde_json::to_vec(&chat(json!({}))).unwrap();
    // The refusal's own headers, not blanked by the route's.
    refused_beside_the_holder(&stack, body.clone()).await;
    assert_eq!(holder.await.unwrap(), 200);
    // Its lease ends when its summary comes, which Envoy sends as the response ends (the access
    // log's buffer_size_bytes: 0), not at the next flush: a minute away here. Batched, it held
    // the lease up to a flush interval longer, and a request sent at once was refused on all
    // three versions. Awaited here: the client's next request can still race the settlement,
    // as on front-proxy.yaml.
    stack
        .tollgate
        .wait_for_metric("tollgate_active_leases", &[], 0.0)
        .await;
    // Counted once handed to the request's end, which may release the lease first.
    let summary = ["report=\"summary\"", "outcome=\"matched\""];
    stack
        .tollgate
        .wait_for_metric("tollgate_response_reports_total", &summary, 1.0)
        .await;

    // Admitted now: the headers come from its admission (one slot, used by itself).
    let (status, headers, text) = send(&stack, "/v1/chat/completions", &HOLDER, body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(header(&headers, "x-tollgate-reason"), None);
    assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("100000"));
    assert!(
        header(&headers, "ratelimit-policy").is_some_and(|p| p.contains("\"concurrency\";q=1")),
        "{headers:?}"
    );
}

/// Proves: the Lua filter of front-proxy-reports.yaml reads a usage event that reaches Envoy in
/// pieces (the upstream writes them 50 ms apart) after three token chunks that end alike (all
/// but the first skipped): cut inside a key, inside a number, in three pieces followed by
/// `data:[DONE]` without its space under a capitalised content type, and with two pieces in a
/// row that are the same digit, the rest and `[DONE]` in one chunk (only the blank-line test
/// keeps the second digit: skipped as a chunk ending as the one before, the count read would
/// be 7). And usage in every event, as sglang's `continuous_usage_stats` sends it, ending alike
/// in fields that do not change, after a role event with `"usage":null`, the first usage's key
/// cut in three and the final usage in a chunk with the finish event: only the usage key found
/// across the pieces keeps the rest (skipped, the count read would be 1). Each
/// request is settled with its final usage and counted complete, not charged its reserved
/// output.
#[tokio::test]
async fn reported_usage_split_across_chunks_is_read_whole() {
    use tokio::io::AsyncWriteExt;

    use crate::support::envoy::{Envoy, EnvoyPorts};
    use crate::support::process::Tollgate;

    // An upstream that answers every request with three tokens, then the usage event cut inside
    // `"completion_tokens":77`, or (the last case) with usage in every event.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_port = listener.local_addr().unwrap().port();
    // Where the usage event is cut: inside a key, inside a number, in three pieces with
    // `data:[DONE]` (no space) on its own and the content type in capitals, and into pieces
    // `7` and `7`; the last case's usage is in every event (below).
    const CASES: [&[&str]; 5] = [
        &["\"completion_tok"],
        &["\"completion_tokens\":7"],
        &["\"prompt_tok", "\"completion_tokens\":7"],
        &[
            "\"completion_tokens\":",
            "\"completion_tokens\":7",
            "\"completion_tokens\":77",
        ],
        &[],
    ];
    const MIXED_CASE: usize = 2;
    const SAME_DIGITS: usize = 3;
    const USAGE_IN_EVERY_EVENT: usize = 4;
    // sglang's usage with `continuous_usage_stats`: in every event, ending in fields that do not
    // change (more than the 32 bytes the script compares).
    let usage_of = |choices: &str, completion: u32| {
        format!(
            "data: {{\"choices\":{choices},\"usage\":{{\"prompt_tokens\":11,\"total_tokens\":{},\
             \"completion_tokens\":{completion},\"prompt_tokens_details\":null,\
             \"reasoning_tokens\":0}}}}\n\n",
            11 + completion
        )
    };
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let served = served.clone();
            // Envoy keeps the connection for the next request: serve requests until it closes.
            tokio::spawn(async move {
                loop {
                    if crate::envoy_config::read_request(&mut socket)
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let case = served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":77,\"total_tokens\":88}}\n\n";
                    let chunk = |text: &str| format!("{:x}\r\n{text}\r\n", text.len());
                    let token =
                        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
                    let case = case % CASES.len();
                    let (content_type, done) = if case == MIXED_CASE {
                        ("Text/Event-Stream; charset=utf-8", "data:[DONE]\n\n")
                    } else {
                        ("text/event-stream", "data: [DONE]\n\n")
                    };
                    let mut pieces = vec![format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
                    )];
                    if case == USAGE_IN_EVERY_EVENT {
                        // The role with `"usage":null`; three tokens with their usage so far,
                        // the first cut in three inside its `"usage"` key; the finish and the
                        // usage event in one chunk; `[DONE]`. All after the first token end
                        // alike, and only its usage, seen across its three pieces, keeps them
                        // (read otherwise: 1).
                        let role = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\n\n";
                        let token = "[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]";
                        let finish = "[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]";
                        pieces.push(chunk(role));
                        let first = usage_of(token, 1);
                        // Cut after `"us` and after `"usag`.
                        let us = first.find("\"usage").unwrap() + 3;
                        for piece in [&first[..us], &first[us..us + 2], &first[us + 2..]] {
                            pieces.push(chunk(piece));
                        }
                        for completion in 2..=3 {
                            pieces.push(chunk(&usage_of(token, completion)));
                        }
                        pieces.push(chunk(&format!(
                            "{}{}",
                            usage_of(finish, 77),
                            usage_of("[]", 77)
                        )));
                        pieces.push(format!("{}0\r\n\r\n", chunk(done)));
                    } else {
                        // Three tokens that end alike, then the usage event in pieces, cut
                        // after each of `CASES[case]`.
                        pieces.extend([chunk(token), chunk(token), chunk(token)]);
                        let mut from = 0;
                        for cut in CASES[case] {
                            let at = usage.find(cut).unwrap() + cut.len();
                            pieces.push(chunk(&usage[from..at]));
                            from = at;
                        }
                        if case == SAME_DIGITS {
                            // In one chunk: four chunks of the usage and `[DONE]` would be more
                            // than the four the script keeps.
                            pieces.push(format!(
                                "{}0\r\n\r\n",
                                chunk(&format!("{}{done}", &usage[from..]))
                            ));
                        } else {
                            pieces.push(chunk(&usage[from..]));
                            pieces.push(format!("{}0\r\n\r\n", chunk(done)));
                        }
                    }
                    for piece in pieces {
                        if socket.write_all(piece.as_bytes()).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            });
        }
    });

    let tollgate = Tollgate::start(DEFAULTS).await;
    let config = crate::envoy_config::envoy_dir().join("front-proxy-reports.yaml");
    let ports = EnvoyPorts::free(upstream_port, tollgate.grpc.port());
    let envoy = Envoy::start(&crate::support::envoy::e2e_envoy_version(), &config, ports).await;
    let client = reqwest::Client::new();
    for _ in CASES {
        let body = serde_json::to_vec(&chat(json!({"stream": true, "max_tokens": 100}))).unwrap();
        let mut request = client
            .post(format!("http://{}/v1/chat/completions", envoy.listen))
            .body(body);
        for (k, v) in USER {
            request = request.header(k, v);
        }
        let text = request.send().await.unwrap().text().await.unwrap();
        assert!(text.ends_with("[DONE]\n\n"), "{text}");
    }
    tollgate
        .wait_for_metric(
            "tollgate_stream_completions_total",
            &["result=\"complete\""],
            CASES.len() as f64,
        )
        .await;
    tollgate
        .wait_for_metric(
            "tollgate_usage_tokens_total",
            &["tier=\"free\"", "kind=\"completion\""],
            77.0 * CASES.len() as f64,
        )
        .await;
}
