//! The fair queue's async face: one global in-flight budget shared by weight, with RAII permits.
//!
//! `fair::FairQueue` decides (pure, no clocks); this module only adds the lock, the wake-ups and
//! the guards. A request either gets a `Permit` at once, waits with a `Ticket`, or is refused
//! because its tenant's queue is full or because the requests already waiting hold as many body
//! bytes as they may. A `Permit` frees its slot exactly once, when dropped, whichever way the
//! request's stream ends; a `Ticket` dropped while queued (client gone, deadline passed,
//! shutdown) gives up its place at once and takes nothing. A `Ticket` also carries its request's
//! body bytes in the queue's count, and gives them back when it drops, however it leaves.

pub mod fair;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::observe::SchedulerGauges;
use fair::{EntryKey, FairQueue, FlowKey, Submit};
pub use fair::{FlowClass, FlowLoad, Headroom, SHARE_SCALE, Share, TenantKey, slots_for_arrivals};

/// The global in-flight budget and the per-tenant queues in front of it.
pub struct Scheduler {
    state: Mutex<State>,
}

struct State {
    fair: FairQueue<oneshot::Sender<Permit>>,
    /// Highest in-flight count since the controller last looked: its demand gate needs to know
    /// whether the budget was used during the tick, not at the instant it ticks.
    peak_in_flight: u32,
    queued_bodies: QueuedBodies,
    /// The deployment's limit: `fair`'s own on a lone replica, the fleet's whole budget when
    /// this replica holds a share of it. Reservations (a percentage) are of this.
    global_limit: u32,
    /// The earliest wake-up armed for a paced request (`fair`, "Pacing a burst").
    pace_wake: Option<Instant>,
}

/// The body bytes that queued requests hold, against a cap. A waiting request keeps its body in
/// memory, and `queue_max` bounds how many wait per tenant, not how large they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QueuedBodies {
    held: usize,
    cap: usize,
}

impl QueuedBodies {
    /// Counts `bytes` more if the total stays within the cap; says whether it did.
    fn try_hold(&mut self, bytes: usize) -> bool {
        match self.held.checked_add(bytes) {
            Some(total) if total <= self.cap => {
                self.held = total;
                true
            }
            _ => false,
        }
    }

    /// Gives back `bytes` that `try_hold` counted.
    fn release(&mut self, bytes: usize) {
        debug_assert!(
            bytes <= self.held,
            "released more body bytes than were held"
        );
        self.held = self.held.saturating_sub(bytes);
    }
}

/// The outcome of asking for a slot.
pub enum Admit {
    /// A slot is free: go.
    Now(Permit),
    /// Wait for a slot with this ticket.
    Queued(Ticket),
    /// The tenant's queue is full.
    Full,
    /// Waiting would take the body bytes held by queued requests over their cap.
    BytesFull,
}

/// The budget's state at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// This replica's slots.
    pub limit: u32,
    /// The deployment's slots (`limit` on a lone replica).
    pub global_limit: u32,
    pub in_flight: u32,
    pub queued: u32,
    /// Body bytes the queued requests hold, against `max_queued_body_bytes`.
    pub queued_body_bytes: usize,
    /// Free slots held for the steady tenants (`fair::Headroom`).
    pub held: u32,
    /// Slots in flight lent: granted beyond their tenant's fair share while it was not steady.
    pub lent: u32,
    /// Slots kept free for tenants the fleet gives all they ask (`fair`, "Standby slots").
    pub standby: u32,
    /// Requests that arrived while their tenant was paced, since start-up (`fair`, "Pacing a
    /// burst").
    pub paced: u64,
    /// Slots released since start-up: streams that ended, whichever way.
    pub released: u64,
}

impl Load {
    /// Requests waiting for want of a slot: all of them while every slot is taken (the standby
    /// slots counted as taken: they are kept from those who wait), none while more are free.
    /// Requests that wait beside other free slots are held back by the headroom (they would
    /// take more than their tenant's fair share); they are not the controller's demand, since
    /// growing the budget for them would hand a burst what the steady tenants need.
    pub fn waiting_for_slot(&self) -> u32 {
        if self.in_flight.saturating_add(self.standby) >= self.limit {
            self.queued
        } else {
            0
        }
    }
}

impl From<Load> for SchedulerGauges {
    fn from(load: Load) -> SchedulerGauges {
        SchedulerGauges {
            limit: load.limit,
            in_flight: load.in_flight,
            queued_body_bytes: load.queued_body_bytes,
            held: load.held,
            lent: load.lent,
            standby: load.standby,
            paced: load.paced,
        }
    }
}

