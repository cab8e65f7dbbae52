//! The budget-store contract (the module doc of `tollgate::budget`), checked against both
//! stores with one suite: every behaviour is an async function of a `Store` and a `Clock`,
//! run once against the embedded store with paused tokio time and once against a real
//! redis-server with real time.
//!
//! Black box: only `tollgate::budget::Store`'s methods. Real time makes every wait approximate,
//! so the windows here are short (2 s in 100 ms buckets) and each assertion after a wait is on
//! a state that is certain whatever the machine's load: "gone" only after waiting past the
//! latest possible expiry, "still there" only with most of a second to spare. Nothing asserts
//! how long anything took. Exact answers to the millisecond are the embedded store's unit tests
//! (`src/budget/memory/tests.rs`) and the window arithmetic's (`src/budget/window/tests.rs`).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::task::JoinSet;
use tollgate::budget::memory::MemoryStore;
use tollgate::budget::redis::{RedisSettings, RedisStore};
use tollgate::budget::{
    Denied, DeniedLimit, Granted, LeaseRef, Quantity, Reservation, Reserve, Settlement, Store,
    Usage, WindowLimit, WindowState,
};

use tollgate_testkit::redis::RedisServer;

/// Every window in these tests: 2 s in 20 buckets of 100 ms.
const WINDOW_MS: u64 = 2_000;
const BUCKET_MS: u64 = 100;
/// Leases that must not expire during a test.
const LONG_TTL_MS: u64 = 60_000;

/// How a behaviour lets time pass on the store's clock.
trait Clock: Sync {
    /// Lets at least `ms` pass on the store's clock.
    fn pass(&self, ms: u64) -> BoxFuture<'_, ()>;
}

/// The embedded store's clock is tokio's: paused, it moves exactly as far as it is told.
struct PausedClock;

impl Clock for PausedClock {
    fn pass(&self, ms: u64) -> BoxFuture<'_, ()> {
        Box::pin(tokio::time::advance(Duration::from_millis(ms)))
    }
}

/// Redis's clock is the server's: wait in real time, a little longer than asked, because the
/// scripts read whole milliseconds from `TIME`.
struct RealClock;

/// Rounding of the server's clock to whole milliseconds, with room to spare.
const REAL_CLOCK_SLACK_MS: u64 = 25;

impl Clock for RealClock {
    fn pass(&self, ms: u64) -> BoxFuture<'_, ()> {
        Box::pin(tokio::time::sleep(Duration::from_millis(
            ms + REAL_CLOCK_SLACK_MS,
        )))
    }
}

fn tokens(name: &str, limit: u64) -> WindowLimit {
    WindowLimit {
        name: name.into(),
        quantity: Quantity::Tokens,
        window_ms: WINDOW_MS,
        bucket_ms: BUCKET_MS,
        limit,
    }
}

fn requests(name: &str, limit: u64) -> WindowLimit {
    WindowLimit {
        quantity: Quantity::Requests,
        ..tokens(name, limit)
    }
}

fn empty(limit: &WindowLimit) -> WindowState {
    WindowState {
        used: 0,
        limit: limit.limit,
        reset_ms: 0,
    }
}

/// One tenant's budget as a request path would use it: its windows, concurrency limit and
/// lease TTL, fixed for the test.
struct Budget<'a> {
    store: &'a Store,
    tenant: String,
    windows: Vec<WindowLimit>,
    max_concurrent: Option<u32>,
    lease_ttl_ms: u64,
}

impl<'a> Budget<'a> {
    fn new(store: &'a Store, tenant: &str, windows: Vec<WindowLimit>) -> Budget<'a> {
        Budget {
            store,
            tenant: tenant.into(),
            windows,
            max_concurrent: None,
            lease_ttl_ms: LONG_TTL_MS,
        }
    }

    fn max_concurrent(self, max: u32) -> Budget<'a> {
        Budget {
            max_concurrent: Some(max),
            ..self
        }
    }

