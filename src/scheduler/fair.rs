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
//! # Headroom: isolation without caps
//!
//! A slot is held for a whole stream (seconds), and the budget is work-conserving, so without
//! more a burst takes every free slot the moment it arrives and a steady tenant's next request
//! waits for a completion: the fair order decides *who* gets a freed slot, not *when* one frees.
//! With `Headroom` set, a flow may take a slot beyond its **fair share** (its weight's share of
//! the limit among the flows present: `in_flight × Σ weights > limit × weight`) only while more
//! slots stay free than the **protected flows** are expected to need. What they need is
//! learned, not set: each flow keeps an exponentially weighted mean of its slots in flight
//! (time constant `Headroom::window`: arrival rate × hold time, Little's law), and the protected
//! flows together are expected to use up to `M + sigmas × √M` slots, `M` the sum of their means
//! (a Poisson-like count's spread). What they hold or have queued is subtracted; the rest is
//! held free, but never more than their **arrivals until releases refill the slots** need: a
//! slot a protected flow takes is given back by the next release (held slots are not lent), so
//! the free slots are an M/M/1/k queue with `ρ = M / in_flight` of their arrivals per release
//! (Little's law, the same hold for all), and `slots_for_arrivals` holds the fewest that their
//! requests find all taken no more often than the spread's own tail, `Φ(-sigmas)` (0.13 % at
//! 3; `sigmas` itself, not a fleet member's scaled margin: the miss is per request, and each
//! replica's arrivals and releases are its own). This assumes the protected flows hold their
//! slots about as long as the others do: behind streams longer than theirs, releases come
//! less often than `in_flight / hold` says, and fewer slots are held than the miss needs.
//! The spread decides while few releases come per arrival; the arrivals decide while many
//! slots turn over for few protected requests (seed 001's sweep: 6 slots instead of the 20 of
//! A's spread, which sat free while B was backlogged and cost 2-3 % of its goodput). A
//! flow is protected when, as of its last event, it is not itself bursting (not above its own
//! mean's `M + sigmas × √M`), was not held back within the last `window`, and is within its
//! fair share or steady (below): a burst's slots, even within its fair share, must not offset
//! what the steady flows are about to need, nor its mean linger in the sum once it ends.
//! A **steady** flow (nothing queued, its next slot within its own usual load, and not held
//! back by the headroom within the last `window`) is never lent to, even beyond its weight's
//! share: a tenant whose everyday load is more than that share is still a steady tenant, and
//! holding it back with the burst is what a cap would do. Once it queues, it competes by
//! weight like the others; once the headroom holds it back, it is a burst for a window.
//!
//! - **Work-conserving otherwise.** A lone tenant, or tenants all above their fair share, or
//!   protected tenants holding their usual load, leave nothing held beyond the spread (and
//!   no more than their arrivals until the next releases need), and a flow
//!   whose next slot stays within its fair share is never held back (a protected flow about to
//!   go beyond its own is held back like any other). Held slots go to a protected flow at once.
//! - **Bands.** A flow is held back only by the protected flows of its own band and the bands
//!   above it: a higher band may take what a lower band's steady tenants would need.
//! - **Reservations.** A flow below its reservation is never held back.
//! - **It decays.** A tenant that goes quiet stops being protected as its mean decays (its
//!   contribution stays in the band's sum after its flow record is gone, decaying the same way).
//! - **Lent slots.** A slot granted beyond the flow's fair share to a flow that is not steady
//!   counts as *lent* until it is released (`lent`); `held` is what is kept free for the protected flows at this instant.
//! - **Dispatch.** If the fair order's next flow is held back, the backlogged flow holding the
//!   fewest slots per weight runs instead when it may; otherwise the slot stays free (with
//!   pacing, after a bounded look past paced flows: "Pacing a burst").
//!
//! # Pacing a burst
//!
//! The headroom bounds how many slots a burst takes, not how fast: within its fair share a
//! burst of 30 requests a second took 16 slots in 0.45 s in seed 000, and their prompts, all
//! prefilled in the same few engine steps, delayed the steady tenants' first tokens by half
//! their baseline. With `Headroom::pace`, a flow that is bursting (one more slot would take it
//! beyond its own mean plus the margin) and already holds a slot, while protected flows of its
//! band or a higher one have demand, starts at most one request per `hold / share` (the rate
//! at which a steady tenant holding its fair share, `share` slots each held `hold`, starts
//! them), with a tolerance of `sigmas` starts ahead of that pace: the spread of a Poisson count
//! of one start per pace, so that a steady tenant's own clumps while its mean catches up at a
//! cold start pass (without it, seed 000's A was paced at 20 s, its mean still lagging, and its
//! p99 went over 1.3×). It is the generic cell rate algorithm (`governor`'s): one
//! theoretical arrival time per flow (`Flow::pace_tat`). A burst takes `1 + sigmas` slots at
//! once and then reaches its share in about one hold time instead of at once, and is paced only
//! until its mean catches up (a few seconds with the default window): a flow whose arrivals
//! are slower than that rate is never delayed, and one back at its usual load is not paced
//! even if the headroom holds it back (pacing it would keep it at its share, leaving the
//! slots it may be lent unused). `hold` is the whole budget's, by Little's law (`Turnover`:
//! mean slots in flight over grants per second).
//!
//! Every fair start moves the theoretical arrival time, paced or not, but never beyond the
//! tolerance ahead of now: a flow that ran above its share while steady, or alone, and then
//! bursts waits at most one pace, not for the starts it made while nothing paced it. Nothing is
//! paced at a cold start (nobody is protected yet), for a lone tenant, or while no grant has
//! been seen. A paced flow is not marked held back: a tenant ramping up to a new everyday load
//! becomes steady as its mean catches up. A paced request waits for the time it may start
//! (`next_pace_at`: the facade wakes up then) or for the next event.
//!
//! A paced flow is held back alone, not its band, so a dispatch whose candidates are held back
//! tries the next few flows in fair order (`PACED_LOOKAHEAD`, so it stays O(log F)): of the
//! first's band, or of any band when the first is held back by its pace alone (a rate limit is
//! no priority claim; a lower band's flow within its share may take a slot the paced burst
//! must leave free for now). Behind more paced flows than that, a flow waits for the earliest
//! of their times (`next_pace_at` covers the same look).
//!
//! # Standby slots: one queue's next free slot, on a fleet member
//!
//! With one replica a waiting request takes the first slot that frees anywhere; a fleet member
//! frees only its share's slots, a third as often with three replicas, so a tenant that the
//! deployment gives all it asks (its demand is below the water level: `Share::standby`) would
//! wait three times as long for its next slot as behind one queue. `set_standby(k)` keeps `k`
//! of this replica's slots free from every other flow: a flow without the standby right may
//! take a slot only while more than `k` stay free (but never while nothing is in flight, and
//! never below its reservation), and the backlogged flows with the right are kept in their own
//! fair order, so the first of them runs when the fair order's first is held back (if it is of
//! that flow's band or a higher one: never out of band order). A standby
//! slot taken is refilled by the replica's next release, which the others do not get. The
//! fleet's leader sizes `k` (`fleet::share`); it is 0 on a lone replica, where nothing changes.
//! Flows the fleet has not yet seen have the right, like its newest tenants' first requests.
//! At most a quarter of the limit is kept this way, so the others always get slots.
//!
//! A lowered limit preempts nothing, headroom or not: what is in flight finishes, and a flow
//! within its fair share waits for that like any other. (Letting protected flows keep the old
//! limit until the lent slots finish was tried: it kept the engine saturated after the
//! controller's cuts, and seed 001's sweep lost up to 9 % of its goodput to it.)
//!
//! It needs the time: `advance(now)` moves the clock the means decay with (the async facade
//! calls it before every operation). With `Headroom` unset nothing is held and the clock is
//! ignored.
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
//! SHA-256 of its name: the key the fleet knows it by). The headroom adds O(1) per change of a
//! flow (its terms leave and rejoin its band's sums), O(bands in use) per check (the sums of
//! its band and those above), and a second `BTreeSet`, of backlogged flows by slots per weight,
//! updated with the first; standby slots a third, of the backlogged flows with the standby
//! right, also updated with the first. Pacing adds O(1) per grant (the turnover and the flow's
//! theoretical arrival time), and a dispatch whose candidates are held back looks at up to
//! `PACED_LOOKAHEAD` more flows in fair order. Nothing on a request's path scans queues
//! or tenants; `flows` and `set_shares`, the fleet's, are O(F) a few times a second. Memory is O(peak queued + peak
//! flows): slab slots are reused, not returned.
//!
//! Handles (`FlowKey`, `EntryKey`) carry a generation, so a handle whose slot was reused is a
//! harmless no-op (a generation wraps only after 2^32 reuses of the same slot).

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

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

