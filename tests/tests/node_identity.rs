//! An agent serves only its own node (`--agent-identifiers-check`): with
//! the destHost strategy, a dial goes to the agent that claims its address,
//! so an agent's claims are checked against the node its credential names.
//! Here the credential is a bound ServiceAccount token: the stand-in
//! kube-apiserver's TokenReview names the node (as kube-apiserver 1.30 and
//! later do for a DaemonSet pod's token) and serves the Nodes (get, list,
//! watch); agents are the real binary, and which agent served a dial is
//! read off each agent's own dial counter.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::certs::Pki;
use crate::support::grpc::play_agent;
use crate::support::kube_api::{AGENT_AUDIENCE, AGENT_USER, KubeApi};
use crate::support::procs::{Agent, Server};
use crate::support::routing::{served_by, target_on};
use crate::support::scrape::metric;
use crate::support::{TempDir, wait_until};

/// Node tokens: a DaemonSet pod's on node-a and on node-b; and a token
/// that names no node (a cluster before 1.30, or a legacy Secret token).
const TOKEN_A: &str = "token-of-the-pod-on-node-a";
const TOKEN_B: &str = "token-of-the-pod-on-node-b";
const TOKEN_NO_NODE: &str = "token-naming-no-node";

const CLAIMS: &str = "konnectivity_network_proxy_server_agent_identifier_claims_total";

/// A Node as kubelet registers it, with one InternalIP.
fn node(name: &str, internal_ip: &str, pod_cidr: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": internal_ip},
                {"type": "Hostname", "address": name},
            ],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    })
}

/// The stand-in with node-a (127.0.0.5) and node-b (127.0.0.6), the tokens
/// bound to them, and a server authenticating agents by token, routing by
/// destHost only, with `extra` flags.
async fn start(dir: &Path, pki: &Pki, extra: &[&str]) -> (KubeApi, Server) {
    let api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    api.review_tokens(
        AGENT_AUDIENCE,
        &[
            (TOKEN_A, AGENT_USER),
            (TOKEN_B, AGENT_USER),
            (TOKEN_NO_NODE, AGENT_USER),
        ],
    );
    let uid_a = api.put_node(node("node-a", "127.0.0.5", "10.244.1.0/24"));
    let uid_b = api.put_node(node("node-b", "127.0.0.6", "10.244.2.0/24"));
    api.bind_token_to_node(TOKEN_A, "node-a", &uid_a);
    api.bind_token_to_node(TOKEN_B, "node-b", &uid_b);
    let mut flags = api.token_auth_flags(dir);
    flags.push("--proxy-strategies=destHost".to_owned());
    flags.extend(extra.iter().map(|flag| (*flag).to_owned()));
    let server = Server::start(dir, pki, "http-connect", true, &flags).await;
    (api, server)
}

/// A real agent with `token` claiming `identifiers`.
fn token_agent(dir: &Path, pki: &Pki, server: &Server, id: &str, token: &str, identifiers: &str) -> Agent {
    let token_file = dir.join(format!("{id}.token"));
    std::fs::write(&token_file, token).unwrap();
    Agent::start(
        dir,
        pki,
        server.agent_port,
        id,
        &[
            "--agent-cert=".to_owned(),
            "--agent-key=".to_owned(),
            format!("--service-account-token-path={}", token_file.display()),
            format!("--agent-identifiers={identifiers}"),
        ],
    )
}

async fn claims(server: &Server, outcome: &str, reason: &str) -> f64 {
    metric(
        server.health_port,
        &format!("{CLAIMS}{{outcome=\"{outcome}\",reason=\"{reason}\"}}"),
    )
    .await
    .unwrap_or(0.0)
}

