//! The Envoy configs under `envoy/` and the filters and clusters the EnvoyFilters under `istio/`
//! patch in: tollgate's ext_proc contract, and `envoy --mode validate` on real Envoy.

use serde_json::{Value, json};

use super::manifests::{
    TollgateContainer, all_of, build, container, container_port, duration_ms, effective_config,
    one, port_of, prod, prod_config, selects, yaml_file,
};
use crate::envoy_config::{VALIDATED_ENVOY_VERSIONS, envoy_validate};

const EXT_PROC: &str = "envoy.filters.http.ext_proc";

const EXT_PROC_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor";

const HCM: &str = "envoy.filters.network.http_connection_manager";

const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

const ROUTER: &str = "envoy.filters.http.router";

/// Checks an ext_proc filter against tollgate's contract with Envoy; returns the problems.
fn ext_proc_problems(
    what: &str,
    filter: &Value,
    response_phases: bool,
    config: &Value,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut expect = |field: &str, got: &Value, want: Value| {
        if *got != want {
            problems.push(format!("{what}: {field} is {got}, expected {want}"));
        }
    };
    expect("name", &filter["name"], json!(EXT_PROC));
    let tc = &filter["typed_config"];
    expect("@type", &tc["@type"], json!(EXT_PROC_TYPE));
    let mode = &tc["processing_mode"];
    expect(
        "request_header_mode",
        &mode["request_header_mode"],
        json!("SEND"),
    );
    expect(
        "request_body_mode",
        &mode["request_body_mode"],
        json!("BUFFERED"),
    );
    expect(
        "request_trailer_mode",
        &mode["request_trailer_mode"],
        json!("SKIP"),
    );
    let (headers, body) = if response_phases {
        ("SEND", "STREAMED")
    } else {
        ("SKIP", "NONE")
    };
    expect(
        "response_header_mode",
        &mode["response_header_mode"],
        json!(headers),
    );
    expect(
        "response_body_mode",
        &mode["response_body_mode"],
        json!(body),
    );
    expect(
        "response_trailer_mode",
        &mode["response_trailer_mode"],
        json!("SKIP"),
    );
    expect(
        "allow_mode_override",
        &tc["allow_mode_override"],
        json!(true),
    );
    expect(
        "failure_mode_allow",
        &tc["failure_mode_allow"],
        json!(false),
    );
    expect(
        "status_on_error",
        &tc["status_on_error"]["code"],
        json!("ServiceUnavailable"),
    );
    let (Some(message_timeout), Some(max)) = (
        duration_ms(&tc["message_timeout"]),
        duration_ms(&tc["max_message_timeout"]),
    ) else {
        problems.push(format!(
            "{what}: message_timeout and max_message_timeout must be durations like 30s: {tc}"
        ));
        return problems;
    };
    expect("message_timeout (ms)", &json!(message_timeout), json!(1000));
    expect(
        "max_message_timeout (ms)",
        &json!(max),
        config["scheduler"]["envoy_max_message_timeout_ms"].clone(),
    );
    for (tier, settings) in config["tiers"].as_object().expect("tiers") {
        let deadline = settings["queue_deadline_ms"].as_u64().expect("deadline");
        if deadline + ENVOY_TIMEOUT_MARGIN_MS > max {
            problems.push(format!(
                "{what}: tier {tier}'s queue deadline {deadline} ms + {ENVOY_TIMEOUT_MARGIN_MS} ms \
                 is over max_message_timeout ({max} ms)"
            ));
        }
    }
    problems
}

/// The HTTP filter chains of an Envoy bootstrap's listeners: (listener, http_filters).
fn http_filter_chains(bootstrap: &Value) -> Vec<(&Value, &Vec<Value>)> {
    let mut chains = Vec::new();
    for listener in bootstrap["static_resources"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for chain in listener["filter_chains"].as_array().into_iter().flatten() {
            for filter in chain["filters"].as_array().into_iter().flatten() {
                if filter["name"] == HCM {
                    chains.push((
                        listener,
                        filter["typed_config"]["http_filters"]
                            .as_array()
                            .expect("http_filters"),
                    ));
                }
            }
        }
    }
    chains
}

pub(super) fn cluster<'a>(bootstrap: &'a Value, name: &str) -> &'a Value {
    bootstrap["static_resources"]["clusters"]
        .as_array()
        .and_then(|clusters| clusters.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no cluster {name}"))
}

