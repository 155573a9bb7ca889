//! A captured connection on its own `Proxy` stream of the node tunnel,
//! which outlives that stream (docs/resume.md, "Node tunnels").
//!
//! The dial asks the server to make the stream resumable. A server that
//! agrees answers with a token; both sides then number their DATA, keep what
//! the other has not written out (at most a window per direction), and
//! acknowledge what they wrote. When the stream is lost (the tunnel's TCP
//! connection reset, or the tunnel replaced after its probes went
//! unanswered), the connection waits, and a new `Proxy` stream on the
//! current tunnel offers the token and what was received; each side sends
//! again what the other lacks, and the captured client sees a pause. A
//! server that does not agree (upstream's, or `--agent-resume-timeout=0`)
//! gets the plain protocol, and a lost stream resets the connection.
//!
//! The same state lets a connection move to the agent that replaces this
//! one ([`crate::capture::handoff`]): it stops between two packets, and the
//! successor resumes its stream as after a loss ([`continue_handed`]).

use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use konnectivity_client::{DialError, Tunnel, dial_response};
use konnectivity_mux::flow::{ReceiveCredit, ReceiveGate, SendWindow, receive_window, receive_window_from};
use konnectivity_mux::outbound::{Outbound, outbound};
use konnectivity_mux::replay::{Arrival, arrival};
use konnectivity_mux::{Extensions, Waited};
use konnectivity_plumbing::backoff::Backoff;
use konnectivity_proto::metadata::{
    AGENT_INSTANCE, RESUME, RESUME_RECEIVED, RESUME_TOKEN, SERVER_ID, instance_id,
};
use konnectivity_proto::{ConnectId, DialId, Frame, Packet};
use konnectivity_telemetry::metrics::Resumes;

use crate::capture::handoff::{ConnectionState, HandedConnection};
use crate::handoff::HandOff;
use crate::tunnel::ServerTunnels;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::sync::{oneshot, watch};
use tonic::Streaming;
use tonic::metadata::AsciiMetadataValue;

/// Packets queued towards the server on one connection's stream.
const QUEUE: usize = 64;
/// How long one attempt to resume may take before the next.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// The first pause after an attempt that failed for want of a working
/// connection, growing by half per failure up to [`RETRY_CAP`]. A new node
/// tunnel ends the pause at once: it is what the attempts wait for.
const RETRY_AFTER: Duration = Duration::from_millis(100);
const RETRY_CAP: Duration = Duration::from_secs(2);
/// How long a closed connection's stream waits for the server's end.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// What every resumable connection shares.
#[derive(Clone)]
pub(crate) struct ResumeContext {
    /// The node tunnel now; replaced when its probes go unanswered.
    pub tunnels: watch::Receiver<Option<Tunnel>>,
    /// `--resume-timeout`; zero asks for nothing.
    pub timeout: Duration,
    pub metrics: Resumes,
    /// Where a connection goes when a successor takes them over.
    pub handoff: Arc<HandOff<HandedConnection>>,
    /// Connections to the server a stream lives at, when the node tunnel
    /// reached another.
    pub servers: Arc<ServerTunnels>,
}

/// How a relayed connection ended, when nothing failed.
pub(crate) enum Ended {
    /// Either side closed it.
    Closed,
    /// It went to the agent that replaces this one: leave the socket be.
    HandedOver,
}

/// A dialed connection and its stream.
pub(crate) struct Dialed {
    connect_id: ConnectId,
    queue: Outbound,
    inbound: Streaming<Packet>,
    /// The server's token, when it made the stream resumable.
    token: Option<AsciiMetadataValue>,
}

