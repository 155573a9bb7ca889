//! The deployment manifests (manifests/): every kustomization renders with
//! `kubectl kustomize`, every object validates against the Kubernetes schemas
//! offline (`kubernetes-validate`), and what the manifests pass the binaries
//! is accepted by the binaries and consistent across the pieces (ports,
//! socket paths, agent ids, token audiences, probes), so manifests and
//! binaries cannot drift apart unnoticed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::TempDir;
use clap::Parser;
use serde::Deserialize;
use serde_json::Value;

/// The oldest Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.31.0";
const BASES: [&str; 5] = [
    "egress",
    "egress-control-plane",
    "node-to-kas",
    "node-to-kas-control-plane",
    "node-agent-static",
];
/// Overlays of our own beside the kind ones, under manifests/overlays.
const OVERLAYS: [&str; 1] = ["every-server"];
/// Example values for what the kubelet fills in at run time.
const SAMPLE_FIELDS: [(&str, &str); 2] = [("status.hostIP", "192.0.2.21"), ("spec.nodeName", "node-1")];
/// What the documented konnectivity ConfigMap holds in the examples.
const SAMPLE_CONFIG: [(&str, &str); 2] = [
    ("kas-endpoint", "192.0.2.10:6443"),
    ("proxy-server-host", "192.0.2.10"),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

/// Whether `program` runs; under CI its absence fails the test.
fn tool_available(program: &str, probe: &[&str]) -> bool {
    let found = Command::new(program)
        .args(probe)
        .output()
        .is_ok_and(|output| output.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{program} is needed for the manifest tests and CI is set (hack/test.sh installs it)"
        );
        eprintln!("skipping: {program} not found");
    }
    found
}

fn render(dir: &Path) -> String {
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("run kubectl");
    assert!(
        output.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// A container of a konnectivity-rs binary, with its arguments as the
/// kubelet would expand them.
#[derive(Debug)]
struct Run {
    workload: String,
    container: Value,
    pod: Value,
    binary: String,
    args: Vec<String>,
}

impl Run {
    fn flag(&self, name: &str) -> Option<&str> {
        let prefix = format!("--{name}=");
        self.args
            .iter()
            .rev()
            .find_map(|arg| arg.strip_prefix(prefix.as_str()))
    }

    fn flag_or(&self, name: &str, default: &'static str) -> String {
        self.flag(name).unwrap_or(default).to_owned()
    }

    /// The node's path that `path` inside the container is, through a
    /// hostPath volume mounted over it; `None` when no such mount covers it.
    fn host_path(&self, path: &str) -> Option<String> {
        let mount = self.container["volumeMounts"]
            .as_array()?
            .iter()
            .filter(|m| {
                let at = m["mountPath"].as_str().unwrap_or_default();
                path == at || path.starts_with(&format!("{}/", at.trim_end_matches('/')))
            })
            .max_by_key(|m| m["mountPath"].as_str().unwrap_or_default().len())?;
        let volume = self.pod["volumes"]
            .as_array()?
            .iter()
            .find(|v| v["name"] == mount["name"])?;
        let host = volume["hostPath"]["path"].as_str()?;
        let rest = &path[mount["mountPath"].as_str()?.len()..];
        Some(format!("{host}{rest}"))
    }

    fn probe_ports(&self) -> Vec<u64> {
        ["livenessProbe", "readinessProbe", "startupProbe"]
            .iter()
            .filter_map(|probe| self.container[probe]["httpGet"]["port"].as_u64())
            .collect()
    }
}

/// The pod spec of a Pod or of a workload's template.
fn pod_spec(object: &Value) -> Option<&Value> {
    match object["kind"].as_str()? {
        "Pod" => Some(&object["spec"]),
        "DaemonSet" | "Deployment" | "StatefulSet" => Some(&object["spec"]["template"]["spec"]),
        _ => None,
    }
}

fn runs(objects: &[Value]) -> Vec<Run> {
    let mut runs = Vec::new();
    for object in objects {
        let Some(pod) = pod_spec(object) else { continue };
        let workload = format!(
            "{}/{}",
            object["kind"].as_str().unwrap(),
            object["metadata"]["name"].as_str().unwrap()
        );
        for container in pod["containers"].as_array().into_iter().flatten() {
            let image = container["image"].as_str().unwrap_or_default();
            if !image.starts_with("konnectivity-rs:") {
                continue;
            }
            let command: Vec<String> = container["command"]
                .as_array()
                .unwrap_or_else(|| {
                    panic!("{workload}: konnectivity-rs containers name their binary in command")
                })
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect();
            let env = environment(&workload, container);
            let args = container["args"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|arg| expand(&workload, arg.as_str().unwrap(), &env))
                .collect();
            runs.push(Run {
                workload: format!("{workload}[{}]", container["name"].as_str().unwrap()),
                container: container.clone(),
                pod: pod.clone(),
                binary: command[0].clone(),
                args,
            });
        }
    }
    runs
}

/// A container's environment, with sample values for what comes from the
/// downward API or the documented ConfigMap.
fn environment(workload: &str, container: &Value) -> HashMap<String, String> {
    let mut env = HashMap::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap().to_owned();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_owned()
        } else if let Some(path) = var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            let sample = SAMPLE_FIELDS.iter().find(|(field, _)| *field == path);
            sample
                .unwrap_or_else(|| panic!("{workload}: no sample for field {path}"))
                .1
                .to_owned()
        } else if let Some(key) = var["valueFrom"]["configMapKeyRef"]["key"].as_str() {
            let map = &var["valueFrom"]["configMapKeyRef"]["name"];
            assert_eq!(
                map, "konnectivity",
                "{workload}: the documented ConfigMap is kube-system/konnectivity"
            );
            let sample = SAMPLE_CONFIG.iter().find(|(k, _)| *k == key);
            sample
                .unwrap_or_else(|| panic!("{workload}: ConfigMap key {key} is not documented"))
                .1
                .to_owned()
        } else {
            panic!("{workload}: env {name} has no value this test understands");
        };
        env.insert(name, value);
    }
    env
}