fn endpoint_address(cluster: &Value) -> (&str, u64) {
    let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"];
    (
        address["address"].as_str().expect("address"),
        address["port_value"].as_u64().expect("port"),
    )
}

/// Proves, for every config under envoy/: its ext_proc filter keeps tollgate's contract (modes,
/// fail closed with 503, 1 s message timeout, max_message_timeout = the config's, every queue
/// deadline + margin under it) and sits before the router; the body limit is tollgate's
/// max_body_bytes; the tollgate cluster's stream limit is raised. The variants differ from
/// front-proxy.yaml only where they mean to: the processing mode (no-response), the clusters
/// (TLS), and the TLS names and ports line up with the TLS sidecar and the headless Service.
#[test]
fn envoy_variants_keep_the_front_proxy_contract() {
    let config = prod_config();
    let docs = prod();
    let load = |name: &str| yaml_file(&format!("envoy/{name}")).remove(0);
    let front = load("front-proxy.yaml");
    let mut problems = Vec::new();
    for name in [
        "front-proxy.yaml",
        "front-proxy-no-response.yaml",
        "front-proxy-tls.yaml",
    ] {
        let bootstrap = load(name);
        let chains = http_filter_chains(&bootstrap);
        assert_eq!(chains.len(), 1, "{name}: one HTTP listener");
        let (listener, filters) = chains[0];
        let position = |wanted: &str| filters.iter().position(|f| f["name"] == wanted);
        let (ext_proc, router) = (
            position(EXT_PROC).unwrap_or_else(|| panic!("{name}: no ext_proc")),
            position(ROUTER).unwrap_or_else(|| panic!("{name}: no router")),
        );
        assert!(
            ext_proc < router,
            "{name}: ext_proc must run before the router"
        );
        problems.extend(ext_proc_problems(
            name,
            &filters[ext_proc],
            name != "front-proxy-no-response.yaml",
            &config,
        ));
        assert_eq!(
            listener["per_connection_buffer_limit_bytes"], config["tokens"]["max_body_bytes"],
            "{name}: Envoy's body limit is tollgate's"
        );
        let target =
            &filters[ext_proc]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"];
        let tollgate = cluster(&bootstrap, target.as_str().expect("cluster name"));
        let limit = tollgate["circuit_breakers"]["thresholds"][0]["max_requests"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            limit >= 100_000,
            "{name}: every request holds a stream; max_requests {limit}"
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // No-response: the front proxy but for the processing mode.
    let strip_mode = |mut bootstrap: Value| {
        let filters = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
            [0]["typed_config"]["http_filters"][0]["typed_config"];
        filters
            .as_object_mut()
            .expect("ext_proc config")
            .remove("processing_mode");
        bootstrap
    };
    assert_eq!(
        strip_mode(load("front-proxy-no-response.yaml")),
        strip_mode(front.clone()),
        "front-proxy-no-response.yaml must differ from front-proxy.yaml only in processing_mode"
    );

    // TLS: same admin and listener; the tollgate cluster reaches the TLS sidecar through the
    // headless Service, over TLS to the name the sidecar's certificate carries.
    let tls = load("front-proxy-tls.yaml");
    assert_eq!(tls["admin"], front["admin"]);
    assert_eq!(
        tls["static_resources"]["listeners"], front["static_resources"]["listeners"],
        "front-proxy-tls.yaml must keep front-proxy.yaml's listener"
    );
    let tollgate = cluster(&tls, "tollgate");
    assert_eq!(tollgate["type"], "STRICT_DNS");
    let headless = one(&docs, "Service", "tollgate-headless");
    let namespace = headless["metadata"]["namespace"]
        .as_str()
        .expect("namespace");
    let (host, port) = endpoint_address(tollgate);
    assert_eq!(
        host,
        format!("tollgate-headless.{namespace}.svc.cluster.local"),
        "the headless Service of k8s/overlays/prod"
    );
    let socket = &tollgate["transport_socket"]["typed_config"];
    assert_eq!(
        socket["sni"],
        format!("tollgate.{namespace}.svc.cluster.local")
    );
    assert_eq!(
        socket["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"][0]["matcher"]
            ["exact"],
        socket["sni"]
    );
    assert_eq!(
        socket["common_tls_context"]["alpn_protocols"],
        json!(["h2"])
    );
    assert_eq!(tollgate["health_checks"][0]["grpc_health_check"], json!({}));

    let sidecar = load("tollgate-tls-sidecar.yaml");
    let listener = &sidecar["static_resources"]["listeners"][0];
    assert_eq!(
        listener["address"]["socket_address"]["port_value"], port,
        "the front proxy's TLS port is the sidecar's"
    );
    assert_eq!(
        listener["filter_chains"][0]["transport_socket"]["typed_config"]["require_client_certificate"],
        true,
        "only trusted clients may open ext_proc streams"
    );
    let (host, port) = endpoint_address(cluster(&sidecar, "tollgate"));
    assert_eq!(host, "127.0.0.1");
    assert_eq!(
        port,
        port_of(config["listen"]["grpc_addr"].as_str().expect("grpc_addr")),
        "the sidecar forwards to tollgate's gRPC port"
    );
}

/// An EnvoyFilter's patches, sorted by what they patch.
#[derive(Default)]
struct Patches<'a> {
    http_filters: Vec<&'a Value>,
    listener_merges: Vec<&'a Value>,
    cluster_adds: Vec<&'a Value>,
}

fn patches(filter: &Value) -> Patches<'_> {
    let mut sorted = Patches::default();
    for patch in filter["spec"]["configPatches"]
        .as_array()
        .expect("configPatches")
    {
        match (
            patch["applyTo"].as_str().unwrap_or_default(),
            patch["patch"]["operation"].as_str().unwrap_or_default(),
        ) {
            ("HTTP_FILTER", "INSERT_BEFORE") => sorted.http_filters.push(patch),
            ("LISTENER", "MERGE") => sorted.listener_merges.push(patch),
            ("CLUSTER", "ADD") => sorted.cluster_adds.push(patch),
            other => panic!("unexpected patch {other:?}"),
        }
    }
    sorted
}

