//! proxy-server's flags (upstream names and defaults) and their validation
//! into one typed [`Config`].

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};
use konnectivity_kube::{KubeEndpoint, RateLimit, parse_labels};
use konnectivity_plumbing::flags::{FlagError, identity_pair, invalid, pem_file};
use konnectivity_plumbing::flags::{GoList, parse_bool, parse_duration, parse_list, parse_port};
use konnectivity_plumbing::tls::{self, Identity, PemFile, TlsOffer};
use konnectivity_telemetry::klog::KlogArgs;

use crate::backend::strategy::{Strategy, parse_strategies};
use crate::identity::IdentifiersCheck;
pub use crate::leases::LeaseSettings;
use crate::policy::{AllowedDestination, parse_allowed};
use crate::token_auth::AllowedAgents;
use konnectivity_kube::node::NodeName;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    // ProxyService over gRPC (kube-apiserver's `GRPC` egress protocol).
    Grpc,
    // HTTP/1.1 CONNECT (kube-apiserver's `HTTPConnect` egress protocol).
    HttpConnect,
}

/// The Konnectivity proxy server: kube-apiserver egress through agents.
#[derive(Parser, Debug, Clone)]
// As with Go's pflag, a flag given twice takes the last value.
#[command(name = "proxy-server", version, about, args_override_self = true)]
#[command(next_help_heading = "Upstream-compatible flags")]
pub struct Args {
    /// Frontend protocol: grpc (ProxyService, kube-apiserver's `GRPC` egress) or http-connect (`HTTPConnect`).
    #[arg(long, value_enum, default_value = "grpc")]
    pub mode: Mode,
    /// Serve the frontend on this Unix socket instead of TCP (then --server-port must be 0).
    #[arg(long, default_value = "")]
    pub uds_name: String,
    /// Remove a leftover socket file at --uds-name before listening.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub delete_existing_uds_file: bool,
    /// TCP port of the frontend (0 with --uds-name).
    #[arg(long, value_parser = parse_port, default_value = "8090")]
    pub server_port: u16,
    /// Bind address of the TCP frontend; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub server_bind_address: String,
    /// Frontend TLS certificate.
    #[arg(long, default_value = "")]
    pub server_cert: String,
    /// Frontend TLS key.
    #[arg(long, default_value = "")]
    pub server_key: String,
    /// CA that frontend clients' certificates must chain to (mandatory over TCP).
    #[arg(long, default_value = "")]
    pub server_ca_cert: String,
    /// Port agents connect to.
    #[arg(long, value_parser = parse_port, default_value = "8091")]
    pub agent_port: u16,
    /// Bind address of the agent listener; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub agent_bind_address: String,
    /// TLS certificate of the agent listener (falls back to --server-cert).
    #[arg(long, default_value = "")]
    pub cluster_cert: String,
    /// TLS key of the agent listener (falls back to --server-key).
    #[arg(long, default_value = "")]
    pub cluster_key: String,
    /// CA that agents' client certificates must chain to; enables agent mTLS.
    #[arg(long, default_value = "")]
    pub cluster_ca_cert: String,
    /// This server's unique id, sent to agents as `serverid`.
    #[arg(long, env = "PROXY_SERVER_ID", default_value = "")]
    pub server_id: String,
    /// How many servers run behind the agents' address (sent as `servercount`).
    #[arg(long, default_value_t = 1)]
    pub server_count: u32,
    /// Backend selection strategies, tried in order: default, destHost, defaultRoute.
    #[arg(long, default_value = "default")]
    pub proxy_strategies: String,
    /// Port of /healthz, /readyz, /ready and /metrics.
    #[arg(long, value_parser = parse_port, default_value = "8092")]
    pub health_port: u16,
    /// Bind address of the health listener; empty means all interfaces.
    #[arg(long, default_value = "")]
    pub health_bind_address: String,
    /// Port of the admin listener: /metrics, as on the health port (upstream's scrape configs use either).
    /// A port that cannot be bound is logged and the server runs on without it, as upstream's.
    #[arg(long, value_parser = parse_port, default_value = "8095")]
    pub admin_port: u16,
    /// Bind address of the admin listener; empty means all interfaces.
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// How long a dial may wait for the agent's DIAL_RSP; 0 waits for the agent's own timeout.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub backend_dial_timeout: Duration,
    /// Packets buffered per connection. Not applied in this version (accepted for upstream compatibility): each connection
    /// buffers up to its flow-control window, 2 MiB, instead.
    #[arg(long, default_value_t = 10)]
    pub xfr_channel_size: usize,
    /// Buffered packets per HTTP CONNECT frontend. Not applied in this version (accepted for upstream compatibility), as
    /// --xfr-channel-size.
    #[arg(long, default_value_t = 10)]
    pub frontend_write_channel_size: usize,
    /// Interval of HTTP/2 keepalive pings to agents; a ping unanswered within the
    /// interval (at most 20s) ends the agent's connection. 0 turns pings off.
    #[arg(long, value_parser = parse_duration, default_value = "1h0m0s")]
    pub keepalive_time: Duration,
    /// Interval of HTTP/2 keepalive pings on gRPC frontend connections (same rules as
    /// --keepalive-time).
    #[arg(long, value_parser = parse_duration, default_value = "1h0m0s")]
    pub frontend_keepalive_time: Duration,
    /// On SIGTERM, stop accepting and wait up to this long for open tunnels to end
    /// before exiting (0: exit at once).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub graceful_shutdown_timeout: Duration,
    /// Most tunnels open at once through each frontend (kube-apiserver's, and the node
    /// frontend's separately); one more is refused (HTTP 503, or a DIAL_RSP error)
    /// and counted in tunnel_limit_refusals_total. 0: no limit.
    #[arg(long, default_value_t = 0, help_heading = "konnectivity-rs additions")]
    pub max_tunnels_per_frontend: usize,
    /// How long the connections of a lost agent stream wait for the agent to resume
    /// them on a new stream (konnectivity-rs agents, which negotiate it; docs/resume.md),
    /// and a node tunnel's captured connection whose stream was lost waits for the node
    /// agent. Meanwhile kube-apiserver's side of each sees a pause, not an error. While
    /// above 0, agent and node tunnel connections are pinged every 5s (or the listener's
    /// keepalive time, if shorter), so a silent peer is noticed within 10s. 0 closes
    /// them at once, as upstream does.
    #[arg(long, value_parser = parse_duration, default_value = "1m0s", help_heading = "konnectivity-rs additions")]
    pub agent_resume_timeout: Duration,
    /// Authenticate agents by ServiceAccount token instead of client certificate:
    /// the namespace of their ServiceAccount (with --agent-service-account and
    /// --authentication-audience; excludes --cluster-ca-cert).
    #[arg(long, default_value = "")]
    pub agent_namespace: String,
    /// The ServiceAccount agents' tokens must belong to.
    #[arg(long, default_value = "")]
    pub agent_service_account: String,
    /// The audience agents' tokens must be issued for (checked by TokenReview).
    #[arg(long, default_value = "")]
    pub authentication_audience: String,
    /// kubeconfig for TokenReviews and server Leases; empty uses the pod's ServiceAccount.
    #[arg(long, default_value = "")]
    pub kubeconfig: String,
    /// Requests per second to kube-apiserver (TokenReviews, Leases), as client-go's rate limit. 0 (or below) is no
    /// limit, where upstream takes client-go's 5: TokenReviews are cached and shared, one per distinct agent token.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub kubeconfig_qps: f32,
    /// Requests to kube-apiserver that may go at once before --kubeconfig-qps applies; 0 means client-go's default, 10.
    #[arg(long, default_value_t = 0)]
    pub kubeconfig_burst: u32,
    /// Content type of requests to kube-apiserver. Not applied (accepted for upstream compatibility): requests are JSON, so
    /// that a Lease update carries back every field kube-apiserver sent, those this version does not know included,
    /// where a protobuf decoder without them would drop them and the update erase them.
    #[arg(long, default_value = "application/vnd.kubernetes.protobuf")]
    pub kube_api_content_type: String,
    /// TLS 1.2 cipher suites every TLS listener offers, Go's names, comma-separated (as Go,
    /// TLS 1.3's suites are always offered): TLS_ECDHE_{ECDSA,RSA}_WITH_AES_{128,256}_GCM_* and
    /// _CHACHA20_POLY1305_SHA256; CBC, RSA key exchange and 3DES suites are refused. Empty: all.
    #[arg(long, value_parser = parse_list, default_value = "")]
    pub cipher_suites: GoList,
    /// Minimum TLS version of every TLS listener: VersionTLS12 or VersionTLS13 (TLS 1.0 and 1.1
    /// are refused: no listener offers them).
    #[arg(long, default_value = "")]
    pub tls_min_version: String,
    /// Publish a Lease for this server (coordination.k8s.io/v1, in --lease-namespace,
    /// labelled --lease-label) for agents to count, and delete expired server Leases;
    /// through --kubeconfig, or the pod's ServiceAccount when it is empty.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub enable_lease_controller: bool,
    /// Namespace of the server Leases.
    #[arg(long, default_value = "kube-system")]
    pub lease_namespace: String,
    /// Labels of this server's Lease, comma-separated key=value; also the selector
    /// of the Leases whose expired ones this server deletes.
    #[arg(long, value_parser = parse_labels, default_value = "k8s-app=konnectivity-server")]
    pub lease_label: BTreeMap<String, String>,
    /// How long a server Lease stays valid after a renewal (upstream fixes 30s).
    #[arg(long, value_parser = parse_duration, default_value = "30s", help_heading = "konnectivity-rs additions")]
    pub lease_duration: Duration,
    /// How often the server renews its Lease (upstream fixes 15s); below --lease-duration.
    #[arg(long, value_parser = parse_duration, default_value = "15s", help_heading = "konnectivity-rs additions")]
    pub lease_renew_interval: Duration,
    /// How often the server looks for expired server Leases to delete (upstream fixes 15s).
    #[arg(long, value_parser = parse_duration, default_value = "15s", help_heading = "konnectivity-rs additions")]
    pub lease_gc_interval: Duration,
    #[command(flatten)]
    pub profiling: konnectivity_telemetry::profiling::ProfilingArgs,
    /// Deprecated upstream and always on; accepted and ignored.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub warn_on_channel_limit: bool,

