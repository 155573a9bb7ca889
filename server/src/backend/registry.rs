//! The set of connected agent streams. Touched on connect, disconnect and
//! dial; never on the data path.
//!
//! Control-plane agents and egress agents are kept in separate lists: a
//! dial of either class looks only at the agents that can serve it. At
//! 5,000 nodes a node dial then picks among the few control-plane agents,
//! instead of scanning every node's agent stream twice (it did, and that
//! was 4% of the server's CPU while 50,000 watches opened).

use std::sync::{Arc, RwLock};

use super::Backend;
use super::strategy::{self, Strategy};
use crate::metrics::ServerMetrics;
use crate::policy::FrontendClass;

/// How many agents each configured strategy can choose, and how many
/// control-plane agents serve node clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    pub per_strategy: Vec<(Strategy, usize)>,
    pub control_plane: usize,
}

impl Readiness {
    /// Ready when some dial can be served: any configured strategy has an
    /// agent (upstream looks at the first strategy only, so `destHost,default`
    /// with plain agents reads not ready there), or a control-plane agent
    /// serves node clients.
    pub fn is_ready(&self) -> bool {
        self.control_plane > 0 || self.per_strategy.iter().any(|(_, count)| *count > 0)
    }
}

impl std::fmt::Display for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (strategy, count) in &self.per_strategy {
            write!(f, "{}: {count} agent(s); ", strategy.name())?;
        }
        write!(f, "control plane: {} agent(s)", self.control_plane)
    }
}

pub struct Registry {
    backends: RwLock<Backends>,
    strategies: Vec<Strategy>,
    metrics: Arc<ServerMetrics>,
}

/// The agent streams connected now, by what they serve. A stream's class
/// never changes, and all streams of one agent share it (it follows from
/// the agent's id, `--control-plane-agent-ids`).
#[derive(Default)]
struct Backends {
    /// Serve kube-apiserver's dials, by the configured strategies.
    egress: Vec<Arc<Backend>>,
    /// Serve node dials only.
    control_plane: Vec<Arc<Backend>>,
}

impl Backends {
    fn of_class(&mut self, control_plane: bool) -> &mut Vec<Arc<Backend>> {
        if control_plane {
            &mut self.control_plane
        } else {
            &mut self.egress
        }
    }

    fn len(&self) -> usize {
        self.egress.len() + self.control_plane.len()
    }

    fn iter(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.egress.iter().chain(&self.control_plane)
    }
}

impl Registry {
    pub fn new(strategies: Vec<Strategy>, metrics: Arc<ServerMetrics>) -> Self {
        let registry = Registry {
            backends: RwLock::new(Backends::default()),
            strategies,
            metrics,
        };
        // Every configured strategy shows up at 0 before the first agent.
        registry.publish(&Backends::default());
        registry
    }

