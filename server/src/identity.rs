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
//!
//! [`judge`] then keeps of its claims only what its node has, by the Node
//! object ([`crate::nodes`]): an ipv4, ipv6 or host claim must be one of the
//! Node's InternalIP/ExternalIP addresses or host names (its Hostname
//! addresses and its name), a cidr claim must lie within one of its pod
//! ranges, and default-route is for agents on the nodes the operator names
//! (`--default-route-nodes`).

use std::net::IpAddr;

use ipnet::IpNet;
use konnectivity_kube::node::NodeName;
use konnectivity_proto::AgentIdentifiers;

use crate::nodes::{NodeFacts, NodeMap};
use crate::token_auth::BoundNode;

/// What is checked of an agent stream's claims for as long as it lives
/// ([`crate::admission`]).
#[derive(Debug)]
pub struct Binding {
    pub(crate) node: ProvenNode,
    pub(crate) claimed: AgentIdentifiers,
    /// The last verdict on each claim: a change of the Nodes logs and
    /// counts only the claims whose verdict changed.
    pub(crate) judged: std::sync::Mutex<Vec<(Claim, Verdict)>>,
}

/// `--agent-identifiers-check`: what happens to an agent's claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentifiersCheck {
    /// Claims the agent's node does not have are dropped (the agent keeps
    /// the rest); an agent whose credential names no node keeps its claims,
    /// as with upstream, and the log and a metric say so.
    Drop,
    /// A stream with any claim its node does not have, or whose credential
    /// names no node, is refused.
    Strict,
    /// Upstream's behaviour: every claim is taken as made.
    Off,
}

impl std::str::FromStr for IdentifiersCheck {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "drop" => Ok(IdentifiersCheck::Drop),
            "strict" => Ok(IdentifiersCheck::Strict),
            "off" => Ok(IdentifiersCheck::Off),
            other => Err(format!("{other:?} is not drop, strict or off")),
        }
    }
}

/// One identifier an agent claims, as it announced it (`ipv4=10.0.0.1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) key: &'static str,
    pub(crate) value: String,
}

impl std::fmt::Display for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

/// Whether a claim is admitted, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Verdict {
    /// One of the Node's addresses, host names or pod ranges.
    NodeHasIt,
    /// default-route, on a node `--default-route-nodes` names.
    DefaultRouteAllowed,
    /// Not among the Node's addresses, host names or pod ranges.
    NotTheNodes,
    /// default-route, on a node `--default-route-nodes` does not name.
    DefaultRouteNotAllowed,
    /// No Node of the credential's name (deleted, or never there).
    NodeNotFound,
    /// A Node of that name, but not the one the token was issued on (its
    /// uid differs: deleted and created again).
    NodeUidDiffers,
    /// The Nodes have not been listed yet (kube-apiserver unreachable, or
    /// the server may not read them).
    NodesNotListed,
}

impl Verdict {
    pub(crate) fn admitted(self) -> bool {
        matches!(self, Verdict::NodeHasIt | Verdict::DefaultRouteAllowed)
    }

    /// The `reason` label of the metric.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Verdict::NodeHasIt => "node_has_it",
            Verdict::DefaultRouteAllowed => "default_route_allowed",
            Verdict::NotTheNodes => "not_the_nodes",
            Verdict::DefaultRouteNotAllowed => "default_route_not_allowed",
            Verdict::NodeNotFound => "node_not_found",
            Verdict::NodeUidDiffers => "node_uid_differs",
            Verdict::NodesNotListed => "nodes_not_listed",
        }
    }

    /// Why a claim was dropped, for the log.
    pub(crate) fn explain(self) -> &'static str {
        match self {
            Verdict::NodeHasIt | Verdict::DefaultRouteAllowed => "the node has it",
            Verdict::NotTheNodes => "not one of the Node's addresses, host names or pod ranges",
            Verdict::DefaultRouteNotAllowed => "the node is not in --default-route-nodes",
            Verdict::NodeNotFound => "no Node of that name",
            Verdict::NodeUidDiffers => {
                "the Node of that name is not the one the token was issued on (its uid differs)"
            }
            Verdict::NodesNotListed => "the Nodes could not be read yet",
        }
    }
}

