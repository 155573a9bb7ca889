//! `konnectivity-bench`'s commands and flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::stack::Layout;

#[derive(Parser, Debug)]
#[command(name = "konnectivity-bench", about = "The tunnel against direct loopback TCP")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Subcommand, Debug)]
pub enum Commands {
    /// Runs every measurement and prints the table.
    Run(RunArgs),
    /// Serves the benchmark targets (started by `run`; prints its ports).
    Targets,
    /// The scale run: many agent streams and tunnels into one server (root).
    Scale(ScaleArgs),
    /// Runs many proxy-agents in one process (started by `scale`).
    Fleet(FleetArgs),
    /// The cluster scale run: thousands of nodes with the node role, their
    /// watches and kube-apiserver's dials, on one server.
    Cluster(ClusterArgs),
    /// Runs many nodes (egress agent + node tunnel + their clients'
    /// watches) in one process (started by `cluster`).
    NodeFleet(NodeFleetArgs),
    /// A TCP load balancer in front of the servers (started by `cluster
    /// --leases`).
    Balancer {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, value_delimiter = ',')]
        backends: Vec<SocketAddr>,
    },
    /// A stand-in kube-apiserver serving watches (started by `cluster`).
    KasStandin {
        #[arg(long)]
        listen: std::net::SocketAddr,
    },
    /// A plain relay (started by `run`; prints its port).
    Relay {
        /// The relay after this one; without, the target the client names.
        #[arg(long)]
        next: Option<std::net::SocketAddr>,
    },
}

/// Where the binaries, certificates and scratch files are, for every run.
#[derive(clap::Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Directory holding proxy-server and proxy-agent (a release build).
    #[arg(long)]
    pub bin_dir: PathBuf,
    /// Certificates from hack/gen-certs.sh.
    #[arg(long)]
    pub certs: PathBuf,
    /// Scratch directory for sockets and process logs.
    #[arg(long)]
    pub work: PathBuf,
}

