//! The validated, typed form of the configuration that deciding code reads.
//!
//! `Policy::from_config` is the only place that judges whether a configuration makes sense;
//! after it, every tier reference is an index and every limit is known to be usable, so the
//! request path never has to handle a malformed policy.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use std::time::Duration;

use crate::budget::{Quantity, WindowLimit};
use crate::config::{
    Config, ConfigError, ControlConfig, ControlSignal, FairnessCost, FleetConfig,
    OutputLimitPolicy, StoreConfig, TierConfig,
};
use crate::observe::MetricLabels;
use crate::reply::Reason;
use crate::scheduler::Headroom;
use crate::tokens::{Encoding, ModelRule, ModelVocabulary};

/// Index of a tier in `Policy::tiers`; also the index of its pre-created metric series.
pub type TierId = usize;

#[derive(Clone, Debug)]
pub struct Policy {
    pub tiers: Vec<Tier>,
    pub default_tier: TierId,
    tier_by_name: HashMap<String, TierId>,
    pub identity: IdentityPolicy,
    pub inference_paths: Vec<String>,
    pub completions_suffix: String,
    pub counting: CountingPolicy,
    pub inject_stream_usage: bool,
    pub max_buffered_json_bytes: usize,
    /// How long a request's end waits for Envoy's summary of its response.
    pub summary_wait: Duration,
    pub scheduling: SchedulingPolicy,
    pub control: ControlConfig,
    /// Tenant → every tier with the tenant's override applied, indexed like `tiers`.
    overrides: HashMap<String, Vec<Tier>>,
    pub store: StoreConfig,
    pub fleet: FleetConfig,
    /// What replicas must agree on to share a budget (`policy_hash`).
    pub hash: String,
    /// The configuration this policy was built from, for the admin API's `/v1/policy` and for
    /// telling a reload which settings it changed.
    pub source: Arc<Config>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tier {
    pub name: String,
    pub max_input_tokens: u32,
    pub max_output_tokens: u32,
    pub output_limit: OutputLimitPolicy,
    pub default_output_tokens: u32,
    pub weight: u32,
    pub priority_band: u8,
    pub queue_max: u32,
    pub queue_deadline: Duration,
    /// Rolling windows every request of this tier counts against; shared with each request's
    /// reservation, so a request that matches no model limit copies nothing.
    pub windows: Arc<[WindowLimit]>,
    /// Extra windows for models matching a glob.
    pub model_windows: Vec<(String, Vec<WindowLimit>)>,
    pub max_concurrent: Option<u32>,
    /// Refusals are enforced; `false` is shadow mode (counted, logged, let through). Resolved:
    /// the tenant's override, else the tier's, else the top level's.
    pub enforce: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulingPolicy {
    pub initial_limit: u32,
    pub cost: FairnessCost,
    /// Tenant → reserved percent of the budget.
    pub reservations: HashMap<String, u32>,
    pub envoy_max_message_timeout: Duration,
    /// Cap on the body bytes held by queued requests (see `SchedulerConfig`).
    pub max_queued_body_bytes: usize,
    /// `None` when `scheduler.headroom.enabled` is off.
    pub headroom: Option<Headroom>,
}

#[derive(Clone, Debug)]
pub struct IdentityPolicy {
    /// Lowercase; empty when header identity is off.
    pub user_header: String,
    pub tier_header: String,
    api_keys: HashMap<[u8; 32], ApiKeyOwner>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKeyOwner {
    pub tenant: String,
    pub tier: TierId,
}

#[derive(Clone, Debug)]
pub struct CountingPolicy {
    pub encodings: Vec<ModelRule>,
    /// The models' own tokenizers the rules loaded, for the start-up log and `check-config`.
    pub tokenizers: Vec<LoadedTokenizer>,
    pub per_message: u32,
    pub per_name: u32,
    pub reply_priming: u32,
    pub per_image: u32,
    pub max_body_bytes: usize,
    /// How long a large body may wait for a thread to count it (`tokens.large_body_max_wait_ms`).
    pub large_body_max_wait: Duration,
}

/// A model's own tokenizer, as loaded.
#[derive(Clone, Debug)]
pub struct LoadedTokenizer {
    pub pattern: String,
    pub vocabulary: &'static ModelVocabulary,
    /// How much the process's resident memory grew while it was built (the first time: a later
    /// policy loading the same files reuses it and reports the same); `None` where that cannot
    /// be read.
    pub resident_bytes: Option<u64>,
}

impl std::fmt::Display for LoadedTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tokens.encodings {:?}: {} ({} BPE entries{}; ",
            self.pattern,
            self.vocabulary.source(),
            self.vocabulary.vocabulary_size(),
            if self.vocabulary.template().is_some() {
                ", with its chat template"
            } else {
                ""
            },
        )?;
        // An operator whose model is not on the fast path should know why it counts slower.
        match self.vocabulary.known_pre_tokenizer() {
            Some(name) => write!(
                f,
                "{name}'s pre-tokenizer: ASCII text cut without its regex"
            ),
            None => write!(
                f,
                "a pre-tokenizer tollgate has no fast cut for: its regex cuts all text, the \
                 slower way"
            ),
        }?;
        write!(f, "), ")?;
        match self.resident_bytes {
            // The growth includes the parsed file's freed buffers: an upper bound on what it keeps.
            Some(bytes) => write!(
                f,
                "at most {:.1} MiB (resident memory grew that much while it was built)",
                bytes as f64 / (1 << 20) as f64
            ),
            None => write!(f, "memory not measured (no /proc/self/status)"),
        }
    }
}

/// How much longer than a queued request's deadline tollgate asks Envoy to wait, so tollgate's
/// own 503 always beats Envoy's message timeout (a 504 with no body).
pub const ENVOY_TIMEOUT_MARGIN: Duration = Duration::from_millis(500);

/// Weights above this make one tenant's share indistinguishable from all of it.
const MAX_WEIGHT: u32 = 10_000;
/// The most threads tokio runs for blocking work by default (`max_blocking_threads`), which
/// tollgate's runtime keeps.
pub const MAX_LARGE_BODY_THREADS: u32 = 512;

impl Tier {
    /// The windows a request for `model` counts against: the tier's own, then those of the
    /// model limits whose glob matches.
    pub fn windows_for(&self, model: &str) -> Arc<[WindowLimit]> {
        let mut matching = self
            .model_windows
            .iter()
            .filter(|(pattern, _)| crate::tokens::glob_match(pattern, model))
            .peekable();
        if matching.peek().is_none() {
            return self.windows.clone();
        }
        let mut windows = self.windows.to_vec();
        for (_, extra) in matching {
            windows.extend(extra.iter().cloned());
        }
        windows.into()
    }
}

/// Token ceilings above this are almost certainly a typo (no model takes or generates ten
/// million tokens in one request) and would make budget arithmetic meaningless.
const MAX_SANE_TOKENS: u32 = 10_000_000;

impl Policy {
    pub fn from_config(config: &Config) -> Result<Policy, ConfigError> {
        let mut problems = Vec::new();
        if config.tiers.is_empty() {
            problems.push("tiers: at least one tier is required".to_owned());
        }
        let mut tiers = Vec::with_capacity(config.tiers.len());
        let mut tier_by_name = HashMap::new();
        for (name, tier) in &config.tiers {
            if !valid_name(name) {
                problems.push(format!(
                    "tiers.{name}: tier names are 1-64 characters of [a-z0-9_-]"
                ));
            }
            tier_by_name.insert(name.clone(), tiers.len());
            tiers.push(build_tier(
                name,
                tier,
                config,
                &format!("tiers.{name}"),
                &mut problems,
            ));
        }
        // Each overridden tenant gets a full copy of every tier with its override applied, so
        // the request path resolves a tenant's limits with one hash lookup.
        let mut overrides = HashMap::new();
        for (tenant, tier_override) in &config.tenants {
            let resolved = config
                .tiers
                .iter()
                .map(|(name, tier)| {
                    let field = format!("tenants.{tenant} (over tier {name})");
                    build_tier(
                        name,
                        &tier_override.apply(tier),
                        config,
                        &field,
                        &mut problems,
                    )
                })
                .collect::<Vec<_>>();
            overrides.insert(tenant.clone(), resolved);
        }
        let default_tier = match tier_by_name.get(&config.default_tier) {
            Some(&id) => id,
            None => {
                problems.push(format!(
                    "default_tier: {:?} is not one of the tiers ({})",
                    config.default_tier,
                    config.tiers.keys().cloned().collect::<Vec<_>>().join(", ")
                ));
                0
            }
        };

        let mut api_keys = HashMap::new();
        for (i, key) in config.identity.api_keys.iter().enumerate() {
            let field = format!("identity.api_keys[{i}]");
            let Some(hash) = parse_sha256(&key.sha256) else {
                problems.push(format!(
                    "{field}.sha256: {:?} is not 64 lowercase hex digits (store the SHA-256 of the key, never the key)",
                    key.sha256
                ));
                continue;
            };
            if key.tenant.is_empty() {
                problems.push(format!("{field}.tenant: must not be empty"));
            }
            let tier = match &key.tier {
                None => default_tier,
                Some(name) => match tier_by_name.get(name) {
                    Some(&id) => id,
                    None => {
                        problems.push(format!("{field}.tier: {name:?} is not one of the tiers"));
                        continue;
                    }
                },
            };
            let owner = ApiKeyOwner {
                tenant: key.tenant.clone(),
                tier,
            };
            if api_keys.insert(hash, owner).is_some() {
                problems.push(format!("{field}.sha256: the same key hash appears twice"));
            }
        }
        for (field, value) in [
            ("identity.user_header", &config.identity.user_header),
            ("identity.tier_header", &config.identity.tier_header),
        ] {
            if !value.is_empty() && !valid_header_name(value) {
                problems.push(format!("{field}: {value:?} is not a valid header name"));
            }
        }
        if config.identity.user_header.is_empty() && config.identity.api_keys.is_empty() {
            problems.push(
                "identity: user_header is empty and there are no api_keys, so no request could ever be identified"
                    .to_owned(),
            );
        }

        if config.routes.completions_suffix.is_empty() {
            problems.push(
                "routes.completions_suffix: must not be empty (every route would parse as completions)"
                    .to_owned(),
            );
        }
        if config.routes.inference_paths.is_empty() {
            problems.push("routes.inference_paths: at least one path is required".to_owned());
        }
        for (i, path) in config.routes.inference_paths.iter().enumerate() {
            if !path.starts_with('/') || path.contains('?') {
                problems.push(format!(
                    "routes.inference_paths[{i}]: {path:?} must start with '/' and carry no query"
                ));
            }
        }
        let mut encodings = Vec::with_capacity(config.tokens.encodings.len());
        let mut tokenizers = Vec::new();
        for (i, rule) in config.tokens.encodings.iter().enumerate() {
            if rule.pattern.is_empty() {
                problems.push(format!("tokens.encodings[{i}].pattern: must not be empty"));
            }
            match files::resolve_encoding(rule) {
                Ok((encoding, loaded)) => {
                    encodings.push(ModelRule {
                        pattern: rule.pattern.clone(),
                        encoding,
                    });
                    tokenizers.extend(loaded);
                }
                Err(problem) => problems.push(format!("tokens.encodings[{i}]{problem}")),
            }
        }
        if config.tokens.max_body_bytes == 0 {
            problems.push("tokens.max_body_bytes: must be positive".to_owned());
        }
        // Longer and Envoy has given up, even where a route sets its timeout to the most.
        let envoy_bound = config.scheduler.envoy_max_message_timeout_ms;
        if !(1..=envoy_bound).contains(&config.tokens.large_body_max_wait_ms) {
            problems.push(format!(
                "tokens.large_body_max_wait_ms: {} must be between 1 and \
                 scheduler.envoy_max_message_timeout_ms ({envoy_bound})",
                config.tokens.large_body_max_wait_ms
            ));
        }
        // tokio runs at most 512 blocking threads: more would wait in its own unbounded queue.
        if config.tokens.large_body_threads > MAX_LARGE_BODY_THREADS {
            problems.push(format!(
                "tokens.large_body_threads: {} is over {MAX_LARGE_BODY_THREADS}, the most \
                 threads the runtime runs for blocking work",
                config.tokens.large_body_threads
            ));
        }
        if config.response.max_buffered_json_bytes == 0 {
            problems.push("response.max_buffered_json_bytes: must be positive".to_owned());
        }
        // Longer would hold a finished request's budget open for minutes on a lost report.
        if !(1..=60_000).contains(&config.response.summary_wait_ms) {
            problems.push("response.summary_wait_ms: must be between 1 and 60000".to_owned());
        }
        for (field, addr) in [
            ("listen.grpc_addr", &config.listen.grpc_addr),
            ("listen.admin_addr", &config.listen.admin_addr),
        ] {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                problems.push(format!("{field}: {addr:?} is not an IP:port address"));
            }
        }

