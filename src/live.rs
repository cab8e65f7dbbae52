//! Operating tollgate live: the policy in force, replaced without a restart by a reload of the
//! configuration or by a setting changed through the admin API.
//!
//! # What a change replaces
//!
//! `Live` publishes the effective policy on a `watch` channel: the last valid configuration
//! file's policy with the run-time settings (`Settings`) in place. Each request takes the
//! policy in force when its headers arrive and keeps it for its whole life (its tier's limits,
//! queue deadline, shadow mode), so a reload never changes the rules under a request already
//! admitted or queued. The long-lived tasks (the controller's tick, the fleet's sync) read the
//! new policy at their next step and keep their state: the controller's current limit survives
//! a reload, clamped into new bounds.
//!
//! # Reload
//!
//! `reload` takes a freshly loaded configuration (SIGHUP, or the file's content changed), and
//! either applies all of it or none: it is validated in full first (`Policy::from_config`, off
//! the async workers since a model's tokenizer takes a while to build), and settings that only
//! a restart can change (`RESTART_ONLY`) must be unchanged. A refusal logs every problem,
//! counts `tollgate_config_reloads_total{result="refused"}`, and the old policy keeps running.
//!
//! # Run-time settings
//!
//! The engines' busy thresholds and the controller's switch and bounds may be changed through
//! the admin API. With a Redis store the change is written to the fleet's `settings` hash
//! (whole, so of two racing writes one wins entire) and every replica reads that hash each
//! `fleet.sync_ms`; without one it applies to this replica. A setting stays in place across
//! reloads and restarts until it is deleted, when the file's value applies again.

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::budget::redis::RedisStore;
use crate::config::{Config, ConfigError, ControlConfig};
use crate::lifecycle::{Lifecycle, reached};
use crate::observe::{Metrics, ReloadResult};
use crate::policy::Policy;

/// The engines' busy thresholds, in the shape of Dynamo's `/busy_threshold` (seed 002): the
/// controller treats the engines as saturated above either.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineThresholds {
    /// KV-cache usage, in (0, 1].
    pub kv_cache_threshold: f64,
    /// Requests waiting in an engine's queue, at least 1.
    pub queue_depth_threshold: u32,
}

/// The controller's switch and bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlSwitch {
    /// Off: the in-flight budget is `scheduler.initial_limit`, as at start-up with
    /// `control.enabled: false`.
    pub enabled: bool,
    pub floor: u32,
    pub ceiling: u32,
}

/// A change of one run-time setting: its new value, or `None` to go back to the file's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change {
    Engine(Option<EngineThresholds>),
    Control(Option<ControlSwitch>),
}

impl Change {
    /// The setting's name, in the admin API's log and the fleet's `settings` hash.
    pub fn key(self) -> &'static str {
        match self {
            Change::Engine(_) => "engine",
            Change::Control(_) => "control",
        }
    }

    /// The value as the fleet's `settings` hash stores it (None: deleted).
    fn encoded(self) -> Option<String> {
        match self {
            Change::Engine(value) => value.and_then(|v| serde_json::to_string(&v).ok()),
            Change::Control(value) => value.and_then(|v| serde_json::to_string(&v).ok()),
        }
    }

    fn apply_to(self, settings: &mut Settings) {
        match self {
            Change::Engine(value) => settings.engine = value,
            Change::Control(value) => settings.control = value,
        }
    }
}

/// The settings changed at run time, each replacing the file's values while present.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Settings {
    pub engine: Option<EngineThresholds>,
    pub control: Option<ControlSwitch>,
}

impl Settings {
    /// `file` with these settings in place, or every problem they make (each naming its field).
    pub fn apply(&self, file: &Policy) -> Result<Policy, Vec<String>> {
        if *self == Settings::default() {
            return Ok(file.clone());
        }
        let mut control = file.control.clone();
        if let Some(engine) = self.engine {
            control.engine.kv_cache_threshold = engine.kv_cache_threshold;
            control.engine.queue_depth_threshold = engine.queue_depth_threshold;
        }
        if let Some(switch) = self.control {
            control.enabled = switch.enabled;
            control.floor = switch.floor;
            control.ceiling = switch.ceiling;
        }
        file.with_control(control)
    }

