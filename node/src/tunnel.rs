//! The node tunnel: one connection to the server's node frontend, kept
//! and probed for as long as the agent runs.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use konnectivity_client::Tunnel;
use konnectivity_plumbing::backoff::Backoff;
use tokio::sync::watch;

use crate::metrics::NodeMetrics;
use crate::readiness::NodeReadiness;
use crate::settings::NodeSettings;

/// How often the node tunnel is probed, and how long an answer may take:
/// a tunnel that stops answering is reported within about 3 s.
const TUNNEL_PROBE_INTERVAL: Duration = Duration::from_secs(1);
const TUNNEL_PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the node tunnel pings the server while streams are open: a
/// captured connection's stream on a silent link fails within twice this,
/// and the connection resumes on a new tunnel (docs/resume.md).
const TUNNEL_KEEPALIVE: Duration = Duration::from_secs(5);
/// The longest wait between reconnection attempts of the node tunnel.
const TUNNEL_RETRY_CAP: Duration = Duration::from_secs(3);

/// Keeps the node tunnel for as long as the agent runs, so that readiness
/// follows it: new captured connections are reset while it is down
/// (established ones wait to resume on the next connection), and `/readyz`
/// says so. The tunnel is probed every second; one that stops
/// answering is replaced by a new connection (the old one's TCP connection
/// may sit in retransmission backoff long after the path is back), retried
/// with the agent's backoff, capped so recovery is seen within seconds.
pub(crate) async fn keep_tunnel(
    settings: NodeSettings,
    tunnel: watch::Sender<Option<Tunnel>>,
    readiness: Arc<NodeReadiness>,
    metrics: Arc<NodeMetrics>,
) {
    let mut backoff = Backoff::new(
        settings.sync_interval,
        settings.sync_interval_cap.min(TUNNEL_RETRY_CAP),
    );
    let mut current: Option<Tunnel> = None;
    loop {
        let was_up = readiness.tunnel_connected.load(Ordering::Relaxed);
        let answer = match &current {
            Some(connected) => connected
                .probe(TUNNEL_PROBE_TIMEOUT)
                .await
                .map_err(|e| e.to_string()),
            None => Err("not connected".to_owned()),
        };
        let answer = match answer {
            Ok(()) => Ok(()),
            Err(problem) => {
                // Not ready from this moment; reconnecting may take a while.
                if was_up {
                    tracing::warn!(%problem, server = %settings.server_host, port = settings.node_frontend_port, "node tunnel stopped answering; new captured connections are reset until it is back");
                }
                readiness.tunnel_failed(problem.clone(), &metrics);
                match connect_tunnel(&settings).await {
                    Ok(fresh) => {
                        let _ = tunnel.send(Some(fresh.clone()));
                        current = Some(fresh);
                        Ok(())
                    }
                    // The probe's failure says what went wrong first.
                    Err(error) if current.is_some() => Err(format!("{problem} (reconnecting: {error})")),
                    Err(error) => Err(error),
                }
            }
        };
        match answer {
            Ok(()) => {
                if !was_up {
                    tracing::info!(server = %settings.server_host, port = settings.node_frontend_port, "node tunnel connected");
                }
                readiness.tunnel_answered(&metrics);
                backoff.reset();
                tokio::time::sleep(TUNNEL_PROBE_INTERVAL).await;
            }
            Err(problem) => {
                if current.is_none() {
                    tracing::warn!(%problem, server = %settings.server_host, port = settings.node_frontend_port, "cannot connect the node tunnel");
                }
                readiness.tunnel_failed(problem, &metrics);
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
}

/// The node role's TLS flags, named when its tunnel cannot connect.
const NODE_TLS_FLAGS: konnectivity_plumbing::tls::ClientFlags = konnectivity_plumbing::tls::ClientFlags {
    ca: "ca-cert",
    cert: "node-client-cert",
    key: "node-client-key",
    host: "proxy-server-host",
};

/// A new connection to the node frontend that has answered a probe.
async fn connect_tunnel(settings: &NodeSettings) -> Result<Tunnel, String> {
    let connect = Tunnel::connect_tls_marked(
        &settings.server_host,
        settings.node_frontend_port,
        settings.tls.clone(),
        Some(settings.mark),
        Some(TUNNEL_KEEPALIVE),
    );
    let connected = match tokio::time::timeout(TUNNEL_PROBE_TIMEOUT, connect).await {
        Ok(Ok(connected)) => connected.with_dial_timeout(Duration::from_secs(10)),
        Ok(Err(error)) => {
            return Err(konnectivity_plumbing::tls::explain_client_failure(
                &error,
                &settings.server_host,
                NODE_TLS_FLAGS,
            )
            .unwrap_or_else(|| konnectivity_plumbing::error_chain(&error)));
        }
        Err(_) => return Err(format!("no connection within {TUNNEL_PROBE_TIMEOUT:?}")),
    };
    connected
        .probe(TUNNEL_PROBE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    Ok(connected)
}
