//! Unit tests for `Metrics`: every series exists (at zero) before any event, histograms are
//! real bucketed histograms with the buckets declared here, events move exactly the series
//! they name, and no label could carry a user.
//!
//! The rendered text is parsed into (name, sorted labels) → value, so the tests do not depend
//! on the exporter's label order or number formatting.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::config::Config;
use crate::control::Action;
use crate::policy::Policy;
use crate::reply::Reason;

/// A series: metric name and its labels, sorted.
type Series = (String, BTreeMap<String, String>);

/// Parses Prometheus text exposition (the subset the exporter writes: no escaped quotes or
/// commas in label values, which holds for every label value tollgate uses).
fn parse(text: &str) -> BTreeMap<Series, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("`series value`");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let inner = rest.strip_suffix('}').expect("labels end with }");
                let labels = inner
                    .split(',')
                    .filter(|pair| !pair.is_empty())
                    .map(|pair| {
                        let (k, v) = pair.split_once('=').expect("label=\"value\"");
                        let v = v.strip_prefix('"').and_then(|v| v.strip_suffix('"'));
                        (k.to_owned(), v.expect("a quoted label value").to_owned())
                    })
                    .collect();
                (name, labels)
            }
        };
        let previous = out.insert((name.to_owned(), labels), value);
        assert!(previous.is_none(), "series rendered twice: {line:?}");
    }
    out
}

fn series(name: &str, labels: &[(&str, &str)]) -> Series {
    let labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (name.to_owned(), labels)
}

/// Renders and parses.
fn scrape(metrics: &Metrics) -> BTreeMap<Series, f64> {
    parse(&metrics.render())
}

/// The value of one series, which must exist.
#[track_caller]
fn value(scraped: &BTreeMap<Series, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    match scraped.get(&series(name, labels)) {
        Some(&v) => v,
        None => panic!(
            "no series {name}{labels:?}; rendered {name} series: {:?}",
            scraped
                .keys()
                .filter(|(n, _)| n.starts_with(name))
                .collect::<Vec<_>>()
        ),
    }
}

fn default_policy() -> Policy {
    Policy::from_config(&Config::default()).expect("the default config is valid")
}

fn tiers(policy: &Policy) -> Vec<&str> {
    policy.tiers.iter().map(|t| t.name.as_str()).collect()
}

/// `(name, type)` of every metric.
const METRICS: &[(&str, &str)] = &[
    (REQUESTS, "counter"),
    (REJECTIONS, "counter"),
    (ESTIMATED_INPUT_TOKENS, "histogram"),
    (USAGE_TOKENS, "counter"),
    (TTFT, "histogram"),
    (UPSTREAM_TTFT, "histogram"),
    (REQUEST_DURATION, "histogram"),
    (STREAM_COMPLETIONS, "counter"),
    (HELD_STREAMS, "gauge"),
    (LARGE_BODIES_WAITING, "gauge"),
    (BODIES_COUNTED_OFF_WORKERS, "counter"),
    (DECISION_DURATION, "histogram"),
    (PROTOCOL_ERRORS, "counter"),
    (RESPONSE_REPORTS, "counter"),
    (COUNT_CACHE_LOOKUPS, "counter"),
    (COUNT_CACHE_BYTES, "gauge"),
    (INFLIGHT_LIMIT, "gauge"),
    (INFLIGHT, "gauge"),
    (QUEUED, "gauge"),
    (QUEUE_WAIT, "histogram"),
    (SCHEDULER_SUBMITTED, "counter"),
    (SCHEDULER_OUTCOMES, "counter"),
    (CONTROLLER_ACTIONS, "counter"),
    (CONTROLLER_P99, "gauge"),
    (ENGINE_SCRAPES, "counter"),
    (ENGINE_SATURATION, "gauge"),
    (ENGINE_KV_CACHE_USAGE, "gauge"),
    (ENGINE_WAITING, "gauge"),
    (BUDGET_TOKENS, "counter"),
    (STORE_DURATION, "histogram"),
    (STORE_ERRORS, "counter"),
    (STORE_BREAKER, "gauge"),
    (STORE_BATCH_CALLS, "histogram"),
    (DEGRADED_DECISIONS, "counter"),
    (ACTIVE_LEASES, "gauge"),
    (RUNTIME_WORKER_THREADS, "gauge"),
];

