//! One agent stream's session: the task that owns its pending dials and its
//! connection table and routes every packet the agent sends.
//!
//! With resume (docs/resume.md) the session outlives its stream: when the
//! stream is lost it keeps its connections for `--agent-resume-timeout`,
//! and a new stream from the same agent takes over, after both sides have
//! said what they hold.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use konnectivity_mux::outbound::{Ahead, SessionSendError};
use konnectivity_mux::{Connections, Delivery, Route};
use konnectivity_proto::{ConnectId, DialId, Frame, Packet, PacketType, ResumeEntry};
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::sync::mpsc;

use super::registry::Registry;
use super::resume::{Attachment, Inbound, Takeover, Ticket};
use super::{AGENT_DISCONNECTED, Backend, Command, Event};
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
    /// On a stream that resumes a lost one, until the agent's RESUME list
    /// is in: what goes out ahead of the queue, and the list so far.
    handshake: Option<Handshake>,
    /// The agent sent STREAM_END on the stream served now: its end is not
    /// a loss (with resume, an end without it is).
    peer_ended: bool,
    /// Told when the agent drains: which of its streams is chosen changes.
    registry: Arc<Registry>,
}

struct Handshake {
    ahead: Ahead,
    peer: Vec<ResumeEntry>,
    lost_at: Instant,
}

/// How the session outlives its stream, when the agent negotiated resume.
pub struct Resume {
    pub ticket: Ticket,
    /// `--agent-resume-timeout`.
    pub timeout: Duration,
}

/// How waiting without a stream ended.
enum Detached {
    Resumed(Attachment),
    TimedOut,
    Restarted,
}

/// How serving one stream ended.
enum Served {
    /// The agent ended the stream: the session ends.
    Ended(String),
    /// The stream failed (reset, timeout, protocol error): with resume, its
    /// connections wait for another.
    Lost(String),
    /// Another stream of the agent's took over (it knew this one lost
    /// before we did).
    Superseded(Attachment),
}

/// Serves one agent stream until it ends (with resume, the streams that
/// take over from it too), then releases everything on it: pending dials
/// fail (upstream leaked them, its issue #126) and every connection's
/// frontend sees its event channel close.
pub async fn run<S>(
    backend: Arc<Backend>,
    inbound: S,
    mut commands: mpsc::Receiver<Command>,
    registry: Arc<Registry>,
    metrics: Arc<ServerMetrics>,
    mut resume: Option<Resume>,
) where
    S: futures_util::Stream<Item = Result<Packet, tonic::Status>> + Send + 'static,
{
    let mut session = Session {
        backend: backend.clone(),
        metrics,
        pending: HashMap::new(),
        connections: Connections::default(),
        handshake: None,
        peer_ended: false,
        registry: registry.clone(),
    };
    let mut inbound: Inbound = Box::pin(inbound);
    let reason = loop {
        let attachments = resume.as_mut().map(|resume| &mut resume.ticket.attachments);
        let served = session.serve(&mut inbound, &mut commands, attachments).await;
        session.fail_pending_dials();
        let (reason, superseded) = match served {
            Served::Ended(reason) => break reason,
            Served::Lost(reason) => (reason, None),
            Served::Superseded(attachment) => (
                "another stream of the agent took over".to_owned(),
                Some(attachment),
            ),
        };
        let Some(resume) = resume.as_mut() else {
            break reason;
        };
        if resume.timeout.is_zero() {
            break reason;
        }
        let lost_at = Instant::now();
        registry.remove(&backend);
        backend.outbound.detach();
        // Let go of the lost stream now, not when the next one comes.
        drop(std::mem::replace(
            &mut inbound,
            Box::pin(futures_util::stream::empty()),
        ));
        session.handshake = None;
        tracing::info!(
            agent_id = %backend.agent_id,
            %reason,
            connections = session.connections.len(),
            timeout = ?resume.timeout,
            "agent stream lost; its connections wait for the agent to resume them (--agent-resume-timeout)"
        );
        let attachment = match superseded {
            Some(attachment) => Detached::Resumed(attachment),
            None => session.wait_detached(&mut commands, resume).await,
        };
        let attachment = match attachment {
            Detached::Resumed(attachment) => attachment,
            Detached::TimedOut => {
                let closed = session.connections.len();
                session.metrics.resumes.timed_out.inc_by(closed as u64);
                break format!(
                    "{reason}; no stream resumed it within {:?} (--agent-resume-timeout), {closed} connections closed",
                    resume.timeout
                );
            }
            Detached::Restarted => {
                break format!(
                    "{reason}; the agent restarted (a new stream from it carried no resume token), {} connections \
                     closed",
                    session.connections.len()
                );
            }
        };
        inbound = session.attach(attachment, lost_at);
        session.peer_ended = false;
        registry.add(backend.clone());
    };
    tracing::info!(agent_id = %backend.agent_id, %reason, "agent stream ended");
    registry.remove(&backend);
    backend.outbound.close();
    // Dials queued after the last loop turn fail too: dropping their event
    // senders tells the frontends the agent is gone.
    commands.close();
    while commands.try_recv().is_ok() {}
    session.fail_pending_dials();
    session.connections.clear();
}

