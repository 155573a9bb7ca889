//! Drop-in parity with upstream's binaries: every upstream flag accepted in
//! Go's value forms, the way upstream's own test harness starts an external
//! agent, and the agent's drain-then-exit signal handling.

use std::time::Duration;

use crate::support::certs::Pki;
use crate::support::procs::Proc;
use crate::support::scrape::http_get;
use crate::support::{TempDir, free_port, wait_until};

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Every proxy-server flag of upstream v0.36.0 at its upstream default, in
/// Go's form, except what a running server must be given (ports, certificates,
/// the socket). Some are passed as `--name value` rather than `--name=value`.
fn server_args(
    dir: &std::path::Path,
    pki: &Pki,
    agent_port: u16,
    health_port: u16,
    admin_port: u16,
) -> Vec<String> {
    let mut list = args(&[
        "--admin-bind-address=127.0.0.1",
        "--agent-bind-address=",
        "--agent-namespace=",
        "--agent-service-account=",
        "--authentication-audience=",
        "--backend-dial-timeout=0s",
        "--cipher-suites=[]",
        "--delete-existing-uds-file=true",
        "--enable-contention-profiling=false",
        "--enable-lease-controller=false",
        "--enable-profiling=false",
        "--frontend-keepalive-time=1h0m0s",
        "--graceful-shutdown-timeout=0s",
        "--health-bind-address=",
        "--keepalive-time=1h0m0s",
        "--kube-api-content-type=application/vnd.kubernetes.protobuf",
        "--kubeconfig=",
        "--kubeconfig-burst=0",
        "--kubeconfig-qps=0",
        "--lease-label=k8s-app=konnectivity-server",
        "--lease-namespace=kube-system",
        "--mode=grpc",
        "--proxy-strategies=default",
        "--server-bind-address=",
        "--server-ca-cert=",
        "--server-cert=",
        "--server-count=1",
        "--server-id=server-under-test",
        "--server-key=",
        "--server-port=0",
        "--tls-min-version=",
        "--xfr-channel-size=10",
        "--warn-on-channel-limit=true",
    ]);
    list.extend([
        format!("--uds-name={}", dir.join("parity.sock").display()),
        format!("--cluster-cert={}", pki.server.cert.display()),
        format!("--cluster-key={}", pki.server.key.display()),
        format!("--cluster-ca-cert={}", pki.ca.display()),
        "--agent-port".to_owned(),
        agent_port.to_string(),
        "--health-port".to_owned(),
        health_port.to_string(),
        format!("--admin-port={admin_port}"),
    ]);
    list.extend(klog_args());
    list
}

/// klog's flags at klog's defaults.
fn klog_args() -> Vec<String> {
    args(&[
        "--v=0",
        "--vmodule=",
        "--logtostderr=true",
        "--alsologtostderr=false",
        "--alsologtostderrthreshold=",
        "--stderrthreshold=2",
        "--log-dir=",
        "--log-file=",
        "--log-file-max-size=1800",
        "--log-backtrace-at=:0",
        "--one-output=false",
        "--skip-headers=false",
        "--skip-log-headers=false",
        "--add-dir-header=false",
        "--legacy-stderr-threshold-behavior=true",
    ])
}

/// Every proxy-agent flag of upstream v0.36.0, at its default where a
/// running agent allows, as upstream's external-agent runner passes them.
fn agent_args(pki: &Pki, server_agent_port: u16, health_port: u16, admin_port: u16) -> Vec<String> {
    let mut list = args(&[
        "--proxy-server-host=127.0.0.1",
        "--alpn-proto=[]",
        "--health-server-host=",
        "--admin-bind-address=127.0.0.1",
        "--enable-profiling=false",
        "--enable-contention-profiling=false",
        "--agent-id=agent-under-test",
        "--sync-interval=1s",
        "--probe-interval=1s",
        "--sync-interval-cap=10s",
        "--keepalive-time=1h0m0s",
        "--service-account-token-path=",
        "--agent-identifiers=",
        "--warn-on-channel-limit=false",
        "--sync-forever=false",
        "--xfr-channel-size=150",
        "--count-server-leases=false",
        "--lease-namespace=kube-system",
        "--lease-label=k8s-app=konnectivity-server",
        "--lease-label-selector=k8s-app=konnectivity-server",
        "--server-count-source=default",
        "--kubeconfig=",
        "--kube-api-content-type=application/vnd.kubernetes.protobuf",
    ]);
    list.extend([
        format!("--agent-cert={}", pki.agent.cert.display()),
        format!("--agent-key={}", pki.agent.key.display()),
        format!("--ca-cert={}", pki.ca.display()),
        format!("--proxy-server-port={server_agent_port}"),
        format!("--health-server-port={health_port}"),
        format!("--admin-server-port={admin_port}"),
    ]);
    list.extend(klog_args());
    list
}

