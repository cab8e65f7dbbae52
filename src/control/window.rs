//! A latency quantile over a sliding time window, in bounded memory: what the control loop
//! reads as "p99 TTFT over the last 10 s".
//!
//! Why a window and not the Prometheus histogram: the controller must react to what latency is
//! *now*, and a cumulative histogram remembers the whole process lifetime. Why not a list of
//! samples: at a few thousand requests per second a window's list is large and grows with load;
//! an admission service must not let traffic grow its memory.
//!
//! # Shape
//!
//! The window is cut into `slots` sub-windows of `window / slots` each, kept in a ring. Every
//! slot is a fixed log-linear histogram (HDR-style): each power of two of seconds is split into
//! 16 equal buckets, from 2^-10 s (about 1 ms) to 2^12 s (about 68 min), 352 buckets in all.
//! A quantile is reported as the midpoint of the bucket it falls in, so it is within 1/32
//! (about 3.1%) of a sample in that bucket. Memory is `slots` × 352 counters, whatever the
//! sample count, plus one entry per *pending* request (below); a quantile merges the live slots
//! bucket by bucket (`slots` × 352 additions, nothing at a 1 s tick).
//!
//! # Pending requests and restarts
//!
//! A request can be counted as pending from its start (`start`) until it answers (`answered`)
//! or ends without answering (`abandon`); `Pending` makes the server's calls, exactly once per
//! request. `quantile_counting_overdue` counts the pending requests already older than a
//! threshold at their age: a request stuck in the upstream's queue is known to be late before
//! it answers. The pending set is keyed by start instant, one entry per distinct instant, so it
//! is bounded by the requests in flight. `restart` forgets every sample and every pending
//! request, and ignores requests started before it: the controller's epoch after a cut.
//!
//! # Expiry
//!
//! Slots expire whole. A slot is live while it is the current one or one of the `slots - 1`
//! before it; so a sample is forgotten between `window - window / slots` and `window` after it
//! was recorded, never later. (Forgetting a little early, rather than keeping a little too long,
//! is the side to err on: stale samples from before a decrease make a controller cut again,
//! seed 001 §5.)
//!
//! # Time
//!
//! `now` is always an argument; nothing here reads a clock, so tests step time by hand.
//! Slot boundaries count from the first `now` ever passed in. Time only moves forward: a `now`
//! earlier than the latest one seen is treated as the latest (a late sample lands in the
//! current slot rather than reviving an expired one), and a jump longer than the whole window
//! simply finds every slot expired.
//!
//! # Odd samples
//!
//! - NaN and negative values are not latencies (a broken measurement, not a fast request):
//!   they are dropped and not counted.
//! - 0 and anything under 2^-10 s count in the bottom bucket (reported as about 1 ms).
//! - +∞ and anything from 2^12 s up count in the top bucket (reported as about 67 min). A
//!   very slow sample must never vanish: hiding it would tell the controller latency is fine.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// Buckets per power of two is `2^SUB_BUCKET_BITS`. With 16, a bucket is at most 1/16 of its
/// lower edge wide, so its midpoint is within 1/32 of anything in it.
const SUB_BUCKET_BITS: u32 = 4;
const SUB_BUCKETS: usize = 1 << SUB_BUCKET_BITS;
/// 2^-10 s ≈ 0.98 ms: the smallest latency told apart from zero.
const MIN_EXPONENT: i32 = -10;
/// 2^12 s ≈ 68 min: everything from here up shares the top bucket.
const MAX_EXPONENT: i32 = 12;
const BUCKETS: usize = (MAX_EXPONENT - MIN_EXPONENT) as usize * SUB_BUCKETS;
/// f64 layout: 52 mantissa bits under 11 exponent bits biased by 1023.
const MANTISSA_BITS: u32 = 52;
const EXPONENT_BIAS: i32 = 1023;

/// Latency samples over the last `window`, in `slots` sub-windows that expire whole.
#[derive(Clone)]
pub struct LatencyWindow {
    slot_width: Duration,
    slots: Vec<Slot>,
    /// Where slot numbering starts: the first `now` seen.
    origin: Option<Instant>,
    /// The highest slot number seen so far; time never goes back behind it.
    latest: u64,
    /// Samples of requests that started before this instant are not recorded (`restart`).
    since: Option<Instant>,
    /// Requests started and still waiting for their latency, by start instant: how many.
    /// At most one entry per request in flight, so its size is bounded by the in-flight budget.
    pending: BTreeMap<Instant, u32>,
}

