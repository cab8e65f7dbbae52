//! Per-tenant and per-run figures from the client's records and the sampled gauges, printed as
//! seed-style Markdown tables and written as JSON and CSV.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use serde_json::Value;

use crate::load::{AdminCallResult, Outcome, Record};

#[derive(Debug, Clone, Serialize)]
pub struct TenantSummary {
    pub name: String,
    pub submitted: u64,
    /// Answered 200 (the stream may still have been cut short).
    pub admitted: u64,
    /// 200 with the whole stream (`[DONE]`).
    pub completed: u64,
    pub rejected_429: u64,
    pub rejected_503: u64,
    /// 400 and 413: refused by a hard limit (input tokens, body size, a malformed request).
    /// Counted in `other_errors` too.
    pub rejected_4xx: u64,
    /// Other statuses and connection errors.
    pub other_errors: u64,
    pub truncated: u64,
    /// Still open when the drain time ran out.
    pub unfinished: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub per_token_p50_ms: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    pub peak_inflight: u64,
    pub output_tokens: u64,
    /// Prompt tokens of the completed requests, as the upstream's usage reported them.
    pub input_tokens: u64,
    /// `x-tollgate-reason` (or `status NNN`) of every refusal.
    pub refusals: BTreeMap<String, u64>,
    /// Arrivals and admissions in the scenario's window.
    pub window_submitted: u64,
    pub window_admitted: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub scenario: String,
    pub run: String,
    pub description: String,
    pub tollgate: bool,
    pub time_scale: f64,
    pub duration_s: f64,
    pub tenants: Vec<TenantSummary>,
    /// Completed requests per second of the run's arrival period.
    pub goodput_rps: f64,
    /// Completed requests whose TTFT met the SLO, per second.
    pub slo_goodput_rps: f64,
    pub slo_ttft_ms: f64,
    pub output_tokens_per_s: f64,
    pub peak_kv_usage: Option<f64>,
    pub peak_vllm_running: Option<f64>,
    pub peak_vllm_waiting: Option<f64>,
    pub limit_min: Option<f64>,
    pub limit_max: Option<f64>,
    pub limit_last: Option<f64>,
    pub send_lag_p99_ms: f64,
    /// p99 TTFT of every completed request, all tenants together (what the controller targets).
    pub ttft_p99_all_ms: Option<f64>,
    /// Prompt tokens the engine prefilled (`vllm:prompt_tokens_total` at the last sample,
    /// recomputations after preemption included): its bill for inputs.
    pub engine_prompt_tokens: Option<f64>,
    /// Calls made to tollgate's admin API during the run, with the answers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub admin_calls: Vec<AdminCallResult>,
    /// tollgate replicas behind Envoy (0: tollgate off).
    pub replicas: usize,
    /// Each replica's own figures, with more than one (the rest of the summary is the
    /// deployment's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replica_summaries: Vec<ReplicaSummary>,
}

/// One replica of several, from its sampled gauges and its counters at the end.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaSummary {
    /// 1-based, in start order.
    pub replica: usize,
    pub share_min: Option<f64>,
    pub share_max: Option<f64>,
    pub share_mean: Option<f64>,
    pub inflight_mean: Option<f64>,
    pub inflight_peak: Option<f64>,
    pub queued_peak: Option<f64>,
    /// Fraction of the samples in which it held the leader lease.
    pub leader_fraction: f64,
    pub admitted_by_tier: BTreeMap<String, u64>,
    pub leaderships: u64,
    pub fallbacks: u64,
}

/// Nearest-rank percentile.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

pub struct RunInfo<'a> {
    pub scenario: &'a str,
    pub run: &'a str,
    pub description: &'a str,
    pub tollgate: bool,
    pub time_scale: f64,
    pub duration_s: f64,
    pub window: Option<[f64; 2]>,
    pub slo_ttft_ms: f64,
    pub tenant_names: Vec<String>,
    /// tollgate replicas (0: tollgate off).
    pub replicas: usize,
}

