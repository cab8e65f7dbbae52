//! Metrics: every name, unit, bucket set and label in one place, and every series created at
//! start-up.
//!
//! Series that only appear on their first event break `rate()` over short windows (seed 000:
//! the sparse 504 series rendered as flat zero), so `Metrics::new` registers every label
//! combination up front and keeps the handles; the request path increments a handle and never
//! formats a key. Labels are bounded sets (tier names from the config, rule names, outcomes),
//! never a user. Each `run` owns its recorder, so servers in one test process do not share
//! counts.
//!
//! The registry sits below the domain: it names no domain module. A domain enum that labels a
//! series gives its own values (`LabelValue`, implemented next to the enum), `Metrics::new`
//! learns which enum labels which metric and the tier names from `MetricLabels` (implemented by
//! `Policy`), and figures it publishes arrive as its own types (`SchedulerGauges`,
//! `EngineScrape`) or plain numbers. Enums that exist only as labels (`RequestOutcome`,
//! `StoreOp`, ...) live here.

pub mod response;

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::tokens::CountCacheStats;
use response::ResponseEnd;

pub const REQUESTS: &str = "tollgate_requests_total";
pub const REJECTIONS: &str = "tollgate_rejections_total";
pub const ESTIMATED_INPUT_TOKENS: &str = "tollgate_estimated_input_tokens";
pub const USAGE_TOKENS: &str = "tollgate_usage_tokens_total";
pub const TTFT: &str = "tollgate_time_to_first_token_seconds";
pub const UPSTREAM_TTFT: &str = "tollgate_upstream_time_to_first_token_seconds";
pub const REQUEST_DURATION: &str = "tollgate_request_duration_seconds";
pub const STREAM_COMPLETIONS: &str = "tollgate_stream_completions_total";
pub const HELD_STREAMS: &str = "tollgate_held_streams";
pub const LARGE_BODIES_WAITING: &str = "tollgate_large_bodies_waiting";
pub const BODIES_COUNTED_OFF_WORKERS: &str = "tollgate_bodies_counted_off_workers_total";
pub const DECISION_DURATION: &str = "tollgate_decision_duration_seconds";
pub const PROTOCOL_ERRORS: &str = "tollgate_protocol_errors_total";
pub const RESPONSE_REPORTS: &str = "tollgate_response_reports_total";
pub const CHAT_TEMPLATE_FALLBACKS: &str = "tollgate_chat_template_fallbacks_total";
pub const COUNT_CACHE_LOOKUPS: &str = "tollgate_token_count_cache_lookups_total";
pub const COUNT_CACHE_BYTES: &str = "tollgate_token_count_cache_bytes";
pub const INFLIGHT_LIMIT: &str = "tollgate_inflight_limit";
pub const INFLIGHT: &str = "tollgate_inflight_requests";
pub const QUEUED: &str = "tollgate_queued_requests";
pub const QUEUED_BODY_BYTES: &str = "tollgate_queued_body_bytes";
pub const HEADROOM_HELD: &str = "tollgate_scheduler_headroom_held_slots";
pub const LENT: &str = "tollgate_scheduler_lent_slots";
pub const PACED: &str = "tollgate_scheduler_paced_requests_total";
pub const STANDBY: &str = "tollgate_scheduler_standby_slots";
pub const QUEUE_WAIT: &str = "tollgate_queue_wait_seconds";
pub const SCHEDULER_SUBMITTED: &str = "tollgate_scheduler_submitted_total";
pub const SCHEDULER_OUTCOMES: &str = "tollgate_scheduler_outcomes_total";
pub const CONTROLLER_ACTIONS: &str = "tollgate_controller_actions_total";
pub const CONTROLLER_P99: &str = "tollgate_controller_observed_p99_ttft_seconds";
pub const ENGINE_SCRAPES: &str = "tollgate_engine_scrapes_total";
pub const ENGINE_SATURATION: &str = "tollgate_engine_saturation_ratio";
pub const ENGINE_KV_CACHE_USAGE: &str = "tollgate_engine_kv_cache_usage_ratio";
pub const ENGINE_WAITING: &str = "tollgate_engine_requests_waiting";
pub const BUDGET_TOKENS: &str = "tollgate_budget_tokens_total";
pub const STORE_DURATION: &str = "tollgate_store_request_duration_seconds";
pub const STORE_ERRORS: &str = "tollgate_store_errors_total";
pub const STORE_BREAKER: &str = "tollgate_store_breaker_state";
pub const STORE_BATCH_CALLS: &str = "tollgate_store_batch_calls";
pub const DEGRADED_DECISIONS: &str = "tollgate_degraded_decisions_total";
pub const ACTIVE_LEASES: &str = "tollgate_active_leases";
pub const FLEET_MEMBERS: &str = "tollgate_fleet_members";
pub const FLEET_LIMIT: &str = "tollgate_fleet_inflight_limit";
pub const FLEET_LEADER: &str = "tollgate_fleet_leader";
pub const FLEET_STANDING: &str = "tollgate_fleet_standing";
pub const FLEET_FALLBACKS: &str = "tollgate_fleet_fallbacks_total";
pub const FLEET_LEADERSHIPS: &str = "tollgate_fleet_leaderships_total";
pub const FLEET_STORE_CALLS: &str = "tollgate_fleet_store_calls_total";
pub const SHADOW_REFUSALS: &str = "tollgate_shadow_refusals_total";
pub const CONFIG_RELOADS: &str = "tollgate_config_reloads_total";
pub const CONFIG_LAST_RELOAD_SUCCESSFUL: &str = "tollgate_config_last_reload_successful";
pub const RUNTIME_WORKER_THREADS: &str = "tollgate_runtime_worker_threads";

/// Seconds from first token targets of tens of ms up to the 30 s+ of an overloaded vLLM.
const LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0,
];
/// A decision is tens of microseconds; a multi-MB prompt's count is tens of milliseconds.
const DECISION_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];
/// Queue waits: deadlines are around 1-2 s, and never beyond Envoy's max_message_timeout.
const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0,
];
/// A store round trip: tens of microseconds on loopback, the configured timeout (~50 ms) at worst.
const STORE_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];
/// Calls per batch the Redis store sends: powers of two, then 48, and one below its cap
/// (`budget::redis::MAX_BATCH`, 64, which its tests hold these to), so that batches at the cap
/// stand apart.
pub(crate) const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 63.0, 64.0];
/// Powers of four from a one-line prompt to a long-context one.
const TOKEN_BUCKETS: &[f64] = &[
    16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
];

/// A bounded set of label values, every one of which gets its series at start-up. Implemented
/// next to each enum that labels a metric, so the enum, not this registry, owns its values.
pub trait LabelValue: Copy + PartialEq + 'static {
    /// Every value, in the order their series are created.
    const ALL: &'static [Self];

    /// The label value; stable (dashboards and alerts select on it).
    fn label(self) -> &'static str;

    /// Where `self` is in `ALL`.
    fn index(self) -> usize {
        Self::ALL
            .iter()
            .position(|&v| v == self)
            .expect("ALL lists every value")
    }
}

