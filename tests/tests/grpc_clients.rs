//! The gRPC ProxyService frontend with clients that are not ours, sending
//! the bytes they send: grpc-go (what kube-apiserver's egress is built on),
//! Python's grpcio (gRPC core), and requests written frame by frame for the
//! `:authority` shapes no HTTP/2 library will send.
//!
//! On the Unix socket, grpc-go's `:authority` is the socket path,
//! percent-encoded by current releases (`%2Fetc%2Fkubernetes%2F…`) and raw
//! by older ones; gRPC core sends the percent-encoded path too. Each must
//! dial, carry data both ways and close. TCP listeners keep h2's checks.

use std::path::Path;

use crate::support::TempDir;
use crate::support::certs::Pki;
use crate::support::cluster::Setup;
use crate::support::foreign::{grpc_go_client, python_with_grpcio, repo, run_client};
use crate::support::h2_raw::{self, Answer, ENHANCE_YOUR_CALM, PROTOCOL_ERROR};
use crate::support::procs::{Agent, Server};
use crate::support::targets;
use crate::support::{free_port, wait_until};
use konnectivity_proto::wire::packet::Payload;

/// What grpc-go sends as `:authority` for a socket path target since it
/// percent-encodes it (every release kube-apiserver vendors today).
fn percent_encoded(path: &Path) -> String {
    path.display().to_string().replace('/', "%2F")
}