        let scheduler = &config.scheduler;
        if scheduler.initial_limit == 0 {
            problems.push("scheduler.initial_limit: must be at least 1".to_owned());
        }
        let mut reserved_total = 0u64;
        for (tenant, &percent) in &scheduler.reservations {
            if !(1..=100).contains(&percent) {
                problems.push(format!(
                    "scheduler.reservations.{tenant}: {percent} is not a percentage in 1..=100"
                ));
            }
            reserved_total += u64::from(percent);
        }
        if reserved_total > 100 {
            problems.push(format!(
                "scheduler.reservations: the shares add up to {reserved_total}%, over 100%"
            ));
        }
        let headroom = &scheduler.headroom;
        if headroom.window_ms == 0 {
            problems.push("scheduler.headroom.window_ms: must be at least 1".to_owned());
        }
        if !(headroom.margin_sigmas.is_finite() && (0.0..=10.0).contains(&headroom.margin_sigmas)) {
            problems.push(format!(
                "scheduler.headroom.margin_sigmas: {} is not in 0..=10",
                headroom.margin_sigmas
            ));
        }
        if scheduler.max_queued_body_bytes < config.tokens.max_body_bytes {
            problems.push(format!(
                "scheduler.max_queued_body_bytes: {} is less than tokens.max_body_bytes ({}), so \
                 a request with the largest body tollgate accepts could never wait for a slot",
                scheduler.max_queued_body_bytes, config.tokens.max_body_bytes
            ));
        }
        problems.extend(control_problems(&config.control));
        problems.extend(store_problems(&config.store));
        problems.extend(fleet_problems(&config.fleet, &config.control));

