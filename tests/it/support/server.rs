//! tollgate in-process on port 0, and a scripted ext_proc client that plays Envoy.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request::Request,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tollgate::config::Config;
pub use tollgate_testkit::metrics::Metrics;

/// A tollgate server running inside the test process.
pub struct TestServer {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tollgate::Error>>,
}

impl TestServer {
    pub async fn start(config: Config) -> TestServer {
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (grpc_addr, admin_addr) = (grpc.local_addr().unwrap(), admin.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(tollgate::run(
            config,
            tollgate::Listeners { grpc, admin },
            async move {
                let _ = rx.await;
            },
            None,
        ));
        TestServer {
            grpc: grpc_addr,
            admin: admin_addr,
            shutdown: Some(tx),
            task,
        }
    }

    pub async fn client(&self) -> ExternalProcessorClient<tonic::transport::Channel> {
        let url = format!("http://{}", self.grpc);
        for _ in 0..100 {
            if let Ok(client) = ExternalProcessorClient::connect(url.clone()).await {
                return client
                    .max_decoding_message_size(64 << 20)
                    .max_encoding_message_size(64 << 20);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("tollgate did not accept gRPC connections on {url}");
    }

    /// Opens one ext_proc stream, as Envoy does per HTTP request.
    pub async fn stream(&self) -> ExtProcStream {
        ExtProcStream::open(&mut self.client().await).await
    }

    /// Opens one ext_proc stream whose filter names its role in `x-tollgate-stream`, as
    /// envoy/front-proxy-reports.yaml's filters do (`reports`, `first-token`).
    pub async fn stream_as(&self, role: &str) -> ExtProcStream {
        ExtProcStream::open_as(&mut self.client().await, Some(role)).await
    }

    pub async fn metrics(&self) -> Metrics {
        self.try_metrics()
            .await
            .unwrap_or_else(|error| panic!("{error:#}"))
    }

    /// One scrape; an error while the server is still starting.
    pub async fn try_metrics(&self) -> anyhow::Result<Metrics> {
        tollgate_testkit::metrics::scrape(self.admin).await
    }

    /// Polls until `name{labels}` equals `want`, and returns that scrape; panics with the last
    /// value otherwise.
    pub async fn wait_for_metric(&self, name: &str, labels: &[&str], want: f64) -> Metrics {
        tollgate_testkit::metrics::wait_for_metric(self.admin, name, labels, want)
            .await
            .unwrap_or_else(|error| panic!("{error:#}"))
    }

    /// Begins shutdown (as SIGTERM does) without waiting for it to finish.
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Shuts down and returns what `run` returned.
    pub async fn stop(mut self) -> Result<(), tollgate::Error> {
        self.begin_shutdown();
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("run() returned within 30 s of shutdown")
            .expect("run() did not panic")
    }
}

/// A minimal HTTP/1.1 GET: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let response = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// One ext_proc stream driven message by message.
pub struct ExtProcStream {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl ExtProcStream {
    pub async fn open(client: &mut ExternalProcessorClient<tonic::transport::Channel>) -> Self {
        ExtProcStream::open_as(client, None).await
    }

    /// Opens a stream with `x-tollgate-stream: role`, if given, as a filter's
    /// `initial_metadata` sets it.
    pub async fn open_as(
        client: &mut ExternalProcessorClient<tonic::transport::Channel>,
        role: Option<&str>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(16);
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(role) = role {
            request
                .metadata_mut()
                .insert("x-tollgate-stream", role.parse().expect("an ASCII role"));
        }
        let response = client.process(request).await.expect("stream opens");
        ExtProcStream {
            tx: Some(tx),
            rx: response.into_inner(),
        }
    }

    pub async fn send(&mut self, request: ProcessingRequest) {
        self.tx
            .as_ref()
            .expect("stream not closed")
            .send(request)
            .await
            .expect("stream accepts messages");
    }

    /// Sends unless the stream is gone (tollgate ended it, or this side closed it); returns
    /// whether the message went out. For clients that break the rules on purpose.
    pub async fn try_send(&mut self, request: ProcessingRequest) -> bool {
        match &self.tx {
            Some(tx) => tx.send(request).await.is_ok(),
            None => false,
        }
    }

    /// The next answer; `Ok(None)` when tollgate closed the stream with OK.
    pub async fn recv(&mut self) -> Result<Option<ProcessingResponse>, tonic::Status> {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("tollgate answered within 10 s")
    }

    /// The next answer without the 10 s guard (for callers with their own timeout).
    pub async fn recv_raw(&mut self) -> Result<Option<ProcessingResponse>, tonic::Status> {
        self.rx.message().await
    }

    /// Sends and waits for the answer, which must not be an error.
    pub async fn exchange(&mut self, request: ProcessingRequest) -> ProcessingResponse {
        self.send(request).await;
        self.recv()
            .await
            .expect("answer is not an error")
            .expect("stream still open")
    }

    /// Half-closes the stream from the Envoy side (as Envoy does at the end of a request).
    pub fn close(&mut self) {
        self.tx = None;
    }
}

pub fn header_map(headers: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    }
}

pub fn request_headers(headers: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    message(Request::RequestHeaders(HttpHeaders {
        headers: Some(header_map(headers)),
        end_of_stream,
        ..HttpHeaders::default()
    }))
}

/// Headers of a chat request from `user` (tier from `x-user-tier` if given).
pub fn chat_headers(user: &str) -> ProcessingRequest {
    request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("x-user-id", user),
        ],
        false,
    )
}

pub fn request_body(body: &[u8]) -> ProcessingRequest {
    message(Request::RequestBody(HttpBody {
        body: body.to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    }))
}

pub fn response_headers(status: u16, content_type: &str) -> ProcessingRequest {
    message(Request::ResponseHeaders(HttpHeaders {
        headers: Some(header_map(&[
            (":status", &status.to_string()),
            ("content-type", content_type),
        ])),
        end_of_stream: false,
        ..HttpHeaders::default()
    }))
}

pub fn response_body(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    message(Request::ResponseBody(HttpBody {
        body: body.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    }))
}

pub fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

/// A small valid chat body.
pub fn chat_body(extra: serde_json::Value) -> Vec<u8> {
    let mut body = serde_json::json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Say hello to the world."}],
    });
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            body.insert(k.clone(), v.clone());
        }
    }
    serde_json::to_vec(&body).unwrap()
}
