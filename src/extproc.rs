//! The ext_proc gRPC adapter: the gRPC service (`service`), one task per stream, an explicit
//! phase state machine, and the translation to and from Envoy's messages (in `convert`, the only
//! place that builds or reads them).
//!
//! Envoy opens one bidirectional stream per HTTP request and expects exactly one answer per
//! message, of the same kind. A stream's story: request headers (who, which route) → request
//! body (the decision) → response headers and body (observation: first byte, usage, proper
//! end). Whatever way the stream ends, `Exchange::finish` records the outcome once.
//!
//! An admitted body asks the scheduler for a slot. If none is free the request waits in its
//! tenant's queue: tollgate first tells Envoy to extend its message timeout
//! (`override_message_timeout`, once per processing state, as Envoy allows), then answers when
//! the slot comes, the queue deadline passes (503), the client goes away (nothing taken), or
//! the server starts shutting down (503). A request whose body would take the bytes held by
//! queued requests over `scheduler.max_queued_body_bytes` does not wait at all (503).

mod convert;
mod service;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    processing_request::Request as Message,
};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tonic::{Status, Streaming};

pub use service::ExtProcService;

use crate::admission::{self, Admission, BodyVerdict};
use crate::budget::ledger::{Grant, Hold, Ledger};
use crate::config::{ControlSignal, FairnessCost};
use crate::observe::response::{ResponseEnd, ResponseObserver};
use crate::observe::window::{self, LatencyWindow, Pending};
use crate::observe::{
    GaugeGuard, Metrics, ProtocolError, RequestOutcome, SchedulerOutcome, TokenKind, TokenStage,
};
use crate::policy::{ENVOY_TIMEOUT_MARGIN, Policy, TierId};
use crate::reply::{LocalReply, Reason};
use crate::request::{self, HeadVerdict, InferenceHead};
use crate::scheduler::{Admit, FlowClass, Permit, Scheduler, Ticket};
use convert::Phase as Answer;
use service::Answers;

/// Bodies above this size are parsed and counted on the blocking pool, so a multi-megabyte
/// prompt never stalls the async workers that every other stream shares.
const INLINE_BODY_BYTES: usize = 256 * 1024;

/// Where the server is in its life; stream tasks watch it to end deliberately at shutdown.
/// Ordered: each state follows the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lifecycle {
    Serving,
    /// SIGTERM received: health says NOT_SERVING; queued requests get 503; streams already
    /// admitted carry on.
    Draining,
    /// The drain deadline passed: every stream still open ends now.
    Closing,
}

/// State shared by every stream.
pub struct Shared {
    pub policy: Arc<Policy>,
    pub metrics: Metrics,
    pub lifecycle: watch::Receiver<Lifecycle>,
    pub open_streams: OpenStreams,
    pub scheduler: Arc<Scheduler>,
    pub ledger: Arc<Ledger>,
    /// Time to first token over the controller's window, fed by every admitted response.
    pub ttft_window: Arc<Mutex<LatencyWindow>>,
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

/// Starts serving one ext_proc stream; returns the stream of its answers.
fn open_stream(shared: Arc<Shared>, inbound: Streaming<ProcessingRequest>) -> Answers {
    // One answer per message and Envoy waits for each, so two slots never block.
    let (tx, rx) = mpsc::channel(2);
    // A task of its own, so a stream that Envoy resets is noticed and accounted for even
    // while tonic is not polling the response stream.
    tokio::spawn(serve_stream(shared, inbound, tx));
    Answers(rx)
}

/// How a stream's conversation with Envoy stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamEnd {
    /// Envoy half-closed or reset the stream, or stopped listening to answers.
    Envoy,
    /// tollgate ended it (shutdown, or a protocol error).
    Tollgate,
}

/// Sends one answer to Envoy; `false` if the stream is gone.
async fn send(
    tx: &mpsc::Sender<service::Answer>,
    answer: Result<ProcessingResponse, Status>,
) -> bool {
    tx.send(Box::new(answer)).await.is_ok()
}

