//! The Envoy configs in `envoy/`, checked against real Envoy (see `support::envoy`).
//!
//! These tests need no tollgate: they prove what the *config* does. A trivial ext_proc server that
//! continues everything stands in where one is needed.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, ProcessingRequest, ProcessingResponse,
    processing_request, processing_response,
};
use futures_util::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use tollgate_testkit::envoy::{
    DEFAULT_BUCKET_TOKENS, PER_USER_BUCKET_TOKENS, render_config, render_over_extprocs,
    request_phases_only, with_local_ratelimit, with_observer_filter, without_ext_proc,
};

use crate::support::envoy::{ENVOY_VERSION, Envoy, EnvoyPorts, envoy_binary, free_port};

const MIB: usize = 1024 * 1024;

/// Every Envoy config in the repo (`envoy/`, and the filters and clusters that `istio/` patches
/// in) is validated on these: the oldest, a middle and the newest Envoy the project supports
/// (the recorded corpus of tests/it/replay.rs comes from the same three). Keep in step
/// with `VALIDATED_ENVOY_VERSIONS` in `scripts/install-test-deps.sh`.
pub(crate) const VALIDATED_ENVOY_VERSIONS: [&str; 3] = ["1.36.4", "1.38.3", ENVOY_VERSION];

/// Where the configs under `envoy/` read their TLS files from. Tests put generated certificates
/// in a temporary directory and substitute its path for this prefix ([`with_test_certs`]).
pub(crate) const TLS_DIR_IN_CONFIGS: &str = "/etc/envoy/tls/";

pub(crate) fn envoy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy")
}

fn front_proxy_config() -> PathBuf {
    envoy_dir().join("front-proxy.yaml")
}

/// Runs `envoy --mode validate` (Envoy `version`) on the config at `path`: strict, so unknown
/// fields, bad enum values, wrong types and missing files fail. `Err` carries Envoy's output.
pub(crate) fn envoy_validate(version: &str, path: &Path) -> Result<(), String> {
    let binary = envoy_binary(version);
    let output = Command::new(&binary)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(path)
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", binary.display()));
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} rejected by Envoy {version} ({}):\n{}{}",
            path.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// A private CA and the certificates the configs under `envoy/` name, made with the `openssl`
/// CLI in a fresh temporary directory:
/// - `ca.crt` (and `ca.key`): the CA both sides trust;
/// - `server.crt`, `server.key`: tollgate's serving certificate (TLS sidecar), SAN
///   `tollgate.tollgate.svc.cluster.local`, the name the front proxy checks;
/// - `client.crt`, `client.key`: the front proxy's client certificate (mutual TLS).
pub(crate) fn test_certs() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("tollgate-certs-")
        .tempdir()
        .expect("create a temp dir for certificates");
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let run = |args: &[&str]| {
        let output = match Command::new("openssl")
            .args(args)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .output()
        {
            Ok(output) => output,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "the openssl CLI is not installed: run scripts/install-test-deps.sh \
                 (or apt-get install openssl)"
            ),
            Err(e) => panic!("run openssl: {e}"),
        };
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let mut ca = vec!["req", "-x509", "-nodes", "-days", "2"];
    ca.extend(ec);
    ca.extend([
        "-subj",
        "/CN=tollgate test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    run(&ca);
    for (name, san, usage) in [
        (
            "server",
            "DNS:tollgate.tollgate.svc.cluster.local",
            "serverAuth",
        ),
        ("client", "DNS:front-proxy", "clientAuth"),
    ] {
        let ext = format!("{name}.ext");
        std::fs::write(
            dir.path().join(&ext),
            format!(
                "subjectAltName = {san}\nbasicConstraints = CA:FALSE\n\
                 keyUsage = digitalSignature\nextendedKeyUsage = {usage}\n"
            ),
        )
        .expect("write the extensions file");
        let (key, csr, crt) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
        );
        let subject = format!("/CN={name}");
        let mut request = vec!["req", "-nodes"];
        request.extend(ec);
        request.extend(["-subj", &subject, "-keyout", &key, "-out", &csr]);
        run(&request);
        run(&[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-extfile",
            &ext,
        ]);
    }
    dir
}

/// `config` with the TLS file paths pointing into `certs` (from [`test_certs`]).
pub(crate) fn with_test_certs(config: &str, certs: &Path) -> String {
    config.replace(TLS_DIR_IN_CONFIGS, &format!("{}/", certs.display()))
}

