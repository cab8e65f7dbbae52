//! Scenario files (`examples/scenarios/*.yaml`): the workload, the simulated vLLM's settings,
//! and the runs to compare (tollgate configurations, or tollgate off). Every time in a scenario
//! is simulated time; [`Scenario::tollgate_config`] scales tollgate's own time settings by the
//! time-scale factor so that tollgate lives on the same clock as the simulated engine.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Simulated seconds per real second (overridable with `--time-scale`).
    #[serde(default = "one")]
    pub time_scale: f64,
    /// Arrivals stop at this simulated second.
    pub duration_s: f64,
    /// After the arrivals stop, in-flight requests get this long (simulated) to finish; any
    /// still open then count as unfinished (hung).
    #[serde(default = "default_drain")]
    pub drain_s: f64,
    /// Seed of the arrival processes.
    #[serde(default = "one_u64")]
    pub seed: u64,
    /// Metrics are sampled this often (simulated seconds).
    #[serde(default = "one")]
    pub sample_every_s: f64,
    /// Arrivals in this window ([start, end) simulated seconds) get their own shares table,
    /// e.g. the time two tenants contend.
    #[serde(default)]
    pub window_s: Option<[f64; 2]>,
    /// TTFT objective for the "goodput within SLO" figure (simulated ms).
    #[serde(default = "default_slo")]
    pub slo_ttft_ms: f64,
    /// The simulated vLLM's flags, without the leading `--` (e.g. `kv_capacity_tokens: 80000`).
    #[serde(default)]
    pub upstream: BTreeMap<String, Value>,
    /// Request defaults for every tenant.
    #[serde(default)]
    pub request: RequestShape,
    pub tenants: Vec<Tenant>,
    /// tollgate's configuration for the runs that use it (its own YAML keys; times in
    /// simulated milliseconds).
    #[serde(default)]
    pub tollgate: Value,
    /// tollgate replicas behind the one Envoy (`LEAST_REQUEST`). Above 1, the lab also starts a
    /// redis-server, points every replica's `store.redis_url` at it, and the replicas share
    /// one in-flight budget (`fleet`, tollgate's defaults unless the scenario names them):
    /// `scheduler.initial_limit` and the controller's floor and ceiling are the deployment's.
    #[serde(default = "one_u32")]
    pub replicas: u32,
    /// Multiply tollgate's per-window budgets (`tokens_per_minute`, `_hour`, `_day`,
    /// `requests_per_minute`) by the time scale (the default), which keeps their rate. `false`
    /// leaves them as written, which keeps what one window holds: right when the whole run fits
    /// in one window (seed 003's hourly budgets in a run of a few minutes), where nothing rolls
    /// off and the window's capacity is what binds.
    #[serde(default = "yes")]
    pub scale_budgets: bool,
    pub runs: Vec<Run>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestShape {
    pub prompt_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub stream: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub name: String,
    /// `x-user-id` (default: the name).
    #[serde(default)]
    pub user: Option<String>,
    /// `x-user-tier` (default: none, so tollgate's `default_tier`).
    #[serde(default)]
    pub tier: Option<String>,
    /// How many users the tenant stands for. Above 1 its requests take turns, in arrival
    /// order, among `x-user-id`s `<user>-1` .. `<user>-<users>`, each with its own per-user
    /// budgets and concurrency: a population of a tier rather than one user.
    #[serde(default = "one_u32")]
    pub users: u32,
    /// Poisson arrivals per second between `start_s` and `end_s`.
    #[serde(default)]
    pub rate: f64,
    #[serde(default)]
    pub start_s: f64,
    /// Default: the scenario's `duration_s`.
    #[serde(default)]
    pub end_s: Option<f64>,
    /// Extra Poisson arrivals on top of `rate`.
    #[serde(default)]
    pub bursts: Vec<Burst>,
    #[serde(flatten)]
    pub shape: RequestShape,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    pub start_s: f64,
    pub length_s: f64,
    pub rate: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Run {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// `false`: Envoy without the ext_proc filter. Absent: the scenario's `tollgate`. A
    /// mapping: merged into the scenario's (maps merge key by key, anything else replaces).
    #[serde(default)]
    pub tollgate: Option<Value>,
    /// Tenants that send nothing in this run.
    #[serde(default)]
    pub without: Vec<String>,
    /// Per-tenant replacements of `rate` for this run (e.g. an overload ladder).
    #[serde(default)]
    pub rates: BTreeMap<String, f64>,
    /// Per-tenant replacements of `start_s` for this run (e.g. a late joiner).
    #[serde(default)]
    pub starts: BTreeMap<String, f64>,
    /// Calls to tollgate's admin API during the run, each sent to every replica at its time
    /// (e.g. new engine thresholds mid-run); marked on the charts.
    #[serde(default)]
    pub admin_calls: Vec<AdminCall>,
}

/// One call to tollgate's admin API at a time in a run.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminCall {
    /// When (simulated seconds from the start of the run).
    pub at_s: f64,
    /// `GET`, `PUT`, `POST` or `DELETE` (default `PUT`).
    #[serde(default = "put")]
    pub method: String,
    /// The path on the admin listener, e.g. `/v1/engine/thresholds`.
    pub path: String,
    /// A JSON body, sent with `content-type: application/json`.
    #[serde(default)]
    pub body: Option<Value>,
}

