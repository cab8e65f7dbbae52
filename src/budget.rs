//! Per-user budgets: token budgets over rolling windows, request rates, and concurrency leases,
//! held in a store every replica shares (Redis) or in this process (the embedded store).
//!
//! # The contract both stores keep (the contract tests in `tests/it/store_contract.rs` check it)
//!
//! **Rolling windows.** A `WindowLimit` of `limit` over `window_ms` is kept as `window_ms /
//! bucket_ms` sub-buckets. Usage is added to the bucket that holds the reservation's time
//! (`bucket = at_ms / bucket_ms`); a bucket counts while `bucket > now_bucket - buckets`, and
//! expires whole after that. So usage rolls off bucket by bucket, never all at once, and a
//! window never holds more than `limit` (a reservation that would pass `limit` is refused).
//!
//! **Reserve** (one atomic step, one round trip): for every window, `used + cost <= limit`
//! where the cost is `tokens` for token windows and 1 for request windows; and, if
//! `max_concurrent` is set, live leases (expiry > now) `< max_concurrent`. If all hold, every
//! window gets its cost in the current bucket and a lease `lease_id` is added with expiry
//! `now + lease_ttl_ms`; otherwise nothing changes at all and the first failing limit (windows in
//! order, then concurrency) is reported with `retry_after_ms`: the time until enough usage has
//! rolled off for this request to fit (until the next lease expiry, for concurrency), or `None`
//! when the cost exceeds the window's whole limit and can never fit.
//!
//! **Settle** (one round trip, at the end of a request): the lease is removed (a no-op if it is
//! gone), and each token window's bucket at `reserved_at_ms` is adjusted by
//! `actual_tokens - reserved_tokens`: a refund lowers it (never below zero), an extra charge raises
//! it. If that bucket has rolled off, a refund does nothing and an extra charge goes to the
//! current bucket. With `refund_request`, request windows give back the 1 they took.
//!
//! **Renew** pushes live leases' expiry to `now + lease_ttl_ms`; a lease that already expired
//! or was removed is not resurrected. A replica killed without settling frees its leases by
//! expiry alone, within `lease_ttl_ms`.
//!
//! **Time** is the store's own: Redis `TIME` inside its scripts (so replicas never disagree),
//! tokio's clock for the embedded store (so tests can pause it). `Granted::at_ms` is that time
//! and is only meaningful to the same store's `settle`.

pub mod breaker;
pub mod ledger;
pub mod memory;
pub mod redis;
pub mod window;

use std::time::Duration;

use crate::observe::{ErrorKind, LabelValue};

/// What a window counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quantity {
    /// Tokens: a request costs its worst case up front, settled to actual usage at the end.
    Tokens,
    /// Requests: each costs 1.
    Requests,
}

impl Quantity {
    pub fn unit(self) -> &'static str {
        match self {
            Quantity::Tokens => "tokens",
            Quantity::Requests => "requests",
        }
    }
}

/// One rolling-window limit.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WindowLimit {
    /// Stable and key-safe (`[a-z0-9_]`), e.g. `tokens_hour`, `requests_minute`,
    /// `model0_tokens_hour` (the first model limit's): it names the stored key and the limit in
    /// headers and errors.
    pub name: String,
    pub quantity: Quantity,
    pub window_ms: u64,
    /// Granularity of roll-off; divides `window_ms`.
    pub bucket_ms: u64,
    pub limit: u64,
}

/// A request's claim on its tenant's budgets.
#[derive(Clone, Copy, Debug)]
pub struct Reservation<'a> {
    pub tenant: &'a str,
    /// Unique per request (replica id and a counter): the lease's name.
    pub lease_id: &'a str,
    /// Cost against token windows: input tokens plus the output reserved.
    pub tokens: u64,
    pub windows: &'a [WindowLimit],
    pub max_concurrent: Option<u32>,
    pub lease_ttl_ms: u64,
}

/// The store's answer to a reservation. A refusal is a value, not an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reserve {
    Granted(Granted),
    Denied(Denied),
}

/// A reservation taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Granted {
    /// The store's time of the reservation, in ms; pass it back in `Settlement::reserved_at_ms`.
    pub at_ms: u64,
    /// Each window after this reservation, in the order of `Reservation::windows`.
    pub windows: Vec<WindowState>,
    /// Live leases including this one, when concurrency is limited.
    pub concurrent: Option<u32>,
}

