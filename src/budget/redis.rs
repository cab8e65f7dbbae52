//! The Redis budget store: the contract in `crate::budget`, kept in a Redis every replica of
//! tollgate shares, one Lua script per operation so each is atomic and one round trip.
//!
//! Rust here is thin: it names keys, passes arguments, and decodes the scripts' flat integer
//! replies. All budget arithmetic lives in the scripts (`redis/*.lua`), which mirror
//! `window.rs`, the reference the contract tests hold both stores to.
//!
//! # Key layout
//!
//! Every key of a tenant carries the same hash tag, so every script touches one hash slot and
//! runs unchanged on Redis Cluster:
//!
//! - `tollgate:{<tag>}:w:<window name>`: a HASH per window. One field per nonzero bucket
//!   (field = bucket number `ms / bucket_ms`, value = usage in it) plus `total` (their sum),
//!   `oldest` (the smallest bucket held), `newest` (an upper bound on the largest), `bms`
//!   (the `bucket_ms` the numbers are in) and `exp` (the expiry last set). It expires one bucket
//!   after its newest bucket rolls off, so an idle tenant's windows delete themselves; a charge
//!   moves the expiry only when that changes (a new bucket, or a reload that changed the
//!   window), not on every write. Keys written before `exp` existed get it with their next
//!   charge.
//! - `tollgate:{<tag>}:leases`: a ZSET of lease id → expiry (ms, server time), kept until its
//!   last lease expires plus one to two seconds (`PTTL` read, `PEXPIREAT` about once a second
//!   per busy tenant).
//!
//! `<tag>` is the first 16 bytes of SHA-256 of the tenant id, in hex (32 characters): fixed
//! length, and free of `{` and `}` whatever bytes the tenant id holds (a raw tenant id with a
//! `}` would end the hash tag early and split a tenant across slots).
//!
//! The window name is the key, not its shape: a reload that changes a window's `bucket_ms` keeps
//! its usage (the next script renumbers the buckets by their start time, as `window.rs` keeps
//! buckets by start time), and one that changes `window_ms` or `limit` just applies from then.
//! Across reloads the scripts round a bucket's start to the last bucket size it was stored at,
//! and `usage` (which writes nothing) does not forget buckets it skips as expired; both differ
//! from `window.rs` by at most one bucket, and only after a reload (see `renumber` in
//! `common.lua`).
//!
//! # Scripts
//!
//! Each is `common.lua` (the window arithmetic) followed by its own body, sent with `EVALSHA`
//! (the fleet registry's `fleet_*.lua`, see [`fleet`], keep no windows and go without it).
//! `reserve`, `settle` and `usage` go in batches ([`batch`]): the calls that came while the
//! last batch was out go together as one pipeline, each still its own `EVALSHA`.
//! Redis forgets scripts on restart, failover and `SCRIPT FLUSH`; `NOSCRIPT` is answered by
//! `SCRIPT LOAD` and one retry (redis-rs `ScriptInvocation::invoke_async`), so only that rare
//! call takes three round trips. In a batch, each script the batch needs is loaded (a round trip
//! each, at most three), then the calls so answered go again. Time inside them is Redis `TIME`,
//! so replicas of tollgate never disagree about it. A window's meta and the bucket about to be
//! written are read in one `HMGET` and written back in one `HSET` (only the meta fields that
//! changed), so once a tenant's keys exist a reserve runs `TIME`, an `HMGET` and an `HSET` per
//! window and four lease commands (purge, count, add, `PTTL`), and a settle `TIME`, `ZREM` and
//! an `HMGET` and an `HSET` per window it adjusts: fewer commands to run, and fewer writes to
//! send replicas and the AOF (docs/benchmarks.md, "What Redis runs per decision";
//! `redis_store::a_steady_reserve_and_settle_make_few_calls` holds the counts).
//!
//! - **reserve** (one `EVALSHA`): loads every window, deleting buckets that rolled off on the
//!   way (`oldest` only moves forward, so amortized O(1); a gap longer than the buckets held is
//!   scanned instead of walked, and a window whose newest bucket rolled off is deleted whole);
//!   checks every window in order, then purges expired leases (`ZREMRANGEBYSCORE -inf now`) and
//!   checks concurrency; then adds the cost to now's bucket of every window and `ZADD`s the
//!   lease, or on the first failing limit returns it with the retry time and changes nothing.
//! - **settle** (one `EVALSHA`): `ZREM`s the lease and adjusts each token window's bucket at
//!   `reserved_at_ms` by `actual - reserved` (a refund clamps at zero and skips a bucket that
//!   rolled off; an extra charge goes to now's bucket if the reserved one rolled off), and with
//!   `refund_request` takes 1 back from each request window.
//! - **renew** (one `EVALSHA` per tenant, all in one pipeline: one round trip): re-scores each
//!   lease that is still live to `now + ttl`.
//! - **usage** (one `EVALSHA`): counts live leases and sums live buckets, writing nothing.
//!
//! Replies are flat arrays of integers. Lua numbers are doubles, exact below 2^53, so every
//! number sent is clamped to `2^53 - 1` ([`MAX_EXACT`]); token counts and limits are far below.
//!
//! # Failures
//!
//! Every call is bounded by `RedisSettings::timeout` (`StoreError::Timeout`); connection and
//! I/O errors, and a Redis that cannot serve right now (loading, read-only replica, out of
//! memory, busy script), are `StoreError::Unavailable`; a reply the scripts would never give is
//! `StoreError::Protocol`. Nothing here panics on a bad reply. A call that timed out may still
//! run on the server later (a paused Redis runs its queue when it resumes), but each script is
//! atomic: a reservation is then either taken whole or not at all, and its lease expires by TTL
//! since the request never learned it was granted. A reserve that timed out before its batch
//! went is not sent at all. Likewise a timed-out settle may or may not have applied; settling
//! twice adjusts twice (as in the embedded store), so a caller should not retry one blindly: a
//! lost settle only leaves the reservation charged in full and the lease to expire.
//!
//! **Redis down at start-up**: [`RedisStore::connect`] does not wait for Redis. It fails only
//! for settings that can never work (an unparsable URL); otherwise
//! it returns at once with a store whose connection is made in the background, and calls fail
//! with `Unavailable`/`Timeout` until Redis answers. The connection manager reconnects by itself
//! after any I/O error (backoff 100 ms doubling to at most 1 s), so the store recovers when
//! Redis comes back without the caller doing anything. TCP keepalive and (on Linux)
//! `TCP_USER_TIMEOUT` turn a silently dead peer into an I/O error and so a reconnect, instead of
//! timing out for ever on a half-open connection. A `READONLY`/`MASTERDOWN` answer (connected to
//! a node that was demoted in a failover) drops the connection for a fresh one, at most once a
//! second, because a reconnect through a Service address or DNS name reaches the new primary.
//!
//! **TLS** (`rediss://`) uses redis-rs's rustls support with the ring crypto provider (both in
//! `Cargo.toml`; without a provider redis-rs would panic at the first TLS connection). The
//! server's certificate is checked against the system roots (`SSL_CERT_FILE` / `SSL_CERT_DIR`
//! point elsewhere, e.g. a private CA).