        if !problems.is_empty() {
            return Err(ConfigError(problems.join("\n")));
        }
        Ok(Policy {
            tiers,
            default_tier,
            tier_by_name,
            identity: IdentityPolicy {
                user_header: config.identity.user_header.to_ascii_lowercase(),
                tier_header: config.identity.tier_header.to_ascii_lowercase(),
                api_keys,
            },
            inference_paths: config.routes.inference_paths.clone(),
            completions_suffix: config.routes.completions_suffix.clone(),
            counting: CountingPolicy {
                encodings,
                tokenizers,
                per_message: config.tokens.per_message,
                per_name: config.tokens.per_name,
                reply_priming: config.tokens.reply_priming,
                per_image: config.tokens.per_image,
                max_body_bytes: config.tokens.max_body_bytes,
                large_body_max_wait: Duration::from_millis(config.tokens.large_body_max_wait_ms),
            },
            inject_stream_usage: config.response.inject_stream_usage,
            max_buffered_json_bytes: config.response.max_buffered_json_bytes,
            summary_wait: Duration::from_millis(config.response.summary_wait_ms),
            scheduling: SchedulingPolicy {
                initial_limit: scheduler.initial_limit,
                cost: scheduler.cost,
                reservations: scheduler
                    .reservations
                    .iter()
                    .map(|(k, v)| (k.clone(), *v))
                    .collect(),
                envoy_max_message_timeout: Duration::from_millis(
                    scheduler.envoy_max_message_timeout_ms,
                ),
                max_queued_body_bytes: scheduler.max_queued_body_bytes,
                headroom: scheduler.headroom.enabled.then(|| Headroom {
                    window: Duration::from_millis(scheduler.headroom.window_ms),
                    sigmas: scheduler.headroom.margin_sigmas,
                    pace: scheduler.headroom.pace_bursts,
                }),
            },
            control: config.control.clone(),
            overrides,
            store: config.store.clone(),
            fleet: config.fleet.clone(),
            hash: policy_hash(config),
            source: Arc::new(config.clone()),
        })
    }

