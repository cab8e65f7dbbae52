//! One in-flight budget for every replica that shares a Redis store: one limit, one controller,
//! each replica holding a share.
//!
//! # Who owns the limit
//!
//! Every `fleet.sync_ms` each replica makes one call to Redis (`RedisStore::fleet_join`, off
//! the request path): it reports its load (per tenant: in flight and waiting, hashed), its TTFT
//! window as a histogram, and the limit it applies; it renews its membership (a heartbeat
//! lease) and reads its share. One replica holds the *leader lease* (with a fencing token).
//! The leader, with every sync:
//!
//! - once per `control.tick_ms`, steps the AIMD controller on the deployment's inputs: the p99
//!   of all replicas' TTFT windows merged bucket by bucket, their summed peak in flight, queue
//!   and held slots, whether any has seen a stream end, and the engines' saturation (the
//!   leader scrapes them). A new leader starts from
//!   the published limit, so the limit survives a change of leader;
//! - divides the limit among the live replicas (`share::divide`: by tenant across the
//!   deployment, then split by where each tenant's demand is), never granting a replica what
//!   another might still hold;
//! - publishes the decision with its fencing token (`fleet_publish`): a deposed leader's write
//!   is refused, so no two replicas ever apply conflicting limits.
//!
//! The others apply the grant their sync returns. A request never waits for any of this: it
//! admits against the local `Scheduler`, whose limit is this replica's share.
//!
//! # Membership
//!
//! A replica that stops syncing (SIGKILL) is dropped by the next sync after its
//! `member_ttl_ms`; its commitment stops counting and its share is handed on. A replica that
//! shuts down deliberately leaves at the end of its drain (if its streams ended within the drain
//! deadline; otherwise by its TTL, since what it admitted may still run upstream). A newcomer admits nothing until the
//! leader grants it a share (one or two syncs). A dead leader's lease lapses within
//! `leader_ttl_ms` and the next replica to sync takes it.
//!
//! # When Redis cannot be reached (or the fleet runs another policy)
//!
//! The replica runs alone on a local budget: its last share (`fleet.fallback: last_share`) or
//! the limit divided by the replicas it last saw (`split`), with its own controller whose
//! floor and ceiling are divided the same way. It logs the change once and counts it
//! (`tollgate_fleet_fallbacks_total`). It keeps trying every sync and rejoins when Redis
//! answers. In a partition the deployment may run up to the partitioned replicas' fallback
//! budgets over the limit, since the others no longer see them: the price of staying up.
//!
//! A replica whose policy hash differs from the live members' is refused (`Joined::
//! PolicyMismatch`): it writes nothing, so it corrupts nobody's view, and it runs alone the
//! same way, with `tollgate_fleet_standing{standing="refused"}` set.

pub mod share;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use crate::budget::redis::RedisStore;
use crate::budget::redis::fleet::{Heartbeat, Joined, MemberRecord, Publish, Published, View};
use crate::config::{ControlConfig, ControlSignal, FleetFallback};
use crate::control::scrape::Scraper;
use crate::control::window::{self, LatencyWindow};
use crate::control::{Action, Aimd, AimdConfig, Observation};
use crate::lifecycle::{Lifecycle, reached};
use crate::observe::{FleetCall, FleetStanding, Metrics};
use crate::policy::Policy;
use crate::scheduler::{Scheduler, Share, TenantKey};
use share::{FlowDemand, MemberLoad};

/// What a replica reports with each sync. JSON: the leader decodes every member's, the scripts
/// never look inside. A change of its shape changes `policy::FLEET_PROTOCOL`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub in_flight: u32,
    /// The limit it applies.
    pub applied: u32,
    /// The most in flight at once since its last report.
    pub peak_in_flight: u32,
    /// Requests waiting for want of a slot (`Load::waiting_for_slot`): the controller's demand.
    pub queued: u32,
    /// Free slots its headroom holds (`Load::held`), which an engine clamp leaves in place.
    pub held: u32,
    /// Whether a slot of its has been released since it started (`Observation::stream_ended`).
    pub stream_ended: bool,
    /// Its TTFT window (overdue requests counted), as `(bucket, count)` pairs.
    pub ttft: Vec<(u16, u64)>,
    pub flows: Vec<FlowDemand>,
}

