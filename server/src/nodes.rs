//! What the server knows of the cluster's Nodes, for admitting an agent's
//! identifiers (docs/security.md): one list-then-watch per server, not one
//! per agent, started when the first agent whose credential names a node
//! connects (a server whose agents name none never reads Nodes, and needs
//! no permission to).
//!
//! Only what admission reads is kept and published: a Node's uid,
//! addresses, host names and pod ranges. kubelet rewrites its Node's status
//! every few minutes; such a change that moves none of these publishes
//! nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use ipnet::IpNet;
use konnectivity_kube::KubeClient;
use konnectivity_kube::node::{Node, NodeName, all_nodes};
use konnectivity_kube::reflector::{ReflectError, Reflected, Reflector};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What admission reads of one Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct NodeFacts {
    pub(crate) uid: String,
    /// InternalIP and ExternalIP addresses.
    pub(crate) ips: BTreeSet<IpAddr>,
    /// Hostname addresses, and the Node's name.
    pub(crate) hostnames: BTreeSet<String>,
    /// `spec.podCIDRs` (or `podCIDR`) that parse.
    pub(crate) pod_cidrs: Vec<IpNet>,
}

impl NodeFacts {
    fn of(node: &Node) -> NodeFacts {
        let mut hostnames: BTreeSet<String> = node.hostnames().map(str::to_owned).collect();
        hostnames.insert(node.metadata.name.clone());
        NodeFacts {
            uid: node.metadata.uid.clone(),
            ips: node.ips().collect(),
            hostnames,
            pod_cidrs: node
                .pod_cidrs()
                .filter_map(|cidr| cidr.parse::<IpNet>().ok())
                .map(|cidr| cidr.trunc())
                .collect(),
        }
    }
}

/// Every Node's facts, by name.
pub(crate) type NodeMap = BTreeMap<NodeName, Arc<NodeFacts>>;

/// The Nodes as last listed or watched: `None` until the first list.
pub(crate) type Published = Option<Arc<NodeMap>>;

/// The server's view of the Nodes.
pub(crate) struct NodeDirectory {
    client: Arc<KubeClient>,
    published: watch::Sender<Published>,
    /// The list-then-watch task, once started.
    follower: OnceLock<JoinHandle<()>>,
}

impl Drop for NodeDirectory {
    fn drop(&mut self) {
        if let Some(task) = self.follower.get() {
            task.abort();
        }
    }
}

impl NodeDirectory {
    pub(crate) fn new(client: Arc<KubeClient>) -> NodeDirectory {
        NodeDirectory {
            client,
            published: watch::Sender::new(None),
            follower: OnceLock::new(),
        }
    }

    /// The Nodes, kept current; starts following them on first use.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Published> {
        self.follower.get_or_init(|| {
            tracing::info!(kube_apiserver = %self.client.server(), "following Nodes, to admit only the identifiers an agent's node has");
            tokio::spawn(follow(self.client.clone(), self.published.clone()))
        });
        self.published.subscribe()
    }
}

/// Lists and watches the Nodes for as long as the server runs, publishing
/// each change of what admission reads.
async fn follow(client: Arc<KubeClient>, published: watch::Sender<Published>) {
    let mut nodes = Reflector::<Node>::new(client, all_nodes(), Box::new(|_, _, _| {}));
    let mut failing = false;
    loop {
        match nodes.next().await {
            Ok(learned) => {
                if failing {
                    tracing::info!("kube-apiserver answers again: following Nodes");
                    failing = false;
                }
                published.send_if_modified(|published| apply(published, learned));
            }
            Err(error) => {
                if !failing {
                    let forbidden = matches!(&error, ReflectError::Kube(kube) if kube.is_status(http::StatusCode::FORBIDDEN));
                    let hint = if forbidden {
                        "; the server's account needs get, list and watch on nodes \
                         (or --agent-identifiers-check=off)"
                    } else {
                        ""
                    };
                    tracing::warn!(%error, "cannot list or watch Nodes; agents' routes stay as they are{hint}");
                }
                failing = true;
            }
        }
    }
}

/// Which Nodes' facts differ between two publications.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Moved {
    /// The Nodes were not listed before: every node may have changed.
    All,
    Some(BTreeSet<NodeName>),
}

impl Moved {
    pub(crate) fn contains(&self, node: &NodeName) -> bool {
        match self {
            Moved::All => true,
            Moved::Some(moved) => moved.contains(node),
        }
    }
}

