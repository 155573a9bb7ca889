//! The node-traffic policy on the server: node clients reach only the
//! allowed API server destinations, only through control-plane agents, and
//! control-plane agents never carry ordinary egress.

use std::time::Duration;

use crate::support::certs::Pki;
use crate::support::netns::{kill_connections_to, root_or_skip};
use crate::support::procs::{Agent, Server};
use crate::support::scrape::metric;
use crate::support::targets::{self, Target};
use crate::support::{TempDir, free_port, wait_until};
use konnectivity_client::{DialError, Tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONTROL_PLANE_ID: &str = "cp-1";

struct NodeSetup {
    dir: TempDir,
    pki: Pki,
    server: Server,
    node_port: u16,
    /// What node clients may reach (the "API server").
    allowed: Target,
    /// Reachable on loopback, but not allowed for node clients.
    other: Target,
    cluster_agent: Agent,
    control_plane_agent: Agent,
}

async fn setup() -> NodeSetup {
    setup_with(&[]).await
}

/// The server (with `extra` flags), a cluster agent and the control-plane
/// agent, waiting for as many agent streams as the server admits.
async fn setup_with(extra: &[String]) -> NodeSetup {
    let dir = TempDir::new("konn-node");
    let pki = Pki::new(dir.path());
    let allowed = targets::blob().await;
    let other = targets::blob().await;
    let node_port = free_port();
    let server = Server::start(
        dir.path(),
        &pki,
        "grpc",
        true,
        &[
            format!("--node-frontend-port={node_port}"),
            "--node-frontend-bind-address=127.0.0.1".to_owned(),
            format!("--node-client-ca-cert={}", pki.node_ca.display()),
            format!("--node-allowed-destinations={},10.96.0.0/12:443", allowed.addr),
            format!("--control-plane-agent-ids={CONTROL_PLANE_ID}"),
        ]
        .into_iter()
        .chain(extra.iter().cloned())
        .collect::<Vec<_>>(),
    )
    .await;
    let cluster_agent = Agent::start(dir.path(), &pki, server.agent_port, "cluster-1", &[]);
    let control_plane_agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        CONTROL_PLANE_ID,
        &[
            format!("--agent-cert={}", pki.control_plane_agent.cert.display()),
            format!("--agent-key={}", pki.control_plane_agent.key.display()),
        ],
    );
    if extra.is_empty() {
        server.wait_backends(2).await;
    }
    NodeSetup {
        dir,
        pki,
        server,
        node_port,
        allowed,
        other,
        cluster_agent,
        control_plane_agent,
    }
}

impl NodeSetup {
    async fn node_tunnel(&self, identity: &crate::support::certs::CertFiles) -> Tunnel {
        let tls = self.pki.client_tls(Some(identity), &[]);
        Tunnel::connect_tls("localhost", self.node_port, tls)
            .await
            .unwrap()
            .with_dial_timeout(Duration::from_secs(10))
    }

    /// How many dials an agent has completed.
    async fn dials_on(agent: &Agent) -> f64 {
        metric(
            agent.health_port,
            "konnectivity_network_proxy_agent_dial_duration_seconds_count",
        )
        .await
        .unwrap()
    }
}

