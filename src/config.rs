//! The configuration file's shape, its defaults, and how it is loaded.
//!
//! Layers, later wins: built-in defaults < `--config FILE` (YAML) < environment variables
//! `TOLLGATE__SECTION__KEY` < command-line flags. Unknown keys are errors, never ignored: a
//! typo in a limit must not silently leave the default in force. Loading only checks shape and
//! types; `Policy::from_config` checks meaning (ranges, references between fields).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::tokens::EncodingRule;

/// The whole configuration. Every field has a documented default, so an empty file is valid.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub listen: ListenConfig,
    pub identity: IdentityConfig,
    pub routes: RoutesConfig,
    pub tokens: TokensConfig,
    /// The tier used when a request names none.
    pub default_tier: String,
    /// Tiers by name. Naming any tier (in the file or the environment) replaces the built-in
    /// set as a whole, so no tier exists that the operator did not write down.
    pub tiers: BTreeMap<String, TierConfig>,
    pub response: ResponseConfig,
    pub scheduler: SchedulerConfig,
    pub control: ControlConfig,
    /// Per-tenant overrides of any tier field ("exceptions" to the default policy, seed 004).
    pub tenants: BTreeMap<String, TierOverride>,
    pub store: StoreConfig,
    /// How replicas sharing a Redis store share one in-flight budget (unused without Redis).
    pub fleet: FleetConfig,
    pub shutdown: ShutdownConfig,
    /// Whether refusals are enforced. `false` is shadow mode: the whole decision runs and every
    /// refusal it would make is counted and logged, but the request continues upstream. A tier's
    /// `enforce` overrides this, and a tenant's overrides its tier's.
    pub enforce: bool,
    /// The admin HTTP API (`/v1/...`, on the admin port).
    pub admin: AdminConfig,
    /// Reloading the configuration while serving.
    pub reload: ReloadConfig,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// A file holding the bearer token the `/v1/` API requires (reads included). Absent: the
    /// API is off and `/v1/` answers 404; `/metrics`, `/healthz` and `/readyz` never need it.
    pub token_file: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReloadConfig {
    /// How often the `--config` file is read to see whether it changed (a Kubernetes ConfigMap
    /// update swaps a symlink; the content is compared, not the modification time). 0: only
    /// SIGHUP reloads.
    pub watch_ms: u64,
}

