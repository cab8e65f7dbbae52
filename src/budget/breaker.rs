//! A circuit breaker for the budget store: after `failures_to_open` consecutive failures it
//! opens, and calls skip the store (taking the configured fail modes at once) instead of each
//! waiting out a timeout against a dead Redis; after `open_for` one probe call tries again, and
//! its result closes or reopens the circuit.
//!
//! Pure: `now` is an argument.

use std::time::Duration;

use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct Breaker {
    failures_to_open: u32,
    open_for: Duration,
    state: State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Closed {
        consecutive_failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is out; everyone else skips until it reports.
    Probing,
}

/// Whether a call may go to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permission {
    Call,
    /// The circuit is open (or a probe is out): use the fail modes without calling.
    Skip,
}

/// The circuit's state, for the metric (`tollgate_store_breaker_state`: 0, 1, 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed = 0,
    Probing = 1,
    Open = 2,
}

/// The gauge value.
impl From<BreakerState> for u8 {
    fn from(state: BreakerState) -> u8 {
        state as u8
    }
}

impl Breaker {
    pub fn new(failures_to_open: u32, open_for: Duration) -> Breaker {
        Breaker {
            failures_to_open: failures_to_open.max(1),
            open_for,
            state: State::Closed {
                consecutive_failures: 0,
            },
        }
    }

    pub fn permission(&mut self, now: Instant) -> Permission {
        match self.state {
            State::Closed { .. } => Permission::Call,
            State::Open { until } if now >= until => {
                self.state = State::Probing;
                Permission::Call
            }
            State::Open { .. } | State::Probing => Permission::Skip,
        }
    }

    /// Reports a call's result. Returns true when this result changed the circuit's state.
    pub fn record(&mut self, ok: bool, now: Instant) -> bool {
        let before = self.state();
        self.state = match (self.state, ok) {
            (_, true) => State::Closed {
                consecutive_failures: 0,
            },
            (
                State::Closed {
                    consecutive_failures,
                },
                false,
            ) if consecutive_failures + 1 < self.failures_to_open => State::Closed {
                consecutive_failures: consecutive_failures + 1,
            },
            (_, false) => State::Open {
                until: now + self.open_for,
            },
        };
        before != self.state()
    }

    pub fn state(&self) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::Probing => BreakerState::Probing,
            State::Open { .. } => BreakerState::Open,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays (seconds since start, event) and renders what the breaker did, one token each:
    /// `C`/`S` for a permission to call or skip, `c`/`o`/`p` for the state after a result.
    #[track_caller]
    fn check(failures_to_open: u32, events: &[(u64, &str)], expected: &str) {
        let start = Instant::now();
        let mut breaker = Breaker::new(failures_to_open, Duration::from_secs(5));
        let mut trace = Vec::new();
        for &(at, event) in events {
            let now = start + Duration::from_secs(at);
            match event {
                "ask" => trace.push(match breaker.permission(now) {
                    Permission::Call => "C",
                    Permission::Skip => "S",
                }),
                "ok" | "fail" => {
                    breaker.record(event == "ok", now);
                    trace.push(match breaker.state() {
                        BreakerState::Closed => "c",
                        BreakerState::Probing => "p",
                        BreakerState::Open => "o",
                    });
                }
                other => panic!("unknown event {other}"),
            }
        }
        assert_eq!(trace.join(" "), expected);
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        check(
            3,
            &[
                (0, "fail"),
                (0, "fail"),
                (0, "ok"),
                (0, "fail"),
                (0, "fail"),
            ],
            "c c c c c",
        );
        check(
            3,
            &[(0, "fail"), (0, "fail"), (0, "fail"), (0, "ask")],
            "c c o S",
        );
        check(1, &[(0, "fail"), (0, "ask")], "o S");
    }

    #[test]
    fn one_probe_after_the_open_period_decides() {
        let open = [(0, "fail"), (0, "fail")];
        // Before 5 s: skip. At 5 s: one probe; others skip while it is out.
        check(
            2,
            &[open[0], open[1], (4, "ask"), (5, "ask"), (5, "ask")],
            "c o S C S",
        );
        // The probe succeeds: closed, calls go through.
        check(
            2,
            &[open[0], open[1], (5, "ask"), (5, "ok"), (5, "ask")],
            "c o C c C",
        );
        // The probe fails: open for another 5 s.
        check(
            2,
            &[
                open[0],
                open[1],
                (5, "ask"),
                (6, "fail"),
                (10, "ask"),
                (11, "ask"),
            ],
            "c o C o S C",
        );
    }

    #[test]
    fn record_reports_state_changes() {
        let now = Instant::now();
        let mut breaker = Breaker::new(2, Duration::from_secs(5));
        assert!(!breaker.record(false, now));
        assert!(breaker.record(false, now), "closed -> open");
        assert!(!breaker.record(false, now), "open stays open");
        assert!(breaker.record(true, now), "-> closed");
    }
}