fn one() -> f64 {
    1.0
}

fn one_u64() -> u64 {
    1
}

fn one_u32() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn put() -> String {
    "PUT".to_owned()
}

fn default_slo() -> f64 {
    2000.0
}

fn default_drain() -> f64 {
    120.0
}

/// A request to send: when (simulated seconds from the start), whose, what size.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: f64,
    pub tenant: usize,
    /// Which of the tenant's users sends it (1-based), when the tenant stands for several.
    pub user: Option<u32>,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub stream: bool,
}

impl Scenario {
    pub fn load(path: &Path) -> Result<Scenario> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        Scenario::parse(&text).with_context(|| format!("load {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Scenario> {
        let scenario: Scenario = serde_json::from_value(yaml_to_json(text)?)?;
        scenario.validate()?;
        Ok(scenario)
    }

    fn validate(&self) -> Result<()> {
        ensure!(self.duration_s > 0.0, "duration_s must be positive");
        ensure!(self.drain_s >= 0.0, "drain_s must not be negative");
        ensure!(self.time_scale > 0.0, "time_scale must be positive");
        ensure!(self.sample_every_s > 0.0, "sample_every_s must be positive");
        ensure!(!self.tenants.is_empty(), "no tenants");
        ensure!(!self.runs.is_empty(), "no runs");
        ensure!(
            (1..=16).contains(&self.replicas),
            "replicas must be between 1 and 16"
        );
        for tenant in &self.tenants {
            ensure!(
                tenant.users >= 1,
                "tenant {}: users must be at least 1",
                tenant.name
            );
        }
        for run in &self.runs {
            for call in &run.admin_calls {
                ensure!(
                    (0.0..self.duration_s).contains(&call.at_s),
                    "run {}: an admin call's at_s must be in [0, duration_s)",
                    run.name
                );
                ensure!(
                    matches!(call.method.as_str(), "GET" | "PUT" | "POST" | "DELETE"),
                    "run {}: admin call method {} (GET, PUT, POST or DELETE)",
                    run.name,
                    call.method
                );
                ensure!(
                    call.path.starts_with('/'),
                    "run {}: admin call path {} must start with /",
                    run.name,
                    call.path
                );
                ensure!(
                    !matches!(run.tollgate, Some(Value::Bool(false))),
                    "run {}: admin calls need tollgate on",
                    run.name
                );
            }
            for name in run
                .without
                .iter()
                .chain(run.rates.keys())
                .chain(run.starts.keys())
            {
                ensure!(
                    self.tenants.iter().any(|t| &t.name == name),
                    "run {}: no tenant {name}",
                    run.name
                );
            }
            if let Some(value) = &run.tollgate {
                ensure!(
                    matches!(value, Value::Bool(false) | Value::Object(_)),
                    "run {}: tollgate must be false or a mapping",
                    run.name
                );
            }
        }
        Ok(())
    }

    /// The tollgate configuration of `run` (`None`: tollgate off), with its times divided and
    /// its per-window budgets multiplied by `time_scale`, as JSON (which is YAML).
    pub fn tollgate_config(&self, run: &Run, time_scale: f64) -> Option<Value> {
        let mut config = self.tollgate.clone();
        match &run.tollgate {
            Some(Value::Bool(false)) => return None,
            Some(patch) => merge(&mut config, patch),
            None => {}
        }
        if config.is_null() {
            config = Value::Object(Map::new());
        }
        if self.replicas > 1 {
            fill_fleet_defaults(&mut config);
        }
        scale_times(&mut config, time_scale, self.scale_budgets);
        Some(config)
    }

    /// Every arrival of `run`, sorted by time. Deterministic per scenario seed.
    pub fn arrivals(&self, run: &Run) -> Vec<Arrival> {
        let mut out = Vec::new();
        for (index, tenant) in self.tenants.iter().enumerate() {
            if run.without.contains(&tenant.name) {
                continue;
            }
            let shape = |field: fn(&RequestShape) -> Option<u64>, default| {
                field(&tenant.shape)
                    .or(field(&self.request))
                    .unwrap_or(default)
            };
            let prompt_tokens = shape(|s| s.prompt_tokens, 512);
            let output_tokens = shape(|s| s.output_tokens, 128);
            let stream = tenant.shape.stream.or(self.request.stream).unwrap_or(true);
            let mut rng = Rng::new(self.seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9));
            let rate = run.rates.get(&tenant.name).copied().unwrap_or(tenant.rate);
            let end = tenant.end_s.unwrap_or(self.duration_s).min(self.duration_s);
            let start = run
                .starts
                .get(&tenant.name)
                .copied()
                .unwrap_or(tenant.start_s);
            let mut times = poisson(&mut rng, rate, start, end);
            for burst in &tenant.bursts {
                let burst_end = (burst.start_s + burst.length_s).min(self.duration_s);
                times.extend(poisson(&mut rng, burst.rate, burst.start_s, burst_end));
            }
            times.sort_by(f64::total_cmp);
            let users = tenant.users;
            out.extend(times.into_iter().enumerate().map(|(n, at)| Arrival {
                at,
                tenant: index,
                user: (users > 1).then(|| n as u32 % users + 1),
                prompt_tokens,
                output_tokens,
                stream,
            }));
        }
        out.sort_by(|a, b| a.at.total_cmp(&b.at));
        out
    }
}

