//! Fetches the engines' `/metrics` once per controller tick: the I/O half of `engine`.
//!
//! Off the request path: one GET per engine per tick, all engines at once, all within
//! `scrape_timeout_ms` so a hung engine delays a tick by at most that. A URL's host is
//! resolved every tick and each address it resolves to is an engine, so one URL naming a
//! Kubernetes headless Service follows the engines as they scale. An engine that does not
//! answer, answers with an error, or serves none of the configured metrics is left out of the
//! tick's saturation; when none answers, the controller runs on latency alone for that tick.
//! The first failure of a run of failures is logged, and every scrape is counted
//! (`tollgate_engine_scrapes_total`), so a wrong URL shows on the dashboard rather than as a
//! controller that silently ignores the engines.
//!
//! Name lookups go through the system resolver on tokio's blocking pool, and a lookup cannot
//! be cancelled: one that outlives its tick keeps its thread until the resolver gives up,
//! which with an unreachable DNS server and a cluster's search domains can take a minute. So
//! each URL has at most one lookup in flight; a tick that finds the last one still running
//! waits for it (within the tick's timeout) instead of starting another. Otherwise every tick
//! would add a stuck thread per URL to the pool that also counts large request bodies.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::header::HOST;
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::engine::{self, EngineLoad};
use crate::config::EngineMetricsConfig;
use crate::observe::{EngineReading, EngineScrape, Metrics};

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

impl EngineScrape for Scrape {
    fn failures(&self) -> usize {
        self.failures
    }

    fn loads(&self) -> impl Iterator<Item = EngineReading> {
        self.loads.iter().map(|load| EngineReading {
            kv_cache_usage: load.kv_cache_usage,
            waiting: load.waiting,
        })
    }
}

/// A host name lookup: every address `(name, port)` resolves to.
type Lookup = Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>>;
type Resolver = fn(String, u16) -> Lookup;

/// The system resolver, through tokio (IP literals are parsed, not looked up).
fn system_resolver(name: String, port: u16) -> Lookup {
    Box::pin(async move {
        Ok(tokio::net::lookup_host((name.as_str(), port))
            .await?
            .collect())
    })
}

/// A name lookup's task.
type LookupTask = JoinHandle<std::io::Result<Vec<SocketAddr>>>;

pub struct Scraper {
    client: Client<HttpConnector, Empty<Bytes>>,
    targets: Vec<Target>,
    /// The metric names and the timeout the scrapes are read and bounded by.
    config: EngineMetricsConfig,
    resolver: Resolver,
}

/// One configured URL, and what is kept for it from one tick to the next.
struct Target {
    url: Uri,
    /// Whether its last scrape failed, so a run of failures is logged once.
    failing: bool,
    /// Its name lookup, while one is in flight (at most one; see the module docs).
    lookup: Option<LookupTask>,
}

impl Scraper {
    /// None when no engine is configured. The URLs were validated with the configuration
    /// (`uri`), so this cannot fail on a checked config.
    pub fn new(config: &EngineMetricsConfig) -> Option<Scraper> {
        if config.metrics_urls.is_empty() {
            return None;
        }
        let targets = config
            .metrics_urls
            .iter()
            .filter_map(|url| uri(url).ok())
            .map(|url| Target {
                url,
                failing: false,
                lookup: None,
            })
            .collect();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(config.scrape_timeout_ms)));
        Some(Scraper {
            client: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1)
                .build(connector),
            targets,
            config: config.clone(),
            resolver: system_resolver,
        })
    }

    /// Scrapes every engine and returns their saturation (`engine::saturation`, None if none
    /// answered), having recorded the scrape in `metrics`: what a controller's tick reads.
    pub async fn saturation(&mut self, metrics: &Metrics) -> Option<f64> {
        let scrape = self.scrape().await;
        let saturation = engine::saturation(&scrape.loads, &self.config);
        metrics.engine_scrape(&scrape, saturation);
        saturation
    }

    /// Every engine, concurrently, within the timeout.
    pub async fn scrape(&mut self) -> Scrape {
        let (client, signal, resolver) = (&self.client, &self.config, self.resolver);
        let timeout = Duration::from_millis(signal.scrape_timeout_ms);
        let deadline = Instant::now() + timeout;
        let results = futures_util::future::join_all(
            self.targets
                .iter_mut()
                .map(|target| target.scrape(client, resolver, signal, deadline, timeout)),
        )
        .await;
        let mut scrape = Scrape::default();
        for (target, results) in self.targets.iter_mut().zip(results) {
            let mut first_error = None;
            for result in results {
                match result {
                    Ok(load) => scrape.loads.push(load),
                    Err(error) => {
                        scrape.failures += 1;
                        first_error.get_or_insert(error);
                    }
                }
            }
            let url = &target.url;
            match &first_error {
                None if target.failing => tracing::info!(%url, "engine metrics: answering again"),
                Some(error) if !target.failing => tracing::warn!(
                    %url,
                    %error,
                    "engine metrics: scrape failed; the controller leaves the engines that do \
                     not answer out until they do"
                ),
                _ => {}
            }
            target.failing = first_error.is_some();
        }
        scrape
    }
}