    /// Settings that are valid but do nothing in this configuration, each named with why: a
    /// configuration someone believes is in force and is not deserves a word at start-up and
    /// from `check-config`, though not a refusal (turning the controller off for a while
    /// should not mean deleting its settings).
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.store.redis_url.is_none() && self.fleet != FleetConfig::default() {
            warnings.push(
                "fleet.* is set but store.redis_url is not: replicas share a budget only \
                 through Redis, so this replica owns its whole budget alone"
                    .to_owned(),
            );
        }
        if !self.control.enabled && !self.control.engine.metrics_urls.is_empty() {
            warnings.push(
                "control.engine.metrics_urls is set but control.enabled is false: the \
                 controller's tick is what scrapes the engines, so they are not read and the \
                 in-flight budget stays at scheduler.initial_limit"
                    .to_owned(),
            );
        }
        warnings
    }

    /// This policy with `control` in place of its controller settings (a run-time change), or
    /// every problem that makes, each naming its field as the file would.
    pub fn with_control(&self, control: ControlConfig) -> Result<Policy, Vec<String>> {
        let mut problems = control_problems(&control);
        problems.extend(fleet_problems(&self.fleet, &control));
        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(Policy {
            control,
            ..self.clone()
        })
    }

    /// The limits that apply to `tenant` in `tier`: the tier's, or the tenant's override of it.
    pub fn tier_for(&self, tenant: &str, tier: TierId) -> &Tier {
        match self.overrides.get(tenant) {
            Some(tiers) => &tiers[tier],
            None => &self.tiers[tier],
        }
    }

    /// The tier of `tenant`'s API key, if it has one, else the default tier: where a lookup
    /// that names no tier finds the tenant.
    pub fn tier_of_tenant(&self, tenant: &str) -> TierId {
        self.identity
            .api_keys
            .values()
            .find(|owner| owner.tenant == tenant)
            .map_or(self.default_tier, |owner| owner.tier)
    }

    pub fn tier_named(&self, name: &str) -> Option<TierId> {
        self.tier_by_name.get(name).copied()
    }

    pub fn encoding_for(&self, model: &str) -> Encoding {
        crate::tokens::encoding_for(model, &self.counting.encodings)
    }
}

