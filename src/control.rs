//! The control loop's algorithm: an AIMD controller that tunes the global in-flight budget
//! against a p99 time-to-first-token target.
//!
//! Netflix's concurrency-limits split: the algorithm *computes* a number, the enforcer (the
//! scheduler) *applies* it. `Aimd::step` is a pure function of its state, the configuration
//! and one `Observation` per tick (p99 TTFT over the sliding window, see
//! `window`, how busy the budget was and, if scraped, how full the engines are, see
//! `engine`); it reads no clock and does no I/O, so a
//! test drives it tick by tick from a table. `tick` is the task that feeds it from the live
//! window and scheduler and hands the limit to the scheduler.
//!
//! Which TTFT it is fed is the enforcer's choice (`config::ControlSignal`): by default the
//! upstream's, from the moment a request got its slot, so queue wait never reads as a breach;
//! or the gateway's, queue wait included, as seed 001 ran it. The rules below hold for both.
//!
//! # The rules, and the lesson behind each (seed 001)
//!
//! Per tick, in this order:
//! 1. **Cooldown.** After a decrease, hold for `cooldown_ticks` ticks. The p99 window still
//!    holds samples from before the cut; reacting to them cuts again for a problem already
//!    handled, compounding the overshoot. The cooldown is after decreases *only*: holding
//!    after increases would cap the climb at one step per `1 + cooldown_ticks` ticks. Backing
//!    off is careful; climbing is eager.
//! 2. **Breach** (p99 above `target × (1 + band)`): decrease, multiplicatively (or by a fixed
//!    step) from the limit or from the peak in flight (plus the free slots the scheduler's
//!    headroom holds, as for a clamp below) if that is lower (but not under half the limit),
//!    never below the **floor**. A limit far above what is in use (at start-up, or
//!    after slow start) cut by 10 % would hold back nothing. Below a small batch the GPU is *less* efficient per
//!    token (the weights are read once per forward pass whatever the batch; continuous
//!    batching has nothing to pack), so throughput falls, a backlog forms, queue wait rises,
//!    and cutting further makes latency worse: the death spiral that parked seed 001's first
//!    controller at its floor with p99 at 17 s. The floor is the edge of the regime where
//!    cutting helps.
//! 3. **Engine saturated** (`engine_saturation` ≥ 1, when the engines' metrics are scraped,
//!    see `engine`): no increase, and a limit above the peak in flight (plus the free slots the
//!    scheduler's headroom holds for steady tenants) comes down to it (not below the floor). Slow start ends if at least half the limit was in flight: with most of
//!    it idle, the engines are full of other traffic (other replicas, a restart into a busy
//!    fleet), which says nothing about where this budget's knee is, and the budget should
//!    climb back fast once they have room. TTFT lags the KV-cache knee by seconds: sequences
//!    admitted under the knee keep growing their KV as they decode, and the latency shows
//!    only once the engine preempts. Without a leading signal, slow start doubled past the
//!    knee in that gap and the cold start's overshoot was the run's p99 (docs/lab.md). The
//!    clamp is not a cut: the requests in flight stay, only the headroom above them goes, so
//!    it restarts no window and starts no cooldown.
//! 4. **No samples, no opinion.** A window with fewer than `min_samples` samples says nothing
//!    about latency (a p99 of three samples is their maximum).
//! 5. **Comfortably under** (p99 below `target × (1 − band)`): add `increase_step` (double,
//!    while **slow start** lasts: until the first decrease with at least half the budget in
//!    flight, or a whole window in which traffic flowed and the budget covered it, counted
//!    once a first stream has ended), but only
//!    with **demand**, and
//!    never above the ceiling. Slow start is TCP's answer to a start far below the operating
//!    point: +1 per tick from 16 to the knee at ~140 takes two minutes at a 1 s tick. It is for
//!    a cold start only: a budget that has covered its traffic for a window has found *an*
//!    operating point, and a burst that then doubled it would get the engine's spare room at
//!    once, at the steady tenants' expense (TCP's congestion window validation, RFC 7661, stops
//!    an application-limited sender's window from growing for the same reason). Demand counts in-flight requests, not
//!    only queued ones: with a tight queue the healthy steady state has an empty queue, and a
//!    gate on "queue non-empty" stalled seed 001's controller below its operating point. And
//!    in-flight must be *near the limit* (Netflix's `inflight * 2 >= limit` guard): a low p99
//!    says nothing about a budget the traffic never used, and without the guard an idle or
//!    lightly loaded system drifts up to the ceiling, ready to let the next burst straight
//!    into KV-cache saturation.
//! 6. Otherwise (inside the **deadband**): hold. Without the band, p99 jittering around the
//!    target (1.9 s, 2.1 s, 1.95 s) flips the direction every tick.
//!
//! What the rules cannot fix on the gateway's signal: queue wait counts in its TTFT (the user
//! did wait), so a long queue timeout lets queue wait dominate the signal, and then every cut,
//! by slowing dispatch, lengthens the wait it is reacting to (seed 001's death spiral). Seed
//! 001's cure was a queue timeout of about a second; the upstream's signal removes the cause,
//! as a queue there is demand, not a breach. `control/tests.rs` replays both regimes on a
//! small plant model, with both signals.

