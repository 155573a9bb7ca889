//! The node tunnel: one connection to the server's node frontend, kept
//! and watched for as long as the agent runs; and, behind one address with
//! several servers, connections of their own to the server a captured
//! connection's stream lives at ([`ServerTunnels`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use konnectivity_client::{Pings, Tunnel};
use konnectivity_plumbing::backoff::Backoff;
use tokio::sync::watch;

use crate::metrics::NodeMetrics;
use crate::readiness::NodeReadiness;
use crate::settings::NodeSettings;

/// How the node tunnel is watched: a PING after every second without a
/// frame from the server, answered within 5 s, so that a tunnel that stops
/// answering is reported within about 6 s; a captured connection's stream on
/// a silent link fails as soon, and resumes on a new tunnel (docs/resume.md).
/// At 5,000 nodes that is 5,000 PINGs a second at the server, which its
/// HTTP/2 layer answers; a probe stream each would cost it ten times more.
/// Generous, as the agent's probe timeout: a false alarm costs every
/// captured connection of the node a resume, and with 2 s, half the nodes of
/// the 5,000-node run (a machine saturated by 50,000 watches opening at
/// once) replaced their tunnels, whose resumes fed the load.
const TUNNEL_PINGS: Pings = Pings {
    interval: Duration::from_secs(1),
    timeout: Duration::from_secs(5),
};
/// How long a probe stream may take: at connect, and every
/// [`TUNNEL_SERVICE_PROBE_INTERVAL`] on a connection whose PINGs answer.
const TUNNEL_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a connection that answers its PINGs is also asked by a probe
/// stream whether the node frontend's service still admits the node (a
/// PING only says the server's HTTP/2 layer runs).
const TUNNEL_SERVICE_PROBE_INTERVAL: Duration = Duration::from_secs(30);
/// The longest wait between reconnection attempts of the node tunnel.
const TUNNEL_RETRY_CAP: Duration = Duration::from_secs(3);

