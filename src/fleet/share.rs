//! How the leader divides the deployment's in-flight limit among the replicas: pure, no clock,
//! no I/O, table-tested.
//!
//! # Two steps
//!
//! 1. **Who deserves what** (`targets`). Every tenant's demand (requests in flight plus waiting)
//!    is summed over the replicas, and the limit is divided among *tenants*, as one fair queue
//!    over the whole deployment would: reservations first (at most the tenant's demand), then
//!    strict priority by band, and within a band weighted max-min (water-filling: every tenant
//!    gets `max(reserved, λ·weight)`, capped at its demand, with one `λ` per band). A
//!    tenant's allotment is then split over the replicas it reaches in proportion to its
//!    demand at each. What no tenant demands is split evenly, so an idle replica still admits
//!    a first request at once. A replica's *target* is the sum; the targets sum to the limit.
//!    Each replica also gets overrides (`scheduler::Share`): a tenant's local weight is its
//!    tier's weight times the part of its demand that is here (in `SHARE_SCALE`ths), so where
//!    tenants are backlogged (one water level λ: allotment = λ·weight) the local fair queue
//!    splits the target as the fleet did, even when tenant A reaches one replica and tenant B
//!    all three.
//!
//! 2. **What is safe to grant now** (`grants`). Slots are never taken back (a lower limit
//!    only stops admitting), and a replica learns its grant only at its next sync. So until a
//!    replica syncs again it may hold up to `max(in_flight, applied, handed)`: what it runs,
//!    the grant it said it applies, and the last one handed to it. That is its *commitment*.
//!    A replica whose target is at or below its commitment is granted its target (it drains
//!    towards it; its commitment stays counted). Replicas whose target is above it share
//!    what no commitment holds, `limit - Σ commitments`, in proportion to what they lack.
//!    Then `Σ max(commitment, grant) ≤ limit` whenever `Σ commitments ≤ limit`: the sum in
//!    flight never exceeds the limit, however the syncs interleave. The cost is latency: a
//!    share moves in two syncs (the shrinking replica confirms, then the growing one learns).
//!
//! Standby slots: with one queue a tenant below the water level (given all it asks) takes the
//! first slot that frees anywhere; split over replicas it waits for its own replica's next
//! release, which comes a third as often with three. So each replica keeps a few of its slots
//! free from the tenants at the level (`scheduler::fair`, "Standby slots"), and the next
//! release refills what a tenant below it took. How many (`scheduler::slots_for_arrivals`):
//! protected arrivals per release are about `ρ`, the part of the limit those tenants hold, so
//! the standby slots of one replica are an M/M/1/k queue (arrivals ρ, one refill per release),
//! and `k` is the smallest whose chance of being found all taken, `ρ^k (1 - ρ) / (1 -
//! ρ^(k+1))`, is at most `fleet.standby_miss`. None when one replica runs alone, when every
//! tenant or none is below the level (nothing to hold back, or nobody to hold it for), and
//! never more than a quarter of a replica's target. A tenant below the level between two requests has no demand at the
//! instant the leader divides, so the slots outlive the demand that asked for them while such
//! a tenant is away (`StandbyHold`, for up to `control.window_ms`): they would otherwise go to
//! the others just before its next request.
//!
//! Token cost (`scheduler.cost: tokens`): each replica reports the mean cost of each tenant's
//! requests, and a tenant's weight in the division is its tier's weight over that cost, so a
//! tenant sending prompts ten times larger gets a tenth of the slots: the same tokens per unit
//! of weight, as one fair queue charging tokens would give. The local fair queue, charging
//! tokens itself, keeps the tier's weight. Floats are fine here: one leader computes, and the
//! result is rounded once, by largest remainder, to whole slots.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use crate::scheduler::{SHARE_SCALE, Share, TenantKey, slots_for_arrivals};

/// One tenant's load on one replica, as that replica reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FlowDemand {
    pub tenant: u64,
    pub weight: u32,
    pub band: u8,
    /// Reserved slots, of the deployment's limit.
    pub reserved: u32,
    pub in_flight: u32,
    pub queued: u32,
    /// The mean cost of its requests (`scheduler.cost`: 1 per request, or worst-case tokens).
    #[serde(default = "one")]
    pub cost: u64,
}

fn one() -> u64 {
    1
}

impl FlowDemand {
    fn demand(&self) -> f64 {
        f64::from(self.in_flight) + f64::from(self.queued)
    }

