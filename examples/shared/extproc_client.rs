//! Playing Envoy's side of ext_proc for the benchmarks that talk to tollgate's gRPC port
//! directly (`bench_held_streams`, `bench_large_bodies`): connections, one stream driven message
//! by message, the messages of a chat request, and reading tollgate's answers.

use std::net::SocketAddr;

use anyhow::{Context, Result, anyhow, bail, ensure};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// Opens `count` HTTP/2 connections; each `Endpoint::connect` is a connection of its own.
pub async fn connect(grpc: SocketAddr, count: usize) -> Result<Vec<Channel>> {
    let mut channels = Vec::with_capacity(count);
    for _ in 0..count {
        let channel = Endpoint::from_shared(format!("http://{grpc}"))
            .context("gRPC endpoint")?
            .tcp_nodelay(true)
            .connect()
            .await
            .with_context(|| format!("connect to tollgate's gRPC port {grpc}"))?;
        channels.push(channel);
    }
    Ok(channels)
}

pub fn client(channel: &Channel) -> ExternalProcessorClient<Channel> {
    ExternalProcessorClient::new(channel.clone())
}

/// One ext_proc stream, driven message by message as Envoy does.
pub struct Stream {
    pub tx: mpsc::Sender<ProcessingRequest>,
    pub rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    pub async fn open(mut client: ExternalProcessorClient<Channel>) -> Result<Stream> {
        // Envoy sends one message and waits for its answer; two slots never block.
        let (tx, rx) = mpsc::channel(2);
        let response = client
            .process(ReceiverStream::new(rx))
            .await
            .context("open an ext_proc stream")?;
        Ok(Stream {
            tx,
            rx: response.into_inner(),
        })
    }

    pub async fn send(&self, message: ProcessingRequest) -> Result<()> {
        self.tx
            .send(message)
            .await
            .map_err(|_| anyhow!("the request stream closed"))
    }

    /// The next answer, or why there is none.
    pub async fn recv(&mut self) -> Result<ProcessingResponse> {
        match self.rx.message().await {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => bail!("stream ended with OK and no answer"),
            Err(status) => bail!(
                "stream ended with {:?}: {}",
                status.code(),
                status.message()
            ),
        }
    }
}

/// The `x-tollgate-reason` header a local reply sets.
pub fn reason(reply: &ImmediateResponse) -> Option<&[u8]> {
    reply.headers.as_ref().and_then(|headers| {
        headers
            .set_headers
            .iter()
            .filter_map(|option| option.header.as_ref())
            .find(|header| header.key == "x-tollgate-reason")
            .map(|header| header.raw_value.as_slice())
    })
}

/// A short description of an answer for failure messages.
pub fn describe(answer: &ProcessingResponse) -> String {
    match &answer.response {
        Some(Response::ImmediateResponse(reply)) => {
            format!(
                "immediate_response {} ({})",
                reply.status.as_ref().map_or(0, |s| s.code),
                reason(reply).map_or_else(
                    || reply.details.clone(),
                    |r| String::from_utf8_lossy(r).into_owned()
                )
            )
        }
        Some(Response::RequestHeaders(_)) => "request_headers".to_owned(),
        Some(Response::RequestBody(_)) => "request_body (admitted)".to_owned(),
        Some(other) => format!("{other:?}").chars().take(80).collect(),
        None if answer.override_message_timeout.is_some() => {
            "override_message_timeout (queued)".to_owned()
        }
        None => "an empty answer".to_owned(),
    }
}

pub fn chat_headers(user: &str) -> ProcessingRequest {
    let header = |key: &str, value: &str| HeaderValue {
        key: key.to_owned(),
        value: String::new(),
        // Envoy sends values as raw bytes.
        raw_value: value.as_bytes().to_vec(),
    };
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/chat/completions"),
                    header("content-type", "application/json"),
                    header("x-user-id", user),
                ],
            }),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

pub fn chat_body_message(body: &[u8]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// The small chat body, or one padded to exactly `bytes` with `filler` (plain ASCII, so the
/// JSON stays valid at any length), repeated and cut, after `lead`.
pub fn chat_body(bytes: Option<usize>, lead: &str, filler: &str) -> Result<Vec<u8>> {
    let with = |content: &str| {
        format!(
            r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"{lead}{content}"}}],"max_tokens":16}}"#
        )
    };
    let small = with("hi");
    let Some(bytes) = bytes else {
        return Ok(small.into_bytes());
    };
    ensure!(
        bytes >= small.len(),
        "--body-bytes must be at least {} (the unpadded body)",
        small.len()
    );
    ensure!(
        filler.is_ascii() && !filler.is_empty() && !filler.contains(['"', '\\']),
        "the filler must be plain ASCII with nothing to escape"
    );
    let length = bytes - small.len() + 2;
    let content: String = filler.repeat(length / filler.len() + 1)[..length].to_owned();
    let body = with(&content);
    debug_assert_eq!(body.len(), bytes);
    Ok(body.into_bytes())
}
