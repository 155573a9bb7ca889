//! High availability: several proxy-servers behind one address. The agent
//! learns `servercount` from each server and keeps dialing the address until
//! it holds one stream to each distinct `serverid`, so every server (each
//! beside its own kube-apiserver) can reach the cluster.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::TempDir;
use crate::support::balancer::RoundRobin;
use crate::support::certs::Pki;
use crate::support::connect::via_uds;
use crate::support::procs::{Agent, Server, agent_args};
use crate::support::scrape::metric;
use crate::support::{targets, wait_until};

const CONNECTED: &str = "konnectivity_network_proxy_server_ready_backend_connections";
const AGENT_SERVERS: &str = "konnectivity_network_proxy_agent_open_server_connections";

async fn server(dir: &TempDir, pki: &Pki, id: &str) -> Server {
    counting_server(dir, pki, id, 3).await
}

async fn counting_server(dir: &TempDir, pki: &Pki, id: &str, count: u32) -> Server {
    let extra = [format!("--server-id={id}"), format!("--server-count={count}")];
    Server::start(dir.path(), pki, "http-connect", true, &extra).await
}

fn agent_address(server: &Server) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], server.agent_port))
}

async fn connected(server: &Server) -> f64 {
    metric(server.health_port, CONNECTED).await.unwrap_or(-1.0)
}

/// A tunnel through `server`'s frontend moves bytes intact.
async fn tunnel_works(server: &Server, target: &str) {
    let mut tunnel = via_uds(server.uds_path(), target)
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let (sent, received) = targets::push(&mut tunnel, 1 << 20, 1).await.unwrap();
    assert_eq!(sent, received);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_behind_a_load_balancer_holds_one_stream_to_each_server() {
    let dir = TempDir::new("konn-ha");
    let pki = Pki::new(dir.path());
    let mut servers = vec![
        server(&dir, &pki, "server-1").await,
        server(&dir, &pki, "server-2").await,
        server(&dir, &pki, "server-3").await,
    ];
    let balancer = RoundRobin::start(servers.iter().map(agent_address).collect()).await;
    // The agent knows only the balancer's address.
    let agent = Agent::start(dir.path(), &pki, balancer.addr.port(), "agent-1", &[]);
    let agent_port = agent.health_port;
    let target = targets::blob().await;
    let target = target.addr.to_string();

    wait_until(
        Duration::from_secs(30),
        "one stream to each of 3 servers",
        || async {
            let mut all = true;
            for server in &servers {
                all &= connected(server).await == 1.0;
            }
            all && metric(agent_port, AGENT_SERVERS).await == Some(3.0)
        },
    )
    .await;
    for server in &servers {
        tunnel_works(server, &target).await;
    }

    // One server goes away: the agent holds the other two, which still serve.
    let mut gone = servers.remove(0);
    gone.proc.kill();
    wait_until(
        Duration::from_secs(10),
        "the agent drops to 2 streams",
        || async { metric(agent_port, AGENT_SERVERS).await == Some(2.0) },
    )
    .await;
    // While short of 3 it keeps dialing through the balancer; a stream that
    // lands on a server it already holds is closed at once, so each survivor
    // settles at exactly one.
    wait_until(Duration::from_secs(5), "one stream per survivor", || async {
        connected(&servers[0]).await == 1.0 && connected(&servers[1]).await == 1.0
    })
    .await;
    for server in &servers {
        tunnel_works(server, &target).await;
    }

    // A new server joins behind the balancer: the agent finds it.
    let fourth = server(&dir, &pki, "server-4").await;
    balancer.add(agent_address(&fourth));
    wait_until(
        Duration::from_secs(30),
        "the agent converges on the new server",
        || async { connected(&fourth).await == 1.0 && metric(agent_port, AGENT_SERVERS).await == Some(3.0) },
    )
    .await;
    tunnel_works(&fourth, &target).await;
    wait_until(
        Duration::from_secs(5),
        "converged: one stream per server",
        || async { connected(&servers[0]).await == 1.0 && connected(&servers[1]).await == 1.0 },
    )
    .await;
}

/// A server that stops answering (SIGSTOP: its sockets stay open, so
/// neither TCP nor the stream notices) is found by the agent's probes and
/// dropped, long before a keepalive would; the other server keeps serving,
/// and once the stopped one resumes the agent holds both again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_drop_a_server_that_stops_answering() {
    let dir = TempDir::new("konn-ha");
    let pki = Pki::new(dir.path());
    let servers = [
        counting_server(&dir, &pki, "server-1", 2).await,
        counting_server(&dir, &pki, "server-2", 2).await,
    ];
    let balancer = RoundRobin::start(servers.iter().map(agent_address).collect()).await;
    let agent = Agent::start(
        dir.path(),
        &pki,
        balancer.addr.port(),
        "agent-1",
        &["--probe-interval=200ms".to_owned()],
    );
    let agent_port = agent.health_port;
    wait_until(Duration::from_secs(30), "streams to both servers", || async {
        metric(agent_port, AGENT_SERVERS).await == Some(2.0)
    })
    .await;

    servers[1].proc.signal("STOP");
    // Probe interval + the 5 s a probe may take, with room for a slow machine.
    wait_until(
        Duration::from_secs(9),
        "the agent to drop the stopped server",
        || async { metric(agent_port, AGENT_SERVERS).await == Some(1.0) },
    )
    .await;
    let target = targets::blob().await;
    tunnel_works(&servers[0], &target.addr.to_string()).await;

    servers[1].proc.signal("CONT");
    wait_until(
        Duration::from_secs(30),
        "the agent back on both servers",
        || async {
            metric(agent_port, AGENT_SERVERS).await == Some(2.0)
                && connected(&servers[0]).await == 1.0
                && connected(&servers[1]).await == 1.0
        },
    )
    .await;
    tunnel_works(&servers[1], &target.addr.to_string()).await;
}