impl Default for ReloadConfig {
    fn default() -> Self {
        ReloadConfig { watch_ms: 2000 }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenConfig {
    /// ext_proc gRPC (and grpc.health.v1) address.
    pub grpc_addr: String,
    /// Admin HTTP address: /metrics, /healthz, /readyz.
    pub admin_addr: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IdentityConfig {
    /// Header naming the tenant, set by a trusted layer in front (an auth filter, a gateway).
    /// Empty disables header identity, leaving API keys as the only way in.
    pub user_header: String,
    /// Header naming the tier; absent means `default_tier`.
    pub tier_header: String,
    /// `Authorization: Bearer KEY` → tenant and tier. Only SHA-256 hashes of keys are stored, so
    /// the config file is not a secret store. When the list is non-empty, an unknown bearer key
    /// is refused (401) rather than falling back to the header.
    pub api_keys: Vec<ApiKeyConfig>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Lowercase hex SHA-256 of the key, e.g. `printf %s "$KEY" | sha256sum`.
    pub sha256: String,
    pub tenant: String,
    /// Absent means `default_tier`.
    #[serde(default)]
    pub tier: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutesConfig {
    /// Paths (query string ignored, exact match) whose POST bodies are OpenAI requests to admit.
    /// Everything else passes through untouched.
    pub inference_paths: Vec<String>,
    /// Paths among `inference_paths` that take a completions `prompt` rather than chat
    /// `messages`. Matched by suffix, so `/openai/v1/completions` works too.
    pub completions_suffix: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokensConfig {
    /// Model-name globs → BPE, first match wins; unmatched models use the built-in family table.
    pub encodings: Vec<EncodingRule>,
    /// Chat framing per message (OpenAI's published counting recipe: 3).
    pub per_message: u32,
    /// Extra when a message carries `name` (1).
    pub per_name: u32,
    /// Priming of the assistant's reply (3).
    pub reply_priming: u32,
    /// Flat cost charged per image part, since the pixels are not in the body to count.
    pub per_image: u32,
    /// Largest request body tollgate will parse; Envoy's own buffer limit should be the same
    /// or lower so clients get Envoy's 413 before any gRPC traffic.
    pub max_body_bytes: usize,
    /// Large bodies (over 16 KiB, or smaller with text that costs more to count than the async
    /// workers' budget) are parsed and counted off the async workers, this many at once (0: one
    /// per runtime worker thread, at least two and at most 512). Many more would only share the
    /// same cores among more bodies, so that a burst of them all finishes late together where,
    /// taken in turn, the first ones finish in time, and would leave the async workers, which
    /// decide every small request, little CPU. Only a restart changes it.
    pub large_body_threads: u32,
    /// How long a large body may wait for one of those threads, from its arrival, before a 503
    /// `counting_backlog` (at most `scheduler.envoy_max_message_timeout_ms`). Keep it well
    /// under Envoy's `message_timeout` (1 s in the shipped configs): Envoy gives up on an
    /// answer later than that, and the counting would be spent on a request nobody waits for.
    /// A tier in shadow mode waits its turn however long it takes.
    pub large_body_max_wait_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// Hard ceiling on a request's counted input tokens (400 above it).
    pub max_input_tokens: u32,
    /// Hard ceiling on `max_tokens` / `max_completion_tokens`.
    pub max_output_tokens: u32,
    /// What happens above `max_output_tokens`: `reject` (400) or `clamp` (rewrite the body).
    pub output_limit: OutputLimitPolicy,
    /// Output tokens assumed, and written into the body, when the request names none. Without
    /// it the upstream would generate until the model's context runs out and the ceiling would
    /// mean nothing. Absent means `max_output_tokens`.
    pub default_output_tokens: Option<u32>,
    /// Share of the global in-flight budget under contention, relative to other tiers' weights.
    pub weight: u32,
    /// Strict priority: band 0 is served before band 1, and so on; weights apply within a band.
    pub priority_band: u8,
    /// Requests of one tenant that may wait for a slot; one more is refused at once (503).
    /// Small on purpose: a deep queue turns into queue wait, which users feel, and which a
    /// controller on the gateway's signal sees as TTFT and answers by shrinking the budget
    /// (seed 001's death spiral).
    pub queue_max: u32,
    /// How long a request may wait for a slot before a 503. About 1 s: a request that waited
    /// longer is a lost cause, and serving it feeds a chain reaction (seed 001).
    pub queue_deadline_ms: u64,
    /// Token budgets per tenant over rolling windows (absent: no such window).
    pub tokens_per_minute: Option<u64>,
    pub tokens_per_hour: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub requests_per_minute: Option<u64>,
    /// Requests of one tenant in flight at once, across all replicas (absent: unlimited).
    pub max_concurrent: Option<u32>,
    /// Extra budgets for requests whose model matches a glob, counted separately.
    pub model_limits: Vec<ModelLimitConfig>,
    /// Shadow mode for this tier (`false`) or enforcement (`true`); absent: the top-level
    /// `enforce`.
    pub enforce: Option<bool>,
}

/// A budget that applies only to some models.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimitConfig {
    /// Model-name glob (`*` wildcards), e.g. `gpt-4o*`.
    pub pattern: String,
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    #[serde(default)]
    pub tokens_per_hour: Option<u64>,
    #[serde(default)]
    pub tokens_per_day: Option<u64>,
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
}

/// Any tier field, for one tenant; what is absent comes from the tenant's tier.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierOverride {
    pub max_input_tokens: Option<u32>,
    pub max_output_tokens: Option<u32>,
    pub output_limit: Option<OutputLimitPolicy>,
    pub default_output_tokens: Option<u32>,
    pub weight: Option<u32>,
    pub priority_band: Option<u8>,
    pub queue_max: Option<u32>,
    pub queue_deadline_ms: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub tokens_per_hour: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub requests_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    pub model_limits: Option<Vec<ModelLimitConfig>>,
    pub enforce: Option<bool>,
}

impl TierOverride {
    /// `tier` with this override's fields in place of its own.
    pub fn apply(&self, tier: &TierConfig) -> TierConfig {
        TierConfig {
            max_input_tokens: self.max_input_tokens.unwrap_or(tier.max_input_tokens),
            max_output_tokens: self.max_output_tokens.unwrap_or(tier.max_output_tokens),
            output_limit: self.output_limit.unwrap_or(tier.output_limit),
            default_output_tokens: self.default_output_tokens.or(tier.default_output_tokens),
            weight: self.weight.unwrap_or(tier.weight),
            priority_band: self.priority_band.unwrap_or(tier.priority_band),
            queue_max: self.queue_max.unwrap_or(tier.queue_max),
            queue_deadline_ms: self.queue_deadline_ms.unwrap_or(tier.queue_deadline_ms),
            tokens_per_minute: self.tokens_per_minute.or(tier.tokens_per_minute),
            tokens_per_hour: self.tokens_per_hour.or(tier.tokens_per_hour),
            tokens_per_day: self.tokens_per_day.or(tier.tokens_per_day),
            requests_per_minute: self.requests_per_minute.or(tier.requests_per_minute),
            max_concurrent: self.max_concurrent.or(tier.max_concurrent),
            model_limits: self
                .model_limits
                .clone()
                .unwrap_or_else(|| tier.model_limits.clone()),
            enforce: self.enforce.or(tier.enforce),
        }
    }
}

/// Where budgets live, and what happens when that store misbehaves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `redis://[:password@]host:port[/db]` or `rediss://` (TLS). Absent: the embedded
    /// in-memory store (budgets per replica).
    pub redis_url: Option<String>,
    /// A file holding the Redis password (a mounted Secret), instead of one in the URL.
    pub redis_password_file: Option<String>,
    /// Longest a decision waits for the store: a slow Redis must not make every request slow.
    pub timeout_ms: u64,
    /// A concurrency lease lives this long unless renewed; a crashed replica's leases free
    /// themselves within it.
    pub lease_ttl_ms: u64,
    /// How often live leases are renewed (well under the TTL).
    pub lease_renew_ms: u64,
    /// Token and request budgets when the store fails: `fail_open` (admit; the budget is not
    /// charged) or `fail_closed` (503).
    pub budgets_on_error: FailMode,
    /// Concurrency when the store fails: `fail_closed` enforces `degraded_max_concurrent` per
    /// tenant in this replica; `fail_open` admits.
    pub concurrency_on_error: FailMode,
    /// The per-replica, per-tenant concurrency cap while the store is failing.
    pub degraded_max_concurrent: u32,
    /// Consecutive store failures that open the circuit breaker (calls skip the store and take
    /// the fail modes at once) ...
    pub breaker_failures: u32,
    /// ... for this long, before one probe call tries the store again.
    pub breaker_open_ms: u64,
}

/// Replicas that share a Redis store share one in-flight budget: one limit, one controller (the
/// leader's), each replica holding a share (see `crate::fleet`). Without Redis this section is
/// unused: a lone replica owns its budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Replicas with the same store and name share a budget; another name on the same Redis
    /// is another deployment.
    pub name: String,
    /// This replica's id in the fleet; empty: the host name (the pod's name in Kubernetes)
    /// and the process id.
    pub member_id: String,
    /// How often a replica reports its load and reads its share (one Redis call, off the
    /// request path). Several per control tick, so a share moves within one tick.
    pub sync_ms: u64,
    /// A replica that has not reported for this long is dropped and its share handed on:
    /// how long a SIGKILLed replica's share stays idle. At least eight `sync_ms`.
    pub member_ttl_ms: u64,
    /// The leader's lease: a dead leader is replaced within it. At least three `sync_ms` (plus
    /// the engines' scrape timeout when they are scraped).
    pub leader_ttl_ms: u64,
    /// The budget a replica runs alone while Redis is unreachable (or the fleet runs another
    /// policy): `last_share` (the share it last held; `split` if it never held one) or `split`
    /// (the limit divided by the replicas it last saw, or `fallback_replicas` if it saw none).
    pub fallback: FleetFallback,
    /// The replicas to assume before any has been seen (Redis down at start-up).
    pub fallback_replicas: u32,
    /// Standby slots (`fleet::share`): each replica keeps a few slots free for the tenants the
    /// deployment gives all they ask, so that their next request need not wait for that
    /// replica's next release, as it would not behind one queue. This is the chance that such
    /// a request finds them all taken; the leader keeps as few as reach it. In (0, 1]; 1 keeps
    /// none.
    pub standby_miss: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetFallback {
    LastShare,
    Split,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    FailOpen,
    FailClosed,
}

/// The `mode` label of `tollgate_degraded_decisions_total`: the configured spelling.
impl crate::observe::LabelValue for FailMode {
    const ALL: &'static [FailMode] = &[FailMode::FailOpen, FailMode::FailClosed];

    fn label(self) -> &'static str {
        match self {
            FailMode::FailOpen => "fail_open",
            FailMode::FailClosed => "fail_closed",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputLimitPolicy {
    #[default]
    Reject,
    Clamp,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResponseConfig {
    /// Ask streaming upstreams for a final usage chunk (`stream_options.include_usage`).
    pub inject_stream_usage: bool,
    /// Most bytes of a non-streamed JSON response kept to read its `usage`.
    pub max_buffered_json_bytes: usize,
    /// Where Envoy does not stream the response body to tollgate but reports on it
    /// (envoy/front-proxy-reports.yaml): how long a request's end waits for Envoy's summary of
    /// the response (usage and status, sent with its access log) before it settles without one,
    /// charging the reserved output. The slot is freed at the end either way; only the
    /// settlement waits. Envoy sends the summary as the response ends (the file's access log
    /// is not batched), so this bounds a lost or delayed one. It also bounds how long a first
    /// token the summary overtook (a short body) may still come, after the settlement.
    pub summary_wait_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// The global in-flight budget at start-up (and for good, if the controller is off).
    pub initial_limit: u32,
    /// What a request costs for fairness: `requests` (1 each) or `tokens` (its worst case:
    /// input + max output), fairer when output lengths differ (seed 000).
    pub cost: FairnessCost,
    /// Tenants with a reserved share of the budget, in percent: while a tenant has demand it gets
    /// at least that share as slots free up; the rest is the unreserved pool (seed 004).
    pub reservations: BTreeMap<String, u32>,
    /// Envoy's `max_message_timeout` (ext_proc filter). A queued request asks Envoy to wait up to
    /// its deadline plus a margin, which must fit under this bound or Envoy ignores the request.
    pub envoy_max_message_timeout_ms: u64,
    /// Most bytes of request bodies that queued requests may hold at once, all tenants together:
    /// each one's body as Envoy sent it, plus tollgate's rewritten copy if it has one. A request
    /// that would take the total over it is refused at once (503) instead of waiting. A waiting
    /// request keeps its body in memory, so without a cap a deep queue of large prompts holds
    /// gigabytes; `queue_max` counts requests, not their size.
    pub max_queued_body_bytes: usize,
    /// Isolation without hand-set caps: slots held free for the steady tenants while another
    /// takes more than its own.
    pub headroom: HeadroomConfig,
}

/// A tenant beyond its weighted fair share of the budget may take a free slot only while more
/// stay free than the steady tenants are expected to need: their recent mean in flight
/// (arrival rate × hold time) plus `margin_sigmas` × its square root, and no more than their
/// arrivals need until releases refill what they take. Learned, decays when they go quiet,
/// nothing per tenant to set (`scheduler::fair`, "Headroom"). On by default: in the lab it
/// keeps seed 000's steady tenants near their baseline through bursts, long and double ones
/// included (docs/lab.md, "Isolation without caps").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeadroomConfig {
    pub enabled: bool,
    /// Time constant of each tenant's mean slots in flight: how long demand is remembered.
    pub window_ms: u64,
    /// Held slots beyond the protected tenants' mean, in standard deviations of a Poisson
    /// count (√mean). Its normal tail is also how often their arrivals may find no held slot
    /// free before the next releases refill them: 0.13 % at 3, 2.3 % at 2, 16 % at 1, and at
    /// 0 (which holds at most what they recently used and do not hold now) half the time, so
    /// at most one slot is held.
    pub margin_sigmas: f64,
    /// Pace a bursting tenant's admissions while steady tenants have demand: one start per
    /// `hold time / fair share`, the rate of a steady tenant at its share, so a burst's prompts
    /// do not all reach the engine's prefill at once (`scheduler::fair`, "Pacing a burst").
    pub pace_bursts: bool,
}

impl Default for HeadroomConfig {
    fn default() -> Self {
        HeadroomConfig {
            enabled: true,
            window_ms: 10_000,
            margin_sigmas: 3.0,
            pace_bursts: true,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FairnessCost {
    #[default]
    Requests,
    Tokens,
}

/// The AIMD controller that sizes the global budget against a p99 time-to-first-token target.
///
/// One place per concern: the defaults are `Default` below (the controller has none of its
/// own), the checks `policy::control_problems`, and `control::AimdConfig::from` the typed
/// form `Aimd::step` reads. A new knob is a field here, its default, and its check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlConfig {
    /// Off: the budget stays at `scheduler.initial_limit`.
    pub enabled: bool,
    /// Which time to first token the controller holds to a target.
    pub signal: ControlSignal,
    /// The SLO: p99 TTFT at the gateway, queue wait included. The controller's target with
    /// `signal: gateway`; with `signal: upstream`, what the dashboard and alerts hold it to.
    pub target_p99_ttft_ms: u64,
    /// The controller's target with `signal: upstream`: p99 from dispatch to first token.
    pub upstream_target_p99_ttft_ms: u64,
    pub tick_ms: u64,
    /// The p99 is taken over this sliding window.
    pub window_ms: u64,
    /// Deadband: no action while p99 is within target x (1 ± band).
    pub band: f64,
    /// Additive increase per tick (for a fixed budget, set floor = ceiling).
    pub increase_step: u32,
    /// Multiplicative decrease factor on a breach (0 < factor < 1)...
    pub decrease_factor: f64,
    /// ...or, if set, a subtractive step instead.
    pub decrease_step: Option<u32>,
    /// The budget never goes below this...
    pub floor: u32,
    /// ...nor above this.
    pub ceiling: u32,
    /// Ticks to hold after a decrease, while the window flushes samples from before it.
    pub cooldown_ticks: u32,
    /// Demand gate: grow only while peak in-flight reached this fraction of the limit, rounded
    /// up (or requests are queued), so an idle system does not drift upward.
    pub demand_fraction: f64,
    /// Until the first decrease (or engine saturation) with the budget in real use, or a
    /// window of traffic the budget covered counted from a first stream's end, each increase
    /// doubles the limit.
    pub slow_start: bool,
    /// The controller holds while the window has fewer samples than this.
    pub min_samples: u64,
    /// The engines' own load, scraped from their metrics: a signal that leads TTFT.
    pub engine: EngineMetricsConfig,
}

/// The inference engines' Prometheus endpoints, read once per controller tick. Saturated
/// engines (KV cache or waiting queue at its threshold, on average over the engines) stop the
/// budget growing and take away its headroom above what is in flight (`control::engine`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineMetricsConfig {
    /// `http://HOST:PORT/metrics` of each engine behind this gateway. Empty: the controller
    /// reads latency only.
    pub metrics_urls: Vec<String>,
    /// KV-cache usage (0 to 1) at which an engine counts as saturated.
    pub kv_cache_threshold: f64,
    /// Requests waiting inside one engine at which it counts as saturated.
    pub queue_depth_threshold: u32,
    /// A scrape not answered within this is a failed one; under `tick_ms`.
    pub scrape_timeout_ms: u64,
    /// KV-cache usage metric names, first present wins.
    pub kv_cache_usage_metrics: Vec<String>,
    /// Waiting-queue metric names, first present wins.
    pub waiting_metrics: Vec<String>,
}

/// What the controller measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlSignal {
    /// From the moment the request got its slot to the first response byte: the upstream's
    /// latency alone, which the budget drives.
    #[default]
    Upstream,
    /// From request arrival to the first response byte, queue wait included (seed 001).
    Gateway,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// After SIGTERM, how long admitted streams may keep being observed before tollgate lets
    /// Envoy carry on without it. Keep it under the pod's terminationGracePeriodSeconds.
    pub drain_deadline_ms: u64,
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            grpc_addr: "0.0.0.0:50051".to_owned(),
            admin_addr: "0.0.0.0:9464".to_owned(),
        }
    }
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            user_header: "x-user-id".to_owned(),
            tier_header: "x-user-tier".to_owned(),
            api_keys: Vec::new(),
        }
    }
}

