//! The pure core of the fair queue: one global budget of in-flight slots, one FIFO queue per
//! tenant (a *flow*), and the rule that picks which queued request gets the next free slot.
//!
//! Nothing here is async, reads a clock, locks or does I/O: `super` (the async facade) holds
//! this behind a mutex and turns dispatches into wake-ups. Every decision is a function of the
//! calls made so far, so the tests replay exact dispatch orders.
//!
//! # The budget
//!
//! `limit` slots may be in flight upstream. The scheduler is work-conserving: a request runs at
//! once when a slot is free and nobody is waiting, so a lone tenant can use the whole budget.
//! Otherwise it joins its tenant's queue, or is refused (`Submit::Full`) when that queue
//! already holds its class's `queue_max` requests. `set_limit` never preempts: lowering the
//! limit only stops dispatching until enough slots are released.
//!
//! # Who gets the next free slot
//!
//! 1. **Reservations.** A flow holding fewer slots than its class's `reserved_slots`, with a
//!    request waiting, goes first, whatever its band. A reservation is a promise ("at least this
//!    share of the budget while you have demand"); a priority band is only an ordering, so the
//!    promise wins. Reservations never preempt: a reserved flow gets the *next* free slot. If
//!    configured reservations add up to more than the limit, the reserved flows compete among
//!    themselves by band, then by the fair order below.
//! 2. **Bands.** Strict priority: band 0 is served while it has waiting requests, then band 1,
//!    and so on. A lower band can starve while a higher one is backlogged; that is the point.
//! 3. **Weighted fair order within a band**: start-time fair queueing (SFQ, Goyal et al.)
//!    with lazily assigned tags. Each flow keeps `finish`, the virtual finish time of its last
//!    dispatched request. When a request becomes the head of its flow it gets the start tag
//!    `max(V, finish)`, where `V` is the band's virtual time (the start tag of the last request
//!    the band dispatched in fair order). The head with the smallest start tag runs next (ties:
//!    earliest arrival), then `V = start` and `finish = start + cost / weight`.
//!
//! Why SFQ rather than deficit round robin: it is exact for any mix of costs and weights (DRR
//! needs a quantum at least as large as the largest cost to stay O(1), and is bursty at one
//! quantum per round), it needs no round state, and one ordered set keyed by start tag gives
//! the next flow in O(log F). The `max(V, ..)` is what keeps it work-conserving without
//! rewarding idleness: a flow that was idle restarts at the present, it does not bank credit
//! and then burst. Tags are assigned when a request becomes its flow's head rather than on
//! arrival, so a flow's queued requests need no tags and a cancelled request never leaves a tag
//! behind.
//!
//! Reserved slots are outside the fair competition: a dispatch (or an immediate grant) that
//! fills a reservation moves neither the flow's `finish` nor `V`. The reservation is a floor,
//! not an addition: a flow below it is topped up first; at or above it, it competes for the
//! rest by weight like any flow. In steady state a reserved flow holds its weighted share when
//! that is larger (the reservation never binds), and a little more than its reservation
//! otherwise (under a flood, 4 reserved of 10 at weight 1 against weight 3 holds about 4.5).
//! Charging reserved dispatches to the fair tag instead would let the tag run ahead of `V`
//! without bound whenever the reservation exceeds the weighted share, and the flow would then be
//! starved of unreserved slots long after the load that caused it had gone.
//!
//! A request granted at once (nobody waiting) outside a reservation is charged like a fair
//! dispatch, so `V` keeps pace with what actually ran and a flow that used the idle budget does
//! not carry the debt into the next busy period beyond its last request.
//!
//! # Cost
//!
//! `cost` is 1 for request-fair scheduling or the estimated tokens for token-fair scheduling:
//! over time backlogged flows get equal `cost / weight`, so with token costs a tenant sending
//! large prompts gets fewer requests, not more tokens. A cost of 0 counts as 1 (and so does a
//! weight of 0), so every dispatch advances its flow's tag.
//!
//! # Integer virtual time
//!
//! Tags are `u128` fixed point: a request is charged `cost * SCALE / weight`, with `SCALE` =
//! 720,720 × 2^32 and the weight in `SHARE_SCALE`ths (1024, a power of two, so the fleet's
//! per-replica shares can split a tier's weight finely), so the charge is exact for every tier
//! weight up to 16 (720,720 = lcm(1..=16)) and has 22 fractional bits for the rest. With floats, tags would lose precision as virtual time
//! grows (an f64 has 53 bits, so after some billions of token-weighted dispatches small costs
//! would stop advancing tags) and ties would depend on rounding; integers make the order exact
//! and reproducible. A `u128` holds 2^56 dispatches of a million tokens at weight 1 (over
//! 2,000 years at a million dispatches a second); tags saturate rather than wrap beyond that.
//!
//! # Flows come and go
//!
//! A flow record exists while it has queued requests or slots in flight and is removed when it
//! has neither, so idle tenants cost nothing. Its fairness history (`finish`) goes with it: a
//! returning tenant starts at the band's present `V`. That can only forgive a flow whose tag was
//! ahead of `V` (one that had recently received more than its share), and only after it held
//! no slot at all, so the gain is bounded by what it gave up by going fully idle.
//!
//! The class passed with the newest `submit` of a tenant applies to the whole flow, including
//! requests already queued: `queue_max` for admission (a smaller one refuses new requests until
//! the queue drains, it evicts nothing), `weight` for the next charges, `reserved_slots` for
//! eligibility. A flow moving to another band restarts at that band's `V`, since virtual times
//! of different bands are unrelated.
//!
//! # Complexity
//!
//! Every operation is O(log F), F the number of flows with waiting requests: one `HashMap`
//! lookup by tenant name (lookup only: no result depends on its iteration order), O(1) list
//! surgery in a slab of entries (an intrusive doubly linked list per flow, so a cancel from the
//! middle of a queue is O(1)), and at most one remove and one insert in a `BTreeSet` holding
//! each backlogged flow's head (and, on a fleet member, when a tenant's flow appears, one
//! SHA-256 of its name: the key the fleet knows it by). Nothing on a request's path scans queues or tenants; `flows` and
//! `set_shares`, the fleet's, are O(F) a few times a second. Memory is O(peak queued + peak
//! flows): slab slots are reused, not returned.
//!
//! Handles (`FlowKey`, `EntryKey`) carry a generation, so a handle whose slot was reused is a
//! harmless no-op (a generation wraps only after 2^32 reuses of the same slot).