    fn lease_ttl_ms(self, ttl: u64) -> Budget<'a> {
        Budget {
            lease_ttl_ms: ttl,
            ..self
        }
    }

    async fn reserve(&self, lease_id: &str, tokens: u64) -> Reserve {
        let reservation = Reservation {
            tenant: &self.tenant,
            lease_id,
            tokens,
            windows: &self.windows,
            max_concurrent: self.max_concurrent,
            lease_ttl_ms: self.lease_ttl_ms,
        };
        self.store
            .reserve(&reservation)
            .await
            .unwrap_or_else(|e| panic!("{}: reserve {lease_id}: {e}", self.tenant))
    }

    async fn grant(&self, lease_id: &str, tokens: u64) -> Granted {
        match self.reserve(lease_id, tokens).await {
            Reserve::Granted(granted) => granted,
            Reserve::Denied(denied) => {
                panic!(
                    "{}: {lease_id} ({tokens} tokens) denied: {denied:?}",
                    self.tenant
                )
            }
        }
    }

    async fn deny(&self, lease_id: &str, tokens: u64) -> Denied {
        match self.reserve(lease_id, tokens).await {
            Reserve::Denied(denied) => denied,
            Reserve::Granted(granted) => {
                panic!(
                    "{}: {lease_id} ({tokens} tokens) granted: {granted:?}",
                    self.tenant
                )
            }
        }
    }

    async fn settle(
        &self,
        lease_id: &str,
        granted: &Granted,
        reserved_tokens: u64,
        actual_tokens: u64,
        refund_request: bool,
    ) {
        let settlement = Settlement {
            tenant: &self.tenant,
            lease_id,
            windows: &self.windows,
            reserved_at_ms: granted.at_ms,
            reserved_tokens,
            actual_tokens,
            refund_request,
        };
        self.store
            .settle(&settlement)
            .await
            .unwrap_or_else(|e| panic!("{}: settle {lease_id}: {e}", self.tenant));
    }

    async fn renew(&self, lease_ids: &[&str]) {
        let leases: Vec<LeaseRef<'_>> = lease_ids
            .iter()
            .map(|&lease_id| LeaseRef {
                tenant: &self.tenant,
                lease_id,
            })
            .collect();
        self.store
            .renew(&leases, self.lease_ttl_ms)
            .await
            .unwrap_or_else(|e| panic!("{}: renew: {e}", self.tenant));
    }

    async fn usage(&self) -> Usage {
        self.store
            .usage(&self.tenant, &self.windows)
            .await
            .unwrap_or_else(|e| panic!("{}: usage: {e}", self.tenant))
    }

    /// Each window's `used`, in order.
    async fn used(&self) -> Vec<u64> {
        self.usage().await.windows.iter().map(|w| w.used).collect()
    }

    async fn leases(&self) -> u32 {
        self.usage().await.leases
    }
}

/// The behaviours, each a function of the store and its clock.
mod contract {
    use super::*;

    /// Usage rolls off bucket by bucket as each ages out of the window, never all at once.
    pub async fn windows_roll_bucket_by_bucket(store: &Store, clock: &dyn Clock) {
        let budget = Budget::new(store, "roll", vec![tokens("tokens", 1_000)]);
        budget.grant("a", 600).await;
        clock.pass(1_000).await;
        let second = budget.grant("b", 300).await;
        assert_eq!(second.windows[0].used, 900, "both reservations count");
        assert!(second.windows[0].reset_ms > 0 && second.windows[0].reset_ms <= WINDOW_MS);
        // a is more than a window old; b has most of a second left.
        clock.pass(1_300).await;
        assert_eq!(budget.used().await, [300], "a rolled off, b did not");
        clock.pass(1_000).await;
        assert_eq!(budget.usage().await.windows, [empty(&budget.windows[0])]);
    }

    /// Exactly at the limit passes; one over is refused and takes nothing.
    pub async fn token_budgets_are_enforced(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(store, "tokens", vec![tokens("tokens", 1_000)]);
        budget.grant("a", 600).await;
        let full = budget.grant("b", 400).await;
        assert_eq!(full.windows[0].used, 1_000, "exactly at the limit");
        assert_eq!(full.windows[0].limit, 1_000);

        let refused = budget.deny("c", 1).await;
        assert_eq!(refused.limit, DeniedLimit::Window(0));
        assert_eq!(
            (refused.used, refused.allowed, refused.requested),
            (1_000, 1_000, 1)
        );
        let retry = refused
            .retry_after_ms
            .expect("1 token fits once usage rolls off");
        assert!(retry > 0 && retry <= WINDOW_MS, "retry_after {retry}");
        assert_eq!(refused.windows.len(), 1);
        assert_eq!(refused.windows[0].used, 1_000);

        let usage = budget.usage().await;
        assert_eq!(usage.windows[0].used, 1_000, "the refusal consumed nothing");
        assert_eq!(usage.leases, 2, "the refusal took no lease");
    }