impl Default for RoutesConfig {
    fn default() -> Self {
        RoutesConfig {
            inference_paths: vec![
                "/v1/chat/completions".to_owned(),
                "/v1/completions".to_owned(),
            ],
            completions_suffix: "/completions".to_owned(),
        }
    }
}

impl Default for TokensConfig {
    fn default() -> Self {
        TokensConfig {
            encodings: Vec::new(),
            per_message: 3,
            per_name: 1,
            reply_priming: 3,
            per_image: 765,
            max_body_bytes: 8 * 1024 * 1024,
            large_body_threads: 0,
            large_body_max_wait_ms: 500,
        }
    }
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            max_input_tokens: 16_000,
            max_output_tokens: 4_096,
            output_limit: OutputLimitPolicy::Reject,
            default_output_tokens: None,
            weight: 1,
            priority_band: 0,
            queue_max: 2,
            queue_deadline_ms: 1_000,
            tokens_per_minute: None,
            tokens_per_hour: None,
            tokens_per_day: None,
            requests_per_minute: None,
            max_concurrent: None,
            model_limits: Vec::new(),
            enforce: None,
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            redis_url: None,
            redis_password_file: None,
            timeout_ms: 50,
            lease_ttl_ms: 30_000,
            lease_renew_ms: 10_000,
            budgets_on_error: FailMode::FailOpen,
            concurrency_on_error: FailMode::FailClosed,
            degraded_max_concurrent: 1,
            breaker_failures: 5,
            breaker_open_ms: 5_000,
        }
    }
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            name: "tollgate".to_owned(),
            member_id: String::new(),
            // Five per default control tick: freeing an idle replica's share takes two syncs
            // (it must confirm the smaller share before another may grow) and the leader's
            // next one, so a share moves within one 1 s tick.
            sync_ms: 200,
            // Ten syncs: a replica that misses a few (a GC pause in Redis, a slow network) is
            // not dropped; a dead one's share is idle for at most 2 s.
            member_ttl_ms: 2_000,
            // Two ticks: "a dead leader is replaced within two ticks".
            leader_ttl_ms: 2_000,
            fallback: FleetFallback::LastShare,
            fallback_replicas: 1,
            standby_miss: 0.05,
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            initial_limit: 128,
            cost: FairnessCost::Requests,
            reservations: BTreeMap::new(),
            envoy_max_message_timeout_ms: 30_000,
            max_queued_body_bytes: 256 * 1024 * 1024,
            headroom: HeadroomConfig::default(),
        }
    }
}