/// Dials `target` on `tunnel`, asking for a resumable stream when the
/// context allows it.
pub(crate) async fn dial(
    tunnel: &Tunnel,
    target: &str,
    context: &ResumeContext,
    timeout: Duration,
) -> Result<Dialed, DialError> {
    let dial_id = DialId::random();
    let queue = outbound(QUEUE);
    let request = Frame::DialRequest {
        protocol: "tcp".to_owned(),
        address: target.into(),
        dial_id,
    };
    queue.try_send(request.into());
    // With resume, this process's id: should it die, the server ends the
    // streams it held as soon as the next agent on this node opens one,
    // rather than waiting for a resume that cannot come.
    let headers = match context.timeout.is_zero() {
        true => Vec::new(),
        false => vec![
            (RESUME, AsciiMetadataValue::from_static("1")),
            (AGENT_INSTANCE, AsciiMetadataValue::from_static(instance_id())),
        ],
    };
    let handshake = async {
        let (mut inbound, headers) = tunnel
            .open(headers, queue.attach())
            .await
            .map_err(|status| DialError::TunnelClosed(status.to_string()))?;
        let connect_id = dial_response(&mut inbound, dial_id).await?;
        Ok((connect_id, inbound, headers.get(RESUME_TOKEN).cloned()))
    };
    match tokio::time::timeout(timeout, handshake).await {
        Ok(Ok((connect_id, inbound, token))) => Ok(Dialed {
            connect_id,
            queue,
            inbound,
            token,
        }),
        Ok(Err(error)) => {
            queue.close();
            Err(error)
        }
        Err(_) => {
            // Still pending on the server: cancel it there.
            queue.try_send(Frame::CloseDial { dial_id }.into());
            queue.close();
            Err(DialError::Timeout(timeout))
        }
    }
}

/// Why a relayed connection ended other than cleanly.
type Failure = String;

/// What a relay starts from: a dialed stream, or a connection handed over
/// by the previous agent (no stream yet).
struct Start {
    connect_id: ConnectId,
    queue: Outbound,
    inbound: Option<Streaming<Packet>>,
    token: Option<AsciiMetadataValue>,
    window: SendWindow,
    gate: ReceiveGate,
    credit: ReceiveCredit,
    close_requested: bool,
    /// Read from the client and not yet sent.
    unsent: Option<Bytes>,
    /// Told how the first resume went (a connection handed over).
    taken_over: Option<oneshot::Sender<Result<(), Failure>>>,
}

/// Carries `socket` over the dialed stream until either side closes it, or
/// it is handed to the agent that replaces this one. An error (the socket
/// is then reset by the caller) when it failed or could not be resumed.
///
/// Not an `async fn`: one would keep `dialed` and `context` in the task
/// beside the state built from them, for as long as the connection lives.
pub(crate) fn relay(
    socket: &mut TcpStream,
    dialed: Dialed,
    context: ResumeContext,
) -> impl Future<Output = Result<Ended, Failure>> + '_ {
    let Dialed {
        connect_id,
        queue,
        inbound,
        token,
    } = dialed;
    let extensions = match token {
        Some(_) => Extensions::Resume,
        None => Extensions::Upstream,
    };
    let (gate, credit) = receive_window(extensions);
    let start = Start {
        connect_id,
        queue,
        inbound: Some(inbound),
        token,
        window: SendWindow::new(extensions),
        gate,
        credit,
        close_requested: false,
        unsent: None,
        taken_over: None,
    };
    run(socket, start, context)
}

/// A connection the previous agent handed over, ready to carry on.
pub(crate) struct Handed(Start);

impl Handed {
    /// Its state, checked.
    pub(crate) fn new(
        state: ConnectionState,
        packets: Vec<Bytes>,
        unsent: Option<Bytes>,
    ) -> Result<Handed, Failure> {
        let connect_id = ConnectId::new(state.connect_id)
            .ok_or_else(|| format!("connectID {} is not one", state.connect_id))?;
        let token = AsciiMetadataValue::try_from(state.token.as_str())
            .map_err(|_| "the token handed over is unreadable".to_owned())?;
        let (gate, credit) = receive_window_from(state.written);
        Ok(Handed(Start {
            connect_id,
            queue: outbound(QUEUE),
            inbound: None,
            token: Some(token),
            window: SendWindow::restored(state.acknowledged, packets),
            gate,
            credit,
            close_requested: state.close_requested,
            unsent,
            taken_over: None,
        }))
    }
}

/// Carries on a connection the previous agent handed over: its stream is
/// resumed on this agent's node tunnel first, as after a loss, and
/// `taken_over` hears how that went.
pub(crate) fn continue_handed(
    socket: &mut TcpStream,
    handed: Handed,
    taken_over: oneshot::Sender<Result<(), Failure>>,
    context: ResumeContext,
) -> impl Future<Output = Result<Ended, Failure>> + '_ {
    let mut start = handed.0;
    start.taken_over = Some(taken_over);
    run(socket, start, context)
}