    /// Port of the node frontend: ProxyService for node agents tunneling captured
    /// connections to the API server (0 = off).
    #[arg(long, value_parser = parse_port, default_value = "0", help_heading = "Node-to-KAS (konnectivity-rs)")]
    pub node_frontend_port: u16,
    /// Bind address of the node frontend; empty means all interfaces.
    #[arg(long, default_value = "", help_heading = "Node-to-KAS (konnectivity-rs)")]
    pub node_frontend_bind_address: String,
    /// CA that node agents' client certificates must chain to (required with --node-frontend-port).
    #[arg(long, default_value = "", help_heading = "Node-to-KAS (konnectivity-rs)")]
    pub node_client_ca_cert: String,
    /// What node clients may dial: comma-separated IP:PORT or CIDR:PORT (IPv6 in brackets).
    #[arg(long, default_value = "", help_heading = "Node-to-KAS (konnectivity-rs)")]
    pub node_allowed_destinations: String,
    /// Agent ids of control-plane agents: the only agents node dials use, never used for
    /// ordinary egress. Needs --cluster-ca-cert: the agent's certificate must name its id.
    #[arg(long, value_parser = parse_list, default_value = "", help_heading = "Node-to-KAS (konnectivity-rs)")]
    pub control_plane_agent_ids: GoList,
    /// Nodes whose agents may be control-plane agents (comma-separated Node names): when set, a
    /// control-plane agent's credential must also name one of them (a certificate name
    /// system:node:NAME, or a bound ServiceAccount token). Empty: any node.
    #[arg(long, value_parser = parse_list, default_value = "", help_heading = "Node-to-KAS (konnectivity-rs)")]
    pub control_plane_nodes: GoList,
    /// What happens to an agent identifier (--agent-identifiers) that the node the agent's credential
    /// names does not have (its Node's addresses, host names and pod ranges; a bound ServiceAccount
    /// token or a certificate for system:node:NAME names the node): drop (the claim is dropped, the
    /// agent keeps the rest; an agent whose credential names no node keeps all, as upstream), strict
    /// (the stream is refused, also when the credential names no node) or off (upstream's behaviour).
    /// Reading Nodes needs --kubeconfig or the pod's ServiceAccount, with get, list and watch on nodes.
    #[arg(long, default_value = "drop", help_heading = "konnectivity-rs additions")]
    pub agent_identifiers_check: IdentifiersCheck,
    /// Nodes whose agents may claim default-route=true (comma-separated Node names); on any other
    /// node the claim is dropped (--agent-identifiers-check).
    #[arg(long, value_parser = parse_list, default_value = "", help_heading = "konnectivity-rs additions")]
    pub default_route_nodes: GoList,