mod batch;
pub mod fleet;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::{
    Client, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError, RedisResult, RedisWrite,
    Script, ScriptInvocation, ServerErrorKind, Value,
};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use self::batch::{Call, ScriptName};

use super::{
    Denied, DeniedLimit, Granted, LeaseRef, Quantity, Reservation, Reserve, Settlement, StoreError,
    Usage, WindowLimit, WindowState,
};

/// The largest integer a Lua number (a double) holds exactly: every number sent to a script is
/// clamped to it.
pub const MAX_EXACT: u64 = (1 << 53) - 1;

/// Each connection attempt gives up after this (redis-rs's default); attempts repeat with
/// backoff in the background, so this bounds no request.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Reconnect backoff: from this, doubling (with jitter)...
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(100);
/// ...to at most this, so a Redis that comes back is found within about a second.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
/// Attempts per reconnect; the next failing call starts another round.
const RECONNECT_ATTEMPTS: usize = 6;
/// A connection to a demoted primary is replaced at most this often.
const MIN_REPLACE_INTERVAL: Duration = Duration::from_secs(1);
/// Idle connections are probed after this, so a dead peer is noticed.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
#[cfg(target_os = "linux")]
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
#[cfg(target_os = "linux")]
const KEEPALIVE_PROBES: u32 = 3;
/// Data unacknowledged this long means the peer is gone (Linux `TCP_USER_TIMEOUT`): the
/// connection fails and is replaced rather than queueing requests behind a half-open socket.
#[cfg(target_os = "linux")]
const USER_TIMEOUT: Duration = Duration::from_secs(10);

