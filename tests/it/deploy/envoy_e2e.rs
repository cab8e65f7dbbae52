//! The TLS and response-phases-off variants of the front proxy, end to end through real Envoy.

use crate::envoy_config::{client, envoy_dir, test_certs, with_test_certs};
use crate::support::envoy::{ENVOY_VERSION, Envoy, EnvoyPorts, envoy_binary};
use crate::support::process::Upstream;
use crate::support::server::TestServer;

use super::manifests::base_config;
use super::read;

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from:?} must occur once");
    text.replacen(from, to, 1)
}

const CHAT: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":8}"#;

/// Proves: envoy/front-proxy-tls.yaml reaches tollgate over mutual TLS through
/// envoy/tollgate-tls-sidecar.yaml (certificates from a private CA, the server name checked), its
/// grpc.health.v1 checks pass through the TLS hop, and a chat request is admitted by tollgate
/// and answered by the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_front_proxy_reaches_tollgate_through_the_tls_sidecar() {
    let certs = test_certs();
    let tollgate = TestServer::start(base_config()).await;
    let upstream = Upstream::start(&[]);

    // The sidecar's listener (50443) and admin (9902) are its `listen` and `admin`, and the
    // tollgate it forwards to (50051) its `upstream`: launch_with renders it again on fresh
    // listener and admin ports if another process takes one first.
    let sidecar_config = with_test_certs(&read("envoy/tollgate-tls-sidecar.yaml"), certs.path());
    let sidecar_config = replace_once(&sidecar_config, "address: 0.0.0.0", "address: 127.0.0.1");
    let sidecar = Envoy::launch_with(
        &envoy_binary(ENVOY_VERSION),
        "tls-sidecar",
        &EnvoyPorts::free_with(tollgate.grpc.port(), None),
        None,
        |ports| {
            let rendered = [
                ("port_value: 50443", ports.listen),
                ("port_value: 9902", ports.admin),
                ("port_value: 50051", ports.upstream),
            ]
            .into_iter()
            .fold(sidecar_config.clone(), |text, (placeholder, port)| {
                replace_once(&text, placeholder, &format!("port_value: {port}"))
            });
            Ok(rendered)
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error:#}"));
    let tls_port = sidecar.listen.port();

    // Into the front proxy's port scheme (tollgate_testkit::envoy::render_config): the Kubernetes names become loopback,
    // the TLS port the ext_proc placeholder.
    let front = with_test_certs(&read("envoy/front-proxy-tls.yaml"), certs.path());
    let front = replace_once(
        &front,
        "address: tollgate-headless.tollgate.svc.cluster.local",
        "address: 127.0.0.1",
    );
    let front = replace_once(
        &front,
        "address: vllm.inference.svc.cluster.local",
        "address: 127.0.0.1",
    );
    let front = replace_once(&front, "port_value: 50443", "port_value: 50051");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("front-proxy-tls.yaml");
    std::fs::write(&path, front).expect("write config");
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &path,
        EnvoyPorts::free(upstream.addr.port(), tls_port),
    )
    .await;

    let response = client()
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .header("x-user-id", "alice")
        .body(CHAT)
        .send()
        .await
        .expect("POST through Envoy");
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{body}\nEnvoy log:\n{}", envoy.log_tail(30));
    assert!(
        body.contains("\"choices\""),
        "the upstream answered: {body}"
    );
    tollgate
        .wait_for_metric("tollgate_requests_total", &[r#"outcome="admitted""#], 1.0)
        .await;
    assert!(
        envoy.stat("cluster.tollgate.health_check.success").await >= Some(1),
        "grpc.health.v1 checks pass over TLS"
    );
    assert_eq!(
        envoy
            .stat("cluster.tollgate.ssl.handshake")
            .await
            .map(|n| n >= 1),
        Some(true),
        "the ext_proc connection is TLS"
    );
}

/// Proves what docs/deploy.md says of envoy/front-proxy-no-response.yaml: requests are admitted
/// and answered; tollgate sees no response (no time to first token, the stream ends as
/// `no_response`); the request keeps its slot until the HTTP request ends (the upstream takes
/// 1.5 s to answer), then releases it; and, its output unseen, it is charged its input tokens
/// and all the output tokens it reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_phases_off_admit_hold_the_slot_and_charge_the_reserved_output() {
    let tollgate = TestServer::start(base_config()).await;
    let upstream = Upstream::start(&["--ttft-ms", "1500"]);
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &envoy_dir().join("front-proxy-no-response.yaml"),
        EnvoyPorts::free(upstream.addr.port(), tollgate.grpc.port()),
    )
    .await;

    let url = format!("http://{}/v1/chat/completions", envoy.listen);
    let request = tokio::spawn(
        client()
            .post(url)
            .header("content-type", "application/json")
            .header("x-user-id", "alice")
            .body(CHAT)
            .send(),
    );
    // Admitted at once; the slot stays taken while the upstream works.
    tollgate
        .wait_for_metric("tollgate_inflight_requests", &[], 1.0)
        .await;
    let response = request.await.expect("join").expect("POST through Envoy");
    assert_eq!(response.status(), 200, "Envoy log:\n{}", envoy.log_tail(30));
    // The request ended: Envoy closes the ext_proc stream, the slot comes back.
    tollgate
        .wait_for_metric("tollgate_held_streams", &[], 0.0)
        .await;
    let metrics = tollgate
        .wait_for_metric("tollgate_inflight_requests", &[], 0.0)
        .await;

    assert_eq!(
        metrics.value("tollgate_requests_total", &[r#"outcome="admitted""#]),
        1.0
    );
    assert_eq!(
        metrics.value(
            "tollgate_stream_completions_total",
            &[r#"result="no_response""#]
        ),
        1.0
    );
    assert_eq!(
        metrics.value(
            "tollgate_time_to_first_token_seconds_count",
            &[r#"tier="free""#]
        ),
        0.0,
        "no response phase, no time to first token"
    );
    let budget = |kind: &str, stage: &str| {
        metrics.value(
            "tollgate_budget_tokens_total",
            &[
                r#"tier="free""#,
                &format!(r#"kind="{kind}""#),
                &format!(r#"stage="{stage}""#),
            ],
        )
    };
    assert!(budget("input", "reserved") > 0.0);
    assert_eq!(budget("input", "settled"), budget("input", "reserved"));
    assert_eq!(
        budget("output", "reserved"),
        8.0,
        "max_tokens is reserved up front"
    );
    assert_eq!(
        (budget("output", "settled"), budget("output", "refunded")),
        (8.0, 0.0),
        "Envoy reports that it sends no response body, so the output cannot be counted and \
         what the request asked for (its max_tokens) is charged (docs/deploy.md says so)"
    );
}
