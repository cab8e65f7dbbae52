//! tollgate: fair, fast admission control for shared LLM inference, as an Envoy ext_proc
//! service.
//!
//! `run` is the whole server: the binary only parses its command line and calls it, and the
//! tests and examples drive it the same way on port 0. See ARCHITECTURE.md for the map.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms, clippy::disallowed_methods, clippy::disallowed_types)]

pub mod admin;
pub mod admission;
#[cfg(test)]
mod architecture;
pub mod budget;
pub mod config;
pub mod control;
pub mod extproc;
pub mod fleet;
pub mod lifecycle;
pub mod live;
pub mod observe;
pub mod pipeline;
pub mod policy;
pub mod reply;
pub mod request;
pub mod scheduler;
pub mod tokens;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;

use crate::config::Config;
use crate::control::window::LatencyWindow;
use crate::extproc::{ExtProcService, OpenStreams, Shared};
use crate::lifecycle::Lifecycle;
use crate::observe::Metrics;
use crate::policy::Policy;
use crate::scheduler::Scheduler;

/// The sockets `run` serves on, bound by the caller (so tests can bind port 0 and read the
/// port before the server starts).
pub struct Listeners {
    /// ext_proc gRPC and grpc.health.v1.
    pub grpc: TcpListener,
    /// /metrics, /healthz, /readyz.
    pub admin: TcpListener,
}

/// How a running server reads its configuration again (SIGHUP, or the file changed).
pub struct Reload {
    /// The `--config` file, whose content is compared every `reload.watch_ms` (None: only
    /// SIGHUP reloads).
    pub file: Option<std::path::PathBuf>,
    /// Reads the whole configuration as at start-up: defaults, file, environment and flags.
    pub load: Arc<dyn Fn() -> Result<Config, config::ConfigError> + Send + Sync>,
    /// SIGHUP, watched from as early as the caller could (until a handler is installed, the
    /// signal would end the process); None: `serve` installs it.
    #[cfg(unix)]
    pub hangups: Option<tokio::signal::unix::Signal>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration:\n{0}")]
    Config(#[from] config::ConfigError),
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("admin server failed: {0}")]
    Admin(#[from] std::io::Error),
    #[error("budget store: {0}")]
    Store(#[from] budget::StoreError),
}

/// How long the gRPC server may take to wind down once every stream was told to end.
const GRPC_CLOSE_GRACE: Duration = Duration::from_secs(5);
/// How often histogram samples are folded into buckets between scrapes.
const METRICS_UPKEEP_PERIOD: Duration = Duration::from_secs(5);
/// Sub-windows of the TTFT window: expiry granularity is window / slots.
const TTFT_WINDOW_SLOTS: u32 = 30;
/// How long shutdown waits for the fleet task to leave the fleet (one Redis call).
const FLEET_LEAVE_GRACE: Duration = Duration::from_secs(2);

/// This replica's id in its fleet: `fleet.member_id`, or the host name (a pod's name) with the
/// process id and a random suffix, so a restarted pod is never mistaken for its previous life.
fn fleet_member_id(fleet: &config::FleetConfig) -> String {
    use std::hash::{BuildHasher, Hasher};
    if !fleet.member_id.is_empty() {
        return fleet.member_id.clone();
    }
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tollgate".to_owned());
    // RandomState is seeded from the OS's randomness per process.
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{host}-{}-{:08x}", std::process::id(), random as u32)
}

/// How to reach the Redis `store.redis_url` names (its password read from
/// `store.redis_password_file`), each call bounded by `store.timeout_ms`; None without one.
async fn redis_settings(
    config: &config::StoreConfig,
) -> Result<Option<budget::redis::RedisSettings>, Error> {
    let Some(url) = &config.redis_url else {
        return Ok(None);
    };
    let password = match &config.redis_password_file {
        None => None,
        Some(path) => Some(
            tokio::fs::read_to_string(path)
                .await
                .map_err(|e| {
                    config::ConfigError(format!(
                        "store.redis_password_file: cannot read {path}: {e}"
                    ))
                })?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
        ),
    };
    Ok(Some(budget::redis::RedisSettings {
        url: url.clone(),
        password,
        timeout: Duration::from_millis(config.timeout_ms),
    }))
}

/// Runs tollgate on TCP listeners until `shutdown` resolves; see `serve`.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
    reload: Option<Reload>,
) -> Result<(), Error> {
    // `Server::tcp_nodelay` applies only to listeners tonic binds itself; a listener handed in
    // keeps Nagle's algorithm unless each accepted connection is set here. With Nagle on, a small
    // answer written after a small message can wait for the peer's delayed ACK (up to 40 ms on
    // Linux), which is what an admission decision would then cost.
    let grpc_incoming = TcpIncoming::from(listeners.grpc).with_nodelay(Some(true));
    serve(config, grpc_incoming, listeners.admin, shutdown, reload).await
}

/// Runs tollgate with gRPC connections from `grpc_incoming` (TCP in production; an in-memory
/// transport in tests that pause time) until `shutdown` resolves, then drains:
/// 1. health and /readyz turn NOT_SERVING; the gRPC listener stops accepting and sends GOAWAY;
/// 2. streams already open carry on until they end or `shutdown.drain_deadline_ms` passes;
/// 3. then every stream still open ends deliberately: undecided ones with an error status (so
///    Envoy answers its `status_on_error`, never a silent pass), decided ones with OK (so Envoy
///    finishes the response without tollgate);
/// 4. returns `Ok(())`.
pub async fn serve<I, IO, IE>(
    config: Config,
    grpc_incoming: I,
    admin_listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    reload: Option<Reload>,
) -> Result<(), Error>
where
    I: tokio_stream::Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    // Off the async workers: a model's own tokenizer takes about a second to build.
    let checked = config.clone();
    let policy = tokio::task::spawn_blocking(move || Policy::from_config(&checked))
        .await
        .unwrap_or_else(|panicked| std::panic::resume_unwind(panicked.into_panic()))?;
    let policy = Arc::new(policy);
    for warning in policy.warnings() {
        tracing::warn!(%warning, "configuration has no effect");
    }
    for loaded in &policy.counting.tokenizers {
        tracing::info!(tokenizer = %loaded, "loaded a model's own tokenizer");
    }
    // Build the BPE tables now, off the async workers, so no request pays for them.
    let encodings = [tokens::Encoding::Cl100kBase, tokens::Encoding::O200kBase];
    let _ = tokio::task::spawn_blocking(move || encodings.iter().for_each(|e| e.warm_up())).await;