/// A window's state as reported to clients (`x-ratelimit-*`, `RateLimit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowState {
    pub used: u64,
    pub limit: u64,
    /// Until the oldest usage in the window rolls off (0 if the window is empty).
    pub reset_ms: u64,
}

/// A reservation refused; nothing was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denied {
    pub limit: DeniedLimit,
    /// Usage of the failing limit before this request (leases, for concurrency).
    pub used: u64,
    /// The failing limit's value.
    pub allowed: u64,
    /// What this request needed from it.
    pub requested: u64,
    /// When enough frees for this request; `None` if it can never fit.
    pub retry_after_ms: Option<u64>,
    /// Every window's state, for the response headers.
    pub windows: Vec<WindowState>,
}

/// Which limit refused a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeniedLimit {
    /// `Reservation::windows[i]`.
    Window(usize),
    Concurrency,
}

/// The end of a granted request.
#[derive(Clone, Copy, Debug)]
pub struct Settlement<'a> {
    pub tenant: &'a str,
    pub lease_id: &'a str,
    pub windows: &'a [WindowLimit],
    pub reserved_at_ms: u64,
    pub reserved_tokens: u64,
    pub actual_tokens: u64,
    /// Give back the request's count too (the upstream failed before answering).
    pub refund_request: bool,
}

/// A lease to keep alive.
#[derive(Clone, Copy, Debug)]
pub struct LeaseRef<'a> {
    pub tenant: &'a str,
    pub lease_id: &'a str,
}

/// A tenant's usage at one instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    /// In the order of the windows asked about.
    pub windows: Vec<WindowState>,
    /// Leases not yet expired.
    pub leases: u32,
}

/// The store could not answer (as opposed to answering no).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("the budget store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the budget store is unavailable: {0}")]
    Unavailable(String),
    #[error("the budget store answered unexpectedly: {0}")]
    Protocol(String),
}

/// What kind of failure a `StoreError` is: the `kind` label of `tollgate_store_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreErrorKind {
    Timeout,
    Unavailable,
    Protocol,
}

impl LabelValue for StoreErrorKind {
    const ALL: &'static [StoreErrorKind] = &[
        StoreErrorKind::Timeout,
        StoreErrorKind::Unavailable,
        StoreErrorKind::Protocol,
    ];

    fn label(self) -> &'static str {
        match self {
            StoreErrorKind::Timeout => "timeout",
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::Protocol => "protocol",
        }
    }
}

impl ErrorKind for StoreError {
    type Kind = StoreErrorKind;

    fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Timeout(_) => StoreErrorKind::Timeout,
            StoreError::Unavailable(_) => StoreErrorKind::Unavailable,
            StoreError::Protocol(_) => StoreErrorKind::Protocol,
        }
    }
}

/// The budget store: embedded or Redis. An enum rather than a trait object: there are exactly
/// two, and the request path pays no boxing for the choice.
pub enum Store {
    Memory(memory::MemoryStore),
    /// Boxed: the Redis client is several times the embedded store's size.
    Redis(Box<redis::RedisStore>),
}

impl Store {
    pub async fn reserve(&self, reservation: &Reservation<'_>) -> Result<Reserve, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.reserve(reservation)),
            Store::Redis(store) => store.reserve(reservation).await,
        }
    }

    pub async fn settle(&self, settlement: &Settlement<'_>) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.settle(settlement);
                Ok(())
            }
            Store::Redis(store) => store.settle(settlement).await,
        }
    }

    pub async fn renew(
        &self,
        leases: &[LeaseRef<'_>],
        lease_ttl_ms: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.renew(leases, lease_ttl_ms);
                Ok(())
            }
            Store::Redis(store) => store.renew(leases, lease_ttl_ms).await,
        }
    }

    /// A tenant's current usage of `windows` and its live leases, changing nothing (for tests,
    /// and for operators asking why a tenant is refused).
    pub async fn usage(&self, tenant: &str, windows: &[WindowLimit]) -> Result<Usage, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.usage(tenant, windows)),
            Store::Redis(store) => store.usage(tenant, windows).await,
        }
    }

    /// Which kind of store this is, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}
