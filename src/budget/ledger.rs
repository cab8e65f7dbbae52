//! The ledger: reserves a request's budgets in the store, and settles them exactly once when
//! the request ends; keeps this replica's live leases renewed; and, when the store fails, takes
//! the configured fail modes (budgets open or closed, concurrency capped per replica) behind a
//! circuit breaker, logging a failure once rather than per request.
//!
//! A `Hold` is the request's side of it: settled explicitly with actual usage, or, if dropped
//! unsettled, released with the reservation charged as taken. Either way, once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::breaker::{Breaker, BreakerState, Permission};
use super::{
    Denied, Granted, LeaseRef, Reservation, Reserve, Settlement, Store, StoreError, WindowLimit,
    WindowState,
};
use crate::config::{FailMode, StoreConfig};
use crate::observe::{DegradedControl, GaugeGuard, Metrics, StoreOp};

pub struct Ledger {
    store: Store,
    config: StoreConfig,
    breaker: Mutex<Breaker>,
    /// This replica's leases, for renewal: lease id → tenant.
    live: Mutex<HashMap<String, String>>,
    /// Per-tenant requests admitted while the store was failing (the per-replica cap).
    degraded: Mutex<HashMap<String, u32>>,
    /// Makes lease ids unique: a per-process random prefix and a counter.
    replica: String,
    next_lease: AtomicU64,
    metrics: Metrics,
}

/// What reserving a request's budgets answers. A "no" is a value: `Err` is not used for it, and
/// what the client is told is decided by `reply`, not here.
pub enum Reserved {
    Granted(Grant),
    Denied(Denial),
}

/// A granted request's claim: the hold to settle at its end, and its budgets' state after it.
pub struct Grant {
    pub hold: Hold,
    /// The budgets after this request, for the client's `x-ratelimit-*` and `RateLimit*`
    /// headers; `None` when nothing was checked (no budgets, or the store failing open).
    pub budgets: Option<BudgetState>,
}

/// A tenant's budgets as one reservation left them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetState {
    /// Shared with the request's `Hold`, which settles against the same windows.
    pub windows: Arc<[WindowLimit]>,
    /// Each window's state, in the order of `windows`.
    pub states: Vec<WindowState>,
    /// Live leases including this request, and the limit, when concurrency is limited.
    pub concurrency: Option<(u32, u32)>,
}

/// Why a reservation was refused; nothing was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denial {
    /// A budget window or the concurrency limit has no room for the request.
    Limit {
        windows: Arc<[WindowLimit]>,
        denied: Denied,
        max_concurrent: Option<u32>,
    },
    /// The store cannot be reached and `store.budgets_on_error` fails closed.
    StoreUnavailable,
    /// The store cannot be reached and this replica already admits `cap` requests of the
    /// tenant (`store.concurrency_on_error: fail_closed`).
    ReplicaConcurrencyCap { cap: u32 },
}

impl Ledger {
    pub fn new(store: Store, config: StoreConfig, metrics: Metrics) -> Arc<Ledger> {
        let breaker = Breaker::new(
            config.breaker_failures,
            Duration::from_millis(config.breaker_open_ms),
        );
        Arc::new(Ledger {
            store,
            config,
            breaker: Mutex::new(breaker),
            live: Mutex::new(HashMap::new()),
            degraded: Mutex::new(HashMap::new()),
            replica: replica_id(),
            next_lease: AtomicU64::new(0),
            metrics,
        })
    }

    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// Reserves `tokens` against `windows` and, if `max_concurrent` is set, a concurrency lease
    /// for a request of `tenant` (policy decides which windows and limits a request counts
    /// against: `policy::Tier::windows_for`). One store round trip, or none when there are no
    /// budgets or the circuit is open.
    pub async fn reserve(
        self: &Arc<Self>,
        tenant: &str,
        windows: Arc<[WindowLimit]>,
        max_concurrent: Option<u32>,
        tokens: u64,
    ) -> Reserved {
        if windows.is_empty() && max_concurrent.is_none() {
            return Reserved::Granted(Grant {
                hold: Hold::none(),
                budgets: None,
            });
        }
        let lease_id = format!(
            "{}-{}",
            self.replica,
            self.next_lease.fetch_add(1, Ordering::Relaxed)
        );
        let reservation = Reservation {
            tenant,
            lease_id: &lease_id,
            tokens,
            windows: &windows,
            max_concurrent,
            lease_ttl_ms: self.config.lease_ttl_ms,
        };
        let answer = match self.permission() {
            Permission::Call => {
                self.call(StoreOp::Reserve, self.store.reserve(&reservation))
                    .await
            }
            Permission::Skip => Err(None),
        };
        match answer {
            Ok(Reserve::Granted(granted)) => {
                let concurrency =
                    max_concurrent.map(|limit| (granted.concurrent.unwrap_or(0), limit));
                let hold = self.recorded(tenant, lease_id, windows.clone(), tokens, &granted);
                Reserved::Granted(Grant {
                    hold,
                    budgets: Some(BudgetState {
                        windows,
                        states: granted.windows,
                        concurrency,
                    }),
                })
            }
            Ok(Reserve::Denied(denied)) => Reserved::Denied(Denial::Limit {
                windows,
                denied,
                max_concurrent,
            }),
            Err(_) => self.degraded_decision(tenant, &windows, max_concurrent),
        }
    }

