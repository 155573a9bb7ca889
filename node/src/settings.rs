//! What the node role is told: the agent's flags, validated (the agent's
//! `config.rs` makes these).

use std::sync::Arc;
use std::time::Duration;

use crate::capture::map::CaptureMap;

/// Everything the node role needs from the agent's configuration.
#[derive(Clone)]
pub struct NodeSettings {
    pub captures: CaptureMap,
    pub capture_port: u16,
    pub mark: u32,
    pub server_host: String,
    pub node_frontend_port: u16,
    pub tls: Arc<rustls::ClientConfig>,
    pub sync_interval: Duration,
    pub sync_interval_cap: Duration,
    /// Pod capture: the CNI socket and the state directory.
    pub cni: Option<CniSettings>,
    /// `--handover-socket`.
    pub handover_socket: Option<std::path::PathBuf>,
    /// `--resume-timeout`: how long a captured connection whose stream of
    /// the node tunnel was lost waits for a new one (0: reset at once).
    pub resume_timeout: Duration,
    /// The agent's egress sessions, handed over with the role.
    pub egress: Option<crate::sessions::EgressHandover>,
}

#[derive(Clone, Debug)]
pub struct CniSettings {
    pub socket: std::path::PathBuf,
    pub state_dir: std::path::PathBuf,
    /// `--pod-netns-dir`; `None` when empty.
    pub netns_dir: Option<std::path::PathBuf>,
    /// `--cni-cache-dir`; `None` when empty.
    pub cni_cache_dir: Option<std::path::PathBuf>,
    /// `--cni-conf-dir`.
    pub cni_conf_dir: std::path::PathBuf,
    /// `--exclude-namespaces`.
    pub exclude_namespaces: Vec<String>,
}

#[cfg(test)]
impl NodeSettings {
    /// Settings that reach no server, for unit tests of what only holds them.
    pub(crate) fn for_tests() -> NodeSettings {
        let tls = konnectivity_plumbing::tls::client_config_from(rustls::RootCertStore::empty(), None, &[])
            .expect("a configuration without a certificate");
        NodeSettings {
            captures: CaptureMap::default(),
            capture_port: 0,
            mark: 0,
            server_host: "127.0.0.1".to_owned(),
            node_frontend_port: 1,
            tls: Arc::new(tls),
            sync_interval: Duration::from_secs(1),
            sync_interval_cap: Duration::from_secs(1),
            cni: None,
            handover_socket: None,
            resume_timeout: Duration::ZERO,
            egress: None,
        }
    }
}
