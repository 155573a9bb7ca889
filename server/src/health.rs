//! The server's health listener: `/healthz`, `/readyz`, `/ready`, `/metrics`.

use std::sync::Arc;

use http::StatusCode;
use konnectivity_plumbing::http::{Endpoints, Reply};
use konnectivity_plumbing::metrics;

use crate::backend::registry::Registry;
use crate::metrics::ServerMetrics;

pub struct ServerEndpoints {
    pub registry: Arc<Registry>,
    pub metrics: Arc<ServerMetrics>,
}

impl Endpoints for ServerEndpoints {
    fn reply(&self, path: &str) -> Reply {
        match path {
            "/healthz" => Reply::text(StatusCode::OK, "ok"),
            // Upstream answers "not ready" with 500.
            "/readyz" | "/ready" => match self.registry.len() {
                0 => Reply::text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "not ready: no agent is connected\n",
                ),
                n => Reply::text(StatusCode::OK, format!("ok: {n} agent stream(s) connected\n")),
            },
            "/metrics" => metrics::reply(&self.metrics.registry, &self.metrics.alive_tasks),
            _ => Reply::not_found(),
        }
    }
}
