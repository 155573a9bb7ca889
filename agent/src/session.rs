//! One server stream's session: serves the server's DIAL_REQ, DATA,
//! CLOSE_REQ and DIAL_CLS, owning the stream's connection table.
//!
//! With resume (docs/resume.md) the session outlives its stream: when the
//! stream is lost, its endpoints keep running for `--resume-timeout` while
//! the agent dials the same server again, and the new stream takes over
//! after both sides have said what they hold.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use konnectivity_mux::outbound::{Ahead, Outbound, SessionSendError, Writer};
use konnectivity_mux::{Connections, Delivery, Extensions};
use konnectivity_node::handoff::{Carried, HandOff};
use konnectivity_node::sessions::{EndpointState, HandedEndpoint, HandedSession, SessionState};
use konnectivity_plumbing::lifecycle::Watcher;
use konnectivity_plumbing::limit::{Limit, Slot};
use konnectivity_proto::{ConnectId, DialId, DialTarget, Frame, Packet, PacketType, ResumeEntry};
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinHandle};
use tracing::Instrument;

use crate::endpoint::{self, DialError, EndpointClosed, ReaderEnd, WriterEnd};
use crate::metrics::{AgentMetrics, Segment, ServerDirection};
use konnectivity_telemetry::metrics::{EndReason, TunnelBytes, TunnelRecord};

/// Why a tunnel ended on this agent, and so who ended it: counted by
/// `tunnels_ended_total{reason}` and logged at -v=2. Every DIAL_REQ ends
/// exactly once, established or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TunnelEnd {
    /// The target could not be dialed (refused, timed out, no such host),
    /// or the request itself was not valid.
    DialFailed,
    /// `--max-endpoint-connections` was reached.
    Limit,
    /// The server cancelled the dial (DIAL_CLS): its client gave up.
    DialCancelled,
    /// The server closed it (CLOSE_REQ): the client's side ended.
    ServerClosed,
    /// The target closed its connection.
    TargetClosed,
    /// The target's connection failed (a reset, say).
    TargetError,
    /// The server sent more than the connection's window allowed.
    ProtocolError,
    /// The stream to the server ended: the server went away, or this agent stopped.
    ServerGone,
    /// Handed, with its session, to the agent that replaced this one.
    HandedOver,
}

impl EndReason for TunnelEnd {
    fn label(self) -> &'static str {
        match self {
            TunnelEnd::DialFailed => "dial_failed",
            TunnelEnd::Limit => "limit",
            TunnelEnd::DialCancelled => "dial_cancelled",
            TunnelEnd::ServerClosed => "server_closed",
            TunnelEnd::TargetClosed => "target_closed",
            TunnelEnd::TargetError => "target_error",
            TunnelEnd::ProtocolError => "protocol_error",
            TunnelEnd::ServerGone => "server_gone",
            TunnelEnd::HandedOver => "handed_over",
        }
    }
}

/// One span per tunnel, from DIAL_REQ to its end, as on the server: every
/// -v=2 line of the tunnel carries its ids (and, from the stream's span,
/// the server's id), so both processes' lines of one tunnel can be matched.
fn tunnel_span(dial_id: DialId, destination: &str) -> tracing::Span {
    tracing::debug_span!(
        "tunnel",
        %dial_id,
        destination,
        connect_id = tracing::field::Empty,
    )
}

/// A dial in progress on its own task.
struct PendingDial {
    task: AbortHandle,
    span: tracing::Span,
}

/// Settings a session needs from the agent's configuration.
#[derive(Clone, Debug)]
pub struct SessionSettings {
    pub dial_timeout: Duration,
    /// `--max-endpoint-connections`, shared by all of the agent's sessions.
    pub endpoint_limit: Option<Limit>,
    /// SO_MARK for endpoint dials when the node role's capture rules are
    /// installed, so the agent's own dials are never captured.
    pub mark: Option<u32>,
    /// `--resume-timeout`: how long a lost stream's connections wait for
    /// a stream that resumes them.
    pub resume_timeout: Duration,
    /// Signalled when the agent exits: the session ends its stream cleanly,
    /// so the server does not wait for a resume.
    pub stopping: Option<Watcher>,
    /// With the node role: where a successor's request for the sessions
    /// comes from (docs/handover.md, "Egress connections").
    pub handoff: Option<SessionHandOff>,
}

impl SessionSettings {
    /// A successor asked for this agent's sessions: it opens no new stream.
    pub(crate) fn handed_over(&self) -> bool {
        self.handoff
            .as_ref()
            .is_some_and(|handoff| *handoff.0.signal().borrow())
    }
}

/// The hand-over of egress sessions, as the node role runs it.
#[derive(Clone)]
pub struct SessionHandOff(pub Arc<HandOff<HandedSession>>);

impl std::fmt::Debug for SessionHandOff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionHandOff")
    }
}

/// What the session keeps with each endpoint connection in its table.
struct Endpoint {
    reader: JoinHandle<ReaderEnd>,
    /// Ends by itself once the route is dropped, after flushing what was
    /// queued; awaited only by a hand-over.
    writer: JoinHandle<WriterEnd>,
    /// Counts and logs the tunnel's end; it stays `ServerGone` when the
    /// session drops the table.
    life: TunnelRecord<TunnelEnd>,
    _gauge: GaugeGuard,
    _slot: Option<Slot>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // The writer task ends once the connection's route is dropped, after
        // flushing what was queued; the reader must be stopped explicitly.
        self.reader.abort();
    }
}

struct Dialed {
    dial_id: DialId,
    result: Result<TcpStream, DialError>,
    /// The connection's slot under --max-endpoint-connections.
    slot: Option<Slot>,
}

struct Session {
    settings: SessionSettings,
    metrics: Arc<AgentMetrics>,
    /// Packets to the server: the attached stream's writer drains it.
    outbound: Outbound,
    /// What the server agreed to beyond upstream's protocol.
    extensions: Extensions,
    next_connect_id: ConnectId,
    dials: HashMap<DialId, PendingDial>,
    endpoints: Connections<Bytes, Endpoint>,
    dialed_tx: mpsc::Sender<Dialed>,
    closed_tx: mpsc::Sender<EndpointClosed>,
    /// No stream is attached: nothing is sent (a resume rebuilds it).
    detached: bool,
    /// On a stream that resumes a lost one, until the server's RESUME list
    /// is in.
    handshake: Option<Handshake>,
    /// The server sent STREAM_END on the stream served now: its end is not
    /// a loss (with resume, an end without it is).
    peer_ended: bool,
    /// Tells every endpoint's tasks to stop for a hand-over.
    stop_endpoints: watch::Sender<bool>,
    /// A session a predecessor handed over: it serves only what it was
    /// given, and ends its stream once all of that has ended.
    retiring: bool,
}