impl Target {
    /// Every address the URL's host resolves to: one result per engine, or one error if the
    /// name does not resolve. A lookup the last tick left running is waited on, not repeated.
    async fn scrape(
        &mut self,
        client: &Client<HttpConnector, Empty<Bytes>>,
        resolver: Resolver,
        signal: &EngineMetricsConfig,
        deadline: Instant,
        timeout: Duration,
    ) -> Vec<Result<EngineLoad, String>> {
        let late = || format!("no answer within {timeout:?}");
        let url = &self.url;
        let host = url.host().unwrap_or_default();
        let port = url.port_u16().unwrap_or(80);
        // An IPv6 literal comes bracketed in the URL and must not be for the resolver.
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let running = self
            .lookup
            .get_or_insert_with(|| tokio::spawn(resolver(name.to_owned(), port)));
        let resolved = match tokio::time::timeout_at(deadline, running).await {
            // Still running: it stays in `lookup` for the next tick to wait on.
            Err(_) => return vec![Err(format!("resolving {name}: {}", late()))],
            Ok(resolved) => resolved,
        };
        self.lookup = None;
        let addresses = match resolved {
            Ok(Ok(addresses)) => engines(addresses.into_iter()),
            Ok(Err(error)) => return vec![Err(format!("cannot resolve {name}: {error}"))],
            Err(error) => return vec![Err(format!("resolving {name}: {error}"))],
        };
        if addresses.is_empty() {
            // A headless Service with no ready pod: no engine to read, and worth saying so.
            return vec![Err(format!("{name} resolves to no address"))];
        }
        let path = url.path_and_query().map_or("/", |p| p.as_str());
        let authority = url.authority().map_or(host, |a| a.as_str());
        futures_util::future::join_all(addresses.into_iter().map(|address| async move {
            let direct: Uri = format!("http://{address}{path}")
                .parse()
                .map_err(|e| format!("{e}"))?;
            tokio::time::timeout_at(deadline, fetch(client, direct, authority))
                .await
                .unwrap_or_else(|_| Err(late()))
                .and_then(|text| engine::parse(&text, signal))
                .map_err(|error| format!("{address}: {error}"))
        }))
        .await
    }
}

/// The engines behind a name's addresses: each address once, and only those of the family
/// the resolver lists first. A dual-stack headless Service lists every pod under both
/// families; scraping both would count each pod twice, or half of them as failures where the
/// engine listens on one family only.
fn engines(addresses: impl Iterator<Item = SocketAddr>) -> Vec<SocketAddr> {
    let mut engines: Vec<SocketAddr> = Vec::new();
    for address in addresses {
        let same_family = engines
            .first()
            .is_none_or(|first| first.is_ipv4() == address.is_ipv4());
        if same_family && !engines.contains(&address) {
            engines.push(address);
        }
    }
    engines
}

