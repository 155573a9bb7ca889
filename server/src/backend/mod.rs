//! Backends: the agent streams connected to this server.
//!
//! Each agent stream is served by one session task ([`session`]) that owns
//! its pending dials and its connection table (the multiplexer core,
//! [`konnectivity_mux`]); frontends talk to it through a bounded command
//! channel and get [`Event`]s back on their connection's port, whose DATA is
//! bounded by the connection's receive window. DATA from a frontend goes
//! straight onto the agent's outbound queue, without a hop through the
//! session task.

pub(crate) mod registry;
pub mod resume;
pub mod session;
pub(crate) mod strategy;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use bytes::Bytes;
use futures_util::FutureExt;
use konnectivity_mux::outbound::{Outbound, Writer, outbound};
use konnectivity_mux::{Extensions, Route};
use konnectivity_proto::{AgentIdentifiers, ConnectId, DialId, DialTarget, Frame};
use tokio::sync::mpsc;

use crate::identity::Binding;
use crate::metrics::{Segment, ServerMetrics};

/// Identifies one agent stream on this server (an agent may hold several).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendId(pub u64);

/// One connected agent stream, as frontends see it.
#[derive(Debug)]
pub struct Backend {
    pub id: BackendId,
    pub agent_id: String,
    /// The identifiers dials are routed by: what the agent claimed, less
    /// what its node does not have ([`crate::admission`]); replaced when
    /// the node's Node changes.
    identifiers: RwLock<AgentIdentifiers>,
    /// The node the agent's credential names and what it claimed, when its
    /// claims are checked against that node.
    pub binding: Option<Arc<Binding>>,
    /// A control-plane agent: serves node dials only (see [`crate::policy`]).
    pub control_plane: bool,
    /// What the agent negotiated beyond upstream's protocol: flow control
    /// ([`konnectivity_mux::flow`]), resume.
    pub extensions: Extensions,
    /// Packets to the agent, in order; the gRPC response stream attached
    /// now drains it (with resume, the queue outlives a lost stream).
    pub(crate) outbound: Outbound,
    /// Requests to this stream's session task.
    commands: mpsc::Sender<Command>,
    draining: AtomicBool,
    /// The agent has an older stream open here: this one is not chosen
    /// (see [`strategy::mark_oldest`]).
    younger: AtomicBool,
    metrics: Arc<ServerMetrics>,
}

/// What a frontend asks of a backend's session.
#[derive(Debug)]
pub enum Command {
    /// Register a dial and send DIAL_REQ; the answer arrives through
    /// `route`, which becomes the connection's once the dial succeeds.
    Dial {
        dial_id: DialId,
        address: DialTarget,
        route: Route<Event>,
    },
    /// The frontend gave up on a dial it started (DIAL_CLS to the agent).
    CancelDial { dial_id: DialId },
    /// The frontend's side of a connection is gone (CLOSE_REQ to the agent).
    Close { connect_id: ConnectId },
}

/// What a backend's session tells the frontend of one connection.
#[derive(Debug)]
pub enum Event {
    Dialed(Result<ConnectId, String>),
    Data(Bytes),
    /// The connection ended; `Some` carries why, when it was not a clean close.
    Closed(Option<String>),
}

impl From<Bytes> for Event {
    fn from(data: Bytes) -> Self {
        Event::Data(data)
    }
}

/// The error text frontends see when an agent stream goes away.
pub(crate) const AGENT_DISCONNECTED: &str = "agent disconnected";

/// Packets queued towards one agent; bounds memory per agent stream (at
/// most this many packets, DATA of up to [`konnectivity_proto::DATA_CHUNK`]).
const OUTBOUND_QUEUE: usize = 256;
/// Commands queued to one session task.
const COMMAND_QUEUE: usize = 1024;

/// What an agent announced when its stream opened.
#[derive(Debug, Clone, Default)]
pub struct Announced {
    pub agent_id: String,
    /// The identifiers admitted ([`crate::admission`]).
    pub identifiers: AgentIdentifiers,
    pub binding: Option<Arc<Binding>>,
    /// Listed in `--control-plane-agent-ids` (and proven by its certificate).
    pub control_plane: bool,
    /// What it negotiated beyond upstream's protocol.
    pub extensions: Extensions,
}

/// The receiving ends of a backend's two queues.
#[derive(Debug)]
pub struct Queues {
    /// Packets for the agent: the gRPC response stream.
    pub to_agent: Writer,
    /// The frontends' commands: the stream's [`session`] serves them.
    pub commands: mpsc::Receiver<Command>,
}

/// The agent's outbound queue is gone: its stream has ended.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("{AGENT_DISCONNECTED}")]
pub struct BackendGone;

impl Backend {
    /// A backend for a stream that has just opened, and the ends of its
    /// queues for the response stream and the session to drain.
    pub fn open(id: BackendId, announced: Announced, metrics: Arc<ServerMetrics>) -> (Arc<Backend>, Queues) {
        let outbound = outbound(OUTBOUND_QUEUE);
        let to_agent = outbound.attach();
        let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE);
        let Announced {
            agent_id,
            identifiers,
            binding,
            control_plane,
            extensions,
        } = announced;
        let backend = Backend {
            id,
            agent_id,
            identifiers: RwLock::new(identifiers),
            binding,
            control_plane,
            extensions,
            outbound,
            commands: commands_tx,
            draining: AtomicBool::new(false),
            younger: AtomicBool::new(false),
            metrics,
        };
        (Arc::new(backend), Queues { to_agent, commands })
    }

    /// The identifiers dials are routed by now.
    pub fn identifiers(&self) -> RwLockReadGuard<'_, AgentIdentifiers> {
        self.identifiers.read().expect("identifiers lock poisoned")
    }

    /// Routes by `identifiers` from now on; the registry republishes what
    /// each strategy can choose ([`registry::Registry::routes_changed`]).
    pub(crate) fn set_identifiers(&self, identifiers: AgentIdentifiers) {
        *self.identifiers.write().expect("identifiers lock poisoned") = identifiers;
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the agent has an older stream open to this server.
    pub fn is_younger_stream(&self) -> bool {
        self.younger.load(Ordering::Relaxed)
    }

    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Queues a frame for the agent, waiting while the queue is full. Not an
    /// `async fn`, for the reason
    /// [`konnectivity_mux::outbound::Queueing`] gives.
    pub fn send(&self, frame: Frame) -> impl Future<Output = Result<(), BackendGone>> + Send + '_ {
        self.metrics.packet(Segment::ToAgent, frame.kind());
        self.outbound
            .send(frame.into())
            .map(|queued| queued.map_err(|_| BackendGone))
    }

    pub async fn command(&self, command: Command) -> Result<(), BackendGone> {
        self.commands.send(command).await.map_err(|_| BackendGone)
    }

    /// For `Drop` paths, which cannot await: queue now if there is room,
    /// otherwise hand the command to a task so it is never lost.
    pub fn command_from_drop(&self, command: Command) {
        match self.commands.try_send(command) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(command)) => {
                let commands = self.commands.clone();
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        let _ = commands.send(command).await;
                    });
                }
            }
            // The session has ended and already released everything.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}
