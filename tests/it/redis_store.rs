//! The Redis budget store against real `redis-server`s: what only Redis can get wrong. One
//! round trip per call, surviving a flushed script cache, a paused, killed, absent or demoted
//! server, one hash slot per tenant (on a real one-node cluster), keys that expire when idle,
//! and the scripts' window arithmetic checked operation by operation against `window.rs`.
//!
//! The shared contract suite (`store_contract.rs`) runs the store's semantics against Redis
//! too; this file does not repeat it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use metrics::Histogram;

use tollgate::budget::redis::{RedisSettings, RedisStore};
use tollgate::budget::window::WindowUsage;
use tollgate::budget::{
    DeniedLimit, Granted, LeaseRef, Quantity, Reservation, Reserve, Settlement, StoreError,
    WindowLimit,
};

use tollgate_testkit::redis::RedisServer;

/// Every test's own bound: generous, so a loaded machine fails nothing by being slow.
const TEST_TIMEOUT: Duration = Duration::from_secs(90);
/// The store's per-call timeout where a test is not about timeouts.
const PATIENT: Duration = Duration::from_secs(5);

async fn within<T>(test: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test finished within its overall timeout")
}

fn windows() -> Vec<WindowLimit> {
    vec![
        WindowLimit {
            name: "tokens_minute".into(),
            quantity: Quantity::Tokens,
            window_ms: 60_000,
            bucket_ms: 1_000,
            limit: 10_000,
        },
        WindowLimit {
            name: "requests_minute".into(),
            quantity: Quantity::Requests,
            window_ms: 60_000,
            bucket_ms: 1_000,
            limit: 100,
        },
    ]
}

fn settings(server: &RedisServer, timeout: Duration) -> RedisSettings {
    RedisSettings {
        url: server.url.clone(),
        password: None,
        timeout,
    }
}

async fn store(server: &RedisServer, timeout: Duration) -> RedisStore {
    RedisStore::connect(settings(server, timeout))
        .await
        .expect("connect (lazily) to the test server")
}

/// Every value recorded, in order.
#[derive(Default)]
struct Recorded(std::sync::Mutex<Vec<f64>>);

impl metrics::HistogramFn for Recorded {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

fn reservation<'a>(
    tenant: &'a str,
    lease_id: &'a str,
    tokens: u64,
    windows: &'a [WindowLimit],
) -> Reservation<'a> {
    Reservation {
        tenant,
        lease_id,
        tokens,
        windows,
        max_concurrent: Some(10),
        lease_ttl_ms: 30_000,
    }
}

fn settlement<'a>(
    reservation: &Reservation<'a>,
    granted: &Granted,
    actual_tokens: u64,
) -> Settlement<'a> {
    Settlement {
        tenant: reservation.tenant,
        lease_id: reservation.lease_id,
        windows: reservation.windows,
        reserved_at_ms: granted.at_ms,
        reserved_tokens: reservation.tokens,
        actual_tokens,
        refund_request: false,
    }
}

#[track_caller]
fn granted(reply: Result<Reserve, StoreError>) -> Granted {
    match reply {
        Ok(Reserve::Granted(granted)) => granted,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// Retries `reserve` until it is granted (a store reconnecting, a server restarting), failing
/// only with `Unavailable`/`Timeout` meanwhile.
async fn reserve_until_granted(store: &RedisStore, reservation: &Reservation<'_>) -> Granted {
    let mut last = None;
    for _ in 0..200 {
        match store.reserve(reservation).await {
            Ok(Reserve::Granted(granted)) => return granted,
            Ok(denied) => panic!("expected a grant, got {denied:?}"),
            Err(e @ (StoreError::Unavailable(_) | StoreError::Timeout(_))) => last = Some(e),
            Err(e) => panic!("only Unavailable or Timeout while Redis comes back, got {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the store never recovered; last error {last:?}");
}

/// Per-command call counts added since `before` (commands whose count did not move left out).
fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(name, &calls)| {
            let added = calls - before.get(name).copied().unwrap_or(0);
            (added > 0).then(|| (name.clone(), added))
        })
        .collect()
}

/// Waits until the store's start-up has loaded its scripts (a late load would land in what the
/// test counts) and nothing but our own INFO runs between two reads of the command stats.
async fn quiesce(server: &RedisServer, store: &RedisStore) {
    store.warmed_up().await;
    let only_info = BTreeMap::from([("info".to_owned(), 1)]);
    for _ in 0..100 {
        let first = server.command_stats().await;
        let second = server.command_stats().await;
        if delta(&first, &second) == only_info {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("commands kept arriving at the test server");
}

/// Every tollgate key with its type, contents and whether it has a TTL.
async fn snapshot(server: &RedisServer) -> Vec<String> {
    let mut out = Vec::new();
    for key in server.keys("tollgate:*").await {
        let contents = match server.cmd(&["TYPE", &key]).await.as_str() {
            "hash" => server.cmd(&["HGETALL", &key]).await,
            "zset" => server.cmd(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]).await,
            other => format!("unexpected type {other}"),
        };
        let expires = server.cmd(&["PTTL", &key]).await.parse::<i64>().unwrap() > 0;
        out.push(format!("{key} expires={expires}: {contents}"));
    }
    out
}

async fn zscore(server: &RedisServer, key: &str, member: &str) -> String {
    server.cmd(&["ZSCORE", key, member]).await
}

#[tokio::test]
async fn reserve_settle_and_usage_are_one_command_each() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        // Warm up: connect, load every script.
        let warm = reservation("alice", "warm", 10, &windows);
        let warm_grant = reserve_until_granted(&store, &warm).await;
        store
            .settle(&settlement(&warm, &warm_grant, 5))
            .await
            .unwrap();
        store.usage("alice", &windows).await.unwrap();
        store
            .renew(
                &[LeaseRef {
                    tenant: "alice",
                    lease_id: "warm",
                }],
                1_000,
            )
            .await
            .unwrap();
        quiesce(&server, &store).await;

        // INFO commandstats counts the commands scripts run as well (`hset`, `time`, ...), so
        // the clients' own commands are read from MONITOR, which tells them apart.
        let mut monitor = server.monitor().await;
        let evalsha = |n: usize| vec!["EVALSHA".to_owned(); n];
        let r = reservation("alice", "lease-1", 100, &windows);
        let grant = granted(store.reserve(&r).await);
        assert_eq!(
            monitor.client_commands(&server).await,
            evalsha(1),
            "reserve"
        );

        store.settle(&settlement(&r, &grant, 40)).await.unwrap();
        assert_eq!(monitor.client_commands(&server).await, evalsha(1), "settle");

        store.usage("alice", &windows).await.unwrap();
        assert_eq!(monitor.client_commands(&server).await, evalsha(1), "usage");

        // Renewing leases of three tenants: one script per tenant, sent as one pipeline.
        let leases = [
            LeaseRef {
                tenant: "alice",
                lease_id: "a1",
            },
            LeaseRef {
                tenant: "bob",
                lease_id: "b1",
            },
            LeaseRef {
                tenant: "alice",
                lease_id: "a2",
            },
            LeaseRef {
                tenant: "carol",
                lease_id: "c1",
            },
        ];
        store.renew(&leases, 30_000).await.unwrap();
        assert_eq!(monitor.client_commands(&server).await, evalsha(3), "renew");

        // And per INFO commandstats: one more `evalsha` per call, and no client command of
        // another kind (the rest is what the script ran; each INFO is counted by the next one).
        let before = server.command_stats().await;
        granted(
            store
                .reserve(&reservation("alice", "lease-2", 1, &windows))
                .await,
        );
        let after = server.command_stats().await;
        let added = delta(&before, &after);
        assert_eq!(added.get("evalsha"), Some(&1), "{added:?}");
        assert_eq!(added.get("info"), Some(&1), "{added:?}");
        for command in [
            "eval",
            "script|load",
            "multi",
            "exec",
            "client|setinfo",
            "ping",
        ] {
            assert_eq!(added.get(command), None, "{command} in {added:?}");
        }
    })
    .await;
}

