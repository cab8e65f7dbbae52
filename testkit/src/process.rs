//! Child processes that cannot outlive their owner: each is SIGKILLed and reaped on drop (on
//! every way out: return, `?`, panic, a benchmark's signal), with its output in a log file whose
//! end goes into every failure message.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::host;

/// How many lines of a child's log a failure message carries.
const LOG_TAIL_LINES: usize = 40;

/// A child process with its output in a log file; SIGKILLed and reaped on drop.
pub struct Proc {
    name: String,
    // Behind a lock so a process shared by tasks can be polled through `&self`.
    child: Mutex<Child>,
    pid: u32,
    log: PathBuf,
}

impl Proc {
    /// Spawns `command` with stdin closed and stderr into `log` (created or truncated); stdout
    /// is the command's to set (piped to read an address from it, or null).
    pub fn spawn(name: impl Into<String>, command: &mut Command, log: PathBuf) -> Result<Proc> {
        let file =
            std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        Proc::spawn_with(name.into(), command.stderr(file), log)
    }

    /// Like [`Proc::spawn`], with stdout into the log too: for a child that logs on stdout
    /// (redis-server) or whose stdout is noise worth keeping for a failure (Envoy).
    pub fn spawn_logged(
        name: impl Into<String>,
        command: &mut Command,
        log: PathBuf,
    ) -> Result<Proc> {
        let file =
            std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let stdout = file
            .try_clone()
            .with_context(|| format!("clone the handle of {}", log.display()))?;
        Proc::spawn_with(name.into(), command.stdout(stdout).stderr(file), log)
    }

    fn spawn_with(name: String, command: &mut Command, log: PathBuf) -> Result<Proc> {
        let child = command
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {name} ({})", command.get_program().display()))?;
        Ok(Proc {
            name,
            pid: child.id(),
            child: Mutex::new(child),
            log,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Where its output goes.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The child's stdout, if the command piped it (once).
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child_mut().stdout.take()
    }

    /// Its exit status, if it has exited (reaping it).
    pub fn try_wait(&self) -> Result<Option<ExitStatus>> {
        self.child()
            .try_wait()
            .with_context(|| format!("poll {}", self.name))
    }

    /// An error with the end of its log if the process has exited.
    pub fn check_alive(&self) -> Result<()> {
        if let Some(status) = self.try_wait()? {
            bail!(
                "{} exited ({status}); end of its log:\n{}",
                self.name,
                self.log_tail(LOG_TAIL_LINES)
            );
        }
        Ok(())
    }

    /// Its whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// utime + stime so far, in clock ticks, for the whole process (all threads).
    pub fn cpu_ticks(&self) -> Option<u64> {
        host::cpu_ticks_of(&format!("/proc/{}/stat", self.pid))
    }

    /// Sends SIGTERM, as Kubernetes does, and leaves the process to exit by itself.
    pub fn terminate(&self) -> Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .context("run kill")?;
        anyhow::ensure!(status.success(), "kill -TERM {} failed", self.pid);
        Ok(())
    }

    /// Sends `signal` (a name `kill` knows: `HUP`, `USR1`, ...).
    pub fn signal(&self, signal: &str) -> Result<()> {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid.to_string()])
            .status()
            .context("run kill")?;
        anyhow::ensure!(status.success(), "kill -{signal} {} failed", self.pid);
        Ok(())
    }

    /// SIGKILLs the process (no shutdown: a crash) and reaps it. Errors mean it is already
    /// gone.
    pub fn kill(&mut self) {
        let child = self.child_mut();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Waits (polling) until the process exits, at most `within`.
    pub async fn wait_exit(&self, within: Duration) -> Result<ExitStatus> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("{} did not exit within {within:?}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn child(&self) -> MutexGuard<'_, Child> {
        self.child
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// SIGKILLs every process in the process group `group` (a child spawned with
/// `CommandExt::process_group(0)` leads a group numbered by its pid): for a server whose worker
/// processes would outlive their parent's own kill.
pub fn kill_process_group(group: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .status();
}

/// Where a child keeps its files (config, log): the caller's `dir`, or else a fresh temp dir
/// named `<prefix>…`, which the caller must keep (and drop after the child) as the first value.
pub(crate) fn files_dir(
    dir: Option<&Path>,
    prefix: &str,
) -> Result<(Option<tempfile::TempDir>, PathBuf)> {
    match dir {
        Some(dir) => Ok((None, dir.to_path_buf())),
        None => {
            let own = tempfile::Builder::new()
                .prefix(prefix)
                .tempdir()
                .with_context(|| format!("create a temp dir {prefix}…"))?;
            let path = own.path().to_path_buf();
            Ok((Some(own), path))
        }
    }
}

/// Polls `ready` every 50 ms until it says yes, failing early (with the end of the log) if the
/// process exits, and after `timeout` (with the end of the log too).
pub async fn wait_until<F, Fut>(proc: &Proc, timeout: Duration, mut ready: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        proc.check_alive()?;
        if ready().await {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "{} not ready within {timeout:?}; end of its log:\n{}",
                proc.name(),
                proc.log_tail(LOG_TAIL_LINES)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`wait_until`] a GET of `url` answers 2xx with a body that `body_ok` accepts (Envoy's
/// `/ready` says LIVE; tollgate's `/readyz` answers 200).
pub async fn wait_until_http(
    proc: &Proc,
    timeout: Duration,
    url: &str,
    body_ok: impl Fn(&str) -> bool,
) -> Result<()> {
    let client = crate::loopback_client()?;
    let body_ok = &body_ok;
    wait_until(proc, timeout, || {
        let request = client.get(url).send();
        async move {
            match request.await {
                Ok(response) if response.status().is_success() => {
                    response.text().await.is_ok_and(|body| body_ok(&body))
                }
                _ => false,
            }
        }
    })
    .await
    .with_context(|| format!("waiting for {url}"))
}
