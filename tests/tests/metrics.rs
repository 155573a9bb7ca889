//! Upstream's metric families on both binaries, as Go's Prometheus text
//! parser (expfmt, what upstream's suite and Prometheus' Go tooling use)
//! reads them after traffic: names, types, HELP texts word for word and
//! label keys, compared with upstream v0.36.0's metrics code, so dashboards,
//! alerts and upstream's own tests keep working after the swap.

use std::collections::BTreeSet;

use crate::support::cluster::{Setup, unanswering_listener};
use crate::support::connect::via_uds;
use crate::support::foreign::go_metric_parser;
use crate::support::scrape::{http_get, sample};
use crate::support::targets;
use serde_json::Value;

async fn scrape(port: u16) -> String {
    let (status, body) = http_get(port, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    body
}

fn value(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
}

/// The families of an exposition as Go's expfmt reads them, by name.
fn go_families(parser: &std::path::Path, text: &str) -> Vec<Value> {
    use std::io::Write;
    let mut child = std::process::Command::new(parser)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "Go's parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// How a family must read: upstream's name (without the binary's prefix
/// for `process_*`), type, HELP and label keys; `always` when the exercise
/// below must have produced samples.
struct Expected {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    always: bool,
}

const fn family(
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
) -> Expected {
    Expected {
        name,
        kind,
        help,
        labels,
        always: true,
    }
}

const fn when_present(
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
) -> Expected {
    Expected {
        name,
        kind,
        help,
        labels,
        always: false,
    }
}

const STREAM_PACKETS_HELP: &str =
    "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)";
const STREAM_ERRORS_HELP: &str = "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)";
const DIAL_LATENCY_HELP: &str = "Latency of dial to the remote endpoint in seconds";

/// Upstream v0.36.0's pkg/server/metrics (connection_duration_seconds from
/// master); the lease families stay absent until a lease is handled
/// (issue 22), as a Go vector without children is.
const SERVER: &[Expected] = &[
    family("dial_duration_seconds", "HISTOGRAM", DIAL_LATENCY_HELP, &[]),
    family(
        "frontend_write_duration_seconds",
        "HISTOGRAM",
        "Latency of write to the frontend in seconds",
        &[],
    ),
    family(
        "connection_duration_seconds",
        "HISTOGRAM",
        "Duration in seconds a proxied end-to-end connection was established (post-dial) before being closed.",
        &[],
    ),
    family(
        "grpc_connections",
        "GAUGE",
        "Number of current grpc connections, partitioned by service method.",
        &["service_method"],
    ),
    family(
        "http_connections",
        "GAUGE",
        "Number of current HTTP CONNECT connections",
        &[],
    ),
    family(
        "ready_backend_connections",
        "GAUGE",
        "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
        &[],
    ),
    family(
        "ready_backends",
        "GAUGE",
        "Number of konnectivity agent connected to the proxy server",
        &["proxy_strategy"],
    ),
    family(
        "pending_backend_dials",
        "GAUGE",
        "Current number of pending backend dial requests",
        &[],
    ),
    family(
        "established_connections",
        "GAUGE",
        "Current number of established end-to-end connections (post-dial).",
        &[],
    ),
    family(
        "full_receive_channels",
        "GAUGE",
        "Number of current connections blocked by a full receive channel, partitioned by service method.",
        &["service_method"],
    ),
    family(
        "dial_failure_count",
        "COUNTER",
        "Number of dial failures observed. Multiple failures can occur for a single dial request.",
        &["reason"],
    ),
    family(
        "culled_leases_count",
        "COUNTER",
        "Count of expired leases that the lease garbage collection controller has culled.",
        &[],
    ),
    family(
        "stream_packets_total",
        "COUNTER",
        STREAM_PACKETS_HELP,
        &["segment", "packet_type"],
    ),
    when_present(
        "stream_errors_total",
        "COUNTER",
        STREAM_ERRORS_HELP,
        &["segment", "code", "packet_type"],
    ),
];

/// Upstream v0.36.0's pkg/agent/metrics (the lease families aside).
const AGENT: &[Expected] = &[
    family("dial_duration_seconds", "HISTOGRAM", DIAL_LATENCY_HELP, &[]),
    when_present(
        "server_connection_failure_count",
        "COUNTER",
        "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_events_error_total",
        &["direction"],
    ),
    family(
        "endpoint_dial_failure_total",
        "COUNTER",
        "Number of failures dialing the remote endpoint, by reason (example: timeout).",
        &["reason"],
    ),
    family(
        "open_server_connections",
        "GAUGE",
        "Current number of open server connections.",
        &[],
    ),
    family(
        "known_server_count",
        "GAUGE",
        "Current number of servers agent is trying to connect to.",
        &[],
    ),
    family(
        "open_endpoint_connections",
        "GAUGE",
        "Current number of open endpoint connections.",
        &[],
    ),
    family(
        "stream_packets_total",
        "COUNTER",
        STREAM_PACKETS_HELP,
        &["segment", "packet_type"],
    ),
    when_present(
        "stream_errors_total",
        "COUNTER",
        STREAM_ERRORS_HELP,
        &["segment", "code", "packet_type"],
    ),
];

/// Go's client's process collector, on both binaries, unprefixed.
const PROCESS: &[Expected] = &[
    family(
        "process_cpu_seconds_total",
        "COUNTER",
        "Total user and system CPU time spent in seconds.",
        &[],
    ),
    family(
        "process_open_fds",
        "GAUGE",
        "Number of open file descriptors.",
        &[],
    ),
    family(
        "process_max_fds",
        "GAUGE",
        "Maximum number of open file descriptors.",
        &[],
    ),
    family(
        "process_virtual_memory_bytes",
        "GAUGE",
        "Virtual memory size in bytes.",
        &[],
    ),
    family(
        "process_virtual_memory_max_bytes",
        "GAUGE",
        "Maximum amount of virtual memory available in bytes.",
        &[],
    ),
    family(
        "process_resident_memory_bytes",
        "GAUGE",
        "Resident memory size in bytes.",
        &[],
    ),
    family(
        "process_start_time_seconds",
        "GAUGE",
        "Start time of the process since unix epoch in seconds.",
        &[],
    ),
    family(
        "process_network_receive_bytes_total",
        "COUNTER",
        "Number of bytes received by the process over the network.",
        &[],
    ),
    family(
        "process_network_transmit_bytes_total",
        "COUNTER",
        "Number of bytes sent by the process over the network.",
        &[],
    ),
];

/// Checks `families` (one binary's, as Go reads them) against `expected`
/// under `prefix`, and that every family at all is typed and has help.
fn check(who: &str, families: &[Value], prefix: &str, expected: &[Expected]) {
    let find = |name: &str| families.iter().find(|f| f["name"] == name);
    for family in expected {
        let name = if family.name.starts_with("process_") {
            family.name.to_owned()
        } else {
            format!("{prefix}{}", family.name)
        };
        let Some(found) = find(&name) else {
            assert!(
                !family.always,
                "{who}: {name} missing; Go's parser saw {families:#?}"
            );
            continue;
        };
        assert_eq!(found["type"], family.kind, "{who}: type of {name}");
        assert_eq!(found["help"], family.help, "{who}: help of {name}");
        let keys: BTreeSet<&str> = family.labels.iter().copied().collect();
        for labels in found["labels"].as_array().unwrap() {
            let got: BTreeSet<&str> = labels.as_array().map_or_else(BTreeSet::new, |labels| {
                labels.iter().map(|l| l.as_str().unwrap()).collect()
            });
            // Histograms' buckets carry `le`, which is not a label key of the family.
            let got: BTreeSet<&str> = got.into_iter().filter(|key| *key != "le").collect();
            assert_eq!(got, keys, "{who}: label keys of {name}");
        }
    }
    for found in families {
        assert_ne!(
            found["type"], "UNTYPED",
            "{who}: Go reads {} as untyped",
            found["name"]
        );
        assert_ne!(found["help"], "", "{who}: Go sees no help for {}", found["name"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_reads_as_upstreams_to_gos_parser() {
    let Some(parser) = tokio::task::spawn_blocking(go_metric_parser).await.unwrap() else {
        return;
    };
    let setup = Setup::with_flags(
        "http-connect",
        true,
        &["--backend-dial-timeout=1s".into()],
        &["--dial-timeout=30s".into()],
    )
    .await;
    let (server_port, agent_port) = (setup.server.health_port, setup.agent.health_port);

    // The exercise: echo dials, a refused dial, a dial that hits --backend-dial-timeout.
    let target = targets::blob().await;
    for seed in 0..3 {
        let mut tunnel = via_uds(setup.server.uds_path(), &target.addr.to_string())
            .await
            .unwrap()
            .expect("CONNECT accepted");
        let (sent, received) = targets::push(&mut tunnel, 1 << 20, seed).await.unwrap();
        assert_eq!(sent, received);
        targets::pull(&mut tunnel, 1 << 20, seed).await.unwrap();
    }
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let refused = via_uds(setup.server.uds_path(), &closed.to_string())
        .await
        .unwrap();
    assert_eq!(refused.expect_err("nothing listens").status, 502);
    let (_listener, _filler, blackhole) = unanswering_listener();
    let timed_out = via_uds(setup.server.uds_path(), &blackhole.to_string())
        .await
        .unwrap();
    assert_eq!(timed_out.expect_err("no DIAL_RSP within 1s").status, 504);
    setup.assert_gauges_return_to_zero().await;

    let (server, agent) = (scrape(server_port).await, scrape(agent_port).await);
    let server_families = go_families(&parser, &server);
    let agent_families = go_families(&parser, &agent);
    let server_prefix = "konnectivity_network_proxy_server_";
    let agent_prefix = "konnectivity_network_proxy_agent_";
    check("proxy-server", &server_families, server_prefix, SERVER);
    check("proxy-server", &server_families, server_prefix, PROCESS);
    check("proxy-agent", &agent_families, agent_prefix, AGENT);
    check("proxy-agent", &agent_families, agent_prefix, PROCESS);

    let server_series = |s: &str| format!("{server_prefix}{s}");
    for reason in ["error_response", "backend_dial_timeout"] {
        let series = server_series(&format!("dial_failure_count{{reason=\"{reason}\"}}"));
        assert_eq!(value(&server, &series), 1.0, "{series}");
    }
    // Latency is observed for dials that succeed, as upstream's server does.
    assert_eq!(value(&server, &server_series("dial_duration_seconds_count")), 3.0);
    assert_eq!(
        value(&server, &server_series("connection_duration_seconds_count")),
        3.0
    );
    assert_eq!(value(&server, &server_series("ready_backend_connections")), 1.0);
    assert_eq!(
        value(
            &server,
            &server_series(r#"ready_backends{proxy_strategy="default"}"#)
        ),
        1.0
    );
    assert_eq!(
        value(&agent, &format!("{agent_prefix}open_server_connections")),
        1.0
    );
    assert_eq!(value(&agent, &format!("{agent_prefix}known_server_count")), 1.0);
    assert_eq!(
        value(
            &agent,
            &format!(r#"{agent_prefix}endpoint_dial_failure_total{{reason="unknown"}}"#)
        ),
        1.0
    );
    for (text, prefix, segment, packet, count) in [
        (&server, server_prefix, "to_agent", "DIAL_REQ", 5.0),
        (&server, server_prefix, "from_agent", "DIAL_RSP", 4.0),
        (&server, server_prefix, "to_agent", "DIAL_CLS", 1.0),
        (&agent, agent_prefix, "to_agent", "DIAL_REQ", 5.0),
        (&agent, agent_prefix, "from_agent", "DIAL_RSP", 4.0),
    ] {
        let series = format!(r#"{prefix}stream_packets_total{{segment="{segment}",packet_type="{packet}"}}"#);
        assert_eq!(value(text, &series), count, "{series}");
    }
    // The process figures are this process's own, not placeholders.
    let pid = setup.server.proc.pid();
    let started = value(&server, "process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        now - started < 120.0 && now >= started - 1.0,
        "started {started}, now {now}"
    );
    let fds = value(&server, "process_open_fds");
    let listed = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count() as f64;
    assert!(
        (fds - listed).abs() <= 8.0,
        "open fds {fds}, /proc lists {listed}"
    );
    assert!(value(&server, "process_resident_memory_bytes") > 1e6);

    // Ours: every tunnel's end, by reason, on both sides (docs/metrics.md),
    // typed as counters with the one label key for Go's parser.
    for (who, families, prefix) in [
        ("proxy-server", &server_families, server_prefix),
        ("proxy-agent", &agent_families, agent_prefix),
    ] {
        let ended = families
            .iter()
            .find(|f| f["name"] == format!("{prefix}tunnels_ended_total"))
            .unwrap_or_else(|| panic!("{who}: no tunnels_ended_total"));
        assert_eq!(ended["type"], "COUNTER", "{who}: {ended}");
    }
    for (text, prefix, reason, count) in [
        (&server, server_prefix, "client_closed", 3.0),
        (&server, server_prefix, "dial_failed", 1.0),
        (&server, server_prefix, "dial_timeout", 1.0),
        (&agent, agent_prefix, "server_closed", 3.0),
        (&agent, agent_prefix, "dial_failed", 1.0),
        (&agent, agent_prefix, "dial_cancelled", 1.0),
    ] {
        let series = format!(r#"{prefix}tunnels_ended_total{{reason="{reason}"}}"#);
        assert_eq!(value(text, &series), count, "{series}");
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