    #[command(flatten)]
    pub runtime: konnectivity_plumbing::runtime::RuntimeArgs,

    #[command(flatten)]
    pub klog: KlogArgs,
}

/// Where and how the frontend listens.
#[derive(Clone, Debug)]
pub enum FrontendListen {
    Uds {
        path: PathBuf,
        delete_existing: bool,
    },
    /// TCP always with mTLS: kube-apiserver must present a certificate.
    Tcp {
        addr: SocketAddr,
        identity: Identity,
        client_ca: PemFile,
    },
}

/// Where the frontend listens, as a log line names it: `unix:PATH` or
/// `tcp:ADDR`.
impl std::fmt::Display for FrontendListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrontendListen::Uds { path, .. } => write!(f, "unix:{}", path.display()),
            FrontendListen::Tcp { addr, .. } => write!(f, "tcp:{addr}"),
        }
    }
}

/// The node frontend and its policy (`--node-*` flags).
#[derive(Clone, Debug)]
pub struct NodeFrontend {
    pub addr: SocketAddr,
    pub client_ca: PemFile,
    pub allowed: Vec<AllowedDestination>,
}

/// The validated configuration the server runs with.
#[derive(Clone, Debug)]
pub struct Config {
    pub mode: Mode,
    pub frontend: FrontendListen,
    pub agent_addr: SocketAddr,
    pub agent_identity: Identity,
    pub agent_client_ca: Option<PemFile>,
    pub server_id: String,
    pub server_count: u32,
    pub strategies: Vec<Strategy>,
    pub health_addr: SocketAddr,
    /// `--admin-bind-address` and `--admin-port`.
    pub admin_addr: SocketAddr,
    /// `--enable-profiling`: `/debug/pprof/` on the admin listener.
    pub profiling: bool,
    pub backend_dial_timeout: Option<Duration>,
    /// `--keepalive-time` (agent connections); `None` is off.
    pub keepalive: Option<Duration>,
    /// `--frontend-keepalive-time` (gRPC frontend connections); `None` is off.
    pub frontend_keepalive: Option<Duration>,
    /// `--graceful-shutdown-timeout`.
    pub graceful_shutdown_timeout: Duration,
    /// `--agent-resume-timeout`; zero: agent streams and node tunnels' streams
    /// are not resumable.
    pub agent_resume_timeout: Duration,
    /// `--tls-min-version` and `--cipher-suites`, for every TLS listener.
    pub tls_offer: TlsOffer,
    pub node_frontend: Option<NodeFrontend>,
    /// Agent ids that are control-plane agents (bound to their certificates).
    pub control_plane_agent_ids: Vec<String>,
    /// `--control-plane-nodes` (empty: any).
    pub control_plane_nodes: Vec<NodeName>,
    /// `--agent-identifiers-check`.
    pub identifiers_check: IdentifiersCheck,
    /// `--default-route-nodes`.
    pub default_route_nodes: Vec<NodeName>,
    /// Agents authenticate by ServiceAccount token rather than certificate.
    pub agent_auth: Option<AgentTokenAuth>,
    /// `--max-tunnels-per-frontend` (0: none).
    pub max_tunnels_per_frontend: usize,
    /// `--enable-lease-controller` and its settings.
    pub leases: Option<LeaseSettings>,
    /// kube-apiserver (`--kubeconfig`, with `--kubeconfig-qps` and
    /// `--kubeconfig-burst`), when token authentication or the Lease
    /// controller needs it: one client, one connection, for both.
    pub kube: Option<KubeEndpoint>,
}