pub fn summarize(info: &RunInfo<'_>, outcome: &Outcome) -> RunSummary {
    let ms = |v: Option<f64>| v.map(|s| s * 1000.0);
    let in_window = |r: &Record| info.window.is_some_and(|[a, b]| (a..b).contains(&r.at));
    let tenants: Vec<TenantSummary> = info
        .tenant_names
        .iter()
        .enumerate()
        .map(|(index, name)| {
            let records: Vec<&Record> = outcome
                .records
                .iter()
                .filter(|r| r.tenant == index)
                .collect();
            let ok = |r: &&&Record| r.status == 200 && !r.truncated;
            let ttfts: Vec<f64> = records.iter().filter(ok).filter_map(|r| r.ttft).collect();
            let e2es: Vec<f64> = records.iter().filter(ok).filter_map(|r| r.e2e).collect();
            let per_token: Vec<f64> = records.iter().filter_map(|r| r.per_token()).collect();
            let mut refusals = BTreeMap::new();
            for r in records.iter().filter(|r| r.status != 200) {
                let key = match (&r.reason, r.status, r.unfinished) {
                    (_, _, true) => "unfinished".to_owned(),
                    (Some(reason), _, _) => reason.clone(),
                    (None, 0, _) => "connection error".to_owned(),
                    (None, status, _) => format!("status {status}"),
                };
                *refusals.entry(key).or_insert(0) += 1;
            }
            let count =
                |f: &dyn Fn(&Record) -> bool| records.iter().filter(|r| f(r)).count() as u64;
            TenantSummary {
                name: name.clone(),
                submitted: records.len() as u64,
                admitted: count(&|r| r.status == 200),
                completed: count(&|r| r.status == 200 && !r.truncated),
                rejected_429: count(&|r| r.status == 429),
                rejected_503: count(&|r| r.status == 503),
                rejected_4xx: count(&|r| matches!(r.status, 400 | 413)),
                other_errors: count(&|r| !matches!(r.status, 200 | 429 | 503) && !r.unfinished),
                truncated: count(&|r| r.status == 200 && r.truncated),
                unfinished: count(&|r| r.unfinished),
                ttft_p50_ms: ms(percentile(&ttfts, 50.0)),
                ttft_p99_ms: ms(percentile(&ttfts, 99.0)),
                per_token_p50_ms: ms(percentile(&per_token, 50.0)),
                e2e_p50_ms: ms(percentile(&e2es, 50.0)),
                e2e_p99_ms: ms(percentile(&e2es, 99.0)),
                peak_inflight: outcome.peak_inflight.get(index).copied().unwrap_or(0),
                output_tokens: records
                    .iter()
                    .filter(ok)
                    .filter_map(|r| r.completion_tokens)
                    .sum(),
                input_tokens: records
                    .iter()
                    .filter(ok)
                    .filter_map(|r| r.prompt_tokens)
                    .sum(),
                refusals,
                window_submitted: count(&|r| in_window(r)),
                window_admitted: count(&|r| in_window(r) && r.status == 200),
            }
        })
        .collect();
    let completed: Vec<&Record> = outcome
        .records
        .iter()
        .filter(|r| r.status == 200 && !r.truncated)
        .collect();
    let within_slo = completed
        .iter()
        .filter(|r| r.ttft.is_some_and(|t| t * 1000.0 <= info.slo_ttft_ms))
        .count();
    let all_ttfts: Vec<f64> = completed.iter().filter_map(|r| r.ttft).collect();
    let max = |f: fn(&crate::load::Sample) -> Option<f64>| {
        outcome.samples.iter().filter_map(f).reduce(f64::max)
    };
    let min = |f: fn(&crate::load::Sample) -> Option<f64>| {
        outcome.samples.iter().filter_map(f).reduce(f64::min)
    };
    RunSummary {
        scenario: info.scenario.to_owned(),
        run: info.run.to_owned(),
        description: info.description.to_owned(),
        tollgate: info.tollgate,
        time_scale: info.time_scale,
        duration_s: info.duration_s,
        goodput_rps: completed.len() as f64 / info.duration_s,
        slo_goodput_rps: within_slo as f64 / info.duration_s,
        slo_ttft_ms: info.slo_ttft_ms,
        output_tokens_per_s: tenants.iter().map(|t| t.output_tokens).sum::<u64>() as f64
            / info.duration_s,
        tenants,
        peak_kv_usage: max(|s| s.vllm_kv_usage),
        peak_vllm_running: max(|s| s.vllm_running),
        peak_vllm_waiting: max(|s| s.vllm_waiting),
        limit_min: min(|s| s.tollgate_limit),
        limit_max: max(|s| s.tollgate_limit),
        limit_last: outcome.samples.iter().rev().find_map(|s| s.tollgate_limit),
        send_lag_p99_ms: outcome.send_lag_p99_ms,
        ttft_p99_all_ms: ms(percentile(&all_ttfts, 99.0)),
        engine_prompt_tokens: outcome
            .samples
            .iter()
            .rev()
            .find_map(|s| s.vllm_prompt_tokens),
        admin_calls: outcome.admin_calls.clone(),
        replicas: info.replicas,
        replica_summaries: replica_summaries(outcome),
    }
}

