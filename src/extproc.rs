//! The ext_proc gRPC adapter: the gRPC service (`service`), one task per stream (the stream
//! loop here), and the translation to and from Envoy's messages (`convert`, the only place that
//! reads or builds them). What a request's phases decide is the protocol-free
//! `pipeline::RequestLife`'s business; this module only carries messages to it and its
//! decisions back.
//!
//! Envoy opens one bidirectional stream per HTTP request and expects exactly one answer per
//! message, of the same kind. Whatever way the stream ends (Envoy half-closes or resets it, an
//! answer cannot be sent, a protocol error, shutdown), the loop ends and
//! `RequestLife::finish` runs once.
//!
//! A body that has to wait for a slot is answered twice: first `override_message_timeout`, so
//! Envoy waits past its `message_timeout` (once per processing state, as Envoy allows), then the
//! decision when `RequestLife::wait` ends. While it waits the stream is still read, so a client
//! that goes away (the stream ends) leaves the queue at once, taking nothing.
//!
//! At shutdown (`Lifecycle::Closing`) an undecided stream ends with UNAVAILABLE, never OK: OK
//! would tell Envoy to continue without tollgate, admitting a request nobody checked.

mod access_log;
mod convert;
mod service;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tonic::{Status, Streaming};

pub use access_log::AccessLogReports;
pub use service::ExtProcService;

use crate::lifecycle::{Lifecycle, reached};
use crate::observe::{GaugeGuard, ProtocolError};
use crate::pipeline::{
    BodyDecision, HeadDecision, OutOfOrder, Phase, Pipeline, RequestLife, TrailersDecision, Waited,
};
use convert::{Inbound, Phase as Answer, ProcessingRequest, ProcessingResponse};
use service::Answers;

/// State shared by every stream.
pub struct Shared {
    pub pipeline: Pipeline,
    pub lifecycle: watch::Receiver<Lifecycle>,
    pub open_streams: OpenStreams,
}

/// Counts open streams so shutdown can wait for them to finish.
#[derive(Default)]
pub struct OpenStreams {
    count: AtomicUsize,
    changed: Notify,
}

impl OpenStreams {
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Resolves once no stream is open.
    pub async fn all_closed(&self) {
        loop {
            let changed = self.changed.notified();
            if self.count() == 0 {
                return;
            }
            changed.await;
        }
    }
}

/// The gRPC request header (the filter's `grpc_service.initial_metadata`) that says what a
/// stream is for, where it is not the default decision stream that is shown the response.
const STREAM_ROLE_HEADER: &str = "x-tollgate-stream";

/// What an ext_proc stream is for, as its filter's configuration says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamRole {
    /// The request's decision, shown the response too (the default).
    Decision,
    /// The request's decision, with the response reported on (`pipeline::reports`): its
    /// filter does not stream the response body, and another filter and the access log report
    /// on it (`reports`).
    DecisionReported,
    /// The first-token filter's stream: one response body chunk, then tollgate closes it.
    FirstToken,
}

impl StreamRole {
    fn of(header: Option<&[u8]>) -> StreamRole {
        match header {
            Some(b"reports") => StreamRole::DecisionReported,
            Some(b"first-token") => StreamRole::FirstToken,
            _ => StreamRole::Decision,
        }
    }
}

/// Starts serving one ext_proc stream; returns the stream of its answers.
fn open_stream(
    shared: Arc<Shared>,
    inbound: Streaming<ProcessingRequest>,
    role: StreamRole,
) -> Answers {
    // One answer per message and Envoy waits for each, so two slots never block.
    let (tx, rx) = mpsc::channel(2);
    // A task of its own, so a stream that Envoy resets is noticed and accounted for even
    // while tonic is not polling the response stream.
    match role {
        StreamRole::FirstToken => {
            tokio::spawn(serve_first_token(shared, inbound, tx));
        }
        StreamRole::Decision | StreamRole::DecisionReported => {
            tokio::spawn(serve_stream(shared, inbound, tx, role));
        }
    }
    Answers(rx)
}