/// Every `*.yaml` under `envoy/` must load in Envoy's validate mode (strict: unknown fields, bad
/// enum values and wrong types fail) on the oldest and the newest supported Envoy, so no config
/// in the repo rots unnoticed. TLS files come from [`test_certs`].
#[test]
fn every_envoy_config_validates() {
    let mut configs: Vec<PathBuf> = std::fs::read_dir(envoy_dir())
        .expect("read envoy/")
        .map(|entry| entry.expect("read envoy/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    configs.sort();
    assert!(
        configs.contains(&front_proxy_config()),
        "envoy/front-proxy.yaml is missing; found {configs:?}"
    );

    let certs = test_certs();
    let rendered = tempfile::Builder::new()
        .prefix("tollgate-envoy-validate-")
        .tempdir()
        .expect("create a temp dir");
    let mut failures = Vec::new();
    for config in &configs {
        let text = std::fs::read_to_string(config)
            .unwrap_or_else(|err| panic!("read {}: {err}", config.display()));
        let path = rendered
            .path()
            .join(config.file_name().expect("a file name"));
        std::fs::write(&path, with_test_certs(&text, certs.path())).expect("write config");
        for version in VALIDATED_ENVOY_VERSIONS {
            if let Err(failure) = envoy_validate(version, &path) {
                failures.push(format!("{} (as {failure}", config.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} config validations failed:\n{}",
        failures.len(),
        configs.len() * VALIDATED_ENVOY_VERSIONS.len(),
        failures.join("\n")
    );
}

/// Proves: the rendered front proxy starts, and with no ext_proc server reachable it FAILS CLOSED.
/// Every request, inference or not, gets Envoy's local reply with `status_on_error` (503) and
/// never reaches the upstream. A dead tollgate must not turn admission off.
#[tokio::test]
async fn front_proxy_fails_closed_without_tollgate() {
    let upstream = Upstream::spawn().await;
    // Nothing listens on this port: the ext_proc connection is refused.
    let extproc_port = free_port();
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &front_proxy_config(),
        EnvoyPorts::free(upstream.port(), extproc_port),
    )
    .await;
    let client = client();

    let chat = client
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .body(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .expect("POST through Envoy");
    assert_eq!(
        chat.status(),
        503,
        "inference request without tollgate; Envoy log:\n{}",
        envoy.log_tail(30)
    );

    let other = client
        .get(format!("http://{}/healthz", envoy.listen))
        .send()
        .await
        .expect("GET through Envoy");
    assert_eq!(
        other.status(),
        503,
        "non-inference request without tollgate (tollgate decides by path, so it must be asked)"
    );

    assert_eq!(
        upstream.bodies(),
        Vec::<usize>::new(),
        "no request may reach the upstream"
    );
    assert_eq!(
        envoy.stat("http.ingress.ext_proc.streams_failed").await,
        Some(2),
        "both ext_proc streams failed"
    );
    assert_eq!(
        envoy
            .stat("http.ingress.ext_proc.failure_mode_allowed")
            .await,
        Some(0),
        "failure_mode_allow must stay off: no request may pass without tollgate"
    );
}

/// Proves the body limits documented in `envoy/front-proxy.yaml`: a 4 MiB prompt reaches ext_proc
/// whole, as ONE buffered `request_body` message, and then the upstream; a 20 MiB body gets Envoy's
/// own 413 and reaches neither the ext_proc body stage nor the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn front_proxy_buffers_multi_mb_prompts_and_rejects_oversize_with_413() {
    let upstream = Upstream::spawn().await;
    let extproc = ContinueAll::spawn().await;
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &front_proxy_config(),
        EnvoyPorts::free(upstream.port(), extproc.port),
    )
    .await;
    let client = client();

    let big = chat_body(4 * MIB);
    let response = client
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .expect("POST 4 MiB through Envoy");
    assert_eq!(
        response.status(),
        200,
        "4 MiB prompt; ext_proc saw {:?}; Envoy log:\n{}",
        extproc.events(),
        envoy.log_tail(30)
    );
    assert_eq!(upstream.bodies(), vec![4 * MIB]);
    let bodies: Vec<String> = extproc
        .events()
        .into_iter()
        .filter(|event| event.starts_with("request_body"))
        .collect();
    assert_eq!(
        bodies,
        vec![format!("request_body {} end_of_stream=true", 4 * MIB)],
        "BUFFERED mode delivers the whole body in one message"
    );

    let oversize = chat_body(20 * MIB);
    let response = client
        .post(format!("http://{}/v1/chat/completions", envoy.listen))
        .header("content-type", "application/json")
        .body(oversize)
        .send()
        .await
        .expect("POST 20 MiB through Envoy");
    assert_eq!(
        response.status(),
        413,
        "20 MiB body is over the 8 MiB limit"
    );
    assert_eq!(
        upstream.bodies(),
        vec![4 * MIB],
        "the oversize body reached the upstream"
    );
    let bodies = extproc
        .events()
        .into_iter()
        .filter(|event| event.starts_with("request_body"))
        .count();
    assert_eq!(
        bodies, 1,
        "the oversize body reached the ext_proc body stage"
    );
}

/// An HTTP client for requests through a test's Envoy: never through a proxy (an `http_proxy`
/// in the environment must not capture loopback traffic), and patient with a busy machine.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("build HTTP client")
}

/// An OpenAI chat request of exactly `len` bytes (the prompt is padding).
fn chat_body(len: usize) -> String {
    let head = r#"{"model":"m","messages":[{"role":"user","content":""#;
    let tail = r#""}]}"#;
    let mut body = String::with_capacity(len);
    body.push_str(head);
    body.push_str(&"a".repeat(len - head.len() - tail.len()));
    body.push_str(tail);
    body
}

/// A minimal HTTP/1.1 upstream: reads one request per connection (Content-Length or chunked body),
/// records the body size, answers a fixed JSON 200 and closes.
struct Upstream {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<usize>>>,
}

impl Upstream {
    async fn spawn() -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream address");
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&bodies);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let recorded = Arc::clone(&recorded);
                tokio::spawn(async move {
                    // The body is recorded before the reply is written, so a client that has its
                    // answer always finds the body recorded (recording after the write raced).
                    let _ = serve_one(stream, |len| recorded.lock().unwrap().push(len)).await;
                });
            }
        });
        Self { addr, bodies }
    }

    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Body sizes of the requests served so far.
    fn bodies(&self) -> Vec<usize> {
        self.bodies.lock().unwrap().clone()
    }
}

