//! Unit tables for `WindowUsage`: adding and rolling within and across buckets, the exact
//! expiry boundary, rolling rather than resetting, retry-after for several shapes, settlement
//! adjustments, long idle gaps, and numbers near `u64::MAX`.
//!
//! Times are plain milliseconds; every case builds its usage from a list of operations and
//! checks the structure's invariants after each one.

use super::*;
use crate::budget::Quantity;

const MINUTE: u64 = 60_000;

fn window(window_ms: u64, bucket_ms: u64, limit: u64) -> WindowLimit {
    WindowLimit {
        name: "tokens_test".into(),
        quantity: Quantity::Tokens,
        window_ms,
        bucket_ms,
        limit,
    }
}

/// A minute in six 10 s buckets, limit 1000: small enough to reason about by hand.
fn minute() -> WindowLimit {
    window(MINUTE, 10_000, 1000)
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Add { now: u64, amount: u64 },
    Adjust { at: u64, now: u64, delta: i128 },
}

fn add(now: u64, amount: u64) -> Op {
    Op::Add { now, amount }
}

fn adjust(at: u64, now: u64, delta: i128) -> Op {
    Op::Adjust { at, now, delta }
}

/// Applies `ops` to an empty window, checking the invariants after each.
#[track_caller]
fn run(limit: &WindowLimit, ops: &[Op]) -> WindowUsage {
    let mut usage = WindowUsage::default();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Add { now, amount } => usage.add(limit, now, amount),
            Op::Adjust { at, now, delta } => usage.adjust(limit, at, now, delta),
        }
        assert_invariants(&usage, &format!("after op {i} {op:?}"));
    }
    usage
}

#[track_caller]
fn assert_invariants(usage: &WindowUsage, context: &str) {
    let sum: u128 = usage.buckets.iter().map(|b| u128::from(b.amount)).sum();
    assert_eq!(
        usage.total, sum,
        "{context}: total is the sum of the buckets"
    );
    assert!(
        usage.buckets.iter().all(|b| b.amount > 0),
        "{context}: no empty bucket is kept: {:?}",
        usage.buckets
    );
    assert!(
        usage
            .buckets
            .iter()
            .zip(usage.buckets.iter().skip(1))
            .all(|(a, b)| a.start_ms < b.start_ms),
        "{context}: buckets in start order: {:?}",
        usage.buckets
    );
}

/// One row: operations, then roll to `now` and expect `used` and `reset_ms`.
type Row<'a> = (&'a str, &'a [Op], u64, u64, u64);

#[track_caller]
fn check(limit: &WindowLimit, (name, ops, now, used, reset_ms): Row<'_>) -> WindowUsage {
    let mut usage = run(limit, ops);
    usage.roll(limit, now);
    assert_invariants(&usage, name);
    let live = Shape::of(limit).buckets as usize;
    assert!(
        usage.buckets.len() <= live,
        "{name}: at most {live} buckets after a roll, got {:?}",
        usage.buckets
    );
    assert_eq!(usage.used(), used, "{name}: used at {now}");
    assert_eq!(
        usage.reset_ms(limit, now),
        reset_ms,
        "{name}: reset_ms at {now}"
    );
    assert_eq!(usage.is_empty(), used == 0, "{name}: is_empty");
    assert_eq!(
        usage.state(limit, now),
        WindowState {
            used,
            limit: limit.limit,
            reset_ms
        },
        "{name}: state"
    );
    usage
}

#[test]
fn adds_land_in_their_bucket_and_roll_off_with_it() {
    let rows: &[Row<'_>] = &[
        ("empty", &[], 0, 0, 0),
        ("one add", &[add(0, 100)], 0, 100, MINUTE),
        (
            "two adds in one bucket",
            &[add(1_000, 100), add(9_999, 50)],
            9_999,
            150,
            MINUTE - 9_999,
        ),
        (
            "adds across buckets",
            &[add(0, 100), add(10_000, 200), add(25_000, 300)],
            25_000,
            600,
            MINUTE - 25_000,
        ),
        (
            "the oldest bucket goes first",
            &[add(0, 100), add(10_000, 200), add(25_000, 300)],
            MINUTE,
            500,
            10_000,
        ),
        (
            "then the next",
            &[add(0, 100), add(10_000, 200), add(25_000, 300)],
            70_000,
            300,
            10_000,
        ),
        (
            "then the last",
            &[add(0, 100), add(10_000, 200), add(25_000, 300)],
            80_000,
            0,
            0,
        ),
        ("a zero add holds nothing", &[add(5_000, 0)], 5_000, 0, 0),
        (
            "an add rolls first",
            &[add(0, 100), add(MINUTE, 200)],
            MINUTE,
            200,
            MINUTE,
        ),
        (
            // Time going back (never from the store's monotonic clock) still keeps order.
            "an earlier now adds to its own bucket",
            &[add(20_000, 100), add(5_000, 50)],
            20_000,
            150,
            MINUTE - 20_000,
        ),
    ];
    for &row in rows {
        check(&minute(), row);
    }
}

