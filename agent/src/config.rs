//! proxy-agent's flags (upstream names and defaults) and their validation
//! into one typed [`Config`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};
use konnectivity_plumbing::flags::{FlagError, identity_pair, invalid, pem_file};
use konnectivity_plumbing::flags::{GoList, parse_bool, parse_duration, parse_list, parse_port};
use konnectivity_telemetry::klog::KlogArgs;

pub use crate::leases::LeaseCounting;
use konnectivity_kube::{KubeEndpoint, LabelSelector};
use konnectivity_node::capture::map::{Capture, CaptureMap};
use konnectivity_node::settings::CniSettings;
use konnectivity_plumbing::tls::{Identity, PemFile};
use konnectivity_proto::AgentIdentifiers;

/// The Konnectivity proxy agent: dials out to proxy-servers and serves their dials.
#[derive(Parser, Debug, Clone)]
// As with Go's pflag, a flag given twice takes the last value.
#[command(name = "proxy-agent", version, about, args_override_self = true)]
#[command(next_help_heading = "Upstream-compatible flags")]
pub struct Args {
    /// Client certificate presented to the server.
    #[arg(long, default_value = "")]
    pub agent_cert: String,
    /// Key of --agent-cert.
    #[arg(long, default_value = "")]
    pub agent_key: String,
    /// CA that the server's certificate must chain to; empty uses the system's roots.
    #[arg(long, default_value = "")]
    pub ca_cert: String,
    /// Host of the proxy-server's agent port: one address (a server, or a load balancer
    /// in front of several), or several, comma-separated, each a server the agent dials
    /// directly and holds a stream to (see --dial-every-address). An entry may carry its
    /// own port (host:port, [v6]:port); --proxy-server-port is the default.
    #[arg(long, default_value = "127.0.0.1")]
    pub proxy_server_host: String,
    /// The proxy-server's agent port.
    #[arg(long, default_value_t = 8091)]
    pub proxy_server_port: u16,
    /// ALPN protocols offered in addition to h2, comma-separated.
    #[arg(long, value_parser = parse_list, default_value = "")]
    pub alpn_proto: GoList,
    /// Bind address of the health listener; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub health_server_host: String,
    /// Port of /healthz, /readyz and /metrics.
    #[arg(long, value_parser = parse_port, default_value = "8093")]
    pub health_server_port: u16,
    /// Port of the admin listener: /metrics, as on the health port (upstream's scrape configs use either).
    /// A port that cannot be bound is logged and the agent runs on without it, as upstream's.
    #[arg(long, value_parser = parse_port, default_value = "8094")]
    pub admin_server_port: u16,
    /// This agent's identity (a random UUID when empty).
    #[arg(long, env = "PROXY_AGENT_ID", default_value = "")]
    pub agent_id: String,
    /// What this agent serves, as a query string: host=, ipv4=, ipv6=, cidr=, default-route=.
    #[arg(long, default_value = "")]
    pub agent_identifiers: String,
    /// First wait before reconnecting to a server; grows ×1.5 per failure.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub sync_interval: Duration,
    /// Longest wait between reconnection attempts.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub sync_interval_cap: Duration,
    /// Packets buffered per connection towards its endpoint. Not applied in this version (accepted for upstream compatibility):
    /// each connection buffers up to its flow-control window, 2 MiB, instead.
    #[arg(long, default_value_t = 150)]
    pub xfr_channel_size: usize,
    /// Bind address of the admin listener; empty means all interfaces.
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// How often each connection to a konnectivity-rs server is probed; one that
    /// leaves a probe unanswered for 5s is dropped and redialed.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub probe_interval: Duration,
    /// Interval of HTTP/2 keepalive pings to the server, at least 30s (upstream servers
    /// close connections pinged more often); a ping unanswered within 20s ends the
    /// connection and the agent reconnects. 0 turns pings off.
    #[arg(long, value_parser = parse_duration, default_value = "1h0m0s")]
    pub keepalive_time: Duration,
    /// ServiceAccount token sent to the server (`authorization: Bearer`), re-read
    /// for every connection so a rotated token is picked up.
    #[arg(long, default_value = "")]
    pub service_account_token_path: String,
    /// After converging, keep the server count current (from probes of held servers)
    /// and dial the address every --sync-interval-cap to meet servers counting differently.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub sync_forever: bool,
    /// Count the valid proxy-server Leases (in --lease-namespace, matching
    /// --lease-label-selector) to learn how many servers to connect to, through
    /// --kubeconfig or the pod's ServiceAccount; see --server-count-source.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub count_server_leases: bool,
    /// Namespace of the server Leases to count.
    #[arg(long, default_value = "kube-system")]
    pub lease_namespace: String,
    /// Label selector of the server Leases to count (upstream v0.36.0's name of
    /// --lease-label-selector; the latter wins when both are given).
    #[arg(long, value_parser = LabelSelector::parse, default_value = "k8s-app=konnectivity-server")]
    pub lease_label: LabelSelector,
    /// Label selector of the server Leases to count, as kubectl's -l takes it
    /// (k=v, k!=v, k in (a,b), k notin (a,b), k, !k; comma-separated, all must hold).
    #[arg(long, value_parser = LabelSelector::parse, default_value = "k8s-app=konnectivity-server")]
    pub lease_label_selector: LabelSelector,
    /// With --count-server-leases, where the server count comes from: default (the
    /// Leases alone) or max (the larger of the Leases' count and the servers' own).
    #[arg(long, default_value = "default")]
    pub server_count_source: String,
    /// kubeconfig for counting Leases; empty uses the pod's ServiceAccount. Not applied without --count-server-leases.
    #[arg(long, default_value = "")]
    pub kubeconfig: String,
    /// Content type of requests to kube-apiserver. Not applied (accepted for upstream compatibility): requests are JSON, so
    /// that every field kube-apiserver sends is read as sent, those this version does not know included.
    #[arg(long, default_value = "application/vnd.kubernetes.protobuf")]
    pub kube_api_content_type: String,
    #[command(flatten)]
    pub profiling: konnectivity_telemetry::profiling::ProfilingArgs,
    /// Deprecated upstream; accepted and ignored.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub warn_on_channel_limit: bool,
    /// Dial every address --proxy-server-host resolves to and hold a stream to each (a
    /// headless Service's name, whose records are the servers), looking the names up
    /// again every --sync-interval-cap; instead of dialing the one name until every
    /// server was met. On by itself when --proxy-server-host lists several hosts.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set,
          help_heading = "konnectivity-rs additions")]
    pub dial_every_address: bool,
    /// Most connections to endpoints open at once (dials included), over all server
    /// streams; one more dial is answered with an error naming this flag. 0: no limit.
    #[arg(long, default_value_t = 0, help_heading = "konnectivity-rs additions")]
    pub max_endpoint_connections: usize,
    /// How long a dial to an endpoint may take (upstream fixes it at 5s).
    #[arg(long, value_parser = parse_duration, default_value = "5s", help_heading = "konnectivity-rs additions")]
    pub dial_timeout: Duration,
    /// How long the connections of a lost server stream wait for a new stream to the
    /// same server to resume them (konnectivity-rs servers, which negotiate it;
    /// docs/resume.md). The agent dials that server again at once, then with its
    /// backoff. The node role's captured connections wait as long for a new stream of
    /// the node tunnel. 0 closes them at once, as upstream does.
    #[arg(long, value_parser = parse_duration, default_value = "1m0s", help_heading = "konnectivity-rs additions")]
    pub resume_timeout: Duration,

    /// Capture connections to VIP:PORT and tunnel them to TARGET:PORT through the
    /// server's node frontend (repeatable), e.g. 10.96.0.1:443=10.222.1.10:6443.
    #[arg(long = "capture", value_name = "VIP:PORT=TARGET:PORT", value_parser = Capture::parse,
          action = ArgAction::Append, help_heading = "Node capture (konnectivity-rs)")]
    pub captures: Vec<Capture>,
    /// Capture connections to TARGET:PORT from the service VIP the kubelet gives every pod
    /// (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT): the common case of --capture
    /// with only the target, e.g. 10.222.1.10:6443.
    #[arg(
        long,
        value_name = "TARGET:PORT",
        help_heading = "Node capture (konnectivity-rs)"
    )]
    pub capture_target: Option<SocketAddr>,
    /// Also capture connections addressed to each target itself, as eBPF service load
    /// balancers (Cilium's socket-LB, Calico's eBPF data plane) send them: they rewrite the
    /// VIP inside connect(), before any netfilter rule sees it.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set,
          help_heading = "Node capture (konnectivity-rs)")]
    pub capture_endpoints: bool,
    /// Port of the capture listener on 127.0.0.1 (and ::1) that the rules redirect to.
    #[arg(
        long,
        default_value_t = 15443,
        help_heading = "Node capture (konnectivity-rs)"
    )]
    pub capture_port: u16,
    /// SO_MARK on the agent's own sockets; the capture rules skip it (hex or decimal).
    #[arg(long, value_parser = parse_mark, default_value = "0x4b4e", help_heading = "Node capture (konnectivity-rs)")]
    pub capture_mark: u32,
    /// The server's node frontend port on --proxy-server-host. With several hosts, the node
    /// tunnel holds one of them (from one its agent id picks, round the list; the next when its
    /// server is lost).
    #[arg(long, default_value_t = 0, help_heading = "Node capture (konnectivity-rs)")]
    pub node_frontend_port: u16,
    /// Client certificate for the node frontend (from the server's --node-client-ca-cert).
    #[arg(long, default_value = "", help_heading = "Node capture (konnectivity-rs)")]
    pub node_client_cert: String,
    /// Key of --node-client-cert.
    #[arg(long, default_value = "", help_heading = "Node capture (konnectivity-rs)")]
    pub node_client_key: String,
    /// Unix socket the konnectivity-cni plugin talks to; empty (the default) turns pod capture
    /// off, and the flag without a value means /var/run/konnectivity/cni.sock, install-cni's
    /// --agent-socket default. The two must name the same socket.
    #[arg(long, default_value = "", num_args = 0..=1, require_equals = true,
          default_missing_value = konnectivity_cni::config::DEFAULT_AGENT_SOCKET,
          help_heading = "Pod capture (konnectivity-rs)")]
    pub cni_socket: String,
    /// Where the container runtime pins pod network namespaces besides /var/run/netns
    /// (containerd with netns_mounts_under_state_dir: its state directory's netns/). A pod
    /// namespace the runtime names there is accepted; the directory is never scanned for pods:
    /// a pin is not a pod. Empty: only /var/run/netns and /run/netns.
    #[arg(
        long,
        default_value = "/var/run/netns",
        help_heading = "Pod capture (konnectivity-rs)"
    )]
    pub pod_netns_dir: String,
    /// The container runtime's CNI result cache (libcni's): its record of every pod it
    /// attached. At start and every 5 s the agent enrols the pods recorded there on a network
    /// of ours (see --cni-conf-dir) that it has not captured: pods that ran before it or before
    /// the plugin was chained. Empty turns enrolment off.
    #[arg(
        long,
        default_value = "/var/lib/cni",
        help_heading = "Pod capture (konnectivity-rs)"
    )]
    pub cni_cache_dir: String,
    /// Where the runtime reads its CNI network configurations (install-cni's --cni-conf-dir,
    /// as the node sees it). A network whose chain has konnectivity-cni pointed at --cni-socket
    /// is ours: only its pods are enrolled from the cache.
    #[arg(
        long,
        default_value = "/etc/cni/net.d",
        help_heading = "Pod capture (konnectivity-rs)"
    )]
    pub cni_conf_dir: String,
    /// Namespaces whose running pods are not enrolled, comma-separated: the same list as
    /// install-cni's --exclude-namespaces, which the plugin applies to new pods.
    #[arg(long, value_parser = parse_list, default_value = "", help_heading = "Pod capture (konnectivity-rs)")]
    pub exclude_namespaces: GoList,
    /// Where the agent records captured pods, to re-open them after a restart.
    #[arg(
        long,
        default_value = "/var/lib/konnectivity/pods",
        help_heading = "Pod capture (konnectivity-rs)"
    )]
    pub state_dir: String,
    /// Unix socket where this node agent hands its listening sockets, captured pods and
    /// rules to the agent that replaces it (a DaemonSet rollout with maxSurge), and where a
    /// new agent looks for the one it replaces; `PATH.lock` says which of the two owns the
    /// rules. Empty: no hand-over (a second agent on the node cannot start).
    #[arg(
        long,
        default_value = "/var/run/konnectivity/handover.sock",
        help_heading = "Node capture (konnectivity-rs)"
    )]
    pub handover_socket: String,
    /// Without --capture: hand this agent's agent-stream sessions, with their connections, to
    /// the agent that replaces it on the same node through --handover-socket (an egress
    /// DaemonSet rolled out with maxSurge), and take over those of the agent it replaces.
    /// Off: a replaced agent drains for --drain-timeout as upstream's does.
    #[arg(
        long,
        default_value_t = false,
        help_heading = "Node capture (konnectivity-rs)"
    )]
    pub egress_handover: bool,
    /// How long an agent that handed over waits, once told to stop, for the connections it
    /// still carries before it exits (below the pod's terminationGracePeriodSeconds).
    #[arg(long, value_parser = parse_duration, default_value = "25s", help_heading = "Node capture (konnectivity-rs)")]
    pub drain_timeout: Duration,

    #[command(flatten)]
    pub runtime: konnectivity_plumbing::runtime::RuntimeArgs,

    #[command(flatten)]
    pub klog: KlogArgs,

    #[command(subcommand)]
    pub command: Option<AgentCommand>,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum AgentCommand {
    /// Install the konnectivity-cni plugin on this node and chain it into the
    /// primary CNI configuration (idempotent), then exit, or keep re-checking.
    InstallCni(konnectivity_node::cni::install::InstallCniArgs),
}