#[derive(Clone)]
struct Slot {
    /// Which slot number (since `origin`) the counts belong to.
    number: u64,
    total: u64,
    counts: Box<[u64]>,
}

impl LatencyWindow {
    /// A window of `window`, cut into `slots` sub-windows.
    ///
    /// More slots expire more smoothly and cost more memory and merge time. `slots == 0` is
    /// taken as 1, and a window shorter than `slots` nanoseconds as 1 ns per slot: there is no
    /// useful way to fail here, and either still bounds memory.
    pub fn new(window: Duration, slots: u32) -> Self {
        let slots = slots.max(1);
        let slot_width = (window / slots).max(Duration::from_nanos(1));
        LatencyWindow {
            slot_width,
            slots: (0..slots)
                .map(|_| Slot {
                    number: 0,
                    total: 0,
                    counts: vec![0; BUCKETS].into_boxed_slice(),
                })
                .collect(),
            origin: None,
            latest: 0,
            since: None,
            pending: BTreeMap::new(),
        }
    }

    /// A request started at `started` and is waiting for its latency, until `answered` or
    /// `abandon` is called for it; `quantile_counting_overdue` counts it once it is overdue.
    /// (In the server, `Pending` makes the call that ends it, whichever way the request ends.)
    ///
    /// Why: a request stuck in the upstream's queue reports its latency only when it gets
    /// out, so a window of finished samples hears about a saturated upstream late, from the
    /// requests that were stuck longest, and latest of all. Its age is a lower bound on its
    /// latency, known now.
    pub fn start(&mut self, started: Instant) {
        if self.since.is_some_and(|since| started < since) {
            return;
        }
        *self.pending.entry(started).or_insert(0) += 1;
    }

    /// A request counted by `start` ended without a latency: it stops counting.
    pub fn abandon(&mut self, started: Instant) {
        if let Some(count) = self.pending.get_mut(&started) {
            *count -= 1;
            if *count == 0 {
                self.pending.remove(&started);
            }
        }
    }

    /// Forgets every sample, and from now on ignores samples of requests that started before
    /// `now` (see `record_started`).
    ///
    /// For the controller after a cut: a request dispatched under the old, larger budget
    /// reports its latency after the cut, and would make the controller cut again for a
    /// problem already handled. Waiting out a fixed cooldown guesses how long those stragglers
    /// take; an epoch knows which ones they are.
    pub fn restart(&mut self, now: Instant) {
        for slot in &mut self.slots {
            slot.total = 0;
            slot.counts.fill(0);
        }
        self.pending.clear();
        self.since = Some(now);
    }

    /// Records the latency of a request that started at `started`, as `record` does, unless it
    /// started before the last `restart`. It does not end a `start`: only the request that
    /// called `start` may (`answered`), or it would end another request started at the same
    /// instant.
    pub fn record_started(&mut self, now: Instant, started: Instant, seconds: f64) {
        if self.since.is_some_and(|since| started < since) {
            return;
        }
        self.record(now, seconds);
    }

    /// The request counted by `start(started)` answered after `seconds`: it stops being pending
    /// and its latency is recorded (as `record_started`).
    pub fn answered(&mut self, now: Instant, started: Instant, seconds: f64) {
        self.abandon(started);
        self.record_started(now, started, seconds);
    }

    /// Records one latency, in seconds, observed at `now` (see the module docs for NaN,
    /// negative, zero and infinite values).
    pub fn record(&mut self, now: Instant, seconds: f64) {
        let current = self.advance(now);
        let Some(bucket) = bucket_of(seconds) else {
            return;
        };
        let ring = self.slots.len() as u64;
        let slot = &mut self.slots[(current % ring) as usize];
        if slot.number != current {
            // The slot last held samples from a whole window ago (or longer): start it afresh.
            slot.number = current;
            slot.total = 0;
            slot.counts.fill(0);
        }
        slot.counts[bucket] += 1;
        slot.total += 1;
    }

    /// The q-quantile (0 < q <= 1) of samples within the window ending at `now`, or None if
    /// there are none.
    ///
    /// Nearest rank: the smallest sample with at least `q` of all samples at or below it,
    /// reported as its bucket's midpoint. A `q` outside (0, 1] is clamped into it (so 0 and NaN
    /// give the minimum).
    pub fn quantile(&mut self, now: Instant, q: f64) -> Option<f64> {
        self.quantile_with(now, q, None)
    }