/// What the leader publishes for one member beside its grant: its standby slots and its
/// tenants' overrides, as `[tenant, weight, reserved_slots, standby (0 or 1)]`.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct MemberPart {
    standby: u32,
    tenants: Vec<[u64; 4]>,
}

fn encode_overrides(overrides: &HashMap<TenantKey, Share>, standby: u32) -> String {
    let tenants = overrides
        .iter()
        .map(|(tenant, share)| {
            [
                tenant.0,
                u64::from(share.weight),
                u64::from(share.reserved_slots),
                u64::from(share.standby),
            ]
        })
        .collect();
    serde_json::to_string(&MemberPart { standby, tenants }).unwrap_or_default()
}

/// A member's overrides and standby slots; none for a value that does not decode.
fn decode_overrides(text: &str) -> (HashMap<TenantKey, Share>, u32) {
    let published: MemberPart = serde_json::from_str(text).unwrap_or_default();
    let overrides = published
        .tenants
        .into_iter()
        .map(|[tenant, weight, reserved, standby]| {
            (
                TenantKey(tenant),
                Share {
                    weight: u32::try_from(weight).unwrap_or(u32::MAX),
                    reserved_slots: u32::try_from(reserved).unwrap_or(u32::MAX),
                    standby: standby != 0,
                },
            )
        })
        .collect();
    (overrides, published.standby)
}

/// The budget a replica runs alone (see "When Redis cannot be reached"): `last_share` if it
/// held one (not 0) and the config prefers it, else `limit / replicas`, at least 1.
pub fn fallback_limit(
    fallback: FleetFallback,
    last_share: Option<u32>,
    limit: u32,
    replicas: u32,
) -> u32 {
    let split = (limit / replicas.max(1)).max(1);
    match (fallback, last_share) {
        // A share of 0 (all the demand was elsewhere) is no share to run alone on: traffic
        // reaches every replica once they stop coordinating.
        (FleetFallback::LastShare, Some(share)) if share > 0 => share,
        _ => split,
    }
}

/// Everything the task needs.
pub struct Fleet {
    /// The policy in force: a reload or a run-time setting replaces it, and the task reads the
    /// new one at its next sync, keeping its controller's limit.
    pub policy: watch::Receiver<Arc<Policy>>,
    pub store: RedisStore,
    pub member_id: String,
    pub scheduler: Arc<Scheduler>,
    pub ttft_window: Arc<Mutex<LatencyWindow>>,
    pub metrics: Metrics,
    pub lifecycle: watch::Receiver<Lifecycle>,
    /// Set once this replica's budget is settled: a share granted, or a local budget.
    pub budget_ready: watch::Sender<bool>,
    /// Set at shutdown when every stream ended within the drain deadline. Only then does the
    /// replica leave the fleet at once; otherwise requests it admitted may still run upstream,
    /// and its membership (and so its share) lapses by its TTL instead.
    pub drained: Arc<AtomicBool>,
}

/// The leader's own state, kept while it holds the lease under one fence.
struct Leadership {
    fence: u64,
    aimd: Aimd,
    window_epoch: u64,
    /// The highest sum of the members' reported peaks since the last control step.
    peak_in_flight: u32,
    /// Until then nobody's grant grows (`share::hold`): the leadership began without a
    /// published decision, so replicas may still run shares the leader cannot see yet (Redis
    /// restarted empty, or evicted the fleet's keys) until each has synced once, within a
    /// member TTL. A brand-new fleet waits the same: it cannot tell the two apart.
    quiet_until: Option<Instant>,
    /// The standby slots recent divisions asked (`share::StandbyHold`).
    standby: share::StandbyHold,
}

/// The local budget's controller while alone.
struct Alone {
    aimd: Aimd,
    config: AimdConfig,
}

