//! Unit tests for `LatencyWindow`: quantiles against exact nearest-rank answers, expiry whole
//! and by slot, jumps in time, time going backwards, and samples that are not latencies.
//!
//! Time is written as seconds after an arbitrary base instant; nothing waits.

use std::sync::LazyLock;

use super::*;

/// Any instant will do: only offsets from it matter.
static BASE: LazyLock<Instant> = LazyLock::new(Instant::now);

fn at(seconds: f64) -> Instant {
    *BASE + Duration::from_secs_f64(seconds)
}

/// The 30 s window in 6 slots of 5 s that the control loop uses (seed 001).
fn thirty_seconds() -> LatencyWindow {
    LatencyWindow::new(Duration::from_secs(30), 6)
}

/// A bucket's midpoint is within 1/32 of anything in the bucket; allow float noise on top.
const RELATIVE_ERROR: f64 = 1.0 / 32.0 + 1e-12;

fn assert_close(got: f64, want: f64, what: &str) {
    let error = (got - want).abs() / want;
    assert!(
        error <= RELATIVE_ERROR,
        "{what}: got {got}, want {want} (relative error {error:.4})"
    );
}

/// The exact nearest-rank q-quantile of `sorted`.
fn exact_quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64 - 1e-9).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn sorted(samples: &[f64]) -> Vec<f64> {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

/// A tiny deterministic generator: uniform in [0, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

const QUANTILES: [f64; 7] = [0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0];

#[test]
fn quantiles_of_known_distributions_are_within_the_relative_error() {
    let mut lcg = Lcg(7);
    let cases: Vec<(&str, Vec<f64>)> = vec![
        ("constant 2 s", vec![2.0; 500]),
        (
            "uniform 1 ms ..= 1 s",
            (1..=1000).map(|ms| f64::from(ms) / 1000.0).collect(),
        ),
        (
            // Evenly spread on a log scale over the whole range: every octave is exercised.
            "log-uniform 1 ms .. 1 h",
            (0..2000)
                .map(|i| 0.001 * (3_600_000f64).powf(f64::from(i) / 2000.0))
                .collect(),
        ),
        (
            "exponential, mean 0.5 s",
            (0..5000)
                .map(|_| (-0.5 * (1.0 - lcg.next()).ln()).max(0.001))
                .collect(),
        ),
        (
            // Nearest rank: with 99 fast and 1 slow, p99 is fast and only p100 is slow.
            "99 fast, 1 slow",
            [vec![0.2; 99], vec![30.0]].concat(),
        ),
        ("a single sample", vec![0.75]),
    ];
    for (name, samples) in cases {
        let mut window = thirty_seconds();
        // Spread the samples over the live part of the window.
        for (i, &sample) in samples.iter().enumerate() {
            window.record(at(i as f64 * 20.0 / samples.len() as f64), sample);
        }
        let now = at(20.0);
        assert_eq!(window.count(now), samples.len() as u64, "{name}: count");
        let samples = sorted(&samples);
        for q in QUANTILES {
            let got = window.quantile(now, q).expect("samples were recorded");
            assert_close(got, exact_quantile(&samples, q), &format!("{name}, q={q}"));
        }
    }
}

#[test]
fn the_bimodal_p99_picks_the_right_mode() {
    let mut window = thirty_seconds();
    for _ in 0..99 {
        window.record(at(1.0), 0.2);
    }
    window.record(at(1.0), 30.0);
    let p99 = window.quantile(at(2.0), 0.99).expect("samples");
    let p100 = window.quantile(at(2.0), 1.0).expect("samples");
    assert!(p99 < 0.21, "p99 {p99}");
    assert!(p100 > 29.0, "p100 {p100}");
}

#[test]
fn random_samples_over_the_whole_range_are_within_the_relative_error() {
    let mut lcg = Lcg(42);
    let samples: Vec<f64> = (0..10_000)
        .map(|_| 0.001 * (3_600_000f64).powf(lcg.next()))
        .collect();
    let mut window = thirty_seconds();
    for &sample in &samples {
        window.record(at(3.0), sample);
    }
    let samples = sorted(&samples);
    for q in (1..=100).map(|i| f64::from(i) / 100.0) {
        let got = window.quantile(at(3.0), q).expect("samples");
        assert_close(got, exact_quantile(&samples, q), &format!("q={q}"));
    }
}

#[test]
fn an_empty_window_has_no_quantile() {
    let mut window = thirty_seconds();
    assert_eq!(window.quantile(at(0.0), 0.99), None);
    assert_eq!(window.count(at(0.0)), 0);
    // Still none later, and asking did not record anything.
    assert_eq!(window.quantile(at(100.0), 0.5), None);
}

#[test]
fn samples_expire_by_whole_slots() {
    // 30 s in 5 s slots, slot numbering from the first `now` (0 s). Each case: samples
    // (time, value), the time asked, the count then, and the maximum then.
    struct Case {
        name: &'static str,
        samples: &'static [(f64, f64)],
        now: f64,
        count: u64,
        max: Option<f64>,
    }
    let cases = [
        Case {
            name: "fresh",
            samples: &[(0.0, 1.0)],
            now: 0.0,
            count: 1,
            max: Some(1.0),
        },
        Case {
            name: "still in the oldest live slot",
            samples: &[(0.0, 1.0)],
            now: 29.999,
            count: 1,
            max: Some(1.0),
        },
        Case {
            name: "a full window later: gone",
            samples: &[(0.0, 1.0)],
            now: 30.0,
            count: 0,
            max: None,
        },
        Case {
            // Recorded at 4.9 s (slot 0), so its slot expires at 30 s though it is 25.1 s old:
            // slots expire whole, never later than the window.
            name: "expires with its slot, a little early",
            samples: &[(4.9, 1.0)],
            now: 30.0,
            count: 0,
            max: None,
        },
        Case {
            name: "partial: the old slow sample went, the newer fast one stayed",
            samples: &[(1.0, 10.0), (11.0, 0.1)],
            now: 31.0,
            count: 1,
            max: Some(0.1),
        },
        Case {
            name: "partial: both still live a moment earlier",
            samples: &[(1.0, 10.0), (11.0, 0.1)],
            now: 29.0,
            count: 2,
            max: Some(10.0),
        },
        Case {
            name: "partial: a slot at a time",
            samples: &[(0.0, 1.0), (5.0, 2.0), (10.0, 3.0), (15.0, 4.0)],
            now: 35.0,
            count: 2,
            max: Some(4.0),
        },
        Case {
            name: "a ring slot reused a window later holds only the new sample",
            samples: &[(0.0, 10.0), (30.0, 0.5)],
            now: 30.0,
            count: 1,
            max: Some(0.5),
        },
    ];
    for case in cases {
        let mut window = thirty_seconds();
        // Fix slot numbering at 0 s whatever the first sample's time.
        window.count(at(0.0));
        for &(time, value) in case.samples {
            window.record(at(time), value);
        }
        let now = at(case.now);
        assert_eq!(window.count(now), case.count, "{}: count", case.name);
        match (window.quantile(now, 1.0), case.max) {
            (None, None) => {}
            (Some(got), Some(want)) => assert_close(got, want, case.name),
            (got, want) => panic!("{}: max {got:?}, want {want:?}", case.name),
        }
    }
}

#[test]
fn jumps_longer_than_the_window_forget_everything() {
    for jump in [30.0, 31.0, 3600.0, 86_400.0 * 365.0] {
        let mut window = thirty_seconds();
        for second in 0..30 {
            window.record(at(f64::from(second)), 5.0);
        }
        assert_eq!(window.count(at(29.0)), 30);
        assert_eq!(window.quantile(at(29.0 + jump), 0.99), None, "jump {jump}");
        window.record(at(29.0 + jump), 0.05);
        assert_eq!(window.count(at(29.0 + jump)), 1, "jump {jump}");
        let p99 = window.quantile(at(29.0 + jump), 0.99).expect("one sample");
        assert_close(p99, 0.05, &format!("jump {jump}"));
    }
}

#[test]
fn time_going_backwards_is_treated_as_the_latest_time() {
    let mut window = thirty_seconds();
    // Slot numbering from 0 s.
    window.count(at(0.0));
    window.record(at(20.0), 1.0);
    // A late sample stamped 15 s earlier lands in the current slot (20 s), not in an old one.
    window.record(at(5.0), 2.0);
    // Asking "at 10 s" is asking at 20 s: both are there.
    assert_eq!(window.count(at(10.0)), 2);
    // Both live until 20 s's slot expires (slot 4, gone at 50 s).
    assert_eq!(window.count(at(49.9)), 2);
    assert_eq!(window.count(at(50.0)), 0);
    // After that, an earlier time still cannot bring them back.
    assert_eq!(window.count(at(21.0)), 0);
}

#[test]
fn a_now_before_the_first_one_does_not_panic() {
    let mut window = thirty_seconds();
    window.record(at(100.0), 1.0);
    window.record(at(0.0), 1.0);
    assert_eq!(window.count(at(0.0)), 2);
    assert_eq!(window.quantile(at(50.0), 0.5).map(|v| v > 0.9), Some(true));
}

#[test]
fn odd_samples_are_dropped_or_clamped() {
    // Each case: the sample, and what a window holding only it reports (None: not counted).
    let top = bucket_midpoint(BUCKETS - 1);
    let bottom = bucket_midpoint(0);
    let cases: [(f64, Option<f64>); 12] = [
        (f64::NAN, None),
        (-f64::NAN, None),
        (-1.0, None),
        (-1e-300, None),
        (f64::NEG_INFINITY, None),
        // Zero (either sign) is a real, very fast latency.
        (0.0, Some(bottom)),
        (-0.0, Some(bottom)),
        (1e-9, Some(bottom)),
        (f64::MIN_POSITIVE / 2.0, Some(bottom)),
        (4096.0, Some(top)),
        (1e12, Some(top)),
        (f64::INFINITY, Some(top)),
    ];
    for (sample, want) in cases {
        let mut window = thirty_seconds();
        window.record(at(0.0), sample);
        let got = window.quantile(at(0.0), 0.99);
        assert_eq!(got, want, "sample {sample:e}");
        assert_eq!(
            window.count(at(0.0)),
            u64::from(want.is_some()),
            "{sample:e}"
        );
    }
    // The ends are where the module docs say.
    assert!((0.0009..0.0011).contains(&bottom), "bottom {bottom}");
    assert!((3600.0..4096.0).contains(&top), "top {top}");
}

#[test]
fn quantile_arguments_outside_the_range_are_clamped() {
    let mut window = thirty_seconds();
    for ms in [10, 20, 30] {
        window.record(at(0.0), f64::from(ms) / 1000.0);
    }
    let now = at(0.0);
    for (q, want) in [(0.0, 0.010), (-1.0, 0.010), (f64::NAN, 0.010), (2.0, 0.030)] {
        let got = window.quantile(now, q).expect("samples");
        assert_close(got, want, &format!("q={q}"));
    }
}

#[test]
fn degenerate_shapes_still_work() {
    for (window, slots) in [
        (Duration::ZERO, 0),
        (Duration::ZERO, 6),
        (Duration::from_nanos(3), 6),
        (Duration::from_secs(30), 0),
        (Duration::from_secs(30), 1),
    ] {
        let mut w = LatencyWindow::new(window, slots);
        w.record(at(0.0), 1.0);
        assert_eq!(w.count(at(0.0)), 1, "{window:?} in {slots}");
        // One slot of 30 s: a sample lives until its slot ends; zero windows: until the next
        // nanosecond at most.
        assert_eq!(w.count(at(31.0)), 0, "{window:?} in {slots}");
    }
}

#[test]
fn buckets_cover_the_range_in_order() {
    // Every midpoint falls in its own bucket, and buckets never go backwards as values grow.
    for bucket in 0..BUCKETS {
        assert_eq!(bucket_of(bucket_midpoint(bucket)), Some(bucket));
    }
    let mut previous = 0;
    let mut value = 1e-4;
    while value < 1e4 {
        let bucket = bucket_of(value).expect("a latency");
        assert!(bucket >= previous, "{value}");
        previous = bucket;
        value *= 1.001;
    }
    assert_eq!(previous, BUCKETS - 1);
}

#[test]
fn memory_does_not_grow_with_samples() {
    let mut window = thirty_seconds();
    for i in 0..200_000u32 {
        window.record(at(f64::from(i) * 1e-4), f64::from(i % 977) / 100.0);
    }
    assert_eq!(window.slots.len(), 6);
    assert!(window.slots.iter().all(|slot| slot.counts.len() == BUCKETS));
    assert_eq!(window.count(at(20.0)), 200_000);
}

// ---------------------------------------------------------------------------------------------
// Restarts and pending requests (the controller's epoch and overdue requests)

#[test]
fn a_restart_forgets_every_sample_and_ignores_requests_started_before_it() {
    let mut window = thirty_seconds();
    (0..50).for_each(|_| window.record(at(1.0), 5.0));
    window.start(at(1.5));
    window.restart(at(2.0));
    assert_eq!(window.quantile(at(2.0), 0.99), None);
    assert_eq!(
        window.quantile_counting_overdue(at(9.0), 0.99, Duration::from_secs(1)),
        (None, 0),
        "the request pending at the restart is forgotten too"
    );
    // Stragglers, dispatched before the restart, answer after it: not counted.
    window.record_started(at(3.0), at(1.9), 8.0);
    window.start(at(1.9));
    assert_eq!(window.quantile(at(3.0), 0.99), None);
    assert_eq!(
        window.quantile_counting_overdue(at(9.0), 0.99, Duration::from_secs(1)),
        (None, 0)
    );
    // Requests started at or after it count as usual.
    window.record_started(at(3.0), at(2.0), 0.25);
    window.record_started(at(3.0), at(2.5), 0.5);
    assert_eq!(window.count(at(3.0)), 2);
    assert_close(window.quantile(at(3.0), 0.99).unwrap(), 0.5, "p99 after");
}

#[test]
fn pending_requests_count_only_once_overdue_and_at_their_age() {
    let overdue_after = Duration::from_millis(1200);
    let mut window = thirty_seconds();
    (0..98).for_each(|_| window.record(at(0.5), 0.3));
    (0..2).for_each(|_| window.start(at(1.0)));
    // Young: unknown yet, so they neither count nor pull the quantile anywhere.
    let (p99, samples) = window.quantile_counting_overdue(at(2.0), 0.99, overdue_after);
    assert_eq!(samples, 98);
    assert_close(p99.unwrap(), 0.3, "young pending ignored");
    // 4 s after they started, both are overdue: 2 of 100 samples at 4 s, so p99 is 4 s.
    let (p99, samples) = window.quantile_counting_overdue(at(5.0), 0.99, overdue_after);
    assert_eq!(samples, 100);
    assert_close(p99.unwrap(), 4.0, "overdue at their age");
    // `quantile` alone still reports the answered ones only.
    assert_close(
        window.quantile(at(5.0), 0.99).unwrap(),
        0.3,
        "plain quantile",
    );
    // One answers (4.5 s) and one is abandoned: neither is pending any longer.
    window.answered(at(5.5), at(1.0), 4.5);
    window.abandon(at(1.0));
    let (p99, samples) = window.quantile_counting_overdue(at(6.0), 0.99, overdue_after);
    assert_eq!(samples, 99);
    assert_close(p99.unwrap(), 4.5, "the answer is a sample like any other");
    assert_eq!(window.pending.len(), 0);
}

#[test]
fn pending_requests_stay_pending_past_the_window() {
    // A request stuck longer than the window must not fall out of it: it is still the
    // slowest thing there is.
    let mut window = thirty_seconds();
    window.start(at(0.0));
    let (p99, samples) = window.quantile_counting_overdue(at(100.0), 0.99, Duration::ZERO);
    assert_eq!(samples, 1);
    assert_close(p99.unwrap(), 100.0, "100 s pending");
}

#[test]
fn requests_started_at_the_same_instant_are_counted_apart() {
    let mut window = thirty_seconds();
    (0..3).for_each(|_| window.start(at(1.0)));
    window.abandon(at(1.0));
    let (_, samples) = window.quantile_counting_overdue(at(5.0), 0.99, Duration::ZERO);
    assert_eq!(samples, 2);
    // Ending a request that was never started (or already ended) changes nothing.
    window.abandon(at(2.0));
    window.abandon(at(1.0));
    window.abandon(at(1.0));
    window.abandon(at(1.0));
    let (_, samples) = window.quantile_counting_overdue(at(5.0), 0.99, Duration::ZERO);
    assert_eq!(samples, 0);
    assert!(window.pending.is_empty());
}

#[test]
fn a_latency_recorded_for_a_request_never_started_ends_no_other() {
    // Two requests share a start instant; only one was counted as pending. The other one's
    // latency must not end the first one's wait.
    let mut window = thirty_seconds();
    window.start(at(1.0));
    window.record_started(at(1.5), at(1.0), 0.5);
    let (p99, samples) = window.quantile_counting_overdue(at(5.0), 0.99, Duration::ZERO);
    assert_eq!(samples, 2);
    assert_close(p99.unwrap(), 4.0, "still pending, 4 s old");
}

#[test]
fn a_pending_guard_ends_its_request_exactly_once() {
    let window = Arc::new(Mutex::new(thirty_seconds()));
    let pending = |w: &Arc<Mutex<LatencyWindow>>| w.lock().unwrap().pending.len();
    // Dropped without an answer (an error, a reset, a panic): abandoned.
    let dropped = Pending::start(&window, at(1.0));
    assert_eq!(pending(&window), 1);
    drop(dropped);
    assert_eq!(pending(&window), 0);
    // Answered: recorded and ended, and its drop does not end it again (which would take
    // another request started at the same instant with it).
    let other = Pending::start(&window, at(2.0));
    let answered = Pending::start(&window, at(2.0));
    answered.answered(at(2.5), 0.5);
    assert_eq!(window.lock().unwrap().pending[&at(2.0)], 1);
    assert_eq!(window.lock().unwrap().count(at(2.5)), 1);
    drop(other);
    assert_eq!(pending(&window), 0);
}

#[test]
fn windows_merged_by_bucket_give_the_quantile_of_all_their_samples() {
    // Three replicas' windows, uneven: the merged p99 is the p99 of every sample together,
    // not the mean (or max) of the three p99s.
    let samples: [&[f64]; 3] = [&[0.1; 90], &[0.2; 9], &[5.0; 1]];
    let mut whole = thirty_seconds();
    let mut histograms = Vec::new();
    for replica in samples {
        let mut window = thirty_seconds();
        for &seconds in replica {
            window.record(at(1.0), seconds);
            whole.record(at(1.0), seconds);
        }
        histograms.push(window.histogram_counting_overdue(at(2.0), Duration::from_secs(1)));
    }
    for q in [0.5, 0.9, 0.99, 1.0] {
        let (merged, samples) = merged_quantile(histograms.iter().map(Vec::as_slice), q);
        assert_eq!(samples, 100);
        assert_eq!(merged, whole.quantile(at(2.0), q), "q = {q}");
    }
    assert_eq!(merged_quantile([], 0.99), (None, 0));

    // Overdue pending requests are in the histogram, as they are in the local quantile.
    let mut window = thirty_seconds();
    window.start(at(0.0));
    let histogram = window.histogram_counting_overdue(at(3.0), Duration::from_secs(1));
    let (p99, samples) = merged_quantile([histogram.as_slice()], 0.99);
    assert_eq!(samples, 1);
    assert_close(p99.unwrap(), 3.0, "a request 3 s overdue");
    // A foreign bucket number is ignored, not a panic.
    assert_eq!(merged_quantile([&[(u16::MAX, 5)][..]], 0.99), (None, 0));
}