pub mod engine;
pub mod scrape;
pub mod tick;
pub mod window;

use std::fmt;

use crate::config::{ControlConfig, ControlSignal};
use crate::observe::LabelValue;

/// The controller's settings, typed: `From<&ControlConfig>` is the only way to make them, so
/// `ControlConfig`'s defaults are the only defaults and `Policy::from_config` (its
/// `control_problems`) the only check. A knob `step` reads as configured is read from
/// `control`; the two whose form changes are here.
#[derive(Clone, Debug, PartialEq)]
pub struct AimdConfig {
    /// The target: p99 TTFT, seconds, of whichever TTFT the controller is fed
    /// (`control.signal` picks `upstream_target_p99_ttft_ms` or `target_p99_ttft_ms`).
    pub target_p99_ttft_seconds: f64,
    /// How to cut on a breach: `control.decrease_step` if set, else `control.decrease_factor`.
    pub decrease: Decrease,
    /// Every other knob, as configured: `band`, `increase_step`, `floor`, `ceiling`,
    /// `cooldown_ticks`, `demand_fraction`, `slow_start`, `min_samples` (see `ControlConfig`).
    pub control: ControlConfig,
}

/// How a breach cuts the budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decrease {
    /// Multiply by the factor (0 < f < 1), rounding down, by at least 1.
    Factor(f64),
    /// Subtract a fixed step (AISD). It does not scale with the budget: a step of 4 is 6% of
    /// 64 but 25% of 16 (seed 001 §4), so `Factor` is the default.
    Step(u32),
}

impl From<&ControlConfig> for AimdConfig {
    fn from(control: &ControlConfig) -> AimdConfig {
        let target_ms = match control.signal {
            ControlSignal::Upstream => control.upstream_target_p99_ttft_ms,
            ControlSignal::Gateway => control.target_p99_ttft_ms,
        };
        AimdConfig {
            target_p99_ttft_seconds: target_ms as f64 / 1000.0,
            decrease: match control.decrease_step {
                Some(step) => Decrease::Step(step),
                None => Decrease::Factor(control.decrease_factor),
            },
            control: control.clone(),
        }
    }
}

