//! Which node an agent runs on, as its credential proves it (issue: an
//! agent serves only its own node; docs/security.md).
//!
//! An agent's identifiers (`--agent-identifiers`) are whatever it says; its
//! credential is not. Two credentials name a node:
//! - a bound ServiceAccount token (a DaemonSet pod's projected token,
//!   Kubernetes 1.30 and later): its TokenReview carries
//!   `authentication.kubernetes.io/node-name` and `node-uid`
//!   ([`crate::token_auth`]);
//! - a client certificate whose subject common name is `system:node:NAME`,
//!   the form kubelet's own client certificates take.
//!
//! An agent whose credential names no node (a certificate shared by every
//! agent, a cluster before 1.30) proves none.

use konnectivity_kube::node::NodeName;

use crate::token_auth::BoundNode;

/// The prefix of a node's name in a client certificate's common name, as
/// kubelet's client certificates carry it.
const NODE_CERTIFICATE_PREFIX: &str = "system:node:";

/// The node an agent's credential names, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ProvenNode {
    /// A bound token's review named it.
    Token(BoundNode),
    /// The client certificate's `system:node:NAME`.
    Certificate(NodeName),
}

impl ProvenNode {
    /// The node an agent's credential proves: the token's, when it was
    /// admitted by a bound token, else the certificate's; `None` when
    /// neither names one.
    pub(crate) fn of(token_node: Option<&BoundNode>, certificate_names: &[String]) -> Option<ProvenNode> {
        match token_node {
            Some(bound) => Some(ProvenNode::Token(bound.clone())),
            None => certificate_node(certificate_names).map(ProvenNode::Certificate),
        }
    }

    pub(crate) fn name(&self) -> &NodeName {
        match self {
            ProvenNode::Token(bound) => &bound.name,
            ProvenNode::Certificate(name) => name,
        }
    }
}

/// The node a client certificate's names name: exactly one name of the form
/// `system:node:NAME` (two would be ambiguous, and prove neither).
pub(crate) fn certificate_node(names: &[String]) -> Option<NodeName> {
    let mut nodes = names
        .iter()
        .filter_map(|name| name.strip_prefix(NODE_CERTIFICATE_PREFIX))
        .filter(|node| !node.is_empty());
    match (nodes.next(), nodes.next()) {
        (Some(node), None) => Some(NodeName(node.to_owned())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|name| (*name).to_owned()).collect()
    }

    #[test]
    fn a_certificate_names_its_node_as_kubelets_do() {
        let node = |list: &[&str]| certificate_node(&names(list));
        assert_eq!(node(&["system:node:node-a"]), Some(NodeName("node-a".to_owned())));
        assert_eq!(
            node(&["system:node:node-a", "konnectivity-agent.kube-system.svc"]),
            Some(NodeName("node-a".to_owned()))
        );
        // No node, an empty one, or two: none proven.
        assert_eq!(node(&["konnectivity-agent"]), None);
        assert_eq!(node(&["system:node:"]), None);
        assert_eq!(node(&["system:node:a", "system:node:b"]), None);
        // Only the exact prefix: not a group, not a look-alike.
        assert_eq!(node(&["system:nodes", "system:node-a"]), None);
    }

    #[test]
    fn a_bound_token_names_the_node_before_a_certificate() {
        let bound = BoundNode {
            name: NodeName("from-token".to_owned()),
            uid: None,
        };
        let certificate = names(&["system:node:from-certificate"]);
        let proven = ProvenNode::of(Some(&bound), &certificate).unwrap();
        assert_eq!(proven.name().0, "from-token");
        let proven = ProvenNode::of(None, &certificate).unwrap();
        assert_eq!(
            proven,
            ProvenNode::Certificate(NodeName("from-certificate".to_owned()))
        );
        assert_eq!(ProvenNode::of(None, &names(&["agent"])), None);
    }
}