/// Every claim of `claimed`, in the order announced.
pub(crate) fn claims(claimed: &AgentIdentifiers) -> Vec<Claim> {
    let each = |key: &'static str, values: &[String]| {
        values
            .iter()
            .map(move |value| Claim {
                key,
                value: value.clone(),
            })
            .collect::<Vec<_>>()
    };
    let mut claims = each("host", &claimed.hosts);
    claims.extend(each("ipv4", &claimed.ipv4));
    claims.extend(each("ipv6", &claimed.ipv6));
    claims.extend(each("cidr", &claimed.cidrs));
    if claimed.default_route {
        claims.push(Claim {
            key: "default-route",
            value: "true".to_owned(),
        });
    }
    claims
}

/// Judges each claim of an agent on `node` against the Nodes (`None`: not
/// listed yet).
pub(crate) fn judge(
    claimed: &AgentIdentifiers,
    node: &ProvenNode,
    nodes: Option<&NodeMap>,
    default_route_nodes: &[NodeName],
) -> Vec<(Claim, Verdict)> {
    let facts = match nodes.map(|nodes| nodes.get(node.name())) {
        None => Err(Verdict::NodesNotListed),
        Some(None) => Err(Verdict::NodeNotFound),
        Some(Some(facts)) => match node {
            ProvenNode::Token(BoundNode { uid: Some(uid), .. }) if *uid != facts.uid => {
                Err(Verdict::NodeUidDiffers)
            }
            _ => Ok(facts),
        },
    };
    claims(claimed)
        .into_iter()
        .map(|claim| {
            let verdict = match &facts {
                Err(verdict) => *verdict,
                Ok(_) if claim.key == "default-route" => {
                    if default_route_nodes.contains(node.name()) {
                        Verdict::DefaultRouteAllowed
                    } else {
                        Verdict::DefaultRouteNotAllowed
                    }
                }
                Ok(facts) if node_has(facts, &claim) => Verdict::NodeHasIt,
                Ok(_) => Verdict::NotTheNodes,
            };
            (claim, verdict)
        })
        .collect()
}

/// Whether the Node has what `claim` claims.
fn node_has(facts: &NodeFacts, claim: &Claim) -> bool {
    let ip = |text: &str| {
        text.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
    };
    match claim.key {
        "ipv4" => ip(&claim.value).is_some_and(|ip| ip.is_ipv4() && facts.ips.contains(&ip)),
        "ipv6" => ip(&claim.value).is_some_and(|ip| ip.is_ipv6() && facts.ips.contains(&ip)),
        "host" => {
            facts.hostnames.contains(&claim.value)
                || ip(&claim.value).is_some_and(|ip| facts.ips.contains(&ip))
        }
        "cidr" => claim
            .value
            .parse::<IpNet>()
            .is_ok_and(|claimed| facts.pod_cidrs.iter().any(|range| range.contains(&claimed))),
        _ => false,
    }
}