/// What the enforcer saw over one tick.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// p99 TTFT over the sliding window (overdue requests included, see `tick`); None if the
    /// window is empty.
    pub p99_ttft_seconds: Option<f64>,
    /// The most requests in flight at once during the tick (a peak, not a snapshot: a
    /// snapshot at tick time misses the bursts that reached the limit).
    pub peak_in_flight: u32,
    /// Requests waiting for a slot (at the tick, or better, the most at once during it).
    pub queued: u32,
    /// How many samples the p99 was taken over.
    pub samples: u64,
    /// The engines' saturation (`engine::saturation`, 1 or more is saturated); None when their
    /// metrics are not scraped, or no engine answered this tick.
    pub engine_saturation: Option<f64>,
    /// Free slots the scheduler's headroom holds for the steady tenants, at the tick
    /// (`scheduler::Load::held`): spoken for, though not yet in flight.
    pub held: u32,
    /// Whether any slot has been released since start-up: until a first stream ends, what is
    /// in flight has only risen, whatever level the traffic will settle at.
    pub stream_ended: bool,
}

/// What a tick did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Increase,
    Decrease,
    /// The engines are saturated: the limit came down to the peak in flight (plus the held
    /// slots).
    Clamp,
    Hold(Hold),
}

/// Why a tick left the limit alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// p99 within the deadband around the target.
    InBand,
    /// p99 comfortably under the target, but the traffic is not using the budget.
    NoDemand,
    /// The window holds fewer than `min_samples` samples.
    NoSamples,
    /// Waiting out the ticks after a decrease.
    Cooldown,
    /// Would increase, but the limit is at the ceiling.
    AtCeiling,
    /// Would decrease, but the limit is at the floor.
    AtFloor,
    /// The engines are saturated, and the limit is already no higher than the peak in flight
    /// (plus the held slots).
    EngineSaturated,
}

impl Action {
    /// Every action, for creating every metric series at start-up.
    pub const ALL: [Action; 10] = [
        Action::Increase,
        Action::Decrease,
        Action::Clamp,
        Action::Hold(Hold::InBand),
        Action::Hold(Hold::NoDemand),
        Action::Hold(Hold::NoSamples),
        Action::Hold(Hold::Cooldown),
        Action::Hold(Hold::AtCeiling),
        Action::Hold(Hold::AtFloor),
        Action::Hold(Hold::EngineSaturated),
    ];

    /// The metric label value; stable.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Increase => "increase",
            Action::Decrease => "decrease",
            Action::Clamp => "clamp_engine_saturated",
            Action::Hold(Hold::InBand) => "hold_in_band",
            Action::Hold(Hold::NoDemand) => "hold_no_demand",
            Action::Hold(Hold::NoSamples) => "hold_no_samples",
            Action::Hold(Hold::Cooldown) => "hold_cooldown",
            Action::Hold(Hold::AtCeiling) => "hold_at_ceiling",
            Action::Hold(Hold::AtFloor) => "hold_at_floor",
            Action::Hold(Hold::EngineSaturated) => "hold_engine_saturated",
        }
    }
}

impl LabelValue for Action {
    const ALL: &'static [Action] = &Action::ALL;

    fn label(self) -> &'static str {
        self.as_str()
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The controller's state: the current limit and the cooldown ticks left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aimd {
    limit: u32,
    cooldown_left: u32,
    /// Increases double (if the config has slow start on) until a decrease or clamp with the
    /// budget in use, or a covered window (`end_slow_start_once_covered`).
    slow_start: bool,
    /// Consecutive ticks in which traffic flowed and no request waited for want of a slot: a
    /// window of them ends slow start.
    covered_ticks: u32,
}

impl Aimd {
    /// Starts at `initial`, clamped to [floor, ceiling].
    pub fn new(initial: u32, config: &AimdConfig) -> Aimd {
        Aimd {
            // Not `clamp`: it panics if floor > ceiling, and an unvalidated config should
            // give a wrong number, not a crash. Ceiling wins.
            limit: initial
                .max(config.control.floor)
                .min(config.control.ceiling),
            cooldown_left: 0,
            slow_start: config.control.slow_start,
            covered_ticks: 0,
        }
    }

