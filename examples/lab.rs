//! `lab`: re-runs the seeds' multi-tenant experiments against a simulated vLLM, through real
//! Envoy, with tollgate in front or not.
//!
//! ```text
//! bash scripts/install-test-deps.sh                     # Envoy 1.40 into .tools/
//! cargo build --release --bin tollgate --example upstream
//! cargo run --release --example lab -- examples/scenarios/seed000-burst.yaml
//! ```
//!
//! A scenario file (`examples/scenarios/*.yaml`, format in docs/lab.md) names the tenants and
//! their open-loop arrivals (Poisson rates, bursts), request sizes, the simulated vLLM's
//! settings, tollgate's configuration, and the runs to compare. For every run the lab starts
//! a fresh stack, the simulated vLLM (`examples/upstream.rs --engine vllm`), the release
//! `tollgate` binary (or none) and Envoy on `envoy/front-proxy.yaml` (for "tollgate off", the
//! same file with the ext_proc filter cut out at run time), sends the load, and tears it down.
//!
//! Everything in a scenario is simulated time. With `time_scale: 4` the engine runs 4 times
//! faster than real time, arrivals come 4 times faster, tollgate's queue deadlines and
//! controller times are divided by 4, and every latency the client measures is multiplied by
//! 4 before it is reported: a 120 s scenario takes 30 s of wall time.
//!
//! A run's `admin_calls` are sent to every replica's admin API at their (simulated) times, e.g.
//! new engine thresholds mid-run, and marked on the charts.
//!
//! With `replicas: N` the lab starts N tollgate replicas sharing one budget through a
//! redis-server of its own, behind the one Envoy (see `lab/stack.rs`), and reports the
//! deployment's figures plus each replica's. `lab --compare BASE/summary.json
//! OTHER/summary.json` prints the ratios of two results, run by run; `lab --slice
//! <out>/<run> FROM TO` one run's tail latencies and budget use over a span of its time.
//!
//! Output: a seed-style table per run and an overview on stdout, a progress line on stderr,
//! and under `--out` (default `target/lab/<scenario>/`): `summary.json`, `summary.csv`,
//! `tables.md`, and per run `<run>.requests.csv` and `<run>.png`.

#[path = "lab/chart.rs"]
mod chart;
#[path = "lab/load.rs"]
mod load;
#[path = "lab/report.rs"]
mod report;
#[path = "lab/scenario.rs"]
mod scenario;
#[path = "lab/stack.rs"]
mod stack;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use serde_json::{Value, json};

use scenario::Scenario;
use stack::{Binaries, Stack};

#[derive(Parser, Debug)]
#[command(name = "lab", about = "Run a load-lab scenario (see docs/lab.md)")]
struct Args {
    /// The scenario file.
    #[arg(required_unless_present_any = ["compare", "slice"])]
    scenario: Option<PathBuf>,
    /// Compare two runs' results instead of running anything: `BASE OTHER`, two `summary.json`
    /// files (e.g. one replica against three); prints a table of ratios, run by run.
    #[arg(long, num_args = 2, value_names = ["BASE", "OTHER"])]
    compare: Vec<PathBuf>,
    /// Summarise a finished run over a span of its simulated time instead of running anything:
    /// `RUN FROM TO`, RUN being `<out>/<run name>` (its `.requests.csv` and `.samples.json`);
    /// prints each tenant's median and p99 TTFT of the arrivals in [FROM, TO) s and tollgate's
    /// mean limit and in-flight count over the samples in it.
    #[arg(long, num_args = 3, value_names = ["RUN", "FROM", "TO"])]
    slice: Vec<String>,
    /// Simulated seconds per real second [default: the scenario's `time_scale`].
    #[arg(long)]
    time_scale: Option<f64>,
    /// Only these runs (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    runs: Vec<String>,
    /// Output directory [default: target/lab/<scenario name>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Skip the PNG charts.
    #[arg(long)]
    no_charts: bool,
    /// Envoy binary [default: $ENVOY_BIN, else .tools/envoy-1.40.0/envoy/_bin/envoy].
    #[arg(long)]
    envoy_bin: Option<PathBuf>,
    /// tollgate binary [default: target/<this profile>/tollgate].
    #[arg(long)]
    tollgate_bin: Option<PathBuf>,
    /// Simulated vLLM binary [default: target/<this profile>/examples/upstream].
    #[arg(long)]
    upstream_bin: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Dropping the lab future on Ctrl-C or SIGTERM drops the stack, and with it every child.
    tollgate_testkit::bench::run_bench("lab", 2, "", async { lab(&args).await.map(|()| true) })
}

