//! Envoy's gRPC access log service, as the channel for response summaries: once a response is
//! over, Envoy logs it with its status and its stream's dynamic metadata, where the report tag
//! and the usage Envoy read from the body are (`pipeline::reports`). Each entry is handed to
//! `Reports::summary`; everything else in it is ignored.
//!
//! Envoy keeps one stream per worker open and sends each entry on it as its response ends
//! (envoy/front-proxy-reports.yaml does not batch them), so a summary costs one message, not a
//! stream of its own. The protocol has no answers: Envoy expects none until the stream ends.

use std::sync::Arc;

use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsResponse;
use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::{
    AccessLogService, AccessLogServiceServer,
};
use tonic::{Request, Response, Status, Streaming};

use super::Shared;
use super::convert::{self, StreamAccessLogsMessage};
use crate::lifecycle::{Lifecycle, reached};

/// The access log service that takes Envoy's response summaries.
#[derive(Clone)]
pub struct AccessLogReports {
    shared: Arc<Shared>,
}

impl AccessLogReports {
    /// The service for tonic's router; messages up to `max_message_bytes` (a batch of entries).
    pub fn server(
        shared: Arc<Shared>,
        max_message_bytes: usize,
    ) -> AccessLogServiceServer<AccessLogReports> {
        AccessLogServiceServer::new(AccessLogReports { shared })
            .max_decoding_message_size(max_message_bytes)
    }

    fn take(&self, message: StreamAccessLogsMessage) {
        let pipeline = &self.shared.pipeline;
        for (tag, summary) in convert::summaries(message) {
            pipeline
                .reports
                .summary(&pipeline.metrics, tag.as_deref(), summary);
        }
    }
}

#[tonic::async_trait]
impl AccessLogService for AccessLogReports {
    async fn stream_access_logs(
        &self,
        request: Request<Streaming<StreamAccessLogsMessage>>,
    ) -> Result<Response<StreamAccessLogsResponse>, Status> {
        let mut messages = request.into_inner();
        let mut lifecycle = self.shared.lifecycle.clone();
        // Until Envoy ends the stream (or it breaks: the entries in flight are lost, and the
        // requests they were about settle without a summary after `response.summary_wait`),
        // or the server closes: Envoy never ends it, and the gRPC server waits for every open
        // stream before it stops. Draining streams still get their summaries until then.
        loop {
            let message = tokio::select! {
                message = messages.message() => message,
                () = reached(&mut lifecycle, Lifecycle::Closing) => break,
            };
            match message {
                Ok(Some(message)) => self.take(message),
                Ok(None) | Err(_) => break,
            }
        }
        Ok(Response::new(StreamAccessLogsResponse {}))
    }
}