    /// The budget to enforce now.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Keeps the limit, moved into `config`'s bounds (a reload or the admin API changed the
    /// floor or ceiling): the controller's work survives a change of its settings.
    pub fn rebound(&mut self, config: &AimdConfig) {
        self.limit = self
            .limit
            .max(config.control.floor)
            .min(config.control.ceiling);
        // Slow start switched off ends it; switched on, it waits for a fresh start.
        self.slow_start &= config.control.slow_start;
    }

    /// One tick: observation in, new limit and what was done out.
    pub fn step(&mut self, config: &AimdConfig, observation: Observation) -> Action {
        self.end_slow_start_once_covered(config, observation);
        if self.cooldown_left > 0 {
            self.cooldown_left -= 1;
            return Action::Hold(Hold::Cooldown);
        }
        // NaN cannot come out of the window; if it ever does, it is no more a latency than an
        // empty window is.
        let p99 = observation
            .p99_ttft_seconds
            .filter(|p| !p.is_nan() && observation.samples >= config.control.min_samples);
        let target = config.target_p99_ttft_seconds;
        if p99.is_some_and(|p99| p99 > target * (1.0 + config.control.band)) {
            return self.decrease(config, observation.peak_in_flight, observation.held);
        }
        if observation.engine_saturation.is_some_and(|s| s >= 1.0) {
            return self.clamp(config, observation.peak_in_flight, observation.held);
        }
        let Some(p99) = p99 else {
            return Action::Hold(Hold::NoSamples);
        };
        if p99 < target * (1.0 - config.control.band) {
            if !self.has_demand(config, observation) {
                return Action::Hold(Hold::NoDemand);
            }
            if self.limit >= config.control.ceiling {
                return Action::Hold(Hold::AtCeiling);
            }
            let step = if self.slow_start {
                self.limit.max(config.control.increase_step)
            } else {
                config.control.increase_step
            };
            self.limit = self.limit.saturating_add(step).min(config.control.ceiling);
            return Action::Increase;
        }
        Action::Hold(Hold::InBand)
    }

    fn decrease(&mut self, config: &AimdConfig, peak_in_flight: u32, held: u32) -> Action {
        if self.limit <= config.control.floor {
            // Nothing was cut, so there are no stale samples to wait out: no cooldown.
            return Action::Hold(Hold::AtFloor);
        }
        self.end_slow_start_if_in_use(peak_in_flight);
        // Cut from what is in use, when that is less than the limit: a limit far above the
        // traffic (at start-up, or after slow start) cut by 10% would still not hold back the
        // requests that are overloading the upstream now. But from no less than half the
        // limit, so that one slow request among a handful in flight cannot take a healthy
        // limit to the floor. The slots the headroom holds count as in use, as for a clamp:
        // they are the steady tenants' next requests, and a cut from below them would take
        // them out of everyone else's part at each breach.
        let base = match peak_in_flight {
            0 => self.limit,
            peak => peak.saturating_add(held).clamp(self.limit / 2, self.limit),
        };
        let cut = match config.decrease {
            Decrease::Factor(factor) => {
                // Round down, with a nudge so float noise does not turn 10 × 0.7 into 6.
                (f64::from(base) * factor + 1e-9).floor() as u32
            }
            Decrease::Step(step) => base.saturating_sub(step),
        };
        // `as` saturates (NaN → 0); at least 1 less, or a factor near 1 would not cut.
        let cut = cut.min(self.limit - 1);
        self.limit = cut.max(config.control.floor);
        self.cooldown_left = config.control.cooldown_ticks;
        Action::Decrease
    }

