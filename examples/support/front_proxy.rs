//! `envoy/front-proxy.yaml` turned into the Envoy config a benchmark or the load lab runs:
//! without ext_proc (Envoy alone, "tollgate off"), and rendered on loopback ports. Included with
//! `#[path = "support/front_proxy.rs"] mod front_proxy;`.

use anyhow::{Result, bail, ensure};

/// `front_proxy` without the ext_proc HTTP filter and the `tollgate` cluster: Envoy straight to
/// the upstream, with everything else (buffer limits, timeouts, circuit breakers, the port
/// placeholders) byte for byte the same, so the only difference is ext_proc.
pub fn without_ext_proc(front_proxy: &str) -> Result<String> {
    let without_filter = remove_list_item(front_proxy, "- name: envoy.filters.http.ext_proc")?;
    let direct = remove_list_item(&without_filter, "- name: tollgate")?;
    ensure!(
        !direct.contains("ext_proc.v3") && !direct.contains("cluster_name: tollgate"),
        "ext_proc is still referenced after removing the filter and the cluster"
    );
    ensure!(
        direct.contains("envoy.filters.http.router"),
        "the router filter went missing"
    );
    Ok(direct)
}

/// Removes the YAML list item that starts with `header` (after indentation): its line and every
/// following line that is blank or indented deeper than the dash. The header must occur once.
fn remove_list_item(yaml: &str, header: &str) -> Result<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let starts: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start() == header)
        .collect();
    let [start] = starts[..] else {
        bail!("`{header}` occurs {} times, expected once", starts.len());
    };
    let indent = lines[start].len() - lines[start].trim_start().len();
    let mut end = start + 1;
    while end < lines.len() {
        let line = lines[end];
        let line_indent = line.len() - line.trim_start().len();
        if !line.trim().is_empty() && line_indent <= indent {
            break;
        }
        end += 1;
    }
    // Blank lines at the end of the item separate it from the next one: keep them.
    while end > start + 1 && lines[end - 1].trim().is_empty() {
        end -= 1;
    }
    let mut kept: Vec<&str> = lines[..start].to_vec();
    kept.extend_from_slice(&lines[end..]);
    Ok(kept.join("\n") + "\n")
}

/// The ports a config is rendered with; same scheme as tests/it/support/envoy.rs and the
/// header of envoy/front-proxy.yaml.
pub struct EnvoyPorts {
    pub listen: u16,
    pub upstream: u16,
    /// `None` for the Envoy-alone config, which has no ext_proc cluster.
    pub extproc: Option<u16>,
    pub admin: u16,
}

/// Substitutes the ports and binds the listener to 127.0.0.1 (as `render_config` does in the
/// tests). Each placeholder must occur exactly once, or the file broke the scheme.
pub fn render_config(config: &str, ports: &EnvoyPorts) -> Result<String> {
    let mut replacements = vec![
        ("port_value: 10000", format!("port_value: {}", ports.listen)),
        (
            "port_value: 8000",
            format!("port_value: {}", ports.upstream),
        ),
        ("port_value: 9901", format!("port_value: {}", ports.admin)),
        ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
    ];
    if let Some(extproc) = ports.extproc {
        replacements.push(("port_value: 50051", format!("port_value: {extproc}")));
    }
    let mut rendered = config.to_owned();
    for (placeholder, value) in replacements {
        let count = rendered.matches(placeholder).count();
        ensure!(
            count == 1,
            "`{placeholder}` occurs {count} times in the Envoy config, expected once (see the \
             header of envoy/front-proxy.yaml)"
        );
        rendered = rendered.replacen(placeholder, &value, 1);
    }
    // Belt and braces: every socket address in the rendered config must be loopback, so no
    // listener is reachable from outside and no traffic leaves the machine.
    for line in rendered
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
    {
        let bytes = line.as_bytes();
        // `address: X` as a key of its own, not the end of e.g. `use_remote_address: true`.
        let starts = line
            .match_indices("address: ")
            .map(|(i, _)| i)
            .filter(|&i| i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        for start in starts {
            let rest = &line[start + "address: ".len()..];
            let value = rest.split([',', ' ', '}']).next().unwrap_or_default();
            ensure!(
                value == "127.0.0.1",
                "the rendered Envoy config has a non-loopback address: {}",
                line.trim()
            );
        }
    }
    Ok(rendered)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn front_proxy() -> String {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(root.join("envoy/front-proxy.yaml")).unwrap()
    }

    #[test]
    fn the_front_proxy_loses_ext_proc_and_keeps_the_rest() {
        let direct = without_ext_proc(&front_proxy()).unwrap();
        assert!(!direct.contains("port_value: 50051"));
        for kept in [
            "envoy.filters.http.router",
            "- name: inference",
            "port_value: 8000",
            "stream_idle_timeout: 600s",
            "per_connection_buffer_limit_bytes: 8388608",
        ] {
            assert!(direct.contains(kept), "{kept} went missing");
        }
    }

    #[test]
    fn rendering_puts_every_port_on_loopback() {
        let ports = EnvoyPorts {
            listen: 20000,
            upstream: 20001,
            extproc: Some(20002),
            admin: 20003,
        };
        let rendered = render_config(&front_proxy(), &ports).unwrap();
        for port in ["20000", "20001", "20002", "20003"] {
            assert!(rendered.contains(&format!("port_value: {port}")), "{port}");
        }
        assert!(!rendered.contains("address: 0.0.0.0"));
        // The Envoy-alone config has no ext_proc port to render, and may not name one.
        let direct = without_ext_proc(&front_proxy()).unwrap();
        assert!(render_config(&direct, &ports).is_err());
        let alone = EnvoyPorts {
            extproc: None,
            ..ports
        };
        assert!(render_config(&direct, &alone).is_ok());
    }
}
