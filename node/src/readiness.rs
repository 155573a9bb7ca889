//! Whether the node role is ready: rules installed and the node tunnel
//! answering, and whether a newer agent took it over.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::metrics::NodeMetrics;

/// Readiness of the node role: rules installed and the tunnel answering.
#[derive(Default)]
pub struct NodeReadiness {
    pub rules_installed: AtomicBool,
    pub tunnel_connected: AtomicBool,
    /// Why the tunnel is not answering, for `/readyz`.
    tunnel_problem: std::sync::Mutex<String>,
    /// Set once a newer agent took the node role over.
    handed_over: tokio::sync::watch::Sender<bool>,
    /// Set while a newer agent waits to take over. Both agents' pods are
    /// probed on the one health listener, this agent's until then: /readyz
    /// says "not ready" meanwhile, so that the new pod is not taken for
    /// ready (and this one deleted) before the new agent holds the role.
    pub successor_waiting: AtomicBool,
}

impl NodeReadiness {
    pub fn is_ready(&self) -> bool {
        self.rules_installed.load(Ordering::Relaxed)
            && self.tunnel_connected.load(Ordering::Relaxed)
            && !self.is_handed_over()
    }

    /// Whether a newer agent took the node role over.
    pub fn is_handed_over(&self) -> bool {
        *self.handed_over.borrow()
    }

    /// Says that a newer agent took the node role over.
    pub(crate) fn set_handed_over(&self) {
        self.handed_over.send_replace(true);
    }

    /// Resolves once a newer agent took the node role over.
    pub async fn handed_over(&self) {
        let _ = self.handed_over.subscribe().wait_for(|handed| *handed).await;
    }

    /// What is missing, in words, when not ready.
    pub fn problem(&self) -> String {
        if self.is_handed_over() {
            return "handed over to a newer agent".to_owned();
        }
        if !self.rules_installed.load(Ordering::Relaxed) {
            return "capture rules not installed yet".to_owned();
        }
        let problem = self
            .tunnel_problem
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if problem.is_empty() {
            "node tunnel not connected yet".to_owned()
        } else {
            format!("node tunnel down: {problem}")
        }
    }

    pub(crate) fn tunnel_answered(&self, metrics: &NodeMetrics) {
        self.tunnel_connected.store(true, Ordering::Relaxed);
        metrics.node_tunnel_up.set(1);
    }

    pub(crate) fn tunnel_failed(&self, problem: String, metrics: &NodeMetrics) {
        *self
            .tunnel_problem
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = problem;
        self.tunnel_connected.store(false, Ordering::Relaxed);
        metrics.node_tunnel_up.set(0);
    }
}