/// An agent whose stream was lost dials its server again with the lost
/// session's token. When the session gave up while that dial was under way
/// (its --resume-timeout ran out: here a stopped server holds the dial in its
/// TLS handshake) and the server resumes it anyway, the agent drops that
/// stream and connects afresh at once. Before, an agent dialing every
/// address held the ended session in the stream's place and never dialed
/// that server again (the two-server 5,000-node run: 781 agents without a
/// stream to the surviving server for minutes). One address, dialed as
/// every address is (`--dial-every-address`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_resumed_for_a_session_that_gave_up_is_replaced_by_a_fresh_one() {
    let dir = TempDir::new("konn-ha");
    let pki = Pki::new(dir.path());
    let server = counting_server(&dir, &pki, "server-1", 1).await;
    let agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        "agent-1",
        &[
            "--dial-every-address".to_owned(),
            "--probe-interval=200ms".to_owned(),
            "--resume-timeout=1s".to_owned(),
        ],
    );
    let agent_port = agent.health_port;
    wait_until(Duration::from_secs(20), "a stream to the server", || async {
        metric(agent_port, AGENT_SERVERS).await == Some(1.0) && connected(&server).await == 1.0
    })
    .await;

    server.proc.signal("STOP");
    // Its PINGs unanswered for 5 s: the stream is lost, and the agent dials
    // again at once; the stopped server takes the TCP connection (the
    // kernel does) and leaves the TLS handshake hanging.
    wait_until(Duration::from_secs(9), "the agent to lose its stream", || async {
        metric(agent_port, AGENT_SERVERS).await == Some(0.0)
    })
    .await;
    // Past the agent's --resume-timeout: the session gives up.
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.proc.signal("CONT");
    // The hanging dial completes and the server resumes the session on it.
    let log = || agent.proc.log_text();
    wait_until(
        Duration::from_secs(15),
        "the agent to hold a stream again",
        || async { metric(agent_port, AGENT_SERVERS).await == Some(1.0) && connected(&server).await == 1.0 },
    )
    .await;
    let target = targets::blob().await;
    tunnel_works(&server, &target.addr.to_string()).await;
    let said = log();
    assert!(
        said.contains("whose session had given up"),
        "the case under test did not happen:\n{said}"
    );
}

