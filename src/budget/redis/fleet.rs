//! The fleet registry in Redis: how replicas of tollgate sharing one store find each other,
//! elect the one that decides the global in-flight limit, and hand each replica its share.
//!
//! Rust here is thin, as in the rest of `budget::redis`: it names keys and decodes replies. A
//! replica's report and a member's overrides are opaque strings to the scripts (the fleet code
//! above encodes and decodes them); the scripts only keep time (Redis `TIME`), expire members,
//! hold the leader lease and fence the leader's writes.
//!
//! # Keys
//!
//! Every key of a fleet carries the hash tag `{<fleet name>}`, so the scripts touch one slot and
//! run unchanged on Redis Cluster:
//!
//! - `tollgate:fleet:{<name>}:members`: ZSET member id → heartbeat expiry (ms, server time).
//! - `tollgate:fleet:{<name>}:reports`: HASH member id → the member's last report (opaque).
//! - `tollgate:fleet:{<name>}:handed`: HASH member id → the grant last handed to it by `join`.
//! - `tollgate:fleet:{<name>}:policy`: STRING, the policy hash the live members run.
//! - `tollgate:fleet:{<name>}:leader`: STRING member id, `PX` the leader lease.
//! - `tollgate:fleet:{<name>}:fence`: INCR counter: the fencing token of each new leadership.
//! - `tollgate:fleet:{<name>}:decision`: HASH: `seq`, `limit`, `window_epoch`, `fence`, and per
//!   member `g:<id>` (its grant) and `o:<id>` (its overrides, opaque).
//! - `tollgate:fleet:{<name>}:settings`: HASH setting → value (opaque JSON): what the admin API
//!   changed at run time (`engine`, `control`), read by every replica each sync. Written whole
//!   per setting (`HSET`), so of two racing writes one wins entire; it never expires, so a
//!   change outlives restarts until it is deleted (`HDEL`).
//!
//! Every key gets a `PEXPIRE` of a few member TTLs on every write, so an abandoned fleet deletes
//! itself.

use std::str::FromStr;
use std::time::Duration;

use redis::Value;

use super::{RedisStore, exact, protocol};
use crate::budget::StoreError;

/// What one replica sends each sync (`RedisStore::fleet_join`).
#[derive(Clone, Debug)]
pub struct Heartbeat<'a> {
    /// The fleet's name: the hash tag of its keys. Replicas sharing a store and a name share a
    /// budget.
    pub fleet: &'a str,
    /// This replica's id, unique in the fleet.
    pub member: &'a str,
    /// The hash of the policy this replica runs: a member whose hash differs from the live
    /// members' is refused.
    pub policy_hash: &'a str,
    /// A member that has not sent a heartbeat for this long is dropped.
    pub member_ttl: Duration,
    /// The leader lease: the leader renews it with every heartbeat; a member takes it when it
    /// has lapsed.
    pub leader_ttl: Duration,
    /// The member's report (opaque here), kept for the leader to read.
    pub report: &'a str,
}

/// The answer to a heartbeat.
#[derive(Clone, Debug, PartialEq)]
pub enum Joined {
    /// The member is registered (or its registration renewed).
    Member(View),
    /// The live members run another policy: this member was not registered and nothing was
    /// written.
    PolicyMismatch { fleet_policy: String },
}

/// The fleet as one member sees it after its heartbeat.
#[derive(Clone, Debug, PartialEq)]
pub struct View {
    /// Live members, this one included.
    pub members: u32,
    /// The member holding the leader lease (after this heartbeat, which may have taken it).
    pub leader: Option<String>,
    /// `Some(token)` when the caller holds the leader lease: the fencing token to publish with.
    pub fence: Option<u64>,
    /// The last decision published, if any.
    pub decision: Option<Decision>,
    /// This member's grant in that decision (`None` if the decision does not name it); the
    /// script recorded it as handed to this member.
    pub grant: Option<u32>,
    /// This member's overrides in that decision (opaque), empty if none.
    pub overrides: String,
    /// Every live member's report and last handed grant, this one's included. Filled only
    /// when the caller holds the leader lease (others do not need it).
    pub reports: Vec<MemberRecord>,
}

/// A published decision's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Increases with every publish.
    pub seq: u64,
    /// The global in-flight limit.
    pub limit: u32,
    /// Changes when the leader cut the limit and every member should restart its TTFT window.
    pub window_epoch: u64,
    /// The fencing token of the leader that published it.
    pub fence: u64,
}

