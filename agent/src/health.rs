//! The agent's health listener: `/healthz`, `/readyz`, `/metrics`.

use std::sync::Arc;

use http::StatusCode;
use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_telemetry::http::{Endpoints, Reply};
use konnectivity_telemetry::metrics;

use crate::metrics::AgentMetrics;
use konnectivity_node::readiness::NodeReadiness;

pub(crate) struct AgentEndpoints {
    pub metrics: Arc<AgentMetrics>,
    /// Signalled by the first SIGTERM: the agent drains.
    pub drain: Watcher,
    /// Set when the node role runs: ready needs its rules and tunnel too.
    pub node_readiness: Option<Arc<NodeReadiness>>,
}

impl Endpoints for AgentEndpoints {
    fn reply(&self, path: &str) -> Reply {
        match path {
            "/healthz" => Reply::text(StatusCode::OK, "ok"),
            // Upstream answers "not ready" with 503.
            "/readyz" => {
                if self.drain.is_signaled() {
                    Reply::text(StatusCode::SERVICE_UNAVAILABLE, "not ready: draining\n")
                } else if self
                    .node_readiness
                    .as_ref()
                    .is_some_and(|node| node.successor_waiting.load(std::sync::atomic::Ordering::Relaxed))
                {
                    Reply::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: a newer agent is taking the node role over\n",
                    )
                } else if let Some(node) = self.node_readiness.as_ref().filter(|node| !node.is_ready()) {
                    Reply::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {}\n", node.problem()),
                    )
                } else if self.metrics.open_server_connections.get() == 0 {
                    Reply::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: no connection to any proxy-server\n",
                    )
                } else {
                    Reply::text(StatusCode::OK, "ok")
                }
            }
            "/metrics" => metrics::reply(
                &self.metrics.registry,
                &self.metrics.alive_tasks,
                &self.metrics.heap_bytes,
            ),
            _ => Reply::not_found(),
        }
    }
}
