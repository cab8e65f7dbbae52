//! The inference engines' own load, read from their Prometheus `/metrics`: a leading signal
//! for the controller.
//!
//! Time to first token is a lagging signal. vLLM's KV cache fills as the running sequences
//! decode, so a budget that has just been raised past the KV knee shows no latency for
//! seconds, until the engine starts preempting and queueing; by then the requests admitted
//! under the raised budget are already inside it (docs/lab.md, "the cold start"). The engine's
//! KV-cache usage and waiting queue show the knee before latency does. This is the signal the
//! Gateway API Inference Extension's saturation detector uses (`max(queue / 5, kv / 0.8)`),
//! and tollgate uses it the same way, as a roofline: an engine is saturated when either ratio
//! reaches 1.
//!
//! Pure: `parse` reads one scrape's text, `saturation` combines the engines' loads, both by
//! the names and thresholds of `control.engine`. The scraping is `control::scrape`'s.

use crate::config::EngineMetricsConfig;

/// One engine's load, as one scrape reported it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineLoad {
    /// KV-cache usage, 0 to 1; None if the engine serves none of the names.
    pub kv_cache_usage: Option<f64>,
    /// Requests waiting in the engine's own queue; None if it serves none of the names.
    pub waiting: Option<f64>,
}

/// Reads an engine's load from Prometheus text exposition. Several series of one name (one
/// per served model, say) add up for the waiting queue, and the fullest counts for the KV
/// cache. An error when the text names neither metric: the operator pointed tollgate at the
/// wrong endpoint, or at an engine whose names the configuration does not list.
pub fn parse(text: &str, signal: &EngineMetricsConfig) -> Result<EngineLoad, String> {
    let kv_cache_usage = first_present(text, &signal.kv_cache_usage_metrics, f64::max);
    let waiting = first_present(text, &signal.waiting_metrics, |a, b| a + b);
    if kv_cache_usage.is_none() && waiting.is_none() {
        return Err(format!(
            "none of the metrics {:?} or {:?} is in the scrape",
            signal.kv_cache_usage_metrics, signal.waiting_metrics
        ));
    }
    Ok(EngineLoad {
        kv_cache_usage,
        waiting,
    })
}

/// The first of `names` with at least one finite sample, its samples folded with `combine`.
fn first_present(text: &str, names: &[String], combine: fn(f64, f64) -> f64) -> Option<f64> {
    names.iter().find_map(|name| {
        text.lines()
            .filter_map(|line| sample(line, name))
            .reduce(combine)
    })
}

/// The value of `line` if it is a sample of the metric `name` (`name 1`, `name{a="b"} 1`,
/// optionally followed by a timestamp). Comments, other names, names that merely start with
/// `name`, and values that are not finite numbers are not samples.
fn sample(line: &str, name: &str) -> Option<f64> {
    let rest = line.trim_start().strip_prefix(name)?;
    let rest = match rest.as_bytes().first()? {
        b'{' => &rest[labels_end(rest)?..],
        b' ' | b'\t' => rest,
        _ => return None,
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some(value)
}

/// The index just past the `}` closing the label set `text` starts with. Label values are
/// quoted and may hold `}`, `"` and `\` escaped with `\`.
fn labels_end(text: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (index, byte) in text.bytes().enumerate() {
        match (quoted, escaped, byte) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (_, _, b'"') => quoted = !quoted,
            (false, _, b'}') => return Some(index + 1),
            _ => {}
        }
    }
    None
}