/// An error counted by its kind, one of a bounded set.
pub trait ErrorKind {
    type Kind: LabelValue;

    fn kind(&self) -> Self::Kind;
}

/// What `Metrics::new` creates series for beyond this module's own enums: the tiers, and which
/// domain enum labels which metric. `Policy` implements it.
pub trait MetricLabels {
    /// `reason` of `tollgate_rejections_total` (the `x-tollgate-reason` rules).
    type Reason: LabelValue;
    /// `action` of `tollgate_controller_actions_total`.
    type Action: LabelValue;
    /// `mode` of `tollgate_degraded_decisions_total`.
    type FailMode: LabelValue;
    /// `kind` of `tollgate_store_errors_total`, by the store error's kind.
    type StoreError: ErrorKind;

    /// The tier names. A tier argument of `Metrics` is an index into them (`policy::TierId`).
    fn tier_names(&self) -> Vec<&str>;
}

impl<T: MetricLabels + ?Sized> MetricLabels for Arc<T> {
    type Reason = T::Reason;
    type Action = T::Action;
    type FailMode = T::FailMode;
    type StoreError = T::StoreError;

    fn tier_names(&self) -> Vec<&str> {
        T::tier_names(self)
    }
}

/// The scheduler's budget at one instant, as its gauges show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerGauges {
    pub limit: u32,
    pub in_flight: u32,
    pub queued_body_bytes: usize,
    /// Slots kept free for the steady tenants (scheduler headroom).
    pub held: u32,
    /// Slots in flight lent: granted beyond their tenant's fair share while it was not steady.
    pub lent: u32,
    /// Slots kept free for tenants the fleet gives all they ask.
    pub standby: u32,
    /// Requests that arrived while their tenant's starts were paced, since start-up.
    pub paced: u64,
}

/// Where a replica stands with the fleet that shares its store's budget: the `standing` label
/// of `tollgate_fleet_standing` (one series per value, the current one 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetStanding {
    /// No shared store: this replica owns its whole budget.
    Alone,
    /// Holds a share of the fleet's budget.
    Member,
    /// The store cannot be reached: runs a local budget meanwhile.
    Fallback,
    /// The fleet runs another policy: kept out, runs a local budget.
    Refused,
}

impl FleetStanding {
    const ALL: [FleetStanding; 4] = [
        FleetStanding::Alone,
        FleetStanding::Member,
        FleetStanding::Fallback,
        FleetStanding::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FleetStanding::Alone => "alone",
            FleetStanding::Member => "member",
            FleetStanding::Fallback => "fallback",
            FleetStanding::Refused => "refused",
        }
    }
}

/// What a configuration reload did: the `result` label of `tollgate_config_reloads_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReloadResult {
    Applied,
    /// The configuration was the one in force.
    Unchanged,
    /// Invalid, or changing what only a restart can: the policy in force kept running.
    Refused,
}

impl ReloadResult {
    const ALL: [ReloadResult; 3] = [
        ReloadResult::Applied,
        ReloadResult::Unchanged,
        ReloadResult::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Applied => "applied",
            ReloadResult::Unchanged => "unchanged",
            ReloadResult::Refused => "refused",
        }
    }
}

/// One of the fleet's Redis calls: the `op` label of `tollgate_fleet_store_calls_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetCall {
    Join,
    Publish,
    Leave,
}

impl FleetCall {
    const ALL: [FleetCall; 3] = [FleetCall::Join, FleetCall::Publish, FleetCall::Leave];

    pub fn as_str(self) -> &'static str {
        match self {
            FleetCall::Join => "join",
            FleetCall::Publish => "publish",
            FleetCall::Leave => "leave",
        }
    }
}

/// One controller tick's scrape of the engines, as the engine metrics read it.
pub trait EngineScrape {
    /// Engines that did not answer.
    fn failures(&self) -> usize;

    /// One reading per engine that answered.
    fn loads(&self) -> impl Iterator<Item = EngineReading>;
}

/// One engine's load at a scrape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineReading {
    /// 0 to 1; None if the engine reported none.
    pub kv_cache_usage: Option<f64>,
    /// Requests waiting inside the engine; None if it reported none.
    pub waiting: Option<f64>,
}

/// The route class and outcome of a request, as counted in `tollgate_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// An inference request let through to the upstream.
    Admitted,
    /// An inference request answered locally with an error (4xx).
    Rejected,
    /// An inference request shed with a 503 (queue full or timed out, shutting down).
    Shed,
    /// An inference request whose stream ended before a decision (client gone).
    Abandoned,
    /// A non-inference request passed through untouched.
    PassedThrough,
    /// An inference request Envoy answered itself before tollgate decided (e.g. its 413).
    AnsweredByEnvoy,
}

impl RequestOutcome {
    const ALL: [RequestOutcome; 6] = [
        RequestOutcome::Admitted,
        RequestOutcome::Rejected,
        RequestOutcome::Shed,
        RequestOutcome::Abandoned,
        RequestOutcome::PassedThrough,
        RequestOutcome::AnsweredByEnvoy,
    ];

    fn labels(self) -> [(&'static str, &'static str); 2] {
        let (class, outcome) = match self {
            RequestOutcome::Admitted => ("inference", "admitted"),
            RequestOutcome::Rejected => ("inference", "rejected"),
            RequestOutcome::Shed => ("inference", "shed"),
            RequestOutcome::Abandoned => ("inference", "abandoned"),
            RequestOutcome::PassedThrough => ("passthrough", "passed_through"),
            RequestOutcome::AnsweredByEnvoy => ("inference", "answered_by_envoy"),
        };
        [("route_class", class), ("outcome", outcome)]
    }
}

/// What became of a request that asked the scheduler for a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerOutcome {
    /// A slot was free.
    AdmittedNow,
    /// Admitted after waiting in its tenant's queue.
    AdmittedAfterWait,
    QueueFull,
    /// Refused because queued requests already held as many body bytes as they may.
    QueueBytesFull,
    QueueTimeout,
    /// Answered 503 because tollgate began shutting down while it waited.
    ShuttingDown,
    /// The client went away while it waited.
    Cancelled,
}

impl LabelValue for SchedulerOutcome {
    const ALL: &'static [SchedulerOutcome] = &[
        SchedulerOutcome::AdmittedNow,
        SchedulerOutcome::AdmittedAfterWait,
        SchedulerOutcome::QueueFull,
        SchedulerOutcome::QueueBytesFull,
        SchedulerOutcome::QueueTimeout,
        SchedulerOutcome::ShuttingDown,
        SchedulerOutcome::Cancelled,
    ];

    fn label(self) -> &'static str {
        match self {
            SchedulerOutcome::AdmittedNow => "admitted_now",
            SchedulerOutcome::AdmittedAfterWait => "admitted_after_wait",
            SchedulerOutcome::QueueFull => "queue_full",
            SchedulerOutcome::QueueBytesFull => "queue_bytes_full",
            SchedulerOutcome::QueueTimeout => "queue_timeout",
            SchedulerOutcome::ShuttingDown => "shutting_down",
            SchedulerOutcome::Cancelled => "cancelled",
        }
    }
}