/// `--agent-namespace` & co.: whom to admit (kube-apiserver reviews the
/// tokens: [`Config::kube`]).
#[derive(Clone, Debug)]
pub struct AgentTokenAuth {
    pub allowed: AllowedAgents,
}

/// Errors name the flag at fault; main exits with status 2 on them.
pub type ConfigError = FlagError;

fn bind_address(flag: &'static str, value: &str, port: u16) -> Result<SocketAddr, ConfigError> {
    let ip = if value.is_empty() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        value
            .parse()
            .map_err(|_| invalid(flag, format!("{value:?} is not an IP address")))?
    };
    Ok(SocketAddr::new(ip, port))
}

impl Config {
    pub fn from_args(args: &Args) -> Result<Config, ConfigError> {
        let server_identity = identity_pair(
            ("server-cert", &args.server_cert),
            ("server-key", &args.server_key),
        )?;
        let server_ca = pem_file("server-ca-cert", &args.server_ca_cert)?;
        let frontend = if args.uds_name.is_empty() {
            if args.server_port == 0 {
                return Err(invalid("server-port", "must be set when --uds-name is empty"));
            }
            let client_ca = server_ca.ok_or_else(|| {
                invalid(
                    "server-ca-cert",
                    "must be set for a TCP frontend (--uds-name is empty)",
                )
            })?;
            let identity = server_identity.clone().ok_or_else(|| {
                invalid(
                    "server-cert",
                    "must be set for a TCP frontend (--uds-name is empty)",
                )
            })?;
            FrontendListen::Tcp {
                addr: bind_address("server-bind-address", &args.server_bind_address, args.server_port)?,
                identity,
                client_ca,
            }
        } else {
            if args.server_port != 0 {
                return Err(invalid(
                    "server-port",
                    format!("must be 0 with --uds-name, not {}", args.server_port),
                ));
            }
            FrontendListen::Uds {
                path: PathBuf::from(&args.uds_name),
                delete_existing: args.delete_existing_uds_file,
            }
        };
        if args.agent_port == 0 {
            return Err(invalid("agent-port", "must not be 0"));
        }
        if args.health_port == 0 {
            return Err(invalid("health-port", "must not be 0"));
        }
        let agent_identity = identity_pair(
            ("cluster-cert", &args.cluster_cert),
            ("cluster-key", &args.cluster_key),
        )?
        .or(server_identity)
        .ok_or_else(|| {
            invalid(
                "cluster-cert",
                "the agent listener needs a TLS certificate (--cluster-cert and --cluster-key)",
            )
        })?;
        if args.server_count == 0 {
            return Err(invalid("server-count", "must be at least 1"));
        }
        if args.xfr_channel_size == 0 {
            return Err(invalid("xfr-channel-size", "must be greater than 0"));
        }
        if args.admin_port == 0 {
            return Err(invalid("admin-port", "must not be 0"));
        }
        if let Some((flag, problem)) = args.profiling.problem() {
            return Err(invalid(flag, problem));
        }
        if args.frontend_write_channel_size == 0 {
            return Err(invalid("frontend-write-channel-size", "must be greater than 0"));
        }
        let token_auth = [
            &args.agent_namespace,
            &args.agent_service_account,
            &args.authentication_audience,
        ];
        if token_auth.iter().any(|v| !v.is_empty()) {
            if !args.cluster_ca_cert.is_empty() {
                return Err(invalid(
                    "cluster-ca-cert",
                    "cannot be used with agent token authentication",
                ));
            }
            for (flag, value) in [
                "agent-namespace",
                "agent-service-account",
                "authentication-audience",
            ]
            .into_iter()
            .zip(token_auth)
            {
                if value.is_empty() {
                    return Err(invalid(
                        flag,
                        "must be set when agent token authentication is enabled",
                    ));
                }
            }
        }
        if !args.kubeconfig_qps.is_finite() {
            return Err(invalid(
                "kubeconfig-qps",
                "must be a number of requests per second",
            ));
        }
        // One limit for every request, as upstream's one client has.
        let rate_limit = RateLimit::from_flags(args.kubeconfig_qps, args.kubeconfig_burst).map(Arc::new);
        let leases = lease_settings(args)?;
        let agent_auth = token_auth.iter().any(|v| !v.is_empty()).then(|| AgentTokenAuth {
            allowed: AllowedAgents {
                namespace: args.agent_namespace.clone(),
                service_account: args.agent_service_account.clone(),
                audience: args.authentication_audience.clone(),
            },
        });
        let checks_nodes = args.agent_identifiers_check != IdentifiersCheck::Off;
        let kube =
            if agent_auth.is_some() || leases.is_some() || (checks_nodes && !args.kubeconfig.is_empty()) {
                let mut kube = KubeEndpoint::from_flag(&args.kubeconfig)
                    .map_err(|e| invalid("kubeconfig", e.to_string()))?;
                kube.rate_limit = rate_limit;
                Some(kube)
            } else if checks_nodes {
                // Agents' certificates may name their nodes: in a pod, its
                // ServiceAccount reads them; elsewhere there is nothing to read
                // them with, and such claims are taken as made (logged).
                KubeEndpoint::in_cluster().ok().map(|mut kube| {
                    kube.rate_limit = rate_limit;
                    kube
                })
            } else {
                None
            };
        if args.agent_identifiers_check == IdentifiersCheck::Strict && kube.is_none() {
            return Err(invalid(
                "agent-identifiers-check",
                "strict reads the Nodes agents run on: set --kubeconfig, or run in a pod with a ServiceAccount",
            ));
        }
        let tls_offer = tls_offer(&args.tls_min_version, &args.cipher_suites.0)?;
        let node_frontend = node_frontend(args)?;
        let control_plane_agent_ids = args.control_plane_agent_ids.0.clone();
        if !control_plane_agent_ids.is_empty() && args.cluster_ca_cert.is_empty() {
            return Err(invalid(
                "control-plane-agent-ids",
                "needs --cluster-ca-cert, so that an agent's certificate proves its control-plane id",
            ));
        }
        if node_frontend.is_some() && control_plane_agent_ids.is_empty() {
            return Err(invalid(
                "control-plane-agent-ids",
                "must name at least one agent when --node-frontend-port is set: node dials go only to control-plane agents",
            ));
        }
        let strategies = parse_strategies(&args.proxy_strategies)
            .map_err(|message| invalid("proxy-strategies", message))?;
        let server_id = if args.server_id.is_empty() {
            random_server_id()
        } else {
            args.server_id.clone()
        };
        Ok(Config {
            mode: args.mode,
            frontend,
            agent_addr: bind_address("agent-bind-address", &args.agent_bind_address, args.agent_port)?,
            agent_identity,
            agent_client_ca: pem_file("cluster-ca-cert", &args.cluster_ca_cert)?,
            server_id,
            server_count: args.server_count,
            strategies,
            health_addr: bind_address("health-bind-address", &args.health_bind_address, args.health_port)?,
            admin_addr: bind_address("admin-bind-address", &args.admin_bind_address, args.admin_port)?,
            profiling: args.profiling.enable_profiling,
            backend_dial_timeout: (!args.backend_dial_timeout.is_zero()).then_some(args.backend_dial_timeout),
            keepalive: (!args.keepalive_time.is_zero()).then_some(args.keepalive_time),
            frontend_keepalive: (!args.frontend_keepalive_time.is_zero())
                .then_some(args.frontend_keepalive_time),
            graceful_shutdown_timeout: args.graceful_shutdown_timeout,
            agent_resume_timeout: args.agent_resume_timeout,
            tls_offer,
            node_frontend,
            control_plane_agent_ids,
            control_plane_nodes: node_names(&args.control_plane_nodes),
            identifiers_check: args.agent_identifiers_check,
            default_route_nodes: node_names(&args.default_route_nodes),
            agent_auth,
            max_tunnels_per_frontend: args.max_tunnels_per_frontend,
            leases,
            kube,
        })
    }
}

