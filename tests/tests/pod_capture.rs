//! Pods reach the API server through the VIP, on Debian's real CNI plugins:
//! a conflist of `bridge` (with `host-local` IPAM), into which
//! `proxy-agent install-cni` chains `konnectivity-cni`, run the way a
//! container runtime runs it, attaches a "pod" network namespace to a bridge
//! in the node namespace (root). Each scenario runs with this build's
//! binaries and again with the image's (install-cni, the plugin it copies,
//! proxy-server and both agents).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use base64::Engine;

use crate::support::image::Binaries;
use crate::support::kas::*;
use crate::support::netns::{Netns, root_or_skip};
use crate::support::procs::Proc;
use serde_json::{Value, json};

/// A container runtime's view of one network: the conflist's plugins run in
/// order for ADD and in reverse for DEL, each given the previous result,
/// found in the CNI bin directories in order.
struct Runtime<'a> {
    topology: &'a Topology,
    /// The network's name, this test's own: libcni's cache on a real node is
    /// machine-global, and agents tell their pods apart by it.
    network: String,
    plugins: Vec<Value>,
    bin_dirs: Vec<PathBuf>,
}

/// A CNI network name no other test, and no other run on this machine, has.
/// A running pod: its namespace, its client process, the file its client
/// appends the API server's answers to, and the primary plugin's result.
type UnchainedPod = (Netns, Proc, PathBuf, Value);