fn parse_mark(text: &str) -> Result<u32, String> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed
        .ok()
        .filter(|mark| *mark != 0)
        .ok_or_else(|| format!("invalid mark {text:?} (a non-zero number, hex with 0x)"))
}

#[derive(Clone, Debug)]
pub struct Config {
    /// The first of `server_hosts`: the one the egress target names when a
    /// single host is given (the node role tries them all).
    pub server_host: String,
    /// `--proxy-server-host`, split at commas, each with its port.
    pub server_hosts: Vec<ServerAddress>,
    /// Dial every address of `server_hosts` (`--dial-every-address`, or
    /// several hosts given).
    pub dial_every_address: bool,
    pub server_port: u16,
    pub ca_cert: Option<PemFile>,
    pub identity: Option<Identity>,
    /// `--service-account-token-path`.
    pub token_path: Option<PathBuf>,
    pub alpn: Vec<String>,
    pub agent_id: String,
    pub identifiers: AgentIdentifiers,
    pub sync_interval: Duration,
    pub sync_interval_cap: Duration,
    /// `--probe-interval`.
    pub probe_interval: Duration,
    /// `--resume-timeout`; zero: resume is not offered.
    pub resume_timeout: Duration,
    /// `--max-endpoint-connections` (0: none).
    pub max_endpoint_connections: usize,
    /// `--sync-forever`.
    pub sync_forever: bool,
    pub health_addr: SocketAddr,
    /// `--admin-bind-address` and `--admin-server-port`.
    pub admin_addr: SocketAddr,
    /// `--enable-profiling`: `/debug/pprof/` on the admin listener.
    pub profiling: bool,
    pub dial_timeout: Duration,
    /// `--keepalive-time`, raised to [`MIN_KEEPALIVE`]; `None` is off.
    pub keepalive: Option<Duration>,
    pub node: Option<NodeConfig>,
    /// `--egress-handover` (no node role): where and how the agent-stream
    /// sessions are handed to a successor.
    pub egress_handover: Option<EgressHandover>,
    /// `--count-server-leases` and its settings.
    pub lease_counting: Option<LeaseCounting>,
    /// `--server-count-source=max`.
    pub server_count_max: bool,
}