const COMMON: &str = include_str!("redis/common.lua");
const RESERVE: &str = include_str!("redis/reserve.lua");
const SETTLE: &str = include_str!("redis/settle.lua");
const RENEW: &str = include_str!("redis/renew.lua");
const USAGE: &str = include_str!("redis/usage.lua");
const FLEET_JOIN: &str = include_str!("redis/fleet_join.lua");
const FLEET_PUBLISH: &str = include_str!("redis/fleet_publish.lua");
const FLEET_LEAVE: &str = include_str!("redis/fleet_leave.lua");

/// How to reach Redis. `Debug` shows neither password (the URL's or the file's).
#[derive(Clone)]
pub struct RedisSettings {
    /// `redis://[user[:password]@]host[:port][/db]`, or `rediss://` for TLS (see
    /// the module docs).
    pub url: String,
    /// Read from a file; overrides the URL's password. A trailing newline (as most secret files
    /// end) is not part of it.
    pub password: Option<String>,
    /// Bound on each call, e.g. 50 ms, from when it is made: with the decision path's calls, the
    /// wait for the batch ahead of it included.
    pub timeout: Duration,
}

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSettings")
            .field("url", &redacted_url(&self.url))
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// `url` with the password of its user info (if any) replaced by `***`, for logs.
pub(crate) fn redacted_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((user_info, host)) if user_info.contains(':') => {
            let user = user_info
                .split_once(':')
                .map_or(user_info, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        _ => url.to_owned(),
    }
}

/// The Redis budget store. Every method takes `&self` and may run concurrently: calls share one
/// multiplexed connection, and the decision path's calls go on it in batches ([`batch`]).
pub struct RedisStore {
    /// Shared with the batch sender, which holds it weakly, so dropping the store ends it.
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    manager_config: ConnectionManagerConfig,
    connection: Mutex<Connection>,
    scripts: Scripts,
    timeout: Duration,
    /// Closed (its sender dropped) once the start-up loading (`warm_up`) has ended: every
    /// script loaded, or given up.
    warmed_up: watch::Receiver<()>,
    /// To the batch sender ([`batch::run`]): `reserve`, `settle` and `usage` go through it.
    calls: mpsc::UnboundedSender<Call>,
    /// Each batch's number of calls (`tollgate_store_batch_calls`).
    batch_calls: metrics::Histogram,
}

/// The current connection manager and how many times it was replaced.
struct Connection {
    generation: u64,
    manager: ConnectionManager,
    replaced_at: Option<Instant>,
}

#[derive(Clone)]
struct Scripts {
    reserve: Script,
    settle: Script,
    renew: Script,
    usage: Script,
    fleet_join: Script,
    fleet_publish: Script,
    fleet_leave: Script,
}

impl Scripts {
    fn new() -> Scripts {
        let script = |body: &str| Script::new(&format!("{COMMON}\n{body}"));
        Scripts {
            reserve: script(RESERVE),
            settle: script(SETTLE),
            renew: script(RENEW),
            usage: script(USAGE),
            // The fleet scripts keep no windows: they go without the prelude.
            fleet_join: Script::new(FLEET_JOIN),
            fleet_publish: Script::new(FLEET_PUBLISH),
            fleet_leave: Script::new(FLEET_LEAVE),
        }
    }