/// The Nodes added, removed or changed from `before` to `after`: only their
/// agents are judged again, so a Node joining a cluster of thousands costs
/// a lookup per agent, not a judgement. A Node not changed keeps its `Arc`,
/// so the comparison is mostly of pointers.
pub(crate) fn moved(before: Option<&NodeMap>, after: Option<&NodeMap>) -> Moved {
    let (Some(before), Some(after)) = (before, after) else {
        return Moved::All;
    };
    let differs = |a: &Arc<NodeFacts>, b: &Arc<NodeFacts>| !Arc::ptr_eq(a, b) && a != b;
    let mut moved: BTreeSet<NodeName> = after
        .iter()
        .filter(|(name, facts)| before.get(*name).is_none_or(|old| differs(old, facts)))
        .map(|(name, _)| name.clone())
        .collect();
    moved.extend(before.keys().filter(|name| !after.contains_key(*name)).cloned());
    Moved::Some(moved)
}

/// Applies what was learned; whether anything admission reads changed.
fn apply(published: &mut Published, learned: Reflected<Node>) -> bool {
    let facts = |node: &Node| (node.name(), Arc::new(NodeFacts::of(node)));
    match learned {
        Reflected::Listed(items) => {
            let listed: NodeMap = items.iter().map(facts).collect();
            let changed = published.as_deref() != Some(&listed);
            *published = Some(Arc::new(listed));
            changed
        }
        Reflected::Applied(node) => {
            let map = Arc::make_mut(published.get_or_insert_with(Default::default));
            let (name, facts) = facts(&node);
            match map.get(&name) {
                Some(known) if *known == facts => false,
                _ => {
                    map.insert(name, facts);
                    true
                }
            }
        }
        Reflected::Deleted(node) => published
            .as_mut()
            .is_some_and(|map| Arc::make_mut(map).remove(&node.name()).is_some()),
        Reflected::Answered => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, ip: &str, cidr: &str) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "1"},
            "spec": {"podCIDRs": [cidr]},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}], "conditions": []},
        }))
        .unwrap()
    }

    #[test]
    fn only_changes_of_what_admission_reads_are_published() {
        let mut published: Published = None;
        assert!(apply(
            &mut published,
            Reflected::Listed(vec![node("a", "10.0.0.1", "10.1.0.0/24")])
        ));
        // The same facts again (a status heartbeat): nothing to publish.
        let mut heartbeat = node("a", "10.0.0.1", "10.1.0.0/24");
        heartbeat.metadata.resource_version = "2".to_owned();
        assert!(!apply(&mut published, Reflected::Applied(heartbeat)));
        assert!(!apply(&mut published, Reflected::Answered));
        // A new address is published.
        assert!(apply(
            &mut published,
            Reflected::Applied(node("a", "10.0.0.9", "10.1.0.0/24"))
        ));
        let map = published.clone().unwrap();
        let a = &map[&NodeName("a".to_owned())];
        assert_eq!(a.ips, BTreeSet::from(["10.0.0.9".parse().unwrap()]));
        assert!(
            a.hostnames.contains("a"),
            "a Node's name is one of its host names"
        );
        // Deleting an unknown Node changes nothing; a known one does.
        assert!(!apply(
            &mut published,
            Reflected::Deleted(node("b", "10.0.0.2", "10.2.0.0/24"))
        ));
        assert!(apply(
            &mut published,
            Reflected::Deleted(node("a", "10.0.0.9", "10.1.0.0/24"))
        ));
        assert!(published.unwrap().is_empty());
    }

    #[test]
    fn only_the_nodes_that_changed_are_judged_again() {
        let listed: Published = None;
        let mut published = listed.clone();
        apply(
            &mut published,
            Reflected::Listed(vec![
                node("a", "10.0.0.1", "10.1.0.0/24"),
                node("b", "10.0.0.2", "10.2.0.0/24"),
            ]),
        );
        assert_eq!(moved(listed.as_deref(), published.as_deref()), Moved::All);
        let names =
            |list: &[&str]| Moved::Some(list.iter().map(|name| NodeName((*name).to_owned())).collect());
        let before = published.clone();
        apply(
            &mut published,
            Reflected::Applied(node("c", "10.0.0.3", "10.3.0.0/24")),
        );
        assert_eq!(moved(before.as_deref(), published.as_deref()), names(&["c"]));
        let before = published.clone();
        apply(
            &mut published,
            Reflected::Applied(node("a", "10.0.0.9", "10.1.0.0/24")),
        );
        apply(
            &mut published,
            Reflected::Deleted(node("b", "10.0.0.2", "10.2.0.0/24")),
        );
        assert_eq!(moved(before.as_deref(), published.as_deref()), names(&["a", "b"]));
        // A list that finds what was known moves nothing.
        let before = published.clone();
        apply(
            &mut published,
            Reflected::Listed(vec![
                node("a", "10.0.0.9", "10.1.0.0/24"),
                node("c", "10.0.0.3", "10.3.0.0/24"),
            ]),
        );
        assert_eq!(moved(before.as_deref(), published.as_deref()), names(&[]));
    }
}
