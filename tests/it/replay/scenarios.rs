//! The recorded scenarios: what a client does through real Envoy (with the recorder between
//! Envoy and the tollgate binary) to produce each file of `tests/fixtures/recorded/`.
//! `scripts/record-corpus.sh` runs [`record_corpus`] (an ignored test).

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::support::envoy::{Envoy, EnvoyPorts};
use crate::support::process::{Tollgate, Upstream};
use crate::support::recorder::Recorder;
use crate::support::recording::{FORMAT, Header, Recording, corpus_dir, normalizations};

/// Event times are rounded down to this (100 ms): queue waits and deadlines show, scheduling
/// jitter does not.
pub const TIME_QUANTUM_US: u32 = 100_000;

/// The Envoy versions the corpus is recorded from. Keep in step with
/// `scripts/install-test-deps.sh` (`VALIDATED_ENVOY_VERSIONS`).
pub const RECORDED_ENVOY_VERSIONS: [&str; 3] = ["1.36.4", "1.38.3", "1.40.0"];

/// The API key of the `identity_api_key` scenario (its SHA-256 is in the config).
const API_KEY: &str = "sk-recorded-corpus-key";

/// The listener's buffer limit in the `body_*_limit` scenarios, lowered from the front proxy's
/// 8 MiB so a body near it keeps the corpus small; still over tollgate's threshold for counting
/// off the async workers (16 KiB).
const SMALL_BUFFER_LIMIT: usize = 320 * 1024;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum EnvoyConfig {
    FrontProxy,
    /// `front-proxy.yaml` with `per_connection_buffer_limit_bytes` lowered to
    /// [`SMALL_BUFFER_LIMIT`].
    SmallBuffer,
    NoResponse,
}

impl EnvoyConfig {
    fn describe(self) -> String {
        match self {
            EnvoyConfig::FrontProxy => "envoy/front-proxy.yaml".to_owned(),
            EnvoyConfig::SmallBuffer => format!(
                "envoy/front-proxy.yaml with per_connection_buffer_limit_bytes: {SMALL_BUFFER_LIMIT}"
            ),
            EnvoyConfig::NoResponse => "envoy/front-proxy-no-response.yaml".to_owned(),
        }
    }
}

pub struct Scenario {
    pub name: &'static str,
    pub description: &'static str,
    pub envoy: EnvoyConfig,
    pub tollgate_config: String,
}

const DEFAULTS: &str = "{}\n";

/// One slot and no controller, so a second request waits for the first (as in e2e.rs).
const ONE_SLOT: &str = "scheduler:\n  initial_limit: 1\ncontrol:\n  enabled: false\n\
tiers:\n  free:\n    queue_max: 2\n    queue_deadline_ms: 1000\n  premium:\n    weight: 4\n    queue_max: 8\n    queue_deadline_ms: 5000\n";

/// Every scenario, in the order of docs/conformance.md.
pub fn scenarios() -> Vec<Scenario> {
    let s = |name, description, envoy, config: &str| Scenario {
        name,
        description,
        envoy,
        tollgate_config: config.to_owned(),
    };
    use EnvoyConfig::{FrontProxy, NoResponse, SmallBuffer};
    let api_key_config = format!(
        "identity:\n  api_keys:\n  - sha256: \"{}\"\n    tenant: acme\n    tier: standard\n",
        hex::encode(Sha256::digest(API_KEY.as_bytes()))
    );
    vec![
        s(
            "chat_json",
            "Chat completion, JSON response, HTTP/1.1, identity by x-user-id.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "chat_sse",
            "Chat completion streamed (SSE); tollgate asks for the usage chunk.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "completions_json",
            "Legacy completion (prompt), JSON response.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "completions_sse",
            "Legacy completion streamed (SSE).",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "chat_http2",
            "Chat completion from an HTTP/2 (prior knowledge) client.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "identity_header_tier",
            "Identity by x-user-id with tier premium by x-user-tier.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "identity_api_key",
            "Identity by Authorization: Bearer API key (tenant acme, tier standard).",
            FrontProxy,
            &api_key_config,
        ),
        s(
            "body_near_limit",
            "A ~320 KiB prompt just under Envoy's buffer limit (lowered to 320 KiB); admitted.",
            SmallBuffer,
            "tiers:\n  free:\n    max_input_tokens: 120000\n    tokens_per_hour: 10000000\n",
        ),
        s(
            "body_over_limit",
            "A body one KiB over Envoy's buffer limit: Envoy's own 413 (from 1.38 on, its headers and body pass tollgate's response phases).",
            SmallBuffer,
            DEFAULTS,
        ),
        s(
            "non_inference",
            "POST /echo (octet-stream) and GET /health: passed through with mode_override.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "bad_json_400",
            "Truncated JSON body: 400 malformed_json.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "missing_identity_401",
            "No identity header or key: 401 at the request headers.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "concurrency_429",
            "A second request while the user's only concurrent slot is held: 429.",
            FrontProxy,
            "tiers:\n  free:\n    max_concurrent: 1\n    tokens_per_hour: 100000\n",
        ),
        s(
            "queue_timeout_503",
            "The only global slot is held for 2 s; a free request's 1 s queue deadline passes: 503.",
            FrontProxy,
            ONE_SLOT,
        ),
        s(
            "queued_then_admitted",
            "The only global slot is held for 1.5 s; a premium request waits in the queue, then is admitted.",
            FrontProxy,
            ONE_SLOT,
        ),
        s(
            "client_abort_before_first_byte",
            "The client gives up 500 ms into a 3 s time to first token.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "client_abort_after_first_byte",
            "The client drops a stream after its first chunk.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "upstream_500",
            "The upstream answers 500 with an error body.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "upstream_reset",
            "The upstream cuts a streamed response after 3 tokens.",
            FrontProxy,
            DEFAULTS,
        ),
        s(
            "no_response_phases",
            "Chat JSON through envoy/front-proxy-no-response.yaml (response phases off).",
            NoResponse,
            DEFAULTS,
        ),
    ]
}