    fn named(&self, name: ScriptName) -> &Script {
        match name {
            ScriptName::Reserve => &self.reserve,
            ScriptName::Settle => &self.settle,
            ScriptName::Usage => &self.usage,
        }
    }

    fn all(&self) -> [&Script; 7] {
        [
            &self.reserve,
            &self.settle,
            &self.renew,
            &self.usage,
            &self.fleet_join,
            &self.fleet_publish,
            &self.fleet_leave,
        ]
    }
}

impl RedisStore {
    /// A store for `settings`, returned without waiting for Redis: the connection (and loading
    /// the scripts) happens in the background, and calls fail with `Unavailable`/`Timeout`
    /// until Redis answers, then succeed without further action. Fails only for settings that
    /// can never work (an unparsable URL); retrying those is pointless.
    pub async fn connect(settings: RedisSettings) -> Result<RedisStore, StoreError> {
        Self::connect_counting_batches(settings, metrics::Histogram::noop()).await
    }

    /// [`RedisStore::connect`], recording each batch's number of calls in `batch_calls`
    /// (`tollgate_store_batch_calls`): the decisions' store does, the fleet's and the settings'
    /// do not.
    pub async fn connect_counting_batches(
        settings: RedisSettings,
        batch_calls: metrics::Histogram,
    ) -> Result<RedisStore, StoreError> {
        let client = client(&settings)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            // Our own timeout bounds each call; this one also frees redis-rs's slot for it.
            .set_response_timeout(Some(settings.timeout))
            .set_min_delay(RECONNECT_MIN_DELAY)
            .set_max_delay(RECONNECT_MAX_DELAY)
            .set_number_of_retries(RECONNECT_ATTEMPTS);
        let manager =
            ConnectionManager::new_lazy_with_config(client.clone(), manager_config.clone())
                .map_err(|e| {
                    StoreError::Unavailable(format!("cannot set up the Redis client: {e}"))
                })?;
        let scripts = Scripts::new();
        let warmed_up = warm_up(manager.clone(), scripts.clone());
        let (calls, waiting) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            client,
            manager_config,
            connection: Mutex::new(Connection {
                generation: 0,
                manager,
                replaced_at: None,
            }),
            scripts,
            timeout: settings.timeout,
            warmed_up,
            calls,
            batch_calls,
        });
        tokio::spawn(batch::run(waiting, Arc::downgrade(&inner)));
        Ok(RedisStore { inner })
    }

    /// Resolves once the start-up's background loading of the scripts has ended: every script
    /// loaded, or given up at the first failure (Redis unreachable; a call then loads the
    /// script it finds missing). When they all loaded, none of its commands can reach Redis
    /// any more: for whoever counts Redis's commands, as the store's tests do.
    pub async fn warmed_up(&self) {
        // Nothing is ever sent: `changed` answers only when the task ends and drops the sender.
        let _ = self.inner.warmed_up.clone().changed().await;
    }

    /// One `EVALSHA` of `reserve.lua`, sent in a batch.
    pub async fn reserve(&self, r: &Reservation<'_>) -> Result<Reserve, StoreError> {
        let this = &*self.inner;
        let keys = TenantKeys::of(r.tenant);
        let mut command = evalsha(&this.scripts.reserve, &keys, r.windows, 3, 4);
        command
            .arg(r.lease_id)
            .arg(exact(r.lease_ttl_ms))
            .arg(r.max_concurrent.map_or(-1, i64::from));
        for limit in r.windows {
            let cost = match limit.quantity {
                Quantity::Tokens => r.tokens,
                Quantity::Requests => 1,
            };
            command
                .arg(exact(cost))
                .arg(exact(limit.window_ms))
                .arg(exact(limit.bucket_ms))
                .arg(exact(limit.limit));
        }
        let reply = this
            .batched::<Vec<i64>>(ScriptName::Reserve, command)
            .await?;
        decode_reserve(&reply, r.windows, r.max_concurrent)
    }

    /// One `EVALSHA` of `settle.lua`, sent in a batch.
    pub async fn settle(&self, s: &Settlement<'_>) -> Result<(), StoreError> {
        let this = &*self.inner;
        let keys = TenantKeys::of(s.tenant);
        let mut command = evalsha(&this.scripts.settle, &keys, s.windows, 5, 3);
        command
            .arg(s.lease_id)
            .arg(exact(s.reserved_at_ms))
            .arg(exact(s.reserved_tokens))
            .arg(exact(s.actual_tokens))
            .arg(if s.refund_request { "1" } else { "0" });
        for limit in s.windows {
            let quantity = match limit.quantity {
                Quantity::Tokens => "t",
                Quantity::Requests => "r",
            };
            command
                .arg(quantity)
                .arg(exact(limit.window_ms))
                .arg(exact(limit.bucket_ms));
        }
        this.batched::<Value>(ScriptName::Settle, command)
            .await
            .map(drop)
    }

    /// One `EVALSHA` of `renew.lua` per tenant, all in one pipeline (one round trip; a
    /// `NOSCRIPT` reloads and resends it, which is harmless as renewing twice is renewing once).
    pub async fn renew(
        &self,
        leases: &[LeaseRef<'_>],
        lease_ttl_ms: u64,
    ) -> Result<(), StoreError> {
        let mut by_tenant: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for lease in leases {
            by_tenant
                .entry(lease.tenant)
                .or_default()
                .push(lease.lease_id);
        }
        if by_tenant.is_empty() {
            return Ok(());
        }
        let this = &*self.inner;
        let script = &this.scripts.renew;
        let mut pipe = redis::pipe();
        for (tenant, ids) in &by_tenant {
            pipe.cmd("EVALSHA")
                .arg(script.get_hash())
                .arg(1)
                .arg(TenantKeys::of(tenant).leases())
                .arg(exact(lease_ttl_ms))
                .arg(ids);
        }
        let (generation, mut connection) = this.connection();
        let reply = tokio::time::timeout(this.timeout, async {
            match pipe.query_async::<Vec<i64>>(&mut connection).await {
                Err(e) if is_noscript(&e) => {
                    script.load_async(&mut connection).await?;
                    pipe.query_async::<Vec<i64>>(&mut connection).await
                }
                other => other,
            }
        })
        .await;
        let reply = this.answer(generation, reply)?;
        if reply.len() != by_tenant.len() {
            return Err(StoreError::Protocol(format!(
                "renew: {} replies for {} tenants",
                reply.len(),
                by_tenant.len()
            )));
        }
        Ok(())
    }

    /// One `EVALSHA` of `usage.lua`, which writes nothing, sent in a batch.
    pub async fn usage(&self, tenant: &str, windows: &[WindowLimit]) -> Result<Usage, StoreError> {
        let this = &*self.inner;
        let keys = TenantKeys::of(tenant);
        let mut command = evalsha(&this.scripts.usage, &keys, windows, 0, 2);
        for limit in windows {
            command
                .arg(exact(limit.window_ms))
                .arg(exact(limit.bucket_ms));
        }
        let reply = this.batched::<Vec<i64>>(ScriptName::Usage, command).await?;
        decode_usage(&reply, windows)
    }
}