/// GET `url` (an address), as `authority` (the name the engine was configured by).
async fn fetch(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: Uri,
    authority: &str,
) -> Result<String, String> {
    let request = Request::get(url)
        .header(HOST, authority)
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let response = client.request(request).await.map_err(|e| e.to_string())?;
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

/// A metrics URL, checked: plain `http://` with a host (the engines' metrics are served
/// in-cluster, and a TLS client is not worth its weight here).
pub fn uri(url: &str) -> Result<Uri, String> {
    const FORM: &str = "must be http://HOST[:PORT]/PATH (https is not supported)";
    let uri: Uri = url.parse().map_err(|e| format!("{FORM}: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.host().is_none_or(str::is_empty) {
        return Err(FORM.to_owned());
    }
    // It would be sent on as the Host header, and the engines' metrics take no credentials.
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(format!("{FORM}, without credentials"));
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves vLLM's KV-cache series on `listener`, only to requests that name `host` in
    /// their Host header.
    fn serve(listener: tokio::net::TcpListener, host: String, kv: f64) {
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move |headers: hyper::HeaderMap| async move {
                match headers.get(HOST).and_then(|h| h.to_str().ok()) {
                    Some(got) if got == host => Ok(format!(
                        "vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv}\n"
                    )),
                    _ => Err(hyper::StatusCode::MISDIRECTED_REQUEST),
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
    }

    #[tokio::test]
    async fn each_address_a_name_resolves_to_is_an_engine_asked_by_that_name() {
        let v4 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = v4.local_addr().unwrap().port();
        let host = format!("localhost:{port}");
        serve(v4, host.clone(), 0.5);
        // Where the machine has IPv6 loopback, an engine there too, on the same port.
        let v6_served = match tokio::net::TcpListener::bind(("::1", port)).await {
            Ok(v6) => {
                serve(v6, host.clone(), 0.7);
                true
            }
            Err(_) => false,
        };
        let config = EngineMetricsConfig {
            metrics_urls: vec![format!("http://{host}/metrics")],
            // Generous: this test is about which addresses are asked, not about time.
            scrape_timeout_ms: 5_000,
            ..EngineMetricsConfig::default()
        };
        let mut scraper = Scraper::new(&config).unwrap();
        let expected = engines(tokio::net::lookup_host(("localhost", port)).await.unwrap());
        assert!(!expected.is_empty());
        let scrape = scraper.scrape().await;
        // One engine per address of the first family, each asked once; every one with a
        // server behind it answers, which it does only when asked as `localhost:PORT`.
        assert_eq!(
            scrape.loads.len() + scrape.failures,
            expected.len(),
            "{expected:?}"
        );
        let served = expected.iter().filter(|a| a.is_ipv4() || v6_served).count();
        // Otherwise nothing answered and the Host check below would prove nothing.
        assert!(
            served > 0,
            "no engine listens on localhost's first family: {expected:?}"
        );
        assert_eq!(scrape.loads.len(), served, "{expected:?}: {scrape:?}");
    }

    #[test]
    fn a_dual_stack_name_is_read_once_per_engine_in_the_first_family() {
        let address = |text: &str| text.parse::<SocketAddr>().unwrap();
        let resolved = [
            "[fd00::1]:8000",
            "10.0.0.1:8000",
            "[fd00::2]:8000",
            "[fd00::1]:8000",
            "10.0.0.2:8000",
        ]
        .map(address);
        assert_eq!(
            engines(resolved.into_iter()),
            [address("[fd00::1]:8000"), address("[fd00::2]:8000")]
        );
        assert_eq!(
            engines(resolved[1..].iter().copied()),
            [address("10.0.0.1:8000"), address("10.0.0.2:8000")]
        );
        assert!(engines(std::iter::empty()).is_empty());
    }

    #[tokio::test]
    async fn an_engine_that_does_not_answer_is_a_failure_within_the_timeout() {
        let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let unresolvable = "http://tollgate-test.invalid/metrics".to_owned();
        let config = EngineMetricsConfig {
            metrics_urls: vec![
                format!("http://{}/metrics", hung.local_addr().unwrap()),
                unresolvable,
            ],
            scrape_timeout_ms: 100,
            ..EngineMetricsConfig::default()
        };
        let mut scraper = Scraper::new(&config).unwrap();
        let started = Instant::now();
        let scrape = scraper.scrape().await;
        assert_eq!((scrape.loads.len(), scrape.failures), (0, 2));
        let failing: Vec<bool> = scraper
            .targets
            .iter()
            .map(|target| target.failing)
            .collect();
        assert_eq!(failing, [true, true]);
        // Generous: the bound is the timeout, the margin is for a loaded machine.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        drop(hung);
    }

    static LOOKUPS_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A resolver that takes 250 ms (in paused time) and finds no address.
    fn slow_resolver(_name: String, _port: u16) -> Lookup {
        LOOKUPS_STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async {
            tokio::time::sleep(Duration::from_millis(250)).await;
            Ok(Vec::new())
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_lookup_that_outlives_its_tick_is_waited_on_not_started_again() {
        let config = EngineMetricsConfig {
            metrics_urls: vec!["http://vllm-engines:8000/metrics".to_owned()],
            scrape_timeout_ms: 100,
            ..EngineMetricsConfig::default()
        };
        let mut scraper = Scraper::new(&config).unwrap();
        scraper.resolver = slow_resolver;
        let started = || LOOKUPS_STARTED.load(std::sync::atomic::Ordering::SeqCst);
        let late = "resolving vllm-engines: no answer within 100ms";
        // Each row is one tick: how many lookups were ever started after it, and its error.
        let ticks = [
            (1, late),
            (1, late),
            // The first lookup ends 250 ms in, during this tick, which takes its answer.
            (1, "vllm-engines resolves to no address"),
            // That lookup is over, so this tick starts the second.
            (2, late),
        ];
        for (tick, (lookups, error)) in ticks.into_iter().enumerate() {
            let timeout = Duration::from_millis(config.scrape_timeout_ms);
            let results = scraper.targets[0]
                .scrape(
                    &scraper.client,
                    scraper.resolver,
                    &config,
                    Instant::now() + timeout,
                    timeout,
                )
                .await;
            assert_eq!(started(), lookups, "tick {tick}");
            assert_eq!(results.len(), 1, "tick {tick}");
            assert_eq!(results[0].as_ref().unwrap_err(), error, "tick {tick}");
        }
        // `scrape` keeps the lookup in flight for its next tick too.
        let scrape = scraper.scrape().await;
        assert_eq!((scrape.loads.len(), scrape.failures), (0, 1));
        assert!(scraper.targets[0].lookup.is_some());
        assert_eq!(started(), 2);
    }

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
            "http://user:secret@vllm:8000/metrics",
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