/// `$(NAME)` as the kubelet expands it; a reference to an undefined
/// variable stays literal there, which is always a bug here.
fn expand(workload: &str, arg: &str, env: &HashMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find(')')
            .unwrap_or_else(|| panic!("{workload}: unclosed $( in {arg}"))
            + start;
        let name = &rest[start + 2..end];
        let value = env.get(name).unwrap_or_else(|| {
            panic!("{workload}: {arg} uses $({name}), which the container's env does not define")
        });
        out.push_str(value);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// Parses a run's arguments with the binary's own flag definitions.
fn check_flags(run: &Run) {
    let argv = std::iter::once(run.binary.clone()).chain(run.args.iter().cloned());
    let parsed = match run.binary.as_str() {
        "proxy-server" => konnectivity_server::config::Args::try_parse_from(argv).map(drop),
        "proxy-agent" => konnectivity_agent::config::Args::try_parse_from(argv).map(drop),
        other => panic!(
            "{}: runs {other}, which is not a konnectivity-rs binary",
            run.workload
        ),
    };
    if let Err(error) = parsed {
        panic!(
            "{}: {} refuses the manifest's flags: {error}",
            run.workload, run.binary
        );
    }
    // Values checked after parsing, where the binaries check them at start-up.
    let problems = [
        run.flag("agent-identifiers")
            .and_then(|text| konnectivity_proto::AgentIdentifiers::parse(text).err())
            .map(|e| ("agent-identifiers", e.to_string())),
        run.flag("node-allowed-destinations")
            .and_then(|text| konnectivity_server::hooks::parse_allowed(text).err())
            .map(|e| ("node-allowed-destinations", e)),
        run.flag("proxy-strategies")
            .and_then(|text| konnectivity_server::hooks::parse_strategies(text).err())
            .map(|e| ("proxy-strategies", e)),
    ];
    if let Some((flag, error)) = problems.into_iter().flatten().next() {
        panic!("{}: --{flag}: {error}", run.workload);
    }
}

fn rendered_base(name: &str) -> Vec<Value> {
    documents(&render(&repo().join("manifests/base").join(name)))
}

fn rendered_overlay(name: &str) -> Vec<Value> {
    documents(&render(&repo().join("manifests/overlays").join(name)))
}

fn find<'a>(runs: &'a [Run], workload: &str) -> &'a Run {
    runs.iter()
        .find(|run| run.workload.starts_with(workload))
        .unwrap_or_else(|| {
            panic!(
                "no {workload} among {:?}",
                runs.iter().map(|r| &r.workload).collect::<Vec<_>>()
            )
        })
}