/// A minimal Envoy bootstrap with what an EnvoyFilter patches in: its HTTP filter before the
/// router of an HTTP listener (with the listener fields it merges), the clusters it adds, and,
/// for a cluster Istio generates from a Service (`outbound|PORT||FQDN`), a stand-in of that
/// name speaking HTTP/2, as Istio's does for a gRPC port.
fn bootstrap_for(patches: &Patches) -> Value {
    let filter = &patches.http_filters[0]["patch"]["value"];
    let mut listener = json!({
        "name": "virtualInbound",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 15006}},
        "filter_chains": [{"filters": [{
            "name": HCM,
            "typed_config": {
                "@type": HCM_TYPE,
                "stat_prefix": "inbound",
                "route_config": {"name": "inbound", "virtual_hosts": [{
                    "name": "inference", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "inference"}}]
                }]},
                "http_filters": [
                    filter,
                    {"name": ROUTER, "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    }}
                ]
            }
        }]}]
    });
    for merge in &patches.listener_merges {
        for (key, value) in merge["patch"]["value"]
            .as_object()
            .expect("a listener fragment")
        {
            listener[key] = value.clone();
        }
    }
    let static_cluster = |name: &str, port: u16, http2: bool| {
        let mut cluster = json!({
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{
                "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}
            }]}]}
        });
        if http2 {
            cluster["typed_extension_protocol_options"] = json!({
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }
            });
        }
        cluster
    };
    let mut clusters = vec![static_cluster("inference", 8000, false)];
    clusters.extend(
        patches
            .cluster_adds
            .iter()
            .map(|p| p["patch"]["value"].clone()),
    );
    let target = filter["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .expect("ext_proc cluster");
    if !clusters.iter().any(|c| c["name"] == target) {
        assert!(
            target.starts_with("outbound|"),
            "the ext_proc cluster {target} is neither added by the EnvoyFilter nor an Istio \
             Service cluster"
        );
        clusters.push(static_cluster(target, 50051, true));
    }
    json!({"static_resources": {"listeners": [listener], "clusters": clusters}})
}

