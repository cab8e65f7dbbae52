//! Unit tests for `MemoryStore` with paused time: what only the embedded store can show
//! exactly (answers to the millisecond, at_ms on its own clock) and what only it has (its
//! cleanup of tenants that hold nothing). The behaviour both stores share is checked against
//! both in `tests/it/store_contract.rs`.

use std::time::Duration;

use super::*;

const TTL: u64 = 1_000;

/// A 10 s window in 1 s buckets.
fn tokens(name: &str, limit: u64) -> WindowLimit {
    WindowLimit {
        name: name.into(),
        quantity: Quantity::Tokens,
        window_ms: 10_000,
        bucket_ms: 1_000,
        limit,
    }
}

fn requests(name: &str, limit: u64) -> WindowLimit {
    WindowLimit {
        quantity: Quantity::Requests,
        ..tokens(name, limit)
    }
}

fn reservation<'a>(
    tenant: &'a str,
    lease_id: &'a str,
    tokens: u64,
    windows: &'a [WindowLimit],
    max_concurrent: Option<u32>,
) -> Reservation<'a> {
    Reservation {
        tenant,
        lease_id,
        tokens,
        windows,
        max_concurrent,
        lease_ttl_ms: TTL,
    }
}

#[track_caller]
fn granted(answer: Reserve) -> Granted {
    match answer {
        Reserve::Granted(granted) => granted,
        Reserve::Denied(denied) => panic!("expected a grant, got {denied:?}"),
    }
}

#[track_caller]
fn denied(answer: Reserve) -> Denied {
    match answer {
        Reserve::Denied(denied) => denied,
        Reserve::Granted(granted) => panic!("expected a denial, got {granted:?}"),
    }
}

fn settlement<'a>(
    tenant: &'a str,
    lease_id: &'a str,
    windows: &'a [WindowLimit],
    granted: &Granted,
    reserved_tokens: u64,
    actual_tokens: u64,
) -> Settlement<'a> {
    Settlement {
        tenant,
        lease_id,
        windows,
        reserved_at_ms: granted.at_ms,
        reserved_tokens,
        actual_tokens,
        refund_request: false,
    }
}

async fn advance(ms: u64) {
    tokio::time::advance(Duration::from_millis(ms)).await;
}

fn state(used: u64, limit: u64, reset_ms: u64) -> WindowState {
    WindowState {
        used,
        limit,
        reset_ms,
    }
}

#[tokio::test(start_paused = true)]
async fn at_ms_is_the_stores_own_milliseconds() {
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 100)];
    advance(1_234).await;
    let grant = granted(store.reserve(&reservation("t", "a", 10, &windows, None)));
    assert_eq!(grant.at_ms, 1_234);
    assert_eq!(grant.windows, [state(10, 100, 10_000 - 234)]);
    assert_eq!(grant.concurrent, None, "no concurrency limit, no count");
}

#[tokio::test(start_paused = true)]
async fn answers_are_exact_to_the_millisecond() {
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000), requests("requests", 100)];
    // 600 at 0 s, 400 at 3.5 s: full.
    granted(store.reserve(&reservation("t", "a", 600, &windows, Some(5))));
    advance(3_500).await;
    let second = granted(store.reserve(&reservation("t", "b", 400, &windows, Some(5))));
    assert_eq!(
        second.windows,
        [state(1_000, 1_000, 6_500), state(2, 100, 6_500)]
    );
    assert_eq!(second.concurrent, Some(1), "a's lease expired at 1 s");

    let refused = denied(store.reserve(&reservation("t", "c", 500, &windows, Some(5))));
    assert_eq!(
        refused,
        Denied {
            limit: DeniedLimit::Window(0),
            used: 1_000,
            allowed: 1_000,
            requested: 500,
            // The 600 from 0 s rolls off at 10 s.
            retry_after_ms: Some(6_500),
            windows: vec![state(1_000, 1_000, 6_500), state(2, 100, 6_500)],
        }
    );
    advance(6_499).await;
    denied(store.reserve(&reservation("t", "c", 500, &windows, Some(5))));
    advance(1).await;
    let third = granted(store.reserve(&reservation("t", "c", 500, &windows, Some(5))));
    // The first bucket is gone; the leases from 0 s and 3.5 s expired long ago.
    assert_eq!(
        third.windows,
        [state(900, 1_000, 3_000), state(2, 100, 3_000)]
    );
    assert_eq!(third.concurrent, Some(1));
}