fn replica_summaries(outcome: &Outcome) -> Vec<ReplicaSummary> {
    let count = outcome
        .samples
        .iter()
        .map(|s| s.replicas.len())
        .max()
        .unwrap_or(0)
        .max(outcome.replicas.len());
    (0..count)
        .map(|index| {
            let samples: Vec<&crate::load::ReplicaSample> = outcome
                .samples
                .iter()
                .filter_map(|s| s.replicas.get(index))
                .collect();
            let values = |f: fn(&crate::load::ReplicaSample) -> Option<f64>| -> Vec<f64> {
                samples.iter().filter_map(|s| f(s)).collect()
            };
            let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
            let shares = values(|s| s.share);
            let inflight = values(|s| s.inflight);
            let queued = values(|s| s.queued);
            let end = outcome.replicas.get(index).cloned().unwrap_or_default();
            ReplicaSummary {
                replica: index + 1,
                share_min: shares.iter().copied().reduce(f64::min),
                share_max: shares.iter().copied().reduce(f64::max),
                share_mean: mean(&shares),
                inflight_mean: mean(&inflight),
                inflight_peak: inflight.iter().copied().reduce(f64::max),
                queued_peak: queued.iter().copied().reduce(f64::max),
                leader_fraction: if samples.is_empty() {
                    0.0
                } else {
                    samples.iter().filter(|s| s.leader == Some(true)).count() as f64
                        / samples.len() as f64
                },
                admitted_by_tier: end.admitted_by_tier,
                leaderships: end.leaderships,
                fallbacks: end.fallbacks,
            }
        })
        .collect()
}

fn thousands(n: f64) -> String {
    let rounded = n.round() as i64;
    let digits = rounded.abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if rounded < 0 { format!("-{out}") } else { out }
}

fn ms_cell(v: Option<f64>) -> String {
    v.map_or("–".to_owned(), |ms| format!("{} ms", thousands(ms)))
}

