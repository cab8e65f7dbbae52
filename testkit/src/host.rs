//! What the benchmarks read off the machine: CPU time of processes and of the whole machine from
//! `/proc`, resident memory, and a description of the machine for a report.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// utime + stime from a /proc/…/stat file, in clock ticks (all threads of the process).
pub fn cpu_ticks_of(stat_path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    Some(ProcStat::parse(&stat)?.ticks)
}

/// The fields of a /proc/PID/stat line the benchmarks read.
struct ProcStat {
    parent: u32,
    /// utime + stime: the process's own CPU, all its threads.
    ticks: u64,
    /// cutime + cstime: the CPU of its children that have exited and been reaped.
    reaped_children_ticks: u64,
}

impl ProcStat {
    fn parse(stat: &str) -> Option<ProcStat> {
        // The command name (field 2) is in parentheses and may contain spaces: count fields
        // after the last ')'. Field 3 (state) is then index 0, ppid (4) index 1, utime (14)
        // index 11, stime (15) index 12, cutime (16) index 13, cstime (17) index 14.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let field = |index: usize| fields.get(index)?.parse::<u64>().ok();
        Some(ProcStat {
            parent: fields.get(1)?.parse().ok()?,
            ticks: field(11)? + field(12)?,
            reaped_children_ticks: field(13)? + field(14)?,
        })
    }
}

/// CPU of process `root` and every process descended from it, in clock ticks: for a server that
/// works in child processes (LiteLLM's workers). Live descendants count with their own CPU, and
/// exited ones through their parents' reaped-children figures, so a worker that is replaced
/// mid-run keeps its CPU. `None` when `root` is gone.
pub fn tree_cpu_ticks(root: u32) -> Option<u64> {
    let mut processes: Vec<(u32, ProcStat)> = Vec::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| ProcStat::parse(&stat))
        else {
            continue;
        };
        processes.push((pid, stat));
    }
    let own = |stat: &ProcStat| stat.ticks + stat.reaped_children_ticks;
    let mut total = own(&processes.iter().find(|(pid, _)| *pid == root)?.1);
    let mut tree = vec![root];
    // Breadth-first over the parent links; a handful of processes, so a scan per level is fine.
    let mut next = 0;
    while next < tree.len() {
        let parent = tree[next];
        next += 1;
        for (pid, stat) in &processes {
            if stat.parent == parent && *pid != root {
                tree.push(*pid);
                total += own(stat);
            }
        }
    }
    Some(total)
}

/// utime + stime of process `pid` (all threads), in seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let ticks = cpu_ticks_of(&path).with_context(|| format!("utime and stime of {path}"))?;
    Ok(ticks as f64 / clock_ticks_per_second())
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

/// A `Name:   123 kB` field of /proc/PID/status (`VmRSS`, `RssAnon`), in KiB.
pub fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    status
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            (name == field).then(|| value.trim().trim_end_matches("kB").trim().parse().ok())?
        })
        .with_context(|| format!("no {field} in {path}"))
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

/// What the numbers were measured on, for a benchmark's report.
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    /// /proc/loadavg as it was: the three load averages, runnable/all tasks, the last pid.
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

    /// [`Machine::describe`], with `busy_before_start` sampled over the next 2 s, before the
    /// benchmark starts anything.
    pub async fn describe_and_sample(software: (&'static str, String)) -> Machine {
        let mut machine = Machine::describe(software);
        let before = machine_jiffies();
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        machine.busy_before_start = busy_fraction(before, machine_jiffies());
        machine
    }

    /// `2 CPUs (<model>), load average <loadavg>, 12% busy before start`, for the line a
    /// benchmark prints when it starts.
    pub fn headline(&self) -> String {
        format!(
            "{} CPUs ({}), load average {}, {:.0}% busy before start",
            self.cpus,
            self.cpu_model,
            self.loadavg_at_start,
            self.busy_before_start.unwrap_or(f64::NAN) * 100.0,
        )
    }

    /// The three load averages of `loadavg_at_start`.
    pub fn load_averages_at_start(&self) -> String {
        self.loadavg_at_start
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
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

/// What `program` printed on stdout, run in the repository root, if it succeeded.
pub fn command_output(program: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new(program)
        .args(args)
        .current_dir(crate::repo_root())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Seconds since the Unix epoch, to date a benchmark's report (0 if the clock is before 1970).
#[allow(clippy::disallowed_methods)] // A report's date is wall-clock time by definition.
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}