/// A stream's task. Its future lives as long as the stream, and is as large as the largest
/// state it can be in, so every held stream pays for the largest step it might ever take. The
/// large, short-lived steps (`on_message`, `finish`, and the settle in `wait_for_slot`) are
/// boxed and take memory only while they run (`tests::stream_task_future_stays_small` holds the
/// future's size to 4 KiB).
async fn serve_stream(
    shared: Arc<Shared>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<service::Answer>,
) {
    let _held = StreamGuard::new(&shared);
    let mut lifecycle = shared.lifecycle.clone();
    let mut exchange = Exchange::default();
    // Whether Envoy will show tollgate the response body, as its first message says (older
    // Envoys say nothing). Unknown counts as yes for charging, where assuming wrongly only
    // charges the reserved output, and as no for waiting on a first token, where waiting for
    // one that never comes would read as an ever slower request.
    let mut sends_response_body: Option<bool> = None;
    let end = loop {
        let message = tokio::select! {
            biased;
            message = inbound.message() => message,
            () = reached(&mut lifecycle, Lifecycle::Closing) => {
                if !exchange.is_decided() {
                    // Closing with OK would tell Envoy to continue without tollgate, admitting
                    // a request nobody checked; an error makes Envoy answer status_on_error.
                    let _ = send(&tx, Err(Status::unavailable("tollgate is shutting down"))).await;
                }
                // A decided stream closes with OK: Envoy finishes the response without us.
                break StreamEnd::Tollgate;
            }
        };
        let message = match message {
            Ok(Some(message)) => message,
            Ok(None) | Err(_) => break StreamEnd::Envoy,
        };
        if let Some(sent) = convert::sends_response_body(&message) {
            sends_response_body = Some(sent);
        }
        let first_token_expected = sends_response_body == Some(true);
        let answer =
            match Box::pin(exchange.on_message(&shared, message, first_token_expected)).await {
                Step::Answer(answer) => answer,
                Step::Wait(waiting) => {
                    let extend = convert::override_message_timeout(waiting.envoy_timeout);
                    if !send(&tx, Ok(extend)).await {
                        break StreamEnd::Envoy;
                    }
                    match exchange
                        .wait_for_slot(
                            &shared,
                            waiting,
                            &mut inbound,
                            &mut lifecycle,
                            first_token_expected,
                        )
                        .await
                    {
                        Some(answer) => answer,
                        None => break StreamEnd::Envoy,
                    }
                }
            };
        let stop = answer.is_err();
        if !send(&tx, answer).await {
            break StreamEnd::Envoy;
        }
        if stop {
            break StreamEnd::Tollgate;
        }
    };
    let output_observed = sends_response_body != Some(false);
    Box::pin(exchange.finish(&shared, end, output_observed)).await;
}

/// Where the controller's time to first token starts for a request (`control.signal`).
fn control_started(shared: &Shared, arrived: Instant, dispatched: Instant) -> Instant {
    match shared.policy.control.signal {
        ControlSignal::Upstream => dispatched,
        ControlSignal::Gateway => arrived,
    }
}

/// Why a queued request left the queue without a slot.
enum Left {
    /// Boxed: a stray message is rare and large.
    ProtocolError(Box<ProcessingRequest>),
    ClientGone,
    Deadline,
    ShuttingDown,
}

/// What a message leads to: an answer now, or a wait for a slot first.
enum Step {
    Answer(Result<ProcessingResponse, Status>),
    Wait(Waiting),
}

/// A request admitted by every check, waiting in its tenant's queue for a slot.
struct Waiting {
    ticket: Ticket,
    admission: Admission,
    grant: Grant,
    arrived: Instant,
    enqueued: Instant,
    deadline: Instant,
    /// How long Envoy is asked to wait for the answer.
    envoy_timeout: std::time::Duration,
    _queued: GaugeGuard,
}