use std::collections::{BTreeSet, HashMap};
use std::fmt;

#[cfg(test)]
mod tests;

/// How a tenant's requests are treated. Comes from the tenant's tier (or override) in the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowClass {
    /// Share of the unreserved budget relative to other flows of the same band (>= 1; 0 counts
    /// as 1).
    pub weight: u32,
    /// Strict priority: 0 is served first.
    pub band: u8,
    /// Requests that may wait in this tenant's queue; 0 means never queue (refuse when no slot
    /// is free at once).
    pub queue_max: u32,
    /// Slots this tenant gets before any unreserved dispatch while it has demand.
    pub reserved_slots: u32,
}

/// Identifies a flow while it has slots in flight (valid from grant to release).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    index: u32,
    generation: u32,
}

/// Identifies a queued request; stale after dispatch or cancel (then operations on it are
/// no-ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryKey {
    index: u32,
    generation: u32,
}

/// The outcome of `FairQueue::submit`.
#[derive(Debug)]
pub enum Submit<T> {
    /// A slot was free and nobody was waiting: the request holds a slot now. The payload is
    /// dropped, since nobody needs to be woken.
    Granted(FlowKey),
    /// The request waits; `dispatch_next` will hand its payload back when its turn comes.
    Queued(EntryKey),
    /// The tenant's queue is full; the payload is handed back and nothing was taken.
    Full(T),
}

/// Fixed-point scale of virtual time: 32 fractional bits, times lcm(1..=16) so that `cost *
/// SCALE / weight` is exact for every weight up to 16 (and every divisor of 720,720). Rounding
/// would otherwise decide ties: three charges of 1/3 rounded down fall just short of 1 and win
/// a tie they should lose to the earlier arrival.
const SCALE: u128 = 720_720 << 32;
/// Bands are a `u8`, so per-band state is a fixed array indexed by band.
const BANDS: usize = u8::MAX as usize + 1;
/// "No entry" in the intrusive lists.
const NIL: u32 = u32::MAX;