impl Inner {
    /// `command` sent in the next batch ([`batch`]), its reply read as `T`; bounded by the
    /// store's timeout from now, the wait for the batch ahead of it included.
    async fn batched<T: FromRedisValue>(
        &self,
        script: ScriptName,
        command: redis::Cmd,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let call = Call {
            script,
            command,
            reply,
        };
        let stopped = || StoreError::Unavailable("the Redis store's batch sender stopped".into());
        self.calls.send(call).map_err(|_| stopped())?;
        let value = match tokio::time::timeout(self.timeout, answer).await {
            Err(_) => return Err(StoreError::Timeout(self.timeout)),
            Ok(Err(_)) => return Err(stopped()),
            Ok(Ok(value)) => value?,
        };
        T::from_redis_value(value).map_err(|e| store_error(&e.into(), self.timeout))
    }

    /// One `EVALSHA` of `invocation` (with redis-rs's one `SCRIPT LOAD` and retry on
    /// `NOSCRIPT`), bounded by the store's timeout, its outcome mapped by `answer`.
    async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let (generation, mut connection) = self.connection();
        let reply =
            tokio::time::timeout(self.timeout, invocation.invoke_async::<T>(&mut connection)).await;
        self.answer(generation, reply)
    }

    /// One plain command, bounded and mapped like `invoke`.
    async fn command<T: FromRedisValue>(&self, command: &redis::Cmd) -> Result<T, StoreError> {
        let (generation, mut connection) = self.connection();
        let reply =
            tokio::time::timeout(self.timeout, command.query_async::<T>(&mut connection)).await;
        self.answer(generation, reply)
    }

    /// The current connection manager (a cheap clone of a shared handle) and its generation.
    fn connection(&self) -> (u64, ConnectionManager) {
        let connection = self
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (connection.generation, connection.manager.clone())
    }

    /// Maps a call's outcome to the store's, replacing the connection when it reached a node
    /// that can no longer take writes.
    fn answer<T>(
        &self,
        generation: u64,
        outcome: Result<RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, StoreError> {
        match outcome {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                if matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                ) {
                    self.replace_connection(generation);
                }
                Err(store_error(&e, self.timeout))
            }
        }
    }

    /// Swaps in a fresh connection manager (connecting lazily) unless another call already
    /// replaced `generation`, or one was replaced within the last `MIN_REPLACE_INTERVAL`.
    fn replace_connection(&self, generation: u64) {
        let mut connection = self
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if connection.generation != generation
            || connection
                .replaced_at
                .is_some_and(|at| at.elapsed() < MIN_REPLACE_INTERVAL)
        {
            return;
        }
        match ConnectionManager::new_lazy_with_config(
            self.client.clone(),
            self.manager_config.clone(),
        ) {
            Ok(manager) => {
                tracing::warn!("Redis refused a write (read-only or demoted node): reconnecting");
                connection.manager = manager;
                connection.generation += 1;
                connection.replaced_at = Some(Instant::now());
            }
            Err(e) => tracing::warn!(error = %e, "cannot replace the Redis connection"),
        }
    }
}