/// Arrival times of a Poisson process of `rate` per second on [start, end).
fn poisson(rng: &mut Rng, rate: f64, start: f64, end: f64) -> Vec<f64> {
    let mut times = Vec::new();
    if rate <= 0.0 {
        return times;
    }
    let mut t = start;
    loop {
        t += -(1.0 - rng.unit()).ln() / rate;
        if t >= end {
            return times;
        }
        times.push(t);
    }
}

/// xorshift64*: small, deterministic, good enough for arrival times.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1_u64 << 53) as f64
    }
}

/// Deep merge: maps key by key, anything else replaces.
pub fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (key, value) in patch {
                merge(base.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
        (base, patch) => *base = patch.clone(),
    }
}

/// tollgate's settings measured in time, divided by `scale` (never below 1 ms); its budgets per
/// window, multiplied by it if `scale_budgets`: a simulated minute lasts 60/scale real seconds.
///
/// A time the scenario leaves out would otherwise run on tollgate's real-time default (a 5 s
/// controller tick would be 20 simulated seconds at scale 4), so tollgate's own defaults for the
/// scaled times are written in first: the controller's tick, window and target, and the queue
/// deadline of every tier (the built-in tiers, if the scenario names none), and the engines'
/// scrape timeout if the scenario scrapes them.
fn scale_times(config: &mut Value, scale: f64, scale_budgets: bool) {
    fill_time_defaults(config);
    let divide = |value: &mut Value| {
        if let Some(ms) = value.as_f64() {
            *value = Value::from(((ms / scale).round() as u64).max(1));
        }
    };
    let multiply = |value: &mut Value| {
        if let Some(n) = value.as_f64() {
            *value = Value::from((n * scale).round() as u64);
        }
    };
    fn walk(value: &mut Value, f: &mut dyn FnMut(&str, &mut Value)) {
        if let Value::Object(map) = value {
            for (key, child) in map.iter_mut() {
                f(key, child);
                walk(child, f);
            }
        } else if let Value::Array(items) = value {
            for item in items {
                walk(item, f);
            }
        }
    }
    walk(config, &mut |key, value| match key {
        "queue_deadline_ms" | "scrape_timeout_ms" => divide(value),
        "tokens_per_minute" | "tokens_per_hour" | "tokens_per_day" | "requests_per_minute"
            if scale_budgets =>
        {
            multiply(value)
        }
        _ => {}
    });
    if let Some(fleet) = config.get_mut("fleet").and_then(Value::as_object_mut) {
        for key in ["sync_ms", "member_ttl_ms", "leader_ttl_ms"] {
            if let Some(value) = fleet.get_mut(key) {
                divide(value);
            }
        }
    }
    if let Some(window) = config.pointer_mut("/scheduler/headroom/window_ms") {
        divide(window);
    }
    if let Some(control) = config.get_mut("control").and_then(Value::as_object_mut) {
        for key in [
            "tick_ms",
            "window_ms",
            "target_p99_ttft_ms",
            "upstream_target_p99_ttft_ms",
        ] {
            if let Some(value) = control.get_mut(key) {
                divide(value);
            }
        }
    }
}