/// The seed-style table of one run (Markdown).
pub fn table(summary: &RunSummary, window: Option<[f64; 2]>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "#### {} / {} ({})\n",
        summary.scenario,
        summary.run,
        if summary.tollgate {
            "tollgate on"
        } else {
            "tollgate off"
        }
    );
    if !summary.description.is_empty() {
        let _ = writeln!(out, "{}\n", summary.description);
    }
    let header: Vec<String> = summary.tenants.iter().map(|t| t.name.clone()).collect();
    let _ = writeln!(out, "| | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(header.len()));
    type Cell = fn(&TenantSummary) -> String;
    let mut rows: Vec<(&str, Cell)> = vec![
        ("Submitted", |t| t.submitted.to_string()),
        ("Admitted (200)", |t| t.admitted.to_string()),
        ("400/413 (hard limits)", |t| t.rejected_4xx.to_string()),
        ("429", |t| t.rejected_429.to_string()),
        ("503", |t| t.rejected_503.to_string()),
        ("Other errors", |t| t.other_errors.to_string()),
        ("Truncated streams", |t| t.truncated.to_string()),
        ("Unfinished (hung)", |t| t.unfinished.to_string()),
        ("Median TTFT", |t| ms_cell(t.ttft_p50_ms)),
        ("p99 TTFT", |t| ms_cell(t.ttft_p99_ms)),
        ("Median per-token decode", |t| {
            t.per_token_p50_ms
                .map_or("–".to_owned(), |ms| format!("{ms:.0} ms"))
        }),
        ("Median E2E", |t| ms_cell(t.e2e_p50_ms)),
        ("p99 E2E", |t| ms_cell(t.e2e_p99_ms)),
        ("Peak in-flight (client)", |t| t.peak_inflight.to_string()),
        ("Input tokens served (usage of completed)", |t| {
            thousands(t.input_tokens as f64)
        }),
        ("Refusals by reason", |t| {
            if t.refusals.is_empty() {
                return "–".to_owned();
            }
            t.refusals
                .iter()
                .map(|(reason, n)| format!("{reason} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        }),
    ];
    if window.is_some() {
        rows.push(("Admitted in window", |t| {
            format!("{} / {}", t.window_admitted, t.window_submitted)
        }));
    }
    for (name, cell) in rows {
        let cells: Vec<String> = summary.tenants.iter().map(cell).collect();
        let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
    }
    if let Some([a, b]) = window {
        let total: u64 = summary.tenants.iter().map(|t| t.window_admitted).sum();
        if total > 0 {
            let shares: Vec<String> = summary
                .tenants
                .iter()
                .map(|t| format!("{:.1}%", 100.0 * t.window_admitted as f64 / total as f64))
                .collect();
            let _ = writeln!(
                out,
                "| Share of admissions, arrivals in [{a}, {b}) s | {} |",
                shares.join(" | ")
            );
        }
    }
    let _ = writeln!(
        out,
        "\nGoodput {:.2} req/s ({:.2} req/s with TTFT ≤ {} ms), {} output tokens/s; p99 TTFT of \
         all completed requests {}; vLLM peak KV {}, peak running {}, peak waiting {}, prompt \
         tokens prefilled {}{}; client send lag p99 {:.1} ms (real).\n",
        summary.goodput_rps,
        summary.slo_goodput_rps,
        thousands(summary.slo_ttft_ms),
        thousands(summary.output_tokens_per_s),
        ms_cell(summary.ttft_p99_all_ms),
        summary
            .peak_kv_usage
            .map_or("–".to_owned(), |kv| format!("{:.0}%", kv * 100.0)),
        summary.peak_vllm_running.map_or("–".to_owned(), thousands),
        summary.peak_vllm_waiting.map_or("–".to_owned(), thousands),
        summary
            .engine_prompt_tokens
            .map_or("–".to_owned(), thousands),
        match (summary.limit_min, summary.limit_max, summary.limit_last) {
            (Some(min), Some(max), Some(last)) if summary.replica_summaries.is_empty() => {
                format!("; tollgate limit {min}..{max}, last {last}")
            }
            (Some(min), Some(max), Some(last)) => format!(
                "; the deployment's limit ({} replicas) {min}..{max}, last {last}",
                summary.replica_summaries.len()
            ),
            _ => String::new(),
        },
        summary.send_lag_p99_ms,
    );
    if !summary.replica_summaries.is_empty() {
        out.push_str(&replicas_table(&summary.replica_summaries));
        out.push('\n');
    }
    for call in &summary.admin_calls {
        let answers: Vec<String> = call
            .answers
            .iter()
            .map(|a| format!("{} `{}`", a.status, a.body))
            .collect();
        let _ = writeln!(
            out,
            "Admin call at {:.1} s (due {} s): {} {}{} → {}\n",
            call.sent_s,
            call.call.at_s,
            call.call.method,
            call.call.path,
            call.call
                .body
                .as_ref()
                .map_or(String::new(), |b| format!(" `{b}`")),
            answers.join("; ")
        );
    }
    out
}

/// One line per replica: its share of the limit, its in flight, how long it led, what it
/// admitted by tier.
pub fn replicas_table(replicas: &[ReplicaSummary]) -> String {
    let tiers: Vec<&String> = replicas
        .iter()
        .flat_map(|r| r.admitted_by_tier.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let number = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| replica | share min..max (mean) | in flight mean / peak | queued peak | led (samples) | \
         leaderships | fallbacks | {} |",
        tiers
            .iter()
            .map(|t| format!("admitted {t}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|{}",
        "---|".repeat(tiers.len())
    );
    for r in replicas {
        let admitted: Vec<String> = tiers
            .iter()
            .map(|t| r.admitted_by_tier.get(*t).copied().unwrap_or(0).to_string())
            .collect();
        let _ = writeln!(
            out,
            "| {} | {}..{} ({}) | {} / {} | {} | {:.0}% | {} | {} | {} |",
            r.replica,
            number(r.share_min),
            number(r.share_max),
            r.share_mean.map_or("–".to_owned(), |v| format!("{v:.1}")),
            r.inflight_mean
                .map_or("–".to_owned(), |v| format!("{v:.1}")),
            number(r.inflight_peak),
            number(r.queued_peak),
            r.leader_fraction * 100.0,
            r.leaderships,
            r.fallbacks,
            admitted.join(" | ")
        );
    }
    out
}

/// Run by run (matched by name), `other`'s figures against `base`'s, from two `summary.json`
/// files: goodput, goodput within the SLO, p99 TTFT of all requests and per tenant, and the
/// tenants' shares of admissions (of arrivals in the scenario's window if it has one, else of
/// the whole run). Markdown.
pub fn compare(base: &Value, other: &Value) -> String {
    let runs = |report: &Value| report["runs"].as_array().cloned().unwrap_or_default();
    let name = |report: &Value| report["scenario"].as_str().unwrap_or("?").to_owned();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} (base) against {}: ratio = other / base.\n",
        name(base),
        name(other)
    );
    let _ = writeln!(
        out,
        "| run | goodput req/s | ratio | within SLO req/s | ratio | all p99 TTFT | ratio | \
         p99 TTFT by tenant | shares of admissions |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    let f = |v: &Value| v.as_f64();
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:.2}×", b / a),
        _ => "–".to_owned(),
    };
    for run in runs(base) {
        let run_name = run["summary"]["run"].as_str().unwrap_or("?");
        let Some(theirs) = runs(other)
            .into_iter()
            .find(|r| r["summary"]["run"].as_str() == Some(run_name))
        else {
            continue;
        };
        let (a, b) = (&run["summary"], &theirs["summary"]);
        let pair_rps = |field: &str| {
            format!(
                "{} → {}",
                f(&a[field]).map_or("–".to_owned(), |v| format!("{v:.2}")),
                f(&b[field]).map_or("–".to_owned(), |v| format!("{v:.2}"))
            )
        };
        let pair_ms = |x: Option<f64>, y: Option<f64>| format!("{} → {}", ms_cell(x), ms_cell(y));
        let tenants = |s: &Value| s["tenants"].as_array().cloned().unwrap_or_default();
        let by_tenant: Vec<String> = tenants(a)
            .iter()
            .zip(tenants(b))
            .map(|(x, y)| {
                format!(
                    "{} {}",
                    x["name"].as_str().unwrap_or("?"),
                    ratio(f(&x["ttft_p99_ms"]), f(&y["ttft_p99_ms"]))
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "| {run_name} | {} | {} | {} | {} | {} | {} | {} | {} → {} |",
            pair_rps("goodput_rps"),
            ratio(f(&a["goodput_rps"]), f(&b["goodput_rps"])),
            pair_rps("slo_goodput_rps"),
            ratio(f(&a["slo_goodput_rps"]), f(&b["slo_goodput_rps"])),
            pair_ms(f(&a["ttft_p99_all_ms"]), f(&b["ttft_p99_all_ms"])),
            ratio(f(&a["ttft_p99_all_ms"]), f(&b["ttft_p99_all_ms"])),
            by_tenant.join(", "),
            shares(a),
            shares(b),
        );
    }
    out
}

/// `A 66.5% / B 33.5%`: each tenant's share of admissions, of arrivals in the window if the
/// run counted any there, else of the whole run.
fn shares(summary: &Value) -> String {
    let tenants = summary["tenants"].as_array().cloned().unwrap_or_default();
    let field = |key: &str| -> Vec<u64> {
        tenants
            .iter()
            .map(|t| t[key].as_u64().unwrap_or(0))
            .collect()
    };
    let window = field("window_admitted");
    let (counts, scope) = if window.iter().sum::<u64>() > 0 {
        (window, "window")
    } else {
        (field("admitted"), "run")
    };
    let total = counts.iter().sum::<u64>().max(1) as f64;
    let parts: Vec<String> = tenants
        .iter()
        .zip(&counts)
        .map(|(t, &n)| {
            format!(
                "{} {:.1}%",
                t["name"].as_str().unwrap_or("?"),
                100.0 * n as f64 / total
            )
        })
        .collect();
    format!("{} ({scope})", parts.join(" / "))
}

/// One row per run: the comparison across runs (e.g. a sweep).
pub fn overview(summaries: &[RunSummary]) -> String {
    let Some(first) = summaries.first() else {
        return String::new();
    };
    let names: Vec<&str> = first.tenants.iter().map(|t| t.name.as_str()).collect();
    // A column for hard-limit refusals only where some run has them (seed 003).
    let hard_limits = summaries
        .iter()
        .any(|s| s.tenants.iter().any(|t| t.rejected_4xx > 0));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| run | goodput req/s | within SLO req/s | {} | shed (429+503) |{} peak KV | limit |",
        names
            .iter()
            .map(|n| format!("{n} p99 TTFT"))
            .collect::<Vec<_>>()
            .join(" | "),
        if hard_limits { " 400/413 |" } else { "" }
    );
    let _ = writeln!(
        out,
        "|---|---|---|{}---|{}---|---|",
        "---|".repeat(names.len()),
        if hard_limits { "---|" } else { "" }
    );
    for s in summaries {
        let p99s: Vec<String> = s.tenants.iter().map(|t| ms_cell(t.ttft_p99_ms)).collect();
        let shed: u64 = s
            .tenants
            .iter()
            .map(|t| t.rejected_429 + t.rejected_503)
            .sum();
        let refused = s.tenants.iter().map(|t| t.rejected_4xx).sum::<u64>();
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {} | {} |{} {} | {} |",
            s.run,
            s.goodput_rps,
            s.slo_goodput_rps,
            p99s.join(" | "),
            shed,
            if hard_limits {
                format!(" {refused} |")
            } else {
                String::new()
            },
            s.peak_kv_usage
                .map_or("–".to_owned(), |kv| format!("{:.0}%", kv * 100.0)),
            match (s.limit_min, s.limit_max, s.limit_last) {
                (Some(min), Some(max), Some(last)) if min == max => format!("{last}"),
                (Some(min), Some(max), Some(last)) => format!("{min}..{max} (last {last})"),
                _ => "off".to_owned(),
            }
        );
    }
    out
}

/// Every request of a run, one CSV line each.
pub fn records_csv(records: &[Record], tenant_names: &[String]) -> String {
    let mut out = String::from(
        "tenant,arrival_s,status,reason,ttft_ms,e2e_ms,completion_tokens,truncated,unfinished,\
         prompt_tokens\n",
    );
    let opt = |v: Option<f64>| v.map_or(String::new(), |s| format!("{:.1}", s * 1000.0));
    for r in records {
        let _ = writeln!(
            out,
            "{},{:.3},{},{},{},{},{},{},{},{}",
            tenant_names[r.tenant],
            r.at,
            r.status,
            r.reason.as_deref().unwrap_or(""),
            opt(r.ttft),
            opt(r.e2e),
            r.completion_tokens.map_or(String::new(), |n| n.to_string()),
            r.truncated,
            r.unfinished,
            r.prompt_tokens.map_or(String::new(), |n| n.to_string())
        );
    }
    out
}

/// Per-run, per-tenant figures, one CSV line each.
pub fn summary_csv(summaries: &[RunSummary]) -> String {
    let mut out = String::from(
        "scenario,run,tollgate,tenant,submitted,admitted,completed,429,503,other_errors,truncated,\
         unfinished,ttft_p50_ms,ttft_p99_ms,per_token_p50_ms,e2e_p50_ms,e2e_p99_ms,peak_inflight,\
         goodput_rps,slo_goodput_rps,peak_kv_usage,rejected_4xx,input_tokens\n",
    );
    let opt = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x:.1}"));
    for s in summaries {
        for t in &s.tenants {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.3},{:.3},{},{},{}",
                s.scenario,
                s.run,
                s.tollgate,
                t.name,
                t.submitted,
                t.admitted,
                t.completed,
                t.rejected_429,
                t.rejected_503,
                t.other_errors,
                t.truncated,
                t.unfinished,
                opt(t.ttft_p50_ms),
                opt(t.ttft_p99_ms),
                opt(t.per_token_p50_ms),
                opt(t.e2e_p50_ms),
                opt(t.e2e_p99_ms),
                t.peak_inflight,
                s.goodput_rps,
                s.slo_goodput_rps,
                s.peak_kv_usage
                    .map_or(String::new(), |kv| format!("{kv:.3}")),
                t.rejected_4xx,
                t.input_tokens
            );
        }
    }
    out
}

