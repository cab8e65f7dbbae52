//! What every benchmark's `main` does: run to the end or until Ctrl-C or SIGTERM, stopping its
//! children either way; and the median and percentiles its reports are made of.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, anyhow};

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

/// The median (NaN for no values); sorts `values`.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The nearest-rank percentile of sorted values (`q` in 0..=1); `None` for no values.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
}

/// A request body whose every copy is a different text: `SerialNumbered::PLACEHOLDER` in it
/// (put it where the body has no other digits) becomes the copy's serial number. tollgate keeps
/// the counts of texts that come back (`tokens::count_cache`); a benchmark that sent one body
/// over and over would measure that cache, not counting.
pub struct SerialNumbered {
    body: Vec<u8>,
    serial_at: std::ops::Range<usize>,
    next_serial: std::sync::atomic::AtomicU64,
}

impl SerialNumbered {
    /// Digits of the serial number: more than any run sends requests.
    pub const PLACEHOLDER: &'static str = "000000000000";

    /// `body`, which holds `PLACEHOLDER` once (its first occurrence is the one stamped).
    pub fn new(body: Vec<u8>) -> Result<SerialNumbered> {
        let digits = Self::PLACEHOLDER.len();
        let at = body
            .windows(digits)
            .position(|window| window == Self::PLACEHOLDER.as_bytes())
            .ok_or_else(|| {
                anyhow!(
                    "the body has no {} for its serial number",
                    Self::PLACEHOLDER
                )
            })?;
        Ok(SerialNumbered {
            body,
            serial_at: at..at + digits,
            next_serial: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A copy of the body with the next serial number (shared by every caller).
    pub fn next(&self) -> Vec<u8> {
        let serial = self
            .next_serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let digits = format!("{serial:0width$}", width = Self::PLACEHOLDER.len());
        let mut body = self.body.clone();
        body[self.serial_at.clone()].copy_from_slice(&digits.as_bytes()[..self.serial_at.len()]);
        body
    }
}
