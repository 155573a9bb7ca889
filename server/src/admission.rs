//! Admitting an agent's identifiers (`--agent-identifiers-check`): with the
//! destHost strategy, whoever claims a node's address receives
//! kube-apiserver's dials to that node (exec, logs, port-forward, webhooks).
//! An agent keeps only the claims its node has, as its credential proves the
//! node ([`crate::identity`]) and the Node object says ([`crate::nodes`]);
//! when the Node changes (an address moves, the Node is deleted) the routes
//! follow within a watch event.
//!
//! Control-plane agents are not judged: they serve node clients only, by
//! role (`--control-plane-agent-ids`, bound to their certificates), and
//! their identifiers route nothing.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use konnectivity_kube::KubeClient;
use konnectivity_kube::node::NodeName;
use konnectivity_proto::AgentIdentifiers;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::Status;

use crate::backend::Backend;
use crate::backend::registry::Registry;
use crate::identity::{Binding, Claim, IdentifiersCheck, ProvenNode, Verdict, admitted, claims, judge};
use crate::metrics::ServerMetrics;
use crate::nodes::{NodeDirectory, Published, moved};

/// How long a stream waits for the first list of Nodes before its claims
/// are judged without it (dropped; strict: refused).
const FIRST_LIST_WAIT: Duration = Duration::from_secs(5);
/// How many agents' "names no node" notices are remembered, so that each
/// agent is told of once without the set growing without bound.
const TOLD_AGENTS: usize = 65_536;

/// A stream's admitted identifiers.
pub(crate) struct Admitted {
    pub(crate) identifiers: AgentIdentifiers,
    pub(crate) binding: Option<Arc<Binding>>,
    /// The Nodes as judged: if they change before the stream is registered,
    /// [`Admission::registered`] judges again.
    seen: Option<watch::Receiver<Published>>,
}

pub(crate) struct Admission {
    check: IdentifiersCheck,
    /// `None`: the server has no kube-apiserver to read Nodes from.
    nodes: Option<NodeDirectory>,
    default_route_nodes: Vec<NodeName>,
    registry: Arc<Registry>,
    metrics: Arc<ServerMetrics>,
    /// Agents told of once: their credential names no node.
    told: Mutex<HashSet<String>>,
    /// Judges every bound stream again when the Nodes change.
    rebinder: OnceLock<JoinHandle<()>>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(task) = self.rebinder.get() {
            task.abort();
        }
    }
}

impl Admission {
    pub(crate) fn new(
        check: IdentifiersCheck,
        kube: Option<Arc<KubeClient>>,
        default_route_nodes: Vec<NodeName>,
        registry: Arc<Registry>,
        metrics: Arc<ServerMetrics>,
    ) -> Arc<Admission> {
        let nodes = match check {
            IdentifiersCheck::Off => None,
            _ => kube.map(NodeDirectory::new),
        };
        Arc::new(Admission {
            check,
            nodes,
            default_route_nodes,
            registry,
            metrics,
            told: Mutex::new(HashSet::new()),
            rebinder: OnceLock::new(),
        })
    }

    /// Judges a new stream's claims; `Err` refuses the stream (strict).
    pub(crate) async fn admit(
        self: &Arc<Self>,
        agent_id: &str,
        claimed: AgentIdentifiers,
        node: Option<ProvenNode>,
        control_plane: bool,
    ) -> Result<Admitted, Status> {
        let unchecked = |identifiers| Admitted {
            identifiers,
            binding: None,
            seen: None,
        };
        if control_plane {
            return Ok(unchecked(claimed));
        }
        if self.check == IdentifiersCheck::Off {
            self.count_unchecked(&claimed, "check_off");
            return Ok(unchecked(claimed));
        }
        let Some(node) = node else {
            if self.check == IdentifiersCheck::Strict {
                self.count_claims(&claimed, "refused", "no_node_in_credential");
                return Err(Status::permission_denied(format!(
                    "agent {agent_id:?}: its credential names no node (a bound ServiceAccount token of \
                     Kubernetes 1.30 or later, or a client certificate whose subject is system:node:NAME), \
                     and --agent-identifiers-check=strict admits only identifiers a node proves"
                )));
            }
            self.count_unchecked(&claimed, "no_node_in_credential");
            if self.tell_once(agent_id) {
                tracing::info!(%agent_id, identifiers = %claimed, "the agent's credential names no node: its identifiers are taken as claimed, as upstream does (--agent-identifiers-check)");
            }
            return Ok(unchecked(claimed));
        };
        // A node, and nothing claimed: nothing to judge, no Node to wait for.
        if claims(&claimed).is_empty() {
            return Ok(unchecked(claimed));
        }
        let Some(directory) = &self.nodes else {
            // Strict needs a kube-apiserver: the configuration refuses it.
            self.count_unchecked(&claimed, "nodes_unreadable");
            if self.tell_once(agent_id) {
                tracing::warn!(%agent_id, node = %node.name(), identifiers = %claimed, "the agent's credential names its node, but this server reads no Nodes (no --kubeconfig, not in a pod): its identifiers are taken as claimed");
            }
            return Ok(unchecked(claimed));
        };
        let mut seen = directory.subscribe();
        self.start_rebinder(&seen);
        let _ = tokio::time::timeout(FIRST_LIST_WAIT, seen.wait_for(Option::is_some)).await;
        let judged = judge(
            &claimed,
            &node,
            seen.borrow_and_update().as_deref(),
            &self.default_route_nodes,
        );
        if self.check == IdentifiersCheck::Strict {
            let refused: Vec<String> = judged
                .iter()
                .filter(|(_, verdict)| !verdict.admitted())
                .map(|(claim, verdict)| format!("{claim} ({})", verdict.explain()))
                .collect();
            if !refused.is_empty() {
                for (_, verdict) in &judged {
                    self.metrics.identifier_claim("refused", verdict.reason());
                }
                let message = format!(
                    "agent {agent_id:?} on node {}: --agent-identifiers-check=strict refuses identifiers its \
                     node does not have: {}",
                    node.name(),
                    refused.join(", ")
                );
                let unlisted = judged
                    .iter()
                    .any(|(_, verdict)| *verdict == Verdict::NodesNotListed);
                return Err(if unlisted {
                    Status::unavailable(message)
                } else {
                    Status::permission_denied(message)
                });
            }
        }
        for (claim, verdict) in &judged {
            self.tell(agent_id, &node, claim, *verdict, None);
        }
        Ok(Admitted {
            identifiers: admitted(&judged),
            binding: Some(Arc::new(Binding {
                node,
                claimed,
                judged: Mutex::new(judged),
            })),
            seen: Some(seen),
        })
    }