    /// Requests in flight or waiting: the tenant counts in the division (and its standby
    /// slots' hold sees it present).
    pub fn has_demand(&self) -> bool {
        self.in_flight > 0 || self.queued > 0
    }
}

/// One live replica, as the leader reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberLoad<'a> {
    pub member: &'a str,
    pub in_flight: u32,
    /// The limit it applied when it reported.
    pub applied: u32,
    /// The grant last handed to it, if any.
    pub handed: Option<u32>,
    pub flows: &'a [FlowDemand],
}

impl MemberLoad<'_> {
    /// The most this replica may hold before it syncs again.
    pub fn commitment(&self) -> u32 {
        self.in_flight
            .max(self.applied)
            .max(self.handed.unwrap_or(0))
    }
}

/// The leader's answer for one replica.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberShare {
    pub member: String,
    /// What it deserves.
    pub target: u32,
    /// What it may use from now (≤ target when it shrinks; between its commitment and its
    /// target when it grows).
    pub grant: u32,
    /// Its tenants' local weights and reservations; empty when it is the only replica (its fair
    /// queue then divides the whole limit by itself, token cost included).
    pub overrides: HashMap<TenantKey, Share>,
    /// Slots it keeps free for tenants below the water level (see "Standby slots").
    pub standby: u32,
}

/// How many standby slots to keep (see "Standby slots").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Standby {
    /// The chance of finding them all taken to reach (`fleet.standby_miss`; 1: keep none).
    pub miss: f64,
    /// At least this many, while there are several replicas: what a recent division asked
    /// (`StandbyHold`).
    pub at_least: u32,
}

/// What `divide` decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Division {
    /// In the order of the members.
    pub shares: Vec<MemberShare>,
    /// The standby slots this division's demand asks of each replica, before `at_least` and
    /// each replica's cap: what `StandbyHold` remembers.
    pub standby_asked: u32,
    /// The tenants they are asked for: those below the water level (when any is at it).
    pub standby_for: Vec<u64>,
}

/// Divides `limit` among `members` (see the module documentation).
pub fn divide(limit: u32, members: &[MemberLoad<'_>], standby: Standby) -> Division {
    if members.is_empty() {
        return Division {
            shares: Vec::new(),
            standby_asked: 0,
            standby_for: Vec::new(),
        };
    }
    let (targets, slices, below_level) = targets(limit, members);
    let grants = grants(limit, members, &targets);
    let asked = below_level
        .as_ref()
        .map_or(0, |(part, _)| slots_for_arrivals(*part, standby.miss));
    let kept = if members.len() > 1 {
        asked.max(standby.at_least)
    } else {
        0
    };
    let shares = members
        .iter()
        .zip(targets)
        .zip(grants)
        .zip(slices)
        .map(|(((member, target), grant), slices)| MemberShare {
            member: member.member.to_owned(),
            target,
            grant,
            overrides: if members.len() == 1 {
                HashMap::new()
            } else {
                slices
            },
            standby: kept.min(target / 4),
        })
        .collect();
    Division {
        shares,
        standby_asked: asked,
        standby_for: below_level.map(|(_, tenants)| tenants).unwrap_or_default(),
    }
}

/// The standby slots the last division that asked for some asked, kept while a tenant they
/// were asked for within the last `hold` is away (no demand anywhere: between two requests). A
/// tenant back at the water level, or one the next division counts again, needs no hold: a
/// division asks for it, or it has no right to them. Pure: the leader passes the time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StandbyHold {
    slots: u32,
    /// Each tenant they were asked for, until when its ask holds.
    tenants: HashMap<u64, Instant>,
}

impl StandbyHold {
    /// What to keep at least at `now`, when `present` says which tenants have demand.
    pub fn at(&self, now: Instant, present: impl Fn(u64) -> bool) -> u32 {
        let away = self
            .tenants
            .iter()
            .any(|(&tenant, &until)| now < until && !present(tenant));
        if away { self.slots } else { 0 }
    }

    /// A division at `now` asked `asked` slots for `tenants`: their asks hold until `now +
    /// hold`, beside the earlier ones still running (which lapse in their time).
    pub fn note(&mut self, asked: u32, tenants: &[u64], now: Instant, hold: Duration) {
        self.tenants.retain(|_, until| now < *until);
        if asked > 0 {
            self.slots = asked;
            for &tenant in tenants {
                self.tenants.insert(tenant, now + hold);
            }
        }
    }
}