#[tokio::test]
async fn a_flushed_script_cache_is_reloaded_and_usage_survives() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        let first = reserve_until_granted(&store, &reservation("alice", "l1", 100, &windows)).await;
        assert_eq!(first.windows[0].used, 100);
        // The store loads its scripts in the background at start (four for budgets, three for
        // the fleet): let it finish, or a late load would count as the reload below.
        store.warmed_up().await;

        server.cmd(&["SCRIPT", "FLUSH"]).await;
        let loads = server.command_calls("script|load").await;
        let second = granted(
            store
                .reserve(&reservation("alice", "l2", 250, &windows))
                .await,
        );
        assert_eq!(
            second.windows[0].used, 350,
            "the first reservation is still counted"
        );
        assert_eq!(second.windows[1].used, 2);
        assert_eq!(second.concurrent, Some(2));
        assert_eq!(
            server.command_calls("script|load").await,
            loads + 1,
            "NOSCRIPT answered by one SCRIPT LOAD"
        );

        server.cmd(&["SCRIPT", "FLUSH"]).await;
        let usage = store.usage("alice", &windows).await.unwrap();
        assert_eq!((usage.windows[0].used, usage.leases), (350, 2));
        server.cmd(&["SCRIPT", "FLUSH"]).await;
        // Renew's pipeline reloads too.
        store
            .renew(
                &[LeaseRef {
                    tenant: "alice",
                    lease_id: "l1",
                }],
                30_000,
            )
            .await
            .unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_flushed_script_cache_is_reloaded_for_every_call_of_a_batch() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        let held = reservation("alice", "held", 100, &windows);
        let granted_held = reserve_until_granted(&store, &held).await;
        store.warmed_up().await;

        // Calls made together go in one batch (the store's sender yields before it sends);
        // with the scripts forgotten, each is answered NOSCRIPT, and each must still succeed:
        // three scripts loaded once each, then the calls sent again.
        server.cmd(&["SCRIPT", "FLUSH"]).await;
        let loads = server.command_calls("script|load").await;
        let (bob, carol) = (
            reservation("bob", "b1", 20, &windows),
            reservation("carol", "c1", 30, &windows),
        );
        let settle = settlement(&held, &granted_held, 60);
        let (bob, carol, settled, usage) = tokio::join!(
            store.reserve(&bob),
            store.reserve(&carol),
            store.settle(&settle),
            store.usage("alice", &windows),
        );
        assert_eq!(granted(bob).windows[0].used, 20);
        assert_eq!(granted(carol).windows[0].used, 30);
        settled.expect("the settle succeeds after its script is loaded again");
        // The usage went after the settle in the same batch, and Redis ran them in order.
        let usage = usage.expect("the usage succeeds after its script is loaded again");
        assert_eq!((usage.windows[0].used, usage.leases), (60, 0));
        assert_eq!(
            server.command_calls("script|load").await,
            loads + 3,
            "one SCRIPT LOAD per script the batch needed, not one per call"
        );
    })
    .await;
}

