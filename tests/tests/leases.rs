//! Server Leases: proxy-servers publish a coordination.k8s.io/v1 Lease each
//! (`--enable-lease-controller`), agents count the valid ones
//! (`--count-server-leases`) to learn how many servers to hold, and servers
//! delete the expired ones. Against the stand-in kube-apiserver of
//! `support::kube_api` (HTTPS, resourceVersion conflicts, label selectors,
//! watches), since a real one cannot be had here.
//!
//! Every server here announces `--server-count=1`: an agent that holds two
//! streams can only have learned the 2 from the Leases.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::support::balancer::RoundRobin;
use crate::support::certs::Pki;
use crate::support::image::{Binaries, PodEnvironment};
use crate::support::kube_api::{KubeApi, SERVICE_ACCOUNT_TOKEN};
use crate::support::netns::root_or_skip;
use crate::support::procs::{Agent, Server};
use crate::support::scrape::metric;
use crate::support::{TempDir, wait_until};

const NAMESPACE: &str = "kube-system";
const KNOWN: &str = "konnectivity_network_proxy_agent_known_server_count";
const HELD: &str = "konnectivity_network_proxy_agent_open_server_connections";
const CULLED: &str = "konnectivity_network_proxy_server_culled_leases_count";

fn lease_name(server: &str) -> String {
    format!("konnectivity-proxy-server-{server}")
}

/// The labels upstream gives server Leases by default.
const SERVER_LABELS: &str = "k8s-app=konnectivity-server";

/// A server renewing its Lease of `duration` every second, collecting
/// expired Leases every `gc`; the Lease carries `labels` (`--lease-label`).
async fn lease_server(
    dir: &TempDir,
    pki: &Pki,
    kubeconfig: &std::path::Path,
    id: &str,
    duration: &str,
    gc: &str,
    labels: &str,
) -> Server {
    let extra = [
        format!("--server-id={id}"),
        "--server-count=1".to_owned(),
        "--enable-lease-controller".to_owned(),
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--lease-duration={duration}"),
        "--lease-renew-interval=1s".to_owned(),
        format!("--lease-gc-interval={gc}"),
        format!("--lease-label={labels}"),
    ];
    Server::start(dir.path(), pki, "http-connect", true, &extra).await
}

/// Two lease servers (`server-1`, `server-2`) behind a round-robin balancer,
/// which is how agents reach servers that count by Leases.
struct TwoServers {
    servers: [Server; 2],
    balancer: RoundRobin,
}

impl TwoServers {
    async fn start(dir: &TempDir, pki: &Pki, kubeconfig: &std::path::Path, duration: &str, gc: &str) -> Self {
        let servers = [
            lease_server(dir, pki, kubeconfig, "server-1", duration, gc, SERVER_LABELS).await,
            lease_server(dir, pki, kubeconfig, "server-2", duration, gc, SERVER_LABELS).await,
        ];
        let balancer = RoundRobin::start(servers.iter().map(agent_address).collect()).await;
        TwoServers { servers, balancer }
    }

    fn balancer_port(&self) -> u16 {
        self.balancer.addr.port()
    }
}

fn counting_agent(dir: &TempDir, pki: &Pki, kubeconfig: &std::path::Path, port: u16) -> Agent {
    selecting_agent(dir, pki, kubeconfig, port, SERVER_LABELS)
}

/// An agent counting the Leases that `selector` (`--lease-label-selector`)
/// picks.
fn selecting_agent(
    dir: &TempDir,
    pki: &Pki,
    kubeconfig: &std::path::Path,
    port: u16,
    selector: &str,
) -> Agent {
    Agent::start(
        dir.path(),
        pki,
        port,
        "agent-1",
        &[
            "--count-server-leases".to_owned(),
            format!("--kubeconfig={}", kubeconfig.display()),
            "--probe-interval=200ms".to_owned(),
            format!("--lease-label-selector={selector}"),
        ],
    )
}

/// Waits until the agent counts and holds 2 servers.
async fn holds_two_servers(agent_port: u16) {
    wait_until(
        Duration::from_secs(20),
        "the agent to count and hold 2 servers",
        || async {
            metric(agent_port, KNOWN).await == Some(2.0) && metric(agent_port, HELD).await == Some(2.0)
        },
    )
    .await;
}

