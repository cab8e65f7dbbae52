//! The alert rules under `promtool check rules` and `promtool test rules`.

use std::path::PathBuf;
use std::process::Command;

use super::manifests::yaml_file;
use super::{INSTALL, on_path, read, root, run, stdout_of};

fn promtool() -> PathBuf {
    on_path("promtool").unwrap_or_else(|| {
        panic!("promtool is not installed: {INSTALL} (or apt-get install -y prometheus)")
    })
}

/// Proves: the rule file passes `promtool check rules`, and its unit tests (every alert fires on
/// its situation and stays quiet on its near misses) pass `promtool test rules`.
#[test]
fn alert_rules_pass_promtool() {
    let dir = root().join("k8s/components/monitoring");
    for args in [
        ["check", "rules", "tollgate.rules.yaml"],
        ["test", "rules", "tollgate.rules.test.yaml"],
    ] {
        let mut command = Command::new(promtool());
        command.args(args).current_dir(&dir);
        stdout_of(
            run(command, None, "promtool"),
            &format!("promtool {args:?}"),
        );
    }
    // Every alert has a unit test.
    let rules = &yaml_file("k8s/components/monitoring/tollgate.rules.yaml")[0];
    let tests = read("k8s/components/monitoring/tollgate.rules.test.yaml");
    for rule in rules["groups"][0]["rules"].as_array().expect("rules") {
        let alert = rule["alert"].as_str().expect("alerts only");
        assert!(
            tests.contains(&format!("alertname: {alert}\n")),
            "{alert} has no promtool unit test"
        );
    }
}