/// Writes tollgate's defaults into `config` for every time setting it does not name (see
/// [`scale_times`]).
fn fill_time_defaults(config: &mut Value) {
    let Some(root) = config.as_object_mut() else {
        return;
    };
    let control = tollgate::config::ControlConfig::default();
    if let Value::Object(map) = root
        .entry("control")
        .or_insert_with(|| Value::Object(Map::new()))
    {
        for (key, default) in [
            ("tick_ms", control.tick_ms),
            ("window_ms", control.window_ms),
            ("target_p99_ttft_ms", control.target_p99_ttft_ms),
            (
                "upstream_target_p99_ttft_ms",
                control.upstream_target_p99_ttft_ms,
            ),
        ] {
            map.entry(key).or_insert(Value::from(default));
        }
        // The engines' scrape must fit in the (scaled) tick.
        if let Some(Value::Object(engine)) = map.get_mut("engine") {
            engine
                .entry("scrape_timeout_ms")
                .or_insert(Value::from(control.engine.scrape_timeout_ms));
        }
    }
    // The scheduler's headroom remembers demand for a time: scaled like the controller's window.
    if let Value::Object(scheduler) = root
        .entry("scheduler")
        .or_insert_with(|| Value::Object(Map::new()))
        && let Value::Object(headroom) = scheduler
            .entry("headroom")
            .or_insert_with(|| Value::Object(Map::new()))
    {
        headroom.entry("window_ms").or_insert(Value::from(
            tollgate::config::HeadroomConfig::default().window_ms,
        ));
    }
    match root.get_mut("tiers") {
        Some(Value::Object(tiers)) => {
            let deadline = tollgate::config::TierConfig::default().queue_deadline_ms;
            for tier in tiers.values_mut() {
                if tier.is_null() {
                    *tier = Value::Object(Map::new());
                }
                if let Value::Object(tier) = tier {
                    tier.entry("queue_deadline_ms")
                        .or_insert(Value::from(deadline));
                }
            }
        }
        None => {
            // Naming any tier replaces the built-in set, so write the whole set, as it is.
            let mut tiers =
                serde_json::to_value(tollgate::config::default_tiers()).unwrap_or(Value::Null);
            strip_nulls(&mut tiers);
            root.insert("tiers".to_owned(), tiers);
        }
        Some(_) => {}
    }
}

