//! core/v1 Nodes, read-only: which addresses and pod ranges a node has, so
//! that a server can admit only the identifiers an agent's node proves
//! (an agent's token or certificate names its node; see docs/security.md).

use std::net::IpAddr;

use serde::Deserialize;

use crate::reflector::{Collection, Object};

/// A node's name, as in `metadata.name` and a bound token's
/// `authentication.kubernetes.io/node-name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeName(pub String);

impl std::fmt::Display for NodeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The part of a Node the proxy reads; every other field is ignored.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    #[serde(default)]
    pub metadata: NodeMeta,
    #[serde(default)]
    pub spec: NodeSpec,
    #[serde(default)]
    pub status: NodeStatus,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeMeta {
    #[serde(default)]
    pub name: String,
    /// Tells a Node apart from an earlier one of the same name (a node
    /// deleted and created again); a bound token names it too.
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub resource_version: String,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// The node's pod ranges (one per family); older objects have only
    /// `podCIDR`.
    #[serde(default, rename = "podCIDRs")]
    pub pod_cidrs: Vec<String>,
    #[serde(default, rename = "podCIDR")]
    pub pod_cidr: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct NodeStatus {
    #[serde(default)]
    pub addresses: Vec<NodeAddress>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct NodeAddress {
    /// InternalIP, ExternalIP, Hostname, InternalDNS, ExternalDNS.
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub address: String,
}

impl Node {
    pub fn name(&self) -> NodeName {
        NodeName(self.metadata.name.clone())
    }

    /// The node's IP addresses: its InternalIP and ExternalIP entries that
    /// parse as addresses (kube-apiserver validates them; a stand-in may not).
    pub fn ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.status
            .addresses
            .iter()
            .filter(|address| matches!(address.kind.as_str(), "InternalIP" | "ExternalIP"))
            .filter_map(|address| address.address.parse().ok())
    }

    /// The node's host names: its Hostname entries.
    pub fn hostnames(&self) -> impl Iterator<Item = &str> + '_ {
        self.status
            .addresses
            .iter()
            .filter(|address| address.kind == "Hostname" && !address.address.is_empty())
            .map(|address| address.address.as_str())
    }

    /// The node's pod ranges as written: `spec.podCIDRs`, or the older
    /// `spec.podCIDR` when that is all there is.
    pub fn pod_cidrs(&self) -> impl Iterator<Item = &str> + '_ {
        let written = match (&self.spec.pod_cidrs[..], &self.spec.pod_cidr) {
            ([], Some(single)) => std::slice::from_ref(single),
            (all, _) => all,
        };
        written.iter().map(String::as_str)
    }
}

impl Object for Node {
    fn resource_version(&self) -> &str {
        &self.metadata.resource_version
    }
}

/// Every Node of the cluster, to follow with a
/// [`crate::reflector::Reflector`].
pub fn all_nodes() -> Collection {
    Collection {
        path: "/api/v1/nodes".to_owned(),
        label_selector: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Node as kube-apiserver 1.31 serves it (trimmed of fields the proxy
    /// ignores, which must not matter).
    const NODE: &str = r#"{
      "kind": "Node", "apiVersion": "v1",
      "metadata": {"name": "node-a", "uid": "6b0c6d2e-0d6f-4bb5-9a43-1d1b2c1f6e0a",
                   "resourceVersion": "4711", "labels": {"kubernetes.io/hostname": "node-a"}},
      "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"],
               "providerID": "kind://docker/kind/node-a"},
      "status": {"addresses": [
          {"type": "InternalIP", "address": "172.18.0.3"},
          {"type": "InternalIP", "address": "fc00:f853:ccd:e793::3"},
          {"type": "ExternalIP", "address": "203.0.113.7"},
          {"type": "Hostname", "address": "node-a"},
          {"type": "InternalDNS", "address": "node-a.internal"}],
        "capacity": {"cpu": "2"}, "conditions": []}
    }"#;

    #[test]
    fn a_nodes_addresses_host_names_and_pod_ranges_are_read() {
        let node: Node = serde_json::from_str(NODE).unwrap();
        assert_eq!(node.name(), NodeName("node-a".to_owned()));
        assert_eq!(node.metadata.uid, "6b0c6d2e-0d6f-4bb5-9a43-1d1b2c1f6e0a");
        let ips: Vec<String> = node.ips().map(|ip| ip.to_string()).collect();
        assert_eq!(ips, ["172.18.0.3", "fc00:f853:ccd:e793::3", "203.0.113.7"]);
        assert_eq!(node.hostnames().collect::<Vec<_>>(), ["node-a"]);
        assert_eq!(
            node.pod_cidrs().collect::<Vec<_>>(),
            ["10.244.1.0/24", "fd00:10:244:1::/64"]
        );
    }

    #[test]
    fn an_older_node_with_only_pod_cidr_and_an_empty_one_are_read() {
        let older: Node =
            serde_json::from_str(r#"{"metadata":{"name":"n"},"spec":{"podCIDR":"10.0.0.0/24"}}"#).unwrap();
        assert_eq!(older.pod_cidrs().collect::<Vec<_>>(), ["10.0.0.0/24"]);
        let empty: Node = serde_json::from_str(r#"{"metadata":{"name":"n"}}"#).unwrap();
        assert_eq!(
            empty.ips().count() + empty.hostnames().count() + empty.pod_cidrs().count(),
            0
        );
        // An address that is not one (a stand-in may serve anything) is
        // not an IP the node proves.
        let odd: Node =
            serde_json::from_str(r#"{"status":{"addresses":[{"type":"InternalIP","address":"not-an-ip"}]}}"#)
                .unwrap();
        assert_eq!(odd.ips().count(), 0);
    }
}