/// One finished run over a span of its simulated time, `[from, to)` seconds (`lab --slice`):
/// per tenant, the p99 and median TTFT of the completed requests that arrived in it, from the
/// run's `<run>.requests.csv`; and the means of tollgate's limit, its in-flight count and their
/// ratio over the samples in it (those with a limit), from `<run>.samples.json`. For figures a
/// whole run's summary cannot give: a tenant's tail after its own cold start, a lone tenant's
/// use of the budget.
pub fn slice(requests_csv: &str, samples: &Value, from: f64, to: f64) -> Result<String, String> {
    let mut lines = requests_csv.lines();
    let header: Vec<&str> = lines.next().ok_or("no header")?.split(',').collect();
    let column = |name: &str| {
        header
            .iter()
            .position(|c| *c == name)
            .ok_or(format!("no `{name}` column"))
    };
    let (tenant, arrival, status, truncated, ttft) = (
        column("tenant")?,
        column("arrival_s")?,
        column("status")?,
        column("truncated")?,
        column("ttft_ms")?,
    );
    let mut ttfts: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in lines {
        let fields: Vec<&str> = line.split(',').collect();
        let number = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        let entry = ttfts.entry(fields[tenant].to_owned()).or_default();
        let at = number(arrival).ok_or(format!("bad arrival in `{line}`"))?;
        // Completed as the run's summary counts them: a 200 whose stream was not cut short.
        if (from..to).contains(&at)
            && fields.get(status) == Some(&"200")
            && fields.get(truncated) == Some(&"false")
        {
            entry.extend(number(ttft));
        }
    }
    let mut out = format!(
        "arrivals in [{from}, {to}) s\n\n| tenant | completed | median TTFT | p99 TTFT |\n|---|---|---|---|\n"
    );
    let ms =
        |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{} ms", thousands(v.round())));
    for (name, values) in &ttfts {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} |",
            values.len(),
            ms(percentile(values, 50.0)),
            ms(percentile(values, 99.0))
        );
    }
    let in_span: Vec<(f64, f64)> = samples
        .as_array()
        .ok_or("samples are not an array")?
        .iter()
        .filter(|s| s["t"].as_f64().is_some_and(|t| (from..to).contains(&t)))
        .filter_map(|s| {
            Some((
                s["tollgate_limit"].as_f64()?,
                s["tollgate_inflight"].as_f64()?,
            ))
        })
        .filter(|(limit, _)| *limit > 0.0)
        .collect();
    if !in_span.is_empty() {
        let n = in_span.len() as f64;
        let mean = |f: &dyn Fn(&(f64, f64)) -> f64| in_span.iter().map(f).sum::<f64>() / n;
        let _ = writeln!(
            out,
            "\ntollgate over {} samples: mean limit {:.1}, mean in flight {:.1}, mean in flight / limit {:.1} %",
            in_span.len(),
            mean(&|(limit, _)| *limit),
            mean(&|(_, in_flight)| *in_flight),
            100.0 * mean(&|(limit, in_flight)| in_flight / limit)
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        // (p, expected)
        for (p, want) in [(50.0, 50.0), (99.0, 99.0), (100.0, 100.0), (0.0, 1.0)] {
            assert_eq!(percentile(&values, p), Some(want), "p{p}");
        }
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
    }

    #[test]
    fn thousands_separators() {
        for (n, want) in [
            (0.0, "0"),
            (999.4, "999"),
            (1280.0, "1,280"),
            (33200.0, "33,200"),
        ] {
            assert_eq!(thousands(n), want);
        }
    }

    #[test]
    fn a_slice_counts_the_completed_arrivals_in_its_span_and_the_samples_in_it() {
        let csv = "tenant,arrival_s,status,reason,ttft_ms,e2e_ms,truncated\n\
                   A,1.0,200,,100,900,false\n\
                   A,2.0,200,,300,900,false\n\
                   A,2.5,503,queue_full,,,false\n\
                   A,3.0,200,,50,400,true\n\
                   A,9.0,200,,5000,9000,false\n\
                   B,0.5,200,,700,900,false\n";
        let samples = serde_json::json!([
            {"t": 1.0, "tollgate_limit": 10.0, "tollgate_inflight": 5.0},
            {"t": 2.0, "tollgate_limit": 20.0, "tollgate_inflight": 20.0},
            {"t": 9.0, "tollgate_limit": 20.0, "tollgate_inflight": 0.0},
        ]);
        let out = slice(csv, &samples, 1.0, 5.0).unwrap();
        assert!(out.contains("| A | 2 | 100 ms | 300 ms |"), "{out}");
        assert!(out.contains("| B | 0 | – | – |"), "{out}");
        assert!(
            out.contains(
                "2 samples: mean limit 15.0, mean in flight 12.5, mean in flight / limit 75.0 %"
            ),
            "{out}"
        );
        assert!(slice("tenant,status\n", &samples, 0.0, 1.0).is_err());
    }
}