#[tokio::test]
async fn the_calls_that_wait_for_a_batch_go_as_one_and_each_batch_is_counted() {
    within(async {
        let server = RedisServer::start().await;
        let recorded = Arc::new(Recorded::default());
        let batch_calls = Histogram::from_arc(recorded.clone());
        let store = RedisStore::connect_counting_batches(settings(&server, PATIENT), batch_calls)
            .await
            .expect("connect (lazily) to the test server");
        let windows = windows();
        reserve_until_granted(&store, &reservation("alice", "warm", 1, &windows)).await;
        store.warmed_up().await;
        let batches = || recorded.0.lock().unwrap().len();
        let before = batches();

        // The batch ahead waits in a paused Redis; five reserves come one by one meanwhile, 50 ms
        // apart, after it went (it is counted as it goes). The pause outlasts their coming by
        // far, so a slow machine still queues all five behind it.
        let paused_at = tokio::time::Instant::now();
        server.cmd(&["CLIENT", "PAUSE", "2000", "ALL"]).await;
        let ahead = reservation("bob", "ahead", 1, &windows);
        let ids: Vec<String> = (0..5).map(|i| format!("behind-{i}")).collect();
        let behind: Vec<_> = ids
            .iter()
            .map(|id| reservation("carol", id, 1, &windows))
            .collect();
        let five = async {
            while batches() == before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let (store, behind) = (&store, &behind);
            let answers = futures_util::future::join_all((0..5).map(|i| async move {
                tokio::time::sleep(Duration::from_millis(50 * i as u64)).await;
                store.reserve(&behind[i]).await
            }))
            .await;
            assert!(
                paused_at.elapsed() > Duration::from_millis(1_500),
                "the five were answered before the pause ended"
            );
            answers
        };
        let (ahead, five) = tokio::join!(store.reserve(&ahead), five);
        granted(ahead);
        for answer in five {
            granted(answer);
        }
        let carol = store.usage("carol", &windows).await.unwrap();
        assert_eq!((carol.windows[1].used, carol.leases), (5, 5), "{carol:?}");
        // The batch ahead, the five together, then the usage read.
        let batches = recorded.0.lock().unwrap()[before..].to_vec();
        assert_eq!(batches, [1.0, 5.0, 1.0]);
    })
    .await;
}

#[tokio::test]
async fn a_call_waits_for_the_batch_ahead_and_only_a_settle_goes_once_its_caller_left() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        let held = reservation("alice", "held", 100, &windows);
        let granted_held = reserve_until_granted(&store, &held).await;
        store.warmed_up().await;

        // The batch ahead: a reserve that goes out and waits in a paused Redis. The pause
        // outlasts what follows by far, so a slow machine still queues both calls behind it.
        let paused_at = tokio::time::Instant::now();
        server.cmd(&["CLIENT", "PAUSE", "2000", "ALL"]).await;
        let ahead = reservation("bob", "ahead", 1, &windows);
        let abandoned = reservation("carol", "abandoned", 5, &windows);
        let settle = settlement(&held, &granted_held, 40);
        let behind = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            // Callers that leave while their calls wait behind it.
            let quick = Duration::from_millis(20);
            let left = tokio::time::timeout(quick, store.reserve(&abandoned)).await;
            assert!(left.is_err(), "the reserve waited behind the batch ahead");
            let left = tokio::time::timeout(quick, store.settle(&settle)).await;
            assert!(left.is_err(), "the settle waited behind the batch ahead");
            assert!(
                paused_at.elapsed() < Duration::from_millis(1_500),
                "the machine was too slow: the pause may have ended before both calls queued"
            );
        };
        let (ahead, ()) = tokio::join!(store.reserve(&ahead), behind);
        assert_eq!(granted(ahead).windows[0].used, 1);

        // The reserve whose caller left was never sent, so nothing of it is in Redis (sent,
        // Redis would have run it when the pause ended). The settle went anyway: the lease is
        // gone and the unused tokens are back.
        let carol = store.usage("carol", &windows).await.unwrap();
        assert_eq!(
            (carol.windows[0].used, carol.windows[1].used, carol.leases),
            (0, 0, 0),
            "{carol:?}"
        );
        let alice = store.usage("alice", &windows).await.unwrap();
        assert_eq!((alice.windows[0].used, alice.leases), (40, 0), "{alice:?}");
    })
    .await;
}

#[tokio::test]
async fn a_paused_redis_times_out_and_nothing_is_half_applied() {
    within(async {
        let server = RedisServer::start().await;
        let fast = store(&server, Duration::from_millis(50)).await;
        let patient = store(&server, PATIENT).await;
        let windows = windows();
        reserve_until_granted(&fast, &reservation("warm", "w", 1, &windows)).await;
        reserve_until_granted(&patient, &reservation("warm", "w2", 1, &windows)).await;

        server.cmd(&["CLIENT", "PAUSE", "1000", "ALL"]).await;
        let result = fast
            .reserve(&reservation("alice", "paused", 300, &windows))
            .await;
        assert!(
            matches!(result, Err(StoreError::Timeout(t)) if t == Duration::from_millis(50)),
            "{result:?}"
        );

        // The timed-out script is still queued on the fast store's connection, and Redis runs
        // it when the pause ends: a call on the same connection that succeeds comes after it.
        // A script is atomic, so that reservation is there whole or not at all.
        let mut usage = None;
        for _ in 0..200 {
            match fast.usage("alice", &windows).await {
                Ok(u) => {
                    usage = Some(u);
                    break;
                }
                Err(StoreError::Timeout(_)) => {}
                Err(e) => panic!("only timeouts while paused, got {e:?}"),
            }
        }
        let usage = usage.expect("the pause ended");
        assert!(usage.leases <= 1, "{usage:?}");
        let taken = u64::from(usage.leases);
        assert_eq!(usage.windows[0].used, 300 * taken, "{usage:?}");
        assert_eq!(usage.windows[1].used, taken, "{usage:?}");

        let after = granted(
            patient
                .reserve(&reservation("alice", "next", 10, &windows))
                .await,
        );
        assert_eq!(after.windows[0].used, 300 * taken + 10);
        assert_eq!(after.concurrent, Some(usage.leases + 1));
        // The fast store recovers too (retrying, as 50 ms is tight on a loaded machine).
        reserve_until_granted(&fast, &reservation("alice", "fast-again", 1, &windows)).await;
    })
    .await;
}

