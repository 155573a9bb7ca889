//! The node role without capture rules, for the scale run
//! (`konnectivity-bench nodes`): thousands of nodes in one process and one
//! network namespace, where rules could not tell one node's clients from
//! another's. Each node keeps its node tunnel as the agent does, and tunnels
//! every connection its listener accepts to one target: what the REDIRECT
//! rule and the capture map give the agent. From the accept on, it is the
//! agent's code: the same relay, resume and probes.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::capture::listener::{self, CaptureContext};
use crate::capture::map::{CaptureMap, OrigDst};
use crate::handoff::HandOff;
use crate::metrics::NodeMetrics;
use crate::readiness::NodeReadiness;
use crate::settings::NodeSettings;
use crate::tunnel::{ServerTunnels, keep_tunnel};

/// One node of the fleet: its readiness (the node tunnel answers) and its
/// metrics, as the agent's `/readyz` and `/metrics` would say.
pub struct FleetNode {
    pub readiness: Arc<NodeReadiness>,
    pub metrics: Arc<NodeMetrics>,
}

/// Runs a node until the task is dropped: keeps its node tunnel, and
/// tunnels every connection `listener` accepts to `target`.
pub fn serve_without_rules(
    settings: NodeSettings,
    listener: TcpListener,
    target: SocketAddr,
) -> (FleetNode, impl Future<Output = ()> + Send + 'static) {
    let (tunnel_tx, tunnel_rx) = watch::channel(None);
    let metrics = Arc::new(NodeMetrics::default());
    let readiness = Arc::new(NodeReadiness::default());
    readiness
        .rules_installed
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let context = Arc::new(CaptureContext {
        map: CaptureMap::default(),
        tunnel: tunnel_rx,
        metrics: metrics.clone(),
        resume_timeout: settings.resume_timeout,
        handoff: HandOff::new(),
        servers: ServerTunnels::new(settings.clone()),
    });
    let keeper = keep_tunnel(settings, tunnel_tx, readiness.clone(), metrics.clone());
    let node = FleetNode { readiness, metrics };
    let serving = async move {
        let accepting = async {
            loop {
                match listener.accept().await {
                    Ok((connection, _)) => {
                        let orig = connection.local_addr().map(OrigDst);
                        if let Ok(orig) = orig {
                            tokio::spawn(listener::tunnel(connection, orig, target, context.clone()));
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "fleet node's listener: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        };
        tokio::join!(keeper, accepting);
    };
    (node, serving)
}