/// A port nothing listens on, for refused dials.
fn closed_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn python_client(python: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(python);
    command
        .arg(repo().join("tests/python/kas_like_client.py"))
        .arg("--proto-dir")
        .arg(repo().join("proto/proto"));
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_dials_through_the_unix_socket_as_kube_apiserver_does() {
    let Some(client) = tokio::task::spawn_blocking(grpc_go_client).await.unwrap() else {
        return;
    };
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let closed = closed_port();
    let socket = setup.server.uds_path();
    // grpc-go's own choice (this Debian release sends the raw path), what
    // current releases send, and what a client that overrides it sends.
    for authority in [String::new(), percent_encoded(socket), "localhost".to_owned()] {
        let mut command = tokio::process::Command::new(&client);
        command
            .arg("-socket")
            .arg(socket)
            .arg("-echo")
            .arg(target.addr.to_string())
            .arg("-closed")
            .arg(closed.to_string())
            .arg("-authority")
            .arg(&authority);
        let output = run_client(command, "grpc-go client: all protocol checks passed").await;
        eprintln!("authority {authority:?}:\n{output}");
    }
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_dials_through_the_unix_socket_with_any_authority() {
    let Some(python) = python_with_grpcio() else {
        return;
    };
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let closed = closed_port();
    let socket = setup.server.uds_path();
    let shapes = [
        None, // gRPC core's own choice: the percent-encoded path
        Some(percent_encoded(socket)),
        Some(socket.display().to_string()),
        Some("localhost".to_owned()),
        Some(format!("unix:{}", socket.display())),
    ];
    for authority in shapes {
        let mut command = python_client(&python);
        command
            .arg("--uds")
            .arg(socket)
            .arg("--echo")
            .arg(target.addr.to_string())
            .arg("--closed")
            .arg(closed.to_string());
        if let Some(authority) = &authority {
            command.arg("--authority").arg(authority);
        }
        let output = run_client(command, "all protocol checks passed").await;
        eprintln!("authority {authority:?}:\n{output}");
    }
    setup.assert_gauges_return_to_zero().await;
}

/// A DIAL_RSP for the dial `h2_raw` sends, or what came instead.
fn dial_response(answer: Answer) -> Result<i64, Answer> {
    match answer {
        Answer::Packet(packet) => match packet.payload {
            Some(Payload::DialResponse(response)) if response.error.is_empty() && response.random == 42 => {
                Ok(response.connect_id)
            }
            _ => Err(Answer::Packet(packet)),
        },
        other => Err(other),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_authority_shape_is_served_on_the_unix_socket() {
    let setup = Setup::start("grpc", true, &[]).await;
    let target = targets::blob().await;
    let socket = setup.server.uds_path();
    let path = socket.display().to_string();
    let shapes: Vec<Option<Vec<u8>>> = vec![
        None,
        Some(percent_encoded(socket).into_bytes()),
        Some(path.clone().into_bytes()),
        Some(b"localhost".to_vec()),
        Some(format!("unix:{path}").into_bytes()),
        Some(format!("unix://{path}").into_bytes()),
        Some(Vec::new()),
    ];
    for authority in shapes {
        let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
        let answer = h2_raw::dial_with_authority(
            &mut stream,
            "http",
            authority.as_deref(),
            &target.addr.to_string(),
        )
        .await;
        let shown = authority.as_deref().map(String::from_utf8_lossy);
        let connect_id =
            dial_response(answer).unwrap_or_else(|other| panic!("authority {shown:?}: {other:?}"));
        assert!(connect_id > 0, "authority {shown:?}");
        // A client closing as newer grpc-go does: GOAWAY, then the end of its
        // side; the server ends the connection and releases the tunnel.
        h2_raw::go_away(&mut stream).await;
    }
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_frontend_keeps_refusing_a_malformed_authority() {
    let setup = Setup::start("grpc", false, &[]).await;
    let target = targets::blob().await;
    let port = setup.server.tcp_port();
    let tls = setup.pki.client_tls(Some(&setup.pki.client), &[b"h2"]);
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        tokio_rustls::TlsConnector::from(tls.clone())
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap()
    };
    let authority = format!("localhost:{port}");
    let answer = h2_raw::dial_with_authority(
        &mut connect().await,
        "https",
        Some(authority.as_bytes()),
        &target.addr.to_string(),
    )
    .await;
    assert!(dial_response(answer).is_ok_and(|id| id > 0));
    // Over TLS a client names the host it verified: a path there is a
    // broken client, and h2 says so as before.
    let answer = h2_raw::dial_with_authority(
        &mut connect().await,
        "https",
        Some(b"%2Ftmp%2Fx.sock"),
        &target.addr.to_string(),
    )
    .await;
    assert_eq!(answer, Answer::Reset(PROTOCOL_ERROR));
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_dials_through_the_tcp_frontend_with_its_usual_authority() {
    let Some(python) = python_with_grpcio() else {
        return;
    };
    let setup = Setup::start("grpc", false, &[]).await;
    let target = targets::blob().await;
    let mut command = python_client(&python);
    command
        .arg("--tls")
        .arg(format!("localhost:{}", setup.server.tcp_port()))
        .arg("--ca")
        .arg(&setup.pki.ca)
        .arg("--cert")
        .arg(&setup.pki.client.cert)
        .arg("--key")
        .arg(&setup.pki.client.key)
        .arg("--echo")
        .arg(target.addr.to_string())
        .arg("--closed")
        .arg(closed_port().to_string());
    run_client(command, "all protocol checks passed").await;
    setup.assert_gauges_return_to_zero().await;
}

/// A server whose node frontend (on the port returned) lets nodes reach
/// `apiserver` through control-plane agent cp-1.
async fn node_frontend_server(dir: &TempDir, pki: &Pki, apiserver: std::net::SocketAddr) -> (Server, u16) {
    let node_port = free_port();
    let server = Server::start(
        dir.path(),
        pki,
        "grpc",
        true,
        &[
            format!("--node-frontend-port={node_port}"),
            "--node-frontend-bind-address=127.0.0.1".to_owned(),
            format!("--node-client-ca-cert={}", pki.node_ca.display()),
            format!("--node-allowed-destinations={apiserver}"),
            "--control-plane-agent-ids=cp-1".to_owned(),
        ],
    )
    .await;
    (server, node_port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_dials_through_the_node_frontend_with_its_usual_authority() {
    let Some(python) = python_with_grpcio() else {
        return;
    };
    let dir = TempDir::new("konn-node-grpcio");
    let pki = Pki::new(dir.path());
    let apiserver = targets::blob().await;
    let (server, node_port) = node_frontend_server(&dir, &pki, apiserver.addr).await;
    let control_plane_agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        "cp-1",
        &[
            format!("--agent-cert={}", pki.control_plane_agent.cert.display()),
            format!("--agent-key={}", pki.control_plane_agent.key.display()),
        ],
    );
    server.wait_backends(1).await;
    let mut command = python_client(&python);
    command
        .arg("--tls")
        .arg(format!("localhost:{node_port}"))
        .arg("--ca")
        .arg(&pki.ca)
        .arg("--cert")
        .arg(&pki.node_client.cert)
        .arg("--key")
        .arg(&pki.node_client.key)
        .arg("--echo")
        .arg(apiserver.addr.to_string());
    run_client(command, "all protocol checks passed").await;
    let agent_port = control_plane_agent.health_port;
    wait_until(
        std::time::Duration::from_secs(10),
        "the control-plane agent's endpoint connections to close",
        || async move {
            crate::support::scrape::metric(
                agent_port,
                "konnectivity_network_proxy_agent_open_endpoint_connections",
            )
            .await
                == Some(0.0)
        },
    )
    .await;
}

/// A node's tunnel carries every connection of its clients: when the server
/// is slow to take new streams (a busy machine, a storm of reconnecting
/// nodes), the node agent may cancel many of them before the server takes
/// them. h2 takes over 20 such resets pending at once for a rapid-reset
/// attack and closes the whole connection (GOAWAY ENHANCE_YOUR_CALM),
/// which in the 5,000-node runs cut whole node tunnels, every stream of the
/// node with them. The node frontend's peers are nodes that proved who they
/// are: a burst of 100 leaves the tunnel serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_burst_of_cancelled_streams_leaves_its_tunnel_serving() {
    let dir = TempDir::new("konn-node-resets");
    let pki = Pki::new(dir.path());
    let apiserver = targets::blob().await;
    let (_server, node_port) = node_frontend_server(&dir, &pki, apiserver.addr).await;
    let tls = pki.client_tls(Some(&pki.node_client), &[b"h2"]);
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", node_port))
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut node = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .unwrap();
    let authority = format!("localhost:{node_port}");
    let answer = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        h2_raw::dial_after_cancelled(
            &mut node,
            "https",
            Some(authority.as_bytes()),
            100,
            &apiserver.addr.to_string(),
        ),
    )
    .await
    .expect("an answer within 10 s");
    // No control-plane agent is connected: the dial fails, on a tunnel that
    // still serves.
    match answer {
        Answer::Packet(packet) => match packet.payload {
            Some(Payload::DialResponse(response)) => {
                assert!(!response.error.is_empty(), "{response:?}")
            }
            other => panic!("a DIAL_RSP, not {other:?}"),
        },
        Answer::GoAway(code) => {
            assert_ne!(code, ENHANCE_YOUR_CALM, "the tunnel was closed as an attacker's");
            panic!("GOAWAY {code}");
        }
        other => panic!("a DIAL_RSP, not {other:?}"),
    }
}
