//! The gRPC ProxyService frontend, as kube-apiserver's `GRPC` egress uses it:
//! one `Proxy` stream per connection. The first DIAL_REQ pins the stream to a
//! backend; then DATA flows both ways and CLOSE_REQ/CLOSE_RSP end it.
//!
//! The dial itself and the data path are the same [`Dialer`] and tunnel as
//! the HTTP CONNECT frontend uses; only the framing towards the client differs.

use std::sync::Arc;
use std::time::Instant;

use crate::serving::peer_certificate_names;
use futures_util::future::{BoxFuture, Either, Ready, ready};
use futures_util::{Stream, StreamExt};
use konnectivity_mux::Waited;
use konnectivity_mux::outbound::{Outbound, Queueing, outbound};
use konnectivity_mux::replay::Arrival;
use konnectivity_proto::metadata::{AGENT_INSTANCE, RESUME, RESUME_RECEIVED, RESUME_TOKEN, SERVER_ID};
use konnectivity_proto::wire::proxy_service_server::ProxyService;
use konnectivity_proto::{ConnectId, DialId, DialTarget, Frame, Packet};
use konnectivity_telemetry::metrics::GaugeGuard;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::AsciiMetadataValue;
use tonic::{Request, Response, Status, Streaming};

use super::node_clients::NodeClients;
use super::resume::{ClientAttachment, ClientPackets, ResponseBody, StreamResume, response_body};
use crate::backend::resume::{PeerIdentity, Resumption, Takeover};
use crate::identity::certificate_node;
use crate::metrics::{Segment, ServerMetrics};
use crate::policy::FrontendClass;
use crate::tunnel::{DialError, Dialer, TunnelConn, TunnelEnd};

/// Packets queued towards one frontend client.
const TO_CLIENT_QUEUE: usize = 64;

/// What goes into a client's queue. Boxed: tokio's channel allocates a
/// block of 32 slots when it is made, and a `Result<Packet, Status>` is
/// large, so every idle Proxy stream held 32 of them (boxed, an idle gRPC
/// tunnel measured 11.1 → 8.7 KiB in hack/bench.sh). The box is one small
/// allocation per packet towards the client, beside that packet's encoding.
type ToClient = Box<Result<Packet, Status>>;

pub(crate) struct ProxyServer {
    dialer: Dialer,
    /// On the node frontend: the nodes whose streams are open.
    node_clients: Option<Arc<NodeClients>>,
    /// The node frontend's resumable streams (super::resume), unless
    /// `--agent-resume-timeout=0`; never on kube-apiserver's frontend.
    resumption: Option<Arc<Resumption<ClientAttachment>>>,
}

impl ProxyServer {
    pub(crate) fn new(dialer: Dialer, resumption: Option<Arc<Resumption<ClientAttachment>>>) -> Self {
        let node_clients =
            (dialer.class == FrontendClass::Node).then(|| NodeClients::new(dialer.metrics.clone()));
        ProxyServer {
            dialer,
            node_clients,
            resumption,
        }
    }

    /// The dialer of a new stream: on the node frontend, it carries the
    /// node the stream's certificate names.
    fn stream_dialer<T>(&self, request: &Request<T>) -> Dialer {
        match &self.node_clients {
            None => self.dialer.clone(),
            Some(clients) => Dialer {
                client_node: clients.opened(certificate_node(&peer_certificate_names(request))),
                ..self.dialer.clone()
            },
        }
    }
}

#[tonic::async_trait]
impl ProxyService for ProxyServer {
    type ProxyStream = ResponseBody;

    async fn proxy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ProxyStream>, Status> {
        let Some(resumption) = &self.resumption else {
            let packets = serve_client(self.stream_dialer(&request), request.into_inner());
            return Ok(Response::new(Box::pin(packets)));
        };
        let metadata = request.metadata();
        let mut response = if metadata.get(RESUME_TOKEN).is_some() {
            resume_client(resumption, request).await?
        } else if metadata.get(RESUME).is_some_and(|value| value == "1") {
            serve_resumable(self.stream_dialer(&request), resumption, request)
        } else {
            let packets = serve_client(self.stream_dialer(&request), request.into_inner());
            Response::new(Box::pin(packets) as ResponseBody)
        };
        // Every answer names this server (a probe's too): behind one address,
        // a node agent whose connections' tokens name another server dials
        // until a connection reaches that one (docs/resume.md).
        if let Some(server_id) = server_id_value(resumption) {
            response.metadata_mut().insert(SERVER_ID, server_id);
        }
        Ok(response)
    }
}