#[test]
fn every_metric_is_rendered_with_its_type_and_help_before_any_event() {
    let rendered = Metrics::new(&default_policy()).render();
    for (name, kind) in METRICS {
        let type_line = format!("# TYPE {name} {kind}\n");
        assert!(
            rendered.contains(&type_line),
            "missing {type_line:?} in:\n{rendered}"
        );
        assert!(
            rendered.contains(&format!("# HELP {name} ")),
            "missing help for {name}"
        );
    }
}

#[test]
fn every_counter_series_exists_at_zero_before_any_event() {
    let policy = default_policy();
    let scraped = scrape(&Metrics::new(&policy));
    let requests = [
        ("inference", "admitted"),
        ("inference", "rejected"),
        ("inference", "shed"),
        ("inference", "abandoned"),
        ("inference", "answered_by_envoy"),
        ("passthrough", "passed_through"),
    ];
    for (class, outcome) in requests {
        let labels = [("route_class", class), ("outcome", outcome)];
        assert_eq!(value(&scraped, REQUESTS, &labels), 0.0);
    }
    for tier in tiers(&policy).into_iter().chain(["none"]) {
        for reason in Reason::ALL {
            let labels = [("reason", reason.as_str()), ("tier", tier)];
            assert_eq!(value(&scraped, REJECTIONS, &labels), 0.0);
        }
    }
    for tier in tiers(&policy) {
        for kind in ["prompt", "completion"] {
            assert_eq!(
                value(&scraped, USAGE_TOKENS, &[("tier", tier), ("kind", kind)]),
                0.0
            );
        }
    }
    for end in ResponseEnd::ALL {
        assert_eq!(
            value(&scraped, STREAM_COMPLETIONS, &[("result", end.as_str())]),
            0.0
        );
    }
    for kind in ["out_of_order", "empty_message"] {
        assert_eq!(value(&scraped, PROTOCOL_ERRORS, &[("kind", kind)]), 0.0);
    }
    for report in ["first_token", "summary"] {
        for outcome in ["matched", "other_replica", "unknown", "missing", "untagged"] {
            assert_eq!(
                value(
                    &scraped,
                    RESPONSE_REPORTS,
                    &[("report", report), ("outcome", outcome)]
                ),
                0.0
            );
        }
    }
    for result in ["found", "counted"] {
        assert_eq!(
            value(&scraped, COUNT_CACHE_LOOKUPS, &[("result", result)]),
            0.0
        );
    }
    for reason in ["size", "costly_text"] {
        assert_eq!(
            value(&scraped, BODIES_COUNTED_OFF_WORKERS, &[("reason", reason)]),
            0.0
        );
    }
    for gauge in [
        HELD_STREAMS,
        LARGE_BODIES_WAITING,
        INFLIGHT_LIMIT,
        INFLIGHT,
        CONTROLLER_P99,
        QUEUED_BODY_BYTES,
        COUNT_CACHE_BYTES,
    ] {
        assert_eq!(value(&scraped, gauge, &[]), 0.0, "{gauge}");
    }
}

#[test]
fn every_scheduler_and_controller_series_exists_at_zero_before_any_event() {
    let policy = default_policy();
    let scraped = scrape(&Metrics::new(&policy));
    let outcomes = [
        "admitted_now",
        "admitted_after_wait",
        "queue_full",
        "queue_bytes_full",
        "queue_timeout",
        "shutting_down",
        "cancelled",
    ];
    for tier in tiers(&policy) {
        assert_eq!(value(&scraped, QUEUED, &[("tier", tier)]), 0.0);
        assert_eq!(value(&scraped, SCHEDULER_SUBMITTED, &[("tier", tier)]), 0.0);
        for outcome in outcomes {
            let labels = [("tier", tier), ("outcome", outcome)];
            assert_eq!(value(&scraped, SCHEDULER_OUTCOMES, &labels), 0.0);
        }
    }
    for action in Action::ALL {
        let labels = [("action", action.as_str())];
        assert_eq!(value(&scraped, CONTROLLER_ACTIONS, &labels), 0.0);
    }
    for result in ["ok", "error"] {
        assert_eq!(value(&scraped, ENGINE_SCRAPES, &[("result", result)]), 0.0);
    }
    // Nothing scraped yet: the engines' load is unknown, not zero.
    for gauge in [ENGINE_SATURATION, ENGINE_KV_CACHE_USAGE, ENGINE_WAITING] {
        assert!(value(&scraped, gauge, &[]).is_nan(), "{gauge}");
    }
}

