//! Arbitrary packet sequences on an agent stream, seen from the server's
//! side and from the agent's, and on a frontend client's Proxy stream into
//! the server (with a real agent session behind it). Input: one byte of
//! switches, then packets in
//! protobuf's length-delimited framing (as many as decode), so the fuzzer
//! can send wrong payloads for a type, unknown types, and huge, zero or
//! negative ids.
//!
//! Whatever arrives, the session must neither panic nor hang, and once the
//! stream ends everything it held must be released: no pending dial, no
//! connection, no endpoint socket, no blocked receive.

use std::sync::Arc;
use std::time::Duration;

use bytes::Buf;
use konnectivity_mux::Extensions;
use konnectivity_proto::{DialId, Packet, PacketType};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;

/// More packets than this in one input are ignored: the run stays short.
const MAX_PACKETS: usize = 512;
/// A session that has not wound down by then is hung.
pub(crate) const DEADLINE: Duration = Duration::from_secs(10);

pub(crate) fn decode(data: &[u8]) -> (u8, Vec<Packet>) {
    let Some((&switches, mut rest)) = data.split_first() else {
        return (0, Vec::new());
    };
    let mut packets = Vec::new();
    while rest.has_remaining() && packets.len() < MAX_PACKETS {
        match Packet::decode_length_delimited(&mut rest) {
            Ok(packet) => packets.push(packet),
            Err(_) => break,
        }
    }
    (switches, packets)
}

/// What the fuzzed stream negotiated: switch bit 2 resume (with flow
/// control), else bit 0 flow control, else nothing (an upstream peer).
fn extensions(switches: u8) -> Extensions {
    if switches & 4 != 0 {
        Extensions::Resume
    } else if switches & 1 != 0 {
        Extensions::FlowControl
    } else {
        Extensions::Upstream
    }
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A server's session for one agent stream, with the agent end left to the
/// caller: `from_agent` feeds the session, `to_agent` is what it sends.
struct ServerSide {
    registry: Arc<konnectivity_server::hooks::Registry>,
    backend: Arc<konnectivity_server::hooks::Backend>,
    metrics: Arc<konnectivity_server::hooks::ServerMetrics>,
    from_agent: mpsc::UnboundedSender<Result<Packet, tonic::Status>>,
    to_agent: konnectivity_mux::outbound::Writer,
    session: tokio::task::JoinHandle<()>,
}

/// Starts a [`ServerSide`] whose agent did (or did not) negotiate flow
/// control. Needs a runtime.
fn server_side(extensions: Extensions) -> ServerSide {
    use konnectivity_server::hooks::Registry;
    use konnectivity_server::hooks::ServerMetrics;
    use konnectivity_server::hooks::Strategy;
    use konnectivity_server::hooks::{Announced, Backend, BackendId, session};

    let metrics = Arc::new(ServerMetrics::default());
    let registry = Arc::new(Registry::new(vec![Strategy::Default], metrics.clone()));
    let announced = Announced {
        agent_id: "fuzzed-agent".to_owned(),
        extensions,
        ..Announced::default()
    };
    let (backend, queues) = Backend::open(BackendId(1), announced, metrics.clone());
    let (to_agent, commands) = (queues.to_agent, queues.commands);
    registry.add(backend.clone());
    let (from_agent, inbound) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
    let session = tokio::spawn(session::run(
        backend.clone(),
        UnboundedReceiverStream::new(inbound),
        commands,
        registry.clone(),
        metrics.clone(),
        None,
    ));
    ServerSide {
        registry,
        backend,
        metrics,
        from_agent,
        to_agent,
        session,
    }
}

/// The server's session for one agent stream. Switches: bits 0 and 2, what
/// the agent negotiated ([`extensions`]); bit 1, the frontends read what reaches them
/// (otherwise they read nothing and go away at the end).
pub fn server_stream(data: &[u8]) {
    use konnectivity_server::hooks::{Command, Event};

    let (switches, packets) = decode(data);
    let extensions = extensions(switches);
    let frontends_read = switches & 2 != 0;
    runtime().block_on(async {
        let ServerSide {
            backend,
            metrics,
            from_agent,
            mut to_agent,
            session,
            ..
        } = server_side(extensions);
        // What the server sends the agent is not under test here; keep the
        // queue moving so the session never waits on it.
        tokio::spawn(async move {
            use tokio_stream::StreamExt;
            while to_agent.next().await.is_some() {}
        });

        // Two frontends wait on dials 1 and 2, which fuzzed DIAL_RSPs may answer.
        let mut frontends = Vec::new();
        for id in [1, 2] {
            let (route, mut port, _) = konnectivity_mux::connection(extensions);
            backend
                .command(Command::Dial {
                    dial_id: DialId::new(id),
                    address: "192.0.2.1:443".into(),
                    route,
                })
                .await
                .expect("the session takes commands");
            if frontends_read {
                frontends.push(tokio::spawn(async move {
                    while let Some(event) = port.recv().await {
                        if let Event::Data(bytes) = event {
                            let _ = port.written(bytes.len());
                        }
                    }
                }));
            } else {
                frontends.push(tokio::spawn(async move {
                    // Holds on, reading nothing, until the end.
                    std::future::pending::<()>().await;
                    drop(port);
                }));
            }
        }

        for packet in packets {
            let _ = from_agent.send(Ok(packet));
        }
        drop(from_agent);
        if !frontends_read {
            // Frontends that never read go away: anything waiting on them ends.
            for frontend in &frontends {
                frontend.abort();
            }
        }
        tokio::time::timeout(DEADLINE, session)
            .await
            .expect("the session hung after its stream ended")
            .expect("the session panicked");
        assert_eq!(metrics.pending_backend_dials.get(), 0, "a pending dial leaked");
        assert_eq!(metrics.established_connections.get(), 0, "a connection leaked");
        assert_eq!(metrics.full_receive_channels("Connect").get(), 0);
        for frontend in frontends {
            frontend.abort();
        }
    });
}

/// A local listener echoing whatever it is sent: where the harnesses send
/// every fuzzed dial, so no input reaches beyond this process.
async fn echo_listener() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a local port");
    let echo = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    echo
}

