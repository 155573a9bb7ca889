//! A node agent behind one address with several servers (an HA control
//! plane's load balancer; root): each captured connection's stream lives at
//! the server that issued its token, and resumes only there. When the node
//! tunnel reaches another server (a successor's, or one reconnected after a
//! cut), the agent dials the address until a connection reaches the
//! token's server and resumes those connections on it; a connection whose
//! server died is reset at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::handover::{REPLACEMENTS, roll_with_connections};
use crate::support::kas::*;
use crate::support::netns::root_or_skip;
use crate::support::procs::Proc;
use crate::support::targets::{self, numbered_lines, pauses_during};

/// What a node agent logs when it found a server its connections need.
const SEARCH: &str = "a connection of its own to the server that holds connections' streams";

/// Kills the node agent's connections to the node frontend's address
/// (`ss -K` in the node's namespace: a reset, as a balancer's cut is).
fn cut_node_tunnels(topology: &Topology) -> usize {
    let killed = topology.node.sh(&format!(
        "ss -K -t -n dst {SERVER_IP} dport = :{NODE_FRONTEND_PORT} | tail -n +2 | grep -c ."
    ));
    String::from_utf8_lossy(&killed.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// The server the node agent's first tunnel reached, from its log.
fn first_server(log: &str) -> usize {
    let line = log
        .lines()
        .find(|line| line.contains("node tunnel connected"))
        .unwrap_or_else(|| panic!("no tunnel line in\n{log}"));
    (0..2)
        .find(|n| line.contains(&format!("server_id=\"server-{n}\"")))
        .unwrap_or_else(|| panic!("the tunnel line names no server: {line}"))
}

async fn streams_target(topology: &Topology) -> targets::Target {
    targets::blob_on(tokio::net::TcpListener::from_std(topology.control_plane.bind_tcp(STREAMS)).unwrap())
        .await
}

/// A connection's numbered lines ([`numbered_lines`]), running.
type Lines = tokio::task::JoinHandle<Result<Vec<(Instant, Duration)>, String>>;

/// `n` connections from the node through its capture, each carrying
/// numbered lines until `stop`.
fn open_lines(topology: &Topology, n: usize, stop: &Arc<AtomicBool>) -> Vec<Lines> {
    (0..n)
        .map(|_| {
            let stream = topology.node.connect_tcp(STREAMS_VIP).unwrap();
            tokio::spawn(numbered_lines(stream, stop.clone()))
        })
        .collect()
}

/// Every one of `connections`, whose server died, ends with an error within
/// 10 s (not at `--resume-timeout`).
async fn each_ends_with_its_server(connections: Vec<Lines>, agent: &Proc) {
    for (i, connection) in connections.into_iter().enumerate() {
        let ended = tokio::time::timeout(Duration::from_secs(10), connection)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "connection {i} at the dead server still hangs after 10 s:\n{}",
                    agent.log_text()
                )
            })
            .unwrap();
        assert!(ended.is_err(), "connection {i} went on without its server");
    }
}

/// A new connection through the capture carries lines for half a second.
async fn a_new_connection_works(topology: &Topology, agent: &Proc) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut new = open_lines(topology, 1, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let lines = new
        .pop()
        .unwrap()
        .await
        .unwrap()
        .unwrap_or_else(|broke| panic!("a new connection: {broke}\n{}", agent.log_text()));
    assert!(lines.len() >= 10, "{} lines", lines.len());
}

