//! Agents authenticated by ServiceAccount token instead of a client
//! certificate: proxy-server asks a stand-in kube-apiserver (HTTPS,
//! `authentication.k8s.io/v1` TokenReview) whose token an agent sent.

use std::path::Path;
use std::time::Duration;

use crate::support::TempDir;
use crate::support::certs::Pki;
use crate::support::connect::via_uds;
use crate::support::grpc::play_agent;
use crate::support::kube_api::{AGENT_AUDIENCE, AGENT_USER, KubeApi};
use crate::support::procs::{Agent, Server};
use crate::support::scrape::metric;
use crate::support::targets;

const GOOD: &str = "agent-token";
const CACHED: &str = "agent-token-for-the-storm";
const OTHER_SA: &str = "someone-elses-token";
const OTHER_NS: &str = "wrong-namespace-token";
const INVALID: &str = "forged-token";

/// Tokens of as many agents as a burst of new ones brings.
const BURST_TOKENS: [&str; 8] = [
    "burst-0", "burst-1", "burst-2", "burst-3", "burst-4", "burst-5", "burst-6", "burst-7",
];

async fn start(dir: &Path, pki: &Pki) -> (KubeApi, Server) {
    start_with(dir, pki, &[]).await
}

async fn start_with(dir: &Path, pki: &Pki, extra: &[String]) -> (KubeApi, Server) {
    let mut users = vec![
        (GOOD, AGENT_USER),
        (CACHED, AGENT_USER),
        (OTHER_SA, "system:serviceaccount:kube-system:someone-else"),
        (OTHER_NS, "system:serviceaccount:default:konnectivity-agent"),
    ];
    users.extend(BURST_TOKENS.iter().map(|token| (*token, AGENT_USER)));
    let reviewer = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    reviewer.review_tokens(AGENT_AUDIENCE, &users);
    // No client certificates: the token is the agent's credential.
    let mut flags = reviewer.token_auth_flags(dir);
    flags.extend_from_slice(extra);
    let server = Server::start(dir, pki, "http-connect", true, &flags).await;
    (reviewer, server)
}

/// Plays an agent with `token` (none when `None`) and returns how the
/// server answered the stream.
async fn connect_with(server: &Server, pki: &Pki, token: Option<&str>) -> Result<(), tonic::Status> {
    play_agent(server.agent_port, pki, token, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_its_service_account_token_is_admitted_and_tunnels() {
    let dir = TempDir::new("konn-token");
    let pki = Pki::new(dir.path());
    let (reviewer, server) = start(dir.path(), &pki).await;
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{GOOD}\n")).unwrap();
    let _agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        "token-agent",
        &[
            "--agent-cert=".to_owned(),
            "--agent-key=".to_owned(),
            format!("--service-account-token-path={}", token_file.display()),
            "--probe-interval=200ms".to_owned(),
        ],
    );
    server.wait_backends(1).await;
    assert_eq!(reviewer.reviews_of(GOOD), 1);

    let target = targets::blob().await;
    let mut tunnel = via_uds(server.uds_path(), &target.addr.to_string())
        .await
        .unwrap()
        .expect("CONNECT accepted");
    let (sent, received) = targets::push(&mut tunnel, 4 << 20, 5).await.unwrap();
    assert_eq!(sent, received);

    // The agent probes its server five times a second, each probe with its
    // token; past the review cache's lifetime, the probes of a token whose
    // stream is open still cost no review (a refused probe would drop the
    // stream).
    tokio::time::sleep(konnectivity_server::hooks::TOKEN_CACHE_TTL + Duration::from_secs(1)).await;
    server.wait_backends(1).await;
    assert_eq!(
        reviewer.reviews_of(GOOD),
        1,
        "probes of an open stream's token must not be reviewed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_wrong_and_forged_tokens_are_refused_with_clear_errors() {
    let dir = TempDir::new("konn-token");
    let pki = Pki::new(dir.path());
    let (reviewer, server) = start(dir.path(), &pki).await;

    let missing = connect_with(&server, &pki, None).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::Unauthenticated, "{missing:?}");
    assert!(
        missing.message().contains("--service-account-token-path"),
        "{missing:?}"
    );

    let other_sa = connect_with(&server, &pki, Some(OTHER_SA)).await.unwrap_err();
    assert_eq!(other_sa.code(), tonic::Code::Unauthenticated, "{other_sa:?}");
    assert!(
        other_sa
            .message()
            .contains("ServiceAccount kube-system/someone-else")
            && other_sa.message().contains("--agent-service-account"),
        "{other_sa:?}"
    );

    let other_ns = connect_with(&server, &pki, Some(OTHER_NS)).await.unwrap_err();
    assert!(other_ns.message().contains("--agent-namespace"), "{other_ns:?}");

    let forged = connect_with(&server, &pki, Some(INVALID)).await.unwrap_err();
    assert!(forged.message().contains("invalid bearer token"), "{forged:?}");
    assert_eq!(reviewer.reviews_of(INVALID), 1);

    assert_eq!(
        metric(
            server.health_port,
            "konnectivity_network_proxy_server_ready_backend_connections"
        )
        .await,
        Some(0.0),
        "a refused agent must not be registered"
    );

    // A real agent with a refused token keeps retrying, and re-reads its
    // token file each time: once the file holds a valid token, it connects.
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, OTHER_SA).unwrap();
    let agent = Agent::start(
        dir.path(),
        &pki,
        server.agent_port,
        "retrying-agent",
        &[
            "--agent-cert=".to_owned(),
            "--agent-key=".to_owned(),
            format!("--service-account-token-path={}", token_file.display()),
        ],
    );
    crate::support::wait_until(
        Duration::from_secs(10),
        "the agent to log its refusal",
        || async { agent.proc.log_text().contains("agent token refused") },
    )
    .await;
    std::fs::write(&token_file, GOOD).unwrap();
    server.wait_backends(1).await;
}