/// Points a DIAL_REQ at `echo`; leaves any other packet alone.
fn redirect_dial(packet: &mut Packet, echo: &str) {
    use konnectivity_proto::wire::packet::Payload;
    if packet.r#type == PacketType::DialReq as i32
        && let Some(Payload::DialRequest(request)) = &mut packet.payload
    {
        request.address = echo.to_owned();
    }
}

/// Waits until `done` holds, for at most `DEADLINE`; panics with `what`.
async fn settles(what: &str, done: impl Fn() -> bool) {
    let wait = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    if tokio::time::timeout(DEADLINE, wait).await.is_err() {
        panic!("{what}");
    }
}

/// The agent's session for one server stream. Switch bits 0 and 2: what
/// was negotiated ([`extensions`]). Every DIAL_REQ is sent to a local echo listener instead of
/// its fuzzed address, so no input reaches beyond this process.
pub fn agent_stream(data: &[u8]) {
    use konnectivity_agent::hooks::AgentMetrics;
    use konnectivity_agent::hooks::session;

    let (switches, mut packets) = decode(data);
    let extensions = extensions(switches);
    runtime().block_on(async {
        let echo = echo_listener().await;
        for packet in &mut packets {
            redirect_dial(packet, &echo);
        }

        let metrics = Arc::new(AgentMetrics::default());
        let (from_server, inbound) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
        let (attached, mut to_server) = agent_attached(inbound);
        tokio::spawn(async move { while to_server.recv().await.is_some() {} });
        let (_drain, drain) = konnectivity_plumbing::lifecycle::channel();
        let session = tokio::spawn(session::run(
            attached,
            extensions,
            agent_settings(),
            metrics.clone(),
            drain,
            None,
        ));
        for packet in packets {
            let _ = from_server.send(Ok(packet));
        }
        drop(from_server);
        tokio::time::timeout(DEADLINE, session)
            .await
            .expect("the session hung after its stream ended")
            .expect("the session panicked");
        // Endpoint sockets close as their tasks see the session gone.
        settles("endpoint connections outlived their session", || {
            metrics.open_endpoint_connections.get() == 0
        })
        .await;
    });
}