fn chat(extra: Value) -> Vec<u8> {
    let mut body = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Write a haiku about fair queues."}],
        "max_tokens": 4,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    serde_json::to_vec(&body).unwrap()
}

fn completion(extra: Value) -> Vec<u8> {
    let mut body =
        json!({"model": "gpt-3.5-turbo-instruct", "prompt": "Once upon a time", "max_tokens": 4});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    serde_json::to_vec(&body).unwrap()
}

const USER: [(&str, &str); 2] = [("content-type", "application/json"), ("x-user-id", "alice")];

struct Ctx<'a> {
    base: String,
    h1: reqwest::Client,
    h2: reqwest::Client,
    tollgate: &'a Tollgate,
}

impl Ctx<'_> {
    fn request(
        &self,
        client: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> reqwest::RequestBuilder {
        let mut request = client.request(method, format!("{}{path}", self.base));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        request.body(body)
    }

    /// Sends and reads the whole response; the status, or 0 when the exchange failed.
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> u16 {
        let request = self.request(&self.h1, reqwest::Method::POST, path, headers, body);
        finish(request).await
    }

    /// Holds the only slot (or the user's only concurrent lease) for `hold_ms`, and waits until
    /// tollgate admitted it.
    async fn hold(&self, user: &str, hold_ms: &str) -> tokio::task::JoinHandle<u16> {
        let request = self.request(
            &self.h1,
            reqwest::Method::POST,
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("x-user-id", user),
                ("x-upstream-ttft-ms", hold_ms),
            ],
            chat(json!({})),
        );
        let holder = tokio::spawn(finish(request));
        self.tollgate
            .wait_for_metric("tollgate_requests_total", &["outcome=\"admitted\""], 1.0)
            .await;
        holder
    }
}

async fn finish(request: reqwest::RequestBuilder) -> u16 {
    match request.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let _ = response.bytes().await;
            status
        }
        Err(_) => 0,
    }
}