/// An agent on node-a claims node-a's address and node-b's (and one that
/// is no node's yet); the agent on node-b claims its own. Dials to node-b
/// all go to node-b's agent, node-a's to node-a's; the dropped claim is
/// logged with agent, node, identifier and reason, and counted. Then
/// node-a's address moves to the third address: within 5 s dials to the
/// new address reach node-a's agent and the old one no agent. Then node-a
/// is deleted: within 5 s its agent serves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serves_only_the_addresses_its_node_has_as_the_node_changes() {
    let dir = TempDir::new("konn-node-identity");
    let pki = Pki::new(dir.path());
    let (api, server) = start(dir.path(), &pki, &[]).await;
    let agent_a = token_agent(
        dir.path(),
        &pki,
        &server,
        "agent-a",
        TOKEN_A,
        "ipv4=127.0.0.5&ipv4=127.0.0.6&ipv4=127.0.0.7",
    );
    let agent_b = token_agent(dir.path(), &pki, &server, "agent-b", TOKEN_B, "ipv4=127.0.0.6");
    server.wait_backends(2).await;
    let agents = [("agent-a", &agent_a), ("agent-b", &agent_b)];
    let (_a, on_a) = target_on("127.0.0.5").await;
    let (_b, on_b) = target_on("127.0.0.6").await;
    let (_moved, on_moved) = target_on("127.0.0.7").await;
    let uds = server.uds_path();

    // Without the check, agent-a would take about half of node-b's dials.
    for _ in 0..20 {
        assert_eq!(served_by(uds, &agents, &on_b).await.unwrap(), "agent-b");
    }
    for _ in 0..3 {
        assert_eq!(served_by(uds, &agents, &on_a).await.unwrap(), "agent-a");
    }
    let refused = served_by(uds, &agents, &on_moved)
        .await
        .expect_err("127.0.0.7 is no node's address yet");
    assert_eq!(refused.status, 500, "{refused:?}");
    assert_eq!(claims(&server, "admitted", "node_has_it").await, 2.0);
    assert_eq!(claims(&server, "dropped", "not_the_nodes").await, 2.0);
    let log = server.proc.log_text();
    for dropped in ["127.0.0.6", "127.0.0.7"] {
        assert!(
            log.lines().any(
                |line| line.contains("dropped an identifier the agent's node does not have")
                    && line.contains("agent_id=\"agent-a\"")
                    && line.contains("node=\"node-a\"")
                    && line.contains(&format!("identifier=\"ipv4={dropped}\""))
                    && line.contains("reason=\"not one of the Node's addresses")
            ),
            "{log}"
        );
    }

    // node-a's address moves: its agent's route follows. The server's
    // Node watch has just been ended (as kube-apiserver ends every watch
    // after its timeout): the change arrives on the next one, which goes on
    // from the last version seen, without listing again.
    api.end_watches();
    api.put_node(node("node-a", "127.0.0.7", "10.244.1.0/24"));
    let moved = Instant::now();
    wait_until(
        Duration::from_secs(5),
        "node-a's new address to reach its agent",
        || async { matches!(served_by(uds, &agents, &on_moved).await, Ok("agent-a")) },
    )
    .await;
    let refused = served_by(uds, &agents, &on_a)
        .await
        .expect_err("127.0.0.5 is no longer node-a's");
    assert_eq!(refused.status, 500, "{refused:?}");
    println!("route moved after {:?}", moved.elapsed());
    assert_eq!(claims(&server, "admitted", "node_has_it").await, 3.0);
    assert_eq!(claims(&server, "dropped", "not_the_nodes").await, 3.0);

    // node-a is deleted: its agent serves nothing; node-b's still serves.
    // The deletion happens while the server is between watches and the
    // history before it is compacted away (etcd compaction): the server's
    // next watch is answered 410 Expired and it lists the Nodes again.
    api.hold_watches(true);
    let watches = api.calls("GET watch node");
    api.end_watches();
    wait_until(Duration::from_secs(5), "the server to watch again", || async {
        api.calls("GET watch node") > watches
    })
    .await;
    api.delete_node("node-a");
    api.put_node(node("node-c", "127.0.0.8", "10.244.3.0/24"));
    api.compact();
    api.hold_watches(false);
    wait_until(
        Duration::from_secs(5),
        "node-a's agent to lose its routes",
        || async { served_by(uds, &agents, &on_moved).await.is_err() },
    )
    .await;
    assert_eq!(served_by(uds, &agents, &on_b).await.unwrap(), "agent-b");
    assert_eq!(claims(&server, "dropped", "node_not_found").await, 3.0);
    let ready = metric(
        server.health_port,
        r#"konnectivity_network_proxy_server_ready_backends{proxy_strategy="destHost"}"#,
    )
    .await;
    assert_eq!(ready, Some(1.0), "only node-b's agent can serve destHost dials");
    // One list and one watch of Nodes for the server, however many agents,
    // taken up again after each end; listed again only after the 410.
    assert_eq!(api.calls("GET list node"), 2);
    assert_eq!(api.calls("GET watch node"), 4);
}

