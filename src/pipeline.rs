//! One request's life, free of any protocol: the admission pipeline the ext_proc adapter drives.
//!
//! A `RequestLife` goes through the phases of an HTTP request, one method each, over domain
//! types: `head` (who, which route), `body` (the decision: admit, refuse with a reply, or wait
//! for a slot), `wait` (in the tenant's queue), `response_headers` and `response_body`
//! (observation: first token, usage, proper end), and `finish` (settle the budgets, free the
//! slot), exactly once whichever way the request ended. Deciding steps take `now` as an
//! argument; the pipeline is tested with the in-memory store and paused time, without gRPC
//! (`pipeline/tests.rs`).
//!
//! A phase that comes out of order is answered with `OutOfOrder`, a value the adapter turns into
//! its protocol's error; the request's state is left as it was.

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

use crate::admission::{self, Admission, BodyVerdict};
use crate::budget::ledger::{Grant, Hold, Ledger, Reserved};
use crate::config::{ControlSignal, FairnessCost};
use crate::control::window::{self, LatencyWindow, Pending};
use crate::lifecycle::{Lifecycle, reached};
use crate::live::Rules;
use crate::observe::response::{ResponseEnd, ResponseObserver, Usage};
use crate::observe::{
    CountedOffWorkers, GaugeGuard, Metrics, RequestOutcome, SchedulerOutcome, TokenKind, TokenStage,
};
use crate::policy::{ENVOY_TIMEOUT_MARGIN, MAX_LARGE_BODY_THREADS, TierId};
use crate::reply::{self, LocalReply, Reason};
use crate::request::{self, HeadVerdict, Header, InferenceHead};
use crate::scheduler::{Admit, FlowClass, Permit, Scheduler, Ticket};
use crate::tokens;

mod reports;
#[cfg(test)]
mod tests;

pub use reports::{FirstToken, Registration, Reports, Summary};

/// Bodies above this size are parsed and counted on the counting threads, so a long prompt
/// never stalls the async workers that every other stream shares. Ordinary text of this size
/// counts in a few tens of microseconds; the long pieces the encoder is slowest on are bounded
/// further by `INLINE_COUNT_BUDGET`, and what is left (pieces of 15 bytes or less, or with a
/// model's own tokenizer any text: at most about 0.1 µs a byte measured) is bounded by this
/// size. At 256 KiB,
/// the bound before, one body of dashes held a worker for 100 to 210 ms (docs/benchmarks.md,
/// "Costly text off the async workers").
const INLINE_BODY_BYTES: usize = 16 * 1024;
/// What the long pieces of a body counted on an async worker may cost
/// (`tokens::within_inline_budget`): 512 bytes of runs of punctuation (0.4 ms at the encoder's
/// slowest, 0.8 µs a byte) or 8 KiB of long words (0.65 ms at 0.08 µs a byte). Past it the body
/// goes to the counting threads.
const INLINE_COUNT_BUDGET: usize = 512;

/// What every request's life shares: the policy, the budgets, the global slots and the
/// controller's window.
pub struct Pipeline {
    /// The policy in force with the metrics of its tiers, replaced by a reload; a request keeps
    /// the one it started under.
    pub rules: watch::Receiver<Arc<Rules>>,
    /// The series that do not depend on the policy (the same as every `Rules`' ones).
    pub metrics: Metrics,
    pub scheduler: Arc<Scheduler>,
    pub ledger: Arc<Ledger>,
    /// Time to first token over the controller's window, fed by every admitted response.
    pub ttft_window: Arc<Mutex<LatencyWindow>>,
    /// Requests whose response is reported on rather than streamed (`reports`).
    pub reports: Arc<Reports>,
    /// One permit per thread that may parse and count a large body at once
    /// (`tokens.large_body_threads`). tokio's semaphore hands permits out in arrival order.
    pub large_body_threads: Arc<Semaphore>,
}

/// What the request headers lead to.
#[derive(Debug, PartialEq, Eq)]
pub enum HeadDecision {
    /// An inference request: continue without the client's copies of these headers, and send
    /// the body.
    Continue {
        remove_headers: Vec<String>,
    },
    /// A route tollgate does not govern: let it through and send nothing more.
    PassThrough,
    Refuse(LocalReply),
}

/// What the request body leads to.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyDecision<'a> {
    Admit(Forward<'a>),
    Refuse(LocalReply),
    /// Queued for a slot: call `RequestLife::wait`. The protocol may be told how long to wait
    /// for the answer (`envoy_timeout`, the queue deadline plus a margin, capped by
    /// `scheduler.envoy_max_message_timeout`).
    Wait {
        envoy_timeout: std::time::Duration,
    },
    /// A request already passed through (its route is not governed): continue unchanged.
    PassThrough,
}

/// What an admitted request sends upstream besides its own headers.
#[derive(Debug, PartialEq, Eq)]
pub struct Forward<'a> {
    /// tollgate's upstream headers: the admission's `x-tollgate-*`, then `budget_headers`.
    pub headers: Vec<(&'static str, String)>,
    /// The budgets' state (`x-ratelimit-*`, `RateLimit*`), which the request keeps for its
    /// client's response: lent, not copied.
    pub budget_headers: &'a [(&'static str, String)],
    /// The rewritten body, if the admission changed it.
    pub body: Option<Vec<u8>>,
    /// The tag reports on the response name the request by, when they are expected
    /// (`RequestLife::expect_reports`).
    pub report_tag: Option<&'a str>,
}