#[tokio::test]
async fn a_killed_redis_fails_fast_and_the_store_reconnects_after_restart() {
    within(async {
        let mut server = RedisServer::start().await;
        let store = store(&server, Duration::from_millis(500)).await;
        let windows = windows();
        reserve_until_granted(&store, &reservation("alice", "before", 100, &windows)).await;

        server.kill();
        for attempt in 0..3 {
            let result = store
                .reserve(&reservation("alice", "down", 100, &windows))
                .await;
            assert!(
                matches!(
                    result,
                    Err(StoreError::Unavailable(_) | StoreError::Timeout(_))
                ),
                "attempt {attempt}: {result:?}"
            );
        }

        server.restart().await;
        let grant =
            reserve_until_granted(&store, &reservation("alice", "after", 100, &windows)).await;
        // A restarted server is empty (no persistence): only this reservation counts.
        assert_eq!(grant.windows[0].used, 100);
        store.usage("alice", &windows).await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn redis_down_at_start_up_is_not_fatal() {
    within(async {
        let mut server = RedisServer::start().await;
        server.kill();
        let store = store(&server, Duration::from_millis(200)).await;
        let windows = windows();
        let result = store
            .reserve(&reservation("alice", "l1", 100, &windows))
            .await;
        assert!(
            matches!(
                result,
                Err(StoreError::Unavailable(_) | StoreError::Timeout(_))
            ),
            "{result:?}"
        );

        server.restart().await;
        let grant = reserve_until_granted(&store, &reservation("alice", "l2", 100, &windows)).await;
        assert_eq!(grant.windows[0].used, 100);
    })
    .await;
}

/// Tenant ids with braces and other bytes that must not split a tenant across slots.
const AWKWARD_TENANTS: &[&str] = &["alice", "{", "}", "}{", "a{b}c", "{x}", "ü{ni}cöde", ""];

#[tokio::test]
async fn every_key_of_a_tenant_is_in_one_slot_of_a_real_cluster() {
    within(async {
        // On a cluster node a script whose keys span slots fails (CROSSSLOT), so every call
        // succeeding is itself the check; CLUSTER KEYSLOT then names the slots.
        let server = RedisServer::start_cluster().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        let mut slots_seen = Vec::new();
        for tenant in AWKWARD_TENANTS {
            server.cmd(&["FLUSHALL"]).await;
            let r = reservation(tenant, "lease", 100, &windows);
            let grant = reserve_until_granted(&store, &r).await;
            store
                .renew(
                    &[LeaseRef {
                        tenant,
                        lease_id: "lease",
                    }],
                    30_000,
                )
                .await
                .unwrap();
            store.usage(tenant, &windows).await.unwrap();
            // Keep the lease: settle with a second one still held, so the ZSET stays.
            let r2 = reservation(tenant, "lease-2", 10, &windows);
            granted(store.reserve(&r2).await);
            store.settle(&settlement(&r, &grant, 50)).await.unwrap();

            let keys = server.keys("tollgate:*").await;
            assert_eq!(
                keys.len(),
                3,
                "{tenant:?}: two windows and the leases: {keys:?}"
            );
            let mut slots = Vec::new();
            for key in &keys {
                slots.push(server.cmd(&["CLUSTER", "KEYSLOT", key]).await);
            }
            slots.sort();
            slots.dedup();
            assert_eq!(slots.len(), 1, "{tenant:?}: {keys:?} in slots {slots:?}");
            slots_seen.push(slots.remove(0));
        }
        slots_seen.sort();
        slots_seen.dedup();
        assert!(
            slots_seen.len() > 1,
            "different tenants spread over slots: {slots_seen:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn every_key_expires_when_idle() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        let r = reservation("alice", "lease", 100, &windows);
        let grant = reserve_until_granted(&store, &r).await;
        granted(
            store
                .reserve(&reservation("alice", "other", 1, &windows))
                .await,
        );

        let keys = server.keys("tollgate:*").await;
        assert_eq!(keys.len(), 3, "{keys:?}");
        for key in &keys {
            let pttl: i64 = server.cmd(&["PTTL", key]).await.parse().unwrap();
            let bound = if key.ends_with(":leases") {
                30_000 + 2_000 // lease TTL plus the margin, moved a margin further
            } else {
                60_000 + 1_000 // window plus one bucket
            };
            assert!(
                pttl > 0 && pttl <= bound,
                "{key}: PTTL {pttl} not in (0, {bound}]"
            );
        }

        // Settling every lease empties the ZSET, which Redis deletes.
        store.settle(&settlement(&r, &grant, 100)).await.unwrap();
        store
            .settle(&Settlement {
                lease_id: "other",
                reserved_tokens: 1,
                actual_tokens: 1,
                ..settlement(&r, &grant, 1)
            })
            .await
            .unwrap();
        assert_eq!(server.keys("tollgate:*:leases").await, Vec::<String>::new());

        // A short window's key goes by itself once its usage has rolled off.
        let short = [WindowLimit {
            name: "tokens_short".into(),
            quantity: Quantity::Tokens,
            window_ms: 200,
            bucket_ms: 100,
            limit: 1_000,
        }];
        granted(store.reserve(&reservation("bob", "l", 5, &short)).await);
        let mut gone = false;
        for _ in 0..200 {
            if server.keys("tollgate:*:w:tokens_short").await.is_empty() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(gone, "the idle short window's key expired");
    })
    .await;
}

/// Windows of one-hour buckets: two calls a few milliseconds apart fall in the same bucket
/// unless an hour turns between them, which the tests below check for and retry.
fn hour_buckets() -> Vec<WindowLimit> {
    windows()
        .into_iter()
        .map(|limit| WindowLimit {
            window_ms: 24 * 3_600_000,
            bucket_ms: 3_600_000,
            ..limit
        })
        .collect()
}

/// Redis's clock, in hours.
async fn redis_hour(server: &RedisServer) -> u64 {
    let time = server.cmd(&["TIME"]).await;
    let seconds: u64 = time.split_whitespace().next().unwrap().parse().unwrap();
    seconds / 3_600
}

/// Runs `attempt` until Redis's hour is the same before and after it (at most three times):
/// the bucket it writes is then the same throughout.
async fn within_one_hour<T, F: Future<Output = T>>(
    server: &RedisServer,
    mut attempt: impl FnMut() -> F,
) -> T {
    for _ in 0..3 {
        let before = redis_hour(server).await;
        let outcome = attempt().await;
        if redis_hour(server).await == before {
            return outcome;
        }
    }
    panic!("an hour turned during each of three attempts");
}

/// The one key of window `name`.
async fn window_key(server: &RedisServer, name: &str) -> String {
    let keys = server.keys(&format!("tollgate:*:w:{name}")).await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys[0].clone()
}

async fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.cmd(&["PTTL", key]).await.parse().unwrap()
}

/// A charge sets a window key's expiry only when it moves: one bucket after the newest bucket
/// rolls off. A second charge in the same bucket leaves the expiry where it was (the key keeps
/// counting down); one in a window with a new length moves it.
#[tokio::test]
async fn a_window_key_expiry_moves_only_with_its_newest_bucket() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = hour_buckets();
        let (first, second) = within_one_hour(&server, || async {
            server.cmd(&["FLUSHALL"]).await;
            granted(store.reserve(&reservation("alice", "a", 5, &windows)).await);
            let key = window_key(&server, "tokens_minute").await;
            let first = pttl(&server, &key).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            granted(store.reserve(&reservation("alice", "b", 5, &windows)).await);
            (first, pttl(&server, &key).await)
        })
        .await;
        // Until the hour's bucket rolls off (24 hours after it began), plus one bucket.
        let window_and_bucket = 25 * 3_600_000;
        assert!(
            first > 24 * 3_600_000 && first <= window_and_bucket,
            "first PTTL {first}"
        );
        assert!(
            second <= first - 300,
            "the second charge left the expiry where it was: PTTL {first}, then {second}"
        );

        // A reload to a longer window moves it with the next charge, in the same bucket as a
        // charge just before it under the old window.
        let longer: Vec<WindowLimit> = windows
            .iter()
            .map(|limit| WindowLimit {
                window_ms: 48 * 3_600_000,
                ..limit.clone()
            })
            .collect();
        let (before, moved) = within_one_hour(&server, || async {
            granted(store.reserve(&reservation("alice", "c", 5, &windows)).await);
            let key = window_key(&server, "tokens_minute").await;
            let before = pttl(&server, &key).await;
            granted(store.reserve(&reservation("alice", "d", 5, &longer)).await);
            (before, pttl(&server, &key).await)
        })
        .await;
        assert!(
            before > 24 * 3_600_000 && before <= window_and_bucket,
            "PTTL before the reload {before}"
        );
        assert!(
            moved > 48 * 3_600_000 && moved <= 49 * 3_600_000,
            "PTTL after the reload {moved}"
        );
    })
    .await;
}

/// What a reserve and a settle run inside Redis once a tenant's keys exist, per INFO
/// commandstats (which counts the commands scripts run): each call converts its arguments and
/// reply between Lua and Redis, and each write goes to replicas and the AOF too
/// (docs/benchmarks.md, "What Redis runs per decision"). Two windows, a concurrency limit, and
/// a settle that gives tokens back.
#[tokio::test]
async fn a_steady_reserve_and_settle_make_few_calls() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = hour_buckets();
        let (reserve, settle) = within_one_hour(&server, || async {
            // Warm up: connect, load the scripts, create the keys, set their expiries. The
            // lease held has a longer TTL than the one measured, so its key's expiry is still
            // far enough ahead however long the warm-up takes (a tenant with requests in
            // flight, as in steady traffic; the ZSET of one whose last lease settled is gone).
            let held = Reservation {
                lease_ttl_ms: 120_000,
                ..reservation("alice", "held", 10, &windows)
            };
            reserve_until_granted(&store, &held).await;
            let warm = reservation("alice", "warm", 10, &windows);
            let warm_grant = reserve_until_granted(&store, &warm).await;
            store
                .settle(&settlement(&warm, &warm_grant, 5))
                .await
                .unwrap();
            quiesce(&server, &store).await;

            let before = server.command_stats().await;
            let r = reservation("alice", "lease", 100, &windows);
            let grant = granted(store.reserve(&r).await);
            let middle = server.command_stats().await;
            store.settle(&settlement(&r, &grant, 40)).await.unwrap();
            let after = server.command_stats().await;
            (delta(&before, &middle), delta(&middle, &after))
        })
        .await;
        let expected = |calls: &[(&str, u64)]| -> BTreeMap<String, u64> {
            calls
                .iter()
                .map(|&(name, n)| (name.to_owned(), n))
                .collect()
        };
        // Per window one HMGET (meta and now's bucket) and one HSET (bucket and meta); the
        // leases: purge, count, add, and the key's TTL read (its expiry moved at most once a
        // second). Each INFO is counted by the next.
        assert_eq!(
            reserve,
            expected(&[
                ("evalsha", 1),
                ("info", 1),
                ("time", 1),
                ("hmget", 2),
                ("hset", 2),
                ("zremrangebyscore", 1),
                ("zcard", 1),
                ("zadd", 1),
                ("pttl", 1),
            ]),
            "reserve"
        );
        // The token window only (the request window is not given back): one HMGET, one HSET.
        assert_eq!(
            settle,
            expected(&[
                ("evalsha", 1),
                ("info", 1),
                ("time", 1),
                ("zrem", 1),
                ("hmget", 1),
                ("hset", 1),
            ]),
            "settle"
        );
    })
    .await;
}