/// The redis-rs client for `settings`: URL, password override, TCP options.
fn client(settings: &RedisSettings) -> Result<Client, StoreError> {
    let url = settings.url.trim();
    // redis-rs's parse errors never echo the URL, which may hold a password.
    let mut info = url
        .into_connection_info()
        .map_err(|e| StoreError::Unavailable(format!("invalid Redis URL: {e}")))?;
    if let Some(password) = &settings.password {
        let password = password.trim_end_matches(['\n', '\r']);
        let redis_settings = info.redis_settings().clone().set_password(password);
        info = info.set_redis_settings(redis_settings);
    }
    let info = info.set_tcp_settings(tcp_settings());
    Client::open(info).map_err(|e| StoreError::Unavailable(format!("invalid Redis settings: {e}")))
}

fn tcp_settings() -> TcpSettings {
    let keepalive = redis::io::tcp::socket2::TcpKeepalive::new().with_time(KEEPALIVE_IDLE);
    #[cfg(target_os = "linux")]
    let keepalive = keepalive
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    // Requests are small and latency-bound: send each at once.
    let settings = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    #[cfg(target_os = "linux")]
    let settings = settings.set_user_timeout(USER_TIMEOUT);
    settings
}

/// Connects and loads the scripts in the background, so the first requests find both ready
/// (instead of paying a connection and a `NOSCRIPT` round within their timeout). Its failure
/// is only logged: calls report their own. The receiver is closed when it has ended.
fn warm_up(mut manager: ConnectionManager, scripts: Scripts) -> watch::Receiver<()> {
    let (running, warmed_up) = watch::channel(());
    tokio::spawn(async move {
        // Held until the task ends, however it ends.
        let _running = running;
        for script in scripts.all() {
            if let Err(e) = script.load_async(&mut manager).await {
                tracing::warn!(
                    error = %e,
                    "Redis is not reachable yet: budget calls fail until it is (reconnecting in \
                     the background)"
                );
                return;
            }
        }
        tracing::debug!("Redis budget scripts loaded");
    });
    warmed_up
}