    pub fn add(&self, backend: Arc<Backend>) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        let class = backends.of_class(backend.control_plane);
        class.push(backend.clone());
        strategy::mark_oldest(class, &backend.agent_id);
        self.publish(&backends);
    }

    /// Forgets the stream `backend` was added as (if it still is here).
    pub fn remove(&self, backend: &Backend) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        let class = backends.of_class(backend.control_plane);
        let Some(index) = class.iter().position(|b| b.id == backend.id) else {
            return;
        };
        class.remove(index);
        strategy::mark_oldest(class, &backend.agent_id);
        self.publish(&backends);
    }

    /// `backend`'s agent drains it (DRAIN): it is chosen only when every
    /// agent drains, and another stream of the same agent may now be.
    pub fn draining(&self, backend: &Backend) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        backend.set_draining();
        strategy::mark_oldest(backends.of_class(backend.control_plane), &backend.agent_id);
    }

    /// The server is stopping: every agent stream is ended cleanly, so the
    /// agents know their connections will not resume here (docs/resume.md).
    /// Returns how many streams were ended.
    pub fn end_streams(&self) -> usize {
        let backends = self.backends.read().expect("registry lock poisoned");
        for backend in backends.iter() {
            if backend.extensions.resume() {
                backend
                    .outbound
                    .try_send(konnectivity_proto::Frame::StreamEnd.into());
            }
            backend.outbound.close();
        }
        backends.len()
    }

    /// Every agent stream connected now.
    pub(crate) fn snapshot(&self) -> Vec<Arc<Backend>> {
        self.backends
            .read()
            .expect("registry lock poisoned")
            .iter()
            .cloned()
            .collect()
    }

    /// Some agents' identifiers changed: what each strategy can choose is
    /// published again.
    pub(crate) fn routes_changed(&self) {
        self.publish(&self.backends.read().expect("registry lock poisoned"));
    }

    /// Whether no agent stream is connected.
    pub fn is_empty(&self) -> bool {
        self.backends.read().expect("registry lock poisoned").len() == 0
    }

    fn publish(&self, backends: &Backends) {
        self.metrics.ready_backend_connections.set(backends.len() as i64);
        for (strategy, count) in self.readiness_of(backends).per_strategy {
            self.metrics.set_ready_backends(strategy.name(), count);
        }
    }

    /// What the server can serve now, for `/readyz`.
    pub fn readiness(&self) -> Readiness {
        self.readiness_of(&self.backends.read().expect("registry lock poisoned"))
    }

    /// Walks the egress agents once per strategy that looks at their
    /// identifiers; `default` chooses any of them, so needs no walk (this
    /// runs each time a stream comes or goes: 5,000 times at a restart).
    fn readiness_of(&self, backends: &Backends) -> Readiness {
        let egress = &backends.egress;
        Readiness {
            per_strategy: self
                .strategies
                .iter()
                .map(|&strategy| {
                    let count = match strategy {
                        Strategy::Default => egress.len(),
                        _ => egress.iter().filter(|b| strategy.can_choose(b)).count(),
                    };
                    (strategy, count)
                })
                .collect(),
            control_plane: backends.control_plane.len(),
        }
    }

    /// Chooses a backend for a dial to `host` from a frontend of `class`:
    /// node dials go only to control-plane agents (any of them), ordinary
    /// egress never does and follows the configured strategies.
    pub fn select(&self, host: &str, class: FrontendClass) -> Option<Arc<Backend>> {
        let backends = self.backends.read().expect("registry lock poisoned");
        match class {
            FrontendClass::Node => strategy::select(&[Strategy::Default], &backends.control_plane, host),
            FrontendClass::Apiserver => strategy::select(&self.strategies, &backends.egress, host),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Announced, BackendId};

    fn stream(registry: &Registry, id: u64, agent_id: &str, control_plane: bool) -> Arc<Backend> {
        let announced = Announced {
            agent_id: agent_id.to_owned(),
            control_plane,
            ..Announced::default()
        };
        let metrics = Arc::new(ServerMetrics::default());
        let backend = Backend::open(BackendId(id), announced, metrics).0;
        registry.add(backend.clone());
        backend
    }

    fn registry() -> Registry {
        Registry::new(vec![Strategy::Default], Arc::new(ServerMetrics::default()))
    }

    /// Node dials reach control-plane agents only, and kube-apiserver's
    /// dials never do, whichever list a stream was added to first.
    #[test]
    fn each_class_of_dial_is_served_by_its_own_agents_only() {
        let registry = registry();
        assert_eq!(registry.select("x", FrontendClass::Node).map(|b| b.id), None);
        let egress = stream(&registry, 1, "node-a", false);
        assert_eq!(registry.select("x", FrontendClass::Node).map(|b| b.id), None);
        let control_plane = stream(&registry, 2, "cp", true);
        for _ in 0..20 {
            assert_eq!(
                registry.select("x", FrontendClass::Node).unwrap().id,
                control_plane.id
            );
            assert_eq!(
                registry.select("x", FrontendClass::Apiserver).unwrap().id,
                egress.id
            );
        }
        assert_eq!(
            registry.readiness(),
            Readiness {
                per_strategy: vec![(Strategy::Default, 1)],
                control_plane: 1,
            }
        );
        registry.remove(&egress);
        assert_eq!(registry.select("x", FrontendClass::Apiserver).map(|b| b.id), None);
        assert_eq!(
            registry.select("x", FrontendClass::Node).unwrap().id,
            control_plane.id
        );
        registry.remove(&control_plane);
        assert!(registry.is_empty());
    }

    /// An agent's younger stream is not chosen while its oldest serves, and
    /// takes over once the oldest is removed, in the control-plane list too.
    #[test]
    fn a_control_plane_agents_younger_stream_serves_once_the_oldest_is_gone() {
        let registry = registry();
        let oldest = stream(&registry, 3, "cp", true);
        let younger = stream(&registry, 9, "cp", true);
        for _ in 0..20 {
            assert_eq!(registry.select("x", FrontendClass::Node).unwrap().id, oldest.id);
        }
        registry.remove(&oldest);
        assert_eq!(registry.select("x", FrontendClass::Node).unwrap().id, younger.id);
        assert_eq!(registry.snapshot().len(), 1);
    }
}
