//! `echo_extproc`: an Envoy ext_proc service that decides nothing. It answers every message with
//! a CONTINUE of its kind (except those of a filter in `observability_mode`, which the protocol
//! says not to answer) and reads nothing, so it is the floor any ext_proc service built with
//! tonic costs: the baseline the benchmarks hold tollgate against (`bench_decisions` over gRPC,
//! `bench_overhead` behind Envoy).
//!
//! It is built with tollgate's plumbing (a task and a 2-slot answer channel per stream, the
//! HTTP/2 options and TCP_NODELAY of `tollgate::run`, a default multi-threaded runtime, the same
//! global allocator), so the difference between the two is tollgate's own work.
//!
//! With `--count-prompts` it also does the one part of a decision that no exact-counting
//! service can skip, and nothing else: it parses each request body and counts its tokens with
//! tollgate's own code (`tollgate::request::parse_body`, under the default configuration), and
//! reads each response body's `usage`. It still continues everything: no budget, no queue, no
//! headers added. `bench_decisions --counting-echo` runs it beside the plain echo, so that what
//! counting costs, and what tollgate costs beyond it, are read in the same round
//! (docs/benchmarks.md, "What deciding costs at the least").
//!
//! ```text
//! cargo run --release --example echo_extproc -- --addr 127.0.0.1:50052 [--count-prompts]
//! ```
//!
//! Once the socket is bound it prints exactly one line to stdout, `echo_extproc listening on
//! ADDR`, with the real address (so `--addr 127.0.0.1:0` reports the port it picked). It serves
//! until it is killed.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, ProcessingRequest, ProcessingResponse,
    TrailersResponse, processing_request::Request as Message,
    processing_response::Response as Answer,
};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tollgate::config::Config;
use tollgate::policy::Policy;
use tollgate::request::{ApiKind, parse_body};
use tonic::Status;
use tonic::transport::server::TcpIncoming;

/// tollgate's allocator (src/main.rs), so that allocating is plumbing both pay alike.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// An ext_proc service that continues every request unchanged.
#[derive(Parser, Debug)]
#[command(name = "echo_extproc")]
struct Args {
    /// Listen address (loopback only: this is a benchmark baseline, not a service).
    #[arg(long, default_value = "127.0.0.1:50052")]
    addr: SocketAddr,
    /// Also parse and count every request body as tollgate does, and read every response
    /// body's usage (an error status if either fails), still continuing everything.
    #[arg(long)]
    count_prompts: bool,
}

/// The echo, counting prompts when it holds a policy to count them under.
struct Echo {
    counting_policy: Option<Arc<Policy>>,
}

/// The header that names the user, as tollgate's default `identity` reads it: the count cache
/// is kept per user.
const USER_HEADER: &str = "x-user-id";
/// Counted exactly up to here: far above any body this is given.
const INPUT_CEILING: u32 = 1 << 24;

/// What the counting echo reads of a response body.
#[derive(Deserialize)]
struct ResponseUsage {
    usage: Usage,
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
}

/// Reads what a decision must read of `message`: the user of request headers, the counted
/// prompt of a request body, the usage of a response body. A failure is the stream's error.
///
/// The least that reading takes, not tollgate's way to it: the user straight from the default
/// identity header (not `request::classify_head`), the usage with a serde struct (not the
/// response observer). A floor that did more would be lower, and the comparison it makes
/// (docs/benchmarks.md, "What deciding costs at the least") would only tighten.
fn read_as_a_decision(policy: &Policy, user: &mut String, message: &Message) -> Result<(), Status> {
    match message {
        Message::RequestHeaders(headers) => {
            let value = headers
                .headers
                .iter()
                .flat_map(|map| &map.headers)
                .find(|header| header.key == USER_HEADER)
                .ok_or_else(|| Status::invalid_argument("no x-user-id header"))?;
            *user = String::from_utf8_lossy(&value.raw_value).into_owned();
        }
        Message::RequestBody(body) => {
            let parsed = parse_body(policy, ApiKind::Chat, &body.body, INPUT_CEILING, user)
                .map_err(|reply| Status::invalid_argument(reply.message))?;
            std::hint::black_box(parsed.input);
        }
        Message::ResponseBody(body) => {
            let read: ResponseUsage = serde_json::from_slice(&body.body)
                .map_err(|e| Status::invalid_argument(format!("no usage: {e}")))?;
            std::hint::black_box((read.usage.prompt_tokens, read.usage.completion_tokens));
        }
        _ => {}
    }
    Ok(())
}