/// This server's id as a header value (`None`: an id no header can carry,
/// which the server's flags refuse).
fn server_id_value<A>(resumption: &Resumption<A>) -> Option<AsciiMetadataValue> {
    AsciiMetadataValue::try_from(resumption.server_id()).ok()
}

/// Who a node tunnel's client proved to be: the node its certificate
/// names, else the certificate's names. A stream resumes only a stream of
/// the same proof: a node only its own connections.
fn client_identity<T>(request: &Request<T>) -> PeerIdentity {
    let names = peer_certificate_names(request);
    PeerIdentity {
        agent_id: "node tunnel".to_owned(),
        proof: match certificate_node(&names) {
            Some(node) => format!("node {node}"),
            None => format!("certificate {names:?}"),
        },
    }
}

/// A new resumable stream: served as any other, with a token in its
/// response headers and its packets through a queue that outlives it.
fn serve_resumable(
    dialer: Dialer,
    resumption: &Arc<Resumption<ClientAttachment>>,
    request: Request<Streaming<Packet>>,
) -> Response<ResponseBody> {
    let identity = client_identity(&request);
    let instance = request
        .metadata()
        .get(AGENT_INSTANCE)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let (body, token) = serve_resumable_client(dialer, resumption, identity, instance, request.into_inner());
    let mut response = Response::new(body);
    if let Ok(token) = AsciiMetadataValue::try_from(token) {
        response.metadata_mut().insert(RESUME_TOKEN, token);
    }
    response
}

/// [`serve_resumable`] without the gRPC envelope: the response's packets and
/// the stream's token. `instance` is the node agent process that opened it:
/// the same node's lost streams held for another process end now, as that
/// process is gone. (Public for the fuzz target.)
pub fn serve_resumable_client(
    dialer: Dialer,
    resumption: &Arc<Resumption<ClientAttachment>>,
    identity: PeerIdentity,
    instance: Option<String>,
    packets: impl Stream<Item = Result<Packet, Status>> + Send + Sync + 'static,
) -> (ResponseBody, String) {
    if instance.is_some() {
        resumption.restarted(&identity, instance.as_deref());
    }
    let ticket = resumption.issue(identity, instance);
    let token = ticket.token.clone();
    let queue = outbound(TO_CLIENT_QUEUE);
    let writer = queue.attach();
    let resume = StreamResume::new(
        ticket,
        resumption.timeout,
        queue.clone(),
        dialer.metrics.resumes.clone(),
    );
    spawn_stream(
        dialer,
        Box::pin(packets),
        ToClientQueue::Resumable(queue),
        Some(Box::new(resume)),
    );
    (response_body(writer), token)
}

/// A stream that offers a token: it takes over the stream the token names,
/// or is refused with the reason.
async fn resume_client(
    resumption: &Resumption<ClientAttachment>,
    request: Request<Streaming<Packet>>,
) -> Result<Response<ResponseBody>, Status> {
    let metadata = request.metadata();
    let token = metadata
        .get(RESUME_TOKEN)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let received = metadata
        .get(RESUME_RECEIVED)
        .map(|value| value.to_str().unwrap_or_default().to_owned());
    let identity = client_identity(&request);
    let (body, server_received) = resume_client_stream(
        resumption,
        &token,
        received.as_deref(),
        &identity,
        request.into_inner(),
    )
    .await?;
    let mut response = Response::new(body);
    if let Ok(value) = AsciiMetadataValue::try_from(server_received.to_string()) {
        response.metadata_mut().insert(RESUME_RECEIVED, value);
    }
    Ok(response)
}

