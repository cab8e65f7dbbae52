//! The alert rules' and the dashboard's queries against a real scrape of tollgate's /metrics,
//! through a small PromQL scanner.

use std::collections::{BTreeMap, BTreeSet};

use crate::support::server::TestServer;

use super::grafana::{dashboard, dashboard_panels};
use super::manifests::{prod_config, yaml_file};

/// Labels Prometheus adds to every scraped series (target labels); queries may group by them.
const TARGET_LABELS: [&str; 7] = [
    "instance",
    "job",
    "namespace",
    "pod",
    "service",
    "endpoint",
    "container",
];

/// A series selector in a query: the metric name and its matchers (label, operator, value).
#[derive(Debug)]
struct Selector {
    metric: String,
    matchers: Vec<(String, String, String)>,
}

/// The `tollgate_*` selectors of a PromQL expression, and the label names of its `by`, `without`,
/// `on` and `ignoring` clauses. A small scanner, enough for the queries in this repository.
fn scan_promql(expr: &str) -> (Vec<Selector>, Vec<String>) {
    let bytes = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let (mut selectors, mut grouping) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'"' {
            // Skip string literals (label values, label_values() arguments are not strings).
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += 1 + usize::from(bytes[i] == b'\\');
            }
            i += 1;
            continue;
        }
        if !ident(bytes[i]) || (i > 0 && ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && ident(bytes[i]) {
            i += 1;
        }
        let word = &expr[start..i];
        let rest = expr[i..].trim_start();
        if word.starts_with("tollgate_") {
            let mut matchers = Vec::new();
            if let Some(inner) = rest.strip_prefix('{') {
                let end = inner.find('}').expect("closing brace");
                for matcher in inner[..end].split(',').filter(|m| !m.trim().is_empty()) {
                    let op_at = matcher.find(['=', '!']).expect("an operator");
                    let label = matcher[..op_at].trim().to_owned();
                    let after = &matcher[op_at..];
                    let op_len = if after.starts_with("=~")
                        || after.starts_with("!~")
                        || after.starts_with("!=")
                    {
                        2
                    } else {
                        1
                    };
                    let value = after[op_len..].trim().trim_matches('"').to_owned();
                    matchers.push((label, after[..op_len].to_owned(), value));
                }
            }
            selectors.push(Selector {
                metric: word.to_owned(),
                matchers,
            });
        } else if matches!(word, "by" | "without" | "on" | "ignoring")
            && let Some(inner) = rest.strip_prefix('(')
        {
            let end = inner.find(')').expect("closing parenthesis");
            grouping.extend(
                inner[..end]
                    .split(',')
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    (selectors, grouping)
}

/// Series of a Prometheus text exposition: metric name -> label sets.
fn series_of(exposition: &str) -> BTreeMap<String, Vec<BTreeMap<String, String>>> {
    let mut series: BTreeMap<String, Vec<BTreeMap<String, String>>> = BTreeMap::new();
    for line in exposition.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (head, _value) = line.rsplit_once(' ').expect("name value");
        let (name, labels) = match head.split_once('{') {
            Some((name, labels)) => (name, labels.trim_end_matches('}')),
            None => (head, ""),
        };
        let labels = labels
            .split(',')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (k, v) = pair.split_once('=').expect("label=value");
                (k.to_owned(), v.trim_matches('"').to_owned())
            })
            .collect();
        series.entry(name.to_owned()).or_default().push(labels);
    }
    series
}

/// Problems of one query against a real exposition: unknown metrics, unknown labels, label values
/// no series has (every series exists from start-up, so a value missing now never appears).
fn query_problems(
    what: &str,
    expr: &str,
    series: &BTreeMap<String, Vec<BTreeMap<String, String>>>,
) -> Vec<String> {
    let (selectors, grouping) = scan_promql(expr);
    let mut problems = Vec::new();
    if selectors.is_empty() {
        problems.push(format!("{what}: no tollgate metric in {expr}"));
    }
    let mut labels_seen = BTreeSet::new();
    for selector in &selectors {
        let Some(sets) = series.get(&selector.metric) else {
            problems.push(format!("{what}: tollgate exports no {}", selector.metric));
            continue;
        };
        labels_seen.extend(sets.iter().flat_map(|set| set.keys().cloned()));
        for (label, op, value) in &selector.matchers {
            if !sets.iter().any(|set| set.contains_key(label)) {
                problems.push(format!("{what}: {} has no label {label}", selector.metric));
                continue;
            }
            if value.contains('$') || value.contains(".*") || op.starts_with('!') {
                continue;
            }
            let alternatives: Vec<&str> = if op == "=~" {
                value.split('|').collect()
            } else {
                vec![value.as_str()]
            };
            for alternative in alternatives {
                if !sets
                    .iter()
                    .any(|set| set.get(label).map(String::as_str) == Some(alternative))
                {
                    problems.push(format!(
                        "{what}: no {}{{{label}=\"{alternative}\"}} series",
                        selector.metric
                    ));
                }
            }
        }
    }
    for label in grouping {
        if !labels_seen.contains(&label) && !TARGET_LABELS.contains(&label.as_str()) {
            problems.push(format!(
                "{what}: groups by {label}, which none of its series has"
            ));
        }
    }
    problems
}

