//! The task that ticks the controller: every `tick_ms` it reads the p99 time to first token over
//! the window and the scheduler's demand, steps the pure `Aimd`, and resizes the budget.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use super::{Aimd, AimdConfig, Decrease, Observation};
use crate::config::ControlConfig;
use crate::extproc::{Lifecycle, reached};
use crate::observe::Metrics;
use crate::observe::window::LatencyWindow;
use crate::scheduler::Scheduler;

/// The pure controller's settings from the configuration.
pub fn aimd_config(control: &ControlConfig) -> AimdConfig {
    AimdConfig {
        target_p99_ttft_seconds: control.target_p99_ttft_ms as f64 / 1000.0,
        band: control.band,
        increase_step: control.increase_step,
        decrease: match control.decrease_step {
            Some(step) => Decrease::Step(step),
            None => Decrease::Factor(control.decrease_factor),
        },
        floor: control.floor,
        ceiling: control.ceiling,
        cooldown_ticks: control.cooldown_ticks,
        demand_fraction: control.demand_fraction,
    }
}

/// Runs until the server starts draining (a draining server admits nothing new, so resizing
/// the budget would only react to its own wind-down).
pub async fn run(
    control: ControlConfig,
    initial_limit: u32,
    scheduler: Arc<Scheduler>,
    ttft_window: Arc<Mutex<LatencyWindow>>,
    metrics: Metrics,
    mut lifecycle: watch::Receiver<Lifecycle>,
) {
    let config = aimd_config(&control);
    let mut aimd = Aimd::new(initial_limit, &config);
    scheduler.set_limit(aimd.limit());
    metrics.scheduler_load(scheduler.load());
    let mut tick = tokio::time::interval_at(
        Instant::now() + Duration::from_millis(control.tick_ms),
        Duration::from_millis(control.tick_ms),
    );
    // After a stall, tick on the normal period again rather than in a burst of catch-up steps.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = reached(&mut lifecycle, Lifecycle::Draining) => return,
        }
        let now = Instant::now();
        let p99 = ttft_window
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .quantile(now, 0.99);
        let observation = Observation {
            p99_ttft_seconds: p99,
            peak_in_flight: scheduler.take_peak_in_flight(),
            queued: scheduler.load().queued,
        };
        let action = aimd.step(&config, observation);
        scheduler.set_limit(aimd.limit());
        metrics.controller_tick(action, p99);
        metrics.scheduler_load(scheduler.load());
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
        _lifecycle: watch::Sender<Lifecycle>,
    }

    fn start(control: ControlConfig, initial: u32) -> Harness {
        let policy = Policy::from_config(&Config::default()).unwrap();
        let scheduler = Scheduler::new(initial, usize::MAX);
        let window = Arc::new(Mutex::new(LatencyWindow::new(
            Duration::from_millis(control.window_ms),
            30,
        )));
        let (lifecycle_tx, lifecycle) = watch::channel(Lifecycle::Serving);
        tokio::spawn(run(
            control,
            initial,
            scheduler.clone(),
            window.clone(),
            Metrics::new(&policy),
            lifecycle,
        ));
        Harness {
            scheduler,
            window,
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

    #[tokio::test(start_paused = true)]
    async fn a_breach_shrinks_the_budget_then_the_cooldown_holds_it() {
        let h = start(ControlConfig::default(), 128);
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), 128);
        h.record(10.0, 100);
        tokio::time::sleep(tick() + Duration::from_millis(1)).await;
        assert_eq!(h.limit(), 115, "128 x 0.9, rounded down");
        // Three ticks of cooldown: no further cut although the window still breaches.
        tokio::time::sleep(tick() * 3).await;
        assert_eq!(h.limit(), 115);
        tokio::time::sleep(tick()).await;
        assert_eq!(h.limit(), 103, "acts again after the cooldown");
    }

    #[tokio::test(start_paused = true)]
    async fn fast_first_tokens_grow_the_budget_only_while_it_is_used() {
        let h = start(ControlConfig::default(), 40);
        tokio::task::yield_now().await;
        h.record(0.2, 100);
        // Idle: fast samples but nothing in flight, so no growth.
        tokio::time::sleep(tick() * 2 + Duration::from_millis(1)).await;
        assert_eq!(h.limit(), 40);
        // Busy at the limit: one step per tick.
        let class = crate::scheduler::FlowClass {
            weight: 1,
            band: 0,
            queue_max: 0,
            reserved_slots: 0,
        };
        let _permits: Vec<_> = (0..40)
            .map(|_| h.scheduler.submit("t", class, 1, 0))
            .collect();
        h.record(0.2, 100);
        tokio::time::sleep(tick()).await;
        assert_eq!(h.limit(), 41);
    }

    #[tokio::test(start_paused = true)]
    async fn the_initial_limit_is_clamped_into_floor_and_ceiling() {
        let h = start(ControlConfig::default(), 1000);
        tokio::task::yield_now().await;
        assert_eq!(h.limit(), ControlConfig::default().ceiling);
    }
}
