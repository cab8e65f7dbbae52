//! A Prometheus text exposition (`/metrics`) scraped, looked up, and waited on.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// How long [`wait_for_metric`] waits: metrics move within milliseconds of what they count; the
/// margin is for a 2-core machine that is also compiling.
const METRIC_TIMEOUT: Duration = Duration::from_secs(10);

/// The Prometheus text exposition, with lookups.
pub struct Metrics(pub String);

impl Metrics {
    /// The value of the series `name{labels}` (labels as written, e.g. `outcome="admitted"`, in
    /// any order).
    ///
    /// # Panics
    /// When the series does not exist (tollgate pre-creates every series, so a missing one is a
    /// test failure).
    pub fn value(&self, name: &str, labels: &[&str]) -> f64 {
        self.find(name, labels)
            .unwrap_or_else(|| panic!("no series {name}{labels:?} in:\n{}", self.0))
    }

    /// The value of the first series `name{...}` that carries `labels`, if there is one.
    pub fn find(&self, name: &str, labels: &[&str]) -> Option<f64> {
        self.series(name, labels).next()
    }

    /// The sum over every series `name{...}` that carries `labels` (e.g. a gauge over all
    /// tiers); 0 when there is none.
    pub fn sum(&self, name: &str, labels: &[&str]) -> f64 {
        self.series(name, labels).sum()
    }

    /// Like [`Metrics::sum`], `None` when no series matches (a server without the metric).
    pub fn sum_if_any(&self, name: &str, labels: &[&str]) -> Option<f64> {
        let mut values = self.series(name, labels).peekable();
        values.peek()?;
        Some(values.sum())
    }

    fn series<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [&'a str],
    ) -> impl Iterator<Item = f64> + 'a {
        self.0.lines().filter_map(move |line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            (series_name == name
                && labels
                    .iter()
                    .all(|l| series_labels.split(',').any(|s| s == *l)))
            .then(|| value.parse().ok())
            .flatten()
        })
    }
}

/// One scrape of `http://<admin>/metrics`.
pub async fn scrape(admin: SocketAddr) -> Result<Metrics> {
    let url = format!("http://{admin}/metrics");
    let text = crate::loopback_client()?
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("GET {url}"))?
        .text()
        .await
        .with_context(|| format!("read {url}"))?;
    Ok(Metrics(text))
}

/// Scrapes `admin` every 20 ms until `name{labels}` equals `want`, and returns that scrape;
/// fails with the last value after 10 s.
pub async fn wait_for_metric(
    admin: SocketAddr,
    name: &str,
    labels: &[&str],
    want: f64,
) -> Result<Metrics> {
    wait_for_metrics(admin, |metrics| {
        let last = metrics.find(name, labels);
        (last == Some(want))
            .then_some(())
            .ok_or_else(|| format!("{name}{labels:?} never reached {want}; last {last:?}"))
    })
    .await
}

/// Scrapes `admin` every 20 ms until `ready` accepts a scrape, and returns that scrape; after
/// 10 s fails with what `ready` said of the last one.
pub async fn wait_for_metrics(
    admin: SocketAddr,
    ready: impl Fn(&Metrics) -> Result<(), String>,
) -> Result<Metrics> {
    let deadline = tokio::time::Instant::now() + METRIC_TIMEOUT;
    loop {
        let metrics = scrape(admin).await?;
        match ready(&metrics) {
            Ok(()) => return Ok(metrics),
            Err(last) if tokio::time::Instant::now() >= deadline => {
                bail!("{last} (waited {METRIC_TIMEOUT:?})")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
