//! The frontend's view of a tunneled connection: dial through a selected
//! backend, then send and receive bytes. HTTP CONNECT and gRPC frontends
//! share this one path.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use konnectivity_mux::flow::SendWindow;
use konnectivity_mux::{Port, Waited};
use konnectivity_proto::{ConnectId, DialId, DialTarget};

use crate::backend::registry::Registry;
use crate::backend::{AGENT_DISCONNECTED, Backend, BackendGone, Command, Event};
use crate::frontend::node_clients::NodeClient;
use crate::metrics::{DialFailure, ServerMetrics};
use crate::policy::{AllowedDestination, FrontendClass, PolicyError, check_node_destination};
use konnectivity_plumbing::limit::{Limit, LimitReached, Slot};
use konnectivity_telemetry::metrics::{EndReason, TunnelBytes, TunnelRecord};

/// Why a dial did not produce a connection. The text reaches the client.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DialError {
    #[error("No agent available")]
    NoBackend,
    #[error("{0}")]
    Policy(#[from] PolicyError),
    /// The agent's own error text, passed through unchanged.
    #[error("{0}")]
    Agent(String),
    #[error("dial timeout: no DIAL_RSP from agent within {0:?} (--backend-dial-timeout)")]
    Timeout(Duration),
    #[error("{AGENT_DISCONNECTED} before answering the dial")]
    BackendGone,
    /// `--max-tunnels-per-frontend` reached on this frontend.
    #[error("{0}")]
    Limit(#[from] LimitReached),
}

impl DialError {
    /// How the tunnel that asked for this dial ended.
    pub fn end(&self) -> TunnelEnd {
        match self {
            DialError::NoBackend => TunnelEnd::NoAgent,
            DialError::Policy(_) => TunnelEnd::Policy,
            DialError::Agent(_) => TunnelEnd::DialFailed,
            DialError::Timeout(_) => TunnelEnd::DialTimeout,
            DialError::BackendGone => TunnelEnd::AgentGone,
            DialError::Limit(_) => TunnelEnd::Limit,
        }
    }

    /// The HTTP status upstream's CONNECT frontend answers this error with.
    pub fn http_status(&self) -> u16 {
        match self {
            DialError::NoBackend => 500,
            DialError::Policy(_) => 403,
            DialError::Timeout(_) => 504,
            DialError::BackendGone => 502,
            DialError::Limit(_) => 503,
            DialError::Agent(text) => {
                let text = text.to_ascii_lowercase();
                if text.contains("timeout") || text.contains("deadline exceeded") {
                    504
                } else if text.contains("too many open files") {
                    503
                } else {
                    502
                }
            }
        }
    }
}

/// Why a tunnel ended, and so who ended it: counted by
/// `tunnels_ended_total{reason}` and logged at -v=2. Every dial a frontend
/// asks for ends exactly once, established or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelEnd {
    /// No agent could take the dial.
    NoAgent,
    /// A node client asked for a destination it may not reach.
    Policy,
    /// `--max-tunnels-per-frontend` was reached.
    Limit,
    /// No DIAL_RSP within `--backend-dial-timeout`.
    DialTimeout,
    /// The agent could not reach the target (its error reaches the client).
    DialFailed,
    /// The client gave up before the dial was answered.
    DialCancelled,
    /// The client ended it: end of stream, CLOSE_REQ.
    ClientClosed,
    /// The client's connection failed, or it broke the protocol.
    ClientError,
    /// The target closed its connection.
    TargetClosed,
    /// The agent reported the target's connection failed (a reset, say).
    TargetError,
    /// The agent's stream to this server ended.
    AgentGone,
    /// The server stopped while the tunnel was open.
    Shutdown,
}