/// What the metrics are labelled by: this policy's tiers (a `TierId` is their index), and the
/// service's bounded enums. `Metrics::new(&policy)`.
impl MetricLabels for Policy {
    type Reason = Reason;
    type Action = crate::control::Action;
    type FailMode = crate::config::FailMode;
    type StoreError = crate::budget::StoreError;

    fn tier_names(&self) -> Vec<&str> {
        self.tiers.iter().map(|tier| tier.name.as_str()).collect()
    }
}

impl IdentityPolicy {
    pub fn has_api_keys(&self) -> bool {
        !self.api_keys.is_empty()
    }

    /// Looks a presented key up by its hash; the key itself is never stored.
    pub fn owner_of_key(&self, key: &[u8]) -> Option<&ApiKeyOwner> {
        let hash: [u8; 32] = Sha256::digest(key).into();
        self.api_keys.get(&hash)
    }
}

/// One tier's validated form; problems are reported under `field`.
fn build_tier(
    name: &str,
    tier: &TierConfig,
    config: &Config,
    field: &str,
    problems: &mut Vec<String>,
) -> Tier {
    for (key, value) in [
        ("max_input_tokens", tier.max_input_tokens),
        ("max_output_tokens", tier.max_output_tokens),
    ] {
        if value == 0 || value > MAX_SANE_TOKENS {
            problems.push(format!(
                "{field}.{key}: {value} is out of range 1..={MAX_SANE_TOKENS}"
            ));
        }
    }
    let default_output_tokens = tier.default_output_tokens.unwrap_or(tier.max_output_tokens);
    if default_output_tokens == 0 || default_output_tokens > tier.max_output_tokens {
        problems.push(format!(
            "{field}.default_output_tokens: {default_output_tokens} must be between 1 and \
             {field}.max_output_tokens ({})",
            tier.max_output_tokens
        ));
    }
    if tier.weight == 0 || tier.weight > MAX_WEIGHT {
        problems.push(format!(
            "{field}.weight: {} is out of range 1..={MAX_WEIGHT}",
            tier.weight
        ));
    }
    let envoy_bound = config.scheduler.envoy_max_message_timeout_ms;
    let margin = ENVOY_TIMEOUT_MARGIN.as_millis() as u64;
    if tier.queue_deadline_ms == 0 || tier.queue_deadline_ms.saturating_add(margin) > envoy_bound {
        problems.push(format!(
            "{field}.queue_deadline_ms: {} must be positive and, plus {margin} ms of margin, \
             within scheduler.envoy_max_message_timeout_ms ({envoy_bound}), or Envoy would time \
             the request out first",
            tier.queue_deadline_ms
        ));
    }
    if tier.max_concurrent == Some(0) {
        problems.push(format!(
            "{field}.max_concurrent: 0 would refuse every request; leave it out for no limit"
        ));
    }
    // The largest request the hard limits let through; a token budget below it would refuse
    // such a request forever, which is a contradiction, not a policy.
    let largest_request = u64::from(tier.max_input_tokens) + u64::from(tier.max_output_tokens);
    let windows = budget_windows(
        "",
        [
            (tier.tokens_per_minute, "tokens_per_minute"),
            (tier.tokens_per_hour, "tokens_per_hour"),
            (tier.tokens_per_day, "tokens_per_day"),
            (tier.requests_per_minute, "requests_per_minute"),
        ],
        field,
        largest_request,
        problems,
    );
    let model_windows = tier
        .model_limits
        .iter()
        .enumerate()
        .map(|(i, limit)| {
            if limit.pattern.is_empty() {
                problems.push(format!(
                    "{field}.model_limits[{i}].pattern: must not be empty"
                ));
            }
            let windows = budget_windows(
                &format!("model{i}_"),
                [
                    (limit.tokens_per_minute, "tokens_per_minute"),
                    (limit.tokens_per_hour, "tokens_per_hour"),
                    (limit.tokens_per_day, "tokens_per_day"),
                    (limit.requests_per_minute, "requests_per_minute"),
                ],
                &format!("{field}.model_limits[{i}]"),
                largest_request,
                problems,
            );
            (limit.pattern.clone(), windows)
        })
        .collect();
    Tier {
        name: name.to_owned(),
        max_input_tokens: tier.max_input_tokens,
        max_output_tokens: tier.max_output_tokens,
        output_limit: tier.output_limit,
        default_output_tokens,
        weight: tier.weight,
        priority_band: tier.priority_band,
        queue_max: tier.queue_max,
        queue_deadline: Duration::from_millis(tier.queue_deadline_ms),
        windows: windows.into(),
        model_windows,
        max_concurrent: tier.max_concurrent,
        enforce: tier.enforce.unwrap_or(config.enforce),
    }
}