async fn serve_one(mut stream: TcpStream, record: impl FnOnce(usize)) -> std::io::Result<()> {
    record(read_request(&mut stream).await?);
    let reply = r#"{"ok":true}"#;
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{reply}",
        reply.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// Reads one HTTP/1.1 request from `stream`, its body by content-length or chunked; returns the
/// body's length.
pub(crate) async fn read_request(stream: &mut TcpStream) -> std::io::Result<usize> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|window| window == b"\r\n\r\n") {
            break pos + 4;
        }
        read_more(stream, &mut buf).await?;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let header = |name: &str| {
        head.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(|value| value.trim().to_owned())
    };
    let body_len = if let Some(len) = header("content-length") {
        let len: usize = len.parse().map_err(std::io::Error::other)?;
        while buf.len() < head_end + len {
            read_more(stream, &mut buf).await?;
        }
        len
    } else if header("transfer-encoding").is_some_and(|te| te.contains("chunked")) {
        read_chunked(stream, &mut buf, head_end).await?
    } else {
        0
    };
    Ok(body_len)
}

/// Decodes a chunked body starting at `pos` in `buf`; returns its decoded length.
async fn read_chunked(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    mut pos: usize,
) -> std::io::Result<usize> {
    let mut total = 0;
    loop {
        let line_end = loop {
            if let Some(end) = buf[pos..].windows(2).position(|window| window == b"\r\n") {
                break pos + end;
            }
            read_more(stream, buf).await?;
        };
        let size_text = String::from_utf8_lossy(&buf[pos..line_end]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(std::io::Error::other)?;
        // chunk data + CRLF (for the last chunk: no trailers, just CRLF).
        let chunk_end = line_end + 2 + size + 2;
        while buf.len() < chunk_end {
            read_more(stream, buf).await?;
        }
        total += size;
        pos = chunk_end;
        if size == 0 {
            return Ok(total);
        }
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut chunk = [0u8; 64 * 1024];
    let n = stream.read(&mut chunk).await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// A trivial ext_proc server: answers every message with CONTINUE and records what it saw.
struct ContinueAll {
    port: u16,
    events: Arc<Mutex<Vec<String>>>,
}

impl ContinueAll {
    async fn spawn() -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind ext_proc");
        let port = listener.local_addr().expect("ext_proc address").port();
        let events = Arc::new(Mutex::new(Vec::new()));
        let service = ExternalProcessorServer::new(ContinueAllService {
            events: Arc::clone(&events),
        })
        // A buffered body arrives as one gRPC message: allow more than the 8 MiB body limit
        // (tonic's default is 4 MiB).
        .max_decoding_message_size(16 * MIB);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Self { port, events }
    }

    fn events(&self) -> Vec<String> {
        self.events.lock().unwrap().clone()
    }
}

struct ContinueAllService {
    events: Arc<Mutex<Vec<String>>>,
}

type ResponseStream =
    Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ExternalProcessor for ContinueAllService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let events = Arc::clone(&self.events);
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let message = match inbound.message().await {
                    Ok(Some(message)) => message,
                    Ok(None) => {
                        events.lock().unwrap().push("stream ended".to_owned());
                        return;
                    }
                    Err(status) => {
                        events
                            .lock()
                            .unwrap()
                            .push(format!("stream error {:?}", status.code()));
                        return;
                    }
                };
                let Some((event, response)) = continue_response(message.request) else {
                    continue;
                };
                events.lock().unwrap().push(event);
                let response = ProcessingResponse {
                    response: Some(response),
                    ..Default::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    events
                        .lock()
                        .unwrap()
                        .push("response channel closed".to_owned());
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// The CONTINUE answer of the same kind as `request`, and a line describing the request.
fn continue_response(
    request: Option<processing_request::Request>,
) -> Option<(String, processing_response::Response)> {
    use processing_request::Request;
    use processing_response::Response;
    let headers = || HeadersResponse {
        response: Some(CommonResponse::default()),
    };
    let body = || BodyResponse {
        response: Some(CommonResponse::default()),
    };
    Some(match request? {
        Request::RequestHeaders(headers_msg) => (
            format!(
                "request_headers end_of_stream={}",
                headers_msg.end_of_stream
            ),
            Response::RequestHeaders(headers()),
        ),
        Request::RequestBody(body_msg) => (
            format!(
                "request_body {} end_of_stream={}",
                body_msg.body.len(),
                body_msg.end_of_stream
            ),
            Response::RequestBody(body()),
        ),
        Request::ResponseHeaders(headers_msg) => (
            format!(
                "response_headers end_of_stream={}",
                headers_msg.end_of_stream
            ),
            Response::ResponseHeaders(headers()),
        ),
        Request::ResponseBody(body_msg) => (
            format!(
                "response_body {} end_of_stream={}",
                body_msg.body.len(),
                body_msg.end_of_stream
            ),
            Response::ResponseBody(body()),
        ),
        // Trailers are SKIPped in the front proxy's processing mode.
        Request::RequestTrailers(_) | Request::ResponseTrailers(_) => return None,
    })
}

/// Proves: the test kit's "tollgate off" config (`without_ext_proc`, what the load lab and
/// bench_overhead run as Envoy alone) loses exactly the ext_proc filter and cluster of
/// front-proxy.yaml and keeps the rest.
#[test]
fn the_front_proxy_without_ext_proc_keeps_the_rest() {
    let front_proxy = std::fs::read_to_string(front_proxy_config()).expect("read front-proxy");
    let direct = without_ext_proc(&front_proxy).unwrap();
    assert!(!direct.contains("port_value: 50051"));
    for kept in [
        "envoy.filters.http.router",
        "- name: inference",
        "port_value: 8000",
        "stream_idle_timeout: 600s",
        "per_connection_buffer_limit_bytes: 8388608",
    ] {
        assert!(direct.contains(kept), "{kept} went missing");
    }
}

/// Proves: bench_overhead's F (`with_local_ratelimit`, Envoy's local_ratelimit filter with a
/// bucket per `x-user-id`) validates on every supported Envoy, and on the newest counts a request
/// that names a user in the per-user descriptor's bucket (its `x-ratelimit-limit`), while a
/// request without the header falls to the filter's default bucket. Without the descriptor
/// matching, the benchmark's floor would be one global bucket, not a per-user decision. (The
/// remaining tokens cannot show one user's bucket apart from another's here: at 10^8 tokens a
/// second, Envoy's bucket refills a token in 10 ns.)
#[tokio::test]
async fn the_local_ratelimit_floor_counts_requests_in_the_per_user_bucket() {
    let front_proxy = std::fs::read_to_string(front_proxy_config()).expect("read front-proxy");
    let config = with_local_ratelimit(&front_proxy).unwrap();
    assert!(
        !config.contains("ext_proc.v3"),
        "the floor runs without ext_proc"
    );
    let dir = tempfile::Builder::new()
        .prefix("tollgate-local-ratelimit-")
        .tempdir()
        .expect("create a temp dir");
    let path = dir.path().join("local-ratelimit.yaml");
    std::fs::write(&path, &config).expect("write config");
    for version in VALIDATED_ENVOY_VERSIONS {
        envoy_validate(version, &path).unwrap_or_else(|failure| panic!("{failure}"));
    }

    let upstream = Upstream::spawn().await;
    let envoy = Envoy::start(
        ENVOY_VERSION,
        &path,
        EnvoyPorts::free_with(upstream.port(), None),
    )
    .await;
    let client = client();
    let send = |user: Option<&str>| {
        let request = client
            .post(format!("http://{}/v1/chat/completions", envoy.listen))
            .header("content-type", "application/json")
            .body(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let request = match user {
            Some(user) => request.header("x-user-id", user),
            None => request,
        };
        async move {
            let response = request.send().await.expect("POST through Envoy");
            assert_eq!(response.status(), 200);
            response
                .headers()
                .get("x-ratelimit-limit")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
        }
    };
    for user in ["alice", "bob", "alice"] {
        assert_eq!(
            send(Some(user)).await,
            Some(PER_USER_BUCKET_TOKENS),
            "{user}"
        );
    }
    assert_eq!(send(None).await, Some(DEFAULT_BUCKET_TOKENS));
    assert_eq!(
        envoy.stat("per_user.http_local_rate_limit.ok").await,
        Some(4),
        "the filter checked every request"
    );
    assert_eq!(
        upstream.bodies().len(),
        4,
        "every request reached the upstream"
    );
}

/// Proves: the configs bench_overhead derives from front-proxy.yaml for its experiments (C and
/// Q: the response phases off; O: those phases moved to a second ext_proc filter in
/// `observability_mode`) load on every supported Envoy, so a comparison never runs on one
/// version and silently fails on another.
#[test]
fn the_benchmarks_derived_configs_validate() {
    let front_proxy = std::fs::read_to_string(front_proxy_config()).expect("read front-proxy");
    let dir = tempfile::Builder::new()
        .prefix("tollgate-bench-configs-")
        .tempdir()
        .expect("create a temp dir");
    let observer = with_observer_filter(&front_proxy).unwrap();
    assert_eq!(observer.matches("ext_proc.v3.ExternalProcessor").count(), 2);
    assert!(observer.contains("observability_mode: true"));
    let mut failures = Vec::new();
    for (name, config) in [
        ("request-only", request_phases_only(&front_proxy).unwrap()),
        ("observer", observer),
    ] {
        let path = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, config).expect("write config");
        for version in VALIDATED_ENVOY_VERSIONS {
            if let Err(failure) = envoy_validate(version, &path) {
                failures.push(failure);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Ports to render configs with in tests that only read the result.
const RENDER_PORTS: EnvoyPorts = EnvoyPorts {
    listen: 20000,
    upstream: 20001,
    extproc: Some(20002),
    admin: 20003,
};

/// Proves: rendering puts every port of front-proxy.yaml on loopback, and a config without
/// ext_proc may not be rendered with an ext_proc port (nor with ext_proc's placeholder left).
#[test]
fn rendering_puts_every_port_on_loopback() {
    let front_proxy = std::fs::read_to_string(front_proxy_config()).expect("read front-proxy");
    let ports = RENDER_PORTS;
    let rendered = render_config(&front_proxy, &ports).unwrap();
    for port in ["20000", "20001", "20002", "20003"] {
        assert!(rendered.contains(&format!("port_value: {port}")), "{port}");
    }
    assert!(!rendered.contains("address: 0.0.0.0"));
    let direct = without_ext_proc(&front_proxy).unwrap();
    assert!(render_config(&direct, &ports).is_err());
    let alone = EnvoyPorts {
        extproc: None,
        ..ports
    };
    assert!(render_config(&direct, &alone).is_ok());
}

/// Proves: a front proxy over several tollgates (the fleet tests' and the lab's) has one
/// `tollgate` cluster, balanced by least request, with an endpoint for each of them and none
/// for the ext_proc port `ports` carries; over none it is an error.
#[test]
fn rendering_over_several_tollgates_spreads_one_cluster_by_least_request() {
    let front_proxy = std::fs::read_to_string(front_proxy_config()).expect("read front-proxy");
    let ports = RENDER_PORTS;
    let text = render_over_extprocs(&front_proxy, &ports, &[50101, 50102, 50103]).unwrap();
    for port in [50101, 50102, 50103] {
        assert_eq!(text.matches(&format!("port_value: {port} ")).count(), 1);
    }
    assert!(!text.contains("port_value: 20002"));
    assert_eq!(text.matches("lb_policy: LEAST_REQUEST").count(), 1);
    let cluster = text.split("  - name: tollgate\n").nth(1).unwrap();
    assert!(cluster.starts_with("    type: STATIC\n    lb_policy: LEAST_REQUEST\n"));
    assert!(render_over_extprocs(&front_proxy, &ports, &[]).is_err());
}
