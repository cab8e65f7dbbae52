//! The task that ticks the controller: every `tick_ms` it scrapes the engines' metrics (if
//! configured), reads the p99 time to first token over the window and the scheduler's
//! demand, steps the pure `Aimd`, and resizes the budget.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use super::scrape::Scraper;
use super::window::{self, LatencyWindow};
use super::{Action, Aimd, AimdConfig, Observation};
use crate::config::{ControlConfig, ControlSignal};
use crate::lifecycle::{Lifecycle, reached};
use crate::observe::{FleetStanding, Metrics};
use crate::scheduler::Scheduler;

/// What the tick runs on: the controller's settings and the static budget (applied while the
/// controller is off). A reload or the admin API replaces them; the tick keeps its limit.
#[derive(Clone, Debug, PartialEq)]
pub struct TickSettings {
    pub control: ControlConfig,
    /// `scheduler.initial_limit`: where the controller starts, and the budget while it is off.
    pub static_limit: u32,
}

/// Runs until the server starts draining (a draining server admits nothing new, so resizing
/// the budget would only react to its own wind-down).
pub async fn run(
    mut settings: watch::Receiver<TickSettings>,
    scheduler: Arc<Scheduler>,
    ttft_window: Arc<Mutex<LatencyWindow>>,
    metrics: Metrics,
    mut lifecycle: watch::Receiver<Lifecycle>,
) {
    let mut current = settings.borrow_and_update().clone();
    let mut config = AimdConfig::from(&current.control);
    let mut aimd = Aimd::new(current.static_limit, &config);
    let mut scraper = Scraper::new(&current.control.engine);
    let applied = |aimd: &Aimd, current: &TickSettings| {
        let limit = if current.control.enabled {
            aimd.limit()
        } else {
            current.static_limit
        };
        scheduler.set_limit(limit);
        // Alone (no shared store: the fleet's task would run the controller otherwise), this
        // replica's limit is the deployment's.
        metrics.fleet(FleetStanding::Alone, 1, limit, false);
        metrics.scheduler_load(scheduler.load());
    };
    applied(&aimd, &current);
    let period = |current: &TickSettings| Duration::from_millis(current.control.tick_ms);
    let mut tick = tokio::time::interval_at(Instant::now() + period(&current), period(&current));
    // After a stall, tick on the normal period again rather than in a burst of catch-up steps.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut settings_open = true;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            changed = settings.changed(), if settings_open => {
                if changed.is_err() {
                    settings_open = false;
                    continue;
                }
                let next = settings.borrow_and_update().clone();
                if next == current {
                    continue;
                }
                config = AimdConfig::from(&next.control);
                if next.control.enabled && !current.control.enabled {
                    // Switched on: from the budget in force, not from where it was switched off.
                    aimd = Aimd::new(scheduler.load().limit, &config);
                } else {
                    aimd.rebound(&config);
                }
                if next.control.engine != current.control.engine {
                    scraper = Scraper::new(&next.control.engine);
                }
                if next.control.tick_ms != current.control.tick_ms {
                    tick = tokio::time::interval_at(Instant::now() + period(&next), period(&next));
                    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
                }
                current = next;
                applied(&aimd, &current);
                tracing::info!(enabled = current.control.enabled, limit = scheduler.load().limit, "controller settings changed");
                continue;
            }
            () = reached(&mut lifecycle, Lifecycle::Draining) => return,
        }
        if !current.control.enabled {
            continue;
        }
        let control = &current.control;
        let breach_threshold =
            Duration::from_secs_f64(config.target_p99_ttft_seconds * (1.0 + control.band));
        // First, so the latency and the peak in flight below are read after it, as fresh.
        let engine_saturation = match &mut scraper {
            Some(scraper) => tokio::select! {
                saturation = scraper.saturation(&metrics) => saturation,
                () = reached(&mut lifecycle, Lifecycle::Draining) => return,
            },
            None => None,
        };
        let now = Instant::now();
        // A request already waiting longer than the breach threshold is a breach, whenever it
        // answers: counting it now is what lets the controller see a saturated upstream
        // before the requests stuck in its queue come out.
        let (p99, samples) =
            window::lock(&ttft_window).quantile_counting_overdue(now, 0.99, breach_threshold);
        let load = scheduler.load();
        let observation = Observation {
            p99_ttft_seconds: p99,
            peak_in_flight: scheduler.take_peak_in_flight(),
            queued: load.waiting_for_slot(),
            samples,
            engine_saturation,
            held: load.held,
            stream_ended: load.released > 0,
        };
        let action = aimd.step(&config, observation);
        if action == Action::Decrease && control.signal == ControlSignal::Upstream {
            // From here the window hears only from requests dispatched under the new limit: the
            // cut is judged on its own effect, not on samples from before it. (The gateway's
            // signal keeps seed 001's cooldown instead: its samples include queue wait, which
            // a cut lengthens, so an epoch would hear the cut's side effect as a new breach
            // at once.)
            window::lock(&ttft_window).restart(now);
        }
        applied(&aimd, &current);
        metrics.controller_tick(action, p99);
        tracing::debug!(
            ?observation,
            ?action,
            limit = aimd.limit(),
            "controller tick"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::policy::Policy;

    /// The task, with its inputs, on paused time.
    struct Harness {
        scheduler: Arc<Scheduler>,
        window: Arc<Mutex<LatencyWindow>>,
        settings: watch::Sender<TickSettings>,
        _lifecycle: watch::Sender<Lifecycle>,
    }

    fn start(control: ControlConfig, initial: u32) -> Harness {
        let policy = Policy::from_config(&Config::default()).unwrap();
        let scheduler = Scheduler::new(initial, usize::MAX, None);
        let window = Arc::new(Mutex::new(LatencyWindow::new(
            Duration::from_millis(control.window_ms),
            30,
        )));
        let (lifecycle_tx, lifecycle) = watch::channel(Lifecycle::Serving);
        let (settings_tx, settings) = watch::channel(TickSettings {
            control,
            static_limit: initial,
        });
        tokio::spawn(run(
            settings,
            scheduler.clone(),
            window.clone(),
            Metrics::new(&policy),
            lifecycle,
        ));
        Harness {
            scheduler,
            window,
            settings: settings_tx,
            _lifecycle: lifecycle_tx,
        }
    }

    impl Harness {
        fn record(&self, seconds: f64, samples: usize) {
            let now = Instant::now();
            let mut window = self.window.lock().unwrap();
            (0..samples).for_each(|_| window.record(now, seconds));
        }

        fn limit(&self) -> u32 {
            self.scheduler.load().limit
        }
    }

    fn tick() -> Duration {
        Duration::from_millis(ControlConfig::default().tick_ms)
    }

    /// Seed 001's controller: the gateway's TTFT, 5 s ticks, 3 ticks of cooldown.
    fn seed_001() -> ControlConfig {
        ControlConfig {
            signal: ControlSignal::Gateway,
            tick_ms: 5_000,
            window_ms: 30_000,
            cooldown_ticks: 3,
            slow_start: false,
            min_samples: 1,
            ..ControlConfig::default()
        }
    }

    fn busy(h: &Harness, requests: usize) -> Vec<crate::scheduler::Admit> {
        let class = crate::scheduler::FlowClass {
            weight: 1,
            band: 0,
            queue_max: 0,
            reserved_slots: 0,
        };
        (0..requests)
            .map(|_| h.scheduler.submit("t", class, 1, 0))
            .collect()
    }

    /// A reload or the admin API replaces the settings: the limit survives, moved into new
    /// bounds; switched off, the static budget applies; switched on, it starts from the limit
    /// in force.
    #[tokio::test(start_paused = true)]
    async fn new_settings_keep_the_limit_within_their_bounds() {
        let h = start(ControlConfig::default(), 128);
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), 128);
        let change = |edit: &dyn Fn(&mut TickSettings)| {
            h.settings.send_modify(|s| edit(s));
        };
        change(&|s| s.control.ceiling = 64);
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), 64, "clamped under the new ceiling");
        change(&|s| {
            s.control.enabled = false;
            s.static_limit = 20;
        });
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), 20, "off: the static budget");
        // Ticks change nothing while it is off, whatever the latency.
        h.record(10.0, 100);
        // To the middle of a tick period, so the switch below lands between two ticks.
        tokio::time::sleep(tick() * 3 + tick() / 2).await;
        assert_eq!(h.limit(), 20);
        change(&|s| {
            s.control.enabled = true;
            s.control.floor = 8;
        });
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), 20, "on again: from the budget in force");
        tokio::time::sleep(tick()).await;
        assert_eq!(h.limit(), 18, "and stepping again: 20 x 0.9");
    }

    #[tokio::test(start_paused = true)]
    async fn a_breach_shrinks_the_budget_then_only_requests_dispatched_after_it_count() {
        let h = start(ControlConfig::default(), 128);
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), 128);
        let before_the_cut = Instant::now();
        h.record(10.0, 100);
        tokio::time::sleep(tick() + Duration::from_millis(1)).await;
        assert_eq!(h.limit(), 115, "128 x 0.9, rounded down");
        // The window restarted: the old samples are gone, and a straggler dispatched before
        // the cut reporting now does not count either, so no second cut.
        {
            let mut window = h.window.lock().unwrap();
            for _ in 0..100 {
                window.record_started(Instant::now(), before_the_cut, 10.0);
            }
        }
        tokio::time::sleep(tick() * 3).await;
        assert_eq!(h.limit(), 115);
        // Slow requests dispatched under the new limit do.
        {
            let mut window = h.window.lock().unwrap();
            let now = Instant::now();
            for _ in 0..100 {
                window.record_started(now, now, 10.0);
            }
        }
        tokio::time::sleep(tick()).await;
        assert_eq!(h.limit(), 103, "115 x 0.9");
    }

    #[tokio::test(start_paused = true)]
    async fn requests_stuck_past_the_breach_threshold_cut_before_they_answer() {
        let h = start(ControlConfig::default(), 128);
        tokio::task::yield_now().await;
        let _in_flight = busy(&h, 100);
        let dispatched = Instant::now();
        {
            let mut window = h.window.lock().unwrap();
            (0..20).for_each(|_| window.start(dispatched));
        }
        // Under the 1.2 s breach threshold (1 s target + 20 %) they are not overdue yet: the
        // window holds nothing else, so nothing happens.
        tokio::time::sleep(tick() + Duration::from_millis(1)).await;
        assert_eq!(h.limit(), 128);
        // Past it they are breaches, although none has answered: cut from what is in flight.
        tokio::time::sleep(tick()).await;
        assert_eq!(h.limit(), 90, "100 in flight x 0.9");
    }

    #[tokio::test(start_paused = true)]
    async fn seed_001_controller_holds_for_its_cooldown_after_a_breach() {
        let config = seed_001();
        let tick = Duration::from_millis(config.tick_ms);
        let h = start(config, 128);
        tokio::task::yield_now().await;
        h.record(10.0, 100);
        tokio::time::sleep(tick + Duration::from_millis(1)).await;
        assert_eq!(h.limit(), 115, "128 x 0.9, rounded down");
        // Three ticks of cooldown: no further cut although the window still breaches.
        tokio::time::sleep(tick * 3).await;
        assert_eq!(h.limit(), 115);
        tokio::time::sleep(tick).await;
        assert_eq!(h.limit(), 103, "acts again after the cooldown");
    }

    #[tokio::test(start_paused = true)]
    async fn fast_first_tokens_grow_the_budget_only_while_it_is_used() {
        for (config, grown) in [(ControlConfig::default(), 80), (seed_001(), 41)] {
            let tick = Duration::from_millis(config.tick_ms);
            let h = start(config.clone(), 40);
            tokio::task::yield_now().await;
            h.record(0.2, 100);
            // Idle: fast samples but nothing in flight, so no growth.
            tokio::time::sleep(tick * 2 + Duration::from_millis(1)).await;
            assert_eq!(h.limit(), 40, "{:?}", config.signal);
            // Busy at the limit: slow start doubles; seed 001's adds one step.
            let _permits = busy(&h, 40);
            h.record(0.2, 100);
            tokio::time::sleep(tick).await;
            assert_eq!(h.limit(), grown, "{:?}", config.signal);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_initial_limit_is_clamped_into_floor_and_ceiling() {
        let h = start(ControlConfig::default(), 1000);
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), ControlConfig::default().ceiling);
    }
}