async fn drive(name: &str, ctx: &Ctx<'_>) {
    let chat_path = "/v1/chat/completions";
    match name {
        "chat_json" => assert_eq!(ctx.post(chat_path, &USER, chat(json!({}))).await, 200),
        "chat_sse" => assert_eq!(
            ctx.post(chat_path, &USER, chat(json!({"stream": true})))
                .await,
            200
        ),
        "completions_json" => assert_eq!(
            ctx.post("/v1/completions", &USER, completion(json!({})))
                .await,
            200
        ),
        "completions_sse" => assert_eq!(
            ctx.post(
                "/v1/completions",
                &USER,
                completion(json!({"stream": true}))
            )
            .await,
            200
        ),
        "chat_http2" => {
            let request = ctx.request(
                &ctx.h2,
                reqwest::Method::POST,
                chat_path,
                &USER,
                chat(json!({})),
            );
            assert_eq!(finish(request).await, 200);
        }
        "identity_header_tier" => {
            let headers = [
                ("content-type", "application/json"),
                ("x-user-id", "bob"),
                ("x-user-tier", "premium"),
            ];
            assert_eq!(ctx.post(chat_path, &headers, chat(json!({}))).await, 200);
        }
        "identity_api_key" => {
            let auth = format!("Bearer {API_KEY}");
            let headers = [
                ("content-type", "application/json"),
                ("authorization", auth.as_str()),
            ];
            assert_eq!(ctx.post(chat_path, &headers, chat(json!({}))).await, 200);
        }
        "body_near_limit" | "body_over_limit" => {
            let sentence = "The quick brown fox jumps over the lazy dog. ";
            let envelope = chat(json!({"messages": [{"role": "user", "content": ""}]})).len();
            let target = if name == "body_near_limit" {
                SMALL_BUFFER_LIMIT - 64
            } else {
                SMALL_BUFFER_LIMIT + 1024
            };
            let mut content = sentence.repeat((target - envelope) / sentence.len() + 1);
            content.truncate(target - envelope);
            let body = chat(json!({"messages": [{"role": "user", "content": content}]}));
            assert_eq!(body.len(), target);
            let want = if name == "body_near_limit" { 200 } else { 413 };
            assert_eq!(ctx.post(chat_path, &USER, body).await, want);
        }
        "non_inference" => {
            let headers = [("content-type", "application/octet-stream")];
            assert_eq!(
                ctx.post(
                    "/echo",
                    &headers,
                    b"\x00\x01 not an OpenAI request".to_vec()
                )
                .await,
                200
            );
            let request = ctx.request(&ctx.h1, reqwest::Method::GET, "/health", &[], Vec::new());
            assert_eq!(finish(request).await, 200);
        }
        "bad_json_400" => assert_eq!(
            ctx.post(
                chat_path,
                &USER,
                b"{\"model\": \"gpt-4o\", \"messages\": [".to_vec()
            )
            .await,
            400
        ),
        "missing_identity_401" => assert_eq!(
            ctx.post(
                chat_path,
                &[("content-type", "application/json")],
                chat(json!({}))
            )
            .await,
            401
        ),
        "concurrency_429" => {
            let holder = ctx.hold("alice", "1500").await;
            assert_eq!(ctx.post(chat_path, &USER, chat(json!({}))).await, 429);
            assert_eq!(holder.await.unwrap(), 200);
        }
        "queue_timeout_503" => {
            let holder = ctx.hold("holder", "2000").await;
            assert_eq!(ctx.post(chat_path, &USER, chat(json!({}))).await, 503);
            assert_eq!(holder.await.unwrap(), 200);
        }
        "queued_then_admitted" => {
            let holder = ctx.hold("holder", "1500").await;
            let headers = [
                ("content-type", "application/json"),
                ("x-user-id", "bob"),
                ("x-user-tier", "premium"),
            ];
            assert_eq!(ctx.post(chat_path, &headers, chat(json!({}))).await, 200);
            assert_eq!(holder.await.unwrap(), 200);
        }
        "client_abort_before_first_byte" => {
            let headers = [
                ("content-type", "application/json"),
                ("x-user-id", "alice"),
                ("x-upstream-ttft-ms", "3000"),
            ];
            let request = ctx
                .request(
                    &ctx.h1,
                    reqwest::Method::POST,
                    chat_path,
                    &headers,
                    chat(json!({})),
                )
                .timeout(Duration::from_millis(500));
            assert_eq!(finish(request).await, 0, "the client gave up");
        }
        "client_abort_after_first_byte" => {
            let headers = [
                ("content-type", "application/json"),
                ("x-user-id", "alice"),
                ("x-upstream-itl-ms", "200"),
            ];
            let body = chat(json!({"stream": true, "max_tokens": 50}));
            let response = ctx
                .request(&ctx.h1, reqwest::Method::POST, chat_path, &headers, body)
                .send()
                .await
                .expect("Envoy answers");
            assert_eq!(response.status().as_u16(), 200);
            let mut chunks = response.bytes_stream();
            chunks.next().await.expect("a first chunk").expect("chunk");
            drop(chunks);
        }
        "upstream_500" => {
            let headers = [
                ("content-type", "application/json"),
                ("x-user-id", "alice"),
                ("x-upstream-status", "500"),
            ];
            assert_eq!(ctx.post(chat_path, &headers, chat(json!({}))).await, 500);
        }
        "upstream_reset" => {
            let headers = [
                ("content-type", "application/json"),
                ("x-user-id", "alice"),
                ("x-upstream-itl-ms", "50"),
                ("x-upstream-truncate-after", "3"),
            ];
            let body = chat(json!({"stream": true, "max_tokens": 20}));
            let response = ctx
                .request(&ctx.h1, reqwest::Method::POST, chat_path, &headers, body)
                .send()
                .await
                .expect("Envoy answers");
            assert_eq!(response.status().as_u16(), 200);
            assert!(response.bytes().await.is_err(), "the body is cut");
        }
        "no_response_phases" => assert_eq!(ctx.post(chat_path, &USER, chat(json!({}))).await, 200),
        other => panic!("no driver for scenario {other}"),
    }
}