/// How saturated the engines are, by the roofline rule: per engine, the larger of KV usage
/// over its threshold and waiting over its threshold; over the engines, the mean. 1 or more
/// is saturated. The mean because one budget feeds every engine through Envoy's load
/// balancer: the budget moves all of them together, so it should stop growing when they are
/// full on the whole, not when the unluckiest one is. None when no engine answered.
pub fn saturation(loads: &[EngineLoad], signal: &EngineMetricsConfig) -> Option<f64> {
    let per_engine = loads.iter().map(|load| {
        let kv = load
            .kv_cache_usage
            .map_or(0.0, |kv| kv / signal.kv_cache_threshold);
        let queue = load
            .waiting
            .map_or(0.0, |w| w / f64::from(signal.queue_depth_threshold));
        kv.max(queue)
    });
    let count = loads.len();
    (count > 0).then(|| per_engine.sum::<f64>() / count as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's names; thresholds KV 0.9, 5 waiting (the defaults, spelled out: the tables
    /// below depend on them).
    fn vllm() -> EngineMetricsConfig {
        EngineMetricsConfig {
            kv_cache_threshold: 0.9,
            queue_depth_threshold: 5,
            ..EngineMetricsConfig::default()
        }
    }

    #[test]
    fn parse_reads_the_first_name_present_in_prometheus_text() {
        let v1 = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
                  # TYPE vllm:num_requests_waiting gauge\n\
                  vllm:num_requests_waiting{model_name=\"m\"} 3.0\n\
                  vllm:kv_cache_usage_perc{model_name=\"m\"} 0.42\n\
                  vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.99\n";
        let older = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n\
                     vllm:num_requests_waiting 0\n";
        let two_models = "vllm:num_requests_waiting{model_name=\"a\"} 2\n\
                          vllm:num_requests_waiting{model_name=\"b\"} 5 1700000000000\n\
                          vllm:kv_cache_usage_perc{model_name=\"a\"} 0.3\n\
                          vllm:kv_cache_usage_perc{model_name=\"b\"} 0.7\n";
        let lookalikes = "vllm:num_requests_waiting_total 9\n\
                          vllm:num_requests_waiting{model_name=\"m\"} NaN\n\
                          # vllm:kv_cache_usage_perc 0.9\n\
                          vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
                          vllm:kv_cache_usage_perc{model_name=\"m\" 0.25\n";
        let quoted = "vllm:kv_cache_usage_perc{model_name=\"a}\\\"b\"} 0.25\n";
        let table: [(&str, Option<f64>, Option<f64>); 5] = [
            // The deprecated name is ignored when the current one is there.
            (v1, Some(0.42), Some(3.0)),
            (older, Some(0.5), Some(0.0)),
            // The fullest model's KV cache; the queues add up; a timestamp is not the value.
            (two_models, Some(0.7), Some(7.0)),
            // A longer name, a NaN, a comment and a broken label set are not samples.
            (lookalikes, Some(0.25), None),
            // A `}` and an escaped quote inside a label value do not end the label set.
            (quoted, Some(0.25), None),
        ];
        for (text, kv, waiting) in table {
            let parsed = parse(text, &vllm());
            match (kv, waiting) {
                (None, None) => assert!(parsed.is_err(), "{text}: {parsed:?}"),
                _ => assert_eq!(
                    parsed,
                    Ok(EngineLoad {
                        kv_cache_usage: kv,
                        waiting
                    }),
                    "{text}"
                ),
            }
        }
    }

    #[test]
    fn parse_names_what_it_looked_for_when_nothing_matches() {
        let error = parse("tgi_queue_size 3\n", &vllm()).unwrap_err();
        assert!(
            error.contains("vllm:kv_cache_usage_perc")
                && error.contains("vllm:num_requests_waiting"),
            "{error}"
        );
        // Another engine's names, once configured, are read the same way.
        let tgi = EngineMetricsConfig {
            kv_cache_usage_metrics: vec![],
            waiting_metrics: vec!["tgi_queue_size".to_owned()],
            ..vllm()
        };
        assert_eq!(
            parse("tgi_queue_size 3\n", &tgi),
            Ok(EngineLoad {
                kv_cache_usage: None,
                waiting: Some(3.0)
            })
        );
    }

    #[test]
    fn saturation_is_the_mean_of_each_engines_larger_ratio() {
        let load = |kv: Option<f64>, waiting: Option<f64>| EngineLoad {
            kv_cache_usage: kv,
            waiting,
        };
        let table: [(&[EngineLoad], Option<f64>); 6] = [
            (&[], None),
            (&[load(Some(0.45), Some(0.0))], Some(0.5)),
            // Either ratio alone saturates.
            (&[load(Some(0.9), Some(0.0))], Some(1.0)),
            (&[load(Some(0.1), Some(10.0))], Some(2.0)),
            // A missing series counts as no load on that axis.
            (&[load(None, Some(5.0))], Some(1.0)),
            // One full engine and one idle one: half saturated on the whole.
            (
                &[load(Some(0.9), Some(0.0)), load(Some(0.0), Some(0.0))],
                Some(0.5),
            ),
        ];
        for (loads, expected) in table {
            let got = saturation(loads, &vllm());
            match (got, expected) {
                (Some(got), Some(expected)) => {
                    assert!((got - expected).abs() < 1e-9, "{loads:?}: {got}")
                }
                _ => assert_eq!(got, expected, "{loads:?}"),
            }
        }
    }
}
