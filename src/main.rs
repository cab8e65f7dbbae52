//! The `tollgate` binary: parses the command line, loads the configuration and calls
//! `tollgate::run`. Nothing else lives here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tollgate::config::{self, Config};
use tollgate::policy::Policy;

/// jemalloc, not glibc's malloc: a decision allocates and frees on every worker (a body of a few
/// KiB, headers, answers), and glibc's malloc, free and realloc, behind arenas the workers lock,
/// were 13 % of its CPU, jemalloc's 3 % (docs/benchmarks.md, "The allocator").
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Fair, fast admission control for shared LLM inference behind Envoy ext_proc.
#[derive(Parser)]
#[command(name = "tollgate", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// YAML configuration file (defaults are built in; TOLLGATE__SECTION__KEY variables
    /// override the file, and these flags override both).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// ext_proc gRPC listen address [default: 0.0.0.0:50051].
    #[arg(long, value_name = "ADDR")]
    grpc_addr: Option<SocketAddr>,
    /// Admin HTTP listen address (/metrics, /healthz, /readyz) [default: 0.0.0.0:9464].
    #[arg(long, value_name = "ADDR")]
    admin_addr: Option<SocketAddr>,
    /// Keep budgets in this Redis (redis://...), shared by every replica [default: the
    /// embedded in-memory store].
    #[arg(long, value_name = "URL")]
    redis_url: Option<String>,
    /// Threads the async runtime runs streams on [default: TOKIO_WORKER_THREADS if set, else
    /// the CPUs this process may use: its CPU affinity and cgroup quota, which without a CPU
    /// limit is every core of the node]. Threads beyond what the load keeps busy cost CPU per
    /// decision: work is handed between them, and idle ones sleep and are woken
    /// (docs/benchmarks.md, "Worker threads").
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=config::MAX_WORKER_THREADS as i64))]
    worker_threads: Option<u16>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a configuration file and exit (status 0 if valid, 2 if not).
    CheckConfig {
        /// The file to check.
        file: PathBuf,
    },
    /// Print the effective configuration (defaults, file, environment and flags applied).
    PrintConfig,
}