/// Proves, for each EnvoyFilter (sidecar inbound, gateway, sidecar container): it inserts
/// tollgate's ext_proc filter (same contract as envoy/front-proxy.yaml) before the router of the
/// inference port's HTTP connection manager, raises the listener's body limit to tollgate's
/// max_body_bytes, and reaches tollgate: through the cluster Istio generates for the prod
/// overlay's gRPC Service port, or through the 127.0.0.1 cluster it adds for the container in the
/// pod. The patched-in filter, listener fields and clusters load in real Envoy 1.36 and 1.40.
#[test]
fn envoy_filters_patch_in_valid_envoy_config() {
    let prod_docs = prod();
    let config = prod_config();
    let service = one(&prod_docs, "Service", "tollgate");
    let grpc_port = service["spec"]["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["appProtocol"] == "grpc"))
        .and_then(|p| p["port"].as_u64())
        .expect("the gRPC port");
    let service_cluster = format!(
        "outbound|{grpc_port}||tollgate.{}.svc.cluster.local",
        service["metadata"]["namespace"]
            .as_str()
            .expect("namespace")
    );
    let inference = build("tests/fixtures/deploy/inference-app");
    let inference_pod = &one(&inference, "Deployment", "vllm")["spec"]["template"];
    let inference_port = container_port(
        container(&inference_pod["spec"]["containers"], "vllm"),
        "http",
    );
    let sidecar_config = effective_config(&inference, &TollgateContainer::sidecar(&inference));

    let dir = tempfile::Builder::new()
        .prefix("tollgate-envoyfilter-")
        .tempdir()
        .expect("temp dir");
    let mut failures = Vec::new();
    for (source, context) in [
        ("istio/sidecar-inbound", "SIDECAR_INBOUND"),
        ("istio/gateway", "GATEWAY"),
        ("tests/fixtures/deploy/inference-app", "SIDECAR_INBOUND"),
    ] {
        let docs = build(source);
        let filters = all_of(&docs, "EnvoyFilter");
        assert_eq!(filters.len(), 1, "{source}: one EnvoyFilter");
        let envoy_filter = filters[0];
        let patches = patches(envoy_filter);
        assert_eq!(
            patches.http_filters.len(),
            1,
            "{source}: one HTTP filter patch"
        );
        let http = patches.http_filters[0];
        let listener = &http["match"]["listener"];
        assert_eq!(http["match"]["context"], context, "{source}");
        assert_eq!(listener["filterChain"]["filter"]["name"], HCM, "{source}");
        assert_eq!(
            listener["filterChain"]["filter"]["subFilter"]["name"], ROUTER,
            "{source}"
        );
        let selector = &envoy_filter["spec"]["workloadSelector"]["labels"];
        if context == "SIDECAR_INBOUND" {
            assert_eq!(
                listener["portNumber"], inference_port,
                "{source}: the inference port"
            );
            assert!(
                selects(selector, &inference_pod["metadata"]["labels"]),
                "{source}: the workload selector must pick the inference pods"
            );
        } else {
            assert!(
                selector.is_object(),
                "{source}: a workload selector for the gateway pods"
            );
        }
        let value = &http["patch"]["value"];
        let filter_config = if source.starts_with("tests/") {
            &sidecar_config
        } else {
            &config
        };
        failures.extend(ext_proc_problems(source, value, true, filter_config));
        let target = value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
            .as_str()
            .expect("cluster name");
        if patches.cluster_adds.is_empty() {
            assert_eq!(
                target, service_cluster,
                "{source}: Istio names the cluster of k8s/overlays/prod's gRPC Service port so"
            );
        } else {
            let added = &patches.cluster_adds[0]["patch"]["value"];
            assert_eq!(
                added["name"], target,
                "{source}: ext_proc uses the added cluster"
            );
            let (host, port) = endpoint_address(added);
            assert_eq!(
                format!("{host}:{port}"),
                sidecar_config["listen"]["grpc_addr"]
                    .as_str()
                    .expect("grpc_addr"),
                "{source}: the added cluster reaches the tollgate container"
            );
            let limit = added["circuit_breakers"]["thresholds"][0]["max_requests"]
                .as_u64()
                .unwrap_or(0);
            assert!(limit >= 100_000, "{source}: max_requests {limit}");
        }
        assert_eq!(patches.listener_merges.len(), 1, "{source}: the body limit");
        assert_eq!(
            patches.listener_merges[0]["patch"]["value"]["per_connection_buffer_limit_bytes"],
            filter_config["tokens"]["max_body_bytes"],
            "{source}: Envoy's body limit is tollgate's max_body_bytes"
        );

        let bootstrap = bootstrap_for(&patches);
        let path = dir
            .path()
            .join(format!("{}.json", source.replace('/', "_")));
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&bootstrap).expect("JSON"),
        )
        .expect("write bootstrap");
        for version in VALIDATED_ENVOY_VERSIONS {
            if let Err(failure) = envoy_validate(version, &path) {
                failures.push(format!("{source}: {failure}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What `tollgate` adds to a queued request's deadline for Envoy (`ENVOY_TIMEOUT_MARGIN`).
const ENVOY_TIMEOUT_MARGIN_MS: u64 = 500;
