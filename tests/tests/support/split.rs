//! A node and a control plane in two network namespaces joined by one veth
//! (`10.222.0.1` and `10.222.0.2`, the addresses the test certificates
//! name): proxy-server (HTTP CONNECT on a Unix socket) in the control plane,
//! an agent in the node, and a target on the node that only the agent can
//! reach. For tests that take the link away (partition.rs, resume.rs).

use std::path::PathBuf;
use std::time::Duration;

use crate::support::certs::Pki;
use crate::support::cluster::{memory_back_to, open_fds};
use crate::support::netns::{Netns, link};
use crate::support::procs::{Proc, agent_args};
use crate::support::targets;
use crate::support::{TempDir, wait_until, wait_until_or_last};

pub const SERVER_IP: &str = "10.222.0.2";
pub const NODE_IP: &str = "10.222.0.1";
pub const AGENT_PORT: u16 = 8091;
pub const SERVER_HEALTH: u16 = 8092;
pub const AGENT_HEALTH: u16 = 8093;
pub const READY: &str = "konnectivity_network_proxy_server_ready_backend_connections";
const SERVER_HEAP: &str = "konnectivity_network_proxy_server_runtime_heap_bytes";
const AGENT_HEAP: &str = "konnectivity_network_proxy_agent_runtime_heap_bytes";

pub struct Split {
    // Dropped last (fields drop in order): the processes go before their
    // namespaces and their directory.
    pub server: Proc,
    pub agent: Proc,
    /// The server's frontend socket.
    pub socket: PathBuf,
    /// `host:port` of the blob target on the node.
    pub target: String,
    _target: targets::Target,
    pub node: Netns,
    pub control_plane: Netns,
    pub pki: Pki,
    pub dir: TempDir,
}

impl Split {
    /// Starts both sides with `server_extra` and `agent_extra` beside their
    /// common flags, and waits for the agent to connect.
    pub async fn start(name: &str, server_extra: &[String], agent_extra: &[String]) -> Split {
        let dir = TempDir::new(name);
        let pki = Pki::new(dir.path());
        let node = Netns::new("node");
        let control_plane = Netns::new("cp");
        link(
            &node,
            &format!("{NODE_IP}/24"),
            &control_plane,
            &format!("{SERVER_IP}/24"),
        );
        let socket = dir.path().join("frontend.sock");
        let mut server_args = vec![
            "--mode=http-connect".to_owned(),
            format!("--uds-name={}", socket.display()),
            "--server-port=0".to_owned(),
            format!("--agent-port={AGENT_PORT}"),
            format!("--health-port={SERVER_HEALTH}"),
            format!("--cluster-cert={}", pki.server.cert.display()),
            format!("--cluster-key={}", pki.server.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
        ];
        server_args.extend(server_extra.iter().cloned());
        let server = control_plane.spawn("proxy-server", &server_args, dir.path());
        let mut args = agent_args(
            (SERVER_IP, AGENT_PORT),
            &pki,
            &pki.agent,
            "node-agent",
            AGENT_HEALTH,
        );
        args.extend(agent_extra.iter().cloned());
        let agent = node.spawn("proxy-agent", &args, dir.path());
        let cp = &control_plane;
        wait_until(Duration::from_secs(15), "the agent to connect", || async {
            cp.metric(SERVER_HEALTH, READY) == Some(1.0)
        })
        .await;
        let listener = node.bind_tcp(&format!("{NODE_IP}:0"));
        let target = targets::blob_on(tokio::net::TcpListener::from_std(listener).unwrap()).await;
        Split {
            server,
            agent,
            socket,
            target: target.addr.to_string(),
            _target: target,
            node,
            control_plane,
            pki,
            dir,
        }
    }

    /// Waits (up to 15 s) until the agent has no endpoint connection and
    /// both processes are back to `fds` descriptors and within 10% of their
    /// `memory` heap (KiB, from [`Split::heap_kib`]); fails naming what is not.
    pub async fn assert_back_to(&self, fds: (usize, usize), memory: (u64, u64)) {
        let current = || async {
            let endpoints = self.node.metric(
                AGENT_HEALTH,
                "konnectivity_network_proxy_agent_open_endpoint_connections",
            );
            let now_fds = (open_fds(self.server.pid()), open_fds(self.agent.pid()));
            let now_memory = self.heap_kib();
            let back = endpoints == Some(0.0)
                && now_fds == fds
                && memory_back_to(now_memory.0, memory.0)
                && memory_back_to(now_memory.1, memory.1);
            (back, (endpoints, now_fds, now_memory))
        };
        let (endpoints, now_fds, now_memory) = wait_until_or_last(Duration::from_secs(15), current).await;
        eprintln!("heap (server, agent) before {memory:?} KiB, after {now_memory:?} KiB");
        assert_eq!(endpoints, Some(0.0), "the agent's endpoint connections");
        assert_eq!(now_fds, fds, "(server, agent) descriptors");
        assert!(
            memory_back_to(now_memory.0, memory.0) && memory_back_to(now_memory.1, memory.1),
            "heap more than 10% above its baseline"
        );
    }

    /// The heap (KiB) of the server and of the agent, from their metrics.
    pub fn heap_kib(&self) -> (u64, u64) {
        let kib =
            |netns: &Netns, port, family| netns.metric(port, family).map_or(0, |bytes| bytes as u64 / 1024);
        (
            kib(&self.control_plane, SERVER_HEALTH, SERVER_HEAP),
            kib(&self.node, AGENT_HEALTH, AGENT_HEAP),
        )
    }
}