/// One live member, as the leader reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberRecord {
    pub member: String,
    /// Its last report (opaque).
    pub report: String,
    /// The most it may have been handed: the larger of the grant its last heartbeat read and
    /// its grant in the decision standing now (which it may read at any moment before the
    /// next publish), if either exists.
    pub handed: Option<u32>,
}

/// The leader's decision for the whole fleet (`RedisStore::fleet_publish`).
#[derive(Clone, Debug)]
pub struct Publish<'a> {
    pub fleet: &'a str,
    pub member: &'a str,
    /// The token `View::fence` gave this leader.
    pub fence: u64,
    pub limit: u32,
    pub window_epoch: u64,
    /// Per member: its id, its grant and its overrides (opaque). Members not named get none.
    pub grants: &'a [(String, u32, String)],
    /// Keys expire after this without writes (a few member TTLs).
    pub member_ttl: Duration,
}

/// The outcome of a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    /// Written as decision `seq`; the leader's own grant was recorded as handed to it.
    Applied { seq: u64 },
    /// The caller no longer holds the lease under this fence: nothing was written.
    Fenced,
}

impl RedisStore {
    /// One `EVALSHA`: registers or renews `member` under `Redis TIME + member_ttl`, drops
    /// members whose heartbeat expired (their report and handed grant with them), refuses a
    /// member whose policy hash differs from the live members' (a fleet with no live members
    /// takes the newcomer's), takes or renews the leader lease (a new leadership `INCR`s the
    /// fence), records this member's grant from the decision as handed, and returns the view.
    pub async fn fleet_join(&self, heartbeat: &Heartbeat<'_>) -> Result<Joined, StoreError> {
        let this = &*self.inner;
        let mut invocation = this.scripts.fleet_join.prepare_invoke();
        for part in [
            "members", "reports", "handed", "policy", "leader", "fence", "decision",
        ] {
            invocation.key(fleet_key(heartbeat.fleet, part));
        }
        invocation
            .arg(heartbeat.member)
            .arg(heartbeat.policy_hash)
            .arg(millis(heartbeat.member_ttl))
            .arg(millis(heartbeat.leader_ttl))
            .arg(heartbeat.report);
        let reply = this.invoke::<Vec<Value>>(&invocation).await?;
        decode_join(&reply)
    }

    /// One `EVALSHA`: if `member` holds the leader lease with `fence`, replaces the decision
    /// with a new `seq` and records the leader's own grant as handed to it; otherwise writes
    /// nothing.
    pub async fn fleet_publish(&self, publish: &Publish<'_>) -> Result<Published, StoreError> {
        let this = &*self.inner;
        let mut invocation = this.scripts.fleet_publish.prepare_invoke();
        for part in ["leader", "fence", "decision", "handed"] {
            invocation.key(fleet_key(publish.fleet, part));
        }
        // The fence and the epoch are stored and compared as strings, never computed with, so
        // they go unclamped.
        invocation
            .arg(publish.member)
            .arg(publish.fence)
            .arg(publish.limit)
            .arg(publish.window_epoch)
            .arg(millis(publish.member_ttl));
        for (member, grant, overrides) in publish.grants {
            invocation.arg(member).arg(grant).arg(overrides);
        }
        let reply = this.invoke::<Vec<Value>>(&invocation).await?;
        match reply.as_slice() {
            [flag, seq] if number::<u8>(flag, "publish flag")? == 1 => Ok(Published::Applied {
                seq: number(seq, "decision seq")?,
            }),
            [flag] if number::<u8>(flag, "publish flag")? == 0 => Ok(Published::Fenced),
            _ => Err(protocol(format_args!(
                "unexpected fleet_publish reply {reply:?}"
            ))),
        }
    }

    /// One `EVALSHA`: removes `member` (registration, report, handed grant, and the leader
    /// lease if it holds it). A replica calls it at shutdown, after its streams drained.
    pub async fn fleet_leave(&self, fleet: &str, member: &str) -> Result<(), StoreError> {
        let this = &*self.inner;
        let mut invocation = this.scripts.fleet_leave.prepare_invoke();
        for part in ["members", "reports", "handed", "leader"] {
            invocation.key(fleet_key(fleet, part));
        }
        invocation.arg(member);
        this.invoke::<Value>(&invocation).await.map(drop)
    }
}

