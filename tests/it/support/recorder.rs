//! The ext_proc recorder: a gRPC proxy for `ExternalProcessor/Process` that sits between Envoy
//! and tollgate, forwards every message both ways unchanged, and notes each one (and how each
//! stream ended) for a recording (`support::recording`).
//!
//! Messages are forwarded as decoded by envoy-types, so a field newer than envoy-types knows
//! would be dropped on the way; tollgate decodes with the same types, so it sees the same
//! either way.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use prost::Message as _;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::recording::{Event, StreamEnd, event, normalize_request, note, stream_end::Kind};

/// Largest message either way: Envoy sends a buffered body (up to 8 MiB) as one message.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// What the proxy saw, in order. Times are exact here; rounding happens when writing.
#[derive(Default)]
struct Log {
    start: Option<Instant>,
    events: Vec<(Duration, Event)>,
}

#[derive(Clone)]
struct Shared {
    log: Arc<Mutex<Log>>,
    next_stream: Arc<AtomicU32>,
    open_streams: Arc<AtomicU32>,
    tollgate: SocketAddr,
}

impl Shared {
    fn record(&self, stream: u32, event: event::Event) {
        let mut log = self.log.lock().unwrap();
        let now = Instant::now();
        let start = *log.start.get_or_insert(now);
        log.events.push((
            now - start,
            Event {
                stream,
                time_us: 0,
                note: note(&event),
                event: Some(event),
            },
        ));
    }

    fn end(&self, stream: u32, kind: Kind, status: Option<&Status>) {
        let (code, message) = status.map_or((0, ""), |s| (s.code() as i32, s.message()));
        self.record(
            stream,
            event::Event::End(StreamEnd::new(kind, code, message)),
        );
    }
}

/// A running recorder. Point Envoy's `tollgate` cluster at [`Recorder::addr`].
pub struct Recorder {
    pub addr: SocketAddr,
    shared: Shared,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Recorder {
    /// Listens on a free loopback port and forwards each stream to tollgate at `tollgate`.
    pub async fn start(tollgate: SocketAddr) -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the recorder");
        let addr = listener.local_addr().unwrap();
        let shared = Shared {
            log: Arc::default(),
            next_stream: Arc::default(),
            open_streams: Arc::default(),
            tollgate,
        };
        let (tx, rx) = oneshot::channel::<()>();
        let service = ExternalProcessorServer::new(Proxy(shared.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
                    let _ = rx.await;
                }),
        );
        Recorder {
            addr,
            shared,
            shutdown: Some(tx),
        }
    }

    /// Streams Envoy has opened so far.
    pub fn streams_opened(&self) -> u32 {
        self.shared.next_stream.load(Ordering::SeqCst)
    }

    /// Waits up to `grace` for every stream to end, marks those still open as `TIMEOUT`, stops
    /// listening, and returns the events with times rounded down to `quantum_us`.
    pub async fn finish(mut self, grace: Duration, quantum_us: u32) -> Vec<Event> {
        let deadline = Instant::now() + grace;
        while self.shared.open_streams.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let opened = self.streams_opened();
        {
            let log = self.shared.log.lock().unwrap();
            let mut ended = vec![false; opened as usize];
            for (_, e) in &log.events {
                if let Some(event::Event::End(end)) = &e.event
                    && matches!(end.kind_enum(), Kind::TollgateClosed | Kind::EnvoyReset)
                {
                    ended[e.stream as usize] = true;
                }
            }
            drop(log);
            for (stream, ended) in ended.into_iter().enumerate() {
                if !ended {
                    self.shared.end(stream as u32, Kind::Timeout, None);
                }
            }
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let quantum = u128::from(quantum_us.max(1));
        let log = std::mem::take(&mut *self.shared.log.lock().unwrap());
        log.events
            .into_iter()
            .map(|(at, mut event)| {
                let us = at.as_micros() / quantum * quantum;
                event.time_us = u32::try_from(us).unwrap_or(u32::MAX);
                event
            })
            .collect()
    }
}

struct Proxy(Shared);

type AnswerStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Proxy {
    type ProcessStream = AnswerStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<AnswerStream>, Status> {
        let shared = self.0.clone();
        let stream = shared.next_stream.fetch_add(1, Ordering::SeqCst);
        shared.open_streams.fetch_add(1, Ordering::SeqCst);
        let mut from_envoy = request.into_inner();

        let (to_tollgate, to_tollgate_rx) = mpsc::channel::<ProcessingRequest>(64);
        let (to_envoy, to_envoy_rx) = mpsc::channel::<Result<ProcessingResponse, Status>>(64);
        // Envoy reset its side: stop forwarding to tollgate and cancel the call there too.
        let (reset_tx, mut reset_rx) = oneshot::channel::<()>();
        // Either side may notice a reset first (an error reading Envoy's messages, or Envoy no
        // longer reading answers); it is recorded once.
        let reset_recorded = Arc::new(AtomicBool::new(false));

        // Envoy -> tollgate.
        let up = shared.clone();
        let up_reset = Arc::clone(&reset_recorded);
        tokio::spawn(async move {
            loop {
                match from_envoy.message().await {
                    Ok(Some(message)) => {
                        let mut recorded = message.clone();
                        normalize_request(&mut recorded, stream);
                        up.record(stream, event::Event::Request(recorded.encode_to_vec()));
                        if to_tollgate.send(message).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => {
                        up.end(stream, Kind::EnvoyHalfClosed, None);
                        break;
                    }
                    Err(status) => {
                        if !up_reset.swap(true, Ordering::SeqCst) {
                            up.end(stream, Kind::EnvoyReset, Some(&status));
                        }
                        let _ = reset_tx.send(());
                        break;
                    }
                }
            }
            // Dropping `to_tollgate` half-closes the call to tollgate.
        });

        // tollgate -> Envoy.
        let down = shared.clone();
        let tollgate = shared.tollgate;
        tokio::spawn(async move {
            let mut client = match ExternalProcessorClient::connect(format!("http://{tollgate}"))
                .await
            {
                Ok(client) => client
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
                Err(e) => {
                    let status = Status::unavailable(format!("recorder: connect tollgate: {e}"));
                    down.end(stream, Kind::TollgateClosed, Some(&status));
                    let _ = to_envoy.send(Err(status)).await;
                    down.open_streams.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            };
            let mut answers = match client.process(ReceiverStream::new(to_tollgate_rx)).await {
                Ok(response) => response.into_inner(),
                Err(status) => {
                    down.end(stream, Kind::TollgateClosed, Some(&status));
                    let _ = to_envoy.send(Err(status)).await;
                    down.open_streams.fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            };
            // Set when the inbound side ended without a reset (its sender dropped unsent).
            let mut no_reset = false;
            loop {
                tokio::select! {
                    answer = answers.message() => match answer {
                        Ok(Some(message)) => {
                            down.record(stream, event::Event::Response(message.encode_to_vec()));
                            if to_envoy.send(Ok(message)).await.is_err() {
                                // Envoy reset the stream after half-closing it.
                                if !reset_recorded.swap(true, Ordering::SeqCst) {
                                    let status = Status::cancelled("Envoy stopped reading answers");
                                    down.end(stream, Kind::EnvoyReset, Some(&status));
                                }
                                break;
                            }
                        }
                        Ok(None) => {
                            down.end(stream, Kind::TollgateClosed, None);
                            break;
                        }
                        Err(status) => {
                            down.end(stream, Kind::TollgateClosed, Some(&status));
                            let _ = to_envoy.send(Err(status)).await;
                            break;
                        }
                    },
                    reset = &mut reset_rx, if !no_reset => match reset {
                        Ok(()) => break,
                        Err(_) => no_reset = true,
                    },
                }
            }
            // Dropping `answers` cancels the call at tollgate if it is still open.
            drop(answers);
            down.open_streams.fetch_sub(1, Ordering::SeqCst);
        });

        Ok(Response::new(Box::pin(ReceiverStream::new(to_envoy_rx))))
    }
}