#[tokio::test(start_paused = true)]
async fn concurrency_retry_after_is_the_first_lease_expiry() {
    let cases: &[(&str, Option<u32>, usize, Option<u64>)] = &[
        // (name, max_concurrent, leases taken first, retry_after of the next)
        ("one slot, taken", Some(1), 1, Some(TTL - 300)),
        ("two slots, taken", Some(2), 2, Some(TTL - 300)),
        ("no slot at all: never", Some(0), 0, None),
    ];
    for &(name, max, taken, want) in cases {
        let store = MemoryStore::new();
        let windows = [requests("requests", 100)];
        for i in 0..taken {
            granted(store.reserve(&reservation("t", &format!("l{i}"), 0, &windows, max)));
            advance(100).await;
        }
        advance(300 - 100 * taken as u64).await;
        let refused = denied(store.reserve(&reservation("t", "next", 0, &windows, max)));
        assert_eq!(refused.limit, DeniedLimit::Concurrency, "{name}");
        assert_eq!(refused.used, taken as u64, "{name}: used");
        assert_eq!(refused.requested, 1, "{name}: requested");
        assert_eq!(refused.retry_after_ms, want, "{name}: retry_after_ms");
        if let Some(wait) = want {
            advance(wait - 1).await;
            denied(store.reserve(&reservation("t", "next", 0, &windows, max)));
            advance(1).await;
            granted(store.reserve(&reservation("t", "next", 0, &windows, max)));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_lease_lives_exactly_its_ttl_and_a_renewal_restarts_it() {
    let store = MemoryStore::new();
    let windows = [requests("requests", 100)];
    granted(store.reserve(&reservation("t", "a", 0, &windows, None)));
    granted(store.reserve(&reservation("t", "b", 0, &windows, None)));
    advance(600).await;
    store.renew(
        &[LeaseRef {
            tenant: "t",
            lease_id: "b",
        }],
        TTL,
    );
    advance(TTL - 600 - 1).await;
    assert_eq!(
        store.usage("t", &windows).leases,
        2,
        "both live 1 ms before a's expiry"
    );
    advance(1).await;
    assert_eq!(store.usage("t", &windows).leases, 1, "a expired at its TTL");
    advance(599).await;
    assert_eq!(
        store.usage("t", &windows).leases,
        1,
        "b lives a TTL after its renewal"
    );
    advance(1).await;
    assert_eq!(store.usage("t", &windows).leases, 0);
    // Renewing an expired lease does not bring it back.
    store.renew(
        &[LeaseRef {
            tenant: "t",
            lease_id: "b",
        }],
        TTL,
    );
    assert_eq!(store.usage("t", &windows).leases, 0);
}

#[tokio::test(start_paused = true)]
async fn a_tenant_that_holds_nothing_is_forgotten_at_once() {
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000), requests("requests", 10)];
    let grant = granted(store.reserve(&reservation("t", "a", 500, &windows, Some(2))));
    assert_eq!(store.tenants_held(), 1);
    store.settle(&Settlement {
        refund_request: true,
        ..settlement("t", "a", &windows, &grant, 500, 0)
    });
    assert_eq!(
        store.tenants_held(),
        0,
        "refunded in full and released: nothing held"
    );

    // Asking about a tenant, renewing for it, or settling a refund for it creates nothing.
    assert_eq!(
        store.usage("nobody", &windows),
        Usage {
            windows: vec![state(0, 1_000, 0), state(0, 10, 0)],
            leases: 0
        }
    );
    store.renew(
        &[LeaseRef {
            tenant: "nobody",
            lease_id: "x",
        }],
        TTL,
    );
    store.settle(&Settlement {
        refund_request: true,
        ..settlement("nobody", "x", &windows, &grant, 500, 0)
    });
    assert_eq!(store.tenants_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_tenant_is_forgotten_when_its_usage_rolls_off() {
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000)];
    let grant = granted(store.reserve(&reservation("t", "a", 500, &windows, None)));
    store.settle(&settlement("t", "a", &windows, &grant, 500, 300));
    assert_eq!(store.tenants_held(), 1, "300 tokens still in the window");
    advance(9_999).await;
    assert_eq!(store.usage("t", &windows).windows, [state(300, 1_000, 1)]);
    assert_eq!(store.tenants_held(), 1);
    advance(1).await;
    assert_eq!(store.usage("t", &windows).windows, [state(0, 1_000, 0)]);
    assert_eq!(
        store.tenants_held(),
        0,
        "usage rolled off: forgotten on access"
    );
}

#[tokio::test(start_paused = true)]
async fn tenants_never_seen_again_are_swept_by_other_tenants_operations() {
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000)];
    let gone = 50;
    for i in 0..gone {
        granted(store.reserve(&reservation(&format!("once{i}"), "a", 10, &windows, None)));
    }
    assert_eq!(store.tenants_held(), gone);
    advance(10_000).await;
    // One tenant keeps working; each of its operations sweeps two others.
    for i in 0..gone / SWEEP_PER_OPERATION {
        let grant =
            granted(store.reserve(&reservation("busy", &format!("l{i}"), 1, &windows, None)));
        store.settle(&settlement(
            "busy",
            &format!("l{i}"),
            &windows,
            &grant,
            1,
            1,
        ));
    }
    assert_eq!(store.tenants_held(), 1, "only the busy tenant is left");
}

