//! What clients are told about their budgets: OpenAI's `x-ratelimit-*` headers, the IETF
//! `RateLimit-Policy` / `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers-10), and the 429
//! that names the limit, the usage and when to come back.
//!
//! Pure: windows and their states in, header pairs and replies out.

use std::fmt::Write as _;

use super::{LocalReply, Reason};
use crate::budget::ledger::{BudgetState, Denial};
use crate::budget::{Denied, DeniedLimit, Quantity, WindowLimit, WindowState};

/// A `Retry-After` longer than this makes OpenAI's SDKs give up rather than wait (they honour up
/// to 60 s, newer ones 120 s), and waiting that long for a request is rarely what a caller wants:
/// say so with `x-should-retry: false`.
const RETRY_SOON_MS: u64 = 60_000;

/// When a concurrency slot frees is when some request of the tenant ends, which nobody knows;
/// the store can only say when a lease would expire (its TTL, tens of seconds, and pessimistic
/// for a live request). Clients are told to retry this soon instead.
const CONCURRENCY_RETRY_MS: u64 = 1_000;

/// The headers that tell an admitted request's client where its budgets stand.
pub fn granted_headers(budgets: &BudgetState) -> Vec<(&'static str, String)> {
    rate_limit_headers(&budgets.windows, &budgets.states, budgets.concurrency)
}

/// The reply to a reservation the ledger refused, for a request of tier `tier`.
pub fn denial(denial: &Denial, tier: &str) -> LocalReply {
    match denial {
        Denial::Limit {
            windows,
            denied,
            max_concurrent,
        } => refusal(windows, denied, *max_concurrent, tier),
        Denial::StoreUnavailable => LocalReply::new(
            Reason::BudgetStoreUnavailable,
            "token budgets cannot be checked right now (the budget store is unavailable); retry \
             shortly",
        ),
        Denial::ReplicaConcurrencyCap { cap } => LocalReply::new(
            Reason::ConcurrencyLimitReached,
            format!(
                "Rate limit reached for concurrent requests: the budget store is unavailable, so \
                 this replica allows {cap} at a time per tenant. Please try again in 1s."
            ),
        )
        .with_header("retry-after", "1"),
    }
}

/// Headers describing `windows` (with their `states`, same order) and concurrency.
pub fn rate_limit_headers(
    windows: &[WindowLimit],
    states: &[WindowState],
    concurrency: Option<(u32, u32)>,
) -> Vec<(&'static str, String)> {
    // Six of OpenAI's and the two IETF fields at most.
    let mut headers = Vec::with_capacity(8);
    let pairs = || windows.iter().zip(states);
    // OpenAI's headers describe one requests limit and one tokens limit: the tightest of each.
    let tightest = |quantity| {
        pairs()
            .filter(|(w, _)| w.quantity == quantity)
            .min_by_key(|(_, s)| s.limit.saturating_sub(s.used))
    };
    for (quantity, suffix) in [
        (Quantity::Requests, "requests"),
        (Quantity::Tokens, "tokens"),
    ] {
        if let Some((_, state)) = tightest(quantity) {
            let (limit, remaining, reset) = match suffix {
                "requests" => (
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ),
                _ => (
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ),
            };
            headers.push((limit, state.limit.to_string()));
            headers.push((
                remaining,
                state.limit.saturating_sub(state.used).to_string(),
            ));
            headers.push((reset, go_duration(state.reset_ms)));
        }
    }
    // Each field written in place, one string each, not a string per window joined after.
    let mut policy = String::new();
    let mut remaining = String::new();
    let separate = |field: &mut String| {
        if !field.is_empty() {
            field.push_str(", ");
        }
    };
    for (w, s) in pairs() {
        let unit = match w.quantity {
            Quantity::Tokens => ";qu=\"tokens\"",
            Quantity::Requests => "",
        };
        separate(&mut policy);
        write!(
            policy,
            "\"{}\";q={};w={}{unit}",
            w.name,
            w.limit,
            w.window_ms / 1000
        )
        .expect("writing to a String");
        separate(&mut remaining);
        write!(
            remaining,
            "\"{}\";r={};t={}",
            w.name,
            s.limit.saturating_sub(s.used),
            s.reset_ms.div_ceil(1000)
        )
        .expect("writing to a String");
    }
    if let Some((used, limit)) = concurrency {
        separate(&mut policy);
        write!(
            policy,
            "\"concurrency\";q={limit};qu=\"concurrent-requests\""
        )
        .expect("writing to a String");
        separate(&mut remaining);
        write!(
            remaining,
            "\"concurrency\";r={}",
            limit.saturating_sub(used)
        )
        .expect("writing to a String");
    }
    if !policy.is_empty() {
        headers.push(("ratelimit-policy", policy));
        headers.push(("ratelimit", remaining));
    }
    headers
}