impl Scheduler {
    /// `limit` slots; queued requests may hold at most `max_queued_body_bytes` of bodies;
    /// `headroom` holds slots for the steady tenants (`None`: never).
    pub fn new(
        limit: u32,
        max_queued_body_bytes: usize,
        headroom: Option<Headroom>,
    ) -> Arc<Scheduler> {
        let fair = match headroom {
            Some(headroom) => FairQueue::with_headroom(limit.max(1), headroom),
            None => FairQueue::new(limit.max(1)),
        };
        Arc::new(Scheduler {
            state: Mutex::new(State {
                fair,
                peak_in_flight: 0,
                queued_bodies: QueuedBodies {
                    held: 0,
                    cap: max_queued_body_bytes,
                },
                global_limit: limit.max(1),
                pace_wake: None,
            }),
        })
    }

    /// Asks for a slot for one request of `tenant`, which holds `body_bytes` of body in memory
    /// for as long as it waits (counted only if it has to).
    pub fn submit(
        self: &Arc<Self>,
        tenant: &str,
        class: FlowClass,
        cost: u64,
        body_bytes: usize,
    ) -> Admit {
        let (tx, rx) = oneshot::channel();
        let mut state = self.lock_at_now();
        match state.fair.submit(tenant, class, cost, tx) {
            Submit::Granted(flow) => {
                state.note_in_flight();
                Admit::Now(Permit {
                    scheduler: self.clone(),
                    flow,
                })
            }
            Submit::Queued(entry) => {
                if !state.queued_bodies.try_hold(body_bytes) {
                    // Undone under the same lock, so no slot was dispatched to it meanwhile, and
                    // a cancel leaves the flow's place in line as it was before this submit.
                    let _ = state.fair.cancel(entry);
                    return Admit::BytesFull;
                }
                // With headroom a request joining the queue can make another runnable (a
                // protected flow's queued request is need already here); its permit, if any,
                // arrives through its channel.
                self.dispatch(state);
                Admit::Queued(Ticket {
                    scheduler: self.clone(),
                    entry,
                    rx,
                    body_bytes,
                })
            }
            Submit::Full(_) => Admit::Full,
        }
    }

    /// Resizes the budget. A larger one admits waiting requests at once; a smaller one never
    /// preempts: in-flight requests finish and the count drains below the new limit. 0 admits
    /// nothing until it grows (a fleet member without a share yet); a lone replica's
    /// controller never goes below its floor.
    pub fn set_limit(self: &Arc<Self>, limit: u32) {
        let mut state = self.lock_at_now();
        state.fair.set_limit(limit);
        state.global_limit = limit;
        self.dispatch(state);
    }

    /// This replica's share of a fleet's budget: `limit` slots here out of `global_limit` in
    /// the whole deployment, the fleet's per-tenant overrides (see `fair::Share`), and the
    /// `standby` slots kept for the tenants it gives all they ask. Never preempts, like
    /// `set_limit`.
    pub fn set_share(
        self: &Arc<Self>,
        limit: u32,
        global_limit: u32,
        shares: Option<HashMap<TenantKey, Share>>,
        standby: u32,
    ) {
        let mut state = self.lock_at_now();
        state.fair.set_limit(limit);
        state.fair.set_global_limit(global_limit);
        state.global_limit = global_limit;
        if let Some(shares) = shares {
            state.fair.set_shares(shares);
        }
        state.fair.set_standby(standby);
        self.dispatch(state);
    }

    /// Caps the body bytes queued requests may hold (a reload): those already waiting stay.
    pub fn set_max_queued_body_bytes(&self, cap: usize) {
        self.lock().queued_bodies.cap = cap;
    }

    /// Every tenant with requests waiting or in flight here, and its load: O(tenants), for the
    /// fleet's report, never on a request's path.
    pub fn flows(&self) -> Vec<FlowLoad> {
        self.lock().fair.flows()
    }

    pub fn load(&self) -> Load {
        let state = self.lock();
        Load {
            limit: state.fair.limit(),
            global_limit: state.global_limit,
            in_flight: state.fair.in_flight(),
            queued: state.fair.queued(),
            queued_body_bytes: state.queued_bodies.held,
            held: state.fair.held(),
            lent: state.fair.lent(),
            standby: state.fair.standby(),
            paced: state.fair.paced(),
            released: state.fair.released(),
        }
    }

    /// The highest in-flight count since the last call; starts the next period at the current
    /// count.
    pub fn take_peak_in_flight(&self) -> u32 {
        let mut state = self.lock();
        let current = state.fair.in_flight();
        std::mem::replace(&mut state.peak_in_flight, current).max(current)
    }

