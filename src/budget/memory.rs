//! The embedded budget store: the contract in `crate::budget` kept in this process, for a
//! single replica (or a test) with no Redis configured.
//!
//! One mutex over every tenant's state. Each method is one short critical section with no
//! await inside (the methods are sync), so an operation is atomic exactly as a Redis script
//! is, and the lock is never held long: the work is O(windows + buckets rolled + live leases)
//! for the one tenant, plus a bounded sweep (below).
//!
//! # Time
//!
//! Milliseconds since the store was made, from tokio's clock, so paused-time tests step it with
//! `tokio::time::advance`. `Granted::at_ms` is on this scale and means nothing to another store.
//!
//! # Memory
//!
//! A tenant's state exists only while it holds something: a window with usage or a live lease.
//! Windows are keyed by `WindowLimit::name` and kept with the last limit seen for them, so any
//! of a tenant's windows can be rolled, including ones the current request does not name (a
//! per-model window of another model). State is forgotten lazily, never by scanning every
//! tenant:
//! - the tenant an operation touches is dropped at its end if it holds nothing;
//! - each operation also looks at the next `SWEEP_PER_OPERATION` tenants in round-robin order
//!   and drops those that hold nothing any more. A tenant seen once and never again would
//!   otherwise stay for ever; with the sweep, tenants are visited faster than operations can
//!   create them, so memory stays proportional to the tenants active within about one sweep
//!   cycle, at O(1) extra work per operation.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::time::Instant;

use super::window::WindowUsage;
use super::{
    Denied, DeniedLimit, Granted, LeaseRef, Quantity, Reservation, Reserve, Settlement, Usage,
    WindowLimit, WindowState,
};

/// Other tenants examined for cleanup per operation. More than one, so that cleanup outpaces
/// the creation of new tenants (at most one per operation).
const SWEEP_PER_OPERATION: usize = 2;

/// The embedded store. Cheap to share behind an `Arc`; every method takes `&self`.
pub struct MemoryStore {
    epoch: Instant,
    tenants: Mutex<Tenants>,
}

/// Every tenant holding something, in a vector (for the round-robin sweep) indexed by name.
#[derive(Default)]
struct Tenants {
    index: HashMap<String, usize>,
    entries: Vec<(String, TenantState)>,
    /// Where the sweep looks next.
    cursor: usize,
}

#[derive(Default)]
struct TenantState {
    /// A handful per tenant, so a vector searched by name beats a map.
    windows: Vec<Window>,
    /// Lease id to expiry (ms); live while the expiry is after now.
    leases: HashMap<String, u64>,
}

struct Window {
    /// The limit last seen for this name: how to roll it when no request names it.
    limit: WindowLimit,
    usage: WindowUsage,
}

impl Default for MemoryStore {
    fn default() -> MemoryStore {
        MemoryStore::new()
    }
}

impl MemoryStore {
    pub fn new() -> MemoryStore {
        MemoryStore {
            epoch: Instant::now(),
            tenants: Mutex::default(),
        }
    }