fn agent_settings() -> konnectivity_agent::hooks::SessionSettings {
    konnectivity_agent::hooks::SessionSettings {
        dial_timeout: Duration::from_secs(1),
        endpoint_limit: None,
        mark: None,
        resume_timeout: Duration::ZERO,
        stopping: None,
        handoff: None,
    }
}

/// A server stream for an agent session, fed from `inbound`; what the
/// session sends comes out of the returned receiver.
fn agent_attached(
    inbound: mpsc::UnboundedReceiver<Result<Packet, tonic::Status>>,
) -> (
    konnectivity_agent::hooks::session::Attached,
    mpsc::Receiver<Packet>,
) {
    let (body, writer) = tokio::sync::oneshot::channel::<konnectivity_mux::outbound::Writer>();
    let (to_harness, from_session) = mpsc::channel(64);
    tokio::spawn(async move {
        use tokio_stream::StreamExt;
        let Ok(mut writer) = writer.await else { return };
        while let Some(packet) = writer.next().await {
            if to_harness.send(packet).await.is_err() {
                return;
            }
        }
    });
    let attached = konnectivity_agent::hooks::session::Attached {
        inbound: Box::pin(UnboundedReceiverStream::new(inbound)),
        body,
        lost: Box::pin(std::future::pending()),
    };
    (attached, from_session)
}

/// A frontend client's Proxy stream (kube-apiserver's side of the gRPC
/// frontend), into a server whose one agent is a real agent session wired
/// to it in memory; every dial reaches a local echo listener. Switches:
/// bits 0 and 2, what was negotiated ([`extensions`]); bit 1, the client reads what it is sent
/// (otherwise it reads nothing and goes away at the end). Bit 3: the stream is a
/// node tunnel's resumable one (docs/resume.md, "Node tunnels": DATA numbered
/// both ways); bit 4, with the client reading: halfway through its packets the
/// stream is lost and a new one resumes it, offering the token and what the
/// client read (bit 5: first a count beyond what was sent, which must be
/// refused and change nothing). The DATA the client reads across both streams
/// must then continue each other: nothing lost, nothing twice.
///
/// After the client's stream ends and the client is gone, the frontend
/// must end, and no tunnel, pending dial or endpoint socket may be left on
/// the server or the agent.
pub fn frontend_stream(data: &[u8]) {
    frontend_exchange(data);
}

/// The DATA bytes among `frames`.
fn data_read(frames: &[konnectivity_proto::Frame]) -> usize {
    frames
        .iter()
        .map(|frame| match frame {
            konnectivity_proto::Frame::Data { data, .. } => data.len(),
            _ => 0,
        })
        .sum()
}

/// What the harness's client has read so far.
#[derive(Default)]
struct Answers {
    frames: Vec<konnectivity_proto::Frame>,
    /// The server ended its answer.
    ended: bool,
}

/// Waits for the first answer `wanted` picks (`None` if the answer ended
/// without one); panics with `missing` if none comes within `DEADLINE`.
async fn await_answer(
    answers: &watch::Receiver<Answers>,
    missing: &str,
    wanted: impl Fn(&konnectivity_proto::Frame) -> bool,
) -> Option<konnectivity_proto::Frame> {
    let mut answers = answers.clone();
    let wait = answers.wait_for(|answers| answers.ended || answers.frames.iter().any(&wanted));
    match tokio::time::timeout(DEADLINE, wait).await {
        Ok(Ok(answers)) => answers.frames.iter().find(|frame| wanted(frame)).cloned(),
        // The reader went away (the client does not read).
        Ok(Err(_)) => None,
        Err(_) => panic!("{missing}"),
    }
}

