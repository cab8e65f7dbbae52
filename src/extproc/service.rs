//! The ext_proc gRPC service, written out by hand rather than taken from envoy-types' generated
//! `ExternalProcessorServer`, so that it can choose its codec.
//!
//! The generated server always uses `ProstCodec::default()`, whose decode and encode buffers
//! start at 8 KiB each and are allocated for every stream when it opens. Under overload
//! thousands of streams wait in the queue, and those two buffers were most of what each one
//! cost (docs/benchmarks.md, "Held streams"). This codec starts them at `CODEC_BUFFER_BYTES`;
//! tonic grows them on demand for larger messages, such as a request body.
//!
//! Apart from the codec this is what the generated server does: one method, `Process`, served
//! through `tonic::server::Grpc::streaming`, the same maximum message sizes, no compression,
//! and `UNIMPLEMENTED` for any other path.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::SERVICE_NAME;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use prost::Message as _;
use tokio::sync::mpsc;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Status, Streaming};

use super::Shared;

/// The one method Envoy calls: `/{SERVICE_NAME}/Process`.
const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// Where tonic's per-stream codec buffers start. Most ext_proc messages (headers, a response
/// chunk, an answer) are a few hundred bytes; the buffers grow in steps of this size when one
/// is larger. Measured per held stream (docs/benchmarks.md): 8 KiB buffers cost 6.5 to 7.5 KB
/// more than 512 B ones, and 256 B saved only 0.5 KB more.
const CODEC_BUFFER_BYTES: usize = 512;
/// tonic's default: encoded answers ready at once are batched into writes of up to this much.
const CODEC_YIELD_THRESHOLD: usize = 32 * 1024;

fn buffer_settings() -> BufferSettings {
    BufferSettings::new(CODEC_BUFFER_BYTES, CODEC_YIELD_THRESHOLD)
}

/// The ext_proc gRPC service, for the tonic router: each `Process` call starts one stream task
/// (`super::open_stream`).
#[derive(Clone)]
pub struct ExtProcService {
    shared: Arc<Shared>,
    max_message_bytes: usize,
}

impl ExtProcService {
    /// Serves streams with `shared`, accepting and sending messages up to `max_message_bytes`
    /// (Envoy sends a buffered request body as one message).
    pub fn new(shared: Arc<Shared>, max_message_bytes: usize) -> ExtProcService {
        ExtProcService {
            shared,
            max_message_bytes,
        }
    }
}

impl NamedService for ExtProcService {
    const NAME: &'static str = SERVICE_NAME;
}

impl<B> Service<http::Request<B>> for ExtProcService
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != PROCESS_PATH {
            return Box::pin(std::future::ready(Ok(unimplemented())));
        }
        let process = Process(self.shared.clone());
        let mut grpc = Grpc::new(SmallBuffers)
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        Box::pin(async move { Ok(grpc.streaming(process, request).await) })
    }
}

/// `UNIMPLEMENTED` for a method this service does not have, as generated servers answer.
fn unimplemented() -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::default());
    let headers = response.headers_mut();
    headers.insert(
        Status::GRPC_STATUS,
        (tonic::Code::Unimplemented as i32).into(),
    );
    headers.insert(
        http::header::CONTENT_TYPE,
        tonic::metadata::GRPC_CONTENT_TYPE,
    );
    response
}

/// The `Process` method.
struct Process(Arc<Shared>);

impl StreamingService<ProcessingRequest> for Process {
    type Response = ProcessingResponse;
    type ResponseStream = Answers;
    type Future = std::future::Ready<Result<tonic::Response<Answers>, Status>>;

    fn call(&mut self, request: tonic::Request<Streaming<ProcessingRequest>>) -> Self::Future {
        let role = super::StreamRole::of(
            request
                .metadata()
                .get(super::STREAM_ROLE_HEADER)
                .map(|value| value.as_bytes()),
        );
        let answers = super::open_stream(self.0.clone(), request.into_inner(), role);
        std::future::ready(Ok(tonic::Response::new(answers)))
    }
}

/// One stream's answers, as its task sends them. Boxed in the channel: tokio allocates a
/// channel's slots 32 at a time, and 32 unboxed answers (296 B each) were 10 KB per stream.
pub type Answer = Box<Result<ProcessingResponse, Status>>;

/// The response stream tonic encodes: one stream task's answers, unboxed.
pub struct Answers(pub(super) mpsc::Receiver<Answer>);

impl tokio_stream::Stream for Answers {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0
            .poll_recv(cx)
            .map(|answer| answer.map(|answer| *answer))
    }
}

/// Protobuf through prost, as tonic-prost's codec, but with small starting buffers.
#[derive(Clone, Copy, Debug, Default)]
struct SmallBuffers;

impl Codec for SmallBuffers {
    type Encode = ProcessingResponse;
    type Decode = ProcessingRequest;
    type Encoder = AnswerEncoder;
    type Decoder = MessageDecoder;

    fn encoder(&mut self) -> AnswerEncoder {
        AnswerEncoder
    }

    fn decoder(&mut self) -> MessageDecoder {
        MessageDecoder
    }
}

struct AnswerEncoder;

impl Encoder for AnswerEncoder {
    type Item = ProcessingResponse;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // An `EncodeBuf` grows as it is written, so prost's "not enough space" cannot happen.
        item.encode(buf)
            .map_err(|error| Status::internal(format!("encoding an answer: {error}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}

struct MessageDecoder;

impl Decoder for MessageDecoder {
    type Item = ProcessingRequest;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        // INTERNAL for a message that does not parse, as tonic-prost and the gRPC status code
        // guide have it.
        ProcessingRequest::decode(buf)
            .map(Some)
            .map_err(|error| Status::internal(error.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_path_is_the_generated_services() {
        assert_eq!(PROCESS_PATH, format!("/{SERVICE_NAME}/Process"));
    }
}
