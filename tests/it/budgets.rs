//! Per-user budgets through the gRPC server with the embedded store: what a tenant is allowed,
//! what it is told, and that whatever a request does not use (or never got to use) comes back.

use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingResponse, processing_response::Response,
};
use tollgate::config::Config;

use crate::support::server::*;

/// One tier, `free`, with only the budgets a test sets.
fn budgets(edit: impl FnOnce(&mut tollgate::config::TierConfig)) -> Config {
    let mut config = Config::default();
    config.control.enabled = false;
    // Tests end with streams still open; do not wait the production drain deadline for them.
    config.shutdown.drain_deadline_ms = 100;
    let free = config.tiers.get_mut("free").unwrap();
    free.tokens_per_hour = None;
    free.max_concurrent = None;
    free.queue_max = 0;
    edit(free);
    config
}

/// Headers set by an answer (request body, response headers or immediate response).
fn set_headers(answer: &ProcessingResponse) -> Vec<(String, String)> {
    let mutation = match &answer.response {
        Some(Response::RequestBody(b)) => {
            b.response.as_ref().and_then(|c| c.header_mutation.clone())
        }
        Some(Response::ResponseHeaders(h)) => {
            h.response.as_ref().and_then(|c| c.header_mutation.clone())
        }
        Some(Response::ImmediateResponse(r)) => r.headers.clone(),
        _ => None,
    };
    mutation
        .map(|m| {
            m.set_headers
                .into_iter()
                .map(|h| {
                    let h = h.header.unwrap();
                    (h.key, String::from_utf8(h.raw_value).unwrap())
                })
                .collect()
        })
        .unwrap_or_default()
}