/// Start at 128 within [32, 256], ±20 % deadband, ×0.9 cuts: seed 001's final configuration.
/// What differs from it, and why (docs/lab.md, "the controller's signal"): the controller
/// holds the *upstream's* p99 TTFT (from dispatch) to 1 s, not the gateway's to 2 s, so queue
/// wait cannot feed back into the budget; it ticks every second over a 10 s window, with no
/// cooldown (the window restarts at each cut instead); it doubles until the first breach; and
/// it waits for 10 samples. Seed 001's settings are `signal: gateway`, `tick_ms: 5000`,
/// `window_ms: 30000`, `cooldown_ticks: 3`, `slow_start: false`, `min_samples: 1` (on
/// tollgate's rules: cuts from what is in flight, overdue requests counted).
impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            enabled: true,
            signal: ControlSignal::Upstream,
            // Seed 001's SLO and deadband.
            target_p99_ttft_ms: 2_000,
            upstream_target_p99_ttft_ms: 1_000,
            tick_ms: 1_000,
            window_ms: 10_000,
            band: 0.2,
            increase_step: 1,
            // 0.9, not seed 001's original 0.5. Halving went 64 → 32 → 16 in three ticks,
            // each tick reacting to the last overcorrection; the author's verdict was that the
            // factor, not multiplication, was the problem, and that 0.8-0.9 would have worked.
            // The gentle end because cuts come in pairs: p99 over a 30 s window keeps a breach
            // visible for six 5 s ticks, so a 3-tick cooldown usually lets a second cut happen
            // before the window has flushed; 0.9² ≈ 0.81 per breach lands in that range, where
            // 0.8² ≈ 0.64 would be most of a halving again. It is also concurrency-limits'
            // AIMD default backoff ratio. Multiplicative rather than a step because the budget
            // spans an order of magnitude (floor to ceiling), and a cut should scale with it.
            decrease_factor: 0.9,
            decrease_step: None,
            // Seed 001's floor was 16 per worker with 2 workers; the U-curve's left arm. It is
            // hardware- and model-shaped: measure it.
            floor: 32,
            ceiling: 256,
            // Seed 001: 3 ticks (15 s at a 5 s tick) after each decrease; here the window
            // restarts at each cut instead.
            cooldown_ticks: 0,
            // 0.8: climb only while the budget's busiest moment used at least 80% of it,
            // i.e. keep the limit within about 1.25× (plus one step) of the concurrency the
            // latency signal has actually vouched for. concurrency-limits uses 0.5, which lets
            // the limit run to twice what traffic tested; past vLLM's KV-cache knee TTFT
            // explodes, so a burst admitted into an untested 2× headroom lands in preemption.
            // Not 1.0: the peak is sampled from a noisy arrival process and a tight queue is
            // usually empty (seed 001 §3), so requiring the limit to be hit exactly would stall
            // the climb just under the operating point. Anything queued counts as demand
            // regardless.
            demand_fraction: 0.8,
            // Seed 001's controller had neither; they come on together with the upstream
            // signal they were measured with.
            slow_start: true,
            min_samples: 10,
            engine: EngineMetricsConfig::default(),
        }
    }
}