#[test]
fn engine_scrapes_count_by_result_and_show_the_engines_load() {
    use crate::control::engine::EngineLoad;
    use crate::control::scrape::Scrape;
    let metrics = Metrics::new(&default_policy());
    let load = |kv, waiting| EngineLoad {
        kv_cache_usage: kv,
        waiting,
    };
    let answered = Scrape {
        loads: vec![load(Some(0.5), Some(2.0)), load(Some(0.9), None)],
        failures: 1,
    };
    metrics.engine_scrape(&answered, Some(0.78));
    let scraped = scrape(&metrics);
    assert_eq!(value(&scraped, ENGINE_SCRAPES, &[("result", "ok")]), 2.0);
    assert_eq!(value(&scraped, ENGINE_SCRAPES, &[("result", "error")]), 1.0);
    assert_eq!(value(&scraped, ENGINE_SATURATION, &[]), 0.78);
    // The mean of the engines that report a KV cache; the sum of those that report a queue.
    assert!((value(&scraped, ENGINE_KV_CACHE_USAGE, &[]) - 0.7).abs() < 1e-9);
    assert_eq!(value(&scraped, ENGINE_WAITING, &[]), 2.0);
    // No engine answered: unknown again.
    metrics.engine_scrape(
        &Scrape {
            loads: vec![],
            failures: 2,
        },
        None,
    );
    let scraped = scrape(&metrics);
    assert_eq!(value(&scraped, ENGINE_SCRAPES, &[("result", "error")]), 3.0);
    for gauge in [ENGINE_SATURATION, ENGINE_KV_CACHE_USAGE, ENGINE_WAITING] {
        assert!(value(&scraped, gauge, &[]).is_nan(), "{gauge}");
    }
}

#[test]
fn every_budget_series_exists_at_zero_before_any_event() {
    let policy = default_policy();
    let scraped = scrape(&Metrics::new(&policy));
    for tier in tiers(&policy) {
        for kind in ["input", "output"] {
            for stage in ["reserved", "settled", "refunded"] {
                let labels = [("tier", tier), ("kind", kind), ("stage", stage)];
                assert_eq!(value(&scraped, BUDGET_TOKENS, &labels), 0.0, "{labels:?}");
            }
        }
    }
    for op in ["reserve", "settle", "renew"] {
        for kind in ["timeout", "unavailable", "protocol"] {
            let labels = [("op", op), ("kind", kind)];
            assert_eq!(value(&scraped, STORE_ERRORS, &labels), 0.0, "{labels:?}");
        }
        let count = format!("{STORE_DURATION}_count");
        assert_eq!(value(&scraped, &count, &[("op", op)]), 0.0, "{op}");
    }
    for control in ["budgets", "concurrency"] {
        for mode in ["fail_open", "fail_closed"] {
            let labels = [("control", control), ("mode", mode)];
            assert_eq!(
                value(&scraped, DEGRADED_DECISIONS, &labels),
                0.0,
                "{labels:?}"
            );
        }
    }
    // No lease held; the breaker closed (0), not open.
    assert_eq!(value(&scraped, ACTIVE_LEASES, &[]), 0.0);
    assert_eq!(value(&scraped, STORE_BREAKER, &[]), 0.0);
    // Exactly these: no series with other label values (2 x 3 per tier, 3 x 3, 2 x 2).
    let count = |name: &str| scraped.keys().filter(|(n, _)| n == name).count();
    assert_eq!(count(BUDGET_TOKENS), tiers(&policy).len() * 6);
    assert_eq!(count(STORE_ERRORS), 9);
    assert_eq!(count(DEGRADED_DECISIONS), 4);
}

#[test]
fn series_per_tier_follow_the_configured_tiers() {
    let config = Config {
        tiers: BTreeMap::from([
            ("gold".to_owned(), Default::default()),
            ("silver".to_owned(), Default::default()),
        ]),
        default_tier: "silver".to_owned(),
        ..Config::default()
    };
    let scraped = scrape(&Metrics::new(&Policy::from_config(&config).unwrap()));
    let tiers_of = |name: &str| -> BTreeSet<String> {
        scraped
            .keys()
            .filter(|(n, _)| n == name)
            .filter_map(|(_, labels)| labels.get("tier").cloned())
            .collect()
    };
    let expected = |names: &[&str]| names.iter().map(|s| s.to_string()).collect();
    assert_eq!(tiers_of(REJECTIONS), expected(&["gold", "silver", "none"]));
    assert_eq!(tiers_of(USAGE_TOKENS), expected(&["gold", "silver"]));
    assert_eq!(
        tiers_of(&format!("{TTFT}_count")),
        expected(&["gold", "silver"])
    );
}