#[test]
fn a_bucket_expires_whole_exactly_one_window_after_its_start() {
    let rows: &[Row<'_>] = &[
        ("1 ms before", &[add(5_000, 100)], MINUTE - 1, 100, 1),
        ("at", &[add(5_000, 100)], MINUTE, 0, 0),
        // Usage late in a bucket is kept for less than a window: window - bucket at least.
        (
            "late in its bucket, 1 ms before",
            &[add(9_999, 100)],
            MINUTE - 1,
            100,
            1,
        ),
        ("late in its bucket, at", &[add(9_999, 100)], MINUTE, 0, 0),
        (
            "second bucket, 1 ms before",
            &[add(10_000, 100)],
            70_000 - 1,
            100,
            1,
        ),
        ("second bucket, at", &[add(10_000, 100)], 70_000, 0, 0),
    ];
    for &row in rows {
        check(&minute(), row);
    }
}

#[test]
fn usage_rolls_off_a_bucket_at_a_time_never_all_at_once() {
    // An hour in one-minute buckets, with usage in three different minutes.
    let hour = window(60 * MINUTE, MINUTE, 1_000_000);
    let ops = &[add(0, 100), add(MINUTE + 30_000, 200), add(2 * MINUTE, 400)];
    let rows: &[Row<'_>] = &[
        ("all three", ops, 60 * MINUTE - 1, 700, 1),
        ("the first minute left", ops, 60 * MINUTE, 600, MINUTE),
        ("the second", ops, 61 * MINUTE, 400, MINUTE),
        ("the third", ops, 62 * MINUTE, 0, 0),
    ];
    for &row in rows {
        check(&hour, row);
    }
}

#[test]
fn retry_after_is_when_enough_has_rolled_off() {
    let three = &[add(0, 300), add(10_000, 300), add(20_000, 300)];
    /// (name, ops, now, needed, retry_after)
    type RetryRow<'a> = (&'a str, &'a [Op], u64, u64, Option<u64>);
    let rows: &[RetryRow<'_>] = &[
        ("empty: fits now", &[], 0, 1000, Some(0)),
        (
            "fills the window exactly: fits now",
            &[add(0, 400)],
            0,
            600,
            Some(0),
        ),
        (
            "one over: the oldest bucket frees it",
            &[add(0, 400), add(10_000, 600)],
            10_000,
            1,
            Some(MINUTE - 10_000),
        ),
        (
            "the oldest bucket is enough",
            three,
            20_000,
            300,
            Some(MINUTE - 20_000),
        ),
        (
            "needs the two oldest buckets",
            three,
            20_000,
            500,
            Some(70_000 - 20_000),
        ),
        (
            "needs all of them",
            three,
            20_000,
            1000,
            Some(80_000 - 20_000),
        ),
        ("larger than the window: never", three, 20_000, 1001, None),
        (
            "larger than the window: never, even empty",
            &[],
            0,
            1001,
            None,
        ),
        (
            // An extra charge took the window past its limit: even nothing waits.
            "over the limit: a zero cost waits too",
            &[add(0, 900), adjust(0, 0, 600)],
            0,
            0,
            Some(MINUTE),
        ),
        (
            "just before the boundary",
            &[add(0, 1000)],
            MINUTE - 1,
            1,
            Some(1),
        ),
    ];
    for &(name, ops, now, needed, want) in rows {
        let limit = minute();
        let mut usage = run(&limit, ops);
        usage.roll(&limit, now);
        let got = usage.retry_after_ms(&limit, now, needed);
        assert_eq!(got, want, "{name}: retry_after_ms({needed}) at {now}");
        assert_eq!(
            usage.fits(&limit, needed),
            want == Some(0),
            "{name}: fits agrees with a zero retry_after"
        );
        // Waiting that long is enough, and (when it was not 0) a millisecond less is not.
        if let Some(wait) = want {
            let mut later = usage.clone();
            later.roll(&limit, now + wait);
            assert!(later.fits(&limit, needed), "{name}: fits after {wait} ms");
            if wait > 0 {
                let mut sooner = usage.clone();
                sooner.roll(&limit, now + wait - 1);
                assert!(
                    !sooner.fits(&limit, needed),
                    "{name}: does not fit after {} ms",
                    wait - 1
                );
            }
        }
    }
}