/// A list flag of Node names.
fn node_names(list: &GoList) -> Vec<NodeName> {
    list.0.iter().map(|name| NodeName(name.clone())).collect()
}

/// `--enable-lease-controller` and the flags it reads.
fn lease_settings(args: &Args) -> Result<Option<LeaseSettings>, ConfigError> {
    if !args.enable_lease_controller {
        return Ok(None);
    }
    if args.lease_namespace.is_empty() {
        return Err(invalid(
            "lease-namespace",
            "must not be empty with --enable-lease-controller",
        ));
    }
    let labels = args.lease_label.clone();
    if labels.is_empty() {
        // An empty selector matches every Lease of the namespace, and the
        // garbage collector would delete other components' expired Leases.
        return Err(invalid(
            "lease-label",
            "must name at least one key=value with --enable-lease-controller",
        ));
    }
    if args.lease_duration < Duration::from_secs(1) {
        return Err(invalid(
            "lease-duration",
            "must be at least 1s (Leases count whole seconds)",
        ));
    }
    if args.lease_renew_interval.is_zero() || args.lease_renew_interval >= args.lease_duration {
        return Err(invalid(
            "lease-renew-interval",
            format!(
                "must be greater than 0 and shorter than --lease-duration {:?}",
                args.lease_duration
            ),
        ));
    }
    if args.lease_gc_interval.is_zero() {
        return Err(invalid("lease-gc-interval", "must be greater than 0"));
    }
    Ok(Some(LeaseSettings {
        namespace: args.lease_namespace.clone(),
        labels,
        duration: args.lease_duration,
        renew_interval: args.lease_renew_interval,
        gc_interval: args.lease_gc_interval,
    }))
}