/// The identifiers made of the admitted claims.
pub(crate) fn admitted(judged: &[(Claim, Verdict)]) -> AgentIdentifiers {
    let mut identifiers = AgentIdentifiers::default();
    for (claim, _) in judged.iter().filter(|(_, verdict)| verdict.admitted()) {
        let value = claim.value.clone();
        match claim.key {
            "host" => identifiers.hosts.push(value),
            "ipv4" => identifiers.ipv4.push(value),
            "ipv6" => identifiers.ipv6.push(value),
            "cidr" => identifiers.cidrs.push(value),
            _ => identifiers.default_route = true,
        }
    }
    identifiers
}

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
    use std::collections::HashSet;
    use std::sync::Arc;

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

    fn facts(uid: &str, ips: &[&str], hostnames: &[&str], cidrs: &[&str]) -> Arc<NodeFacts> {
        Arc::new(NodeFacts {
            uid: uid.to_owned(),
            ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            hostnames: hostnames.iter().map(|name| (*name).to_owned()).collect(),
            pod_cidrs: cidrs.iter().map(|cidr| cidr.parse().unwrap()).collect(),
        })
    }

    fn token_node(name: &str, uid: Option<&str>) -> ProvenNode {
        ProvenNode::Token(BoundNode {
            name: NodeName(name.to_owned()),
            uid: uid.map(str::to_owned),
        })
    }

    fn verdicts(judged: &[(Claim, Verdict)]) -> Vec<(String, Verdict)> {
        judged
            .iter()
            .map(|(claim, verdict)| (claim.to_string(), *verdict))
            .collect()
    }

    #[test]
    fn an_agent_keeps_only_what_its_node_has() {
        let nodes: NodeMap = [
            (
                NodeName("node-a".to_owned()),
                facts(
                    "uid-a",
                    &["172.18.0.3", "fc00::3"],
                    &["node-a", "node-a.local"],
                    &["10.244.1.0/24"],
                ),
            ),
            (
                NodeName("node-b".to_owned()),
                facts("uid-b", &["172.18.0.4"], &["node-b"], &["10.244.2.0/24"]),
            ),
        ]
        .into_iter()
        .collect();
        let claimed = AgentIdentifiers::parse(
            "host=node-a.local&host=node-b&host=172.18.0.3&ipv4=172.18.0.3&ipv4=172.18.0.4&ipv6=fc00::3\
             &ipv6=fc00::4&cidr=10.244.1.128/25&cidr=10.244.0.0/16&cidr=10.244.2.0/24&default-route=true",
        )
        .unwrap();
        let node_a = token_node("node-a", Some("uid-a"));
        let judged = judge(&claimed, &node_a, Some(&nodes), &[]);
        use Verdict::*;
        assert_eq!(
            verdicts(&judged),
            [
                ("host=node-a.local", NodeHasIt),
                ("host=node-b", NotTheNodes),
                ("host=172.18.0.3", NodeHasIt),
                ("ipv4=172.18.0.3", NodeHasIt),
                ("ipv4=172.18.0.4", NotTheNodes),
                ("ipv6=fc00::3", NodeHasIt),
                ("ipv6=fc00::4", NotTheNodes),
                // Within the pod range; wider than it; another node's.
                ("cidr=10.244.1.128/25", NodeHasIt),
                ("cidr=10.244.0.0/16", NotTheNodes),
                ("cidr=10.244.2.0/24", NotTheNodes),
                ("default-route=true", DefaultRouteNotAllowed),
            ]
            .map(|(claim, verdict)| (claim.to_owned(), verdict))
        );
        let routes = admitted(&judged);
        assert_eq!(
            routes.to_string(),
            "host=node-a.local&host=172.18.0.3&ipv4=172.18.0.3&ipv6=fc00%3A%3A3&cidr=10.244.1.128%2F25"
        );
        // default-route on a node the operator names.
        let judged = judge(&claimed, &node_a, Some(&nodes), &[NodeName("node-a".to_owned())]);
        assert!(admitted(&judged).default_route);
    }

    #[test]
    fn an_unknown_replaced_or_unlisted_node_admits_nothing() {
        let nodes: NodeMap = [(
            NodeName("node-a".to_owned()),
            facts("uid-a", &["172.18.0.3"], &["node-a"], &[]),
        )]
        .into_iter()
        .collect();
        let claimed = AgentIdentifiers::parse("ipv4=172.18.0.3&default-route=true").unwrap();
        let every = |node: &ProvenNode, nodes: Option<&NodeMap>| {
            let judged = judge(&claimed, node, nodes, &[NodeName("node-a".to_owned())]);
            assert_eq!(admitted(&judged), AgentIdentifiers::default());
            let verdicts: HashSet<Verdict> = judged.iter().map(|(_, verdict)| *verdict).collect();
            assert_eq!(verdicts.len(), 1, "{judged:?}");
            verdicts.into_iter().next().unwrap()
        };
        assert_eq!(
            every(&token_node("node-z", None), Some(&nodes)),
            Verdict::NodeNotFound
        );
        // A token issued on an earlier node of the same name.
        assert_eq!(
            every(&token_node("node-a", Some("uid-old")), Some(&nodes)),
            Verdict::NodeUidDiffers
        );
        assert_eq!(
            every(&token_node("node-a", Some("uid-a")), None),
            Verdict::NodesNotListed
        );
        // A certificate names no uid: the name decides.
        let certificate = ProvenNode::Certificate(NodeName("node-a".to_owned()));
        let judged = judge(&claimed, &certificate, Some(&nodes), &[]);
        assert_eq!(admitted(&judged).ipv4, ["172.18.0.3"]);
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