#[test]
fn retry_after_counts_expired_buckets_as_freed_without_a_roll() {
    let limit = minute();
    let usage = run(&limit, &[add(0, 600), add(30_000, 400)]);
    // Not rolled: the bucket at 0 has expired at 60 s and must not make 500 wait.
    assert_eq!(usage.retry_after_ms(&limit, MINUTE, 500), Some(0));
    assert_eq!(usage.retry_after_ms(&limit, MINUTE, 700), Some(30_000));
    assert_eq!(usage.reset_ms(&limit, MINUTE), 30_000);
}

#[test]
fn adjustments_refund_and_charge_the_reserved_bucket() {
    let rows: &[Row<'_>] = &[
        (
            "a refund lowers the bucket",
            &[add(0, 500), adjust(0, 1_000, -300)],
            1_000,
            200,
            MINUTE - 1_000,
        ),
        (
            "a full refund empties the window",
            &[add(0, 500), adjust(0, 1_000, -500)],
            1_000,
            0,
            0,
        ),
        (
            "a refund never goes below zero, nor into another bucket",
            &[add(0, 500), add(10_000, 300), adjust(10_000, 10_000, -1000)],
            10_000,
            500,
            MINUTE - 10_000,
        ),
        (
            "refunding twice is clamped the same",
            &[
                add(0, 500),
                add(10_000, 300),
                adjust(10_000, 12_000, -300),
                adjust(10_000, 12_000, -300),
            ],
            12_000,
            500,
            MINUTE - 12_000,
        ),
        (
            "a refund of a bucket that holds nothing does nothing",
            &[add(0, 500), adjust(10_000, 20_000, -100)],
            20_000,
            500,
            MINUTE - 20_000,
        ),
        (
            "a refund of a rolled-off bucket does nothing",
            &[add(0, 500), add(30_000, 200), adjust(0, MINUTE, -500)],
            MINUTE,
            200,
            30_000,
        ),
        (
            "a charge raises the reserved bucket while it is live",
            &[add(0, 500), add(30_000, 100), adjust(0, 30_000, 200)],
            30_000,
            800,
            30_000,
        ),
        (
            "and rolls off with it",
            &[add(0, 500), add(30_000, 100), adjust(0, 30_000, 200)],
            MINUTE,
            100,
            30_000,
        ),
        (
            "a charge to a live bucket emptied by a refund stays in that bucket",
            &[add(0, 500), adjust(0, 10_000, -500), adjust(0, 10_000, 100)],
            10_000,
            100,
            MINUTE - 10_000,
        ),
        (
            "a charge to a rolled-off bucket goes to now's",
            &[add(0, 500), adjust(0, 70_000, 200)],
            70_000,
            200,
            MINUTE,
        ),
        (
            "a charge may pass the limit",
            &[add(0, 900), adjust(0, 0, 500)],
            0,
            1400,
            MINUTE,
        ),
        (
            "a zero adjustment does nothing",
            &[add(0, 500), adjust(0, 0, 0)],
            0,
            500,
            MINUTE,
        ),
        (
            // A reservation time from the future is taken as now.
            "a charge at a future time goes to now's bucket",
            &[add(0, 100), adjust(50_000, 10_000, 100)],
            MINUTE,
            100,
            10_000,
        ),
    ];
    for &row in rows {
        check(&minute(), row);
    }
}