/// Keeps the node tunnel for as long as the agent runs, so that readiness
/// follows it: new captured connections are reset while it is down
/// (established ones wait to resume on the next connection), and `/readyz`
/// says so. The tunnel is watched by PINGs ([`TUNNEL_PINGS`]) and now and
/// then by a probe stream; one that closes or stops answering is replaced
/// by a new connection (the old one's TCP connection may sit in
/// retransmission backoff long after the path is back), retried with the
/// agent's backoff, capped so recovery is seen within seconds.
pub(crate) async fn keep_tunnel(
    settings: NodeSettings,
    tunnel: watch::Sender<Option<Tunnel>>,
    readiness: Arc<NodeReadiness>,
    metrics: Arc<NodeMetrics>,
) {
    let mut backoff = Backoff::new(
        settings.sync_interval,
        settings.sync_interval_cap.min(TUNNEL_RETRY_CAP),
    );
    let mut current: Option<Tunnel> = None;
    // The host of `settings.server_hosts` the tunnel is connected to, or
    // tries first: a tunnel whose server is lost tries the next host first.
    let mut host_at = 0;
    loop {
        let was_up = readiness.tunnel_connected.load(Ordering::Relaxed);
        let answer = match &current {
            Some(connected) => tokio::select! {
                () = connected.closed() => Err(format!(
                    "the connection closed (the server ended it, or its pings went unanswered for {:?})",
                    TUNNEL_PINGS.timeout
                )),
                answer = async {
                    tokio::time::sleep(TUNNEL_SERVICE_PROBE_INTERVAL).await;
                    connected.probe(TUNNEL_PROBE_TIMEOUT).await.map(drop).map_err(|e| e.to_string())
                } => answer,
            },
            None => Err("not connected".to_owned()),
        };
        let answer = match answer {
            Ok(()) => Ok(()),
            Err(problem) => {
                // Not ready from this moment; reconnecting may take a while.
                let host = &settings.server_hosts[host_at];
                if was_up {
                    tracing::warn!(%problem, server = %host, port = settings.node_frontend_port, "node tunnel stopped answering; new captured connections are reset until it is back");
                }
                readiness.tunnel_failed(problem.clone(), &metrics);
                let lost = current.take().is_some();
                if lost {
                    host_at = (host_at + 1) % settings.server_hosts.len();
                }
                match connect_any(&settings, host_at).await {
                    Ok((fresh, server_id, at)) => {
                        let _ = tunnel.send(Some(fresh.clone()));
                        current = Some(fresh);
                        host_at = at;
                        // Said at every new connection: after a loss, which
                        // host and server the node moved to.
                        let named = server_id.as_deref().unwrap_or("(not named)");
                        tracing::info!(server = %settings.server_hosts[host_at], port = settings.node_frontend_port, server_id = named, "node tunnel connected");
                        Ok(())
                    }
                    // The probe's failure says what went wrong first.
                    Err(error) if lost => Err(format!("{problem} (reconnecting: {error})")),
                    Err(error) => Err(error),
                }
            }
        };
        match answer {
            Ok(()) => {
                readiness.tunnel_answered(&metrics);
                backoff.reset();
            }
            Err(problem) => {
                if current.is_none() {
                    tracing::warn!(%problem, servers = %settings.server_hosts.join(","), port = settings.node_frontend_port, "cannot connect the node tunnel");
                }
                readiness.tunnel_failed(problem, &metrics);
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
}

/// The node role's TLS flags, named when its tunnel cannot connect.
const NODE_TLS_FLAGS: konnectivity_plumbing::tls::ClientFlags = konnectivity_plumbing::tls::ClientFlags {
    ca: "ca-cert",
    cert: "node-client-cert",
    key: "node-client-key",
    host: "proxy-server-host",
};

/// A new connection to the node frontend of the first host, from
/// `settings.server_hosts[first]` round the list, that answers a probe: the
/// connection, the id of the server it reached (if that server names
/// itself), and the host's place in the list.
async fn connect_any(
    settings: &NodeSettings,
    first: usize,
) -> Result<(Tunnel, Option<String>, usize), String> {
    let hosts = &settings.server_hosts;
    let mut problems = Vec::new();
    for at in (first..hosts.len()).chain(0..first) {
        match connect_tunnel(settings, &hosts[at]).await {
            Ok((tunnel, server_id)) => return Ok((tunnel, server_id, at)),
            // One host alone says what went wrong as before.
            Err(problem) if hosts.len() == 1 => return Err(problem),
            Err(problem) => problems.push(format!("{}: {problem}", hosts[at])),
        }
    }
    Err(problems.join("; "))
}

/// A new connection to the node frontend on `host` that has answered a
/// probe, and the id of the server it reached (if that server names itself).
async fn connect_tunnel(settings: &NodeSettings, host: &str) -> Result<(Tunnel, Option<String>), String> {
    let connect = Tunnel::connect_tls_marked(
        host,
        settings.node_frontend_port,
        settings.tls.clone(),
        Some(settings.mark),
        Some(TUNNEL_PINGS),
    );
    let connected = match tokio::time::timeout(TUNNEL_PROBE_TIMEOUT, connect).await {
        Ok(Ok(connected)) => connected.with_dial_timeout(Duration::from_secs(10)),
        Ok(Err(error)) => {
            return Err(
                konnectivity_plumbing::tls::explain_client_failure(&error, host, NODE_TLS_FLAGS)
                    .unwrap_or_else(|| konnectivity_plumbing::error_chain(&error)),
            );
        }
        Err(_) => return Err(format!("no connection within {TUNNEL_PROBE_TIMEOUT:?}")),
    };
    let server_id = connected
        .probe(TUNNEL_PROBE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    Ok((connected, server_id))
}

/// How many connections a search for one server makes before it gives up:
/// behind a balancer that spreads connections at random over four servers,
/// twenty miss the one wanted 0.3% of the time (round robin never).
const SEARCH_ATTEMPTS: usize = 20;
/// How long a failed search answers for itself: every captured connection
/// of a node is lost at once, and one search, not one each, is enough to
/// learn that a server is gone.
const SEARCH_FAILED_HOLD: Duration = Duration::from_secs(2);

/// Connections to particular servers behind the node frontend's address.
///
/// A captured connection's stream lives at the server that issued its
/// token (`<session><secret>@<server id>`), and resumes only there. With
/// several servers behind one address (a load balancer), the node tunnel
/// may reach another one: after a hand-over (the predecessor's tunnel
/// reached one server, this agent's another), or after the tunnel was
/// replaced. Such a connection's stream resumes on a connection of its own
/// to its server: dialed until one reaches that server (each server names
/// itself in its answers), shared by the connections of that server, and
/// closed once the last of them ends.
pub(crate) struct ServerTunnels {
    settings: NodeSettings,
    /// By server id.
    slots: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Slot>>>>,
    /// How many searches ran (for the tests: one per lost server, not one
    /// per connection).
    searches: std::sync::atomic::AtomicU64,
}

/// One server's connection, and its last failed search.
#[derive(Default)]
struct Slot {
    /// Held by the captured connections that use it.
    tunnel: Weak<Tunnel>,
    failed: Option<(Instant, String)>,
}

impl ServerTunnels {
    pub(crate) fn new(settings: NodeSettings) -> Arc<ServerTunnels> {
        Arc::new(ServerTunnels {
            settings,
            slots: Mutex::new(HashMap::new()),
            searches: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn slot(&self, server: &str) -> Arc<tokio::sync::Mutex<Slot>> {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        // Servers come and go (a restarted server has a new id): forget
        // those whose connection is gone and whose failure is old, unless
        // someone holds their slot.
        slots.retain(|_, slot| {
            Arc::strong_count(slot) > 1
                || slot.try_lock().map_or(true, |slot| {
                    slot.tunnel.strong_count() > 0
                        || slot
                            .failed
                            .as_ref()
                            .is_some_and(|(at, _)| at.elapsed() < SEARCH_FAILED_HOLD)
                })
        });
        slots.entry(server.to_owned()).or_default().clone()
    }

    /// The connection to `server` that connections already use, if any.
    pub(crate) fn existing(&self, server: &str) -> Option<Arc<Tunnel>> {
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        slots.get(server)?.try_lock().ok()?.tunnel.upgrade()
    }

    /// A connection to `server`: the one connections already use, unless it
    /// is `failed` (it answered for another server, or not at all), or a
    /// new one, dialed until one reaches `server`, at most
    /// [`SEARCH_ATTEMPTS`] times and not past `deadline`. Connections that
    /// ask at once share one search.
    pub(crate) async fn to(
        &self,
        server: &str,
        failed: Option<&Arc<Tunnel>>,
        deadline: Instant,
    ) -> Result<Arc<Tunnel>, String> {
        let slot = self.slot(server);
        let mut slot = slot.lock().await;
        if let Some(tunnel) = slot.tunnel.upgrade()
            && !failed.is_some_and(|failed| Arc::ptr_eq(failed, &tunnel))
        {
            return Ok(tunnel);
        }
        if let Some((at, why)) = &slot.failed
            && at.elapsed() < SEARCH_FAILED_HOLD
        {
            return Err(why.clone());
        }
        match tokio::time::timeout_at(deadline.into(), self.search(server)).await {
            Ok(Ok(tunnel)) => {
                let tunnel = Arc::new(tunnel);
                slot.tunnel = Arc::downgrade(&tunnel);
                slot.failed = None;
                Ok(tunnel)
            }
            Ok(Err(why)) => {
                slot.failed = Some((Instant::now(), why.clone()));
                Err(why)
            }
            Err(_) => Err(format!("no connection reached server {server} in time")),
        }
    }

    async fn search(&self, server: &str) -> Result<Tunnel, String> {
        self.searches.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut reached: Vec<String> = Vec::new();
        let mut last_error = None;
        // Several hosts (servers listed without a balancer): each in turn,
        // and each a server, so one that answered for another server is not
        // asked again (every attempt that reaches a server costs it a TLS
        // handshake: after a server's death, every node that had streams
        // there searches at once). One that did not answer is asked again.
        let hosts = &self.settings.server_hosts;
        let mut elsewhere = vec![false; hosts.len()];
        let mut attempts = 0;
        for attempt in 0..SEARCH_ATTEMPTS {
            let at = attempt % hosts.len();
            if elsewhere.iter().all(|other| *other) {
                break;
            }
            if elsewhere[at] {
                continue;
            }
            attempts += 1;
            match connect_tunnel(&self.settings, &hosts[at]).await {
                Ok((tunnel, Some(id))) if id == server => {
                    tracing::info!(
                        server_id = server,
                        attempts,
                        took = ?started.elapsed(),
                        "a connection of its own to the server that holds connections' streams (the node tunnel reached another)"
                    );
                    return Ok(tunnel);
                }
                // Dropped: the connection closes.
                Ok((_, Some(other))) => {
                    elsewhere[at] = hosts.len() > 1;
                    if !reached.contains(&other) {
                        reached.push(other);
                    }
                }
                Ok((_, None)) => {
                    return Err(format!(
                        "the node frontend does not name its server (an older proxy-server), so server {server} cannot be looked for"
                    ));
                }
                Err(error) => last_error = Some(error),
            }
        }
        Err(format!(
            "no connection to {}:{} reached server {server} in {attempts} attempts (reached: {}{})",
            hosts.join(","),
            self.settings.node_frontend_port,
            if reached.is_empty() {
                "none".to_owned()
            } else {
                reached.join(", ")
            },
            last_error
                .map(|error| format!("; last failure: {error}"))
                .unwrap_or_default()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every captured connection of a node is lost at once; those whose
    /// server is gone must not each dial twenty times: the first search's
    /// failure answers for the rest.
    #[tokio::test]
    async fn connections_that_ask_at_once_share_one_search() {
        // Nothing listens there: every attempt is refused.
        let servers = ServerTunnels::new(NodeSettings::for_tests());
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut asking = tokio::task::JoinSet::new();
        for _ in 0..100 {
            let servers = servers.clone();
            asking.spawn(async move { servers.to("server-a", None, deadline).await.map(|_| ()) });
        }
        while let Some(answer) = asking.join_next().await {
            let error = answer.unwrap().unwrap_err();
            assert!(
                error.contains("reached server server-a in 20 attempts"),
                "{error}"
            );
        }
        assert_eq!(servers.searches.load(Ordering::Relaxed), 1);
        // Another server is looked for on its own.
        let _ = servers.to("server-b", None, deadline).await;
        assert_eq!(servers.searches.load(Ordering::Relaxed), 2);
        assert!(servers.existing("server-a").is_none());
    }
}
