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
//! The two reports travel on different streams, so they may arrive in either order: a short
//! body's end, and so its summary, can overtake its first token. A request whose summary says
//! its response had a body, and whose first token has not come, stays open to it after
//! settling, until the same deadline, on a task of its own. A first token not yet reported
//! stays pending in the controller's window until the summary comes (Envoy sends it as the
//! response ends), or `response.summary_wait` at most.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

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
    /// The body bytes sent to the client: without any, there is no first token to wait for.
    pub body_bytes: u64,
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
    /// Told when the first token is recorded.
    first_token_seen: Option<oneshot::Sender<()>>,
    summary: Option<oneshot::Sender<Summary>>,
}

/// An admitted request's place in `Reports`: its tag, and where its summary and the news of
/// its first token arrive. Closed to reports when it drops, however the request ended (after
/// `await_late_first_token`, where its first token is overdue).
pub struct Registration {
    reports: Arc<Reports>,
    id: u64,
    tag: String,
    summary: Option<oneshot::Receiver<Summary>>,
    first_token_seen: Option<oneshot::Receiver<()>>,
}

impl Registration {
    /// The tag reports name the request by.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The request ended: waits until `deadline` for its summary. None (counted `Missing`)
    /// when no summary came in time.
    pub async fn wait_for_summary(
        &mut self,
        metrics: &Metrics,
        deadline: Instant,
    ) -> Option<Summary> {
        let summary = match self.summary.take() {
            Some(receiver) => tokio::time::timeout_at(deadline, receiver)
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

    /// Whether the response (by its `summary`) had a first token that has not been reported
    /// yet: Envoy sends it on a stream of its own as the body goes by, and a short body's
    /// summary can overtake it. Read from the news of it, without the registry's lock.
    pub fn first_token_overdue(&mut self, summary: Option<&Summary>) -> bool {
        summary.is_some_and(|summary| summary.body_bytes > 0)
            && self.first_token_seen.as_mut().is_some_and(|seen| {
                matches!(seen.try_recv(), Err(oneshot::error::TryRecvError::Empty))
            })
    }

    /// Keeps the request open to its overdue first token until `deadline`, then closes it. The
    /// response is over, so its entry in the controller's window ends now: waiting, it would
    /// age as if the first token were still to come. A first token reported later still
    /// records its time to first token, and its sample in the window (`record_first_token`).
    pub fn await_late_first_token(
        mut self,
        deadline: Instant,
    ) -> impl Future<Output = ()> + Send + 'static {
        let pending = self
            .reports
            .lock()
            .get_mut(&self.id)
            .and_then(|open| open.first_token.as_mut()?.pending.take());
        // Outside the lock: ending it takes the window's lock.
        drop(pending);
        let seen = self.first_token_seen.take();
        async move {
            if let Some(seen) = seen {
                // Told (recorded), the sender gone (recorded), or too late: closed either way.
                let _ = tokio::time::timeout_at(deadline, seen).await;
            }
            drop(self);
        }
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
        let (summary_tx, summary_rx) = oneshot::channel();
        let (seen_tx, seen_rx) = oneshot::channel();
        self.lock().insert(
            id,
            Open {
                first_token: Some(first_token),
                first_token_seen: Some(seen_tx),
                summary: Some(summary_tx),
            },
        );
        Registration {
            reports: self.clone(),
            id,
            tag: format!("{}.{id}", self.prefix),
            summary: Some(summary_rx),
            first_token_seen: Some(seen_rx),
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
                let taken = self.lock().get_mut(&id).and_then(|open| {
                    let first_token = open.first_token.take()?;
                    Some((first_token, open.first_token_seen.take()))
                });
                match taken {
                    Some((first_token, seen)) => {
                        super::record_first_token(window, first_token, now);
                        if let Some(seen) = seen {
                            // Nobody waiting (the summary has not come) is fine.
                            let _ = seen.send(());
                        }
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