/// `name`'s bucket bounds for `labels` are exactly `buckets` then +Inf, all at `count`.
#[track_caller]
fn check_buckets(
    scraped: &BTreeMap<Series, f64>,
    name: &str,
    labels: &[(&str, &str)],
    buckets: &[f64],
    count: f64,
) {
    let bucket_name = format!("{name}_bucket");
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut bounds: Vec<f64> = scraped
        .iter()
        .filter(|((n, l), _)| {
            *n == bucket_name && {
                let mut without_le = l.clone();
                without_le.remove("le").is_some() && without_le == want
            }
        })
        .map(|((_, l), v)| {
            assert_eq!(*v, count, "{bucket_name}{l:?}");
            match l["le"].as_str() {
                "+Inf" => f64::INFINITY,
                le => le.parse().expect("a numeric le"),
            }
        })
        .collect();
    bounds.sort_by(f64::total_cmp);
    let mut expected = buckets.to_vec();
    expected.push(f64::INFINITY);
    assert_eq!(bounds, expected, "{bucket_name}{labels:?}");
    assert_eq!(value(scraped, &format!("{name}_count"), labels), count);
}

#[test]
fn histograms_have_explicit_buckets_before_any_event() {
    let policy = default_policy();
    let metrics = Metrics::new(&policy);
    let rendered = metrics.render();
    assert!(
        !rendered.contains("quantile="),
        "summaries rendered:\n{rendered}"
    );
    let scraped = parse(&rendered);
    for tier in tiers(&policy) {
        let labels = [("tier", tier)];
        check_buckets(&scraped, TTFT, &labels, LATENCY_BUCKETS, 0.0);
        check_buckets(&scraped, UPSTREAM_TTFT, &labels, LATENCY_BUCKETS, 0.0);
        check_buckets(&scraped, REQUEST_DURATION, &labels, LATENCY_BUCKETS, 0.0);
        check_buckets(
            &scraped,
            ESTIMATED_INPUT_TOKENS,
            &labels,
            TOKEN_BUCKETS,
            0.0,
        );
        check_buckets(&scraped, QUEUE_WAIT, &labels, QUEUE_WAIT_BUCKETS, 0.0);
    }
    check_buckets(&scraped, DECISION_DURATION, &[], DECISION_BUCKETS, 0.0);
    for op in StoreOp::ALL {
        let labels = [("op", op.label())];
        check_buckets(&scraped, STORE_DURATION, &labels, STORE_BUCKETS, 0.0);
    }
    check_buckets(&scraped, STORE_BATCH_CALLS, &[], BATCH_BUCKETS, 0.0);
}

#[test]
fn every_histogram_renders_buckets() {
    // Generic over whatever histograms exist, so a new one without buckets (a summary) fails.
    let rendered = Metrics::new(&default_policy()).render();
    let histograms: Vec<&str> = rendered
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" histogram"))
        .collect();
    assert!(histograms.len() >= 6, "{histograms:?}");
    for name in histograms {
        let bucket = format!("{name}_bucket{{");
        let buckets: Vec<&str> = rendered
            .lines()
            .filter(|l| l.starts_with(&bucket))
            .collect();
        assert!(buckets.len() >= 2, "{name} has no buckets");
        assert!(
            buckets.iter().any(|l| l.contains("le=\"+Inf\"")),
            "{name}: {buckets:?}"
        );
    }
}