/// Budget-store operations, as metric labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOp {
    Reserve,
    Settle,
    Renew,
}

impl LabelValue for StoreOp {
    const ALL: &'static [StoreOp] = &[StoreOp::Reserve, StoreOp::Settle, StoreOp::Renew];

    fn label(self) -> &'static str {
        match self {
            StoreOp::Reserve => "reserve",
            StoreOp::Settle => "settle",
            StoreOp::Renew => "renew",
        }
    }
}

/// Which control took a fail mode while the store failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DegradedControl {
    Budgets,
    Concurrency,
}

/// The kinds of token amounts a budget sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenStage {
    /// Taken up front: input counted, output at its maximum.
    Reserved,
    /// What the request really cost.
    Settled,
    /// Reserved but not used, given back.
    Refunded,
}

/// Input or output tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    Input,
    Output,
}

/// Why a request body was sent to the counting threads rather than counted on the async workers
/// (`pipeline::decide_body`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountedOffWorkers {
    /// Over the bytes counted inline.
    Size,
    /// Within them, but its text ran out of the inline counting budget.
    CostlyText,
}

impl LabelValue for CountedOffWorkers {
    const ALL: &'static [CountedOffWorkers] =
        &[CountedOffWorkers::Size, CountedOffWorkers::CostlyText];

    fn label(self) -> &'static str {
        match self {
            CountedOffWorkers::Size => "size",
            CountedOffWorkers::CostlyText => "costly_text",
        }
    }
}

/// Ways Envoy's message sequence broke the ext_proc protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    OutOfOrder,
    EmptyMessage,
}

impl LabelValue for ProtocolError {
    const ALL: &'static [ProtocolError] = &[ProtocolError::OutOfOrder, ProtocolError::EmptyMessage];

    fn label(self) -> &'static str {
        match self {
            ProtocolError::OutOfOrder => "out_of_order",
            ProtocolError::EmptyMessage => "empty_message",
        }
    }
}

/// A report Envoy sends about a response outside the request's own stream, when the response
/// body is not streamed to tollgate (`pipeline::reports`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseReport {
    /// The first body chunk, on a stream of its own.
    FirstToken,
    /// Usage and status once the response is over (Envoy's access log).
    Summary,
}

impl LabelValue for ResponseReport {
    const ALL: &'static [ResponseReport] = &[ResponseReport::FirstToken, ResponseReport::Summary];

    fn label(self) -> &'static str {
        match self {
            ResponseReport::FirstToken => "first_token",
            ResponseReport::Summary => "summary",
        }
    }
}

/// What became of a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportOutcome {
    /// It reached the request it was about.
    Matched,
    /// Its request was admitted by another replica (or an earlier run of this one).
    OtherReplica,
    /// No such request is open here: it ended before the report came, or the report repeats.
    Unknown,
    /// The request closed to reports without this one: no summary within
    /// `response.summary_wait`, or no first token (a response without a body, a client gone).
    Missing,
    /// The report named no request: not one tollgate admitted.
    Untagged,
}

impl LabelValue for ReportOutcome {
    const ALL: &'static [ReportOutcome] = &[
        ReportOutcome::Matched,
        ReportOutcome::OtherReplica,
        ReportOutcome::Unknown,
        ReportOutcome::Missing,
        ReportOutcome::Untagged,
    ];

    fn label(self) -> &'static str {
        match self {
            ReportOutcome::Matched => "matched",
            ReportOutcome::OtherReplica => "other_replica",
            ReportOutcome::Unknown => "unknown",
            ReportOutcome::Missing => "missing",
            ReportOutcome::Untagged => "untagged",
        }
    }
}

/// Label value for rejections that happen before a tier is known (e.g. no identity).
const NO_TIER: &str = "none";

/// Pre-registered handles for every series. A `tier` argument is an index into
/// `MetricLabels::tier_names` (a `policy::TierId`).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
    tiers: Arc<TierSeries>,
}

struct Inner {
    /// Kept to register the series of a reloaded policy's tiers.
    recorder: metrics_exporter_prometheus::PrometheusRecorder,
    handle: PrometheusHandle,
    requests: Vec<Counter>,
    stream_completions: Vec<Counter>,
    held_streams: Gauge,
    large_bodies_waiting: Gauge,
    bodies_counted_off_workers: Vec<Counter>,
    decision_duration: Histogram,
    protocol_errors: Vec<Counter>,
    /// By `ResponseReport`, then `ReportOutcome`.
    response_reports: Vec<Vec<Counter>>,
    chat_template_fallbacks: Counter,
    /// `[found, counted]`.
    count_cache_lookups: [Counter; 2],
    count_cache_bytes: Gauge,
    inflight_limit: Gauge,
    inflight: Gauge,
    queued_body_bytes: Gauge,
    headroom_held: Gauge,
    lent: Gauge,
    standby: Gauge,
    paced: Counter,
    controller_actions: Vec<Counter>,
    /// The `action` of each of `controller_actions`.
    actions: Vec<&'static str>,
    controller_p99: Gauge,
    /// `[ok, error]`.
    engine_scrapes: [Counter; 2],
    engine_saturation: Gauge,
    engine_kv_cache_usage: Gauge,
    engine_waiting: Gauge,
    store_duration: Vec<Histogram>,
    /// `[op][kind]`.
    store_errors: Vec<Vec<Counter>>,
    /// The `kind` of each column of `store_errors`.
    store_error_kinds: Vec<&'static str>,
    store_breaker: Gauge,
    store_batch_calls: Histogram,
    /// `[control][mode]`.
    degraded: Vec<Vec<Counter>>,
    /// The `mode` of each column of `degraded`.
    fail_modes: Vec<&'static str>,
    active_leases: Gauge,
    fleet_members: Gauge,
    fleet_limit: Gauge,
    fleet_leader: Gauge,
    /// One per `FleetStanding::ALL`.
    fleet_standing: Vec<Gauge>,
    /// `[store_unreachable, policy_mismatch]`.
    fleet_fallbacks: [Counter; 2],
    fleet_leaderships: Counter,
    /// `[join, publish, leave]` × `[ok, error]`.
    fleet_store_calls: [[Counter; 2]; 3],
    /// One per `ReloadResult::ALL`.
    config_reloads: Vec<Counter>,
    config_last_reload_successful: Gauge,
    runtime_worker_threads: Gauge,
}