/// Plays an agent with `token` claiming `identifiers`; how the server
/// answered the stream.
async fn connect_with(
    server: &Server,
    pki: &Pki,
    token: &str,
    identifiers: &str,
) -> Result<(), tonic::Status> {
    play_agent(server.agent_port, pki, Some(token), Some(identifiers)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_refuses_a_claim_the_node_does_not_have_and_a_credential_naming_no_node() {
    let dir = TempDir::new("konn-node-identity");
    let pki = Pki::new(dir.path());
    let (_api, server) = start(dir.path(), &pki, &["--agent-identifiers-check=strict"]).await;
    let refused = connect_with(&server, &pki, TOKEN_A, "ipv4=127.0.0.5&ipv4=127.0.0.6")
        .await
        .expect_err("node-b's address on node-a's token");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("node node-a")
            && refused.message().contains("--agent-identifiers-check=strict")
            && refused
                .message()
                .contains("ipv4=127.0.0.6 (not one of the Node's addresses"),
        "{refused:?}"
    );
    let refused = connect_with(&server, &pki, TOKEN_NO_NODE, "ipv4=127.0.0.5")
        .await
        .expect_err("a credential naming no node");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("names no node"), "{refused:?}");
    // Its own node's addresses only: admitted.
    connect_with(
        &server,
        &pki,
        TOKEN_A,
        "ipv4=127.0.0.5&host=node-a&cidr=10.244.1.0/25",
    )
    .await
    .expect("node-a's own address, host name and pod range");
    assert_eq!(claims(&server, "refused", "not_the_nodes").await, 1.0);
    assert_eq!(claims(&server, "refused", "no_node_in_credential").await, 1.0);
    assert_eq!(claims(&server, "admitted", "node_has_it").await, 3.0);
}

/// Where the credential names no node, the default takes the claims as
/// upstream does and says so once per agent; with the check off, every
/// claim is taken as made (upstream's behaviour), counted as unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_node_or_with_the_check_off_claims_are_taken_as_made_and_said_so() {
    let dir = TempDir::new("konn-node-identity");
    let pki = Pki::new(dir.path());
    let (api, server) = start(dir.path(), &pki, &[]).await;
    for _ in 0..2 {
        connect_with(&server, &pki, TOKEN_NO_NODE, "ipv4=127.0.0.6")
            .await
            .expect("no node: taken as claimed");
    }
    assert_eq!(claims(&server, "unchecked", "no_node_in_credential").await, 2.0);
    let told = server
        .proc
        .log_text()
        .matches("the agent's credential names no node")
        .count();
    assert_eq!(told, 1, "told once per agent");
    // No agent named a node: the server never read Nodes.
    assert_eq!(api.calls("GET list node"), 0);
    drop(server);

    let dir = TempDir::new("konn-node-identity");
    let pki = Pki::new(dir.path());
    let (api, server) = start(dir.path(), &pki, &["--agent-identifiers-check=off"]).await;
    let agent_a = token_agent(dir.path(), &pki, &server, "agent-a", TOKEN_A, "ipv4=127.0.0.6");
    server.wait_backends(1).await;
    let (_b, on_b) = target_on("127.0.0.6").await;
    assert_eq!(
        served_by(server.uds_path(), &[("agent-a", &agent_a)], &on_b)
            .await
            .unwrap(),
        "agent-a",
        "with the check off, a claim is taken as made"
    );
    assert_eq!(claims(&server, "unchecked", "check_off").await, 1.0);
    assert_eq!(api.calls("GET list node"), 0);
}