/// Behind one address, two servers (an HA control plane's load balancer,
/// round robin): each successor's node tunnel reaches the other server than
/// the one its predecessor's first connections live at, so that a handed
/// connection's resume there is refused ("the token names another
/// proxy-server"). The successor dials the address until a connection
/// reaches the token's server and resumes those connections on it. Five
/// replacements, with connections opened before each (on both servers, as
/// the tunnels alternate): none breaks, no line goes missing or doubled,
/// every successor resumes every connection and says which server it
/// looked for. Without the search, the first replacement resets the first
/// agent's connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_handed_connection_resumes_at_its_own_server() {
    if !root_or_skip("each_handed_connection_resumes_at_its_own_server") {
        return;
    }
    let topology = build_behind_balancer(2).await;
    let _streams = streams_target(&topology).await;
    let args = ["--drain-timeout=5s".to_owned(), STREAMS_CAPTURE.to_owned()];
    let mut agent = topology.start_node_agent(&args);
    topology.wait_node_ready().await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut long_lived = Vec::new();
    let mut searches = Vec::new();
    let mut replacing = Vec::new();
    for n in 0..REPLACEMENTS {
        for _ in 0..4 {
            let stream = topology.node.connect_tcp(STREAMS_VIP).unwrap();
            long_lived.push(tokio::spawn(numbered_lines(stream, stop.clone())));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let began = Instant::now();
        let (successor, log) = roll_with_connections(&topology, &mut agent, &args, n).await;
        let search = log
            .lines()
            .find(|line| line.contains(SEARCH))
            .unwrap_or_else(|| {
                panic!("replacement {n}: the new agent's tunnel reached the same server:\n{log}")
            })
            .to_owned();
        searches.push(search);
        replacing.push((began, Instant::now()));
        agent = successor;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let round_trips = targets::lines_of(long_lived, &format!("searches:\n{}", searches.join("\n"))).await;
    let mut pauses = pauses_during(&replacing, &round_trips);
    pauses.sort();
    println!(
        "{} lines through {} connections; pause p50 {:?}, max {:?}\nsearches:\n{}",
        round_trips.iter().map(Vec::len).sum::<usize>(),
        round_trips.len(),
        pauses[pauses.len() / 2],
        pauses.last().unwrap(),
        searches.join("\n")
    );
    drop(agent);
}

/// Behind one address, the node tunnel cut six times (`ss -K`: every
/// connection of the node agent to the balancer, the tunnel's and those of
/// connections' own servers): each time the tunnel reconnects through the
/// balancer, reaching the next server in turn, and each captured connection
/// resumes at its own server. Connections are opened after each cut, so
/// that both servers hold some. None breaks, no line goes missing or
/// doubled, and the agent's log names the servers it looked for. Without
/// the search, the first cut resets every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuts_of_the_node_tunnel_resume_each_connection_at_its_own_server() {
    const CUTS: usize = 6;
    if !root_or_skip("cuts_of_the_node_tunnel_resume_each_connection_at_its_own_server") {
        return;
    }
    let topology = build_behind_balancer(2).await;
    let _streams = streams_target(&topology).await;
    let agent = topology.start_node_agent(&[STREAMS_CAPTURE.to_owned()]);
    topology.wait_node_ready().await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut long_lived = Vec::new();
    for cut in 0..CUTS {
        long_lived.extend(open_lines(&topology, 3, &stop));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            cut_node_tunnels(&topology) >= 1,
            "cut {cut}: no connection to kill"
        );
        tokio::time::sleep(Duration::from_millis(1500)).await;
        topology.wait_node_ready().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let log = agent.log_text();
    let lines: usize = targets::lines_of(long_lived, &log)
        .await
        .iter()
        .map(Vec::len)
        .sum();
    let searches: Vec<&str> = log.lines().filter(|line| line.contains(SEARCH)).collect();
    println!(
        "{lines} lines through {} connections across {CUTS} cuts\nsearches:\n{}",
        3 * CUTS,
        searches.join("\n")
    );
    assert!(
        !searches.is_empty(),
        "no cut sent the tunnel to the other server:\n{log}"
    );
}