impl LayoutArgs {
    pub fn layout(&self) -> Layout {
        Layout {
            bin_dir: self.bin_dir.clone(),
            certs: self.certs.clone(),
            work: self.work.clone(),
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Runs per figure; the table shows the median.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Bytes pushed through one connection, and through 8 together.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: u64,
    /// Round trips measured per run.
    #[arg(long, default_value_t = 5000)]
    pub round_trips: usize,
    /// Connections opened and closed per run of the set-up measurement.
    #[arg(long, default_value_t = 5000)]
    pub setups: usize,
    /// Idle tunneled connections held for the memory measurement.
    #[arg(long, default_value_t = 10_000)]
    pub idle: usize,
    /// The Go CONNECT client (bench/go/connect-client.go, built by
    /// hack/bench.sh): its figures are reported beside ours.
    #[arg(long)]
    pub go_client: Option<PathBuf>,
    /// The same client built with its gRPC route (bench/go/grpc_tunnel.go,
    /// Debian's grpc-go), for the gRPC frontend.
    #[arg(long)]
    pub go_grpc_client: Option<PathBuf>,
    /// Connections of the Go client's one-at-a-time dial measurement.
    #[arg(long, default_value_t = 2000)]
    pub go_dials: usize,
    /// Only these measurements (one, down, eight, rtt, setup, memory, stall,
    /// go); all by default.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

impl RunArgs {
    pub fn wants(&self, measurement: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|m| m == measurement)
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct ScaleArgs {
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Agent streams into the server.
    #[arg(long, default_value_t = 1000)]
    pub agents: usize,
    /// Tunnels held open across them.
    #[arg(long, default_value_t = 20_000)]
    pub tunnels: usize,
    /// Connections opened and closed per dial-rate measurement (with 2,000
    /// the rate varied by a third between runs on 2 vCPUs; with 10,000 by a
    /// tenth).
    #[arg(long, default_value_t = 10_000)]
    pub dials: usize,
}

#[derive(clap::Args, Debug, Clone)]
pub struct FleetArgs {
    /// The number of the first agent, so that fleets split over processes
    /// have distinct agents.
    #[arg(long, default_value_t = 0)]
    pub first: usize,
    #[arg(long)]
    pub agents: usize,
    #[arg(long)]
    pub server_port: u16,
    #[arg(long)]
    pub certs: PathBuf,
    /// Holds agent-N, the token of agent N.
    #[arg(long)]
    pub tokens: PathBuf,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Directory holding proxy-server and proxy-agent (a release build).
    #[arg(long)]
    pub bin_dir: PathBuf,
    /// Sockets, certificates and logs of this run.
    #[arg(long)]
    pub work: PathBuf,
    #[arg(long, default_value_t = 5000)]
    pub nodes: usize,
    /// Watches each node's clients hold through its node agent.
    #[arg(long, default_value_t = 10)]
    pub watches_per_node: usize,
    /// The mean interval between two events of one watch.
    #[arg(long, default_value_t = 30)]
    pub event_interval_s: u64,
    /// kube-apiserver's dials through the nodes' agents, per second.
    #[arg(long, default_value_t = 500)]
    pub dials_per_second: u64,
    /// Each measurement's length.
    #[arg(long, default_value_t = 30)]
    pub measure_s: u64,
    /// Nodes per fleet process: each node holds 25 descriptors (its agent
    /// stream, health and admin listeners, node tunnel, capture listener
    /// and ten watches on both ends), and a process may hold 20,000 here.
    #[arg(long, default_value_t = 700)]
    pub nodes_per_process: usize,
    /// Control-plane agents (processes): the captured connections' sockets
    /// to kube-apiserver are spread over them.
    #[arg(long, default_value_t = 4)]
    pub control_plane_agents: usize,
    /// Stand-in kube-apiserver processes (one address each).
    #[arg(long, default_value_t = 4)]
    pub kas_processes: usize,
    /// Probe watches (an event every 100 ms) through nodes, and as many
    /// straight to the stand-in, for the delays with the fleet idle.
    #[arg(long, default_value_t = 20)]
    pub probes: usize,
    /// Runs proxy-server under this program (e.g. heaptrack, with a server
    /// built without mimalloc, whose allocations heaptrack cannot see); the
    /// server's own memory and CPU figures are then the wrapper's.
    #[arg(long)]
    pub server_wrapper: Option<PathBuf>,
    /// The fleet processes log their agents' and node agents' warnings
    /// (fleet-N.log). Off by default: a storm's warnings (a line per failed
    /// dial, 300,000 while 50,000 watches open) cost the fleets CPU that
    /// the run's figures are measured against; one 5,000-node run with them
    /// had half the watches back after the restart that the runs around it
    /// had.
    #[arg(long)]
    pub fleet_warnings: bool,
    /// proxy-servers, each on an address of its own (127.0.2.1, 127.0.2.2,
    /// ...) with the same ports, as several control-plane machines: every
    /// agent holds a stream to each (all addresses in --proxy-server-host),
    /// each node's tunnel one of them. With two or more, the run ends by
    /// killing the last server: how long until every node is served by the
    /// others, and what was lost; then that server is started again.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub servers: u8,
    /// An HA control plane as upstream's manifests set it up: the agents
    /// know one address, a TCP balancer's in front of the servers
    /// (`konnectivity-bench balancer`), and count the servers by their
    /// Leases (--count-server-leases) to learn how many distinct servers to
    /// find through it; the servers publish them (--enable-lease-controller)
    /// at a stand-in kube-apiserver in this process. (An agent given every
    /// server's address dials each and needs no count.) The node tunnels
    /// still go to the servers' own addresses. The run then says what each
    /// phase cost kube-apiserver in requests.
    #[arg(long)]
    pub leases: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct NodeFleetArgs {
    /// The number of the first node (node-N).
    #[arg(long)]
    pub first: usize,
    #[arg(long)]
    pub nodes: usize,
    /// The servers' addresses (agent port and node frontend port on each).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1")]
    pub server_hosts: Vec<String>,
    #[arg(long)]
    pub server_port: u16,
    #[arg(long)]
    pub node_frontend_port: u16,
    /// The run's certificates ([`ClusterPki`]).
    #[arg(long)]
    pub pki: PathBuf,
    /// The stand-in kube-apiserver addresses; node N's clients reach
    /// address N mod their count.
    #[arg(long, value_delimiter = ',')]
    pub kas: Vec<SocketAddr>,
    /// Watches each node's clients hold.
    #[arg(long)]
    pub watches: usize,
    /// The mean interval between two events of a watch.
    #[arg(long)]
    pub event_interval_ms: u64,
    /// Probe watches (events every 100 ms), this many through nodes' capture
    /// and as many straight to the stand-in, from the start.
    #[arg(long, default_value_t = 0)]
    pub probes: usize,
    /// Where the fleet writes the port of its control listener (bound
    /// before any agent takes a port of the kernel's choosing).
    #[arg(long)]
    pub control_file: PathBuf,
    /// See `ClusterArgs::fleet_warnings`.
    #[arg(long, action = clap::ArgAction::Set, default_value_t = false)]
    pub warnings: bool,
    /// The agents count the servers by their Leases at the kube-apiserver
    /// this kubeconfig names (see `ClusterArgs::leases`).
    #[arg(long)]
    pub lease_kubeconfig: Option<PathBuf>,
    /// The agents' one server address (a balancer's), instead of
    /// --server-hosts; the node tunnels still use --server-hosts.
    #[arg(long)]
    pub agent_server_host: Option<String>,
}
