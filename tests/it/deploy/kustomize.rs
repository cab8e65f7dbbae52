//! `kubectl kustomize` on every kustomization, the output validated against the Kubernetes
//! schemas, and the objects checked against each other and against tollgate's config.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::dockerfile::dockerfile_user;
use super::manifests::{
    TollgateContainer, all_of, build, check_py, container_port, effective_config, env_var,
    kustomize, one, port_of, prod, selects, yaml_docs, yaml_file,
};
use super::read;

/// The oldest Kubernetes the manifests must validate against (native sidecars on by default since
/// 1.29). The newest is whatever kubernetes-validate
/// ships.
const OLDEST_KUBERNETES: &str = "1.29";

/// Every kustomization a user applies (components are built through the ones that include them).
const KUSTOMIZATIONS: [&str; 6] = [
    "k8s/overlays/dev",
    "k8s/overlays/prod",
    "istio/tollgate",
    "istio/sidecar-inbound",
    "istio/gateway",
    "tests/fixtures/deploy/inference-app",
];

/// Proves: every kustomization builds, and every object in it validates strictly (unknown fields
/// are errors) against Kubernetes 1.29 and the newest schemas kubernetes-validate ships, or, for a
/// custom resource, against its schema in tests/fixtures/deploy/schemas. No object goes unchecked.
#[test]
fn every_kustomization_builds_and_validates() {
    let mut failures = Vec::new();
    for dir in KUSTOMIZATIONS {
        let yaml = kustomize(dir);
        let docs = yaml_docs(&yaml);
        assert!(!docs.is_empty(), "{dir} builds to nothing");
        let report: Value = serde_json::from_str(&check_py(
            &["validate", OLDEST_KUBERNETES, "latest"],
            Some(&yaml),
        ))
        .expect("a JSON report");
        let versions = report["versions"].as_array().expect("versions");
        assert_eq!(versions[0], OLDEST_KUBERNETES);
        let newest = versions[1].as_str().expect("newest version");
        let minor: u32 = newest
            .split('.')
            .nth(1)
            .and_then(|m| m.parse().ok())
            .expect("a version like 1.37.0");
        assert!(
            minor >= 37,
            "kubernetes-validate ships schemas up to {newest}; expected 1.37+"
        );
        for error in report["errors"].as_array().expect("errors") {
            failures.push(format!("{dir}: {}", error.as_str().unwrap_or_default()));
        }
        for unchecked in report["unchecked"].as_array().expect("unchecked") {
            failures.push(format!(
                "{dir}: unchecked {}",
                unchecked.as_str().unwrap_or_default()
            ));
        }
        let checked: BTreeSet<&str> = report["checked"]
            .as_array()
            .expect("checked")
            .iter()
            .filter_map(|entry| entry[0].as_str())
            .collect();
        for doc in &docs {
            let what = format!(
                "{}/{}",
                doc["kind"].as_str().unwrap_or("?"),
                doc["metadata"]["name"].as_str().unwrap_or("?")
            );
            if !checked.contains(what.as_str()) {
                failures.push(format!("{dir}: {what} was not validated"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Proves, for the dev and prod overlays: tollgate runs as the Dockerfile's non-root user on a
/// read-only root filesystem with no capabilities; its probes use /readyz (readiness: a share of
/// the fleet's budget held, not draining) and /healthz (liveness) on the ports its config listens
/// on; the pod's grace period outlasts the preStop pause, the drain deadline and closing; the
/// Services declare gRPC and select the pods (one of them headless); the PDB and HPA point at them; each overlay's Redis is wired; and the
/// replicas share one in-flight budget as a fleet: member ids from the pod's name, the fallback
/// budget sized for the autoscaler's minimum, prod's fleet named and falling back to its last share.
#[test]
fn overlays_run_tollgate_safely_and_consistently() {
    let (uid, gid) = dockerfile_user();
    for overlay in ["k8s/overlays/dev", "k8s/overlays/prod"] {
        let docs = build(overlay);
        let deployment = one(&docs, "Deployment", "tollgate");
        let tollgate = TollgateContainer::deployment(&docs);
        let (pod, c) = (tollgate.pod, tollgate.container);
        let config = effective_config(&docs, &tollgate);
        let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        assert!(
            selects(&deployment["spec"]["selector"]["matchLabels"], pod_labels),
            "{overlay}: the Deployment's selector must match its pods"
        );
        assert!(
            deployment["spec"].get("replicas").is_none(),
            "{overlay}: the HPA owns the replica count"
        );

        // Security.
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{overlay}");
        assert_eq!(
            pod["securityContext"]["runAsUser"], uid,
            "{overlay}: Dockerfile USER"
        );
        assert_eq!(
            pod["securityContext"]["runAsGroup"], gid,
            "{overlay}: Dockerfile USER"
        );
        assert_eq!(pod["automountServiceAccountToken"], false, "{overlay}");
        let security = &c["securityContext"];
        assert_eq!(security["readOnlyRootFilesystem"], true, "{overlay}");
        assert_eq!(security["allowPrivilegeEscalation"], false, "{overlay}");
        assert_eq!(
            security["capabilities"]["drop"],
            json!(["ALL"]),
            "{overlay}"
        );
        assert!(
            c["resources"]["requests"]["cpu"].is_string()
                && c["resources"]["requests"]["memory"].is_string()
                && c["resources"]["limits"]["memory"].is_string(),
            "{overlay}: CPU and memory requests and a memory limit: {}",
            c["resources"]
        );

        // Ports and probes agree with the config.
        let grpc_port = container_port(c, "grpc");
        let admin_port = container_port(c, "admin");
        assert_eq!(
            grpc_port,
            port_of(config["listen"]["grpc_addr"].as_str().expect("grpc_addr"))
        );
        assert_eq!(
            admin_port,
            port_of(config["listen"]["admin_addr"].as_str().expect("admin_addr"))
        );
        assert_eq!(
            c["readinessProbe"]["httpGet"]["path"], "/readyz",
            "{overlay}: ready once the replica holds its share of the fleet's budget"
        );
        assert_eq!(c["readinessProbe"]["httpGet"]["port"], "admin", "{overlay}");
        assert_eq!(
            c["livenessProbe"]["httpGet"]["path"], "/healthz",
            "{overlay}"
        );
        assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin", "{overlay}");

        // Graceful termination.
        let pre_stop: Vec<&str> = c["lifecycle"]["preStop"]["exec"]["command"]
            .as_array()
            .expect("a preStop command")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(pre_stop[0], "/bin/sleep", "{overlay}: preStop sleeps");
        let pause: u64 = pre_stop[1].parse().expect("seconds");
        let drain_ms = config["shutdown"]["drain_deadline_ms"]
            .as_u64()
            .expect("drain");
        let grace = pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace");
        assert!(
            grace * 1000 > pause * 1000 + drain_ms + GRPC_CLOSE_GRACE_SECS * 1000,
            "{overlay}: terminationGracePeriodSeconds {grace} must exceed the preStop pause \
             {pause} s + drain_deadline_ms {drain_ms} + {GRPC_CLOSE_GRACE_SECS} s"
        );

        // Services.
        let service = one(&docs, "Service", "tollgate");
        let headless = one(&docs, "Service", "tollgate-headless");
        assert_eq!(headless["spec"]["clusterIP"], "None", "{overlay}");
        for svc in [service, headless] {
            assert!(
                selects(&svc["spec"]["selector"], pod_labels),
                "{overlay}: {} must select the tollgate pods",
                svc["metadata"]["name"]
            );
            let grpc = svc["spec"]["ports"]
                .as_array()
                .and_then(|ports| ports.iter().find(|p| p["targetPort"] == "grpc"))
                .expect("a port to the grpc container port");
            assert_eq!(
                grpc["appProtocol"], "grpc",
                "{overlay}: Istio must speak HTTP/2"
            );
            assert!(
                grpc["name"].as_str().is_some_and(|n| n.starts_with("grpc")),
                "{overlay}: Istio before appProtocol support reads the port name's prefix"
            );
        }

        let pdb = one(&docs, "PodDisruptionBudget", "tollgate");
        assert!(selects(&pdb["spec"]["selector"]["matchLabels"], pod_labels));
        let hpa = one(&docs, "HorizontalPodAutoscaler", "tollgate");
        assert_eq!(
            hpa["spec"]["scaleTargetRef"],
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "tollgate"})
        );
        let (min, max) = (
            hpa["spec"]["minReplicas"].as_u64().expect("min"),
            hpa["spec"]["maxReplicas"].as_u64().expect("max"),
        );
        assert!(min >= 1 && min <= max, "{overlay}: HPA range {min}..{max}");

        // The fleet (src/fleet.rs): one in-flight budget for the replicas sharing Redis.
        let fleet = &config["fleet"];
        assert_eq!(
            fleet["member_id"], "",
            "{overlay}: each replica joins the fleet as its host name (the pod's name)"
        );
        assert!(
            pod.get("hostname").is_none() && pod.get("setHostnameAsFQDN").is_none(),
            "{overlay}: HOSTNAME must stay the pod's name (fleet member ids)"
        );
        for var in c["env"].as_array().into_iter().flatten() {
            if var["name"] == "HOSTNAME" {
                assert_eq!(
                    var["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name",
                    "{overlay}: HOSTNAME, if set, must be the pod's name"
                );
            }
        }
        assert_eq!(
            fleet["fallback_replicas"].as_u64(),
            Some(min),
            "{overlay}: fleet.fallback_replicas (the replicas a replica that never saw the fleet \
             divides the limit by) must be the HPA's minReplicas"
        );

        let redis_url = config["store"]["redis_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{overlay}: budgets must be in Redis"));
        if overlay.ends_with("dev") {
            let redis = one(&docs, "Service", "redis");
            let port = redis["spec"]["ports"][0]["port"].as_u64().expect("port");
            assert_eq!(redis_url, format!("redis://redis:{port}"));
            assert!(selects(
                &redis["spec"]["selector"],
                &one(&docs, "Deployment", "redis")["spec"]["template"]["metadata"]["labels"]
            ));
        } else {
            assert!(
                redis_url.starts_with("rediss://"),
                "prod talks TLS to Redis"
            );
            assert!(min >= 3, "prod runs at least three replicas");
            let password = config["store"]["redis_password_file"]
                .as_str()
                .expect("a password file in prod");
            let mount = c["volumeMounts"]
                .as_array()
                .and_then(|mounts| {
                    mounts
                        .iter()
                        .find(|m| password.starts_with(m["mountPath"].as_str().unwrap_or("\0")))
                })
                .expect("the password file is mounted");
            let volume = pod["volumes"]
                .as_array()
                .and_then(|v| v.iter().find(|v| v["name"] == mount["name"]))
                .expect("its volume");
            assert!(volume["secret"]["secretName"].is_string(), "from a Secret");
            assert!(
                pod["topologySpreadConstraints"].is_array(),
                "spread over nodes"
            );
            let names: Vec<&str> = c["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|var| var["name"].as_str())
                .collect();
            for setting in [
                "TOLLGATE__FLEET__NAME",
                "TOLLGATE__FLEET__FALLBACK",
                "TOLLGATE__FLEET__FALLBACK_REPLICAS",
            ] {
                assert!(
                    names.contains(&setting),
                    "prod configures its fleet explicitly: {setting}"
                );
            }
            assert_ne!(
                fleet["name"], "tollgate",
                "prod's fleet has a name of its own, not the default"
            );
            assert_eq!(fleet["fallback"], "last_share", "prod");
        }
    }
}

/// Proves: the ServiceMonitor scrapes exactly one Service (not the headless one too), through a
/// port that reaches the admin port; the PrometheusRule carries the rule file's groups verbatim;
/// the dashboard ConfigMap carries grafana-dashboard.json verbatim.
#[test]
fn monitoring_objects_point_at_tollgate() {
    let docs = prod();
    let monitor = one(&docs, "ServiceMonitor", "tollgate");
    let selected: Vec<&Value> = all_of(&docs, "Service")
        .into_iter()
        .filter(|svc| {
            selects(
                &monitor["spec"]["selector"]["matchLabels"],
                &svc["metadata"]["labels"],
            )
        })
        .collect();
    assert_eq!(
        selected.len(),
        1,
        "the ServiceMonitor must select one Service, or every pod is scraped more than once"
    );
    let endpoint = &monitor["spec"]["endpoints"][0];
    let port = selected[0]["spec"]["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == endpoint["port"]))
        .expect("the ServiceMonitor's port exists on the Service");
    assert_eq!(port["targetPort"], "admin", "scrapes the admin port");
    assert_eq!(endpoint["path"], "/metrics");

    let rules = &yaml_file("k8s/components/monitoring/tollgate.rules.yaml")[0];
    let rule = one(&docs, "PrometheusRule", "tollgate");
    assert_eq!(
        rule["spec"]["groups"], rules["groups"],
        "prometheusrule.yaml and tollgate.rules.yaml must carry the same groups"
    );

    let dashboards: Vec<&Value> = all_of(&docs, "ConfigMap")
        .into_iter()
        .filter(|cm| cm["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    assert_eq!(dashboards.len(), 1);
    let shipped: Value = serde_json::from_str(
        dashboards[0]["data"]["tollgate.json"]
            .as_str()
            .expect("JSON"),
    )
    .expect("the dashboard is JSON");
    let file: Value =
        serde_json::from_str(&read("k8s/components/monitoring/grafana-dashboard.json"))
            .expect("grafana-dashboard.json is JSON");
    assert_eq!(shipped, file);
}

/// Every kustomization that runs tollgate, and whether it runs as the inference pod's sidecar.
const TOLLGATE_CONTAINERS: [(&str, bool); 3] = [
    ("k8s/overlays/dev", false),
    ("k8s/overlays/prod", false),
    ("tests/fixtures/deploy/inference-app", true),
];

/// Proves: every tollgate container (dev, prod, the inference pod's sidecar) runs one runtime
/// thread per CPU it requests, rounded up, rather than one per core of its node: it sets
/// `TOKIO_WORKER_THREADS` from its own `requests.cpu`, and requests some CPU (the downward API
/// gives 0 for no request and no limit, which tollgate refuses).
#[test]
fn tollgate_runs_a_thread_per_cpu_requested() {
    for (dir, sidecar) in TOLLGATE_CONTAINERS {
        let docs = build(dir);
        let tollgate = TollgateContainer::of(&docs, sidecar);
        let c = tollgate.container;
        let threads = env_var(c, "TOKIO_WORKER_THREADS")
            .unwrap_or_else(|| panic!("{dir}: TOKIO_WORKER_THREADS sets the runtime's threads"));
        let field = &threads["valueFrom"]["resourceFieldRef"];
        assert_eq!(
            field["containerName"], c["name"],
            "{dir}: its own container's request"
        );
        assert_eq!(field["resource"], "requests.cpu", "{dir}");
        let divisor = match &field["divisor"] {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        assert_eq!(divisor, "1", "{dir}: whole CPUs, rounded up");
        let cpu = &c["resources"]["requests"]["cpu"];
        assert!(
            millicores(cpu).is_some_and(|m| m > 0.0),
            "{dir}: a CPU request ({cpu}), or the variable would be 0"
        );
    }
}

/// A Kubernetes CPU quantity in millicores (`500m`, `"1"`, `1.5`, `2`); `None` if it is none.
fn millicores(quantity: &Value) -> Option<f64> {
    match quantity {
        Value::Number(cores) => cores.as_f64().map(|cores| cores * 1000.0),
        Value::String(text) => match text.strip_suffix('m') {
            Some(milli) => milli.parse().ok(),
            None => text.parse::<f64>().ok().map(|cores| cores * 1000.0),
        },
        _ => None,
    }
}

/// Proves: every tollgate config shipped in a ConfigMap passes `tollgate check-config` with its
/// container's environment (dev, prod, and the sidecar in the inference pod), the settings Envoy
/// must agree with are what envoy/ and istio/ use, and each inference pod's sidecar is a fleet of
/// its own.
#[test]
fn configmap_configs_pass_check_config() {
    for (dir, sidecar) in TOLLGATE_CONTAINERS {
        let docs = build(dir);
        let tollgate = TollgateContainer::of(&docs, sidecar);
        let config = effective_config(&docs, &tollgate);
        assert_eq!(
            config["scheduler"]["envoy_max_message_timeout_ms"], 30_000,
            "{dir}: Envoy's max_message_timeout in envoy/ and istio/ is 30s"
        );
        assert_eq!(config["tokens"]["max_body_bytes"], 8_388_608, "{dir}");
        if sidecar {
            assert_eq!(
                config["listen"]["grpc_addr"], "127.0.0.1:50051",
                "in the inference pod, ext_proc listens on loopback only (the EnvoyFilter's \
                 tollgate_local cluster)"
            );
            assert_eq!(
                tollgate.container["readinessProbe"]["httpGet"]["path"], "/readyz",
                "the loopback gRPC port cannot be probed by the kubelet"
            );
            assert_eq!(
                tollgate.container["restartPolicy"], "Always",
                "a native sidecar"
            );
            let fleet_name = env_var(tollgate.container, "TOLLGATE__FLEET__NAME")
                .expect("the sidecar names its fleet");
            assert_eq!(
                fleet_name["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name",
                "each inference pod's tollgate is a fleet of its own: its budget is its engine's"
            );
        }
    }
}

/// tollgate's pause between the drain deadline and exit, at most (`GRPC_CLOSE_GRACE` in
/// src/lib.rs).
const GRPC_CLOSE_GRACE_SECS: u64 = 5;