/// Writes tollgate's defaults for the fleet's times (sync, member and leader leases) into
/// `config` where it names none, so that [`scale_times`] puts them on the simulated clock too:
/// at the defaults, a share moves within one (scaled) controller tick. Only for scenarios with
/// more than one replica; a lone replica has no fleet, and its configuration stays as it was.
fn fill_fleet_defaults(config: &mut Value) {
    let Some(root) = config.as_object_mut() else {
        return;
    };
    let fleet = tollgate::config::FleetConfig::default();
    if let Value::Object(map) = root
        .entry("fleet")
        .or_insert_with(|| Value::Object(Map::new()))
    {
        for (key, default) in [
            ("sync_ms", fleet.sync_ms),
            ("member_ttl_ms", fleet.member_ttl_ms),
            ("leader_ttl_ms", fleet.leader_ttl_ms),
        ] {
            map.entry(key).or_insert(Value::from(default));
        }
    }
}

/// Removes `null` map entries (unset `Option`s), which tollgate's loader reads as absent anyway.
fn strip_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// YAML (one document) to JSON, through yaml-rust2 (already in the tree through `config`).
pub fn yaml_to_json(text: &str) -> Result<Value> {
    let docs = yaml_rust2::YamlLoader::load_from_str(text)?;
    let [doc] = &docs[..] else {
        bail!("expected one YAML document, found {}", docs.len());
    };
    convert(doc)
}