/// One entry of `--proxy-server-host`: a host name or address, and the
/// port of its agent listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerAddress {
    /// A name, or an IP address without brackets.
    pub host: String,
    pub port: u16,
}

impl ServerAddress {
    /// `host`, `host:port`, `[v6]:port`, `[v6]` or a bare IPv6 address
    /// (more than one colon: no port).
    fn parse(entry: &str, default_port: u16) -> Result<ServerAddress, String> {
        let bad = |why: &str| format!("{entry:?}: {why}");
        let port = |text: &str| {
            text.parse::<u16>()
                .ok()
                .filter(|port| *port != 0)
                .ok_or_else(|| bad("the port must be a number from 1 to 65535"))
        };
        let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(|| bad("no closing ]"))?;
            match after {
                "" => (host, default_port),
                _ => (
                    host,
                    port(
                        after
                            .strip_prefix(':')
                            .ok_or_else(|| bad("expected :port after ]"))?,
                    )?,
                ),
            }
        } else if entry.matches(':').count() == 1 {
            let (host, text) = entry.split_once(':').expect("one colon");
            (host, port(text)?)
        } else {
            (entry, default_port)
        };
        if host.is_empty() {
            return Err(bad(
                "every host must be non-empty (several are separated by commas)",
            ));
        }
        Ok(ServerAddress {
            host: host.to_owned(),
            port,
        })
    }
}

