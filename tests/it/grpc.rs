//! Level 3: tollgate's gRPC server on port 0, driven by scripted ext_proc message sequences (no
//! Envoy). Each test plays one HTTP request's stream the way Envoy would, or breaks the rules
//! on purpose.

use std::collections::BTreeMap;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingResponse, body_mutation::Mutation, processing_response::Response,
};
use serde_json::Value;
use tollgate::config::{Config, OutputLimitPolicy};

use crate::support::server::*;

/// The status of an ImmediateResponse, if that is what this is.
fn immediate_status(response: &ProcessingResponse) -> Option<i32> {
    match &response.response {
        Some(Response::ImmediateResponse(r)) => r.status.as_ref().map(|s| s.code),
        _ => None,
    }
}

pub(crate) fn immediate_json(response: &ProcessingResponse) -> (i32, String, Value) {
    let Some(Response::ImmediateResponse(r)) = &response.response else {
        panic!("expected an ImmediateResponse, got {response:?}");
    };
    let headers = r.headers.as_ref().unwrap();
    let find = |name: &str| {
        headers
            .set_headers
            .iter()
            .find(|h| h.header.as_ref().unwrap().key == name)
            .map(|h| String::from_utf8(h.header.as_ref().unwrap().raw_value.clone()).unwrap())
    };
    assert_eq!(find("content-type").as_deref(), Some("application/json"));
    (
        r.status.as_ref().unwrap().code,
        find("x-tollgate-reason").expect("x-tollgate-reason is set"),
        serde_json::from_slice(&r.body).expect("the body is JSON"),
    )
}

/// Headers set by a request body response, as (name, value).
pub(crate) fn body_set_headers(response: &ProcessingResponse) -> Vec<(String, String)> {
    let Some(Response::RequestBody(body)) = &response.response else {
        panic!("expected a request_body answer, got {response:?}");
    };
    let common = body.response.as_ref().unwrap();
    common
        .header_mutation
        .iter()
        .flat_map(|m| &m.set_headers)
        .map(|h| {
            let h = h.header.as_ref().unwrap();
            (
                h.key.clone(),
                String::from_utf8(h.raw_value.clone()).unwrap(),
            )
        })
        .collect()
}

/// The input tokens an admission counted, as it tells the upstream (`x-tollgate-input-tokens`).
fn admitted_input_tokens(response: &ProcessingResponse) -> Option<u64> {
    body_set_headers(response)
        .into_iter()
        .find(|(name, _)| name == "x-tollgate-input-tokens")
        .map(|(_, value)| value.parse().expect("a number of tokens"))
}

fn body_rewrite(response: &ProcessingResponse) -> Option<Value> {
    let Some(Response::RequestBody(body)) = &response.response else {
        panic!("expected a request_body answer, got {response:?}");
    };
    match body
        .response
        .as_ref()?
        .body_mutation
        .as_ref()?
        .mutation
        .as_ref()?
    {
        Mutation::Body(bytes) => Some(serde_json::from_slice(bytes).unwrap()),
        other => panic!("unexpected mutation {other:?}"),
    }
}

