//! The fleet registry's scripts against real `redis-server`s: membership and its expiry, the
//! policy check, the leader lease and its fencing token, decisions reaching the followers, and
//! keys that share one slot and delete themselves. Short TTLs (hundreds of ms) are slept past
//! with wide margins; nothing here measures latency.

use std::future::Future;
use std::time::Duration;

use tollgate::budget::StoreError;
use tollgate::budget::redis::fleet::{
    Decision, Heartbeat, Joined, MemberRecord, Publish, Published, View,
};
use tollgate::budget::redis::{RedisSettings, RedisStore};

use tollgate_testkit::redis::RedisServer;

/// Every test's own bound: generous, so a loaded machine fails nothing by being slow.
const TEST_TIMEOUT: Duration = Duration::from_secs(90);
/// The store's per-call timeout.
const PATIENT: Duration = Duration::from_secs(5);
/// A TTL no test outlives.
const LONG: Duration = Duration::from_secs(30);
/// A TTL tests wait out, by sleeping `PAST_SHORT`.
const SHORT: Duration = Duration::from_millis(300);
const PAST_SHORT: Duration = Duration::from_millis(900);

const FLEET: &str = "fleet-a";

async fn within<T>(test: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test finished within its overall timeout")
}

async fn store(server: &RedisServer) -> RedisStore {
    RedisStore::connect(RedisSettings {
        url: server.url.clone(),
        password: None,
        timeout: PATIENT,
    })
    .await
    .expect("connect (lazily) to the test server")
}

fn key(part: &str) -> String {
    format!("tollgate:fleet:{{{FLEET}}}:{part}")
}

/// A heartbeat of `member` running `policy` with long TTLs, reporting `report-<member>`.
fn beat<'a>(member: &'a str, policy: &'a str, report: &'a str) -> Heartbeat<'a> {
    Heartbeat {
        fleet: FLEET,
        member,
        policy_hash: policy,
        member_ttl: LONG,
        leader_ttl: LONG,
        report,
    }
}

/// Joins, retrying while the store's background connection comes up.
async fn join(store: &RedisStore, heartbeat: &Heartbeat<'_>) -> Joined {
    let mut last = None;
    for _ in 0..100 {
        match store.fleet_join(heartbeat).await {
            Ok(joined) => return joined,
            Err(e @ (StoreError::Unavailable(_) | StoreError::Timeout(_))) => last = Some(e),
            Err(e) => panic!("join failed: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the store never answered; last error {last:?}");
}

#[track_caller]
fn member(joined: Joined) -> View {
    match joined {
        Joined::Member(view) => view,
        other => panic!("expected to be registered, got {other:?}"),
    }
}

fn record(member: &str, report: &str, handed: Option<u32>) -> MemberRecord {
    MemberRecord {
        member: member.into(),
        report: report.into(),
        handed,
    }
}

fn publish<'a>(member: &'a str, fence: u64, grants: &'a [(String, u32, String)]) -> Publish<'a> {
    Publish {
        fleet: FLEET,
        member,
        fence,
        limit: 8,
        window_epoch: 2,
        grants,
        member_ttl: LONG,
    }
}

fn grant(member: &str, grant: u32, overrides: &str) -> (String, u32, String) {
    (member.into(), grant, overrides.into())
}

/// The live member ids in the members ZSET, sorted.
async fn registered(server: &RedisServer) -> Vec<String> {
    let mut ids: Vec<String> = server
        .cmd(&["ZRANGE", &key("members"), "0", "-1"])
        .await
        .lines()
        .map(str::to_owned)
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn the_first_member_leads_and_a_foreign_policy_is_refused() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;

        let a = member(join(&store, &beat("a", "p1", "ra")).await);
        assert_eq!(
            a,
            View {
                members: 1,
                leader: Some("a".into()),
                fence: Some(1),
                decision: None,
                grant: None,
                overrides: String::new(),
                reports: vec![record("a", "ra", None)],
            }
        );
        assert_eq!(server.cmd(&["GET", &key("policy")]).await, "p1");

        let b = member(join(&store, &beat("b", "p1", "rb")).await);
        assert_eq!(b.members, 2);
        assert_eq!(b.leader.as_deref(), Some("a"));
        assert_eq!(b.fence, None, "a follower gets no token");
        assert_eq!(b.reports, Vec::new(), "a follower reads no reports");

        let c = join(&store, &beat("c", "p2", "rc")).await;
        assert_eq!(
            c,
            Joined::PolicyMismatch {
                fleet_policy: "p1".into()
            }
        );
        assert_eq!(registered(&server).await, ["a", "b"], "c is not counted");
        assert_eq!(server.cmd(&["HEXISTS", &key("reports"), "c"]).await, "0");
        assert_eq!(server.cmd(&["GET", &key("policy")]).await, "p1");

        // The leader renews its lease under the same token and reads every report.
        let a = member(join(&store, &beat("a", "p1", "ra2")).await);
        assert_eq!(a.members, 2);
        assert_eq!(a.fence, Some(1));
        let mut reports = a.reports;
        reports.sort_by(|x, y| x.member.cmp(&y.member));
        assert_eq!(reports, [record("a", "ra2", None), record("b", "rb", None)]);
    })
    .await;
}