/// [`resume_client`] without the gRPC envelope: `token` and `received` as the
/// headers carried them; the response's packets and the bytes this side has
/// received. (Public for the fuzz target.)
pub async fn resume_client_stream(
    resumption: &Resumption<ClientAttachment>,
    token: &str,
    received: Option<&str>,
    identity: &PeerIdentity,
    packets: impl Stream<Item = Result<Packet, Status>> + Send + Sync + 'static,
) -> Result<(ResponseBody, u64), Status> {
    let received = received
        .and_then(|value| value.parse::<u64>().ok())
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "resume refused: {RESUME_RECEIVED} must be one byte count"
            ))
        })?;
    let session = resumption
        .find(&[token], identity)
        .inspect_err(|refused| {
            tracing::warn!(error = refused.message(), "node tunnel stream's resume refused")
        })?
        .ok_or_else(|| {
            // Named, so that the node agent can look for the token's server.
            let mut refused = Status::not_found("resume refused: the token names another proxy-server");
            if let Some(server_id) = server_id_value(resumption) {
                refused.metadata_mut().insert(SERVER_ID, server_id);
            }
            refused
        })?;
    let gone = || Status::not_found("resume refused: the stream's connection has ended");
    let (answer, answered) = oneshot::channel();
    let attachment = ClientAttachment {
        inbound: Box::pin(packets),
        received,
        answer,
    };
    session
        .send(Takeover::Resume(Box::new(attachment)))
        .map_err(|_| gone())?;
    let (writer, server_received) = answered.await.map_err(|_| gone())??;
    Ok((response_body(writer), server_received))
}

/// Serves one client's Proxy stream: `packets` is what the client sends, the
/// stream returned what it receives. (Public for the fuzz target, which
/// drives it without a gRPC transport.)
pub fn serve_client(
    dialer: Dialer,
    packets: impl Stream<Item = Result<Packet, Status>> + Send + Sync + 'static,
) -> impl Stream<Item = Result<Packet, Status>> + Send + Unpin + 'static {
    let (to_client, received) = mpsc::channel::<ToClient>(TO_CLIENT_QUEUE);
    spawn_stream(dialer, Box::pin(packets), ToClientQueue::Plain(to_client), None);
    ReceiverStream::new(received).map(|packet| *packet)
}

fn spawn_stream(
    dialer: Dialer,
    packets: ClientPackets,
    to_client: ToClientQueue,
    resume: Option<Box<StreamResume>>,
) {
    let open = GaugeGuard::new(&dialer.metrics.grpc_connections("Proxy"));
    tokio::spawn(async move {
        let _open = open;
        let mut stream = ClientStream {
            inbound: ClientInbound {
                packets,
                metrics: dialer.metrics.clone(),
                failure: None,
            },
            outbound: ClientOutbound {
                to_client,
                metrics: dialer.metrics.clone(),
            },
            resume,
        };
        stream.serve(&dialer).await;
        match &stream.outbound.to_client {
            // A stream that failed on the client's side (a message over the
            // size limit, say) ends with that status rather than silently.
            ToClientQueue::Plain(to_client) => {
                if let Some(status) = stream.inbound.failure.take() {
                    let _ = to_client.send(Box::new(Err(status))).await;
                }
            }
            // Its writer sends what is queued (the CLOSE_RSP), then ends.
            ToClientQueue::Resumable(queue) => queue.close(),
        }
    });
}

/// One client's Proxy stream, as two halves so that both directions of an
/// established connection can wait at once.
struct ClientStream {
    inbound: ClientInbound,
    outbound: ClientOutbound,
    /// Boxed: kube-apiserver's streams (most of them) never have it.
    resume: Option<Box<StreamResume>>,
}

/// What the client sends.
struct ClientInbound {
    packets: ClientPackets,
    metrics: Arc<ServerMetrics>,
    /// How the client's stream failed, if it did, to tell the client.
    failure: Option<Status>,
}

/// What goes back to the client.
struct ClientOutbound {
    to_client: ToClientQueue,
    metrics: Arc<ServerMetrics>,
}

/// The queue towards the client: a channel into the one response, or, for
/// a resumable stream, a queue each resuming stream's response drains.
enum ToClientQueue {
    Plain(mpsc::Sender<ToClient>),
    Resumable(Outbound),
}

/// The client's stream is gone (it ended, failed, or stopped reading).
struct ClientGone;

/// How one direction of a relayed connection ended.
enum RelayEnd {
    /// Answer the client with CLOSE_RSP carrying this error, if any.
    Close(Option<String>),
    /// Nothing to answer: the client's stream is gone.
    ClientGone,
}

/// A packet on its way to the client: done at once while the queue has
/// room. Not an `async fn`: every tunnel's task awaits one, and the wait
/// for room (rare) is boxed so that it does not sit in each of them (as
/// `konnectivity_mux::outbound::Queueing`).
type ClientSend<'a> = Either<Ready<Result<(), ClientGone>>, BoxFuture<'a, Result<(), ClientGone>>>;

