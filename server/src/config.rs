//! proxy-server's flags (upstream names and defaults) and their validation
//! into one typed [`Config`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};
use konnectivity_plumbing::flags::{parse_bool, parse_duration, parse_port};
use konnectivity_plumbing::tls::{Identity, PemFile};

use crate::backend::strategy::{Strategy, parse_strategies};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// ProxyService over gRPC (kube-apiserver's `GRPC` egress protocol).
    Grpc,
    /// HTTP/1.1 CONNECT (kube-apiserver's `HTTPConnect` egress protocol).
    HttpConnect,
}

/// The Konnectivity proxy server: kube-apiserver egress through agents.
#[derive(Parser, Debug, Clone)]
#[command(name = "proxy-server", version, about)]
pub struct Args {
    /// Frontend protocol: grpc or http-connect.
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
    /// Port of the admin listener.
    #[arg(long, value_parser = parse_port, default_value = "8095")]
    pub admin_port: u16,
    /// Bind address of the admin listener.
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// How long a dial may wait for the agent's DIAL_RSP; 0 waits for the agent's own timeout.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub backend_dial_timeout: Duration,
    /// Packets buffered per connection in each direction.
    #[arg(long, default_value_t = 10)]
    pub xfr_channel_size: usize,
    /// Log verbosity, as klog's -v.
    #[arg(short = 'v', long = "v", default_value_t = 0)]
    pub verbosity: u32,
    /// Log to a file instead of standard error.
    #[arg(long, default_value = "")]
    pub log_file: String,
    /// Accepted for klog compatibility; logs go to standard error.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub logtostderr: bool,
    /// Accepted for klog compatibility.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub alsologtostderr: bool,
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
    pub backend_dial_timeout: Option<Duration>,
    pub xfr_channel_size: usize,
}

/// A flag with a bad value, or flags that conflict. Exits with status 2.
#[derive(Debug, thiserror::Error)]
#[error("invalid flag --{flag}: {message}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub message: String,
}

fn invalid(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        message: message.into(),
    }
}

/// An existing file given by a flag, or none when the flag is empty.
fn pem_file(flag: &'static str, value: &str) -> Result<Option<PemFile>, ConfigError> {
    if value.is_empty() {
        return Ok(None);
    }
    if !std::path::Path::new(value).is_file() {
        return Err(invalid(flag, format!("{value}: no such file")));
    }
    Ok(Some(PemFile::new(flag, value)))
}

/// A certificate/key flag pair: both or neither.
fn identity(
    cert_flag: &'static str,
    cert: &str,
    key_flag: &'static str,
    key: &str,
) -> Result<Option<Identity>, ConfigError> {
    match (pem_file(cert_flag, cert)?, pem_file(key_flag, key)?) {
        (Some(cert), Some(key)) => Ok(Some(Identity { cert, key })),
        (None, None) => Ok(None),
        (Some(_), None) => Err(invalid(key_flag, format!("must be set when --{cert_flag} is"))),
        (None, Some(_)) => Err(invalid(cert_flag, format!("must be set when --{key_flag} is"))),
    }
}

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
        let server_identity = identity("server-cert", &args.server_cert, "server-key", &args.server_key)?;
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
        let agent_identity = identity(
            "cluster-cert",
            &args.cluster_cert,
            "cluster-key",
            &args.cluster_key,
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
            backend_dial_timeout: (!args.backend_dial_timeout.is_zero()).then_some(args.backend_dial_timeout),
            xfr_channel_size: args.xfr_channel_size,
        })
    }
}

/// Upstream defaults the server id to a fresh UUID.
fn random_server_id() -> String {
    uuid::Uuid::new_v4().to_string()
}
