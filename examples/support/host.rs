//! What the benchmark examples and the load lab read off the machine and the processes they
//! start: the child processes themselves (`Proc`), CPU time from `/proc`, free loopback ports,
//! signals, medians. Included by each with `#[path = "support/host.rs"] mod host;` (a folder
//! under `examples/` is not an example of its own); each uses a subset, hence the `dead_code`
//! allowance where it is included.

use std::future::Future;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};

/// Runs a benchmark to its end on a runtime of `threads` workers, or until Ctrl-C or SIGTERM:
/// dropping the benchmark's future drops the processes it owns, and with them every child.
/// The exit status is 0 when it ran clean, 3 when it flagged its own results (`Ok(false)`;
/// `flagged` says where to look), 1 on an error.
pub fn run_bench(
    name: &str,
    threads: usize,
    flagged: &str,
    bench: impl Future<Output = Result<bool>>,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{name}: cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        tokio::select! {
            result = bench => result,
            signal = interrupted() => Err(anyhow!("interrupted by {signal}; children stopped")),
        }
    });
    // Do not wait for a thread still sleeping towards its next due time (bench_overhead's
    // dispatcher): it sees its cancel flag and stops on its own.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("{name}: {flagged}");
            ExitCode::from(3)
        }
        Err(error) => {
            eprintln!("{name}: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM, naming the signal, so a benchmark can stop its children.
pub async fn interrupted() -> &'static str {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        // Without a SIGTERM handler the default action still ends the process.
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// A child process with its stderr in a log file; SIGKILLed and reaped on drop (on every way
/// out: return, `?`, panic, signal), so no benchmark leaves a process behind.
pub struct Proc {
    name: &'static str,
    // Behind a lock so a process shared by tasks can be polled through `&self`.
    child: Mutex<Child>,
    pid: u32,
    log: PathBuf,
}

impl Proc {
    /// Spawns `command` with stdin closed and stderr into `log`; stdout is the command's to set.
    pub fn spawn(name: &'static str, command: &mut Command, log: PathBuf) -> Result<Proc> {
        let file =
            std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stderr(file)
            .spawn()
            .with_context(|| format!("spawn {name}"))?;
        Ok(Proc {
            name,
            pid: child.id(),
            child: Mutex::new(child),
            log,
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The child's stdout, if the command piped it (once).
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child_mut().stdout.take()
    }

    /// An error with the end of its log if the process has exited.
    pub fn check_alive(&self) -> Result<()> {
        let status = self
            .child
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .try_wait()
            .context("poll child")?;
        if let Some(status) = status {
            bail!(
                "{} exited ({status}); end of its log:\n{}",
                self.name,
                self.log_tail(40)
            );
        }
        Ok(())
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// utime + stime so far, in clock ticks, for the whole process (all threads).
    pub fn cpu_ticks(&self) -> Option<u64> {
        cpu_ticks_of(&format!("/proc/{}/stat", self.pid))
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL, then reap so no zombie is left. Errors mean it is already gone.
        let child = self.child_mut();
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// utime + stime from a /proc/…/stat file, in clock ticks (all threads of the process).
pub fn cpu_ticks_of(stat_path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: count fields after
    // the last ')'. Field 3 (state) is then index 0, utime (14) index 11, stime (15) index 12.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// USER_HZ, the unit of utime and stime in /proc/PID/stat (100 on every common Linux).
pub fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Busy and total jiffies of the whole machine (first line of /proc/stat).
pub fn machine_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let values: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal; idle and iowait are not busy. Guest time
    // is already inside user, so only the first eight columns count.
    let total: u64 = values.iter().take(8).sum();
    let idle = values.get(3)? + values.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The share of the machine's CPU time that was busy between two `machine_jiffies` readings.
pub fn busy_fraction(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    match (before, after) {
        (Some((busy0, total0)), Some((busy1, total1))) if total1 > total0 => {
            Some(busy1.saturating_sub(busy0) as f64 / (total1 - total0) as f64)
        }
        _ => None,
    }
}

/// A loopback port that was free a moment ago (the child that gets it binds it soon after).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .context("bind 127.0.0.1:0")?
        .port())
}

/// An HTTP client for the children's admin endpoints: loopback only, never through a proxy.
pub fn admin_client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .context("build the admin HTTP client")
}

/// The median (NaN for no values); sorts `values`.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// What the numbers were measured on, for a benchmark's report.
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub loadavg_at_start: String,
    /// Busy fraction of all CPUs over a moment before anything started: other work on the
    /// machine, which every figure shares the CPUs with. Set by the caller.
    pub busy_before_start: Option<f64>,
    /// The commit measured, "+ uncommitted changes" when the tree differs from it.
    pub git: String,
    /// The other software measured with, as (JSON key, version): Envoy's or Redis's.
    pub software: (&'static str, String),
}

impl Machine {
    pub fn describe(software: (&'static str, String)) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|line| line.split(':').next().is_some_and(|k| k.trim() == name))
                .and_then(|line| line.split_once(':'))
                .map_or_else(|| "?".to_owned(), |(_, value)| value.trim().to_owned())
        };
        // A KVM guest's model name is often just "Intel(R) Xeon(R) Processor"; family and model
        // numbers say which generation it is.
        let cpu_model = format!(
            "{}, family {} model {}",
            field("model name"),
            field("cpu family"),
            field("model")
        );
        let read = |path: &str| {
            std::fs::read_to_string(path).map_or_else(|_| "?".to_owned(), |s| s.trim().to_owned())
        };
        let git = |args: &[&str]| command_output(Path::new("git"), args);
        let dirty = git(&["status", "--porcelain"]).is_some_and(|out| !out.trim().is_empty());
        Machine {
            cpus: cpuinfo
                .lines()
                .filter(|line| line.starts_with("processor"))
                .count(),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease"),
            loadavg_at_start: read("/proc/loadavg"),
            busy_before_start: None,
            git: match git(&["rev-parse", "--short", "HEAD"]) {
                Some(commit) if dirty => format!("{} + uncommitted changes", commit.trim()),
                Some(commit) => commit.trim().to_owned(),
                None => "?".to_owned(),
            },
            software,
        }
    }

    pub fn json(&self) -> Value {
        let mut json = json!({
            "cpus": self.cpus,
            "cpu_model": self.cpu_model,
            "kernel": self.kernel,
            "loadavg_at_start": self.loadavg_at_start,
            "busy_before_start": self.busy_before_start,
            "git": self.git,
        });
        json[self.software.0] = json!(self.software.1);
        json
    }
}

/// What `program` printed on stdout, run in the repository, if it succeeded.
pub fn command_output(program: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new(program)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}