    /// A request window counts requests, whatever their tokens.
    pub async fn request_rates_are_enforced(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(store, "rpm", vec![requests("requests", 3)]);
        for (i, lease) in ["a", "b", "c"].into_iter().enumerate() {
            let granted = budget.grant(lease, 10_000).await;
            assert_eq!(granted.windows[0].used, i as u64 + 1);
        }
        let refused = budget.deny("d", 1).await;
        assert_eq!(refused.limit, DeniedLimit::Window(0));
        assert_eq!(
            (refused.used, refused.allowed, refused.requested),
            (3, 3, 1)
        );
        assert!(refused.retry_after_ms.is_some_and(|ms| ms <= WINDOW_MS));
        assert_eq!(budget.used().await, [3]);
        assert_eq!(budget.leases().await, 3);
    }

    /// Windows are checked in order, then concurrency; the first that fails is reported.
    pub async fn the_first_failing_limit_is_reported(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(
            store,
            "order",
            vec![tokens("tokens", 100), requests("requests", 2)],
        )
        .max_concurrent(1);
        budget.grant("a", 60).await;
        // Tokens and concurrency both fail: the window, which comes first.
        let refused = budget.deny("b", 50).await;
        assert_eq!(refused.limit, DeniedLimit::Window(0));
        assert_eq!((refused.used, refused.requested), (60, 50));
        // Only concurrency fails.
        let refused = budget.deny("b", 40).await;
        assert_eq!(refused.limit, DeniedLimit::Concurrency);
        assert_eq!(
            (refused.used, refused.allowed, refused.requested),
            (1, 1, 1)
        );
        assert_eq!(refused.windows.len(), 2, "every window's state");
        assert_eq!((refused.windows[0].used, refused.windows[1].used), (60, 1));
    }

    /// At most `max_concurrent` live leases; settling one frees its slot.
    pub async fn concurrency_is_enforced_and_released_by_settle(store: &Store, _: &dyn Clock) {
        let budget =
            Budget::new(store, "concurrency", vec![requests("requests", 100)]).max_concurrent(2);
        let a = budget.grant("a", 0).await;
        assert_eq!(a.concurrent, Some(1));
        assert_eq!(budget.grant("b", 0).await.concurrent, Some(2));

        let refused = budget.deny("c", 0).await;
        assert_eq!(refused.limit, DeniedLimit::Concurrency);
        assert_eq!(
            (refused.used, refused.allowed, refused.requested),
            (2, 2, 1)
        );
        let retry = refused.retry_after_ms.expect("a lease will expire");
        assert!(retry > 0 && retry <= LONG_TTL_MS, "retry_after {retry}");
        assert_eq!(budget.leases().await, 2);

        budget.settle("a", &a, 0, 0, false).await;
        assert_eq!(budget.leases().await, 1);
        assert_eq!(budget.grant("c", 0).await.concurrent, Some(2));
    }

    /// A cost over a window's whole limit (or a concurrency limit of 0) can never fit.
    pub async fn a_request_larger_than_a_window_never_fits(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(
            store,
            "larger",
            vec![tokens("tokens", 1_000), requests("requests", 10)],
        );
        let refused = budget.deny("a", 1_001).await;
        assert_eq!(refused.limit, DeniedLimit::Window(0));
        assert_eq!(
            (refused.used, refused.allowed, refused.requested),
            (0, 1_000, 1_001)
        );
        assert_eq!(refused.retry_after_ms, None);
        assert_eq!(
            refused.windows,
            [empty(&budget.windows[0]), empty(&budget.windows[1])]
        );
        // Still never with usage in the window.
        budget.grant("b", 500).await;
        assert_eq!(budget.deny("c", 1_001).await.retry_after_ms, None);

        let nowhere =
            Budget::new(store, "no_slots", vec![requests("requests", 10)]).max_concurrent(0);
        let refused = nowhere.deny("a", 0).await;
        assert_eq!(refused.limit, DeniedLimit::Concurrency);
        assert_eq!(refused.retry_after_ms, None);
        assert_eq!(
            nowhere.usage().await,
            Usage {
                windows: vec![empty(&nowhere.windows[0])],
                leases: 0
            }
        );
    }