#[test]
fn histogram_samples_land_in_their_buckets() {
    let policy = default_policy();
    let premium = policy.tier_named("premium").unwrap();
    let metrics = Metrics::new(&policy);
    metrics.time_to_first_token(premium, 0.03);
    metrics.time_to_first_token(premium, 3.0);
    metrics.request_duration(premium, 200.0);
    metrics.estimated_input_tokens(premium, 100);
    metrics.decision_duration(0.0002);
    let scraped = scrape(&metrics);
    let bucket = |name: &str, tier: Option<&str>, le: &str| {
        let mut labels = vec![("le", le)];
        labels.extend(tier.map(|t| ("tier", t)));
        value(&scraped, &format!("{name}_bucket"), &labels)
    };
    let p = Some("premium");
    assert_eq!(bucket(TTFT, p, "0.025"), 0.0);
    assert_eq!(bucket(TTFT, p, "0.05"), 1.0);
    assert_eq!(bucket(TTFT, p, "2"), 1.0);
    assert_eq!(bucket(TTFT, p, "4"), 2.0);
    assert_eq!(bucket(TTFT, p, "+Inf"), 2.0);
    assert_eq!(
        value(&scraped, &format!("{TTFT}_count"), &[("tier", "premium")]),
        2.0
    );
    assert_eq!(
        value(&scraped, &format!("{TTFT}_sum"), &[("tier", "premium")]),
        3.03
    );
    assert_eq!(bucket(TTFT, Some("free"), "+Inf"), 0.0);
    assert_eq!(bucket(REQUEST_DURATION, p, "128"), 0.0);
    assert_eq!(bucket(REQUEST_DURATION, p, "+Inf"), 1.0);
    assert_eq!(bucket(ESTIMATED_INPUT_TOKENS, p, "64"), 0.0);
    assert_eq!(bucket(ESTIMATED_INPUT_TOKENS, p, "256"), 1.0);
    let decision_count = value(&scraped, &format!("{DECISION_DURATION}_count"), &[]);
    assert_eq!(decision_count, 1.0);
    let decision_sum = value(&scraped, &format!("{DECISION_DURATION}_sum"), &[]);
    assert_eq!(decision_sum, 0.0002);
}

#[test]
fn rejection_counts_under_its_reason_and_tier() {
    let policy = default_policy();
    let premium = policy.tier_named("premium").unwrap();
    let metrics = Metrics::new(&policy);
    metrics.rejection(Reason::MissingIdentity, None);
    metrics.rejection(Reason::InputTokensExceeded, Some(premium));
    metrics.rejection(Reason::InputTokensExceeded, Some(premium));
    let scraped = scrape(&metrics);
    for tier in tiers(&policy).into_iter().chain(["none"]) {
        for reason in Reason::ALL {
            let expected = match (reason, tier) {
                (Reason::MissingIdentity, "none") => 1.0,
                (Reason::InputTokensExceeded, "premium") => 2.0,
                _ => 0.0,
            };
            let labels = [("reason", reason.as_str()), ("tier", tier)];
            assert_eq!(value(&scraped, REJECTIONS, &labels), expected, "{labels:?}");
        }
    }
}