impl EndReason for TunnelEnd {
    fn label(self) -> &'static str {
        match self {
            TunnelEnd::NoAgent => "no_agent",
            TunnelEnd::Policy => "policy",
            TunnelEnd::Limit => "limit",
            TunnelEnd::DialTimeout => "dial_timeout",
            TunnelEnd::DialFailed => "dial_failed",
            TunnelEnd::DialCancelled => "dial_cancelled",
            TunnelEnd::ClientClosed => "client_closed",
            TunnelEnd::ClientError => "client_error",
            TunnelEnd::TargetClosed => "target_closed",
            TunnelEnd::TargetError => "target_error",
            TunnelEnd::AgentGone => "agent_gone",
            TunnelEnd::Shutdown => "shutdown",
        }
    }
}

/// A dial not yet answered: counted as cancelled if the caller drops it
/// before it resolves one way or the other.
struct DialInFlight<'a> {
    metrics: &'a ServerMetrics,
    tunnel: &'a tracing::Span,
    armed: bool,
}

impl DialInFlight<'_> {
    /// The dial failed: count and log how.
    fn failed(mut self, error: DialError) -> DialError {
        self.armed = false;
        let ended = &self.metrics.tunnels_ended;
        ended.before_established(self.tunnel, error.end(), Some(&error));
        error
    }

    /// The dial succeeded: the tunnel's [`TunnelLife`] counts its end.
    fn established(mut self) {
        self.armed = false;
    }
}

impl Drop for DialInFlight<'_> {
    fn drop(&mut self) {
        if self.armed {
            let ended = &self.metrics.tunnels_ended;
            ended.before_established(self.tunnel, TunnelEnd::DialCancelled, None);
        }
    }
}

/// An established tunnel from dial to end, for its closing log line and
/// `tunnels_ended_total`. The frontend says how it ended with
/// [`TunnelRecord::end`]; dropped without that (its task cancelled), it ended
/// with the server.
pub(crate) type TunnelLife = TunnelRecord<TunnelEnd>;

/// Dials through the registry's backends.
#[derive(Clone)]
pub struct Dialer {
    pub registry: Arc<Registry>,
    pub metrics: Arc<ServerMetrics>,
    /// `--backend-dial-timeout`; `None` leaves the deadline to the agent.
    pub timeout: Option<Duration>,
    /// Who dials through this dialer, which decides agents and destinations.
    pub class: FrontendClass,
    /// For node clients: the destinations they may reach.
    pub node_allowed: Arc<Vec<AllowedDestination>>,
    /// For node clients: the node the stream's certificate names, counted
    /// while the stream and its tunnels live.
    pub client_node: Option<Arc<NodeClient>>,
    /// `--max-tunnels-per-frontend`, counted for this frontend alone.
    pub tunnel_limit: Option<Limit>,
}

impl Dialer {
    /// Dials `address` with a dial id of the caller's choosing (gRPC clients
    /// pick their own; HTTP CONNECT uses a random one).
    pub async fn dial(&self, address: &DialTarget, dial_id: DialId) -> Result<TunnelConn, DialError> {
        // One span per tunnel, from the dial to its end, on this side and
        // on the agent's: every -v=2 line of the tunnel carries its ids, so
        // the two processes' lines of one tunnel can be matched.
        let span = tracing::debug_span!(
            "tunnel",
            %dial_id,
            destination = address.as_str(),
            agent_id = tracing::field::Empty,
            connect_id = tracing::field::Empty,
            node = tracing::field::Empty,
        );
        if let Some(client) = &self.client_node {
            span.record("node", tracing::field::display(&client.name));
        }
        // Not `instrument`ed: the span's events here name it themselves, and
        // an instrumented future is larger, in every idle tunnel's task.
        span.in_scope(|| tracing::debug!(client = self.class.label(), "dial requested"));
        let in_flight = DialInFlight {
            metrics: &self.metrics,
            tunnel: &span,
            armed: true,
        };
        match self.dial_agent(address, dial_id, &span).await {
            Ok(connection) => {
                in_flight.established();
                Ok(connection)
            }
            Err(error) => Err(in_flight.failed(error)),
        }
    }