    let metrics = Metrics::new(&policy);
    let worker_threads = tokio::runtime::Handle::current().metrics().num_workers();
    metrics.runtime_worker_threads(worker_threads);
    let (lifecycle_tx, lifecycle) = watch::channel(Lifecycle::Serving);
    let scheduler = Scheduler::new(
        policy.scheduling.initial_limit,
        policy.scheduling.max_queued_body_bytes,
        policy.scheduling.headroom,
    );
    metrics.scheduler_load(scheduler.load());
    let ttft_window = Arc::new(Mutex::new(LatencyWindow::new(
        Duration::from_millis(policy.control.window_ms),
        TTFT_WINDOW_SLOTS,
    )));
    // The budget store: Redis if `store.redis_url` is set (connected lazily, so tollgate starts
    // and serves in its fail modes while Redis is still down), else the embedded one.
    let redis = redis_settings(&policy.store).await?;
    let store = match &redis {
        Some(settings) => budget::Store::Redis(Box::new(
            budget::redis::RedisStore::connect_counting_batches(
                settings.clone(),
                metrics.store_batch_calls(),
            )
            .await?,
        )),
        None => budget::Store::Memory(budget::memory::MemoryStore::new()),
    };
    // With a shared store, replicas share one budget: this one admits nothing until the fleet
    // grants it a share (its first sync, at once), and the fleet's task runs the controller.
    // The fleet has a connection of its own, so its syncs never queue behind requests'
    // decisions (nor theirs behind a leader's larger reads), bounded by a sync period rather
    // than the decisions' tight timeout.
    let redis_for_settings = redis.map(|settings| budget::redis::RedisSettings {
        timeout: Duration::from_millis(policy.fleet.sync_ms.max(policy.store.timeout_ms)),
        ..settings
    });
    let fleet = match &redis_for_settings {
        // Its calls go one at a time, not in batches: no batch is counted.
        Some(settings) => Some(budget::redis::RedisStore::connect(settings.clone()).await?),
        None => None,
    };
    // Run-time settings are shared through Redis on a connection of their own, read each sync.
    let settings_store = match &redis_for_settings {
        // Its batches (the admin API's usage reads) are left out of the decisions' count.
        Some(settings) => Some((
            budget::redis::RedisStore::connect(settings.clone()).await?,
            policy.fleet.name.clone(),
        )),
        None => None,
    };
    let live = live::Live::new(policy.clone(), settings_store, metrics.clone());
    let admin_token = admin::read_token(&policy.source.admin).await?;
    let (budget_ready_tx, budget_ready) = watch::channel(fleet.is_none());
    if fleet.is_some() {
        scheduler.set_share(0, policy.scheduling.initial_limit, None, 0);
    } else {
        metrics.fleet(
            observe::FleetStanding::Alone,
            1,
            policy.scheduling.initial_limit,
            false,
        );
    }
    tracing::info!(store = store.kind(), "budget store");
    let ledger = budget::ledger::Ledger::new(store, policy.store.clone(), metrics.clone());
    let renewer = tokio::spawn(ledger.clone().renew_leases());
    let shared = Arc::new(Shared {
        pipeline: pipeline::Pipeline {
            rules: live.subscribe_rules(),
            metrics: metrics.clone(),
            scheduler: scheduler.clone(),
            ledger,
            ttft_window: ttft_window.clone(),
            reports: Arc::new(pipeline::Reports::new(budget::ledger::replica_id())),
            large_body_threads: Arc::new(tokio::sync::Semaphore::new(
                pipeline::large_body_permits(config.tokens.large_body_threads, worker_threads),
            )),
        },
        lifecycle: lifecycle.clone(),
        open_streams: OpenStreams::default(),
    });
    let drained = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fleet_task = fleet.map(|store| {
        let member_id = fleet_member_id(&policy.fleet);
        tracing::info!(fleet = %policy.fleet.name, member = %member_id, policy_hash = %policy.hash, "fleet: sharing the in-flight budget through Redis");
        tokio::spawn(
            fleet::Fleet {
                policy: live.subscribe(),
                store,
                member_id,
                scheduler: scheduler.clone(),
                ttft_window: ttft_window.clone(),
                metrics: metrics.clone(),
                lifecycle: lifecycle.clone(),
                budget_ready: budget_ready_tx,
                drained: drained.clone(),
            }
            .run(),
        )
    });
    let tick_settings = |policy: &Policy| control::tick::TickSettings {
        control: policy.control.clone(),
        static_limit: policy.scheduling.initial_limit,
    };
    // Alone, this replica's own controller task owns the limit (the fleet's task does
    // otherwise); it runs whether or not the controller is on, since either may change live.
    let tick_tx = fleet_task.is_none().then(|| {
        let (tx, rx) = watch::channel(tick_settings(&policy));
        tokio::spawn(control::tick::run(
            rx,
            scheduler.clone(),
            ttft_window.clone(),
            metrics.clone(),
            lifecycle.clone(),
        ));
        tx
    });
    if policy.control.enabled && fleet_task.is_none() {
        let control = &policy.control;
        let aimd = control::AimdConfig::from(control);
        // Says which target drives the budget: with the upstream signal, a tuned
        // `target_p99_ttft_ms` is the SLO the dashboards and alerts use, not the controller's.
        tracing::info!(
            signal = ?control.signal,
            target_p99_ms = aimd.target_p99_ttft_seconds * 1000.0,
            slo_p99_ttft_ms = control.target_p99_ttft_ms,
            engine_metrics_urls = ?control.engine.metrics_urls,
            "controller"
        );
    }
    // Hands a replaced policy to what read the old one at start-up.
    let follower = {
        let mut policies = live.subscribe();
        let scheduler = scheduler.clone();
        tokio::spawn(async move {
            while policies.changed().await.is_ok() {
                let policy = policies.borrow_and_update().clone();
                scheduler.set_max_queued_body_bytes(policy.scheduling.max_queued_body_bytes);
                if let Some(tx) = &tick_tx {
                    let next = tick_settings(&policy);
                    tx.send_if_modified(|settings| {
                        let changed = *settings != next;
                        *settings = next;
                        changed
                    });
                }
            }
        })
    };
    let settings_follower = tokio::spawn(live.clone().follow_shared_settings(
        Duration::from_millis(policy.fleet.sync_ms),
        lifecycle.clone(),
    ));
    if let Some(reload) = reload {
        spawn_reloaders(&live, reload, policy.source.reload.watch_ms, &lifecycle);
    }

