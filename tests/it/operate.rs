//! Operating tollgate live (issue 18), with real parts: the tollgate binary, real Envoy in
//! front of the example upstream, and real redis-server.
//!
//! - Reload: SIGHUP, or the file's content changing (a Kubernetes ConfigMap update, which swaps
//!   a symlink), applies a valid configuration; a broken one, or one changing what only a
//!   restart can, is refused whole, counted, and the old policy keeps deciding.
//! - The admin API: bearer token on every `/v1/` route, reads included; bad input is a 400
//!   naming the field and changes nothing; a change made on one replica reaches the others
//!   through Redis; racing changes leave one of them whole; a tenant's usage as the store holds
//!   it.
//! - Shadow mode: what enforcement would refuse goes upstream and is counted, per tier and per
//!   tenant.
//!
//! Waits here are "eventually within" polls with generous bounds, never latency assertions.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tollgate_testkit::redis::RedisServer;
use tollgate_testkit::tollgate::{TollgateCommand, TollgateProcess};

use crate::support::envoy::{Envoy, EnvoyPorts, e2e_envoy_version};
use crate::support::process::Upstream;

/// A bound on "eventually": reloads are read every 100 ms and settings synced every 100 ms
/// below; the margin is for a 2-core machine that is also compiling.
const EVENTUALLY: Duration = Duration::from_secs(20);

const TOKEN: &str = "s3cret-admin-token";

/// One tollgate process whose config file the test rewrites. The file sits where a ConfigMap
/// mount puts it: `tollgate.yaml` → `..data/tollgate.yaml`, `..data` → a versioned directory,
/// and an update swaps `..data` atomically.
struct Gate {
    process: TollgateProcess,
    dir: tempfile::TempDir,
    versions: u32,
}

impl Gate {
    async fn start(name: &str, yaml: &str) -> Gate {
        Gate::start_in(name, |_| yaml.to_owned()).await
    }

    /// Starts it on the configuration `yaml` writes for the gate's directory, which holds the
    /// admin token in `token`.
    async fn start_in(name: &str, yaml: impl FnOnce(&Path) -> String) -> Gate {
        let dir = tempfile::Builder::new()
            .prefix("tollgate-operate-")
            .tempdir()
            .expect("temp dir");
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).unwrap();
        write_version(dir.path(), 0, &yaml(dir.path()));
        std::os::unix::fs::symlink("..0", dir.path().join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/tollgate.yaml", dir.path().join("tollgate.yaml"))
            .unwrap();
        let binary = Path::new(env!("CARGO_BIN_EXE_tollgate"));
        let process = TollgateCommand::new(binary, &dir.path().join("tollgate.yaml"))
            .name(name)
            .rust_log("info")
            .start(dir.path())
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        Gate {
            process,
            dir,
            versions: 0,
        }
    }

    /// A ConfigMap update: the new file in a new directory, then `..data` swapped to it by a
    /// rename (atomic), as the kubelet does.
    fn update_configmap(&mut self, yaml: &str) {
        self.versions += 1;
        let version = self.versions;
        write_version(self.dir.path(), version, yaml);
        let next = self.dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(format!("..{version}"), &next).unwrap();
        std::fs::rename(&next, self.dir.path().join("..data")).unwrap();
    }

    /// The file changed in place, then SIGHUP.
    fn rewrite_and_hangup(&mut self, yaml: &str) {
        self.update_configmap(yaml);
        self.process.proc().signal("HUP").unwrap();
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.process.admin)
    }

    async fn reloads(&self, result: &str) -> f64 {
        self.process.metrics().await.unwrap().value(
            "tollgate_config_reloads_total",
            &[&format!("result=\"{result}\"")],
        )
    }

    /// Polls until `want` reloads ended with `result`. Generous: a reload that loads a model's
    /// tokenizer takes seconds in a debug build on a busy machine.
    async fn wait_for_reloads(&self, result: &str, want: f64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let seen = self.reloads(result).await;
            if seen == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "reloads {result}: {seen}, never {want}\n{}",
                self.process.proc().log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        self.process.proc().log()
    }
}

