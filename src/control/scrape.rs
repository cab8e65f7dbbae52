//! Fetches the engines' `/metrics` once per controller tick: the I/O half of `engine`.
//!
//! Off the request path: one GET per engine per tick, all engines at once, each bounded by
//! `scrape_timeout_ms` so a hung engine delays a tick by at most that. An engine that does not
//! answer, answers with an error, or serves none of the configured metrics is left out of the
//! tick's saturation; when none answers, the controller runs on latency alone for that tick.
//! The first failure of a run of failures is logged, and every scrape is counted
//! (`tollgate_engine_scrapes_total`), so a wrong URL shows on the dashboard rather than as a
//! controller that silently ignores the engines.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::engine::{self, EngineLoad, EngineSignal};
use crate::config::EngineMetricsConfig;

/// vLLM serves about 100 KB of metrics with its histograms; a body past this is not an
/// engine's metrics page.
const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// One tick's scrape of every engine.
#[derive(Debug, Default)]
pub struct Scrape {
    /// The engines that answered with their load.
    pub loads: Vec<EngineLoad>,
    /// How many did not.
    pub failures: usize,
}

pub struct Scraper {
    client: Client<HttpConnector, Empty<Bytes>>,
    urls: Vec<Uri>,
    timeout: Duration,
    signal: EngineSignal,
    /// Per URL: whether its last scrape failed, so a run of failures is logged once.
    failing: Vec<bool>,
}

impl Scraper {
    /// None when no engine is configured. The URLs were validated with the configuration
    /// (`uri`), so this cannot fail on a checked config.
    pub fn new(config: &EngineMetricsConfig) -> Option<Scraper> {
        if config.metrics_urls.is_empty() {
            return None;
        }
        let urls: Vec<Uri> = config
            .metrics_urls
            .iter()
            .filter_map(|url| uri(url).ok())
            .collect();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(config.scrape_timeout_ms)));
        Some(Scraper {
            client: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1)
                .build(connector),
            failing: vec![false; urls.len()],
            urls,
            timeout: Duration::from_millis(config.scrape_timeout_ms),
            signal: signal(config),
        })
    }

    pub fn signal(&self) -> &EngineSignal {
        &self.signal
    }

    /// Every engine, concurrently.
    pub async fn scrape(&mut self) -> Scrape {
        let (client, signal, timeout) = (&self.client, &self.signal, self.timeout);
        let results = futures_util::future::join_all(self.urls.iter().map(|url| async move {
            tokio::time::timeout(timeout, fetch(client, url.clone()))
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
                .and_then(|text| engine::parse(&text, signal))
        }))
        .await;
        let mut scrape = Scrape::default();
        for ((url, failing), result) in self.urls.iter().zip(&mut self.failing).zip(results) {
            match result {
                Ok(load) => {
                    if *failing {
                        tracing::info!(%url, "engine metrics: answering again");
                    }
                    *failing = false;
                    scrape.loads.push(load);
                }
                Err(error) => {
                    if !*failing {
                        tracing::warn!(
                            %url,
                            %error,
                            "engine metrics: scrape failed; the controller leaves this engine \
                             out until it answers"
                        );
                    }
                    *failing = true;
                    scrape.failures += 1;
                }
            }
        }
        scrape
    }
}

async fn fetch(client: &Client<HttpConnector, Empty<Bytes>>, url: Uri) -> Result<String, String> {
    let response = client.get(url).await.map_err(|e| e.to_string())?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("HTTP {status}"));
    }
    let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    String::from_utf8(body.into()).map_err(|_| "the body is not UTF-8".to_owned())
}

/// The engine signal's settings from the configuration.
pub fn signal(config: &EngineMetricsConfig) -> EngineSignal {
    EngineSignal {
        kv_cache_usage_metrics: config.kv_cache_usage_metrics.clone(),
        waiting_metrics: config.waiting_metrics.clone(),
        kv_cache_threshold: config.kv_cache_threshold,
        queue_depth_threshold: config.queue_depth_threshold,
    }
}

/// A metrics URL, checked: plain `http://` with a host (the engines' metrics are served
/// in-cluster, and a TLS client is not worth its weight here).
pub fn uri(url: &str) -> Result<Uri, String> {
    const FORM: &str = "must be http://HOST[:PORT]/PATH (https is not supported)";
    let uri: Uri = url.parse().map_err(|e| format!("{FORM}: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.host().is_none_or(str::is_empty) {
        return Err(FORM.to_owned());
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_accepts_plain_http_with_a_host_only() {
        for good in [
            "http://10.0.0.7:8000/metrics",
            "http://vllm/metrics",
            "http://[::1]:9/",
        ] {
            assert!(uri(good).is_ok(), "{good}");
        }
        for bad in [
            "https://vllm/metrics",
            "vllm:8000/metrics",
            "/metrics",
            "http://",
            "not a url",
        ] {
            let error = uri(bad).unwrap_err();
            assert!(error.starts_with("must be http://HOST"), "{bad}: {error}");
        }
    }
}