/// Upstream servers allow a ping every 30s at most (gRPC keepalive
/// enforcement) and close the connection of a client that pings faster.
pub const MIN_KEEPALIVE: Duration = Duration::from_secs(30);

/// The node role (enabled by `--capture`).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub captures: CaptureMap,
    pub capture_port: u16,
    pub mark: u32,
    pub node_frontend_port: u16,
    pub identity: Identity,
    pub cni: Option<CniSettings>,
    /// `--handover-socket`; `None` when empty.
    pub handover_socket: Option<std::path::PathBuf>,
    pub drain_timeout: Duration,
}

/// `--egress-handover`: a plain egress agent's hand-over socket.
#[derive(Clone, Debug)]
pub struct EgressHandover {
    /// `--handover-socket`.
    pub socket: std::path::PathBuf,
    /// `--drain-timeout`.
    pub drain_timeout: Duration,
}

/// Errors name the flag at fault; main exits with status 2 on them.
pub type ConfigError = FlagError;

impl Config {
    pub fn from_args(args: &Args) -> Result<Config, ConfigError> {
        let identity = match (
            pem_file("agent-cert", &args.agent_cert)?,
            pem_file("agent-key", &args.agent_key)?,
        ) {
            (Some(cert), Some(key)) => Some(Identity { cert, key }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(invalid("agent-key", "must be set when --agent-cert is"));
            }
            (None, Some(_)) => {
                return Err(invalid("agent-cert", "must be set when --agent-key is"));
            }
        };
        let server_hosts = args
            .proxy_server_host
            .split(',')
            .map(|entry| ServerAddress::parse(entry.trim(), args.proxy_server_port))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|problem| invalid("proxy-server-host", problem))?;
        if args.proxy_server_port == 0 {
            return Err(invalid("proxy-server-port", "must not be 0"));
        }
        if args.sync_interval.is_zero() {
            return Err(invalid("sync-interval", "must be greater than 0"));
        }
        if args.sync_interval > args.sync_interval_cap {
            return Err(invalid(
                "sync-interval",
                format!(
                    "{:?} is larger than --sync-interval-cap {:?}",
                    args.sync_interval, args.sync_interval_cap
                ),
            ));
        }
        if args.xfr_channel_size == 0 {
            return Err(invalid("xfr-channel-size", "must be greater than 0"));
        }
        if args.health_server_port == 0 {
            return Err(invalid("health-server-port", "must not be 0"));
        }
        if args.admin_server_port == 0 {
            return Err(invalid("admin-server-port", "must not be 0"));
        }
        if let Some((flag, problem)) = args.profiling.problem() {
            return Err(invalid(flag, problem));
        }
        if args.probe_interval.is_zero() {
            return Err(invalid("probe-interval", "must be greater than 0"));
        }
        // Upstream takes an empty value as default.
        let count_max = match args.server_count_source.as_str() {
            "" | "default" => false,
            "max" => true,
            other => {
                return Err(invalid(
                    "server-count-source",
                    format!("{other:?} is not default or max"),
                ));
            }
        };
        let lease_counting = lease_counting(args)?;
        let token_path =
            pem_file("service-account-token-path", &args.service_account_token_path)?.map(|file| file.path);
        pem_file("kubeconfig", &args.kubeconfig)?;
        let node = node_config(args)?;
        let egress_handover = match (args.egress_handover, &node) {
            (false, _) => None,
            (true, Some(_)) => {
                return Err(invalid(
                    "egress-handover",
                    "is for agents without --capture: a node agent hands its sessions over with its role",
                ));
            }
            (true, None) if args.handover_socket.is_empty() => {
                return Err(invalid(
                    "handover-socket",
                    "must not be empty with --egress-handover",
                ));
            }
            (true, None) => Some(EgressHandover {
                socket: args.handover_socket.clone().into(),
                drain_timeout: args.drain_timeout,
            }),
        };
        let identifiers = AgentIdentifiers::parse(&args.agent_identifiers)
            .map_err(|e| invalid("agent-identifiers", e.to_string()))?;
        let admin_ip = bind_ip("admin-bind-address", &args.admin_bind_address)?;
        let health_ip = bind_ip("health-server-host", &args.health_server_host)?;
        // gRPC needs h2; --alpn-proto adds to it, as upstream's does.
        let mut alpn = vec!["h2".to_owned()];
        for proto in &args.alpn_proto.0 {
            if !alpn.contains(proto) {
                alpn.push(proto.clone());
            }
        }
        let agent_id = if args.agent_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            args.agent_id.clone()
        };
        Ok(Config {
            server_host: server_hosts[0].host.clone(),
            server_port: server_hosts[0].port,
            dial_every_address: args.dial_every_address || server_hosts.len() > 1,
            server_hosts,
            ca_cert: pem_file("ca-cert", &args.ca_cert)?,
            identity,
            token_path,
            alpn,
            agent_id,
            identifiers,
            sync_interval: args.sync_interval,
            sync_interval_cap: args.sync_interval_cap,
            probe_interval: args.probe_interval,
            resume_timeout: args.resume_timeout,
            max_endpoint_connections: args.max_endpoint_connections,
            sync_forever: args.sync_forever,
            health_addr: SocketAddr::new(health_ip, args.health_server_port),
            admin_addr: SocketAddr::new(admin_ip, args.admin_server_port),
            profiling: args.profiling.enable_profiling,
            dial_timeout: args.dial_timeout,
            keepalive: (!args.keepalive_time.is_zero()).then(|| args.keepalive_time.max(MIN_KEEPALIVE)),
            node,
            egress_handover,
            lease_counting,
            server_count_max: count_max,
        })
    }
}