fn convert(yaml: &yaml_rust2::Yaml) -> Result<Value> {
    use yaml_rust2::Yaml;
    Ok(match yaml {
        Yaml::Real(text) => Value::from(
            text.parse::<f64>()
                .with_context(|| format!("bad number {text}"))?,
        ),
        Yaml::Integer(n) => Value::from(*n),
        Yaml::String(s) => Value::from(s.clone()),
        Yaml::Boolean(b) => Value::from(*b),
        Yaml::Array(items) => Value::Array(items.iter().map(convert).collect::<Result<_>>()?),
        Yaml::Hash(hash) => {
            let mut map = Map::new();
            for (key, value) in hash {
                let key = match key {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(n) => n.to_string(),
                    other => bail!("unsupported mapping key {other:?}"),
                };
                map.insert(key, convert(value)?);
            }
            Value::Object(map)
        }
        Yaml::Null => Value::Null,
        other => bail!("unsupported YAML value {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tollgate_times_scale_with_the_clock() {
        let mut config = json!({
            "tiers": {"free": {"queue_deadline_ms": 1000, "tokens_per_minute": 100}},
            "tenants": {"a": {"queue_deadline_ms": 2000}},
            "control": {"tick_ms": 5000, "window_ms": 30000, "target_p99_ttft_ms": 2000, "floor": 32},
            "store": {"timeout_ms": 50},
            "scheduler": {"initial_limit": 64, "headroom": {"enabled": true, "window_ms": 30000}},
        });
        scale_times(&mut config, 4.0, true);
        assert_eq!(
            config,
            json!({
                "tiers": {"free": {"queue_deadline_ms": 250, "tokens_per_minute": 400}},
                "tenants": {"a": {"queue_deadline_ms": 500}},
                // The upstream target was not named: tollgate's default (1 s), scaled.
                "control": {"tick_ms": 1250, "window_ms": 7500, "target_p99_ttft_ms": 500,
                            "upstream_target_p99_ttft_ms": 250, "floor": 32},
                "store": {"timeout_ms": 50},
                "scheduler": {"initial_limit": 64, "headroom": {"enabled": true, "window_ms": 7500}},
            })
        );
    }

    #[test]
    fn unnamed_times_get_tollgate_defaults_then_scale() {
        let mut config = json!({
            "tiers": {"free": {"weight": 1}, "paid": {"queue_deadline_ms": 2000}},
            "control": {"enabled": true},
        });
        scale_times(&mut config, 4.0, true);
        assert_eq!(
            config,
            json!({
                "tiers": {"free": {"weight": 1, "queue_deadline_ms": 250}, "paid": {"queue_deadline_ms": 500}},
                "control": {"enabled": true, "tick_ms": 250, "window_ms": 2500, "target_p99_ttft_ms": 500,
                            "upstream_target_p99_ttft_ms": 250},
                // The headroom's window, not named: tollgate's default (10 s), scaled.
                "scheduler": {"headroom": {"window_ms": 2500}},
            })
        );
        // No tiers named: the built-in ones, with their deadlines scaled.
        let mut config = json!({});
        scale_times(&mut config, 4.0, true);
        assert_eq!(config["tiers"]["free"]["queue_deadline_ms"], json!(250));
        assert_eq!(config["tiers"]["premium"]["queue_deadline_ms"], json!(500));
        assert_eq!(config["tiers"]["free"]["max_concurrent"], json!(3));
        assert_eq!(config["control"]["tick_ms"], json!(250));
        // Scraping the engines: the scrape timeout too, named or not, so it stays under the
        // tick as tollgate requires.
        for (engine, timeout) in [(json!({}), 63), (json!({"scrape_timeout_ms": 100}), 25)] {
            let mut config = json!({"control": {"engine": engine}});
            scale_times(&mut config, 4.0, true);
            assert_eq!(
                config["control"]["engine"]["scrape_timeout_ms"],
                json!(timeout)
            );
        }
    }

    #[test]
    fn runs_patch_the_base_config() {
        let mut base = json!({"control": {"enabled": true, "floor": 32}, "tiers": {"a": {}}});
        merge(
            &mut base,
            &json!({"control": {"enabled": false}, "tiers": {"b": {"weight": 2}}}),
        );
        assert_eq!(
            base,
            json!({"control": {"enabled": false, "floor": 32}, "tiers": {"a": {}, "b": {"weight": 2}}})
        );
    }

    #[test]
    fn poisson_arrivals_have_the_asked_rate_and_repeat() {
        // (rate, seconds, tolerance on the count)
        for (rate, seconds) in [(2.0, 1000.0), (30.0, 100.0), (0.5, 2000.0)] {
            let times = poisson(&mut Rng::new(7), rate, 0.0, seconds);
            let expected = rate * seconds;
            let error = (times.len() as f64 - expected).abs() / expected;
            assert!(error < 0.08, "rate {rate}: {} arrivals", times.len());
            assert!(times.windows(2).all(|w| w[0] <= w[1]));
            assert_eq!(times, poisson(&mut Rng::new(7), rate, 0.0, seconds));
        }
        assert!(poisson(&mut Rng::new(7), 0.0, 0.0, 10.0).is_empty());
    }

    const REPLICAS: &str = "name: r\nduration_s: 10\ntenants: [{name: A, rate: 1}]\n\
                            tollgate: {scheduler: {initial_limit: 32}}\nruns: [{name: on}]\n";

    #[test]
    fn one_replica_by_default_with_no_fleet_settings() {
        let scenario = Scenario::parse(REPLICAS).unwrap();
        assert_eq!(scenario.replicas, 1);
        let config = scenario.tollgate_config(&scenario.runs[0], 4.0).unwrap();
        assert_eq!(config.get("fleet"), None);
        assert_eq!(config.get("store"), None);
        assert_eq!(config["scheduler"]["initial_limit"], json!(32));
    }

    #[test]
    fn replicas_get_the_fleet_times_on_the_simulated_clock() {
        let scenario = Scenario::parse(&format!("{REPLICAS}replicas: 3\n")).unwrap();
        assert_eq!(scenario.replicas, 3);
        let config = scenario.tollgate_config(&scenario.runs[0], 4.0).unwrap();
        // tollgate's defaults (200 ms, 2 s, 2 s), divided by the time scale; the limit stays
        // the deployment's.
        assert_eq!(
            config["fleet"],
            json!({"sync_ms": 50, "member_ttl_ms": 500, "leader_ttl_ms": 500})
        );
        assert_eq!(config["scheduler"]["initial_limit"], json!(32));
        // A scenario's own fleet times win, and scale too.
        let named = format!("{REPLICAS}replicas: 3\n").replace(
            "tollgate: {",
            "tollgate: {fleet: {sync_ms: 400, member_ttl_ms: 4000}, ",
        );
        let scenario = Scenario::parse(&named).unwrap();
        let config = scenario.tollgate_config(&scenario.runs[0], 4.0).unwrap();
        assert_eq!(
            config["fleet"],
            json!({"sync_ms": 100, "member_ttl_ms": 1000, "leader_ttl_ms": 500})
        );
        for bad in ["replicas: 0\n", "replicas: 17\n"] {
            let error = Scenario::parse(&format!("{REPLICAS}{bad}")).unwrap_err();
            assert!(format!("{error:#}").contains("replicas"), "{error:#}");
        }
    }

    #[test]
    fn budgets_keep_their_window_when_asked() {
        let text = "name: b\nduration_s: 10\ntenants: [{name: A, rate: 1}]\n\
                    tollgate: {tiers: {free: {tokens_per_hour: 100000, queue_deadline_ms: 10000}}}\n\
                    runs: [{name: on}]\n";
        // (scale_budgets line, the hour's budget at time scale 4)
        for (line, budget) in [("", 400_000), ("scale_budgets: false\n", 100_000)] {
            let scenario = Scenario::parse(&format!("{text}{line}")).unwrap();
            let config = scenario.tollgate_config(&scenario.runs[0], 4.0).unwrap();
            assert_eq!(config["tiers"]["free"]["tokens_per_hour"], json!(budget));
            // Times scale either way.
            assert_eq!(config["tiers"]["free"]["queue_deadline_ms"], json!(2500));
        }
    }

    #[test]
    fn a_tenant_of_several_users_sends_in_turns() {
        let scenario = Scenario::parse(
            "name: u\nduration_s: 100\ntenants: [{name: A, rate: 2, users: 3}, {name: B, rate: 1}]\n\
             runs: [{name: on}]\n",
        )
        .unwrap();
        let arrivals = scenario.arrivals(&scenario.runs[0]);
        let a: Vec<Option<u32>> = arrivals
            .iter()
            .filter(|x| x.tenant == 0)
            .map(|x| x.user)
            .collect();
        assert!(a.len() > 100);
        for (n, user) in a.iter().enumerate() {
            assert_eq!(*user, Some(n as u32 % 3 + 1));
        }
        assert!(
            arrivals
                .iter()
                .filter(|x| x.tenant == 1)
                .all(|x| x.user.is_none())
        );
        assert!(
            Scenario::parse(
                "name: u\nduration_s: 10\ntenants: [{name: A, users: 0}]\nruns: [{name: on}]\n"
            )
            .is_err()
        );
    }

    #[test]
    fn admin_calls_are_checked() {
        let base = "name: a\nduration_s: 60\ntenants: [{name: A, rate: 1}]\nruns:\n";
        let good = format!(
            "{base}  - {{name: on, admin_calls: [{{at_s: 30, path: /v1/engine/thresholds, \
             body: {{kv_cache_threshold: 0.85, queue_depth_threshold: 10}}}}]}}\n"
        );
        let scenario = Scenario::parse(&good).unwrap();
        let call = &scenario.runs[0].admin_calls[0];
        assert_eq!(call.method, "PUT");
        assert_eq!(
            call.body,
            Some(json!({"kv_cache_threshold": 0.85, "queue_depth_threshold": 10}))
        );
        for (bad, why) in [
            ("{at_s: 60, path: /x}", "at_s"),
            ("{at_s: 1, path: x}", "path"),
            ("{at_s: 1, method: PATCH, path: /x}", "method"),
        ] {
            let text = format!("{base}  - {{name: on, admin_calls: [{bad}]}}\n");
            let error = Scenario::parse(&text).unwrap_err();
            assert!(format!("{error:#}").contains(why), "{error:#}");
        }
        let off = format!(
            "{base}  - {{name: off, tollgate: false, admin_calls: [{{at_s: 1, path: /x}}]}}\n"
        );
        assert!(format!("{:#}", Scenario::parse(&off).unwrap_err()).contains("tollgate on"));
    }

    #[test]
    fn yaml_becomes_json() {
        let value = yaml_to_json("a: 1\nb: [x, 2.5, true, null]\nc: {d: e}\n").unwrap();
        assert_eq!(
            value,
            json!({"a": 1, "b": ["x", 2.5, true, null], "c": {"d": "e"}})
        );
    }
}
