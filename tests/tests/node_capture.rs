//! Node → kube-apiserver, transparently, in network namespaces (root).
//!
//! ```text
//!  [node netns] 10.222.0.1 ──veth── 10.222.0.2 [control-plane netns]
//!   curl/kubectl → 10.96.0.1:443                proxy-server (agent port, node frontend)
//!   nft REDIRECT → node proxy-agent :15443      control-plane proxy-agent (cp-1)
//!   (no route to 10.222.1.10)                   nginx "kube-apiserver" on 10.222.1.10:6443 (lo)
//! ```

use std::time::Duration;

use crate::support::image::Binaries;
use crate::support::kas::*;
use crate::support::netns::root_or_skip;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_processes_reach_the_private_api_server_through_the_vip() {
    if !root_or_skip("node_processes_reach_the_private_api_server_through_the_vip") {
        return;
    }
    node_processes_reach_the_api_server(Binaries::Build).await;
}

/// The same with proxy-server and both agents from the image, on its own
/// filesystem: its nft, its libc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_the_image_node_processes_reach_the_private_api_server_through_the_vip() {
    if !root_or_skip("from_the_image_node_processes_reach_the_private_api_server_through_the_vip") {
        return;
    }
    if let Some(image) = Binaries::image() {
        node_processes_reach_the_api_server(image).await;
    }
}

