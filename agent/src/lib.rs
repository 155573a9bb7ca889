//! proxy-agent: holds a stream to the proxy-server and serves its dials.
//!
//! Reading order: [`config`] (flags), [`server_conn`] (opening a stream),
//! [`session`] (serving one stream), [`endpoint`] (the TCP connections
//! opened for the server), [`health`] and [`metrics`].

pub mod capture;
pub mod cni;
pub mod config;
mod endpoint;
mod health;
mod leases;
mod metrics;
pub mod programs;
mod server_conn;
mod servers;
mod session;

/// What the fuzz targets reach inside the agent: a server stream's session
/// and the capture map's parser. Not an API: only with the `test-hooks`
/// feature, which the binary is never built with.
#[cfg(feature = "test-hooks")]
pub mod hooks {
    pub use crate::capture::map::Capture;
    pub use crate::metrics::AgentMetrics;
    pub use crate::session::SessionSettings;

    /// A server stream's session.
    pub mod session {
        pub use crate::session::run;
    }
}

use std::sync::Arc;
use std::time::Duration;

use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_plumbing::tls::{self, TlsError};

use crate::capture::{CaptureError, NodeReadiness, NodeSettings};
use crate::config::Config;
use crate::health::AgentEndpoints;
use crate::metrics::AgentMetrics;
use crate::server_conn::ServerTarget;
use crate::session::SessionSettings;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot listen on {addr} for the health server (--health-server-port): {source}")]
    HealthBind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// Reconnection backoff as upstream's: start at --sync-interval, grow ×1.5
/// per failure, never beyond --sync-interval-cap.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, cap: Duration) -> Self {
        Backoff {
            initial,
            cap,
            next: initial,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.mul_f64(1.5).min(self.cap);
        delay
    }

    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Runs the agent until the task is dropped. Once `drain` is signalled,
/// every server stream sends DRAIN, so servers stop choosing this agent, and
/// /readyz answers 503.
pub async fn run(config: Config, drain: Watcher) -> Result<(), AgentError> {
    let metrics = Arc::new(AgentMetrics::default());
    let health = tokio::net::TcpListener::bind(config.health_addr)
        .await
        .map_err(|source| AgentError::HealthBind {
            addr: config.health_addr,
            source,
        })?;
    let node_readiness = config.node.as_ref().map(|_| Arc::new(NodeReadiness::default()));
    let endpoints = Arc::new(AgentEndpoints {
        metrics: metrics.clone(),
        drain: drain.clone(),
        node_readiness: node_readiness.clone(),
    });
    let _health = AbortOnDrop(tokio::spawn(konnectivity_plumbing::http::serve(
        health, endpoints,
    )));

    let alpn: Vec<&[u8]> = config.alpn.iter().map(|proto| proto.as_bytes()).collect();
    let tls = tls::client_config(config.ca_cert.as_ref(), config.identity.as_ref(), &alpn)?;
    let target = ServerTarget {
        host: config.server_host.clone(),
        port: config.server_port,
        tls: Arc::new(tls),
        agent_id: config.agent_id.clone(),
        identifiers: config.identifiers.clone(),
        mark: config.node.as_ref().map(|node| node.mark),
        keepalive: config.keepalive,
        token_path: config.token_path.clone(),
        resolved: None,
    };
    let settings = SessionSettings {
        dial_timeout: config.dial_timeout,
        endpoint_limit: konnectivity_plumbing::limit::Limit::from_flag(
            "max-endpoint-connections",
            config.max_endpoint_connections,
        ),
        mark: config.node.as_ref().map(|node| node.mark),
    };
    tracing::info!(
        agent_id = %config.agent_id,
        server = %config.server_hosts.iter().map(|a| format!("{}:{}", a.host, a.port)).collect::<Vec<_>>().join(","),
        dial_every_address = config.dial_every_address,
        "proxy-agent started"
    );

    // On a worker thread of its own rather than in the caller's block_on:
    // every packet wakes this task, and workers wake each other cheaply.
    let backoff = Backoff::new(config.sync_interval, config.sync_interval_cap);
    let sync = servers::SyncSettings {
        probe_interval: config.probe_interval,
        sync_forever: config.sync_forever,
        rediscover_every: config.sync_interval_cap,
    };
    // Held for as long as the agent runs: dropping it stops the counting.
    let mut lease_count = None;
    let egress = if config.dial_every_address {
        if config.lease_counting.is_some() {
            tracing::warn!(
                "--count-server-leases is not applied: every server address is dialed directly, whatever the count"
            );
        }
        tokio::spawn(servers::serve_each(
            target,
            config.server_hosts.clone(),
            settings,
            sync,
            metrics.clone(),
            drain,
            backoff,
        ))
    } else {
        lease_count = config
            .lease_counting
            .clone()
            .map(|counting| leases::LeaseCount::start(counting, metrics.clone()));
        let count_source = servers::ServerCountSource {
            max: config.server_count_max,
            leases: lease_count.as_ref().map(leases::LeaseCount::subscribe),
        };
        tokio::spawn(servers::serve(
            target,
            settings,
            sync,
            count_source,
            metrics.clone(),
            drain,
            backoff,
        ))
    };
    let mut egress = AbortOnDrop(egress);
    let _lease_count = lease_count;
    let (Some(node), Some(readiness)) = (&config.node, node_readiness) else {
        let _ = (&mut egress.0).await;
        return Ok(());
    };
    let node_tls = tls::client_config(config.ca_cert.as_ref(), Some(&node.identity), &[b"h2"])?;
    let node_settings = NodeSettings {
        captures: node.captures.clone(),
        capture_port: node.capture_port,
        mark: node.mark,
        server_host: config.server_host.clone(),
        node_frontend_port: node.node_frontend_port,
        tls: Arc::new(node_tls),
        sync_interval: config.sync_interval,
        sync_interval_cap: config.sync_interval_cap,
        cni: node.cni.clone(),
    };
    tokio::select! {
        result = capture::run(node_settings, metrics, readiness) => result.map_err(AgentError::from),
        _ = &mut egress.0 => Ok(()),
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_by_half_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(3));
        let delays: Vec<_> = (0..5).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [1000, 1500, 2250, 3000, 3000]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_secs(1));
    }
}
