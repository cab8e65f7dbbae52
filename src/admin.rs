//! Admin HTTP: `/metrics` (Prometheus text), `/healthz` (the process is alive) and `/readyz`
//! (send it traffic: false while draining, so Kubernetes and load balancers stop routing here
//! before the gRPC listener goes away; and false until the budget is settled: a fleet member
//! is not ready before its first sync has given it a share or sent it to a local budget, so it
//! does not take traffic it would only queue).

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio::sync::watch;

use crate::budget::ledger::Ledger;
use crate::config::AdminConfig;
use crate::lifecycle::Lifecycle;
use crate::live::{Change, Live, SettingError, Settings};
use crate::observe::Metrics;
use crate::scheduler::Scheduler;

/// What the admin endpoints read and change.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Metrics,
    pub scheduler: Arc<Scheduler>,
    pub lifecycle: watch::Receiver<Lifecycle>,
    pub budget_ready: watch::Receiver<bool>,
    pub live: Arc<Live>,
    pub ledger: Arc<Ledger>,
    /// The bearer token `/v1/` requires; `None`: the API is off.
    pub token: Option<Arc<str>>,
}

/// The bearer token in `admin.token_file` (surrounding whitespace trimmed), if it is set.
pub async fn read_token(
    admin: &AdminConfig,
) -> Result<Option<Arc<str>>, crate::config::ConfigError> {
    let Some(path) = &admin.token_file else {
        return Ok(None);
    };
    let text = tokio::fs::read_to_string(path).await.map_err(|e| {
        crate::config::ConfigError(format!("admin.token_file: cannot read {path}: {e}"))
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(crate::config::ConfigError(format!(
            "admin.token_file: {path} is empty; write a bearer token into it"
        )));
    }
    Ok(Some(token.into()))
}

pub fn router(state: AdminState) -> Router {
    let api = Router::new()
        .route("/v1/policy", get(policy))
        .route(
            "/v1/engine/thresholds",
            get(engine_get).put(engine_put).delete(engine_delete),
        )
        .route(
            "/v1/control",
            get(control_get).put(control_put).delete(control_delete),
        )
        .route("/v1/tenants/{tenant}/usage", get(usage))
        .layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(api)
        .with_state(state)
}

/// `/v1/` needs `Authorization: Bearer <admin.token_file's token>`, reads included; without a
/// token file the API does not exist.
async fn authorize(State(state): State<AdminState>, request: Request, next: Next) -> Response {
    let Some(token) = &state.token else {
        return error(
            StatusCode::NOT_FOUND,
            "the admin API is off: set admin.token_file to turn it on",
            None,
        );
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        // The scheme is case-insensitive (RFC 9110), the token is not.
        .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
        .map(|v| &v[7..]);
    match presented {
        Some(presented) if same_secret(presented, token.as_bytes()) => next.run(request).await,
        _ => {
            let mut response = error(
                StatusCode::UNAUTHORIZED,
                "send Authorization: Bearer <the token in admin.token_file>",
                None,
            );
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

/// Compares in time that depends on the lengths only, not on where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_vec_pretty(value) {
        Ok(mut body) => {
            body.push(b'\n');
            (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    /// The field at fault, where one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

fn error(status: StatusCode, message: &str, field: Option<&str>) -> Response {
    json(
        status,
        &ErrorBody {
            error: message,
            field,
        },
    )
}

/// `GET /v1/policy`: the policy in force, as the configuration it came from with the run-time
/// settings in place, and which settings the admin API changed.
async fn policy(State(state): State<AdminState>) -> Response {
    let policy = state.live.current();
    let mut config = (*policy.source).clone();
    config.control = policy.control.clone();
    if let Some(url) = &mut config.store.redis_url {
        *url = redact_url(url);
    }
    for url in &mut config.control.engine.metrics_urls {
        *url = redact_url(url);
    }
    let settings = state.live.settings();
    json(
        StatusCode::OK,
        &serde_json::json!({
            "policy_hash": policy.hash,
            "settings": {
                "engine": settings.engine,
                "control": settings.control,
            },
            "config": config,
        }),
    )
}

/// A URL without its credentials.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://<redacted>{}", &url[..scheme], &url[at..])
        }
        _ => url.to_owned(),
    }
}

async fn engine_get(State(state): State<AdminState>) -> Response {
    json(StatusCode::OK, &Settings::engine_in(&state.live.current()))
}

async fn engine_put(State(state): State<AdminState>, body: Bytes) -> Response {
    put(&state, &body, ENGINE_FIELDS, Change::Engine).await
}

async fn engine_delete(State(state): State<AdminState>) -> Response {
    change(&state, Change::Engine(None)).await
}

async fn control_get(State(state): State<AdminState>) -> Response {
    json(
        StatusCode::OK,
        &Settings::control_in(&state.live.current().control),
    )
}

async fn control_put(State(state): State<AdminState>, body: Bytes) -> Response {
    put(&state, &body, CONTROL_FIELDS, Change::Control).await
}

async fn control_delete(State(state): State<AdminState>) -> Response {
    change(&state, Change::Control(None)).await
}

/// A `PUT` of a setting: the body parsed as the whole resource, then the change.
async fn put<T: serde::de::DeserializeOwned>(
    state: &AdminState,
    body: &[u8],
    fields: &[(&str, Kind)],
    setting: fn(Option<T>) -> Change,
) -> Response {
    match parse::<T>(body, fields) {
        Ok(value) => change(state, setting(Some(value))).await,
        Err(response) => *response,
    }
}

/// What a field of a resource holds, as a `PUT` body must give it.
#[derive(Clone, Copy)]
enum Kind {
    /// A finite number.
    Number,
    /// A whole number from 0 to 2^32 - 1.
    Count,
    /// `true` or `false`.
    Switch,
}

impl Kind {
    fn holds(self, value: &serde_json::Value) -> bool {
        match self {
            Kind::Number => value.as_f64().is_some_and(f64::is_finite),
            Kind::Count => value.as_u64().is_some_and(|n| u32::try_from(n).is_ok()),
            Kind::Switch => value.is_boolean(),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Kind::Number => "a number",
            Kind::Count => "a whole number from 0 to 4294967295",
            Kind::Switch => "true or false",
        }
    }
}

const ENGINE_FIELDS: &[(&str, Kind)] = &[
    ("kv_cache_threshold", Kind::Number),
    ("queue_depth_threshold", Kind::Count),
];

const CONTROL_FIELDS: &[(&str, Kind)] = &[
    ("enabled", Kind::Switch),
    ("floor", Kind::Count),
    ("ceiling", Kind::Count),
];

/// A JSON object of exactly `fields`, each of its kind, as `T`; or a 400 naming the field at
/// fault (ranges are the policy's to judge, after this).
fn parse<T: serde::de::DeserializeOwned>(
    body: &[u8],
    fields: &[(&str, Kind)],
) -> Result<T, Box<Response>> {
    let bad = |message: String, field: Option<&str>| {
        Box::new(error(StatusCode::BAD_REQUEST, &message, field))
    };
    let names = || {
        fields
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the body is not valid JSON: {e}"), None))?;
    let Some(object) = value.as_object() else {
        return Err(bad(
            format!("the body must be a JSON object with the fields {}", names()),
            None,
        ));
    };
    if let Some(unknown) = object
        .keys()
        .find(|key| !fields.iter().any(|(f, _)| f == key))
    {
        return Err(bad(
            format!("unknown field {unknown:?}; the fields are {}", names()),
            Some(unknown),
        ));
    }
    for (field, kind) in fields {
        match object.get(*field) {
            None => {
                return Err(bad(
                    format!(
                        "missing field {field:?}: a PUT gives the whole resource ({})",
                        names()
                    ),
                    Some(field),
                ));
            }
            Some(found) if !kind.holds(found) => {
                return Err(bad(
                    format!("{field}: {found} is not {}", kind.describe()),
                    Some(field),
                ));
            }
            Some(_) => {}
        }
    }
    serde_json::from_value(value).map_err(|e| bad(e.to_string(), None))
}

/// Applies a change and answers with the setting's value in force after it.
async fn change(state: &AdminState, change: Change) -> Response {
    match state.live.set(change).await {
        // The policy this change installed, not whatever is in force by now.
        Ok(policy) => match change {
            Change::Engine(_) => json(StatusCode::OK, &Settings::engine_in(&policy)),
            Change::Control(_) => json(StatusCode::OK, &Settings::control_in(&policy.control)),
        },
        Err(SettingError::Invalid(problems)) => {
            let message = problems.join("; ");
            // "control.engine.kv_cache_threshold: ..." names the field as the file does; the
            // resource's own name is the last part.
            let field = problems
                .first()
                .and_then(|p| p.split(':').next())
                .and_then(|path| path.rsplit('.').next())
                .map(str::to_owned);
            error(StatusCode::BAD_REQUEST, &message, field.as_deref())
        }
        Err(e @ SettingError::Store(_)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string(), None)
        }
    }
}

#[derive(Serialize)]
struct UsageBody<'a> {
    tenant: &'a str,
    tier: &'a str,
    /// Each budget window of the tenant's tier (and of `model`'s limits, if one was named).
    windows: Vec<WindowUsage<'a>>,
    leases: Leases,
}

#[derive(Serialize)]
struct WindowUsage<'a> {
    window: &'a str,
    /// `tokens` or `requests`.
    unit: &'static str,
    used: u64,
    limit: u64,
    /// Until the oldest usage in the window rolls off (0 if the window is empty): when the
    /// tenant has room again.
    reset_seconds: f64,
}

#[derive(Serialize)]
struct Leases {
    /// Requests of the tenant in flight, as the store counts them (every replica's).
    in_use: u32,
    /// `max_concurrent`, if the tier sets one.
    limit: Option<u32>,
}

/// `GET /v1/tenants/{tenant}/usage[?tier=T][&model=M]`: the tenant's budgets as the store
/// holds them now (with Redis, what every replica sees). The tier is `tier`, or the tier of the
/// tenant's API key if it has one, or the default tier.
async fn usage(State(state): State<AdminState>, Path(tenant): Path<String>, uri: Uri) -> Response {
    let policy = state.live.current();
    let query = query_pairs(uri.query().unwrap_or(""));
    let tier = match query.iter().find(|(k, _)| k == "tier") {
        Some((_, name)) => match policy.tier_named(name) {
            Some(tier) => tier,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("tier {name:?} is not one of the tiers"),
                    Some("tier"),
                );
            }
        },
        None => policy.tier_of_tenant(&tenant),
    };
    let model = query
        .iter()
        .find(|(k, _)| k == "model")
        .map_or("", |(_, m)| m.as_str());
    let tier_policy = policy.tier_for(&tenant, tier);
    let windows = tier_policy.windows_for(model);
    // With Redis, on the run-time settings' connection: a lookup never queues behind decisions.
    let usage = match state.live.usage(&tenant, &windows).await {
        Some(usage) => usage,
        None => state.ledger.usage(&tenant, &windows).await,
    };
    match usage {
        Ok(usage) => json(
            StatusCode::OK,
            &UsageBody {
                tenant: &tenant,
                tier: &tier_policy.name,
                windows: windows
                    .iter()
                    .zip(&usage.windows)
                    .map(|(window, now)| WindowUsage {
                        window: &window.name,
                        unit: window.quantity.unit(),
                        used: now.used,
                        limit: window.limit,
                        reset_seconds: now.reset_ms as f64 / 1000.0,
                    })
                    .collect(),
                leases: Leases {
                    in_use: usage.leases,
                    limit: tier_policy.max_concurrent,
                },
            },
        ),
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("the budget store cannot answer: {e}"),
            None,
        ),
    }
}

/// `k=v&k2=v2`, percent-decoded.
fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn metrics_text(State(state): State<AdminState>) -> impl IntoResponse {
    // The budget's gauges are read at scrape time: exact, and nothing on the request path
    // has to keep them current.
    state.metrics.scheduler_load(state.scheduler.load());
    state
        .metrics
        .count_cache(crate::tokens::Encoding::count_cache_stats());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    match *state.lifecycle.borrow() {
        Lifecycle::Serving if !*state.budget_ready.borrow() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for a share of the fleet's budget\n",
        ),
        Lifecycle::Serving => (StatusCode::OK, "ready\n"),
        Lifecycle::Draining | Lifecycle::Closing => (StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
    }
}
