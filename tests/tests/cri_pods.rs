//! Pods made by containerd's CRI, as kubelet makes them, reach the API
//! server through the VIP (root, containerd 1.6 from Debian).
//!
//! ```text
//!  [pod netns] ──ptp── [node netns] ──veth── [control-plane netns]
//!   kubectl/curl         containerd (CRI)        proxy-server, control-plane agent,
//!   → 10.96.0.1:443      node proxy-agent        API server stand-in on 10.222.1.10:6443
//! ```
//!
//! The node's CNI configuration is a kind node's chain (ptp with host-local,
//! portmap), into which `proxy-agent install-cni` chains konnectivity-cni;
//! containerd runs the chain through libcni, writes libcni's cache, and runs
//! DEL when a pod stops. install-cni, the plugin, proxy-server and both
//! agents come from the image when `hack/image.sh` exported it (always under
//! CI), from this build otherwise.

use std::time::Duration;

use crate::support::containerd::containerd_or_skip;
use crate::support::cri_node::Node;
use crate::support::kas::*;
use crate::support::wait_until;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_from_containerds_cri_reach_the_api_server_through_the_vip_until_deleted() {
    if !containerd_or_skip("pods_from_containerds_cri_reach_the_api_server_through_the_vip_until_deleted") {
        return;
    }
    let node = Node::start(true, false).await;
    let containerd = &node.containerd;

    let pod = containerd
        .run_pod("web", "default")
        .await
        .unwrap_or_else(|status| panic!("RunPodSandbox: {status}\n{}", containerd.log()));
    // kubectl through the VIP: TLS end to end, verified against the API
    // server's CA; and curl, showing whose certificate it is.
    node.assert_reaches_the_api_server(&pod, "a new pod").await;
    let curl = containerd
        .run_to_completion(
            &pod,
            "curl",
            &[
                "curl",
                "-sS",
                "-v",
                "--max-time",
                "10",
                "--cacert",
                "/ca.crt",
                &format!("https://{VIP}/version"),
            ],
            &[(&node.topology.pki.ca, "/ca.crt")],
        )
        .await;
    assert_eq!(curl.exit_code, 0, "{}", curl.output);
    assert!(curl.output.contains(VERSION_BODY), "{}", curl.output);
    assert!(
        curl.output.contains("CN=kube-apiserver-standin"),
        "{}",
        curl.output
    );
    // Recorded under the sandbox id containerd gave it.
    assert!(
        node.record_of(&pod).is_file(),
        "the agent records the pod under its sandbox id"
    );
    assert!(node.has_table(&pod).await);

    // A kube-system pod starts, uncaptured.
    let system = containerd
        .run_pod("coredns", "kube-system")
        .await
        .unwrap_or_else(|status| panic!("RunPodSandbox in kube-system: {status}"));
    assert!(!node.record_of(&system).exists());
    assert!(
        !node.has_table(&system).await,
        "an excluded pod keeps no table of ours"
    );

    // Deleting the pod: StopPodSandbox runs DEL through the chain, which
    // releases the capture before it returns; RemovePodSandbox then succeeds.
    containerd.stop_pod(&pod).await.unwrap();
    assert!(!node.record_of(&pod).exists(), "DEL removes the agent's record");
    let released = node.agent.as_ref().unwrap().log_text();
    assert!(
        released.contains("pod released") && released.contains(&pod.id),
        "the agent releases the pod on DEL:\n{released}"
    );
    containerd.remove_pod(&pod).await.unwrap();
    containerd.stop_pod(&system).await.unwrap();
    containerd.remove_pod(&system).await.unwrap();
    let cache: Vec<_> = std::fs::read_dir(containerd.cni_cache_dir.join("results"))
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name())
        .collect();
    assert!(
        cache.is_empty(),
        "containerd removes its cache entries on DEL: {cache:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_pods_ride_out_agent_and_containerd_restarts() {
    if !containerd_or_skip("captured_pods_ride_out_agent_and_containerd_restarts") {
        return;
    }
    let mut node = Node::start(true, false).await;
    let pod = node.containerd.run_pod("web", "default").await.unwrap();
    node.assert_reaches_the_api_server(&pod, "a new pod").await;

    // The agent killed and started again: it re-opens what it recorded.
    node.kill_agent();
    node.start_agent();
    node.topology.wait_node_ready().await;
    node.assert_reaches_the_api_server(&pod, "after an agent restart")
        .await;

    // The agent's records lost (a new node agent on a node whose pods run):
    // it enrols the pod from the cache containerd wrote, under its sandbox id.
    node.kill_agent();
    std::fs::remove_dir_all(node.state_dir()).unwrap();
    node.start_agent();
    node.topology.wait_node_ready().await;
    node.assert_reaches_the_api_server(&pod, "after an agent restart without its records")
        .await;
    assert!(node.record_of(&pod).is_file());
    let log = node.agent.as_ref().unwrap().log_text();
    assert!(
        log.contains("enrolled=1"),
        "enrolled from containerd's cache:\n{log}"
    );

    // containerd restarted: the pod, its namespace and its capture stay.
    node.containerd.restart().await;
    node.assert_reaches_the_api_server(&pod, "after a containerd restart")
        .await;
    node.containerd.stop_pod(&pod).await.unwrap();
    assert!(
        !node.record_of(&pod).exists(),
        "the restarted containerd's DEL reaches the agent"
    );
    node.containerd.remove_pod(&pod).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_created_while_the_agent_is_down_fails_closed_and_starts_once_it_is_back() {
    if !containerd_or_skip("a_pod_created_while_the_agent_is_down_fails_closed_and_starts_once_it_is_back") {
        return;
    }
    let mut node = Node::start(true, false).await;
    node.kill_agent();
    let refused = match node.containerd.run_pod("web", "default").await {
        Ok(_) => panic!("RunPodSandbox succeeded with the node agent down"),
        Err(status) => status,
    };
    // kubelet's event shows the plugin's own words, naming the socket.
    let socket = node.dir().join("cni.sock");
    assert!(
        refused
            .message()
            .contains(&format!("cannot reach the node agent at {}", socket.display())),
        "the runtime reports our plugin's error: {refused}"
    );
    // containerd tore the half-made sandbox down (DEL through the chain):
    // no sandbox, no pinned namespace, no cache entry is left.
    assert!(node.containerd.sandboxes().await.is_empty());
    assert_eq!(std::fs::read_dir(&node.containerd.netns_dir).unwrap().count(), 0);
    let cache = node.containerd.cni_cache_dir.join("results");
    assert_eq!(std::fs::read_dir(&cache).map(Iterator::count).unwrap_or(0), 0);

    // kubelet tries again; the agent is back.
    node.start_agent();
    node.topology.wait_node_ready().await;
    let pod = node
        .containerd
        .run_pod("web", "default")
        .await
        .unwrap_or_else(|status| panic!("RunPodSandbox with the agent back: {status}"));
    node.assert_reaches_the_api_server(&pod, "a pod created once the agent was back")
        .await;
    node.containerd.stop_pod(&pod).await.unwrap();
    node.containerd.remove_pod(&pod).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_that_ran_before_the_plugin_was_chained_are_enrolled_from_containerds_cache() {
    if !containerd_or_skip("pods_that_ran_before_the_plugin_was_chained_are_enrolled_from_containerds_cache")
    {
        return;
    }
    // A live cluster before the DaemonSet: containerd sets pods up with the
    // primary chain alone.
    let mut node = Node::start(false, false).await;
    let early = node.containerd.run_pod("early", "default").await.unwrap();
    let system = node.containerd.run_pod("coredns", "kube-system").await.unwrap();
    assert!(!node.has_table(&early).await);

    // The DaemonSet arrives: install-cni chains the plugin, the agent starts.
    node.install_cni();
    node.start_agent();
    node.topology.wait_node_ready().await;
    let record = node.record_of(&early);
    wait_until(
        Duration::from_secs(10),
        "the running pod to be enrolled",
        || async { record.is_file() },
    )
    .await;
    node.assert_reaches_the_api_server(&early, "a pod that ran before the plugin was chained")
        .await;
    assert!(!node.record_of(&system).exists());
    assert!(
        !node.has_table(&system).await,
        "an excluded pod keeps no table of ours"
    );
    for pod in [&early, &system] {
        node.containerd.stop_pod(pod).await.unwrap();
        node.containerd.remove_pod(pod).await.unwrap();
    }
    assert!(!record.exists());
}
