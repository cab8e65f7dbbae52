//! One tenant's usage of one rolling window: the reference for the contract's window arithmetic.
//!
//! The embedded store keeps a `WindowUsage` per tenant and window; the Redis store's scripts
//! compute the same answers over a hash of buckets, and this module is what they are checked
//! against (the contract tests run both). Pure: no I/O, no clock; `now_ms` is an argument.
//!
//! # Semantics
//!
//! With `B = bucket_ms` and `k = window_ms / B` buckets:
//!
//! - Usage at `at_ms` lands in bucket `b = at_ms / B`.
//! - Bucket `b` is live at `now_ms` while `b + k > now_ms / B`; it expires whole at
//!   `(b + k) * B`. So usage is kept for between `window_ms - B` and `window_ms`, and rolls off
//!   bucket by bucket, never all at once.
//! - `used` is the sum of the live buckets. A cost fits while `used + cost <= limit`, computed
//!   exactly (no wrapping, no saturation that could let a huge cost through).
//! - `retry_after_ms(needed)`: `None` if `needed > limit` (it can never fit); 0 if it fits now;
//!   otherwise walk the live buckets oldest first, adding up what each frees, and answer the
//!   expiry of the first bucket after which `used - freed + needed <= limit`, less `now_ms`.
//! - `reset_ms`: the oldest live bucket's expiry less `now_ms`; 0 for an empty window.
//! - `adjust(at_ms, delta)`: a refund (`delta < 0`) lowers bucket `at_ms / B` but never below
//!   zero, and does nothing if that bucket holds nothing or has rolled off; a charge
//!   (`delta > 0`) raises that bucket if it is still live, else now's bucket. A charge may take
//!   a window past its limit: the tokens were spent, and later reservations wait for them to
//!   roll off.
//! - A bucket that reaches zero is removed, so a window whose usage was all refunded is empty
//!   (`reset_ms` 0), not "empty until a bucket of nothing expires". (A script deletes the field
//!   when it reaches zero, or skips zero fields.)
//!
//! # Edges
//!
//! - Amounts saturate at `u64::MAX` per bucket; the running total is a `u128`, so it is always
//!   exactly the sum of the buckets and `used()` saturates only when reported.
//! - `bucket_ms == 0` is treated as 1 and a window shorter than a bucket as one bucket (the
//!   policy rejects both; this only keeps the arithmetic total). A `window_ms` that `bucket_ms`
//!   does not divide is rounded down to whole buckets.
//! - Time may only go forward in practice (the store's clock is monotonic), but nothing breaks
//!   if it does not: a `now_ms` earlier than the newest bucket adds to its own bucket in order,
//!   and an `at_ms` later than `now_ms` is treated as `now_ms`.
//! - Buckets are kept by their start time (`b * B`), not their number, so a window whose
//!   `bucket_ms` changed (a configuration reload) keeps its usage, each old bucket now expiring
//!   with the new bucket that holds its start.

use std::collections::VecDeque;

use super::{WindowLimit, WindowState};

/// One tenant's usage of one window: the live buckets, oldest first, and their total.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WindowUsage {
    /// Nonzero buckets in order of start time. After `roll(now)` all of them are live at `now`,
    /// so there are at most `window_ms / bucket_ms` of them.
    buckets: VecDeque<Bucket>,
    /// Exactly the sum of `buckets`' amounts (a `u128` cannot overflow on a sum of `u64`s).
    total: u128,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bucket {
    /// `bucket number * bucket_ms`.
    start_ms: u64,
    /// Never zero: a bucket that reaches zero is removed.
    amount: u64,
}

/// A window's geometry, made total (see "Edges").
#[derive(Clone, Copy)]
struct Shape {
    bucket_ms: u64,
    buckets: u64,
}

impl Shape {
    fn of(limit: &WindowLimit) -> Shape {
        let bucket_ms = limit.bucket_ms.max(1);
        Shape {
            bucket_ms,
            buckets: (limit.window_ms / bucket_ms).max(1),
        }
    }

    fn number(self, ms: u64) -> u64 {
        ms / self.bucket_ms
    }

    fn start(self, ms: u64) -> u64 {
        self.number(ms) * self.bucket_ms
    }

    /// When the bucket holding `ms` expires; a `u128` because it can pass `u64::MAX`.
    fn expires_at(self, ms: u64) -> u128 {
        (u128::from(self.number(ms)) + u128::from(self.buckets)) * u128::from(self.bucket_ms)
    }

    fn live(self, ms: u64, now_ms: u64) -> bool {
        self.expires_at(ms) > u128::from(now_ms)
    }

    /// ms from `now_ms` until the bucket holding `ms` expires (0 if it has).
    fn until_expiry(self, ms: u64, now_ms: u64) -> u64 {
        clamp_u64(self.expires_at(ms).saturating_sub(u128::from(now_ms)))
    }
}