fn run(
    socket: &mut TcpStream,
    start: Start,
    context: ResumeContext,
) -> impl Future<Output = Result<Ended, Failure>> + '_ {
    let Start {
        connect_id,
        queue,
        inbound,
        token,
        window,
        gate,
        credit,
        close_requested,
        mut unsent,
        taken_over,
    } = start;
    let close_requested = Arc::new(AtomicBool::new(close_requested));
    let carried = context.handoff.carry(token.is_some());
    let handing = context.handoff.signal();
    let mut down = Down {
        connect_id,
        queue: queue.clone(),
        inbound,
        own_server: None,
        token,
        window: window.clone(),
        gate,
        credit,
        handing,
        context,
        close_requested: close_requested.clone(),
        taken_over,
    };
    async move {
        let outcome = {
            let (read, write) = socket.split();
            let up = up(
                read,
                connect_id,
                queue.clone(),
                window.clone(),
                close_requested.clone(),
                &mut unsent,
            );
            tokio::select! {
                outcome = down.run(write) => outcome,
                // Only a queue closed ends it: the stream's side decides the rest.
                () = up => Err("the connection's stream ended".to_owned()),
            }
        };
        match outcome {
            Ok(Stopped::HandOver(socket)) => {
                carried.give(down.handed(socket, unsent));
                Ok(Ended::HandedOver)
            }
            Ok(Stopped::Closed) => {
                // Its writer sends what is queued, then ends the stream cleanly.
                queue.close();
                // Boxed: inline, the wait (and the session it takes) would
                // sit in every captured connection's task for its life.
                Box::pin(down.finish()).await;
                Ok(Ended::Closed)
            }
            Err(failure) => {
                queue.close();
                Err(failure)
            }
        }
    }
}

/// Why [`Down::run`] returned without a failure.
enum Stopped {
    Closed,
    /// Promised to the successor, with a copy of the client's socket.
    HandOver(OwnedFd),
}

/// The captured client's bytes, numbered (with resume) and queued for the
/// server. They wait for window credit, never for a stream: the queue
/// outlives each stream under it. On the client's end of stream, CLOSE_REQ
/// (the protocol has no half-close).
///
/// What was read and waits for credit sits in `unsent`, so that a hand-over
/// that stops this task takes it along; a packet numbered is kept for
/// replay, so stopping while it is queued loses nothing either.
async fn up(
    read: ReadHalf<'_>,
    connect_id: ConnectId,
    queue: Outbound,
    window: SendWindow,
    close_requested: Arc<AtomicBool>,
    unsent: &mut Option<Bytes>,
) {
    // A connection handed over after its client closed has nothing to read.
    while !close_requested.load(Ordering::Acquire) {
        let data = match unsent.take() {
            Some(data) => data,
            None => {
                if read.readable().await.is_err() {
                    break;
                }
                // A buffer the size of each read: an idle connection holds
                // none, and a small packet kept for replay pins no large
                // buffer.
                match konnectivity_mux::chunk::read_ready(
                    |first| read.try_read(first),
                    |more| read.try_read_buf(more),
                ) {
                    Ok(None) => break,
                    Ok(Some(data)) => data,
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => break,
                }
            }
        };
        let len = data.len();
        *unsent = Some(data);
        if window.reserve(len).await.is_err() {
            return std::future::pending().await;
        }
        let data = unsent.take().expect("kept across the wait for credit");
        let frame = window.data(connect_id, data);
        if queue.send(frame.into()).await.is_err() {
            return;
        }
    }
    if !close_requested.swap(true, Ordering::AcqRel) {
        let _ = queue.send(Frame::CloseRequest { connect_id }.into()).await;
    }
    // The answer (CLOSE_RSP) ends the relay.
    std::future::pending().await
}