/// Isolation without caps: how much of the budget is held free for the steady tenants while
/// another takes more than its own (see "Headroom" above).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Headroom {
    /// Time constant of each flow's mean slots in flight: how long recent demand is remembered.
    pub window: Duration,
    /// How far above the protected flows' mean the held slots reach, in standard deviations of
    /// a Poisson count (`√mean`); its normal tail is also the chance their arrivals may find
    /// no held slot free (`slots_for_arrivals`).
    pub sigmas: f64,
    /// Pace a burst's admissions beside protected flows (see "Pacing a burst").
    pub pace: bool,
}

/// The whole budget's turnover, for how long a slot is held (Little's law: mean slots in flight
/// over grants per second), both exponentially weighted with the headroom's window.
#[derive(Clone, Copy, Debug, Default)]
struct Turnover {
    /// Mean slots in flight as of `at`.
    in_flight: f64,
    /// Mean grants per second as of `at`.
    starts: f64,
    at: Option<Instant>,
}

impl Turnover {
    /// Brings both means to `now`, with `in_flight` held since `at`.
    fn advance(&mut self, in_flight: u32, now: Option<Instant>, window: Duration) {
        self.in_flight = decayed(self.in_flight, in_flight, self.at, now, window);
        // A rate decays towards nothing between grants.
        self.starts = decayed(self.starts, 0, self.at, now, window);
        if now.is_some() {
            self.at = now;
        }
    }

    /// How long a slot is held, as of the last `advance`: `None` before any grant.
    fn hold(&self) -> Option<f64> {
        let hold = self.in_flight / self.starts;
        (self.starts > 0.0 && hold.is_finite()).then_some(hold)
    }
}

/// Protected flows of one band, all together: the sum of their means as of `at` (it decays
/// towards `in_flight` like each of its terms), and the sum of their slots in flight.
#[derive(Clone, Copy, Debug, Default)]
struct Protected {
    mean: f64,
    at: Option<Instant>,
    in_flight: u32,
    /// Their queued requests: demand already here, which the fair order serves; the slots held
    /// are for what has not arrived yet.
    queued: u32,
}

impl Protected {
    fn mean_at(&self, now: Option<Instant>, window: Duration) -> f64 {
        decayed(self.mean, self.in_flight, self.at, now, window)
    }
}