impl Session {
    /// Serves `inbound` and the frontends' commands until the stream ends.
    async fn serve(
        &mut self,
        inbound: &mut Inbound,
        commands: &mut mpsc::Receiver<Command>,
        mut attachments: Option<&mut konnectivity_mux::mailbox::Receiver<Takeover>>,
    ) -> Served {
        use futures_util::StreamExt;
        loop {
            let next_attachment = async {
                loop {
                    match attachments.as_mut() {
                        Some(attachments) => match attachments.recv().await {
                            // Taken, it would supersede the live stream for
                            // one nobody reads.
                            Some(Takeover::Resume(attachment)) if attachment.abandoned() => continue,
                            Some(Takeover::Resume(attachment)) => return Some(attachment),
                            // This session's stream is alive: another stream
                            // of the same agent is no restart of its.
                            Some(Takeover::Restarted) => continue,
                            None => return None,
                        },
                        None => std::future::pending().await,
                    }
                }
            };
            // Commands first: a Dial command is always registered before the
            // DIAL_RSP that answers it can be read. Not during a resume's
            // handshake: the queue opens only once the agent's RESUME list is
            // read, and a command's packet waiting for room in it would keep
            // that list from ever being read (the 5,000-node run: three
            // control-plane agents' sessions resumed and then sent nothing, a
            // flood of dials queued ahead of the list).
            let step = tokio::select! {
                biased;
                Some(command) = commands.recv(), if self.handshake.is_none() => self.on_command(command).await,
                Some(attachment) = next_attachment => return Served::Superseded(*attachment),
                packet = inbound.next() => match packet {
                    Some(Ok(packet)) => self.on_packet(packet).await,
                    Some(Err(status)) => {
                        self.metrics.stream_errors.count(Segment::FromAgent, status.code(), None);
                        // An agent that exits closes its connection without
                        // ending its stream first: not a protocol error.
                        let reason = if konnectivity_plumbing::net::grpc_connection_ended(&status) {
                            "the agent's connection closed (the agent exited, or the network dropped it)".to_owned()
                        } else {
                            format!("stream error: {status}")
                        };
                        return match self.peer_ended {
                            true => Served::Ended(reason),
                            false => Served::Lost(reason),
                        };
                    }
                    // With resume only STREAM_END tells a deliberate end:
                    // a connection that dies (its keepalive unanswered, say)
                    // can end the stream without an error.
                    None if self.backend.extensions.resume() && !self.peer_ended => {
                        return Served::Lost("the agent's stream ended without STREAM_END (its connection died)".to_owned());
                    }
                    None => return Served::Ended("agent closed the stream".to_owned()),
                },
            };
            match step {
                Ok(()) => {}
                Err(SessionSendError::StreamGone) => {
                    return Served::Lost(
                        "the agent's stream is gone (its response body was dropped) with packets still to send"
                            .to_owned(),
                    );
                }
                Err(SessionSendError::Closed) => return Served::Ended("outbound queue closed".to_owned()),
            }
        }
    }

    /// Fails every dial the agent has not answered (their frontends see
    /// the agent gone): whatever becomes of the stream, its answers are lost.
    fn fail_pending_dials(&mut self) {
        for _ in self.pending.drain() {
            self.metrics.dial_failed(DialFailure::BackendClose);
        }
    }