/// The server's side: its DATA to the client, its acknowledgements, and the
/// stream itself, resumed when it is lost.
struct Down {
    connect_id: ConnectId,
    queue: Outbound,
    /// `None` until a connection handed over is first resumed.
    inbound: Option<Streaming<Packet>>,
    /// The connection to the server this stream lives at, when the node
    /// tunnel reached another (see [`ServerTunnels`]); `None`: the stream
    /// is on the node tunnel.
    own_server: Option<Arc<Tunnel>>,
    token: Option<AsciiMetadataValue>,
    window: SendWindow,
    gate: ReceiveGate,
    credit: ReceiveCredit,
    /// `true` once a successor asks for the connections.
    handing: watch::Receiver<bool>,
    context: ResumeContext,
    close_requested: Arc<AtomicBool>,
    taken_over: Option<oneshot::Sender<Result<(), Failure>>>,
}

impl Down {
    async fn run(&mut self, mut write: WriteHalf<'_>) -> Result<Stopped, Failure> {
        // Only a tunnel replaced from now on means this stream is lost.
        self.context.tunnels.mark_unchanged();
        if self.inbound.is_none() {
            let resumed = Box::pin(self.lost("handed over by the previous agent".to_owned())).await;
            if let Some(taken_over) = self.taken_over.take() {
                let _ = taken_over.send(resumed.clone());
            }
            resumed?;
        }
        // A successor that asked while this connection was being dialed.
        if *self.handing.borrow_and_update()
            && let Some(socket) = self.stop_for_successor(&write)
        {
            return Ok(Stopped::HandOver(socket));
        }
        loop {
            let inbound = self.inbound.as_mut().expect("a stream is attached");
            let next = tokio::select! {
                waited = self.credit.or_quiet(inbound.message()) => match waited {
                    Waited::Arrived(next) => next,
                    // The server may drop what it kept for replay.
                    Waited::Quiet(credit) => {
                        let _ = self.queue.send(credit.frame(self.connect_id).into()).await;
                        continue;
                    }
                },
                // The tunnel was replaced (its probes went unanswered): this
                // stream's connection is as good as gone, unless the stream
                // is on a connection of its own.
                Ok(()) = self.context.tunnels.changed(), if self.token.is_some() && self.own_server.is_none() => {
                    Err(tonic::Status::unavailable("the node tunnel was replaced"))
                }
                // A successor takes the connections: here, between two
                // packets, nothing is half written to the client.
                Ok(()) = self.handing.changed(), if self.token.is_some() => {
                    if let Some(socket) = self.stop_for_successor(&write) {
                        return Ok(Stopped::HandOver(socket));
                    }
                    continue;
                }
            };
            // Boxed: rare, and its state would otherwise sit in every
            // captured connection's task.
            let packet = match next {
                Ok(Some(packet)) => packet,
                Ok(None) => {
                    Box::pin(self.lost("the tunnel stream ended without CLOSE_RSP".to_owned())).await?;
                    continue;
                }
                Err(status) => {
                    Box::pin(self.lost(format!("the tunnel stream failed: {status}"))).await?;
                    continue;
                }
            };
            match Frame::try_from(packet) {
                Ok(Frame::Data {
                    connect_id,
                    data,
                    offset,
                }) if connect_id == self.connect_id => {
                    if self.token.is_some() {
                        let offset = offset.ok_or("DATA without an offset on a resumable stream")?;
                        match arrival(self.gate.written(), offset, data.len())
                            .map_err(|gap| gap.to_string())?
                        {
                            Arrival::Next => self
                                .gate
                                .admit_negotiated(data.len())
                                .map_err(|e| e.to_string())?,
                            Arrival::Duplicate => continue,
                        }
                    }
                    write.write_all(&data).await.map_err(|error| error.to_string())?;
                    if let Some(credit) = self.credit.consumed(data.len()) {
                        let _ = self.queue.send(credit.frame(self.connect_id).into()).await;
                    }
                }
                Ok(Frame::WindowUpdate {
                    connect_id,
                    bytes,
                    written,
                }) if connect_id == self.connect_id => {
                    self.window
                        .grant(bytes, written)
                        .map_err(|error| error.to_string())?;
                }
                Ok(Frame::CloseResponse { error: None, .. }) => {
                    let _ = write.shutdown().await;
                    return Ok(Stopped::Closed);
                }
                Ok(Frame::CloseResponse {
                    error: Some(error), ..
                }) => return Err(error),
                Ok(other) => tracing::warn!(kind = ?other.kind(), "unexpected packet on a tunnel stream"),
                Err(error) => tracing::warn!(%error, "invalid packet on a tunnel stream"),
            }
        }
    }