/// `--count-server-leases` and the flags it reads.
fn lease_counting(args: &Args) -> Result<Option<LeaseCounting>, ConfigError> {
    if !args.count_server_leases {
        return Ok(None);
    }
    if args.lease_namespace.is_empty() {
        return Err(invalid(
            "lease-namespace",
            "must not be empty with --count-server-leases",
        ));
    }
    let selector = lease_selector(args)?;
    let kube = KubeEndpoint::from_flag(&args.kubeconfig).map_err(|e| invalid("kubeconfig", e.to_string()))?;
    Ok(Some(LeaseCounting {
        kube,
        namespace: args.lease_namespace.clone(),
        selector,
    }))
}

/// The selector of the Leases to count, in its normal form: that of
/// `--lease-label-selector`, or of v0.36.0's `--lease-label` when only that
/// one is given.
fn lease_selector(args: &Args) -> Result<String, ConfigError> {
    const DEFAULT_SELECTOR: &str = "k8s-app=konnectivity-server";
    let (flag, selector) = if args.lease_label_selector.to_string() != DEFAULT_SELECTOR
        || args.lease_label.to_string() == DEFAULT_SELECTOR
    {
        ("lease-label-selector", &args.lease_label_selector)
    } else {
        ("lease-label", &args.lease_label)
    };
    // Upstream master reads an empty selector as "every Lease in the
    // namespace", which in kube-system counts the controllers' leader
    // Leases as servers; v0.36.0 refuses it, and so do we.
    if selector.is_everything() {
        return Err(invalid(
            flag,
            "must not be empty with --count-server-leases (it would count every Lease in the namespace)",
        ));
    }
    Ok(selector.to_string())
}