fn header(answer: &ProcessingResponse, name: &str) -> Option<String> {
    set_headers(answer)
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

fn status(answer: &ProcessingResponse) -> Option<i32> {
    match &answer.response {
        Some(Response::ImmediateResponse(r)) => r.status.as_ref().map(|s| s.code),
        _ => None,
    }
}

fn admitted(answer: &ProcessingResponse) -> bool {
    matches!(answer.response, Some(Response::RequestBody(_)))
}

/// A request from `user` asking for `max_tokens`; returns the open stream and the body's answer.
async fn request(
    server: &TestServer,
    user: &str,
    extra: serde_json::Value,
) -> (ExtProcStream, ProcessingResponse) {
    let mut stream = server.stream().await;
    stream.exchange(chat_headers(user)).await;
    let answer = stream.exchange(request_body(&chat_body(extra))).await;
    (stream, answer)
}

/// Finishes an admitted request with the upstream reporting `usage`.
async fn complete(stream: &mut ExtProcStream, prompt: u64, completion: u64) {
    stream
        .exchange(response_headers(200, "application/json"))
        .await;
    let body = serde_json::json!({
        "choices": [{"message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    });
    stream
        .exchange(response_body(body.to_string().as_bytes(), true))
        .await;
    stream.close();
    assert!(stream.recv().await.unwrap().is_none());
}

#[tokio::test]
async fn an_exhausted_token_budget_answers_429_with_rate_limit_headers() {
    // 30,000 tokens an hour; each request reserves its input (~13) + 4,096 output.
    let server = TestServer::start(budgets(|t| t.tokens_per_hour = Some(30_000))).await;
    let mut held = Vec::new();
    for _ in 0..7 {
        let (stream, answer) = request(&server, "alice", serde_json::json!({})).await;
        assert!(admitted(&answer), "{answer:?}");
        held.push(stream);
    }
    // Seven reservations of 13 input + 4,096 output tokens leave 30,000 - 28,763.
    let probe = held_answer(&server).await;
    assert_eq!(status(&probe), Some(429));
    assert_eq!(
        header(&probe, "x-ratelimit-remaining-tokens").as_deref(),
        Some("1237")
    );

    let (_, answer) = request(&server, "alice", serde_json::json!({})).await;
    assert_eq!(status(&answer), Some(429));
    assert_eq!(
        header(&answer, "x-tollgate-reason").as_deref(),
        Some("token_budget_exhausted")
    );
    let retry_after: u64 = header(&answer, "retry-after").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&retry_after), "{retry_after}");
    assert_eq!(
        header(&answer, "x-ratelimit-limit-tokens").as_deref(),
        Some("30000")
    );
    assert!(
        header(&answer, "ratelimit-policy")
            .unwrap()
            .contains("\"tokens_hour\";q=30000;w=3600")
    );
    assert!(
        header(&answer, "ratelimit")
            .unwrap()
            .starts_with("\"tokens_hour\";r=")
    );
    // Another tenant is not affected. (Streams stay open: a dropped one would be settled.)
    let (_bob, answer) = request(&server, "bob", serde_json::json!({})).await;
    assert!(admitted(&answer));

    // One request ends having used 20 tokens: the rest of its reservation comes back.
    complete(&mut held[0], 10, 10).await;
    let (_again, answer) = request(&server, "alice", serde_json::json!({})).await;
    assert!(admitted(&answer), "the refund made room: {answer:?}");
    let m = server.metrics().await;
    assert_eq!(
        m.value(
            "tollgate_rejections_total",
            &["reason=\"token_budget_exhausted\"", "tier=\"free\""]
        ),
        2.0
    );
    // 4,096 reserved, 10 used.
    assert_eq!(
        m.value(
            "tollgate_budget_tokens_total",
            &["tier=\"free\"", "kind=\"output\"", "stage=\"refunded\""]
        ),
        4086.0
    );
    server.stop().await.unwrap();
}

/// A refused request for alice (used to read her remaining budget from the 429).
async fn held_answer(server: &TestServer) -> ProcessingResponse {
    request(server, "alice", serde_json::json!({})).await.1
}

#[tokio::test]
async fn admitted_requests_carry_their_budget_upstream_and_back_to_the_client() {
    let server = TestServer::start(budgets(|t| {
        t.tokens_per_hour = Some(100_000);
        t.max_concurrent = Some(3);
    }))
    .await;
    let (mut stream, answer) =
        request(&server, "carol", serde_json::json!({"max_tokens": 100})).await;
    assert!(admitted(&answer));
    assert_eq!(
        header(&answer, "x-ratelimit-limit-tokens").as_deref(),
        Some("100000")
    );
    let remaining: u64 = header(&answer, "x-ratelimit-remaining-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(remaining, 100_000 - 113, "13 input + 100 output reserved");
    assert!(
        header(&answer, "ratelimit")
            .unwrap()
            .contains("\"concurrency\";r=2")
    );
    // The same numbers are added to the client's response.
    let answer = stream
        .exchange(response_headers(200, "application/json"))
        .await;
    assert_eq!(
        header(&answer, "x-ratelimit-remaining-tokens"),
        Some(remaining.to_string())
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn concurrency_is_capped_per_user_and_freed_when_a_request_ends() {
    let server = TestServer::start(budgets(|t| t.max_concurrent = Some(2))).await;
    let (mut first, _) = request(&server, "dave", serde_json::json!({})).await;
    let (_second, _) = request(&server, "dave", serde_json::json!({})).await;
    let (_, answer) = request(&server, "dave", serde_json::json!({})).await;
    assert_eq!(status(&answer), Some(429));
    assert_eq!(
        header(&answer, "x-tollgate-reason").as_deref(),
        Some("concurrency_limit_reached")
    );
    assert_eq!(
        header(&answer, "retry-after").as_deref(),
        Some("1"),
        "not the lease TTL"
    );
    complete(&mut first, 10, 10).await;
    let (_, answer) = request(&server, "dave", serde_json::json!({})).await;
    assert!(
        admitted(&answer),
        "the finished request's lease was released: {answer:?}"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_request_larger_than_the_whole_budget_is_told_not_to_retry() {
    let server = TestServer::start(budgets(|t| t.tokens_per_hour = Some(30_000))).await;
    // n = 8 choices of up to 4,096 tokens each: 32,768 output tokens can never fit in 30,000.
    let (_, answer) = request(&server, "erin", serde_json::json!({"n": 8})).await;
    assert_eq!(status(&answer), Some(429));
    assert_eq!(
        header(&answer, "x-tollgate-reason").as_deref(),
        Some("request_exceeds_budget")
    );
    assert_eq!(header(&answer, "x-should-retry").as_deref(), Some("false"));
    assert_eq!(header(&answer, "retry-after"), None);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn requests_shed_or_failed_upstream_consume_nothing() {
    // One slot and no queue: the second concurrent request is shed with 503 after reserving.
    let mut config = budgets(|t| t.tokens_per_hour = Some(30_000));
    config.scheduler.initial_limit = 1;
    let server = TestServer::start(config).await;
    let (mut holder, answer) = request(&server, "frank", serde_json::json!({})).await;
    assert!(admitted(&answer));
    for _ in 0..20 {
        let (_, answer) = request(&server, "frank", serde_json::json!({})).await;
        assert_eq!(status(&answer), Some(503), "{answer:?}");
        assert_eq!(
            header(&answer, "x-tollgate-reason").as_deref(),
            Some("queue_full")
        );
    }
    // The upstream fails: the holder's reservation comes back whole.
    holder
        .exchange(response_headers(500, "application/json"))
        .await;
    holder
        .exchange(response_body(b"{\"error\":{}}", true))
        .await;
    holder.close();
    assert!(holder.recv().await.unwrap().is_none());

    // Had any of those 21 reservations stuck, 30,000 tokens would not hold 7 more requests.
    let mut held = Vec::new();
    for i in 0..7 {
        let (stream, answer) = request(&server, "frank", serde_json::json!({})).await;
        assert!(
            admitted(&answer) || status(&answer) == Some(503),
            "#{i}: {answer:?}"
        );
        assert_ne!(
            status(&answer),
            Some(429),
            "#{i}: the budget was not charged: {answer:?}"
        );
        held.push(stream);
        // Free the slot again for the next one.
        let last = held.last_mut().unwrap();
        if admitted(&answer) {
            last.exchange(response_headers(200, "application/json"))
                .await;
            last.exchange(response_body(b"{}", true)).await;
        }
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_tenant_override_wins_over_its_tier() {
    let mut config = budgets(|t| t.max_concurrent = Some(1));
    config.tenants.insert(
        "vip".to_owned(),
        tollgate::config::TierOverride {
            max_concurrent: Some(3),
            ..Default::default()
        },
    );
    let server = TestServer::start(config).await;
    let mut held = Vec::new();
    for i in 0..3 {
        let (stream, answer) = request(&server, "vip", serde_json::json!({})).await;
        assert!(admitted(&answer), "vip #{i}: {answer:?}");
        held.push(stream);
    }
    let (_, answer) = request(&server, "vip", serde_json::json!({})).await;
    assert_eq!(
        status(&answer),
        Some(429),
        "the override's cap, 3, is reached"
    );
    let (_plain, answer) = request(&server, "plain", serde_json::json!({})).await;
    assert!(admitted(&answer));
    let (_, answer) = request(&server, "plain", serde_json::json!({})).await;
    assert_eq!(
        status(&answer),
        Some(429),
        "everyone else has the tier's cap, 1"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_model_limit_counts_only_requests_for_matching_models() {
    let server = TestServer::start(budgets(|t| {
        t.model_limits = vec![tollgate::config::ModelLimitConfig {
            pattern: "gpt-4o*".to_owned(),
            tokens_per_minute: None,
            tokens_per_hour: Some(25_000),
            tokens_per_day: None,
            requests_per_minute: None,
        }];
    }))
    .await;
    let mut held = Vec::new();
    // gpt-4o-mini matches: 25,000 tokens hold six reservations of ~4,109.
    for i in 0..6 {
        let (stream, answer) = request(&server, "gina", serde_json::json!({})).await;
        assert!(admitted(&answer), "#{i}: {answer:?}");
        held.push(stream);
    }
    let (_, answer) = request(&server, "gina", serde_json::json!({})).await;
    assert_eq!(status(&answer), Some(429));
    assert!(
        header(&answer, "ratelimit-policy")
            .unwrap()
            .contains("\"model0_tokens_hour\";q=25000")
    );
    // Another model is not limited by it.
    let (_other, answer) =
        request(&server, "gina", serde_json::json!({"model": "llama-3-8b"})).await;
    assert!(admitted(&answer), "{answer:?}");
    server.stop().await.unwrap();
}