/// The first-token filter's stream: reports the first non-empty response body chunk's arrival
/// (`Reports::first_token`). The filter runs in `observability_mode`
/// (envoy/front-proxy-reports.yaml): Envoy does not wait for answers, so the chunk is not
/// delayed, and none is sent, as the protocol asks; tollgate then ends the stream with OK, on
/// which Envoy sends nothing more on it. A filter not in that mode is answered CONTINUE for
/// every message and its stream is left open: closing it while Envoy still held a chunk for it
/// lost the response body (Envoy 1.38 and 1.40), so that misconfiguration only costs a round
/// trip per chunk.
async fn serve_first_token(
    shared: Arc<Shared>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<service::Answer>,
) {
    let _held = StreamGuard::new(&shared);
    let mut lifecycle = shared.lifecycle.clone();
    let mut reported = false;
    loop {
        let message = tokio::select! {
            message = inbound.message() => message,
            // A timing, not a decision: closing with OK lets Envoy go on without it, and the
            // gRPC server stops only once every stream has ended.
            () = reached(&mut lifecycle, Lifecycle::Closing) => break,
        };
        let Ok(Some(message)) = message else {
            break;
        };
        let (message, observing, tag) = convert::first_token_message(message);
        if let Inbound::ResponseBody { body, .. } = &message
            && !reported
            && !body.is_empty()
        {
            reported = true;
            let pipeline = &shared.pipeline;
            pipeline.reports.first_token(
                &pipeline.metrics,
                &pipeline.ttft_window,
                tag.as_deref(),
                Instant::now(),
            );
        }
        if observing {
            // Nothing to answer; once the first token is in, nothing more to see.
            if reported {
                break;
            }
            continue;
        }
        let answer = convert::continue_as_is(&message).ok_or_else(empty_message);
        let stop = answer.is_err();
        if !send(&tx, answer).await || stop {
            break;
        }
    }
    // Dropping `tx` ends the answers, and tonic the stream, with OK.
}

/// The error a message without any of the protocol's phases ends its stream with.
fn empty_message() -> Status {
    Status::invalid_argument(
        "ProcessingRequest carries no request_headers/request_body/... message",
    )
}

/// Sends one answer to Envoy; `false` if the stream is gone.
async fn send(
    tx: &mpsc::Sender<service::Answer>,
    answer: Result<ProcessingResponse, Status>,
) -> bool {
    tx.send(Box::new(answer)).await.is_ok()
}

/// A stream's task: reads Envoy's messages, hands each phase to the request's `RequestLife`,
/// and sends its answers. Its future lives as long as the stream, and is as large as the
/// largest state it can be in, so every held stream pays for the largest step it might ever
/// take. The large, short-lived steps (`on_message` and `RequestLife::finish`) are boxed and
/// take memory only while they run (`tests::stream_task_future_stays_small` holds the future's
/// size to 4 KiB).
async fn serve_stream(
    shared: Arc<Shared>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<service::Answer>,
    role: StreamRole,
) {
    let _held = StreamGuard::new(&shared);
    let mut lifecycle = shared.lifecycle.clone();
    let mut life = RequestLife::new(&shared.pipeline);
    if role == StreamRole::DecisionReported {
        life.expect_reports();
    }
    loop {
        let message = tokio::select! {
            biased;
            message = inbound.message() => message,
            () = reached(&mut lifecycle, Lifecycle::Closing) => {
                if !life.phase().is_decided() {
                    // Closing with OK would tell Envoy to continue without tollgate, admitting
                    // a request nobody checked; an error makes Envoy answer status_on_error.
                    let _ = send(&tx, Err(Status::unavailable("tollgate is shutting down"))).await;
                }
                // A decided stream closes with OK: Envoy finishes the response without us.
                break;
            }
        };
        let message = match message {
            Ok(Some(message)) => message,
            // Envoy half-closed or reset the stream.
            Ok(None) | Err(_) => break,
        };
        let (message, sends_response_body) = convert::inbound(message);
        // Whether Envoy will show tollgate the response body, as its first message says (older
        // Envoys say nothing).
        if let Some(shown) = sends_response_body {
            life.set_response_body_shown(shown);
        }
        let answer = match Box::pin(on_message(&shared, &mut life, message)).await {
            Step::Answer(answer) => answer,
            Step::Wait(envoy_timeout) => {
                let extend = convert::override_message_timeout(envoy_timeout);
                if !send(&tx, Ok(extend)).await {
                    break;
                }
                // Envoy sends nothing while it waits for this answer: anything but the end of
                // the stream is a protocol violation.
                let client = async {
                    match inbound.message().await {
                        Ok(Some(message)) => Some(convert::inbound(message).0),
                        Ok(None) | Err(_) => None,
                    }
                };
                match life.wait(client, &mut lifecycle).await {
                    Ok(Waited::Admit(forward)) => Ok(convert::request_body_admit(forward)),
                    Ok(Waited::Refuse(reply)) => Ok(convert::immediate(&reply)),
                    Ok(Waited::ClientGone) => break,
                    Ok(Waited::Stray(convert::Inbound::Empty)) => Err(Status::invalid_argument(
                        "empty ProcessingRequest while queued",
                    )),
                    Ok(Waited::Stray(message)) => Err(protocol_violation(
                        &shared,
                        Phase::Queued.describe(),
                        message.name(),
                    )),
                    Err(wrong) => Err(Status::internal(format!(
                        "tollgate waited for a slot while {}",
                        wrong.state
                    ))),
                }
            }
        };
        let stop = answer.is_err();
        if !send(&tx, answer).await || stop {
            break;
        }
    }
    Box::pin(life.finish()).await;
}