#[tokio::test]
async fn join_publish_and_leave_are_one_command_each() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        member(join(&store, &beat("a", "p1", "ra")).await);
        // Let the background loading of the scripts finish before watching.
        store.warmed_up().await;
        let mut monitor = server.monitor().await;
        let evalsha = vec!["EVALSHA".to_owned()];

        member(join(&store, &beat("a", "p1", "ra")).await);
        assert_eq!(monitor.client_commands(&server).await, evalsha, "join");
        let grants = [grant("a", 1, "")];
        let applied = store.fleet_publish(&publish("a", 1, &grants)).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 1 });
        assert_eq!(monitor.client_commands(&server).await, evalsha, "publish");
        store.fleet_leave(FLEET, "a").await.unwrap();
        assert_eq!(monitor.client_commands(&server).await, evalsha, "leave");
    })
    .await;
}

#[tokio::test]
async fn published_grants_reach_the_followers_and_show_as_handed() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        let a = member(join(&store, &beat("a", "p1", "ra")).await);
        member(join(&store, &beat("b", "p1", "rb")).await);

        let grants = [grant("a", 3, "oa"), grant("b", 5, "ob")];
        let fence = a.fence.unwrap();
        let applied = store.fleet_publish(&publish("a", fence, &grants)).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 1 });

        let decision = Decision {
            seq: 1,
            limit: 8,
            window_epoch: 2,
            fence: 1,
        };
        let b = member(join(&store, &beat("b", "p1", "rb")).await);
        assert_eq!(b.decision, Some(decision));
        assert_eq!(b.grant, Some(5));
        assert_eq!(b.overrides, "ob");

        // The leader sees its own grant (recorded by the publish) and b's (by b's join).
        let a = member(join(&store, &beat("a", "p1", "ra")).await);
        assert_eq!(a.grant, Some(3));
        assert_eq!(a.overrides, "oa");
        let mut reports = a.reports;
        reports.sort_by(|x, y| x.member.cmp(&y.member));
        assert_eq!(
            reports,
            [record("a", "ra", Some(3)), record("b", "rb", Some(5))]
        );

        // b has not synced since a decision that grants it more: the leader counts that grant,
        // since b may read it any moment before the next publish.
        let grants = [grant("a", 3, "oa"), grant("b", 9, "ob")];
        let applied = store.fleet_publish(&publish("a", fence, &grants)).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 2 });
        let a = member(join(&store, &beat("a", "p1", "ra")).await);
        let mut reports = a.reports;
        reports.sort_by(|x, y| x.member.cmp(&y.member));
        assert_eq!(
            reports,
            [record("a", "ra", Some(3)), record("b", "rb", Some(9))]
        );
        member(join(&store, &beat("b", "p1", "rb")).await);

        // A new decision replaces the old one whole: b is no longer named in it.
        let grants = [grant("a", 7, "")];
        let applied = store.fleet_publish(&publish("a", fence, &grants)).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 3 });
        let b = member(join(&store, &beat("b", "p1", "rb")).await);
        assert_eq!(b.decision.map(|d| d.seq), Some(3));
        assert_eq!(b.grant, None);
        assert_eq!(b.overrides, "");
        assert_eq!(server.cmd(&["HEXISTS", &key("decision"), "g:b"]).await, "0");
    })
    .await;
}