    /// The stream is in the registry: if the Nodes changed since its claims
    /// were judged, the rebinder may have missed it; judge it again.
    pub(crate) fn registered(&self, backend: &Backend, seen: Option<watch::Receiver<Published>>) {
        if let Some(mut seen) = seen
            && seen.has_changed().unwrap_or(false)
        {
            let nodes = seen.borrow_and_update().clone();
            if self.rejudge(backend, nodes.as_deref()) {
                self.registry.routes_changed();
            }
        }
    }

    fn start_rebinder(self: &Arc<Self>, seen: &watch::Receiver<Published>) {
        self.rebinder.get_or_init(|| {
            let mut changes = seen.clone();
            let admission = Arc::downgrade(self);
            tokio::spawn(async move {
                // What the last round judged against; the first round judges
                // every bound stream.
                let mut last: Published = None;
                while changes.changed().await.is_ok() {
                    let nodes = changes.borrow_and_update().clone();
                    let moved = moved(last.as_deref(), nodes.as_deref());
                    last = nodes.clone();
                    let Some(admission) = admission.upgrade() else {
                        return;
                    };
                    let mut changed = false;
                    for backend in admission.registry.snapshot() {
                        let bound_to_moved = |binding: &Binding| moved.contains(binding.node.name());
                        if backend.binding.as_deref().is_some_and(bound_to_moved) {
                            changed |= admission.rejudge(&backend, nodes.as_deref());
                        }
                    }
                    if changed {
                        admission.registry.routes_changed();
                    }
                }
            })
        });
    }

    /// Judges a bound stream's claims against `nodes`; whether its routes
    /// changed.
    fn rejudge(&self, backend: &Backend, nodes: Option<&crate::nodes::NodeMap>) -> bool {
        let Some(binding) = &backend.binding else {
            return false;
        };
        let judged = judge(&binding.claimed, &binding.node, nodes, &self.default_route_nodes);
        let mut last = binding.judged.lock().expect("judged lock poisoned");
        if *last == judged {
            return false;
        }
        for ((claim, verdict), (_, before)) in judged.iter().zip(last.iter()) {
            if verdict != before {
                self.tell(&backend.agent_id, &binding.node, claim, *verdict, Some(*before));
            }
        }
        let routes = admitted(&judged);
        *last = judged;
        drop(last);
        tracing::info!(agent_id = %backend.agent_id, node = %binding.node.name(), identifiers = %routes, "the agent's node changed: it now serves these identifiers");
        backend.set_identifiers(routes);
        true
    }

    /// Logs and counts a verdict on one claim (`before`: the claim's last
    /// verdict, when it changed).
    fn tell(
        &self,
        agent_id: &str,
        node: &ProvenNode,
        claim: &Claim,
        verdict: Verdict,
        before: Option<Verdict>,
    ) {
        let outcome = if verdict.admitted() { "admitted" } else { "dropped" };
        self.metrics.identifier_claim(outcome, verdict.reason());
        if !verdict.admitted() {
            tracing::warn!(%agent_id, node = %node.name(), identifier = %claim, reason = verdict.explain(), "dropped an identifier the agent's node does not have: no dial to it goes to this agent");
        } else if before.is_some() {
            tracing::info!(%agent_id, node = %node.name(), identifier = %claim, "admitted an identifier the agent's node now has");
        }
    }

    fn count_unchecked(&self, claimed: &AgentIdentifiers, reason: &'static str) {
        self.count_claims(claimed, "unchecked", reason);
    }

    fn count_claims(&self, claimed: &AgentIdentifiers, outcome: &'static str, reason: &'static str) {
        for _ in claims(claimed) {
            self.metrics.identifier_claim(outcome, reason);
        }
    }

    /// Whether `agent_id` is told of for the first time.
    fn tell_once(&self, agent_id: &str) -> bool {
        let mut told = self.told.lock().expect("told lock poisoned");
        if told.contains(agent_id) {
            return false;
        }
        if told.len() < TOLD_AGENTS {
            told.insert(agent_id.to_owned());
        }
        true
    }
}

impl Admitted {
    /// What [`Admission::registered`] needs once the stream is registered.
    pub(crate) fn take_seen(&mut self) -> Option<watch::Receiver<Published>> {
        self.seen.take()
    }
}