async fn status(port: u16, path: &str) -> u16 {
    http_get(port, path).await.map(|(status, _)| status).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_upstream_flag_at_its_default_comes_up_healthy_without_warnings() {
    let dir = TempDir::new("konn-parity");
    let pki = Pki::new(dir.path());
    let (agent_port, server_health, server_admin) = (free_port(), free_port(), free_port());
    let server = Proc::spawn(
        "proxy-server",
        &server_args(dir.path(), &pki, agent_port, server_health, server_admin),
        dir.path(),
    );
    wait_until(Duration::from_secs(10), "server /healthz 200", || async move {
        status(server_health, "/healthz").await == 200
    })
    .await;

    let (agent_health, agent_admin) = (free_port(), free_port());
    let agent = Proc::spawn(
        "proxy-agent",
        &agent_args(&pki, agent_port, agent_health, agent_admin),
        dir.path(),
    );
    wait_until(Duration::from_secs(10), "agent /healthz 200", || async move {
        status(agent_health, "/healthz").await == 200
    })
    .await;
    wait_until(Duration::from_secs(10), "agent /readyz 200", || async move {
        status(agent_health, "/readyz").await == 200
    })
    .await;
    assert_eq!(status(server_health, "/readyz").await, 200);
    let connected = crate::support::scrape::metric(
        agent_health,
        "konnectivity_network_proxy_agent_open_server_connections",
    )
    .await;
    assert_eq!(connected, Some(1.0));
    // The admin listeners serve /metrics too, as upstream's: scrape configs
    // written for upstream point at either port.
    let server_connected = crate::support::scrape::metric(
        server_admin,
        "konnectivity_network_proxy_server_ready_backend_connections",
    )
    .await;
    assert_eq!(server_connected, Some(1.0));
    let agent_connected = crate::support::scrape::metric(
        agent_admin,
        "konnectivity_network_proxy_agent_open_server_connections",
    )
    .await;
    assert_eq!(agent_connected, Some(1.0));
    for admin in [server_admin, agent_admin] {
        assert_eq!(
            status(admin, "/healthz").await,
            404,
            "health stays on the health port"
        );
    }

    // Defaults change nothing, so nothing is reported as inert.
    for proc in [&server, &agent] {
        let log = proc.log_text();
        assert!(
            !log.contains("has no effect"),
            "{} warned at defaults:\n{log}",
            proc.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inert_flag_set_to_a_non_default_value_is_named_in_a_warning() {
    let dir = TempDir::new("konn-parity");
    let pki = Pki::new(dir.path());
    let (agent_port, health) = (free_port(), free_port());
    let mut args = server_args(dir.path(), &pki, agent_port, health, free_port());
    args.push("--enable-profiling".to_owned());
    args.push("--enable-contention-profiling".to_owned());
    args.push("--frontend-write-channel-size=5".to_owned());
    let server = Proc::spawn("proxy-server", &args, dir.path());
    wait_until(Duration::from_secs(10), "server /healthz 200", || async move {
        status(health, "/healthz").await == 200
    })
    .await;
    let log = server.log_text();
    for flag in ["--enable-contention-profiling", "--frontend-write-channel-size"] {
        assert!(
            log.lines()
                .any(|l| l.contains("has no effect") && l.contains(flag)),
            "no warning naming {flag}:\n{log}"
        );
    }
    // Applied, so not reported.
    assert!(
        !log.lines()
            .any(|l| l.contains("has no effect") && l.contains("--enable-profiling")),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_sigterm_drains_the_agent_and_the_second_exits() {
    let setup = crate::support::cluster::Setup::start("grpc", true, &[]).await;
    let mut agent = setup.agent;
    let health = agent.health_port;
    assert_eq!(status(health, "/readyz").await, 200);

    agent.proc.signal("TERM");
    wait_until(
        Duration::from_secs(5),
        "agent /readyz 503 while draining",
        || async move { status(health, "/readyz").await == 503 },
    )
    .await;
    // Still alive and still connected: open connections may finish.
    assert_eq!(status(health, "/healthz").await, 200);
    assert!(
        agent.proc.wait_exit(Duration::from_millis(300)).await.is_none(),
        "exited on the first signal"
    );
    // The server saw the DRAIN; with no other agent it still falls back to this one.
    let target = crate::support::targets::http("still served while draining\n").await;
    let tunnel = konnectivity_client::Tunnel::connect_uds(setup.server.uds_path())
        .await
        .unwrap();
    assert!(tunnel.dial(&target.addr.to_string()).await.is_ok());

    agent.proc.signal("TERM");
    let status = agent.proc.wait_exit(Duration::from_secs(5)).await;
    assert!(status.is_some(), "the second SIGTERM must exit the agent");
}
