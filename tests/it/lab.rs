//! The load lab end to end (examples/lab.rs): a short burst scenario through real Envoy and the
//! simulated vLLM, once with tollgate off and once with tollgate on, in the same test.
//!
//! The scenario: tenant A sends 2 requests/s for 40 simulated seconds; tenant B (free tier)
//! bursts at 30 requests/s from t = 10 s to t = 20 s; every request is 512 tokens in, 128 out,
//! streamed; time scale 5, so each run takes about 15 s of wall time.
//!
//! The assertion is qualitative, with wide margins, because the machine may be a loaded 2-core
//! box: A's p99 time to first token must stay under 5 simulated seconds with tollgate on and
//! exceed it with tollgate off. The two sides are far apart for structural reasons, not timing
//! ones. Off, B's 300 requests fill the simulated KV cache (about 150 sequences fit) and queue
//! inside vLLM, served at about 10 requests/s: A's requests that arrive during the burst wait
//! behind B's, 10 s or more (the engine's unit tests pin this at the model level). On, B may
//! hold 8 requests in flight (429 above), so vLLM runs about 25 sequences and A's TTFT stays at
//! its unloaded ~0.3-0.4 s: more than 10× under the bound, and a slow machine only makes the
//! "off" side worse (its queue is in simulated time). Also: B's excess got 429 or 503 and nothing
//! else; no request hung or was truncated.
//!
//! A second, shorter test runs the lab's `replicas: 3` path: three tollgate binaries sharing one
//! budget through a redis-server the lab starts, behind one Envoy. It asserts the run's
//! structure, not its speed: one summary per replica, one leader at a time, the replicas'
//! admissions adding up to the client's 200s, and never more than the deployment's limit
//! running in the simulated vLLM.

use std::process::Command;

use serde_json::Value;

use super::support::envoy::{ENVOY_VERSION, envoy_binary};
use super::support::process::example_binary;

const SCENARIO: &str = r#"
name: lab-test-burst
time_scale: 5
duration_s: 40
drain_s: 90
seed: 3
sample_every_s: 2
upstream: {stream_interval: 16}
request: {prompt_tokens: 512, output_tokens: 128, stream: true}
tenants:
  - {name: A, user: tenant-a, tier: paid, rate: 2}
  - {name: B, user: tenant-b, tier: free, bursts: [{start_s: 10, length_s: 10, rate: 30}]}
tollgate:
  default_tier: free
  tiers:
    free: {weight: 1, queue_max: 2, queue_deadline_ms: 1000, max_concurrent: 8}
    paid: {weight: 2, queue_max: 8, queue_deadline_ms: 2000}
  scheduler: {initial_limit: 64}
  control: {enabled: true, target_p99_ttft_ms: 2000, floor: 32, ceiling: 256}
runs:
  - {name: off, tollgate: false}
  - {name: on}
"#;

/// The bound on A's p99 TTFT (simulated ms): under it with tollgate on, over it with it off.
const BOUND_MS: f64 = 5_000.0;

fn tenant<'a>(run: &'a Value, name: &str) -> &'a Value {
    run["summary"]["tenants"]
        .as_array()
        .expect("tenants")
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tenant {name}"))
}