fn write_version(dir: &Path, version: u32, yaml: &str) {
    let data = dir.join(format!("..{version}"));
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("tollgate.yaml"), yaml).unwrap();
}

/// Real Envoy (envoy/front-proxy.yaml) in front of `upstream`, with `gate` as its ext_proc.
async fn envoy_for(gate: &Gate, upstream: &Upstream) -> Envoy {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/front-proxy.yaml");
    let ports = EnvoyPorts::free(upstream.addr.port(), gate.process.grpc.port());
    Envoy::start(&e2e_envoy_version(), &config, ports).await
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A small chat request of `user` through Envoy: its status and response headers.
async fn chat(
    client: &reqwest::Client,
    envoy: &Envoy,
    user: &str,
) -> (u16, reqwest::header::HeaderMap) {
    let body = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
    });
    let response = client
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .header("x-user-id", user)
        .body(serde_json::to_vec(&body).unwrap())
        .send()
        .await
        .expect("Envoy answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let _ = response.bytes().await;
    (status, headers)
}

/// Polls `check` until it holds, or panics with `what`.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + EVENTUALLY;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One tier, `free`, allowing each tenant `rpm` requests a minute and a million tokens; the
/// file is read every 100 ms.
fn tiers_yaml(rpm: u64, extra: &str) -> String {
    format!(
        "default_tier: free\n\
         reload: {{watch_ms: 100}}\n\
         tiers:\n  free: {{max_input_tokens: 1000, max_output_tokens: 100, \
         requests_per_minute: {rpm}, tokens_per_minute: 1000000}}\n\
         {extra}"
    )
}

/// As `tiers_yaml`, reloaded only by SIGHUP (the file is not watched).
fn sighup_yaml(rpm: u64, extra: &str) -> String {
    tiers_yaml(rpm, extra).replace("watch_ms: 100", "watch_ms: 0")
}

/// Requests a tenant may make a minute: enough for any test, or one.
const GENEROUS: u64 = 1000;
const ONE: u64 = 1;