async fn lab(args: &Args) -> Result<()> {
    if let [base, other] = &args.compare[..] {
        let read = |path: &PathBuf| -> Result<Value> {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("read {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
        };
        print!("{}", report::compare(&read(base)?, &read(other)?));
        return Ok(());
    }
    if let [run, from, to] = &args.slice[..] {
        let read = |suffix: &str| {
            let path = format!("{run}.{suffix}");
            std::fs::read_to_string(&path).with_context(|| format!("read {path}"))
        };
        let samples: Value = serde_json::from_str(&read("samples.json")?)
            .with_context(|| format!("parse {run}.samples.json"))?;
        let (from, to): (f64, f64) = (
            from.parse().context("FROM: seconds")?,
            to.parse().context("TO: seconds")?,
        );
        let out = report::slice(&read("requests.csv")?, &samples, from, to)
            .map_err(|error| anyhow::anyhow!("{run}: {error}"))?;
        print!("{out}");
        return Ok(());
    }
    let scenario_file = args.scenario.as_ref().context("no scenario file")?;
    let scenario = Scenario::load(scenario_file)?;
    let time_scale = args.time_scale.unwrap_or(scenario.time_scale);
    ensure!(time_scale > 0.0, "--time-scale must be positive");
    let runs: Vec<&scenario::Run> = scenario
        .runs
        .iter()
        .filter(|run| args.runs.is_empty() || args.runs.contains(&run.name))
        .collect();
    ensure!(!runs.is_empty(), "no run of the scenario matches --runs");
    let binaries = Binaries::locate(
        args.envoy_bin.clone(),
        args.tollgate_bin.clone(),
        args.upstream_bin.clone(),
    )?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let front_proxy = std::fs::read_to_string(root.join("envoy/front-proxy.yaml"))
        .context("read envoy/front-proxy.yaml")?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| root.join("target/lab").join(&scenario.name));
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .context("build the HTTP client")?;
    let tenant_names: Vec<String> = scenario.tenants.iter().map(|t| t.name.clone()).collect();
    let mut upstream_args = vec!["--time-scale".to_owned(), time_scale.to_string()];
    for (key, value) in &scenario.upstream {
        upstream_args.push(format!("--{}", key.replace('_', "-")));
        upstream_args.push(match value {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        });
    }

    if !scenario.description.is_empty() {
        eprintln!("{}", scenario.description.trim());
    }
    eprintln!(
        "scenario {}: {} run(s), {} s simulated each (+ up to {} s drain) at time scale {}{}",
        scenario.name,
        runs.len(),
        scenario.duration_s,
        scenario.drain_s,
        time_scale,
        if scenario.replicas > 1 {
            format!(
                ", {} tollgate replicas sharing one budget in Redis",
                scenario.replicas
            )
        } else {
            String::new()
        }
    );
    let mut summaries = Vec::new();
    let mut tables = String::new();
    for run in runs {
        let tollgate_config = scenario.tollgate_config(run, time_scale);
        // tollgate's admin API answers only with a bearer token (`admin.token_file`): the
        // configuration's own, or, for a run that calls it, one the stack writes in.
        let admin_token = match admin_token(tollgate_config.as_ref())? {
            Some(token) => Some(token),
            None if !run.admin_calls.is_empty() => {
                Some(format!("tollgate-lab-{}", std::process::id()))
            }
            None => None,
        };
        // The ports are picked free and then bound by the children, so another process on the
        // machine can take one in between ("Address already in use"): try a fresh set.
        let mut attempt = 1;
        let mut stack = loop {
            match Stack::start(
                &binaries,
                &upstream_args,
                tollgate_config.as_ref(),
                admin_token.as_deref(),
                scenario.replicas,
                &front_proxy,
            )
            .await
            {
                Ok(stack) => break stack,
                Err(error) if attempt < 3 => {
                    eprintln!("run {}: {error:#}; starting again", run.name);
                    attempt += 1;
                }
                Err(error) => {
                    return Err(error)
                        .with_context(|| format!("start the stack of run {}", run.name));
                }
            }
        };
        let arrivals = scenario.arrivals(run);
        let target = load::Target {
            url: format!("http://{}/v1/chat/completions", stack.envoy_listen),
            upstream: stack.upstream_addr,
            tollgate_admins: stack.tollgate_admins.clone(),
            identities: scenario
                .tenants
                .iter()
                .map(|t| {
                    (
                        t.user.clone().unwrap_or_else(|| t.name.clone()),
                        t.tier.clone(),
                    )
                })
                .collect(),
            admin_calls: run.admin_calls.clone(),
            admin_token,
            time_scale,
            sample_every: scenario.sample_every_s,
            duration: scenario.duration_s,
            drain: scenario.drain_s,
            label: run.name.clone(),
        };
        let outcome = load::run(&target, &arrivals, &client).await;
        stack
            .check_alive()
            .with_context(|| format!("a process of run {} died", run.name))?;
        drop(stack);

        let summary = report::summarize(
            &report::RunInfo {
                scenario: &scenario.name,
                run: &run.name,
                description: &run.description,
                tollgate: tollgate_config.is_some(),
                time_scale,
                duration_s: scenario.duration_s,
                window: scenario.window_s,
                slo_ttft_ms: scenario.slo_ttft_ms,
                tenant_names: tenant_names.clone(),
                replicas: if tollgate_config.is_some() {
                    scenario.replicas as usize
                } else {
                    0
                },
            },
            &outcome,
        );
        let table = report::table(&summary, scenario.window_s);
        println!("{table}");
        tables.push_str(&table);
        let stem = run.name.replace(['/', ' '], "_");
        std::fs::write(
            out.join(format!("{stem}.requests.csv")),
            report::records_csv(&outcome.records, &tenant_names),
        )?;
        std::fs::write(
            out.join(format!("{stem}.samples.json")),
            serde_json::to_string(&outcome.samples)?,
        )?;
        if !args.no_charts {
            chart::run_chart(
                &out.join(format!("{stem}.png")),
                &summary,
                &outcome,
                &tenant_names,
            )?;
        }
        summaries.push((summary, tollgate_config));
    }

    let only: Vec<report::RunSummary> = summaries.iter().map(|(s, _)| s.clone()).collect();
    let overview = report::overview(&only);
    println!("#### {} overview\n\n{overview}", scenario.name);
    tables.push_str(&format!("#### {} overview\n\n{overview}", scenario.name));
    std::fs::write(out.join("tables.md"), tables)?;
    std::fs::write(out.join("summary.csv"), report::summary_csv(&only))?;
    let report = json!({
        "scenario": scenario.name,
        "file": scenario_file,
        "replicas": scenario.replicas,
        "time_scale": time_scale,
        "command": std::env::args().collect::<Vec<_>>(),
        "runs": summaries.iter().map(|(summary, config)| json!({
            "summary": summary,
            "tollgate_config": config,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    eprintln!("results in {}", out.display());
    Ok(())
}

/// The bearer token for tollgate's admin API: the contents of its `admin.token_file`, if the
/// run's configuration names one.
fn admin_token(config: Option<&Value>) -> Result<Option<String>> {
    let Some(path) = config
        .and_then(|c| c.pointer("/admin/token_file"))
        .and_then(Value::as_str)
    else {
        return Ok(None);
    };
    let token = std::fs::read_to_string(path).with_context(|| format!("read {path}"))?;
    Ok(Some(token.trim().to_owned()))
}