/// Rolling windows from `(limit, field name)` pairs: a minute in 5 s buckets, an hour in 1 min
/// buckets, a day in 15 min buckets, so usage rolls off in small steps rather than resetting.
fn budget_windows(
    prefix: &str,
    limits: [(Option<u64>, &str); 4],
    field: &str,
    largest_request: u64,
    problems: &mut Vec<String>,
) -> Vec<WindowLimit> {
    let mut windows = Vec::new();
    for (limit, key) in limits {
        let Some(limit) = limit else { continue };
        let (quantity, name, window_ms, bucket_ms) = match key {
            "tokens_per_minute" => (Quantity::Tokens, "tokens_minute", 60_000, 5_000),
            "tokens_per_hour" => (Quantity::Tokens, "tokens_hour", 3_600_000, 60_000),
            "tokens_per_day" => (Quantity::Tokens, "tokens_day", 86_400_000, 900_000),
            _ => (Quantity::Requests, "requests_minute", 60_000, 5_000),
        };
        if limit == 0 {
            problems.push(format!(
                "{field}.{key}: 0 would refuse every request; leave it out for no limit"
            ));
        } else if quantity == Quantity::Tokens && limit < largest_request {
            problems.push(format!(
                "{field}.{key}: {limit} is below the largest request the tier admits \
                 (max_input_tokens + max_output_tokens = {largest_request}), which could then \
                 never pass"
            ));
        }
        windows.push(WindowLimit {
            name: format!("{prefix}{name}"),
            quantity,
            window_ms,
            bucket_ms,
            limit,
        });
    }
    windows
}

fn store_problems(store: &StoreConfig) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(url) = &store.redis_url
        && !(url.starts_with("redis://") || url.starts_with("rediss://"))
    {
        problems.push(format!(
            "store.redis_url: {url:?} must start with redis:// or rediss://"
        ));
    }
    if store.timeout_ms == 0 {
        problems.push("store.timeout_ms: must be positive".to_owned());
    }
    if store.lease_ttl_ms == 0
        || store.lease_renew_ms == 0
        || store.lease_renew_ms > store.lease_ttl_ms / 2
    {
        problems.push(format!(
            "store.lease_renew_ms: {} must be positive and at most half of store.lease_ttl_ms ({}), \
             so one missed renewal does not expire a live lease",
            store.lease_renew_ms, store.lease_ttl_ms
        ));
    }
    if store.breaker_failures == 0 {
        problems.push("store.breaker_failures: must be at least 1".to_owned());
    }
    problems
}