/// The hash tag shared by every key of `tenant`: 32 hex characters of SHA-256, so any tenant id
/// (with `{`, `}` or any bytes) maps to a tag of fixed length and safe characters.
pub(crate) fn tenant_tag(tenant: &str) -> String {
    let digest = Sha256::digest(tenant.as_bytes());
    hex::encode(&digest[..16])
}

/// The keys of one tenant, from its tag hashed once: a call names the leases key and every
/// window's, and a SHA-256 per key was a measurable part of a call's client-side CPU.
pub(crate) struct TenantKeys {
    tag: String,
}

impl TenantKeys {
    pub(crate) fn of(tenant: &str) -> TenantKeys {
        TenantKeys {
            tag: tenant_tag(tenant),
        }
    }

    /// The tenant's lease ZSET.
    pub(crate) fn leases(&self) -> String {
        self.leases_key().to_string()
    }

    /// The tenant's HASH for the window named `name`.
    #[cfg(test)]
    pub(crate) fn window(&self, name: &str) -> String {
        self.window_key(name).to_string()
    }

    fn leases_key(&self) -> TenantKey<'_> {
        TenantKey {
            tag: &self.tag,
            window: None,
        }
    }

    fn window_key<'a>(&'a self, name: &'a str) -> TenantKey<'a> {
        TenantKey {
            tag: &self.tag,
            window: Some(name),
        }
    }
}

/// One of a tenant's keys, written where it goes rather than made a string of its own first:
/// its leases (no `window`) or a window's.
struct TenantKey<'a> {
    tag: &'a str,
    window: Option<&'a str>,
}

impl std::fmt::Display for TenantKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.window {
            None => write!(f, "tollgate:{{{}}}:leases", self.tag),
            Some(name) => write!(f, "tollgate:{{{}}}:w:{name}", self.tag),
        }
    }
}

/// The bytes `evalsha` sets aside for the key count and each argument after the keys. A number
/// takes at most 16 (`MAX_EXACT`'s digits) and most far fewer, so the total leaves room for a
/// lease id (the replica's id, `-` and a serial number) longer than this; past it, the buffer
/// grows once.
const VALUE_ARG_BYTES: usize = 24;

/// `EVALSHA` of a window script with the keys every one of them takes (`KEYS[1]` the tenant's
/// leases, then one per window, in order); its arguments to follow, `per_call` of them and
/// `per_window` for each window.
///
/// Sized for the whole command up front, the keys written straight into it: grown argument by
/// argument, each call's two buffers were moved about nine times and each key was a string of
/// its own first (docs/benchmarks.md, "Commands built at their size").
fn evalsha(
    script: &Script,
    keys: &TenantKeys,
    windows: &[WindowLimit],
    per_call: usize,
    per_window: usize,
) -> redis::Cmd {
    let window_key_bytes = |name_len: usize| "tollgate:{}:w:".len() + keys.tag.len() + name_len;
    let values = per_call + per_window * windows.len();
    let bytes = "EVALSHA".len()
        + script.get_hash().len()
        + VALUE_ARG_BYTES
        + "tollgate:{}:leases".len()
        + keys.tag.len()
        + windows
            .iter()
            .map(|w| window_key_bytes(w.name.len()))
            .sum::<usize>()
        + values * VALUE_ARG_BYTES;
    let mut command = redis::Cmd::with_capacity(4 + windows.len() + values, bytes);
    command
        .arg("EVALSHA")
        .arg(script.get_hash())
        .arg(1 + windows.len());
    command.write_arg_fmt(keys.leases_key());
    for limit in windows {
        command.write_arg_fmt(keys.window_key(&limit.name));
    }
    command
}