    /// Waiting `retry_after_ms` is enough for the refused request to fit.
    pub async fn retry_after_is_when_enough_has_rolled_off(store: &Store, clock: &dyn Clock) {
        // The oldest bucket frees enough.
        let budget = Budget::new(store, "retry_one", vec![tokens("tokens", 1_000)]);
        budget.grant("a", 600).await;
        clock.pass(500).await;
        budget.grant("b", 400).await;
        let retry = budget
            .deny("c", 300)
            .await
            .retry_after_ms
            .expect("fits later");
        assert!(retry > 0 && retry <= WINDOW_MS - 500, "retry_after {retry}");
        clock.pass(retry).await;
        budget.grant("c", 300).await;

        // It takes the two oldest buckets.
        let budget = Budget::new(store, "retry_two", vec![tokens("tokens", 1_000)]);
        budget.grant("a", 300).await;
        clock.pass(500).await;
        budget.grant("b", 300).await;
        clock.pass(500).await;
        budget.grant("c", 300).await;
        let retry = budget
            .deny("d", 650)
            .await
            .retry_after_ms
            .expect("fits later");
        assert!(retry > 0 && retry <= WINDOW_MS - 500, "retry_after {retry}");
        clock.pass(retry).await;
        budget.grant("d", 650).await;
    }

    /// Settling lowers the reserved bucket to the actual tokens, or raises it, even past the
    /// limit; `refund_request` gives the request's count back.
    pub async fn settlement_refunds_and_charges(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(
            store,
            "settle",
            vec![tokens("tokens", 1_000), requests("requests", 10)],
        );
        let a = budget.grant("a", 500).await;
        budget.settle("a", &a, 500, 200, false).await;
        assert_eq!(
            budget.used().await,
            [200, 1],
            "refunded 300; the request still counts"
        );

        let b = budget.grant("b", 500).await;
        budget.settle("b", &b, 500, 1_100, false).await;
        assert_eq!(
            budget.used().await,
            [1_300, 2],
            "charged 600 more, past the limit"
        );
        let refused = budget.deny("c", 0).await;
        assert_eq!(refused.limit, DeniedLimit::Window(0));
        assert_eq!(refused.used, 1_300);
        assert!(
            refused.retry_after_ms.is_some(),
            "fits once the charge rolls off"
        );

        let budget = Budget::new(
            store,
            "settle_request",
            vec![tokens("tokens", 1_000), requests("requests", 10)],
        );
        let a = budget.grant("a", 100).await;
        budget.settle("a", &a, 100, 100, true).await;
        assert_eq!(
            budget.used().await,
            [100, 0],
            "the request count given back"
        );
        assert_eq!(budget.leases().await, 0);
    }

    /// A refund lowers only the reservation's own bucket, and never below zero.
    pub async fn refunds_are_clamped_to_their_bucket(store: &Store, clock: &dyn Clock) {
        let budget = Budget::new(store, "clamp", vec![tokens("tokens", 1_000)]);
        budget.grant("a", 300).await;
        // Past a bucket boundary: b lands in a later bucket than a.
        clock.pass(3 * BUCKET_MS).await;
        let b = budget.grant("b", 500).await;
        budget.settle("b", &b, 500, 0, false).await;
        // Settled twice (the caller's bug): the second refund finds b's bucket empty.
        budget.settle("b", &b, 500, 0, false).await;
        assert_eq!(budget.used().await, [300], "a's tokens untouched");
    }

    /// A bucket that rolled off before the settlement: a refund does nothing, a charge goes to
    /// now's bucket.
    pub async fn settling_after_the_bucket_rolled_off(store: &Store, clock: &dyn Clock) {
        let budget = Budget::new(store, "late", vec![tokens("tokens", 1_000)]);
        let a = budget.grant("a", 500).await;
        let b = budget.grant("b", 500).await;
        clock.pass(WINDOW_MS + 200).await;
        assert_eq!(budget.used().await, [0]);
        budget.settle("a", &a, 500, 0, false).await;
        assert_eq!(budget.used().await, [0], "nothing to refund");
        budget.settle("b", &b, 500, 800, false).await;
        let usage = budget.usage().await;
        assert_eq!(usage.windows[0].used, 300, "the extra 300 charged now");
        assert!(usage.windows[0].reset_ms > WINDOW_MS / 2, "in now's bucket");
    }