fn fleet_problems(fleet: &FleetConfig, control: &ControlConfig) -> Vec<String> {
    let mut problems = Vec::new();
    if fleet.name.is_empty()
        || fleet.name.len() > 64
        || fleet.name.contains(['{', '}'])
        || fleet.name.chars().any(char::is_whitespace)
    {
        problems.push(format!(
            "fleet.name: {:?} must be 1-64 characters without braces or spaces (it is the \
             Redis Cluster hash tag of the fleet's keys)",
            fleet.name
        ));
    }
    if fleet.sync_ms == 0 {
        problems.push("fleet.sync_ms: must be positive".to_owned());
    }
    // A failing sync takes up to a sync period to time out, and the next starts a period later:
    // three failures (`fleet::FAILURES_BEFORE_FALLBACK`) take up to six periods, and the
    // replica must fall back to its own budget before the others drop it and hand its share on.
    if fleet.member_ttl_ms < fleet.sync_ms.saturating_mul(8) {
        problems.push(format!(
            "fleet.member_ttl_ms: {} must be at least eight fleet.sync_ms ({}), so a replica \
             whose syncs fail falls back to its own budget before the others drop it",
            fleet.member_ttl_ms, fleet.sync_ms
        ));
    }
    // A leader's round is its sync, the engines' scrape and its publish (each bounded by a sync
    // period or the scrape timeout); the lease must outlast a slow one with room to spare.
    let scrape_ms = if control.enabled && !control.engine.metrics_urls.is_empty() {
        control.engine.scrape_timeout_ms
    } else {
        0
    };
    let leader_round = fleet.sync_ms.saturating_mul(3).saturating_add(scrape_ms);
    if fleet.leader_ttl_ms < leader_round {
        problems.push(format!(
            "fleet.leader_ttl_ms: {} must be at least three fleet.sync_ms ({}) plus \
             control.engine.scrape_timeout_ms when engines are scraped ({scrape_ms}), so the \
             leader renews its lease before a slow round lets it lapse",
            fleet.leader_ttl_ms, fleet.sync_ms
        ));
    }
    if !(fleet.standby_miss > 0.0 && fleet.standby_miss <= 1.0) {
        problems.push(format!(
            "fleet.standby_miss: {} must be above 0 and at most 1 (1 keeps no standby slots)",
            fleet.standby_miss
        ));
    }
    if fleet.fallback_replicas == 0 {
        problems.push("fleet.fallback_replicas: must be at least 1".to_owned());
    }
    problems
}

/// Changes whenever the fleet's reports or overrides change shape (`crate::fleet::Report`).
const FLEET_PROTOCOL: &str = "tollgate fleet protocol 5\n";

/// The hash a fleet member publishes so that replicas running different policies do not share
/// a budget: SHA-256 (first 16 bytes, hex) of the configuration as JSON, without what is each
/// replica's own (listen addresses, the store's address and credentials, the member id,
/// shutdown timing, the admin token's file, the reload period). Tiers, tenants, weights,
/// limits, shadow mode, the scheduler and the controller are in; the admin API's run-time
/// settings are not (every replica reads the same ones).
pub fn policy_hash(config: &Config) -> String {
    let mut shared = config.clone();
    shared.listen = Default::default();
    shared.store = Default::default();
    shared.shutdown = Default::default();
    shared.fleet.member_id = String::new();
    // Each replica's own: its credentials and how it notices a new file.
    shared.admin = Default::default();
    shared.reload = Default::default();
    // Serializing a `Config` cannot fail: every map key is a string.
    let json = serde_json::to_vec(&shared).unwrap_or_default();
    let mut hasher = Sha256::new();
    // The fleet's wire format (its reports and overrides) is part of what must agree: a build
    // that speaks another one is kept out rather than misread.
    hasher.update(FLEET_PROTOCOL.as_bytes());
    hasher.update(&json);
    hex::encode(&hasher.finalize()[..16])
}