/// [`frontend_stream`], returning what the client read.
fn frontend_exchange(data: &[u8]) -> Vec<konnectivity_proto::Frame> {
    use konnectivity_agent::hooks::AgentMetrics;
    use konnectivity_agent::hooks::session;
    use konnectivity_proto::Frame;
    use konnectivity_server::hooks::Dialer;
    use konnectivity_server::hooks::FrontendClass;
    use konnectivity_server::hooks::{
        ClientAttachment, PeerIdentity, ResponseBody, Resumption, resume_client_stream, serve_client,
        serve_resumable_client,
    };
    use tokio_stream::StreamExt;

    let (switches, packets) = decode(data);
    let extensions = extensions(switches);
    let client_reads = switches & 2 != 0;
    let resumable = switches & 8 != 0;
    let cut_at = (resumable && client_reads && switches & 16 != 0).then_some(packets.len() / 2);
    let overreach_first = switches & 32 != 0;
    runtime().block_on(async {
        let echo = echo_listener().await;
        let ServerSide {
            registry,
            metrics,
            from_agent,
            mut to_agent,
            ..
        } = server_side(extensions);

        // The agent: what the server sends reaches its session (dials sent
        // to the echo listener), what it sends reaches the server's.
        let agent_metrics = Arc::new(AgentMetrics::default());
        let (server_to_agent, agent_inbound) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(mut packet) = to_agent.next().await {
                redirect_dial(&mut packet, &echo);
                if server_to_agent.send(Ok(packet)).is_err() {
                    return;
                }
            }
        });
        let (attached, mut from_agent_session) = agent_attached(agent_inbound);
        tokio::spawn(async move {
            while let Some(packet) = from_agent_session.recv().await {
                if from_agent.send(Ok(packet)).is_err() {
                    return;
                }
            }
        });
        let (_drain, drain) = konnectivity_plumbing::lifecycle::channel();
        tokio::spawn(session::run(
            attached,
            extensions,
            agent_settings(),
            agent_metrics.clone(),
            drain,
            None,
        ));

        let dialer = Dialer {
            registry,
            metrics: metrics.clone(),
            timeout: Some(Duration::from_secs(2)),
            class: FrontendClass::Apiserver,
            node_allowed: Arc::new(Vec::new()),
            client_node: None,
            tunnel_limit: None,
        };
        let (mut client, sent) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
        // Short, so that the stream the client leaves at the end closes soon.
        let resumption = Resumption::<ClientAttachment>::new(Duration::from_millis(200), "server-1");
        let node = PeerIdentity {
            agent_id: "node tunnel".to_owned(),
            proof: "certificate [\"node-1\"]".to_owned(),
        };
        let (received, token): (ResponseBody, _) = match resumable {
            true => {
                let (body, token) = serve_resumable_client(
                    dialer.clone(),
                    &resumption,
                    node.clone(),
                    None,
                    UnboundedReceiverStream::new(sent),
                );
                (body, Some(token))
            }
            false => (
                Box::pin(serve_client(dialer.clone(), UnboundedReceiverStream::new(sent))),
                None,
            ),
        };
        let (answers_tx, answers) = watch::channel(Answers::default());
        let answers_tx = Arc::new(answers_tx);
        // Kept only where the stream may be resumed: a client that does not
        // read drops every sender, which is how waits for answers end.
        let resume_tx = client_reads.then(|| answers_tx.clone());
        let read_into = |mut body: ResponseBody, answers_tx: Arc<watch::Sender<Answers>>| async move {
            while let Some(Ok(packet)) = body.next().await {
                answers_tx.send_modify(|answers| answers.frames.extend(Frame::try_from(packet).ok()));
            }
            answers_tx.send_modify(|answers| answers.ended = true);
        };
        let mut reader = if client_reads {
            tokio::spawn(read_into(received, answers_tx.clone()))
        } else {
            // Holds the answer unread for a while, then goes away. (Kept
            // short: it is most of what a run of this kind costs.)
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop((received, answers_tx));
            })
        };

        // The client behaves as kube-apiserver's does where the input lets
        // it: it waits for the answer to its dial, and before it ends its
        // stream, for its bytes to come back (the target echoes) or for the
        // answer to its CLOSE_REQ. Those answers must come.
        let mut connection = None;
        let mut dialing = false;
        let mut sent_bytes = 0;
        let mut close_sent = false;
        for (index, packet) in packets.into_iter().enumerate() {
            if Some(index) == cut_at
                && let Some(token) = &token
            {
                // The stream is lost under the client; a new one resumes it.
                reader.abort();
                let _ = (&mut reader).await;
                let (next_client, next_sent) = mpsc::unbounded_channel();
                drop(std::mem::replace(&mut client, next_client));
                let read: usize = data_read(&answers.borrow().frames);
                if overreach_first {
                    let beyond = (read + (1 << 20)).to_string();
                    let (_keep, nothing) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
                    let refused = resume_client_stream(
                        &resumption,
                        token,
                        Some(&beyond),
                        &node,
                        UnboundedReceiverStream::new(nothing),
                    )
                    .await
                    .err()
                    .expect("a resume claiming bytes never sent must be refused");
                    assert!(
                        matches!(refused.code(), tonic::Code::OutOfRange | tonic::Code::NotFound),
                        "{refused:?}"
                    );
                }
                let resumed = resume_client_stream(
                    &resumption,
                    token,
                    Some(&read.to_string()),
                    &node,
                    UnboundedReceiverStream::new(next_sent),
                )
                .await;
                reader = match resumed {
                    Ok((body, _)) => {
                        tokio::spawn(read_into(body, resume_tx.clone().expect("the client reads")))
                    }
                    // The stream had already ended (its connection closed).
                    Err(status) => {
                        assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
                        if let Some(answers_tx) = &resume_tx {
                            answers_tx.send_modify(|answers| answers.ended = true);
                        }
                        tokio::spawn(async {})
                    }
                };
            }
            let frame = Frame::try_from(packet.clone()).ok();
            let _ = client.send(Ok(packet));
            if !client_reads {
                continue;
            }
            match frame {
                Some(Frame::DialRequest { dial_id, .. }) if connection.is_none() && !dialing => {
                    dialing = true;
                    let answer = await_answer(
                        &answers,
                        "no DIAL_RSP for the dial",
                        |frame| matches!(frame, Frame::DialResponse { dial_id: id, .. } if *id == dial_id),
                    )
                    .await;
                    if let Some(Frame::DialResponse { result: Ok(id), .. }) = answer {
                        connection = Some(id);
                    }
                }
                Some(Frame::Data { connect_id, data, .. })
                    if Some(connect_id) == connection && !close_sent =>
                {
                    sent_bytes += data.len();
                }
                Some(Frame::CloseRequest { connect_id }) if Some(connect_id) == connection => {
                    close_sent = true
                }
                _ => {}
            }
        }
        if let Some(connect_id) = connection {
            if close_sent {
                await_answer(&answers, "no CLOSE_RSP for the CLOSE_REQ", |frame| {
                    matches!(frame, Frame::CloseResponse { .. })
                })
                .await;
            } else if sent_bytes > 0 {
                let echoed = |answers: &Answers| {
                    answers
                        .frames
                        .iter()
                        .map(|frame| match frame {
                            Frame::Data {
                                connect_id: id, data, ..
                            } if *id == connect_id => data.len(),
                            _ => 0,
                        })
                        .sum::<usize>()
                };
                let mut waiting = answers.clone();
                let wait = waiting.wait_for(|answers| {
                    answers.ended
                        || echoed(answers) >= sent_bytes
                        || answers
                            .frames
                            .iter()
                            .any(|f| matches!(f, Frame::CloseResponse { .. }))
                });
                tokio::time::timeout(DEADLINE, wait)
                    .await
                    .expect("bytes sent on an open connection never came back")
                    .ok();
            }
        }
        drop(client);
        tokio::time::timeout(DEADLINE, reader)
            .await
            .expect("the frontend's answer never ended after the client's stream did")
            .expect("the client's reader panicked");
        let read = answers.borrow().frames.clone();
        if resumable {
            // Numbered from 0 across every stream the client read: nothing
            // lost, nothing twice.
            let mut expected = 0;
            for frame in &read {
                if let Frame::Data { data, offset, .. } = frame {
                    assert_eq!(*offset, Some(expected), "DATA out of place: {read:?}");
                    expected += data.len() as u64;
                }
            }
        }
        let proxy_streams = metrics.grpc_connections("Proxy");
        settles("the frontend outlived its client", || proxy_streams.get() == 0).await;
        settles("a tunnel outlived its client", || {
            metrics.established_connections.get() == 0 && metrics.pending_backend_dials.get() == 0
        })
        .await;
        settles("an endpoint connection outlived its tunnel", || {
            agent_metrics.open_endpoint_connections.get() == 0
        })
        .await;
        read
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use konnectivity_proto::{ConnectId, Frame};

    /// The node tunnel's mode is not vacuous either: numbered DATA lost
    /// with its stream halfway (after a refused overreach) is all echoed,
    /// numbered on across both streams.
    #[test]
    fn a_node_stream_resumed_halfway_echoes_everything_once() {
        let connect_id = ConnectId::new(1).unwrap();
        let mut frames = vec![Frame::DialRequest {
            protocol: "tcp".into(),
            address: "10.0.0.5:10250".into(),
            dial_id: DialId::new(7),
        }];
        for offset in [0u64, 1000, 2000, 3000, 4000] {
            frames.push(Frame::Data {
                connect_id,
                data: bytes::Bytes::from(vec![b'x'; 1000]),
                offset: Some(offset),
            });
        }
        let mut input = vec![2 | 8 | 16 | 32];
        for frame in frames {
            Packet::from(frame).encode_length_delimited(&mut input).unwrap();
        }
        let read = frontend_exchange(&input);
        assert_eq!(data_read(&read), 5000, "{read:?}");
    }

    /// The harness is not vacuous: a well-formed exchange goes all the way
    /// through the frontend, the server's and the agent's sessions to the
    /// echo listener and back.
    #[test]
    fn a_valid_client_exchange_is_echoed_through_both_sessions() {
        let connect_id = ConnectId::new(1).unwrap();
        let sent = [
            Frame::DialRequest {
                protocol: "tcp".into(),
                address: "10.0.0.5:10250".into(),
                dial_id: DialId::new(7),
            },
            Frame::Data {
                connect_id,
                data: bytes::Bytes::from_static(b"hello"),
                offset: None,
            },
        ];
        let mut input = vec![3u8];
        for frame in sent {
            Packet::from(frame).encode_length_delimited(&mut input).unwrap();
        }
        let read = frontend_exchange(&input);
        assert!(
            matches!(&read[0], Frame::DialResponse { dial_id, result: Ok(id) } if dial_id.get() == 7 && *id == connect_id),
            "{read:?}"
        );
        let echoed: Vec<u8> = read
            .iter()
            .filter_map(|frame| match frame {
                Frame::Data { data, .. } => Some(data.to_vec()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(echoed, b"hello", "{read:?}");

        // And a CLOSE_REQ is answered.
        let mut input = vec![3u8];
        for frame in [
            Frame::DialRequest {
                protocol: "tcp".into(),
                address: "10.0.0.5:10250".into(),
                dial_id: DialId::new(8),
            },
            Frame::CloseRequest { connect_id },
        ] {
            Packet::from(frame).encode_length_delimited(&mut input).unwrap();
        }
        let read = frontend_exchange(&input);
        assert!(
            matches!(read.last(), Some(Frame::CloseResponse { connect_id: id, error: None }) if *id == connect_id),
            "{read:?}"
        );
    }
}