/// What the task remembers between syncs.
struct Memory {
    standing: FleetStanding,
    members: u32,
    global_limit: u32,
    last_share: Option<u32>,
    window_epoch: Option<u64>,
    leadership: Option<Leadership>,
    alone: Option<Alone>,
    /// The most in flight here at once since the local controller last stepped.
    peak_in_flight: u32,
    /// Syncs made so far.
    syncs: u32,
    /// Syncs failed in a row: a replica falls back after `FAILURES_BEFORE_FALLBACK`, keeping
    /// its share meanwhile (the fleet still counts it until its membership lapses).
    failures: u32,
}

/// What the task derives from the policy, again whenever the policy is replaced.
struct Derived {
    config: AimdConfig,
    breach_threshold: Duration,
    sync: Duration,
    control_tick: Duration,
}

impl Derived {
    fn of(policy: &Policy) -> Derived {
        let control = &policy.control;
        let config = AimdConfig::from(control);
        Derived {
            breach_threshold: Duration::from_secs_f64(
                config.target_p99_ttft_seconds * (1.0 + control.band),
            ),
            config,
            sync: Duration::from_millis(policy.fleet.sync_ms),
            control_tick: Duration::from_millis(control.tick_ms),
        }
    }
}

impl Memory {
    /// The controllers' state kept across a change of policy: each limit moved into the new
    /// bounds; a controller switched on starts from the limit in force.
    fn rebound(&mut self, policy: &Policy, config: &AimdConfig, was_enabled: bool) {
        if let Some(leadership) = &mut self.leadership {
            if policy.control.enabled && !was_enabled {
                leadership.aimd = Aimd::new(self.global_limit, config);
            } else {
                leadership.aimd.rebound(config);
            }
        }
        // Run alone again from its current limit, with bounds divided from the new ones; a
        // controller switched on starts from the local budget in force (the static one).
        if let Some(alone) = self.alone.take() {
            let replicas = self.replicas(policy);
            let local = alone_config(&policy.control, replicas);
            let mut aimd = alone.aimd;
            if policy.control.enabled && !was_enabled {
                let in_force = fallback_limit(
                    policy.fleet.fallback,
                    self.last_share,
                    self.global_limit,
                    replicas,
                );
                aimd = Aimd::new(in_force, &local);
            }
            aimd.rebound(&local);
            self.alone = Some(Alone {
                aimd,
                config: local,
            });
        }
    }

    /// The replicas a local budget is divided by: those last seen, or the configured guess.
    fn replicas(&self, policy: &Policy) -> u32 {
        if self.members == 0 {
            policy.fleet.fallback_replicas
        } else {
            self.members
        }
    }
}

/// A controller run alone: the fleet's bounds divided as the limit was.
fn alone_config(control: &ControlConfig, replicas: u32) -> AimdConfig {
    let mut local = control.clone();
    local.floor = (control.floor / replicas.max(1)).max(1);
    local.ceiling = (control.ceiling / replicas.max(1)).max(local.floor);
    AimdConfig::from(&local)
}

/// One slow answer from a briefly busy Redis is not a partition.
pub const FAILURES_BEFORE_FALLBACK: u32 = 3;

