//! Controller traces: observations in, actions and limits out, as tables. No clocks, no I/O.
//!
//! The last section replays seed 001 on a small plant model of a gateway in front of vLLM, to
//! show the rules hold the SLO without the death spiral, and that the same test catches the
//! spiral when it is there.

use std::collections::VecDeque;

use super::*;
use crate::config::Config;
use crate::policy::Policy;

/// Seed 001's final controller, which these tables were written against: a 2 s target, 3 ticks
/// of cooldown after a cut, no slow start, an opinion from one sample, and `ControlConfig`'s
/// defaults otherwise. Seed 001 held the gateway's TTFT; `Aimd::step` does not read the signal
/// (`tick` does), so the 2 s target is given as the upstream's here, which lets the variants
/// below drop the cooldown and still pass the configuration's checks.
fn seed_001() -> ControlConfig {
    ControlConfig {
        upstream_target_p99_ttft_ms: 2_000,
        cooldown_ticks: 3,
        slow_start: false,
        min_samples: 1,
        ..ControlConfig::default()
    }
}

fn config() -> AimdConfig {
    AimdConfig::from(&seed_001())
}

/// Seed 001's controller changed by `edit`, checked as a configuration is.
#[track_caller]
fn with(edit: impl FnOnce(&mut ControlConfig)) -> AimdConfig {
    let mut control = seed_001();
    edit(&mut control);
    let config = Config {
        control: control.clone(),
        ..Config::default()
    };
    if let Err(problems) = Policy::from_config(&config) {
        panic!("not a valid test config: {problems}");
    }
    AimdConfig::from(&control)
}

/// Sets the knobs that make `decrease`.
fn cut_by(control: &mut ControlConfig, decrease: Decrease) {
    match decrease {
        Decrease::Factor(factor) => {
            control.decrease_factor = factor;
            control.decrease_step = None;
        }
        Decrease::Step(step) => control.decrease_step = Some(step),
    }
}

/// An observation with p99 `p99` seconds.
fn seen(p99: f64, peak_in_flight: u32, queued: u32) -> Observation {
    Observation {
        p99_ttft_seconds: Some(p99),
        peak_in_flight,
        queued,
        samples: 100,
        engine_saturation: None,
        held: 0,
        stream_ended: true,
    }
}

/// `seen`, with the engines' saturation scraped.
fn engine(saturation: f64, observation: Observation) -> Observation {
    Observation {
        engine_saturation: Some(saturation),
        ..observation
    }
}

const NO_SAMPLES: Observation = Observation {
    p99_ttft_seconds: None,
    peak_in_flight: 0,
    queued: 0,
    samples: 0,
    engine_saturation: None,
    held: 0,
    stream_ended: true,
};

/// p99 comfortably under, on the SLO, and in breach of the default 2 s ± 20% target.
const FAST: f64 = 0.5;
const ON_TARGET: f64 = 2.0;
const SLOW: f64 = 5.0;

const INCREASE: Action = Action::Increase;
const DECREASE: Action = Action::Decrease;
const IN_BAND: Action = Action::Hold(Hold::InBand);
const NO_DEMAND: Action = Action::Hold(Hold::NoDemand);
const COOLDOWN: Action = Action::Hold(Hold::Cooldown);
const AT_CEILING: Action = Action::Hold(Hold::AtCeiling);
const AT_FLOOR: Action = Action::Hold(Hold::AtFloor);

