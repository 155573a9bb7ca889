//! Upstream's metric names, labels and types on both binaries, scraped
//! before and after traffic: dashboards and alerts written for upstream
//! work unchanged.

mod support;

use support::cluster::Setup;
use support::connect::via_uds;
use support::scrape::{http_get, sample};
use support::targets;

async fn scrape(port: u16) -> String {
    let (status, body) = http_get(port, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    body
}

fn value(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_metrics_exist_and_move_with_traffic() {
    let setup = Setup::start("http-connect", true, &[]).await;
    let (server_port, agent_port) = (setup.server.health_port, setup.agent.health_port);
    let server = |name: &str| format!("konnectivity_network_proxy_server_{name}");
    let agent = |name: &str| format!("konnectivity_network_proxy_agent_{name}");

    // Families with labels and no sample yet (dial_failure_count{reason},
    // endpoint_dial_failure_total{reason}, stream_errors_total{...}) are
    // absent until the first failure, as with upstream's Go client;
    // egress_http_connect checks them.
    let before = (scrape(server_port).await, scrape(agent_port).await);
    for (text, name, kind) in [
        (&before.0, server("dial_duration_seconds"), "histogram"),
        (&before.0, server("frontend_write_duration_seconds"), "histogram"),
        (&before.0, server("ready_backend_connections"), "gauge"),
        (&before.0, server("ready_backends"), "gauge"),
        (&before.0, server("pending_backend_dials"), "gauge"),
        (&before.0, server("established_connections"), "gauge"),
        (&before.0, server("http_connections"), "gauge"),
        (&before.0, server("grpc_connections"), "gauge"),
        (&before.0, server("stream_packets_total"), "counter"),
        (&before.0, server("full_receive_channels"), "gauge"),
        (&before.1, agent("dial_duration_seconds"), "histogram"),
        (&before.1, agent("open_server_connections"), "gauge"),
        (&before.1, agent("known_server_count"), "gauge"),
        (&before.1, agent("open_endpoint_connections"), "gauge"),
        (&before.1, agent("stream_packets_total"), "counter"),
    ] {
        // prometheus-client names counter families without `_total` in TYPE.
        let family = name.trim_end_matches("_total");
        assert!(
            text.contains(&format!("# TYPE {family} {kind}")),
            "{family} ({kind}) missing from:\n{text}"
        );
    }
    assert_eq!(value(&before.0, &server("ready_backend_connections")), 1.0);
    assert_eq!(
        value(&before.0, &server(r#"ready_backends{proxy_strategy="default"}"#)),
        1.0
    );
    assert_eq!(
        value(
            &before.0,
            &server(r#"grpc_connections{service_method="Connect"}"#)
        ),
        1.0
    );
    assert_eq!(value(&before.1, &agent("open_server_connections")), 1.0);
    assert_eq!(value(&before.1, &agent("known_server_count")), 1.0);

    let target = targets::blob().await;
    for seed in 0..3 {
        let mut tunnel = via_uds(setup.server.uds_path(), &target.addr.to_string())
            .await
            .unwrap()
            .expect("CONNECT accepted");
        let (sent, received) = targets::push(&mut tunnel, 1 << 20, seed).await.unwrap();
        assert_eq!(sent, received);
    }
    setup.assert_gauges_return_to_zero().await;

    let after = (scrape(server_port).await, scrape(agent_port).await);
    let moved = |text_before: &str, text_after: &str, series: &str| {
        sample(text_after, series).unwrap_or(0.0) - sample(text_before, series).unwrap_or(0.0)
    };
    assert_eq!(
        moved(&before.0, &after.0, &server("dial_duration_seconds_count")),
        3.0
    );
    assert_eq!(
        moved(&before.1, &after.1, &agent("dial_duration_seconds_count")),
        3.0
    );
    for (segment, packet, text_before, text_after, who) in [
        ("to_agent", "DIAL_REQ", &before.0, &after.0, server("")),
        ("from_agent", "DIAL_RSP", &before.0, &after.0, server("")),
        ("to_agent", "DIAL_REQ", &before.1, &after.1, agent("")),
        ("from_agent", "DIAL_RSP", &before.1, &after.1, agent("")),
    ] {
        let series = format!(r#"{who}stream_packets_total{{segment="{segment}",packet_type="{packet}"}}"#);
        assert_eq!(moved(text_before, text_after, &series), 3.0, "{series}");
    }
    for (text_before, text_after, who) in [
        (&before.0, &after.0, server("")),
        (&before.1, &after.1, agent("")),
    ] {
        let series = format!(r#"{who}stream_packets_total{{segment="to_agent",packet_type="DATA"}}"#);
        assert!(moved(text_before, text_after, &series) >= 3.0, "{series}");
    }
    assert_eq!(
        value(
            &after.0,
            &server(r#"full_receive_channels{service_method="Connect"}"#)
        ),
        0.0
    );
    for text in [&after.0, &after.1] {
        assert!(
            !text.contains("stream_errors_total{"),
            "no stream failed, yet:\n{text}"
        );
    }
}

/// The gRPC frontend's legs are counted as upstream's server counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_frontend_packets_are_counted_by_client_segment() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let setup = Setup::start("grpc", true, &[]).await;
    let server_port = setup.server.health_port;
    let series = |segment: &str, packet: &str| {
        format!(
            r#"konnectivity_network_proxy_server_stream_packets_total{{segment="{segment}",packet_type="{packet}"}}"#
        )
    };
    let target = targets::blob().await;
    let tunnel = konnectivity_client::Tunnel::connect_uds(setup.server.uds_path())
        .await
        .unwrap();
    let mut stream = tunnel.dial(&target.addr.to_string()).await.unwrap();
    let (sent, received) = targets::push(&mut stream, 1 << 20, 7).await.unwrap();
    assert_eq!(sent, received);
    stream.shutdown().await.unwrap();
    // The server's CLOSE_RSP ends the stream: only then is our CLOSE_REQ
    // sure to have arrived (dropping earlier may cancel the call first).
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    drop(stream);
    setup.assert_gauges_return_to_zero().await;
    let text = scrape(server_port).await;
    assert_eq!(value(&text, &series("from_client", "DIAL_REQ")), 1.0);
    assert_eq!(value(&text, &series("to_client", "DIAL_RSP")), 1.0);
    assert!(value(&text, &series("from_client", "DATA")) >= 1.0);
    assert!(value(&text, &series("to_client", "DATA")) >= 1.0);
    assert_eq!(value(&text, &series("from_client", "CLOSE_REQ")), 1.0);
    assert_eq!(value(&text, &series("to_client", "CLOSE_RSP")), 1.0);
}