struct Handshake {
    ahead: Ahead,
    peer: Vec<ResumeEntry>,
    lost_at: Instant,
}

/// Why the session could not queue a packet for the server.
enum StreamGone {
    /// The queue is closed: the session has ended.
    Closed,
    /// The stream's writer is gone and the queue full: the stream was lost
    /// (its connection died) and only reading it would have said so.
    Lost,
}

/// An endpoint to start: a dialed one, or one handed over.
struct StartEndpoint {
    connect_id: ConnectId,
    stream: TcpStream,
    connection: (
        konnectivity_mux::Route<Bytes>,
        konnectivity_mux::Port<Bytes>,
        konnectivity_mux::flow::SendWindow,
    ),
    tunnel: tracing::Span,
    slot: Option<Slot>,
    /// Read by the predecessor, not yet sent.
    unsent: Option<Bytes>,
    /// A packet the predecessor was writing: its length, the rest to write.
    in_hand: Option<(usize, Bytes)>,
}

/// Waits for an endpoint's task to stop, taking the closes reported meanwhile.
async fn stopping_task<T>(
    task: &mut JoinHandle<T>,
    closed_rx: &mut mpsc::Receiver<EndpointClosed>,
    closed_now: &mut HashMap<ConnectId, Option<String>>,
) -> Result<T, tokio::task::JoinError> {
    loop {
        tokio::select! {
            ended = &mut *task => return ended,
            Some(closed) = closed_rx.recv() => {
                closed_now.insert(closed.connect_id, closed.error);
            }
        }
    }
}

/// One connection of a session handed over: `closing` carries the close's
/// error when this side closed it (and no socket goes).
fn handed_endpoint(
    connect_id: ConnectId,
    position: konnectivity_mux::Position,
    unsent: Option<Bytes>,
    in_hand: Option<(usize, Bytes)>,
    socket: Option<std::os::fd::OwnedFd>,
    closing: Option<Option<String>>,
) -> HandedEndpoint {
    let unsent = unsent.unwrap_or_default();
    let (in_hand, in_hand_rest) = in_hand.unwrap_or_default();
    let mut data = bytes::BytesMut::new();
    for packet in &position.unacknowledged {
        data.extend_from_slice(packet);
    }
    data.extend_from_slice(&unsent);
    data.extend_from_slice(&in_hand_rest);
    HandedEndpoint {
        state: EndpointState {
            connect_id: connect_id.get(),
            acknowledged: position.acknowledged,
            unacknowledged: position.unacknowledged.iter().map(Bytes::len).collect(),
            unsent: unsent.len(),
            written: position.written,
            in_hand,
            in_hand_rest: in_hand_rest.len(),
            closing: closing.is_some(),
            error: closing.flatten(),
        },
        data: data.freeze(),
        socket,
    }
}

/// Packets queued towards the server.
const OUTBOUND_QUEUE: usize = 256;

/// What a session's packets arrive as.
pub type Inbound = Pin<Box<dyn futures_util::Stream<Item = Result<Packet, tonic::Status>> + Send>>;

/// A stream for the session to serve.
pub struct Attached {
    pub inbound: Inbound,
    /// Takes the writer of the stream's request body.
    pub body: oneshot::Sender<Writer>,
    /// Resolves when the stream is found dead while its inbound is still
    /// open (a probe of its connection failed).
    pub lost: Pin<Box<dyn Future<Output = StreamEnd> + Send>>,
}

/// Resolves when the agent exits; never for a session without that signal.
async fn stopping(stopping: Option<Watcher>) {
    match stopping {
        Some(stopping) => stopping.signaled().await,
        None => std::future::pending().await,
    }
}

/// The stream's body, to hand the writer to (once per stream).
fn take_body(attached: &mut Attached) -> oneshot::Sender<Writer> {
    std::mem::replace(&mut attached.body, oneshot::channel().0)
}

/// How a session outlives its stream, when the server agreed to resume.
pub struct Resume {
    /// `--resume-timeout`.
    pub timeout: Duration,
    /// Streams that resume this session; closed when the agent gives up on it.
    pub attachments: mpsc::Receiver<Attached>,
    /// Called when the stream is lost, so the agent dials again at once.
    pub on_lost: Box<dyn Fn() + Send>,
    /// What a successor needs to resume the session (its next connection
    /// id filled in when it is handed over); `None` when it cannot be.
    pub handover: Option<SessionState>,
}

/// Why a server stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    /// The server ended the stream or closed its connection: it stopped,
    /// restarted or was cut off. Servers close without a TLS close_notify
    /// when they stop, so a bare end of the connection is this, not an error.
    ServerWentAway(&'static str),
    /// Anything else: a protocol or transport error, a failed probe.
    Failed(String),
    /// The agent is exiting: it ended the stream.
    Stopping,
    /// The session went to the agent that replaced this one.
    HandedOver,
    /// A session handed over by the previous agent: all it carried ended.
    Retired,
}

impl std::fmt::Display for StreamEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamEnd::ServerWentAway(how) => f.write_str(how),
            StreamEnd::Failed(why) => f.write_str(why),
            StreamEnd::Stopping => f.write_str("the agent is exiting"),
            StreamEnd::HandedOver => f.write_str("handed to the agent that replaced this one"),
            StreamEnd::Retired => f.write_str("every connection handed over by the previous agent ended"),
        }
    }
}

impl StreamEnd {
    /// How a stream that failed with `status` ended.
    fn from_status(status: &tonic::Status) -> StreamEnd {
        if konnectivity_plumbing::net::grpc_connection_ended(status) {
            StreamEnd::ServerWentAway("the server closed the connection")
        } else {
            StreamEnd::Failed(format!("stream error: {status}"))
        }
    }
}