    /// Settling twice removes the lease once, and the second settle is not an error.
    pub async fn release_is_idempotent(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(store, "twice", vec![tokens("tokens", 1_000)]).max_concurrent(3);
        let a = budget.grant("a", 100).await;
        budget.grant("b", 100).await;
        budget.settle("a", &a, 100, 100, false).await;
        assert_eq!(budget.leases().await, 1);
        budget.settle("a", &a, 100, 100, false).await;
        assert_eq!(budget.leases().await, 1, "b's lease is still there");
        // A lease the store never saw.
        budget.settle("never", &a, 0, 0, false).await;
        assert_eq!(budget.leases().await, 1);
        assert_eq!(budget.used().await, [200]);
    }

    /// A lease not renewed frees its slot after its TTL; a renewed one stays; an expired one
    /// is not renewed back to life.
    pub async fn leases_expire_unless_renewed(store: &Store, clock: &dyn Clock) {
        let budget = Budget::new(store, "expiry", vec![requests("requests", 100)])
            .max_concurrent(2)
            .lease_ttl_ms(1_500);
        budget.grant("a", 0).await;
        budget.grant("b", 0).await;
        budget.deny("c", 0).await;
        clock.pass(900).await;
        budget.renew(&["b"]).await;
        // a is past its TTL; b has most of a second left since its renewal.
        clock.pass(900).await;
        assert_eq!(budget.leases().await, 1, "a expired, b renewed");
        assert_eq!(
            budget.grant("c", 0).await.concurrent,
            Some(2),
            "a's slot is free again"
        );
        clock.pass(1_600).await;
        assert_eq!(budget.leases().await, 0, "b and c expired");
        budget.renew(&["a", "b", "c"]).await;
        assert_eq!(budget.leases().await, 0, "expired leases stay expired");
    }

    /// Renewing a settled lease does not bring it back.
    pub async fn renew_does_not_resurrect_a_settled_lease(store: &Store, _: &dyn Clock) {
        let budget =
            Budget::new(store, "resurrect", vec![requests("requests", 100)]).max_concurrent(1);
        let a = budget.grant("a", 0).await;
        budget.settle("a", &a, 0, 0, false).await;
        budget.renew(&["a"]).await;
        assert_eq!(budget.leases().await, 0);
        budget.grant("b", 0).await;
    }

    /// A refusal by any limit takes nothing from any other.
    pub async fn nothing_is_consumed_on_reject(store: &Store, _: &dyn Clock) {
        let budget = Budget::new(
            store,
            "reject",
            vec![tokens("tokens", 1_000), requests("requests", 2)],
        )
        .max_concurrent(1);
        let a = budget.grant("a", 900).await;
        // Refused by tokens: the request window would have fit.
        assert_eq!(budget.deny("b", 200).await.limit, DeniedLimit::Window(0));
        // Refused by concurrency: both windows would have fit.
        assert_eq!(budget.deny("b", 50).await.limit, DeniedLimit::Concurrency);
        assert_eq!(budget.used().await, [900, 1]);
        assert_eq!(budget.leases().await, 1);

        budget.settle("a", &a, 900, 900, false).await;
        let c = budget.grant("c", 50).await;
        budget.settle("c", &c, 50, 50, false).await;
        // Refused by the request window: the token window would have fit.
        assert_eq!(budget.deny("d", 10).await.limit, DeniedLimit::Window(1));
        assert_eq!(budget.used().await, [950, 2]);
        assert_eq!(budget.leases().await, 0);
    }