/// The series labelled by tier, registered again (the same series, and new ones for new
/// tiers) when a reload changes the tiers: a `tier` index is valid only with the policy it
/// came from, so a request uses the `Metrics` of the policy it was admitted under.
struct TierSeries {
    /// `[tier or NO_TIER][reason]`; the last row is NO_TIER.
    rejections: Vec<Vec<Counter>>,
    /// The `reason` of each column of `rejections`.
    reasons: Vec<&'static str>,
    estimated_input_tokens: Vec<Histogram>,
    /// `[tier][prompt, completion]`.
    usage_tokens: Vec<[Counter; 2]>,
    ttft: Vec<Histogram>,
    upstream_ttft: Vec<Histogram>,
    request_duration: Vec<Histogram>,
    queued: Vec<Gauge>,
    queue_wait: Vec<Histogram>,
    scheduler_submitted: Vec<Counter>,
    /// `[tier][SchedulerOutcome]`.
    scheduler_outcomes: Vec<Vec<Counter>>,
    /// `[tier][kind * 3 + stage]`.
    budget_tokens: Vec<Vec<Counter>>,
    /// `[tier][reason]`.
    shadow_refusals: Vec<Vec<Counter>>,
}

impl Metrics {
    /// Registers every series: per tier of `labels.tier_names()`, and per value of each enum
    /// `labels` names.
    pub fn new<L: MetricLabels + ?Sized>(labels: &L) -> Metrics {
        let builder = PrometheusBuilder::new();
        let builder = [
            (TTFT, LATENCY_BUCKETS),
            (UPSTREAM_TTFT, LATENCY_BUCKETS),
            (REQUEST_DURATION, LATENCY_BUCKETS),
            (DECISION_DURATION, DECISION_BUCKETS),
            (ESTIMATED_INPUT_TOKENS, TOKEN_BUCKETS),
            (QUEUE_WAIT, QUEUE_WAIT_BUCKETS),
            (STORE_DURATION, STORE_BUCKETS),
            (STORE_BATCH_CALLS, BATCH_BUCKETS),
        ]
        .into_iter()
        .fold(builder, |b, (name, buckets)| {
            b.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
                .expect("bucket lists are non-empty constants")
        });
        let recorder = builder.build_recorder();
        let r = Registrar {
            recorder: &recorder,
            fresh: true,
        };

        r.describe_counter(
            REQUESTS,
            Unit::Count,
            "Requests seen, by route class and outcome.",
        );
        r.describe_counter(
            REJECTIONS,
            Unit::Count,
            "Inference requests answered locally, by rule (x-tollgate-reason) and tier.",
        );
        r.describe_histogram(
            ESTIMATED_INPUT_TOKENS,
            Unit::Count,
            "Input tokens counted in admitted request bodies, by tier.",
        );
        r.describe_counter(
            USAGE_TOKENS,
            Unit::Count,
            "Tokens the upstream reported in usage, by tier and kind (prompt, completion).",
        );
        r.describe_histogram(
            TTFT,
            Unit::Seconds,
            "From request headers reaching tollgate to the first response body byte, by tier.",
        );
        r.describe_histogram(
            UPSTREAM_TTFT,
            Unit::Seconds,
            "From the request getting its slot to the first response body byte, by tier: \
             the upstream's share of the time to first token, without queue wait.",
        );
        r.describe_histogram(
            REQUEST_DURATION,
            Unit::Seconds,
            "From request headers to the end of a complete response, by tier.",
        );
        r.describe_counter(
            STREAM_COMPLETIONS,
            Unit::Count,
            "How admitted responses ended: complete, truncated, upstream_error, no_response.",
        );
        r.describe_gauge(
            HELD_STREAMS,
            Unit::Count,
            "ext_proc streams currently open to tollgate.",
        );
        r.describe_gauge(
            LARGE_BODIES_WAITING,
            Unit::Count,
            "Requests whose large body waits now for a thread to count it (tokens.large_body_threads).",
        );
        r.describe_counter(
            BODIES_COUNTED_OFF_WORKERS,
            Unit::Count,
            "Request bodies sent to the counting threads rather than counted on the async \
             workers (counted there, or refused while they waited), by reason: size (over 16 \
             KiB) or costly_text (text the encoder is slow on, such as long runs of \
             punctuation).",
        );
        r.describe_histogram(
            DECISION_DURATION,
            Unit::Seconds,
            "Time to decide on a request once its deciding message arrived.",
        );
        r.describe_counter(
            PROTOCOL_ERRORS,
            Unit::Count,
            "ext_proc message sequences that broke the protocol, by kind.",
        );
        r.describe_counter(
            RESPONSE_REPORTS,
            Unit::Count,
            "Reports about responses that came outside their request's stream, by report and outcome.",
        );
        r.describe_counter(
            CHAT_TEMPLATE_FALLBACKS,
            Unit::Count,
            "Admitted chats a model's chat template refused, counted by the per-message recipe.",
        );
        r.describe_counter(
            COUNT_CACHE_LOOKUPS,
            Unit::Count,
            "Prompt texts of 512 bytes to 1 MiB on the request path, by result: found (a text its tenant sent before, not counted again) or counted.",
        );
        r.describe_gauge(
            COUNT_CACHE_BYTES,
            Unit::Bytes,
            "Bytes of prompt text whose token counts are kept (at most 32 MiB).",
        );

        r.describe_gauge(
            INFLIGHT_LIMIT,
            Unit::Count,
            "The global in-flight budget now (set by the controller, or static).",
        );
        r.describe_gauge(
            INFLIGHT,
            Unit::Count,
            "Requests holding a slot of the budget now.",
        );
        r.describe_gauge(
            QUEUED,
            Unit::Count,
            "Requests waiting for a slot now, by tier.",
        );
        r.describe_gauge(
            QUEUED_BODY_BYTES,
            Unit::Bytes,
            "Request-body bytes held by requests waiting for a slot now (capped by \
             scheduler.max_queued_body_bytes).",
        );
        r.describe_gauge(
            HEADROOM_HELD,
            Unit::Count,
            "Free slots held for the steady tenants against a tenant that would take more than \
             its own (scheduler.headroom), now.",
        );
        r.describe_gauge(
            STANDBY,
            Unit::Count,
            "Slots this fleet member keeps free for tenants the deployment gives all they ask, \
             against the others (fleet.standby_miss); 0 on a lone replica.",
        );
        r.describe_gauge(
            LENT,
            Unit::Count,
            "Slots in flight that were lent: granted beyond their tenant's fair share of the \
             budget while it was not steady (scheduler.headroom), now.",
        );
        r.describe_counter(
            PACED,
            Unit::Count,
            "Requests that found a free slot their tenant could not take because it was paced \
             (bursting beside steady tenants: at most the start rate of its fair share, \
             scheduler.headroom.pace_bursts); each waited for its pace, or was refused with its \
             tenant's queue full.",
        );
        r.describe_histogram(
            QUEUE_WAIT,
            Unit::Seconds,
            "Time admitted requests waited for a slot, by tier.",
        );
        r.describe_counter(
            SCHEDULER_SUBMITTED,
            Unit::Count,
            "Requests that asked the scheduler for a slot, by tier.",
        );
        r.describe_counter(
            SCHEDULER_OUTCOMES,
            Unit::Count,
            "What became of requests that asked for a slot, by tier and outcome.",
        );
        r.describe_counter(
            CONTROLLER_ACTIONS,
            Unit::Count,
            "AIMD controller ticks, by action (increase, decrease, hold_*).",
        );
        r.describe_gauge(
            CONTROLLER_P99,
            Unit::Seconds,
            "The p99 time to first token the controller saw at its last tick, of its signal \
             (control.signal), overdue requests included (NaN: no samples).",
        );
        r.describe_counter(
            ENGINE_SCRAPES,
            Unit::Count,
            "Scrapes of the engines' metrics (control.engine.metrics_urls), one per engine per \
             controller tick, by result (ok, error).",
        );
        r.describe_gauge(
            ENGINE_SATURATION,
            Unit::Percent,
            "The engines' saturation at the last tick, as a ratio (1 = saturated): per engine \
             the larger of KV-cache usage and waiting requests over their thresholds, averaged \
             (NaN: no engine answered).",
        );
        r.describe_gauge(
            ENGINE_KV_CACHE_USAGE,
            Unit::Percent,
            "The engines' mean KV-cache usage at the last tick, as a ratio (NaN: none reported).",
        );
        r.describe_gauge(
            ENGINE_WAITING,
            Unit::Count,
            "Requests waiting inside the engines at the last tick, summed (NaN: none reported).",
        );

        r.describe_counter(
            BUDGET_TOKENS,
            Unit::Count,
            "Budget tokens by tier, kind (input, output) and stage (reserved up front, settled \
             at the end, refunded when unused).",
        );
        r.describe_histogram(
            STORE_DURATION,
            Unit::Seconds,
            "Budget store calls, by operation (reserve, settle, renew); with Redis, a reserve's and a settle's wait for the batch ahead included.",
        );
        r.describe_histogram(
            STORE_BATCH_CALLS,
            Unit::Count,
            "Calls per batch the Redis store sent or tried (reserves, settles and usage reads \
             that waited for the batch ahead go together as one pipeline; at most 64). No \
             batches with the embedded store.",
        );
        r.describe_counter(
            STORE_ERRORS,
            Unit::Count,
            "Budget store failures, by operation and kind (timeout, unavailable, protocol).",
        );
        r.describe_gauge(
            STORE_BREAKER,
            Unit::Count,
            "The budget store's circuit breaker: 0 closed, 1 probing, 2 open (store skipped).",
        );
        r.describe_counter(
            DEGRADED_DECISIONS,
            Unit::Count,
            "Decisions taken by a fail mode because the store failed, by control and mode.",
        );
        r.describe_gauge(
            ACTIVE_LEASES,
            Unit::Count,
            "Concurrency leases this replica holds in the store now.",
        );
        r.describe_gauge(
            FLEET_MEMBERS,
            Unit::Count,
            "Replicas sharing this replica's in-flight budget, itself included, as its last \
             sync saw them (1 alone or in fallback).",
        );
        r.describe_gauge(
            FLEET_LIMIT,
            Unit::Count,
            "The in-flight limit of the whole deployment (this replica's share is \
             tollgate_inflight_limit).",
        );
        r.describe_gauge(
            FLEET_LEADER,
            Unit::Count,
            "1 while this replica holds the fleet's leader lease and decides the limit.",
        );
        r.describe_gauge(
            FLEET_STANDING,
            Unit::Count,
            "Where this replica stands with its fleet: 1 for the current standing (alone, \
             member, fallback, refused).",
        );
        r.describe_counter(
            FLEET_FALLBACKS,
            Unit::Count,
            "Times this replica fell back to a local budget, by reason (store_unreachable, \
             policy_mismatch).",
        );
        r.describe_counter(
            FLEET_STORE_CALLS,
            Unit::Count,
            "Redis calls the fleet's sync made (one EVALSHA each, off the request path), by op \
             (join: every sync; publish: the leader's decision; leave: at shutdown) and result.",
        );
        r.describe_counter(
            SHADOW_REFUSALS,
            Unit::Count,
            "Refusals shadow mode (enforce: false) counted and let through, by rule and tier.",
        );
        r.describe_gauge(
            CONFIG_LAST_RELOAD_SUCCESSFUL,
            Unit::Count,
            "1 if the last configuration reload was applied (or found nothing to change, or none \
             was tried), 0 if it was refused and an older policy is running.",
        );
        r.describe_counter(
            CONFIG_RELOADS,
            Unit::Count,
            "Configuration reloads (SIGHUP or the file changed), by result (applied, \
             unchanged, refused: the policy in force kept running).",
        );
        r.describe_gauge(
            RUNTIME_WORKER_THREADS,
            Unit::Count,
            "Threads the async runtime runs streams on: --worker-threads, TOKIO_WORKER_THREADS, \
             or the CPUs the process may use.",
        );
        r.describe_counter(
            FLEET_LEADERSHIPS,
            Unit::Count,
            "Times this replica took the fleet's leader lease.",
        );

        let actions = label_set::<L::Action>();
        let fail_modes = label_set::<L::FailMode>();
        let store_error_kinds = label_set::<<L::StoreError as ErrorKind>::Kind>();
        let tiers = tier_series(&r, labels);
        let handle = recorder.handle();
        let inner = Inner {
            requests: RequestOutcome::ALL
                .iter()
                .map(|o| r.counter(REQUESTS, &o.labels()))
                .collect(),
            stream_completions: <ResponseEnd as LabelValue>::ALL
                .iter()
                .map(|e| r.counter(STREAM_COMPLETIONS, &[("result", e.label())]))
                .collect(),
            held_streams: r.gauge(HELD_STREAMS, &[]),
            large_bodies_waiting: r.gauge(LARGE_BODIES_WAITING, &[]),
            bodies_counted_off_workers: CountedOffWorkers::ALL
                .iter()
                .map(|reason| r.counter(BODIES_COUNTED_OFF_WORKERS, &[("reason", reason.label())]))
                .collect(),
            decision_duration: r.histogram(DECISION_DURATION, &[]),
            chat_template_fallbacks: r.counter(CHAT_TEMPLATE_FALLBACKS, &[]),
            count_cache_lookups: ["found", "counted"]
                .map(|result| r.counter(COUNT_CACHE_LOOKUPS, &[("result", result)])),
            count_cache_bytes: r.gauge(COUNT_CACHE_BYTES, &[]),
            protocol_errors: ProtocolError::ALL
                .iter()
                .map(|k| r.counter(PROTOCOL_ERRORS, &[("kind", k.label())]))
                .collect(),
            response_reports: ResponseReport::ALL
                .iter()
                .map(|report| {
                    ReportOutcome::ALL
                        .iter()
                        .map(|outcome| {
                            r.counter(
                                RESPONSE_REPORTS,
                                &[("report", report.label()), ("outcome", outcome.label())],
                            )
                        })
                        .collect()
                })
                .collect(),
            inflight_limit: r.gauge(INFLIGHT_LIMIT, &[]),
            inflight: r.gauge(INFLIGHT, &[]),
            queued_body_bytes: r.gauge(QUEUED_BODY_BYTES, &[]),
            headroom_held: r.gauge(HEADROOM_HELD, &[]),
            lent: r.gauge(LENT, &[]),
            standby: r.gauge(STANDBY, &[]),
            paced: r.counter(PACED, &[]),
            controller_actions: actions
                .iter()
                .map(|action| r.counter(CONTROLLER_ACTIONS, &[("action", action)]))
                .collect(),
            actions,
            controller_p99: r.gauge(CONTROLLER_P99, &[]),
            engine_scrapes: ["ok", "error"]
                .map(|result| r.counter(ENGINE_SCRAPES, &[("result", result)])),
            engine_saturation: r.gauge(ENGINE_SATURATION, &[]),
            engine_kv_cache_usage: r.gauge(ENGINE_KV_CACHE_USAGE, &[]),
            engine_waiting: r.gauge(ENGINE_WAITING, &[]),
            store_duration: StoreOp::ALL
                .iter()
                .map(|op| r.histogram(STORE_DURATION, &[("op", op.label())]))
                .collect(),
            store_errors: StoreOp::ALL
                .iter()
                .map(|op| {
                    store_error_kinds
                        .iter()
                        .map(|kind| r.counter(STORE_ERRORS, &[("op", op.label()), ("kind", kind)]))
                        .collect()
                })
                .collect(),
            store_error_kinds,
            store_breaker: r.gauge(STORE_BREAKER, &[]),
            store_batch_calls: r.histogram(STORE_BATCH_CALLS, &[]),
            degraded: ["budgets", "concurrency"]
                .iter()
                .map(|control| {
                    fail_modes
                        .iter()
                        .map(|mode| {
                            r.counter(DEGRADED_DECISIONS, &[("control", control), ("mode", mode)])
                        })
                        .collect()
                })
                .collect(),
            fail_modes,
            active_leases: r.gauge(ACTIVE_LEASES, &[]),
            fleet_members: r.gauge(FLEET_MEMBERS, &[]),
            fleet_limit: r.gauge(FLEET_LIMIT, &[]),
            fleet_leader: r.gauge(FLEET_LEADER, &[]),
            fleet_standing: FleetStanding::ALL
                .iter()
                .map(|standing| r.gauge(FLEET_STANDING, &[("standing", standing.as_str())]))
                .collect(),
            fleet_fallbacks: ["store_unreachable", "policy_mismatch"]
                .map(|reason| r.counter(FLEET_FALLBACKS, &[("reason", reason)])),
            fleet_leaderships: r.counter(FLEET_LEADERSHIPS, &[]),
            fleet_store_calls: FleetCall::ALL.map(|call| {
                ["ok", "error"].map(|result| {
                    r.counter(
                        FLEET_STORE_CALLS,
                        &[("op", call.as_str()), ("result", result)],
                    )
                })
            }),
            config_reloads: ReloadResult::ALL
                .iter()
                .map(|result| r.counter(CONFIG_RELOADS, &[("result", result.as_str())]))
                .collect(),
            config_last_reload_successful: r.gauge(CONFIG_LAST_RELOAD_SUCCESSFUL, &[]),
            runtime_worker_threads: r.gauge(RUNTIME_WORKER_THREADS, &[]),
            handle,
            recorder,
        };
        // Nothing scraped yet (or the engines' signal is off): unknown, not an idle engine.
        for unknown in [
            &inner.engine_saturation,
            &inner.engine_kv_cache_usage,
            &inner.engine_waiting,
        ] {
            unknown.set(f64::NAN);
        }
        // The configuration in force was loaded: no reload has failed yet.
        inner.config_last_reload_successful.set(1.0);
        Metrics {
            inner: Arc::new(inner),
            tiers: Arc::new(tiers),
        }
    }