/// How serving one stream ended.
enum Served {
    /// The server ended the stream: the session ends.
    Ended(StreamEnd),
    /// The stream failed (reset, timeout, a failed probe): with resume, its
    /// connections wait for another.
    Lost(StreamEnd),
    /// A successor asked for the session, and it stopped where its state is
    /// whole.
    Handing,
}

/// Serves one server stream until it ends (with resume, the streams that
/// take over from it too). Dropping the session closes every endpoint
/// connection on it and abandons its pending dials.
pub async fn run(
    first: Attached,
    extensions: Extensions,
    settings: SessionSettings,
    metrics: Arc<AgentMetrics>,
    drain: Watcher,
    resume: Option<Resume>,
) -> StreamEnd {
    run_from(Start::Fresh(first), extensions, settings, metrics, drain, resume).await
}

/// Serves a session the previous agent handed over (docs/handover.md,
/// "Egress connections"): its connections run at once, its stream resumes
/// on the first stream `resume` attaches, and it drains: it carries only
/// what it was given, and ends its stream once all of that has ended.
pub async fn run_inherited(
    handed: HandedSession,
    settings: SessionSettings,
    metrics: Arc<AgentMetrics>,
    resume: Resume,
) -> StreamEnd {
    let (drain, drained) = konnectivity_plumbing::lifecycle::channel();
    drain.signal();
    run_from(
        Start::Inherited(handed),
        Extensions::Resume,
        settings,
        metrics,
        drained,
        Some(resume),
    )
    .await
}

/// How a session begins.
enum Start {
    /// On a stream that has just opened.
    Fresh(Attached),
    /// With what a predecessor handed over, detached until its stream resumes.
    Inherited(HandedSession),
}

/// Where a session stands with a successor's request for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Handing {
    /// Not asked (or it cannot be handed over).
    Idle,
    /// Asked: DRAIN went out; the session serves on until the dials the
    /// server sent before it arrived and finished, checking at `check_at`.
    Settling { check_at: tokio::time::Instant },
    /// Too late to be taken: it drains here.
    Declined,
}

/// How long a session asked for serves on after its DRAIN, so that dials
/// the server sent before it still arrive here and finish.
const SETTLE: Duration = Duration::from_millis(100);

async fn run_from(
    start: Start,
    extensions: Extensions,
    settings: SessionSettings,
    metrics: Arc<AgentMetrics>,
    drain: Watcher,
    mut resume: Option<Resume>,
) -> StreamEnd {
    let (dialed_tx, mut dialed_rx) = mpsc::channel(64);
    let (closed_tx, mut closed_rx) = mpsc::channel(64);
    let outbound = konnectivity_mux::outbound::outbound(OUTBOUND_QUEUE);
    let handoff = settings.handoff.clone();
    let mut session = Session {
        settings,
        metrics,
        outbound,
        extensions,
        next_connect_id: ConnectId::FIRST,
        dials: HashMap::new(),
        endpoints: Connections::default(),
        dialed_tx,
        closed_tx,
        detached: false,
        handshake: None,
        peer_ended: false,
        stop_endpoints: watch::Sender::new(false),
        retiring: false,
    };
    // Counted by the hand-over while it lives: a session that can resume
    // is asked for, one that cannot stays and drains.
    let resumable = extensions.resume()
        && resume
            .as_ref()
            .is_some_and(|resume| resume.handover.is_some() && !resume.timeout.is_zero());
    let mut carried: Option<Carried<HandedSession>> =
        handoff.as_ref().map(|handoff| handoff.0.carry(resumable));
    let handing_signal = match (&handoff, resumable) {
        (Some(handoff), true) => Some(handoff.0.signal()),
        _ => None,
    };
    let mut handing = Handing::Idle;
    let mut attached = match start {
        Start::Fresh(mut attached) => {
            let _ = take_body(&mut attached).send(session.outbound.attach());
            attached
        }
        Start::Inherited(handed) => {
            session.retiring = true;
            session.restore(handed);
            session.detached = true;
            let resume = resume.as_mut().expect("an inherited session resumes");
            let resumed_at = Instant::now();
            match session
                .wait_detached(resume, &mut dialed_rx, &mut closed_rx)
                .await
            {
                Some(mut attached) => {
                    session.attach(&mut attached, resumed_at);
                    attached
                }
                None => {
                    let closed = session.endpoints.len();
                    session.outbound.close();
                    return StreamEnd::Failed(format!(
                        "the session handed over by the previous agent was not resumed within {:?} \
                         (--resume-timeout); its {closed} connections closed",
                        resume.timeout
                    ));
                }
            }
        }
    };
    let reason = loop {
        // Counted while a stream is attached, not while one is awaited.
        let open = GaugeGuard::new(&session.metrics.open_server_connections);
        let served = session
            .serve(
                &mut attached,
                &mut dialed_rx,
                &mut closed_rx,
                &drain,
                (&handing_signal, &mut handing),
            )
            .await;
        let reason = match served {
            Served::Handing => {
                let promised = handoff.as_ref().is_some_and(|handoff| handoff.0.promise());
                let state = resume.as_ref().and_then(|resume| resume.handover.clone());
                match (promised, carried.take(), state) {
                    (true, Some(carried), Some(state)) => {
                        let handed = session.hand_over(state, &mut closed_rx).await;
                        carried.give(handed);
                        // Nothing more goes out on the stream, and it is not
                        // ended: the successor's resume supersedes it.
                        session.outbound.detach();
                        return StreamEnd::HandedOver;
                    }
                    (_, still_carried, _) => {
                        carried = still_carried;
                        handing = Handing::Declined;
                        continue;
                    }
                }
            }
            served => {
                session.abandon_dials();
                served
            }
        };
        let reason = match reason {
            Served::Ended(StreamEnd::Stopping) => {
                session.farewell(&mut attached).await;
                break StreamEnd::Stopping;
            }
            Served::Ended(StreamEnd::Retired) => {
                session.farewell(&mut attached).await;
                break StreamEnd::Retired;
            }
            Served::Ended(reason) => break reason,
            Served::Lost(reason) => reason,
            Served::Handing => unreachable!("handled above"),
        };
        drop(open);
        let Some(resume) = resume.as_mut().filter(|resume| !resume.timeout.is_zero()) else {
            break reason;
        };
        let lost_at = Instant::now();
        session.outbound.detach();
        // Let go of the lost stream and its connection (their probes too):
        // dropping its answer resets the stream, never ends it cleanly.
        attached.inbound = Box::pin(futures_util::stream::empty());
        attached.lost = Box::pin(std::future::pending());
        session.detached = true;
        session.handshake = None;
        tracing::info!(
            %reason,
            connections = session.endpoints.len(),
            timeout = ?resume.timeout,
            "proxy-server stream lost; its connections wait for a stream that resumes them (--resume-timeout)"
        );
        (resume.on_lost)();
        let next = session
            .wait_detached(resume, &mut dialed_rx, &mut closed_rx)
            .await;
        let Some(next) = next else {
            if session
                .settings
                .stopping
                .as_ref()
                .is_some_and(Watcher::is_signaled)
            {
                break StreamEnd::Stopping;
            }
            let closed = session.endpoints.len();
            session.metrics.resumes.timed_out.inc_by(closed as u64);
            break StreamEnd::Failed(format!(
                "{reason}; not resumed within {:?} (--resume-timeout), {closed} connections closed",
                resume.timeout
            ));
        };
        attached = next;
        session.attach(&mut attached, lost_at);
        session.peer_ended = false;
    };
    session.abandon_dials();
    session.outbound.close();
    reason
}

