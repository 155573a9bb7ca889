//! One agent stream's session: the task that owns its pending dials and its
//! connection table and routes every packet the agent sends.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use konnectivity_plumbing::metrics::GaugeGuard;
use konnectivity_proto::flow::{ReceiveGate, Refused, SendWindow};
use konnectivity_proto::{ConnectId, DialId, Frame, Packet};
use tokio::sync::mpsc;

use super::registry::Registry;
use super::{Backend, BackendGone, Command, Event};
use crate::metrics::{DialFailure, Segment, ServerMetrics};

struct PendingDial {
    events: mpsc::UnboundedSender<Event>,
    send_window: SendWindow,
    receive_gate: ReceiveGate,
    started: Instant,
    _gauge: GaugeGuard,
}

struct Connection {
    /// Unbounded: what it holds is bounded by `receive_gate`.
    events: mpsc::UnboundedSender<Event>,
    send_window: SendWindow,
    receive_gate: ReceiveGate,
    _gauge: GaugeGuard,
}

impl Drop for Connection {
    fn drop(&mut self) {
        // A frontend waiting for credit must learn the connection is gone.
        self.send_window.close();
    }
}

struct Session {
    backend: Arc<Backend>,
    metrics: Arc<ServerMetrics>,
    pending: HashMap<DialId, PendingDial>,
    connections: HashMap<ConnectId, Connection>,
    /// Connections we sent CLOSE_REQ for and whose CLOSE_RSP has not come:
    /// DATA still in flight for them is dropped quietly instead of answered
    /// with another CLOSE_REQ.
    closing: HashSet<ConnectId>,
}

/// Serves one agent stream until it ends, then releases everything on it:
/// pending dials fail (upstream leaked them, its issue #126) and every
/// connection's frontend sees its event channel close.
pub async fn run<S>(
    backend: Arc<Backend>,
    mut inbound: S,
    mut commands: mpsc::Receiver<Command>,
    registry: Arc<Registry>,
    metrics: Arc<ServerMetrics>,
) where
    S: futures_util::Stream<Item = Result<Packet, tonic::Status>> + Unpin,
{
    use futures_util::StreamExt;

    let mut session = Session {
        backend: backend.clone(),
        metrics,
        pending: HashMap::new(),
        connections: HashMap::new(),
        closing: HashSet::new(),
    };
    let reason = loop {
        // Commands first: a Dial command is always registered before the
        // DIAL_RSP that answers it can be read.
        let step = tokio::select! {
            biased;
            Some(command) = commands.recv() => session.on_command(command).await,
            packet = inbound.next() => match packet {
                Some(Ok(packet)) => session.on_packet(packet).await,
                Some(Err(status)) => break format!("stream error: {status}"),
                None => break "agent closed the stream".to_owned(),
            },
        };
        if step.is_err() {
            break "outbound queue closed".to_owned();
        }
    };
    tracing::info!(agent_id = %backend.agent_id, %reason, "agent stream ended");
    registry.remove(backend.id);
    // Dials queued after the last loop turn fail too: dropping their event
    // senders tells the frontends the agent is gone.
    commands.close();
    while commands.try_recv().is_ok() {}
    for _ in session.pending.drain() {
        session.metrics.dial_failed(DialFailure::BackendClose);
    }
    session.connections.clear();
}

impl Session {
    async fn on_command(&mut self, command: Command) -> Result<(), BackendGone> {
        match command {
            Command::Dial {
                dial_id,
                address,
                events,
                send_window,
                receive_gate,
            } => {
                if self.pending.contains_key(&dial_id) {
                    let _ = events.send(Event::Dialed(Err(format!(
                        "dial id {dial_id} is already pending on this agent"
                    ))));
                    return Ok(());
                }
                self.pending.insert(
                    dial_id,
                    PendingDial {
                        events,
                        send_window,
                        receive_gate,
                        started: Instant::now(),
                        _gauge: GaugeGuard::new(&self.metrics.pending_backend_dials),
                    },
                );
                self.send(Frame::DialRequest {
                    protocol: "tcp".to_owned(),
                    address,
                    dial_id,
                })
                .await
            }
            Command::CancelDial { dial_id } => {
                if self.pending.remove(&dial_id).is_some() {
                    self.metrics.dial_failed(DialFailure::FrontendClose);
                    self.send(Frame::CloseDial { dial_id }).await?;
                }
                Ok(())
            }
            Command::Close { connect_id } => {
                if self.connections.remove(&connect_id).is_some() {
                    self.close_on_agent(connect_id).await?;
                }
                Ok(())
            }
        }
    }