    /// Stops for the successor, if it still takes connections: a copy of
    /// the client's socket (taken before the promise, so a promise is always
    /// kept). `None`: carry on here.
    fn stop_for_successor(&self, write: &WriteHalf<'_>) -> Option<OwnedFd> {
        // Only a stream the successor can resume.
        self.token.as_ref()?;
        let socket: &TcpStream = write.as_ref();
        let copy = match socket.as_fd().try_clone_to_owned() {
            Ok(copy) => copy,
            Err(error) => {
                tracing::warn!(connect_id = self.connect_id.get(), %error, "cannot hand a captured connection over; it stays");
                return None;
            }
        };
        self.context.handoff.promise().then_some(copy)
    }

    /// After CLOSE_RSP, with the queue closed (the stream ends cleanly): a
    /// resumable stream's server keeps the session until it sees that end,
    /// then ends its side. Waited for, briefly, rather than dropped: a
    /// dropped stream is reset, and the server would wait for a resume.
    async fn finish(mut self) {
        if self.token.is_none() {
            return;
        }
        if let Some(mut inbound) = self.inbound.take() {
            let _ = tokio::time::timeout(CLOSE_WAIT, async {
                while let Ok(Some(_)) = inbound.message().await {}
            })
            .await;
        }
    }

    /// The connection, stopped for the successor with `socket` (a copy of
    /// the client's) and `unsent` (read from the client, not yet sent), as
    /// it goes to the successor.
    ///
    /// This agent sends nothing more on the stream, and keeps it open until
    /// the server ends it (once the successor resumed the connection, when
    /// the connection ends) or this agent exits. Ended now, it would leave
    /// the connection waiting for a resume at the server, where the
    /// successor's first new stream would take it for a crashed agent's
    /// (docs/resume.md) and close it.
    fn handed(self, socket: OwnedFd, unsent: Option<Bytes>) -> HandedConnection {
        // A stream with a token negotiated resume: its window keeps what
        // was sent.
        let (acknowledged, packets) = self.window.position().unwrap_or_default();
        let state = ConnectionState {
            connect_id: self.connect_id.get(),
            token: self
                .token
                .as_ref()
                .and_then(|token| token.to_str().ok())
                .unwrap_or_default()
                .to_owned(),
            acknowledged,
            unacknowledged: packets.iter().map(Bytes::len).collect(),
            unsent: unsent.as_ref().map_or(0, Bytes::len),
            written: self.gate.written(),
            close_requested: self.close_requested.load(Ordering::Acquire),
        };
        // One buffer: thousands of tiny packets, each a buffer of its own,
        // would cost far more than their bytes on the way.
        let mut data = BytesMut::with_capacity(state.data_len());
        for packet in packets.iter().chain(&unsent) {
            data.extend_from_slice(packet);
        }
        self.hold_stream();
        HandedConnection {
            state,
            data: data.freeze(),
            socket,
        }
    }

    /// See [`Down::handed`].
    fn hold_stream(self) {
        self.queue.detach();
        if let Some(mut inbound) = self.inbound {
            // The connection the stream is on, when it is one of its own.
            let (queue, own_server) = (self.queue, self.own_server);
            tokio::spawn(async move {
                let _held = (queue, own_server);
                while let Ok(Some(_)) = inbound.message().await {}
            });
        }
    }