#[tonic::async_trait]
impl ExternalProcessor for Echo {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(2);
        let counting_policy = self.counting_policy.clone();
        tokio::spawn(async move {
            let mut user = String::new();
            while let Ok(Some(message)) = inbound.message().await {
                // A filter in observability_mode does not wait for answers, and the protocol
                // asks the server to send none.
                if message.observability_mode {
                    continue;
                }
                if let (Some(policy), Some(request)) = (&counting_policy, &message.request)
                    && let Err(status) = read_as_a_decision(policy, &mut user, request)
                {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
                let Some(answer) = continue_answer(message.request) else {
                    let _ = tx
                        .send(Err(Status::invalid_argument("empty message")))
                        .await;
                    return;
                };
                let response = ProcessingResponse {
                    response: Some(answer),
                    ..ProcessingResponse::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// CONTINUE for the phase `message` belongs to; `None` for a message with no phase.
fn continue_answer(message: Option<Message>) -> Option<Answer> {
    let common = || Some(CommonResponse::default());
    Some(match message? {
        Message::RequestHeaders(_) => {
            Answer::RequestHeaders(HeadersResponse { response: common() })
        }
        Message::RequestBody(_) => Answer::RequestBody(BodyResponse { response: common() }),
        Message::ResponseHeaders(_) => {
            Answer::ResponseHeaders(HeadersResponse { response: common() })
        }
        Message::ResponseBody(_) => Answer::ResponseBody(BodyResponse { response: common() }),
        Message::RequestTrailers(_) => Answer::RequestTrailers(TrailersResponse::default()),
        Message::ResponseTrailers(_) => Answer::ResponseTrailers(TrailersResponse::default()),
    })
}

async fn serve(addr: SocketAddr, counting_policy: Option<Arc<Policy>>) -> Result<()> {
    anyhow::ensure!(addr.ip().is_loopback(), "--addr must be a loopback address");
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listen on {addr}"))?;
    println!("echo_extproc listening on {}", listener.local_addr()?);
    // The same server options and incoming stream as tollgate's `run` (src/lib.rs).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .http2_adaptive_window(Some(true))
        .add_service(ExternalProcessorServer::new(Echo { counting_policy }))
        .serve_with_incoming(incoming)
        .await
        .context("serve")
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let counting_policy = if args.count_prompts {
        match Policy::from_config(&Config::default()) {
            Ok(policy) => Some(Arc::new(policy)),
            Err(error) => {
                eprintln!("echo_extproc: the default policy: {error}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    match serve(args.addr, counting_policy).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("echo_extproc: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders};

    fn policy() -> Policy {
        Policy::from_config(&Config::default()).expect("the default configuration is valid")
    }

    fn headers(pairs: &[(&str, &str)]) -> Message {
        Message::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(key, value)| HeaderValue {
                        key: (*key).to_owned(),
                        raw_value: value.as_bytes().to_vec(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            ..HttpHeaders::default()
        })
    }

    fn body(json: &str, response: bool) -> Message {
        let body = HttpBody {
            body: json.as_bytes().to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        };
        if response {
            Message::ResponseBody(body)
        } else {
            Message::RequestBody(body)
        }
    }

    /// The counting echo reads what a decision reads, and fails the stream on what a decision
    /// could not read, so a floor that skipped its work would fail the benchmark, not flatter it.
    #[test]
    fn the_counting_echo_reads_each_message_as_a_decision_does() {
        let policy = policy();
        let chat =
            r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hello there"}]}"#;
        let usage =
            r#"{"id":"x","usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}"#;
        let cases: [(&str, Message, Result<&str, &str>); 7] = [
            ("a user", headers(&[("x-user-id", "alice")]), Ok("alice")),
            (
                "no user",
                headers(&[(":path", "/v1/chat/completions")]),
                Err("x-user-id"),
            ),
            ("a chat body", body(chat, false), Ok("")),
            (
                "a body that is not JSON",
                body("{", false),
                Err("not valid JSON"),
            ),
            (
                "a chat body with no messages",
                body(r#"{"model":"m"}"#, false),
                Err("messages"),
            ),
            ("a response with usage", body(usage, true), Ok("")),
            (
                "a response with none",
                body(r#"{"id":"x"}"#, true),
                Err("no usage"),
            ),
        ];
        for (case, message, expected) in cases {
            let mut user = String::new();
            let read = read_as_a_decision(&policy, &mut user, &message);
            match (read, expected) {
                (Ok(()), Ok(want_user)) => assert_eq!(user, want_user, "{case}"),
                (Err(status), Err(said)) => assert!(
                    status.message().contains(said),
                    "{case}: {}",
                    status.message()
                ),
                (read, expected) => panic!("{case}: read {read:?}, expected {expected:?}"),
            }
        }
    }
}