    /// A tenant's usage of `windows` and its live leases, changing nothing: for tests, and for
    /// operators asking why a tenant is refused.
    pub async fn usage(
        &self,
        tenant: &str,
        windows: &[WindowLimit],
    ) -> Result<super::Usage, StoreError> {
        self.store.usage(tenant, windows).await
    }

    /// Settles `hold` with what the request really cost.
    pub async fn settle(&self, mut hold: Hold, actual_tokens: u64, refund_request: bool) {
        let Some(HoldKind::Recorded(recorded)) = hold.kind.take() else {
            return; // Degraded holds release their local count on drop; nothing was stored.
        };
        self.settle_recorded(recorded, actual_tokens, refund_request)
            .await;
    }

    /// Keeps this replica's leases alive until the server stops: one batched round trip per
    /// period.
    pub async fn renew_leases(self: Arc<Self>) {
        let period = Duration::from_millis(self.config.lease_renew_ms);
        let mut tick = tokio::time::interval_at(Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let live: Vec<(String, String)> = lock(&self.live)
                .iter()
                .map(|(lease, tenant)| (tenant.clone(), lease.clone()))
                .collect();
            // Not skipped while the breaker is open: renewal is background work, nobody waits
            // on it, and skipping it would let live leases expire after a short blip (the
            // tenant could then exceed its concurrency cap). Its result still feeds the breaker.
            if live.is_empty() {
                continue;
            }
            let leases: Vec<LeaseRef<'_>> = live
                .iter()
                .map(|(tenant, lease_id)| LeaseRef { tenant, lease_id })
                .collect();
            let _ = self
                .call(
                    StoreOp::Renew,
                    self.store.renew(&leases, self.config.lease_ttl_ms),
                )
                .await;
        }
    }

    fn recorded(
        self: &Arc<Self>,
        tenant: &str,
        lease_id: String,
        windows: Arc<[WindowLimit]>,
        tokens: u64,
        granted: &Granted,
    ) -> Hold {
        lock(&self.live).insert(lease_id.clone(), tenant.to_owned());
        Hold {
            kind: Some(HoldKind::Recorded(Recorded {
                ledger: self.clone(),
                tenant: tenant.to_owned(),
                lease_id,
                windows,
                reserved_at_ms: granted.at_ms,
                reserved_tokens: tokens,
                _lease: self.metrics.hold_lease(),
            })),
        }
    }

    async fn settle_recorded(&self, recorded: Recorded, actual_tokens: u64, refund_request: bool) {
        lock(&self.live).remove(&recorded.lease_id);
        let settlement = Settlement {
            tenant: &recorded.tenant,
            lease_id: &recorded.lease_id,
            windows: &recorded.windows,
            reserved_at_ms: recorded.reserved_at_ms,
            reserved_tokens: recorded.reserved_tokens,
            actual_tokens,
            refund_request,
        };
        // Not retried: a settle that timed out may have been applied, and applying it twice
        // would be worse than the reservation staying charged as taken (the lease expires).
        if self.permission() == Permission::Call {
            let _ = self
                .call(StoreOp::Settle, self.store.settle(&settlement))
                .await;
        }
        tracing::trace!(actual_tokens, "settled");
    }