/// Resolves once `signal` says a successor asks; never without one.
async fn handing_requested(signal: Option<watch::Receiver<bool>>) {
    if let Some(mut signal) = signal
        && signal.wait_for(|asked| *asked).await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

impl Session {
    /// Serves one attached stream until it ends.
    async fn serve(
        &mut self,
        attached: &mut Attached,
        dialed_rx: &mut mpsc::Receiver<Dialed>,
        closed_rx: &mut mpsc::Receiver<EndpointClosed>,
        drain: &Watcher,
        (handing_signal, handing): (&Option<watch::Receiver<bool>>, &mut Handing),
    ) -> Served {
        use futures_util::StreamExt;

        // Sent once per stream, whether the drain began before this stream
        // or during it. One future for the whole stream, not one per packet.
        let drain_signaled = drain.signaled();
        tokio::pin!(drain_signaled);
        let stopping = stopping(self.settings.stopping.clone());
        tokio::pin!(stopping);
        let asked = handing_requested(handing_signal.clone());
        tokio::pin!(asked);
        let mut drained = false;
        loop {
            if self.retiring
                && self.endpoints.is_empty()
                && self.endpoints.closing_len() == 0
                && self.dials.is_empty()
                && self.handshake.is_none()
            {
                return Served::Ended(StreamEnd::Retired);
            }
            let settling = match *handing {
                Handing::Settling { check_at } => Some(check_at),
                _ => None,
            };
            let step = tokio::select! {
                () = &mut asked, if *handing == Handing::Idle && self.handshake.is_none() => {
                    *handing = Handing::Settling { check_at: tokio::time::Instant::now() + SETTLE };
                    match drained {
                        true => Ok(()),
                        false => {
                            drained = true;
                            self.send(Frame::Drain).await
                        }
                    }
                }
                () = tokio::time::sleep_until(settling.unwrap_or_else(tokio::time::Instant::now)), if settling.is_some() => {
                    if self.dials.is_empty() && self.handshake.is_none() {
                        return Served::Handing;
                    }
                    *handing = Handing::Settling { check_at: tokio::time::Instant::now() + Duration::from_millis(10) };
                    Ok(())
                }
                // Not during a resume's handshake: the queue opens only once
                // the server's RESUME list is read, and a packet waiting for
                // room in it would keep that list from ever being read.
                Some(dialed) = dialed_rx.recv(), if self.handshake.is_none() => self.on_dialed(dialed).await,
                Some(closed) = closed_rx.recv(), if self.handshake.is_none() => self.on_endpoint_closed(closed).await,
                () = &mut drain_signaled, if !drained && self.handshake.is_none() => {
                    drained = true;
                    self.send(Frame::Drain).await
                }
                end = &mut attached.lost => return Served::Lost(end),
                () = &mut stopping => return Served::Ended(StreamEnd::Stopping),
                packet = attached.inbound.next() => match packet {
                    Some(Ok(packet)) => self.on_packet(packet).await,
                    Some(Err(status)) => {
                        self.metrics.stream_errors.count(Segment::ToAgent, status.code(), None);
                        self.metrics.server_failure(ServerDirection::FromServer);
                        return match self.peer_ended {
                            true => Served::Ended(StreamEnd::ServerWentAway("the server ended the stream")),
                            false => Served::Lost(StreamEnd::from_status(&status)),
                        };
                    }
                    // With resume only STREAM_END tells a deliberate end: a
                    // connection that dies can end the stream without an error.
                    None if self.extensions.resume() && !self.peer_ended => {
                        return Served::Lost(StreamEnd::ServerWentAway(
                            "the server's stream ended without STREAM_END (its connection died)",
                        ));
                    }
                    None => return Served::Ended(StreamEnd::ServerWentAway("the server ended the stream")),
                },
            };
            match step {
                Ok(()) => {}
                Err(StreamGone::Lost) => {
                    self.metrics.server_failure(ServerDirection::ToServer);
                    return Served::Lost(StreamEnd::Failed(
                        "the stream's connection is gone (its request body was dropped) with packets still to send"
                            .to_owned(),
                    ));
                }
                Err(StreamGone::Closed) => {
                    self.metrics.server_failure(ServerDirection::ToServer);
                    return Served::Ended(StreamEnd::Failed(
                        "sending to the server failed (outbound queue closed)".to_owned(),
                    ));
                }
            }
        }
    }

    /// The agent is exiting: with resume, STREAM_END tells the server not
    /// to wait for one; the stream ends, and the server's end of it is
    /// awaited (at most a second) so that the exit cannot cut it first.
    async fn farewell(&mut self, attached: &mut Attached) {
        use futures_util::StreamExt;
        if self.extensions.resume() {
            self.outbound.try_send(Frame::StreamEnd.into());
        }
        self.outbound.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while let Some(Ok(_)) = attached.inbound.next().await {}
        })
        .await;
    }

    /// The dials in flight: the server forgets them with the stream.
    fn abandon_dials(&mut self) {
        for (_, dial) in self.dials.drain() {
            dial.task.abort();
            self.metrics
                .tunnels_ended
                .before_established(&dial.span, TunnelEnd::ServerGone, None);
        }
    }

    /// No stream: endpoints keep running (what they send waits in the
    /// queue) and those that close are kept as closing, until a stream
    /// resumes the session, the agent gives up on it, or the timeout runs out.
    async fn wait_detached(
        &mut self,
        resume: &mut Resume,
        dialed_rx: &mut mpsc::Receiver<Dialed>,
        closed_rx: &mut mpsc::Receiver<EndpointClosed>,
    ) -> Option<Attached> {
        let deadline = tokio::time::sleep(resume.timeout);
        tokio::pin!(deadline);
        let stopping = stopping(self.settings.stopping.clone());
        tokio::pin!(stopping);
        loop {
            tokio::select! {
                () = &mut stopping => return None,
                // Abandoned dials: their sockets close as they drop.
                Some(_) = dialed_rx.recv() => {}
                Some(closed) = closed_rx.recv() => {
                    let _ = self.on_endpoint_closed(closed).await;
                }
                attached = resume.attachments.recv() => return attached,
                () = &mut deadline => return None,
            }
        }
    }

    /// Takes a stream that resumes this session: our RESUME list goes out
    /// ahead of everything queued.
    fn attach(&mut self, attached: &mut Attached, lost_at: Instant) {
        let (writer, ahead) = self.outbound.attach_resuming();
        for frame in self.endpoints.resume_frames() {
            ahead.send(frame);
        }
        let _ = take_body(attached).send(writer);
        self.detached = false;
        self.handshake = Some(Handshake {
            ahead,
            peer: Vec::new(),
            lost_at,
        });
    }

    /// The server's RESUME list is complete: both sides' connections are
    /// reconciled, what the server lacks goes out ahead of the queue, which
    /// then opens.
    fn reconcile(&mut self, handshake: Handshake) {
        let Handshake { ahead, peer, lost_at } = handshake;
        let plan = self.endpoints.resume(&peer);
        let resent = plan.resent_bytes();
        for frame in plan.resend {
            ahead.send(frame);
        }
        for (connect_id, error) in plan.close_again {
            ahead.send(Frame::CloseResponse { connect_id, error });
        }
        for connect_id in plan.unknown {
            ahead.send(Frame::CloseResponse {
                connect_id,
                error: Some(format!("unknown connectID {connect_id}")),
            });
        }
        ahead.open();
        let dropped = plan.gone.len() + plan.refused.len();
        for (connect_id, mut entry) in plan.gone {
            let tunnel = entry.state.life.span();
            tunnel.in_scope(
                || tracing::debug!(%connect_id, "connection unknown to the server after the resume; closed"),
            );
            entry.state.life.set_end(TunnelEnd::ServerGone);
        }
        for (connect_id, mut entry, error) in plan.refused {
            tracing::warn!(%connect_id, %error, "connection cannot resume; closed");
            entry.state.life.set_end(TunnelEnd::ProtocolError);
        }
        let resumes = &self.metrics.resumes;
        resumes.resumed.inc_by(self.endpoints.len() as u64);
        resumes.resent_bytes.inc_by(resent as u64);
        resumes.dropped.inc_by(dropped as u64);
        resumes.duration.observe(lost_at.elapsed().as_secs_f64());
        tracing::info!(
            connections = self.endpoints.len(),
            resent_bytes = resent,
            dropped,
            after = ?lost_at.elapsed(),
            "proxy-server stream resumed"
        );
    }

    /// Queues a packet for the server. With no stream attached nothing is
    /// sent: a resume rebuilds what the server needs from the table.
    async fn send(&self, frame: Frame) -> Result<(), StreamGone> {
        if self.detached {
            return Ok(());
        }
        self.outbound
            .send_from_session(frame.into())
            .await
            .map_err(|error| match error {
                SessionSendError::Closed => StreamGone::Closed,
                SessionSendError::StreamGone => StreamGone::Lost,
            })
    }

    async fn on_packet(&mut self, packet: Packet) -> Result<(), StreamGone> {
        if let Ok(kind) = konnectivity_proto::PacketType::try_from(packet.r#type) {
            self.metrics.packet(Segment::ToAgent, kind);
        }
        let frame = match Frame::try_from(packet) {
            Ok(frame) => frame,
            Err(error) => {
                tracing::warn!(%error, "invalid packet from server");
                self.metrics.stream_errors.count(
                    Segment::ToAgent,
                    tonic::Code::InvalidArgument,
                    error.packet_type(),
                );
                return Ok(());
            }
        };
        match frame {
            Frame::Data {
                connect_id,
                data,
                offset,
            } => self.on_data(connect_id, data, offset).await?,
            Frame::WindowUpdate {
                connect_id,
                bytes,
                written,
            } => {
                if let Err((entry, error)) = self.endpoints.grant(connect_id, bytes, written) {
                    self.violation(connect_id, entry, error.to_string(), PacketType::WindowUpdate)
                        .await?;
                }
            }
            Frame::DialRequest {
                protocol,
                address,
                dial_id,
            } => self.on_dial_request(protocol, address, dial_id).await?,
            // With resume, the server's confirmation of a close of ours.
            Frame::CloseRequest { connect_id } if self.endpoints.confirm(connect_id) => {}
            Frame::CloseRequest { connect_id } => {
                let error = match self.end_endpoint(connect_id, TunnelEnd::ServerClosed) {
                    true => None,
                    false => Some(format!("unknown connectID {connect_id}")),
                };
                self.send(Frame::CloseResponse { connect_id, error }).await?;
            }
            Frame::StreamEnd => self.peer_ended = true,
            Frame::Resume { connections, last } => match &mut self.handshake {
                Some(handshake) => {
                    handshake.peer.extend(connections);
                    if last && let Some(handshake) = self.handshake.take() {
                        self.reconcile(handshake);
                    }
                }
                None => {
                    tracing::warn!("RESUME from server outside a resume");
                    self.metrics.stream_errors.count(
                        Segment::ToAgent,
                        tonic::Code::InvalidArgument,
                        Some(PacketType::Resume),
                    );
                }
            },
            Frame::CloseDial { dial_id } => {
                if let Some(dial) = self.dials.remove(&dial_id) {
                    dial.task.abort();
                    self.metrics
                        .tunnels_ended
                        .before_established(&dial.span, TunnelEnd::DialCancelled, None);
                }
            }
            unexpected => {
                tracing::warn!(kind = ?unexpected.kind(), "unexpected packet from server");
                self.metrics.stream_errors.count(
                    Segment::ToAgent,
                    tonic::Code::InvalidArgument,
                    Some(unexpected.kind()),
                );
            }
        }
        Ok(())
    }

    /// Hands DATA to its endpoint's writer. With flow control this never
    /// waits; with an upstream server it waits for a full endpoint, as
    /// upstream's agent does.
    async fn on_data(
        &mut self,
        connect_id: ConnectId,
        data: Bytes,
        offset: Option<u64>,
    ) -> Result<(), StreamGone> {
        match self.endpoints.deliver(connect_id, data, offset, || ()).await {
            // A gone writer has already reported the endpoint closed; that
            // report answers the server.
            Delivery::Delivered | Delivery::Duplicate | Delivery::ConsumerGone => Ok(()),
            Delivery::Unknown => {
                self.send(Frame::CloseResponse {
                    connect_id,
                    error: Some(format!("unknown connectID {connect_id}")),
                })
                .await
            }
            Delivery::Violation { entry, error } => {
                self.violation(connect_id, entry, error.to_string(), PacketType::Data)
                    .await
            }
        }
    }

    /// The server broke the protocol on one connection (more than its
    /// window, bytes out of order): that connection ends, the stream and
    /// its other connections carry on.
    async fn violation(
        &mut self,
        connect_id: ConnectId,
        mut entry: konnectivity_mux::Entry<Bytes, Endpoint>,
        error: String,
        kind: PacketType,
    ) -> Result<(), StreamGone> {
        tracing::warn!(%connect_id, %error, "closing connection");
        self.metrics
            .stream_errors
            .count(Segment::ToAgent, tonic::Code::ResourceExhausted, Some(kind));
        entry.state.life.set_end(TunnelEnd::ProtocolError);
        drop(entry);
        self.send(Frame::CloseResponse {
            connect_id,
            error: Some(error),
        })
        .await
    }

    async fn on_dial_request(
        &mut self,
        protocol: String,
        address: DialTarget,
        dial_id: DialId,
    ) -> Result<(), StreamGone> {
        let tunnel = tunnel_span(dial_id, address.as_str());
        tunnel.in_scope(|| tracing::debug!("dial requested"));
        let refusal = if protocol != "tcp" {
            Some(format!(
                "unsupported protocol {protocol:?}: only \"tcp\" is served"
            ))
        } else if self.dials.contains_key(&dial_id) {
            Some(format!("dial id {dial_id} is already pending"))
        } else {
            None
        };
        if let Some(error) = refusal {
            let ended = &self.metrics.tunnels_ended;
            ended.before_established(&tunnel, TunnelEnd::DialFailed, Some(&error));
            let result = Err(error);
            return self.send(Frame::DialResponse { dial_id, result }).await;
        }
        // A slot for the connection's whole life, pending dial included.
        let slot = match self
            .settings
            .endpoint_limit
            .as_ref()
            .map(|limit| limit.take("endpoint connection"))
        {
            Some(Err(refused)) => {
                self.metrics.dial_failed(crate::metrics::DialFailure::Limit);
                tracing::warn!(%address, error = %refused, "dial refused");
                let error = refused.to_string();
                let ended = &self.metrics.tunnels_ended;
                ended.before_established(&tunnel, TunnelEnd::Limit, Some(&error));
                let result = Err(error);
                return self.send(Frame::DialResponse { dial_id, result }).await;
            }
            Some(Ok(slot)) => Some(slot),
            None => None,
        };
        // Dial on its own task: the receive loop never waits for a dial.
        let timeout = self.settings.dial_timeout;
        let mark = self.settings.mark;
        let metrics = self.metrics.clone();
        let dialed = self.dialed_tx.clone();
        let dial = async move {
            let result = endpoint::dial(&address, timeout, mark, &metrics).await;
            let _ = dialed
                .send(Dialed {
                    dial_id,
                    result,
                    slot,
                })
                .await;
        };
        let task = tokio::spawn(dial.instrument(tunnel.clone()));
        let pending = PendingDial {
            task: task.abort_handle(),
            span: tunnel,
        };
        self.dials.insert(dial_id, pending);
        Ok(())
    }

    async fn on_dialed(&mut self, dialed: Dialed) -> Result<(), StreamGone> {
        let Some(PendingDial { span: tunnel, .. }) = self.dials.remove(&dialed.dial_id) else {
            // Cancelled by DIAL_CLS while connecting: dropping the stream closes it.
            return Ok(());
        };
        let stream = match dialed.result {
            Ok(stream) => stream,
            Err(DialError(error)) => {
                let ended = &self.metrics.tunnels_ended;
                ended.before_established(&tunnel, TunnelEnd::DialFailed, Some(&error));
                return self
                    .send(Frame::DialResponse {
                        dial_id: dialed.dial_id,
                        result: Err(error),
                    })
                    .await;
            }
        };
        let connect_id = self.next_connect_id;
        self.next_connect_id = connect_id.next();
        // DIAL_RSP goes out before the reader can queue any DATA.
        let answer = Frame::DialResponse {
            dial_id: dialed.dial_id,
            result: Ok(connect_id),
        };
        if let Err(gone) = self.send(answer).await {
            let ended = &self.metrics.tunnels_ended;
            ended.before_established(&tunnel, TunnelEnd::ServerGone, None);
            return Err(gone);
        }
        tunnel.record("connect_id", tracing::field::display(connect_id));
        let connection = konnectivity_mux::connection(self.extensions);
        let started = StartEndpoint {
            connect_id,
            stream,
            connection,
            tunnel,
            slot: dialed.slot,
            unsent: None,
            in_hand: None,
        };
        self.start_endpoint(started);
        Ok(())
    }

    /// Starts an endpoint's two tasks and puts it in the table.
    fn start_endpoint(&mut self, start: StartEndpoint) {
        let StartEndpoint {
            connect_id,
            stream,
            connection: (route, port, send_window),
            tunnel,
            slot,
            unsent,
            in_hand,
        } = start;
        let bytes = Arc::new(TunnelBytes::default());
        let (read, write) = stream.into_split();
        let stream = endpoint::StreamHandle {
            connect_id,
            outbound: self.outbound.clone(),
            closed: self.closed_tx.clone(),
            bytes: bytes.clone(),
            stop: self
                .settings
                .handoff
                .as_ref()
                .map(|_| self.stop_endpoints.subscribe()),
        };
        let writer = endpoint::pump_to_endpoint(write, port, stream.clone(), in_hand);
        let writer = tokio::spawn(writer.instrument(tunnel.clone()));
        let reader = endpoint::pump_from_endpoint(read, send_window, stream, unsent);
        let reader = tokio::spawn(reader.instrument(tunnel.clone()));
        self.endpoints.insert(
            connect_id,
            route,
            Endpoint {
                reader,
                writer,
                life: self
                    .metrics
                    .tunnels_ended
                    .established(tunnel, bytes, TunnelEnd::ServerGone),
                _gauge: GaugeGuard::new(&self.metrics.open_endpoint_connections),
                _slot: slot,
            },
        );
    }

    /// Stops every endpoint where its state is whole and takes the session
    /// apart for the successor: each connection's socket and where it
    /// stands, and the connections closed here and not yet confirmed.
    async fn hand_over(
        &mut self,
        mut state: SessionState,
        closed_rx: &mut mpsc::Receiver<EndpointClosed>,
    ) -> HandedSession {
        // Closes reported before the stop: the successor finishes them.
        while let Ok(closed) = closed_rx.try_recv() {
            let _ = self.on_endpoint_closed(closed).await;
        }
        self.stop_endpoints.send_replace(true);
        // Closes reported while stopping: those endpoints go as closing. Taken
        // while the tasks are awaited: a task reporting a close into a full
        // channel would otherwise never stop.
        let mut closed_now = HashMap::new();
        let mut stopped = Vec::with_capacity(self.endpoints.len());
        for (connect_id, mut entry) in self.endpoints.take_open() {
            let reader = stopping_task(&mut entry.state.reader, closed_rx, &mut closed_now).await;
            let writer = stopping_task(&mut entry.state.writer, closed_rx, &mut closed_now).await;
            stopped.push((connect_id, entry, reader, writer));
        }
        while let Ok(closed) = closed_rx.try_recv() {
            closed_now.insert(closed.connect_id, closed.error);
        }
        let mut endpoints = Vec::with_capacity(stopped.len() + self.endpoints.closing_len());
        for (connect_id, mut entry, reader, writer) in stopped {
            let position = entry.route.position().unwrap_or(konnectivity_mux::Position {
                written: 0,
                acknowledged: 0,
                unacknowledged: Vec::new(),
            });
            let halves = match (reader, writer) {
                (Ok(ReaderEnd::Stopped { read, unsent }), Ok(WriterEnd::Stopped { write, in_hand })) => read
                    .reunite(write)
                    .ok()
                    .and_then(|stream| stream.into_std().ok())
                    .map(|stream| (std::os::fd::OwnedFd::from(stream), unsent, in_hand)),
                _ => None,
            };
            let handed = match halves {
                Some((socket, unsent, in_hand)) => {
                    entry.state.life.set_end(TunnelEnd::HandedOver);
                    handed_endpoint(connect_id, position, unsent, in_hand, Some(socket), None)
                }
                // It ended while stopping: the successor closes it at the server.
                None => {
                    let error = closed_now.remove(&connect_id).flatten();
                    let reason = match error {
                        Some(_) => TunnelEnd::TargetError,
                        None => TunnelEnd::TargetClosed,
                    };
                    entry.state.life.set_end(reason);
                    let position = konnectivity_mux::Position {
                        written: 0,
                        ..position
                    };
                    handed_endpoint(connect_id, position, None, None, None, Some(error))
                }
            };
            endpoints.push(handed);
        }
        for closing in self.endpoints.take_closing() {
            let (acknowledged, unacknowledged) = closing.sent.unwrap_or_default();
            let position = konnectivity_mux::Position {
                written: 0,
                acknowledged,
                unacknowledged,
            };
            endpoints.push(handed_endpoint(
                closing.id,
                position,
                None,
                None,
                None,
                Some(closing.error),
            ));
        }
        state.next_connect_id = self.next_connect_id.get();
        HandedSession { state, endpoints }
    }

    /// Takes in a session a predecessor handed over: its connections start
    /// at once (what they send waits for the resume), those it was closing
    /// stay closing. A connection whose state does not add up is reset.
    fn restore(&mut self, handed: HandedSession) {
        if let Some(next) = ConnectId::new(handed.state.next_connect_id) {
            self.next_connect_id = next;
        }
        for endpoint in handed.endpoints {
            let (Some(parts), Some(connect_id)) =
                (endpoint.parts(), ConnectId::new(endpoint.state.connect_id))
            else {
                tracing::warn!(state = ?endpoint.state, "a connection handed over does not add up; reset");
                if let Some(socket) = endpoint.socket {
                    konnectivity_plumbing::net::reset(socket);
                }
                continue;
            };
            let state = &endpoint.state;
            let sent = (state.acknowledged, parts.unacknowledged);
            let Some(socket) = endpoint.socket.filter(|_| !state.closing) else {
                self.endpoints.insert_closing(konnectivity_mux::ClosingPosition {
                    id: connect_id,
                    error: state.error.clone(),
                    sent: Some(sent),
                });
                continue;
            };
            let stream = std::net::TcpStream::from(socket);
            let stream = match stream
                .set_nonblocking(true)
                .and_then(|()| TcpStream::from_std(stream))
            {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::warn!(%connect_id, %error, "a connection handed over cannot be served; closed");
                    continue;
                }
            };
            let window = konnectivity_mux::flow::SendWindow::restored(sent.0, sent.1);
            let connection = konnectivity_mux::restored_connection(state.written, state.in_hand, window);
            let slot = self
                .settings
                .endpoint_limit
                .as_ref()
                .and_then(|limit| limit.take("endpoint connection").ok());
            let tunnel = tracing::debug_span!("tunnel", %connect_id, handed_over = true);
            self.start_endpoint(StartEndpoint {
                connect_id,
                stream,
                connection,
                tunnel,
                slot,
                unsent: (!parts.unsent.is_empty()).then_some(parts.unsent),
                in_hand: (state.in_hand > 0).then_some((state.in_hand, parts.in_hand_rest)),
            });
        }
    }

    /// Removes an endpoint from the table because of `reason`; whether it was there.
    fn end_endpoint(&mut self, connect_id: ConnectId, reason: TunnelEnd) -> bool {
        match self.endpoints.remove(connect_id) {
            Some(mut endpoint) => {
                endpoint.state.life.set_end(reason);
                true
            }
            None => false,
        }
    }

    async fn on_endpoint_closed(&mut self, closed: EndpointClosed) -> Result<(), StreamGone> {
        // Only the first report counts; after a CLOSE_REQ the server needs none.
        let reason = match closed.error {
            None => TunnelEnd::TargetClosed,
            Some(_) => TunnelEnd::TargetError,
        };
        // With resume, kept as closing until the server confirms: what the
        // endpoint sent last must reach the server even if this stream is
        // lost. Without it no confirmation comes (upstream's servers send
        // none), so nothing is kept.
        let endpoint = match self.extensions.resume() {
            true => self.endpoints.close(closed.connect_id, closed.error.clone()),
            false => self.endpoints.remove(closed.connect_id),
        };
        if let Some(mut endpoint) = endpoint {
            if let Some(error) = &closed.error {
                let tunnel = endpoint.state.life.span();
                tunnel.in_scope(|| tracing::debug!(%error, "endpoint connection failed"));
            }
            endpoint.state.life.set_end(reason);
            drop(endpoint);
            // The error tells the client its connection was cut (a reset),
            // not ended: a reader of "everything until EOF" must not take a
            // truncated answer for a whole one. Upstream's servers and
            // clients accept the field (its Close() returns it).
            self.send(Frame::CloseResponse {
                connect_id: closed.connect_id,
                error: closed.error,
            })
            .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use konnectivity_proto::{DialId, ResumeEntry};
    use tokio_stream::wrappers::ReceiverStream;

    type ServerSide = mpsc::Sender<Result<Packet, tonic::Status>>;

    /// A stream as the server side of a test sees it: what it sends the
    /// session, what the session writes, and the stream to attach.
    fn stream() -> (ServerSide, oneshot::Receiver<Writer>, Attached) {
        let (server, inbound) = mpsc::channel(1024);
        let (body, writer) = oneshot::channel();
        let attached = Attached {
            inbound: Box::pin(ReceiverStream::new(inbound)),
            body,
            lost: Box::pin(std::future::pending()),
        };
        (server, writer, attached)
    }

    /// A resumed stream's queue opens only once the server's RESUME list is
    /// read. Endpoints that close meanwhile (more of them than the queue
    /// holds) wait for it: served first, their CLOSE_RSPs filled a queue that
    /// could not open, the session waited for room and never read the list.
    #[tokio::test]
    async fn a_resumed_session_reads_the_servers_resume_list_before_serving_closes() {
        const ENDPOINTS: usize = OUTBOUND_QUEUE + 44;
        let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = target.local_addr().unwrap().to_string();
        let (accepted_tx, mut accepted) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((socket, _)) = target.accept().await {
                let _ = accepted_tx.send(socket);
            }
        });
        let (attach, attachments) = mpsc::channel(1);
        let settings = SessionSettings {
            dial_timeout: Duration::from_secs(5),
            endpoint_limit: None,
            mark: None,
            resume_timeout: Duration::from_secs(60),
            stopping: None,
            handoff: None,
        };
        let resume = Resume {
            timeout: Duration::from_secs(60),
            attachments,
            on_lost: Box::new(|| {}),
            handover: None,
        };
        let (_drain, drained) = konnectivity_plumbing::lifecycle::channel();
        let (server, writer, first) = stream();
        tokio::spawn(run(
            first,
            Extensions::Resume,
            settings,
            Arc::new(AgentMetrics::default()),
            drained,
            Some(resume),
        ));
        let mut to_server = writer.await.unwrap();
        for n in 0..ENDPOINTS {
            let dial = Frame::DialRequest {
                protocol: "tcp".to_owned(),
                address: address.clone().into(),
                dial_id: DialId::new(n as i64 + 1),
            };
            server.send(Ok(dial.into())).await.unwrap();
        }
        let mut connections = Vec::new();
        while connections.len() < ENDPOINTS {
            if let Ok(Frame::DialResponse { result: Ok(id), .. }) =
                Frame::try_from(to_server.next().await.unwrap())
            {
                connections.push(id);
            }
        }
        let mut sockets = Vec::new();
        while sockets.len() < ENDPOINTS {
            sockets.push(accepted.recv().await.unwrap());
        }

        // The stream is lost; another resumes it, and the session sends its
        // RESUME list ahead.
        server
            .send(Err(tonic::Status::unavailable("connection reset")))
            .await
            .unwrap();
        let (server, writer, second) = stream();
        assert!(attach.send(second).await.is_ok());
        let mut to_server = writer.await.unwrap();
        loop {
            if let Ok(Frame::Resume { last: true, .. }) = Frame::try_from(to_server.next().await.unwrap()) {
                break;
            }
        }
        // Every target closes before the server's list is in.
        drop(sockets);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let list = Frame::Resume {
            connections: connections
                .iter()
                .map(|&connect_id| ResumeEntry {
                    connect_id,
                    received: 0,
                    written: 0,
                    closing: false,
                })
                .collect(),
            last: true,
        };
        server.send(Ok(list.into())).await.unwrap();
        let mut closes = 0;
        let all = tokio::time::timeout(Duration::from_secs(5), async {
            while closes < ENDPOINTS {
                // A target's end goes to the server as a CLOSE_RSP.
                if let Ok(Frame::CloseResponse { .. }) = Frame::try_from(to_server.next().await.unwrap()) {
                    closes += 1;
                }
            }
        })
        .await;
        assert!(
            all.is_ok(),
            "{closes} of {ENDPOINTS} closes sent after the RESUME list"
        );
    }
}