async fn echo_once(tunnel: &Tunnel, address: &str) {
    let mut stream = tunnel.dial(address).await.unwrap();
    targets::start_echo(&mut stream).await.unwrap();
    stream.write_all(b"ping through the node tunnel").await.unwrap();
    let mut echoed = [0u8; 28];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping through the node tunnel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_clients_reach_allowed_destinations_only_through_the_control_plane_agent() {
    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    for _ in 0..10 {
        echo_once(&tunnel, &setup.allowed.addr.to_string()).await;
    }
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 10.0);
    assert_eq!(
        NodeSetup::dials_on(&setup.cluster_agent).await,
        0.0,
        "a cluster agent got a node dial"
    );
    // The node frontend knows whose streams these were: the certificate
    // names node-1 (system:node:node-1, as kubelet's do).
    let port = setup.server.health_port;
    let server_metric = |series: &'static str| async move {
        metric(port, &format!("konnectivity_network_proxy_server_{series}")).await
    };
    let by_node = server_metric(r#"node_frontend_streams_total{identity="node"}"#).await;
    assert!(by_node >= Some(1.0), "{by_node:?}");
    assert_eq!(
        server_metric(r#"node_frontend_streams_total{identity="no_node"}"#).await,
        None
    );
    let open = tunnel.dial(&setup.allowed.addr.to_string()).await.unwrap();
    assert_eq!(server_metric("node_frontend_nodes").await, Some(1.0));
    drop(open);
    drop(tunnel);
    wait_until(Duration::from_secs(5), "node-1's streams to end", || async {
        server_metric("node_frontend_nodes").await == Some(0.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_agent_must_run_on_a_node_control_plane_nodes_names() {
    // The control-plane agent's certificate names cp-1 (its id) and the
    // node cp-node; only other-node may run control-plane agents.
    let setup = setup_with(&["--control-plane-nodes=other-node".to_owned()]).await;
    wait_until(Duration::from_secs(10), "the refusal to be logged", || async {
        setup
            .server
            .proc
            .log_text()
            .contains("refused a control-plane agent on a node")
    })
    .await;
    // The agent logs the refusal once its status arrives, which may be just
    // after the server logged it.
    wait_until(
        Duration::from_secs(10),
        "the agent to log the refusal",
        || async {
            setup
                .control_plane_agent
                .proc
                .log_text()
                .contains("not one of --control-plane-nodes")
        },
    )
    .await;
    let log = setup.control_plane_agent.proc.log_text();
    assert!(log.contains("cp-node"), "{log}");
    setup.server.wait_backends(1).await;

    // On a node the flag names, the same agent is admitted.
    let setup = setup_with(&["--control-plane-nodes=cp-node,other-node".to_owned()]).await;
    setup.server.wait_backends(2).await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    echo_once(&tunnel, &setup.allowed.addr.to_string()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_dials_outside_the_allow_list_are_refused_and_counted() {
    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    for address in [setup.other.addr.to_string(), "kubernetes.default:443".to_owned()] {
        let error = tunnel.dial(&address).await.err().expect("outside the allow-list");
        let DialError::Failed(text) = error else {
            panic!("unexpected error {error:?}");
        };
        assert!(text.contains("node-traffic policy"), "{text}");
    }
    let refused = metric(
        setup.server.health_port,
        "konnectivity_network_proxy_server_dial_failure_count{reason=\"node_policy\"}",
    )
    .await;
    assert_eq!(refused, Some(2.0));
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 0.0);
    assert_eq!(NodeSetup::dials_on(&setup.cluster_agent).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_egress_never_uses_the_control_plane_agent() {
    let mut setup = setup().await;
    let tunnel = Tunnel::connect_uds(setup.server.uds_path()).await.unwrap();
    for _ in 0..20 {
        echo_once(&tunnel, &setup.other.addr.to_string()).await;
    }
    assert_eq!(NodeSetup::dials_on(&setup.cluster_agent).await, 20.0);
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 0.0);

    // With only the control-plane agent left, egress has no agent at all.
    setup.cluster_agent.proc.kill();
    setup.server.wait_backends(1).await;
    let error = tunnel
        .dial(&setup.other.addr.to_string())
        .await
        .err()
        .expect("no cluster agent");
    assert_eq!(error, DialError::NoAgent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_claiming_a_control_plane_id_with_another_certificate_is_refused() {
    let setup = setup().await;
    // The ordinary agent certificate (CN proxy-agent) claiming cp-1.
    let impostor = Agent::start(
        setup.dir.path(),
        &setup.pki,
        setup.server.agent_port,
        CONTROL_PLANE_ID,
        &[],
    );
    let port = impostor.health_port;
    wait_until(
        Duration::from_secs(10),
        "the impostor's refusal to be logged",
        || async {
            impostor.proc.log_text().contains("PermissionDenied")
                || impostor.proc.log_text().contains("control-plane id")
        },
    )
    .await;
    assert_eq!(
        metric(port, "konnectivity_network_proxy_agent_open_server_connections").await,
        Some(0.0)
    );
    assert_eq!(
        metric(
            setup.server.health_port,
            "konnectivity_network_proxy_server_ready_backend_connections"
        )
        .await,
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_frontend_refuses_certificates_from_other_cas() {
    let setup = setup().await;
    // The apiserver-class client certificate is valid, but not for the node frontend.
    let tunnel = setup.node_tunnel(&setup.pki.client).await;
    let error = tunnel
        .dial(&setup.allowed.addr.to_string())
        .await
        .err()
        .expect("refused");
    assert!(matches!(error, DialError::TunnelClosed(_)), "{error:?}");
    assert_eq!(NodeSetup::dials_on(&setup.control_plane_agent).await, 0.0);
}

/// A node tunnel's resumable `Proxy` stream, spoken by hand as the node
/// agent speaks it (docs/resume.md, "Node tunnels").
struct HandStream {
    outbound: tokio::sync::mpsc::Sender<konnectivity_proto::Packet>,
    inbound: tonic::Streaming<konnectivity_proto::Packet>,
    connect_id: konnectivity_proto::ConnectId,
    sent: u64,
    received: u64,
}

impl HandStream {
    async fn send(&mut self, bytes: &[u8]) {
        use konnectivity_proto::Frame;
        let data = Frame::Data {
            connect_id: self.connect_id,
            data: bytes::Bytes::copy_from_slice(bytes),
            offset: Some(self.sent),
        };
        self.sent += bytes.len() as u64;
        self.outbound.send(data.into()).await.unwrap();
    }

    /// Reads DATA until `len` bytes arrived; each must continue what was
    /// received.
    async fn receive(&mut self, len: usize) -> Vec<u8> {
        use konnectivity_proto::Frame;
        let mut got = Vec::new();
        while got.len() < len {
            let packet = tokio::time::timeout(Duration::from_secs(10), self.inbound.message())
                .await
                .expect("DATA within 10 s")
                .unwrap()
                .expect("the stream stays open");
            if let Ok(Frame::Data { data, offset, .. }) = Frame::try_from(packet) {
                assert_eq!(offset, Some(self.received), "DATA continues what was received");
                self.received += data.len() as u64;
                got.extend_from_slice(&data);
            }
        }
        got
    }
}

fn header(value: &str) -> tonic::metadata::AsciiMetadataValue {
    tonic::metadata::AsciiMetadataValue::try_from(value).unwrap()
}

/// Opens a stream on `tunnel` with `headers`; a dial when `dial` names a
/// target.
async fn open_by_hand(
    tunnel: &Tunnel,
    headers: Vec<(&'static str, tonic::metadata::AsciiMetadataValue)>,
    dial: Option<&str>,
) -> Result<(HandStream, tonic::metadata::MetadataMap), tonic::Status> {
    use konnectivity_proto::{DialId, Frame};
    let (outbound, queued) = tokio::sync::mpsc::channel(16);
    if let Some(address) = dial {
        let request = Frame::DialRequest {
            protocol: "tcp".to_owned(),
            address: address.into(),
            dial_id: DialId::random(),
        };
        outbound.send(request.into()).await.unwrap();
    }
    let (mut inbound, answer) = tunnel
        .open(headers, tokio_stream::wrappers::ReceiverStream::new(queued))
        .await?;
    let mut connect_id = konnectivity_proto::ConnectId::FIRST;
    if dial.is_some() {
        let packet = inbound.message().await.unwrap().unwrap();
        let Ok(Frame::DialResponse { result: Ok(id), .. }) = Frame::try_from(packet) else {
            panic!("the dial succeeds");
        };
        connect_id = id;
    }
    let stream = HandStream {
        outbound,
        inbound,
        connect_id,
        sent: 0,
        received: 0,
    };
    Ok((stream, answer))
}

/// A resumable stream to `address` opened by hand, as the node agent dials,
/// and the token the server gave it.
async fn open_resumable(tunnel: &Tunnel, address: &str) -> (HandStream, String) {
    use konnectivity_proto::metadata::{RESUME, RESUME_TOKEN};
    let (stream, answer) = open_by_hand(tunnel, vec![(RESUME, header("1"))], Some(address))
        .await
        .unwrap();
    let token = answer
        .get(RESUME_TOKEN)
        .expect("a node tunnel's stream gets a resume token")
        .to_str()
        .unwrap()
        .to_owned();
    (stream, token)
}

/// A resume is refused, with the reason, for a malformed, unknown or forged
/// token, a missing byte count, a count beyond what the server sent and
/// another node's certificate; none
/// of it disturbs the stream. The right token and count take the stream
/// over (the old one still open, as after a silent link) and the bytes go on
/// where they stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_tunnel_stream_resumes_only_with_its_token_and_positions_it_sent() {
    use konnectivity_proto::metadata::{RESUME_RECEIVED, RESUME_TOKEN};

    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    let address = setup.allowed.addr.to_string();
    let (mut stream, token) = open_resumable(&tunnel, &address).await;
    stream.send(&targets::header(b'E', 0, 0)).await;
    stream.send(b"before").await;
    assert_eq!(stream.receive(6).await, b"before");

    let (session, server) = token.split_once('@').unwrap();
    let flipped = {
        let mut bytes = session.as_bytes().to_vec();
        let last = bytes.len() - 1;
        bytes[last] = if bytes[last] == b'0' { b'1' } else { b'0' };
        format!("{}@{server}", String::from_utf8(bytes).unwrap())
    };
    let unknown = format!("{}{}@{server}", "f".repeat(16), &session[16..]);
    let refusals = [
        (
            "nonsense@".to_owned() + server,
            "0",
            tonic::Code::InvalidArgument,
            "malformed",
        ),
        (unknown, "0", tonic::Code::NotFound, "has no session"),
        (flipped, "0", tonic::Code::PermissionDenied, "wrong secret"),
        (
            token.clone(),
            "not a number",
            tonic::Code::InvalidArgument,
            RESUME_RECEIVED,
        ),
        (
            token.clone(),
            "1000000",
            tonic::Code::OutOfRange,
            "only 6 were sent",
        ),
    ];
    for (offered, received, code, says) in refusals {
        let headers = vec![
            (RESUME_TOKEN, header(&offered)),
            (RESUME_RECEIVED, header(received)),
        ];
        let refused = open_by_hand(&tunnel, headers, None).await.err().expect("refused");
        assert_eq!(
            refused.code(),
            code,
            "{offered} {received}: {}",
            refused.message()
        );
        assert!(refused.message().contains(says), "{}", refused.message());
    }
    // The right token and count from another node's certificate.
    let other_node = setup.node_tunnel(&setup.pki.other_node_client).await;
    let headers = vec![(RESUME_TOKEN, header(&token)), (RESUME_RECEIVED, header("6"))];
    let refused = open_by_hand(&other_node, headers, None)
        .await
        .err()
        .expect("refused");
    assert_eq!(
        refused.code(),
        tonic::Code::PermissionDenied,
        "{}",
        refused.message()
    );
    assert!(refused.message().contains("node-1"), "{}", refused.message());
    // Nothing changed: the stream carries on.
    stream.send(b"still here").await;
    assert_eq!(stream.receive(10).await, b"still here");

    let received = stream.received.to_string();
    let headers = vec![
        (RESUME_TOKEN, header(&token)),
        (RESUME_RECEIVED, header(&received)),
    ];
    let (mut resumed, answer) = open_by_hand(&tunnel, headers, None).await.unwrap();
    let server_received: u64 = answer
        .get(RESUME_RECEIVED)
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(server_received, stream.sent, "the server has every byte sent");
    resumed.connect_id = stream.connect_id;
    resumed.sent = server_received;
    resumed.received = stream.received;
    resumed.send(b"after the resume").await;
    assert_eq!(resumed.receive(16).await, b"after the resume");
    let resumed_count = metric(
        setup.server.health_port,
        "konnectivity_network_proxy_server_resumed_connections_total",
    )
    .await;
    assert_eq!(resumed_count, Some(1.0));
}

/// A resume attempt the node gave up on (its 2 s bound ran out) can reach
/// the server after the node resumed on a later attempt, and take the
/// connection over. The stream the node is on then ends with ABORTED, and
/// the node resumes again; it used to stay open and silent for good (a
/// watch on it never got another event). The 5,000-node run logged such
/// late attempts as refusals ("claims N but had already written out M")
/// whenever the node had acknowledged more since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_superseded_by_an_attempt_nobody_reads_ends_and_the_node_resumes_again() {
    use konnectivity_proto::metadata::{RESUME_RECEIVED, RESUME_TOKEN};

    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    let address = setup.allowed.addr.to_string();
    let (mut live, token) = open_resumable(&tunnel, &address).await;
    live.send(&targets::header(b'E', 0, 0)).await;
    live.send(b"before").await;
    assert_eq!(live.receive(6).await, b"before");

    // The attempt the node gave up on: answered, and never read.
    let position = || {
        vec![
            (RESUME_TOKEN, header(&token)),
            (RESUME_RECEIVED, header(&live.received.to_string())),
        ]
    };
    let (abandoned, _) = open_by_hand(&tunnel, position(), None).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), live.inbound.message())
        .await
        .expect("the stream the node is on ends within 5 s, not never");
    let status = ended.expect_err("it ends with a status");
    assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    assert!(status.message().contains("superseded"), "{}", status.message());

    // The node resumes again (and resets the attempt it gave up on); the
    // bytes go on where they stopped.
    let (mut resumed, answer) = open_by_hand(&tunnel, position(), None).await.unwrap();
    drop(abandoned);
    let server_received: u64 = answer
        .get(RESUME_RECEIVED)
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(server_received, live.sent);
    resumed.connect_id = live.connect_id;
    resumed.sent = server_received;
    resumed.received = live.received;
    resumed.send(b"after").await;
    assert_eq!(resumed.receive(5).await, b"after");
}

/// A connection that ends while its stream is lost (a node agent that
/// handed it to its successor, or a cut): the target's last bytes and the
/// CLOSE_RSP went to a stream the client no longer reads. The server keeps
/// the session until the client has them, and a stream that resumes it gets
/// them again; ending the session at once (as before) refused the resume,
/// and the connection was reset with its last bytes lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_bytes_and_close_of_a_connection_reach_a_stream_that_resumes_it() {
    use konnectivity_proto::Frame;
    use konnectivity_proto::metadata::{RESUME_RECEIVED, RESUME_TOKEN};

    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    let address = setup.allowed.addr.to_string();
    let (mut lost, token) = open_resumable(&tunnel, &address).await;
    // 1000 bytes, then a command the target does not know: it closes.
    lost.send(&targets::header(b'G', 1000, 3)).await;
    lost.send(&targets::header(b'X', 0, 0)).await;
    // This stream stays open and unread, as a predecessor's does after a
    // hand-over, while the server sends everything and the CLOSE_RSP.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let headers = vec![(RESUME_TOKEN, header(&token)), (RESUME_RECEIVED, header("0"))];
    let (mut resumed, answer) = open_by_hand(&tunnel, headers, None)
        .await
        .unwrap_or_else(|refused| panic!("the resume was refused: {}", refused.message()));
    let server_received = answer.get(RESUME_RECEIVED).unwrap().to_str().unwrap();
    assert_eq!(server_received, "34", "the server has both commands");
    resumed.connect_id = lost.connect_id;
    let data = resumed.receive(1000).await;
    let mut expected = Vec::new();
    targets::write_pattern(&mut expected, 1000, 3).await.unwrap();
    assert_eq!(data, expected, "the target's bytes, again, from the start");
    let close = tokio::time::timeout(Duration::from_secs(10), resumed.inbound.message())
        .await
        .expect("CLOSE_RSP within 10 s")
        .unwrap()
        .expect("the stream carries the CLOSE_RSP");
    assert!(
        matches!(
            Frame::try_from(close),
            Ok(Frame::CloseResponse { error: None, .. })
        ),
        "the connection's close, again"
    );
    drop(lost);
}

/// A node agent of an earlier version drops its stream as soon as it has
/// the CLOSE_RSP, without waiting for the server's end of it: the server,
/// which keeps a session until its client has the close, ends it then, and
/// does not hold it for `--agent-resume-timeout` waiting for a resume that
/// will never come (twenty times over: no ordering of the two ends leaves
/// it waiting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_drops_its_stream_after_the_close_ends_the_session() {
    use konnectivity_proto::Frame;
    use konnectivity_proto::metadata::{RESUME_RECEIVED, RESUME_TOKEN};

    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    let address = setup.allowed.addr.to_string();
    for round in 0..20 {
        let (mut stream, token) = open_resumable(&tunnel, &address).await;
        stream.send(&targets::header(b'X', 0, 0)).await;
        let close = tokio::time::timeout(Duration::from_secs(10), stream.inbound.message())
            .await
            .expect("CLOSE_RSP within 10 s")
            .unwrap()
            .expect("the stream carries the CLOSE_RSP");
        assert!(matches!(Frame::try_from(close), Ok(Frame::CloseResponse { .. })));
        // As such an agent does: its answer, then its requests.
        let HandStream {
            inbound, outbound, ..
        } = stream;
        drop(inbound);
        drop(outbound);
        let headers = vec![(RESUME_TOKEN, header(&token)), (RESUME_RECEIVED, header("0"))];
        let mut refused = None;
        for _ in 0..50 {
            match open_by_hand(&tunnel, headers.clone(), None).await {
                Err(status) => {
                    refused = Some(status);
                    break;
                }
                // Taken: the session was still there, waiting; let go.
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        let refused = refused
            .unwrap_or_else(|| panic!("round {round}: the session still waits for a resume after 1 s"));
        assert_eq!(refused.code(), tonic::Code::NotFound, "{}", refused.message());
    }
}

/// A node agent hands a connection to its successor while the connection's
/// stream is still open, and the successor's own new streams carry another
/// process id, which tells the server to end the waiting streams of the
/// node's other processes. A stream that is attached does not wait: the
/// successor's resume of it is taken at once (a server that let that
/// message stop it from taking resumes served them only when the old
/// stream next carried a packet, or ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_still_open_is_resumed_at_once_after_another_process_of_the_node_opened_one() {
    use konnectivity_proto::metadata::{AGENT_INSTANCE, RESUME, RESUME_RECEIVED, RESUME_TOKEN};

    let setup = setup().await;
    let tunnel = setup.node_tunnel(&setup.pki.node_client).await;
    let address = setup.allowed.addr.to_string();
    let (mut held, answer) = open_by_hand(
        &tunnel,
        vec![(RESUME, header("1")), (AGENT_INSTANCE, header("predecessor"))],
        Some(&address),
    )
    .await
    .unwrap();
    let token = answer.get(RESUME_TOKEN).unwrap().to_str().unwrap().to_owned();
    held.send(&targets::header(b'E', 0, 0)).await;
    held.send(b"before").await;
    assert_eq!(held.receive(6).await, b"before");
    // Past the server's acknowledgement of a quiet connection (after 1 s,
    // konnectivity_mux::flow::QUIET_ACK_AFTER): nothing is
    // due on the held stream any more.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The successor's first stream of its own.
    let (_successors, _) = open_by_hand(
        &tunnel,
        vec![(RESUME, header("1")), (AGENT_INSTANCE, header("successor"))],
        Some(&address),
    )
    .await
    .unwrap();
    // The held stream stays open and silent; the successor resumes it.
    let headers = vec![
        (RESUME_TOKEN, header(&token)),
        (RESUME_RECEIVED, header(&held.received.to_string())),
    ];
    let (mut resumed, _) = tokio::time::timeout(Duration::from_secs(5), open_by_hand(&tunnel, headers, None))
        .await
        .expect("the resume is answered at once, not when the old stream next moves")
        .unwrap();
    resumed.connect_id = held.connect_id;
    resumed.sent = held.sent;
    resumed.received = held.received;
    resumed.send(b"after").await;
    assert_eq!(resumed.receive(5).await, b"after");
    drop(held);
}

/// A node agent that dies (SIGKILL, OOM) takes its captured sockets with
/// it: no later process can resume their streams. The server ends those
/// streams, and the connections behind them, as soon as the node's next
/// agent process opens a stream (it carries another process id), not after
/// `--agent-resume-timeout`; another node's new process ends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_agents_lost_streams_end_when_the_nodes_next_agent_opens_one() {
    use konnectivity_proto::metadata::{AGENT_INSTANCE, RESUME};
    if !root_or_skip("a_dead_node_agents_lost_streams_end_when_the_nodes_next_agent_opens_one") {
        return;
    }
    let setup = setup().await;
    let address = setup.allowed.addr.to_string();
    let port = setup.server.health_port;
    let dropped = || async move {
        metric(
            port,
            "konnectivity_network_proxy_server_resume_dropped_connections_total",
        )
        .await
        .unwrap_or(0.0)
    };
    let process = |instance: &str| vec![(RESUME, header("1")), (AGENT_INSTANCE, header(instance))];

    // The first process's connection; then its node tunnel is cut (ss -K),
    // as the kernel does when the process dies: the stream waits for a
    // resume.
    let dying = setup.node_tunnel(&setup.pki.node_client).await;
    let (mut stream, _) = open_by_hand(&dying, process("first-process"), Some(&address))
        .await
        .unwrap();
    stream.send(&targets::header(b'E', 0, 0)).await;
    stream.send(b"hello").await;
    assert_eq!(stream.receive(5).await, b"hello");
    assert!(kill_connections_to(setup.node_port) > 0);

    // Another node's new process changes nothing for node-1.
    let other = setup.node_tunnel(&setup.pki.other_node_client).await;
    let _other_stream = open_by_hand(&other, process("node-2-process"), Some(&address))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        dropped().await,
        0.0,
        "another node's process ended node-1's stream"
    );

    // node-1's next process: the dead one's stream ends now, with a reason.
    let next = setup.node_tunnel(&setup.pki.node_client).await;
    let opened = std::time::Instant::now();
    let _next_stream = open_by_hand(&next, process("second-process"), Some(&address))
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(5),
        "the dead process's stream to end",
        || async { dropped().await == 1.0 },
    )
    .await;
    println!("ended {:?} after the next process's stream", opened.elapsed());
    let log = setup.server.proc.log_text();
    assert!(
        log.contains("the node agent process that held this node tunnel stream is gone"),
        "{log}"
    );
    // Its connection to the API server went with it.
    wait_until(
        Duration::from_secs(5),
        "the agent's endpoint connection to close",
        || async {
            metric(
                setup.control_plane_agent.health_port,
                "konnectivity_network_proxy_agent_open_endpoint_connections",
            )
            .await
                == Some(2.0)
        },
    )
    .await;
}