/// The `--capture` entry `--capture-target` stands for: the kubelet's
/// service environment gives the VIP.
fn capture_from_environment(
    target: SocketAddr,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Capture, ConfigError> {
    let missing = |name: &str| {
        invalid(
            "capture-target",
            format!(
                "takes the VIP from {name}, which is not set (the kubelet sets it in every pod; \
                 elsewhere use --capture=VIP:PORT=TARGET:PORT)"
            ),
        )
    };
    let host = env("KUBERNETES_SERVICE_HOST").ok_or_else(|| missing("KUBERNETES_SERVICE_HOST"))?;
    let port = env("KUBERNETES_SERVICE_PORT").ok_or_else(|| missing("KUBERNETES_SERVICE_PORT"))?;
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Capture::parse(&format!("{host}:{port}={target}")).map_err(|problem| {
        invalid(
            "capture-target",
            format!("from the kubelet's service environment: {problem}"),
        )
    })
}

fn node_config(args: &Args) -> Result<Option<NodeConfig>, ConfigError> {
    let mut captures = args.captures.clone();
    if let Some(target) = args.capture_target {
        captures.push(capture_from_environment(target, |name| std::env::var(name).ok())?);
    }
    node_config_for(args, captures)
}

fn node_config_for(args: &Args, captures: Vec<Capture>) -> Result<Option<NodeConfig>, ConfigError> {
    if captures.is_empty() {
        if !args.cni_socket.is_empty() {
            return Err(invalid(
                "cni-socket",
                "needs at least one --capture: pods are captured like the host",
            ));
        }
        return Ok(None);
    }
    let captures =
        CaptureMap::new(captures, args.capture_endpoints).map_err(|message| invalid("capture", message))?;
    if args.node_frontend_port == 0 {
        return Err(invalid("node-frontend-port", "must be set with --capture"));
    }
    if args.capture_port == 0 {
        return Err(invalid("capture-port", "must not be 0"));
    }
    let identity = identity_pair(
        ("node-client-cert", &args.node_client_cert),
        ("node-client-key", &args.node_client_key),
    )?
    .ok_or_else(|| {
        invalid(
            "node-client-cert",
            "--node-client-cert and --node-client-key must be set with --capture",
        )
    })?;
    let cni = (!args.cni_socket.is_empty()).then(|| CniSettings {
        socket: args.cni_socket.clone().into(),
        state_dir: args.state_dir.clone().into(),
        netns_dir: (!args.pod_netns_dir.is_empty()).then(|| args.pod_netns_dir.clone().into()),
        cni_cache_dir: (!args.cni_cache_dir.is_empty()).then(|| args.cni_cache_dir.clone().into()),
        cni_conf_dir: args.cni_conf_dir.clone().into(),
        exclude_namespaces: args.exclude_namespaces.0.clone(),
    });
    if args.state_dir.is_empty() {
        return Err(invalid("state-dir", "must not be empty"));
    }
    if cni.is_some() && args.cni_conf_dir.is_empty() {
        return Err(invalid(
            "cni-conf-dir",
            "must not be empty with --cni-socket: it says which network's pods are this agent's",
        ));
    }
    Ok(Some(NodeConfig {
        cni,
        captures,
        capture_port: args.capture_port,
        mark: args.capture_mark,
        node_frontend_port: args.node_frontend_port,
        identity,
        handover_socket: (!args.handover_socket.is_empty()).then(|| args.handover_socket.clone().into()),
        drain_timeout: args.drain_timeout,
    }))
}

impl Args {
    /// Upstream flags given a non-default value that this version accepts
    /// but does not act on; main logs each once.
    pub fn inert_settings(&self) -> Vec<&'static str> {
        [
            ("xfr-channel-size", self.xfr_channel_size != 150),
            (
                "kubeconfig",
                !self.kubeconfig.is_empty() && !self.count_server_leases,
            ),
            (
                "kube-api-content-type",
                self.kube_api_content_type != "application/vnd.kubernetes.protobuf",
            ),
            (
                "enable-contention-profiling",
                self.profiling.enable_contention_profiling,
            ),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }
}

/// The address a listener binds from `flag`'s `value`: empty means every
/// interface.
fn bind_ip(flag: &'static str, value: &str) -> Result<IpAddr, ConfigError> {
    if value.is_empty() {
        return Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }
    value
        .parse()
        .map_err(|_| invalid(flag, format!("{value:?} is not an IP address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keepalive(flag: &str) -> Option<Duration> {
        let args = Args::try_parse_from(["proxy-agent", "--agent-id=a", flag]).unwrap();
        Config::from_args(&args).unwrap().keepalive
    }

    #[test]
    fn help_describes_every_flag_and_marks_every_inert_one() {
        use clap::CommandFactory;
        let line = vec![
            "proxy-agent",
            "--xfr-channel-size=5",
            "--kubeconfig=/x",
            "--kube-api-content-type=application/json",
            "--enable-profiling",
            "--enable-contention-profiling",
        ];
        let applied = ["--enable-profiling"];
        let inert = Args::try_parse_from(&line).unwrap().inert_settings();
        // Every flag set above but the applied ones is reported inert at
        // start-up...
        assert_eq!(inert.len(), line.len() - 1 - applied.len(), "{inert:?}");
        // ...and its help says so; every flag has a description.
        let command = Args::command();
        let problems = konnectivity_telemetry::klog::help_problems(&command, &inert);
        assert!(problems.is_empty(), "{problems:#?}");
        for sub in command.get_subcommands() {
            let problems = konnectivity_telemetry::klog::help_problems(sub, &[]);
            assert!(problems.is_empty(), "{}: {problems:#?}", sub.get_name());
        }
    }

    #[test]
    fn lease_selectors_take_kubectls_syntax_and_refuse_what_kube_apiserver_would() {
        let selector = |flags: &[&str]| {
            let mut line = vec!["proxy-agent", "--agent-id=a", "--count-server-leases"];
            line.extend(flags);
            let args = Args::try_parse_from(&line).map_err(|e| e.to_string())?;
            lease_selector(&args).map_err(|e| e.to_string())
        };
        assert_eq!(selector(&[]).unwrap(), "k8s-app=konnectivity-server");
        // Set-based terms reach kube-apiserver whole, sorted by key.
        assert_eq!(
            selector(&["--lease-label-selector=tier notin (canary,blue), k8s-app=konnectivity-server"])
                .unwrap(),
            "k8s-app=konnectivity-server,tier notin (blue,canary)"
        );
        assert_eq!(
            selector(&["--lease-label=app=x,!canary"]).unwrap(),
            "app=x,!canary"
        );
        assert_eq!(
            selector(&["--lease-label=app=x", "--lease-label-selector=app=y"]).unwrap(),
            "app=y"
        );
        // What kube-apiserver would refuse with a 400 on every list is
        // refused at start, naming the flag.
        let error = selector(&["--lease-label-selector=*notavalidlabel*"]).unwrap_err();
        assert!(
            error.contains("--lease-label-selector") && error.contains("invalid label key"),
            "{error}"
        );
        let error = selector(&["--lease-label=app in (x"]).unwrap_err();
        assert!(
            error.contains("--lease-label ") && error.contains("the end in the values"),
            "{error}"
        );
        let error = selector(&["--lease-label-selector="]).unwrap_err();
        assert!(
            error.contains("--lease-label-selector") && error.contains("every Lease"),
            "{error}"
        );
    }

    /// `--egress-handover` is a plain agent's: with `--capture` the role
    /// hands the sessions over already, and it needs a socket.
    #[test]
    fn egress_handover_is_for_plain_agents_with_a_socket() {
        let config = |flags: &[&str]| {
            let mut line = vec!["proxy-agent", "--agent-id=a", "--egress-handover"];
            line.extend(flags);
            Config::from_args(&Args::try_parse_from(&line).unwrap()).map_err(|e| e.to_string())
        };
        let plain = config(&["--handover-socket=/run/k/h.sock", "--drain-timeout=9s"]).unwrap();
        let handover = plain.egress_handover.unwrap();
        assert_eq!(handover.socket, std::path::PathBuf::from("/run/k/h.sock"));
        assert_eq!(handover.drain_timeout, Duration::from_secs(9));
        assert!(
            config(&["--handover-socket="])
                .unwrap_err()
                .contains("--handover-socket")
        );
        let off = Config::from_args(&Args::try_parse_from(["proxy-agent", "--agent-id=a"]).unwrap()).unwrap();
        assert!(off.egress_handover.is_none(), "off by default");
    }

    #[test]
    fn capture_target_takes_the_vip_from_the_kubelets_environment() {
        let target: SocketAddr = "10.222.1.10:6443".parse().unwrap();
        let env = |host: &'static str| {
            move |name: &str| match name {
                "KUBERNETES_SERVICE_HOST" => Some(host.to_owned()),
                "KUBERNETES_SERVICE_PORT" => Some("443".to_owned()),
                _ => None,
            }
        };
        let v4 = capture_from_environment(target, env("10.96.0.1")).unwrap();
        assert_eq!(v4.destination, "10.96.0.1:443".parse().unwrap());
        assert_eq!(v4.target, target);
        let v6 = capture_from_environment(target, env("fd00:96::1")).unwrap();
        assert_eq!(v6.destination, "[fd00:96::1]:443".parse().unwrap());
        let error = capture_from_environment(target, |_| None)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--capture-target") && error.contains("KUBERNETES_SERVICE_HOST"),
            "{error}"
        );
    }

    #[test]
    fn server_hosts_split_at_commas_and_may_carry_ports() {
        let hosts = |flag: &str| {
            let args = Args::try_parse_from(["proxy-agent", "--agent-id=a", flag]).unwrap();
            Config::from_args(&args).map(|config| (config.server_hosts, config.dial_every_address))
        };
        let address = |host: &str, port| ServerAddress {
            host: host.to_owned(),
            port,
        };
        assert_eq!(
            hosts("--proxy-server-host=lb.example").unwrap(),
            (vec![address("lb.example", 8091)], false)
        );
        assert_eq!(
            hosts("--proxy-server-host=a:9000, b,[fd00::1]:9001,fd00::2").unwrap(),
            (
                vec![
                    address("a", 9000),
                    address("b", 8091),
                    address("fd00::1", 9001),
                    address("fd00::2", 8091)
                ],
                true
            )
        );
        for bad in ["a,,b", "a:0", "a:x", "[fd00::1", ""] {
            let error = hosts(&format!("--proxy-server-host={bad}"))
                .unwrap_err()
                .to_string();
            assert!(error.contains("--proxy-server-host"), "{bad}: {error}");
        }
    }

    #[test]
    fn keepalive_is_raised_to_what_servers_allow_and_zero_turns_it_off() {
        assert_eq!(keepalive("--keepalive-time=5s"), Some(MIN_KEEPALIVE));
        assert_eq!(keepalive("--keepalive-time=2m"), Some(Duration::from_secs(120)));
        assert_eq!(keepalive("--keepalive-time=0s"), None);
    }
}