/// What a message leads to: an answer now, or a wait for a slot first (with how long Envoy is
/// asked to wait for the answer).
// Returned once per message and taken apart at once: boxing the answer would allocate per
// message for nothing.
#[allow(clippy::large_enum_variant)]
enum Step {
    Answer(Result<ProcessingResponse, Status>),
    Wait(std::time::Duration),
}

/// Hands one of Envoy's messages to the request's life and translates its decision.
async fn on_message(shared: &Shared, life: &mut RequestLife<'_>, message: Inbound) -> Step {
    let now = Instant::now();
    let got = message.name();
    let answer = match message {
        Inbound::Empty => {
            shared
                .pipeline
                .metrics
                .protocol_error(ProtocolError::EmptyMessage);
            return Step::Answer(Err(empty_message()));
        }
        Inbound::RequestHeaders {
            headers,
            end_of_stream,
        } => life
            .head(&headers.list(), end_of_stream, now)
            .map(|decision| match decision {
                HeadDecision::Continue { remove_headers } => {
                    convert::request_headers_continue(remove_headers)
                }
                HeadDecision::PassThrough => convert::request_headers_pass_through(),
                HeadDecision::Refuse(reply) => convert::immediate(&reply),
            }),
        Inbound::RequestBody {
            body,
            end_of_stream,
        } => match life.body(body, end_of_stream, now).await {
            Ok(BodyDecision::Wait { envoy_timeout }) => return Step::Wait(envoy_timeout),
            Ok(BodyDecision::Admit(forward)) => Ok(convert::request_body_admit(forward)),
            Ok(BodyDecision::Refuse(reply)) => Ok(convert::immediate(&reply)),
            Ok(BodyDecision::PassThrough) => Ok(convert::continue_unchanged(Answer::RequestBody)),
            Err(wrong) => Err(wrong),
        },
        Inbound::RequestTrailers => life.request_trailers(now).map(|decision| match decision {
            TrailersDecision::Continue => convert::continue_unchanged(Answer::RequestTrailers),
            TrailersDecision::Refuse(reply) => convert::immediate(&reply),
        }),
        Inbound::ResponseHeaders {
            headers,
            end_of_stream,
        } => life
            .response_headers(headers.status(), headers.get("content-type"), end_of_stream)
            .map(convert::response_headers_continue),
        Inbound::ResponseBody {
            body,
            end_of_stream,
        } => life
            .response_body(&body, end_of_stream, now)
            .map(|()| convert::continue_unchanged(Answer::ResponseBody)),
        Inbound::ResponseTrailers => life
            .response_trailers()
            .map(|()| convert::continue_unchanged(Answer::ResponseTrailers)),
    };
    Step::Answer(answer.map_err(|wrong: OutOfOrder| protocol_violation(shared, wrong.state, got)))
}

/// Counts the stream as open (metric and shutdown counter) until dropped.
struct StreamGuard {
    shared: Arc<Shared>,
    _gauge: GaugeGuard,
}

impl StreamGuard {
    fn new(shared: &Arc<Shared>) -> StreamGuard {
        shared.open_streams.count.fetch_add(1, Ordering::AcqRel);
        StreamGuard {
            shared: shared.clone(),
            _gauge: shared.pipeline.metrics.hold_stream(),
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let streams = &self.shared.open_streams;
        streams.count.fetch_sub(1, Ordering::AcqRel);
        streams.changed.notify_waiters();
    }
}

fn protocol_violation(shared: &Shared, phase: &str, got: &str) -> Status {
    shared
        .pipeline
        .metrics
        .protocol_error(ProtocolError::OutOfOrder);
    Status::failed_precondition(format!(
        "ext_proc protocol violation: received {got} while {phase}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future an async fn returns, without calling it.
    fn future_size<A, B, C, D, Fut>(_: &impl Fn(A, B, C, D) -> Fut) -> usize {
        std::mem::size_of::<Fut>()
    }

    /// Every held stream keeps its task's future for as long as it waits, and a future is as
    /// large as the largest state it can reach: an await of a large step inlined into
    /// `serve_stream` would cost every queued stream that many bytes (docs/benchmarks.md,
    /// "Held streams"). `cargo test --release --lib stream_task -- --nocapture` prints the size
    /// the release build has.
    #[test]
    fn stream_task_future_stays_small() {
        let size = future_size(&serve_stream);
        println!("serve_stream future: {size} B");
        assert!(
            size <= 4096,
            "serve_stream's future grew to {size} B: box the large step that is awaited inline"
        );
    }
}