/// The per-tenant queues in front of one global slot budget. See the module documentation.
pub struct FairQueue<T> {
    limit: u32,
    in_flight: u32,
    queued: u32,
    queued_by_band: Box<[u32; BANDS]>,
    /// Per band: the start tag of the last request dispatched in fair order.
    virtual_time: Box<[u128; BANDS]>,
    entries: Vec<EntrySlot<T>>,
    /// Head of the list of vacant entry slots, threaded through `Slot::Vacant`.
    free_entry: u32,
    flows: Vec<FlowSlot>,
    free_flows: Vec<u32>,
    by_name: HashMap<Box<str>, u32>,
    /// One key per flow with waiting requests: its head's place in line. The first key is the
    /// next dispatch.
    order: BTreeSet<OrderKey>,
    /// Arrival counter, for "earliest arrival first" among equal tags.
    next_seq: u64,
    /// The fleet's per-tenant overrides (`set_shares`); empty on a lone replica.
    shares: HashMap<TenantKey, Share>,
    /// Set by the fleet's first `flows` or `set_shares`: new flows get their key at once.
    keyed: bool,
}

/// A tenant's name as the fleet knows it: the first 8 bytes of SHA-256 of the name, the same in
/// every replica and process (a `HashMap`'s hasher is seeded per process). Replicas exchange
/// these, not names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantKey(pub u64);

impl TenantKey {
    pub fn of(tenant: &str) -> TenantKey {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(tenant.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        TenantKey(u64::from_be_bytes(first))
    }
}

/// The fleet's override of a flow's weight and reservation on this replica, so that a tenant
/// present here and elsewhere gets here what the fleet allotted it here (see `crate::fleet`):
/// the weight is the tier's weight times the part of the tenant's demand that is here, in
/// `SHARE_SCALE`ths.
/// A share's weight of `SHARE_SCALE` × w is a tier weight of w with all its demand here. A
/// power of two, so charges stay exact for every tier weight up to 16 (the 2^32 of `SCALE`
/// absorbs it), with 10 bits for the fleet's finer splits.
pub const SHARE_SCALE: u32 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub weight: u32,
    pub reserved_slots: u32,
}

/// One flow's load, as `FairQueue::flows` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowLoad {
    pub tenant: TenantKey,
    /// As submitted (the policy's), not as overridden by a share.
    pub class: FlowClass,
    pub in_flight: u32,
    pub queued: u32,
    /// The mean cost of the requests the flow was submitted (1 with request costs), at least 1.
    pub mean_cost: u64,
}

struct EntrySlot<T> {
    generation: u32,
    slot: Slot<T>,
}

enum Slot<T> {
    Occupied(Entry<T>),
    Vacant { next_free: u32 },
}

struct Entry<T> {
    flow: u32,
    prev: u32,
    next: u32,
    cost: u64,
    seq: u64,
    payload: T,
}

struct FlowSlot {
    generation: u32,
    flow: Option<Flow>,
}

struct Flow {
    name: Box<str>,
    /// `TenantKey::of(name)`, once the fleet has asked for keys (`keyed`): computed when the
    /// flow appears, so the fleet's report and `set_shares` hash only flows older than that
    /// while they hold the scheduler's lock, and a lone replica never hashes at all.
    key: Option<TenantKey>,
    /// As submitted: what the tenant's policy says.
    class: FlowClass,
    /// The fleet's override of `class.weight` and `class.reserved_slots`, if any (see
    /// `set_shares`).
    share: Option<Share>,
    /// The cost of every request submitted to this flow while it lived, and how many: the
    /// fleet divides its budget by cost as the fair order does (`FlowLoad::mean_cost`).
    submitted_cost: u128,
    submitted: u64,
    head: u32,
    tail: u32,
    queued: u32,
    in_flight: u32,
    /// Virtual finish time of the last request charged to this flow.
    finish: u128,
    /// Start tag of the head request; meaningful while `queued > 0`.
    head_start: u128,
    /// This flow's key in `FairQueue::order`, present iff `queued > 0`.
    order: Option<OrderKey>,
}

/// Which dispatch rule applies to a backlogged flow. Declaration order is dispatch order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Lane {
    /// Holds fewer slots than its reservation.
    Reserved,
    /// Competes by band and fair order.
    Fair,
}