    /// Decodes the fleet's `settings` hash; a value that does not decode (written by another
    /// build, or by hand) is left out and named.
    fn decode(stored: &HashMap<String, String>) -> (Settings, Vec<String>) {
        let mut settings = Settings::default();
        let mut unreadable = Vec::new();
        for (key, value) in stored {
            let decoded = match key.as_str() {
                "engine" => serde_json::from_str(value).map(|v| settings.engine = Some(v)),
                "control" => serde_json::from_str(value).map(|v| settings.control = Some(v)),
                _ => continue,
            };
            if let Err(e) = decoded {
                unreadable.push(format!("{key}: {e}"));
            }
        }
        (settings, unreadable)
    }
}

/// What `reload` did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// The new policy is in force; the configuration's top-level sections it changed.
    Applied { changed: Vec<String> },
    /// The configuration is the one already in force.
    Unchanged,
}

/// Settings only a restart can change: the sockets, the store's connection, the fleet's name
/// and this replica's id in it and sync period, the gRPC message limit (`tokens.max_body_bytes`),
/// the large bodies' counting threads, the admin token's file, how the file is watched, the
/// scheduler's headroom and the TTFT window's length.
/// Whether two configurations agree on one setting.
type Same = fn(&Config, &Config) -> bool;

const RESTART_ONLY: &[(&str, Same)] = &[
    ("listen.grpc_addr", |a, b| {
        a.listen.grpc_addr == b.listen.grpc_addr
    }),
    ("listen.admin_addr", |a, b| {
        a.listen.admin_addr == b.listen.admin_addr
    }),
    ("store", |a, b| a.store == b.store),
    ("fleet.name", |a, b| a.fleet.name == b.fleet.name),
    ("fleet.member_id", |a, b| {
        a.fleet.member_id == b.fleet.member_id
    }),
    ("tokens.max_body_bytes", |a, b| {
        a.tokens.max_body_bytes == b.tokens.max_body_bytes
    }),
    // The threads' permits are made once, at start-up.
    ("tokens.large_body_threads", |a, b| {
        a.tokens.large_body_threads == b.tokens.large_body_threads
    }),
    ("admin.token_file", |a, b| a.admin == b.admin),
    ("reload.watch_ms", |a, b| a.reload == b.reload),
    // The headroom's sums are kept incrementally from the first request on.
    ("scheduler.headroom", |a, b| {
        a.scheduler.headroom == b.scheduler.headroom
    }),
    // The TTFT window is sized once, and the fleet's connections time out by the sync period.
    ("control.window_ms", |a, b| {
        a.control.window_ms == b.control.window_ms
    }),
    ("fleet.sync_ms", |a, b| a.fleet.sync_ms == b.fleet.sync_ms),
];

/// The settings `next` changes that only a restart can (empty: it may be applied live).
pub fn restart_only_changes(running: &Config, next: &Config) -> Vec<&'static str> {
    RESTART_ONLY
        .iter()
        .filter(|(_, same)| !same(running, next))
        .map(|(name, _)| *name)
        .collect()
}

/// The configuration's top-level sections that differ, for the log line of a reload.
fn changed_sections(running: &Config, next: &Config) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(running), serde_json::to_value(next))
    else {
        return Vec::new();
    };
    b.iter()
        .filter(|(key, value)| a.get(*key) != Some(value))
        .map(|(key, _)| key.clone())
        .collect()
}

/// What a request is decided under: the policy, and the metric series of its tiers (a
/// `TierId` indexes both).
pub struct Rules {
    pub policy: Arc<Policy>,
    pub metrics: Metrics,
}

impl Rules {
    pub fn new(policy: Arc<Policy>, metrics: &Metrics) -> Arc<Rules> {
        let metrics = metrics.for_tiers(&*policy);
        Arc::new(Rules { policy, metrics })
    }
}