#[test]
fn a_long_idle_gap_empties_everything() {
    let limit = minute();
    let full: Vec<Op> = (0..6).map(|i| add(i * 10_000, 100)).collect();
    let rows: &[Row<'_>] = &[
        ("every bucket held", &full, 59_999, 600, 1),
        ("a thousand windows later", &full, 1_000 * MINUTE, 0, 0),
        ("near the end of time", &full, u64::MAX - 1, 0, 0),
    ];
    for &row in rows {
        check(&limit, row);
    }
    // The next add after the gap starts afresh.
    let gap = 1_000 * MINUTE;
    let mut ops = full.clone();
    ops.push(add(gap, 7));
    check(&limit, ("after the gap", &ops, gap, 7, MINUTE));
}

#[test]
fn numbers_near_u64_max_saturate_instead_of_wrapping() {
    let max = u64::MAX;
    let huge = window(MINUTE, 10_000, max);
    // A bucket saturates; the total over several stays exact but reports u64::MAX.
    let usage = check(
        &huge,
        (
            "one bucket saturates",
            &[add(0, max), add(0, max)],
            0,
            max,
            MINUTE,
        ),
    );
    assert!(!usage.fits(&huge, 1), "a full u64 window has no room for 1");
    assert!(
        usage.fits(&huge, 0),
        "but exactly at the limit still fits 0"
    );
    let usage = check(
        &huge,
        (
            "two buckets report u64::MAX",
            &[add(0, max), add(10_000, max)],
            10_000,
            max,
            MINUTE - 10_000,
        ),
    );
    assert!(!usage.fits(&huge, 0), "twice u64::MAX is over the limit");
    assert_eq!(
        usage.retry_after_ms(&huge, 10_000, max),
        Some(MINUTE),
        "needs both buckets gone"
    );
    // A small limit and a huge request: never, and no overflow computing it.
    assert_eq!(
        run(&minute(), &[add(0, 10)]).retry_after_ms(&minute(), 0, max),
        None
    );
    assert!(!run(&minute(), &[add(0, 10)]).fits(&minute(), max));

    // Refunds and charges of any size.
    let rows: &[Row<'_>] = &[
        (
            "an i128::MIN refund",
            &[add(0, 500), adjust(0, 0, i128::MIN)],
            0,
            0,
            0,
        ),
        (
            "an i128::MAX charge",
            &[add(0, 500), adjust(0, 0, i128::MAX)],
            0,
            max,
            MINUTE,
        ),
    ];
    for &row in rows {
        check(&minute(), row);
    }

    // Times at the end of the clock: expiry is past u64::MAX and must not wrap to "expired".
    let end = max - 5;
    let expires = (u128::from(end / 10_000) + 6) * 10_000;
    let reset = u64::try_from(expires - u128::from(end)).unwrap();
    check(
        &minute(),
        (
            "usage at the end of time",
            &[add(end, 100)],
            max,
            100,
            reset - 5,
        ),
    );
}

#[test]
fn degenerate_shapes_stay_total() {
    let rows: &[(&str, WindowLimit, Row<'_>)] = &[
        (
            "bucket_ms 0 counts as 1 ms",
            window(10, 0, 100),
            ("", &[add(3, 10)], 12, 10, 1),
        ),
        (
            "a window shorter than a bucket is one bucket",
            window(5, 10, 100),
            ("", &[add(3, 10)], 9, 10, 1),
        ),
        (
            "a window that is not a whole number of buckets rounds down",
            window(25, 10, 100),
            ("", &[add(3, 10)], 20, 0, 0),
        ),
    ];
    for (name, limit, (_, ops, now, used, reset)) in rows {
        check(limit, (name, ops, *now, *used, *reset));
    }
}

#[test]
fn a_reshaped_window_keeps_its_usage() {
    // Usage taken with 10 s buckets, then read with 1 s buckets over the same minute: the old
    // bucket starting at 10 s now expires with the new bucket holding 10 s, at 70 s.
    let usage = run(&minute(), &[add(15_000, 100)]);
    let reshaped = window(MINUTE, 1_000, 1000);
    let mut later = usage.clone();
    later.roll(&reshaped, 70_000 - 1);
    assert_eq!(later.used(), 100);
    assert_eq!(later.reset_ms(&reshaped, 70_000 - 1), 1);
    later.roll(&reshaped, 70_000);
    assert!(later.is_empty());
}