async fn node_processes_reach_the_api_server(binaries: Binaries) {
    let topology = build_from(true, binaries).await;
    // Without the tunnel, the node has no way to the API server's address.
    let direct = topology.curl(&format!("--connect-timeout 2 https://{KAS}/version"));
    assert!(
        !direct.status.success(),
        "the node must not reach {KAS} directly: {}",
        text(&direct)
    );

    // The node agent also captures its own server address (as a cluster might
    // route the server through a captured VIP): its own sockets carry the mark,
    // so they must never be captured, or the tunnel would loop into itself.
    let loop_guard = format!("--capture={SERVER_IP}:{NODE_FRONTEND_PORT}={KAS}");
    let _agent = topology.start_node_agent(&[loop_guard]);
    topology.wait_node_ready().await;
    assert!(topology.has_table());

    // curl with the API server's CA: TLS is end to end, so this verifies
    // nginx's certificate (SAN 10.96.0.1) through the tunnel.
    let version = topology.curl(&format!("-v https://{VIP}/version"));
    assert!(version.status.success(), "{}", text(&version));
    assert_eq!(String::from_utf8_lossy(&version.stdout), VERSION_BODY);
    assert!(
        String::from_utf8_lossy(&version.stderr).contains("CN=kube-apiserver-standin"),
        "the certificate seen must be the API server's: {}",
        text(&version)
    );

    // Socket-LB, simulated honestly: Cilium's kube-proxy replacement and
    // Calico's eBPF data plane rewrite the VIP to the endpoint inside
    // connect(), so the client's first packet is addressed to the API
    // server's private endpoint, which this node cannot route to. The
    // endpoint is captured too, so it still arrives.
    let endpoint = topology.curl(&format!("https://{KAS}/version"));
    assert!(endpoint.status.success(), "{}", text(&endpoint));
    assert_eq!(String::from_utf8_lossy(&endpoint.stdout), VERSION_BODY);

    // kubectl with a kubeconfig as a node has it: the server is the VIP.
    let kubectl = topology.kubectl_get_raw(&topology.node, "/version");
    assert!(kubectl.status.success(), "{}", text(&kubectl));
    assert!(String::from_utf8_lossy(&kubectl.stdout).contains("v1.31.0-konnectivity-standin"));

    // 200 MiB through the captured path, checksummed inside the node.
    let download = topology.curl(&format!("https://{VIP}/files/blob | sha256sum"));
    assert!(download.status.success(), "{}", text(&download));
    assert!(
        String::from_utf8_lossy(&download.stdout).starts_with(&topology.blob_sha256),
        "200 MiB arrived changed: {}",
        text(&download)
    );

    // 200 concurrent captured connections, each answered correctly.
    let urls: String = (0..200)
        .map(|i| format!(" https://{VIP}/version?n={i}"))
        .collect();
    let parallel = topology.curl(&format!(
        "--parallel --parallel-max 200 --parallel-immediate{urls}"
    ));
    assert!(parallel.status.success(), "{}", text(&parallel));
    let bodies = String::from_utf8_lossy(&parallel.stdout)
        .matches(VERSION_BODY)
        .count();
    assert_eq!(bodies, 200, "{}", text(&parallel));

    // The IPv6 service VIP is captured the same way (SO_ORIGINAL_DST v6).
    let v6 = topology.curl(&format!("-g https://[{VIP6}]/version"));
    assert!(v6.status.success(), "{}", text(&v6));
    assert_eq!(String::from_utf8_lossy(&v6.stdout), VERSION_BODY);

    // A connection redirected to the listener for a destination that is not
    // in the capture map is closed and counted, never forwarded.
    let stray = topology
        .node
        .sh("nft add rule inet konnectivity output ip daddr 10.96.0.2 tcp dport 443 redirect to :15443");
    assert!(stray.status.success(), "{}", text(&stray));
    let refused = topology.curl("https://10.96.0.2/version");
    assert!(!refused.status.success(), "{}", text(&refused));
    let unknown = topology.node.metric(
        NODE_AGENT_HEALTH,
        "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"unknown_destination\"}",
    );
    assert_eq!(unknown, Some(1.0));

    let tunneled = topology.node.metric(
        NODE_AGENT_HEALTH,
        "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"tunneled\"}",
    );
    assert!(tunneled.unwrap_or(0.0) >= 205.0, "tunneled {tunneled:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_resumes_capturing_and_a_clean_shutdown_removes_the_rules() {
    if !root_or_skip("a_restarted_agent_resumes_capturing_and_a_clean_shutdown_removes_the_rules") {
        return;
    }
    let topology = build(true).await;
    let mut agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    assert!(topology.version_through_vip().status.success());

    // A crash leaves the rules in place: clients fail fast (reset) meanwhile.
    agent.kill();
    assert!(topology.has_table(), "rules must survive a crash");
    let during = topology.version_through_vip();
    assert!(!during.status.success(), "no agent, no answer: {}", text(&during));

    let mut agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    let after = topology.version_through_vip();
    assert!(after.status.success(), "{}", text(&after));
    assert_eq!(String::from_utf8_lossy(&after.stdout), VERSION_BODY);

    // Two SIGTERMs (drain, then exit) end it cleanly and take the table away.
    agent.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.signal("TERM");
    assert!(
        agent.wait_exit(Duration::from_secs(5)).await.is_some(),
        "agent did not exit"
    );
    assert!(
        !topology.has_table(),
        "a clean shutdown must remove the konnectivity table"
    );
}

/// How long `/readyz` may take to follow the node tunnel, either way.
const READINESS_BOUND: Duration = Duration::from_secs(9);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_readiness_follows_the_node_tunnel() {
    if !root_or_skip("node_readiness_follows_the_node_tunnel") {
        return;
    }
    let topology = build(false).await;
    let _agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    let up = "konnectivity_network_proxy_agent_node_tunnel_up";
    assert_eq!(topology.node.metric(NODE_AGENT_HEALTH, up), Some(1.0));

    // An idle tunnel is watched by HTTP/2 PINGs, which open no stream at the
    // server: a probe stream each second would be three more by the end.
    let streams = r#"konnectivity_network_proxy_server_node_frontend_streams_total{identity="node"}"#;
    let before = topology.control_plane.metric(SERVER_HEALTH, streams);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        topology.control_plane.metric(SERVER_HEALTH, streams),
        before,
        "no probe stream on an idle node tunnel"
    );

    // Cut the node tunnel alone (the agent's own stream to the agent port
    // stays up): the node namespace drops everything to the node frontend.
    let cut = topology.node.sh(&format!(
        "nft add table inet cut && nft add chain inet cut out '{{ type filter hook output priority 0; }}' \
         && nft add rule inet cut out tcp dport {NODE_FRONTEND_PORT} drop"
    ));
    assert!(cut.status.success(), "{}", text(&cut));
    let node = &topology.node;
    let started = std::time::Instant::now();
    crate::support::wait_until(READINESS_BOUND, "/readyz to turn 503", || async {
        node.http_get(NODE_AGENT_HEALTH, "/readyz").0 == 503
    })
    .await;
    let (_, body) = node.http_get(NODE_AGENT_HEALTH, "/readyz");
    assert!(body.contains("node tunnel down"), "{body}");
    assert_eq!(node.metric(NODE_AGENT_HEALTH, up), Some(0.0));
    eprintln!("503 after {:?}", started.elapsed());

    // The path comes back: ready again, and captured connections flow.
    let restored = node.sh("nft delete table inet cut");
    assert!(restored.status.success(), "{}", text(&restored));
    let started = std::time::Instant::now();
    crate::support::wait_until(READINESS_BOUND, "/readyz to turn 200 again", || async {
        node.http_get(NODE_AGENT_HEALTH, "/readyz").0 == 200
    })
    .await;
    eprintln!("200 after {:?}", started.elapsed());
    assert_eq!(node.metric(NODE_AGENT_HEALTH, up), Some(1.0));
    let version = topology.version_through_vip();
    assert!(version.status.success(), "{}", text(&version));
    assert_eq!(String::from_utf8_lossy(&version.stdout), VERSION_BODY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kube_proxy_dnat_rule_does_not_take_the_connection_from_the_capture() {
    if !root_or_skip("a_kube_proxy_dnat_rule_does_not_take_the_connection_from_the_capture") {
        return;
    }
    let topology = build(false).await;
    // kube-proxy's nftables mode: the VIP is DNATed to the endpoint at
    // priority -100 in the output hook (iptables mode's KUBE-SERVICES is the
    // same hook and priority).
    let kube_proxy = topology.node.sh(&format!(
        "nft add table ip kube-proxy-like && \
         nft add chain ip kube-proxy-like output '{{ type nat hook output priority -100; }}' && \
         nft add rule ip kube-proxy-like output ip daddr {VIP} tcp dport 443 dnat to {KAS}"
    ));
    assert!(kube_proxy.status.success(), "{}", text(&kube_proxy));
    let _agent = topology.start_node_agent(&[]);
    topology.wait_node_ready().await;
    let version = topology.version_through_vip();
    assert!(version.status.success(), "{}", text(&version));
    assert_eq!(String::from_utf8_lossy(&version.stdout), VERSION_BODY);
    let tunneled = topology.node.metric(
        NODE_AGENT_HEALTH,
        "konnectivity_network_proxy_agent_captured_connections_total{outcome=\"tunneled\"}",
    );
    assert_eq!(tunneled, Some(1.0), "the connection went through the capture");
}