/// A backlogged flow's place in line; field order is the dispatch order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct OrderKey {
    lane: Lane,
    band: u8,
    start: u128,
    /// Arrival of the head request; unique, so keys never collide.
    seq: u64,
    flow: u32,
}

impl Flow {
    /// In `SHARE_SCALE`ths, always: a flow without a share weighs its class's weight as if its
    /// whole demand were here. Always, and not only while the fleet's shares are in force, so
    /// that a flow's last charge (its `finish`) is in the same unit before and after shares
    /// arrive: charged at an unscaled weight of 1 and then competing against scaled ones, it
    /// would wait a hundred-odd dispatches of its peers for one request.
    fn weight(&self) -> u32 {
        match self.share {
            Some(share) => share.weight,
            None => self.class.weight.max(1).saturating_mul(SHARE_SCALE),
        }
    }

    fn note_submitted(&mut self, cost: u64) {
        self.submitted_cost = self.submitted_cost.saturating_add(u128::from(cost.max(1)));
        self.submitted = self.submitted.saturating_add(1);
    }

    fn reserved_slots(&self) -> u32 {
        self.share
            .map_or(self.class.reserved_slots, |share| share.reserved_slots)
    }

    fn lane(&self) -> Lane {
        if self.in_flight < self.reserved_slots() {
            Lane::Reserved
        } else {
            Lane::Fair
        }
    }
}

/// Virtual time one request of `cost` takes from a flow of `weight`; at least 1, so tags always
/// advance.
fn charge(cost: u64, weight: u32) -> u128 {
    u128::from(cost.max(1)) * SCALE / u128::from(weight.max(1))
}

impl<T> FairQueue<T> {
    /// A scheduler with `limit` slots (at least 1).
    pub fn new(limit: u32) -> Self {
        FairQueue {
            limit: limit.max(1),
            in_flight: 0,
            queued: 0,
            queued_by_band: Box::new([0; BANDS]),
            virtual_time: Box::new([0; BANDS]),
            entries: Vec::new(),
            free_entry: NIL,
            flows: Vec::new(),
            free_flows: Vec::new(),
            by_name: HashMap::new(),
            order: BTreeSet::new(),
            next_seq: 0,
            shares: HashMap::new(),
            keyed: false,
        }
    }

    /// Every flow (tenant with requests waiting or in flight) and its load: O(F), for the
    /// fleet's report, never on a request's path.
    pub fn flows(&mut self) -> Vec<FlowLoad> {
        self.key_flows();
        self.flows
            .iter()
            .filter_map(|slot| slot.flow.as_ref())
            .map(|flow| FlowLoad {
                // Always set by `key_flows` just above.
                tenant: flow.key.unwrap_or_else(|| TenantKey::of(&flow.name)),
                class: flow.class,
                in_flight: flow.in_flight,
                queued: flow.queued,
                mean_cost: u64::try_from(flow.submitted_cost / u128::from(flow.submitted.max(1)))
                    .unwrap_or(u64::MAX)
                    .max(1),
            })
            .collect()
    }

    /// From now on flows carry their `TenantKey`; the ones that do not yet get it now.
    fn key_flows(&mut self) {
        self.keyed = true;
        for flow in self.flows.iter_mut().filter_map(|slot| slot.flow.as_mut()) {
            if flow.key.is_none() {
                flow.key = Some(TenantKey::of(&flow.name));
            }
        }
    }