/// How a wait in the queue ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Waited<'a, M> {
    Admit(Forward<'a>),
    /// The queue deadline passed, or the server began shutting down.
    Refuse(LocalReply),
    /// The client went away: nothing was taken, and there is nobody to answer.
    ClientGone,
    /// The protocol delivered a message while the request was waiting for its answer: a
    /// protocol violation, counted as an abandoned request. The message comes back to the
    /// adapter to report.
    Stray(M),
}

/// What trailers on the request lead to.
#[derive(Debug, PartialEq, Eq)]
pub enum TrailersDecision {
    Continue,
    /// Trailers before any body: a request with no body.
    Refuse(LocalReply),
}

/// A phase arrived that the request's state does not allow; nothing changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfOrder {
    /// What the request was doing, for the error message.
    pub state: &'static str,
}

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Nothing received yet; request headers must come first.
    Start,
    /// An inference request whose body has not arrived yet.
    AwaitingBody,
    /// A route tollgate does not govern, or one Envoy answered itself.
    PassedThrough,
    /// Answered with a local reply.
    Refused,
    /// Waiting in its tenant's queue for a slot.
    Queued,
    /// Let through; its response is being watched.
    Admitted,
}

impl Phase {
    /// Whether the request has been decided (answered, admitted or passed through).
    pub fn is_decided(self) -> bool {
        !matches!(self, Phase::Start | Phase::AwaitingBody | Phase::Queued)
    }

    pub fn describe(self) -> &'static str {
        match self {
            Phase::Start => "start (expecting request_headers)",
            Phase::AwaitingBody => "awaiting request_body",
            Phase::PassedThrough => "passed through",
            Phase::Refused => "rejected (no further messages expected)",
            Phase::Queued => "waiting in the queue for a slot",
            Phase::Admitted => "admitted (expecting response messages)",
        }
    }
}

/// One HTTP request's life through the pipeline.
pub struct RequestLife<'p> {
    pipeline: &'p Pipeline,
    /// The policy in force when the request began, kept for its whole life.
    rules: Arc<Rules>,
    state: State,
    /// Whether the protocol will show the response body (`None`: it has not said). Unknown
    /// counts as yes for charging, where assuming wrongly only charges the reserved output, and
    /// as no for waiting on a first token, where waiting for one that never comes would read as
    /// an ever slower request.
    response_body_shown: Option<bool>,
    /// Whether the response is reported on outside this stream (`reports`) instead of shown.
    reports_expected: bool,
}

#[derive(Default)]
enum State {
    #[default]
    Start,
    AwaitingBody {
        head: InferenceHead,
        arrived: Instant,
    },
    PassedThrough,
    Refused,
    Queued(Box<Queued>),
    Admitted(Box<Watched>),
}

/// A request admitted by every check, waiting in its tenant's queue for a slot.
struct Queued {
    ticket: Ticket,
    admission: Admission,
    grant: Grant,
    arrived: Instant,
    /// When its body arrived: its decision is timed from then.
    body_arrived: Instant,
    /// When it joined the queue, after its count and its reservation: its queue wait is timed
    /// from then.
    enqueued: Instant,
    deadline: Instant,
    _queued: GaugeGuard,
}