/// A mean of slots in flight `mean` as of `at`, with `in_flight` held since then, as of `now`.
fn decayed(
    mean: f64,
    in_flight: u32,
    at: Option<Instant>,
    now: Option<Instant>,
    window: Duration,
) -> f64 {
    let held = f64::from(in_flight);
    match (at, now) {
        (Some(at), Some(now)) if now > at && !window.is_zero() => {
            let elapsed = now.duration_since(at).as_secs_f64() / window.as_secs_f64();
            held + (mean - held) * (-elapsed).exp()
        }
        _ => mean,
    }
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
/// How many flows past the fair order's first a dispatch looks at when the candidates are held
/// back (`next_eligible`): paced flows are held back one by one.
const PACED_LOOKAHEAD: usize = 8;

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
    /// Isolation without caps; `None` holds nothing back.
    headroom: Option<Headroom>,
    /// The deployment's limit on a fleet member (`set_global_limit`); 0 alone.
    global_limit: u32,
    /// The clock the means decay with (`advance`); `None` until first advanced.
    now: Option<Instant>,
    /// Per band: the protected flows' sums.
    protected: Box<[Protected; BANDS]>,
    /// Sum of `Flow::counted_weight` over the flows present: fair shares are of this.
    live_weight: u64,
    /// Slots lent (see `lends`), not yet released.
    lent: u32,
    /// One key per backlogged flow: its slots per weight, fewest first. Where the fair order's
    /// next flow is held back, the first of these runs instead.
    by_usage: BTreeSet<UsageKey>,
    /// Slots kept free for the flows with the standby right (`set_standby`); 0: none.
    standby: u32,
    /// While `standby > 0`: the backlogged flows with the standby right, by their place in the
    /// fair order (the same keys as `order`).
    standby_order: BTreeSet<OrderKey>,
    /// How long a slot is held, for pacing (headroom only).
    turnover: Turnover,
    /// Requests submitted while their flow was paced.
    paced: u64,
    /// Slots released so far.
    released: u64,
}

/// A backlogged flow by how many slots it would hold per weight with one more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct UsageKey {
    usage: u128,
    seq: u64,
    flow: u32,
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
    /// The fleet gives this tenant all it asks (its demand is below the deployment's water
    /// level), so it may take this replica's standby slots (see "Standby slots").
    pub standby: bool,
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
    /// This flow's key in `FairQueue::by_usage`, present iff `queued > 0`.
    usage: Option<UsageKey>,
    /// Its key in `FairQueue::standby_order`: its `order` key, present iff that is and the
    /// flow may take standby slots while some are kept.
    standby_key: Option<OrderKey>,
    /// The weight counted in `FairQueue::live_weight` for this flow.
    counted_weight: u32,
    /// Mean slots in flight as of `mean_at` (headroom only).
    mean: f64,
    mean_at: Option<Instant>,
    /// Counted in its band's `Protected` (not bursting, not held back within the window, and
    /// within its fair share or steady, as of its last event).
    protected: bool,
    /// Of its slots in flight, how many were lent beyond its fair share.
    lent: u32,
    /// When the headroom last kept one of its requests from a free slot: such a flow is not
    /// `steady` for a window.
    held_back_at: Option<Instant>,
    /// Its pace's theoretical arrival time (GCRA, as `governor` keeps it): one pace after the
    /// later of its last fair-order start and that start's own.
    pace_tat: Option<Instant>,
    /// When it may next start, if it is paced (see "Pacing a burst"): `pace_tat` less the
    /// tolerance, as of its last fair-order start.
    next_start_at: Option<Instant>,
}

/// Why a flow may not take a free slot now (`FairQueue::hold_back`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HoldBack {
    /// It would be lent into the slots held for the protected flows.
    Headroom,
    /// It would take a standby slot it has no right to.
    Standby,
    /// It is bursting beside protected flows and its next start is not due.
    Pace,
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

    /// May take the standby slots: the fleet gives its tenant all it asks, or has not seen it.
    fn has_standby_right(&self) -> bool {
        self.share.is_none_or(|share| share.standby)
    }

    fn lane(&self) -> Lane {
        if self.in_flight < self.reserved_slots() {
            Lane::Reserved
        } else {
            Lane::Fair
        }
    }
}

/// Slots the protected flows are expected to need beyond the `in_flight` they hold: their
/// summed mean plus `sigmas` standard deviations of a Poisson count of that mean.
fn expected_need(mean: f64, in_flight: u32, headroom: Headroom) -> u32 {
    let mean = mean.max(0.0);
    let expected = (mean + headroom.sigmas * mean.sqrt()).ceil();
    // `as` saturates: a mean beyond u32 holds everything, as it should.
    (expected as u32).saturating_sub(in_flight)
}

/// The fewest slots kept free that arrivals, one per slot, find all taken with a chance of at
/// most `miss`, where `rho` arrivals come per release and each release refills one: an M/M/1/k
/// queue of the slots taken, whose chance of being full is `ρ^k (1 - ρ) / (1 - ρ^(k+1))`. In
/// closed form, the least `k ≥ 1` with `ρ^k (1 - ρ + ρ·miss) ≤ miss`. `rho` is clamped to
/// 0.95 (beyond it the arrivals take nearly every release: holding more gains them nothing);
/// 0 when `miss` is 1 or more. The fleet's standby slots and the headroom both size by it.
pub fn slots_for_arrivals(rho: f64, miss: f64) -> u32 {
    if miss >= 1.0 || miss.is_nan() {
        return 0;
    }
    let rho = if rho.is_finite() {
        rho.clamp(0.0, 0.95)
    } else {
        0.0
    };
    let miss = miss.max(f64::MIN_POSITIVE);
    let k = (miss / (1.0 - rho + rho * miss)).ln() / rho.ln();
    // The tolerance keeps an exact boundary (`ρ^k` equal to it) from rounding up a slot;
    // `as` saturates, and `ln 0` gives 0 here, so no arrivals still hold one slot.
    ((k - 1e-9).ceil() as u32).max(1)
}

