//! The set of connected agent streams. Touched on connect, disconnect and
//! dial; never on the data path.

use std::sync::{Arc, RwLock};

use super::strategy::{self, Strategy};
use super::{Backend, BackendId};
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
    backends: RwLock<Vec<Arc<Backend>>>,
    strategies: Vec<Strategy>,
    metrics: Arc<ServerMetrics>,
}

impl Registry {
    pub fn new(strategies: Vec<Strategy>, metrics: Arc<ServerMetrics>) -> Self {
        let registry = Registry {
            backends: RwLock::new(Vec::new()),
            strategies,
            metrics,
        };
        // Every configured strategy shows up at 0 before the first agent.
        registry.publish(&[]);
        registry
    }

    pub fn add(&self, backend: Arc<Backend>) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        let agent_id = backend.agent_id.clone();
        backends.push(backend);
        strategy::mark_oldest(&backends, &agent_id);
        self.publish(&backends);
    }

    pub fn remove(&self, id: BackendId) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        let Some(index) = backends.iter().position(|b| b.id == id) else {
            return;
        };
        let removed = backends.remove(index);
        strategy::mark_oldest(&backends, &removed.agent_id);
        self.publish(&backends);
    }

    /// `backend`'s agent drains it (DRAIN): it is chosen only when every
    /// agent drains, and another stream of the same agent may now be.
    pub fn draining(&self, backend: &Backend) {
        let backends = self.backends.write().expect("registry lock poisoned");
        backend.set_draining();
        strategy::mark_oldest(&backends, &backend.agent_id);
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
        self.backends.read().expect("registry lock poisoned").clone()
    }

    /// Some agents' identifiers changed: what each strategy can choose is
    /// published again.
    pub(crate) fn routes_changed(&self) {
        self.publish(&self.backends.read().expect("registry lock poisoned"));
    }

    /// Whether no agent stream is connected.
    pub fn is_empty(&self) -> bool {
        self.backends.read().expect("registry lock poisoned").is_empty()
    }

    fn publish(&self, backends: &[Arc<Backend>]) {
        self.metrics.ready_backend_connections.set(backends.len() as i64);
        for (strategy, count) in self.readiness_of(backends).per_strategy {
            self.metrics.set_ready_backends(strategy.name(), count);
        }
    }

    /// What the server can serve now, for `/readyz`.
    pub fn readiness(&self) -> Readiness {
        self.readiness_of(&self.backends.read().expect("registry lock poisoned"))
    }

    fn readiness_of(&self, backends: &[Arc<Backend>]) -> Readiness {
        let egress: Vec<&Arc<Backend>> = backends.iter().filter(|b| !b.control_plane).collect();
        Readiness {
            per_strategy: self
                .strategies
                .iter()
                .map(|strategy| {
                    (
                        *strategy,
                        egress.iter().filter(|b| strategy.can_choose(b)).count(),
                    )
                })
                .collect(),
            control_plane: backends.len() - egress.len(),
        }
    }

    /// Chooses a backend for a dial to `host` from a frontend of `class`:
    /// node dials go only to control-plane agents (any of them), ordinary
    /// egress never does and follows the configured strategies.
    pub fn select(&self, host: &str, class: FrontendClass) -> Option<Arc<Backend>> {
        let backends = self.backends.read().expect("registry lock poisoned");
        let eligible = |b: &Backend| b.control_plane == (class == FrontendClass::Node);
        match class {
            FrontendClass::Node => strategy::select(&[Strategy::Default], &backends, eligible, host),
            FrontendClass::Apiserver => strategy::select(&self.strategies, &backends, eligible, host),
        }
    }
}
