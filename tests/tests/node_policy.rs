//! The node-traffic policy on the server: node clients reach only the
//! allowed API server destinations, only through control-plane agents, and
//! control-plane agents never carry ordinary egress.

use std::time::Duration;

use crate::support::certs::Pki;
use crate::support::procs::{Agent, Server};
use crate::support::scrape::metric;
use crate::support::targets::{self, Target};
use crate::support::{TempDir, free_port, wait_until};
use konnectivity_client::{DialError, Tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONTROL_PLANE_ID: &str = "cp-1";

struct NodeSetup {
    dir: TempDir,
    pki: Pki,
    server: Server,
    node_port: u16,
    /// What node clients may reach (the "API server").
    allowed: Target,
    /// Reachable on loopback, but not allowed for node clients.
    other: Target,
    cluster_agent: Agent,
    control_plane_agent: Agent,
}

async fn setup() -> NodeSetup {
    let dir = TempDir::new("konn-node");
    let pki = Pki::new(dir.path());
    let allowed = targets::blob().await;
    let other = targets::blob().await;
    let node_port = free_port();
    let server = Server::start(
        dir.path(),
        &pki,
        "grpc",
        true,
        &[
            format!("--node-frontend-port={node_port}"),
            "--node-frontend-bind-address=127.0.0.1".to_owned(),
            format!("--node-client-ca-cert={}", pki.node_ca.display()),
            format!("--node-allowed-destinations={},10.96.0.0/12:443", allowed.addr),
            format!("--control-plane-agent-ids={CONTROL_PLANE_ID}"),
        ],
    )
    .await;
    let cluster_agent = Agent::start(dir.path(), &pki, server.agent_port, "cluster-1", &[]);
    let control_plane_agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        CONTROL_PLANE_ID,
        &[
            format!("--agent-cert={}", pki.control_plane_agent.cert.display()),
            format!("--agent-key={}", pki.control_plane_agent.key.display()),
        ],
    );
    server.wait_backends(2).await;
    NodeSetup {
        dir,
        pki,
        server,
        node_port,
        allowed,
        other,
        cluster_agent,
        control_plane_agent,
    }
}

impl NodeSetup {
    async fn node_tunnel(&self, identity: &crate::support::certs::CertFiles) -> Tunnel {
        let tls = self.pki.client_tls(Some(identity), &[]);
        Tunnel::connect_tls("localhost", self.node_port, tls)
            .await
            .unwrap()
            .with_dial_timeout(Duration::from_secs(10))
    }

    /// How many dials an agent has completed.
    async fn dials_on(agent: &Agent) -> f64 {
        metric(
            agent.health_port,
            "konnectivity_network_proxy_agent_dial_duration_seconds_count",
        )
        .await
        .unwrap()
    }
}

async fn echo_once(tunnel: &Tunnel, address: &str) {
    let mut stream = tunnel.dial(address).await.unwrap();
    targets::start_echo(&mut stream).await.unwrap();
    stream.write_all(b"ping through the node tunnel").await.unwrap();
    let mut echoed = [0u8; 28];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping through the node tunnel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_clients_reach_allowed_destinations_only_through_the_control_plane_agent() {
    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    for _ in 0..10 {
        echo_once(&tunnel, &setup.allowed.addr.to_string()).await;
    }
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 10.0);
    assert_eq!(
        NodeSetup::dials_on(&setup.cluster_agent).await,
        0.0,
        "a cluster agent got a node dial"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_dials_outside_the_allow_list_are_refused_and_counted() {
    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    for address in [setup.other.addr.to_string(), "kubernetes.default:443".to_owned()] {
        let error = tunnel.dial(&address).await.err().expect("outside the allow-list");
        let DialError::Failed(text) = error else {
            panic!("unexpected error {error:?}");
        };
        assert!(text.contains("node-traffic policy"), "{text}");
    }
    let refused = metric(
        setup.server.health_port,
        "konnectivity_network_proxy_server_dial_failure_count{reason=\"node_policy\"}",
    )
    .await;
    assert_eq!(refused, Some(2.0));
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 0.0);
    assert_eq!(NodeSetup::dials_on(&setup.cluster_agent).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_egress_never_uses_the_control_plane_agent() {
    let mut setup = setup().await;
    let tunnel = Tunnel::connect_uds(setup.server.uds_path()).await.unwrap();
    for _ in 0..20 {
        echo_once(&tunnel, &setup.other.addr.to_string()).await;
    }
    assert_eq!(NodeSetup::dials_on(&setup.cluster_agent).await, 20.0);
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 0.0);

    // With only the control-plane agent left, egress has no agent at all.
    setup.cluster_agent.proc.kill();
    setup.server.wait_backends(1).await;
    let error = tunnel
        .dial(&setup.other.addr.to_string())
        .await
        .err()
        .expect("no cluster agent");
    assert_eq!(error, DialError::NoAgent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_claiming_a_control_plane_id_with_another_certificate_is_refused() {
    let setup = setup().await;
    // The ordinary agent certificate (CN proxy-agent) claiming cp-1.
    let impostor = Agent::start(
        setup.dir.path(),
        &setup.pki,
        setup.server.agent_port,
        CONTROL_PLANE_ID,
        &[],
    );
    let port = impostor.health_port;
    wait_until(
        Duration::from_secs(10),
        "the impostor's refusal to be logged",
        || async {
            impostor.proc.log_text().contains("PermissionDenied")
                || impostor.proc.log_text().contains("control-plane id")
        },
    )
    .await;
    assert_eq!(
        metric(port, "konnectivity_network_proxy_agent_open_server_connections").await,
        Some(0.0)
    );
    assert_eq!(
        metric(
            setup.server.health_port,
            "konnectivity_network_proxy_server_ready_backend_connections"
        )
        .await,
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_frontend_refuses_certificates_from_other_cas() {
    let setup = setup().await;
    // The apiserver-class client certificate is valid, but not for the node frontend.
    let tunnel = setup.node_tunnel(&setup.pki.client).await;
    let error = tunnel
        .dial(&setup.allowed.addr.to_string())
        .await
        .err()
        .expect("refused");
    assert!(matches!(error, DialError::TunnelClosed(_)), "{error:?}");
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 0.0);
}
