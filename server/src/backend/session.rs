//! One agent stream's session: the task that owns its pending dials and its
//! connection table and routes every packet the agent sends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use konnectivity_mux::{Connections, Delivery, Route};
use konnectivity_proto::{ConnectId, DialId, Frame, Packet, PacketType};
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::sync::mpsc;

use super::registry::Registry;
use super::{Backend, BackendGone, Command, Event};
use crate::metrics::{DialFailure, Established, Segment, ServerMetrics};

struct PendingDial {
    /// Becomes the connection's route once the dial succeeds.
    route: Route<Event>,
    started: Instant,
    _gauge: GaugeGuard,
}

struct Session {
    backend: Arc<Backend>,
    metrics: Arc<ServerMetrics>,
    pending: HashMap<DialId, PendingDial>,
    /// Each connection keeps its `established_connections` count. Those we
    /// sent CLOSE_REQ for stay marked closing until their CLOSE_RSP comes:
    /// DATA still in flight for them is dropped quietly instead of answered
    /// with another CLOSE_REQ.
    connections: Connections<Event, Established>,
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
        connections: Connections::default(),
    };
    let reason = loop {
        // Commands first: a Dial command is always registered before the
        // DIAL_RSP that answers it can be read.
        let step = tokio::select! {
            biased;
            Some(command) = commands.recv() => session.on_command(command).await,
            packet = inbound.next() => match packet {
                Some(Ok(packet)) => session.on_packet(packet).await,
                Some(Err(status)) => {
                    session.metrics.stream_errors.count(Segment::FromAgent, status.code(), None);
                    // An agent that exits closes its connection without
                    // ending its stream first: not a protocol error.
                    if konnectivity_plumbing::net::grpc_connection_ended(&status) {
                        break "the agent's connection closed (the agent exited, or the network dropped it)".to_owned();
                    }
                    break format!("stream error: {status}");
                }
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
                route,
            } => {
                if self.pending.contains_key(&dial_id) {
                    route.send(Event::Dialed(Err(format!(
                        "dial id {dial_id} is already pending on this agent"
                    ))));
                    return Ok(());
                }
                self.pending.insert(
                    dial_id,
                    PendingDial {
                        route,
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
                if self.connections.close(connect_id).is_some() {
                    self.send(Frame::CloseRequest { connect_id }).await?;
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
                self.metrics.stream_errors.count(
                    Segment::FromAgent,
                    tonic::Code::InvalidArgument,
                    error.packet_type(),
                );
                return Ok(());
            }
        };
        self.metrics.packet(Segment::FromAgent, frame.kind());
        match frame {
            Frame::Data {
                connect_id,
                data,
                offset,
            } => self.on_data(connect_id, data, offset).await?,
            Frame::DialResponse { dial_id, result } => self.on_dial_response(dial_id, result).await?,
            Frame::CloseResponse { connect_id, error } => {
                self.connections.confirm(connect_id);
                if let Some(connection) = self.connections.remove(connect_id) {
                    connection.route.send(Event::Closed(error));
                }
            }
            Frame::WindowUpdate {
                connect_id,
                bytes,
                written,
            } => {
                if let Err((entry, error)) = self.connections.grant(connect_id, bytes, written) {
                    self.violation(connect_id, entry, error.to_string(), PacketType::WindowUpdate)
                        .await?;
                }
            }
            Frame::Drain => {
                tracing::info!(agent_id = %self.backend.agent_id, "agent is draining");
                self.backend.set_draining();
            }
            unexpected => {
                tracing::warn!(agent_id = %self.backend.agent_id, kind = ?unexpected.kind(), "unexpected packet from agent");
                self.metrics.stream_errors.count(
                    Segment::FromAgent,
                    tonic::Code::InvalidArgument,
                    Some(unexpected.kind()),
                );
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
                if pending.route.send(Event::Dialed(Ok(connect_id))) {
                    // An agent reusing a connect id ends the connection it displaces.
                    let established = self.metrics.established();
                    self.connections.insert(connect_id, pending.route, established);
                } else {
                    self.metrics.dial_failed(DialFailure::SendResponse);
                    self.close_on_agent(connect_id).await?;
                }
            }
            Err(error) => {
                self.metrics.dial_failed(DialFailure::ErrorResponse);
                pending.route.send(Event::Dialed(Err(error)));
            }
        }
        Ok(())
    }

    /// Hands DATA to its connection's frontend. With flow control this never
    /// waits; with an upstream agent it waits for a full connection's
    /// frontend, as upstream's server does, shown by `full_receive_channels`.
    async fn on_data(
        &mut self,
        connect_id: ConnectId,
        data: bytes::Bytes,
        offset: Option<u64>,
    ) -> Result<(), BackendGone> {
        let metrics = &self.metrics;
        let blocked = || GaugeGuard::new(&metrics.full_receive_channels("Connect"));
        match self.connections.deliver(connect_id, data, offset, blocked).await {
            Delivery::Delivered | Delivery::Duplicate => Ok(()),
            Delivery::Unknown if self.connections.is_closing(connect_id) => Ok(()),
            Delivery::Unknown => self.close_on_agent(connect_id).await,
            Delivery::ConsumerGone => {
                if let Some(entry) = self.connections.close(connect_id) {
                    entry.route.send(Event::Closed(None));
                }
                self.send(Frame::CloseRequest { connect_id }).await
            }
            Delivery::Violation { entry, error } => {
                self.violation(connect_id, entry, error.to_string(), PacketType::Data)
                    .await
            }
        }
    }

    /// The agent broke the protocol on one connection (more than its
    /// window, bytes out of order): that connection ends, the stream and
    /// its other connections carry on.
    async fn violation(
        &mut self,
        connect_id: ConnectId,
        entry: konnectivity_mux::Entry<Event, Established>,
        error: String,
        kind: PacketType,
    ) -> Result<(), BackendGone> {
        tracing::warn!(agent_id = %self.backend.agent_id, %connect_id, %error, "closing connection");
        self.metrics
            .stream_errors
            .count(Segment::FromAgent, tonic::Code::ResourceExhausted, Some(kind));
        entry.route.send(Event::Closed(Some(error)));
        self.close_on_agent(connect_id).await
    }

    /// Tells the agent to close a connection this side no longer has.
    async fn close_on_agent(&mut self, connect_id: ConnectId) -> Result<(), BackendGone> {
        self.connections.closing_without_entry(connect_id);
        self.send(Frame::CloseRequest { connect_id }).await
    }

    async fn send(&self, frame: Frame) -> Result<(), BackendGone> {
        self.backend.send(frame).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::strategy::Strategy;
    use crate::backend::{Announced, BackendId, Queues};
    use tokio_stream::wrappers::ReceiverStream;

    fn gauge(metrics: &ServerMetrics) -> i64 {
        metrics.full_receive_channels("Connect").get()
    }

    /// With an agent that did not negotiate flow control, a connection whose
    /// frontend stops reading holds up the agent stream, as upstream's does;
    /// `full_receive_channels` shows it while it lasts.
    #[tokio::test]
    async fn a_full_connection_of_an_upstream_agent_shows_in_full_receive_channels() {
        let metrics = Arc::new(ServerMetrics::default());
        let registry = Arc::new(Registry::new(vec![Strategy::Default], metrics.clone()));
        let announced = Announced {
            agent_id: "upstream-agent".to_owned(),
            ..Announced::default()
        };
        let (backend, queues) = Backend::open(BackendId(1), announced, metrics.clone());
        let Queues {
            mut to_agent,
            commands,
        } = queues;
        let (from_agent, inbound) = mpsc::channel::<Result<Packet, tonic::Status>>(64);
        let session = tokio::spawn(run(
            backend.clone(),
            ReceiverStream::new(inbound),
            commands,
            registry,
            metrics.clone(),
        ));

        let (route, mut frontend, _) = konnectivity_mux::connection(konnectivity_mux::Extensions::Upstream);
        let dial_id = DialId::new(7);
        backend
            .command(Command::Dial {
                dial_id,
                address: "10.0.0.1:80".into(),
                route,
            })
            .await
            .unwrap();
        assert!(to_agent.recv().await.is_some(), "DIAL_REQ sent");
        let connect_id = ConnectId::new(3).unwrap();
        let answer = Frame::DialResponse {
            dial_id,
            result: Ok(connect_id),
        };
        from_agent.send(Ok(answer.into())).await.unwrap();
        assert!(matches!(frontend.recv().await, Some(Event::Dialed(Ok(_)))));

        // 3 MiB to a frontend that reads none of it: past the 2 MiB window
        // the session waits.
        let chunk = bytes::Bytes::from(vec![0u8; 256 * 1024]);
        for _ in 0..12 {
            let data = Frame::Data {
                connect_id,
                data: chunk.clone(),
                offset: None,
            };
            from_agent.send(Ok(data.into())).await.unwrap();
        }
        for _ in 0..100 {
            if gauge(&metrics) == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(gauge(&metrics), 1, "the blocked stream is not shown");

        // The frontend goes away: the wait ends and so does the gauge.
        drop(frontend);
        for _ in 0..100 {
            if gauge(&metrics) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(gauge(&metrics), 0);
        drop(from_agent);
        session.await.unwrap();
    }
}
