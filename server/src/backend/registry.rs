//! The set of connected agent streams. Touched on connect, disconnect and
//! dial; never on the data path.

use std::sync::{Arc, RwLock};

use super::strategy::{self, Strategy};
use super::{Backend, BackendId};
use crate::metrics::ServerMetrics;
use crate::policy::FrontendClass;

pub struct Registry {
    backends: RwLock<Vec<Arc<Backend>>>,
    strategies: Vec<Strategy>,
    metrics: Arc<ServerMetrics>,
}

impl Registry {
    pub fn new(strategies: Vec<Strategy>, metrics: Arc<ServerMetrics>) -> Self {
        Registry {
            backends: RwLock::new(Vec::new()),
            strategies,
            metrics,
        }
    }

    pub fn add(&self, backend: Arc<Backend>) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        backends.push(backend);
        self.metrics.ready_backends.set(backends.len() as i64);
    }

    pub fn remove(&self, id: BackendId) {
        let mut backends = self.backends.write().expect("registry lock poisoned");
        backends.retain(|b| b.id != id);
        self.metrics.ready_backends.set(backends.len() as i64);
    }

    /// Chooses a backend for a dial to `host` from a frontend of `class`:
    /// node dials go only to control-plane agents (any of them), ordinary
    /// egress never does and follows the configured strategies.
    pub fn select(&self, host: &str, class: FrontendClass) -> Option<Arc<Backend>> {
        let backends = self.backends.read().expect("registry lock poisoned");
        let eligible: Vec<Arc<Backend>> = backends
            .iter()
            .filter(|b| b.control_plane == (class == FrontendClass::Node))
            .cloned()
            .collect();
        match class {
            FrontendClass::Node => strategy::select(&[Strategy::Default], &eligible, host),
            FrontendClass::Apiserver => strategy::select(&self.strategies, &eligible, host),
        }
    }

    pub fn len(&self) -> usize {
        self.backends.read().expect("registry lock poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
