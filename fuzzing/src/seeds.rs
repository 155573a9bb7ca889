//! The seed inputs committed under `fuzz/corpus/TARGET/seed-*`: valid and
//! nearly valid inputs that start the fuzzer where the interesting code is.
//! `cargo test` checks the committed files match these (regenerate with
//! `UPDATE_SEEDS=1 cargo test -p konnectivity-fuzzing`).

use bytes::Bytes;
use konnectivity_proto::wire::packet::Payload;
use konnectivity_proto::wire::{Data, DialResponse};
use konnectivity_proto::{ConnectId, DialId, Frame, Packet, PacketType};
use prost::Message;

/// (target, seed name, bytes)
pub fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let mut seeds = Vec::new();
    let mut add = |target, name, bytes: Vec<u8>| seeds.push((target, name, bytes));

    for (name, text) in [
        (
            "connect",
            "CONNECT 10.0.0.5:10250 HTTP/1.1\r\nHost: 10.0.0.5:10250\r\n\r\n",
        ),
        (
            "connect-early-data",
            "CONNECT node-a:443 HTTP/1.1\r\nUser-Agent: Go-http-client/1.1\r\n\r\n\x16\x03\x01",
        ),
        (
            "connect-ipv6",
            "CONNECT [fd00::5]:10250 HTTP/1.1\r\nHost: [fd00::5]:10250\r\n\r\n",
        ),
        ("get", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
        // A gRPC client on the CONNECT frontend: HTTP/2's preface and SETTINGS.
        (
            "http2-preface",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
        ),
        ("partial", "CONNECT 10.0.0.5:10250 HTTP/1.1\r\nHost: 10"),
        ("bad-target", "CONNECT 10.0.0.5 HTTP/1.1\r\n\r\n"),
    ] {
        add("connect_head", name, text.as_bytes().to_vec());
    }
    for (name, text) in [
        (
            "all-keys",
            "ipv4=10.0.0.5&ipv6=fd00::5&host=node-a&cidr=10.0.0.0/8&default-route=true",
        ),
        ("repeated", "ipv4=10.0.0.5&ipv4=10.0.0.6"),
        ("unknown-key", "zone=a"),
        ("escaped", "host=node%2Da&ipv6=%3A%3A1"),
    ] {
        add("agent_identifiers", name, text.as_bytes().to_vec());
    }
    for (name, text) in [
        ("ipv4", "10.96.0.1:443=10.222.1.10:6443"),
        ("ipv6", "[fd00:96::1]:443=[fd00:222::10]:6443"),
        ("loopback-vip", "127.0.0.1:443=10.0.0.1:6443"),
        ("zero-port", "10.96.0.1:0=10.0.0.1:6443"),
    ] {
        add("capture", name, text.as_bytes().to_vec());
    }
    let prev_result = r#""prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/cni-1"}],"ips":[{"address":"10.244.1.5/24","interface":0}]}"#;
    let conf = |extra: &str| {
        format!(
            r#"{{"cniVersion":"1.0.0","name":"kindnet","type":"konnectivity-cni","excludeNamespaces":["kube-system"]{extra}}}"#
        )
    };
    let env = |command: &str| {
        format!(
            "CNI_COMMAND={command}\nCNI_CONTAINERID=abc123\nCNI_NETNS=/var/run/netns/cni-1\nCNI_IFNAME=eth0\n\
             CNI_PATH=/opt/cni/bin\nCNI_ARGS=K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1\n\n"
        )
    };
    for (name, text) in [
        ("version", format!("{}{}", env("VERSION"), conf(""))),
        (
            "add",
            format!("{}{}", env("ADD"), conf(&format!(",{prev_result}"))),
        ),
        (
            "add-excluded",
            format!(
                "{}{}",
                env("ADD").replace("=default;", "=kube-system;"),
                conf(&format!(",{prev_result}"))
            ),
        ),
        ("del", format!("{}{}", env("DEL"), conf(""))),
        (
            "check",
            format!("{}{}", env("CHECK"), conf(&format!(",{prev_result}"))),
        ),
        ("status", format!("{}{}", env("STATUS"), conf(""))),
        (
            "gc",
            format!(
                "{}{}",
                env("GC"),
                conf(r#","cni.dev/valid-attachments":[{"containerID":"abc123","ifname":"eth0"}]"#)
            ),
        ),
        ("no-command", format!("CNI_CONTAINERID=x\n\n{}", conf(""))),
        ("bad-json", format!("{}{{\"cniVersion\":", env("ADD"))),
    ] {
        add("cni_plugin", name, text.into_bytes());
    }

    let id = |raw| ConnectId::new(raw).expect("a valid id");
    let data = |connect_id, len| Frame::Data {
        connect_id: id(connect_id),
        data: Bytes::from(vec![0x5a; len]),
        offset: None,
    };
    let numbered = |connect_id, offset, len| Frame::Data {
        connect_id: id(connect_id),
        data: Bytes::from(vec![0x5a; len]),
        offset: Some(offset),
    };
    // Server side: the harness waits on dials 1 and 2.
    let dialed = Frame::DialResponse {
        dial_id: DialId::new(1),
        result: Ok(id(5)),
    };
    let refused = Frame::DialResponse {
        dial_id: DialId::new(2),
        result: Err("dial tcp 10.0.0.9:80: connect: connection refused".to_owned()),
    };
    // The dial answered, then 9 x 256 KiB: past the 2 MiB window.
    let flood = |dialed: Frame| {
        std::iter::once(dialed)
            .chain(std::iter::repeat_with(|| data(5, 262_144)).take(9))
            .collect::<Vec<_>>()
    };
    for (name, switches, frames) in [
        (
            "dial-data-close",
            2,
            vec![
                dialed.clone(),
                data(5, 1024),
                Frame::CloseResponse {
                    connect_id: id(5),
                    error: None,
                },
            ],
        ),
        ("dial-refused", 2, vec![refused.clone()]),
        (
            // Resume negotiated: numbered DATA in order, a repeat, a gap,
            // credit by position, a position past what was sent, a RESUME.
            "resume-numbered",
            4 | 2,
            vec![
                dialed.clone(),
                numbered(5, 0, 1024),
                numbered(5, 1024, 1024),
                numbered(5, 0, 1024),
                numbered(5, 9999, 10),
                Frame::WindowUpdate {
                    connect_id: id(5),
                    bytes: 0,
                    written: Some(1 << 40),
                },
                Frame::Resume {
                    connections: vec![konnectivity_proto::ResumeEntry {
                        connect_id: id(5),
                        received: 0,
                        written: 0,
                        closing: false,
                    }],
                    last: true,
                },
            ],
        ),
        (
            "flow-window-update",
            3,
            vec![
                dialed.clone(),
                Frame::WindowUpdate {
                    connect_id: id(5),
                    bytes: 65536,
                    written: None,
                },
                data(5, 4096),
            ],
        ),
        (
            "upstream-agent-floods-an-unread-connection",
            0,
            flood(dialed.clone()),
        ),
        ("overrun", 1, flood(dialed.clone())),
        (
            "unknown-ids",
            2,
            vec![
                data(77, 10),
                Frame::CloseResponse {
                    connect_id: id(78),
                    error: None,
                },
                Frame::DialResponse {
                    dial_id: DialId::new(99),
                    result: Ok(id(6)),
                },
            ],
        ),
        (
            "drain-and-dial-close",
            2,
            vec![
                Frame::Drain,
                Frame::CloseDial {
                    dial_id: DialId::new(1),
                },
                dialed.clone(),
            ],
        ),
        (
            "agent-sends-server-packets",
            2,
            vec![
                Frame::DialRequest {
                    protocol: "tcp".into(),
                    address: "x:1".into(),
                    dial_id: DialId::new(3),
                },
                Frame::CloseRequest { connect_id: id(5) },
            ],
        ),
    ] {
        let mut packets: Vec<Packet> = frames.into_iter().map(Packet::from).collect();
        if name == "unknown-ids" {
            // What Frame refuses to build: wrong payloads and unknown types.
            packets.push(Packet {
                r#type: 99,
                payload: None,
            });
            packets.push(Packet {
                r#type: PacketType::Data as i32,
                payload: Some(Payload::DialResponse(DialResponse {
                    random: 1,
                    connect_id: 5,
                    error: String::new(),
                })),
            });
            packets.push(Packet {
                r#type: PacketType::Data as i32,
                payload: Some(Payload::Data(Data {
                    connect_id: 0,
                    data: Bytes::from_static(&[1, 2, 3]),
                    error: String::new(),
                    offset: None,
                })),
            });
            packets.push(Packet {
                r#type: PacketType::Data as i32,
                payload: Some(Payload::Data(Data {
                    connect_id: i64::MIN,
                    data: Bytes::new(),
                    error: String::new(),
                    offset: None,
                })),
            });
        }
        add("server_stream", name, encode(switches, &packets));
    }

    // Agent side: dials go to the harness's echo listener.
    let dial = |random| Frame::DialRequest {
        protocol: "tcp".into(),
        address: "10.0.0.5:10250".into(),
        dial_id: DialId::new(random),
    };
    for (name, switches, frames) in [
        (
            "dial-data-close",
            0,
            vec![dial(1), data(1, 2048), Frame::CloseRequest { connect_id: id(1) }],
        ),
        (
            "flow-dial-data",
            1,
            vec![
                dial(1),
                dial(2),
                data(1, 4096),
                data(2, 4096),
                Frame::WindowUpdate {
                    connect_id: id(1),
                    bytes: 1 << 20,
                    written: None,
                },
            ],
        ),
        (
            "dial-then-cancel",
            0,
            vec![
                dial(7),
                Frame::CloseDial {
                    dial_id: DialId::new(7),
                },
            ],
        ),
        (
            "udp-and-duplicates",
            0,
            vec![
                Frame::DialRequest {
                    protocol: "udp".into(),
                    address: "x:53".into(),
                    dial_id: DialId::new(1),
                },
                dial(2),
                dial(2),
            ],
        ),
        (
            "server-sends-agent-packets",
            0,
            vec![
                Frame::Drain,
                Frame::CloseResponse {
                    connect_id: id(1),
                    error: None,
                },
                Frame::DialResponse {
                    dial_id: DialId::new(1),
                    result: Ok(id(1)),
                },
            ],
        ),
    ] {
        let packets: Vec<Packet> = frames.into_iter().map(Packet::from).collect();
        add("agent_stream", name, encode(switches, &packets));
    }

    // Frontend client: the agent behind the server numbers connections from 1.
    let close = |connect_id| Frame::CloseRequest {
        connect_id: id(connect_id),
    };
    // A node tunnel's resumable stream (switch bit 3): numbered DATA, lost
    // and resumed halfway (bit 4), first with a count beyond what was sent
    // (bit 5); and what must be refused on it.
    let node_stream = || {
        vec![
            dial(1),
            numbered(1, 0, 1000),
            numbered(1, 1000, 1000),
            numbered(1, 2000, 1000),
            numbered(1, 3000, 1000),
            numbered(1, 4000, 1000),
        ]
    };
    for (name, switches, frames) in [
        ("node-resume-cut", 2 | 8 | 16, node_stream()),
        ("node-resume-overreach", 2 | 8 | 16 | 32, node_stream()),
        (
            "node-unnumbered-gap-overack",
            2 | 8,
            vec![
                dial(1),
                data(1, 100),
                numbered(1, 500, 10),
                Frame::WindowUpdate {
                    connect_id: id(1),
                    bytes: 1 << 20,
                    written: Some(1 << 40),
                },
            ],
        ),
        ("dial-data-close", 2, vec![dial(1), data(1, 2048), close(1)]),
        (
            "flow-echo-bulk",
            3,
            std::iter::once(dial(1))
                .chain(std::iter::repeat_with(|| data(1, 262_144)).take(12))
                .collect(),
        ),
        (
            "never-reads",
            1,
            std::iter::once(dial(1))
                .chain(std::iter::repeat_with(|| data(1, 262_144)).take(12))
                .collect(),
        ),
        (
            "out-of-order",
            2,
            vec![
                data(1, 10),
                close(5),
                dial(3),
                dial(4),
                Frame::CloseDial {
                    dial_id: DialId::new(3),
                },
                data(9, 10),
            ],
        ),
        (
            "client-sends-agent-packets",
            2,
            vec![
                Frame::DialResponse {
                    dial_id: DialId::new(1),
                    result: Ok(id(1)),
                },
                Frame::Drain,
                dial(1),
                Frame::CloseResponse {
                    connect_id: id(1),
                    error: None,
                },
                Frame::WindowUpdate {
                    connect_id: id(1),
                    bytes: 1 << 30,
                    written: None,
                },
            ],
        ),
    ] {
        let packets: Vec<Packet> = frames.into_iter().map(Packet::from).collect();
        add("frontend_stream", name, encode(switches, &packets));
    }

    // The resumed stream of a session with connections 5 and 6, 4 KiB sent
    // on each: the agent received half of 5 and all of 6, closed 6, and
    // lists one it never had and one twice; then numbered DATA and closes.
    let entry = |connect_id, received, written, closing| konnectivity_proto::ResumeEntry {
        connect_id: id(connect_id),
        received,
        written,
        closing,
    };
    let resumed = [
        Frame::Resume {
            connections: vec![entry(5, 0, 0, false), entry(9, 10, 0, false)],
            last: false,
        },
        Frame::Resume {
            connections: vec![entry(6, 4096, 4096, true), entry(5, 0, 0, false)],
            last: true,
        },
        numbered(5, 0, 100),
        numbered(5, 50, 100),
        Frame::WindowUpdate {
            connect_id: id(5),
            bytes: 0,
            written: Some(4096),
        },
        Frame::CloseResponse {
            connect_id: id(6),
            error: None,
        },
        Frame::CloseResponse {
            connect_id: id(5),
            error: Some("connection reset by peer".to_owned()),
        },
    ];
    for (name, switches) in [("resumed", 1), ("forged-token", 0), ("another-identity", 3)] {
        let packets: Vec<Packet> = resumed.iter().cloned().map(Packet::from).collect();
        add("resume_handshake", name, encode(switches, &packets));
    }
    seeds
}

fn encode(switches: u8, packets: &[Packet]) -> Vec<u8> {
    let mut out = vec![switches];
    for packet in packets {
        packet.encode_length_delimited(&mut out).expect("a Vec grows");
    }
    out
}