fn node_frontend(args: &Args) -> Result<Option<NodeFrontend>, ConfigError> {
    if args.node_frontend_port == 0 {
        for (flag, value) in [
            ("node-client-ca-cert", &args.node_client_ca_cert),
            ("node-allowed-destinations", &args.node_allowed_destinations),
        ] {
            if !value.is_empty() {
                return Err(invalid(flag, "has no effect without --node-frontend-port"));
            }
        }
        return Ok(None);
    }
    let client_ca = pem_file("node-client-ca-cert", &args.node_client_ca_cert)?
        .ok_or_else(|| invalid("node-client-ca-cert", "must be set with --node-frontend-port"))?;
    let allowed = parse_allowed(&args.node_allowed_destinations)
        .map_err(|message| invalid("node-allowed-destinations", message))?;
    if allowed.is_empty() {
        return Err(invalid(
            "node-allowed-destinations",
            "must list the API server endpoints node clients may reach",
        ));
    }
    Ok(Some(NodeFrontend {
        addr: bind_address(
            "node-frontend-bind-address",
            &args.node_frontend_bind_address,
            args.node_frontend_port,
        )?,
        client_ca,
        allowed,
    }))
}

/// What every TLS listener offers: upstream's `--tls-min-version` names
/// mapped to what rustls has (TLS 1.0 and 1.1 are refused: it has neither),
/// and `--cipher-suites` by Go's names.
fn tls_offer(min_version: &str, cipher_suites: &[String]) -> Result<TlsOffer, ConfigError> {
    let tls13_only = match min_version {
        "" | "VersionTLS12" => false,
        "VersionTLS13" => true,
        "VersionTLS10" | "VersionTLS11" => {
            return Err(invalid(
                "tls-min-version",
                format!(
                    "{min_version} is not offered (TLS 1.0 and 1.1 are insecure and rustls has neither); use VersionTLS12 or VersionTLS13"
                ),
            ));
        }
        other => {
            return Err(invalid(
                "tls-min-version",
                format!("{other:?} is not one of VersionTLS12, VersionTLS13"),
            ));
        }
    };
    let tls12_suites =
        tls::cipher_suites_by_go_name(cipher_suites).map_err(|problem| invalid("cipher-suites", problem))?;
    if !tls13_only
        && !tls12_suites.is_empty()
        && tls12_suites
            .iter()
            .all(|suite| suite.version() == &rustls::version::TLS13)
    {
        tracing::warn!("--cipher-suites names TLS 1.3 suites only: TLS 1.2 clients cannot connect");
    }
    Ok(TlsOffer {
        tls13_only,
        tls12_suites,
    })
}

impl Args {
    /// Upstream flags given a non-default value that this version accepts
    /// but does not act on; main logs each once.
    pub fn inert_settings(&self) -> Vec<&'static str> {
        [
            (
                "frontend-write-channel-size",
                self.frontend_write_channel_size != 10,
            ),
            ("xfr-channel-size", self.xfr_channel_size != 10),
            // Only token authentication and Leases read it.
            (
                "kubeconfig",
                !self.kubeconfig.is_empty()
                    && self.agent_namespace.is_empty()
                    && !self.enable_lease_controller
                    && self.agent_identifiers_check == IdentifiersCheck::Off,
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

/// Upstream defaults the server id to a fresh UUID.
fn random_server_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_describes_every_flag_and_marks_every_inert_one() {
        use clap::CommandFactory;
        let line = vec![
            "proxy-server",
            "--frontend-write-channel-size=5",
            "--xfr-channel-size=5",
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
        let problems = konnectivity_telemetry::klog::help_problems(&Args::command(), &inert);
        assert!(problems.is_empty(), "{problems:#?}");
    }
}