/// Exit status for an unusable configuration, as for a usage error.
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    let file = match &cli.command {
        Some(Command::CheckConfig { file }) => Some(file.clone()),
        _ => cli.config.clone(),
    };
    // The runtime's thread count is read for check-config too, so a variable the start would
    // refuse fails the check, named with the file's problems; print-config prints the
    // configuration only, which does not hold it.
    let worker_threads = match cli.command {
        Some(Command::PrintConfig) => Ok(None),
        _ => runtime_worker_threads(&cli),
    };
    let ((config, policy), worker_threads) =
        match (effective_config(&cli, file.as_deref()), worker_threads) {
            (Ok(checked), Ok(threads)) => (checked, threads),
            (checked, threads) => {
                let problems: Vec<String> = [checked.err(), threads.err()]
                    .into_iter()
                    .flatten()
                    .map(|e| e.to_string())
                    .collect();
                eprintln!("tollgate: invalid configuration:\n{}", problems.join("\n"));
                return ExitCode::from(EXIT_CONFIG);
            }
        };
    match cli.command {
        Some(Command::CheckConfig { file }) => {
            println!("{}: ok", file.display());
            // The models' own tokenizers it loaded, with the memory each took; what it warns of
            // does not change the exit status.
            for loaded in &policy.counting.tokenizers {
                println!("{loaded}");
            }
            for warning in policy.warnings() {
                println!("warning: {warning}");
            }
            ExitCode::SUCCESS
        }
        Some(Command::PrintConfig) => {
            // JSON is valid YAML, so the output can be fed back with --config.
            match serde_json::to_string_pretty(&config) {
                Ok(text) => {
                    println!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("tollgate: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        None => {
            // Only when serving: `check-config` and `print-config` may run where the Secret
            // holding the password is not mounted.
            if let Err(e) = check_password_file(&config.store) {
                eprintln!("tollgate: invalid configuration:\n{e}");
                return ExitCode::from(EXIT_CONFIG);
            }
            let flags = Flags::of(&cli);
            let file = cli.config.clone();
            let reload = tollgate::Reload {
                file: file.clone(),
                load: std::sync::Arc::new(move || layered_config(&flags, file.as_deref())),
                #[cfg(unix)]
                hangups: None,
            };
            serve(config, reload, worker_threads)
        }
    }
}

/// A Redis password file that cannot be read is a configuration error (exit status 2), found
/// before anything starts rather than as a server error.
fn check_password_file(store: &config::StoreConfig) -> Result<(), config::ConfigError> {
    match (&store.redis_url, &store.redis_password_file) {
        (Some(_), Some(path)) => std::fs::read_to_string(path).map(drop).map_err(|e| {
            config::ConfigError(format!(
                "store.redis_password_file: cannot read {path}: {e}"
            ))
        }),
        _ => Ok(()),
    }
}

/// The flags that override the configuration file and the environment.
#[derive(Clone)]
struct Flags {
    grpc_addr: Option<SocketAddr>,
    admin_addr: Option<SocketAddr>,
    redis_url: Option<String>,
}

impl Flags {
    fn of(cli: &Cli) -> Flags {
        Flags {
            grpc_addr: cli.grpc_addr,
            admin_addr: cli.admin_addr,
            redis_url: cli.redis_url.clone(),
        }
    }
}

/// The configuration from every layer: defaults, file, environment, flags. A reload reads it
/// again the same way.
fn layered_config(
    flags: &Flags,
    file: Option<&std::path::Path>,
) -> Result<Config, config::ConfigError> {
    let mut config = config::load(file, std::env::vars())?;
    if let Some(addr) = flags.grpc_addr {
        config.listen.grpc_addr = addr.to_string();
    }
    if let Some(addr) = flags.admin_addr {
        config.listen.admin_addr = addr.to_string();
    }
    if let Some(url) = &flags.redis_url {
        config.store.redis_url = Some(url.clone());
    }
    Ok(config)
}

/// The runtime's worker threads: the flag, else `TOKIO_WORKER_THREADS`, else `None` (tokio's
/// default). The flag wins, and the variable it overrides is not read. tokio reads the variable
/// itself when no count is given, and panics on a bad one: it is read here first.
fn runtime_worker_threads(cli: &Cli) -> Result<Option<u16>, config::ConfigError> {
    match cli.worker_threads {
        Some(threads) => Ok(Some(threads)),
        None => {
            let variable = std::env::var_os(config::TOKIO_WORKER_THREADS);
            config::worker_threads_variable(variable.as_deref())
        }
    }
}

/// The configuration from every layer, and the policy it validates into.
fn effective_config(
    cli: &Cli,
    file: Option<&std::path::Path>,
) -> Result<(Config, Policy), config::ConfigError> {
    let config = layered_config(&Flags::of(cli), file)?;
    let policy = Policy::from_config(&config)?;
    Ok((config, policy))
}

fn serve(config: Config, reload: tollgate::Reload, worker_threads: Option<u16>) -> ExitCode {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads {
        builder.worker_threads(threads.into());
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tollgate: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        // SIGHUP's default action ends the process: handle it from here on, before the slow
        // parts of start-up (a model's tokenizer takes a second to build).
        #[cfg(unix)]
        let mut reload = reload;
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            reload.hangups = signal(SignalKind::hangup()).ok();
        }
        let bind = |addr: String| async move {
            tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))
        };
        let listeners = match (
            bind(config.listen.grpc_addr.clone()).await,
            bind(config.listen.admin_addr.clone()).await,
        ) {
            (Ok(grpc), Ok(admin)) => tollgate::Listeners { grpc, admin },
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("tollgate: {e}");
                return ExitCode::FAILURE;
            }
        };
        for (name, listener) in [
            ("ext_proc gRPC", &listeners.grpc),
            ("admin HTTP", &listeners.admin),
        ] {
            if let Ok(addr) = listener.local_addr() {
                tracing::info!(%addr, "{name} listening");
            }
        }
        match tollgate::run(config, listeners, shutdown_signal(), Some(reload)).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e @ tollgate::Error::Config(_)) => {
                eprintln!("tollgate: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
            Err(e) => {
                eprintln!("tollgate: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// SIGTERM (Kubernetes) or SIGINT (a terminal).
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(e) => {
                    tracing::warn!("cannot watch SIGTERM ({e}); only SIGINT stops tollgate");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