#[tokio::test]
async fn a_connection_to_a_demoted_primary_is_replaced() {
    within(async {
        let primary = RedisServer::start().await;
        let other = RedisServer::start().await;
        let store = store(&primary, PATIENT).await;
        let windows = windows();
        reserve_until_granted(&store, &reservation("alice", "l1", 1, &windows)).await;

        // A failover demotes the node this store is connected to: it refuses writes.
        let port = other.port.to_string();
        primary.cmd(&["REPLICAOF", "127.0.0.1", &port]).await;
        let connections = |info: String| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix("total_connections_received:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("total_connections_received in INFO stats")
        };
        let mut refused = None;
        for _ in 0..100 {
            match store
                .reserve(&reservation("alice", "l2", 1, &windows))
                .await
            {
                Err(StoreError::Unavailable(message))
                    if message.to_ascii_lowercase().contains("read only") =>
                {
                    refused = Some(message);
                    break;
                }
                // LOADING while it syncs from its new primary, or not yet demoted.
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        assert!(refused.is_some(), "the demoted node refused the write");
        let before = connections(primary.cmd(&["INFO", "stats"]).await);
        // The store dropped that connection: its next call connects afresh (here, to the same
        // address, which a Service or DNS name would point at the new primary).
        let _ = store.usage("alice", &windows).await;
        let after = connections(primary.cmd(&["INFO", "stats"]).await);
        // +1 for the INFO's own connection, +1 for the store's new one.
        assert!(after >= before + 2, "a new connection: {before} -> {after}");

        primary.cmd(&["REPLICAOF", "NO", "ONE"]).await;
        reserve_until_granted(&store, &reservation("alice", "l3", 1, &windows)).await;
    })
    .await;
}

#[tokio::test]
async fn renew_extends_live_leases_and_never_resurrects() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        let short = Reservation {
            lease_ttl_ms: 1,
            ..reservation("alice", "expired", 1, &windows)
        };
        reserve_until_granted(&store, &short).await;
        let live = reservation("alice", "live", 1, &windows);
        let live_grant = granted(store.reserve(&live).await);
        let settled = reservation("alice", "settled", 1, &windows);
        let settled_grant = granted(store.reserve(&settled).await);
        store
            .settle(&settlement(&settled, &settled_grant, 1))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;

        let leases = [
            LeaseRef {
                tenant: "alice",
                lease_id: "expired",
            },
            LeaseRef {
                tenant: "alice",
                lease_id: "live",
            },
            LeaseRef {
                tenant: "alice",
                lease_id: "settled",
            },
            LeaseRef {
                tenant: "nobody",
                lease_id: "never",
            },
        ];
        store.renew(&leases, 600_000).await.unwrap();

        let key = server.keys("tollgate:*:leases").await.remove(0);
        let renewed: u64 = zscore(&server, &key, "live").await.parse().unwrap();
        assert!(
            renewed >= live_grant.at_ms + 600_000,
            "renewed to now + ttl: {renewed} vs granted at {}",
            live_grant.at_ms
        );
        let expired = zscore(&server, &key, "expired").await;
        assert!(
            expired.is_empty() || expired.parse::<u64>().unwrap() <= live_grant.at_ms + 1_000,
            "an expired lease stays expired: {expired}"
        );
        assert_eq!(
            zscore(&server, &key, "settled").await,
            "",
            "a settled lease stays gone"
        );
        assert_eq!(
            server.keys("tollgate:*").await.len(),
            3,
            "no keys for `nobody`"
        );
        let pttl: u64 = server.cmd(&["PTTL", &key]).await.parse().unwrap();
        assert!(
            pttl > 30_000,
            "the ZSET lives as long as its renewed lease: {pttl}"
        );
        assert_eq!(store.usage("alice", &windows).await.unwrap().leases, 1);
    })
    .await;
}