    /// The stream is lost: resume on the current tunnel (or on a connection
    /// to the token's server, when the tunnel reached another) within the
    /// resume timeout, or fail with `why`.
    async fn lost(&mut self, why: String) -> Result<(), Failure> {
        let Some(token) = self.token.clone() else {
            return Err(why);
        };
        self.queue.detach();
        let lost_at = Instant::now();
        let deadline = lost_at + self.context.timeout;
        let mut backoff = Backoff::new(RETRY_AFTER, RETRY_CAP);
        tracing::debug!(connect_id = self.connect_id.get(), %why, "captured connection's stream lost; resuming it");
        let server = token_server(&token);
        // Connections of the same server that went before found it already.
        if self.own_server.is_none() {
            self.own_server = server.and_then(|server| self.context.servers.existing(server));
        }
        loop {
            if Instant::now() >= deadline {
                self.context.metrics.timed_out.inc();
                return Err(format!(
                    "{why}; not resumed within --resume-timeout ({:?})",
                    self.context.timeout
                ));
            }
            let tunnel = match &self.own_server {
                Some(own) => Some(Tunnel::clone(own)),
                None => self.context.tunnels.borrow_and_update().clone(),
            };
            let Some(tunnel) = tunnel else {
                wait_for_tunnel(&mut self.context.tunnels, None, deadline).await;
                continue;
            };
            match tokio::time::timeout(ATTEMPT_TIMEOUT, self.attach(&tunnel, &token)).await {
                Ok(Ok(resent)) => {
                    self.context.metrics.resumed.inc();
                    self.context.metrics.resent_bytes.inc_by(resent as u64);
                    self.context
                        .metrics
                        .duration
                        .observe(lost_at.elapsed().as_secs_f64());
                    tracing::debug!(connect_id = self.connect_id.get(), resent, after = ?lost_at.elapsed(), "captured connection resumed");
                    return Ok(());
                }
                Ok(Err(Attempt::Refused(reason))) => {
                    self.context.metrics.dropped.inc();
                    return Err(format!("{why}; the resume was refused: {reason}"));
                }
                // Behind one address, the connection reached another server
                // than the stream's: resume on one that reaches it.
                Ok(Err(Attempt::OtherServer(reached))) => {
                    let Some(server) = server else {
                        self.context.metrics.dropped.inc();
                        return Err(format!(
                            "{why}; server {reached} refused a token that names no server"
                        ));
                    };
                    let found = self
                        .context
                        .servers
                        .to(server, self.own_server.as_ref(), deadline)
                        .await;
                    match found {
                        Ok(own) => self.own_server = Some(own),
                        Err(error) => {
                            self.context.metrics.dropped.inc();
                            return Err(format!(
                                "{why}; the stream lives at server {server}, the node tunnel reached {reached}, and {error}"
                            ));
                        }
                    }
                }
                Ok(Err(Attempt::Failed(error))) => {
                    tracing::debug!(connect_id = self.connect_id.get(), %error, "resume attempt failed");
                    let pause = spread(backoff.next_delay(), self.connect_id);
                    wait_for_tunnel(&mut self.context.tunnels, Some(pause), deadline).await;
                }
                Err(_) => {
                    tracing::debug!(connect_id = self.connect_id.get(), "resume attempt timed out");
                    let pause = spread(backoff.next_delay(), self.connect_id);
                    wait_for_tunnel(&mut self.context.tunnels, Some(pause), deadline).await;
                }
            }
        }
    }

    /// One attempt: a new stream offering the token and what was received;
    /// then what the server lacks goes ahead of everything queued.
    async fn attach(&mut self, tunnel: &Tunnel, token: &AsciiMetadataValue) -> Result<usize, Attempt> {
        let (writer, ahead) = self.queue.attach_resuming();
        let received = AsciiMetadataValue::try_from(self.gate.written().to_string())
            .map_err(|_| Attempt::Refused("unreadable byte count".to_owned()))?;
        let headers = vec![(RESUME_TOKEN, token.clone()), (RESUME_RECEIVED, received)];
        let (inbound, answer) = match tunnel.open(headers, writer).await {
            Ok(opened) => opened,
            Err(status) => {
                // Refused by a server that names itself, not the token's.
                let reached = status
                    .metadata()
                    .get(SERVER_ID)
                    .and_then(|value| value.to_str().ok())
                    .filter(|reached| Some(*reached) != token_server(token));
                if let Some(reached) = reached {
                    return Err(Attempt::OtherServer(reached.to_owned()));
                }
                return Err(match status.code() {
                    tonic::Code::NotFound
                    | tonic::Code::PermissionDenied
                    | tonic::Code::InvalidArgument
                    | tonic::Code::OutOfRange => Attempt::Refused(status.message().to_owned()),
                    _ => Attempt::Failed(status.to_string()),
                });
            }
        };
        let server_received = answer
            .get(RESUME_RECEIVED)
            .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
            .ok_or_else(|| Attempt::Refused(format!("the server's answer has no {RESUME_RECEIVED}")))?;
        let resend = self
            .window
            .grant(0, Some(server_received))
            .and_then(|()| self.window.resend_since(self.connect_id, server_received))
            .map_err(|error| Attempt::Refused(error.to_string()))?;
        let mut resent = 0;
        for frame in resend {
            if let Frame::Data { data, .. } = &frame {
                resent += data.len();
            }
            ahead.send(frame);
        }
        // A CLOSE_REQ queued for the lost stream was dropped with it.
        if self.close_requested.load(Ordering::Acquire) {
            ahead.send(Frame::CloseRequest {
                connect_id: self.connect_id,
            });
        }
        ahead.open();
        self.inbound = Some(inbound);
        Ok(resent)
    }
}