impl Default for EngineMetricsConfig {
    fn default() -> Self {
        EngineMetricsConfig {
            metrics_urls: Vec::new(),
            // Over the Inference Extension's 0.8: vLLM runs its KV cache nearly full by design,
            // and in the lab the best static budget held it at 0.84-0.95 with no preemption.
            // 0.9 still stops the cold start's climb (docs/lab.md).
            kv_cache_threshold: 0.9,
            // The Inference Extension's saturation detector's default.
            queue_depth_threshold: 5,
            scrape_timeout_ms: 250,
            // vLLM V1's name, then the one older vLLM serves (deprecated in V1).
            kv_cache_usage_metrics: vec![
                "vllm:kv_cache_usage_perc".to_owned(),
                "vllm:gpu_cache_usage_perc".to_owned(),
            ],
            waiting_metrics: vec!["vllm:num_requests_waiting".to_owned()],
        }
    }
}

impl Default for ResponseConfig {
    fn default() -> Self {
        ResponseConfig {
            inject_stream_usage: true,
            max_buffered_json_bytes: 1024 * 1024,
            summary_wait_ms: 2000,
        }
    }
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            drain_deadline_ms: 20_000,
        }
    }
}

/// The built-in tiers, from seeds 001 and 003: free, standard, premium with weights 1, 2, 4
/// and 100,000 / 200,000 / 500,000 tokens per rolling hour, 3 concurrent requests per user;
/// paying tiers queue up to 8 requests for 2 s, free ones 2 for 1 s. Requests without a tier
/// are free.
pub fn default_tiers() -> BTreeMap<String, TierConfig> {
    let tier = |weight, tokens_per_hour, paying: bool| TierConfig {
        weight,
        queue_max: if paying { 8 } else { 2 },
        queue_deadline_ms: if paying { 2_000 } else { 1_000 },
        tokens_per_hour: Some(tokens_per_hour),
        max_concurrent: Some(3),
        ..TierConfig::default()
    };
    BTreeMap::from([
        ("free".to_owned(), tier(1, 100_000, false)),
        ("standard".to_owned(), tier(2, 200_000, true)),
        ("premium".to_owned(), tier(4, 500_000, true)),
    ])
}