#[tokio::test]
async fn a_denial_changes_nothing_and_reports_the_first_failing_limit() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let windows = windows();
        reserve_until_granted(&store, &reservation("alice", "l1", 9_000, &windows)).await;
        let before = snapshot(&server).await;

        let too_big = store
            .reserve(&reservation("alice", "l2", 1_001, &windows))
            .await;
        let Ok(Reserve::Denied(denied)) = too_big else {
            panic!("expected a denial, got {too_big:?}");
        };
        assert_eq!(denied.limit, DeniedLimit::Window(0));
        assert_eq!(
            (denied.used, denied.allowed, denied.requested),
            (9_000, 10_000, 1_001)
        );
        let retry = denied
            .retry_after_ms
            .expect("fits once the first bucket rolls off");
        assert!(retry > 0 && retry <= 60_000, "{retry}");

        let never = store
            .reserve(&reservation("alice", "l3", 10_001, &windows))
            .await;
        let Ok(Reserve::Denied(denied)) = never else {
            panic!("expected a denial, got {never:?}");
        };
        assert_eq!(
            denied.retry_after_ms, None,
            "more than the whole limit never fits"
        );

        let no_slot = Reservation {
            max_concurrent: Some(1),
            ..reservation("alice", "l4", 1, &windows)
        };
        let Ok(Reserve::Denied(denied)) = store.reserve(&no_slot).await else {
            panic!("one lease is live");
        };
        assert_eq!(denied.limit, DeniedLimit::Concurrency);
        assert_eq!((denied.used, denied.allowed, denied.requested), (1, 1, 1));
        assert!(
            denied
                .retry_after_ms
                .is_some_and(|ms| ms > 0 && ms <= 30_000)
        );

        assert_eq!(snapshot(&server).await, before, "nothing changed");
    })
    .await;
}

#[tokio::test]
async fn a_bucket_ms_reload_keeps_the_usage() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server, PATIENT).await;
        let mut windows = windows();
        reserve_until_granted(&store, &reservation("alice", "l1", 700, &windows)).await;
        windows[0].bucket_ms = 10_000;
        let usage = store.usage("alice", &windows).await.unwrap();
        assert_eq!(usage.windows[0].used, 700);
        let grant = granted(
            store
                .reserve(&reservation("alice", "l2", 300, &windows))
                .await,
        );
        assert_eq!(grant.windows[0].used, 1_000);
        windows[0].bucket_ms = 500;
        assert_eq!(
            store.usage("alice", &windows).await.unwrap().windows[0].used,
            1_000
        );
    })
    .await;
}

/// Drives the window functions of `common.lua` with explicit times (rather than `TIME`), the
/// same functions reserve and settle call, so they can be checked against `window.rs`.
const HARNESS: &str = r"
-- KEYS[1]: the window. ARGV: op ('add' | 'adjust' | 'peek' | 'load'), now, window_ms,
-- bucket_ms, amount (add) or delta (adjust), at (adjust), limit, needed, and '1' to have load
-- read the bucket about to be written with the meta, as reserve and settle do ('0': it is read
-- when written), and what to leave of `exp` for the next step: '0', '1' or 'stale' (see the
-- end).
local op, now = ARGV[1], tonumber(ARGV[2])
local exp_before = tonumber(redis.call('HGET', KEYS[1], 'exp')) or -1
local bms_before = tonumber(redis.call('HGET', KEYS[1], 'bms')) or -1
local w = window(KEYS[1], tonumber(ARGV[3]), tonumber(ARGV[4]), now)
local prefetch = ARGV[9] == '1'
local retry = -2
if op == 'peek' then
  peek(w)