    async fn dial_agent(
        &self,
        address: &DialTarget,
        dial_id: DialId,
        span: &tracing::Span,
    ) -> Result<TunnelConn, DialError> {
        if self.class == FrontendClass::Node
            && let Err(refused) = check_node_destination(&self.node_allowed, address)
        {
            self.metrics.dial_failed(DialFailure::NodePolicy);
            tracing::warn!(%address, error = %refused, "node dial refused by policy");
            return Err(refused.into());
        }
        // A slot for the tunnel's whole life, taken before anything else so
        // that a refused request costs the agents nothing.
        let slot = match self.tunnel_limit.as_ref().map(|limit| limit.take("tunnel")) {
            Some(Err(refused)) => {
                self.metrics.limit_refused(self.class.label());
                tracing::warn!(%address, error = %refused, "tunnel refused");
                return Err(refused.into());
            }
            Some(Ok(slot)) => Some(slot),
            None => None,
        };
        let Some(backend) = self.registry.select(address.host(), self.class) else {
            self.metrics.dial_failed(DialFailure::NoAgent);
            return Err(DialError::NoBackend);
        };
        let (route, port, send_window) = konnectivity_mux::connection(backend.extensions);
        backend
            .command(Command::Dial {
                dial_id,
                address: address.clone(),
                route,
            })
            .await
            .map_err(|BackendGone| DialError::BackendGone)?;
        // Until the answer is read, dropping this future cancels the dial.
        let mut cancel = CancelDialOnDrop {
            backend: &backend,
            dial_id,
            port: Some(port),
        };
        let waiting = cancel.port.as_mut().expect("taken only below");
        let answer = match self.timeout {
            Some(limit) => tokio::time::timeout(limit, waiting.recv())
                .await
                .map_err(|_| DialError::Timeout(limit)),
            None => Ok(waiting.recv().await),
        };
        let answer = match answer {
            Ok(answer) => answer,
            Err(timeout) => {
                self.metrics.dial_failed(DialFailure::BackendDialTimeout);
                return Err(timeout);
            }
        };
        let port = cancel.port.take().expect("taken only here");
        match answer {
            Some(Event::Dialed(Ok(connect_id))) => {
                span.record("agent_id", backend.agent_id.as_str());
                span.record("connect_id", tracing::field::display(connect_id));
                let bytes = Arc::new(TunnelBytes::default());
                Ok(TunnelConn {
                    connect_id,
                    sender: TunnelSender {
                        backend: backend.clone(),
                        connect_id,
                        window: send_window,
                        bytes: bytes.clone(),
                        _slot: slot,
                    },
                    receiver: TunnelReceiver {
                        backend: backend.clone(),
                        connect_id,
                        port,
                        unconsumed: 0,
                        bytes: bytes.clone(),
                    },
                    life: self
                        .metrics
                        .tunnels_ended
                        .established(span.clone(), bytes, TunnelEnd::Shutdown),
                })
            }
            Some(Event::Dialed(Err(text))) => Err(DialError::Agent(text)),
            Some(_) | None => Err(DialError::BackendGone),
        }
    }
}

/// Cancels a dial whose answer was not read: DIAL_CLS while the agent still
/// dials; and when the agent's answer arrived and waits unread (the client
/// gave up just then), the connection it made is closed. Cancelling alone
/// left that one open on the agent for good (nothing on it ever reads or
/// writes: 2,500 of them in the 5,000-node run, the dials its clients gave up
/// under load).
struct CancelDialOnDrop<'a> {
    backend: &'a Backend,
    dial_id: DialId,
    /// Until the answer is read.
    port: Option<Port<Event>>,
}