fn clamp_u64(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

impl WindowUsage {
    /// Drops the buckets that have rolled off at `now_ms`. Amortized O(1): buckets expire
    /// oldest first, so only the front is ever looked at, and a jump of any length costs at
    /// most one step per bucket held.
    pub fn roll(&mut self, limit: &WindowLimit, now_ms: u64) {
        let shape = Shape::of(limit);
        while let Some(oldest) = self.buckets.front() {
            if shape.live(oldest.start_ms, now_ms) {
                break;
            }
            self.total -= u128::from(oldest.amount);
            self.buckets.pop_front();
        }
    }

    /// The window's usage as of the last `roll` (saturating at `u64::MAX`).
    pub fn used(&self) -> u64 {
        clamp_u64(self.total)
    }

    /// Nothing held: the store may forget this window.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Whether `cost` more fits under `limit.limit` (as of the last `roll`), exactly.
    pub fn fits(&self, limit: &WindowLimit, cost: u64) -> bool {
        self.total + u128::from(cost) <= u128::from(limit.limit)
    }

    /// Rolls to `now_ms` and adds `amount` to now's bucket.
    pub fn add(&mut self, limit: &WindowLimit, now_ms: u64, amount: u64) {
        self.roll(limit, now_ms);
        self.charge(Shape::of(limit), now_ms, amount);
    }

    /// Rolls to `now_ms` and adjusts the bucket holding `at_ms` by `delta`: a refund lowers it,
    /// never below zero, and does nothing if the bucket is empty or gone; a charge raises it,
    /// or now's bucket if it has rolled off.
    pub fn adjust(&mut self, limit: &WindowLimit, at_ms: u64, now_ms: u64, delta: i128) {
        self.roll(limit, now_ms);
        let shape = Shape::of(limit);
        let at_ms = at_ms.min(now_ms);
        let amount = clamp_u64(delta.unsigned_abs());
        if delta > 0 {
            let target = if shape.live(at_ms, now_ms) {
                at_ms
            } else {
                now_ms
            };
            self.charge(shape, target, amount);
        } else if delta < 0
            && let Ok(index) = self.find(shape, at_ms)
        {
            let bucket = &mut self.buckets[index];
            let refund = bucket.amount.min(amount);
            bucket.amount -= refund;
            self.total -= u128::from(refund);
            if bucket.amount == 0 {
                self.buckets.remove(index);
            }
        }
    }

    /// ms from `now_ms` until `needed` more fits under `limit.limit`: 0 if it fits now, `None`
    /// if it never can (`needed > limit.limit`). Buckets already expired at `now_ms` count as
    /// freed, so this is right whether or not the caller rolled first.
    pub fn retry_after_ms(&self, limit: &WindowLimit, now_ms: u64, needed: u64) -> Option<u64> {
        let (limit_value, needed) = (u128::from(limit.limit), u128::from(needed));
        if needed > limit_value {
            return None;
        }
        // Everything held minus what must roll off for `needed` to fit.
        let must_free = (self.total + needed).saturating_sub(limit_value);
        let shape = Shape::of(limit);
        let mut freed = 0u128;
        for bucket in &self.buckets {
            if freed >= must_free {
                break;
            }
            freed += u128::from(bucket.amount);
            if freed >= must_free {
                return Some(shape.until_expiry(bucket.start_ms, now_ms));
            }
        }
        // Nothing had to be freed (freeing everything always suffices, as needed <= limit).
        Some(0)
    }

    /// ms from `now_ms` until the oldest live usage rolls off; 0 if the window is empty.
    pub fn reset_ms(&self, limit: &WindowLimit, now_ms: u64) -> u64 {
        let shape = Shape::of(limit);
        self.buckets
            .iter()
            .find(|bucket| shape.live(bucket.start_ms, now_ms))
            .map_or(0, |bucket| shape.until_expiry(bucket.start_ms, now_ms))
    }

    /// The window as reported to clients, as of the last `roll` (which should be at `now_ms`).
    pub fn state(&self, limit: &WindowLimit, now_ms: u64) -> WindowState {
        WindowState {
            used: self.used(),
            limit: limit.limit,
            reset_ms: self.reset_ms(limit, now_ms),
        }
    }

    /// The index of the bucket holding `ms`, or where it would go to keep start order.
    fn find(&self, shape: Shape, ms: u64) -> Result<usize, usize> {
        let number = shape.number(ms);
        let index = self
            .buckets
            .partition_point(|bucket| shape.number(bucket.start_ms) < number);
        match self.buckets.get(index) {
            Some(bucket) if shape.number(bucket.start_ms) == number => Ok(index),
            _ => Err(index),
        }
    }

    /// Adds `amount` to the bucket holding `ms` (saturating), creating it if needed.
    fn charge(&mut self, shape: Shape, ms: u64, amount: u64) {
        if amount == 0 {
            return;
        }
        match self.find(shape, ms) {
            Ok(index) => {
                let bucket = &mut self.buckets[index];
                let before = bucket.amount;
                bucket.amount = before.saturating_add(amount);
                self.total += u128::from(bucket.amount - before);
            }
            Err(index) => {
                let start_ms = shape.start(ms);
                self.buckets.insert(index, Bucket { start_ms, amount });
                self.total += u128::from(amount);
            }
        }
    }
}

#[cfg(test)]
mod tests;