/// A captured connection whose server died cannot resume (its session died
/// with it): behind one address, the agent looks for that server, finds
/// only the other, and resets the connection within seconds (not at
/// `--resume-timeout`, a minute); the connections at the other server carry
/// on, and new ones work. First connections land on the first server; a cut
/// sends the tunnel to the other, where the next connections land (the
/// first ones resume at their server on a connection of their own); then
/// the first server is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_server_died_is_reset_and_only_it() {
    if !root_or_skip("a_connection_whose_server_died_is_reset_and_only_it") {
        return;
    }
    let mut topology = build_behind_balancer(2).await;
    let _streams = streams_target(&topology).await;
    let agent = topology.start_node_agent(&[STREAMS_CAPTURE.to_owned()]);
    topology.wait_node_ready().await;
    let first = first_server(&agent.log_text());
    let (stop_first, stop_second) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let at_first = open_lines(&topology, 5, &stop_first);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(cut_node_tunnels(&topology) >= 1, "no connection to kill");
    let agent_log = &agent;
    crate::support::wait_until(
        Duration::from_secs(15),
        "the first connections to resume at their server",
        || async { agent_log.log_text().contains(SEARCH) },
    )
    .await;
    topology.wait_node_ready().await;
    let at_second = open_lines(&topology, 5, &stop_second);
    tokio::time::sleep(Duration::from_millis(500)).await;

    topology.kill_server(first);
    let killed = Instant::now();
    each_ends_with_its_server(at_first, &agent).await;
    let ended_after = killed.elapsed();
    // New connections work meanwhile, through the server that lives.
    a_new_connection_works(&topology, &agent).await;
    stop_second.store(true, Ordering::Relaxed);
    for (i, connection) in at_second.into_iter().enumerate() {
        let lines = connection.await.unwrap().unwrap_or_else(|broke| {
            panic!(
                "connection {i} at the living server: {broke}\n{}",
                agent.log_text()
            )
        });
        assert!(lines.len() >= 10, "{} lines", lines.len());
    }
    let log = agent.log_text();
    println!(
        "the dead server's connections ended {ended_after:?} after the kill; {}",
        log.lines()
            .find(|line| line.contains("reached server") || line.contains("no connection"))
            .unwrap_or("")
    );
}

/// Several servers listed in `--proxy-server-host`, without a balancer (an
/// HA control plane whose machines the nodes name): the node tunnel holds
/// one of them, and when that server dies it moves to the next. The
/// connections whose streams lived at the dead server are reset (their
/// sessions died with it); new connections work within seconds through the
/// other server, and the agent's log says which one. Without the list, the
/// node role dialed only the first host and stayed down with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_servers_listed_the_node_tunnel_moves_to_another_when_its_server_dies() {
    if !root_or_skip("with_servers_listed_the_node_tunnel_moves_to_another_when_its_server_dies") {
        return;
    }
    let mut topology = build_listed(2).await;
    let _streams = streams_target(&topology).await;
    let agent = topology.start_node_agent(&[STREAMS_CAPTURE.to_owned()]);
    topology.wait_node_ready().await;
    let first = first_server(&agent.log_text());
    let stop = Arc::new(AtomicBool::new(false));
    let at_first = open_lines(&topology, 5, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let survivor_streams = |topology: &Topology| {
        topology.control_plane.metric(
            server_health(1 - first),
            "konnectivity_network_proxy_server_node_frontend_streams_total{identity=\"node\"}",
        )
    };
    // No series before the first stream of a node.
    let streams_before = survivor_streams(&topology).unwrap_or(0.0);
    topology.kill_server(first);
    let killed = Instant::now();
    let other = format!("server_id=\"server-{}\"", 1 - first);
    let agent_log = &agent;
    crate::support::wait_until(
        Duration::from_secs(15),
        "the node tunnel to reach the other server",
        || async {
            agent_log
                .log_text()
                .lines()
                .any(|line| line.contains("node tunnel connected") && line.contains(&other))
        },
    )
    .await;
    let moved_after = killed.elapsed();
    topology.wait_node_ready().await;
    each_ends_with_its_server(at_first, &agent).await;
    // The survivor saw the new tunnel's probe, the five connections' resumes
    // (refused: their tokens name the dead server) and one search's probe:
    // it answers for another server, and a listed host is one server, so it
    // is not asked again (asked ten times, one of every two attempts, it was
    // ten TLS handshakes per node that had connections at the dead server).
    let seen = survivor_streams(&topology).expect("the survivor's stream count") - streams_before;
    assert!(
        seen <= 8.0,
        "{seen} streams at the survivor:\n{}",
        agent.log_text()
    );
    a_new_connection_works(&topology, &agent).await;
    println!(
        "the node tunnel reached the other server {moved_after:?} after the kill; {seen} streams at it meanwhile"
    );
}