/// A reconnect storm: many streams with one token cost one review.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_storm_costs_kube_apiserver_one_review() {
    let dir = TempDir::new("konn-token");
    let pki = Pki::new(dir.path());
    let (reviewer, server) = start(dir.path(), &pki).await;
    let storm = (0..40).map(|_| connect_with(&server, &pki, Some(CACHED)));
    for result in futures_util::future::join_all(storm).await {
        result.expect("admitted");
    }
    assert_eq!(
        reviewer.reviews_of(CACHED),
        1,
        "answers must be cached and shared"
    );
}

/// `--kubeconfig-qps` and `--kubeconfig-burst` limit the server's requests to
/// kube-apiserver as client-go's do: a burst of new agents (a token each)
/// gets `burst` reviews at once and the rest at `qps`, and all are admitted.
/// Only lower bounds on time are asserted: a slow machine cannot fail them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_new_agents_reaches_kube_apiserver_at_the_configured_rate() {
    let dir = TempDir::new("konn-token");
    let pki = Pki::new(dir.path());
    let limit = ["--kubeconfig-qps=4".to_owned(), "--kubeconfig-burst=2".to_owned()];
    let (reviewer, server) = start_with(dir.path(), &pki, &limit).await;
    let burst = BURST_TOKENS
        .iter()
        .map(|token| connect_with(&server, &pki, Some(token)));
    for result in futures_util::future::join_all(burst).await {
        result.expect("every agent of the burst is admitted");
    }
    let arrivals = reviewer.review_arrivals();
    assert_eq!(arrivals.len(), BURST_TOKENS.len(), "one review per token");
    // Two at once, then one every 250 ms: the eighth no sooner than 1.5 s
    // after the first; and in any stretch of n reviews, at least
    // (n - 2) × 250 ms between its first and last.
    for first in 0..arrivals.len() {
        for last in first + 2..arrivals.len() {
            let at_least = Duration::from_millis(250) * (last - first - 1) as u32;
            let took = arrivals[last] - arrivals[first];
            assert!(
                took + Duration::from_millis(20) >= at_least,
                "reviews {first}..={last} came within {took:?}, the limit allows no less than {at_least:?}"
            );
        }
    }
}

/// What a server restart looks like to kube-apiserver: two hundred agents,
/// each with a token of its own, connect at once while the server renews
/// its Lease. Over HTTP/2, as client-go speaks it to kube-apiserver, every
/// TokenReview and every Lease call is a stream of one connection: one TLS
/// handshake, not one per concurrent review (over HTTP/1.1 each review
/// that finds the kept connection busy opens another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_agents_with_tokens_of_their_own_cost_one_kube_apiserver_connection() {
    const AGENTS: usize = 200;
    let dir = TempDir::new("konn-token");
    let pki = Pki::new(dir.path());
    let api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let tokens: Vec<String> = (0..AGENTS).map(|i| format!("node-{i}-agent-token")).collect();
    let users: Vec<(&str, &str)> = tokens.iter().map(|token| (token.as_str(), AGENT_USER)).collect();
    api.review_tokens(AGENT_AUDIENCE, &users);
    let mut flags = api.token_auth_flags(dir.path());
    flags.extend(
        [
            "--enable-lease-controller",
            "--lease-renew-interval=1s",
            "--lease-duration=5s",
            "--lease-gc-interval=1s",
        ]
        .map(str::to_owned),
    );
    let server = Server::start(dir.path(), &pki, "http-connect", true, &flags).await;
    let storm = tokens
        .iter()
        .map(|token| connect_with(&server, &pki, Some(token)));
    let admitted = futures_util::future::join_all(storm)
        .await
        .into_iter()
        .filter(Result::is_ok)
        .count();
    // The Lease is renewed and collected on the same connection meanwhile.
    crate::support::wait_until(
        Duration::from_secs(10),
        "Lease renewals and collections",
        || async { api.calls("PUT update") >= 2 && api.calls("GET list") >= 2 },
    )
    .await;
    let connections = api.connections();
    let http2 = connections.iter().filter(|protocol| **protocol == "h2").count();
    eprintln!(
        "{admitted} of {AGENTS} agents admitted; kube-apiserver connections: {} ({http2} HTTP/2)",
        connections.len()
    );
    assert_eq!(admitted, AGENTS, "every agent is admitted");
    for token in &tokens {
        assert_eq!(api.reviews_of(token), 1, "{token}: one review each");
    }
    assert_eq!(
        (connections.len(), http2),
        (1, 1),
        "one HTTP/2 connection for every review and Lease call"
    );
}

/// A kube-apiserver with HTTP/2 turned off gets HTTP/1.1, and every agent
/// is admitted as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kube_apiserver_without_http2_is_spoken_to_in_http1() {
    let dir = TempDir::new("konn-token");
    let pki = Pki::new(dir.path());
    let api = KubeApi::start_http1_only(pki.kube_api_cert()).await.unwrap();
    api.review_tokens(AGENT_AUDIENCE, &BURST_TOKENS.map(|token| (token, AGENT_USER)));
    let flags = api.token_auth_flags(dir.path());
    let server = Server::start(dir.path(), &pki, "http-connect", true, &flags).await;
    let burst = BURST_TOKENS
        .iter()
        .map(|token| connect_with(&server, &pki, Some(token)));
    for result in futures_util::future::join_all(burst).await {
        result.expect("every agent of the burst is admitted");
    }
    let connections = api.connections();
    assert!(!connections.is_empty());
    assert!(
        connections.iter().all(|protocol| *protocol == "http/1.1"),
        "{connections:?}"
    );
}