impl Fleet {
    /// Runs until the server closes (after its drain: a draining replica still holds slots,
    /// so it keeps reporting them), then leaves the fleet.
    pub async fn run(mut self) {
        let mut policy = self.policy.borrow_and_update().clone();
        let mut derived = Derived::of(&policy);
        let scraper_for = |policy: &Policy| {
            let control = &policy.control;
            if control.enabled {
                Scraper::new(&control.engine)
            } else {
                None
            }
        };
        let mut scraper = scraper_for(&policy);
        let mut memory = Memory {
            // Not a member yet: a first sync that fails falls back at once.
            standing: FleetStanding::Alone,
            members: 0,
            global_limit: policy.scheduling.initial_limit,
            last_share: None,
            window_epoch: None,
            leadership: None,
            alone: None,
            peak_in_flight: 0,
            syncs: 0,
            failures: 0,
        };
        let mut ticks = tokio::time::interval(derived.sync);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut next_control = Instant::now() + derived.control_tick;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = reached(&mut self.lifecycle, Lifecycle::Closing) => break,
            }
            if self.policy.has_changed().unwrap_or(false) {
                let next = self.policy.borrow_and_update().clone();
                // `fleet.sync_ms` is restart-only (`live::RESTART_ONLY`): the ticks stay.
                derived = Derived::of(&next);
                if (&next.control.engine, next.control.enabled)
                    != (&policy.control.engine, policy.control.enabled)
                {
                    scraper = scraper_for(&next);
                }
                memory.rebound(&next, &derived.config, policy.control.enabled);
                policy = next;
            }
            let fleet = &policy.fleet;
            let control = &policy.control;
            let now = Instant::now();
            let control_due = control.enabled && now >= next_control;
            if control_due {
                next_control = now + derived.control_tick;
            }
            // The engines are read by whoever steps a controller: the leader (as of its last
            // sync) or a replica alone. Before the sync, so that a leader's publish follows its
            // read of the fleet by one round trip, not by a scrape as well.
            let steps_controller =
                memory.leadership.is_some() || memory.standing != FleetStanding::Member;
            let engine_saturation = match (&mut scraper, control_due && steps_controller) {
                (Some(scraper), true) => tokio::select! {
                    saturation = scraper.saturation(&self.metrics) => saturation,
                    () = reached(&mut self.lifecycle, Lifecycle::Closing) => break,
                },
                _ => None,
            };
            let report = self.report(now, derived.breach_threshold);
            memory.peak_in_flight = memory.peak_in_flight.max(report.peak_in_flight);
            let heartbeat = Heartbeat {
                fleet: &fleet.name,
                member: &self.member_id,
                policy_hash: &policy.hash,
                member_ttl: Duration::from_millis(fleet.member_ttl_ms),
                leader_ttl: Duration::from_millis(fleet.leader_ttl_ms),
                report: &serde_json::to_string(&report).unwrap_or_default(),
            };
            let joined = tokio::select! {
                joined = self.store.fleet_join(&heartbeat) => joined,
                () = reached(&mut self.lifecycle, Lifecycle::Closing) => break,
            };
            self.metrics
                .fleet_store_call(FleetCall::Join, joined.is_ok());
            match joined {
                Ok(Joined::Member(view)) => {
                    if memory.standing != FleetStanding::Member {
                        tracing::info!(
                            members = view.members,
                            member = %self.member_id,
                            "fleet: joined; the in-flight budget is shared again"
                        );
                    }
                    memory.standing = FleetStanding::Member;
                    memory.alone = None;
                    memory.failures = 0;
                    if control_due {
                        // The local peak feeds only a controller run alone: start it afresh.
                        memory.peak_in_flight = 0;
                    }
                    self.member(
                        &policy,
                        &mut memory,
                        view,
                        control_due,
                        engine_saturation,
                        &derived.config,
                    )
                    .await;
                }
                Ok(Joined::PolicyMismatch { fleet_policy }) => {
                    memory.failures = 0;
                    if memory.standing != FleetStanding::Refused {
                        tracing::error!(
                            member = %self.member_id,
                            ours = %policy.hash,
                            fleet = %fleet_policy,
                            "fleet: refused: the live replicas run another policy (tiers, \
                             weights, limits, scheduler or controller differ); running alone \
                             on a local budget until they agree"
                        );
                        self.metrics.fleet_fallback(true);
                    }
                    self.alone(
                        &policy,
                        &mut memory,
                        FleetStanding::Refused,
                        control_due,
                        engine_saturation,
                        now,
                    );
                }
                Err(error) => {
                    memory.failures += 1;
                    if memory.failures < FAILURES_BEFORE_FALLBACK
                        && memory.standing == FleetStanding::Member
                    {
                        tracing::debug!(%error, failures = memory.failures, "fleet: sync failed");
                        continue;
                    }
                    if memory.standing != FleetStanding::Fallback {
                        tracing::warn!(
                            %error,
                            "fleet: Redis cannot be reached; running alone on a local budget \
                             until it answers"
                        );
                        self.metrics.fleet_fallback(false);
                    }
                    self.alone(
                        &policy,
                        &mut memory,
                        FleetStanding::Fallback,
                        control_due,
                        engine_saturation,
                        now,
                    );
                }
            }
            let load = self.scheduler.load();
            memory.syncs += 1;
            // Ready with a share, or alone; or, at the latest, after a member TTL's worth of
            // syncs: the whole limit may be allotted to tenants backlogged elsewhere, and a
            // replica nobody routes to could never show the demand that earns it a share.
            if load.limit > 0
                || memory.standing != FleetStanding::Member
                || u64::from(memory.syncs) * fleet.sync_ms >= fleet.member_ttl_ms
            {
                self.budget_ready
                    .send_if_modified(|ready| !std::mem::replace(ready, true));
            }
            self.metrics.scheduler_load(load);
            let members = match memory.standing {
                FleetStanding::Member => memory.members.max(1),
                _ => 1,
            };
            self.metrics.fleet(
                memory.standing,
                members,
                memory.global_limit,
                memory.leadership.is_some(),
            );
        }
        if !self.drained.load(Ordering::SeqCst) {
            tracing::info!(
                member = %self.member_id,
                "fleet: streams were still open at the drain deadline; the membership lapses \
                 by its TTL instead of leaving now"
            );
            return;
        }
        let left = self
            .store
            .fleet_leave(&policy.fleet.name, &self.member_id)
            .await;
        self.metrics
            .fleet_store_call(FleetCall::Leave, left.is_ok());
        match left {
            Ok(()) => tracing::info!(member = %self.member_id, "fleet: left"),
            Err(error) => tracing::warn!(
                %error,
                "fleet: could not leave; the membership expires by itself"
            ),
        }
    }

    /// This replica's load now.
    fn report(&self, now: Instant, breach_threshold: Duration) -> Report {
        let load = self.scheduler.load();
        let ttft =
            window::lock(&self.ttft_window).histogram_counting_overdue(now, breach_threshold);
        Report {
            in_flight: load.in_flight,
            applied: load.limit,
            peak_in_flight: self.scheduler.take_peak_in_flight(),
            queued: load.waiting_for_slot(),
            held: load.held,
            stream_ended: load.released > 0,
            ttft,
            flows: self
                .scheduler
                .flows()
                .into_iter()
                .map(|flow| FlowDemand {
                    tenant: flow.tenant.0,
                    weight: flow.class.weight,
                    band: flow.class.band,
                    reserved: flow.class.reserved_slots,
                    in_flight: flow.in_flight,
                    queued: flow.queued,
                    cost: flow.mean_cost,
                })
                .collect(),
        }
    }

    /// A sync answered: lead if this replica holds the lease, then apply the share.
    async fn member(
        &self,
        policy: &Policy,
        memory: &mut Memory,
        view: View,
        control_due: bool,
        engine_saturation: Option<f64>,
        config: &AimdConfig,
    ) {
        memory.members = view.members;
        if let Some(decision) = view.decision {
            memory.global_limit = decision.limit;
            if memory
                .window_epoch
                .is_some_and(|seen| seen != decision.window_epoch)
            {
                // The leader cut the limit: judge the cut on requests dispatched after it.
                window::lock(&self.ttft_window).restart(Instant::now());
            }
            memory.window_epoch = Some(decision.window_epoch);
        }
        let Some(fence) = view.fence else {
            memory.leadership = None;
            if view.decision.is_some() {
                let grant = view.grant.unwrap_or(0);
                memory.last_share = Some(grant);
                let (overrides, standby) = decode_overrides(&view.overrides);
                self.scheduler
                    .set_share(grant, memory.global_limit, Some(overrides), standby);
            } else {
                // No decision yet: nobody has been granted anything; wait for the leader.
                self.scheduler.set_share(0, memory.global_limit, None, 0);
            }
            return;
        };
        let leadership = match memory.leadership.take() {
            Some(leadership) if leadership.fence == fence => leadership,
            _ => {
                // The published limit; without one (a new fleet, or a Redis that restarted
                // empty), the last this replica knew, so a lost store does not reset the
                // controller's work.
                let start = view.decision.map_or(memory.global_limit, |d| d.limit);
                tracing::info!(
                    member = %self.member_id,
                    fence,
                    limit = start,
                    members = view.members,
                    "fleet: took the leader lease"
                );
                self.metrics.fleet_leadership();
                Leadership {
                    fence,
                    aimd: Aimd::new(start, config),
                    window_epoch: view.decision.map_or(0, |d| d.window_epoch),
                    peak_in_flight: 0,
                    quiet_until: view.decision.is_none().then(|| {
                        Instant::now() + Duration::from_millis(policy.fleet.member_ttl_ms)
                    }),
                    standby: share::StandbyHold::default(),
                }
            }
        };
        let reports: Vec<(&MemberRecord, Report)> = view
            .reports
            .iter()
            .map(|record| {
                // Builds with another report format have another policy hash and are kept
                // out, so a report that does not decode is corrupt: count the member by what
                // it was handed alone.
                let report = serde_json::from_str(&record.report).unwrap_or_default();
                (record, report)
            })
            .collect();
        let mut leadership = leadership;
        self.lead(
            policy,
            &mut leadership,
            &reports,
            control_due,
            engine_saturation,
            config,
        );
        let limit = if policy.control.enabled {
            leadership.aimd.limit()
        } else {
            policy.scheduling.initial_limit
        };
        let loads: Vec<MemberLoad<'_>> = reports
            .iter()
            .map(|(record, report)| MemberLoad {
                member: &record.member,
                in_flight: report.in_flight,
                applied: report.applied,
                handed: record.handed,
                flows: &report.flows,
            })
            .collect();
        let now = Instant::now();
        let present: HashSet<u64> = loads
            .iter()
            .flat_map(|load| load.flows)
            .filter(|flow| flow.has_demand())
            .map(|flow| flow.tenant)
            .collect();
        let standby = share::Standby {
            miss: policy.fleet.standby_miss,
            at_least: leadership
                .standby
                .at(now, |tenant| present.contains(&tenant)),
        };
        let division = share::divide(limit, &loads, standby);
        leadership.standby.note(
            division.standby_asked,
            &division.standby_for,
            now,
            Duration::from_millis(policy.control.window_ms),
        );
        let mut shares = division.shares;
        if leadership
            .quiet_until
            .is_some_and(|until| Instant::now() < until)
        {
            shares = share::hold(shares, &loads);
        }
        let grants: Vec<(String, u32, String)> = shares
            .iter()
            .map(|s| {
                (
                    s.member.clone(),
                    s.grant,
                    encode_overrides(&s.overrides, s.standby),
                )
            })
            .collect();
        let publish = Publish {
            fleet: &policy.fleet.name,
            member: &self.member_id,
            fence,
            limit,
            window_epoch: leadership.window_epoch,
            grants: &grants,
            member_ttl: Duration::from_millis(policy.fleet.member_ttl_ms),
        };
        let published = self.store.fleet_publish(&publish).await;
        self.metrics
            .fleet_store_call(FleetCall::Publish, published.is_ok());
        match published {
            Ok(Published::Applied { .. }) => {
                memory.global_limit = limit;
                memory.window_epoch = Some(leadership.window_epoch);
                if let Some(own) = shares.iter().find(|s| s.member == self.member_id) {
                    memory.last_share = Some(own.grant);
                    self.scheduler.set_share(
                        own.grant,
                        limit,
                        Some(own.overrides.clone()),
                        own.standby,
                    );
                }
                memory.leadership = Some(leadership);
            }
            Ok(Published::Fenced) => {
                tracing::warn!(
                    member = %self.member_id,
                    fence,
                    "fleet: lost the leader lease before publishing; the new leader decides"
                );
            }
            Err(error) => {
                // Keep the lease state: the next sync tells whether it is still ours.
                tracing::debug!(%error, "fleet: publish failed");
                memory.leadership = Some(leadership);
            }
        }
    }

    /// The leader's control step: once per control tick, on the deployment's merged inputs.
    fn lead(
        &self,
        policy: &Policy,
        leadership: &mut Leadership,
        reports: &[(&MemberRecord, Report)],
        control_due: bool,
        engine_saturation: Option<f64>,
        config: &AimdConfig,
    ) {
        let reports: Vec<&Report> = reports.iter().map(|(_, report)| report).collect();
        let peak: u32 = reports.iter().map(|r| r.peak_in_flight).sum();
        leadership.peak_in_flight = leadership.peak_in_flight.max(peak);
        if !control_due {
            return;
        }
        let (p99, samples) =
            window::merged_quantile(reports.iter().map(|r| r.ttft.as_slice()), 0.99);
        let observation = Observation {
            p99_ttft_seconds: p99,
            peak_in_flight: std::mem::take(&mut leadership.peak_in_flight),
            queued: reports.iter().map(|r| r.queued).sum(),
            samples,
            engine_saturation,
            held: reports.iter().map(|r| r.held).sum(),
            stream_ended: reports.iter().any(|r| r.stream_ended),
        };
        let action = leadership.aimd.step(config, observation);
        if action == Action::Decrease && policy.control.signal == ControlSignal::Upstream {
            // Every member restarts its window when it sees the new epoch (see
            // `control::tick` for why the upstream signal judges a cut on its own effect).
            leadership.window_epoch += 1;
            window::lock(&self.ttft_window).restart(Instant::now());
        }
        self.metrics.controller_tick(action, p99);
        tracing::debug!(
            ?observation,
            ?action,
            limit = leadership.aimd.limit(),
            "fleet controller tick"
        );
    }

    /// Runs on a local budget (see "When Redis cannot be reached").
    fn alone(
        &self,
        policy: &Policy,
        memory: &mut Memory,
        standing: FleetStanding,
        control_due: bool,
        engine_saturation: Option<f64>,
        now: Instant,
    ) {
        memory.standing = standing;
        memory.leadership = None;
        let control = &policy.control;
        let fleet = &policy.fleet;
        let replicas = memory.replicas(policy);
        let alone = memory.alone.get_or_insert_with(|| {
            let limit = fallback_limit(
                fleet.fallback,
                memory.last_share,
                memory.global_limit,
                replicas,
            );
            let config = alone_config(control, replicas);
            tracing::info!(limit, replicas, "fleet: local budget");
            Alone {
                aimd: Aimd::new(limit, &config),
                config,
            }
        });
        if control_due {
            let breach_threshold = Duration::from_secs_f64(
                alone.config.target_p99_ttft_seconds * (1.0 + control.band),
            );
            let (p99, samples) = window::lock(&self.ttft_window).quantile_counting_overdue(
                now,
                0.99,
                breach_threshold,
            );
            let load = self.scheduler.load();
            let observation = Observation {
                p99_ttft_seconds: p99,
                peak_in_flight: std::mem::take(&mut memory.peak_in_flight).max(load.in_flight),
                queued: load.waiting_for_slot(),
                samples,
                engine_saturation,
                held: load.held,
                stream_ended: load.released > 0,
            };
            let action = alone.aimd.step(&alone.config, observation);
            self.metrics.controller_tick(action, p99);
        }
        let limit = if control.enabled {
            alone.aimd.limit()
        } else {
            fallback_limit(
                fleet.fallback,
                memory.last_share,
                memory.global_limit,
                replicas,
            )
        };
        self.scheduler
            .set_share(limit, limit, Some(HashMap::new()), 0);
    }
}

#[cfg(test)]
mod tests;