/// The 429 for a denied reservation.
pub fn refusal(
    windows: &[WindowLimit],
    denied: &Denied,
    concurrency_limit: Option<u32>,
    tier: &str,
) -> LocalReply {
    let (reason, what) = match denied.limit {
        DeniedLimit::Window(i) => {
            let window = &windows[i];
            let reason = match (window.quantity, denied.retry_after_ms) {
                (_, None) => Reason::RequestExceedsBudget,
                (Quantity::Tokens, _) => Reason::TokenBudgetExhausted,
                (Quantity::Requests, _) => Reason::RequestRateExceeded,
            };
            (reason, format!("{} ({})", describe(window), window.name))
        }
        DeniedLimit::Concurrency => (
            Reason::ConcurrencyLimitReached,
            "concurrent requests (concurrency)".to_owned(),
        ),
    };
    let retry_after_ms = match denied.limit {
        DeniedLimit::Concurrency => denied.retry_after_ms.map(|ms| ms.min(CONCURRENCY_RETRY_MS)),
        DeniedLimit::Window(_) => denied.retry_after_ms,
    };
    let message = match retry_after_ms {
        None => format!(
            "Request too large for {what} in tier {tier:?}: it needs {} but the limit is {}. \
             Reduce the prompt or max_tokens; retrying will not help.",
            denied.requested, denied.allowed
        ),
        Some(ms) => format!(
            "Rate limit reached for {what} in tier {tier:?}: limit {}, used {}, requested {}. \
             Please try again in {}.",
            denied.allowed,
            denied.used,
            denied.requested,
            go_duration(ms)
        ),
    };
    let mut reply = LocalReply::new(reason, message);
    match retry_after_ms {
        Some(ms) => {
            // Whole seconds, rounded up: retrying a moment early just earns another 429.
            reply = reply
                .with_header("retry-after", ms.div_ceil(1000).max(1).to_string())
                .with_header("retry-after-ms", ms.to_string());
            if ms > RETRY_SOON_MS {
                reply = reply.with_header("x-should-retry", "false");
            }
        }
        None => reply = reply.with_header("x-should-retry", "false"),
    }
    let concurrency = concurrency_limit.map(|limit| {
        let used = match denied.limit {
            DeniedLimit::Concurrency => denied.used as u32,
            DeniedLimit::Window(_) => 0,
        };
        (used, limit)
    });
    for (name, value) in rate_limit_headers(windows, &denied.windows, concurrency) {
        reply = reply.with_header(name, value);
    }
    reply
}

fn describe(window: &WindowLimit) -> &'static str {
    match (window.quantity, window.window_ms) {
        (Quantity::Tokens, 60_000) => "tokens per minute",
        (Quantity::Tokens, 3_600_000) => "tokens per hour",
        (Quantity::Tokens, 86_400_000) => "tokens per day",
        (Quantity::Tokens, _) => "tokens",
        (Quantity::Requests, 60_000) => "requests per minute",
        (Quantity::Requests, _) => "requests",
    }
}

/// A duration the way OpenAI writes resets: `12ms`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn go_duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (hours, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (minutes, rest) = (rest / 60_000, rest % 60_000);
    // One string written in place, the milliseconds as digits (not through a float): every
    // admitted request's headers carry one or two of these.
    let mut text = String::with_capacity(16);
    match (hours, minutes) {
        (0, 0) => {}
        (0, m) => write!(text, "{m}m").expect("writing to a String"),
        (h, m) => write!(text, "{h}h{m}m").expect("writing to a String"),
    }
    let (seconds, millis) = (rest / 1000, rest % 1000);
    if millis == 0 {
        write!(text, "{seconds}s").expect("writing to a String");
    } else {
        write!(text, "{seconds}.{millis:03}").expect("writing to a String");
        // At least one digit after the point is not zero, so the point stays.
        text.truncate(text.trim_end_matches('0').len());
        text.push('s');
    }
    text
}

#[cfg(test)]
mod tests;