#[tokio::test]
async fn chat_request_is_admitted_and_its_stream_observed() {
    let server = TestServer::start(Config::default()).await;
    let mut stream = server.stream().await;

    let answer = stream
        .exchange(request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("x-user-id", "alice"),
                ("x-user-tier", "premium"),
                ("x-tollgate-tenant", "mallory"),
            ],
            false,
        ))
        .await;
    let Some(Response::RequestHeaders(headers)) = &answer.response else {
        panic!("expected CONTINUE on headers, got {answer:?}");
    };
    let removed = &headers
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .remove_headers;
    assert_eq!(
        removed,
        &["x-tollgate-tenant"],
        "client copies of tollgate headers are removed"
    );

    let answer = stream
        .exchange(request_body(&chat_body(
            serde_json::json!({"stream": true}),
        )))
        .await;
    let set = body_set_headers(&answer);
    let get = |name: &str| set.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    assert_eq!(get("x-tollgate-tenant"), Some("alice"));
    assert_eq!(get("x-tollgate-tier"), Some("premium"));
    // "Say hello to the world." is 6 o200k tokens + "user" 1 + 3 framing + 3 priming.
    assert_eq!(get("x-tollgate-input-tokens"), Some("13"));
    let rewritten = body_rewrite(&answer).expect("the body is rewritten");
    assert_eq!(
        rewritten["max_tokens"], 4096,
        "the tier default is written in"
    );
    assert_eq!(rewritten["stream_options"]["include_usage"], true);
    let new_len = serde_json::to_vec(&rewritten).unwrap().len();
    assert_eq!(get("content-length"), Some(new_len.to_string().as_str()));

    stream
        .exchange(response_headers(200, "text/event-stream"))
        .await;
    for chunk in [
        &b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"[..],
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":13,\"completion_tokens\":2,\"total_tokens\":15}}\n\ndata: [DONE]\n\n",
    ] {
        let answer = stream.exchange(response_body(chunk, false)).await;
        assert!(matches!(answer.response, Some(Response::ResponseBody(_))));
    }
    stream.exchange(response_body(b"", true)).await;
    stream.close();
    assert!(
        stream.recv().await.unwrap().is_none(),
        "tollgate closes with OK after Envoy"
    );

    server
        .wait_for_metric("tollgate_held_streams", &[], 0.0)
        .await;
    let m = server.metrics().await;
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"admitted\""]),
        1.0
    );
    assert_eq!(
        m.value(
            "tollgate_stream_completions_total",
            &["result=\"complete\""]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "tollgate_usage_tokens_total",
            &["tier=\"premium\"", "kind=\"completion\""]
        ),
        2.0
    );
    assert_eq!(
        m.value(
            "tollgate_time_to_first_token_seconds_count",
            &["tier=\"premium\""]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "tollgate_request_duration_seconds_count",
            &["tier=\"premium\""]
        ),
        1.0
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn local_replies_are_openai_shaped_with_a_reason() {
    let server = TestServer::start(Config::default()).await;
    // (body, header overrides, status, reason)
    type Case<'a> = (Vec<u8>, &'a [(&'a str, &'a str)], i32, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            chat_body(serde_json::json!({})),
            &[("x-user-id", "")],
            401,
            "missing_identity",
        ),
        (b"{not json".to_vec(), &[], 400, "malformed_json"),
        (b"[1,2]".to_vec(), &[], 400, "invalid_request"),
        (
            chat_body(serde_json::json!({"max_tokens": 1_000_000})),
            &[],
            400,
            "output_tokens_exceeded",
        ),
        (
            chat_body(serde_json::json!({"max_tokens": "many"})),
            &[],
            400,
            "invalid_max_tokens",
        ),
        (
            chat_body(serde_json::json!({"messages": []})),
            &[],
            400,
            "invalid_request",
        ),
        (
            chat_body(
                serde_json::json!({"messages": [{"role": "user", "content": "word ".repeat(20_000)}]}),
            ),
            &[],
            400,
            "input_tokens_exceeded",
        ),
        (
            chat_body(serde_json::json!({})),
            &[("x-user-tier", "platinum")],
            401,
            "unknown_tier",
        ),
        (
            chat_body(serde_json::json!({})),
            &[("content-type", "text/plain")],
            400,
            "invalid_content_type",
        ),
        (
            chat_body(serde_json::json!({})),
            &[("content-encoding", "gzip")],
            415,
            "unsupported_content_encoding",
        ),
    ];
    for (body, header_overrides, want_status, want_reason) in cases {
        let mut headers = vec![
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("x-user-id", "bob"),
        ];
        for (k, v) in header_overrides {
            headers.retain(|(name, _)| name != k);
            if !v.is_empty() {
                headers.push((k, v));
            }
        }
        let mut stream = server.stream().await;
        let answer = stream.exchange(request_headers(&headers, false)).await;
        let answer = if immediate_status(&answer).is_some() {
            answer
        } else {
            stream.exchange(request_body(&body)).await
        };
        let (status, reason, json) = immediate_json(&answer);
        assert_eq!(
            (status, reason.as_str()),
            (want_status, want_reason),
            "{json}"
        );
        let error = &json["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{json}"
        );
        assert!(
            error["type"].is_string() && error["code"].is_string(),
            "{json}"
        );
        assert!(error.as_object().unwrap().contains_key("param"), "{json}");
    }
    let m = server.metrics().await;
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"rejected\""]),
        10.0
    );
    assert_eq!(
        m.value(
            "tollgate_rejections_total",
            &["reason=\"missing_identity\"", "tier=\"none\""]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "tollgate_rejections_total",
            &["reason=\"malformed_json\"", "tier=\"free\""]
        ),
        1.0
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn clamp_policy_rewrites_max_tokens() {
    let mut config = Config::default();
    for tier in config.tiers.values_mut() {
        tier.output_limit = OutputLimitPolicy::Clamp;
        tier.max_output_tokens = 100;
    }
    let server = TestServer::start(config).await;
    let mut stream = server.stream().await;
    stream.exchange(chat_headers("carol")).await;
    let answer = stream
        .exchange(request_body(&chat_body(
            serde_json::json!({"max_completion_tokens": 5000}),
        )))
        .await;
    let rewritten = body_rewrite(&answer).expect("clamped body");
    assert_eq!(rewritten["max_completion_tokens"], 100);
    assert!(
        rewritten.get("max_tokens").is_none(),
        "only the field the client used changes"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn non_inference_paths_pass_through_and_skip_later_phases() {
    let server = TestServer::start(Config::default()).await;
    for (method, path) in [
        ("GET", "/v1/models"),
        ("POST", "/echo"),
        ("GET", "/v1/chat/completions"),
    ] {
        let mut stream = server.stream().await;
        let answer = stream
            .exchange(request_headers(
                &[(":method", method), (":path", path)],
                method == "GET",
            ))
            .await;
        let mode = answer
            .mode_override
            .expect("mode_override skips the body phases");
        assert_eq!(mode.request_body_mode, 0, "NONE");
        assert_eq!(mode.response_body_mode, 0, "NONE");
        // If Envoy ignores the override (allow_mode_override off), later phases still pass.
        let answer = stream.exchange(request_body(b"anything")).await;
        assert!(body_set_headers(&answer).is_empty());
        assert!(body_rewrite(&answer).is_none());
    }
    let m = server.metrics().await;
    assert_eq!(
        m.value("tollgate_requests_total", &["outcome=\"passed_through\""]),
        3.0
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn messages_out_of_order_get_a_grpc_error_not_a_panic() {
    let server = TestServer::start(Config::default()).await;
    let sequences: Vec<Vec<_>> = vec![
        vec![request_body(b"{}")],
        vec![response_headers(200, "application/json")],
        vec![chat_headers("dave"), chat_headers("dave")],
        // A second body after the decision. (A response message while tollgate awaits the
        // body is legitimate: Envoy's own local reply, e.g. its 413, travels that way.)
        vec![
            chat_headers("dave"),
            request_body(&chat_body(serde_json::json!({}))),
            request_body(b"{}"),
        ],
        vec![message_without_request()],
    ];
    for sequence in sequences {
        let mut stream = server.stream().await;
        let last = sequence.len() - 1;
        for (i, message) in sequence.into_iter().enumerate() {
            stream.send(message).await;
            let answer = stream.recv().await;
            if i < last {
                answer.expect("valid prefix").expect("open");
            } else {
                let status =
                    answer.expect_err("a protocol violation ends the stream with an error");
                assert!(
                    matches!(
                        status.code(),
                        tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument
                    ),
                    "{status:?}"
                );
            }
        }
    }
    server
        .wait_for_metric("tollgate_held_streams", &[], 0.0)
        .await;
    let m = server.metrics().await;
    assert_eq!(
        m.value("tollgate_protocol_errors_total", &["kind=\"out_of_order\""]),
        4.0
    );
    assert_eq!(
        m.value(
            "tollgate_protocol_errors_total",
            &["kind=\"empty_message\""]
        ),
        1.0
    );
    server.stop().await.unwrap();
}

fn message_without_request() -> envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest {
    Default::default()
}

#[tokio::test]
async fn a_stream_that_ends_without_done_is_truncated_and_released() {
    let server = TestServer::start(Config::default()).await;
    let mut stream = server.stream().await;
    stream.exchange(chat_headers("erin")).await;
    stream
        .exchange(request_body(&chat_body(
            serde_json::json!({"stream": true}),
        )))
        .await;
    stream
        .exchange(response_headers(200, "text/event-stream"))
        .await;
    stream
        .exchange(response_body(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"partial\"}}]}\n\n",
            false,
        ))
        .await;
    server
        .wait_for_metric("tollgate_held_streams", &[], 1.0)
        .await;
    // The client goes away: Envoy resets the side stream.
    drop(stream);
    server
        .wait_for_metric("tollgate_held_streams", &[], 0.0)
        .await;
    let m = server.metrics().await;
    assert_eq!(
        m.value(
            "tollgate_stream_completions_total",
            &["result=\"truncated\""]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "tollgate_stream_completions_total",
            &["result=\"complete\""]
        ),
        0.0
    );
    server.stop().await.unwrap();
}

/// Proves: a long prompt that comes back gets the same count every time, and from its third
/// time on it is found in the count cache, not counted (the first two counts keep it); the
/// cache's series say exactly that. A tollgate process of its own: the count cache is the
/// process's, and the servers of the tests beside this one share theirs.
#[tokio::test]
async fn a_long_prompt_that_comes_back_is_found_and_counts_the_same() {
    let gate = crate::support::process::Tollgate::start("{}\n").await;
    let url = format!("http://{}", gate.grpc);
    let mut client = ExternalProcessorClient::connect(url).await.unwrap();
    let prompt =
        "The count cache test asks the same long question every time it comes back. ".repeat(20);
    let body = chat_body(serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
    }));
    let mut counts = Vec::new();
    // After each time: (found, counted, bytes kept). Only the prompt is 512 bytes or more.
    let expected = [
        (0.0, 1.0, 0.0),
        (0.0, 2.0, prompt.len() as f64),
        (1.0, 2.0, prompt.len() as f64),
    ];
    for (time, expected) in (1..).zip(expected) {
        let mut stream = ExtProcStream::open(&mut client).await;
        stream.exchange(chat_headers("grace")).await;
        let answer = stream.exchange(request_body(&body)).await;
        let tokens = admitted_input_tokens(&answer)
            .unwrap_or_else(|| panic!("time {time}: not admitted: {answer:?}"));
        counts.push(tokens);
        drop(stream);
        let m = gate.metrics().await;
        let lookups = |result: &str| {
            m.value(
                "tollgate_token_count_cache_lookups_total",
                &[&format!("result=\"{result}\"")],
            )
        };
        assert_eq!(
            (
                lookups("found"),
                lookups("counted"),
                m.value("tollgate_token_count_cache_bytes", &[])
            ),
            expected,
            "time {time}"
        );
    }
    assert!(counts.iter().all(|count| *count == counts[0]), "{counts:?}");
}

#[tokio::test]
async fn a_large_body_is_counted_off_the_async_workers() {
    let server = TestServer::start(Config::default()).await;
    let mut stream = server.stream().await;
    stream.exchange(chat_headers("frank")).await;
    // ~600 KB of prose with no words over the ceiling: 1 token per "ab " pair.
    let text = "ab ".repeat(200_000);
    let answer = stream
        .exchange(request_body(&chat_body(serde_json::json!({
            "messages": [{"role": "user", "content": text}],
        }))))
        .await;
    let (status, reason, _) = immediate_json(&answer);
    assert_eq!((status, reason.as_str()), (400, "input_tokens_exceeded"));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn bodies_up_to_max_body_bytes_arrive_whole_and_larger_ones_get_413() {
    // Envoy sends a buffered body as one gRPC message: the server must accept messages larger
    // than tonic's default 4 MiB, up to tokens.max_body_bytes and a little more, so that tollgate
    // (not the gRPC layer) answers an oversized body.
    let config = Config::default();
    let max_body = config.tokens.max_body_bytes;
    let server = TestServer::start(config).await;
    let padded = |bytes: usize| {
        let with = |content: &str| {
            chat_body(serde_json::json!({"messages": [{"role": "user", "content": content}]}))
        };
        let unpadded = with("").len();
        with(&"ab ".repeat(bytes / 3)[..bytes - unpadded])
    };
    for (bytes, status, reason) in [
        (5 << 20, 400, "input_tokens_exceeded"),
        (max_body, 400, "input_tokens_exceeded"),
        (max_body + 1, 413, "body_too_large"),
    ] {
        let body = padded(bytes);
        assert_eq!(body.len(), bytes);
        let mut stream = server.stream().await;
        stream.exchange(chat_headers("olga")).await;
        let answer = stream.exchange(request_body(&body)).await;
        let (got_status, got_reason, _) = immediate_json(&answer);
        assert_eq!(
            (got_status, got_reason.as_str()),
            (status, reason),
            "{bytes} B"
        );
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_queued_request_counts_its_body_bytes_until_it_leaves_the_queue() {
    let mut config = Config::default();
    config.scheduler.initial_limit = 1;
    config.control.enabled = false;
    config.tiers.get_mut("free").unwrap().queue_deadline_ms = 20_000;
    config.tiers.get_mut("free").unwrap().max_concurrent = None;
    let server = TestServer::start(config).await;
    // Names max_tokens and does not stream, so tollgate keeps it as sent: it holds its length.
    let body = chat_body(serde_json::json!({"max_tokens": 16}));
    let mut holder = server.stream().await;
    holder.exchange(chat_headers("paul")).await;
    let answer = holder.exchange(request_body(&body)).await;
    assert!(matches!(answer.response, Some(Response::RequestBody(_))));

    let mut waiting = server.stream().await;
    waiting.exchange(chat_headers("quinn")).await;
    let answer = waiting.exchange(request_body(&body)).await;
    assert!(answer.override_message_timeout.is_some(), "queued");
    let bytes = body.len() as f64;
    server
        .wait_for_metric("tollgate_queued_body_bytes", &[], bytes)
        .await;
    // The client goes away: its place and its bytes are given back.
    drop(waiting);
    server
        .wait_for_metric("tollgate_queued_body_bytes", &[], 0.0)
        .await;
    drop(holder);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_undecided_streams_with_an_error_and_decided_ones_with_ok() {
    let mut config = Config::default();
    config.shutdown.drain_deadline_ms = 200;
    let mut server = TestServer::start(config).await;
    let metrics_addr = server.admin;

    let mut undecided = server.stream().await;
    undecided.exchange(chat_headers("gina")).await;
    let mut decided = server.stream().await;
    decided.exchange(chat_headers("hank")).await;
    decided
        .exchange(request_body(&chat_body(serde_json::json!({}))))
        .await;
    decided
        .exchange(response_headers(200, "application/json"))
        .await;

    server.begin_shutdown();
    // While draining, /readyz says so.
    let mut ready = 200;
    for _ in 0..100 {
        ready = http_get(metrics_addr, "/readyz").await.0;
        if ready == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(ready, 503);

    let status = undecided
        .recv()
        .await
        .expect_err("never a silent OK for an undecided request");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        decided.recv().await.expect("OK close").is_none(),
        "decided streams end with OK"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn grpc_health_serves_until_shutdown_begins() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let mut config = Config::default();
    config.shutdown.drain_deadline_ms = 200;
    let mut server = TestServer::start(config).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }
    // A watch opened while serving sees the change (new checks after GOAWAY cannot open).
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap().status;
    assert_eq!(first, ServingStatus::Serving as i32);
    // Keep a stream open so the server drains rather than exiting at once.
    let mut open = server.stream().await;
    open.exchange(chat_headers("ivan")).await;
    server.begin_shutdown();
    let status = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("the watch reports the change")
        .unwrap()
        .unwrap()
        .status;
    assert_eq!(status, ServingStatus::NotServing as i32);
    server.stop().await.unwrap();
}

/// The string fields a request body answer sets in one dynamic-metadata namespace.
fn answer_metadata(answer: &ProcessingResponse, namespace: &str) -> BTreeMap<String, String> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let fields = answer
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get(namespace))
        .and_then(|v| v.kind.as_ref());
    let Some(Kind::StructValue(fields)) = fields else {
        panic!("no `{namespace}` dynamic metadata in {answer:?}");
    };
    fields
        .fields
        .iter()
        .map(|(key, value)| match value.kind.as_ref() {
            Some(Kind::StringValue(text)) => (key.clone(), text.clone()),
            other => panic!("{namespace}.{key} is not a string: {other:?}"),
        })
        .collect()
}

/// The dynamic metadata a request body answer sets in namespace `tollgate`: its report tag.
fn report_tag(answer: &ProcessingResponse) -> String {
    let fields = answer_metadata(answer, "tollgate");
    fields.get("tag").cloned().expect("a report tag")
}

/// The `tollgate` metadata namespace with these fields, as Envoy forwards or logs it.
fn tollgate_metadata(
    fields: &[(&str, envoy_types::pb::google::protobuf::value::Kind)],
) -> envoy_types::pb::envoy::config::core::v3::Metadata {
    use envoy_types::pb::google::protobuf::{Struct, Value};
    let namespace = Struct {
        fields: fields
            .iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    Value {
                        kind: Some(v.clone()),
                    },
                )
            })
            .collect(),
    };
    envoy_types::pb::envoy::config::core::v3::Metadata {
        filter_metadata: [("tollgate".to_owned(), namespace)].into(),
        ..Default::default()
    }
}

/// Proves, at the gRPC level: the admission on a decision stream marked `reports` tags the
/// request in Envoy's dynamic metadata, with the client's budget headers beside it (the
/// stream is shown no response headers); the first-token stream that
/// forwards the tag gets no answer in observability mode and is closed with OK after its
/// first chunk; the access log entry that carries the tag, status and usage settles the
/// request with that usage once its own stream has ended.
#[tokio::test]
async fn responses_reported_on_are_timed_and_settled_by_their_reports() {
    use envoy_types::pb::envoy::data::accesslog::v3::{
        AccessLogCommon, HttpAccessLogEntry, HttpResponseProperties,
    };
    use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_client::AccessLogServiceClient;
    use envoy_types::pb::envoy::service::accesslog::v3::{
        StreamAccessLogsMessage,
        stream_access_logs_message::{HttpAccessLogEntries, LogEntries},
    };
    use envoy_types::pb::google::protobuf::value::Kind;

    let server = TestServer::start(Config::default()).await;
    let mut decision = server.stream_as("reports").await;
    decision.exchange(chat_headers("alice")).await;
    let admitted = decision
        .exchange(request_body(&chat_body(
            serde_json::json!({"stream": true, "max_tokens": 20}),
        )))
        .await;
    let tag = report_tag(&admitted);
    // The client's budget headers, for Envoy to add to the response it is not shown.
    let headers = answer_metadata(&admitted, "tollgate.response_headers");
    assert_eq!(
        headers.get("x-ratelimit-limit-tokens").map(String::as_str),
        Some("100000"),
        "{headers:?}"
    );
    for name in [
        "x-ratelimit-remaining-tokens",
        "ratelimit-policy",
        "ratelimit",
    ] {
        assert!(headers.contains_key(name), "{name} in {headers:?}");
    }

    // The first token, on a stream of its own.
    let mut first = server.stream_as("first-token").await;
    let mut chunk = response_body(b"data: {\"choices\":[]}\n\n", false);
    chunk.observability_mode = true;
    chunk.metadata_context = Some(tollgate_metadata(&[(
        "tag",
        Kind::StringValue(tag.clone()),
    )]));
    first.send(chunk).await;
    assert!(
        matches!(first.recv().await, Ok(None)),
        "closed with OK after the first chunk, without an answer"
    );
    server
        .wait_for_metric(
            "tollgate_response_reports_total",
            &["report=\"first_token\"", "outcome=\"matched\""],
            1.0,
        )
        .await;

    // The response ends: the request's stream closes, and the access log reports.
    decision.close();
    let entry = HttpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            metadata: Some(tollgate_metadata(&[
                ("tag", Kind::StringValue(tag)),
                ("prompt_tokens", Kind::NumberValue(13.0)),
                ("completion_tokens", Kind::NumberValue(9.0)),
                ("done", Kind::BoolValue(true)),
            ])),
            ..Default::default()
        }),
        response: Some(HttpResponseProperties {
            response_code: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 200 }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let message = StreamAccessLogsMessage {
        log_entries: Some(LogEntries::HttpLogs(HttpAccessLogEntries {
            log_entry: vec![entry],
        })),
        ..Default::default()
    };
    let mut access_log = AccessLogServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("the access log service answers");
    access_log
        .stream_access_logs(tokio_stream::iter([message]))
        .await
        .expect("the entries are taken");

    let m = server
        .wait_for_metric(
            "tollgate_stream_completions_total",
            &["result=\"complete\""],
            1.0,
        )
        .await;
    assert_eq!(
        m.value(
            "tollgate_response_reports_total",
            &["report=\"summary\"", "outcome=\"matched\""]
        ),
        1.0
    );
    assert_eq!(
        m.value(
            "tollgate_usage_tokens_total",
            &["tier=\"free\"", "kind=\"completion\""]
        ),
        9.0
    );
    assert_eq!(
        m.value(
            "tollgate_budget_tokens_total",
            &["tier=\"free\"", "kind=\"output\"", "stage=\"settled\""]
        ),
        9.0
    );
    assert_eq!(
        m.value(
            "tollgate_time_to_first_token_seconds_count",
            &["tier=\"free\""]
        ),
        1.0
    );
    assert_eq!(m.value("tollgate_inflight_requests", &[]), 0.0);
}

/// Proves: a small body whose text is costly to count (a run of dashes) is counted off the async
/// workers and gets the count it would get on them; a body over 16 KiB is counted off them by
/// its size; the series say which was which.
#[tokio::test]
async fn a_body_costly_to_count_is_counted_off_the_workers_with_the_same_count() {
    let server = TestServer::start(Config::default()).await;
    let input_tokens = |answer: &ProcessingResponse| {
        admitted_input_tokens(answer).unwrap_or_else(|| panic!("not admitted: {answer:?}"))
    };
    let server_ref = &server;
    let ask = |content: String| async move {
        let mut stream = server_ref.stream().await;
        stream.exchange(chat_headers("dora")).await;
        let body = chat_body(serde_json::json!({
            "messages": [{"role": "user", "content": content}],
        }));
        stream.exchange(request_body(&body)).await
    };
    // The chat's framing around an empty message, counted on a worker.
    let framing = input_tokens(&ask(String::new()).await);
    let dashes = "-".repeat(4096);
    let counted = input_tokens(&ask(dashes.clone()).await);
    assert_eq!(
        counted,
        framing + tollgate::tokens::Encoding::O200kBase.count(&dashes) as u64
    );
    let off_workers = |m: &Metrics, reason: &str| {
        m.value(
            "tollgate_bodies_counted_off_workers_total",
            &[&format!("reason=\"{reason}\"")],
        )
    };
    let m = server.metrics().await;
    assert_eq!(
        (off_workers(&m, "costly_text"), off_workers(&m, "size")),
        (1.0, 0.0)
    );
    let long = "lorem ipsum dolor sit amet ".repeat(800);
    input_tokens(&ask(long).await);
    let m = server.metrics().await;
    assert_eq!(
        (off_workers(&m, "costly_text"), off_workers(&m, "size")),
        (1.0, 1.0)
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn large_bodies_that_cannot_start_counting_in_time_get_503_counting_backlog() {
    let mut config = Config::default();
    // One thread for large bodies, and a wait shorter than any count of one.
    config.tokens.large_body_threads = 1;
    config.tokens.large_body_max_wait_ms = 1;
    config.scheduler.initial_limit = 16;
    config.control.enabled = false;
    for tier in config.tiers.values_mut() {
        tier.max_input_tokens = 10_000_000;
        (
            tier.tokens_per_minute,
            tier.tokens_per_hour,
            tier.tokens_per_day,
        ) = (None, None, None);
        (tier.requests_per_minute, tier.max_concurrent) = (None, None);
    }
    let server = TestServer::start(config).await;
    let mut streams = Vec::new();
    for i in 0..8 {
        let mut stream = server.stream().await;
        stream.exchange(chat_headers(&format!("user-{i}"))).await;
        streams.push(stream);
    }
    // 1.5 MiB each, over the count cache's 1 MiB: every one is counted, and its made-up words
    // take the count tens of milliseconds at least (short pieces' counts are remembered, so
    // repeated words would not). All are sent before any answer is read, so they arrive
    // together and only one can start at once.
    let words = tollgate_testkit::text::made_up_words(1_500_000);
    for (i, stream) in streams.iter_mut().enumerate() {
        let text = format!("{i} {words}");
        stream
            .send(request_body(&chat_body(serde_json::json!({
                "messages": [{"role": "user", "content": text}],
            }))))
            .await;
    }
    let (mut admitted, mut backlog) = (0, 0);
    for stream in &mut streams {
        let answer = stream.recv().await.unwrap().expect("an answer");
        if matches!(answer.response, Some(Response::RequestBody(_))) {
            admitted += 1;
            continue;
        }
        let (status, reason, _) = immediate_json(&answer);
        assert_eq!(
            (status, reason.as_str()),
            (503, "counting_backlog"),
            "{answer:?}"
        );
        backlog += 1;
    }
    assert!(admitted >= 1, "the first body to arrive is counted");
    assert!(backlog >= 1, "the rest could not start within 1 ms");
    let m = server.metrics().await;
    assert_eq!(
        // One series per tier.
        m.sum(
            "tollgate_rejections_total",
            &["reason=\"counting_backlog\""]
        ),
        f64::from(backlog)
    );
    assert_eq!(m.value("tollgate_large_bodies_waiting", &[]), 0.0);
    // Enforced: none went upstream as a shadow refusal, a body that got its thread late included.
    assert_eq!(m.sum("tollgate_shadow_refusals_total", &[]), 0.0);
    drop(streams);
    server.stop().await.unwrap();
}