    /// These metrics with the tier series of `labels` (a reloaded policy): the series of
    /// tiers kept are the same, new tiers' are created, and those of tiers removed stay as
    /// they were. Every other series is shared.
    pub fn for_tiers<L: MetricLabels + ?Sized>(&self, labels: &L) -> Metrics {
        let r = Registrar {
            recorder: &self.inner.recorder,
            fresh: false,
        };
        Metrics {
            inner: self.inner.clone(),
            tiers: Arc::new(tier_series(&r, labels)),
        }
    }

    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        self.inner.handle.render()
    }

    /// Folds recorded histogram samples into their buckets; call periodically so memory stays
    /// bounded between scrapes.
    pub fn run_upkeep(&self) {
        self.inner.handle.run_upkeep();
    }

    pub fn request(&self, outcome: RequestOutcome) {
        let index = RequestOutcome::ALL
            .iter()
            .position(|&o| o == outcome)
            .expect("ALL lists every outcome");
        self.inner.requests[index].increment(1);
    }

    /// Counts a local reply by its rule (`MetricLabels::Reason`) and tier, if one was known.
    pub fn rejection(&self, reason: impl LabelValue, tier: Option<usize>) {
        let row = tier.unwrap_or(self.tiers.rejections.len() - 1);
        let col = column(&self.tiers.reasons, reason);
        self.tiers.rejections[row][col].increment(1);
    }

    pub fn estimated_input_tokens(&self, tier: usize, tokens: u32) {
        self.tiers.estimated_input_tokens[tier].record(f64::from(tokens));
    }

    pub fn usage(&self, tier: usize, prompt_tokens: u64, completion_tokens: u64) {
        let [prompt, completion] = &self.tiers.usage_tokens[tier];
        prompt.increment(prompt_tokens);
        completion.increment(completion_tokens);
    }

    pub fn time_to_first_token(&self, tier: usize, seconds: f64) {
        self.tiers.ttft[tier].record(seconds);
    }

    pub fn upstream_time_to_first_token(&self, tier: usize, seconds: f64) {
        self.tiers.upstream_ttft[tier].record(seconds);
    }

    pub fn request_duration(&self, tier: usize, seconds: f64) {
        self.tiers.request_duration[tier].record(seconds);
    }

    pub fn stream_completion(&self, end: ResponseEnd) {
        self.inner.stream_completions[end.index()].increment(1);
    }

    pub fn decision_duration(&self, seconds: f64) {
        self.inner.decision_duration.record(seconds);
    }

    /// Counts an admitted chat whose model's template refused it (see `request::ParsedBody`).
    pub fn chat_template_fallback(&self) {
        self.inner.chat_template_fallbacks.increment(1);
    }

    pub fn protocol_error(&self, kind: ProtocolError) {
        self.inner.protocol_errors[kind.index()].increment(1);
    }

    pub fn response_report(&self, report: ResponseReport, outcome: ReportOutcome) {
        self.inner.response_reports[report.index()][outcome.index()].increment(1);
    }

    /// The token count cache's totals, read at scrape time.
    pub fn count_cache(&self, stats: CountCacheStats) {
        let [found, counted] = &self.inner.count_cache_lookups;
        found.absolute(stats.found);
        counted.absolute(stats.counted);
        self.inner.count_cache_bytes.set(stats.bytes as f64);
    }

    /// Publishes the scheduler's budget, in-flight count and limit.
    pub fn scheduler_load(&self, load: impl Into<SchedulerGauges>) {
        let load = load.into();
        self.inner.inflight_limit.set(f64::from(load.limit));
        self.inner.inflight.set(f64::from(load.in_flight));
        self.inner
            .queued_body_bytes
            .set(load.queued_body_bytes as f64);
        self.inner.headroom_held.set(f64::from(load.held));
        self.inner.lent.set(f64::from(load.lent));
        self.inner.standby.set(f64::from(load.standby));
        self.inner.paced.absolute(load.paced);
    }

    pub fn scheduler_submitted(&self, tier: usize) {
        self.tiers.scheduler_submitted[tier].increment(1);
    }

    pub fn scheduler_outcome(&self, tier: usize, outcome: SchedulerOutcome) {
        self.tiers.scheduler_outcomes[tier][outcome.index()].increment(1);
    }

    pub fn queue_wait(&self, tier: usize, seconds: f64) {
        self.tiers.queue_wait[tier].record(seconds);
    }

    /// Counts a request of `tier` as queued until the returned guard drops.
    pub fn hold_queued(&self, tier: usize) -> GaugeGuard {
        GaugeGuard::new(self.tiers.queued[tier].clone())
    }

    /// Counts one controller tick by its action (`MetricLabels::Action`), and the p99 it saw.
    pub fn controller_tick(&self, action: impl LabelValue, p99_seconds: Option<f64>) {
        let index = column(&self.inner.actions, action);
        self.inner.controller_actions[index].increment(1);
        self.inner
            .controller_p99
            .set(p99_seconds.unwrap_or(f64::NAN));
    }

    /// One tick's scrape of the engines, and the saturation it came to.
    pub fn engine_scrape(&self, scrape: &impl EngineScrape, saturation: Option<f64>) {
        let inner = &self.inner;
        inner.engine_scrapes[0].increment(scrape.loads().count() as u64);
        inner.engine_scrapes[1].increment(scrape.failures() as u64);
        inner.engine_saturation.set(saturation.unwrap_or(f64::NAN));
        // Sum and count of one figure over the engines that reported it; NaN from none.
        let over_engines = |figure: fn(EngineReading) -> Option<f64>| {
            scrape
                .loads()
                .filter_map(figure)
                .fold((0.0, 0u32), |(sum, n), value| (sum + value, n + 1))
        };
        let (kv_sum, kv_engines) = over_engines(|load| load.kv_cache_usage);
        inner.engine_kv_cache_usage.set(if kv_engines == 0 {
            f64::NAN
        } else {
            kv_sum / f64::from(kv_engines)
        });
        let (waiting, waiting_engines) = over_engines(|load| load.waiting);
        inner.engine_waiting.set(if waiting_engines == 0 {
            f64::NAN
        } else {
            waiting
        });
    }

    pub fn budget_tokens(&self, tier: usize, kind: TokenKind, stage: TokenStage, tokens: u64) {
        let index = (kind as usize) * 3 + stage as usize;
        self.tiers.budget_tokens[tier][index].increment(tokens);
    }

    /// One store round trip, and its failure by kind (`MetricLabels::StoreError`) if it failed.
    pub fn store_call<E: ErrorKind>(&self, op: StoreOp, seconds: f64, error: Option<&E>) {
        let op_index = op.index();
        self.inner.store_duration[op_index].record(seconds);
        if let Some(error) = error {
            let kind_index = column(&self.inner.store_error_kinds, error.kind());
            self.inner.store_errors[op_index][kind_index].increment(1);
        }
    }

    /// Where the Redis store records how many calls each of its batches held.
    pub fn store_batch_calls(&self) -> Histogram {
        self.inner.store_batch_calls.clone()
    }

    /// The store's circuit breaker, as its gauge value: 0 closed, 1 probing, 2 open.
    pub fn breaker_state(&self, state: impl Into<u8>) {
        self.inner.store_breaker.set(f64::from(state.into()));
    }

    /// Counts a decision `control` took by its fail mode (`MetricLabels::FailMode`).
    pub fn degraded(&self, control: DegradedControl, mode: impl LabelValue) {
        let mode = column(&self.inner.fail_modes, mode);
        self.inner.degraded[control as usize][mode].increment(1);
    }

    /// Where this replica stands with its fleet, and what it last saw of it.
    pub fn fleet(&self, standing: FleetStanding, members: u32, limit: u32, leader: bool) {
        for (gauge, value) in self.inner.fleet_standing.iter().zip(FleetStanding::ALL) {
            gauge.set(if value == standing { 1.0 } else { 0.0 });
        }
        self.inner.fleet_members.set(f64::from(members));
        self.inner.fleet_limit.set(f64::from(limit));
        self.inner.fleet_leader.set(if leader { 1.0 } else { 0.0 });
    }

    /// Counts a fall back to a local budget: `policy_mismatch` or else the store unreachable.
    pub fn fleet_fallback(&self, policy_mismatch: bool) {
        self.inner.fleet_fallbacks[usize::from(policy_mismatch)].increment(1);
    }

    /// Counts one of the fleet's Redis calls.
    pub fn fleet_store_call(&self, call: FleetCall, ok: bool) {
        self.inner.fleet_store_calls[call as usize][usize::from(!ok)].increment(1);
    }

    /// Counts a configuration reload by what it did.
    pub fn config_reload(&self, result: ReloadResult) {
        self.inner.config_reloads[result as usize].increment(1);
        let successful = result != ReloadResult::Refused;
        self.inner
            .config_last_reload_successful
            .set(if successful { 1.0 } else { 0.0 });
    }

    /// The runtime's worker threads, set once at start-up.
    pub fn runtime_worker_threads(&self, threads: usize) {
        self.inner.runtime_worker_threads.set(threads as f64);
    }

    /// Counts a refusal shadow mode let through, by its rule (`MetricLabels::Reason`) and tier.
    pub fn shadow_refusal(&self, reason: impl LabelValue, tier: usize) {
        let col = column(&self.tiers.reasons, reason);
        self.tiers.shadow_refusals[tier][col].increment(1);
    }

    /// Counts a leadership taken.
    pub fn fleet_leadership(&self) {
        self.inner.fleet_leaderships.increment(1);
    }

    /// Counts a live lease until the returned guard drops.
    pub fn hold_lease(&self) -> GaugeGuard {
        GaugeGuard::new(self.inner.active_leases.clone())
    }

    /// Counts a held ext_proc stream until the returned guard drops, whichever way the stream
    /// task ends.
    pub fn hold_stream(&self) -> GaugeGuard {
        GaugeGuard::new(self.inner.held_streams.clone())
    }

    /// Counts a body sent to the counting threads, and why.
    pub fn counted_off_workers(&self, reason: CountedOffWorkers) {
        self.inner.bodies_counted_off_workers[reason.index()].increment(1);
    }

    /// Counts a large body waiting for a thread to count it, until the guard drops.
    pub fn hold_large_body_waiting(&self) -> GaugeGuard {
        GaugeGuard::new(self.inner.large_bodies_waiting.clone())
    }
}