impl ClientOutbound {
    fn send(&self, frame: Frame) -> ClientSend<'_> {
        self.metrics.packet(Segment::ToClient, frame.kind());
        match &self.to_client {
            ToClientQueue::Plain(to_client) => match to_client.try_send(Box::new(Ok(frame.into()))) {
                Ok(()) => Either::Left(ready(Ok(()))),
                Err(mpsc::error::TrySendError::Closed(_)) => Either::Left(ready(Err(ClientGone))),
                Err(mpsc::error::TrySendError::Full(packet)) => Either::Right(Box::pin(async move {
                    to_client.send(packet).await.map_err(|_| ClientGone)
                })),
            },
            ToClientQueue::Resumable(queue) => match queue.send(frame.into()) {
                Queueing::Done(result) => Either::Left(ready(result.map_err(|_| ClientGone))),
                waiting => Either::Right(Box::pin(async move { waiting.await.map_err(|_| ClientGone) })),
            },
        }
    }
}

impl ClientInbound {
    /// A resuming stream's packets replace the lost stream's.
    fn resumed(&mut self, packets: ClientPackets) {
        self.packets = packets;
        self.failure = None;
    }

    /// The next valid frame from the client; `None` when its stream ended.
    async fn next_frame(&mut self) -> Option<Frame> {
        loop {
            match self.packets.next().await? {
                Ok(packet) => match Frame::try_from(packet) {
                    Ok(frame) => {
                        self.metrics.packet(Segment::FromClient, frame.kind());
                        return Some(frame);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "invalid packet from frontend client");
                        self.metrics.stream_errors.count(
                            Segment::FromClient,
                            tonic::Code::InvalidArgument,
                            error.packet_type(),
                        );
                    }
                },
                Err(status) => {
                    tracing::debug!(%status, "frontend stream failed");
                    self.metrics
                        .stream_errors
                        .count(Segment::FromClient, status.code(), None);
                    self.failure = Some(status);
                    return None;
                }
            }
        }
    }
}

impl ClientStream {
    async fn send(&self, frame: Frame) -> Result<(), ClientGone> {
        self.outbound.send(frame).await
    }

    async fn next_frame(&mut self) -> Option<Frame> {
        self.inbound.next_frame().await
    }

    async fn serve(&mut self, dialer: &Dialer) {
        // Until the first DIAL_REQ there is nothing to do.
        let (address, dial_id) = loop {
            match self.next_frame().await {
                Some(Frame::DialRequest {
                    protocol,
                    address,
                    dial_id,
                }) => {
                    if protocol == "tcp" {
                        break (address, dial_id);
                    }
                    let error = format!("unsupported protocol {protocol:?}: only \"tcp\" is served");
                    let _ = self
                        .send(Frame::DialResponse {
                            dial_id,
                            result: Err(error),
                        })
                        .await;
                    return;
                }
                Some(other) => tracing::warn!(kind = ?other.kind(), "frontend sent a packet before DIAL_REQ"),
                None => return,
            }
        };
        // Boxed: the dial's state (its select over the agent's answer and
        // the client's packets, the answers it may send) is larger than the
        // relay's, and a task is as large as the largest state it can be in.
        // Boxed, that memory is taken only while dialing: every idle tunnel's
        // task went from 2,176 to 1,922 bytes (heaptrack, release build).
        let Some(connection) = Box::pin(self.dial(dialer, &address, dial_id)).await else {
            return;
        };
        self.relay(connection, &dialer.metrics).await;
    }

    /// Dials while watching the client: DIAL_CLS or the stream ending cancels
    /// the dial (dropping the dial future sends DIAL_CLS to the agent, which
    /// closes the connection if it was already made).
    async fn dial(&mut self, dialer: &Dialer, address: &DialTarget, dial_id: DialId) -> Option<TunnelConn> {
        let dial = dialer.dial(address, dial_id);
        tokio::pin!(dial);
        let result = loop {
            tokio::select! {
                result = &mut dial => break result,
                frame = self.next_frame() => match frame {
                    Some(Frame::CloseDial { dial_id: cancelled }) if cancelled == dial_id => return None,
                    Some(other) => tracing::warn!(kind = ?other.kind(), "unexpected packet while dialing"),
                    None => return None,
                },
            }
        };
        match result {
            Ok(connection) => {
                let answer = Frame::DialResponse {
                    dial_id,
                    result: Ok(connection.connect_id),
                };
                self.send(answer).await.ok()?;
                Some(connection)
            }
            Err(error) => {
                if !matches!(error, DialError::NoBackend) {
                    tracing::info!(%address, %error, "gRPC dial failed");
                }
                let answer = Frame::DialResponse {
                    dial_id,
                    result: Err(error.to_string()),
                };
                let _ = self.send(answer).await;
                None
            }
        }
    }