/// Every check of the controller's settings (`control::AimdConfig` has none of its own).
fn control_problems(c: &ControlConfig) -> Vec<String> {
    let mut problems = Vec::new();
    let mut check = |ok: bool, field: &str, value: String, want: &str| {
        if !ok {
            problems.push(format!("control.{field}: {value} {want}"));
        }
    };
    check(
        c.target_p99_ttft_ms > 0,
        "target_p99_ttft_ms",
        c.target_p99_ttft_ms.to_string(),
        "must be positive",
    );
    check(
        c.upstream_target_p99_ttft_ms > 0,
        "upstream_target_p99_ttft_ms",
        c.upstream_target_p99_ttft_ms.to_string(),
        "must be positive",
    );
    check(
        c.min_samples > 0,
        "min_samples",
        c.min_samples.to_string(),
        "must be at least 1",
    );
    check(
        c.signal != ControlSignal::Gateway || c.cooldown_ticks > 0,
        "cooldown_ticks",
        c.cooldown_ticks.to_string(),
        "must be at least 1 with signal: gateway (the window keeps a breach's samples, and \
         without a cooldown every tick would cut again on them; seed 001 used 3)",
    );
    check(
        c.signal != ControlSignal::Upstream
            || c.upstream_target_p99_ttft_ms <= c.target_p99_ttft_ms,
        "upstream_target_p99_ttft_ms",
        c.upstream_target_p99_ttft_ms.to_string(),
        &format!(
            "must be at most control.target_p99_ttft_ms ({}): the upstream's share of the \
             time to first token cannot exceed the whole",
            c.target_p99_ttft_ms
        ),
    );
    check(
        c.tick_ms > 0,
        "tick_ms",
        c.tick_ms.to_string(),
        "must be positive",
    );
    let engine = &c.engine;
    for (index, url) in engine.metrics_urls.iter().enumerate() {
        if let Err(problem) = crate::control::scrape::uri(url) {
            check(
                false,
                &format!("engine.metrics_urls[{index}]"),
                format!("{url:?}"),
                &problem,
            );
        }
    }
    check(
        engine.kv_cache_threshold > 0.0 && engine.kv_cache_threshold <= 1.0,
        "engine.kv_cache_threshold",
        engine.kv_cache_threshold.to_string(),
        "must be in (0, 1]",
    );
    check(
        engine.queue_depth_threshold > 0,
        "engine.queue_depth_threshold",
        engine.queue_depth_threshold.to_string(),
        "must be at least 1",
    );
    check(
        engine.metrics_urls.is_empty()
            || c.tick_ms == 0
            || (engine.scrape_timeout_ms > 0 && engine.scrape_timeout_ms < c.tick_ms),
        "engine.scrape_timeout_ms",
        engine.scrape_timeout_ms.to_string(),
        &format!(
            "must be positive and under control.tick_ms ({}): a tick waits for its scrape",
            c.tick_ms
        ),
    );
    check(
        engine.metrics_urls.is_empty()
            || !(engine.kv_cache_usage_metrics.is_empty() && engine.waiting_metrics.is_empty()),
        "engine.kv_cache_usage_metrics",
        "[]".to_owned(),
        "and control.engine.waiting_metrics cannot both be empty when metrics_urls are set",
    );
    check(
        c.window_ms >= c.tick_ms,
        "window_ms",
        c.window_ms.to_string(),
        "must be at least control.tick_ms",
    );
    // band = 1 would put the increase threshold at 0: the budget could never grow.
    check(
        (0.0..1.0).contains(&c.band),
        "band",
        c.band.to_string(),
        "must be in [0, 1)",
    );
    check(
        c.increase_step > 0,
        "increase_step",
        c.increase_step.to_string(),
        "must be positive",
    );
    check(
        c.decrease_factor > 0.0 && c.decrease_factor < 1.0,
        "decrease_factor",
        c.decrease_factor.to_string(),
        "must be in (0, 1)",
    );
    check(
        c.decrease_step != Some(0),
        "decrease_step",
        "0".to_owned(),
        "must be positive when set",
    );
    check(
        c.floor > 0,
        "floor",
        c.floor.to_string(),
        "must be at least 1",
    );
    check(
        c.floor <= c.ceiling,
        "ceiling",
        c.ceiling.to_string(),
        "must be at least control.floor",
    );
    check(
        c.demand_fraction > 0.0 && c.demand_fraction <= 1.0,
        "demand_fraction",
        c.demand_fraction.to_string(),
        "must be in (0, 1]",
    );
    problems
}

fn parse_sha256(hex_digest: &str) -> Option<[u8; 32]> {
    if hex_digest.len() != 64 || hex_digest.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_digest, &mut out).ok()?;
    Some(out)
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

mod files;
#[cfg(test)]
mod tests;