impl Drop for CancelDialOnDrop<'_> {
    fn drop(&mut self) {
        let Some(port) = self.port.take() else {
            return;
        };
        // In one step: the session either delivered the answer before (it
        // is returned here) or finds the port closed and closes the
        // connection itself.
        let answered = port.close().find_map(|event| match event {
            Event::Dialed(Ok(connect_id)) => Some(connect_id),
            _ => None,
        });
        let command = match answered {
            Some(connect_id) => Command::Close { connect_id },
            None => Command::CancelDial {
                dial_id: self.dial_id,
            },
        };
        self.backend.command_from_drop(command);
    }
}

/// An established tunneled connection.
pub struct TunnelConn {
    pub connect_id: ConnectId,
    sender: TunnelSender,
    receiver: TunnelReceiver,
    life: TunnelLife,
}

impl TunnelConn {
    /// Splits into the half that sends to the agent, the half that
    /// receives from it (so both directions can run at once) and the
    /// record that says, when the frontend is done, how the tunnel ended.
    pub fn split(self) -> (TunnelSender, TunnelReceiver, TunnelLife) {
        (self.sender, self.receiver, self.life)
    }
}

/// Sends bytes to the remote end. Dropping it closes the connection on the
/// agent (CLOSE_REQ), whatever path the frontend took to get there.
pub struct TunnelSender {
    backend: Arc<Backend>,
    connect_id: ConnectId,
    window: SendWindow,
    bytes: Arc<TunnelBytes>,
    /// The frontend's tunnel slot, freed when the tunnel ends.
    _slot: Option<Slot>,
}

impl TunnelSender {
    /// Sends one chunk, first waiting for the connection's flow-control
    /// credit (with agents that negotiated it). Fails once the connection or
    /// the agent stream is gone.
    pub async fn send(&self, data: Bytes) -> Result<(), BackendGone> {
        self.window.reserve(data.len()).await.map_err(|_| BackendGone)?;
        let len = data.len();
        let packet = self.window.data(self.connect_id, data);
        self.backend.send(packet).await?;
        self.bytes.sent_to_target(len);
        Ok(())
    }
}

impl Drop for TunnelSender {
    fn drop(&mut self) {
        // Harmless when the agent closed first: the session no longer knows
        // the id and ignores the request.
        self.backend.command_from_drop(Command::Close {
            connect_id: self.connect_id,
        });
    }
}

/// How the remote side of a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteEnd {
    /// The agent closed it cleanly (the target closed, or it answered our close).
    Closed,
    /// The agent reported an error (the target reset, say).
    Failed(String),
    /// The agent's stream went away.
    AgentGone,
}

impl RemoteEnd {
    /// The error a client is told, if any.
    pub fn error(&self) -> Option<String> {
        match self {
            RemoteEnd::Closed => None,
            RemoteEnd::Failed(error) => Some(error.clone()),
            RemoteEnd::AgentGone => Some(AGENT_DISCONNECTED.to_owned()),
        }
    }

    /// How the tunnel ended, from the server's side.
    pub fn tunnel_end(&self) -> TunnelEnd {
        match self {
            RemoteEnd::Closed => TunnelEnd::TargetClosed,
            RemoteEnd::Failed(_) => TunnelEnd::TargetError,
            RemoteEnd::AgentGone => TunnelEnd::AgentGone,
        }
    }
}

pub struct TunnelReceiver {
    backend: Arc<Backend>,
    connect_id: ConnectId,
    port: Port<Event>,
    /// Length of the chunk handed out last: asking for the next one means
    /// the caller has written it, so its credit goes back to the agent.
    unconsumed: usize,
    bytes: Arc<TunnelBytes>,
}