    /// Moves bytes until either side closes. The two directions wait
    /// independently: a client write waiting for the agent's window must not
    /// stop bytes flowing back to the client (an echoing target would
    /// otherwise deadlock both). Dropping the tunnel's sender on the way out
    /// closes the connection on the agent.
    ///
    /// Not an `async fn`: one would keep its `connection` argument (200
    /// bytes) in the task, beside the parts split from it, for as long as
    /// the connection lives.
    fn relay<'a>(
        &'a mut self,
        connection: TunnelConn,
        metrics: &'a ServerMetrics,
    ) -> impl Future<Output = ()> + 'a {
        let connect_id = connection.connect_id;
        let (sender, mut receiver, life) = connection.split();
        async move {
            // Its events name the tunnel's span themselves: an instrumented relay
            // would make every idle tunnel's task larger.
            let tunnel = life.span();
            let inbound = &mut self.inbound;
            let outbound = &self.outbound;
            let mut resume = self.resume.as_deref_mut();
            let window = resume.as_ref().map(|resume| resume.window.clone());
            let to_agent = async {
                loop {
                    let frame = match &mut resume {
                        None => inbound.next_frame().await,
                        Some(resume) => tokio::select! {
                            waited = resume.credit.or_quiet(inbound.next_frame()) => match waited {
                                Waited::Arrived(frame) => frame,
                                // The node may drop what it kept for replay.
                                Waited::Quiet(credit) => {
                                    let _ = outbound.send(credit.frame(connect_id)).await;
                                    continue;
                                }
                            },
                            // The client resumed on a new stream before this
                            // one failed here (a silent link, or a node agent
                            // that handed the connection to its successor).
                            // Matched in full: a pattern that left out
                            // `Restarted` would stop this branch from being
                            // polled again until the next packet came.
                            Some(takeover) = resume.ticket.attachments.recv() => {
                                if let Takeover::Resume(attachment) = takeover
                                    && let Some(packets) = resume.attach(connect_id, *attachment)
                                {
                                    inbound.resumed(packets);
                                }
                                // `Restarted` is for a stream that waits; this
                                // one is attached.
                                continue;
                            }
                        },
                    };
                    match frame {
                        Some(Frame::Data {
                            connect_id: id,
                            data,
                            offset,
                        }) if id == connect_id => {
                            let len = data.len();
                            if let Some(resume) = &resume {
                                match resume.admit(offset, len) {
                                    Ok(Arrival::Next) => {}
                                    Ok(Arrival::Duplicate) => continue,
                                    Err(error) => {
                                        tunnel.in_scope(
                                            || tracing::warn!(%error, "closing resumable frontend stream"),
                                        );
                                        return (RelayEnd::Close(Some(error)), TunnelEnd::ClientError);
                                    }
                                }
                            }
                            if sender.send(data).await.is_err() {
                                // Gone on the agent's side: the other direction
                                // learns how and answers the client.
                                std::future::pending::<()>().await;
                            }
                            if let Some(resume) = &mut resume
                                && let Some(credit) = resume.credit.consumed(len)
                            {
                                let _ = outbound.send(credit.frame(connect_id)).await;
                            }
                        }
                        Some(Frame::WindowUpdate {
                            connect_id: id,
                            bytes,
                            written,
                        }) if id == connect_id && resume.is_some() => {
                            if let Some(resume) = &resume
                                && let Err(error) = resume.window.grant(bytes, written)
                            {
                                let error = error.to_string();
                                tunnel.in_scope(|| tracing::warn!(%error, "closing resumable frontend stream"));
                                return (RelayEnd::Close(Some(error)), TunnelEnd::ClientError);
                            }
                        }
                        Some(Frame::Data {
                            connect_id: foreign, ..
                        }) => {
                            // A client mixing up ids could read or write someone
                            // else's connection: end this one instead.
                            let error =
                                format!("DATA for connectID {foreign} on the stream of connectID {connect_id}");
                            tunnel.in_scope(|| tracing::warn!(%error, "closing frontend stream"));
                            return (RelayEnd::Close(Some(error)), TunnelEnd::ClientError);
                        }
                        Some(Frame::CloseRequest { .. }) => {
                            return (RelayEnd::Close(None), TunnelEnd::ClientClosed);
                        }
                        Some(other) => tunnel.in_scope(
                            || tracing::warn!(kind = ?other.kind(), "unexpected packet on an established stream"),
                        ),
                        None => {
                            // Rare, and boxed so that the wait does not make
                            // every tunnel's task larger.
                            if let Some(resume) = &mut resume
                                && let Some(packets) = Box::pin(resume.wait_for_resume(connect_id)).await
                            {
                                inbound.resumed(packets);
                                continue;
                            }
                            return match inbound.failure.is_some() {
                                true => (RelayEnd::ClientGone, TunnelEnd::ClientError),
                                false => (RelayEnd::ClientGone, TunnelEnd::ClientClosed),
                            };
                        }
                    }
                }
            };
            let to_client = async {
                loop {
                    match receiver.recv().await {
                        Ok(data) => {
                            let started = Instant::now();
                            let frame = match &window {
                                None => Frame::Data {
                                    connect_id,
                                    data,
                                    offset: None,
                                },
                                // Numbered and kept until the client wrote it
                                // out, at most a window of it.
                                Some(window) => {
                                    if window.reserve(data.len()).await.is_err() {
                                        return (RelayEnd::ClientGone, TunnelEnd::ClientClosed);
                                    }
                                    window.data(connect_id, data)
                                }
                            };
                            if outbound.send(frame).await.is_err() {
                                return (RelayEnd::ClientGone, TunnelEnd::ClientClosed);
                            }
                            metrics
                                .frontend_write_duration
                                .observe(started.elapsed().as_secs_f64());
                        }
                        Err(end) => return (RelayEnd::Close(end.error()), end.tunnel_end()),
                    }
                }
            };
            let (end, reason) = tokio::select! {
                end = to_agent => end,
                end = to_client => end,
            };
            drop(sender);
            life.end(reason);
            if let RelayEnd::Close(error) = end
                && self.close(connect_id, error.clone()).await.is_ok()
            {
                // Rare per connection, and boxed so that it does not make every
                // tunnel's task larger.
                Box::pin(self.linger(connect_id, error)).await;
            }
        }
    }

    /// A resumable stream's connection has ended and its CLOSE_RSP is
    /// queued; the session stays until the client has it. The client ends
    /// its stream cleanly once it read the CLOSE_RSP; a stream lost before
    /// that (a cut, or a node agent that handed the connection to its
    /// successor) is resumed as before, and the resuming stream gets again
    /// what the client lacks, then the CLOSE_RSP. Ending the session at once
    /// would lose the last bytes and the close whenever they were on their
    /// way when the stream was lost: the resume would find no session.
    async fn linger(&mut self, connect_id: ConnectId, error: Option<String>) {
        let Some(resume) = self.resume.as_deref_mut() else {
            return;
        };
        let inbound = &mut self.inbound;
        let outbound = &self.outbound;
        let close = || Frame::CloseResponse {
            connect_id,
            error: error.clone(),
        };
        loop {
            let frame = tokio::select! {
                frame = inbound.next_frame() => frame,
                // As in the relay: matched in full, `Restarted` ignored.
                Some(takeover) = resume.ticket.attachments.recv() => {
                    if let Takeover::Resume(attachment) = takeover
                        && let Some(packets) = resume.attach(connect_id, *attachment)
                    {
                        inbound.resumed(packets);
                        let _ = outbound.send(close()).await;
                    }
                    continue;
                }
            };
            match frame {
                Some(Frame::WindowUpdate { bytes, written, .. }) => {
                    let _ = resume.window.grant(bytes, written);
                }
                // Late packets of a connection that has ended.
                Some(_) => {}
                None if inbound.failure.is_none() => return,
                None => match Box::pin(resume.wait_for_resume(connect_id)).await {
                    Some(packets) => {
                        inbound.resumed(packets);
                        let _ = outbound.send(close()).await;
                    }
                    None => return,
                },
            }
        }
    }

    async fn close(&self, connect_id: ConnectId, error: Option<String>) -> Result<(), ClientGone> {
        self.send(Frame::CloseResponse { connect_id, error }).await
    }
}
