//! Arbitrary packet sequences on an agent stream, seen from the server's
//! side and from the agent's. Input: one byte of switches, then packets in
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
use konnectivity_proto::flow::{self, SendWindow};
use konnectivity_proto::{DialId, Packet, PacketType};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;

/// More packets than this in one input are ignored: the run stays short.
const MAX_PACKETS: usize = 512;
/// A session that has not wound down by then is hung.
const DEADLINE: Duration = Duration::from_secs(10);

fn decode(data: &[u8]) -> (u8, Vec<Packet>) {
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

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// The server's session for one agent stream. Switches: bit 0, the agent
/// negotiated flow control; bit 1, the frontends read what reaches them
/// (otherwise they read nothing and go away at the end).
pub fn server_stream(data: &[u8]) {
    use konnectivity_server::backend::registry::Registry;
    use konnectivity_server::backend::strategy::Strategy;
    use konnectivity_server::backend::{Backend, BackendId, Command, Event, session};
    use konnectivity_server::metrics::ServerMetrics;

    let (switches, packets) = decode(data);
    let flow_control = switches & 1 != 0;
    let frontends_read = switches & 2 != 0;
    runtime().block_on(async {
        let metrics = Arc::new(ServerMetrics::default());
        let registry = Arc::new(Registry::new(vec![Strategy::Default], metrics.clone()));
        let (outbound, mut to_agent) = mpsc::channel(64);
        let (commands_tx, commands) = mpsc::channel(16);
        let backend = Arc::new(Backend::new(
            BackendId(1),
            "fuzzed-agent".to_owned(),
            Default::default(),
            false,
            flow_control,
            outbound,
            commands_tx,
            metrics.clone(),
        ));
        registry.add(backend.clone());
        // What the server sends the agent is not under test here; keep the
        // queue moving so the session never waits on it.
        tokio::spawn(async move { while to_agent.recv().await.is_some() {} });

        let (from_agent, inbound) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
        let session = tokio::spawn(session::run(
            backend.clone(),
            UnboundedReceiverStream::new(inbound),
            commands,
            registry,
            metrics.clone(),
        ));

        // Two frontends wait on dials 1 and 2, which fuzzed DIAL_RSPs may answer.
        let mut frontends = Vec::new();
        for id in [1, 2] {
            let (events, mut receiver) = mpsc::unbounded_channel();
            let (receive_gate, mut credit) = flow::receive_window(flow_control);
            backend
                .command(Command::Dial {
                    dial_id: DialId::new(id),
                    address: "192.0.2.1:443".to_owned(),
                    events,
                    send_window: SendWindow::new(flow_control),
                    receive_gate,
                })
                .await
                .expect("the session takes commands");
            if frontends_read {
                frontends.push(tokio::spawn(async move {
                    while let Some(event) = receiver.recv().await {
                        if let Event::Data(bytes) = event {
                            let _ = credit.consumed(bytes.len());
                        }
                    }
                }));
            } else {
                frontends.push(tokio::spawn(async move {
                    // Holds on, reading nothing, until the end.
                    std::future::pending::<()>().await;
                    drop((receiver, credit));
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

/// The agent's session for one server stream. Switch bit 0: flow control
/// negotiated. Every DIAL_REQ is sent to a local echo listener instead of
/// its fuzzed address, so no input reaches beyond this process.
pub fn agent_stream(data: &[u8]) {
    use konnectivity_agent::metrics::AgentMetrics;
    use konnectivity_agent::session::{self, SessionSettings};
    use konnectivity_proto::wire::packet::Payload;

    let (switches, mut packets) = decode(data);
    let flow_control = switches & 1 != 0;
    runtime().block_on(async {
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
        for packet in &mut packets {
            if packet.r#type == PacketType::DialReq as i32
                && let Some(Payload::DialRequest(request)) = &mut packet.payload
            {
                request.address = echo.clone();
            }
        }

        let metrics = Arc::new(AgentMetrics::default());
        let (outbound, mut to_server) = mpsc::channel(64);
        tokio::spawn(async move { while to_server.recv().await.is_some() {} });
        let (from_server, inbound) = mpsc::unbounded_channel::<Result<Packet, tonic::Status>>();
        let (_drain_tx, drain) = watch::channel(false);
        let settings = SessionSettings {
            dial_timeout: Duration::from_secs(1),
            endpoint_limit: None,
            mark: None,
        };
        let session = tokio::spawn(session::run(
            UnboundedReceiverStream::new(inbound),
            outbound,
            flow_control,
            settings,
            metrics.clone(),
            drain,
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
        let released = async {
            while metrics.open_endpoint_connections.get() != 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), released)
            .await
            .expect("endpoint connections outlived their session");
    });
}