    async fn on_packet(&mut self, packet: Packet) -> Result<(), BackendGone> {
        let frame = match Frame::try_from(packet) {
            Ok(frame) => frame,
            Err(error) => {
                // A bad packet names no connection we could close; drop it.
                tracing::warn!(agent_id = %self.backend.agent_id, %error, "invalid packet from agent");
                self.metrics.stream_errors.inc();
                return Ok(());
            }
        };
        self.metrics.packet(Segment::FromAgent, frame.kind());
        match frame {
            Frame::Data { connect_id, data } => self.on_data(connect_id, data).await?,
            Frame::DialResponse { dial_id, result } => self.on_dial_response(dial_id, result).await?,
            Frame::CloseResponse { connect_id, error } => {
                self.closing.remove(&connect_id);
                if let Some(connection) = self.connections.remove(&connect_id) {
                    let _ = connection.events.send(Event::Closed(error));
                }
            }
            Frame::WindowUpdate { connect_id, bytes } => {
                // Unknown ids are connections that just ended; nothing to do.
                if let Some(connection) = self.connections.get(&connect_id) {
                    connection.send_window.grant(bytes);
                }
            }
            Frame::Drain => {
                tracing::info!(agent_id = %self.backend.agent_id, "agent is draining");
                self.backend.set_draining();
            }
            unexpected => {
                tracing::warn!(agent_id = %self.backend.agent_id, kind = ?unexpected.kind(), "unexpected packet from agent");
                self.metrics.stream_errors.inc();
            }
        }
        Ok(())
    }

    async fn on_dial_response(
        &mut self,
        dial_id: DialId,
        result: Result<ConnectId, String>,
    ) -> Result<(), BackendGone> {
        let Some(pending) = self.pending.remove(&dial_id) else {
            // The frontend cancelled while the agent dialed. Upstream leaks
            // the agent's connection here; close it.
            self.metrics.dial_failed(DialFailure::UnrecognizedResponse);
            if let Ok(connect_id) = result {
                self.close_on_agent(connect_id).await?;
            }
            return Ok(());
        };
        match result {
            Ok(connect_id) => {
                self.metrics
                    .dial_duration
                    .observe(pending.started.elapsed().as_secs_f64());
                if pending.events.send(Event::Dialed(Ok(connect_id))).is_ok() {
                    self.connections.insert(
                        connect_id,
                        Connection {
                            events: pending.events,
                            send_window: pending.send_window,
                            receive_gate: pending.receive_gate,
                            _gauge: GaugeGuard::new(&self.metrics.established_connections),
                        },
                    );
                } else {
                    self.metrics.dial_failed(DialFailure::FrontendClose);
                    self.close_on_agent(connect_id).await?;
                }
            }
            Err(error) => {
                self.metrics.dial_failed(DialFailure::Endpoint);
                let _ = pending.events.send(Event::Dialed(Err(error)));
            }
        }
        Ok(())
    }

    /// Hands DATA to its connection's frontend. With flow control this never
    /// waits; with an upstream agent it waits for a full connection's
    /// frontend, as upstream's server does.
    async fn on_data(&mut self, connect_id: ConnectId, data: bytes::Bytes) -> Result<(), BackendGone> {
        let Some(connection) = self.connections.get(&connect_id) else {
            if !self.closing.contains(&connect_id) {
                self.close_on_agent(connect_id).await?;
            }
            return Ok(());
        };
        let admitted = connection.receive_gate.admit(data.len()).await;
        let failure = match admitted {
            Ok(()) if connection.events.send(Event::Data(data)).is_ok() => return Ok(()),
            Ok(()) | Err(Refused::Closed) => None,
            Err(overrun @ Refused::Overrun) => {
                tracing::warn!(agent_id = %self.backend.agent_id, %connect_id, error = %overrun, "closing connection");
                self.metrics.stream_errors.inc();
                Some(overrun.to_string())
            }
        };
        if let Some(connection) = self.connections.remove(&connect_id) {
            let _ = connection.events.send(Event::Closed(failure));
        }
        self.close_on_agent(connect_id).await
    }

    async fn close_on_agent(&mut self, connect_id: ConnectId) -> Result<(), BackendGone> {
        self.closing.insert(connect_id);
        self.send(Frame::CloseRequest { connect_id }).await
    }

    async fn send(&self, frame: Frame) -> Result<(), BackendGone> {
        self.backend.send(frame).await
    }
}