/// The first server an agent meets says there is one server; the second
/// says two (a fleet being scaled up). Without --sync-forever the agent
/// stops at one; with it, it keeps looking now and then and finds the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_forever_finds_a_server_that_counts_more() {
    let dir = TempDir::new("konn-ha");
    let pki = Pki::new(dir.path());
    let servers = [
        counting_server(&dir, &pki, "old", 1).await,
        counting_server(&dir, &pki, "new", 2).await,
    ];
    // One balancer per agent, so each starts at the first server.
    let plain_balancer = RoundRobin::start(servers.iter().map(agent_address).collect()).await;
    let syncing_balancer = RoundRobin::start(servers.iter().map(agent_address).collect()).await;
    let fast = [
        "--sync-interval=100ms".to_owned(),
        "--sync-interval-cap=300ms".to_owned(),
    ];
    let plain = Agent::start(dir.path(), &pki, plain_balancer.addr.port(), "plain", &fast);
    let syncing = Agent::start(
        dir.path(),
        &pki,
        syncing_balancer.addr.port(),
        "syncing",
        &[fast[0].clone(), fast[1].clone(), "--sync-forever".to_owned()],
    );

    wait_until(
        Duration::from_secs(15),
        "the syncing agent on both servers",
        || async { metric(syncing.health_port, AGENT_SERVERS).await == Some(2.0) },
    )
    .await;
    assert_eq!(metric(plain.health_port, AGENT_SERVERS).await, Some(1.0));
    // Give the plain agent ten of the syncing agent's rounds: it stays put.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(metric(plain.health_port, AGENT_SERVERS).await, Some(1.0));
    // The syncing agent's later dials land on servers it holds and are
    // closed at once: each server carries one stream of each agent at most.
    wait_until(
        Duration::from_secs(5),
        "one stream per agent and server",
        || async { connected(&servers[0]).await == 2.0 && connected(&servers[1]).await == 1.0 },
    )
    .await;
}

/// Without a load balancer: the agent is given both servers' addresses,
/// dials each directly and holds a stream to each, though each server
/// announces a count of 1. One killed: it keeps the other and redials the
/// first with backoff until it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_given_every_server_address_holds_each_and_redials_a_lost_one_with_backoff() {
    let dir = TempDir::new("konn-ha");
    let pki = Pki::new(dir.path());
    let mut servers = [
        counting_server(&dir, &pki, "server-1", 1).await,
        counting_server(&dir, &pki, "server-2", 1).await,
    ];
    let hosts = format!(
        "--proxy-server-host=127.0.0.1:{},localhost:{}",
        servers[0].agent_port, servers[1].agent_port
    );
    let agent = Agent::start(dir.path(), &pki, servers[0].agent_port, "agent-1", &[hosts]);
    let agent_port = agent.health_port;
    const KNOWN: &str = "konnectivity_network_proxy_agent_known_server_count";
    wait_until(Duration::from_secs(20), "a stream to each server", || async {
        connected(&servers[0]).await == 1.0
            && connected(&servers[1]).await == 1.0
            && metric(agent_port, AGENT_SERVERS).await == Some(2.0)
    })
    .await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    for server in &servers {
        tunnel_works(server, &target).await;
    }
    // localhost may also be ::1, where nothing listens: that address is
    // counted and redialed, and holds nothing.
    let known = metric(agent_port, KNOWN).await.unwrap();
    assert!((2.0..=3.0).contains(&known), "{known}");

    servers[1].proc.kill();
    wait_until(Duration::from_secs(10), "the agent to hold 1 stream", || async {
        metric(agent_port, AGENT_SERVERS).await == Some(1.0)
    })
    .await;
    tunnel_works(&servers[0], &target).await;
    // Redials with backoff (100ms ×1.5 up to 500ms here): over 3 s a handful
    // of attempts at the lost address, not one every 100 ms.
    let failures = |log: &str| {
        log.lines()
            .filter(|l| {
                l.contains("cannot connect to proxy-server")
                    && l.contains(&format!(":{}", servers[1].agent_port))
            })
            .count()
    };
    let before = failures(&agent.proc.log_text());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = failures(&agent.proc.log_text()) - before;
    assert!((3..=16).contains(&during), "{during} redials in 3 s");
    assert_eq!(
        connected(&servers[0]).await,
        1.0,
        "the survivor keeps its one stream"
    );

    servers[1].restart().await;
    wait_until(
        Duration::from_secs(10),
        "the agent to hold both again",
        || async {
            connected(&servers[1]).await == 1.0 && metric(agent_port, AGENT_SERVERS).await == Some(2.0)
        },
    )
    .await;
    tunnel_works(&servers[1], &target).await;
}