/// The labels of a `MetricLabels` enum's series, in `ALL` order.
fn label_set<T: LabelValue>() -> Vec<&'static str> {
    T::ALL.iter().map(|value| value.label()).collect()
}

/// `value`'s column in a family created from `labels` (`label_set` of the enum `MetricLabels`
/// named for that metric).
fn column<T: LabelValue>(labels: &[&'static str], value: T) -> usize {
    let index = value.index();
    debug_assert_eq!(
        labels.get(index).copied(),
        Some(value.label()),
        "{} is not the enum this metric's series were created for",
        std::any::type_name::<T>()
    );
    index
}

/// Adds one (or `amount`) to a gauge while it lives.
pub struct GaugeGuard {
    gauge: Gauge,
    amount: f64,
}

impl GaugeGuard {
    fn new(gauge: Gauge) -> GaugeGuard {
        GaugeGuard::add(gauge, 1.0)
    }

    fn add(gauge: Gauge, amount: f64) -> GaugeGuard {
        gauge.increment(amount);
        GaugeGuard { gauge, amount }
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.gauge.decrement(self.amount);
    }
}

/// Registers series on one recorder (not the global one).
/// Registers the series labelled by tier (again, for a reloaded policy: registering an existing
/// series returns it, counts and all).
fn tier_series<L: MetricLabels + ?Sized>(r: &Registrar<'_>, labels: &L) -> TierSeries {
    let tier_names = labels.tier_names();
    let reasons = label_set::<L::Reason>();
    let per_tier = |f: &dyn Fn(&str) -> Histogram| tier_names.iter().map(|t| f(t)).collect();
    TierSeries {
        rejections: tier_names
            .iter()
            .copied()
            .chain([NO_TIER])
            .map(|tier| {
                reasons
                    .iter()
                    .map(|reason| r.counter(REJECTIONS, &[("reason", reason), ("tier", tier)]))
                    .collect()
            })
            .collect(),
        reasons: reasons.clone(),
        estimated_input_tokens: per_tier(&|t| r.histogram(ESTIMATED_INPUT_TOKENS, &[("tier", t)])),
        usage_tokens: tier_names
            .iter()
            .map(|t| {
                [
                    r.counter(USAGE_TOKENS, &[("tier", t), ("kind", "prompt")]),
                    r.counter(USAGE_TOKENS, &[("tier", t), ("kind", "completion")]),
                ]
            })
            .collect(),
        ttft: per_tier(&|t| r.histogram(TTFT, &[("tier", t)])),
        upstream_ttft: per_tier(&|t| r.histogram(UPSTREAM_TTFT, &[("tier", t)])),
        request_duration: per_tier(&|t| r.histogram(REQUEST_DURATION, &[("tier", t)])),
        queued: tier_names
            .iter()
            .map(|t| r.gauge(QUEUED, &[("tier", t)]))
            .collect(),
        queue_wait: per_tier(&|t| r.histogram(QUEUE_WAIT, &[("tier", t)])),
        scheduler_submitted: tier_names
            .iter()
            .map(|t| r.counter(SCHEDULER_SUBMITTED, &[("tier", t)]))
            .collect(),
        scheduler_outcomes: tier_names
            .iter()
            .map(|t| {
                SchedulerOutcome::ALL
                    .iter()
                    .map(|o| r.counter(SCHEDULER_OUTCOMES, &[("tier", t), ("outcome", o.label())]))
                    .collect()
            })
            .collect(),
        budget_tokens: tier_names
            .iter()
            .map(|t| {
                ["input", "output"]
                    .iter()
                    .flat_map(|kind| {
                        ["reserved", "settled", "refunded"].map(|stage| {
                            r.counter(
                                BUDGET_TOKENS,
                                &[("tier", t), ("kind", kind), ("stage", stage)],
                            )
                        })
                    })
                    .collect()
            })
            .collect(),
        shadow_refusals: tier_names
            .iter()
            .map(|tier| {
                reasons
                    .iter()
                    .map(|reason| r.counter(SHADOW_REFUSALS, &[("reason", reason), ("tier", tier)]))
                    .collect()
            })
            .collect(),
    }
}

struct Registrar<'a> {
    recorder: &'a metrics_exporter_prometheus::PrometheusRecorder,
    /// Registering for the first time: gauges start at 0. Otherwise a gauge may already hold
    /// a value (requests queued under the policy before a reload), which must stay.
    fresh: bool,
}

