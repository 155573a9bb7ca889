//! The capture listener: accepts connections the REDIRECT rule sent here,
//! reads where they were going (`SO_ORIGINAL_DST`), and tunnels each one
//! through the node frontend to its mapped target.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use konnectivity_client::Tunnel;
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::capture::map::{CaptureMap, OrigDst};
use crate::capture::resumable::{self, ResumeContext};
use crate::metrics::{CaptureOutcome, NodeMetrics};

/// What every captured connection needs.
pub(crate) struct CaptureContext {
    pub map: CaptureMap,
    /// The node tunnel, once connected.
    pub tunnel: watch::Receiver<Option<Tunnel>>,
    pub metrics: Arc<NodeMetrics>,
    /// `--resume-timeout`: how long a connection whose stream was lost
    /// waits for a new one (zero: it is reset at once).
    pub resume_timeout: Duration,
}

/// How long a captured connection's dial may take (the agent's own dial
/// timeout is shorter: this only bounds a server that does not answer).
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts captured connections until the task is dropped.
pub(crate) async fn serve(listener: Arc<TcpListener>, context: Arc<CaptureContext>) {
    loop {
        match listener.accept().await {
            Ok((connection, _)) => {
                tokio::spawn(handle(connection, context.clone()));
            }
            Err(error) => {
                tracing::warn!(%error, "capture listener accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn original_dst(connection: &TcpStream) -> io::Result<OrigDst> {
    let socket = socket2::SockRef::from(connection);
    let addr = if connection.local_addr()?.is_ipv4() {
        socket.original_dst_v4()?
    } else {
        socket.original_dst_v6()?
    };
    addr.as_socket()
        .map(OrigDst)
        .ok_or_else(|| io::Error::other("original destination is not an IP address"))
}

/// Ends a captured connection with a reset: its client sees a failure at
/// once and retries, instead of hanging or mistaking it for a clean end.
fn reset(connection: TcpStream) {
    let _ = socket2::SockRef::from(&connection).set_linger(Some(Duration::ZERO));
}

async fn handle(mut connection: TcpStream, context: Arc<CaptureContext>) {
    let metrics = &context.metrics;
    let orig = match original_dst(&connection) {
        Ok(orig) => orig,
        Err(error) => {
            tracing::warn!(%error, "captured connection has no original destination");
            metrics.captured(CaptureOutcome::UnknownDestination);
            return reset(connection);
        }
    };
    let Some(target) = context.map.target_for(orig) else {
        tracing::warn!(%orig, "connection to a destination that is not captured; closing it");
        metrics.captured(CaptureOutcome::UnknownDestination);
        return reset(connection);
    };
    // Dialed in a block of its own: what only the dial needs (the tunnel,
    // the dial's result, moved into the relay) is then not kept in the task
    // for the connection's life.
    let relay = {
        let tunnel = context.tunnel.borrow().clone();
        let Some(tunnel) = tunnel else {
            metrics.captured(CaptureOutcome::TunnelUnavailable);
            return reset(connection);
        };
        let resume = ResumeContext {
            tunnels: context.tunnel.clone(),
            timeout: context.resume_timeout,
            metrics: metrics.resumes.clone(),
        };
        match resumable::dial(&tunnel, &target.to_string(), &resume, DIAL_TIMEOUT).await {
            Ok(dialed) => resumable::relay(&mut connection, dialed, resume),
            Err(error) => {
                tracing::warn!(%orig, %target, %error, "captured connection could not be tunneled");
                metrics.captured(CaptureOutcome::DialFailed);
                return reset(connection);
            }
        }
    };
    metrics.captured(CaptureOutcome::Tunneled);
    let _open = GaugeGuard::new(&metrics.captured_connections_open);
    let outcome = relay.await;
    if let Err(error) = outcome {
        tracing::debug!(%orig, %error, "captured connection ended with an error");
        reset(connection);
    }
}
