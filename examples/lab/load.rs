//! The open-loop load: every request is sent at its due time whatever happened to the earlier
//! ones, and measured from that due time (so a slow system cannot hide its queue by slowing
//! the client). Also the sampler: vLLM's and tollgate's gauges, and the client's in-flight
//! requests per tenant, every `sample_every_s`, with a progress line. With several tollgate
//! replicas every one is scraped: the deployment's figures (the fleet's limit, the sums of
//! in flight and queued, the leader's controller p99) and each replica's own.

use std::io::{IsTerminal, Write as _};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use futures_util::StreamExt;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::scenario::{AdminCall, Arrival};

/// What the client saw of one request. Times are simulated seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    pub tenant: usize,
    /// Due time, from the start of the run.
    pub at: f64,
    /// HTTP status; 0 when no response came (connection error, or still open at the end).
    pub status: u16,
    /// `x-tollgate-reason`, on tollgate's own answers.
    pub reason: Option<String>,
    /// Due time to the first body bytes of a 200.
    pub ttft: Option<f64>,
    /// Due time to the end of the response.
    pub e2e: Option<f64>,
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` as the upstream reported it (the simulated vLLM counts words).
    pub prompt_tokens: Option<u64>,
    /// A 200 whose stream ended without `data: [DONE]` (or broke off).
    pub truncated: bool,
    /// Still open when the drain time ran out: it hung.
    pub unfinished: bool,
    pub error: Option<String>,
}

impl Record {
    /// Time per output token after the first.
    pub fn per_token(&self) -> Option<f64> {
        let tokens = self.completion_tokens?;
        if tokens < 2 || self.truncated || self.status != 200 {
            return None;
        }
        Some((self.e2e? - self.ttft?) / (tokens - 1) as f64)
    }
}

/// One sample of the gauges; times in simulated seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    pub t: f64,
    pub vllm_running: Option<f64>,
    pub vllm_waiting: Option<f64>,
    pub vllm_kv_usage: Option<f64>,
    /// `vllm:prompt_tokens_total`: prompt tokens the engine has prefilled since it started
    /// (recomputations after a preemption included).
    pub vllm_prompt_tokens: Option<f64>,
    /// The deployment's limit: the one replica's, or the fleet's (`tollgate_fleet_inflight_limit`
    /// as the leader reports it).
    pub tollgate_limit: Option<f64>,
    /// Summed over the replicas.
    pub tollgate_inflight: Option<f64>,
    pub tollgate_queued: Option<f64>,
    /// The p99 TTFT the controller saw at its last tick, in real seconds (NaN: no samples); with
    /// several replicas, the leader's (all replicas' windows merged).
    pub tollgate_controller_p99: Option<f64>,
    /// Requests each tenant has open (sent, not yet answered in full).
    pub client_inflight: Vec<u64>,
    /// Each replica's own gauges, with more than one replica (absent with one).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaSample>,
}

/// One replica's gauges in a sample (`None`: its scrape failed).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaSample {
    /// Its share of the deployment's limit (`tollgate_inflight_limit`).
    pub share: Option<f64>,
    pub inflight: Option<f64>,
    pub queued: Option<f64>,
    pub leader: Option<bool>,
    pub members: Option<f64>,
}

/// One replica's counters at the end of a run (with more than one replica).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaEnd {
    /// Requests the scheduler admitted (at once or after a wait), by tier.
    pub admitted_by_tier: std::collections::BTreeMap<String, u64>,
    /// Times it took the leader lease (`tollgate_fleet_leaderships_total`).
    pub leaderships: u64,
    /// Times it fell back to a local budget (`tollgate_fleet_fallbacks_total`).
    pub fallbacks: u64,
}

pub struct Target {
    pub url: String,
    pub upstream: SocketAddr,
    /// Every replica's admin address (empty: tollgate off).
    pub tollgate_admins: Vec<SocketAddr>,
    /// `(x-user-id, x-user-tier)` per tenant (a tenant of several users appends `-<n>`).
    pub identities: Vec<(String, Option<String>)>,
    /// Calls to every replica's admin API, at their times.
    pub admin_calls: Vec<AdminCall>,
    /// `Authorization: Bearer` for the admin calls: the token in tollgate's `admin.token_file`.
    pub admin_token: Option<String>,
    pub time_scale: f64,
    pub sample_every: f64,
    pub duration: f64,
    pub drain: f64,
    pub label: String,
}

pub struct Outcome {
    pub records: Vec<Record>,
    pub samples: Vec<Sample>,
    pub peak_inflight: Vec<u64>,
    /// 99th percentile of how late requests were sent after their due time (real ms): a busy
    /// machine shows here.
    pub send_lag_p99_ms: f64,
    /// Each replica's counters at the end, with more than one replica (empty with one).
    pub replicas: Vec<ReplicaEnd>,
    /// The admin calls made, with every replica's answer.
    pub admin_calls: Vec<AdminCallResult>,
}

/// One scheduled admin call and what each replica answered.
#[derive(Debug, Clone, Serialize)]
pub struct AdminCallResult {
    #[serde(flatten)]
    pub call: AdminCall,
    /// When it was sent (simulated seconds from the start).
    pub sent_s: f64,
    /// One per replica, in start order.
    pub answers: Vec<AdminAnswer>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AdminAnswer {
    /// HTTP status; 0 when no answer came.
    pub status: u16,
    /// The answer's body (or the error), at most 1,000 characters.
    pub body: String,
}

struct Shared {
    records: Mutex<Vec<Option<Record>>>,
    inflight: Vec<AtomicU64>,
    peak: Vec<AtomicU64>,
    done: AtomicU64,
    lags_us: Mutex<Vec<u64>>,
    samples: Mutex<Vec<Sample>>,
}

pub async fn run(target: &Target, arrivals: &[Arrival], client: &reqwest::Client) -> Outcome {
    let tenants = target.identities.len();
    let shared = Arc::new(Shared {
        records: Mutex::new(vec![None; arrivals.len()]),
        inflight: (0..tenants).map(|_| AtomicU64::new(0)).collect(),
        peak: (0..tenants).map(|_| AtomicU64::new(0)).collect(),
        done: AtomicU64::new(0),
        lags_us: Mutex::new(Vec::with_capacity(arrivals.len())),
        samples: Mutex::new(Vec::new()),
    });
    let scale = target.time_scale;
    let start = Instant::now() + Duration::from_millis(50);
    let real = |sim: f64| Duration::from_secs_f64(sim.max(0.0) / scale);

    let sampler = tokio::spawn(sample_loop(
        SamplerArgs {
            upstream: target.upstream,
            tollgate_admins: target.tollgate_admins.clone(),
            every: target.sample_every,
            scale,
            end: target.duration + target.drain,
            label: target.label.clone(),
            total: arrivals.len(),
            start,
        },
        Arc::clone(&shared),
        client.clone(),
    ));

    let admin = tokio::spawn(admin_loop(
        target.admin_calls.clone(),
        target.tollgate_admins.clone(),
        target.admin_token.clone(),
        start,
        scale,
        client.clone(),
    ));

    let mut tasks = JoinSet::new();
    for (index, arrival) in arrivals.iter().enumerate() {
        let due = start + real(arrival.at);
        tokio::time::sleep_until(due).await;
        let (user, tier) = target.identities[arrival.tenant].clone();
        let user = match arrival.user {
            Some(n) => format!("{user}-{n}"),
            None => user,
        };
        let request = client
            .post(&target.url)
            .header("content-type", "application/json")
            .header("x-user-id", user);
        let request = match tier {
            Some(tier) => request.header("x-user-tier", tier),
            None => request,
        };
        let request = request.body(body(arrival));
        let shared = Arc::clone(&shared);
        let arrival = arrival.clone();
        tasks.spawn(async move {
            let lag = due.elapsed();
            shared.lags_us.lock().unwrap().push(lag.as_micros() as u64);
            let tenant = arrival.tenant;
            let now = shared.inflight[tenant].fetch_add(1, Ordering::Relaxed) + 1;
            shared.peak[tenant].fetch_max(now, Ordering::Relaxed);
            let mut record = send(request, due, scale).await;
            record.tenant = tenant;
            record.at = arrival.at;
            shared.inflight[tenant].fetch_sub(1, Ordering::Relaxed);
            shared.records.lock().unwrap()[index] = Some(record);
            shared.done.fetch_add(1, Ordering::Relaxed);
        });
        // Reap finished tasks as we go, so the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    let deadline = start + real(target.duration + target.drain);
    while !tasks.is_empty() {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(_) => {}
            Err(_) => {
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
            }
        }
    }
    sampler.abort();
    let _ = sampler.await;
    // Every call is due before the arrivals end (the scenario checks): sent by now, or soon.
    let admin_calls = admin.await.unwrap_or_default();
    if std::io::stderr().is_terminal() {
        eprintln!();
    }

    let records = shared
        .records
        .lock()
        .unwrap()
        .iter()
        .zip(arrivals)
        .map(|(record, arrival)| {
            record.clone().unwrap_or_else(|| Record {
                tenant: arrival.tenant,
                at: arrival.at,
                unfinished: true,
                error: Some("still open when the drain time ran out".to_owned()),
                ..Record::default()
            })
        })
        .collect();
    let mut lags = shared.lags_us.lock().unwrap().clone();
    lags.sort_unstable();
    let send_lag_p99_ms = lags
        .get((lags.len() * 99 / 100).min(lags.len().saturating_sub(1)))
        .map_or(0.0, |us| *us as f64 / 1000.0);
    let mut replicas = Vec::new();
    if target.tollgate_admins.len() > 1 {
        for &admin in &target.tollgate_admins {
            let text = scrape(client, admin).await.unwrap_or_default();
            replicas.push(replica_end(&text));
        }
    }
    Outcome {
        records,
        samples: shared.samples.lock().unwrap().clone(),
        peak_inflight: shared
            .peak
            .iter()
            .map(|p| p.load(Ordering::Relaxed))
            .collect(),
        send_lag_p99_ms,
        replicas,
        admin_calls,
    }
}

/// Sends each admin call at its time to every replica, at once, and keeps the answers.
async fn admin_loop(
    calls: Vec<AdminCall>,
    admins: Vec<SocketAddr>,
    token: Option<String>,
    start: Instant,
    scale: f64,
    client: reqwest::Client,
) -> Vec<AdminCallResult> {
    let mut calls = calls;
    calls.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    let mut results = Vec::new();
    for call in calls {
        tokio::time::sleep_until(start + Duration::from_secs_f64(call.at_s / scale)).await;
        let sent_s = start.elapsed().as_secs_f64() * scale;
        let answers = futures_util::future::join_all(admins.iter().map(|&addr| {
            let method =
                reqwest::Method::from_bytes(call.method.as_bytes()).unwrap_or(reqwest::Method::PUT);
            let mut request = client
                .request(method, format!("http://{addr}{}", call.path))
                .timeout(Duration::from_secs(5));
            if let Some(body) = &call.body {
                request = request
                    .header("content-type", "application/json")
                    .body(body.to_string());
            }
            if let Some(token) = &token {
                request = request.bearer_auth(token);
            }
            async move {
                match request.send().await {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let text = response.text().await.unwrap_or_default();
                        // JSON on one line, so that it sits in a table.
                        let body = serde_json::from_str::<serde_json::Value>(&text)
                            .map_or_else(|_| text.trim().to_owned(), |v| v.to_string());
                        AdminAnswer {
                            status,
                            body: body.chars().take(1000).collect(),
                        }
                    }
                    Err(error) => AdminAnswer {
                        status: 0,
                        body: format!("{error}"),
                    },
                }
            }
        }))
        .await;
        for (replica, answer) in answers.iter().enumerate() {
            eprintln!(
                "admin call at {sent_s:.1} s: {} {} -> replica {}: {} {}",
                call.method,
                call.path,
                replica + 1,
                answer.status,
                answer.body
            );
        }
        results.push(AdminCallResult {
            call,
            sent_s,
            answers,
        });
    }
    results
}

/// A replica's end-of-run counters from its `/metrics`.
fn replica_end(text: &str) -> ReplicaEnd {
    let mut admitted_by_tier = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("tollgate_scheduler_outcomes_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
        };
        let (Some(tier), Some(outcome)) = (label("tier"), label("outcome")) else {
            continue;
        };
        if outcome.starts_with("admitted") {
            let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
            *admitted_by_tier.entry(tier).or_insert(0) += n;
        }
    }
    let count = |name: &str| metric(text, name).unwrap_or(0.0) as u64;
    ReplicaEnd {
        admitted_by_tier,
        leaderships: count("tollgate_fleet_leaderships_total"),
        fallbacks: count("tollgate_fleet_fallbacks_total"),
    }
}

/// An OpenAI chat body with `prompt_tokens` one-token words (" hello" is one token in both
/// cl100k and o200k, and one word for the simulated vLLM's count).
fn body(arrival: &Arrival) -> Bytes {
    let prompt = "hello ".repeat(arrival.prompt_tokens as usize);
    let mut body = serde_json::json!({
        "model": "upstream-sim",
        "messages": [{"role": "user", "content": prompt.trim_end()}],
        "max_tokens": arrival.output_tokens,
        "stream": arrival.stream,
    });
    if arrival.stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    Bytes::from(body.to_string())
}

async fn send(request: reqwest::RequestBuilder, due: Instant, scale: f64) -> Record {
    let sim = |at: Instant| at.duration_since(due).as_secs_f64() * scale;
    let mut record = Record::default();
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            record.error = Some(format!("{error}"));
            record.e2e = Some(sim(Instant::now()));
            return record;
        }
    };
    record.status = response.status().as_u16();
    record.reason = response
        .headers()
        .get("x-tollgate-reason")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let streaming = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut stream = response.bytes_stream();
    // The end of the body is all we need: the usage chunk and `[DONE]`.
    let mut tail: Vec<u8> = Vec::new();
    let mut broke = false;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) if bytes.is_empty() => {}
            Ok(bytes) => {
                if record.ttft.is_none() {
                    record.ttft = Some(sim(Instant::now()));
                }
                tail.extend_from_slice(&bytes);
                if tail.len() > 8192 {
                    tail.drain(..tail.len() - 4096);
                }
            }
            Err(error) => {
                record.error = Some(format!("{error}"));
                broke = true;
                break;
            }
        }
    }
    record.e2e = Some(sim(Instant::now()));
    if record.status == 200 {
        let text = String::from_utf8_lossy(&tail);
        let usage = |field: &str| {
            let key = format!("\"{field}\":");
            text.rfind(&key).and_then(|at| {
                let digits: String = text[at + key.len()..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                digits.parse().ok()
            })
        };
        record.completion_tokens = usage("completion_tokens");
        record.prompt_tokens = usage("prompt_tokens");
        record.truncated = broke || (streaming && !text.contains("data: [DONE]"));
    } else {
        record.ttft = None;
    }
    record
}

struct SamplerArgs {
    upstream: SocketAddr,
    tollgate_admins: Vec<SocketAddr>,
    every: f64,
    scale: f64,
    end: f64,
    label: String,
    total: usize,
    start: Instant,
}

/// Samples into `shared.samples` until aborted.
async fn sample_loop(args: SamplerArgs, shared: Arc<Shared>, client: reqwest::Client) {
    let tty = std::io::stderr().is_terminal();
    let mut next = args.start;
    let mut last_line = -1.0_f64;
    loop {
        tokio::time::sleep_until(next).await;
        next += Duration::from_secs_f64(args.every / args.scale);
        let t = args.start.elapsed().as_secs_f64() * args.scale;
        // Every endpoint at once, so the replicas' gauges are of the same moment.
        let (vllm, tollgates) = tokio::join!(
            scrape(&client, args.upstream),
            futures_util::future::join_all(
                args.tollgate_admins
                    .iter()
                    .map(|&admin| scrape(&client, admin))
            )
        );
        let value =
            |text: &Option<String>, name: &str| text.as_deref().and_then(|t| metric(t, name));
        let sum = |name: &str| {
            tollgates
                .iter()
                .filter_map(|t| value(t, name))
                .reduce(|a, b| a + b)
        };
        let controller_p99 =
            |text: &Option<String>| value(text, CONTROLLER_P99).filter(|p| p.is_finite());
        let client_inflight = shared
            .inflight
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect();
        let sample = match &tollgates[..] {
            [] | [_] => {
                let tollgate = tollgates.first().cloned().flatten();
                Sample {
                    t,
                    vllm_running: value(&vllm, "vllm:num_requests_running"),
                    vllm_waiting: value(&vllm, "vllm:num_requests_waiting"),
                    vllm_kv_usage: value(&vllm, "vllm:kv_cache_usage_perc"),
                    vllm_prompt_tokens: value(&vllm, VLLM_PROMPT_TOKENS),
                    tollgate_limit: value(&tollgate, "tollgate_inflight_limit"),
                    tollgate_inflight: value(&tollgate, "tollgate_inflight_requests"),
                    tollgate_queued: value(&tollgate, "tollgate_queued_requests"),
                    tollgate_controller_p99: controller_p99(&tollgate),
                    client_inflight,
                    replicas: Vec::new(),
                }
            }
            several => {
                let replicas: Vec<ReplicaSample> = several
                    .iter()
                    .map(|text| ReplicaSample {
                        share: value(text, "tollgate_inflight_limit"),
                        inflight: value(text, "tollgate_inflight_requests"),
                        queued: value(text, "tollgate_queued_requests"),
                        leader: value(text, "tollgate_fleet_leader").map(|l| l == 1.0),
                        members: value(text, "tollgate_fleet_members"),
                    })
                    .collect();
                let leader = replicas
                    .iter()
                    .position(|r| r.leader == Some(true))
                    .map(|i| &several[i]);
                Sample {
                    t,
                    vllm_running: value(&vllm, "vllm:num_requests_running"),
                    vllm_waiting: value(&vllm, "vllm:num_requests_waiting"),
                    vllm_kv_usage: value(&vllm, "vllm:kv_cache_usage_perc"),
                    vllm_prompt_tokens: value(&vllm, VLLM_PROMPT_TOKENS),
                    // The leader's word on the deployment's limit; between leaders, the
                    // highest any replica last applied.
                    tollgate_limit: leader.and_then(|l| value(l, FLEET_LIMIT)).or_else(|| {
                        several
                            .iter()
                            .filter_map(|t| value(t, FLEET_LIMIT))
                            .reduce(f64::max)
                    }),
                    tollgate_inflight: sum("tollgate_inflight_requests"),
                    tollgate_queued: sum("tollgate_queued_requests"),
                    tollgate_controller_p99: leader.and_then(controller_p99),
                    client_inflight,
                    replicas,
                }
            }
        };
        let open: u64 = sample.client_inflight.iter().sum();
        let line = format!(
            "[{}] t={:>5.0}/{:.0}s  done {}/{}  open {}  vllm running {} waiting {} kv {:.0}%{}",
            args.label,
            t,
            args.end,
            shared.done.load(Ordering::Relaxed),
            args.total,
            open,
            sample.vllm_running.unwrap_or(0.0),
            sample.vllm_waiting.unwrap_or(0.0),
            sample.vllm_kv_usage.unwrap_or(0.0) * 100.0,
            match sample.tollgate_limit {
                Some(limit) => format!(
                    "  tollgate limit {limit}{} in flight {} queued {}",
                    if sample.replicas.is_empty() {
                        String::new()
                    } else {
                        let shares: Vec<String> = sample
                            .replicas
                            .iter()
                            .map(|r| r.share.map_or("?".to_owned(), |s| s.to_string()))
                            .collect();
                        format!(" (shares {})", shares.join("+"))
                    },
                    sample.tollgate_inflight.unwrap_or(0.0),
                    sample.tollgate_queued.unwrap_or(0.0)
                ),
                None => String::new(),
            }
        );
        if tty {
            eprint!("\r{line}\x1b[K");
            let _ = std::io::stderr().flush();
        } else if t - last_line >= 10.0 {
            eprintln!("{line}");
            last_line = t;
        }
        shared.samples.lock().unwrap().push(sample);
    }
}

const VLLM_PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
const CONTROLLER_P99: &str = "tollgate_controller_observed_p99_ttft_seconds";
const FLEET_LIMIT: &str = "tollgate_fleet_inflight_limit";

async fn scrape(client: &reqwest::Client, addr: SocketAddr) -> Option<String> {
    let response = client
        .get(format!("http://{addr}/metrics"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    response.error_for_status().ok()?.text().await.ok()
}

/// Sum of every series of `name` in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(value) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}