/// Proves: every metric, label and label value that the alert rules and the dashboard query exists
/// in a real scrape of tollgate's /metrics, run with the prod overlay's configuration (so the tier
/// names agree); no series carries a user or tenant label; and the rules' and the dashboard's TTFT
/// thresholds are the controller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_and_dashboard_query_only_real_series() {
    let config_json = prod_config();
    let mut config: tollgate::config::Config =
        serde_json::from_value(config_json.clone()).expect("print-config output is a Config");
    config.store.redis_url = None;
    config.store.redis_password_file = None;
    let server = TestServer::start(config).await;
    // The admin listener is bound before `start` returns: the scrape waits until it is served.
    let exposition = server.metrics().await.0;
    let series = series_of(&exposition);
    assert!(series.len() > 20, "a real scrape:\n{exposition}");

    // No label may name a user (README, ARCHITECTURE invariant); tiers are the config's.
    let mut tiers = BTreeSet::new();
    for (name, sets) in &series {
        for set in sets {
            for forbidden in ["user", "user_id", "tenant", "tenant_id", "api_key"] {
                assert!(
                    !set.contains_key(forbidden),
                    "{name} has a {forbidden} label"
                );
            }
            if let Some(tier) = set.get("tier") {
                tiers.insert(tier.clone());
            }
        }
    }
    let mut expected: BTreeSet<String> = config_json["tiers"]
        .as_object()
        .expect("tiers")
        .keys()
        .cloned()
        .collect();
    expected.insert("none".to_owned());
    assert_eq!(
        tiers, expected,
        "tier label values are the config's tiers (and none)"
    );

    let mut problems = Vec::new();
    let rules = &yaml_file("k8s/components/monitoring/tollgate.rules.yaml")[0];
    for rule in rules["groups"][0]["rules"].as_array().expect("rules") {
        let alert = rule["alert"].as_str().expect("alert");
        problems.extend(query_problems(
            alert,
            rule["expr"].as_str().expect("expr"),
            &series,
        ));
    }
    let dashboard = dashboard();
    for panel in dashboard_panels(&dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let what = format!("panel {:?}", panel["title"].as_str().unwrap_or_default());
            problems.extend(query_problems(
                &what,
                target["expr"].as_str().expect("expr"),
                &series,
            ));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if let Some(definition) = variable["definition"].as_str() {
            // label_values(metric, label)
            let inner = definition
                .strip_prefix("label_values(")
                .and_then(|d| d.strip_suffix(')'))
                .expect("label_values(metric, label)");
            let (metric, label) = inner.split_once(',').expect("metric, label");
            let has = series
                .get(metric.trim())
                .is_some_and(|sets| sets.iter().any(|set| set.contains_key(label.trim())));
            if !has {
                problems.push(format!("variable {definition}: no such series or label"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // Thresholds: the controller's target (dashboard) and its decrease point (alert).
    let target_s = config_json["control"]["target_p99_ttft_ms"]
        .as_f64()
        .expect("target")
        / 1000.0;
    let band = config_json["control"]["band"].as_f64().expect("band");
    let ttft_panel = dashboard_panels(&dashboard)
        .into_iter()
        .find(|p| p["title"] == "p99 time to first token vs target")
        .expect("the TTFT panel");
    assert_eq!(
        ttft_panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"].as_f64(),
        Some(target_s),
        "the dashboard's target line is control.target_p99_ttft_ms"
    );
    let ttft_alert = rules["groups"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["alert"] == "TollgateTTFTAboveTarget")
        .expect("the TTFT alert");
    let threshold: f64 = ttft_alert["expr"]
        .as_str()
        .and_then(|e| e.trim().rsplit_once('>'))
        .and_then(|(_, t)| t.trim().parse().ok())
        .expect("expr ends with > THRESHOLD");
    assert!(
        (threshold - target_s * (1.0 + band)).abs() < 1e-9,
        "TollgateTTFTAboveTarget fires at target x (1 + band) = {}, not {threshold}",
        target_s * (1.0 + band)
    );
    server.stop().await.expect("tollgate shuts down cleanly");
}

#[test]
fn promql_scanner_reads_selectors_and_grouping() {
    let (selectors, grouping) = scan_promql(
        r#"sum by (tier, le) (rate(tollgate_x_bucket{tier=~"a|b", outcome!="c"}[5m])) / on() max(tollgate_y) > 0"#,
    );
    assert_eq!(selectors.len(), 2);
    assert_eq!(selectors[0].metric, "tollgate_x_bucket");
    assert_eq!(
        selectors[0].matchers,
        vec![
            ("tier".to_owned(), "=~".to_owned(), "a|b".to_owned()),
            ("outcome".to_owned(), "!=".to_owned(), "c".to_owned()),
        ]
    );
    assert_eq!(selectors[1].metric, "tollgate_y");
    assert_eq!(grouping, vec!["tier", "le"]);
}
