//! Limits: a request over one is refused on its own, with a status naming
//! the limit and a metric, while the connections already open carry on.

use crate::support::cluster::Setup;
use crate::support::connect::{Refused, via_uds};
use crate::support::scrape::metric;
use crate::support::targets;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// Opens a CONNECT tunnel to `target` on the setup's Unix socket.
async fn open(setup: &Setup, target: &str) -> Result<UnixStream, Refused> {
    via_uds(setup.server.uds_path(), target).await.unwrap()
}

async fn still_works(tunnel: &mut UnixStream, seed: u64) {
    let (sent, received) = targets::push(tunnel, 1 << 20, seed).await.unwrap();
    assert_eq!(sent, received, "an open tunnel was disturbed by the refusal");
}

/// With a limit of two: two tunnels open, a third is refused with `status`
/// and a body naming `flag`, and `counter` (at `port`) counts it once.
async fn two_open_and_a_third_refused(
    setup: &Setup,
    target: &str,
    status: u16,
    flag: &str,
    (port, counter): (u16, &str),
) -> (UnixStream, UnixStream) {
    let first = open(setup, target).await.expect("first tunnel");
    let second = open(setup, target).await.expect("second tunnel");
    let refused = open(setup, target).await.expect_err("a third is over the limit");
    assert_eq!(refused.status, status, "{refused:?}");
    assert!(refused.body.contains(flag), "{refused:?}");
    assert_eq!(metric(port, counter).await, Some(1.0));
    (first, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_over_its_tunnel_limit_refuses_one_request_with_503() {
    let setup = Setup::with_flags(
        "http-connect",
        true,
        &["--max-tunnels-per-frontend=2".to_owned()],
        &[],
    )
    .await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    let (mut first, mut second) = two_open_and_a_third_refused(
        &setup,
        &target,
        503,
        "--max-tunnels-per-frontend=2",
        (
            setup.server.health_port,
            r#"konnectivity_network_proxy_server_tunnel_limit_refusals_total{frontend="apiserver"}"#,
        ),
    )
    .await;
    still_works(&mut first, 1).await;
    still_works(&mut second, 2).await;

    // A slot comes back when its tunnel ends.
    first.shutdown().await.unwrap();
    drop(first);
    crate::support::wait_until(std::time::Duration::from_secs(5), "a free slot", || async {
        match open(&setup, &target).await {
            Ok(mut third) => {
                still_works(&mut third, 3).await;
                true
            }
            Err(_) => false,
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_over_its_connection_limit_refuses_one_dial() {
    let setup = Setup::start("http-connect", true, &["--max-endpoint-connections=2".to_owned()]).await;
    let target = targets::blob().await;
    let target = target.addr.to_string();
    let (mut first, mut second) = two_open_and_a_third_refused(
        &setup,
        &target,
        502,
        "--max-endpoint-connections=2",
        (
            setup.agent.health_port,
            r#"konnectivity_network_proxy_agent_endpoint_dial_failure_total{reason="limit"}"#,
        ),
    )
    .await;
    still_works(&mut first, 1).await;
    still_works(&mut second, 2).await;
    drop((first, second));
    setup.assert_gauges_return_to_zero().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_connect_head_is_refused_with_431_and_counted() {
    let setup = Setup::start("http-connect", true, &[]).await;
    let mut stream = UnixStream::connect(setup.server.uds_path()).await.unwrap();
    let padding = "x".repeat(17 * 1024);
    let head = format!("CONNECT 127.0.0.1:1 HTTP/1.1\r\nX-Padding: {padding}\r\n\r\n");
    let _ = stream.write_all(head.as_bytes()).await;
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut answer)
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    assert!(answer.contains("larger than 16384 bytes"), "{answer}");
    assert_eq!(
        metric(
            setup.server.health_port,
            r#"konnectivity_network_proxy_server_http_connect_rejections_total{status="431"}"#
        )
        .await,
        Some(1.0)
    );
    // Others are unaffected.
    let target = targets::blob().await;
    let mut tunnel = open(&setup, &target.addr.to_string())
        .await
        .expect("a normal tunnel");
    still_works(&mut tunnel, 4).await;
}

/// A gRPC client sending one message over 4 MiB (what Go peers accept by
/// default) has its stream refused; the server carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_message_over_4_mib_ends_that_stream_only() {
    use konnectivity_proto::wire::proxy_service_client::ProxyServiceClient;
    use konnectivity_proto::{ConnectId, Frame, Packet};
    use tokio_stream::StreamExt;

    let setup = Setup::start("grpc", true, &[]).await;
    let path = setup.server.uds_path().to_owned();
    let channel =
        tonic::transport::Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(UnixStream::connect(path).await?))
                }
            }))
            .await
            .unwrap();
    let mut client = ProxyServiceClient::new(channel);
    let huge = Frame::Data {
        connect_id: ConnectId::new(1).unwrap(),
        data: bytes::Bytes::from(vec![0u8; 5 * 1024 * 1024]),
        offset: None,
    };
    let outcome = async {
        let mut answers = client
            .proxy(tokio_stream::iter(vec![Packet::from(huge)]).chain(tokio_stream::pending()))
            .await?
            .into_inner();
        answers.message().await
    }
    .await;
    let status = outcome.expect_err("the stream must be refused");
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert_eq!(
        metric(
            setup.server.health_port,
            r#"konnectivity_network_proxy_server_stream_errors_total{segment="from_client",code="OutOfRange",packet_type="Unknown"}"#
        )
        .await,
        Some(1.0)
    );
    // Others are unaffected.
    let target = targets::blob().await;
    let tunnel = konnectivity_client::Tunnel::connect_uds(setup.server.uds_path())
        .await
        .unwrap();
    let mut stream = tunnel.dial(&target.addr.to_string()).await.unwrap();
    let (sent, received) = targets::push(&mut stream, 1 << 20, 5).await.unwrap();
    assert_eq!(sent, received);
}