    fn release(self: &Arc<Self>, flow: FlowKey) {
        let mut state = self.lock_at_now();
        state.fair.release(flow);
        self.dispatch(state);
    }

    /// A ticket's request left the queue, whichever way: its place (if it still had one) and
    /// its body bytes are given back.
    fn leave_queue(self: &Arc<Self>, entry: EntryKey, body_bytes: usize) {
        let mut state = self.lock_at_now();
        // The returned sender (if the entry was still queued) is dropped here: nothing was taken.
        let _ = state.fair.cancel(entry);
        state.queued_bodies.release(body_bytes);
        // With headroom, slots may be free while requests wait; time has passed and the flow
        // that left may have been what held them.
        self.dispatch(state);
    }

    /// Hands free slots to waiting requests, outside the lock; if what waits beside free slots
    /// is paced, wakes up when it may start.
    fn dispatch(self: &Arc<Self>, mut state: MutexGuard<'_, State>) {
        let mut granted = Vec::new();
        while let Some((flow, waiter)) = state.fair.dispatch_next() {
            state.note_in_flight();
            granted.push((flow, waiter));
        }
        // A wake-up already due is no reason to skip another (it may be a task that will never
        // run: its runtime is shutting down). Recorded only where a timer can be armed: one
        // recorded but never armed would keep every later one from being armed.
        let wake = state
            .fair
            .next_pace_at()
            .filter(|at| {
                state
                    .pace_wake
                    .is_none_or(|armed| *at < armed || armed <= Instant::now())
            })
            .and_then(|at| Some((at, tokio::runtime::Handle::try_current().ok()?)));
        if let Some((at, _)) = wake {
            state.pace_wake = Some(at);
        }
        drop(state);
        if let Some((at, runtime)) = wake {
            self.wake_at(&runtime, at);
        }
        for (flow, waiter) in granted {
            let permit = Permit {
                scheduler: self.clone(),
                flow,
            };
            // If the waiter gave up in the meantime, the permit comes back and drops here,
            // releasing the slot (and dispatching the next request) exactly once.
            let _ = waiter.send(permit);
        }
    }

    /// Dispatches at `at`, when a paced request may start. An earlier event may dispatch it
    /// first; the wake-up then finds nothing to do. Holds the scheduler weakly, so a wake-up
    /// outliving it is a no-op. (Outside a runtime none is armed, and a paced request waits
    /// for the next event; tollgate's scheduler always runs in one.)
    fn wake_at(self: &Arc<Self>, runtime: &tokio::runtime::Handle, at: Instant) {
        let scheduler = Arc::downgrade(self);
        runtime.spawn(async move {
            tokio::time::sleep_until(at).await;
            if let Some(scheduler) = scheduler.upgrade() {
                let mut state = scheduler.lock_at_now();
                if state.pace_wake == Some(at) {
                    state.pace_wake = None;
                }
                scheduler.dispatch(state);
            }
        });
    }

    /// The lock, with the fair queue's clock moved to now (its headroom decays with time).
    fn lock_at_now(&self) -> MutexGuard<'_, State> {
        let mut state = self.lock();
        state.fair.advance(Instant::now());
        state
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the queue half-updated in a way that
        // matters more than stopping admission for good would; keep serving.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl State {
    fn note_in_flight(&mut self) {
        self.peak_in_flight = self.peak_in_flight.max(self.fair.in_flight());
    }
}

/// One slot of the global budget; freed when dropped.
pub struct Permit {
    scheduler: Arc<Scheduler>,
    flow: FlowKey,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.scheduler.release(self.flow);
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

/// A place in a tenant's queue; given up when dropped before its slot arrives. Its body bytes
/// count against the queue's cap until it drops, granted or not.
pub struct Ticket {
    scheduler: Arc<Scheduler>,
    entry: EntryKey,
    rx: oneshot::Receiver<Permit>,
    body_bytes: usize,
}

impl Ticket {
    /// Waits for the slot. Cancel-safe: dropping the future (or the ticket) gives the place up.
    pub async fn granted(&mut self) -> Permit {
        match (&mut self.rx).await {
            Ok(permit) => permit,
            // The sender lives in the queue until it is used or this ticket cancels it, so it
            // cannot be dropped while the ticket waits; never resolve if it somehow was.
            Err(_) => std::future::pending().await,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.scheduler.leave_queue(self.entry, self.body_bytes);
        // A permit sent after the cancel lost the race drops with `rx`, releasing its slot.
    }
}

#[cfg(test)]
mod tests;
