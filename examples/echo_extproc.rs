//! `echo_extproc`: an Envoy ext_proc service that decides nothing. It answers every message with
//! a CONTINUE of its kind (except those of a filter in `observability_mode`, which the protocol
//! says not to answer) and reads nothing, so it is the floor any ext_proc service built with
//! tonic costs: the baseline the benchmarks hold tollgate against (`bench_decisions` over gRPC,
//! `bench_overhead` behind Envoy).
//!
//! It is built with tollgate's plumbing (a task and a 2-slot answer channel per stream, the
//! HTTP/2 options and TCP_NODELAY of `tollgate::run`, a default multi-threaded runtime, the same
//! global allocator), so the difference between the two is tollgate's own work.
//!
//! ```text
//! cargo run --release --example echo_extproc -- --addr 127.0.0.1:50052
//! ```
//!
//! Once the socket is bound it prints exactly one line to stdout, `echo_extproc listening on
//! ADDR`, with the real address (so `--addr 127.0.0.1:0` reports the port it picked). It serves
//! until it is killed.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, ProcessingRequest, ProcessingResponse,
    TrailersResponse, processing_request::Request as Message,
    processing_response::Response as Answer,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::transport::server::TcpIncoming;

/// tollgate's allocator (src/main.rs), so that allocating is plumbing both pay alike.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// An ext_proc service that continues every request unchanged.
#[derive(Parser, Debug)]
#[command(name = "echo_extproc")]
struct Args {
    /// Listen address (loopback only: this is a benchmark baseline, not a service).
    #[arg(long, default_value = "127.0.0.1:50052")]
    addr: SocketAddr,
}

struct Echo;

#[tonic::async_trait]
impl ExternalProcessor for Echo {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                // A filter in observability_mode does not wait for answers, and the protocol
                // asks the server to send none.
                if message.observability_mode {
                    continue;
                }
                let Some(answer) = continue_answer(message.request) else {
                    let _ = tx
                        .send(Err(Status::invalid_argument("empty message")))
                        .await;
                    return;
                };
                let response = ProcessingResponse {
                    response: Some(answer),
                    ..ProcessingResponse::default()
                };
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// CONTINUE for the phase `message` belongs to; `None` for a message with no phase.
fn continue_answer(message: Option<Message>) -> Option<Answer> {
    let common = || Some(CommonResponse::default());
    Some(match message? {
        Message::RequestHeaders(_) => {
            Answer::RequestHeaders(HeadersResponse { response: common() })
        }
        Message::RequestBody(_) => Answer::RequestBody(BodyResponse { response: common() }),
        Message::ResponseHeaders(_) => {
            Answer::ResponseHeaders(HeadersResponse { response: common() })
        }
        Message::ResponseBody(_) => Answer::ResponseBody(BodyResponse { response: common() }),
        Message::RequestTrailers(_) => Answer::RequestTrailers(TrailersResponse::default()),
        Message::ResponseTrailers(_) => Answer::ResponseTrailers(TrailersResponse::default()),
    })
}

async fn serve(addr: SocketAddr) -> Result<()> {
    anyhow::ensure!(addr.ip().is_loopback(), "--addr must be a loopback address");
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listen on {addr}"))?;
    println!("echo_extproc listening on {}", listener.local_addr()?);
    // The same server options and incoming stream as tollgate's `run` (src/lib.rs).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .http2_adaptive_window(Some(true))
        .add_service(ExternalProcessorServer::new(Echo))
        .serve_with_incoming(incoming)
        .await
        .context("serve")
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match serve(args.addr).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("echo_extproc: {error:#}");
            ExitCode::FAILURE
        }
    }
}