    let upkeep = {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(METRICS_UPKEEP_PERIOD);
            loop {
                tick.tick().await;
                metrics.run_upkeep();
            }
        })
    };

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<ExtProcService>().await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    // Envoy sends the whole buffered body in one message; tonic's default 4 MiB cap would
    // reject large prompts before tollgate could answer them with a proper 413.
    let max_message = policy.counting.max_body_bytes + 64 * 1024;
    let ext_proc = ExtProcService::new(shared.clone(), max_message);
    let access_log = extproc::AccessLogReports::server(shared.clone(), max_message);
    let grpc_stopping = {
        let mut lifecycle = lifecycle.clone();
        async move {
            let _ = lifecycle.wait_for(|s| *s != Lifecycle::Serving).await;
        }
    };
    let grpc_server = tonic::transport::Server::builder()
        // No `.tcp_nodelay(..)`: tonic ignores it for `serve_with_incoming`; `run` sets it.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .http2_adaptive_window(Some(true))
        .add_service(health_service)
        .add_service(ext_proc)
        .add_service(access_log)
        .serve_with_incoming_shutdown(grpc_incoming, grpc_stopping);
    let mut grpc_server = tokio::spawn(grpc_server);

    let admin_stopping = {
        let mut lifecycle = lifecycle.clone();
        async move {
            let _ = lifecycle.wait_for(|s| *s == Lifecycle::Closing).await;
        }
    };
    let admin_server = axum::serve(
        admin_listener,
        admin::router(admin::AdminState {
            metrics: metrics.clone(),
            scheduler: scheduler.clone(),
            lifecycle,
            budget_ready,
            live: live.clone(),
            ledger: shared.pipeline.ledger.clone(),
            token: admin_token,
        }),
    )
    .with_graceful_shutdown(admin_stopping);
    let admin_server = tokio::spawn(async move { admin_server.await });

    tracing::info!(worker_threads, "tollgate serving");
    tokio::select! {
        _ = shutdown => {}
        result = &mut grpc_server => {
            // The server ended on its own: nothing to drain.
            let _ = lifecycle_tx.send(Lifecycle::Closing);
            upkeep.abort();
            renewer.abort();
            follower.abort();
            settings_follower.abort();
            return match result {
                Ok(inner) => inner.map_err(Error::from),
                Err(join_error) => Err(Error::Admin(std::io::Error::other(join_error))),
            };
        }
    }

    let open = shared.open_streams.count();
    tracing::info!(open, "shutdown: draining");
    let _ = lifecycle_tx.send(Lifecycle::Draining);
    health.set_not_serving::<ExtProcService>().await;
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    // The policy in force now: a reload may have changed the drain deadline.
    let deadline = Duration::from_millis(live.current().source.shutdown.drain_deadline_ms);
    if tokio::time::timeout(deadline, shared.open_streams.all_closed())
        .await
        .is_err()
    {
        tracing::warn!(
            open = shared.open_streams.count(),
            "shutdown: drain deadline passed; ending the remaining streams"
        );
    } else {
        // Nothing of ours is in flight upstream any more: the fleet may hand our share on.
        drained.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    let _ = lifecycle_tx.send(Lifecycle::Closing);
    let grpc_result = match tokio::time::timeout(GRPC_CLOSE_GRACE, &mut grpc_server).await {
        Ok(Ok(result)) => result.map_err(Error::from),
        Ok(Err(join_error)) => Err(Error::Admin(std::io::Error::other(join_error))),
        Err(_) => {
            // Envoy kept connections open past GOAWAY; every stream is answered already.
            grpc_server.abort();
            Ok(())
        }
    };
    upkeep.abort();
    renewer.abort();
    follower.abort();
    settings_follower.abort();
    if let Some(task) = fleet_task {
        // It leaves the fleet once Closing is reached; bounded, since Redis may be down.
        let _ = tokio::time::timeout(FLEET_LEAVE_GRACE, task).await;
    }
    let admin_result = match admin_server.await {
        Ok(result) => result.map_err(Error::from),
        Err(join_error) => Err(Error::Admin(std::io::Error::other(join_error))),
    };
    tracing::info!("shutdown: done");
    grpc_result.and(admin_result)
}