// ---------------------------------------------------------------------------------------------
// Reload
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_a_valid_file_and_refuses_a_broken_one_whole() {
    let upstream = Upstream::start(&[]);
    let mut gate = Gate::start("tollgate-reload", &sighup_yaml(GENEROUS, "")).await;
    let envoy = envoy_for(&gate, &upstream).await;
    let client = client();
    assert_eq!(chat(&client, &envoy, "alice").await.0, 200);

    // SIGHUP with a file that allows one request a minute: alice's second is refused.
    gate.rewrite_and_hangup(&sighup_yaml(ONE, ""));
    gate.wait_for_reloads("applied", 1.0).await;
    assert_eq!(
        chat(&client, &envoy, "alice").await.0,
        429,
        "the new budget decides"
    );
    assert_eq!(chat(&client, &envoy, "bob").await.0, 200);
    let (status, headers) = chat(&client, &envoy, "bob").await;
    assert_eq!(status, 429);
    assert_eq!(
        headers
            .get("x-tollgate-reason")
            .and_then(|v| v.to_str().ok()),
        Some("request_rate_exceeded")
    );

    // Broken files, each refused whole: YAML that does not parse, a value that does not make
    // sense, and a setting that needs a restart. The policy in force keeps deciding.
    let broken = [
        ("tiers: [unclosed\n".to_owned(), "tiers"),
        (
            sighup_yaml(ONE, "scheduler: {initial_limit: 0}\n"),
            "scheduler.initial_limit",
        ),
        (
            sighup_yaml(GENEROUS, "store: {timeout_ms: 75}\n"),
            "store: cannot change while running",
        ),
        (
            sighup_yaml(GENEROUS, "tokens: {max_body_bytes: 100000}\n"),
            "tokens.max_body_bytes: cannot change while running",
        ),
    ];
    for (refused, (yaml, named)) in broken.iter().enumerate() {
        gate.rewrite_and_hangup(yaml);
        gate.wait_for_reloads("refused", refused as f64 + 1.0).await;
        let log = gate.log();
        assert!(log.contains(named), "the refusal names {named:?}:\n{log}");
        assert_eq!(
            chat(&client, &envoy, "bob").await.0,
            429,
            "the old policy still decides"
        );
    }
    assert_eq!(gate.reloads("applied").await, 1.0);
    let metrics = gate.process.metrics().await.unwrap();
    assert_eq!(
        metrics.value("tollgate_config_last_reload_successful", &[]),
        0.0
    );
    assert!(gate.process.proc().check_alive().is_ok());

    // The same content again: nothing to do.
    gate.rewrite_and_hangup(&sighup_yaml(ONE, ""));
    gate.wait_for_reloads("unchanged", 1.0).await;
    let metrics = gate.process.metrics().await.unwrap();
    assert_eq!(
        metrics.value("tollgate_config_last_reload_successful", &[]),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_is_applied_without_a_signal() {
    let upstream = Upstream::start(&[]);
    let mut gate = Gate::start("tollgate-configmap", &tiers_yaml(ONE, "")).await;
    let envoy = envoy_for(&gate, &upstream).await;
    let client = client();
    assert_eq!(chat(&client, &envoy, "alice").await.0, 200);
    assert_eq!(chat(&client, &envoy, "alice").await.0, 429);
    // The kubelet swaps the `..data` symlink; tollgate reads the file through it.
    gate.update_configmap(&tiers_yaml(GENEROUS, ""));
    gate.wait_for_reloads("applied", 1.0).await;
    assert_eq!(chat(&client, &envoy, "alice").await.0, 200);
    assert!(
        gate.log().contains("the configuration file changed"),
        "{}",
        gate.log()
    );
}

// ---------------------------------------------------------------------------------------------
// Shadow mode
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_lets_through_and_counts_what_it_would_refuse() {
    let upstream = Upstream::start(&[]);
    // One request a minute: enforcement refuses each tenant's second. Shadow mode at the top;
    // tenant `enforced` overrides it back.
    let yaml = tiers_yaml(
        ONE,
        "enforce: false\ntenants:\n  enforced: {enforce: true}\n",
    );
    let mut gate = Gate::start("tollgate-shadow", &yaml).await;
    let envoy = envoy_for(&gate, &upstream).await;
    let client = client();
    assert_eq!(chat(&client, &envoy, "alice").await.0, 200);
    for _ in 0..3 {
        let (status, headers) = chat(&client, &envoy, "alice").await;
        assert_eq!(status, 200, "shadow mode lets it through");
        assert_eq!(
            headers
                .get("x-upstream-saw-x-tollgate-shadow-refusal")
                .and_then(|v| v.to_str().ok()),
            Some("request_rate_exceeded"),
            "the upstream is told what would have been refused"
        );
    }
    assert_eq!(chat(&client, &envoy, "enforced").await.0, 200);
    assert_eq!(chat(&client, &envoy, "enforced").await.0, 429);
    let metrics = gate.process.metrics().await.unwrap();
    assert_eq!(
        metrics.value(
            "tollgate_shadow_refusals_total",
            &["reason=\"request_rate_exceeded\"", "tier=\"free\""]
        ),
        3.0
    );
    assert_eq!(
        metrics.sum(
            "tollgate_rejections_total",
            &["reason=\"request_rate_exceeded\""]
        ),
        1.0,
        "only the enforced tenant's refusal"
    );
    assert!(gate.log().contains("shadow mode: would refuse"));

    // A reload turns enforcement on for everyone.
    gate.rewrite_and_hangup(&tiers_yaml(ONE, ""));
    gate.wait_for_reloads("applied", 1.0).await;
    assert_eq!(chat(&client, &envoy, "alice").await.0, 429);
}

// ---------------------------------------------------------------------------------------------
// The admin API
// ---------------------------------------------------------------------------------------------

fn admin_yaml(gate_dir: &Path, redis: &RedisServer) -> String {
    format!(
        "{}admin: {{token_file: {}}}\nstore: {{redis_url: \"{}\"}}\nfleet: {{sync_ms: 100}}\n",
        tiers_yaml(GENEROUS, ""),
        gate_dir.join("token").display(),
        redis.url_without_password()
    )
}

/// Two replicas sharing a Redis, their admin API on, each with its own copy of the token.
async fn two_replicas(redis: &RedisServer) -> (Gate, Gate) {
    (
        Gate::start_in("tollgate-admin-a", |dir| admin_yaml(dir, redis)).await,
        Gate::start_in("tollgate-admin-b", |dir| admin_yaml(dir, redis)).await,
    )
}

async fn call(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, Value) {
    let mut request = client.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_owned());
    }
    let response = request.send().await.expect("the admin port answers");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// `PUT url` with `body` and the token: the status and the answer.
async fn put_json(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    call(
        client,
        reqwest::Method::PUT,
        url,
        Some(TOKEN),
        Some(&body.to_string()),
    )
    .await
}

/// `GET url` with the token: the answer.
async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    call(client, reqwest::Method::GET, url, Some(TOKEN), None)
        .await
        .1
}