    /// All or nothing: every window and the concurrency limit are checked before anything is
    /// taken; see the contract in `crate::budget`.
    pub fn reserve(&self, r: &Reservation<'_>) -> Reserve {
        let now = self.now_ms();
        let mut tenants = self.lock();
        tenants.sweep(now);
        let state = tenants.state(r.tenant);
        state.adopt(r.windows);
        state.roll(now);

        let windows: Vec<WindowState> = r
            .windows
            .iter()
            .map(|limit| state.window_state(limit, now))
            .collect();
        let empty = WindowUsage::default();
        let denied = r
            .windows
            .iter()
            .enumerate()
            .find_map(|(i, limit)| {
                let usage = state.usage(&limit.name).unwrap_or(&empty);
                let cost = cost(limit, r.tokens);
                (!usage.fits(limit, cost)).then(|| Denied {
                    limit: DeniedLimit::Window(i),
                    used: windows[i].used,
                    allowed: limit.limit,
                    requested: cost,
                    retry_after_ms: usage.retry_after_ms(limit, now, cost),
                    windows: windows.clone(),
                })
            })
            .or_else(|| {
                let max = r.max_concurrent?;
                let live = state.leases.len() as u64;
                (live >= u64::from(max)).then(|| Denied {
                    limit: DeniedLimit::Concurrency,
                    used: live,
                    allowed: u64::from(max),
                    requested: 1,
                    // With no slot at all it can never fit; else when the first lease expires.
                    retry_after_ms: (max > 0).then(|| {
                        state
                            .leases
                            .values()
                            .min()
                            .map_or(0, |&expiry| expiry - now)
                    }),
                    windows: windows.clone(),
                })
            });
        let answer = match denied {
            Some(denied) => Reserve::Denied(denied),
            None => {
                for limit in r.windows {
                    let cost = cost(limit, r.tokens);
                    if cost > 0 {
                        state.window_mut(limit).usage.add(limit, now, cost);
                    }
                }
                state
                    .leases
                    .insert(r.lease_id.to_owned(), now.saturating_add(r.lease_ttl_ms));
                let leases = u32::try_from(state.leases.len()).unwrap_or(u32::MAX);
                Reserve::Granted(Granted {
                    at_ms: now,
                    windows: r
                        .windows
                        .iter()
                        .map(|limit| state.window_state(limit, now))
                        .collect(),
                    concurrent: r.max_concurrent.map(|_| leases),
                })
            }
        };
        tenants.forget_if_idle(r.tenant);
        answer
    }

    /// Removes the lease (if still there) and adjusts each token window's reserved bucket by
    /// `actual - reserved` (and each request window by -1 with `refund_request`).
    ///
    /// The adjustment is applied whether or not the lease was still there: a long request can
    /// outlive a lease its replica failed to renew, and its tokens were spent all the same.
    /// Settling exactly once is the caller's duty; a second settle removes no further lease
    /// but would adjust again.
    pub fn settle(&self, s: &Settlement<'_>) {
        let now = self.now_ms();
        let mut tenants = self.lock();
        tenants.sweep(now);
        let state = tenants.state(s.tenant);
        state.adopt(s.windows);
        state.roll(now);
        state.leases.remove(s.lease_id);
        for limit in s.windows {
            let delta = match limit.quantity {
                Quantity::Tokens => i128::from(s.actual_tokens) - i128::from(s.reserved_tokens),
                Quantity::Requests if s.refund_request => -1,
                Quantity::Requests => 0,
            };
            if delta != 0 {
                state
                    .window_mut(limit)
                    .usage
                    .adjust(limit, s.reserved_at_ms, now, delta);
            }
        }
        state.windows.retain(|window| !window.usage.is_empty());
        tenants.forget_if_idle(s.tenant);
    }