/// Built-in defaults: what `tollgate` with no arguments runs.
impl Default for Config {
    fn default() -> Self {
        Config {
            listen: ListenConfig::default(),
            identity: IdentityConfig::default(),
            routes: RoutesConfig::default(),
            tokens: TokensConfig::default(),
            default_tier: "free".to_owned(),
            tiers: default_tiers(),
            response: ResponseConfig::default(),
            scheduler: SchedulerConfig::default(),
            control: ControlConfig::default(),
            tenants: BTreeMap::new(),
            store: StoreConfig::default(),
            fleet: FleetConfig::default(),
            shutdown: ShutdownConfig::default(),
            enforce: true,
            admin: AdminConfig::default(),
            reload: ReloadConfig::default(),
        }
    }
}

/// A configuration that cannot be used. The message names the field and the value.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl From<config::ConfigError> for ConfigError {
    fn from(e: config::ConfigError) -> Self {
        ConfigError(e.to_string())
    }
}

/// tokio's own variable for a runtime's worker count. The runtime's threads are not in the file:
/// `tollgate --worker-threads`, else this variable, else tokio's default (the CPUs the process
/// may use).
pub const TOKIO_WORKER_THREADS: &str = "TOKIO_WORKER_THREADS";

/// The most runtime threads `--worker-threads` or `TOKIO_WORKER_THREADS` may ask for: far above
/// any core count tollgate is given, far below a count that exhausts the process's threads.
pub const MAX_WORKER_THREADS: u16 = 1024;