#[tokio::test]
async fn a_stale_fence_is_refused_and_writes_nothing() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        let short_lease = |member| Heartbeat {
            leader_ttl: SHORT,
            ..beat(member, "p1", "r")
        };
        let a = member(join(&store, &short_lease("a")).await);
        assert_eq!(a.fence, Some(1));

        // a stops renewing; b takes the lapsed lease under the next token.
        tokio::time::sleep(PAST_SHORT).await;
        let b = member(join(&store, &beat("b", "p1", "r")).await);
        assert_eq!(b.leader.as_deref(), Some("b"));
        assert_eq!(b.fence, Some(2));

        let grants = [grant("a", 1, "")];
        let stale = store.fleet_publish(&publish("a", 1, &grants)).await;
        assert_eq!(stale.unwrap(), Published::Fenced);
        assert_eq!(server.cmd(&["EXISTS", &key("decision")]).await, "0");
        assert_eq!(server.cmd(&["HEXISTS", &key("handed"), "a"]).await, "0");
        // Neither may the new leader write under an old token, nor anyone under its token.
        let stale = store.fleet_publish(&publish("b", 1, &grants)).await;
        assert_eq!(stale.unwrap(), Published::Fenced);
        let foreign = store.fleet_publish(&publish("a", 2, &grants)).await;
        assert_eq!(foreign.unwrap(), Published::Fenced);
        assert_eq!(server.cmd(&["EXISTS", &key("decision")]).await, "0");

        // a, back, follows.
        let a = member(join(&store, &short_lease("a")).await);
        assert_eq!((a.leader.as_deref(), a.fence), (Some("b"), None));
        let applied = store.fleet_publish(&publish("b", 2, &grants)).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 1 });
    })
    .await;
}

#[tokio::test]
async fn a_silent_member_drops_out_after_its_ttl() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        member(join(&store, &beat("a", "p1", "ra")).await);
        let b = Heartbeat {
            member_ttl: SHORT,
            ..beat("b", "p1", "rb")
        };
        assert_eq!(member(join(&store, &b).await).members, 2);
        let grants = [grant("b", 4, "")];
        let applied = store.fleet_publish(&publish("a", 1, &grants)).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 1 });
        member(join(&store, &b).await);
        assert_eq!(server.cmd(&["HGET", &key("handed"), "b"]).await, "4");

        tokio::time::sleep(PAST_SHORT).await;
        let a = member(join(&store, &beat("a", "p1", "ra")).await);
        assert_eq!(a.members, 1);
        assert_eq!(a.reports, [record("a", "ra", None)]);
        assert_eq!(registered(&server).await, ["a"]);
        assert_eq!(server.cmd(&["HEXISTS", &key("reports"), "b"]).await, "0");
        assert_eq!(server.cmd(&["HEXISTS", &key("handed"), "b"]).await, "0");
    })
    .await;
}

#[tokio::test]
async fn leaving_releases_the_lease_to_the_next_member() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        assert_eq!(
            member(join(&store, &beat("a", "p1", "ra")).await).fence,
            Some(1)
        );
        member(join(&store, &beat("b", "p1", "rb")).await);

        store.fleet_leave(FLEET, "a").await.unwrap();
        assert_eq!(registered(&server).await, ["b"]);
        assert_eq!(server.cmd(&["EXISTS", &key("leader")]).await, "0");
        assert_eq!(server.cmd(&["HEXISTS", &key("reports"), "a"]).await, "0");

        let b = member(join(&store, &beat("b", "p1", "rb")).await);
        assert_eq!(b.members, 1);
        assert_eq!((b.leader.as_deref(), b.fence), (Some("b"), Some(2)));

        // A follower leaving leaves the lease alone; leaving twice is harmless.
        member(join(&store, &beat("c", "p1", "rc")).await);
        store.fleet_leave(FLEET, "c").await.unwrap();
        store.fleet_leave(FLEET, "c").await.unwrap();
        assert_eq!(server.cmd(&["GET", &key("leader")]).await, "b");
        assert_eq!(registered(&server).await, ["b"]);
    })
    .await;
}