/// Runs `steps` from `initial`: each row is (observation, expected action, expected limit
/// after the tick).
fn trace(config: &AimdConfig, initial: u32, steps: &[(Observation, Action, u32)]) {
    let mut aimd = Aimd::new(initial, config);
    for (tick, &(observation, action, limit)) in steps.iter().enumerate() {
        let got = aimd.step(config, observation);
        assert_eq!(
            (got, aimd.limit()),
            (action, limit),
            "tick {tick}: {observation:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The rules, tick by tick

#[test]
fn climbs_one_step_per_tick_while_fast_and_busy() {
    let config = config();
    // In flight at the limit each tick, queue empty: the healthy steady state of seed 001 §3.
    let steps: Vec<_> = (0..10)
        .map(|i| (seen(FAST, 64 + i, 0), INCREASE, 65 + i))
        .collect();
    trace(&config, 64, &steps);

    let config = with(|c| c.increase_step = 4);
    trace(
        &config,
        64,
        &[
            (seen(FAST, 64, 0), INCREASE, 68),
            (seen(FAST, 68, 0), INCREASE, 72),
            // Something queued is demand even with in-flight low (the scheduler is between
            // dispatches).
            (seen(FAST, 3, 1), INCREASE, 76),
        ],
    );
}

#[test]
fn no_cooldown_after_an_increase() {
    // Climbing is eager (seed 001 §5): increase, increase, increase, with no hold between.
    let config = with(|c| c.cooldown_ticks = 10);
    trace(
        &config,
        40,
        &[
            (seen(FAST, 40, 0), INCREASE, 41),
            (seen(FAST, 41, 0), INCREASE, 42),
            (seen(FAST, 42, 0), INCREASE, 43),
        ],
    );
}

#[test]
fn holds_in_the_band() {
    let config = config();
    // Default band: [1.6, 2.4] seconds, both ends included.
    for p99 in [1.6, 1.61, 1.9, ON_TARGET, 2.1, 2.39, 2.4] {
        trace(&config, 100, &[(seen(p99, 100, 5), IN_BAND, 100)]);
    }
    // Just outside on either side acts.
    trace(&config, 100, &[(seen(1.599, 100, 5), INCREASE, 101)]);
    trace(&config, 100, &[(seen(2.401, 100, 5), DECREASE, 90)]);
    // A zero band still holds exactly on target.
    let config = with(|c| c.band = 0.0);
    trace(&config, 100, &[(seen(ON_TARGET, 100, 5), IN_BAND, 100)]);
}

#[test]
fn jitter_around_the_target_does_not_flip_the_direction() {
    // Seed 001 §5: 1.9 s, 2.1 s, 1.95 s flipped the controller every tick without a band.
    let config = config();
    let steps: Vec<_> = [1.9, 2.1, 1.95, 2.3, 1.7, 2.05, 1.8, 2.2]
        .into_iter()
        .map(|p99| (seen(p99, 100, 3), IN_BAND, 100))
        .collect();
    trace(&config, 100, &steps);
}

#[test]
fn decreases_on_a_breach() {
    // (decrease, limit before, limit after)
    let cases = [
        (Decrease::Factor(0.9), 100, 90),
        (Decrease::Factor(0.9), 255, 229),
        (Decrease::Factor(0.9), 256, 230),
        // Clamped to the floor (32): 33 × 0.9 = 29.7.
        (Decrease::Factor(0.9), 33, 32),
        (Decrease::Factor(0.5), 128, 64),
        (Decrease::Factor(0.7), 100, 70),
        // A factor so close to 1 that rounding down would not move still cuts by one.
        (Decrease::Factor(0.999_999), 100, 99),
        (Decrease::Step(4), 100, 96),
        (Decrease::Step(4), 34, 32),
        (Decrease::Step(1000), 200, 32),
    ];
    for (decrease, before, after) in cases {
        let config = with(|c| cut_by(c, decrease));
        let mut aimd = Aimd::new(before, &config);
        assert_eq!(
            (aimd.step(&config, seen(SLOW, before, 10)), aimd.limit()),
            (DECREASE, after),
            "{decrease:?} from {before}"
        );
    }
}

#[test]
fn at_the_floor_a_breach_holds_without_a_cooldown() {
    let config = config();
    trace(
        &config,
        33,
        &[
            (seen(SLOW, 33, 10), DECREASE, 32),
            (seen(SLOW, 32, 10), COOLDOWN, 32),
            (seen(SLOW, 32, 10), COOLDOWN, 32),
            (seen(SLOW, 32, 10), COOLDOWN, 32),
            (seen(SLOW, 32, 10), AT_FLOOR, 32),
            // Nothing was cut, so nothing to wait out: the next fast tick climbs at once.
            (seen(FAST, 32, 10), INCREASE, 33),
        ],
    );
}

#[test]
fn waits_out_exactly_the_cooldown_then_acts_again() {
    for cooldown_ticks in [0, 1, 3, 7] {
        let config = with(|c| c.cooldown_ticks = cooldown_ticks);
        let mut aimd = Aimd::new(200, &config);
        assert_eq!(aimd.step(&config, seen(SLOW, 200, 10)), DECREASE);
        assert_eq!(aimd.limit(), 180);
        // Breaching, fast, empty: it holds whatever it sees.
        let during = [seen(SLOW, 180, 10), seen(FAST, 180, 10), NO_SAMPLES];
        for tick in 0..cooldown_ticks {
            let observation = during[tick as usize % during.len()];
            assert_eq!(
                aimd.step(&config, observation),
                COOLDOWN,
                "cooldown {cooldown_ticks}, tick {tick}"
            );
            assert_eq!(aimd.limit(), 180);
        }
        // Then it acts on the next tick.
        assert_eq!(
            aimd.step(&config, seen(SLOW, 180, 10)),
            DECREASE,
            "{cooldown_ticks}"
        );
        assert_eq!(aimd.limit(), 162);
    }
}

#[test]
fn slow_start_doubles_until_the_first_breach_then_adds_steps() {
    let config = with(|c| {
        c.slow_start = true;
        c.cooldown_ticks = 0;
    });
    trace(
        &config,
        32,
        &[
            (seen(FAST, 32, 4), INCREASE, 64),
            (seen(FAST, 64, 4), INCREASE, 128),
            // Doubling stops at the ceiling like any increase.
            (seen(FAST, 128, 0), INCREASE, 256),
            (seen(FAST, 256, 0), AT_CEILING, 256),
            // The first breach ends slow start (and cuts from the 160 in flight).
            (seen(SLOW, 160, 0), DECREASE, 144),
            (seen(FAST, 144, 1), INCREASE, 145),
            (seen(FAST, 145, 1), INCREASE, 146),
        ],
    );
    // Without demand slow start does not double either.
    trace(&config, 32, &[(seen(FAST, 3, 0), NO_DEMAND, 32)]);
    // A breach with most of the budget idle (one slow request at light load) is no knee:
    // slow start goes on after it.
    trace(
        &config,
        128,
        &[
            (seen(SLOW, 5, 0), DECREASE, 57),
            (seen(FAST, 57, 3), INCREASE, 114),
            (seen(SLOW, 114, 0), DECREASE, 102),
            (seen(FAST, 102, 3), INCREASE, 103),
        ],
    );
}

#[test]
fn a_window_of_traffic_the_budget_covers_ends_slow_start() {
    // A 6 s window at 1 s ticks: 6 ticks make a window.
    let config = with(|c| {
        c.slow_start = true;
        c.cooldown_ticks = 0;
        c.window_ms = 6_000;
    });
    let covered = (seen(FAST, 20, 0), NO_DEMAND, 64);
    let idle = (seen(FAST, 0, 0), NO_DEMAND, 64);
    let burst = seen(FAST, 64, 2);
    // Six covered ticks: the burst after them is probed for by steps, not doubled into.
    let mut steps = vec![covered; 6];
    steps.extend([(burst, INCREASE, 65), (seen(FAST, 65, 2), INCREASE, 66)]);
    trace(&config, 64, &steps);
    // Five are not a window: the burst doubles.
    let mut steps = vec![covered; 5];
    steps.push((burst, INCREASE, 128));
    trace(&config, 64, &steps);
    // A tick at the limit with nothing waiting for a slot is covered too (the budget was
    // enough), though the demand gate grows the limit by a step.
    let mut steps = vec![covered; 5];
    steps.push((seen(FAST, 64, 0), INCREASE, 65));
    trace(&config, 64, &steps);
    // A request waiting for a slot in between starts the count again.
    let mut steps = vec![covered; 5];
    steps.push((seen(FAST, 64, 1), INCREASE, 128));
    steps.extend(vec![(seen(FAST, 20, 0), NO_DEMAND, 128); 5]);
    steps.push((seen(FAST, 128, 3), INCREASE, 256));
    trace(&config, 64, &steps);
    // Ticks with nothing in flight say nothing (a replica up before its traffic), whatever
    // the latency rule does with them.
    let mut steps = vec![idle; 10];
    steps.extend([
        (NO_SAMPLES, Action::Hold(Hold::NoSamples), 64),
        (burst, INCREASE, 128),
    ]);
    trace(&config, 64, &steps);
    // Nor do they start the count again: covered, idle, covered makes a window.
    let mut steps = vec![covered; 3];
    steps.extend([idle; 4]);
    steps.extend([covered; 3]);
    steps.push((burst, INCREASE, 65));
    trace(&config, 64, &steps);
    // Covered ticks count whatever the latency: a window in the deadband ends it too.
    let mut steps = vec![(seen(ON_TARGET, 20, 0), IN_BAND, 64); 6];
    steps.push((burst, INCREASE, 65));
    trace(&config, 64, &steps);
    // Nor do ticks before a first stream has ended: a tenant ramping up still has in flight
    // only what arrived within one hold time (seed 000's heavy-steady A, 10 s of ramp, then
    // 55 in flight once decode slowed, against a budget of 64). A window counts from the tick
    // that saw a release; its ramp reaching the limit before then doubles.
    let ramping = |in_flight| Observation {
        stream_ended: false,
        ..seen(FAST, in_flight, 0)
    };
    let mut steps: Vec<_> = (0..10u32)
        .map(|tick| (ramping(4 * tick + 4), NO_DEMAND, 64))
        .collect();
    steps.push((seen(FAST, 54, 0), INCREASE, 128));
    trace(&config, 64, &steps);
    let mut steps: Vec<_> = (0..10u32)
        .map(|tick| (ramping(2 * tick + 2), NO_DEMAND, 64))
        .collect();
    steps.extend([covered; 5]);
    steps.push((burst, INCREASE, 128));
    steps.extend([(seen(FAST, 20, 0), NO_DEMAND, 128); 6]);
    steps.push((seen(FAST, 128, 2), INCREASE, 129));
    trace(&config, 64, &steps);
}

#[test]
fn an_engine_clamp_leaves_the_slots_the_headroom_holds() {
    let config = with(|c| c.cooldown_ticks = 0);
    let held = |held, observation| Observation {
        held,
        ..observation
    };
    trace(
        &config,
        160,
        &[
            // 118 in flight, 16 held free for the steady tenants: the limit comes down to 134,
            // not to 118 (from where the held slots would come out of everyone else's part).
            (
                held(16, engine(1.1, seen(FAST, 118, 0))),
                Action::Clamp,
                134,
            ),
            // Nothing above that to take: hold.
            (
                held(16, engine(1.1, seen(FAST, 118, 0))),
                Action::Hold(Hold::EngineSaturated),
                134,
            ),
            // Without held slots, down to what is in flight.
            (held(0, engine(1.1, seen(FAST, 120, 0))), Action::Clamp, 120),
        ],
    );
    // Held slots that cover every free one (the steady tenants' expected need is more than
    // what is free): the clamp holds rather than lowers.
    trace(
        &config,
        140,
        &[(
            held(20, engine(1.1, seen(FAST, 120, 0))),
            Action::Hold(Hold::EngineSaturated),
            140,
        )],
    );
}

#[test]
fn saturated_engines_end_slow_start_and_take_the_headroom_above_what_is_in_flight() {
    let config = with(|c| {
        c.slow_start = true;
        c.cooldown_ticks = 0;
    });
    const CLAMP: Action = Action::Clamp;
    const SATURATED: Action = Action::Hold(Hold::EngineSaturated);
    trace(
        &config,
        64,
        &[
            // Under saturation the engine signal changes nothing: slow start doubles.
            (engine(0.5, seen(FAST, 64, 4)), INCREASE, 128),
            // Full engines with fast first tokens (the KV cache fills before latency shows
            // it): no doubling, and the limit comes down to the 120 in flight.
            (engine(1.05, seen(FAST, 120, 0)), CLAMP, 120),
            // Still full, nothing above the peak to take: hold.
            (engine(1.0, seen(FAST, 120, 3)), SATURATED, 120),
            // Room again: +1, not a doubling, since slow start is over.
            (engine(0.9, seen(FAST, 120, 3)), INCREASE, 121),
            // A breach still cuts, saturated or not, and before the clamp would.
            (engine(2.0, seen(SLOW, 121, 0)), DECREASE, 108),
            // Without samples the engines still count.
            (engine(1.5, NO_SAMPLES), CLAMP, config.control.floor),
            (engine(1.5, NO_SAMPLES), SATURATED, config.control.floor),
            // Unknown saturation (no engine answered) is no opinion: the latency rules act.
            (seen(FAST, 40, 0), INCREASE, config.control.floor + 1),
        ],
    );
    // Saturated by other traffic, with this budget mostly idle (a replica restarted into a
    // busy fleet): the headroom goes, but slow start stays, to climb back fast.
    trace(
        &config,
        128,
        &[
            (engine(1.2, seen(FAST, 40, 0)), CLAMP, 40),
            (engine(0.5, seen(FAST, 40, 2)), INCREASE, 80),
            // With the budget in real use, saturation ends slow start.
            (engine(1.0, seen(FAST, 70, 0)), CLAMP, 70),
            (engine(0.5, seen(FAST, 70, 2)), INCREASE, 71),
        ],
    );
    // The clamp never goes under the floor, and never above the limit.
    trace(
        &config,
        100,
        &[
            (engine(1.0, seen(FAST, 3, 0)), CLAMP, config.control.floor),
            (
                engine(1.0, seen(FAST, 500, 0)),
                SATURATED,
                config.control.floor,
            ),
        ],
    );
    // The gateway signal's cooldown after a cut holds the engine rule back too.
    let config = with(|c| c.cooldown_ticks = 1);
    trace(
        &config,
        100,
        &[
            (seen(SLOW, 100, 0), DECREASE, 90),
            (engine(1.5, seen(FAST, 50, 0)), COOLDOWN, 90),
            (engine(1.5, seen(FAST, 50, 0)), CLAMP, 50),
        ],
    );
}

#[test]
fn a_breach_cuts_from_what_is_in_flight_when_that_is_under_the_limit() {
    let config = with(|c| c.cooldown_ticks = 0);
    trace(
        &config,
        256,
        &[
            // 170 in flight under a limit of 256: 10% off the limit would hold nothing back.
            (seen(SLOW, 170, 0), DECREASE, 153),
            // More in flight than the limit (a cut does not preempt): from the limit.
            (seen(SLOW, 200, 0), DECREASE, 137),
            // Nothing in flight this tick (a breach from samples alone): from the limit.
            (seen(SLOW, 0, 0), DECREASE, 123),
        ],
    );
    // The slots the headroom holds free for the steady tenants count as in use: 128 in flight
    // and 6 held under a limit of 140 cut from 134, not from 128 (which would take the held
    // slots out of the others' part at every breach, as a clamp would).
    let held = |held, observation| Observation {
        held,
        ..observation
    };
    trace(
        &config,
        140,
        &[
            (held(6, seen(SLOW, 128, 0)), DECREASE, 120),
            (seen(SLOW, 108, 0), DECREASE, 97),
            // Held slots that cover every free one: from the limit, no higher.
            (held(40, seen(SLOW, 90, 0)), DECREASE, 87),
        ],
    );
    let by_step = with(|c| {
        c.cooldown_ticks = 0;
        cut_by(c, Decrease::Step(10));
    });
    trace(&by_step, 256, &[(seen(SLOW, 170, 0), DECREASE, 160)]);
    // From no less than half the limit: one slow request among a few in flight (50 × 0.9).
    trace(&config, 100, &[(seen(SLOW, 1, 0), DECREASE, 45)]);
    // Never below the floor, and always at least one below the limit.
    trace(&config, 40, &[(seen(SLOW, 40, 0), DECREASE, 36)]);
    trace(&config, 34, &[(seen(SLOW, 20, 0), DECREASE, 32)]);
    let gentle = with(|c| {
        c.cooldown_ticks = 0;
        cut_by(c, Decrease::Factor(0.99));
    });
    trace(&gentle, 50, &[(seen(SLOW, 50, 0), DECREASE, 49)]);
}

#[test]
fn too_few_samples_hold_whatever_they_say() {
    let config = with(|c| c.min_samples = 10);
    let nine_slow = Observation {
        samples: 9,
        ..seen(SLOW, 100, 0)
    };
    let ten_slow = Observation {
        samples: 10,
        ..seen(SLOW, 100, 0)
    };
    let nine_fast = Observation {
        samples: 9,
        ..seen(FAST, 100, 5)
    };
    trace(
        &config,
        100,
        &[
            (nine_slow, Action::Hold(Hold::NoSamples), 100),
            (nine_fast, Action::Hold(Hold::NoSamples), 100),
            (ten_slow, DECREASE, 90),
        ],
    );
}

#[test]
fn an_empty_window_holds() {
    let config = config();
    let nan = Observation {
        p99_ttft_seconds: Some(f64::NAN),
        ..seen(0.0, 100, 10)
    };
    trace(
        &config,
        100,
        &[
            (NO_SAMPLES, Action::Hold(Hold::NoSamples), 100),
            (nan, Action::Hold(Hold::NoSamples), 100),
            // An infinite p99 is a breach, not an absence.
            (seen(f64::INFINITY, 100, 0), DECREASE, 90),
        ],
    );
}

#[test]
fn the_demand_gate_counts_in_flight_near_the_limit() {
    // Limit 100, default demand_fraction 0.8: in flight must reach 80, or something queued.
    // (peak in flight, queued, action)
    let cases = [
        (100, 0, INCREASE),
        (80, 0, INCREASE),
        (79, 0, NO_DEMAND),
        (10, 0, NO_DEMAND),
        (0, 0, NO_DEMAND),
        (0, 1, INCREASE),
        (10, 2, INCREASE),
        // A peak above the limit (the limit just dropped under requests already in flight).
        (150, 0, INCREASE),
    ];
    let config = config();
    for (peak, queued, action) in cases {
        let mut aimd = Aimd::new(100, &config);
        assert_eq!(
            aimd.step(&config, seen(FAST, peak, queued)),
            action,
            "peak {peak}, queued {queued}"
        );
    }
    // The fraction rounds up: ceil(33 × 0.8) = 27.
    let config = with(|c| c.floor = 1);
    for (peak, action) in [(27, INCREASE), (26, NO_DEMAND)] {
        let mut aimd = Aimd::new(33, &config);
        assert_eq!(aimd.step(&config, seen(FAST, peak, 0)), action, "{peak}");
    }
    // demand_fraction 1: only a full budget (or a queue) is demand.
    let config = with(|c| c.demand_fraction = 1.0);
    for (peak, action) in [(100, INCREASE), (99, NO_DEMAND)] {
        let mut aimd = Aimd::new(100, &config);
        assert_eq!(aimd.step(&config, seen(FAST, peak, 0)), action, "{peak}");
    }
}

#[test]
fn does_not_drift_up_without_demand() {
    let config = config();
    // (what the traffic looks like, observation every tick)
    let cases = [
        ("idle, empty window", NO_SAMPLES),
        ("idle, old fast samples", seen(FAST, 0, 0)),
        ("light load far under the limit", seen(0.3, 20, 0)),
        ("steady load just under the gate", seen(0.3, 79, 0)),
    ];
    for (name, observation) in cases {
        let mut aimd = Aimd::new(100, &config);
        for _ in 0..1000 {
            aimd.step(&config, observation);
        }
        assert_eq!(aimd.limit(), 100, "{name}");
    }
}

#[test]
fn stops_at_the_ceiling() {
    let config = with(|c| c.increase_step = 4);
    trace(
        &config,
        250,
        &[
            (seen(FAST, 250, 3), INCREASE, 254),
            (seen(FAST, 254, 3), INCREASE, 256),
            (seen(FAST, 256, 3), AT_CEILING, 256),
            // No demand is the more telling reason when both hold.
            (seen(FAST, 0, 0), NO_DEMAND, 256),
        ],
    );
}

#[test]
fn new_clamps_the_initial_limit() {
    let config = config();
    for (initial, limit) in [
        (0, 32),
        (31, 32),
        (32, 32),
        (100, 100),
        (256, 256),
        (9999, 256),
    ] {
        assert_eq!(Aimd::new(initial, &config).limit(), limit, "{initial}");
    }
    // An unchecked config with floor above ceiling gives a number, not a panic.
    let broken = AimdConfig::from(&ControlConfig {
        floor: 100,
        ceiling: 10,
        ..seed_001()
    });
    assert_eq!(Aimd::new(50, &broken).limit(), 10);
}

#[test]
fn action_labels_are_stable() {
    let labels = Action::ALL.map(Action::as_str);
    assert_eq!(
        labels,
        [
            "increase",
            "decrease",
            "clamp_engine_saturated",
            "hold_in_band",
            "hold_no_demand",
            "hold_no_samples",
            "hold_cooldown",
            "hold_at_ceiling",
            "hold_at_floor",
            "hold_engine_saturated",
        ]
    );
    assert_eq!(Action::Hold(Hold::Cooldown).to_string(), "hold_cooldown");
}

/// A tiny deterministic generator.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u32 {
        (self.next() % n) as u32
    }
}

#[test]
fn never_leaves_floor_and_ceiling_whatever_it_sees() {
    let mut lcg = Lcg(2024);
    for run in 0..200 {
        let floor = 1 + lcg.below(64);
        let config = with(|c| {
            c.floor = floor;
            c.ceiling = floor + lcg.below(300);
            c.increase_step = 1 + lcg.below(8);
            let decrease = if lcg.below(2) == 0 {
                Decrease::Factor(f64::from(1 + lcg.below(98)) / 100.0)
            } else {
                Decrease::Step(1 + lcg.below(50))
            };
            cut_by(c, decrease);
            c.cooldown_ticks = lcg.below(5);
            c.band = f64::from(lcg.below(50)) / 100.0;
            c.demand_fraction = f64::from(1 + lcg.below(100)) / 100.0;
            c.slow_start = lcg.below(2) == 0;
            c.min_samples = u64::from(1 + lcg.below(20));
        });
        let mut aimd = Aimd::new(lcg.below(1000), &config);
        for tick in 0..500 {
            let p99 = match lcg.below(10) {
                0 => None,
                1 => Some(f64::INFINITY),
                2 => Some(0.0),
                _ => Some(f64::from(lcg.below(10_000)) / 1000.0),
            };
            let observation = Observation {
                p99_ttft_seconds: p99,
                peak_in_flight: lcg.below(u64::from(config.control.ceiling) * 2 + 1),
                queued: if lcg.below(3) == 0 { lcg.below(20) } else { 0 },
                samples: u64::from(lcg.below(30)),
                engine_saturation: match lcg.below(4) {
                    0 => None,
                    _ => Some(f64::from(lcg.below(300)) / 100.0),
                },
                held: if lcg.below(3) == 0 { lcg.below(40) } else { 0 },
                stream_ended: lcg.below(4) != 0,
            };
            let before = aimd.limit();
            let action = aimd.step(&config, observation);
            let after = aimd.limit();
            let context = format!("run {run}, tick {tick}: {config:?} {observation:?}");
            assert!(
                (config.control.floor..=config.control.ceiling).contains(&after),
                "{after}: {context}"
            );
            match action {
                Action::Increase => {
                    // At most one step, or a doubling while slow start lasts.
                    let most = if config.control.slow_start {
                        before.max(config.control.increase_step)
                    } else {
                        config.control.increase_step
                    };
                    assert!(after > before && after - before <= most, "{context}")
                }
                Action::Decrease | Action::Clamp => assert!(after < before, "{context}"),
                Action::Hold(_) => assert_eq!(after, before, "{context}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Seed 001 replayed on a plant model
//
// The plant is a gateway in front of one vLLM pool, as a fluid model stepped one 5 s tick at a
// time. Numbers are seed 000/001's where they have them; the shape is what matters:
//
// - Decode: each forward pass reads the weights once (14 GB at ~300 GB/s ≈ 47 ms) plus a
//   per-sequence share (0.7 ms, so ~61 ms per token at 20 in flight, seed 000's baseline).
//   Each request decodes 128 tokens. Throughput at concurrency n is n / (128 × step(n)): it
//   falls off below a small batch (the left arm of the U: cutting the budget there creates
//   a backlog, and queue wait rises).
// - KV cache: past 128 sequences vLLM preempts. Service TTFT, 0.3 s at light load, grows with
//   the square of the overshoot, ×2 at 144, ×5 at 160, ×65 at 256 (the right arm); decode
//   slows by a quarter as much.
// - Queue: requests beyond the budget wait in the gateway. A request that would wait longer
//   than the queue timeout is shed (504) and never records a TTFT, so served requests wait at
//   most the timeout: the backlog is capped at `throughput × timeout`.
// - Observed TTFT = service TTFT (spread ±20% across a tick's requests) + queue wait. The
//   controller reads the exact p99 over the last 6 ticks (30 s) of samples.
// - In flight: when the budget carries the load and nothing is queued, the concurrency that
//   just carries it (Little's law); otherwise the whole budget.
//
// Under 20 rps (about 3× what the pool can serve) and a 1 s timeout, p99 is the KV-cache curve
// plus 1 s: under 1.6 s up to a budget of 141, over 2.4 s past 155. The operating point,
// the largest budget meeting 2 s, is about 149.

const TICK_SECONDS: f64 = 5.0;
const WINDOW_TICKS: usize = 6;
const OUTPUT_TOKENS: f64 = 128.0;
const WEIGHT_READ_SECONDS: f64 = 0.047;
const PER_SEQUENCE_SECONDS: f64 = 0.0007;
const KV_KNEE: f64 = 128.0;
const KV_SCALE: f64 = 16.0;
const BASE_TTFT_SECONDS: f64 = 0.3;

/// How far past the KV-cache knee `n` sequences are, as a slowdown factor minus one.
fn kv_pressure(n: f64) -> f64 {
    ((n - KV_KNEE).max(0.0) / KV_SCALE).powi(2)
}

fn service_ttft(n: f64) -> f64 {
    BASE_TTFT_SECONDS * (1.0 + kv_pressure(n))
}

/// Requests per second completed with `n` in flight.
fn throughput(n: f64) -> f64 {
    let step = (WEIGHT_READ_SECONDS + PER_SEQUENCE_SECONDS * n) * (1.0 + kv_pressure(n) / 4.0);
    n / (OUTPUT_TOKENS * step)
}

struct Plant {
    queue_timeout: f64,
    /// What the controller is shown: the upstream's TTFT alone (`signal: upstream`), or with
    /// the queue wait added (the gateway's, seed 001).
    signal: Signal,
    /// Requests waiting at the gateway.
    backlog: f64,
    /// TTFT samples of the last `WINDOW_TICKS` ticks, newest last.
    window: VecDeque<Vec<f64>>,
}

impl Plant {
    fn new(queue_timeout: f64, signal: Signal) -> Plant {
        Plant {
            queue_timeout,
            signal,
            backlog: 0.0,
            window: VecDeque::new(),
        }
    }

    /// One tick of `offered` requests per second under `budget`: what the controller sees.
    fn tick(&mut self, budget: u32, offered: f64) -> Observation {
        let carried_at = (0..=budget).find(|&n| throughput(f64::from(n)) >= offered);
        let (in_flight, served_per_second, wait, queued) = match carried_at {
            Some(n) if self.backlog == 0.0 => (n, offered, 0.0, 0),
            _ => {
                let rate = throughput(f64::from(budget));
                let start = self.backlog;
                let end =
                    (start + (offered - rate) * TICK_SECONDS).clamp(0.0, rate * self.queue_timeout);
                self.backlog = end;
                let wait = ((start + end) / 2.0 / rate).min(self.queue_timeout);
                let served = rate.min(offered + start / TICK_SECONDS);
                (budget, served, wait, start.max(end).ceil() as u32)
            }
        };
        let ttft = service_ttft(f64::from(in_flight));
        let served = (served_per_second * TICK_SECONDS).round() as usize;
        let shown_wait = match self.signal {
            Signal::Upstream => 0.0,
            Signal::Gateway => wait,
        };
        let samples = (0..served)
            .map(|i| ttft * (0.8 + 0.4 * (i as f64 + 0.5) / served as f64) + shown_wait)
            .collect();
        self.window.push_back(samples);
        if self.window.len() > WINDOW_TICKS {
            self.window.pop_front();
        }
        Observation {
            p99_ttft_seconds: self.p99(),
            peak_in_flight: in_flight,
            queued,
            samples: self.window.iter().map(|tick| tick.len() as u64).sum(),
            engine_saturation: None,
            held: 0,
            stream_ended: true,
        }
    }

    /// Exact nearest-rank p99 of the window's samples.
    fn p99(&self) -> Option<f64> {
        let mut all: Vec<f64> = self.window.iter().flatten().copied().collect();
        if all.is_empty() {
            return None;
        }
        all.sort_by(f64::total_cmp);
        let rank = ((0.99 * all.len() as f64 - 1e-9).ceil() as usize).max(1);
        Some(all[rank - 1])
    }
}

/// Offered load, requests per second: light (the pool carries it with about 80 in flight),
/// and heavy (about 3× what the pool can serve at any budget).
const LIGHT: f64 = 6.0;
const HEAVY: f64 = 20.0;
/// (ticks, offered): light; a 30 s burst (seed 000's bursty tenant); light; five minutes of
/// sustained overload (seed 001 post 5's 20 rps); light.
const SCHEDULE: &[(usize, f64)] = &[
    (40, LIGHT),
    (6, HEAVY),
    (60, LIGHT),
    (100, HEAVY),
    (40, LIGHT),
];
const BURST: std::ops::Range<usize> = 40..46;
const OVERLOAD: std::ops::Range<usize> = 106..206;

/// One replay: the limit in force and the p99 seen, per tick.
struct Replay {
    limits: Vec<u32>,
    p99s: Vec<Option<f64>>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Signal {
    Upstream,
    Gateway,
}

fn replay(config: &AimdConfig, initial: u32, queue_timeout: f64) -> Replay {
    replay_signal(config, initial, queue_timeout, Signal::Gateway)
}

/// As `control::tick` does: with the upstream signal, a cut restarts the window.
fn replay_signal(config: &AimdConfig, initial: u32, queue_timeout: f64, signal: Signal) -> Replay {
    let mut plant = Plant::new(queue_timeout, signal);
    let mut aimd = Aimd::new(initial, config);
    let mut replay = Replay {
        limits: Vec::new(),
        p99s: Vec::new(),
    };
    for &(ticks, offered) in SCHEDULE {
        for _ in 0..ticks {
            let budget = aimd.limit();
            let observation = plant.tick(budget, offered);
            replay.limits.push(budget);
            replay.p99s.push(observation.p99_ttft_seconds);
            let action = aimd.step(config, observation);
            if action == Action::Decrease && signal == Signal::Upstream {
                plant.window.clear();
            }
        }
    }
    replay
}

/// Seed 001's first controller: halve on a breach, no cooldown.
fn seed_001_original() -> AimdConfig {
    with(|c| {
        cut_by(c, Decrease::Factor(0.5));
        c.cooldown_ticks = 0;
    })
}

/// The concurrency the pool needs to carry `offered` with nothing queued (Little's law).
fn carrying_concurrency(offered: f64) -> u32 {
    (0..)
        .find(|&n| throughput(f64::from(n)) >= offered)
        .expect("the plant carries the light load")
}

/// Whether the limit sat at the floor from the start of the sustained overload to the end:
/// 140 ticks (over 11 minutes) of chances to climb out, taken by none.
fn parks_at_floor(replay: &Replay, floor: u32) -> bool {
    replay.limits[OVERLOAD.start..].iter().all(|&l| l == floor)
}

#[test]
fn seed_001_replayed_the_timeout_decides_between_converging_and_the_death_spiral() {
    let fixed = config();
    let original = seed_001_original();
    // The plant's operating point under overload with a 1 s timeout: p99 leaves the band's
    // lower edge at 141 and breaches past 155 (see the plant's notes).
    let near_operating_point = 128..=155;
    struct Case {
        name: &'static str,
        config: AimdConfig,
        queue_timeout: f64,
        initial: u32,
        falls_to_floor: bool,
        parks: bool,
    }
    let cases = [
        Case {
            name: "the fixes, from the floor",
            config: fixed.clone(),
            queue_timeout: 1.0,
            initial: 32,
            falls_to_floor: false,
            parks: false,
        },
        Case {
            name: "the fixes, from seed 001's bootstrap",
            config: fixed.clone(),
            queue_timeout: 1.0,
            initial: 128,
            falls_to_floor: false,
            parks: false,
        },
        Case {
            name: "the fixes, from the ceiling",
            config: fixed.clone(),
            queue_timeout: 1.0,
            initial: 256,
            falls_to_floor: false,
            parks: false,
        },
        Case {
            // Seed 001's first deploy: the burst's queue wait reads as a breach, each halving
            // slows dispatch and lengthens the wait, 128 → 64 → 32 in two ticks, and at the
            // floor the light load alone keeps the queue at 30 s forever.
            name: "seed 001's original: 30 s timeout, halving, no cooldown",
            config: original.clone(),
            queue_timeout: 30.0,
            initial: 128,
            falls_to_floor: true,
            parks: true,
        },
        Case {
            name: "seed 001's original, from the ceiling",
            config: original.clone(),
            queue_timeout: 30.0,
            initial: 256,
            falls_to_floor: true,
            parks: true,
        },
        Case {
            // Post 5's finding: gentle cuts and a cooldown only slow the spiral down; with
            // queue wait dominating the signal every cut still makes it worse.
            name: "gentle cuts and a cooldown, but a 30 s timeout",
            config: fixed.clone(),
            queue_timeout: 30.0,
            initial: 128,
            falls_to_floor: true,
            parks: true,
        },
        Case {
            // The floor only relocates the trap when the queue wait is long (seed 001 §2):
            // at the floor the light load already overflows, and the wait never clears.
            name: "the fixes, from the floor, but a 30 s timeout",
            config: fixed.clone(),
            queue_timeout: 30.0,
            initial: 32,
            falls_to_floor: true,
            parks: true,
        },
        Case {
            // Halving still overshoots (256 → 128 → 64 → 32 in three ticks, each reacting to
            // the same stale window) but with a 1 s timeout the floor is no trap: queue wait
            // is capped, p99 drops under the band, and it climbs back.
            name: "a 1 s timeout with halving and no cooldown",
            config: original.clone(),
            queue_timeout: 1.0,
            initial: 256,
            falls_to_floor: true,
            parks: false,
        },
    ];
    for case in cases {
        let name = case.name;
        let floor = case.config.control.floor;
        let replay = replay(&case.config, case.initial, case.queue_timeout);
        let limits = &replay.limits;

        // At the floor on some tick after the first (starting there does not count).
        let fell = limits[1..].contains(&floor);
        assert_eq!(
            fell, case.falls_to_floor,
            "{name}: falls to the floor {limits:?}"
        );
        assert_eq!(
            parks_at_floor(&replay, floor),
            case.parks,
            "{name}: parks at the floor {limits:?}"
        );

        if case.parks {
            // Parked with the SLO lost, the GPUs idle behind a queue of lost causes.
            let last = replay.p99s.last().copied().flatten().expect("samples");
            assert!(
                last > 10.0 * case.config.target_p99_ttft_seconds,
                "{name}: p99 {last}"
            );
        } else {
            // Off the floor by the time the burst and the window it leaves behind have passed,
            // and never back.
            let last_at_floor = limits.iter().rposition(|&l| l == floor);
            assert!(
                last_at_floor.is_none_or(|tick| tick < BURST.end + WINDOW_TICKS),
                "{name}: at the floor at tick {last_at_floor:?}"
            );
            // The second half of the overload: near the operating point, SLO held.
            let settled = OVERLOAD.start + 50..OVERLOAD.end;
            for tick in settled {
                assert!(
                    near_operating_point.contains(&limits[tick]),
                    "{name}: tick {tick} at {} {limits:?}",
                    limits[tick]
                );
                let p99 = replay.p99s[tick].expect("samples");
                assert!(
                    p99 <= case.config.target_p99_ttft_seconds,
                    "{name}: tick {tick} p99 {p99}"
                );
            }
        }
    }
}

/// tollgate's default: the upstream's p99 TTFT held to 1 s, slow start, no cooldown (the
/// window restarts at each cut), on the plant's 5 s ticks.
fn upstream_default() -> AimdConfig {
    AimdConfig::from(&ControlConfig::default())
}

#[test]
fn seed_001_replayed_on_the_upstream_signal_no_timeout_makes_a_spiral() {
    // The plant's service TTFT stays under the 0.8 s increase threshold up to about 145 in
    // flight and passes the 1.2 s breach threshold (p99 of a ±20% spread) past about 152.
    let near_knee = 128..=155;
    let config = upstream_default();
    for queue_timeout in [1.0, 30.0] {
        for initial in [32, 128, 256] {
            let name = format!("{queue_timeout} s timeout, from {initial}");
            let replay = replay_signal(&config, initial, queue_timeout, Signal::Upstream);
            let limits = &replay.limits;
            // Queue wait is not in the signal, so a long queue never reads as a breach: the
            // seed's spiral (a cut lengthens the wait it reacts to) has nothing to feed on.
            assert!(
                !parks_at_floor(&replay, config.control.floor),
                "{name}: {limits:?}"
            );
            // Near the knee after the first half of the overload, whatever the timeout.
            for tick in OVERLOAD.start + 50..OVERLOAD.end {
                assert!(
                    near_knee.contains(&limits[tick]),
                    "{name}: tick {tick} at {} {limits:?}",
                    limits[tick]
                );
            }
            // And there within ten ticks of the overload's start from anywhere: slow start and
            // cuts from what is in flight, not a step per tick.
            let arrived = (OVERLOAD.start..OVERLOAD.end)
                .find(|&tick| near_knee.contains(&limits[tick]))
                .expect("reaches the knee");
            assert!(
                arrived <= OVERLOAD.start + 10,
                "{name}: at the knee only at tick {arrived} {limits:?}"
            );
        }
    }
}

#[test]
fn seed_001_replayed_light_load_does_not_lift_the_limit() {
    // 6 rps needs about 80 in flight. The gate (in flight >= 80% of the limit) lets the limit
    // climb to at most about 1.25× that when something pushes it (a backlog at the floor), and
    // otherwise leaves it where it is: no drift while the traffic does not use it.
    let config = config();
    let needed = carrying_concurrency(LIGHT);
    let gate = f64::from(needed) / config.control.demand_fraction
        + f64::from(config.control.increase_step);
    for initial in [32, 64, 128, 256] {
        let replay = replay(&config, initial, 1.0);
        let first_light = &replay.limits[..BURST.start];
        for &limit in first_light {
            assert!(
                f64::from(limit) <= gate.max(f64::from(initial)),
                "from {initial}: {limit} in {first_light:?}"
            );
        }
        // The last light phase, after the overload: the limit stays put (it was earned under
        // load; no breach, no reason to cut; no demand, no reason to grow). Its first tick
        // still drains the overload's backlog, so start one later.
        let last_light = &replay.limits[OVERLOAD.end + 1..];
        assert!(
            last_light.iter().all(|&l| l == last_light[0]),
            "from {initial}: {last_light:?}"
        );
    }
}

#[test]
fn seed_001_replayed_the_fixed_descent_is_gentle() {
    // From the ceiling, the burst lands deep in KV-cache preemption (p99 ~20 s). Cuts of 10%
    // with a 3-tick cooldown walk down one step per 4 ticks and stop at 135, in the band;
    // halving with no cooldown falls to the floor in three ticks, each cut reacting to the
    // same stale window (seed 001 §4).
    let fixed = replay(&config(), 256, 1.0);
    let halving = replay(&seed_001_original(), 256, 1.0);
    let descent = |replay: &Replay| -> Vec<u32> {
        let mut steps = vec![replay.limits[BURST.start]];
        for &limit in &replay.limits[BURST.start..OVERLOAD.start] {
            if limit != *steps.last().expect("non-empty") {
                steps.push(limit);
            }
        }
        steps
    };
    assert_eq!(descent(&fixed), [256, 230, 207, 186, 167, 150, 135]);
    assert_eq!(&descent(&halving)[..4], [256, 128, 64, 32]);
}