/// The chance that a normal variable lands more than `sigmas` standard deviations above its
/// mean: what the headroom's margin leaves uncovered, and so the miss its arrivals' sizing
/// aims at (0.13 % at the default 3). Abramowitz and Stegun's 7.1.26 for `erfc`, to 1.5e-7.
fn normal_tail(sigmas: f64) -> f64 {
    let x = sigmas.max(0.0) / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    0.5 * poly * (-x * x).exp()
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
            headroom: None,
            global_limit: 0,
            now: None,
            protected: Box::new([Protected::default(); BANDS]),
            live_weight: 0,
            lent: 0,
            by_usage: BTreeSet::new(),
            standby: 0,
            standby_order: BTreeSet::new(),
            turnover: Turnover::default(),
            paced: 0,
            released: 0,
        }
    }

    /// A scheduler that holds headroom for the steady tenants (see "Headroom").
    pub fn with_headroom(limit: u32, headroom: Headroom) -> Self {
        FairQueue {
            headroom: Some(headroom),
            ..FairQueue::new(limit)
        }
    }

    /// Moves the clock the flows' means decay with. Earlier instants are ignored.
    pub fn advance(&mut self, now: Instant) {
        if self.now.is_none_or(|then| now > then) {
            self.now = Some(now);
        }
    }

    /// Slots lent (granted beyond their flow's fair share while it was not steady) and not yet
    /// released.
    pub fn lent(&self) -> u32 {
        self.lent
    }

    /// Requests submitted while their flow was paced (and not held back by the headroom), so
    /// far.
    pub fn paced(&self) -> u64 {
        self.paced
    }

    /// Slots released so far (grants whose streams ended, whichever way).
    pub fn released(&self) -> u64 {
        self.released
    }

    /// Slots kept free at this instant for the protected flows (of every band) against a flow
    /// that would take more than its fair share.
    pub fn held(&self) -> u32 {
        let Some(headroom) = self.headroom else {
            return 0;
        };
        let free = self.limit.saturating_sub(self.in_flight);
        let (mean, present) = self.protected_upto(u8::MAX, headroom);
        self.held_for(mean, present, headroom).min(free)
    }

    /// Slots to keep free for protected flows of summed `mean` that have `present` requests
    /// here (in flight or queued): the fewer of what their spread may still need
    /// (`expected_need`, with this replica's margin) and what their arrivals need until
    /// releases refill the slots they take (`slots_for_arrivals`, at the miss of `sigmas`
    /// itself, unscaled on a fleet member: see "Headroom").
    /// Both are what the protected flows would find free; the first counts how far above their
    /// mean they may go, the second how soon a release gives back what they took, which is
    /// what decides while many slots turn over for few protected arrivals (seed 001's sweep:
    /// 5 to 7 slots, not the 20 of A's spread). Protected arrivals per release are `ρ = mean /
    /// in_flight`: by Little's law they arrive at `mean / hold`, and the slots in flight
    /// release at `in_flight / hold`, for the same hold.
    fn held_for(&self, mean: f64, present: u32, headroom: Headroom) -> u32 {
        let spread = expected_need(mean, present, self.margin_headroom(headroom));
        let rho = mean / f64::from(self.in_flight.max(1));
        spread.min(slots_for_arrivals(rho, normal_tail(headroom.sigmas)))
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
            self.leave_protected(index);
            self.flow_mut(index).share = share;
            self.recount_weight(index);
            self.join_protected(index);
            if waiting > 0 {
                // The reservation decides the lane, which is part of the key.
                self.rekey(index);
            }
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Keeps `slots` free for the flows with the standby right (see "Standby slots"); 0 keeps
    /// none. O(F log F) when it turns on or off, never on a request's path. A smaller value lets
    /// the caller dispatch at once.
    pub fn set_standby(&mut self, slots: u32) {
        let was_on = self.standby > 0;
        self.standby = slots;
        if was_on != (slots > 0) {
            for index in 0..self.flows.len() as u32 {
                if self.flows[index as usize]
                    .flow
                    .as_ref()
                    .is_some_and(|flow| flow.queued > 0)
                {
                    self.rekey(index);
                }
            }
        }
    }

    /// The standby slots in force: at most a quarter of the limit.
    pub fn standby(&self) -> u32 {
        self.standby.min(self.limit / 4)
    }

    /// Changes the budget. A larger limit lets the caller dispatch more at once; a smaller one
    /// preempts nothing: `dispatch_next` waits until `in_flight` drops below it. 0 admits
    /// nothing (a fleet member the leader has not granted a share yet).
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    /// The deployment's limit, of which this replica's is a part (a fleet member; 0 or the
    /// limit itself: alone). The headroom's margin is the deployment's spread: see
    /// `margin_headroom`.
    pub fn set_global_limit(&mut self, global_limit: u32) {
        self.global_limit = global_limit;
    }

    /// The headroom with its margin for this replica: `sigmas × √(limit / global)`. Each of n
    /// replicas sees about 1/n of a steady tenant's mean `M`, and a margin of `sigmas` standard
    /// deviations on each would hold `sigmas × √n × √M` over the deployment, √n times what one
    /// replica holds for the same tenants; seed001-aimd-3x lost 8 % of its goodput to that. The
    /// deployment's spread is what it holds instead; a tenant the fleet gives all it asks also
    /// has the standby slots on each replica (sized per replica, `fleet::share`).
    fn margin_headroom(&self, headroom: Headroom) -> Headroom {
        if self.global_limit <= self.limit || self.limit == 0 {
            return headroom;
        }
        Headroom {
            sigmas: headroom.sigmas * (f64::from(self.limit) / f64::from(self.global_limit)).sqrt(),
            ..headroom
        }
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
    /// `Granted` iff a slot is free and nothing waits anywhere (with headroom: nothing that may
    /// take it, and the flow itself is not held back). A `Queued` answer while slots are free
    /// means the caller owes `dispatch_next` calls: a queued request can change who is held
    /// back.
    pub fn submit(&mut self, tenant: &str, class: FlowClass, cost: u64, payload: T) -> Submit<T> {
        let existing = self.by_name.get(tenant).copied();
        if let Some(index) = existing {
            self.apply_class(index, class);
        }

        // With headroom or standby slots, requests may wait while slots are free (held back); a
        // newcomer may take one if none of them may.
        let holds_back = self.headroom.is_some() || self.standby > 0;
        let nothing_eligible_waits =
            self.queued == 0 || (holds_back && self.next_eligible().is_none());
        if self.in_flight < self.limit && nothing_eligible_waits {
            let index = existing.unwrap_or_else(|| self.insert_flow(tenant, class));
            // Never ahead of the flow's own queued requests.
            let hold_back = self.hold_back(index);
            if self.flow(index).queued == 0 && hold_back.is_none() {
                self.flow_mut(index).note_submitted(cost);
                let flow = self.flow(index);
                let start = self.virtual_time[usize::from(flow.class.band)].max(flow.finish);
                let lends = self.lends(index);
                self.take_slot(index, start, cost, lends);
                return Submit::Granted(self.flow_key(index));
            }
            // Beyond its fair share into the headroom (or the standby slots): it waits (or is
            // refused) as if no slot were free. (Or behind its own queued requests, held back
            // the same way.) If the headroom is what holds it back, it is no steady tenant for
            // a window; standby slots kept for others say nothing about its own load.
            match hold_back {
                Some(HoldBack::Headroom) => {
                    let now = self.now;
                    self.flow_mut(index).held_back_at = now;
                }
                Some(HoldBack::Pace) => self.paced += 1,
                Some(HoldBack::Standby) | None => {}
            }
            if self.flow(index).queued >= class.queue_max {
                self.remove_flow_if_idle(index);
                return Submit::Full(payload);
            }
            self.flow_mut(index).note_submitted(cost);
            return Submit::Queued(self.push_entry(index, cost, payload));
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
        let index = self.next_eligible()?;
        let (start, head) = {
            let flow = self.flow(index);
            (flow.head_start, flow.head)
        };
        // Lent or not is decided as the dispatch was, with the request still queued (so the
        // flow is not `steady`): taking its last queued request must not make it look steady.
        let lends = self.lends(index);
        let entry = self.unlink(head);
        self.take_slot(index, start, entry.cost, lends);

        let band = usize::from(self.flow(index).class.band);
        let now = self.virtual_time[band];
        let flow = self.flow_mut(index);
        if flow.queued > 0 {
            // The next request becomes the head: it gets its start tag now (lazy tagging).
            flow.head_start = now.max(flow.finish);
        }
        self.rekey(index);
        Some((self.flow_key(index), entry.payload))
    }

    /// The backlogged flow the next free slot goes to: the fair order's first, unless it is
    /// held back; then the first in fair order of those with the standby right, if it is of the
    /// same band or a higher one; then the one holding the fewest slots per weight, if it may
    /// take one. O(log F).
    /// Without pacing, if both are held back every flow would lend (the fewest does) and is held
    /// back too, but for flows of lower bands whose test counts fewer protected flows: those wait
    /// for the next event, a slot never dispatched out of band order. (With the headroom and
    /// standby slots both on, a flow with the right may also wait for the next event behind one
    /// with the right that the headroom holds back.) A paced flow is held back alone, so with
    /// pacing the fewest may be paced while others may run: the next few flows in fair order are
    /// tried (`look_past_paced`), and behind more paced flows than that a flow waits for their
    /// earliest time (`next_pace_at`) or the next event.
    fn next_eligible(&self) -> Option<u32> {
        let first = self.order.first()?;
        let first_hold = self.hold_back(first.flow);
        if first_hold.is_none() {
            return Some(first.flow);
        }
        if let Some(standby) = self.standby_order.first()
            && standby.band <= first.band
            && !self.held_back(standby.flow)
        {
            return Some(standby.flow);
        }
        let fewest = self.by_usage.first()?.flow;
        if !self.held_back(fewest) {
            return Some(fewest);
        }
        // Pacing holds flows back one by one, not a band at once: the next flows in fair order
        // may run (seed 000's heavy-steady: A, queued once, waited over a second beside free slots
        // behind the paced burst).
        self.look_past_paced(first, first_hold)
            .find(|key| !self.held_back(key.flow))
            .map(|key| key.flow)
    }

    /// The flows after the fair order's first that a dispatch may try when its candidates are
    /// held back: a bounded look (`PACED_LOOKAHEAD`), so a dispatch stays O(log F); behind more
    /// paced flows than that, a flow waits for their pace. Of the first's band only, unless the
    /// first is held back by its pace alone: a rate limit is no priority claim, and a lower
    /// band's flow within its share may take a slot a paced burst must leave free for now (a
    /// flow held back by the headroom or the standby slots holds its band's place as before).
    /// Nothing without pacing. `first_hold` is why the first is held back (`hold_back`), which
    /// the caller has already asked.
    fn look_past_paced<'a>(
        &'a self,
        first: &'a OrderKey,
        first_hold: Option<HoldBack>,
    ) -> impl Iterator<Item = &'a OrderKey> {
        let pacing = self.headroom.is_some_and(|headroom| headroom.pace);
        let any_band = pacing && first_hold == Some(HoldBack::Pace);
        self.order
            .iter()
            .skip(1)
            .take(if pacing { PACED_LOOKAHEAD } else { 0 })
            .take_while(move |key| key.lane == first.lane && (any_band || key.band == first.band))
    }

    /// Whether one more slot for this flow would take a standby slot it has no right to (see
    /// "Standby slots"), or be lent beyond its fair share into the slots held for the protected
    /// flows (see "Headroom").
    fn held_back(&self, index: u32) -> bool {
        self.hold_back(index).is_some()
    }

    /// Why one more slot for this flow is withheld, if it is: the headroom first (what marks a
    /// flow as held back), then the standby slots, then its pace (so `Pace` is its pace alone).
    fn hold_back(&self, index: u32) -> Option<HoldBack> {
        let flow = self.flow(index);
        // Nothing in flight: no release will come to dispatch what waits, so hold nothing.
        if self.in_flight == 0 || flow.lane() == Lane::Reserved {
            return None;
        }
        let free = self.limit.saturating_sub(self.in_flight);
        if self.headroom_holds_back(flow) {
            Some(HoldBack::Headroom)
        } else if !flow.has_standby_right() && free <= self.standby() {
            Some(HoldBack::Standby)
        } else if self.paced_until(flow).is_some() {
            Some(HoldBack::Pace)
        } else {
            None
        }
    }

    /// How long after one start a paced flow may start again: `hold / share`, the interval
    /// between the starts of a steady flow holding its fair share (see "Pacing a burst").
    /// `None` before the turnover has seen a grant.
    fn pace(&self, flow: &Flow) -> Option<Duration> {
        self.headroom.filter(|headroom| headroom.pace)?;
        let share =
            f64::from(self.limit) * f64::from(flow.counted_weight) / self.live_weight.max(1) as f64;
        Duration::try_from_secs_f64(self.turnover.hold()? / share.max(1.0)).ok()
    }

    /// While the flow's next start is paced (see "Pacing a burst"): when it may start.
    fn paced_until(&self, flow: &Flow) -> Option<Instant> {
        let headroom = self.headroom.filter(|headroom| headroom.pace)?;
        let (now, next_start_at) = (self.now?, flow.next_start_at?);
        if now >= next_start_at || flow.in_flight == 0 || flow.lane() == Lane::Reserved {
            return None;
        }
        // Bursting only: a flow held back for a window but back at its usual load is the
        // headroom's; pacing it would keep it at its share, the slots it may be lent unused.
        if !self.bursting(flow, flow.in_flight + 1) {
            return None;
        }
        // Protected demand of its band or a higher one, other than its own.
        let (mut mean, _) = self.protected_upto(flow.class.band, headroom);
        if flow.protected {
            mean -= self.mean_now(flow, headroom);
        }
        (mean >= 1.0).then_some(next_start_at)
    }

    /// When a paced flow among the next dispatch's candidates may start, if `dispatch_next`
    /// finds nothing to run while slots are free: the caller should call it again then (a later
    /// event may also dispatch it sooner). O(log F).
    pub fn next_pace_at(&self) -> Option<Instant> {
        if self.in_flight >= self.limit || self.queued == 0 {
            return None;
        }
        let first = self.order.first()?;
        let candidates = [
            Some(first.flow),
            self.standby_order.first().map(|key| key.flow),
            self.by_usage.first().map(|key| key.flow),
        ];
        candidates
            .into_iter()
            .flatten()
            .chain(
                self.look_past_paced(first, self.hold_back(first.flow))
                    .map(|key| key.flow),
            )
            .filter_map(|index| self.paced_until(self.flow(index)))
            .min()
    }

    /// Whether one more slot for this flow would be lent into the slots held for the protected
    /// flows (see "Headroom").
    fn headroom_holds_back(&self, flow: &Flow) -> bool {
        let Some(headroom) = self.headroom else {
            return false;
        };
        if self.in_flight == 0 || flow.lane() == Lane::Reserved || !self.would_lend(flow) {
            return false;
        }
        // One test for every flow of a band (a protected flow about to lend is held back by its
        // own demand too), so that if the fair order's first flow and the one with the fewest
        // slots per weight are both held back by it, every flow of that band is
        // (`next_eligible`; pacing, per flow, is apart from this).
        let free = self.limit.saturating_sub(self.in_flight);
        let (mean, present) = self.protected_upto(flow.class.band, headroom);
        free <= self.held_for(mean, present, headroom)
    }

    /// Whether one more slot would be lent: beyond the flow's fair share (its weight's share of
    /// the limit among the flows present) to a flow that is not steady. A flow's first slot
    /// never is, so that with more tenants than slots each still gets one.
    ///
    /// Steady: nothing queued, and one more slot keeps it within its own usual load (its mean
    /// plus the margin, `bursting` below). A tenant whose steady load is more than its weight's
    /// share of the limit (seed 000's `heavy-steady`: A at 36 slots against a share of 26) is
    /// served as it usually is, like one within its share, rather than held back with the
    /// burst; the steady load of every tenant is what the headroom is for. Once it queues it
    /// competes by weight like any other, so among backlogged flows the rule is the weighted
    /// share alone (what `next_eligible`'s two candidates rely on).
    fn would_lend(&self, flow: &Flow) -> bool {
        let beyond_share = flow.in_flight > 0
            && u128::from(flow.in_flight + 1) * u128::from(self.live_weight)
                > u128::from(self.limit) * u128::from(flow.counted_weight);
        beyond_share && !self.steady(flow, flow.in_flight + 1)
    }

    /// Whether the flow, holding `in_flight`, is taking its usual load: nothing queued, not
    /// bursting, and not held back by the headroom within the last window. The last is what
    /// keeps a long burst a burst: after a window its mean has caught up with what it holds, so
    /// only having been held back tells it from a tenant whose everyday load this is.
    fn steady(&self, flow: &Flow, in_flight: u32) -> bool {
        self.headroom.is_some()
            && flow.queued == 0
            && !self.recently_held_back(flow)
            && !self.bursting(flow, in_flight)
    }

    /// Whether one of the flow's requests was kept from a free slot within the last window.
    fn recently_held_back(&self, flow: &Flow) -> bool {
        let Some(headroom) = self.headroom else {
            return false;
        };
        match (flow.held_back_at, self.now) {
            (Some(at), Some(now)) => now.saturating_duration_since(at) < headroom.window,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// Whether `in_flight` slots would be far above the flow's own recent mean (beyond it by
    /// more than the headroom's margin, and more than one): a surge, not its usual load.
    fn bursting(&self, flow: &Flow, in_flight: u32) -> bool {
        let Some(headroom) = self.headroom else {
            return false;
        };
        expected_need(self.mean_now(flow, headroom), 0, headroom).max(1) < in_flight
    }

    /// The flow's mean slots in flight as of now.
    fn mean_now(&self, flow: &Flow, headroom: Headroom) -> f64 {
        decayed(
            flow.mean,
            flow.in_flight,
            flow.mean_at,
            self.now,
            headroom.window,
        )
    }

    /// Whether the flow holds no more than its fair share.
    fn within_share(&self, flow: &Flow) -> bool {
        u128::from(flow.in_flight) * u128::from(self.live_weight)
            <= u128::from(self.limit) * u128::from(flow.counted_weight)
    }

    /// The protected flows of bands `0..=band`: their means summed, as of now, and the
    /// requests they have here already (in flight and queued).
    fn protected_upto(&self, band: u8, headroom: Headroom) -> (f64, u32) {
        self.protected[..=usize::from(band)]
            .iter()
            .fold((0.0, 0), |(mean, present), sums| {
                (
                    mean + sums.mean_at(self.now, headroom.window),
                    present + sums.in_flight + sums.queued,
                )
            })
    }

    /// Takes the flow's terms out of its band's protected sums (bringing both to now) before
    /// its slots, weight or band change; `join_protected` puts them back as they are then.
    fn leave_protected(&mut self, index: u32) {
        let Some(headroom) = self.headroom else {
            return;
        };
        let now = self.now;
        let (flow, sums) = self.flow_with_sums(index);
        flow.mean = decayed(
            flow.mean,
            flow.in_flight,
            flow.mean_at,
            now,
            headroom.window,
        );
        flow.mean_at = now;
        if flow.protected {
            flow.protected = false;
            sums.mean = sums.mean_at(now, headroom.window) - flow.mean;
            sums.at = now;
            sums.in_flight -= flow.in_flight;
            sums.queued -= flow.queued;
        }
    }

    /// A live flow and its band's protected sums, borrowed together.
    fn flow_with_sums(&mut self, index: u32) -> (&mut Flow, &mut Protected) {
        let flow = self.flows[index as usize]
            .flow
            .as_mut()
            .expect("flow indices held internally always point at live flows");
        let sums = &mut self.protected[usize::from(flow.class.band)];
        (flow, sums)
    }

    fn join_protected(&mut self, index: u32) {
        let Some(headroom) = self.headroom else {
            return;
        };
        let flow = self.flow(index);
        // A flow far above its own recent mean is bursting, not steady: counted, its surge
        // would offset what the steady ones are expected to need.
        // At least one slot: a tenant back after a pause starts its record at a mean of 0.
        // (`leave_protected` brought its mean to now.) A steady flow beyond its fair share
        // with nothing queued is protected too (see `would_lend`).
        // Nor is one held back within the window: a burst that is ending (its last slots
        // within its share) must not leave its mean in the sum as recent demand to protect.
        let bursting = self.bursting(flow, flow.in_flight) || self.recently_held_back(flow);
        if bursting || !(self.within_share(flow) || self.steady(flow, flow.in_flight)) {
            return;
        }
        let now = self.now;
        let (flow, sums) = self.flow_with_sums(index);
        flow.protected = true;
        sums.mean = sums.mean_at(now, headroom.window).max(0.0) + flow.mean;
        sums.at = now;
        sums.in_flight += flow.in_flight;
        sums.queued += flow.queued;
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
        let waiting = record.queued;
        let lane_before = record.lane();
        self.released += 1;
        if let Some(headroom) = self.headroom {
            self.turnover
                .advance(self.in_flight, self.now, headroom.window);
        }
        self.leave_protected(flow.index);
        let record = self.flow_mut(flow.index);
        record.in_flight -= 1;
        let was_lent = record.lent > 0;
        if was_lent {
            record.lent -= 1;
            self.lent -= 1;
        }
        self.in_flight -= 1;
        self.join_protected(flow.index);
        if waiting > 0 {
            // Its lane may have changed, and with headroom its slots per weight have.
            if self.headroom.is_some() || self.flow(flow.index).lane() != lane_before {
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
            usage: None,
            standby_key: None,
            counted_weight: 0,
            mean: 0.0,
            mean_at: self.now,
            protected: false,
            lent: 0,
            held_back_at: None,
            pace_tat: None,
            next_start_at: None,
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
        self.recount_weight(index);
        self.join_protected(index);
        index
    }

    /// Brings the flow's part of `live_weight` in line with its weight now.
    fn recount_weight(&mut self, index: u32) {
        let flow = self.flow_mut(index);
        let (old, new) = (flow.counted_weight, flow.weight());
        flow.counted_weight = new;
        self.live_weight = self.live_weight - u64::from(old) + u64::from(new);
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
        // A protected flow's mean stays in its band's sum and decays there: a tenant between
        // two requests is still recent demand.
        if flow.protected {
            self.protected[usize::from(flow.class.band)].in_flight -= flow.in_flight;
        }
        self.live_weight -= u64::from(flow.counted_weight);
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
        self.leave_protected(index);
        let flow = self.flow_mut(index);
        flow.class = class;
        if old.band != class.band {
            // Virtual times of different bands are unrelated: restart at the new band's present.
            flow.finish = 0;
            flow.head_start = new_band_time;
            self.queued_by_band[usize::from(old.band)] -= waiting;
            self.queued_by_band[usize::from(class.band)] += waiting;
        }
        self.recount_weight(index);
        self.join_protected(index);
        if waiting > 0 {
            self.rekey(index);
        }
    }

    /// Whether the flow's next slot counts as lent (see `lent`).
    fn lends(&self, index: u32) -> bool {
        let flow = self.flow(index);
        flow.lane() == Lane::Fair && self.headroom.is_some() && self.would_lend(flow)
    }

    /// Gives `index` one slot for a request whose start tag is `start`, charging the fair order
    /// unless the slot fills a reservation; `lends` as `lends` said before the request left its
    /// queue.
    fn take_slot(&mut self, index: u32, start: u128, cost: u64, lends: bool) {
        let flow = self.flow(index);
        let band = usize::from(flow.class.band);
        let lane = flow.lane();
        self.leave_protected(index);
        if lane == Lane::Fair {
            let time = &mut self.virtual_time[band];
            *time = (*time).max(start);
        }
        if let Some(headroom) = self.headroom {
            self.turnover
                .advance(self.in_flight, self.now, headroom.window);
            self.turnover.starts += 1.0 / headroom.window.as_secs_f64();
        }
        // A slot filling a reservation is a promise kept, not a start to pace.
        let paced = match (lane, self.now, self.pace(self.flow(index))) {
            (Lane::Fair, Some(now), Some(pace)) => {
                // `sigmas` starts ahead, to the nearest start: the pace shortens a little with
                // each start (the turnover counts it), so exactly `sigmas` paces of the newest
                // would fall just short of the last start they are meant to allow.
                let sigmas = self.headroom.map_or(0.0, |headroom| headroom.sigmas);
                let tolerance = pace.mul_f64(sigmas + 0.5);
                // Every fair start moves the arrival time, paced or not (a flow above its share
                // while steady, or alone), so it is kept within the tolerance of now: a flow
                // that starts to burst later waits at most one pace, never for the starts it
                // made while nothing paced it.
                let base = self
                    .flow(index)
                    .pace_tat
                    .map_or(now, |tat| tat.max(now))
                    .min(now + tolerance);
                let tat = base + pace;
                Some((tat, tat.checked_sub(tolerance)))
            }
            _ => None,
        };
        let flow = self.flow_mut(index);
        if lane == Lane::Fair {
            flow.finish = start.saturating_add(charge(cost, flow.weight()));
        }
        if let Some((tat, next_start_at)) = paced {
            flow.pace_tat = Some(tat);
            flow.next_start_at = next_start_at;
        }
        flow.in_flight += 1;
        if lends {
            flow.lent += 1;
            self.lent += 1;
        }
        self.in_flight += 1;
        self.join_protected(index);
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
        self.leave_protected(index);
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
        self.join_protected(index);
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
        self.leave_protected(entry.flow);
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
        self.join_protected(entry.flow);
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
        // Only the headroom looks past the fair order's first flow.
        let usage = new.filter(|_| self.headroom.is_some()).map(|key| UsageKey {
            // Slots per weight after one more: the first of these is within its fair share
            // if any backlogged flow is.
            usage: (u128::from(flow.in_flight + 1) << 64) / u128::from(flow.weight().max(1)),
            seq: key.seq,
            flow: index,
        });
        let old_usage = flow.usage;
        let standby = new.filter(|_| self.standby > 0 && flow.has_standby_right());
        let old_standby = flow.standby_key;
        if let Some(old) = old {
            self.order.remove(&old);
        }
        if let Some(new) = new {
            self.order.insert(new);
        }
        if let Some(old) = old_standby {
            self.standby_order.remove(&old);
        }
        if let Some(standby) = standby {
            self.standby_order.insert(standby);
        }
        if let Some(old) = old_usage {
            self.by_usage.remove(&old);
        }
        if let Some(usage) = usage {
            self.by_usage.insert(usage);
        }
        let flow = self.flow_mut(index);
        flow.order = new;
        flow.usage = usage;
        flow.standby_key = standby;
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