/// Waits until the node tunnel is replaced, `pause` has passed (`None`:
/// no limit) or `deadline` comes, whichever is first. A lost connection
/// waits here rather than polling: every captured connection of a node
/// loses its stream at once, and their attempts must not hammer a server
/// that is restarting.
async fn wait_for_tunnel(
    tunnels: &mut watch::Receiver<Option<Tunnel>>,
    pause: Option<Duration>,
    deadline: Instant,
) {
    let until = match pause {
        Some(pause) => deadline.min(Instant::now() + pause),
        None => deadline,
    };
    tokio::select! {
        _ = tokio::time::sleep_until(until.into()) => {}
        // A closed watch (the agent is stopping) waits out the pause.
        Ok(()) = tunnels.changed() => {}
    }
}

/// `delay` spread over [0.5, 1.5) of itself by the connection's id, so the
/// connections of one node, lost together, do not retry in step.
fn spread(delay: Duration, connect_id: ConnectId) -> Duration {
    // The fractional part of id × the golden ratio: consecutive ids land
    // far apart in [0, 1).
    let fraction = (connect_id.get() as f64 * 0.618_033_988_749_895).fract();
    delay.mul_f64(0.5 + fraction)
}

/// How one attempt to resume went.
enum Attempt {
    /// The server will not resume it (it no longer has the connection, say).
    Refused(String),
    /// No answer (no connection yet): try again.
    Failed(String),
    /// The connection reached this server, which is not the token's.
    OtherServer(String),
}

/// The server a token names (`<session><secret>@<server id>`).
fn token_server(token: &AsciiMetadataValue) -> Option<&str> {
    token.to_str().ok()?.rsplit_once('@').map(|(_, server)| server)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_of_one_nodes_connections_are_spread_not_in_step() {
        let delay = Duration::from_millis(1000);
        let pauses: Vec<Duration> = (1..=20)
            .map(|id| spread(delay, ConnectId::new(id).unwrap()))
            .collect();
        assert!(
            pauses.iter().all(|p| *p >= delay / 2 && *p < delay * 3 / 2),
            "{pauses:?}"
        );
        // Every pair at least a few milliseconds apart.
        let mut sorted = pauses.clone();
        sorted.sort();
        assert!(
            sorted.windows(2).all(|w| w[1] - w[0] >= Duration::from_millis(5)),
            "{sorted:?}"
        );
    }

    #[tokio::test]
    async fn a_lost_connection_waits_for_a_new_tunnel_not_a_poll() {
        let (sender, mut tunnels) = watch::channel(None);
        tunnels.mark_unchanged();
        let far = Instant::now() + Duration::from_secs(60);
        // Nothing changes: the pause is what ends the wait.
        let started = Instant::now();
        wait_for_tunnel(&mut tunnels, Some(Duration::from_millis(50)), far).await;
        assert!(started.elapsed() >= Duration::from_millis(50));
        // No pause: only a new tunnel ends the wait (here, a minute away).
        let waiting = tokio::spawn(async move {
            let started = Instant::now();
            wait_for_tunnel(&mut tunnels, None, far).await;
            started.elapsed()
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished());
        sender.send(None).unwrap();
        let waited = waiting.await.unwrap();
        assert!(waited < Duration::from_secs(10), "{waited:?}");
        // The deadline ends it too.
        let (_sender, mut tunnels) = watch::channel::<Option<Tunnel>>(None);
        tunnels.mark_unchanged();
        wait_for_tunnel(&mut tunnels, None, Instant::now() + Duration::from_millis(20)).await;
    }
}