impl TunnelReceiver {
    /// The next chunk from the remote end, or how the connection ended.
    /// Call it only once the previous chunk is written to the client.
    pub async fn recv(&mut self) -> Result<Bytes, RemoteEnd> {
        let consumed = std::mem::take(&mut self.unconsumed);
        if consumed > 0
            && let Some(credit) = self.port.written(consumed)
            && self.backend.send(credit.frame(self.connect_id)).await.is_err()
        {
            return Err(RemoteEnd::AgentGone);
        }
        let event = loop {
            match self.port.recv_or_quiet().await {
                Waited::Arrived(event) => break event,
                // With resume: the agent may drop what it kept for replay.
                Waited::Quiet(credit) => {
                    if self.backend.send(credit.frame(self.connect_id)).await.is_err() {
                        return Err(RemoteEnd::AgentGone);
                    }
                }
            }
        };
        if let Some(Event::Data(data)) = &event {
            self.unconsumed = data.len();
            self.bytes.received_from_target(data.len());
        }
        match event {
            Some(Event::Data(data)) => Ok(data),
            Some(Event::Closed(None)) => Err(RemoteEnd::Closed),
            Some(Event::Closed(Some(error))) => Err(RemoteEnd::Failed(error)),
            Some(Event::Dialed(_)) => Err(RemoteEnd::Failed("duplicate DIAL_RSP".to_owned())),
            None => Err(RemoteEnd::AgentGone),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that gives up on a dial just as the agent answers (its
    /// answer delivered, not yet read) leaves no connection open on the
    /// agent: the session is told to close it. Cancelling the dial alone did
    /// nothing there (the dial was no longer pending), and the connection
    /// stayed for good.
    #[tokio::test]
    async fn a_dial_given_up_with_its_answer_unread_closes_the_agents_connection() {
        use crate::backend::session::testing::{RunningSession, running_session};
        use futures_util::StreamExt;
        use konnectivity_proto::Frame;
        let RunningSession {
            registry,
            metrics,
            mut to_agent,
            from_agent,
            ..
        } = running_session("agent", konnectivity_mux::Extensions::FlowControl, None);
        let dialer = Dialer {
            registry,
            metrics: metrics.clone(),
            timeout: None,
            class: FrontendClass::Apiserver,
            node_allowed: Arc::new(Vec::new()),
            client_node: None,
            tunnel_limit: None,
        };
        let target = DialTarget::new("10.0.0.1:80");
        let dial_id = DialId::new(7);
        let mut dial = Box::pin(dialer.dial(&target, dial_id));
        // Polled until the DIAL_REQ is out, then no more.
        let request = tokio::select! {
            _ = &mut dial => panic!("the dial ended before its answer"),
            request = to_agent.next() => request.unwrap(),
        };
        assert!(matches!(Frame::try_from(request), Ok(Frame::DialRequest { .. })));
        let connect_id = ConnectId::new(3).unwrap();
        let answer = Frame::DialResponse {
            dial_id,
            result: Ok(connect_id),
        };
        from_agent.send(Ok(answer.into())).await.unwrap();
        // The session delivers the answer; nobody reads it; the client goes.
        while metrics.established_connections.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(dial);
        let next = tokio::time::timeout(Duration::from_secs(2), to_agent.next()).await;
        let next = next.expect("a packet for the agent").map(Frame::try_from);
        assert!(
            matches!(next, Some(Ok(Frame::CloseRequest { connect_id: id })) if id == connect_id),
            "{next:?}"
        );
        let closed = Frame::CloseResponse {
            connect_id,
            error: None,
        };
        from_agent.send(Ok(closed.into())).await.unwrap();
        tokio::time::timeout(Duration::from_secs(2), async {
            while metrics.established_connections.get() != 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the connection is released");
    }

    #[test]
    fn agent_errors_map_to_upstream_statuses() {
        let status = |text: &str| DialError::Agent(text.into()).http_status();
        assert_eq!(status("dial tcp 10.0.0.1:80: i/o timeout"), 504);
        assert_eq!(status("context deadline exceeded"), 504);
        assert_eq!(status("dial tcp: socket: too many open files"), 503);
        assert_eq!(status("dial tcp 127.0.0.1:1: connect: connection refused"), 502);
        assert_eq!(DialError::NoBackend.http_status(), 500);
        assert_eq!(DialError::Timeout(Duration::from_secs(1)).http_status(), 504);
    }
}