    /// The q-quantile, as `quantile`, with every pending request (see `start`) that is already
    /// older than `overdue_after` counted as a sample of its age so far; and how many samples
    /// that was over.
    ///
    /// Only the overdue ones count: a young pending request may yet answer fast or slow, and
    /// counting it at its age would pull the quantile down on no evidence. An overdue one is
    /// known to be slower than `overdue_after`, whenever it answers.
    pub fn quantile_counting_overdue(
        &mut self,
        now: Instant,
        q: f64,
        overdue_after: Duration,
    ) -> (Option<f64>, u64) {
        let mut overdue = [0u64; BUCKETS];
        let count = self.add_overdue(now, overdue_after, &mut overdue);
        let quantile = self.quantile_with(now, q, Some(&overdue));
        (quantile, self.count(now) + count)
    }

    /// The samples `quantile_counting_overdue` would read, as sparse `(bucket, count)` pairs:
    /// what a fleet member reports so the leader takes one quantile over the whole deployment
    /// (`merged_quantile`), rather than a quantile of quantiles.
    pub fn histogram_counting_overdue(
        &mut self,
        now: Instant,
        overdue_after: Duration,
    ) -> Vec<(u16, u64)> {
        let mut dense = vec![0u64; BUCKETS];
        self.add_overdue(now, overdue_after, &mut dense);
        let current = self.advance(now);
        let ring = self.slots.len() as u64;
        for slot in self
            .slots
            .iter()
            .filter(|slot| is_live(slot, current, ring))
        {
            for (total, count) in dense.iter_mut().zip(slot.counts.iter()) {
                *total += count;
            }
        }
        dense
            .iter()
            .enumerate()
            .filter(|(_, count)| **count > 0)
            .map(|(bucket, &count)| (bucket as u16, count))
            .collect()
    }

    /// Adds every pending request older than `overdue_after` to `counts` at its age so far;
    /// returns how many.
    fn add_overdue(&self, now: Instant, overdue_after: Duration, counts: &mut [u64]) -> u64 {
        let mut added = 0;
        for (&started, &n) in &self.pending {
            let age = now.saturating_duration_since(started);
            if age <= overdue_after {
                // The map is ordered by start: every later entry is younger.
                break;
            }
            if let Some(bucket) = bucket_of(age.as_secs_f64()) {
                counts[bucket] += u64::from(n);
                added += u64::from(n);
            }
        }
        added
    }

    fn quantile_with(&mut self, now: Instant, q: f64, extra: Option<&[u64]>) -> Option<f64> {
        let current = self.advance(now);
        let extra_at = |bucket: usize| extra.map_or(0, |extra| extra[bucket]);
        let total = self.live_total(current) + (0..BUCKETS).map(extra_at).sum::<u64>();
        if total == 0 {
            return None;
        }
        let rank = nearest_rank(q, total);
        let ring = self.slots.len() as u64;
        let mut seen = 0;
        for bucket in 0..BUCKETS {
            seen += extra_at(bucket);
            seen += self
                .slots
                .iter()
                .filter(|slot| is_live(slot, current, ring))
                .map(|slot| slot.counts[bucket])
                .sum::<u64>();
            if seen >= rank {
                return Some(bucket_midpoint(bucket));
            }
        }
        // Unreachable: the buckets of the live slots add up to `total` and `rank <= total`.
        Some(bucket_midpoint(BUCKETS - 1))
    }

    /// How many samples are within the window ending at `now` (pending requests are not).
    pub fn count(&mut self, now: Instant) -> u64 {
        let current = self.advance(now);
        self.live_total(current)
    }

    /// Moves time to `now` (never backwards) and returns the current slot number.
    fn advance(&mut self, now: Instant) -> u64 {
        let origin = *self.origin.get_or_insert(now);
        let elapsed = now.saturating_duration_since(origin).as_nanos();
        let number = elapsed / self.slot_width.as_nanos();
        // u64 slot numbers last 584 years at 1 ns per slot; saturate rather than wrap anyway.
        let number = u64::try_from(number).unwrap_or(u64::MAX);
        self.latest = self.latest.max(number);
        self.latest
    }

    fn live_total(&self, current: u64) -> u64 {
        let ring = self.slots.len() as u64;
        self.slots
            .iter()
            .filter(|slot| is_live(slot, current, ring))
            .map(|slot| slot.total)
            .sum()
    }
}