    /// Replaces the fleet's overrides: flows of tenants named in `shares` take its weight and
    /// reservation instead of their class's, now and when they next arrive; others go back to
    /// their class. O(F log F), never on a request's path.
    pub fn set_shares(&mut self, shares: HashMap<TenantKey, Share>) {
        self.shares = shares;
        self.key_flows();
        for index in 0..self.flows.len() as u32 {
            let Some(flow) = self.flows[index as usize].flow.as_ref() else {
                continue;
            };
            let share = if self.shares.is_empty() {
                None
            } else {
                flow.key.and_then(|key| self.shares.get(&key).copied())
            };
            if flow.share == share {
                continue;
            }
            let waiting = flow.queued;
            self.flow_mut(index).share = share;
            if waiting > 0 {
                // The reservation decides the lane, which is part of the key.
                self.rekey(index);
            }
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Changes the budget. A larger limit lets the caller dispatch more at once; a smaller one
    /// preempts nothing: `dispatch_next` waits until `in_flight` drops below it. 0 admits
    /// nothing (a fleet member the leader has not granted a share yet).
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    /// Slots granted and not yet released. May exceed `limit` after the limit was lowered.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Requests waiting, all flows.
    pub fn queued(&self) -> u32 {
        self.queued
    }

    /// Requests waiting in flows of `band`.
    pub fn queued_in_band(&self, band: u8) -> u32 {
        self.queued_by_band[usize::from(band)]
    }

    /// Tenants with requests waiting or slots in flight (every other tenant is forgotten).
    pub fn flow_count(&self) -> usize {
        self.by_name.len()
    }

    /// Asks for a slot for one request of `tenant`. `cost` is what the request is charged in
    /// the fair order (1 per request, or its estimated tokens); `class` is the tenant's newest
    /// class and applies to its whole flow.
    ///
    /// `Granted` iff a slot is free and nothing waits anywhere. A `Queued` answer while slots
    /// are free means the caller still owes `dispatch_next` calls after a `release` or
    /// `set_limit`.
    pub fn submit(&mut self, tenant: &str, class: FlowClass, cost: u64, payload: T) -> Submit<T> {
        let existing = self.by_name.get(tenant).copied();
        if let Some(index) = existing {
            self.apply_class(index, class);
        }

        if self.in_flight < self.limit && self.queued == 0 {
            let index = existing.unwrap_or_else(|| self.insert_flow(tenant, class));
            self.flow_mut(index).note_submitted(cost);
            let flow = self.flow(index);
            let start = self.virtual_time[usize::from(flow.class.band)].max(flow.finish);
            self.take_slot(index, start, cost);
            return Submit::Granted(self.flow_key(index));
        }

        let waiting = existing.map_or(0, |index| self.flow(index).queued);
        if waiting >= class.queue_max {
            return Submit::Full(payload);
        }
        let index = existing.unwrap_or_else(|| self.insert_flow(tenant, class));
        self.flow_mut(index).note_submitted(cost);
        Submit::Queued(self.push_entry(index, cost, payload))
    }

    /// The next queued request to run, if a slot is free: its flow now holds one more slot.
    pub fn dispatch_next(&mut self) -> Option<(FlowKey, T)> {
        if self.in_flight >= self.limit {
            return None;
        }
        let key = self.order.pop_first()?;
        let index = key.flow;
        let head = {
            let flow = self.flow_mut(index);
            flow.order = None;
            flow.head
        };
        let entry = self.unlink(head);
        debug_assert_eq!(
            key.lane,
            self.flow(index).lane(),
            "keys are refreshed on every change"
        );
        self.take_slot(index, key.start, entry.cost);

        let band = usize::from(self.flow(index).class.band);
        let now = self.virtual_time[band];
        let flow = self.flow_mut(index);
        if flow.queued > 0 {
            // The next request becomes the head: it gets its start tag now (lazy tagging).
            flow.head_start = now.max(flow.finish);
            self.rekey(index);
        }
        Some((self.flow_key(index), entry.payload))
    }

    /// A slot held by `flow` is free again. Does not dispatch: the caller calls `dispatch_next`.
    /// A stale key (its flow holds no slot, or is gone) is a no-op. The key names the flow, not
    /// the grant: all slots of a flow share it, so the caller must release each grant exactly
    /// once (the facade's `Permit` does).
    pub fn release(&mut self, flow: FlowKey) {
        let Some(record) = self.live_flow_mut(flow) else {
            return;
        };
        if record.in_flight == 0 {
            return;
        }
        let lane_before = record.lane();
        record.in_flight -= 1;
        let lane_after = record.lane();
        let waiting = record.queued;
        self.in_flight -= 1;
        if waiting > 0 {
            if lane_before != lane_after {
                self.rekey(flow.index);
            }
        } else {
            self.remove_flow_if_idle(flow.index);
        }
    }

    /// Removes a queued request; returns its payload if it was still queued. The request
    /// consumed nothing, and its flow keeps its place in line.
    pub fn cancel(&mut self, entry: EntryKey) -> Option<T> {
        let slot = self.entries.get(entry.index as usize)?;
        let Slot::Occupied(queued) = &slot.slot else {
            return None;
        };
        if slot.generation != entry.generation {
            return None;
        }
        let index = queued.flow;
        let was_head = self.flow(index).head == entry.index;
        let removed = self.unlink(entry.index);
        if was_head {
            // The next request inherits the head's start tag: the flow waited in line and a
            // cancel must not send it to the back.
            self.rekey(index);
        }
        self.remove_flow_if_idle(index);
        Some(removed.payload)
    }

    fn flow_key(&self, index: u32) -> FlowKey {
        FlowKey {
            index,
            generation: self.flows[index as usize].generation,
        }
    }

    fn flow(&self, index: u32) -> &Flow {
        self.flows[index as usize]
            .flow
            .as_ref()
            .expect("flow indices held internally always point at live flows")
    }

    fn flow_mut(&mut self, index: u32) -> &mut Flow {
        self.flows[index as usize]
            .flow
            .as_mut()
            .expect("flow indices held internally always point at live flows")
    }

    fn live_flow_mut(&mut self, key: FlowKey) -> Option<&mut Flow> {
        let slot = self.flows.get_mut(key.index as usize)?;
        if slot.generation != key.generation {
            return None;
        }
        slot.flow.as_mut()
    }

    fn insert_flow(&mut self, tenant: &str, class: FlowClass) -> u32 {
        let key = self.keyed.then(|| TenantKey::of(tenant));
        let share = key.and_then(|key| self.shares.get(&key).copied());
        let flow = Flow {
            name: tenant.into(),
            key,
            class,
            share,
            submitted_cost: 0,
            submitted: 0,
            head: NIL,
            tail: NIL,
            queued: 0,
            in_flight: 0,
            finish: 0,
            head_start: 0,
            order: None,
        };
        let index = match self.free_flows.pop() {
            Some(index) => {
                self.flows[index as usize].flow = Some(flow);
                index
            }
            None => {
                let index = u32::try_from(self.flows.len())
                    .expect("fewer than 2^32 tenants are active at once");
                self.flows.push(FlowSlot {
                    generation: 0,
                    flow: Some(flow),
                });
                index
            }
        };
        self.by_name.insert(tenant.into(), index);
        index
    }

    fn remove_flow_if_idle(&mut self, index: u32) {
        let slot = &mut self.flows[index as usize];
        let idle = slot
            .flow
            .as_ref()
            .is_some_and(|flow| flow.queued == 0 && flow.in_flight == 0);
        if !idle {
            return;
        }
        let flow = slot.flow.take().expect("checked live just above");
        debug_assert!(
            flow.order.is_none(),
            "a flow with nothing queued has no key"
        );
        slot.generation = slot.generation.wrapping_add(1);
        self.by_name.remove(&flow.name);
        self.free_flows.push(index);
    }

    /// Applies the tenant's newest class to its flow (see "Flows come and go").
    fn apply_class(&mut self, index: u32, class: FlowClass) {
        let flow = self.flow(index);
        let old = flow.class;
        if old == class {
            return;
        }
        let waiting = flow.queued;
        let new_band_time = self.virtual_time[usize::from(class.band)];
        let flow = self.flow_mut(index);
        flow.class = class;
        if old.band != class.band {
            // Virtual times of different bands are unrelated: restart at the new band's present.
            flow.finish = 0;
            flow.head_start = new_band_time;
            self.queued_by_band[usize::from(old.band)] -= waiting;
            self.queued_by_band[usize::from(class.band)] += waiting;
        }
        if waiting > 0 {
            self.rekey(index);
        }
    }

    /// Gives `index` one slot for a request whose start tag is `start`, charging the fair order
    /// unless the slot fills a reservation.
    fn take_slot(&mut self, index: u32, start: u128, cost: u64) {
        let flow = self.flow(index);
        let band = usize::from(flow.class.band);
        let lane = flow.lane();
        if lane == Lane::Fair {
            let time = &mut self.virtual_time[band];
            *time = (*time).max(start);
        }
        let flow = self.flow_mut(index);
        if lane == Lane::Fair {
            flow.finish = start.saturating_add(charge(cost, flow.weight()));
        }
        flow.in_flight += 1;
        self.in_flight += 1;
    }

    /// Appends a request to the flow's queue; a request that becomes the head gets its start tag.
    fn push_entry(&mut self, index: u32, cost: u64, payload: T) -> EntryKey {
        let seq = self.next_seq;
        self.next_seq += 1;
        let tail = self.flow(index).tail;
        let entry = Entry {
            flow: index,
            prev: tail,
            next: NIL,
            cost,
            seq,
            payload,
        };
        let slot = match self.free_entry {
            NIL => {
                let slot = u32::try_from(self.entries.len())
                    .ok()
                    .filter(|&slot| slot != NIL)
                    .expect("fewer than 2^32 - 1 requests are queued at once");
                self.entries.push(EntrySlot {
                    generation: 0,
                    slot: Slot::Occupied(entry),
                });
                slot
            }
            slot => {
                let vacant = &mut self.entries[slot as usize];
                let Slot::Vacant { next_free } = vacant.slot else {
                    unreachable!("the free list threads vacant slots only");
                };
                self.free_entry = next_free;
                vacant.slot = Slot::Occupied(entry);
                slot
            }
        };
        if tail != NIL {
            self.entry_mut(tail).next = slot;
        }

        let band = usize::from(self.flow(index).class.band);
        let now = self.virtual_time[band];
        let flow = self.flow_mut(index);
        flow.tail = slot;
        flow.queued += 1;
        let became_head = flow.head == NIL;
        if became_head {
            flow.head = slot;
            flow.head_start = now.max(flow.finish);
        }
        self.queued += 1;
        self.queued_by_band[band] += 1;
        if became_head {
            self.rekey(index);
        }
        EntryKey {
            index: slot,
            generation: self.entries[slot as usize].generation,
        }
    }

    fn entry(&self, slot: u32) -> &Entry<T> {
        match &self.entries[slot as usize].slot {
            Slot::Occupied(entry) => entry,
            Slot::Vacant { .. } => unreachable!("list links point at occupied slots only"),
        }
    }

    fn entry_mut(&mut self, slot: u32) -> &mut Entry<T> {
        match &mut self.entries[slot as usize].slot {
            Slot::Occupied(entry) => entry,
            Slot::Vacant { .. } => unreachable!("list links point at occupied slots only"),
        }
    }

    /// Takes an occupied entry out of its flow's list, frees its slot and counts it out of the
    /// queue. The caller re-keys the flow if the head changed.
    fn unlink(&mut self, slot: u32) -> Entry<T> {
        let vacant = Slot::Vacant {
            next_free: self.free_entry,
        };
        let taken = &mut self.entries[slot as usize];
        let Slot::Occupied(entry) = std::mem::replace(&mut taken.slot, vacant) else {
            unreachable!("callers unlink occupied slots only");
        };
        // Stale keys to this slot must not match whatever is stored here next.
        taken.generation = taken.generation.wrapping_add(1);
        self.free_entry = slot;

        if entry.prev != NIL {
            self.entry_mut(entry.prev).next = entry.next;
        }
        if entry.next != NIL {
            self.entry_mut(entry.next).prev = entry.prev;
        }
        let flow = self.flow_mut(entry.flow);
        if flow.head == slot {
            flow.head = entry.next;
        }
        if flow.tail == slot {
            flow.tail = entry.prev;
        }
        flow.queued -= 1;
        let band = usize::from(flow.class.band);
        self.queued -= 1;
        self.queued_by_band[band] -= 1;
        entry
    }

    /// Puts the flow's key in `order` in line with its state: removed, then re-inserted if it
    /// has a head.
    fn rekey(&mut self, index: u32) {
        let flow = self.flow(index);
        let old = flow.order;
        let new = (flow.queued > 0).then(|| OrderKey {
            lane: flow.lane(),
            band: flow.class.band,
            start: flow.head_start,
            seq: self.entry(flow.head).seq,
            flow: index,
        });
        if let Some(old) = old {
            self.order.remove(&old);
        }
        if let Some(new) = new {
            self.order.insert(new);
        }
        self.flow_mut(index).order = new;
    }
}

impl<T> fmt::Debug for FairQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueue")
            .field("limit", &self.limit)
            .field("in_flight", &self.in_flight)
            .field("queued", &self.queued)
            .field("flows", &self.by_name.len())
            .finish_non_exhaustive()
    }
}