#[tokio::test(start_paused = true)]
async fn the_sweep_keeps_tenants_that_still_hold_something() {
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000)];
    // Ten with usage that lasts, ten with only a lease that expires.
    for i in 0..10 {
        granted(store.reserve(&reservation(&format!("usage{i}"), "a", 10, &windows, None)));
        granted(store.reserve(&reservation(&format!("lease{i}"), "a", 0, &windows, None)));
    }
    advance(TTL).await;
    for _ in 0..40 {
        store.renew(&[], TTL);
    }
    assert_eq!(
        store.tenants_held(),
        10,
        "the expired leases' tenants are swept"
    );
    for i in 0..10 {
        let usage = store.usage(&format!("usage{i}"), &windows);
        assert_eq!(usage.windows[0].used, 10, "usage{i} kept its usage");
    }
}

#[tokio::test(start_paused = true)]
async fn windows_a_request_does_not_name_still_roll_off() {
    // A per-model window used once, then only other models: the tenant is still forgotten
    // once everything rolls off, though no later request names that window.
    let store = MemoryStore::new();
    let model_a = [tokens("tokens", 1_000), tokens("model_a_tokens", 500)];
    let model_b = [tokens("tokens", 1_000), tokens("model_b_tokens", 500)];
    granted(store.reserve(&reservation("t", "a", 100, &model_a, None)));
    advance(5_000).await;
    granted(store.reserve(&reservation("t", "b", 100, &model_b, None)));
    advance(5_000).await;
    assert_eq!(
        store.usage("t", &model_b).windows,
        [state(100, 1_000, 5_000), state(100, 500, 5_000)]
    );
    advance(5_000).await;
    assert_eq!(
        store.usage("t", &model_b).windows,
        [state(0, 1_000, 0), state(0, 500, 0)]
    );
    assert_eq!(store.tenants_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_charge_after_the_tenant_was_forgotten_still_counts() {
    // The lease expired and the reservation rolled off before the long request settled: its
    // extra tokens were spent all the same, and land in now's bucket.
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000)];
    let grant = granted(store.reserve(&reservation("t", "a", 100, &windows, None)));
    advance(10_000).await;
    assert_eq!(store.usage("t", &windows).windows[0].used, 0);
    assert_eq!(store.tenants_held(), 0);
    store.settle(&settlement("t", "a", &windows, &grant, 100, 250));
    assert_eq!(
        store.usage("t", &windows).windows,
        [state(150, 1_000, 10_000)]
    );
}

#[tokio::test(start_paused = true)]
async fn zero_cost_windows_take_nothing() {
    // A token window charged 0 (a request with no tokens) holds nothing and resets at 0.
    let store = MemoryStore::new();
    let windows = [tokens("tokens", 1_000), requests("requests", 10)];
    let grant = granted(store.reserve(&reservation("t", "a", 0, &windows, None)));
    assert_eq!(grant.windows, [state(0, 1_000, 0), state(1, 10, 10_000)]);
}
