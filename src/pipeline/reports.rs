//! Reports on a response that arrive outside the request's own stream.
//!
//! Streaming every response chunk through tollgate costs a round trip per token (issue 17). In
//! the reports deployment (envoy/front-proxy-reports.yaml) Envoy does not stream the response
//! body on the request's stream. Two reports come instead, each naming its request by the tag
//! the admission gave it (Envoy carries the tag as dynamic metadata):
//! - the **first token**: a second ext_proc filter shows tollgate the first body chunk on a
//!   stream of its own, which tollgate then closes, so Envoy sends no further chunk;
//! - the **summary**: once the response is over, Envoy's access log brings its status and the
//!   usage that Envoy's `sse_to_metadata` / `json_to_metadata` filters read from the body.
//!
//! The request's own stream still ends with the HTTP request, so its slot is freed then, as
//! before; only the settlement waits for the summary (`response.summary_wait` at most). A report
//! whose request is not open here (another replica admitted it, or it ended before the report
//! came) changes nothing and is counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::control::window::Pending;
use crate::live::Rules;
use crate::observe::response::Usage;
use crate::observe::{Metrics, ReportOutcome, ResponseReport};
use crate::policy::TierId;

/// What Envoy reports once a response is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The HTTP status sent to the client (0 if none was).
    pub status: u16,
    /// The usage the upstream reported, if its body carried one.
    pub usage: Option<Usage>,
    /// Whether the body ended properly (`data: [DONE]`, or a whole JSON body).
    pub finished: bool,
}

/// What a request's first token is recorded with.
pub struct FirstToken {
    pub rules: Arc<Rules>,
    pub tier: TierId,
    pub arrived: Instant,
    pub dispatched: Instant,
    /// Pending in the controller's window until the first token (None when the request does
    /// not feed the controller).
    pub pending: Option<Pending>,
    pub feeds_controller: bool,
}

/// The open requests that reports may name.
pub struct Reports {
    /// Tells this process's tags from another replica's, or an earlier run's.
    prefix: String,
    next: AtomicU64,
    open: Mutex<HashMap<u64, Open>>,
}

struct Open {
    first_token: Option<FirstToken>,
    summary: Option<oneshot::Sender<Summary>>,
}

/// An admitted request's place in `Reports`: its tag, and where its summary arrives. Given back
/// with `Reports::summary_of` when the request ends.
pub struct Registration {
    id: u64,
    tag: String,
    summary: oneshot::Receiver<Summary>,
}

impl Registration {
    /// The tag reports name the request by.
    pub fn tag(&self) -> &str {
        &self.tag
    }
}

/// Who a report is about.
#[derive(Debug, PartialEq, Eq)]
enum Addressee {
    Here(u64),
    OtherReplica,
}

impl Reports {
    pub fn new(prefix: String) -> Reports {
        Reports {
            prefix,
            next: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Opens a request to reports: they may name it by the returned registration's tag until
    /// `summary_of` takes it back.
    pub fn register(&self, first_token: FirstToken) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.lock().insert(
            id,
            Open {
                first_token: Some(first_token),
                summary: Some(tx),
            },
        );
        Registration {
            id,
            tag: format!("{}.{id}", self.prefix),
            summary: rx,
        }
    }

    /// The first token of the request tagged `tag` went by at `now`: its time to first token is
    /// recorded (once; a repeat is `Unknown`).
    pub fn first_token(
        &self,
        metrics: &Metrics,
        window: &Arc<Mutex<crate::control::window::LatencyWindow>>,
        tag: Option<&str>,
        now: Instant,
    ) -> ReportOutcome {
        let outcome = match self.addressee(tag) {
            None => ReportOutcome::Untagged,
            Some(Addressee::OtherReplica) => ReportOutcome::OtherReplica,
            Some(Addressee::Here(id)) => {
                let first_token = self
                    .lock()
                    .get_mut(&id)
                    .and_then(|open| open.first_token.take());
                match first_token {
                    Some(first_token) => {
                        super::record_first_token(window, first_token, now);
                        ReportOutcome::Matched
                    }
                    None => ReportOutcome::Unknown,
                }
            }
        };
        metrics.response_report(ResponseReport::FirstToken, outcome);
        outcome
    }

    /// Envoy's summary of the response of the request tagged `tag`: handed to its end (once; a
    /// repeat, or one that comes after the request gave up waiting, is `Unknown`).
    pub fn summary(&self, metrics: &Metrics, tag: Option<&str>, summary: Summary) -> ReportOutcome {
        let outcome = match self.addressee(tag) {
            None => ReportOutcome::Untagged,
            Some(Addressee::OtherReplica) => ReportOutcome::OtherReplica,
            Some(Addressee::Here(id)) => {
                let sender = self
                    .lock()
                    .get_mut(&id)
                    .and_then(|open| open.summary.take());
                // A receiver that is gone gave up waiting: the report came too late.
                match sender.map(|tx| tx.send(summary)) {
                    Some(Ok(())) => ReportOutcome::Matched,
                    Some(Err(_)) | None => ReportOutcome::Unknown,
                }
            }
        };
        metrics.response_report(ResponseReport::Summary, outcome);
        outcome
    }

    /// The request ended: waits up to `wait` for its summary, then closes it to reports. None
    /// (counted `Missing`) when no summary came in time.
    pub async fn summary_of(
        &self,
        metrics: &Metrics,
        registration: Registration,
        wait: Duration,
    ) -> Option<Summary> {
        let Registration { id, summary, .. } = registration;
        let summary = tokio::time::timeout(wait, summary)
            .await
            .ok()
            .and_then(Result::ok);
        // Dropped outside the lock: a first token never reported ends its pending entry in the
        // controller's window, which takes that window's lock.
        let closed = self.lock().remove(&id);
        drop(closed);
        if summary.is_none() {
            metrics.response_report(ResponseReport::Summary, ReportOutcome::Missing);
        }
        summary
    }

    /// Requests open to reports.
    pub fn open_count(&self) -> usize {
        self.lock().len()
    }

    fn addressee(&self, tag: Option<&str>) -> Option<Addressee> {
        let (prefix, id) = tag?.rsplit_once('.')?;
        let id = id.parse().ok()?;
        Some(if prefix == self.prefix {
            Addressee::Here(id)
        } else {
            Addressee::OtherReplica
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Open>> {
        self.open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