/// A name whose addresses are the servers (a headless Service's, or DNS
/// round robin): with --dial-every-address the agent looks it up and holds
/// a stream to each address, checking each server's certificate against the
/// name. The name resolves through the real resolver: a network namespace's
/// own /etc/hosts (`ip netns exec` mounts /etc/netns/NAME/hosts over it)
/// lists two addresses for `localhost`, one server on each, same port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dial_every_address_holds_a_stream_to_each_address_of_a_name() {
    if !crate::support::netns::root_or_skip("dial_every_address_holds_a_stream_to_each_address_of_a_name") {
        return;
    }
    let dir = TempDir::new("konn-ha");
    let pki = Pki::new(dir.path());
    let netns = crate::support::netns::Netns::new("dns");
    let hosts_dir = std::path::PathBuf::from("/etc/netns").join(&netns.name);
    std::fs::create_dir_all(&hosts_dir).unwrap();
    // Removed with the test, whatever happens.
    struct RemoveDir(std::path::PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
            // And /etc/netns itself when no other namespace uses it.
            let _ = std::fs::remove_dir("/etc/netns");
        }
    }
    let _hosts_dir = RemoveDir(hosts_dir.clone());
    std::fs::write(
        hosts_dir.join("hosts"),
        "127.0.0.2 localhost\n127.0.0.3 localhost\n",
    )
    .unwrap();

    let agent_port = crate::support::free_port();
    let mut health = Vec::new();
    let mut servers = Vec::new();
    for (id, ip) in [("server-1", "127.0.0.2"), ("server-2", "127.0.0.3")] {
        let health_port = crate::support::free_port();
        let args = vec![
            "--mode=http-connect".to_owned(),
            format!("--uds-name={}", dir.path().join(format!("{id}.sock")).display()),
            "--server-port=0".to_owned(),
            format!("--agent-port={agent_port}"),
            format!("--agent-bind-address={ip}"),
            format!("--health-port={health_port}"),
            "--health-bind-address=127.0.0.1".to_owned(),
            format!("--admin-port={}", crate::support::free_port()),
            format!("--cluster-cert={}", pki.server.cert.display()),
            format!("--cluster-key={}", pki.server.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
            format!("--server-id={id}"),
            "--server-count=1".to_owned(),
        ];
        servers.push(netns.spawn("proxy-server", &args, dir.path()));
        health.push(health_port);
    }
    let agent_health = crate::support::free_port();
    let mut args = agent_args(
        ("localhost", agent_port),
        &pki,
        &pki.agent,
        "agent-1",
        agent_health,
    );
    args.extend([
        "--dial-every-address".to_owned(),
        "--health-server-host=127.0.0.1".to_owned(),
        format!("--admin-server-port={}", crate::support::free_port()),
    ]);
    let agent = netns.spawn("proxy-agent", &args, dir.path());
    wait_until(Duration::from_secs(20), "a stream to each address", || async {
        health
            .iter()
            .all(|port| netns.metric(*port, CONNECTED) == Some(1.0))
            && netns.metric(agent_health, AGENT_SERVERS) == Some(2.0)
    })
    .await;
    assert_eq!(
        netns.metric(
            agent_health,
            "konnectivity_network_proxy_agent_known_server_count"
        ),
        Some(2.0)
    );
    let log = agent.log_text();
    assert!(log.contains("127.0.0.2") && log.contains("127.0.0.3"), "{log}");
    drop(servers);
}