/// Resolves once the server's lifecycle is at `state` or past it.
pub async fn reached(lifecycle: &mut watch::Receiver<Lifecycle>, state: Lifecycle) {
    // The borrow guard wait_for returns is not Send; drop it before anything else awaits.
    let _ = lifecycle.wait_for(|s| *s >= state).await.is_ok();
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
            _gauge: shared.metrics.hold_stream(),
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

/// One HTTP request's progress through the phases.
#[derive(Default)]
enum Exchange {
    /// Nothing received yet; request headers must come first.
    #[default]
    Start,
    /// An inference request whose body has not arrived yet.
    AwaitingBody {
        head: InferenceHead,
        arrived: Instant,
    },
    /// A route tollgate does not govern.
    PassedThrough,
    /// Answered with a local reply; Envoy sends nothing more.
    Rejected,
    /// Let through; its response is being watched.
    Admitted(Box<Watched>),
}

struct Watched {
    admission: Admission,
    arrived: Instant,
    /// When the request got its slot: the upstream's share of its TTFT starts here.
    dispatched: Instant,
    /// Pending in the controller's window until the first token, or the request's end
    /// (`Pending` ends it on drop). None when no first token is expected.
    awaiting_first_token: Option<Pending>,
    response: Option<ResponseObserver>,
    /// The request's slot in the global budget, freed when the response ends (or, at the
    /// latest, when this drops with the stream).
    permit: Option<Permit>,
    /// The request's budgets, settled with actual usage when the stream ends.
    hold: Hold,
    /// Budget headers for the client's response.
    budget_headers: Vec<(&'static str, String)>,
}

impl Exchange {
    fn is_decided(&self) -> bool {
        !matches!(self, Exchange::Start | Exchange::AwaitingBody { .. })
    }

    /// `first_token_expected`: Envoy said it will show tollgate the response body (see
    /// `serve_stream`).
    async fn on_message(
        &mut self,
        shared: &Shared,
        message: ProcessingRequest,
        first_token_expected: bool,
    ) -> Step {
        let now = Instant::now();
        let Some(message) = message.request else {
            shared.metrics.protocol_error(ProtocolError::EmptyMessage);
            return Step::Answer(Err(Status::invalid_argument(
                "ProcessingRequest carries no request_headers/request_body/... message",
            )));
        };
        match (std::mem::take(self), message) {
            (Exchange::Start, Message::RequestHeaders(headers)) => {
                Step::Answer(Ok(self.on_request_headers(shared, &headers, now)))
            }
            (Exchange::AwaitingBody { head, arrived }, Message::RequestBody(body)) => {
                self.on_request_body(shared, head, arrived, body, first_token_expected)
                    .await
            }
            (state, message) => Step::Answer(self.on_later_message(shared, state, message, now)),
        }
    }

    /// Messages after the decision: response observation, trailers, and protocol errors.
    fn on_later_message(
        &mut self,
        shared: &Shared,
        state: Exchange,
        message: Message,
        now: Instant,
    ) -> Result<ProcessingResponse, Status> {
        match (state, message) {
            (Exchange::Admitted(mut watched), Message::ResponseHeaders(headers)) => {
                watched.on_response_headers(shared, &headers);
                let answer = convert::response_headers_continue(&watched.budget_headers);
                *self = Exchange::Admitted(watched);
                Ok(answer)
            }
            (Exchange::Admitted(mut watched), Message::ResponseBody(body)) => {
                watched.on_response_body(shared, &body, now);
                *self = Exchange::Admitted(watched);
                Ok(convert::continue_unchanged(Answer::ResponseBody))
            }
            // Trailers before any body: the request had no body (Envoy sends a buffered body
            // before the trailers). A CONTINUE here would send it upstream undecided.
            (Exchange::AwaitingBody { head, .. }, Message::RequestTrailers(_)) => {
                let reply = LocalReply::new(
                    Reason::MissingBody,
                    "the request ended with trailers and no body: send a JSON body",
                );
                Ok(self.reject(shared, &reply, Some(head.identity.tier), now))
            }
            // Trailers carry nothing tollgate decides on; answer them wherever they come.
            (state, Message::RequestTrailers(_)) if !matches!(state, Exchange::Start) => {
                *self = state;
                Ok(convert::continue_unchanged(Answer::RequestTrailers))
            }
            (
                state @ (Exchange::Admitted(_) | Exchange::PassedThrough),
                Message::ResponseTrailers(_),
            ) => {
                *self = state;
                Ok(convert::continue_unchanged(Answer::ResponseTrailers))
            }
            // Envoy answered the request itself before its body reached tollgate (e.g. its own
            // 413 for a body over the buffer limit); since 1.40 that local reply goes through the
            // response phases. Nothing was decided or taken: let it through.
            (
                Exchange::AwaitingBody { .. },
                later @ (Message::ResponseHeaders(_) | Message::ResponseBody(_)),
            ) => {
                shared.metrics.request(RequestOutcome::AnsweredByEnvoy);
                *self = Exchange::PassedThrough;
                Ok(convert::continue_unchanged(match later {
                    Message::ResponseHeaders(_) => Answer::ResponseHeaders,
                    _ => Answer::ResponseBody,
                }))
            }
            // Envoy ignores mode_override unless the filter allows it; then the later phases
            // of a passed-through request still arrive and are let through unchanged.
            (Exchange::PassedThrough, later) => {
                *self = Exchange::PassedThrough;
                let phase = match later {
                    Message::RequestBody(_) => Answer::RequestBody,
                    Message::ResponseHeaders(_) => Answer::ResponseHeaders,
                    Message::ResponseBody(_) => Answer::ResponseBody,
                    other => return Err(out_of_order(shared, "passed through", &other)),
                };
                Ok(convert::continue_unchanged(phase))
            }
            (state, message) => {
                let phase = state.name();
                *self = state;
                Err(out_of_order(shared, phase, &message))
            }
        }
    }

    fn on_request_headers(
        &mut self,
        shared: &Shared,
        headers: &HttpHeaders,
        now: Instant,
    ) -> ProcessingResponse {
        let list = convert::headers(headers.headers.as_ref());
        match request::classify_head(&shared.policy, &list, headers.end_of_stream) {
            HeadVerdict::Inference(mut head) => {
                let remove = std::mem::take(&mut head.spoofed_headers);
                *self = Exchange::AwaitingBody { head, arrived: now };
                convert::request_headers_continue(remove)
            }
            HeadVerdict::PassThrough => {
                shared.metrics.request(RequestOutcome::PassedThrough);
                *self = Exchange::PassedThrough;
                convert::request_headers_pass_through()
            }
            HeadVerdict::Reject(reply) => {
                // The tier is known only if identity succeeded, which a head rejection means
                // it did not, or did for a reason unrelated to tiers; count it tierless.
                self.reject(shared, &reply, None, now)
            }
        }
    }

    async fn on_request_body(
        &mut self,
        shared: &Shared,
        head: InferenceHead,
        arrived: Instant,
        body: HttpBody,
        first_token_expected: bool,
    ) -> Step {
        let started = Instant::now();
        let tier = head.identity.tier;
        if !body.end_of_stream {
            let reply = LocalReply::new(
                crate::reply::Reason::IncompleteBody,
                format!(
                    "tollgate received a partial request body ({} bytes): the body is over Envoy's \
                     buffer limit, the request carries trailers, or the ext_proc filter is not in \
                     BUFFERED request body mode",
                    body.body.len()
                ),
            );
            return Step::Answer(Ok(self.reject(shared, &reply, Some(tier), started)));
        }
        let received = body.body.len();
        // The decoded body is freed once decided: what waits in the queue, or goes upstream, is
        // the `Admission`, with its rewritten body if there is one.
        let verdict = decide_body(shared, &head, body.body).await;
        let admission = match verdict {
            BodyVerdict::Admit(admission) => admission,
            BodyVerdict::Reject(reply) => {
                return Step::Answer(Ok(self.reject(shared, &reply, Some(tier), started)));
            }
        };
        let policy = &shared.policy;
        let tenant = &admission.identity.tenant;
        let tier_policy = policy.tier_for(tenant, tier);
        let grant = match shared
            .ledger
            .reserve(
                tenant,
                tier_policy,
                &admission.model,
                admission.worst_case_tokens(),
            )
            .await
        {
            Ok(grant) => grant,
            Err(reply) => {
                return Step::Answer(Ok(self.reject(shared, &reply, Some(tier), started)));
            }
        };
        let limit = shared.scheduler.load().limit;
        let class = FlowClass {
            weight: tier_policy.weight,
            band: tier_policy.priority_band,
            queue_max: tier_policy.queue_max,
            reserved_slots: policy
                .scheduling
                .reservations
                .get(tenant)
                .map_or(0, |&percent| reserved_slots(limit, percent)),
        };
        let cost = match policy.scheduling.cost {
            FairnessCost::Requests => 1,
            FairnessCost::Tokens => admission.worst_case_tokens(),
        };
        let held_bytes = queued_body_bytes(received, &admission);
        shared.metrics.scheduler_submitted(tier);
        match shared.scheduler.submit(tenant, class, cost, held_bytes) {
            Admit::Now(permit) => {
                shared
                    .metrics
                    .scheduler_outcome(tier, SchedulerOutcome::AdmittedNow);
                let answer = self.admit(
                    shared,
                    admission,
                    grant,
                    arrived,
                    permit,
                    first_token_expected,
                );
                shared
                    .metrics
                    .decision_duration(started.elapsed().as_secs_f64());
                Step::Answer(Ok(answer))
            }
            refused @ (Admit::Full | Admit::BytesFull) => {
                let (outcome, reason, message) = if matches!(refused, Admit::Full) {
                    (
                        SchedulerOutcome::QueueFull,
                        Reason::QueueFull,
                        format!(
                            "the service is at capacity and tenant {tenant:?} already has {} \
                             requests waiting; retry shortly",
                            tier_policy.queue_max
                        ),
                    )
                } else {
                    (
                        SchedulerOutcome::QueueBytesFull,
                        Reason::QueueBytesFull,
                        "the service is at capacity and the requests already waiting hold as \
                         many bytes of request bodies as it allows; retry shortly"
                            .to_owned(),
                    )
                };
                shared.metrics.scheduler_outcome(tier, outcome);
                // A rejected request consumes nothing: give its reservation back.
                shared.ledger.settle(grant.hold, 0, true).await;
                let reply = LocalReply::new(reason, message).with_header("retry-after", "1");
                Step::Answer(Ok(self.reject(shared, &reply, Some(tier), started)))
            }
            Admit::Queued(ticket) => {
                let deadline = started + tier_policy.queue_deadline;
                let envoy_timeout = (tier_policy.queue_deadline + ENVOY_TIMEOUT_MARGIN)
                    .min(policy.scheduling.envoy_max_message_timeout);
                Step::Wait(Waiting {
                    ticket,
                    admission,
                    grant,
                    arrived,
                    enqueued: started,
                    deadline,
                    envoy_timeout,
                    _queued: shared.metrics.hold_queued(tier),
                })
            }
        }
    }

    /// Waits for a queued request's slot; `None` if Envoy gave up on the stream (the client
    /// went away), in which case nothing was taken.
    async fn wait_for_slot(
        &mut self,
        shared: &Shared,
        waiting: Waiting,
        inbound: &mut Streaming<ProcessingRequest>,
        lifecycle: &mut watch::Receiver<Lifecycle>,
        first_token_expected: bool,
    ) -> Option<Result<ProcessingResponse, Status>> {
        let Waiting {
            mut ticket,
            admission,
            grant,
            arrived,
            enqueued,
            deadline,
            _queued,
            ..
        } = waiting;
        let tier = admission.identity.tier;
        let outcome = tokio::select! {
            biased;
            permit = ticket.granted() => Ok(permit),
            message = inbound.message() => Err(match message {
                // Envoy sends nothing while it waits for this answer.
                Ok(Some(message)) => Left::ProtocolError(Box::new(message)),
                Ok(None) | Err(_) => Left::ClientGone,
            }),
            () = tokio::time::sleep_until(deadline) => Err(Left::Deadline),
            () = reached(lifecycle, Lifecycle::Draining) => Err(Left::ShuttingDown),
        };
        drop(ticket);
        let left = match outcome {
            Ok(permit) => {
                let now = Instant::now();
                let waited = now.duration_since(enqueued).as_secs_f64();
                shared.metrics.queue_wait(tier, waited);
                shared
                    .metrics
                    .scheduler_outcome(tier, SchedulerOutcome::AdmittedAfterWait);
                shared.metrics.decision_duration(waited);
                return Some(Ok(self.admit(
                    shared,
                    admission,
                    grant,
                    arrived,
                    permit,
                    first_token_expected,
                )));
            }
            Err(left) => left,
        };
        // Left the queue without a slot: it consumes nothing, so its reservation goes back.
        // Boxed, like the steps in `serve_stream`: this future waits as long as the request
        // does, and the settle would otherwise make it larger for the whole wait.
        Box::pin(shared.ledger.settle(grant.hold, 0, true)).await;
        *self = Exchange::Rejected;
        let (outcome, reason, message) = match left {
            Left::ProtocolError(message) => {
                // Like a client that went away, it leaves without a decision: counted once, as
                // abandoned, or the stream would end with no outcome at all.
                shared
                    .metrics
                    .scheduler_outcome(tier, SchedulerOutcome::Cancelled);
                shared.metrics.request(RequestOutcome::Abandoned);
                let phase = "waiting in the queue for a slot";
                return Some(Err(match message.request {
                    Some(message) => out_of_order(shared, phase, &message),
                    None => Status::invalid_argument("empty ProcessingRequest while queued"),
                }));
            }
            Left::ClientGone => {
                shared
                    .metrics
                    .scheduler_outcome(tier, SchedulerOutcome::Cancelled);
                shared.metrics.request(RequestOutcome::Abandoned);
                return None;
            }
            Left::Deadline => (
                SchedulerOutcome::QueueTimeout,
                Reason::QueueTimeout,
                format!(
                    "the service is at capacity: no slot freed within the {} ms queue deadline; \
                     retry shortly",
                    shared
                        .policy
                        .tier_for(&admission.identity.tenant, tier)
                        .queue_deadline
                        .as_millis()
                ),
            ),
            Left::ShuttingDown => (
                SchedulerOutcome::ShuttingDown,
                Reason::ShuttingDown,
                "this tollgate replica is shutting down; retry shortly".to_owned(),
            ),
        };
        shared.metrics.scheduler_outcome(tier, outcome);
        let reply = LocalReply::new(reason, message).with_header("retry-after", "1");
        Some(Ok(self.reject(shared, &reply, Some(tier), enqueued)))
    }

    /// Lets an admitted request through, holding `permit` until its response ends and its
    /// budgets until its stream ends.
    fn admit(
        &mut self,
        shared: &Shared,
        mut admission: Admission,
        grant: Grant,
        arrived: Instant,
        permit: Permit,
        first_token_expected: bool,
    ) -> ProcessingResponse {
        // The rewritten body goes into the answer; nothing needs it after that, and an admitted
        // stream lives as long as its response.
        let new_body = admission.new_body.take();
        let answer = convert::request_body_admit(&admission, new_body, &grant.headers);
        let tier = admission.identity.tier;
        let metrics = &shared.metrics;
        metrics.request(RequestOutcome::Admitted);
        metrics.estimated_input_tokens(tier, admission.input_tokens);
        let (input, output) = admission.reserved_tokens();
        metrics.budget_tokens(tier, TokenKind::Input, TokenStage::Reserved, input);
        metrics.budget_tokens(tier, TokenKind::Output, TokenStage::Reserved, output);
        let dispatched = Instant::now();
        // Only when Envoy has said it will show tollgate the response body: otherwise there
        // may be no first token to wait for, and the request's age would read as a latency.
        let awaiting_first_token = first_token_expected.then(|| {
            Pending::start(
                &shared.ttft_window,
                control_started(shared, arrived, dispatched),
            )
        });
        *self = Exchange::Admitted(Box::new(Watched {
            admission,
            arrived,
            dispatched,
            awaiting_first_token,
            response: None,
            permit: Some(permit),
            hold: grant.hold,
            budget_headers: grant.headers,
        }));
        answer
    }

    fn reject(
        &mut self,
        shared: &Shared,
        reply: &LocalReply,
        tier: Option<TierId>,
        started: Instant,
    ) -> ProcessingResponse {
        shared.metrics.request(if reply.status() == 503 {
            RequestOutcome::Shed
        } else {
            RequestOutcome::Rejected
        });
        shared.metrics.rejection(reply.reason, tier);
        shared
            .metrics
            .decision_duration(started.elapsed().as_secs_f64());
        *self = Exchange::Rejected;
        convert::immediate(reply)
    }

    /// Records how the stream ended and settles its budgets; runs exactly once per stream.
    async fn finish(self, shared: &Shared, end: StreamEnd, output_observed: bool) {
        match self {
            Exchange::AwaitingBody { .. } => shared.metrics.request(RequestOutcome::Abandoned),
            Exchange::Admitted(watched) => watched.finish(shared, end, output_observed).await,
            Exchange::Start | Exchange::PassedThrough | Exchange::Rejected => {}
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Exchange::Start => "start (expecting request_headers)",
            Exchange::AwaitingBody { .. } => "awaiting request_body",
            Exchange::PassedThrough => "passed through",
            Exchange::Rejected => "rejected (no further messages expected)",
            Exchange::Admitted(_) => "admitted (expecting response messages)",
        }
    }
}

impl Watched {
    fn on_response_headers(&mut self, shared: &Shared, headers: &HttpHeaders) {
        let map = headers.headers.as_ref();
        let status = convert::header(map, ":status")
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut observer = ResponseObserver::new(
            status,
            convert::header(map, "content-type"),
            shared.policy.max_buffered_json_bytes,
        )
        .counting_output(self.admission.encoding);
        if headers.end_of_stream {
            observer.on_end_of_stream();
            self.permit = None;
            // A response without a body has no first token to wait for.
            self.awaiting_first_token = None;
        }
        self.response = Some(observer);
    }

    fn on_response_body(&mut self, shared: &Shared, body: &HttpBody, now: Instant) {
        // Without response headers (header mode SKIP) the status is unknown: assume success and
        // sniff nothing but usage from a JSON body.
        let encoding = self.admission.encoding;
        let observer = self.response.get_or_insert_with(|| {
            ResponseObserver::new(200, None, shared.policy.max_buffered_json_bytes)
                .counting_output(encoding)
        });
        if observer.on_chunk(&body.body, body.end_of_stream) {
            let tier = self.admission.identity.tier;
            let ttft = now.duration_since(self.arrived).as_secs_f64();
            let upstream_ttft = now.duration_since(self.dispatched).as_secs_f64();
            shared.metrics.time_to_first_token(tier, ttft);
            shared
                .metrics
                .upstream_time_to_first_token(tier, upstream_ttft);
            let started = control_started(shared, self.arrived, self.dispatched);
            let seconds = now.duration_since(started).as_secs_f64();
            match self.awaiting_first_token.take() {
                Some(pending) => pending.answered(now, seconds),
                None => window::lock(&shared.ttft_window).record_started(now, started, seconds),
            }
        }
        if body.end_of_stream {
            // The upstream is done with this request: its slot is free for the next one.
            self.permit = None;
        }
    }

    async fn finish(self, shared: &Shared, _end: StreamEnd, output_observed: bool) {
        let Watched {
            admission,
            arrived,
            awaiting_first_token,
            response,
            permit,
            hold,
            ..
        } = self;
        drop(permit);
        // Over without a first token (an error, a reset): no longer pending.
        drop(awaiting_first_token);
        let tier = admission.identity.tier;
        let metrics = &shared.metrics;
        let end = response
            .as_ref()
            .map_or(ResponseEnd::NoResponse, ResponseObserver::end);
        metrics.stream_completion(end);
        if end == ResponseEnd::Complete {
            metrics.request_duration(tier, arrived.elapsed().as_secs_f64());
        }
        let usage = response.as_ref().and_then(ResponseObserver::usage);
        if let Some(usage) = usage {
            metrics.usage(tier, usage.prompt_tokens, usage.completion_tokens);
        }
        let spent = spent_tokens(&admission, end, usage, response.as_ref(), output_observed);
        let (reserved_input, reserved_output) = admission.reserved_tokens();
        for (kind, reserved, actual) in [
            (TokenKind::Input, reserved_input, spent.input),
            (TokenKind::Output, reserved_output, spent.output),
        ] {
            metrics.budget_tokens(tier, kind, TokenStage::Settled, actual);
            metrics.budget_tokens(
                tier,
                kind,
                TokenStage::Refunded,
                reserved.saturating_sub(actual),
            );
        }
        shared
            .ledger
            .settle(hold, spent.input + spent.output, spent.refund_request)
            .await;
    }
}

/// What a finished request really cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spent {
    input: u64,
    output: u64,
    /// The upstream failed before answering: the request itself is not counted either.
    refund_request: bool,
}

/// The settlement rules: the upstream's own usage when it reported one; else the counted input
/// plus the output tokens that were streamed; nothing at all when the upstream failed. When
/// Envoy does not send the response body (`output_observed` false), the output cannot be
/// counted, so what the request asked for is charged: its reserved output (its max tokens,
/// after defaulting or clamping), the most it may have generated.
fn spent_tokens(
    admission: &Admission,
    end: ResponseEnd,
    usage: Option<crate::observe::response::Usage>,
    response: Option<&ResponseObserver>,
    output_observed: bool,
) -> Spent {
    let input = u64::from(admission.input_tokens);
    match (end, usage) {
        (ResponseEnd::UpstreamError, _) => Spent {
            input: 0,
            output: 0,
            refund_request: true,
        },
        (_, Some(usage)) => Spent {
            input: usage.prompt_tokens,
            output: usage.completion_tokens,
            refund_request: false,
        },
        (_, None) if !output_observed => Spent {
            input,
            output: admission.reserved_tokens().1,
            refund_request: false,
        },
        // Complete without usage, truncated, or the client left before any response: the
        // prompt was (or may have been) processed; charge it and what was generated.
        _ => Spent {
            input,
            output: response.map_or(0, ResponseObserver::output_tokens),
            refund_request: false,
        },
    }
}

/// The admission decision on a body, on the blocking pool if the body is large. Takes the body,
/// so its bytes are freed as soon as the decision is made.
async fn decide_body(shared: &Shared, head: &InferenceHead, body: Vec<u8>) -> BodyVerdict {
    if body.len() <= INLINE_BODY_BYTES {
        return admission::decide_body(&shared.policy, head, &body);
    }
    let policy = shared.policy.clone();
    let head = head.clone();
    match tokio::task::spawn_blocking(move || admission::decide_body(&policy, &head, &body)).await {
        Ok(verdict) => verdict,
        // Only a panic in counting gets here; refuse rather than pass unchecked.
        Err(join_error) => BodyVerdict::Reject(LocalReply::new(
            crate::reply::Reason::InvalidRequest,
            format!("the request body could not be processed: {join_error}"),
        )),
    }
}

/// The body bytes a request keeps in memory while it waits for a slot, as counted against
/// `scheduler.max_queued_body_bytes`: the body as Envoy sent it, which stays in tonic's decode
/// buffer for the life of the stream (a `BytesMut` never shrinks), plus the rewritten body that
/// will go upstream, if there is one.
fn queued_body_bytes(received: usize, admission: &Admission) -> usize {
    received + admission.new_body.as_ref().map_or(0, Vec::len)
}

/// Slots a tenant's reserved percentage is worth at `limit`, rounded up so a small reservation
/// still guarantees one slot.
fn reserved_slots(limit: u32, percent: u32) -> u32 {
    (u64::from(limit) * u64::from(percent)).div_ceil(100) as u32
}

fn out_of_order(shared: &Shared, phase: &str, message: &Message) -> Status {
    shared.metrics.protocol_error(ProtocolError::OutOfOrder);
    let got = match message {
        Message::RequestHeaders(_) => "request_headers",
        Message::RequestBody(_) => "request_body",
        Message::RequestTrailers(_) => "request_trailers",
        Message::ResponseHeaders(_) => "response_headers",
        Message::ResponseBody(_) => "response_body",
        Message::ResponseTrailers(_) => "response_trailers",
    };
    Status::failed_precondition(format!(
        "ext_proc protocol violation: received {got} while {phase}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future an async fn returns, without calling it.
    fn future_size<A, B, C, Fut>(_: &impl Fn(A, B, C) -> Fut) -> usize {
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