#[test]
fn every_kustomization_renders_and_validates_against_the_kubernetes_schemas() {
    if !tool_available("kubectl", &["version", "--client"])
        || !tool_available("python3", &["-m", "kubernetes_validate", "--version"])
    {
        return;
    }
    let dir = TempDir::new("konn-manifests");
    let mut dirs: Vec<PathBuf> = BASES
        .iter()
        .map(|b| repo().join("manifests/base").join(b))
        .collect();
    dirs.extend(
        BASES
            .iter()
            .map(|b| repo().join("manifests/overlays/kind").join(b)),
    );
    dirs.extend(OVERLAYS.iter().map(|o| repo().join("manifests/overlays").join(o)));
    for kustomization in &dirs {
        let rendered = render(kustomization);
        let objects = documents(&rendered);
        assert!(!objects.is_empty(), "{} renders nothing", kustomization.display());
        let kind_overlay = kustomization.starts_with(repo().join("manifests/overlays/kind"));
        for run in runs(&objects) {
            let image = run.container["image"].as_str().unwrap();
            let expected = if kind_overlay {
                "konnectivity-rs:dev"
            } else {
                "konnectivity-rs:latest"
            };
            assert_eq!(image, expected, "{} in {}", run.workload, kustomization.display());
        }
        let file = dir.path().join("rendered.yaml");
        std::fs::write(&file, &rendered).unwrap();
        let output = Command::new("python3")
            .args([
                "-m",
                "kubernetes_validate",
                "--strict",
                "--quiet",
                "-k",
                KUBERNETES_VERSION,
            ])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{} does not validate against Kubernetes {KUBERNETES_VERSION}:\n{}{}",
            kustomization.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn the_binaries_accept_every_flag_the_manifests_give_them() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let mut seen = 0;
    let rendered = BASES
        .iter()
        .map(|base| rendered_base(base))
        .chain(OVERLAYS.iter().map(|overlay| rendered_overlay(overlay)));
    for objects in rendered {
        for run in runs(&objects) {
            check_flags(&run);
            // Probes go to the port the binary serves health on.
            let health = match run.binary.as_str() {
                "proxy-server" => run.flag_or("health-port", "8092"),
                _ => run.flag_or("health-server-port", "8093"),
            };
            for port in run.probe_ports() {
                assert_eq!(
                    port.to_string(),
                    health,
                    "{}: a probe misses the health port",
                    run.workload
                );
            }
            seen += 1;
        }
    }
    assert!(seen >= 9, "only {seen} konnectivity-rs containers found");
}

#[test]
fn egress_pieces_agree_with_each_other_and_with_kube_apiserver() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let cluster = rendered_base("egress");
    let control_plane = runs(&rendered_base("egress-control-plane"));
    let server = find(&control_plane, "Pod/konnectivity-server");
    let agents = runs(&cluster);
    let agent = find(&agents, "DaemonSet/konnectivity-agent");

    assert_eq!(agent.flag("proxy-server-port"), server.flag("agent-port"));
    // The projected token is the one the agent reads, for the audience the
    // server asks TokenReviews about, of the ServiceAccount it admits.
    let token_path = agent.flag("service-account-token-path").expect("token auth");
    let mount = agent.container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| token_path.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the token file is on a mounted volume");
    let volume = agent.pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let projected = &volume["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!(
        format!(
            "{}/{}",
            mount["mountPath"].as_str().unwrap(),
            projected["path"].as_str().unwrap()
        ),
        token_path
    );
    assert_eq!(
        projected["audience"].as_str(),
        server.flag("authentication-audience")
    );
    assert_eq!(
        agent.pod["serviceAccountName"].as_str(),
        server.flag("agent-service-account")
    );
    let account = cluster
        .iter()
        .find(|o| o["kind"] == "ServiceAccount")
        .expect("the agents' ServiceAccount");
    assert_eq!(
        account["metadata"]["namespace"].as_str(),
        server.flag("agent-namespace")
    );
    assert_eq!(
        account["metadata"]["name"].as_str(),
        server.flag("agent-service-account")
    );
    assert!(
        server.flag("cluster-ca-cert").is_none(),
        "token auth excludes --cluster-ca-cert"
    );

    // Leases: the server may keep its own and delete expired ones, the
    // agents may list and watch them, in the namespace both name.
    assert_eq!(server.flag("enable-lease-controller"), Some("true"));
    assert_eq!(agent.flag("count-server-leases"), Some("true"));
    let namespace = server.flag_or("lease-namespace", "kube-system");
    assert_eq!(agent.flag_or("lease-namespace", "kube-system"), namespace);
    let granted = |subject_kind: &str, subject_name: &str| -> Vec<String> {
        let bindings = cluster.iter().filter(|o| {
            o["kind"] == "RoleBinding"
                && o["metadata"]["namespace"] == namespace.as_str()
                && o["subjects"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|s| s["kind"] == subject_kind && s["name"] == subject_name)
        });
        let mut verbs = Vec::new();
        for binding in bindings {
            let role = cluster
                .iter()
                .find(|o| {
                    o["kind"] == "Role"
                        && o["metadata"]["name"] == binding["roleRef"]["name"]
                        && o["metadata"]["namespace"] == namespace.as_str()
                })
                .expect("the binding's Role");
            for rule in role["rules"].as_array().unwrap() {
                let on_leases = rule["apiGroups"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|g| g == "coordination.k8s.io")
                    && rule["resources"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|r| r == "leases");
                if on_leases {
                    verbs.extend(
                        rule["verbs"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|v| v.as_str().unwrap().to_owned()),
                    );
                }
            }
        }
        verbs
    };
    let server_verbs = granted("User", "system:konnectivity-server");
    for verb in ["get", "list", "create", "update", "delete"] {
        assert!(
            server_verbs.iter().any(|v| v == verb),
            "server may not {verb} leases: {server_verbs:?}"
        );
    }
    let agent_verbs = granted(
        "ServiceAccount",
        agent.pod["serviceAccountName"].as_str().unwrap(),
    );
    for verb in ["list", "watch"] {
        assert!(
            agent_verbs.iter().any(|v| v == verb),
            "agents may not {verb} leases: {agent_verbs:?}"
        );
    }

    // kube-apiserver's egress selector dials the server's socket, in the
    // mode it serves.
    let selector: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("manifests/control-plane/egress-selector-configuration.yaml"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(selector["apiVersion"], "apiserver.k8s.io/v1beta1");
    assert_eq!(selector["kind"], "EgressSelectorConfiguration");
    let cluster_selection = selector["egressSelections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "cluster")
        .expect("a cluster egress selection");
    let connection = &cluster_selection["connection"];
    assert_eq!(connection["proxyProtocol"], "GRPC");
    assert_eq!(server.flag("mode"), Some("grpc"));
    let socket = connection["transport"]["uds"]["udsName"].as_str();
    for base in ["egress-control-plane", "node-to-kas-control-plane"] {
        let pods = runs(&rendered_base(base));
        assert_eq!(
            find(&pods, "Pod/konnectivity-server").flag("uds-name"),
            socket,
            "{base}"
        );
    }
}

/// The every-server overlay: agents dial each proxy-server by the one name
/// a headless Service gives them all, with no load balancer in between.
#[test]
fn the_every_server_overlay_names_each_server_through_a_headless_service() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let objects = rendered_overlay("every-server");
    let control_plane = rendered_base("egress-control-plane");
    let server_pod = control_plane
        .iter()
        .find(|o| o["kind"] == "Pod")
        .expect("the server's static pod");
    let server = find(&runs(&control_plane), "Pod/konnectivity-server")
        .args
        .clone();
    let agents = runs(&objects);
    let agent = find(&agents, "DaemonSet/konnectivity-agent");
    let service = objects
        .iter()
        .find(|o| o["kind"] == "Service")
        .expect("a Service naming the servers");

    // Headless: its name resolves to every server, not to one virtual IP.
    assert_eq!(service["spec"]["clusterIP"], "None");
    // It selects the servers' static pods (their mirror pods' labels).
    let selector = service["spec"]["selector"].as_object().unwrap();
    assert!(!selector.is_empty());
    for (key, value) in selector {
        assert_eq!(
            &server_pod["metadata"]["labels"][key], value,
            "the Service selects {key}={value}, which the server pod does not carry"
        );
    }
    // On the port the servers take agents on, which the agents dial.
    let agent_port = server
        .iter()
        .find_map(|arg| arg.strip_prefix("--agent-port="))
        .expect("the server's --agent-port");
    let port = &service["spec"]["ports"][0];
    assert_eq!(port["port"].to_string(), agent_port);
    assert_eq!(port["targetPort"].to_string(), agent_port);
    assert_eq!(agent.flag("proxy-server-port"), Some(agent_port));

    // Agents resolve the Service's name and hold a stream to each address.
    let name = format!(
        "{}.{}.svc",
        service["metadata"]["name"].as_str().unwrap(),
        service["metadata"]["namespace"].as_str().unwrap()
    );
    assert_eq!(agent.flag("proxy-server-host"), Some(name.as_str()));
    assert_eq!(agent.flag("dial-every-address"), Some("true"));
    // Lease counting is not applied with every address dialed (the agent
    // would warn at each start), and the ConfigMap's host is not read: a
    // key left out of it must not keep the pod from starting.
    assert_eq!(agent.flag("count-server-leases"), None);
    let from_config_map = agent.container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|var| !var["valueFrom"]["configMapKeyRef"].is_null())
        .count();
    assert_eq!(from_config_map, 0, "{:?}", agent.container["env"]);
    check_flags(agent);
}