fn network_name() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    format!(
        "konn-{}-{}-podnet",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

impl<'a> Runtime<'a> {
    /// A node's CNI set-up as the node agent's install-cni sidecar leaves
    /// it: the primary network's conflist in the configuration directory,
    /// then `proxy-agent install-cni` (from the topology's binaries) copies
    /// the plugin into the bin directory and chains it into that conflist.
    fn install(topology: &'a Topology) -> Runtime<'a> {
        let dir = topology.dir.path();
        let (conf_dir, bin_dir) = (dir.join("cni-conf"), dir.join("cni-bin"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        let conflist = conf_dir.join("10-podnet.conflist");
        let network = network_name();
        let primary = json!({
            "cniVersion": "1.0.0",
            "name": network,
            "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "10.244.1.0/24"}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": dir.join("ipam").display().to_string(),
                },
            }],
        });
        std::fs::write(&conflist, primary.to_string()).unwrap();
        let line = topology.binaries.command_line(
            "proxy-agent",
            &[
                "install-cni".to_owned(),
                format!("--cni-bin-dir={}", bin_dir.display()),
                format!("--cni-conf-dir={}", conf_dir.display()),
                format!("--agent-socket={}", dir.join("cni.sock").display()),
            ],
        );
        let installed = Command::new(&line[0]).args(&line[1..]).output().unwrap();
        assert!(installed.status.success(), "install-cni: {}", text(&installed));
        let conflist: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
        let plugins = conflist["plugins"].as_array().unwrap().clone();
        let types: Vec<&str> = plugins.iter().map(|p| p["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            ["bridge", "konnectivity-cni"],
            "install-cni chains the plugin last"
        );
        assert!(
            bin_dir.join("konnectivity-cni").is_file(),
            "install-cni copies the plugin into the bin directory"
        );
        Runtime {
            topology,
            network,
            plugins,
            bin_dirs: vec![bin_dir, PathBuf::from("/usr/lib/cni")],
        }
    }

    /// Runs one plugin inside the node namespace.
    fn exec(
        &self,
        plugin: &Value,
        command: &str,
        container: &str,
        pod: &Netns,
        prev: Option<&Value>,
    ) -> Output {
        let kind = plugin["type"].as_str().unwrap();
        let path = self
            .bin_dirs
            .iter()
            .map(|dir| dir.join(kind))
            .find(|path| path.is_file())
            .unwrap_or_else(|| panic!("no {kind} plugin in {:?}", self.bin_dirs));
        let mut conf = plugin.clone();
        conf["cniVersion"] = json!("1.0.0");
        conf["name"] = json!(self.network);
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.topology.node.name])
            .arg(&path)
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", container)
            .env("CNI_NETNS", format!("/var/run/netns/{}", pod.name))
            .env("CNI_IFNAME", "eth0")
            .env(
                "CNI_ARGS",
                format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={container}"),
            )
            .env("CNI_PATH", std::env::join_paths(&self.bin_dirs).unwrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// ADD through the chain; the final result, or the failing plugin's output.
    fn add(&self, container: &str, pod: &Netns) -> Result<Value, Output> {
        let mut prev: Option<Value> = None;
        for plugin in &self.plugins {
            let output = self.exec(plugin, "ADD", container, pod, prev.as_ref());
            if !output.status.success() {
                return Err(output);
            }
            prev = Some(serde_json::from_slice(&output.stdout).expect("ADD prints a result"));
        }
        Ok(prev.unwrap())
    }

    fn del(&self, container: &str, pod: &Netns, result: &Value) -> bool {
        self.plugins.iter().rev().all(|plugin| {
            self.exec(plugin, "DEL", container, pod, Some(result))
                .status
                .success()
        })
    }

    /// A pod set up by the primary plugin alone, as before konnectivity-cni
    /// was chained (or while the primary CNI had dropped our entry): its
    /// namespace pinned and its attachment cached, as the runtime leaves
    /// them, and a process in it that keeps trying the API server through
    /// the VIP, as a controller does (bounded: 240 tries, 1 s each at most),
    /// appending what it gets to the returned file. Also the primary's result.
    fn run_pod_unchained(&self, container: &str, namespace: &str) -> UnchainedPod {
        let topology = self.topology;
        let dir = topology.dir.path();
        let netns = Netns::bare("pod");
        let added = self.exec(&self.plugins[0], "ADD", container, &netns, None);
        assert!(added.status.success(), "bridge ADD: {}", text(&added));
        cache_attachment(
            topology,
            &self.network,
            &self.plugins[..1],
            container,
            &netns,
            namespace,
        );
        pin(topology, &netns);
        let answers = dir.join(format!("{container}-answers"));
        let client = netns.spawn_program(
            "sh",
            &[
                "-c".to_owned(),
                format!(
                    "for i in $(seq 1 240); do curl -s --max-time 1 --cacert {} https://{VIP}/version >> {}; sleep 0.25; done",
                    topology.pki.ca.display(),
                    answers.display()
                ),
            ],
            dir,
        );
        let primary: Value = serde_json::from_slice(&added.stdout).unwrap();
        (netns, client, answers, primary)
    }

    fn check_ours(&self, container: &str, pod: &Netns, result: &Value) -> Output {
        self.exec(&self.plugins[1], "CHECK", container, pod, Some(result))
    }
}

fn pod_agent_args(topology: &Topology) -> Vec<String> {
    let dir = topology.dir.path();
    // The test's own pin, cache and configuration directories: the
    // machine's /var/run/netns and /var/lib/cni hold other tests' and other
    // programs' namespaces and records, which are not this agent's pods.
    let pins = dir.join("netns");
    std::fs::create_dir_all(&pins).unwrap();
    vec![
        format!("--cni-socket={}", dir.join("cni.sock").display()),
        format!("--state-dir={}", dir.join("pods").display()),
        format!("--pod-netns-dir={}", pins.display()),
        format!("--cni-cache-dir={}", dir.join("cni-cache").display()),
        format!("--cni-conf-dir={}", dir.join("cni-conf").display()),
        "--exclude-namespaces=kube-system".to_owned(),
    ]
}

/// Pins a namespace in the test's pin directory (`--pod-netns-dir`), as a
/// runtime, `ip netns add` or any other tool pins one there.
fn pin(topology: &Topology, netns: &Netns) {
    let pins = topology.dir.path().join("netns");
    std::fs::create_dir_all(&pins).unwrap();
    std::os::unix::fs::symlink(format!("/var/run/netns/{}", netns.name), pins.join(&netns.name)).unwrap();
}

/// The runtime's CNI result cache entry for a pod, as containerd's libcni
/// writes it after the chain's ADD (`results/NETWORK-ID-IFNAME`): the
/// network's name and the configuration the chain ran with, base64.
fn cache_attachment(
    topology: &Topology,
    network: &str,
    chain: &[Value],
    container: &str,
    pod: &Netns,
    namespace: &str,
) {
    let results = topology.dir.path().join("cni-cache/results");
    std::fs::create_dir_all(&results).unwrap();
    let config = json!({"cniVersion": "1.0.0", "name": network, "plugins": chain});
    let entry = json!({
        "kind": "cniCacheV1",
        "containerId": container,
        "config": base64::engine::general_purpose::STANDARD.encode(config.to_string()),
        "ifName": "eth0",
        "networkName": network,
        "netns": format!("/var/run/netns/{}", pod.name),
        "cniArgs": [["IgnoreUnknown", "1"], ["K8S_POD_NAMESPACE", namespace], ["K8S_POD_NAME", container]],
        "result": {},
    });
    std::fs::write(
        results.join(format!("{network}-{container}-eth0")),
        entry.to_string(),
    )
    .unwrap();
}

fn curl_from_pod(topology: &Topology, pod: &Netns) -> Output {
    pod.sh(&format!(
        "curl -sS --max-time 10 --cacert {} https://{VIP}/version",
        topology.pki.ca.display()
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_the_api_server_through_the_vip_with_the_chained_plugin() {
    if !root_or_skip("pods_reach_the_api_server_through_the_vip_with_the_chained_plugin") {
        return;
    }
    pods_reach_the_api_server(Binaries::Build).await;
}

/// The same with the image's install-cni, plugin, proxy-server and agents,
/// each on the image's own filesystem (the plugin runs on the node, as the
/// runtime runs it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_the_image_pods_reach_the_api_server_through_the_vip_with_the_chained_plugin() {
    if !root_or_skip("from_the_image_pods_reach_the_api_server_through_the_vip_with_the_chained_plugin") {
        return;
    }
    if let Some(image) = Binaries::image() {
        pods_reach_the_api_server(image).await;
    }
}

async fn pods_reach_the_api_server(binaries: Binaries) {
    let topology = build_from(false, binaries).await;
    let mut agent = topology.start_node_agent(&pod_agent_args(&topology));
    topology.wait_node_ready().await;
    let runtime = Runtime::install(&topology);

    // Loopback down, as the kernel makes it: the agent brings it up itself
    // (its listener binds 127.0.0.1 there), with netlink, not `ip`.
    let pod = Netns::bare("pod");
    let result = runtime
        .add("pod-1", &pod)
        .unwrap_or_else(|o| panic!("ADD failed: {}", text(&o)));
    assert_eq!(
        result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .split('.')
            .take(3)
            .collect::<Vec<_>>(),
        ["10", "244", "1"]
    );

    let version = curl_from_pod(&topology, &pod);
    assert!(version.status.success(), "{}", text(&version));
    assert_eq!(String::from_utf8_lossy(&version.stdout), VERSION_BODY);
    // A pod whose connect() an eBPF load balancer rewrote to the endpoint
    // (Cilium's socket-LB in pods) is captured all the same.
    let endpoint = pod.sh(&format!(
        "curl -sS --max-time 10 --cacert {} https://{KAS}/version",
        topology.pki.ca.display()
    ));
    assert!(endpoint.status.success(), "{}", text(&endpoint));
    assert_eq!(String::from_utf8_lossy(&endpoint.stdout), VERSION_BODY);

    let check = runtime.check_ours("pod-1", &pod, &result);
    assert!(check.status.success(), "CHECK: {}", text(&check));

    assert!(runtime.del("pod-1", &pod, &result), "DEL failed");
    let after = curl_from_pod(&topology, &pod);
    assert!(
        !after.status.success(),
        "the pod's listener must be gone after DEL: {}",
        text(&after)
    );
    assert!(runtime.del("pod-1", &pod, &result), "a second DEL must succeed");
    let check = runtime.check_ours("pod-1", &pod, &result);
    assert!(!check.status.success(), "CHECK after DEL must fail");

    // With the agent stopped, ADD fails with "try again later": no pod runs uncaptured.
    agent.kill();
    let pod2 = Netns::bare("pod");
    let refused = runtime.add("pod-2", &pod2).expect_err("ADD without the agent");
    let error: Value = serde_json::from_slice(&refused.stdout).unwrap();
    assert_eq!(error["code"], 11, "{}", text(&refused));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_reopens_the_pod_listeners_it_recorded() {
    if !root_or_skip("a_restarted_agent_reopens_the_pod_listeners_it_recorded") {
        return;
    }
    let topology = build(false).await;
    let mut agent = topology.start_node_agent(&pod_agent_args(&topology));
    topology.wait_node_ready().await;
    let runtime = Runtime::install(&topology);
    let pod = Netns::bare("pod");
    runtime
        .add("pod-1", &pod)
        .unwrap_or_else(|o| panic!("ADD failed: {}", text(&o)));

    agent.kill();
    let _agent = topology.start_node_agent(&pod_agent_args(&topology));
    topology.wait_node_ready().await;
    let mut last = None;
    for _ in 0..50 {
        let version = curl_from_pod(&topology, &pod);
        if version.status.success() {
            assert_eq!(String::from_utf8_lossy(&version.stdout), VERSION_BODY);
            return;
        }
        last = Some(version);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the pod's capture did not come back: {}", text(&last.unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_that_ran_before_the_agent_are_captured_when_it_starts() {
    if !root_or_skip("pods_that_ran_before_the_agent_are_captured_when_it_starts") {
        return;
    }
    let topology = build(false).await;
    let dir = topology.dir.path();
    let runtime = Runtime::install(&topology);
    let agent_args = pod_agent_args(&topology);

    // Two pods came up before konnectivity-cni was chained: the primary
    // plugin alone set up their network, so nothing captures them yet. The
    // runtime pinned their namespaces and cached their attachments; one is
    // in kube-system, which install-cni (and so the agent) excludes.
    let (pod, client, answers, primary) = runtime.run_pod_unchained("pod-early", "default");
    let (_system_pod, _system_client, system_answers, _) =
        runtime.run_pod_unchained("pod-system", "kube-system");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        std::fs::read_to_string(&answers).unwrap_or_default().is_empty(),
        "nothing answers the pod before the agent runs"
    );

    let _agent = topology.start_node_agent(&agent_args);
    topology.wait_node_ready().await;
    crate::support::wait_until(
        Duration::from_secs(10),
        "the running pod's own requests to get through",
        || async {
            std::fs::read_to_string(&answers)
                .unwrap_or_default()
                .contains(VERSION_BODY)
        },
    )
    .await;
    // Recorded like any pod, under the runtime's container id.
    let state = dir.join("pods").join("pod-early.json");
    assert!(
        state.is_file(),
        "recorded under the runtime's id: {}",
        state.display()
    );
    // The excluded namespace's pod is left alone.
    assert!(!dir.join("pods").join("pod-system.json").exists());
    assert!(
        !std::fs::read_to_string(&system_answers)
            .unwrap_or_default()
            .contains(VERSION_BODY),
        "a kube-system pod must not be enrolled"
    );

    // A pod created while the agent runs but our entry was missing from the
    // chain (the primary CNI had rewritten its file): the runtime's cache
    // names it once its ADD is done, and the agent's re-check captures it.
    let (_late_pod, _late_client, late_answers, _) = runtime.run_pod_unchained("pod-late", "default");
    crate::support::wait_until(
        Duration::from_secs(15),
        "the late pod to be captured by the re-check",
        || async {
            std::fs::read_to_string(&late_answers)
                .unwrap_or_default()
                .contains(VERSION_BODY)
        },
    )
    .await;
    assert!(dir.join("pods").join("pod-late.json").is_file());

    // The runtime's ADD for the same pod arrives after all (it was retrying
    // while the agent started): the capture in place is taken over, not
    // opened twice; CHECK finds it.
    let ours = runtime.exec(&runtime.plugins[1], "ADD", "pod-early", &pod, Some(&primary));
    assert!(
        ours.status.success(),
        "our ADD on an enrolled pod: {}",
        text(&ours)
    );
    let check = runtime.check_ours("pod-early", &pod, &primary);
    assert!(check.status.success(), "CHECK: {}", text(&check));

    // The pod goes away: its namespace is forgotten, its record removed.
    drop(client);
    drop(pod);
    crate::support::wait_until(
        Duration::from_secs(10),
        "the gone pod's record to be removed",
        || async { !state.exists() },
    )
    .await;
}

/// A namespace is enrolled only when the runtime recorded it as a pod of
/// this agent's network. Pinned beside a real pod of ours, in the same pin
/// directory: a namespace made with `ip netns add` (a lab's control plane, a
/// VPN) with no record; another agent's pod, on a network of another name;
/// another agent's pod on a network of the same name, whose chain pointed
/// konnectivity-cni at that agent's socket; and a record an earlier agent
/// left for the `ip netns add` namespace. None of them gets a table, a
/// listener or a record, at start or in the re-checks, and the foreign
/// namespace's own connections to the API server's addresses reach its own
/// listeners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_the_runtime_did_not_record_as_our_pods_are_never_touched() {
    if !root_or_skip("namespaces_the_runtime_did_not_record_as_our_pods_are_never_touched") {
        return;
    }
    let topology = build(false).await;
    let dir = topology.dir.path();
    let runtime = Runtime::install(&topology);

    // The foreign namespace serves the VIP and the API server's endpoint
    // itself, as a control plane in a one-machine lab does.
    let foreign = Netns::new("foreign");
    foreign.ip(&["addr", "add", "10.222.1.10/32", "dev", "lo"]);
    foreign.ip(&["addr", "add", &format!("{VIP}/32"), "dev", "lo"]);
    for addr in [KAS.to_owned(), format!("{VIP}:443")] {
        let listener = tokio::net::TcpListener::from_std(foreign.bind_tcp(&addr)).unwrap();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Ok((mut connection, _)) = listener.accept().await {
                let _ = connection
                    .write_all(b"the foreign namespace's own listener\n")
                    .await;
            }
        });
    }
    pin(&topology, &foreign);
    let foreign_answer = |addr: &str| foreign.sh(&format!("socat -u -T 5 TCP:{addr},connect-timeout=5 -"));
    let reaches_its_own = |addr: &str| {
        let answer = foreign_answer(addr);
        assert!(
            String::from_utf8_lossy(&answer.stdout).contains("own listener"),
            "the foreign namespace's connection to {addr} must reach its own listener: {}",
            text(&answer)
        );
    };
    reaches_its_own(KAS);

    let theirs = Netns::bare("theirs");
    let their_chain = [
        json!({"type": "ptp"}),
        json!({"type": "konnectivity-cni", "agentSocket": "/run/another-agent/cni.sock"}),
    ];
    cache_attachment(
        &topology,
        "another-network",
        &their_chain,
        "their-pod",
        &theirs,
        "default",
    );
    pin(&topology, &theirs);
    let same_name = Netns::bare("theirs");
    cache_attachment(
        &topology,
        &runtime.network,
        &their_chain,
        "their-other-pod",
        &same_name,
        "default",
    );
    pin(&topology, &same_name);
    let pods_dir = dir.join("pods");
    std::fs::create_dir_all(&pods_dir).unwrap();
    let legacy = pods_dir.join(format!("netns-{}.json", foreign.name));
    std::fs::write(
        &legacy,
        json!({"containerId": format!("netns-{}", foreign.name), "netns": format!("/var/run/netns/{}", foreign.name), "ifname": "eth0"})
            .to_string(),
    )
    .unwrap();

    let (_pod, _client, answers, _) = runtime.run_pod_unchained("pod-ours", "default");
    let agent = topology.start_node_agent(&pod_agent_args(&topology));
    topology.wait_node_ready().await;
    crate::support::wait_until(Duration::from_secs(10), "our pod to be enrolled", || async {
        std::fs::read_to_string(&answers)
            .unwrap_or_default()
            .contains(VERSION_BODY)
    })
    .await;
    // A pod of ours that the re-check enrols: once it is recorded, a
    // re-check has passed over the others too.
    let (_late, _late_client, _, _) = runtime.run_pod_unchained("pod-late", "default");
    crate::support::wait_until(
        Duration::from_secs(15),
        "the re-check to enrol the late pod",
        || async { pods_dir.join("pod-late.json").is_file() },
    )
    .await;

    let mut records: Vec<String> = std::fs::read_dir(&pods_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    records.sort();
    assert_eq!(
        records,
        ["pod-late.json", "pod-ours.json"],
        "records of our pods only"
    );
    for netns in [&foreign, &theirs, &same_name] {
        let tables = netns.sh("nft list tables");
        assert!(tables.status.success(), "{}", text(&tables));
        assert!(
            !String::from_utf8_lossy(&tables.stdout).contains("konnectivity"),
            "{} must have no table of ours: {}",
            netns.name,
            text(&tables)
        );
    }
    reaches_its_own(KAS);
    reaches_its_own(&format!("{VIP}:443"));
    // Said once, counted: the three pins that are no pods of ours.
    let log = agent.log_text();
    let started = log
        .lines()
        .find(|line| line.contains("pod capture started"))
        .unwrap_or_else(|| panic!("no start-up line:\n{log}"));
    for field in [
        "enrolled=1",
        "pinned_left_alone=3",
        "other_networks=2",
        "restored=0",
    ] {
        assert!(started.contains(field), "{field} in {started}");
    }
    assert!(!legacy.exists(), "the earlier agent's record is dropped");
}

/// The one-machine lab: the control plane's namespace (proxy-server,
/// the control-plane agent, the API server on its private address) and the
/// node's are both pinned where the runtime pins pods, as `ip netns add`
/// pins them. With pod capture on, the node agent leaves the control
/// plane's namespace alone, so node → KAS and pod → KAS both work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_to_kas_works_with_pod_capture_on_a_machine_that_also_holds_the_control_plane() {
    if !root_or_skip("node_to_kas_works_with_pod_capture_on_a_machine_that_also_holds_the_control_plane") {
        return;
    }
    let topology = build(false).await;
    let runtime = Runtime::install(&topology);
    pin(&topology, &topology.control_plane);
    pin(&topology, &topology.node);
    let _agent = topology.start_node_agent(&pod_agent_args(&topology));
    topology.wait_node_ready().await;

    let kubectl = topology.kubectl_get_raw(&topology.node, "/version");
    assert!(kubectl.status.success(), "node → KAS: {}", text(&kubectl));
    assert!(String::from_utf8_lossy(&kubectl.stdout).contains("v1.31.0-konnectivity-standin"));

    let pod = Netns::bare("pod");
    runtime
        .add("pod-1", &pod)
        .unwrap_or_else(|o| panic!("ADD failed: {}", text(&o)));
    let from_pod = curl_from_pod(&topology, &pod);
    assert!(from_pod.status.success(), "pod → KAS: {}", text(&from_pod));
    assert_eq!(String::from_utf8_lossy(&from_pod.stdout), VERSION_BODY);

    // Past a re-check (it enrols a pod of ours), still so.
    let (_late, _late_client, late_answers, _) = runtime.run_pod_unchained("pod-late", "default");
    crate::support::wait_until(
        Duration::from_secs(15),
        "the re-check to enrol the late pod",
        || async {
            std::fs::read_to_string(&late_answers)
                .unwrap_or_default()
                .contains(VERSION_BODY)
        },
    )
    .await;
    let tables = topology.control_plane.sh("nft list tables");
    assert!(
        !String::from_utf8_lossy(&tables.stdout).contains("konnectivity"),
        "the control plane's namespace must have no table of ours: {}",
        text(&tables)
    );
    let kubectl = topology.kubectl_get_raw(&topology.node, "/version");
    assert!(kubectl.status.success(), "node → KAS: {}", text(&kubectl));
}