/// The policy in force and what may replace it.
pub struct Live {
    state: Mutex<State>,
    /// Serializes reloads and setting changes end to end (validation included), so two never
    /// interleave and one always wins whole.
    changing: tokio::sync::Mutex<()>,
    effective: watch::Sender<Arc<Policy>>,
    /// The same, with the metrics of its tiers, for the request path.
    rules: watch::Sender<Arc<Rules>>,
    /// Where run-time settings are shared with the other replicas (`None`: this replica only).
    shared: Option<SharedSettings>,
    metrics: Metrics,
    /// The configuration file's content as last read for a reload (SIGHUP or the watch), so
    /// the watch does not reload again what a SIGHUP already did.
    file_seen: Mutex<Option<Vec<u8>>>,
    /// Bumped by every change made here through the admin API: a read of the shared settings
    /// that began before one is older than it and is dropped, not applied over it.
    settings_changes: std::sync::atomic::AtomicU64,
}

struct SharedSettings {
    store: RedisStore,
    fleet: String,
}

struct State {
    /// The last valid configuration's policy, without run-time settings.
    file: Arc<Policy>,
    settings: Settings,
}

/// A setting that cannot be applied, as the admin API reports it.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    /// The value makes the policy invalid; each problem names its field.
    #[error("{}", .0.join("; "))]
    Invalid(Vec<String>),
    /// The shared store did not take it; nothing changed.
    #[error("the settings could not be shared through Redis: {0}")]
    Store(String),
}