impl Registrar<'_> {
    fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
        let labels: Vec<Label> = labels
            .iter()
            .map(|(k, v)| Label::new(*k, v.to_string()))
            .collect();
        Key::from_parts(name, labels)
    }

    fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        let counter = self
            .recorder
            .register_counter(&Self::key(name, labels), &METADATA);
        // Registering alone does not make the series render; a zero increment does.
        counter.increment(0);
        counter
    }

    fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        let gauge = self
            .recorder
            .register_gauge(&Self::key(name, labels), &METADATA);
        if self.fresh {
            gauge.set(0.0);
        } else {
            // Renders a new series without changing an existing one.
            gauge.increment(0.0);
        }
        gauge
    }

    fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        self.recorder
            .register_histogram(&Self::key(name, labels), &METADATA)
    }

    fn describe_counter(&self, name: &'static str, unit: Unit, help: &'static str) {
        self.recorder
            .describe_counter(name.into(), Some(unit), help.into());
    }

    fn describe_gauge(&self, name: &'static str, unit: Unit, help: &'static str) {
        self.recorder
            .describe_gauge(name.into(), Some(unit), help.into());
    }

    fn describe_histogram(&self, name: &'static str, unit: Unit, help: &'static str) {
        self.recorder
            .describe_histogram(name.into(), Some(unit), help.into());
    }
}

static METADATA: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, None);

#[cfg(test)]
mod tests;