/// `shares` with no grant above its replica's commitment: nobody grows. What a leader publishes
/// while the fleet re-forms (a Redis that lost its keys: replicas still run the shares they
/// had, and the leader learns of them only as each syncs and reports the limit it applies).
pub fn hold(mut shares: Vec<MemberShare>, members: &[MemberLoad<'_>]) -> Vec<MemberShare> {
    for (share, member) in shares.iter_mut().zip(members) {
        share.grant = share.grant.min(member.commitment());
    }
    shares
}

/// A tenant over the whole fleet.
struct Tenant {
    /// Its tier's weight divided by the mean cost of its requests: in slots, what one fair
    /// queue over the deployment would give it (a tenant whose requests cost ten times more
    /// gets a tenth of the slots, the same cost per unit of weight).
    weight: f64,
    /// Demand-weighted sum of the replicas' mean costs, while aggregating.
    cost_sum: f64,
    /// Its tier's weight, as configured: the local fair queue divides by cost itself.
    tier_weight: f64,
    band: u8,
    reserved: f64,
    demand: f64,
    allotted: f64,
}

/// What `targets` finds: per replica its target (summing to the limit) and its tenants'
/// overrides; and, when some tenants are below the water level and some at it, the part of the
/// limit the ones below hold, and who they are.
type Targets = (
    Vec<u32>,
    Vec<HashMap<TenantKey, Share>>,
    Option<(f64, Vec<u64>)>,
);

/// Every replica's target and its tenants' overrides (see `Targets`).
fn targets(limit: u32, members: &[MemberLoad<'_>]) -> Targets {
    let mut tenants: BTreeMap<u64, Tenant> = BTreeMap::new();
    for flow in members.iter().flat_map(|member| member.flows) {
        let tenant = tenants.entry(flow.tenant).or_insert(Tenant {
            weight: f64::from(flow.weight.max(1)),
            tier_weight: f64::from(flow.weight.max(1)),
            cost_sum: 0.0,
            band: flow.band,
            reserved: f64::from(flow.reserved),
            demand: 0.0,
            allotted: 0.0,
        });
        tenant.demand += flow.demand();
        tenant.cost_sum += flow.demand() * flow.cost.max(1) as f64;
    }
    for tenant in tenants.values_mut() {
        if tenant.demand > 0.0 {
            tenant.weight /= tenant.cost_sum / tenant.demand;
        }
    }
    let capacity = f64::from(limit);
    allot(capacity, &mut tenants);
    let below_level = |t: &Tenant| t.allotted >= t.demand - 1e-9;
    let demanding = || tenants.iter().filter(|(_, t)| t.demand > 0.0);
    let below: f64 = demanding()
        .filter(|(_, t)| below_level(t))
        .map(|(_, t)| t.allotted)
        .sum();
    let some_at_level = demanding().any(|(_, t)| !below_level(t));
    let below_part = (below > 0.0 && some_at_level && capacity > 0.0).then(|| {
        let who = demanding()
            .filter(|(_, t)| below_level(t))
            .map(|(&key, _)| key)
            .collect();
        (below / capacity, who)
    });

    let spare = (capacity - tenants.values().map(|t| t.allotted).sum::<f64>()).max(0.0);
    let spare_each = spare / members.len() as f64;
    let mut wanted = Vec::with_capacity(members.len());
    let mut slices = Vec::with_capacity(members.len());
    for member in members {
        let mut here = spare_each;
        let mut overrides = HashMap::new();
        for flow in member.flows {
            let tenant = &tenants[&flow.tenant];
            if tenant.demand <= 0.0 {
                continue;
            }
            let part = flow.demand() / tenant.demand;
            here += tenant.allotted * part;
            let reserved = tenant.reserved.min(tenant.demand) * part;
            overrides.insert(
                TenantKey(flow.tenant),
                Share {
                    weight: ((tenant.tier_weight * part * f64::from(SHARE_SCALE)).round() as u32)
                        .max(1),
                    reserved_slots: reserved.round() as u32,
                    standby: below_level(tenant),
                },
            );
        }
        wanted.push(here);
        slices.push(overrides);
    }
    (largest_remainder(limit, &wanted), slices, below_part)
}

/// Sets every tenant's `allotted`: reservations, then bands in order, weighted water-filling
/// within a band, each capped at demand.
fn allot(capacity: f64, tenants: &mut BTreeMap<u64, Tenant>) {
    let reserved: f64 = tenants.values().map(|t| t.reserved.min(t.demand)).sum();
    // Reservations that add up to more than the limit are scaled down together.
    let scale = if reserved > capacity && reserved > 0.0 {
        capacity / reserved
    } else {
        1.0
    };
    for tenant in tenants.values_mut() {
        tenant.allotted = tenant.reserved.min(tenant.demand) * scale;
    }
    let mut left = capacity - tenants.values().map(|t| t.allotted).sum::<f64>();
    let mut bands: Vec<u8> = tenants.values().map(|t| t.band).collect();
    bands.sort_unstable();
    bands.dedup();
    for band in bands {
        if left <= 0.0 {
            break;
        }
        let in_band = |t: &&mut Tenant| t.band == band;
        // What each tenant of the band ends with at water level `level`.
        let at = |t: &Tenant, level: f64| t.demand.min(t.allotted.max(level * t.weight));
        let extra = |tenants: &BTreeMap<u64, Tenant>, level: f64| -> f64 {
            tenants
                .values()
                .filter(|t| t.band == band)
                .map(|t| at(t, level) - t.allotted)
                .sum()
        };
        let top = tenants
            .values()
            .filter(|t| t.band == band)
            .map(|t| t.demand / t.weight)
            .fold(0.0, f64::max);
        let level = if extra(tenants, top) <= left {
            top
        } else {
            // extra() is continuous and nondecreasing in the level: bisect for extra = left.
            let (mut low, mut high) = (0.0, top);
            for _ in 0..64 {
                let mid = (low + high) / 2.0;
                if extra(tenants, mid) <= left {
                    low = mid;
                } else {
                    high = mid;
                }
            }
            low
        };
        left -= extra(tenants, level);
        for tenant in tenants.values_mut().filter(in_band) {
            tenant.allotted = at(tenant, level);
        }
    }
}

/// Whole numbers summing to `total` as near `wanted` as can be: floors, then one more to the
/// largest remainders (ties: the earlier member). `wanted` sums to `total` (or less: the rest
/// goes by the same rule).
fn largest_remainder(total: u32, wanted: &[f64]) -> Vec<u32> {
    let mut whole: Vec<u32> = wanted.iter().map(|w| w.max(0.0).floor() as u32).collect();
    let given: u64 = whole.iter().map(|&w| u64::from(w)).sum();
    let mut left = u64::from(total).saturating_sub(given);
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by(|&a, &b| {
        let remainder = |i: usize| wanted[i].max(0.0) - wanted[i].max(0.0).floor();
        remainder(b).total_cmp(&remainder(a)).then(a.cmp(&b))
    });
    let mut i = 0;
    while left > 0 && !order.is_empty() {
        whole[order[i % order.len()]] += 1;
        left -= 1;
        i += 1;
    }
    // Float noise could have floored above the total: take back from the largest.
    while whole.iter().map(|&w| u64::from(w)).sum::<u64>() > u64::from(total) {
        let largest = (0..whole.len())
            .max_by_key(|&i| (whole[i], std::cmp::Reverse(i)))
            .unwrap_or(0);
        whole[largest] -= 1;
    }
    whole
}

/// What each replica may use now, given its target (see "What is safe to grant now").
fn grants(limit: u32, members: &[MemberLoad<'_>], targets: &[u32]) -> Vec<u32> {
    let committed: u64 = members.iter().map(|m| u64::from(m.commitment())).sum();
    let mut free = u64::from(limit).saturating_sub(committed);
    let mut grants: Vec<u32> = members
        .iter()
        .zip(targets)
        .map(|(member, &target)| target.min(member.commitment()))
        .collect();
    let lacking: Vec<(usize, u64)> = members
        .iter()
        .zip(targets)
        .enumerate()
        .filter(|(_, (member, target))| **target > member.commitment())
        .map(|(i, (member, &target))| (i, u64::from(target - member.commitment())))
        .collect();
    let lacking_total: u64 = lacking.iter().map(|&(_, lack)| lack).sum();
    if lacking_total <= free {
        for &(i, lack) in &lacking {
            grants[i] += lack as u32;
        }
        return grants;
    }
    // Not enough free yet: each grower gets its proportional part of what is free, rounded
    // down, then one each by largest lack until none is left.
    let mut given = vec![0u64; members.len()];
    for &(i, lack) in &lacking {
        given[i] = lack * free / lacking_total;
    }
    free -= given.iter().sum::<u64>();
    let mut by_lack = lacking.clone();
    by_lack.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    for &(i, lack) in by_lack.iter().cycle().take(by_lack.len()) {
        if free == 0 {
            break;
        }
        if given[i] < lack {
            given[i] += 1;
            free -= 1;
        }
    }
    for (i, extra) in given.into_iter().enumerate() {
        grants[i] += extra as u32;
    }
    grants
}

#[cfg(test)]
mod tests;