#[test]
fn request_outcomes_count_separately() {
    let metrics = Metrics::new(&default_policy());
    metrics.request(RequestOutcome::Admitted);
    metrics.request(RequestOutcome::Admitted);
    metrics.request(RequestOutcome::PassedThrough);
    let scraped = scrape(&metrics);
    let requests = |class, outcome| {
        value(
            &scraped,
            REQUESTS,
            &[("route_class", class), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("inference", "admitted"), 2.0);
    assert_eq!(requests("inference", "rejected"), 0.0);
    assert_eq!(requests("inference", "shed"), 0.0);
    assert_eq!(requests("inference", "abandoned"), 0.0);
    assert_eq!(requests("inference", "answered_by_envoy"), 0.0);
    assert_eq!(requests("passthrough", "passed_through"), 1.0);
}

#[test]
fn usage_completions_and_protocol_errors_count() {
    let policy = default_policy();
    let standard = policy.tier_named("standard").unwrap();
    let metrics = Metrics::new(&policy);
    metrics.usage(standard, 120, 30);
    metrics.usage(standard, 1, 2);
    metrics.stream_completion(ResponseEnd::Truncated);
    metrics.protocol_error(ProtocolError::EmptyMessage);
    let scraped = scrape(&metrics);
    let usage = |tier, kind| value(&scraped, USAGE_TOKENS, &[("tier", tier), ("kind", kind)]);
    assert_eq!(usage("standard", "prompt"), 121.0);
    assert_eq!(usage("standard", "completion"), 32.0);
    assert_eq!(usage("free", "prompt"), 0.0);
    for end in ResponseEnd::ALL {
        let expected = if end == ResponseEnd::Truncated {
            1.0
        } else {
            0.0
        };
        let got = value(&scraped, STREAM_COMPLETIONS, &[("result", end.as_str())]);
        assert_eq!(got, expected, "{end:?}");
    }
    assert_eq!(
        value(&scraped, PROTOCOL_ERRORS, &[("kind", "empty_message")]),
        1.0
    );
    assert_eq!(
        value(&scraped, PROTOCOL_ERRORS, &[("kind", "out_of_order")]),
        0.0
    );
}

#[test]
fn scheduler_events_move_their_series() {
    let policy = default_policy();
    let premium = policy.tier_named("premium").unwrap();
    let metrics = Metrics::new(&policy);
    metrics.scheduler_load(crate::scheduler::Load {
        limit: 64,
        global_limit: 64,
        in_flight: 10,
        queued: 3,
        queued_body_bytes: 83 + 1_048_576,
        held: 5,
        lent: 7,
        standby: 2,
        paced: 11,
        released: 30,
    });
    metrics.scheduler_submitted(premium);
    metrics.scheduler_outcome(premium, SchedulerOutcome::QueueTimeout);
    metrics.queue_wait(premium, 0.3);
    let queued = metrics.hold_queued(premium);
    let scraped = scrape(&metrics);
    assert_eq!(value(&scraped, INFLIGHT_LIMIT, &[]), 64.0);
    assert_eq!(value(&scraped, INFLIGHT, &[]), 10.0);
    assert_eq!(value(&scraped, HEADROOM_HELD, &[]), 5.0);
    assert_eq!(value(&scraped, LENT, &[]), 7.0);
    assert_eq!(value(&scraped, STANDBY, &[]), 2.0);
    assert_eq!(value(&scraped, PACED, &[]), 11.0);
    assert_eq!(value(&scraped, QUEUED_BODY_BYTES, &[]), 83.0 + 1_048_576.0);
    assert_eq!(
        value(&scraped, SCHEDULER_SUBMITTED, &[("tier", "premium")]),
        1.0
    );
    assert_eq!(
        value(&scraped, SCHEDULER_SUBMITTED, &[("tier", "free")]),
        0.0
    );
    let outcome = |o| {
        value(
            &scraped,
            SCHEDULER_OUTCOMES,
            &[("tier", "premium"), ("outcome", o)],
        )
    };
    assert_eq!(outcome("queue_timeout"), 1.0);
    assert_eq!(outcome("queue_full"), 0.0);
    let wait = |le| {
        value(
            &scraped,
            &format!("{QUEUE_WAIT}_bucket"),
            &[("tier", "premium"), ("le", le)],
        )
    };
    assert_eq!(wait("0.25"), 0.0);
    assert_eq!(wait("0.5"), 1.0);
    assert_eq!(value(&scraped, QUEUED, &[("tier", "premium")]), 1.0);
    assert_eq!(value(&scraped, QUEUED, &[("tier", "free")]), 0.0);
    drop(queued);
    assert_eq!(
        value(&scrape(&metrics), QUEUED, &[("tier", "premium")]),
        0.0
    );
}

#[test]
fn controller_ticks_count_actions_and_show_the_p99() {
    let metrics = Metrics::new(&default_policy());
    metrics.controller_tick(Action::Decrease, Some(2.5));
    metrics.controller_tick(Action::Decrease, Some(1.5));
    let scraped = scrape(&metrics);
    assert_eq!(
        value(&scraped, CONTROLLER_ACTIONS, &[("action", "decrease")]),
        2.0
    );
    assert_eq!(
        value(&scraped, CONTROLLER_ACTIONS, &[("action", "increase")]),
        0.0
    );
    assert_eq!(value(&scraped, CONTROLLER_P99, &[]), 1.5);
    // No samples: NaN, not a stale value or zero.
    metrics.controller_tick(Action::Hold(crate::control::Hold::NoSamples), None);
    assert!(value(&scrape(&metrics), CONTROLLER_P99, &[]).is_nan());
}

#[test]
fn held_streams_gauge_follows_the_guards() {
    let metrics = Metrics::new(&default_policy());
    let held = |m: &Metrics| value(&scrape(m), HELD_STREAMS, &[]);
    let first = metrics.hold_stream();
    let second = metrics.clone().hold_stream();
    assert_eq!(held(&metrics), 2.0);
    drop(first);
    assert_eq!(held(&metrics), 1.0);
    drop(second);
    assert_eq!(held(&metrics), 0.0);
}

#[test]
fn two_metrics_do_not_share_counts() {
    let policy = default_policy();
    let a = Metrics::new(&policy);
    let b = Metrics::new(&policy);
    a.request(RequestOutcome::Rejected);
    let rejected = |m: &Metrics| {
        let labels = [("route_class", "inference"), ("outcome", "rejected")];
        value(&scrape(m), REQUESTS, &labels)
    };
    assert_eq!(rejected(&a), 1.0);
    assert_eq!(rejected(&b), 0.0);
}

#[test]
fn labels_are_bounded_sets_never_a_user() {
    let policy = default_policy();
    let metrics = Metrics::new(&policy);
    // Touch everything, so every label in use shows up.
    metrics.rejection(Reason::UnknownTier, Some(0));
    metrics.time_to_first_token(0, 0.1);
    metrics.request_duration(0, 0.1);
    metrics.estimated_input_tokens(0, 10);
    metrics.decision_duration(0.001);
    let keys: BTreeSet<String> = scrape(&metrics)
        .into_keys()
        .flat_map(|(_, labels)| labels.into_keys())
        .collect();
    for forbidden in ["user", "tenant", "user_id", "api_key", "model"] {
        assert!(!keys.contains(forbidden), "label {forbidden:?} in {keys:?}");
    }
    // A new label must be a bounded set; add it here once it is.
    let allowed: BTreeSet<String> = [
        "route_class",
        "outcome",
        "reason",
        "tier",
        "kind",
        "result",
        "action",
        "stage",
        "op",
        "control",
        "mode",
        // FleetStanding: four values.
        "standing",
        // ResponseReport: two values.
        "report",
        "le",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert!(
        keys.is_subset(&allowed),
        "unexpected labels: {:?}",
        keys.difference(&allowed)
    );
}

#[test]
fn store_events_move_their_series() {
    use crate::budget::StoreError;
    use crate::budget::breaker::BreakerState;
    use crate::config::FailMode;
    let metrics = Metrics::new(&default_policy());
    let timeout = StoreError::Timeout(std::time::Duration::from_millis(50));
    metrics.store_call(StoreOp::Settle, 0.05, Some(&timeout));
    metrics.store_call(StoreOp::Settle, 0.001, None::<&StoreError>);
    // As the ledger passes a call's outcome.
    let refused: Result<(), StoreError> = Err(StoreError::Unavailable("refused".to_owned()));
    metrics.store_call(StoreOp::Reserve, 0.002, refused.as_ref().err());
    metrics.breaker_state(BreakerState::Open);
    metrics.degraded(DegradedControl::Concurrency, FailMode::FailClosed);
    let scraped = scrape(&metrics);
    let errors = |op, kind| value(&scraped, STORE_ERRORS, &[("op", op), ("kind", kind)]);
    assert_eq!(errors("settle", "timeout"), 1.0);
    assert_eq!(errors("settle", "unavailable"), 0.0);
    assert_eq!(errors("reserve", "unavailable"), 1.0);
    let calls = |op| value(&scraped, &format!("{STORE_DURATION}_count"), &[("op", op)]);
    assert_eq!(
        (calls("settle"), calls("reserve"), calls("renew")),
        (2.0, 1.0, 0.0)
    );
    assert_eq!(value(&scraped, STORE_BREAKER, &[]), 2.0);
    let degraded = |control, mode| {
        value(
            &scraped,
            DEGRADED_DECISIONS,
            &[("control", control), ("mode", mode)],
        )
    };
    assert_eq!(degraded("concurrency", "fail_closed"), 1.0);
    assert_eq!(degraded("concurrency", "fail_open"), 0.0);
    assert_eq!(degraded("budgets", "fail_closed"), 0.0);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "is not the enum this metric's series were created for")]
fn a_value_of_another_enum_than_metric_labels_names_is_caught() {
    Metrics::new(&default_policy()).rejection(Action::Increase, None);
}

#[test]
fn the_count_cache_s_totals_are_shown_as_read() {
    let metrics = Metrics::new(&default_policy());
    for (found, counted, bytes) in [(3, 5, 4096), (10, 7, 0)] {
        metrics.count_cache(CountCacheStats {
            found,
            counted,
            bytes,
        });
        let scraped = scrape(&metrics);
        assert_eq!(
            value(&scraped, COUNT_CACHE_LOOKUPS, &[("result", "found")]),
            found as f64
        );
        assert_eq!(
            value(&scraped, COUNT_CACHE_LOOKUPS, &[("result", "counted")]),
            counted as f64
        );
        assert_eq!(value(&scraped, COUNT_CACHE_BYTES, &[]), bytes as f64);
    }
}