else
  if op == 'add' and prefetch then
    load(w, w.nb)
  elseif op == 'adjust' and prefetch then
    -- As settle does: a refund leaves `exp` unread.
    local delta = tonumber(ARGV[5])
    load(w, adjusted_bucket(w, tonumber(ARGV[6]), delta), delta < 0)
  else
    load(w)
  end
  if op == 'add' then
    add(w, w.nb, tonumber(ARGV[5]))
  elseif op == 'adjust' then
    adjust(w, tonumber(ARGV[6]), tonumber(ARGV[5]))
  end
  retry = retry_after(w, tonumber(ARGV[8]), tonumber(ARGV[7]))
end
local pttl = redis.call('PTTL', KEYS[1])
local exp = tonumber(redis.call('HGET', KEYS[1], 'exp')) or -1
-- Real time must not expire what synthetic time keeps, so each step ends with no expiry and
-- a PTTL of 0 or more above is one this step set. With ARGV[10] '0' `exp` goes too, and the next
-- write sets an expiry whatever it is; with '1' it stays, and the next one may skip it; with
-- 'stale' it is one bucket earlier, as an older tollgate's writes can leave it (they move the
-- expiry without writing `exp`), and the next charge must set the expiry.
redis.call('PERSIST', KEYS[1])
if ARGV[10] == '0' then
  redis.call('HDEL', KEYS[1], 'exp')
elseif ARGV[10] == 'stale' and exp >= 0 then
  redis.call('HSET', KEYS[1], 'exp', int(exp - w.bms))
end
return { w.total, reset_ms(w), retry, pttl, exp, exp_before, bms_before }
";

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

#[tokio::test]
async fn the_window_scripts_match_window_rs_operation_by_operation() {
    within(async {
        let server = RedisServer::start().await;
        let mut connection = server.connection().await;
        let common = include_str!("../../src/budget/redis/common.lua");
        let script = redis::Script::new(&format!("{common}\n{HARNESS}"));
        let key = "tollgate:{harness}:w:tokens";

        for seed in 1..=12u64 {
            redis::cmd("DEL")
                .arg(key)
                .exec_async(&mut connection)
                .await
                .unwrap();
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut reference = WindowUsage::default();
            // Reloads change bucket_ms along a chain of multiples, one way per seed: the
            // scripts renumber buckets to the new size, which keeps window.rs's answers exactly
            // when the sizes divide each other and never go back down (see `renumber` in
            // common.lua for the one-bucket approximation otherwise).
            let chain: &[u64] = if seed % 2 == 0 {
                &[1, 10, 100, 1_000]
            } else {
                &[1, 7, 14, 70, 700]
            };
            let coarsening = seed % 4 < 2;
            let mut level = if coarsening { 0 } else { chain.len() - 1 };
            let shape = |rng: &mut Rng, level: usize| {
                let bucket_ms = chain[level];
                let buckets = rng.pick(&[1, 2, 5, 60, 600]);
                // Sometimes a window the bucket does not divide (rounded down to whole buckets).
                let extra = if rng.below(4) == 0 { bucket_ms / 2 } else { 0 };
                (bucket_ms * buckets + extra, bucket_ms)
            };
            let (mut window_ms, mut bucket_ms) = shape(&mut rng, level);
            let limit_value = rng.pick(&[50, 1_000, 100_000]);
            let mut now: u64 = 1_700_000_000_000 + rng.below(1_000_000);
            let mut added_at: Vec<u64> = vec![now];
            // Refunds reaching across buckets merged by a coarser bucket_ms may differ from
            // window.rs (documented in common.lua); refunds before such a reload are skipped.
            let mut coarsened_at = 0;

            for step in 0..400 {
                // Time: mostly forward by up to a few buckets, sometimes a long gap, rarely
                // backwards a little.
                now = match rng.below(20) {
                    0 => now + window_ms * (1 + rng.below(3)),
                    1 => now.saturating_sub(rng.below(bucket_ms + 1)),
                    2..=4 => now,
                    _ => now + rng.below(bucket_ms * 3 + 1),
                };
                if rng.below(40) == 0 {
                    if coarsening && level + 1 < chain.len() {
                        level += 1;
                        coarsened_at = now;
                    } else if !coarsening && level > 0 {
                        level -= 1;
                    }
                    (window_ms, bucket_ms) = shape(&mut rng, level);
                }
                let limit = WindowLimit {
                    name: "tokens".into(),
                    quantity: Quantity::Tokens,
                    window_ms,
                    bucket_ms,
                    limit: limit_value,
                };
                let needed = rng.below(limit_value * 2);
                let (op, amount, at): (&str, i64, u64) = match rng.below(10) {
                    0..=4 => ("add", rng.below(limit_value / 2 + 1) as i64, now),
                    5..=7 => {
                        let at = rng.pick(&added_at);
                        let mut delta =
                            rng.below(limit_value) as i64 - (limit_value as i64 * 2 / 3);
                        if delta < 0 && at < coarsened_at {
                            delta = -delta;
                        }
                        ("adjust", delta, at)
                    }
                    8 => ("peek", 0, now),
                    _ => ("load", 0, now),
                };
                let keep_exp = rng.pick(&["0", "1", "stale"]);
                let reply: Vec<i64> = script
                    .key(key)
                    .arg(op)
                    .arg(now)
                    .arg(window_ms)
                    .arg(bucket_ms)
                    .arg(amount)
                    .arg(at)
                    .arg(limit_value)
                    .arg(needed)
                    .arg(if rng.below(2) == 0 { "1" } else { "0" })
                    .arg(keep_exp)
                    .invoke_async(&mut connection)
                    .await
                    .unwrap();

                // `peek` (the usage script) writes nothing, so it must not roll the reference
                // either: a bucket it skips as expired is still stored, and a reload to a longer
                // window could bring it back into the window, in both.
                let mut peeked = reference.clone();
                let expected = match op {
                    "add" => {
                        reference.add(&limit, now, amount as u64);
                        added_at.push(now);
                        &reference
                    }
                    "adjust" => {
                        reference.adjust(&limit, at, now, i128::from(amount));
                        &reference
                    }
                    "peek" => {
                        peeked.roll(&limit, now);
                        &peeked
                    }
                    _ => {
                        reference.roll(&limit, now);
                        &reference
                    }
                };
                let context = format!(
                    "seed {seed} step {step}: {op} amount {amount} at {at} now {now} window \
                     {window_ms}/{bucket_ms}"
                );
                assert_eq!(reply[0] as u64, expected.used(), "used, {context}");
                assert_eq!(
                    reply[1] as u64,
                    expected.reset_ms(&limit, now),
                    "reset_ms, {context}"
                );
                if op != "peek" {
                    let retry = expected
                        .retry_after_ms(&limit, now, needed)
                        .map_or(-1, |ms| ms as i64);
                    assert_eq!(reply[2], retry, "retry_after({needed}), {context}");
                    let wrote = (op == "add" || op == "adjust") && amount > 0;
                    let (pttl, exp, exp_before) = (reply[3], reply[4], reply[5]);
                    assert!(!wrote || exp >= 0, "a charge sets exp, {context}");
                    // The step began with no expiry on the key (the harness removes it), so a
                    // PTTL of 0 or more is one this step set: `exp`, one bucket past the newest
                    // bucket's roll-off (checked against the hash below). After the clock went
                    // back the newest bucket may be ahead of now's, so that can be more than a
                    // window from now. 0, not -1, is an expiry already due: a 1 ms window's can
                    // run out while the script runs on a loaded machine.
                    if pttl >= 0 {
                        // PTTL reads Redis's clock when it runs, later than the expiry was
                        // set: the slack is the script's time in between.
                        let left = exp - now as i64;
                        assert!(
                            pttl <= left && pttl > left - 100,
                            "PTTL {pttl} not exp {exp} ({left} ms from now), {context}"
                        );
                    }
                    // It may skip setting one only if `exp` did not move.
                    assert!(
                        pttl >= 0 || pttl == -2 || exp == exp_before,
                        "PTTL {pttl} with exp {exp_before} -> {exp}, {context}"
                    );
                    // Without a charge or a reload's renumbering (a refund, whether it read
                    // `exp` or not, or rolling off), no expiry is set and `exp` stays, unless
                    // the key went.
                    let renumbered = reply[6] >= 0 && reply[6] != bucket_ms as i64;
                    if !wrote && !renumbered {
                        assert!(
                            pttl == -2 || (pttl == -1 && exp == exp_before),
                            "PTTL {pttl} with exp {exp_before} -> {exp}, no charge, {context}"
                        );
                    }
                    // A charge works `exp` out from the window as it is now, as does
                    // renumbering; otherwise it may be from before a reload.
                    let fresh_exp = (wrote || exp != exp_before).then_some(exp);
                    // What the harness left of it for the next step.
                    let left_exp = match keep_exp {
                        "0" => None,
                        "1" => (exp >= 0).then_some(exp),
                        _ => (exp >= 0).then_some(exp - bucket_ms as i64),
                    };
                    check_hash(
                        &mut connection,
                        key,
                        (window_ms, bucket_ms),
                        fresh_exp,
                        left_exp,
                        &context,
                    )
                    .await;
                }
            }
        }
    })
    .await;
}