/// The count `TOKIO_WORKER_THREADS` asks for, given its value (`None`: unset, tokio's default).
/// A value that is not a count from 1 to `MAX_WORKER_THREADS` is an error: tokio, which reads
/// the variable itself when no count is set in code, would panic on 0 or on what is not a
/// number, and would start as many threads as any larger count asks.
pub fn worker_threads_variable(
    value: Option<&std::ffi::OsStr>,
) -> Result<Option<u16>, ConfigError> {
    let Some(value) = value else {
        return Ok(None);
    };
    match value.to_str().map(str::parse::<u16>) {
        Some(Ok(threads)) if (1..=MAX_WORKER_THREADS).contains(&threads) => Ok(Some(threads)),
        _ => Err(ConfigError(format!(
            "{TOKIO_WORKER_THREADS}: {value:?} is not a number of threads from 1 to \
             {MAX_WORKER_THREADS}"
        ))),
    }
}

/// Loads defaults, then `file` (if any), then `TOLLGATE__*` variables from `env`.
///
/// `env` is passed in (rather than read here) so tests can inject variables without touching
/// the process environment.
pub fn load(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let mut builder = config::Config::builder();
    if let Some(path) = file {
        if !path.is_file() {
            return Err(ConfigError(format!(
                "config file {}: not found or not a file",
                path.display()
            )));
        }
        builder = builder.add_source(
            config::File::from(path)
                .format(config::FileFormat::Yaml)
                .required(true),
        );
    }
    let env: config::Map<String, String> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("TOLLGATE__"))
        .collect();
    builder = builder.add_source(
        config::Environment::with_prefix("TOLLGATE")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("routes.inference_paths")
            .source(Some(env)),
    );
    Ok(builder.build()?.try_deserialize()?)
}

#[cfg(test)]
mod tests;
