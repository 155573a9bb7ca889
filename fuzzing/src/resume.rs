//! The resume of a lost agent stream on the server (docs/resume.md): a
//! session that carried connections loses its stream, and a new stream
//! offering a token takes over, sending whatever the fuzzer wrote: RESUME
//! lists with any ids, positions and flags, DATA at any offset, credit past
//! anything sent, closes for anything.
//!
//! Input: one byte of switches, then packets as the stream targets read them.
//! Switch bit 0: the new stream offers the session's real token (otherwise a
//! forged one, which must be refused and change nothing); bit 1: it offers
//! it under another identity (refused too).
//!
//! The stream ends with STREAM_END (the agent ending it on purpose).
//! Whatever arrives, the session must neither panic nor hang, what it sends
//! must be in order (DATA of each connection at increasing offsets, never
//! past what the frontend sent), and once the stream ends nothing is left:
//! no connection, no pending dial.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use konnectivity_mux::Extensions;
use konnectivity_proto::{ConnectId, DialId, Frame, Packet};
use konnectivity_server::hooks::{
    Announced, Attachment, Backend, BackendId, Command, Event, PeerIdentity, Registry, Resume, Resumption,
    ServerMetrics, Strategy, Takeover, session,
};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::streams::{DEADLINE, decode, runtime};

fn identity(agent_id: &str) -> PeerIdentity {
    PeerIdentity {
        agent_id: agent_id.to_owned(),
        proof: "certificate [\"agent\"]".to_owned(),
    }
}

pub fn resume_handshake(data: &[u8]) {
    let (switches, packets) = decode(data);
    let real_token = switches & 1 != 0;
    let other_identity = switches & 2 != 0;
    runtime().block_on(async {
        let metrics = Arc::new(ServerMetrics::default());
        let registry = Arc::new(Registry::new(vec![Strategy::Default], metrics.clone()));
        let announced = Announced {
            agent_id: "fuzzed-agent".to_owned(),
            extensions: Extensions::Resume,
            ..Announced::default()
        };
        let (backend, queues) = Backend::open(BackendId(1), announced, metrics.clone());
        registry.add(backend.clone());
        let resumption = Resumption::new(Duration::from_secs(30), "server-1");
        let ticket = resumption.issue(identity("fuzzed-agent"), None);
        let token = ticket.token.clone();
        let (from_agent, inbound) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
        let session = tokio::spawn(session::run(
            backend.clone(),
            UnboundedReceiverStream::new(inbound),
            queues.commands,
            registry.clone(),
            metrics.clone(),
            Some(Resume {
                ticket,
                timeout: Duration::from_secs(30),
            }),
        ));
        let mut to_agent = queues.to_agent;
        tokio::spawn(async move { while to_agent.next().await.is_some() {} });

        // Two connections on the first stream, each with 4 KiB sent by its
        // frontend (kept for a resume) and its port read.
        let mut frontends = Vec::new();
        for (dial, id) in [(1, 5), (2, 6)] {
            let (route, mut port, window) = konnectivity_mux::connection(Extensions::Resume);
            let dial_id = DialId::new(dial);
            backend
                .command(Command::Dial {
                    dial_id,
                    address: "192.0.2.1:443".into(),
                    route,
                })
                .await
                .expect("the session takes commands");
            let connect_id = ConnectId::new(id).unwrap();
            let answer = Frame::DialResponse {
                dial_id,
                result: Ok(connect_id),
            };
            from_agent.send(Ok(answer.into())).unwrap();
            assert!(matches!(port.recv().await, Some(Event::Dialed(Ok(_)))));
            window.reserve(4096).await.unwrap();
            backend
                .send(window.data(connect_id, Bytes::from(vec![7; 4096])))
                .await
                .unwrap();
            frontends.push(tokio::spawn(async move {
                while let Some(event) = port.recv().await {
                    if let Event::Data(bytes) = event {
                        let _ = port.written(bytes.len());
                    }
                }
            }));
        }
        // The stream is lost (a reset, as a cut makes it).
        from_agent
            .send(Err(tonic::Status::unavailable("connection reset")))
            .unwrap();
        drop(from_agent);

        let offered = match real_token {
            true => token.clone(),
            false => format!("{}@server-1", "f".repeat(48)),
        };
        let who = identity(if other_identity {
            "another-agent"
        } else {
            "fuzzed-agent"
        });
        let found = resumption.find(&[offered.as_str()], &who);
        let resumable = real_token && !other_identity;
        match (&found, resumable) {
            (Ok(Some(_)), true) => {}
            (Err(_), false) => {}
            (other, _) => panic!("offer real={real_token} other identity={other_identity}: {other:?}"),
        }
        if let Ok(Some(attach)) = found {
            let (to_session, inbound) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
            let (writer, answer) = tokio::sync::oneshot::channel();
            let attachment = Attachment {
                inbound: Box::pin(UnboundedReceiverStream::new(inbound)),
                writer,
            };
            if attach.send(Takeover::Resume(Box::new(attachment))).is_err() {
                panic!("the session waits for a resume");
            }
            let mut writer = tokio::time::timeout(DEADLINE, answer)
                .await
                .expect("the session takes the stream")
                .expect("the session answers with its writer");
            // What the session sends: its RESUME list first, then DATA of a
            // connection only at increasing offsets within what was sent.
            let checker = tokio::spawn(async move {
                let mut first = true;
                let mut next_offset = std::collections::HashMap::new();
                while let Some(packet) = writer.next().await {
                    let frame = Frame::try_from(packet).expect("the session sends valid packets");
                    if first {
                        assert!(
                            matches!(frame, Frame::Resume { .. }),
                            "RESUME first, got {frame:?}"
                        );
                        first = false;
                    }
                    if let Frame::Data {
                        connect_id,
                        data,
                        offset,
                    } = frame
                    {
                        let offset = offset.expect("numbered DATA on a resumed stream");
                        let end = offset + data.len() as u64;
                        assert!(end <= 4096, "DATA past what the frontend sent");
                        let last = next_offset.entry(connect_id).or_insert(0u64);
                        assert!(offset >= *last, "DATA out of order");
                        *last = end;
                    }
                }
            });
            for packet in packets {
                let _ = to_session.send(Ok(packet));
            }
            // The agent ends the stream on purpose: the session ends (an end
            // without STREAM_END would be a loss, waited out for a resume).
            let _ = to_session.send(Ok(Frame::StreamEnd.into()));
            drop(to_session);
            tokio::time::timeout(DEADLINE, session)
                .await
                .expect("the session hung after its resumed stream ended")
                .expect("the session panicked");
            checker.abort();
        } else {
            // Refused: the session still waits for its own agent; stopping
            // the fuzzed world ends it.
            session.abort();
        }
        for frontend in frontends {
            frontend.abort();
        }
        if resumable {
            assert_eq!(metrics.established_connections.get(), 0, "a connection leaked");
            assert_eq!(metrics.pending_backend_dials.get(), 0, "a pending dial leaked");
        }
    });
}
