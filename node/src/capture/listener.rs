//! The capture listener: accepts connections the REDIRECT rule sent here,
//! reads where they were going (`SO_ORIGINAL_DST`), and tunnels each one
//! through the node frontend to its mapped target.

use std::io;

use std::sync::Arc;
use std::time::Duration;

use konnectivity_client::Tunnel;
use konnectivity_plumbing::net::reset;
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

use crate::capture::handoff::HandedConnection;
use crate::capture::map::{CaptureMap, OrigDst};
use crate::capture::resumable::{self, Ended, ResumeContext};
use crate::handoff::HandOff;
use crate::metrics::{CaptureOutcome, NodeMetrics};
use crate::tunnel::ServerTunnels;

/// What every captured connection needs.
pub(crate) struct CaptureContext {
    pub map: CaptureMap,
    /// The node tunnel, once connected.
    pub tunnel: watch::Receiver<Option<Tunnel>>,
    pub metrics: Arc<NodeMetrics>,
    /// `--resume-timeout`: how long a connection whose stream was lost
    /// waits for a new one (zero: it is reset at once).
    pub resume_timeout: Duration,
    /// Where established connections go when a successor takes them.
    pub handoff: Arc<HandOff<HandedConnection>>,
    /// Connections to the server a stream lives at, when the node tunnel
    /// reached another.
    pub servers: Arc<ServerTunnels>,
}

impl CaptureContext {
    fn resume(&self) -> ResumeContext {
        ResumeContext {
            tunnels: self.tunnel.clone(),
            timeout: self.resume_timeout,
            metrics: self.metrics.resumes.clone(),
            handoff: self.handoff.clone(),
            servers: self.servers.clone(),
        }
    }
}

/// How long a captured connection's dial may take (the agent's own dial
/// timeout is shorter: this only bounds a server that does not answer).
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts captured connections until the task is dropped.
pub(crate) async fn serve(listener: Arc<TcpListener>, context: Arc<CaptureContext>) {
    loop {
        match listener.accept().await {
            Ok((connection, _)) => {
                // Where it was going is read here, not in the task: the
                // task then holds only what the tunnel needs.
                if let Some((orig, target)) = destination(&connection, &context) {
                    tokio::spawn(tunnel(connection, orig, target, context.clone()));
                }
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

/// Where a captured connection was going, and where it goes instead;
/// `None` (the connection is reset) when it was going nowhere captured.
fn destination(connection: &TcpStream, context: &CaptureContext) -> Option<(OrigDst, std::net::SocketAddr)> {
    let metrics = &context.metrics;
    let orig = match original_dst(connection) {
        Ok(orig) => orig,
        Err(error) => {
            tracing::warn!(%error, "captured connection has no original destination");
            metrics.captured(CaptureOutcome::UnknownDestination);
            reset(connection);
            return None;
        }
    };
    let Some(target) = context.map.target_for(orig) else {
        tracing::warn!(%orig, "connection to a destination that is not captured; closing it");
        metrics.captured(CaptureOutcome::UnknownDestination);
        reset(connection);
        return None;
    };
    Some((orig, target))
}

/// Tunnels a captured connection that was going to `orig` to `target`.
pub(crate) async fn tunnel(
    mut connection: TcpStream,
    orig: OrigDst,
    target: std::net::SocketAddr,
    context: Arc<CaptureContext>,
) {
    let metrics = &context.metrics;
    // Dialed in a block of its own: what only the dial needs (the tunnel,
    // the dial's result, moved into the relay) is then not kept in the task
    // for the connection's life.
    let relay = {
        let tunnel = context.tunnel.borrow().clone();
        let Some(tunnel) = tunnel else {
            metrics.captured(CaptureOutcome::TunnelUnavailable);
            return reset(connection);
        };
        let resume = context.resume();
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
    match relay.await {
        Ok(Ended::Closed) => {}
        // The successor holds the socket now: closing this process's
        // descriptor leaves the connection be.
        Ok(Ended::HandedOver) => {}
        Err(error) => {
            tracing::debug!(%orig, %error, "captured connection ended with an error");
            reset(connection);
        }
    }
}

/// Carries on a connection the previous agent handed over; `taken_over`
/// hears whether its stream resumed.
pub(crate) async fn continue_handed(
    handed: HandedConnection,
    context: Arc<CaptureContext>,
    taken_over: oneshot::Sender<Result<(), String>>,
) {
    let Some((packets, unsent)) = handed.packets() else {
        let _ = taken_over.send(Err("the data handed over does not match its state".to_owned()));
        return reset(handed.socket);
    };
    let HandedConnection { state, socket, .. } = handed;
    let std = std::net::TcpStream::from(socket);
    let mut connection = match std.set_nonblocking(true).and_then(|()| TcpStream::from_std(std)) {
        Ok(connection) => connection,
        Err(error) => {
            let _ = taken_over.send(Err(format!("the socket handed over: {error}")));
            return;
        }
    };
    let connect_id = state.connect_id;
    let handed = match resumable::Handed::new(state, packets, unsent) {
        Ok(handed) => handed,
        Err(error) => {
            let _ = taken_over.send(Err(error));
            return reset(connection);
        }
    };
    let relay = resumable::continue_handed(&mut connection, handed, taken_over, context.resume());
    let _open = GaugeGuard::new(&context.metrics.captured_connections_open);
    match relay.await {
        Ok(Ended::Closed | Ended::HandedOver) => {}
        Err(error) => {
            tracing::debug!(connect_id, %error, "captured connection taken over ended with an error");
            reset(connection);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A captured connection's task is most of what an idle one costs
    /// (50,000 of them on a large node fleet): 1,888 bytes before the
    /// hand-over of established connections, 1,896 after, 1,968 with the
    /// connection of its own to its server behind one address (and the
    /// destination read before the task). Keep it so: a rare path's state
    /// belongs in a box.
    #[tokio::test]
    async fn a_captured_connections_task_stays_small() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        accepted.set_nonblocking(true).unwrap();
        let (_tunnel, tunnel) = watch::channel(None);
        let mut registry = prometheus_client::registry::Registry::default();
        let context = Arc::new(CaptureContext {
            map: CaptureMap::default(),
            tunnel,
            metrics: Arc::new(NodeMetrics::register(&mut registry, Default::default())),
            resume_timeout: Duration::from_secs(60),
            handoff: HandOff::new(),
            servers: ServerTunnels::new(crate::settings::NodeSettings::for_tests()),
        });
        let orig = OrigDst("10.96.0.1:443".parse().unwrap());
        let target = "10.0.0.1:6443".parse().unwrap();
        let task = super::tunnel(TcpStream::from_std(accepted).unwrap(), orig, target, context);
        let size = std::mem::size_of_val(&task);
        assert!(size <= 2048, "a captured connection's task is {size} bytes");
    }
}
