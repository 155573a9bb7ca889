//! `--proxy-strategies` with several agents, end to end: which agent a dial
//! reaches is read off each agent's own dial counter. Targets listen on
//! distinct loopback addresses so that each agent's identifiers can name one.

use crate::support::TempDir;
use crate::support::certs::Pki;
use crate::support::connect::via_uds;
use crate::support::procs::{Agent, Server};
use crate::support::routing::{self, target_on};
use crate::support::scrape::metric;

struct Fleet {
    _dir: TempDir,
    server: Server,
    /// (name, health port), in start order.
    agents: Vec<(&'static str, Agent)>,
}

impl Fleet {
    async fn start(strategies: &str, agents: &[(&'static str, &str)]) -> Fleet {
        let dir = TempDir::new("konn-strategies");
        let pki = Pki::new(dir.path());
        let server = Server::start(
            dir.path(),
            &pki,
            "http-connect",
            true,
            &[format!("--proxy-strategies={strategies}")],
        )
        .await;
        let agents: Vec<_> = agents
            .iter()
            .map(|(name, identifiers)| {
                let extra = [format!("--agent-identifiers={identifiers}")];
                (
                    *name,
                    Agent::start(dir.path(), &pki, server.agent_port, name, &extra),
                )
            })
            .collect();
        server.wait_backends(agents.len() as u32).await;
        Fleet {
            _dir: dir,
            server,
            agents,
        }
    }

    /// The agent that serves a dial to `address` (which must be served).
    async fn served_by(&self, address: &str) -> &'static str {
        let agents: Vec<(&'static str, &Agent)> =
            self.agents.iter().map(|(name, agent)| (*name, agent)).collect();
        routing::served_by(self.server.uds_path(), &agents, address)
            .await
            .unwrap_or_else(|refused| panic!("CONNECT {address} refused: {refused:?}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dest_host_picks_the_named_agent_and_default_route_catches_the_rest() {
    let fleet = Fleet::start(
        "destHost,defaultRoute",
        &[
            ("agent-a", "ipv4=127.0.0.5&host=node-a"),
            ("agent-b", "ipv4=127.0.0.6"),
            ("agent-v6", "ipv6=::1"),
            ("agent-gw", "default-route=true"),
        ],
    )
    .await;
    let (_a, a) = target_on("127.0.0.5").await;
    let (_b, b) = target_on("127.0.0.6").await;
    // CONNECT writes IPv6 hosts in brackets; the identifier has none.
    let (_v6, v6) = target_on("::1").await;
    assert!(v6.starts_with("[::1]:"), "{v6}");
    let (_other, other) = target_on("127.0.0.7").await;
    let port = fleet.server.health_port;
    let server_metric = |series: &'static str| async move {
        metric(port, &format!("konnectivity_network_proxy_server_{series}")).await
    };
    assert_eq!(server_metric("ready_backend_connections").await, Some(4.0));
    assert_eq!(
        server_metric(r#"ready_backends{proxy_strategy="destHost"}"#).await,
        Some(3.0)
    );
    assert_eq!(
        server_metric(r#"ready_backends{proxy_strategy="defaultRoute"}"#).await,
        Some(1.0)
    );
    for _ in 0..5 {
        assert_eq!(fleet.served_by(&a).await, "agent-a");
        assert_eq!(fleet.served_by(&b).await, "agent-b");
        assert_eq!(fleet.served_by(&v6).await, "agent-v6");
        // No agent names 127.0.0.7: destHost hands over to defaultRoute.
        assert_eq!(fleet.served_by(&other).await, "agent-gw");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dest_host_alone_refuses_a_host_no_agent_names() {
    let fleet = Fleet::start("destHost", &[("agent-a", "ipv4=127.0.0.5")]).await;
    let (_a, a) = target_on("127.0.0.5").await;
    let (_other, other) = target_on("127.0.0.7").await;
    assert_eq!(fleet.served_by(&a).await, "agent-a");
    let refused = via_uds(fleet.server.uds_path(), &other)
        .await
        .unwrap()
        .expect_err("no strategy admits an agent for 127.0.0.7");
    assert_eq!(refused.status, 500, "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_order_of_strategies_decides_default_route_first_then_dest_host() {
    // defaultRoute first: while a default-route agent exists, it takes
    // every dial, even one that destHost would send elsewhere.
    let fleet = Fleet::start(
        "defaultRoute,destHost",
        &[("agent-a", "ipv4=127.0.0.5"), ("agent-gw", "default-route=true")],
    )
    .await;
    let (_a, a) = target_on("127.0.0.5").await;
    for _ in 0..3 {
        assert_eq!(fleet.served_by(&a).await, "agent-gw");
    }
}

async fn readyz(fleet: &Fleet) -> (u16, String) {
    crate::support::scrape::http_get(fleet.server.health_port, "/readyz")
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_counts_every_configured_strategy_not_only_the_first() {
    // Upstream reads only the first strategy: destHost has no agent here, so
    // it would report not ready although `default` serves every dial.
    let fleet = Fleet::start("destHost,default", &[("plain", "")]).await;
    let (status, body) = readyz(&fleet).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("destHost: 0") && body.contains("default: 1"),
        "{body}"
    );

    // With destHost alone, an agent without identifiers serves no dial.
    let fleet = Fleet::start("destHost", &[("plain", "")]).await;
    let (status, body) = readyz(&fleet).await;
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("destHost: 0"), "{body}");
}