#[test]
fn node_to_kas_pieces_agree_with_each_other() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let control_plane = runs(&rendered_base("node-to-kas-control-plane"));
    let server = find(&control_plane, "Pod/konnectivity-server");
    let cp_agent = find(&control_plane, "Pod/konnectivity-control-plane-agent");
    let ids: Vec<&str> = server
        .flag("control-plane-agent-ids")
        .unwrap()
        .split(',')
        .collect();
    assert!(ids.contains(&cp_agent.flag("agent-id").unwrap()), "{ids:?}");
    assert_eq!(cp_agent.flag("proxy-server-port"), server.flag("agent-port"));
    let allowed = server.flag("node-allowed-destinations").unwrap();

    for (base, workload) in [
        ("node-to-kas", "DaemonSet/konnectivity-node-agent"),
        ("node-agent-static", "Pod/konnectivity-node-agent"),
    ] {
        let node_runs = runs(&rendered_base(base));
        let node = find(&node_runs, &format!("{workload}[node-agent]"));
        let install = find(&node_runs, &format!("{workload}[install-cni]"));
        assert_eq!(
            node.flag("proxy-server-port"),
            server.flag("agent-port"),
            "{base}"
        );
        assert_eq!(
            node.flag("node-frontend-port"),
            server.flag("node-frontend-port"),
            "{base}"
        );
        assert_eq!(install.args.first().map(String::as_str), Some("install-cni"));
        assert_eq!(install.flag("agent-socket"), node.flag("cni-socket"), "{base}");
        if node.flag("cni-socket").is_some() {
            // New pods (the plugin) and running ones (the agent's enrolment)
            // are excluded alike.
            assert_eq!(
                install.flag("exclude-namespaces"),
                node.flag("exclude-namespaces"),
                "{base}"
            );
            // The agent reads the configuration install-cni writes, to know
            // which network's pods are its own: the same node directory.
            let conf_dir = node.flag_or("cni-conf-dir", "/etc/cni/net.d");
            let installed = install.flag_or("cni-conf-dir", "/etc/cni/net.d");
            assert_eq!(
                node.host_path(&conf_dir),
                install.host_path(&installed),
                "{base}: the node agent's --cni-conf-dir must be install-cni's on the node"
            );
            assert!(
                node.host_path(&conf_dir).is_some(),
                "{base}: --cni-conf-dir is not mounted"
            );
            // So is the cache the runtime records its pods in.
            assert_eq!(
                node.host_path(&node.flag_or("cni-cache-dir", "/var/lib/cni"))
                    .as_deref(),
                Some("/var/lib/cni"),
                "{base}: --cni-cache-dir must be the node's libcni cache"
            );
        }
        // The hand-over socket is on a directory of the node both pods of a
        // rollout mount, and an agent that handed over is done before
        // kubelet kills it.
        let handover = node.flag_or("handover-socket", "/var/run/konnectivity/handover.sock");
        let host = node
            .host_path(&handover)
            .unwrap_or_else(|| panic!("{base}: --handover-socket {handover} is on no hostPath volume"));
        assert_eq!(host, handover, "{base}: the hand-over socket's node path");
        let drain = node.flag_or("drain-timeout", "25s");
        let grace = node.pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        let drain_seconds: u64 = drain.trim_end_matches('s').parse().unwrap();
        assert!(
            drain_seconds < grace,
            "{base}: --drain-timeout={drain} within the grace of {grace}s"
        );
        // Every capture target is a destination the server lets nodes dial.
        let targets: Vec<&str> = node
            .args
            .iter()
            .filter_map(|a| {
                a.strip_prefix("--capture=")
                    .map(|capture| capture.split_once('=').unwrap().1)
                    .or_else(|| a.strip_prefix("--capture-target="))
            })
            .collect();
        assert!(!targets.is_empty(), "{base}: the node agent captures nothing");
        for target in targets {
            assert!(
                allowed.split(',').any(|a| a == target),
                "{base}: {target} not in {allowed}"
            );
        }
        // Certificates on both sides: node agents use client certificates,
        // which the server checks against its two CAs.
        assert!(
            node.flag("agent-cert").is_some() && node.flag("node-client-cert").is_some(),
            "{base}"
        );
        assert!(server.flag("cluster-ca-cert").is_some() && server.flag("node-client-ca-cert").is_some());
        // Different ports from the control-plane agent on a shared host.
        assert_ne!(
            node.flag("health-server-port"),
            cp_agent.flag("health-server-port")
        );
    }
}