impl Live {
    /// `policy` from the configuration the process started with; `shared`: the Redis store and
    /// fleet name through which run-time settings reach the other replicas.
    pub fn new(
        policy: Arc<Policy>,
        shared: Option<(RedisStore, String)>,
        metrics: Metrics,
    ) -> Arc<Live> {
        let (effective, _) = watch::channel(policy.clone());
        let (rules, _) = watch::channel(Rules::new(policy.clone(), &metrics));
        Arc::new(Live {
            rules,
            state: Mutex::new(State {
                file: policy,
                settings: Settings::default(),
            }),
            changing: tokio::sync::Mutex::new(()),
            effective,
            shared: shared.map(|(store, fleet)| SharedSettings { store, fleet }),
            metrics,
            file_seen: Mutex::new(None),
            settings_changes: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The policy in force now, and each that replaces it.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Policy>> {
        self.effective.subscribe()
    }

    /// The rules in force now, and each that replaces them.
    pub fn subscribe_rules(&self) -> watch::Receiver<Arc<Rules>> {
        self.rules.subscribe()
    }

    pub fn current(&self) -> Arc<Policy> {
        self.effective.borrow().clone()
    }

    /// The run-time settings in force.
    pub fn settings(&self) -> Settings {
        self.state().settings
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies the configuration `load` reads (the file, the environment and the flags, as at
    /// start-up) if it is valid and changes nothing that needs a restart; otherwise logs every
    /// problem, counts the refusal, and keeps the policy in force. `cause` says what asked.
    pub async fn reload(
        &self,
        load: impl FnOnce() -> Result<Config, ConfigError> + Send + 'static,
        cause: &str,
    ) -> Result<Reloaded, Vec<String>> {
        self.reload_counted(load, cause, true).await
    }

    /// `reload`, counting and logging a reload that changed nothing only if `count_unchanged`.
    async fn reload_counted(
        &self,
        load: impl FnOnce() -> Result<Config, ConfigError> + Send + 'static,
        cause: &str,
        count_unchanged: bool,
    ) -> Result<Reloaded, Vec<String>> {
        let _changing = self.changing.lock().await;
        let outcome = self.reload_locked(load).await;
        match &outcome {
            Ok(Reloaded::Unchanged) if !count_unchanged => {}
            Ok(Reloaded::Applied { changed }) => {
                self.metrics.config_reload(ReloadResult::Applied);
                let policy = self.current();
                tracing::info!(cause, ?changed, policy_hash = %policy.hash, "configuration reloaded");
                for loaded in &policy.counting.tokenizers {
                    tracing::info!(tokenizer = %loaded, "loaded a model's own tokenizer");
                }
                for warning in policy.warnings() {
                    tracing::warn!(%warning, "configuration has no effect");
                }
            }
            Ok(Reloaded::Unchanged) => {
                self.metrics.config_reload(ReloadResult::Unchanged);
                tracing::info!(cause, "configuration reloaded: nothing changed");
            }
            Err(problems) => {
                self.metrics.config_reload(ReloadResult::Refused);
                for problem in problems {
                    tracing::error!(cause, %problem, "configuration reload refused");
                }
                tracing::error!(
                    cause,
                    problems = problems.len(),
                    "configuration reload refused: the policy in force keeps running"
                );
            }
        }
        outcome
    }

    async fn reload_locked(
        &self,
        load: impl FnOnce() -> Result<Config, ConfigError> + Send + 'static,
    ) -> Result<Reloaded, Vec<String>> {
        let running = self.state().file.source.clone();
        // Off the async workers: reading files, and a model's tokenizer takes a while to build.
        let checked = tokio::task::spawn_blocking(move || {
            let config = load().map_err(|e| lines(&e))?;
            if *running == config {
                return Ok(None);
            }
            let mut problems: Vec<String> = restart_only_changes(&running, &config)
                .iter()
                .map(|name| format!("{name}: cannot change while running; restart to change it"))
                .collect();
            let changed = changed_sections(&running, &config);
            match Policy::from_config(&config) {
                Ok(policy) if problems.is_empty() => Ok(Some((policy, changed))),
                Ok(_) => Err(problems),
                Err(e) => {
                    problems.extend(lines(&e));
                    Err(problems)
                }
            }
        })
        .await
        // A panic while loading (a file no parser expected) is a refusal, not the end of
        // reloading: the tasks that call this must live on.
        .unwrap_or_else(|failed| {
            Err(vec![format!(
                "the configuration could not be loaded: {failed}"
            )])
        })?;
        let Some((policy, changed)) = checked else {
            return Ok(Reloaded::Unchanged);
        };
        let mut state = self.state();
        let effective = state.settings.apply(&policy).map_err(|problems| {
            problems
                .into_iter()
                .map(|p| format!("{p} (with the settings changed through the admin API)"))
                .collect::<Vec<_>>()
        })?;
        state.file = Arc::new(policy);
        drop(state);
        self.publish(Arc::new(effective));
        Ok(Reloaded::Applied { changed })
    }

    /// Records the configuration file's content as read for a reload; whether it differs from
    /// the last recorded.
    pub fn note_file_read(&self, content: Vec<u8>) -> bool {
        let mut seen = self
            .file_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let changed = seen.as_ref() != Some(&content);
        *seen = Some(content);
        changed
    }

    /// Reloads whenever the content at `path` changes (read every `period`; a ConfigMap update
    /// swaps a symlink, which reading through it sees), until the server closes.
    pub async fn watch_file(
        self: Arc<Self>,
        path: std::path::PathBuf,
        period: Duration,
        load: Arc<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>,
        mut lifecycle: watch::Receiver<Lifecycle>,
    ) {
        if let Ok(content) = tokio::fs::read(&path).await {
            self.note_file_read(content);
        }
        // The file may have changed since start-up read it: apply that now, and say nothing if
        // it did not.
        let first = load.clone();
        let _ = self
            .reload_counted(
                move || first(),
                "the configuration file changed during start-up",
                false,
            )
            .await;
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = reached(&mut lifecycle, Lifecycle::Closing) => return,
            }
            // Missing for a moment while a symlink is swapped: wait for the next read.
            let Ok(content) = tokio::fs::read(&path).await else {
                continue;
            };
            if !self.note_file_read(content) {
                continue;
            }
            let load = load.clone();
            let _ = self
                .reload(move || load(), "the configuration file changed")
                .await;
        }
    }

    /// Replaces one run-time setting (`None`: back to the file's value), here and, through
    /// Redis, on every replica sharing the store. Nothing changes if it is invalid or cannot be
    /// shared.
    pub async fn set(&self, change: Change) -> Result<Arc<Policy>, SettingError> {
        let _changing = self.changing.lock().await;
        let mut next = self.settings();
        change.apply_to(&mut next);
        let file = self.state().file.clone();
        let effective = next.apply(&file).map_err(SettingError::Invalid)?;
        if let Some(shared) = &self.shared {
            // Before the write: a read of the shared settings racing it must not be applied
            // after it (nor one that read the old value while this write was under way).
            self.settings_changes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            shared
                .store
                .fleet_set_setting(&shared.fleet, change.key(), change.encoded().as_deref())
                .await
                .map_err(|e| SettingError::Store(e.to_string()))?;
        }
        let effective = Arc::new(effective);
        self.state().settings = next;
        self.publish(effective.clone());
        // And after it: a read that began while the write was under way may have missed it.
        self.settings_changes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tracing::info!(?change, "run-time setting changed through the admin API");
        Ok(effective)
    }

    fn publish(&self, policy: Arc<Policy>) {
        // A run-time setting, or a reload that keeps the tiers, keeps their metric series: only
        // new tiers need registering.
        let in_force = self.rules.borrow().clone();
        let same_tiers = in_force.policy.tiers.len() == policy.tiers.len()
            && in_force
                .policy
                .tiers
                .iter()
                .zip(&policy.tiers)
                .all(|(a, b)| a.name == b.name);
        let rules = if same_tiers {
            Arc::new(Rules {
                policy: policy.clone(),
                metrics: in_force.metrics.clone(),
            })
        } else {
            Rules::new(policy.clone(), &self.metrics)
        };
        self.rules.send_replace(rules);
        self.effective.send_replace(policy);
    }

    /// Reads the fleet's run-time settings every `period` until the server closes, applying
    /// what another replica changed.
    pub async fn follow_shared_settings(
        self: Arc<Self>,
        period: Duration,
        mut lifecycle: watch::Receiver<Lifecycle>,
    ) {
        let Some(shared) = &self.shared else { return };
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut unreadable_logged = false;
        let mut misfit_logged = false;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = reached(&mut lifecycle, Lifecycle::Closing) => return,
            }
            let changes_before = self
                .settings_changes
                .load(std::sync::atomic::Ordering::SeqCst);
            let stored = match shared.store.fleet_settings(&shared.fleet).await {
                Ok(stored) => stored,
                // The fleet logs an unreachable Redis; the settings in force stay.
                Err(error) => {
                    tracing::debug!(%error, "run-time settings: cannot read them");
                    continue;
                }
            };
            let (settings, unreadable) = Settings::decode(&stored);
            if !unreadable.is_empty() && !unreadable_logged {
                tracing::warn!(
                    ?unreadable,
                    "run-time settings in Redis that do not decode are ignored"
                );
            }
            unreadable_logged = !unreadable.is_empty();
            let _changing = self.changing.lock().await;
            let changed_here = self
                .settings_changes
                .load(std::sync::atomic::Ordering::SeqCst)
                != changes_before;
            if changed_here || settings == self.settings() {
                continue;
            }
            let file = self.state().file.clone();
            match settings.apply(&file) {
                Ok(effective) => {
                    misfit_logged = false;
                    tracing::info!(?settings, "run-time settings changed by another replica");
                    self.state().settings = settings;
                    self.publish(Arc::new(effective));
                }
                Err(problems) if !misfit_logged => {
                    misfit_logged = true;
                    tracing::warn!(
                        ?problems,
                        "run-time settings from Redis do not fit this replica's policy; keeping those in force"
                    );
                }
                Err(_) => {}
            }
        }
    }
}

impl Live {
    /// A tenant's usage of `windows` from the shared store, on this replica's own connection
    /// (None without Redis: the ledger's store is the embedded one).
    pub async fn usage(
        &self,
        tenant: &str,
        windows: &[crate::budget::WindowLimit],
    ) -> Option<Result<crate::budget::Usage, crate::budget::StoreError>> {
        let shared = self.shared.as_ref()?;
        Some(shared.store.usage(tenant, windows).await)
    }
}

impl Settings {
    /// The engines' thresholds in force: this setting, or the file's.
    pub fn engine_in(policy: &Policy) -> EngineThresholds {
        EngineThresholds {
            kv_cache_threshold: policy.control.engine.kv_cache_threshold,
            queue_depth_threshold: policy.control.engine.queue_depth_threshold,
        }
    }

    /// The controller's switch and bounds in force.
    pub fn control_in(control: &ControlConfig) -> ControlSwitch {
        ControlSwitch {
            enabled: control.enabled,
            floor: control.floor,
            ceiling: control.ceiling,
        }
    }
}

/// A configuration error's problems, one per line.
fn lines(error: &ConfigError) -> Vec<String> {
    error.0.lines().map(str::to_owned).collect()
}