    /// Many reservations at once never grant past the limit, and settling every grant in full
    /// (actual 0, request refunded) leaves nothing behind.
    pub async fn counters_return_to_zero(store: &Arc<Store>, _: &dyn Clock) {
        const TASKS: usize = 12;
        const MAX: u32 = 5;
        let windows = Arc::new(vec![tokens("tokens", 100_000), requests("requests", 1_000)]);
        let mut tasks = JoinSet::new();
        for i in 0..TASKS {
            let (store, windows) = (store.clone(), windows.clone());
            tasks.spawn(async move {
                let lease_id = format!("lease{i}");
                let reservation = Reservation {
                    tenant: "crowd",
                    lease_id: &lease_id,
                    tokens: 100,
                    windows: &windows,
                    max_concurrent: Some(MAX),
                    lease_ttl_ms: LONG_TTL_MS,
                };
                (lease_id.clone(), store.reserve(&reservation).await)
            });
        }
        let mut granted = Vec::new();
        for (lease_id, answer) in tasks.join_all().await {
            match answer.expect("store answers") {
                Reserve::Granted(grant) => granted.push((lease_id, grant)),
                Reserve::Denied(denied) => {
                    assert_eq!(denied.limit, DeniedLimit::Concurrency, "{denied:?}");
                    assert_eq!(denied.used, u64::from(MAX), "{denied:?}");
                }
            }
        }
        // Nothing settles in between, so exactly MAX fit, each seeing a distinct count.
        let mut counts: Vec<_> = granted.iter().map(|(_, g)| g.concurrent).collect();
        counts.sort();
        assert_eq!(counts, (1..=MAX).map(Some).collect::<Vec<_>>());
        let usage = store.usage("crowd", &windows).await.expect("store answers");
        assert_eq!(usage.leases, MAX);
        assert_eq!(
            (usage.windows[0].used, usage.windows[1].used),
            (100 * u64::from(MAX), u64::from(MAX))
        );

        let mut tasks = JoinSet::new();
        for (lease_id, grant) in granted {
            let (store, windows) = (store.clone(), windows.clone());
            tasks.spawn(async move {
                let settlement = Settlement {
                    tenant: "crowd",
                    lease_id: &lease_id,
                    windows: &windows,
                    reserved_at_ms: grant.at_ms,
                    reserved_tokens: 100,
                    actual_tokens: 0,
                    refund_request: true,
                };
                store.settle(&settlement).await
            });
        }
        for settled in tasks.join_all().await {
            settled.expect("store answers");
        }
        assert_eq!(
            store.usage("crowd", &windows).await.expect("store answers"),
            Usage {
                windows: windows.iter().map(empty).collect(),
                leases: 0
            }
        );
    }
}

/// Each behaviour as a test against each store: `store_contract::memory::<behaviour>` with
/// paused time and `store_contract::redis::<behaviour>` against a fresh redis-server.
macro_rules! against_both_stores {
    ($($behaviour:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(start_paused = true)]
                async fn $behaviour() {
                    let store = Arc::new(Store::Memory(MemoryStore::new()));
                    contract::$behaviour(&store, &PausedClock).await;
                }
            )*
        }

        mod redis {
            use super::*;
            $(
                #[tokio::test]
                async fn $behaviour() {
                    let (_server, store) = redis_store().await;
                    contract::$behaviour(&Arc::new(store), &RealClock).await;
                }
            )*
        }
    };
}

against_both_stores!(
    windows_roll_bucket_by_bucket,
    token_budgets_are_enforced,
    request_rates_are_enforced,
    the_first_failing_limit_is_reported,
    concurrency_is_enforced_and_released_by_settle,
    a_request_larger_than_a_window_never_fits,
    retry_after_is_when_enough_has_rolled_off,
    settlement_refunds_and_charges,
    refunds_are_clamped_to_their_bucket,
    settling_after_the_bucket_rolled_off,
    release_is_idempotent,
    leases_expire_unless_renewed,
    renew_does_not_resurrect_a_settled_lease,
    nothing_is_consumed_on_reject,
    counters_return_to_zero,
);

/// A fresh redis-server (stopped when the first value drops) and a store connected to it.
async fn redis_store() -> (RedisServer, Store) {
    let server = RedisServer::start().await;
    let store = RedisStore::connect(RedisSettings {
        url: server.url.clone(),
        password: None,
        // Generous: a loaded 2-core machine, and these tests are about answers, not speed.
        timeout: Duration::from_secs(5),
    })
    .await
    .expect("settings are valid");
    (server, Store::Redis(Box::new(store)))
}