/// A rollout replaces the node agent by starting the new one beside the
/// old (maxSurge): the hand-over needs both on the node at once, and a
/// declared port would keep the scheduler from placing the second.
#[test]
fn node_agent_rollouts_start_the_new_agent_beside_the_old() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let objects = rendered_base("node-to-kas");
    let daemonset = objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .expect("the node agent DaemonSet");
    let strategy = &daemonset["spec"]["updateStrategy"];
    assert_eq!(strategy["type"], "RollingUpdate");
    assert_eq!(strategy["rollingUpdate"]["maxSurge"], 1, "{strategy}");
    assert_eq!(strategy["rollingUpdate"]["maxUnavailable"], 0, "{strategy}");
    let spec = &daemonset["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true);
    for container in spec["containers"].as_array().unwrap() {
        assert!(
            container["ports"].as_array().is_none_or(Vec::is_empty),
            "{}: a hostNetwork pod's declared port is a host port the surge pod cannot have",
            container["name"]
        );
    }
}

/// The egress DaemonSet rolls the same way, and its agents hand their
/// sessions over on a hostPath both pods mount, writable by the agent's
/// user, apart from the node agent's hand-over socket.
#[test]
fn egress_agent_rollouts_hand_sessions_over_beside_the_old() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let objects = rendered_base("egress");
    let daemonset = objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .expect("the egress agent DaemonSet");
    let strategy = &daemonset["spec"]["updateStrategy"];
    assert_eq!(strategy["rollingUpdate"]["maxSurge"], 1, "{strategy}");
    assert_eq!(strategy["rollingUpdate"]["maxUnavailable"], 0, "{strategy}");
    let agents = runs(&objects);
    let agent = find(&agents, "DaemonSet/konnectivity-agent");
    assert!(
        agent.args.iter().any(|arg| arg == "--egress-handover"),
        "{:?}",
        agent.args
    );
    let socket = agent.flag("handover-socket").expect("a hand-over socket");
    let host = agent
        .host_path(socket)
        .expect("the hand-over socket is on a hostPath");
    let node_agents = runs(&rendered_base("node-to-kas"));
    let node_agent = find(&node_agents, "DaemonSet/konnectivity-node-agent");
    let node_socket = node_agent.flag("handover-socket").unwrap();
    assert_ne!(
        Some(host.clone()),
        node_agent.host_path(node_socket),
        "each role its own socket"
    );
    // The agent runs as a user that must be able to bind there.
    let user = agent.container["securityContext"]["runAsUser"].as_u64().unwrap();
    let init = agent.pod["initContainers"]
        .as_array()
        .and_then(|containers| containers.iter().find(|c| c["name"] == "handover-dir"))
        .expect("an init container makes the directory the agent's");
    let command: Vec<&str> = init["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let directory = socket.rsplit_once('/').unwrap().0;
    assert_eq!(command, ["chown", &format!("{user}:{user}"), directory]);
}