/// `value` as a script argument: clamped to what a Lua number holds exactly.
pub(crate) fn exact(value: u64) -> u64 {
    value.min(MAX_EXACT)
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// A redis-rs error as the store reports it: I/O and a server that cannot serve now are
/// `Unavailable`; a reply or script error these scripts should never cause is `Protocol`.
pub(crate) fn store_error(e: &RedisError, timeout: Duration) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout(timeout);
    }
    let protocol = match e.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => true,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::ResponseError
                | ServerErrorKind::ExecAbort
                | ServerErrorKind::NoScript
                | ServerErrorKind::CrossSlot
        ),
        // A foreign value under one of our keys.
        ErrorKind::Extension => e.code() == Some("WRONGTYPE"),
        _ => false,
    };
    if protocol {
        StoreError::Protocol(e.to_string())
    } else {
        StoreError::Unavailable(e.to_string())
    }
}

fn protocol(what: impl std::fmt::Display) -> StoreError {
    StoreError::Protocol(what.to_string())
}

/// A count, time or index from a script: never negative.
fn unsigned(value: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| protocol(format_args!("negative {what}: {value}")))
}

/// `-1` for "none", else a non-negative value.
fn optional(value: i64, what: &str) -> Result<Option<u64>, StoreError> {
    if value == -1 {
        Ok(None)
    } else {
        unsigned(value, what).map(Some)
    }
}

/// The `(used, reset_ms)` pairs that end every reply, one per window.
fn window_states(pairs: &[i64], windows: &[WindowLimit]) -> Result<Vec<WindowState>, StoreError> {
    if pairs.len() != 2 * windows.len() {
        return Err(protocol(format_args!(
            "{} window values for {} windows",
            pairs.len(),
            windows.len()
        )));
    }
    pairs
        .chunks_exact(2)
        .zip(windows)
        .map(|(pair, limit)| {
            Ok(WindowState {
                used: unsigned(pair[0], "window usage")?,
                limit: limit.limit,
                reset_ms: unsigned(pair[1], "window reset")?,
            })
        })
        .collect()
}

/// Decodes `reserve.lua`'s reply (its header documents the layout).
pub(crate) fn decode_reserve(
    reply: &[i64],
    windows: &[WindowLimit],
    max_concurrent: Option<u32>,
) -> Result<Reserve, StoreError> {
    match reply {
        [1, at_ms, live, rest @ ..] => {
            let concurrent = match (max_concurrent, optional(*live, "lease count")?) {
                (None, _) => None,
                (Some(_), Some(live)) => Some(u32::try_from(live).unwrap_or(u32::MAX)),
                (Some(_), None) => return Err(protocol("no lease count for a concurrency limit")),
            };
            Ok(Reserve::Granted(Granted {
                at_ms: unsigned(*at_ms, "time")?,
                windows: window_states(rest, windows)?,
                concurrent,
            }))
        }
        [0, _at_ms, which, used, allowed, requested, retry, rest @ ..] => {
            let limit = match usize::try_from(*which) {
                Ok(0) if max_concurrent.is_some() => DeniedLimit::Concurrency,
                Ok(i) if (1..=windows.len()).contains(&i) => DeniedLimit::Window(i - 1),
                _ => return Err(protocol(format_args!("denied by unknown limit {which}"))),
            };
            Ok(Reserve::Denied(Denied {
                limit,
                used: unsigned(*used, "usage")?,
                allowed: unsigned(*allowed, "limit")?,
                requested: unsigned(*requested, "cost")?,
                retry_after_ms: optional(*retry, "retry after")?,
                windows: window_states(rest, windows)?,
            }))
        }
        _ => Err(protocol(format_args!("unexpected reserve reply {reply:?}"))),
    }
}

/// Decodes `usage.lua`'s reply: live leases, then `(used, reset_ms)` per window.
pub(crate) fn decode_usage(reply: &[i64], windows: &[WindowLimit]) -> Result<Usage, StoreError> {
    let [leases, rest @ ..] = reply else {
        return Err(protocol("empty usage reply"));
    };
    let leases = unsigned(*leases, "lease count")?;
    Ok(Usage {
        windows: window_states(rest, windows)?,
        leases: u32::try_from(leases).unwrap_or(u32::MAX),
    })
}

#[cfg(test)]
mod tests;