/// The q-quantile over several windows' histograms (`histogram_counting_overdue`) merged
/// bucket by bucket, and the number of samples: the same nearest rank as `quantile`. Buckets
/// out of range (a report from a foreign build) are ignored.
pub fn merged_quantile<'a>(
    histograms: impl IntoIterator<Item = &'a [(u16, u64)]>,
    q: f64,
) -> (Option<f64>, u64) {
    let mut dense = vec![0u64; BUCKETS];
    for histogram in histograms {
        for &(bucket, count) in histogram {
            if let Some(total) = dense.get_mut(usize::from(bucket)) {
                *total = total.saturating_add(count);
            }
        }
    }
    let total: u64 = dense.iter().sum();
    if total == 0 {
        return (None, 0);
    }
    let rank = nearest_rank(q, total);
    let mut seen = 0;
    for (bucket, count) in dense.iter().enumerate() {
        seen += count;
        if seen >= rank {
            return (Some(bucket_midpoint(bucket)), total);
        }
    }
    (Some(bucket_midpoint(BUCKETS - 1)), total)
}

/// The rank (1-based) of the q-quantile among `total` samples, by nearest rank. The tiny nudge
/// keeps float noise from rounding an exact rank up: p99 of 100 samples is the 99th, not the
/// 100th.
fn nearest_rank(q: f64, total: u64) -> u64 {
    let rank = (q.clamp(0.0, 1.0) * total as f64 - 1e-9).ceil();
    (rank as u64).clamp(1, total)
}

/// A request counted as pending in a shared window (`LatencyWindow::start`), ended exactly
/// once: by `answered`, or on drop (`abandon`), whichever way the request ends, a panic
/// included. A pending entry left behind would age forever and read as a breach.
pub struct Pending {
    window: Arc<Mutex<LatencyWindow>>,
    started: Instant,
    /// `answered` ended it; the drop must not end it again.
    ended: bool,
}

impl Pending {
    /// Counts a request started at `started` as pending in `window` until this is answered or
    /// dropped.
    pub fn start(window: &Arc<Mutex<LatencyWindow>>, started: Instant) -> Pending {
        lock(window).start(started);
        Pending {
            window: window.clone(),
            started,
            ended: false,
        }
    }

    /// The request answered after `seconds`: recorded, and no longer pending.
    pub fn answered(mut self, now: Instant, seconds: f64) {
        lock(&self.window).answered(now, self.started, seconds);
        self.ended = true;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.ended {
            lock(&self.window).abandon(self.started);
        }
    }
}

/// The shared window, locked. A poisoned lock only means another thread panicked mid-update;
/// the counters are still counters.
pub fn lock(window: &Mutex<LatencyWindow>) -> std::sync::MutexGuard<'_, LatencyWindow> {
    window
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl fmt::Debug for LatencyWindow {
    // The counters are thousands of numbers; the shape is what helps when debugging.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyWindow")
            .field("slot_width", &self.slot_width)
            .field("slots", &self.slots.len())
            .field("latest_slot", &self.latest)
            .field("since", &self.since)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

/// Whether `slot` holds samples of the window whose newest slot is `current`.
fn is_live(slot: &Slot, current: u64, ring: u64) -> bool {
    slot.total > 0 && slot.number <= current && current - slot.number < ring
}

/// The bucket a latency counts in, or None for a value that is not a latency.
fn bucket_of(seconds: f64) -> Option<usize> {
    if seconds.is_nan() || seconds < 0.0 {
        return None;
    }
    if seconds < 2f64.powi(MIN_EXPONENT) {
        return Some(0);
    }
    if seconds >= 2f64.powi(MAX_EXPONENT) {
        return Some(BUCKETS - 1);
    }
    // A normal float in range: its exponent picks the power of two and the top mantissa bits
    // the linear bucket within it. Exact, and no logarithm.
    let bits = seconds.to_bits();
    let exponent = ((bits >> MANTISSA_BITS) & 0x7ff) as i32 - EXPONENT_BIAS;
    let sub = ((bits >> (MANTISSA_BITS - SUB_BUCKET_BITS)) as usize) & (SUB_BUCKETS - 1);
    Some((exponent - MIN_EXPONENT) as usize * SUB_BUCKETS + sub)
}

/// The value a bucket reports: its midpoint.
fn bucket_midpoint(bucket: usize) -> f64 {
    let octave = (bucket / SUB_BUCKETS) as i32;
    let sub = (bucket % SUB_BUCKETS) as f64;
    2f64.powi(MIN_EXPONENT + octave) * (1.0 + (sub + 0.5) / SUB_BUCKETS as f64)
}

#[cfg(test)]
mod tests;