    /// Sets each live lease's expiry to now + `lease_ttl_ms`; expired or settled leases stay
    /// gone (a tenant that holds nothing is not even created).
    pub fn renew(&self, leases: &[LeaseRef<'_>], lease_ttl_ms: u64) {
        let now = self.now_ms();
        let mut tenants = self.lock();
        tenants.sweep(now);
        for lease in leases {
            let Some(&i) = tenants.index.get(lease.tenant) else {
                continue;
            };
            let state = &mut tenants.entries[i].1;
            if let Some(expiry) = state.leases.get_mut(lease.lease_id)
                && *expiry > now
            {
                *expiry = now.saturating_add(lease_ttl_ms);
            }
        }
    }

    /// The tenant's usage of `windows` and its live leases. Changes nothing observable (it may
    /// forget what has already rolled off or expired).
    pub fn usage(&self, tenant: &str, windows: &[WindowLimit]) -> Usage {
        let now = self.now_ms();
        let mut tenants = self.lock();
        let Some(&i) = tenants.index.get(tenant) else {
            return Usage {
                windows: windows.iter().map(empty_state).collect(),
                leases: 0,
            };
        };
        let state = &mut tenants.entries[i].1;
        state.adopt(windows);
        state.roll(now);
        let usage = Usage {
            windows: windows
                .iter()
                .map(|limit| state.window_state(limit, now))
                .collect(),
            leases: u32::try_from(state.leases.len()).unwrap_or(u32::MAX),
        };
        tenants.forget_if_idle(tenant);
        usage
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Nothing panics while the lock is held, but if something ever did, the state is still
    /// consistent between operations: carry on rather than fail every request after.
    fn lock(&self) -> MutexGuard<'_, Tenants> {
        self.tenants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tenants currently held, for the cleanup tests.
    #[cfg(test)]
    fn tenants_held(&self) -> usize {
        self.lock().entries.len()
    }
}

/// What a reservation costs a window.
fn cost(limit: &WindowLimit, tokens: u64) -> u64 {
    match limit.quantity {
        Quantity::Tokens => tokens,
        Quantity::Requests => 1,
    }
}

fn empty_state(limit: &WindowLimit) -> WindowState {
    WindowState {
        used: 0,
        limit: limit.limit,
        reset_ms: 0,
    }
}

impl Tenants {
    /// The tenant's state, created empty if it holds nothing yet.
    fn state(&mut self, tenant: &str) -> &mut TenantState {
        let i = match self.index.get(tenant) {
            Some(&i) => i,
            None => {
                self.entries
                    .push((tenant.to_owned(), TenantState::default()));
                let i = self.entries.len() - 1;
                self.index.insert(tenant.to_owned(), i);
                i
            }
        };
        &mut self.entries[i].1
    }

    /// Drops `tenant` if it holds nothing (as of its last roll).
    fn forget_if_idle(&mut self, tenant: &str) {
        if let Some(&i) = self.index.get(tenant)
            && self.entries[i].1.is_idle()
        {
            self.remove(i);
        }
    }

    /// Looks at the next few tenants round-robin, dropping those that hold nothing at `now`.
    fn sweep(&mut self, now: u64) {
        for _ in 0..SWEEP_PER_OPERATION {
            if self.entries.is_empty() {
                return;
            }
            if self.cursor >= self.entries.len() {
                self.cursor = 0;
            }
            let state = &mut self.entries[self.cursor].1;
            state.roll(now);
            if state.is_idle() {
                // The last entry moves into the cursor's place: look at it next.
                self.remove(self.cursor);
            } else {
                self.cursor += 1;
            }
        }
    }

    fn remove(&mut self, i: usize) {
        let (tenant, _) = self.entries.swap_remove(i);
        self.index.remove(&tenant);
        if let Some((moved, _)) = self.entries.get(i) {
            self.index.insert(moved.clone(), i);
        }
    }
}

impl TenantState {
    /// Rolls every window to `now` (each with its last-seen limit), forgets the empty ones, and
    /// forgets expired leases.
    fn roll(&mut self, now: u64) {
        self.windows.retain_mut(|window| {
            window.usage.roll(&window.limit, now);
            !window.usage.is_empty()
        });
        self.leases.retain(|_, &mut expiry| expiry > now);
    }

    /// Takes the shapes in `limits` for the windows they name (a reload may have changed
    /// them), so they roll as the request that names them expects.
    fn adopt(&mut self, limits: &[WindowLimit]) {
        for window in &mut self.windows {
            if let Some(limit) = limits.iter().find(|limit| limit.name == window.limit.name)
                && window.limit != *limit
            {
                window.limit = limit.clone();
            }
        }
    }

    fn is_idle(&self) -> bool {
        self.windows.is_empty() && self.leases.is_empty()
    }

    fn usage(&self, name: &str) -> Option<&WindowUsage> {
        self.windows
            .iter()
            .find(|window| window.limit.name == name)
            .map(|window| &window.usage)
    }

    /// The window named by `limit`, created empty if absent (callers `adopt` first).
    fn window_mut(&mut self, limit: &WindowLimit) -> &mut Window {
        let i = match self
            .windows
            .iter()
            .position(|window| window.limit.name == limit.name)
        {
            Some(i) => i,
            None => {
                self.windows.push(Window {
                    limit: limit.clone(),
                    usage: WindowUsage::default(),
                });
                self.windows.len() - 1
            }
        };
        &mut self.windows[i]
    }

    /// The window as a client sees it under `limit` (which may differ from the last-seen one).
    fn window_state(&self, limit: &WindowLimit, now: u64) -> WindowState {
        self.usage(&limit.name)
            .map_or_else(|| empty_state(limit), |usage| usage.state(limit, now))
    }
}

#[cfg(test)]
mod tests;