/// Polls `GET url` (with the token) until it answers `want`, or panics with `what`.
async fn reads_eventually(client: &reqwest::Client, url: &str, want: &Value, what: &str) {
    eventually(what, || async {
        call(client, reqwest::Method::GET, url, Some(TOKEN), None)
            .await
            .1
            == *want
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_its_token_and_refuses_bad_input_changing_nothing() {
    let redis = RedisServer::start().await;
    let (a, _b) = two_replicas(&redis).await;
    let client = client();
    let get = reqwest::Method::GET;
    let put = reqwest::Method::PUT;
    let thresholds = a.url("/v1/engine/thresholds");

    // Every route, reads included, needs the token.
    for path in [
        "/v1/policy",
        "/v1/engine/thresholds",
        "/v1/control",
        "/v1/tenants/alice/usage",
    ] {
        for token in [None, Some("wrong"), Some("s3cret-admin-tokenX")] {
            let (status, _) = call(&client, get.clone(), &a.url(path), token, None).await;
            assert_eq!(status, 401, "{path} with {token:?}");
        }
        let (status, body) = call(&client, get.clone(), &a.url(path), Some(TOKEN), None).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (status, _) = call(&client, put.clone(), &thresholds, None, Some("{}")).await;
    assert_eq!(status, 401);
    // Never on the gRPC port: it is not HTTP/1 at all.
    assert!(
        client
            .get(format!("http://{}/v1/policy", a.process.grpc))
            .bearer_auth(TOKEN)
            .send()
            .await
            .map(|r| r.status().as_u16() != 200)
            .unwrap_or(true)
    );

    let before = get_json(&client, &thresholds).await;
    let bad = [
        ("{", None),
        ("[]", None),
        (
            r#"{"kv_cache_threshold": 0.5}"#,
            Some("queue_depth_threshold"),
        ),
        (
            r#"{"kv_cache_threshold": 0.5, "queue_depth_threshold": 3, "model": "x"}"#,
            Some("model"),
        ),
        (
            r#"{"kv_cache_threshold": "high", "queue_depth_threshold": 3}"#,
            Some("kv_cache_threshold"),
        ),
        (
            r#"{"kv_cache_threshold": 1.5, "queue_depth_threshold": 3}"#,
            Some("kv_cache_threshold"),
        ),
        (
            r#"{"kv_cache_threshold": 0.5, "queue_depth_threshold": 0}"#,
            Some("queue_depth_threshold"),
        ),
        (
            r#"{"kv_cache_threshold": 0.5, "queue_depth_threshold": -1}"#,
            Some("queue_depth_threshold"),
        ),
        (
            r#"{"kv_cache_threshold": 0.5, "queue_depth_threshold": 2.5}"#,
            Some("queue_depth_threshold"),
        ),
    ];
    for (body, field) in bad {
        let (status, answer) =
            call(&client, put.clone(), &thresholds, Some(TOKEN), Some(body)).await;
        assert_eq!(status, 400, "{body}: {answer}");
        if let Some(field) = field {
            assert_eq!(answer["field"], field, "{body}: {answer}");
        }
    }
    let control = a.url("/v1/control");
    for (body, field) in [
        (r#"{"enabled": true, "floor": 0, "ceiling": 10}"#, "floor"),
        (
            r#"{"enabled": true, "floor": 20, "ceiling": 10}"#,
            "ceiling",
        ),
        (r#"{"enabled": true, "floor": 1}"#, "ceiling"),
        (
            r#"{"enabled": "yes", "floor": 1, "ceiling": 10}"#,
            "enabled",
        ),
        (
            r#"{"enabled": true, "floor": 1, "ceiling": 10, "limit": 5}"#,
            "limit",
        ),
    ] {
        let (status, answer) = call(&client, put.clone(), &control, Some(TOKEN), Some(body)).await;
        assert_eq!(status, 400, "{body}: {answer}");
        if !field.is_empty() {
            assert_eq!(answer["field"], field, "{body}: {answer}");
        }
    }
    let after = get_json(&client, &thresholds).await;
    assert_eq!(before, after, "bad input changed nothing");
    let policy = get_json(&client, &a.url("/v1/policy")).await;
    assert_eq!(policy["settings"]["engine"], Value::Null);
    assert_eq!(policy["settings"]["control"], Value::Null);
    assert!(
        !policy.to_string().contains(TOKEN),
        "the policy never shows the token"
    );
    assert_eq!(
        redis
            .cmd(&["EXISTS", "tollgate:fleet:{tollgate}:settings"])
            .await,
        "0",
        "nothing was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_on_one_replica_reaches_the_other_and_racing_changes_leave_one_whole() {
    let redis = RedisServer::start().await;
    let (a, b) = two_replicas(&redis).await;
    let client = client();

    let wanted = json!({"kv_cache_threshold": 0.6, "queue_depth_threshold": 7});
    let (status, answer) = put_json(&client, &a.url("/v1/engine/thresholds"), &wanted).await;
    assert_eq!((status, &answer), (200, &wanted));
    reads_eventually(
        &client,
        &b.url("/v1/engine/thresholds"),
        &wanted,
        "replica b applies replica a's thresholds",
    )
    .await;
    assert!(
        a.log()
            .contains("run-time setting changed through the admin API")
    );
    assert!(
        b.log()
            .contains("run-time settings changed by another replica")
    );

    let switch = json!({"enabled": false, "floor": 4, "ceiling": 40});
    let (status, _) = put_json(&client, &b.url("/v1/control"), &switch).await;
    assert_eq!(status, 200);
    reads_eventually(
        &client,
        &a.url("/v1/control"),
        &switch,
        "replica a applies replica b's control switch",
    )
    .await;
    let policy = get_json(&client, &a.url("/v1/policy")).await;
    assert_eq!(policy["settings"]["control"], switch);
    assert_eq!(policy["config"]["control"]["ceiling"], 40);
    // The fleet applies it: off, the deployment's limit is scheduler.initial_limit (128); on
    // again with a ceiling of 40, the leader's controller starts from the limit in force and
    // keeps under the ceiling.
    let fleet_limit = |gate: &Gate| {
        let admin = gate.process.admin;
        async move {
            tollgate_testkit::metrics::scrape(admin)
                .await
                .unwrap()
                .value("tollgate_fleet_inflight_limit", &[])
        }
    };
    for gate in [&a, &b] {
        eventually(
            "the controller switched off gives the static limit",
            || async { fleet_limit(gate).await == 128.0 },
        )
        .await;
    }
    let on = json!({"enabled": true, "floor": 4, "ceiling": 40});
    let (status, _) = put_json(&client, &a.url("/v1/control"), &on).await;
    assert_eq!(status, 200);
    for gate in [&a, &b] {
        eventually("on again, under the new ceiling", || async {
            fleet_limit(gate).await == 40.0
        })
        .await;
    }

    // Twenty PUTs at once, half to each replica, each a different pair: both replicas end on
    // the same pair, and it is one that was sent, whole.
    let puts = (0..20u32).map(|i| {
        let client = client.clone();
        let url = if i % 2 == 0 { a.url("/v1/engine/thresholds") } else { b.url("/v1/engine/thresholds") };
        async move {
            let body = json!({"kv_cache_threshold": 0.5 + f64::from(i) / 100.0, "queue_depth_threshold": 10 + i});
            put_json(&client, &url, &body).await.0
        }
    });
    let statuses = futures_util::future::join_all(puts).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let deadline = tokio::time::Instant::now() + EVENTUALLY;
    let settled = loop {
        let x = get_json(&client, &a.url("/v1/engine/thresholds")).await;
        let y = get_json(&client, &b.url("/v1/engine/thresholds")).await;
        if x == y {
            break x;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replicas never agreed: {x} vs {y}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let i = settled["queue_depth_threshold"].as_u64().unwrap() - 10;
    assert!(i < 20, "{settled}");
    assert!(
        (settled["kv_cache_threshold"].as_f64().unwrap() - (0.5 + i as f64 / 100.0)).abs() < 1e-9,
        "one PUT's pair, whole: {settled}"
    );

    // Deleted: the file's values again, everywhere.
    let (status, answer) = call(
        &client,
        reqwest::Method::DELETE,
        &a.url("/v1/engine/thresholds"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(status, 200);
    // The file names none: tollgate's defaults.
    let file = json!({"kv_cache_threshold": 0.9, "queue_depth_threshold": 5});
    assert_eq!(answer, file);
    reads_eventually(
        &client,
        &b.url("/v1/engine/thresholds"),
        &file,
        "replica b drops the deleted setting",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_usage_is_what_every_replica_sees() {
    let redis = RedisServer::start().await;
    let upstream = Upstream::start(&[]);
    let (a, b) = two_replicas(&redis).await;
    let envoy = envoy_for(&a, &upstream).await;
    let client = client();
    for _ in 0..2 {
        assert_eq!(chat(&client, &envoy, "alice").await.0, 200);
    }
    // Read on the replica that served nothing: the store's view.
    let deadline = tokio::time::Instant::now() + EVENTUALLY;
    let usage = loop {
        let usage = get_json(&client, &b.url("/v1/tenants/alice/usage")).await;
        if usage["leases"]["in_use"] == 0 && usage["windows"][0]["used"].as_u64().unwrap_or(0) > 0 {
            break usage;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "alice's usage never settled: {usage}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(usage["tenant"], "alice");
    assert_eq!(usage["tier"], "free");
    let by_name = |name: &str| {
        usage["windows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["window"] == name)
            .unwrap_or_else(|| panic!("no {name} in {usage}"))
            .clone()
    };
    let requests = by_name("requests_minute");
    assert_eq!(
        (requests["used"].as_u64(), requests["limit"].as_u64()),
        (Some(2), Some(GENEROUS))
    );
    assert_eq!(requests["unit"], "requests");
    let window = by_name("tokens_minute");
    assert_eq!(window["unit"], "tokens");
    assert_eq!(window["limit"], 1_000_000);
    assert!(window["used"].as_u64().unwrap() > 2 * 8, "{usage}");
    let reset = window["reset_seconds"].as_f64().unwrap();
    assert!(reset > 0.0 && reset <= 60.0, "{usage}");
    // Nobody else used anything; a tier that does not exist is named.
    let (status, other) = call(
        &client,
        reqwest::Method::GET,
        &b.url("/v1/tenants/bob/usage"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(other["windows"][0]["used"], 0);
    let (status, answer) = call(
        &client,
        reqwest::Method::GET,
        &b.url("/v1/tenants/alice/usage?tier=gold"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!((status, answer["field"].as_str()), (400, Some("tier")));
}

#[tokio::test]
async fn without_a_token_file_the_admin_api_does_not_exist() {
    let gate = Gate::start("tollgate-no-admin", &tiers_yaml(ONE, "")).await;
    let (status, _) = call(
        &client(),
        reqwest::Method::GET,
        &gate.url("/v1/policy"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(status, 404);
}

// ---------------------------------------------------------------------------------------------
// A model's own tokenizer, reloaded (issue 19)
// ---------------------------------------------------------------------------------------------

/// The input tokens tollgate told the upstream it counted for one chat of `model`.
async fn counted(client: &reqwest::Client, envoy: &Envoy, model: &str, body: &Value) -> u32 {
    let mut body = body.clone();
    body["model"] = json!(model);
    let response = client
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .header("x-user-id", "alice")
        .body(serde_json::to_vec(&body).unwrap())
        .send()
        .await
        .expect("Envoy answers");
    assert_eq!(response.status().as_u16(), 200);
    let counted = response
        .headers()
        .get("x-upstream-saw-x-tollgate-input-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("tollgate's count, echoed by the upstream");
    let _ = response.bytes().await;
    counted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_brings_in_a_models_own_tokenizer_and_refuses_a_missing_one() {
    let qwen = tollgate_testkit::repo_root().join(".tools/tokenizers/qwen2_5");
    assert!(
        qwen.join("tokenizer.json").is_file(),
        "the qwen2_5 tokenizer is not installed in {}: run scripts/install-test-deps.sh",
        qwen.display()
    );
    let upstream = Upstream::start(&[]);
    let mut gate = Gate::start("tollgate-tokenizer-reload", &sighup_yaml(GENEROUS, "")).await;
    let envoy = envoy_for(&gate, &upstream).await;
    let client = client();
    let model = "Qwen/Qwen2.5-7B-Instruct";
    let body = json!({
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "排队公平很重要，每个租户都应该按照权重得到服务。请用三句话解释加权公平队列。"},
        ],
        "max_tokens": 8,
    });
    let before = counted(&client, &envoy, model, &body).await;

    let rule = |dir: &Path| {
        format!(
            "tokens:\n  encodings:\n  - pattern: \"Qwen/*\"\n    tokenizer_file: {}\n    chat_template_file: {}\n",
            dir.join("tokenizer.json").display(),
            dir.join("tokenizer_config.json").display()
        )
    };
    let with_qwen = sighup_yaml(GENEROUS, &rule(&qwen));
    gate.rewrite_and_hangup(&with_qwen);
    gate.wait_for_reloads("applied", 1.0).await;
    let after = counted(&client, &envoy, model, &body).await;
    // What the library counts under the same configuration: the reloaded rule reached counting.
    let config = tollgate::config::load(
        Some(&gate.dir.path().join("tollgate.yaml")),
        std::iter::empty(),
    )
    .unwrap();
    let policy = tollgate::policy::Policy::from_config(&config).unwrap();
    let mut expected = body.clone();
    expected["model"] = json!(model);
    let parsed = tollgate::request::parse_body(
        &policy,
        tollgate::request::ApiKind::Chat,
        expected.to_string().as_bytes(),
        u32::MAX,
        "alice",
    )
    .unwrap();
    let tollgate::request::InputCount::Exact(exact) = parsed.input else {
        panic!("over the ceiling");
    };
    assert_eq!(
        after, exact,
        "counted with Qwen's tokenizer and chat template after the reload"
    );
    assert_ne!(after, before, "before the reload, o200k/cl100k counted it");
    assert!(
        gate.log().contains("loaded a model's own tokenizer"),
        "{}",
        gate.log()
    );

    // A rule whose file is missing: refused, naming the file; Qwen's tokenizer keeps counting.
    let missing = gate.dir.path().join("nowhere");
    gate.rewrite_and_hangup(&sighup_yaml(GENEROUS, &rule(&missing)));
    gate.wait_for_reloads("refused", 1.0).await;
    assert!(
        gate.log()
            .contains(&missing.join("tokenizer.json").display().to_string())
    );
    assert_eq!(counted(&client, &envoy, model, &body).await, after);
}
