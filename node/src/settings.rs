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
    /// The hosts of `--proxy-server-host`, in the order this node tries them
    /// ([`NodeSettings::hosts_in_node_order`]); all serve the node frontend
    /// on `node_frontend_port`.
    pub server_hosts: Vec<String>,
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

impl NodeSettings {
    /// The hosts of `--proxy-server-host` (several servers without a
    /// balancer in front) in the order a node tries them: from one its agent
    /// id picks, round the list. The nodes of a DaemonSet, whose flags are
    /// all the same, so spread over the servers (by a stable hash: agent ids
    /// are random unless `--agent-id` is set), and a node whose server is
    /// gone moves to the next.
    pub fn hosts_in_node_order(hosts: &[String], agent_id: &str) -> Vec<String> {
        let mut unique: Vec<String> = Vec::with_capacity(hosts.len());
        for host in hosts {
            if !unique.contains(host) {
                unique.push(host.clone());
            }
        }
        if !unique.is_empty() {
            // FNV-1a: the same on every build and platform, unlike std's hasher.
            let hash = agent_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
            });
            let first = (hash % unique.len() as u64) as usize;
            unique.rotate_left(first);
        }
        unique
    }
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
            server_hosts: vec!["127.0.0.1".to_owned()],
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn the_nodes_of_a_daemonset_spread_over_the_servers_each_round_the_list() {
        let hosts: Vec<String> = ["a", "b", "c", "b"].iter().map(|h| (*h).to_owned()).collect();
        let mut first = HashMap::new();
        for n in 0..3000 {
            let order = NodeSettings::hosts_in_node_order(&hosts, &format!("node-{n}"));
            // Every host once, in the list's order round from the first.
            let at = |host: &str| order.iter().position(|h| h == host).expect("every host");
            assert_eq!(order.len(), 3, "{order:?}");
            assert_eq!((at("a") + 1) % 3, at("b"), "{order:?}");
            assert_eq!((at("b") + 1) % 3, at("c"), "{order:?}");
            *first.entry(order[0].clone()).or_insert(0) += 1;
        }
        for host in ["a", "b", "c"] {
            let count = first[host];
            assert!(
                (800..=1200).contains(&count),
                "{host} first for {count} of 3000: {first:?}"
            );
        }
        // The same node, the same order.
        assert_eq!(
            NodeSettings::hosts_in_node_order(&hosts, "node-7"),
            NodeSettings::hosts_in_node_order(&hosts, "node-7")
        );
        assert_eq!(
            NodeSettings::hosts_in_node_order(&[], "node-7"),
            Vec::<String>::new()
        );
    }
}
