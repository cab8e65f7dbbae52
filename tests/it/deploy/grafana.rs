//! The Grafana dashboard: the seed panels, its data source variable, its layout.

use std::collections::BTreeSet;

use serde_json::Value;

use super::read;

/// The dashboard's panels (rows' nested panels included) and their queries.
pub(super) fn dashboard() -> Value {
    serde_json::from_str(&read("k8s/components/monitoring/grafana-dashboard.json"))
        .expect("grafana-dashboard.json is JSON")
}

pub(super) fn dashboard_panels(dashboard: &Value) -> Vec<&Value> {
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        panels.push(panel);
        panels.extend(panel["panels"].as_array().into_iter().flatten());
    }
    panels
}

/// Proves: the dashboard has the panels of seeds 000 and 001 (per-tier submitted, admitted and
/// shed; p99 TTFT against the target; global limit and in flight; controller actions) and of the
/// fleet (its limit, each replica's share, leader, standing, fallbacks), every panel queries
/// through the dashboard's data source variable, panel ids are unique, and the layout has no
/// overlapping panels.
#[test]
fn grafana_dashboard_has_the_seed_panels() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "tollgate");
    let panels = dashboard_panels(&dashboard);
    let titles: BTreeSet<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for wanted in [
        "Submitted per tier",
        "Admitted per tier",
        "Shed per tier (503)",
        "Refused per tier (429)",
        "p99 time to first token vs target",
        "Global in-flight budget",
        "Controller actions",
        "Stream completions",
        // The fleet: one in-flight budget shared by the replicas.
        "Fleet in-flight limit",
        "Share and in flight per replica",
        "Leader and members",
        "Standing per replica",
        "Fallbacks and leader changes",
    ] {
        assert!(
            titles.contains(wanted),
            "no panel {wanted:?}; have {titles:?}"
        );
    }
    let mut ids = BTreeSet::new();
    let mut boxes = Vec::new();
    for panel in &panels {
        let id = panel["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "panel id {id} is used twice");
        let grid = &panel["gridPos"];
        let (x, y, w, h) = (
            grid["x"].as_u64().expect("x"),
            grid["y"].as_u64().expect("y"),
            grid["w"].as_u64().expect("w"),
            grid["h"].as_u64().expect("h"),
        );
        assert!(w > 0 && h > 0 && x + w <= 24, "panel {id}: gridPos {grid}");
        for &(other, ox, oy, ow, oh) in &boxes {
            let overlap = x < ox + ow && ox < x + w && y < oy + oh && oy < y + h;
            assert!(!overlap, "panels {other} and {id} overlap");
        }
        boxes.push((id, x, y, w, h));
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {id}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {id} has no query");
        let refs: BTreeSet<&str> = targets.iter().filter_map(|t| t["refId"].as_str()).collect();
        assert_eq!(
            refs.len(),
            targets.len(),
            "panel {id}: refIds must be unique"
        );
    }
    assert!(
        dashboard["templating"]["list"]
            .as_array()
            .expect("variables")
            .iter()
            .any(|v| v["name"] == "datasource" && v["type"] == "datasource"),
        "a data source variable"
    );
}