    /// The store failed or the circuit is open: take the fail modes.
    fn degraded_decision(
        self: &Arc<Self>,
        tenant: &str,
        windows: &[WindowLimit],
        max_concurrent: Option<u32>,
    ) -> Reserved {
        if !windows.is_empty() {
            let mode = self.config.budgets_on_error;
            self.metrics.degraded(DegradedControl::Budgets, mode);
            if mode == FailMode::FailClosed {
                return Reserved::Denied(Denial::StoreUnavailable);
            }
        }
        let mut local = None;
        if max_concurrent.is_some() {
            let mode = self.config.concurrency_on_error;
            self.metrics.degraded(DegradedControl::Concurrency, mode);
            if mode == FailMode::FailClosed {
                let cap = self.config.degraded_max_concurrent;
                let mut counts = lock(&self.degraded);
                let count = counts.entry(tenant.to_owned()).or_insert(0);
                if *count >= cap {
                    return Reserved::Denied(Denial::ReplicaConcurrencyCap { cap });
                }
                *count += 1;
                local = Some(tenant.to_owned());
            }
        }
        Reserved::Granted(Grant {
            hold: Hold {
                kind: local.map(|tenant| HoldKind::Degraded {
                    _release: Degraded {
                        ledger: self.clone(),
                        tenant,
                    },
                }),
            },
            budgets: None,
        })
    }

    fn permission(&self) -> Permission {
        lock(&self.breaker).permission(Instant::now())
    }

    /// One store call with its metrics and breaker bookkeeping. `Err(Some(e))` is a failure,
    /// `Err(None)` a skipped call.
    async fn call<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, Option<StoreError>> {
        let started = Instant::now();
        // The store bounds its own calls; this is the backstop for one that does not.
        let timeout = Duration::from_millis(self.config.timeout_ms);
        let result = match tokio::time::timeout(timeout + timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(timeout)),
        };
        let now = Instant::now();
        self.metrics.store_call(
            op,
            now.duration_since(started).as_secs_f64(),
            result.as_ref().err(),
        );
        let changed = lock(&self.breaker).record(result.is_ok(), now);
        let state = lock(&self.breaker).state();
        self.metrics.breaker_state(state);
        if changed {
            match (state, &result) {
                (BreakerState::Open, Err(e)) => tracing::warn!(
                    store = self.store.kind(),
                    "budget store failing ({e}); taking the fail modes until it recovers"
                ),
                (BreakerState::Closed, _) => {
                    tracing::info!(store = self.store.kind(), "budget store recovered")
                }
                _ => {}
            }
        }
        result.map_err(Some)
    }
}

/// A request's claim on the budgets, to settle once at its end.
pub struct Hold {
    kind: Option<HoldKind>,
}

enum HoldKind {
    /// Reserved in the store: settle there.
    Recorded(Recorded),
    /// Admitted under the per-replica cap while the store failed: release the local count.
    Degraded { _release: Degraded },
}

struct Recorded {
    ledger: Arc<Ledger>,
    tenant: String,
    lease_id: String,
    windows: Arc<[WindowLimit]>,
    reserved_at_ms: u64,
    reserved_tokens: u64,
    _lease: GaugeGuard,
}

struct Degraded {
    ledger: Arc<Ledger>,
    tenant: String,
}

impl Hold {
    /// Nothing reserved (the tier has no budgets or concurrency limit).
    pub fn none() -> Hold {
        Hold { kind: None }
    }

    /// Whether the store holds a reservation to settle.
    pub fn is_recorded(&self) -> bool {
        matches!(self.kind, Some(HoldKind::Recorded(_)))
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        // Unsettled (a path that forgot, or a panic): release the lease, charging the
        // reservation as taken. Spawned because Drop cannot wait; outside a runtime there is
        // nobody to serve anyway, and the lease expires by itself.
        if let Some(HoldKind::Recorded(recorded)) = self.kind.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let tokens = recorded.reserved_tokens;
            let ledger = recorded.ledger.clone();
            runtime.spawn(async move { ledger.settle_recorded(recorded, tokens, false).await });
        }
    }
}

impl Drop for Degraded {
    fn drop(&mut self) {
        let mut counts = lock(&self.ledger.degraded);
        if let Some(count) = counts.get_mut(&self.tenant) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.tenant);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A prefix that keeps lease ids (and report tags, `pipeline::reports`) of different replicas
/// and restarts apart.
pub(crate) fn replica_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::process::id());
    format!("{:x}-{:x}", std::process::id(), random & 0xffff_ffff)
}