/// The window hash's invariants: bucket fields nonzero, `total` their sum, `oldest` the least,
/// `newest` at least the greatest, `bms` current, `fresh_exp` (an `exp` worked out in this
/// step, if any) one bucket past the newest bucket's roll-off, and `exp` what the harness left
/// of it (`left_exp`); an empty window has no key.
async fn check_hash(
    connection: &mut redis::aio::MultiplexedConnection,
    key: &str,
    (window_ms, bucket_ms): (u64, u64),
    fresh_exp: Option<i64>,
    left_exp: Option<i64>,
    context: &str,
) {
    let hash: BTreeMap<String, i64> = redis::cmd("HGETALL")
        .arg(key)
        .query_async(connection)
        .await
        .unwrap();
    if hash.is_empty() {
        return;
    }
    let buckets: Vec<(i64, i64)> = hash
        .iter()
        .filter_map(|(field, &value)| Some((field.parse::<i64>().ok()?, value)))
        .collect();
    assert_eq!(
        hash.get("exp").copied(),
        left_exp,
        "exp as the harness left it, {context}: {hash:?}"
    );
    assert_eq!(
        hash.len(),
        buckets.len() + 4 + usize::from(left_exp.is_some()),
        "only buckets, 4 meta fields and `exp` if the harness left it, {context}: {hash:?}"
    );
    assert!(
        !buckets.is_empty(),
        "an empty window is deleted, {context}: {hash:?}"
    );
    assert!(
        buckets.iter().all(|&(_, v)| v > 0),
        "no empty bucket, {context}: {hash:?}"
    );
    let sum: i64 = buckets.iter().map(|&(_, v)| v).sum();
    assert_eq!(hash["total"], sum, "total, {context}: {hash:?}");
    let least = buckets.iter().map(|&(b, _)| b).min().unwrap();
    let greatest = buckets.iter().map(|&(b, _)| b).max().unwrap();
    assert_eq!(hash["oldest"], least, "oldest, {context}: {hash:?}");
    assert!(hash["newest"] >= greatest, "newest, {context}: {hash:?}");
    assert_eq!(hash["bms"], bucket_ms as i64, "bms, {context}: {hash:?}");
    if let Some(exp) = fresh_exp.filter(|&exp| exp >= 0) {
        let buckets_per_window = (window_ms / bucket_ms).max(1) as i64;
        assert_eq!(
            exp,
            (hash["newest"] + buckets_per_window + 1) * bucket_ms as i64,
            "exp, {context}: {hash:?}"
        );
    }
}
