//! The agent's connections to proxy-servers. Servers behind one address (a
//! load balancer) each announce their `serverid` and how many there are
//! (`servercount`); the agent keeps dialing the address until it holds a
//! stream to that many distinct servers, so every server can reach it.
//! A second stream to a server it already holds is closed at once.

use std::collections::HashMap;
use std::sync::Arc;

use konnectivity_plumbing::metrics::GaugeGuard;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::Backoff;
use crate::metrics::AgentMetrics;
use crate::server_conn::ServerTarget;
use crate::session::{self, SessionSettings};

/// Holds streams to `servercount` distinct servers, forever: dials with
/// upstream's backoff while short of them, waits for a loss once converged.
pub async fn serve(
    target: ServerTarget,
    settings: SessionSettings,
    metrics: Arc<AgentMetrics>,
    drain: watch::Receiver<bool>,
    mut backoff: Backoff,
) {
    let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<String>();
    let mut held: HashMap<String, SessionTask> = HashMap::new();
    // Until a server says otherwise there is one.
    let mut wanted: usize = 1;
    loop {
        while let Ok(server_id) = ended_rx.try_recv() {
            held.remove(&server_id);
        }
        if held.len() >= wanted {
            // Converged: nothing to dial until a stream ends.
            if let Some(server_id) = ended_rx.recv().await {
                held.remove(&server_id);
            }
            backoff.reset();
            continue;
        }
        match target.connect(&metrics).await {
            Ok(stream) => {
                wanted = (stream.server_count as usize).max(1);
                metrics.known_server_count.set(i64::from(stream.server_count));
                if held.contains_key(&stream.server_id) {
                    tracing::debug!(server_id = %stream.server_id, "already connected to this server; closing the duplicate");
                } else {
                    tracing::info!(
                        server_id = %stream.server_id,
                        server_count = stream.server_count,
                        flow_control = stream.flow_control,
                        connected = held.len() + 1,
                        "connected to proxy-server"
                    );
                    let server_id = stream.server_id.clone();
                    let ended = ended_tx.clone();
                    let open = GaugeGuard::new(&metrics.open_server_connections);
                    let run = session::run(
                        stream.inbound,
                        stream.outbound,
                        stream.flow_control,
                        settings.clone(),
                        metrics.clone(),
                        drain.clone(),
                    );
                    let id = server_id.clone();
                    let task = tokio::spawn(async move {
                        let _open = open;
                        let reason = run.await;
                        tracing::warn!(server_id = %id, %reason, "lost proxy-server stream");
                        let _ = ended.send(id);
                    });
                    held.insert(server_id, SessionTask(task));
                    backoff.reset();
                    if held.len() >= wanted {
                        continue;
                    }
                }
            }
            Err(error) => {
                tracing::warn!(error = %konnectivity_plumbing::error_chain(&error), "cannot connect to proxy-server")
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// A session's task; dropping it (the agent stopping) ends the session.
struct SessionTask(JoinHandle<()>);

impl Drop for SessionTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}