fn count(tenant: &Value, field: &str) -> u64 {
    tenant[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {tenant}"))
}

/// Runs the lab binary on `scenario` (YAML text) with the test's binaries; its `summary.json`
/// and stdout.
fn run_lab(scenario: &str) -> (Value, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("scenario.yaml");
    std::fs::write(&path, scenario).expect("write scenario");
    let out = dir.path().join("out");
    let output = Command::new(example_binary("lab"))
        .arg(&path)
        .arg("--out")
        .arg(&out)
        .arg("--envoy-bin")
        .arg(envoy_binary(ENVOY_VERSION))
        .arg("--tollgate-bin")
        .arg(env!("CARGO_BIN_EXE_tollgate"))
        .arg("--upstream-bin")
        .arg(example_binary("upstream"))
        .output()
        .expect("run the lab");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "lab failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("summary.json is JSON");
    (report, stdout)
}

const THREE_REPLICAS: &str = r#"
name: lab-test-replicas
time_scale: 5
duration_s: 30
drain_s: 60
seed: 5
sample_every_s: 1
replicas: 3
upstream: {stream_interval: 16}
request: {prompt_tokens: 512, output_tokens: 64, stream: true}
tenants:
  - {name: A, user: tenant-a, tier: paid, rate: 4}
  - {name: B, user: tenant-b, tier: free, rate: 4}
tollgate:
  default_tier: free
  tiers:
    free: {weight: 1, queue_max: 8, queue_deadline_ms: 2000}
    paid: {weight: 2, queue_max: 8, queue_deadline_ms: 2000}
  scheduler: {initial_limit: 12}
  control: {enabled: false}
runs:
  - {name: fleet}
"#;

#[test]
fn three_replicas_share_one_budget_in_the_lab() {
    let (report, stdout) = run_lab(THREE_REPLICAS);
    assert_eq!(report["replicas"], 3);
    let summary = &report["runs"][0]["summary"];
    assert_eq!(summary["replicas"], 3, "{stdout}");
    // The tollgate config the replicas ran: the fleet's times on the simulated clock.
    let fleet = &report["runs"][0]["tollgate_config"]["fleet"];
    assert_eq!(fleet["sync_ms"], 40, "{fleet}");
    let replicas = summary["replica_summaries"].as_array().expect("replicas");
    assert_eq!(replicas.len(), 3, "{stdout}");
    let led: f64 = replicas
        .iter()
        .map(|r| r["leader_fraction"].as_f64().unwrap())
        .sum();
    assert!(
        (0.9..=1.01).contains(&led),
        "one leader at a time: {led}\n{stdout}"
    );
    let admitted_by_replicas: u64 = replicas
        .iter()
        .flat_map(|r| r["admitted_by_tier"].as_object().unwrap().values())
        .map(|n| n.as_u64().unwrap())
        .sum();
    let admitted_by_client: u64 = ["A", "B"]
        .iter()
        .map(|name| count(tenant(&report["runs"][0], name), "admitted"))
        .sum();
    assert!(admitted_by_client > 0, "{stdout}");
    assert_eq!(admitted_by_replicas, admitted_by_client, "{stdout}");
    assert!(
        summary["peak_vllm_running"].as_f64().unwrap() <= 12.0,
        "more than the deployment's limit ran upstream:\n{stdout}"
    );
    for name in ["A", "B"] {
        let t = tenant(&report["runs"][0], name);
        assert_eq!(count(t, "unfinished"), 0, "{name} hung:\n{stdout}");
        assert_eq!(count(t, "truncated"), 0, "{name} truncated:\n{stdout}");
        assert_eq!(count(t, "other_errors"), 0, "{name} errors:\n{stdout}");
    }
}

#[test]
fn tollgate_keeps_the_steady_tenant_fast_through_a_burst_that_floods_vllm_without_it() {
    let (report, stdout) = run_lab(SCENARIO);
    let runs = report["runs"].as_array().expect("runs");
    let [off, on] = &runs[..] else {
        panic!("expected two runs:\n{stdout}");
    };
    assert_eq!(off["summary"]["tollgate"], false);
    assert_eq!(on["summary"]["tollgate"], true);

    let p99 = |run: &Value| {
        tenant(run, "A")["ttft_p99_ms"]
            .as_f64()
            .unwrap_or_else(|| panic!("A has no TTFT:\n{stdout}"))
    };
    let (p99_off, p99_on) = (p99(off), p99(on));
    eprintln!(
        "A's p99 TTFT: tollgate off {p99_off:.0} ms, on {p99_on:.0} ms (bound {BOUND_MS} ms)"
    );
    assert!(
        p99_on < BOUND_MS,
        "A's p99 TTFT with tollgate on is {p99_on:.0} ms, over {BOUND_MS} ms:\n{stdout}"
    );
    assert!(
        p99_off > BOUND_MS,
        "A's p99 TTFT with tollgate off is only {p99_off:.0} ms: the burst should have flooded \
         vLLM:\n{stdout}"
    );

    for run in [off, on] {
        for name in ["A", "B"] {
            let t = tenant(run, name);
            assert_eq!(count(t, "unfinished"), 0, "{name} hung:\n{stdout}");
            assert_eq!(count(t, "truncated"), 0, "{name} truncated:\n{stdout}");
            assert_eq!(count(t, "other_errors"), 0, "{name} errors:\n{stdout}");
        }
    }
    // Off, everything is admitted; on, A is and B's excess is shed with 429/503.
    for name in ["A", "B"] {
        let t = tenant(off, name);
        assert_eq!(
            count(t, "admitted"),
            count(t, "submitted"),
            "{name}:\n{stdout}"
        );
    }
    let a = tenant(on, "A");
    assert_eq!(count(a, "admitted"), count(a, "submitted"), "A:\n{stdout}");
    let b = tenant(on, "B");
    let shed = count(b, "rejected_429") + count(b, "rejected_503");
    assert!(shed > 0, "B shed nothing:\n{stdout}");
    assert_eq!(
        count(b, "admitted") + shed,
        count(b, "submitted"),
        "B:\n{stdout}"
    );
}

/// Proves: the CPU of a process tree (`host::tree_cpu_ticks`, what bench_overhead reads for
/// LiteLLM, which serves from worker processes) counts a live child's CPU, which the root's own
/// figure leaves out.
#[test]
fn a_process_trees_cpu_counts_its_children() {
    use std::os::unix::process::CommandExt as _;
    use tollgate_testkit::host::{cpu_ticks_of, tree_cpu_ticks};

    // The root shell only waits; a subshell spins, then stays alive (only live processes count).
    let mut root = std::process::Command::new("sh")
        .args([
            "-c",
            "(i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done; sleep 60) & wait",
        ])
        .process_group(0)
        .spawn()
        .expect("spawn sh");
    let pid = root.id();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    let (own, tree) = loop {
        let own = cpu_ticks_of(&format!("/proc/{pid}/stat")).expect("the root's CPU");
        let tree = tree_cpu_ticks(pid).expect("the tree's CPU");
        // 10 ticks: 0.1 s of CPU at the usual 100 ticks a second, all the child's.
        if tree >= own + 10 || tokio::time::Instant::now() > deadline {
            break (own, tree);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    tollgate_testkit::process::kill_process_group(pid);
    let _ = root.wait();
    assert!(
        tree >= own + 10,
        "the tree's CPU ({tree} ticks) should count the spinning child beside the root's ({own})"
    );
    assert_eq!(tree_cpu_ticks(pid), None, "a root that is gone has no tree");
}