/// Samples the agent's server count every 100 ms from now on; the first
/// value is the lowest seen so far (abort the task to stop).
fn lowest_count(agent_port: u16) -> (Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let lowest = Arc::new(AtomicU64::new(u64::MAX));
    let seen = lowest.clone();
    let sampler = tokio::spawn(async move {
        loop {
            if let Some(count) = metric(agent_port, KNOWN).await {
                seen.fetch_min(count as u64, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (lowest, sampler)
}

fn agent_address(server: &Server) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], server.agent_port))
}

fn renew_time(lease: &Value) -> String {
    lease["spec"]["renewTime"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_count_servers_by_their_leases_and_expired_ones_are_deleted() {
    let dir = TempDir::new("konn-leases");
    let pki = Pki::new(dir.path());
    let api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let mut first = lease_server(&dir, &pki, &kubeconfig, "server-1", "4s", "1s", SERVER_LABELS).await;
    let mut second = lease_server(&dir, &pki, &kubeconfig, "server-2", "4s", "1s", SERVER_LABELS).await;

    // Each server holds its Lease as upstream names and labels it.
    wait_until(Duration::from_secs(10), "both server Leases", || async {
        api.lease_names(NAMESPACE).len() == 2
    })
    .await;
    let lease = api.lease(NAMESPACE, &lease_name("server-1")).unwrap();
    assert_eq!(
        lease["metadata"]["labels"],
        serde_json::json!({"k8s-app": "konnectivity-server"})
    );
    assert_eq!(lease["spec"]["holderIdentity"], "server-1");
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 4);
    // MicroTime: six fractional digits, UTC, as Go's parser wants.
    let renewed = renew_time(&lease);
    assert!(
        renewed.len() == "2026-01-01T00:00:00.000000Z".len() && renewed.ends_with('Z'),
        "{renewed}"
    );
    // ...and renews it.
    wait_until(Duration::from_secs(5), "a renewal", || async {
        api.lease(NAMESPACE, &lease_name("server-1"))
            .is_some_and(|lease| renew_time(&lease) > renewed)
    })
    .await;

    let balancer = RoundRobin::start(vec![agent_address(&first), agent_address(&second)]).await;
    let agent = counting_agent(&dir, &pki, &kubeconfig, balancer.addr.port());
    let agent_port = agent.health_port;
    holds_two_servers(agent_port).await;
    let lists = "konnectivity_network_proxy_agent_lease_lists_total{http_response_code=\"200\",reason=\"\"}";
    let watches =
        "konnectivity_network_proxy_agent_lease_watches_total{http_response_code=\"200\",reason=\"\"}";
    assert!(metric(agent_port, lists).await >= Some(1.0));
    assert!(metric(agent_port, watches).await >= Some(1.0));
    assert!(api.calls("GET watch") >= 1, "the agent watches rather than polls");
    // The flags are logged at start-up, the kubeconfig's token is not.
    for log in [first.proc.log_text(), agent.proc.log_text()] {
        assert!(log.contains(r#""FLAG: --kubeconfig=\""#), "{log}");
        assert!(!log.contains(crate::support::kube_api::TOKEN), "{log}");
    }

    // A server dies without deleting its Lease: the agent counts one server
    // once the Lease expires, and the survivor deletes it.
    second.proc.kill();
    wait_until(Duration::from_secs(10), "the agent to count 1 server", || async {
        metric(agent_port, KNOWN).await == Some(1.0)
    })
    .await;
    wait_until(Duration::from_secs(10), "the expired Lease deleted", || async {
        api.lease_names(NAMESPACE) == vec![lease_name("server-1")]
    })
    .await;
    let server_port = first.health_port;
    assert_eq!(metric(server_port, CULLED).await, Some(1.0));
    let deletes =
        "konnectivity_network_proxy_server_lease_delete_total{http_status_code=\"200\",reason=\"\"}";
    assert_eq!(metric(server_port, deletes).await, Some(1.0));
    let lists = "konnectivity_network_proxy_server_lease_list_total{http_status_code=\"200\",reason=\"\"}";
    assert!(metric(server_port, lists).await >= Some(1.0));

    // A server that stops cleanly deletes its own Lease.
    first.proc.signal("TERM");
    assert!(first.proc.wait_exit(Duration::from_secs(15)).await.is_some());
    assert_eq!(api.lease_names(NAMESPACE), Vec::<String>::new());
    assert!(first.proc.log_text().contains("deleting the server Lease"));
}

/// Upstream master's `--lease-label-selector` is a full label selector, as
/// kubectl's `-l`: a canary server's Lease is left out with `notin`, which
/// also picks a Lease without the label at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_counts_only_the_leases_its_selector_picks() {
    let dir = TempDir::new("konn-leases");
    let pki = Pki::new(dir.path());
    let api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let app = SERVER_LABELS;
    let servers = [
        lease_server(&dir, &pki, &kubeconfig, "server-1", "30s", "10s", app).await,
        lease_server(
            &dir,
            &pki,
            &kubeconfig,
            "server-2",
            "30s",
            "10s",
            &format!("{app},tier=stable"),
        )
        .await,
        lease_server(
            &dir,
            &pki,
            &kubeconfig,
            "server-3",
            "30s",
            "10s",
            &format!("{app},tier=canary"),
        )
        .await,
    ];
    wait_until(Duration::from_secs(10), "the three server Leases", || async {
        api.lease_names(NAMESPACE).len() == 3
    })
    .await;
    let balancer = RoundRobin::start(servers.iter().map(agent_address).collect()).await;
    let agent = selecting_agent(
        &dir,
        &pki,
        &kubeconfig,
        balancer.addr.port(),
        "tier notin (canary), k8s-app = konnectivity-server",
    );
    let agent_port = agent.health_port;
    holds_two_servers(agent_port).await;
    // kube-apiserver is asked with the selector whole, in its normal form
    // (the others seen are the servers' own, collecting expired Leases).
    let selectors = api.selectors();
    assert!(
        selectors.contains("k8s-app=konnectivity-server,tier notin (canary)"),
        "{selectors:?}"
    );
    // The canary's Lease stays out of the count.
    let (lowest, sampler) = lowest_count(agent_port);
    let mut highest = 0.0;
    for _ in 0..20 {
        highest = f64::max(highest, metric(agent_port, KNOWN).await.unwrap_or(0.0));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sampler.abort();
    assert_eq!((lowest.load(Ordering::Relaxed), highest), (2, 2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_counts_ride_out_conflicts_an_apiserver_restart_and_a_server_that_cannot_renew() {
    let dir = TempDir::new("konn-leases");
    let pki = Pki::new(dir.path());
    let mut api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let servers = TwoServers::start(&dir, &pki, &kubeconfig, "8s", "1s").await;
    let [first, second] = &servers.servers;
    let agent = counting_agent(&dir, &pki, &kubeconfig, servers.balancer_port());
    let agent_port = agent.health_port;
    holds_two_servers(agent_port).await;

    // From here on, the count is sampled all along: it must not flap.
    let (lowest, sampler) = lowest_count(agent_port);

    // Someone else changes server-1's Lease: its next renewal is refused
    // with 409 Conflict; it reads the Lease again and renews that.
    let name = lease_name("server-1");
    let updates = api.calls("PUT update");
    api.touch(NAMESPACE, &name);
    let touched = api.lease(NAMESPACE, &name).unwrap();
    wait_until(Duration::from_secs(5), "a renewal after the conflict", || async {
        api.lease(NAMESPACE, &name).is_some_and(|lease| {
            renew_time(&lease) > renew_time(&touched)
                && lease["metadata"]["annotations"]["touched-by"] == "test"
        })
    })
    .await;
    assert!(
        api.calls("GET get") >= 1,
        "the conflict made the server read the Lease again"
    );
    assert!(api.calls("PUT update") >= updates + 2);

    // kube-apiserver goes away for 3 s (less than the Leases' 8 s) and comes
    // back with its store: renewals resume, the agent watches again from
    // the last version it saw, without listing, and its count stays 2
    // throughout.
    let agent_lists =
        "konnectivity_network_proxy_agent_lease_lists_total{http_response_code=\"200\",reason=\"\"}";
    let lists_before = metric(agent_port, agent_lists).await.unwrap();
    let watches_before = api.calls("GET watch");
    api.stop();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stale = renew_time(&api.lease(NAMESPACE, &name).unwrap());
    api.restart().await;
    wait_until(Duration::from_secs(10), "renewals after the restart", || async {
        api.lease(NAMESPACE, &name)
            .is_some_and(|lease| renew_time(&lease) > stale)
    })
    .await;
    wait_until(Duration::from_secs(10), "the agent to watch again", || async {
        api.calls("GET watch") > watches_before
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        metric(agent_port, agent_lists).await,
        Some(lists_before),
        "the agent resumed its watch without listing"
    );
    assert_eq!(
        lowest.load(Ordering::Relaxed),
        2,
        "the agent's server count flapped"
    );
    assert_eq!(api.lease_names(NAMESPACE).len(), 2);
    sampler.abort();

    // server-2 stays up but cannot renew: once its Lease expires the agent
    // counts 1 (it keeps the stream it holds), and server-1 deletes the Lease.
    api.refuse_updates(&lease_name("server-2"));
    wait_until(Duration::from_secs(15), "the agent to count 1 server", || async {
        metric(agent_port, KNOWN).await == Some(1.0)
    })
    .await;
    wait_until(Duration::from_secs(5), "the expired Lease deleted", || async {
        !api.lease_names(NAMESPACE).contains(&lease_name("server-2"))
    })
    .await;
    let culled = metric(first.health_port, CULLED).await.unwrap_or(0.0)
        + metric(second.health_port, CULLED).await.unwrap_or(0.0);
    assert!(culled >= 1.0, "{culled}");
    assert!(
        second
            .proc
            .log_text()
            .contains("could not renew the server Lease")
    );
}

/// kube-apiserver away for twice the Lease duration: no server could renew,
/// so every Lease looks expired when it is back, until each server's next
/// renewal (held back here until the agent has listed them again, as a
/// server's retry backoff would: the agent's own retry is jittered, so
/// waiting a fixed time for it would let it come back after the renewals
/// and never see the stale Leases). The agent keeps its count through the
/// outage and the catching up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apiserver_outage_longer_than_the_leases_loses_no_server() {
    let dir = TempDir::new("konn-leases");
    let pki = Pki::new(dir.path());
    let mut api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let servers = TwoServers::start(&dir, &pki, &kubeconfig, "3s", "30s").await;
    let agent = counting_agent(&dir, &pki, &kubeconfig, servers.balancer_port());
    let agent_port = agent.health_port;
    holds_two_servers(agent_port).await;
    let (lowest, sampler) = lowest_count(agent_port);
    let names = [lease_name("server-1"), lease_name("server-2")];
    api.stop();
    tokio::time::sleep(Duration::from_secs(6)).await;
    for name in &names {
        api.refuse_updates(name);
    }
    api.restart().await;
    wait_until(
        Duration::from_secs(40),
        "the agent listing the stale Leases",
        || async { agent.proc.log_text().contains("kube-apiserver answers again") },
    )
    .await;
    let stale = renew_time(&api.lease(NAMESPACE, &names[0]).unwrap());
    for name in &names {
        api.allow_updates(name);
    }
    wait_until(Duration::from_secs(10), "renewals after the outage", || async {
        api.lease(NAMESPACE, &names[0])
            .is_some_and(|lease| renew_time(&lease) > stale)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    sampler.abort();
    let log = agent.proc.log_text();
    assert!(log.contains("kube-apiserver answers again"), "{log}");
    assert_eq!(
        lowest.load(Ordering::Relaxed),
        2,
        "the agent counted a server out"
    );
    assert_eq!(api.lease_names(NAMESPACE).len(), 2);
}

/// kube-apiserver keeps a limited history of changes (etcd compacts it; a
/// restarted kube-apiserver's watch cache starts at its own first list). An
/// agent whose watch ended and that watches again from a version no longer
/// kept is told so by an `ERROR` event, 410 Expired, and must list again:
/// that is the only way it learns of a Lease created meanwhile. A watch that
/// merely ended is taken up again from the last version, without a list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_watch_version_expired_lists_again() {
    let dir = TempDir::new("konn-leases");
    let pki = Pki::new(dir.path());
    let api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let first = lease_server(&dir, &pki, &kubeconfig, "server-1", "8s", "1s", SERVER_LABELS).await;
    // The agent dials server-1 only: the count it learns comes from the
    // Leases alone.
    let agent = counting_agent(&dir, &pki, &kubeconfig, first.agent_port);
    let agent_port = agent.health_port;
    let lists = "konnectivity_network_proxy_agent_lease_lists_total{http_response_code=\"200\",reason=\"\"}";
    wait_until(Duration::from_secs(10), "the agent to list and watch", || async {
        metric(agent_port, lists).await >= Some(1.0) && api.calls("GET watch") >= 1
    })
    .await;
    assert_eq!(metric(agent_port, KNOWN).await, Some(1.0));

    // The watch ends; the agent's next one waits while server-2 creates its
    // Lease and the history is compacted past what the agent saw.
    api.hold_watches(true);
    api.end_watches();
    wait_until(Duration::from_secs(5), "the agent to watch again", || async {
        api.calls("GET watch") >= 2
    })
    .await;
    let _second = lease_server(&dir, &pki, &kubeconfig, "server-2", "8s", "1s", SERVER_LABELS).await;
    wait_until(Duration::from_secs(10), "server-2's Lease", || async {
        api.lease_names(NAMESPACE).len() == 2
    })
    .await;
    api.compact();
    let listed = metric(agent_port, lists).await.unwrap();
    api.hold_watches(false);
    wait_until(
        Duration::from_secs(10),
        "the agent to count 2 servers",
        || async { metric(agent_port, KNOWN).await == Some(2.0) },
    )
    .await;
    assert!(
        metric(agent_port, lists).await > Some(listed),
        "the agent listed again"
    );

    // A watch that ends with its version still kept: the agent watches on
    // from where it was, and lists nothing.
    let listed = metric(agent_port, lists).await.unwrap();
    let watches = api.calls("GET watch");
    api.end_watches();
    wait_until(Duration::from_secs(5), "the agent to watch again", || async {
        api.calls("GET watch") > watches
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metric(agent_port, lists).await, Some(listed));
    assert_eq!(metric(agent_port, KNOWN).await, Some(2.0));
    let log = agent.proc.log_text();
    assert!(!log.contains("cannot list or watch"), "{log}");
}

/// The egress DaemonSet's agent counts Leases with no kubeconfig: through
/// the pod's own ServiceAccount (token and CA where the kubelet mounts
/// them, the `kubernetes` Service from the environment, kube-apiserver's
/// certificate checked against kubernetes.default.svc). From the image, as
/// uid 65532, with the manifests' flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_in_a_pod_counts_leases_with_its_service_account() {
    // Entering the image's filesystem needs root (mount, chroot).
    if !root_or_skip("an_agent_in_a_pod_counts_leases_with_its_service_account") {
        return;
    }
    let Some(image) = Binaries::image() else {
        return;
    };
    let dir = TempDir::new("konn-leases");
    let pki = Pki::new(dir.path());
    let mut api = KubeApi::start(pki.kube_api_cert()).await.unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let servers = TwoServers::start(&dir, &pki, &kubeconfig, "8s", "1s").await;

    let pod = PodEnvironment {
        service_account: api.service_account(dir.path()),
        kubernetes_service: std::net::SocketAddr::from(([127, 0, 0, 1], api.port)),
    };
    let agent = Agent::start_from(
        &image.as_user(65532).in_pod(pod),
        dir.path(),
        &pki,
        servers.balancer_port(),
        "agent-1",
        &[
            "--count-server-leases=true".to_owned(),
            "--probe-interval=200ms".to_owned(),
        ],
    );
    let agent_port = agent.health_port;
    holds_two_servers(agent_port).await;
    assert!(api.calls("GET watch") >= 1, "the agent watches the Leases");

    // The kubelet rotates the projected token in place; the old one expires.
    // The agent's next watch (after kube-apiserver cut the one it had)
    // carries the new one: the stand-in counts only calls it authorized.
    let token = format!(
        "/proc/{}/root/run/secrets/kubernetes.io/serviceaccount/token",
        agent.proc.pid()
    );
    std::fs::write(&token, "rotated-token").unwrap();
    api.rotate_token(SERVICE_ACCOUNT_TOKEN, "rotated-token");
    let watches = api.calls("GET watch");
    api.restart().await;
    wait_until(
        Duration::from_secs(10),
        "a watch with the rotated token",
        || async { api.calls("GET watch") > watches },
    )
    .await;
    assert_eq!(metric(agent_port, KNOWN).await, Some(2.0));
    let log = agent.proc.log_text();
    for secret in [SERVICE_ACCOUNT_TOKEN, "rotated-token"] {
        assert!(!log.contains(secret), "{log}");
    }
}