#[tokio::test]
async fn a_new_policy_takes_over_once_the_old_members_are_gone() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        let old = |member| Heartbeat {
            member_ttl: SHORT,
            leader_ttl: SHORT,
            ..beat(member, "p1", "r")
        };
        member(join(&store, &old("a")).await);
        member(join(&store, &old("b")).await);
        assert!(matches!(
            join(&store, &beat("c", "p2", "r")).await,
            Joined::PolicyMismatch { .. }
        ));

        // Once both expired, the next member's policy is the fleet's.
        tokio::time::sleep(PAST_SHORT).await;
        let c = member(join(&store, &beat("c", "p2", "r")).await);
        assert_eq!(c.members, 1);
        assert_eq!((c.leader.as_deref(), c.fence), (Some("c"), Some(2)));
        assert_eq!(server.cmd(&["GET", &key("policy")]).await, "p2");
        let refused = join(&store, &beat("a", "p1", "r")).await;
        assert_eq!(
            refused,
            Joined::PolicyMismatch {
                fleet_policy: "p2".into()
            }
        );

        // Leaving works as well as expiring: the last member out hands the policy on.
        store.fleet_leave(FLEET, "c").await.unwrap();
        member(join(&store, &beat("d", "p3", "r")).await);
        assert_eq!(server.cmd(&["GET", &key("policy")]).await, "p3");
    })
    .await;
}

#[tokio::test]
async fn every_key_of_a_fleet_is_in_one_slot_and_expires() {
    within(async {
        // On a cluster node a script whose keys span slots fails (CROSSSLOT), so every call
        // succeeding is itself the check; CLUSTER KEYSLOT then names the slot.
        let server = RedisServer::start_cluster().await;
        let store = store(&server).await;
        let member_ttl = Duration::from_secs(10);
        let heartbeat = |member| Heartbeat {
            member_ttl,
            ..beat(member, "p1", "r")
        };
        member(join(&store, &heartbeat("a")).await);
        member(join(&store, &heartbeat("b")).await);
        let grants = [grant("a", 1, "o"), grant("b", 2, "o")];
        let publish = Publish {
            member_ttl,
            ..publish("a", 1, &grants)
        };
        let applied = store.fleet_publish(&publish).await;
        assert_eq!(applied.unwrap(), Published::Applied { seq: 1 });
        member(join(&store, &heartbeat("b")).await);

        let keys = server.keys("tollgate:fleet:*").await;
        let parts = [
            "decision", "fence", "handed", "leader", "members", "policy", "reports",
        ];
        assert_eq!(keys, parts.map(key), "every key of the fleet");
        let mut slots = Vec::new();
        for key in &keys {
            assert!(key.contains(&format!("{{{FLEET}}}")), "{key}");
            slots.push(server.cmd(&["CLUSTER", "KEYSLOT", key]).await);
            let pttl: u64 = server.cmd(&["PTTL", key]).await.parse().unwrap();
            let bound = if key.ends_with(":leader") {
                LONG
            } else {
                5 * member_ttl
            };
            assert!(
                pttl > 0 && u128::from(pttl) <= bound.as_millis(),
                "{key}: PTTL {pttl} not in (0, {bound:?}]"
            );
        }
        slots.dedup();
        assert_eq!(slots.len(), 1, "{keys:?} in slots {slots:?}");

        store.fleet_leave(FLEET, "b").await.unwrap();
        store.fleet_leave(FLEET, "a").await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_corrupt_decision_is_a_protocol_error() {
    within(async {
        let server = RedisServer::start().await;
        let store = store(&server).await;
        member(join(&store, &beat("a", "p1", "r")).await);
        server
            .cmd(&["HSET", &key("decision"), "seq", "x", "limit", "8"])
            .await;
        let joined = store.fleet_join(&beat("a", "p1", "r")).await;
        assert!(matches!(joined, Err(StoreError::Protocol(_))), "{joined:?}");

        // A foreign type under a key is one too.
        server.cmd(&["DEL", &key("decision")]).await;
        server.cmd(&["SET", &key("reports"), "x"]).await;
        let joined = store.fleet_join(&beat("a", "p1", "r")).await;
        assert!(matches!(joined, Err(StoreError::Protocol(_))), "{joined:?}");
    })
    .await;
}