    /// No stream: serves the frontends' commands without sending anything
    /// (what they change goes out when a stream resumes) until a stream
    /// takes over, or the resume timeout runs out.
    async fn wait_detached(
        &mut self,
        commands: &mut mpsc::Receiver<Command>,
        resume: &mut Resume,
    ) -> Detached {
        let deadline = tokio::time::sleep(resume.timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                biased;
                Some(command) = commands.recv() => match command {
                    // Dropping its route tells the frontend the agent is gone.
                    Command::Dial { .. } => self.metrics.dial_failed(DialFailure::BackendClose),
                    // Its dial failed when the stream was lost.
                    Command::CancelDial { .. } => {}
                    Command::Close { connect_id } => {
                        self.connections.close(connect_id, None);
                    }
                },
                takeover = resume.ticket.attachments.recv() => match takeover {
                    Some(Takeover::Resume(attachment)) => return Detached::Resumed(*attachment),
                    Some(Takeover::Restarted) => return Detached::Restarted,
                    None => return Detached::TimedOut,
                },
                () = &mut deadline => return Detached::TimedOut,
            }
        }
    }

    /// Takes `attachment`'s stream as this session's: sends our RESUME list
    /// ahead of everything queued, and hands the stream its writer.
    fn attach(&mut self, attachment: Attachment, lost_at: Instant) -> Inbound {
        let (writer, ahead) = self.backend.outbound.attach_resuming();
        for frame in self.connections.resume_frames() {
            ahead.send(frame);
        }
        // If the agent service gave up on the stream meanwhile, its inbound
        // ends at once and the stream counts as lost again.
        let _ = attachment.writer.send(writer);
        self.handshake = Some(Handshake {
            ahead,
            peer: Vec::new(),
            lost_at,
        });
        attachment.inbound
    }

    /// The agent's RESUME list is complete: both sides' connections are
    /// reconciled, what it lacks goes out ahead of the queue, which then
    /// opens.
    fn reconcile(&mut self, handshake: Handshake) {
        let Handshake { ahead, peer, lost_at } = handshake;
        let plan = self.connections.resume(&peer);
        let resent = plan.resent_bytes();
        for frame in plan.resend {
            ahead.send(frame);
        }
        for (connect_id, _) in plan.close_again {
            ahead.send(Frame::CloseRequest { connect_id });
        }
        for connect_id in plan.unknown {
            self.connections.closing_without_entry(connect_id);
            ahead.send(Frame::CloseRequest { connect_id });
        }
        ahead.open();
        let dropped = plan.gone.len() + plan.refused.len();
        for (connect_id, entry) in plan.gone {
            tracing::debug!(agent_id = %self.backend.agent_id, %connect_id, "connection unknown to the resumed agent; closed");
            entry.route.send(Event::Closed(Some(format!(
                "{AGENT_DISCONNECTED}: the agent no longer had the connection when its stream resumed"
            ))));
        }
        for (connect_id, entry, error) in plan.refused {
            tracing::warn!(agent_id = %self.backend.agent_id, %connect_id, %error, "connection cannot resume; closed");
            entry.route.send(Event::Closed(Some(format!(
                "{AGENT_DISCONNECTED}: resume refused: {error}"
            ))));
        }
        let resumes = &self.metrics.resumes;
        resumes.resumed.inc_by(self.connections.len() as u64);
        resumes.resent_bytes.inc_by(resent as u64);
        resumes.dropped.inc_by(dropped as u64);
        resumes.duration.observe(lost_at.elapsed().as_secs_f64());
        tracing::info!(
            agent_id = %self.backend.agent_id,
            connections = self.connections.len(),
            resent_bytes = resent,
            dropped,
            after = ?lost_at.elapsed(),
            "agent stream resumed"
        );
    }

    async fn on_command(&mut self, command: Command) -> Result<(), SessionSendError> {
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
                if self.connections.close(connect_id, None).is_some() {
                    self.send(Frame::CloseRequest { connect_id }).await?;
                }
                Ok(())
            }
        }
    }

    async fn on_packet(&mut self, packet: Packet) -> Result<(), SessionSendError> {
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
                    if self.backend.extensions.resume() {
                        // The agent keeps what it sent until we confirm its
                        // close (docs/resume.md).
                        self.send(Frame::CloseRequest { connect_id }).await?;
                    }
                }
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
                    tracing::warn!(agent_id = %self.backend.agent_id, "RESUME from agent outside a resume");
                    self.metrics.stream_errors.count(
                        Segment::FromAgent,
                        tonic::Code::InvalidArgument,
                        Some(PacketType::Resume),
                    );
                }
            },
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
                self.registry.draining(&self.backend);
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
    ) -> Result<(), SessionSendError> {
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
    ) -> Result<(), SessionSendError> {
        let metrics = &self.metrics;
        let blocked = || GaugeGuard::new(&metrics.full_receive_channels("Connect"));
        match self.connections.deliver(connect_id, data, offset, blocked).await {
            Delivery::Delivered | Delivery::Duplicate => Ok(()),
            Delivery::Unknown if self.connections.is_closing(connect_id) => Ok(()),
            Delivery::Unknown => self.close_on_agent(connect_id).await,
            Delivery::ConsumerGone => {
                if let Some(entry) = self.connections.close(connect_id, None) {
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
    ) -> Result<(), SessionSendError> {
        tracing::warn!(agent_id = %self.backend.agent_id, %connect_id, %error, "closing connection");
        self.metrics
            .stream_errors
            .count(Segment::FromAgent, tonic::Code::ResourceExhausted, Some(kind));
        entry.route.send(Event::Closed(Some(error)));
        self.close_on_agent(connect_id).await
    }

    /// Tells the agent to close a connection this side no longer has.
    async fn close_on_agent(&mut self, connect_id: ConnectId) -> Result<(), SessionSendError> {
        self.connections.closing_without_entry(connect_id);
        self.send(Frame::CloseRequest { connect_id }).await
    }

    /// The session's own packets: it reads its stream in the same task, so
    /// it must not wait for room in the queue of a stream that is gone
    /// ([`konnectivity_mux::outbound::Outbound::send_from_session`]).
    /// Fails with the stream gone (its response body dropped: the stream is
    /// lost) or the queue closed (the backend was closed: the session ends).
    async fn send(&self, frame: Frame) -> Result<(), SessionSendError> {
        self.backend.metrics.packet(Segment::ToAgent, frame.kind());
        self.backend.outbound.send_from_session(frame.into()).await
    }
}

/// A backend with its session running, for the unit tests of what a
/// session does with frontends' commands and an agent's packets (here and
/// in the frontends' modules).
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::backend::strategy::Strategy;
    use crate::backend::{Announced, BackendId, Queues};
    use konnectivity_mux::outbound::Writer;

    pub(crate) struct RunningSession {
        pub backend: Arc<Backend>,
        /// Holds the backend (frontends find it there).
        pub registry: Arc<Registry>,
        pub metrics: Arc<ServerMetrics>,
        /// What the session sends the agent (a resumed session sends on the
        /// stream it took over instead).
        pub to_agent: Writer,
        /// The agent's stream into the session: an error loses the stream.
        pub from_agent: mpsc::Sender<Result<Packet, tonic::Status>>,
        pub session: tokio::task::JoinHandle<()>,
    }

    /// Agent `agent_id`'s session with resume negotiated, and the sender
    /// that hands it streams resuming it (as the agent service does once a
    /// token checks out).
    pub(crate) fn resumable_session(
        agent_id: &str,
    ) -> (
        RunningSession,
        konnectivity_mux::mailbox::Sender<crate::backend::resume::Takeover>,
    ) {
        use crate::backend::resume::{Attachment, PeerIdentity, Resumption};
        let identity = PeerIdentity {
            agent_id: agent_id.to_owned(),
            proof: "test".to_owned(),
        };
        let resumption = Resumption::<Attachment>::new(Duration::from_secs(60), "server-1");
        let ticket = resumption.issue(identity.clone(), None);
        let attach = resumption
            .find(&[ticket.token.as_str()], &identity)
            .unwrap()
            .unwrap();
        let resume = Resume {
            ticket,
            timeout: Duration::from_secs(60),
        };
        let running = running_session(agent_id, konnectivity_mux::Extensions::Resume, Some(resume));
        (running, attach)
    }

    /// Agent `agent_id`, which announced `extensions`, in a registry of its
    /// own with its session running; a session given `resume` waits for its
    /// stream to be taken over when that stream is lost.
    pub(crate) fn running_session(
        agent_id: &str,
        extensions: konnectivity_mux::Extensions,
        resume: Option<Resume>,
    ) -> RunningSession {
        let metrics = Arc::new(ServerMetrics::default());
        let registry = Arc::new(Registry::new(vec![Strategy::Default], metrics.clone()));
        let announced = Announced {
            agent_id: agent_id.to_owned(),
            extensions,
            ..Announced::default()
        };
        let (backend, Queues { to_agent, commands }) =
            Backend::open(BackendId(1), announced, metrics.clone());
        registry.add(backend.clone());
        let (from_agent, inbound) = mpsc::channel(64);
        let session = tokio::spawn(run(
            backend.clone(),
            tokio_stream::wrappers::ReceiverStream::new(inbound),
            commands,
            registry.clone(),
            metrics.clone(),
            resume,
        ));
        RunningSession {
            backend,
            registry,
            metrics,
            to_agent,
            from_agent,
            session,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::wrappers::ReceiverStream;

    fn gauge(metrics: &ServerMetrics) -> i64 {
        metrics.full_receive_channels("Connect").get()
    }

    /// A resumed stream's queue opens only once the agent's RESUME list is
    /// read. Dials that come meanwhile (more than the queue holds) wait for
    /// it: served first, the session waited for room in a queue that could
    /// not open, never read the list, and sent nothing again (three
    /// control-plane agents' sessions in the 5,000-node run).
    #[tokio::test]
    async fn a_resumed_session_reads_the_agents_resume_list_before_serving_dials() {
        use crate::backend::resume::{Attachment, Takeover};
        use futures_util::StreamExt;
        let (
            testing::RunningSession {
                backend,
                to_agent,
                from_agent: first_stream,
                ..
            },
            attach,
        ) = testing::resumable_session("agent");
        // The first stream is lost: its writer goes with it.
        first_stream
            .send(Err(tonic::Status::unavailable("connection reset")))
            .await
            .unwrap();
        drop(to_agent);
        let (agent, inbound) = mpsc::channel::<Result<Packet, tonic::Status>>(4);
        let (writer, resumed_writer) = tokio::sync::oneshot::channel();
        let resuming = Attachment {
            inbound: Box::pin(ReceiverStream::new(inbound)),
            writer,
        };
        assert!(attach.send(Takeover::Resume(Box::new(resuming))).is_ok());
        let mut to_agent = resumed_writer.await.expect("the session takes the stream");

        const DIALS: i64 = 600;
        let mut frontends = Vec::new();
        for n in 0..DIALS {
            let (route, frontend, _) = konnectivity_mux::connection(konnectivity_mux::Extensions::Resume);
            frontends.push(frontend);
            backend
                .command(Command::Dial {
                    dial_id: DialId::new(n + 1),
                    address: "10.0.0.1:80".into(),
                    route,
                })
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let list = Frame::Resume {
            connections: Vec::new(),
            last: true,
        };
        agent.send(Ok(list.into())).await.unwrap();
        let mut dial_requests = 0;
        let all = tokio::time::timeout(Duration::from_secs(5), async {
            while dial_requests < DIALS {
                let packet = to_agent.next().await.expect("the stream stays");
                if matches!(Frame::try_from(packet), Ok(Frame::DialRequest { .. })) {
                    dial_requests += 1;
                }
            }
        })
        .await;
        assert!(
            all.is_ok(),
            "{dial_requests} of {DIALS} DIAL_REQs sent after the RESUME list"
        );
    }

    /// A resuming stream whose request went away before the session took it
    /// (the agent reset it when its own attempt timed out) is passed over:
    /// the session keeps serving the stream it has. Taken, it left that
    /// stream, which the agent may still be on, for one nobody reads.
    #[tokio::test]
    async fn a_live_session_passes_over_a_resuming_stream_already_abandoned() {
        use crate::backend::resume::{Attachment, Takeover};
        use futures_util::StreamExt;
        let (
            testing::RunningSession {
                backend,
                mut to_agent,
                from_agent: _live,
                ..
            },
            attach,
        ) = testing::resumable_session("agent");
        let (_agent, inbound) = mpsc::channel::<Result<Packet, tonic::Status>>(4);
        let (writer, answer) = tokio::sync::oneshot::channel();
        drop(answer);
        let abandoned = Attachment {
            inbound: Box::pin(ReceiverStream::new(inbound)),
            writer,
        };
        assert!(attach.send(Takeover::Resume(Box::new(abandoned))).is_ok());
        tokio::time::sleep(Duration::from_millis(50)).await;

        let (route, _frontend, _) = konnectivity_mux::connection(konnectivity_mux::Extensions::Resume);
        backend
            .command(Command::Dial {
                dial_id: DialId::new(1),
                address: "10.0.0.1:80".into(),
                route,
            })
            .await
            .unwrap();
        let sent = tokio::time::timeout(Duration::from_secs(2), to_agent.next()).await;
        assert!(
            matches!(
                sent.as_ref().map(|packet| packet.clone().map(Frame::try_from)),
                Ok(Some(Ok(Frame::DialRequest { .. })))
            ),
            "the DIAL_REQ goes out on the stream the session had: {sent:?}"
        );
    }

    /// With an agent that did not negotiate flow control, a connection whose
    /// frontend stops reading holds up the agent stream, as upstream's does;
    /// `full_receive_channels` shows it while it lasts.
    #[tokio::test]
    async fn a_full_connection_of_an_upstream_agent_shows_in_full_receive_channels() {
        let testing::RunningSession {
            backend,
            metrics,
            mut to_agent,
            from_agent,
            session,
            ..
        } = testing::running_session("upstream-agent", konnectivity_mux::Extensions::Upstream, None);

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
        use futures_util::StreamExt;
        assert!(to_agent.next().await.is_some(), "DIAL_REQ sent");
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