/// Records `scenario` through Envoy `version` and returns the recording.
pub async fn record(version: &str, scenario: &Scenario) -> Recording {
    // Tokens 5 ms apart, so each streamed chunk reaches Envoy (and tollgate) on its own.
    let upstream = Upstream::start(&["--itl-ms", "5"]);
    let tollgate = Tollgate::start(&scenario.tollgate_config).await;
    let recorder = Recorder::start(tollgate.grpc).await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let edited;
    let config_path: PathBuf = match scenario.envoy {
        EnvoyConfig::FrontProxy => root.join("envoy/front-proxy.yaml"),
        EnvoyConfig::NoResponse => root.join("envoy/front-proxy-no-response.yaml"),
        EnvoyConfig::SmallBuffer => {
            let text = std::fs::read_to_string(root.join("envoy/front-proxy.yaml")).unwrap();
            let from = "per_connection_buffer_limit_bytes: 8388608";
            assert_eq!(text.matches(from).count(), 1, "{from} in front-proxy.yaml");
            let text = text.replace(
                from,
                &format!("per_connection_buffer_limit_bytes: {SMALL_BUFFER_LIMIT}"),
            );
            edited = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(edited.path(), text).unwrap();
            edited.path().to_owned()
        }
    };
    let ports = EnvoyPorts::free(upstream.addr.port(), recorder.addr.port());
    let envoy = Envoy::start(version, &config_path, ports).await;
    let ctx = Ctx {
        base: format!("http://{}", envoy.listen),
        h1: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
        h2: reqwest::Client::builder()
            .no_proxy()
            .http2_prior_knowledge()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
        tollgate: &tollgate,
    };
    drive(scenario.name, &ctx).await;
    // Let Envoy finish with the streams (an abort's reset, a held stream's end).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = recorder
        .finish(Duration::from_secs(5), TIME_QUANTUM_US)
        .await;
    drop(envoy);
    Recording {
        header: Header {
            format: FORMAT.to_owned(),
            envoy_version: version.to_owned(),
            scenario: scenario.name.to_owned(),
            description: scenario.description.to_owned(),
            envoy_config: scenario.envoy.describe(),
            tollgate_config: scenario.tollgate_config.clone(),
            time_quantum_us: TIME_QUANTUM_US,
            normalizations: normalizations(),
        },
        events,
    }
}

/// Re-records the corpus. Versions from `TOLLGATE_RECORD_ENVOY_VERSIONS` (comma-separated,
/// default all three), scenarios from `TOLLGATE_RECORD_SCENARIOS` (default all).
#[tokio::test]
#[ignore = "re-records tests/fixtures/recorded/ through real Envoy: scripts/record-corpus.sh"]
async fn record_corpus() {
    let list = |var: &str| -> Option<Vec<String>> {
        std::env::var(var)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect())
    };
    let versions = list("TOLLGATE_RECORD_ENVOY_VERSIONS").unwrap_or_else(|| {
        RECORDED_ENVOY_VERSIONS
            .iter()
            .map(|v| (*v).to_owned())
            .collect()
    });
    let only = list("TOLLGATE_RECORD_SCENARIOS");
    for version in &versions {
        let dir = corpus_dir().join(version);
        std::fs::create_dir_all(&dir).unwrap();
        for scenario in scenarios() {
            if only
                .as_ref()
                .is_some_and(|only| !only.iter().any(|s| s == scenario.name))
            {
                continue;
            }
            let recording = record(version, &scenario).await;
            let path = dir.join(format!("{}.jsonl", scenario.name));
            std::fs::write(&path, recording.to_jsonl()).unwrap();
            eprintln!(
                "recorded {} ({} streams, {} events)",
                path.display(),
                recording.stream_count(),
                recording.events.len()
            );
        }
    }
}