/// Reloads on SIGHUP, and whenever the configuration file's content changes (every
/// `watch_ms`; 0: SIGHUP only), until the server closes.
fn spawn_reloaders(
    live: &Arc<live::Live>,
    reload: Reload,
    watch_ms: u64,
    lifecycle: &watch::Receiver<Lifecycle>,
) {
    if let (Some(file), true) = (&reload.file, watch_ms > 0) {
        tokio::spawn(live.clone().watch_file(
            file.clone(),
            Duration::from_millis(watch_ms),
            reload.load.clone(),
            lifecycle.clone(),
        ));
    }
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = match reload
            .hangups
            .map_or_else(|| signal(SignalKind::hangup()), Ok)
        {
            Ok(hangups) => hangups,
            Err(e) => {
                tracing::warn!(
                    "cannot watch SIGHUP ({e}); the configuration reloads only when its file changes"
                );
                return;
            }
        };
        let live = live.clone();
        let mut lifecycle = lifecycle.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    hangup = hangups.recv() => if hangup.is_none() { return },
                    () = lifecycle::reached(&mut lifecycle, Lifecycle::Closing) => return,
                }
                if let Some(content) = match &reload.file {
                    Some(file) => tokio::fs::read(file).await.ok(),
                    None => None,
                } {
                    live.note_file_read(content);
                }
                let load = reload.load.clone();
                let _ = live.reload(move || load(), "SIGHUP").await;
            }
        });
    }
}