struct Watched {
    admission: Admission,
    arrived: Instant,
    /// When the request got its slot: the upstream's share of its TTFT starts here.
    dispatched: Instant,
    /// Pending in the controller's window until the first token, or the request's end
    /// (`Pending` ends it on drop). None when no first token is expected.
    awaiting_first_token: Option<Pending>,
    /// Whether its time to first token goes into the controller's window: not for a request
    /// shadow mode let through without a slot.
    feeds_controller: bool,
    response: Option<ResponseObserver>,
    /// The request's slot in the global budget, freed when the response ends (or, at the
    /// latest, when this drops with the request).
    permit: Option<Permit>,
    /// The request's budgets, settled with actual usage when the request ends.
    hold: Hold,
    /// Its place among the requests reports may name, when its response is reported on.
    reports: Option<Registration>,
    /// Budget headers for the client's response (lent to what went upstream).
    budget_headers: Vec<(&'static str, String)>,
}

/// Why a queued request left the queue without a slot.
enum Left<M> {
    Stray(M),
    ClientGone,
    Deadline,
    ShuttingDown,
}

impl<'p> RequestLife<'p> {
    pub fn new(pipeline: &'p Pipeline) -> RequestLife<'p> {
        RequestLife {
            pipeline,
            rules: pipeline.rules.borrow().clone(),
            state: State::Start,
            response_body_shown: None,
            reports_expected: false,
        }
    }

    pub fn phase(&self) -> Phase {
        match self.state {
            State::Start => Phase::Start,
            State::AwaitingBody { .. } => Phase::AwaitingBody,
            State::PassedThrough => Phase::PassedThrough,
            State::Refused => Phase::Refused,
            State::Queued(_) => Phase::Queued,
            State::Admitted(_) => Phase::Admitted,
        }
    }

    /// Records whether the protocol will show this request's response body.
    pub fn set_response_body_shown(&mut self, shown: bool) {
        self.response_body_shown = Some(shown);
    }

    /// The response will not be shown on this stream but reported on (`reports`): a first
    /// token and a summary, naming the request by the tag its admission gives it.
    pub fn expect_reports(&mut self) {
        self.reports_expected = true;
    }

    fn out_of_order(&self) -> OutOfOrder {
        OutOfOrder {
            state: self.phase().describe(),
        }
    }

    /// The request headers: identity and route.
    pub fn head(
        &mut self,
        headers: &[Header<'_>],
        end_of_stream: bool,
        now: Instant,
    ) -> Result<HeadDecision, OutOfOrder> {
        if !matches!(self.state, State::Start) {
            return Err(self.out_of_order());
        }
        let rules = &self.rules;
        Ok(
            match request::classify_head(&rules.policy, headers, end_of_stream) {
                HeadVerdict::Inference(mut head) => {
                    let remove_headers = std::mem::take(&mut head.spoofed_headers);
                    self.state = State::AwaitingBody { head, arrived: now };
                    HeadDecision::Continue { remove_headers }
                }
                HeadVerdict::PassThrough => {
                    rules.metrics.request(RequestOutcome::PassedThrough);
                    self.state = State::PassedThrough;
                    HeadDecision::PassThrough
                }
                // The tier is known only if identity succeeded, which a head rejection means it
                // did not, or did for a reason unrelated to tiers; count it tierless.
                HeadVerdict::Reject(reply) => HeadDecision::Refuse(self.refuse(reply, None, now)),
            },
        )
    }

    /// The buffered request body (`complete`: all of it arrived in this one piece): parse,
    /// count, check the hard limits, reserve the budgets (one store call), and ask for a slot.
    pub async fn body(
        &mut self,
        body: Vec<u8>,
        complete: bool,
        now: Instant,
    ) -> Result<BodyDecision<'_>, OutOfOrder> {
        let (head, arrived) = match std::mem::take(&mut self.state) {
            State::AwaitingBody { head, arrived } => (head, arrived),
            State::PassedThrough => {
                self.state = State::PassedThrough;
                return Ok(BodyDecision::PassThrough);
            }
            other => {
                self.state = other;
                return Err(self.out_of_order());
            }
        };
        let pipeline = self.pipeline;
        let rules = &self.rules;
        let tier = head.identity.tier;
        if !complete {
            let reply = LocalReply::new(
                Reason::IncompleteBody,
                format!(
                    "tollgate received a partial request body ({} bytes): the body is over Envoy's \
                     buffer limit, the request carries trailers, or the ext_proc filter is not in \
                     BUFFERED request body mode",
                    body.len()
                ),
            );
            return Ok(BodyDecision::Refuse(self.refuse(reply, Some(tier), now)));
        }
        let received = body.len();
        let policy = &rules.policy;
        let tier_policy = policy.tier_for(&head.identity.tenant, tier);
        // The decoded body is freed once decided: what waits in the queue, or goes upstream, is
        // the `Admission`, with its rewritten body if there is one.
        let Decided { verdict, backlog } =
            decide_body(pipeline, rules, &head, body, now, tier_policy.enforce).await;
        let admission = match verdict {
            BodyVerdict::Admit(admission) => admission,
            BodyVerdict::Reject(reply) => {
                return Ok(BodyDecision::Refuse(self.refuse(reply, Some(tier), now)));
            }
        };
        if let Some(reply) = backlog {
            return Ok(self.let_through_unreserved(admission, &reply, tier, arrived));
        }
        let tenant = &admission.identity.tenant;
        let reserved = pipeline
            .ledger
            .reserve(
                tenant,
                tier_policy.windows_for(&admission.model),
                tier_policy.max_concurrent,
                admission.worst_case_tokens(),
            )
            .await;
        let mut admission = admission;
        let grant = match reserved {
            Reserved::Granted(grant) => grant,
            Reserved::Denied(denial) => {
                let reply = reply::rate_limit::denial(&denial, &tier_policy.name);
                if tier_policy.enforce {
                    return Ok(BodyDecision::Refuse(self.refuse(reply, Some(tier), now)));
                }
                return Ok(self.let_through_unreserved(admission, &reply, tier, arrived));
            }
        };
        let tenant = &admission.identity.tenant;
        // A reservation is a share of the deployment's budget: on a fleet member the fleet's
        // override carries this replica's slice of it.
        let limit = pipeline.scheduler.load().global_limit;
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
        let metrics = &rules.metrics;
        metrics.scheduler_submitted(tier);
        match pipeline.scheduler.submit(tenant, class, cost, held_bytes) {
            Admit::Now(permit) => {
                metrics.scheduler_outcome(tier, SchedulerOutcome::AdmittedNow);
                metrics.decision_duration(Instant::now().duration_since(now).as_secs_f64());
                Ok(BodyDecision::Admit(self.admit(
                    admission,
                    grant,
                    arrived,
                    Some(permit),
                )))
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
                metrics.scheduler_outcome(tier, outcome);
                let reply = LocalReply::new(reason, message);
                if !tier_policy.enforce {
                    // Shadow mode: upstream without a slot (see `shadow_refusal`).
                    shadow_refusal(rules, &mut admission, &reply, tier);
                    let forward = self.admit(admission, grant, arrived, None);
                    return Ok(BodyDecision::Admit(forward));
                }
                // A refused request consumes nothing: give its reservation back.
                pipeline.ledger.settle(grant.hold, 0, true).await;
                Ok(BodyDecision::Refuse(self.refuse(reply, Some(tier), now)))
            }
            Admit::Queued(ticket) => {
                let envoy_timeout = (tier_policy.queue_deadline + ENVOY_TIMEOUT_MARGIN)
                    .min(policy.scheduling.envoy_max_message_timeout);
                self.state = State::Queued(Box::new(Queued {
                    ticket,
                    deadline: now + tier_policy.queue_deadline,
                    admission,
                    grant,
                    arrived,
                    body_arrived: now,
                    enqueued: Instant::now(),
                    _queued: metrics.hold_queued(tier),
                }));
                Ok(BodyDecision::Wait { envoy_timeout })
            }
        }
    }

    /// Waits in the queue for a slot, until one comes, the queue deadline passes (503), the
    /// server starts draining (503), or `client` resolves: `None` when the client went away
    /// (nothing taken), `Some(message)` when the protocol sent something while it should have
    /// been waiting for the answer. Whichever way it leaves without a slot, the request's
    /// reservation goes back whole.
    pub async fn wait<M>(
        &mut self,
        client: impl Future<Output = Option<M>>,
        lifecycle: &mut watch::Receiver<Lifecycle>,
    ) -> Result<Waited<'_, M>, OutOfOrder> {
        let wrong = self.out_of_order();
        let State::Queued(queued) = &mut self.state else {
            return Err(wrong);
        };
        // The request stays `Queued` while it waits: if this future is dropped, `finish` still
        // finds it there and gives its reservation back.
        let deadline = queued.deadline;
        let outcome = tokio::select! {
            biased;
            permit = queued.ticket.granted() => Ok(permit),
            message = client => Err(match message {
                Some(message) => Left::Stray(message),
                None => Left::ClientGone,
            }),
            () = tokio::time::sleep_until(deadline) => Err(Left::Deadline),
            () = reached(lifecycle, Lifecycle::Draining) => Err(Left::ShuttingDown),
        };
        let State::Queued(queued) = std::mem::take(&mut self.state) else {
            unreachable!("the state stays Queued while the request waits");
        };
        let Queued {
            ticket,
            admission,
            grant,
            arrived,
            body_arrived,
            enqueued,
            _queued,
            ..
        } = *queued;
        drop(ticket);
        let pipeline = self.pipeline;
        let rules = &self.rules;
        let metrics = &rules.metrics;
        let tier = admission.identity.tier;
        let left = match outcome {
            Ok(permit) => {
                let now = Instant::now();
                metrics.queue_wait(tier, now.duration_since(enqueued).as_secs_f64());
                metrics.scheduler_outcome(tier, SchedulerOutcome::AdmittedAfterWait);
                metrics.decision_duration(now.duration_since(body_arrived).as_secs_f64());
                return Ok(Waited::Admit(self.admit(
                    admission,
                    grant,
                    arrived,
                    Some(permit),
                )));
            }
            Err(left) => left,
        };
        let mut admission = admission;
        if matches!(left, Left::Deadline) {
            let tier_policy = rules.policy.tier_for(&admission.identity.tenant, tier);
            if !tier_policy.enforce {
                // Shadow mode: the deadline passed; upstream now, without a slot.
                metrics.scheduler_outcome(tier, SchedulerOutcome::QueueTimeout);
                let reply = LocalReply::new(Reason::QueueTimeout, "the queue deadline passed");
                shadow_refusal(rules, &mut admission, &reply, tier);
                return Ok(Waited::Admit(self.admit(admission, grant, arrived, None)));
            }
        }
        // Left the queue without a slot: it consumes nothing, so its reservation goes back.
        // Boxed: this future waits as long as the request does, and the settle would otherwise
        // make it larger for the whole wait.
        Box::pin(pipeline.ledger.settle(grant.hold, 0, true)).await;
        self.state = State::Refused;
        let (outcome, reason, message) = match left {
            // Like a client that went away, a stray message leaves without a decision: counted
            // once, as abandoned, or the request would end with no outcome at all.
            Left::Stray(message) => {
                metrics.scheduler_outcome(tier, SchedulerOutcome::Cancelled);
                metrics.request(RequestOutcome::Abandoned);
                return Ok(Waited::Stray(message));
            }
            Left::ClientGone => {
                metrics.scheduler_outcome(tier, SchedulerOutcome::Cancelled);
                metrics.request(RequestOutcome::Abandoned);
                return Ok(Waited::ClientGone);
            }
            Left::Deadline => (
                SchedulerOutcome::QueueTimeout,
                Reason::QueueTimeout,
                format!(
                    "the service is at capacity: no slot freed within the {} ms queue deadline; \
                     retry shortly",
                    rules
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
        metrics.scheduler_outcome(tier, outcome);
        let reply = LocalReply::new(reason, message);
        Ok(Waited::Refuse(self.refuse(reply, Some(tier), body_arrived)))
    }

    /// Trailers on the request.
    pub fn request_trailers(&mut self, now: Instant) -> Result<TrailersDecision, OutOfOrder> {
        match std::mem::take(&mut self.state) {
            State::Start => Err(self.out_of_order()),
            // Trailers before any body: the request had no body (Envoy sends a buffered body
            // before the trailers). Continuing would send it upstream undecided.
            State::AwaitingBody { head, .. } => {
                let reply = LocalReply::new(
                    Reason::MissingBody,
                    "the request ended with trailers and no body: send a JSON body",
                );
                let tier = head.identity.tier;
                Ok(TrailersDecision::Refuse(self.refuse(
                    reply,
                    Some(tier),
                    now,
                )))
            }
            // Trailers carry nothing tollgate decides on; let them through wherever they come.
            state => {
                self.state = state;
                Ok(TrailersDecision::Continue)
            }
        }
    }

    /// The response's headers: returns the headers to add for the client (the budgets' state).
    /// `status` is the HTTP status (0 if unknown).
    pub fn response_headers(
        &mut self,
        status: u16,
        content_type: Option<&[u8]>,
        end_of_stream: bool,
    ) -> Result<&[(&'static str, String)], OutOfOrder> {
        if matches!(
            self.state,
            State::AwaitingBody { .. } | State::PassedThrough
        ) {
            self.answered_by_envoy();
            return Ok(&[]);
        }
        let wrong = self.out_of_order();
        let State::Admitted(watched) = &mut self.state else {
            return Err(wrong);
        };
        let mut observer = ResponseObserver::new(
            status,
            content_type,
            self.rules.policy.max_buffered_json_bytes,
        )
        .counting_output(watched.admission.encoding);
        if end_of_stream {
            observer.on_end_of_stream();
            watched.permit = None;
            // A response without a body has no first token to wait for.
            watched.awaiting_first_token = None;
        }
        watched.response = Some(observer);
        Ok(&watched.budget_headers)
    }

    /// A piece of the response body, as it goes by to the client.
    pub fn response_body(
        &mut self,
        chunk: &[u8],
        end_of_stream: bool,
        now: Instant,
    ) -> Result<(), OutOfOrder> {
        match &mut self.state {
            State::Admitted(watched) => {
                watched.on_response_body(self.pipeline, &self.rules, chunk, end_of_stream, now);
                Ok(())
            }
            State::AwaitingBody { .. } | State::PassedThrough => {
                self.answered_by_envoy();
                Ok(())
            }
            _ => Err(self.out_of_order()),
        }
    }

    /// Trailers on the response.
    pub fn response_trailers(&self) -> Result<(), OutOfOrder> {
        match self.state {
            State::Admitted(_) | State::PassedThrough => Ok(()),
            _ => Err(self.out_of_order()),
        }
    }

    /// A response phase arrived before the request's body: Envoy answered the request itself
    /// (e.g. its own 413 for a body over the buffer limit; since 1.40 that local reply goes
    /// through the response phases). Nothing was decided or taken: let it through. Envoy also
    /// ignores `mode_override` unless the filter allows it; then the later phases of a
    /// passed-through request still arrive and are let through unchanged.
    fn answered_by_envoy(&mut self) {
        if matches!(self.state, State::AwaitingBody { .. }) {
            self.rules.metrics.request(RequestOutcome::AnsweredByEnvoy);
            self.state = State::PassedThrough;
        }
    }

    /// Lets an admitted request through, holding `permit` until its response ends and its
    /// budgets until the request ends.
    fn admit(
        &mut self,
        mut admission: Admission,
        grant: Grant,
        arrived: Instant,
        permit: Option<Permit>,
    ) -> Forward<'_> {
        let pipeline = self.pipeline;
        let rules = &self.rules;
        let budget_headers = grant
            .budgets
            .as_ref()
            .map(reply::rate_limit::granted_headers)
            .unwrap_or_default();
        // The rewritten body and the upstream headers go into the answer; nothing needs them
        // after that, and an admitted request lives as long as its response.
        let headers = std::mem::take(&mut admission.upstream_headers);
        let body = admission.new_body.take();
        let tier = admission.identity.tier;
        let metrics = &rules.metrics;
        metrics.request(RequestOutcome::Admitted);
        metrics.estimated_input_tokens(tier, admission.input_tokens);
        if admission.chat_template_refused {
            metrics.chat_template_fallback();
        }
        let (input, output) = admission.reserved_tokens();
        metrics.budget_tokens(tier, TokenKind::Input, TokenStage::Reserved, input);
        metrics.budget_tokens(tier, TokenKind::Output, TokenStage::Reserved, output);
        let dispatched = Instant::now();
        // A request let through without a slot (shadow mode) is load the budget does not
        // count: its latency must not steer the controller that sizes the budget.
        let feeds_controller = permit.is_some();
        // Only when a first token will be seen, on this stream or in a report: otherwise there
        // may be none to wait for, and the request's age would read as a latency.
        let first_token_expected = self.reports_expected || self.response_body_shown == Some(true);
        let awaiting_first_token = (feeds_controller && first_token_expected).then(|| {
            Pending::start(
                &pipeline.ttft_window,
                control_started(rules, arrived, dispatched),
            )
        });
        let (awaiting_first_token, reports) = if self.reports_expected {
            let registration = pipeline.reports.register(FirstToken {
                rules: rules.clone(),
                tier,
                arrived,
                dispatched,
                pending: awaiting_first_token,
                feeds_controller,
            });
            (None, Some(registration))
        } else {
            (awaiting_first_token, None)
        };
        self.state = State::Admitted(Box::new(Watched {
            admission,
            arrived,
            dispatched,
            awaiting_first_token,
            response: None,
            feeds_controller,
            permit,
            hold: grant.hold,
            reports,
            budget_headers,
        }));
        let State::Admitted(watched) = &self.state else {
            unreachable!("admitted just above");
        };
        Forward {
            headers,
            budget_headers: &watched.budget_headers,
            body,
            report_tag: watched.reports.as_ref().map(Registration::tag),
        }
    }

    /// Shadow mode's answer to a refusal that enforcement makes before reserving (a budget
    /// denied, a large body's count that could not start in time): refused as enforcement
    /// would, so nothing reserved (enforcement would have charged nothing either) and no place
    /// taken in the queue (nor a slot) that enforcement would have given to others: upstream
    /// now. (A large body's count did take a thread, which enforcement would have left to the
    /// bodies behind it.)
    fn let_through_unreserved(
        &mut self,
        mut admission: Admission,
        reply: &LocalReply,
        tier: TierId,
        arrived: Instant,
    ) -> BodyDecision<'_> {
        shadow_refusal(&self.rules, &mut admission, reply, tier);
        let grant = Grant {
            hold: Hold::none(),
            budgets: None,
        };
        BodyDecision::Admit(self.admit(admission, grant, arrived, None))
    }

    fn refuse(&mut self, reply: LocalReply, tier: Option<TierId>, started: Instant) -> LocalReply {
        let metrics = &self.rules.metrics;
        metrics.request(if reply.status() == 503 {
            RequestOutcome::Shed
        } else {
            RequestOutcome::Rejected
        });
        metrics.rejection(reply.reason, tier);
        metrics.decision_duration(Instant::now().duration_since(started).as_secs_f64());
        self.state = State::Refused;
        reply
    }

    /// Ends the request's life: records how it ended and settles its budgets with what it
    /// really cost, freeing its slot. Runs exactly once per request (it takes `self`), whatever
    /// way the request ended: success, client gone, upstream error, shutdown.
    pub async fn finish(self) {
        // A reported-on response's output is known from its summary's usage or not at all.
        let output_observed = self.response_body_shown != Some(false) && !self.reports_expected;
        let pipeline = self.pipeline;
        let rules = &self.rules;
        match self.state {
            State::AwaitingBody { .. } => rules.metrics.request(RequestOutcome::Abandoned),
            // Only if `wait` was never called: the request leaves the queue now, unanswered.
            State::Queued(queued) => {
                let Queued {
                    ticket,
                    admission,
                    grant,
                    ..
                } = *queued;
                drop(ticket);
                let tier = admission.identity.tier;
                rules
                    .metrics
                    .scheduler_outcome(tier, SchedulerOutcome::Cancelled);
                rules.metrics.request(RequestOutcome::Abandoned);
                pipeline.ledger.settle(grant.hold, 0, true).await;
            }
            State::Admitted(watched) => watched.finish(pipeline, rules, output_observed).await,
            State::Start | State::PassedThrough | State::Refused => {}
        }
    }
}

impl Watched {
    fn on_response_body(
        &mut self,
        pipeline: &Pipeline,
        rules: &Arc<Rules>,
        chunk: &[u8],
        end: bool,
        now: Instant,
    ) {
        // Without response headers (header mode SKIP) the status is unknown: assume success and
        // sniff nothing but usage from a JSON body.
        let encoding = self.admission.encoding;
        let observer = self.response.get_or_insert_with(|| {
            ResponseObserver::new(200, None, rules.policy.max_buffered_json_bytes)
                .counting_output(encoding)
        });
        if observer.on_chunk(chunk, end) {
            let first_token = FirstToken {
                rules: rules.clone(),
                tier: self.admission.identity.tier,
                arrived: self.arrived,
                dispatched: self.dispatched,
                pending: self.awaiting_first_token.take(),
                feeds_controller: self.feeds_controller,
            };
            record_first_token(&pipeline.ttft_window, first_token, now);
        }
        if end {
            // The upstream is done with this request: its slot is free for the next one.
            self.permit = None;
        }
    }

    async fn finish(self, pipeline: &Pipeline, rules: &Rules, output_observed: bool) {
        let Watched {
            admission,
            arrived,
            awaiting_first_token,
            response,
            permit,
            hold,
            reports,
            ..
        } = self;
        drop(permit);
        // Over without a first token (an error, a reset): no longer pending.
        drop(awaiting_first_token);
        let tier = admission.identity.tier;
        let metrics = &rules.metrics;
        let (end, usage, reported) = match reports {
            // The slot is free already; only the settlement waits for Envoy's summary.
            Some(mut registration) => {
                let deadline = Instant::now() + rules.policy.summary_wait;
                let summary = registration.wait_for_summary(metrics, deadline).await;
                let (end, usage) = reported_end(response.as_ref(), summary);
                (end, usage, Some((registration, summary, deadline)))
            }
            None => (
                response
                    .as_ref()
                    .map_or(ResponseEnd::NoResponse, ResponseObserver::end),
                response.as_ref().and_then(ResponseObserver::usage),
                None,
            ),
        };
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
        // Counted after the usage and the budget's figures: whoever sees the ending counted
        // (a scrape is not atomic across series) sees what it cost too, sooner or later.
        metrics.stream_completion(end);
        if end == ResponseEnd::Complete {
            metrics.request_duration(tier, arrived.elapsed().as_secs_f64());
        }
        pipeline
            .ledger
            .settle(hold, spent.input + spent.output, spent.refund_request)
            .await;
        // After the settlement, which a late first token must not hold up; detached, so that
        // nothing of the request (its stream, its body) waits with it.
        if let Some((mut registration, summary, deadline)) = reported
            && registration.first_token_overdue(summary.as_ref())
        {
            tokio::spawn(registration.await_late_first_token(deadline));
        }
    }
}

/// A refusal shadow mode (`enforce: false`) lets through: counted, logged with its reason, and
/// named to the upstream in `x-tollgate-shadow-refusal`. Scheduling still applies in shadow
/// mode (the request waits for a slot like any other); a request the queue would have refused
/// (full, or its deadline passed) goes upstream without a slot, so the in-flight budget does
/// not count it.
fn shadow_refusal(rules: &Rules, admission: &mut Admission, reply: &LocalReply, tier: TierId) {
    rules.metrics.shadow_refusal(reply.reason, tier);
    tracing::info!(
        tenant = %admission.identity.tenant,
        tier = %rules.policy.tiers[tier].name,
        reason = reply.reason.as_str(),
        status = reply.status(),
        "shadow mode: would refuse; let through"
    );
    admission.upstream_headers.push((
        "x-tollgate-shadow-refusal",
        reply.reason.as_str().to_owned(),
    ));
}

/// Records a request's first token at `now`: its time to first token, and the controller's
/// window (ending its pending entry, if it had one).
fn record_first_token(window: &Arc<Mutex<LatencyWindow>>, first_token: FirstToken, now: Instant) {
    let FirstToken {
        rules,
        tier,
        arrived,
        dispatched,
        pending,
        feeds_controller,
    } = first_token;
    let metrics = &rules.metrics;
    metrics.time_to_first_token(tier, now.duration_since(arrived).as_secs_f64());
    metrics.upstream_time_to_first_token(tier, now.duration_since(dispatched).as_secs_f64());
    let started = control_started(&rules, arrived, dispatched);
    let seconds = now.duration_since(started).as_secs_f64();
    match pending {
        Some(pending) => pending.answered(now, seconds),
        None if feeds_controller => window::lock(window).record_started(now, started, seconds),
        None => {}
    }
}

/// How a reported-on response ended, and the usage to charge. The upstream's own status, when
/// its response headers came on the request's stream, decides an upstream error; otherwise the
/// summary says whether the body ended properly (complete) or not (truncated), and its usage is
/// charged either way when there is one. With no summary the end cannot be known: truncated,
/// charged as reserved (`spent_tokens`). Without response headers the summary's status stands
/// in for them.
fn reported_end(
    response: Option<&ResponseObserver>,
    summary: Option<Summary>,
) -> (ResponseEnd, Option<Usage>) {
    let ok = |status: u16| (200..300).contains(&status);
    match (response.map(ResponseObserver::end), summary) {
        (Some(ResponseEnd::UpstreamError), _) => (ResponseEnd::UpstreamError, None),
        (None, None | Some(Summary { status: 0, .. })) => (ResponseEnd::NoResponse, None),
        (None, Some(Summary { status, .. })) if !ok(status) => (ResponseEnd::UpstreamError, None),
        (_, None) => (ResponseEnd::Truncated, None),
        (
            _,
            Some(Summary {
                usage, finished, ..
            }),
        ) => {
            let end = if finished {
                ResponseEnd::Complete
            } else {
                ResponseEnd::Truncated
            };
            (end, usage)
        }
    }
}

/// Where the controller's time to first token starts for a request (`control.signal`).
fn control_started(rules: &Rules, arrived: Instant, dispatched: Instant) -> Instant {
    match rules.policy.control.signal {
        ControlSignal::Upstream => dispatched,
        ControlSignal::Gateway => arrived,
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
/// the response body is not shown (`output_observed` false), the output cannot be counted, so
/// what the request asked for is charged: its reserved output (its max tokens, after defaulting
/// or clamping), the most it may have generated.
fn spent_tokens(
    admission: &Admission,
    end: ResponseEnd,
    usage: Option<Usage>,
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

/// A body's decision, and in shadow mode the refusal enforcement would have made instead.
struct Decided {
    verdict: BodyVerdict,
    /// The body waited longer than `tokens.large_body_max_wait_ms` for its count: its tier is
    /// in shadow mode, which counts it anyway (enforcement answers 503 `counting_backlog`).
    backlog: Option<LocalReply>,
}

/// The admission decision on a body: on the async worker if the body is small and its text
/// cheap to count, else on the counting threads of the blocking pool. Takes the body, so its
/// bytes are freed as soon as the decision is made.
///
/// Bodies counted off the workers ("large bodies" below, whatever made them so) are decided a
/// few at a time (`Pipeline::large_body_threads`), in the order they arrived: a burst of them
/// all counted at once would share the cores among all of them, and under Envoy's
/// `message_timeout` could all be answered too late together. One that cannot start within
/// `tokens.large_body_max_wait_ms` of `body_arrived` is refused, as overload, before anything
/// is counted or reserved; in shadow mode (`enforce` false) it waits its turn and is counted.
async fn decide_body(
    pipeline: &Pipeline,
    rules: &Rules,
    head: &InferenceHead,
    body: Vec<u8>,
    body_arrived: Instant,
    enforce: bool,
) -> Decided {
    if body.len() <= INLINE_BODY_BYTES {
        let decided = tokens::within_inline_budget(INLINE_COUNT_BUDGET, || {
            admission::decide_body(&rules.policy, head, &body)
        });
        if let Some(verdict) = decided {
            return Decided {
                verdict,
                backlog: None,
            };
        }
        // Counted again from the start on a counting thread: the work done here was at most
        // the budget.
        pipeline
            .metrics
            .counted_off_workers(CountedOffWorkers::CostlyText);
    } else {
        pipeline
            .metrics
            .counted_off_workers(CountedOffWorkers::Size);
    }
    let max_wait = rules.policy.counting.large_body_max_wait;
    let backlog = || {
        LocalReply::new(
            Reason::CountingBacklog,
            format!(
                "tollgate is behind on counting request bodies off its async workers: this one \
                 ({} bytes) could not start within tokens.large_body_max_wait_ms ({} ms)",
                body.len(),
                max_wait.as_millis()
            ),
        )
    };
    let threads = Arc::clone(&pipeline.large_body_threads);
    let waited = {
        let _waiting = pipeline.metrics.hold_large_body_waiting();
        if enforce {
            tokio::time::timeout_at(body_arrived + max_wait, threads.acquire_owned()).await
        } else {
            Ok(threads.acquire_owned().await)
        }
    };
    // Late also when the thread came just before the deadline and this task ran just after it
    // (a timeout looks at what it waits for first): enforcement refuses that one too.
    let late = Instant::now().duration_since(body_arrived) > max_wait;
    // The semaphore is never closed.
    let thread = match waited {
        Ok(Ok(thread)) if !(late && enforce) => thread,
        _ => {
            return Decided {
                verdict: BodyVerdict::Reject(backlog()),
                backlog: None,
            };
        }
    };
    // Only in shadow mode: counted anyway.
    let backlog = late.then(backlog);
    let policy = rules.policy.clone();
    let head = head.clone();
    // The permit goes with the work: if the stream ends meanwhile, the thread is still busy
    // until the count is done.
    let counted = tokio::task::spawn_blocking(move || {
        let _thread = thread;
        admission::decide_body(&policy, &head, &body)
    });
    let verdict = match counted.await {
        Ok(verdict) => verdict,
        // Only a panic in counting gets here; refuse rather than pass unchecked.
        Err(join_error) => BodyVerdict::Reject(LocalReply::new(
            Reason::InvalidRequest,
            format!("the request body could not be processed: {join_error}"),
        )),
    };
    Decided { verdict, backlog }
}

/// How many large bodies may be counted at once: `tokens.large_body_threads`, or where that is
/// 0, one per runtime worker thread (at least two, at most the runtime's 512). The counting
/// threads share the cores with the async workers, which decide every small request: with no
/// more of them than workers, small requests beside a burst were answered in about a
/// millisecond at the median, and two per worker counted about as many bodies in time for more
/// CPU (docs/benchmarks.md, "A burst of large bodies"). At least two, so that on a one-worker
/// replica one long count (about 2 s for 8 MiB on a model's own tokenizer's slow path) does not
/// hold every other large body behind it.
pub fn large_body_permits(setting: u32, worker_threads: usize) -> usize {
    match setting {
        0 => worker_threads.clamp(
            MIN_DEFAULT_LARGE_BODY_THREADS,
            MAX_LARGE_BODY_THREADS as usize,
        ),
        threads => threads as usize,
    }
}

/// The fewest large bodies counted at once when `tokens.large_body_threads` is left at 0.
const MIN_DEFAULT_LARGE_BODY_THREADS: usize = 2;

/// The body bytes a request keeps in memory while it waits for a slot, as counted against
/// `scheduler.max_queued_body_bytes`: the body as received, which stays in the protocol's
/// decode buffer for the life of the stream (tonic's `BytesMut` never shrinks), plus the
/// rewritten body that will go upstream, if there is one.
fn queued_body_bytes(received: usize, admission: &Admission) -> usize {
    received + admission.new_body.as_ref().map_or(0, Vec::len)
}

/// Slots a tenant's reserved percentage is worth at `limit`, rounded up so a small reservation
/// still guarantees one slot.
fn reserved_slots(limit: u32, percent: u32) -> u32 {
    (u64::from(limit) * u64::from(percent)).div_ceil(100) as u32
}
