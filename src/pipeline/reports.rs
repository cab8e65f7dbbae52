//! Reports on a response that arrive outside the request's own stream.
//!
//! Streaming every response chunk through tollgate costs a round trip per token (issue 17). In
//! the reports deployment (envoy/front-proxy-reports.yaml) Envoy does not stream the response
//! body on the request's stream. Two reports come instead, each naming its request by the tag
//! the admission gave it (Envoy carries the tag as dynamic metadata):
//! - the **first token**: a second ext_proc filter shows tollgate the first body chunk on a
//!   stream of its own, which tollgate then closes, so Envoy sends no further chunk;
//! - the **summary**: once the response is over, Envoy's access log brings its status, and the
//!   usage and proper end that Envoy's Lua and `json_to_metadata` filters read from the body.
//!
//! The request's own stream still ends with the HTTP request, so its slot is freed then, as
//! before; only the settlement waits for the summary (`response.summary_wait` at most). A report
//! whose request is not open here (another replica admitted it, or it ended before the report
//! came) changes nothing and is counted.
//!
//! A first token never reported stays pending in the controller's window until the request
//! closes to reports: when its summary comes (typically the access log's flush interval after
//! the end), or `response.summary_wait` at most.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::control::window::{LatencyWindow, Pending};
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

/// An admitted request's place in `Reports`: its tag, and where its summary arrives. Closed to
/// reports when it drops, however the request ended (`summary` waits for the summary first).
pub struct Registration {
    reports: Arc<Reports>,
    id: u64,
    tag: String,
    summary: Option<oneshot::Receiver<Summary>>,
}

impl Registration {
    /// The tag reports name the request by.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The request ended: waits up to `wait` for its summary, then closes it to reports. None
    /// (counted `Missing`) when no summary came in time.
    pub async fn wait_for_summary(mut self, metrics: &Metrics, wait: Duration) -> Option<Summary> {
        let summary = match self.summary.take() {
            Some(receiver) => tokio::time::timeout(wait, receiver)
                .await
                .ok()
                .and_then(Result::ok),
            None => None,
        };
        if summary.is_none() {
            metrics.response_report(ResponseReport::Summary, ReportOutcome::Missing);
        }
        summary
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // A request dropped without finishing (a panic) closes here too, so no entry outlives
        // its request.
        let closed = self.reports.lock().remove(&self.id);
        // Dropped outside the lock: a first token never reported ends its pending entry in the
        // controller's window, which takes that window's lock.
        if let Some(Open {
            first_token: Some(first_token),
            ..
        }) = closed
        {
            first_token
                .rules
                .metrics
                .response_report(ResponseReport::FirstToken, ReportOutcome::Missing);
            drop(first_token);
        }
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
    /// the registration drops.
    pub fn register(self: &Arc<Self>, first_token: FirstToken) -> Registration {
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
            reports: self.clone(),
            id,
            tag: format!("{}.{id}", self.prefix),
            summary: Some(rx),
        }
    }

    /// The first token of the request tagged `tag` went by at `now`: its time to first token is
    /// recorded (once; a repeat is `Unknown`).
    pub fn first_token(
        &self,
        metrics: &Metrics,
        window: &Arc<Mutex<LatencyWindow>>,
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

    /// Requests open to reports.
    #[cfg(test)]
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
