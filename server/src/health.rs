//! The server's health listener: `/healthz`, `/readyz`, `/ready`, `/metrics`.

use std::sync::Arc;

use http::StatusCode;
use konnectivity_telemetry::http::{Endpoints, Reply};
use konnectivity_telemetry::metrics;

use crate::backend::registry::Registry;
use crate::metrics::ServerMetrics;

pub(crate) struct ServerEndpoints {
    pub registry: Arc<Registry>,
    pub metrics: Arc<ServerMetrics>,
}

impl Endpoints for ServerEndpoints {
    fn reply(&self, path: &str) -> Reply {
        match path {
            "/healthz" => Reply::text(StatusCode::OK, "ok"),
            // Upstream answers "not ready" with 500.
            "/readyz" | "/ready" => {
                let readiness = self.registry.readiness();
                if readiness.is_ready() {
                    Reply::text(StatusCode::OK, format!("ok: {readiness}\n"))
                } else {
                    Reply::text(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("not ready: no strategy has an agent to choose ({readiness})\n"),
                    )
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