#[test]
fn the_image_ships_every_binary_the_manifests_run() {
    if !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let shipped: Vec<&str> = dockerfile
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("target/release/"))
        .collect();
    for base in BASES {
        for run in runs(&rendered_base(base)) {
            assert!(
                shipped.contains(&run.binary.as_str()),
                "{} runs {}, not in the image",
                run.workload,
                run.binary
            );
        }
    }
    // What the image copies is what the workspace builds.
    for binary in &shipped {
        let built = ["server", "agent", "cni-plugin", "test-client"]
            .iter()
            .any(|krate| {
                std::fs::read_to_string(repo().join(krate).join("Cargo.toml"))
                    .unwrap()
                    .contains(&format!("name = \"{binary}\""))
            });
        assert!(built, "the Dockerfile copies {binary}, which no crate builds");
    }
    assert!(
        shipped.contains(&"konnectivity-cni"),
        "install-cni copies the plugin from the image"
    );
}

/// The cluster certificates the manifests expect exist, chain as the
/// server will check them, and keep node and agent identities apart.
#[test]
fn cluster_certificates_split_agents_from_nodes() {
    if !tool_available("openssl", &["version"]) || !tool_available("kubectl", &["version", "--client"]) {
        return;
    }
    let dir = TempDir::new("konn-certs");
    let status = Command::new("bash")
        .arg(repo().join("hack/gen-certs.sh"))
        .args(["--cluster"])
        .arg(dir.path())
        .args(["--server-san", "DNS:cp.example", "--server-san", "IP:127.0.0.1"])
        .args(["--control-plane-agent", "konnectivity-cp-1", "--node", "node-1"])
        .status()
        .unwrap();
    assert!(status.success());
    let verify = |ca: &str, cert: &str| {
        Command::new("openssl")
            .args(["verify", "-CAfile"])
            .arg(dir.path().join(ca))
            .arg(dir.path().join(cert))
            .output()
            .unwrap()
            .status
            .success()
    };
    for cert in ["server.crt", "agent.crt", "konnectivity-cp-1.crt"] {
        assert!(verify("cluster-ca.crt", cert), "{cert}");
    }
    assert!(verify("node-client-ca.crt", "node-node-1.crt"));
    assert!(
        !verify("cluster-ca.crt", "node-node-1.crt"),
        "a node certificate must not pass as an agent"
    );
    assert!(
        !verify("node-client-ca.crt", "agent.crt"),
        "an agent certificate must not pass as a node"
    );

    // The file names the control-plane static pods mount.
    let control_plane = render(&repo().join("manifests/base/node-to-kas-control-plane"));
    for name in [
        "cluster-ca.crt",
        "server.crt",
        "server.key",
        "node-client-ca.crt",
        "konnectivity-cp-1.crt",
    ] {
        assert!(
            control_plane.contains(&format!("/etc/kubernetes/konnectivity/pki/{name}")),
            "{name}"
        );
        assert!(dir.path().join(name).exists(), "gen-certs.sh made no {name}");
    }
}

/// hack/kind-e2e.sh cannot run here (no container engine), but it must
/// parse, and without its tools it must say which are missing and stop
/// before touching anything.
#[test]
fn the_kind_e2e_script_parses_and_names_missing_tools() {
    let script = repo().join("hack/kind-e2e.sh");
    let syntax = Command::new("bash").arg("-n").arg(&script).output().unwrap();
    assert!(
        syntax.status.success(),
        "{}",
        String::from_utf8_lossy(&syntax.stderr)
    );

    let empty = TempDir::new("konn-no-tools");
    let output = Command::new("/bin/bash")
        .arg(&script)
        .env_clear()
        .env("PATH", empty.path())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("missing docker kind kubectl"), "{stderr}");

    let bad_mode = Command::new("/bin/bash")
        .arg(&script)
        .arg("everything")
        .output()
        .unwrap();
    assert_eq!(bad_mode.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_mode.stderr).contains("unknown mode 'everything'"));
}