    /// The engines are full: whatever the latency says yet, no room is left above what is in
    /// flight, and if this budget was in real use it has found the knee (slow start ends, as
    /// for a breach). The slots the scheduler's headroom holds stay: they are the steady
    /// tenants' next requests, already counted in the engines' load they usually carry, and
    /// clamping them away would shrink every other tenant's part by as much at each clamp
    /// (seed 001's sweep lost up to 6 % of its goodput with the first headroom, most likely to
    /// that, docs/lab.md). The price: while the steady tenants' expected need covers every
    /// free slot, the clamp holds rather than lowers, and the engines' overload is bounded by
    /// what is held for those tenants (at most their own spread, `margin_sigmas × √M`, and
    /// at most what their arrivals need until the next releases) instead of by what is in
    /// flight.
    fn clamp(&mut self, config: &AimdConfig, peak_in_flight: u32, held: u32) -> Action {
        self.end_slow_start_if_in_use(peak_in_flight);
        let in_use = peak_in_flight
            .saturating_add(held)
            .max(config.control.floor);
        if self.limit > in_use {
            self.limit = in_use;
            Action::Clamp
        } else {
            Action::Hold(Hold::EngineSaturated)
        }
    }

    /// A breach or saturation with the budget in real use (at least half of it in flight) ends
    /// slow start: the limit has found the knee's neighbourhood, and doubling from here would
    /// go straight back past it. One with most of it idle (a single slow request at light
    /// load, or engines filled by other traffic) says little about where the knee is.
    fn end_slow_start_if_in_use(&mut self, peak_in_flight: u32) {
        if peak_in_flight.saturating_mul(2) >= self.limit {
            self.slow_start = false;
        }
    }

    /// Slow start finds the operating point from a cold start. Once traffic has flowed for a
    /// whole window (`window_ms`) with the budget covering it (no request waited for want of a
    /// slot, however near the limit the peak came), the budget has been shown
    /// enough for the tenants it serves, and later demand is a change of load, not a cold
    /// start: it is probed for by steps. Doubling then hands a sudden burst the engine's
    /// spare room at once, and the steady tenants' first tokens slow down for as long as the
    /// burst's streams last (seed 000, docs/lab.md "Isolation without caps"). A tick with
    /// nothing in flight says nothing (a replica up before its traffic): it neither counts nor
    /// starts the count again. Nor does one before a first stream has ended: until then what
    /// is in flight is only what arrived within one hold time, still climbing to the
    /// traffic's level, and a window of it proves nothing. Seed 000's `heavy-steady` A, at
    /// 4 rps, had ramped for 10 s with no request waiting when slow start ended, then reached
    /// 55 in flight (its first streams ending only then, and decode slowing as the engine
    /// filled) against a budget of 64 that then grew by steps: its p99 was 2.9× its baseline.
    /// The first release is the budget's, not each tenant's: a tenant that starts ramping
    /// after others' streams have ended is a change of load like a burst, probed for by steps.
    fn end_slow_start_once_covered(&mut self, config: &AimdConfig, observation: Observation) {
        if !self.slow_start {
            return;
        }
        if observation.queued > 0 {
            self.covered_ticks = 0;
            return;
        }
        // Before a first stream ends, in flight is still climbing towards arrivals × hold
        // time (Little's law), so a window of it has not seen the traffic's level.
        if observation.peak_in_flight == 0 || !observation.stream_ended {
            return;
        }
        self.covered_ticks += 1;
        let window_ticks = config
            .control
            .window_ms
            .div_ceil(config.control.tick_ms.max(1))
            .max(1);
        if u64::from(self.covered_ticks) >= window_ticks {
            self.slow_start = false;
        }
    }

    /// Seed 001's gate (anything in flight or queued) and Netflix's (in flight near the
    /// limit), together: something queued is demand outright; otherwise the busiest moment of
    /// the tick must have used `demand_fraction` of the limit (and at least one slot, should
    /// the fraction of a small limit round to nothing).
    fn has_demand(&self, config: &AimdConfig, observation: Observation) -> bool {
        let Observation {
            peak_in_flight,
            queued,
            ..
        } = observation;
        let near_limit = (f64::from(self.limit) * config.control.demand_fraction).ceil();
        queued > 0 || (peak_in_flight > 0 && f64::from(peak_in_flight) >= near_limit)
    }
}

#[cfg(test)]
mod tests;