impl RedisStore {
    /// The settings changed at run time (`HGETALL`; see the module docs).
    pub async fn fleet_settings(
        &self,
        fleet: &str,
    ) -> Result<std::collections::HashMap<String, String>, StoreError> {
        let this = &*self.inner;
        this.command(redis::cmd("HGETALL").arg(fleet_key(fleet, "settings")))
            .await
    }

    /// Replaces one run-time setting whole (`HSET`), or drops it (`HDEL`, for `None`).
    pub async fn fleet_set_setting(
        &self,
        fleet: &str,
        setting: &str,
        value: Option<&str>,
    ) -> Result<(), StoreError> {
        let this = &*self.inner;
        let key = fleet_key(fleet, "settings");
        let command = match value {
            Some(value) => redis::cmd("HSET").arg(key).arg(setting).arg(value).clone(),
            None => redis::cmd("HDEL").arg(key).arg(setting).clone(),
        };
        this.command::<Value>(&command).await.map(drop)
    }
}

/// The fleet's key for `part` (see the module docs).
fn fleet_key(fleet: &str, part: &str) -> String {
    format!("tollgate:fleet:{{{fleet}}}:{part}")
}

/// A duration as script milliseconds, clamped to what a Lua number holds exactly.
fn millis(duration: Duration) -> u64 {
    exact(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
}

/// Decodes `fleet_join.lua`'s reply (its header documents the layout).
fn decode_join(reply: &[Value]) -> Result<Joined, StoreError> {
    match reply {
        [flag, policy] if number::<u8>(flag, "join flag")? == 0 => Ok(Joined::PolicyMismatch {
            fleet_policy: text(policy, "fleet policy")?,
        }),
        [
            flag,
            members,
            leader,
            fence,
            seq,
            limit,
            window_epoch,
            decision_fence,
            grant,
            overrides,
            records @ ..,
        ] if number::<u8>(flag, "join flag")? == 1 => {
            if records.len() % 3 != 0 {
                return Err(protocol(format_args!(
                    "fleet_join: {} values for member records",
                    records.len()
                )));
            }
            let decision = match optional::<u64>(seq, "decision seq")? {
                None => None,
                Some(seq) => Some(Decision {
                    seq,
                    limit: number(limit, "decision limit")?,
                    window_epoch: number(window_epoch, "decision window_epoch")?,
                    fence: number(decision_fence, "decision fence")?,
                }),
            };
            let reports = records
                .chunks_exact(3)
                .map(|record| {
                    Ok(MemberRecord {
                        member: text(&record[0], "member id")?,
                        report: optional_text(&record[1], "member report")?.unwrap_or_default(),
                        handed: optional(&record[2], "handed grant")?,
                    })
                })
                .collect::<Result<_, StoreError>>()?;
            Ok(Joined::Member(View {
                members: number(members, "member count")?,
                leader: optional_text(leader, "leader")?,
                fence: optional(fence, "fence")?,
                decision,
                grant: optional(grant, "grant")?,
                overrides: optional_text(overrides, "overrides")?.unwrap_or_default(),
                reports,
            }))
        }
        _ => Err(protocol(format_args!(
            "unexpected fleet_join reply {reply:?}"
        ))),
    }
}

/// A string from a script: a bulk string (what keys hold) in UTF-8, or `None` for nil.
fn optional_text(value: &Value, what: &str) -> Result<Option<String>, StoreError> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => String::from_utf8(bytes.clone())
            .map(Some)
            .map_err(|_| protocol(format_args!("{what} is not UTF-8"))),
        Value::SimpleString(text) => Ok(Some(text.clone())),
        Value::Int(n) => Ok(Some(n.to_string())),
        other => Err(protocol(format_args!("{what}: unexpected {other:?}"))),
    }
}

fn text(value: &Value, what: &str) -> Result<String, StoreError> {
    optional_text(value, what)?.ok_or_else(|| protocol(format_args!("no {what}")))
}

/// A number from a script, as an integer (one it computed) or a string (one read from a key),
/// or `None` for nil.
fn optional<T: FromStr>(value: &Value, what: &str) -> Result<Option<T>, StoreError> {
    let Some(text) = optional_text(value, what)? else {
        return Ok(None);
    };
    text.parse()
        .map(Some)
        .map_err(|_| protocol(format_args!("{what}: {text:?} is not a valid number")))
}

fn number<T: FromStr>(value: &Value, what: &str) -> Result<T, StoreError> {
    optional(value, what)?.ok_or_else(|| protocol(format_args!("no {what}")))
}
