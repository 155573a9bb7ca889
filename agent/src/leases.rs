//! Counting proxy-servers by their Leases (`--count-server-leases`), as
//! upstream's agents do: every server holds a Lease with known labels and
//! renews it; the valid ones are the servers alive. The agent lists them
//! once, then watches for changes, and recounts every second, because a
//! Lease expires by the clock, without any event. A watch that ends, or
//! whose connection fails, is taken up again from the last resourceVersion
//! seen; only kube-apiserver's 410 Expired makes the agent list again.
//!
//! The count follows upstream's rules: no valid Lease counts as one server.
//! Ours beyond upstream: a Lease is judged at the time the agent last heard
//! from kube-apiserver (plus a few seconds), not at the wall clock's now.
//! While kube-apiserver is unreachable, or the watch silently dead, no
//! renewal can arrive, and judging by the clock would count every server
//! out one by one as its Lease seemed to expire (upstream's informer does);
//! judged this way the count holds. While the watch runs, each renewal of
//! any server moves that time on, so an expired Lease still drops out, at
//! most a renewal interval late. And once kube-apiserver answers again, the
//! count does not drop for one Lease duration: the servers could not renew
//! meanwhile either, and need that long to catch up.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::StatusCode;
use konnectivity_kube::lease::{Lease, Leases};
use konnectivity_kube::{KubeClient, KubeEndpoint, KubeError, WatchEvent};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::{AgentMetrics, LeaseCall};

/// How often the count is made again from what is known.
const RECOUNT_EVERY: Duration = Duration::from_secs(1);
/// How long kube-apiserver keeps a watch open before the agent starts the
/// next one (client-go picks 5 to 10 minutes at random).
const WATCH_TIMEOUT: Duration = Duration::from_secs(300);
/// How far past the last word from kube-apiserver Leases are judged.
const JUDGE_GRACE: Duration = Duration::from_secs(5);
/// A watch that delivers nothing for this long (kube-apiserver ends it
/// after WATCH_TIMEOUT) is taken for a dead connection.
const WATCH_SILENCE: Duration = Duration::from_secs(WATCH_TIMEOUT.as_secs() + 30);
/// Waits after a failed list or watch: first, and at most.
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// `--count-server-leases` and the flags that go with it.
#[derive(Clone, Debug)]
pub struct LeaseCounting {
    pub kube: KubeEndpoint,
    /// `--lease-namespace`.
    pub namespace: String,
    /// `--lease-label-selector` (or v0.36.0's `--lease-label`).
    pub selector: String,
}

/// The server count the Leases give, kept current by a task of its own.
pub(crate) struct LeaseCount {
    count: watch::Receiver<u32>,
    task: JoinHandle<()>,
}

impl Drop for LeaseCount {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LeaseCount {
    pub(crate) fn start(settings: LeaseCounting, metrics: Arc<AgentMetrics>) -> LeaseCount {
        // Until the first list, as upstream: one server.
        let (publish, count) = watch::channel(1);
        tracing::info!(
            namespace = %settings.namespace,
            selector = %settings.selector,
            kube_apiserver = %settings.kube.server,
            "counting proxy-servers by their Leases"
        );
        let counter = Counter {
            client: Arc::new(KubeClient::new(settings.kube.clone())),
            settings,
            metrics,
            publish,
            known: HashMap::new(),
            heard: SystemTime::UNIX_EPOCH,
            failing: false,
            hold_until: SystemTime::UNIX_EPOCH,
            version: None,
        };
        LeaseCount {
            count,
            task: tokio::spawn(counter.run()),
        }
    }

    /// Receives every change of the count.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u32> {
        self.count.clone()
    }
}

#[derive(Debug, thiserror::Error)]
enum FollowError {
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("kube-apiserver ended the Lease watch with {code} {reason}: {message}")]
    Watch {
        code: u16,
        reason: String,
        message: String,
    },
    #[error("the Lease watch delivered nothing for {0:?}")]
    Silent(Duration),
}

struct Counter {
    client: Arc<KubeClient>,
    settings: LeaseCounting,
    metrics: Arc<AgentMetrics>,
    publish: watch::Sender<u32>,
    /// The Leases matching the selector, by name, as last listed or watched.
    known: HashMap<String, Lease>,
    /// When kube-apiserver last answered or sent an event: Leases are judged
    /// at this time (plus [`JUDGE_GRACE`]) at the latest.
    heard: SystemTime,
    /// The last list or watch failed (logged once, not every retry).
    failing: bool,
    /// Until then the count may grow but not drop: servers are catching up
    /// on renewals after kube-apiserver was away.
    hold_until: SystemTime,
    /// The resourceVersion the next watch starts from: the last one listed
    /// or watched. `None` until the first list, and after a 410 Expired.
    version: Option<String>,
}

impl Counter {
    async fn run(mut self) {
        let mut retry = RETRY_FIRST;
        loop {
            match self.follow().await {
                // The watch's resourceVersion expired (410 Gone): list again.
                Ok(()) => retry = RETRY_FIRST,
                Err(error) => {
                    if self.failing {
                        tracing::debug!(%error, "still cannot list or watch proxy-server Leases");
                    } else {
                        tracing::warn!(%error, count = *self.publish.borrow(), "cannot list or watch proxy-server Leases; keeping the last server count");
                    }
                    self.failing = true;
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// Follows the Leases' changes from the last version seen (listing
    /// them first when there is none) until a watch cannot go on from it
    /// (`Ok`: 410 Expired, list again) or a call fails (`Err`: the next
    /// call watches on from the same version, as client-go's reflector
    /// does, so that kube-apiserver coming back is not met by every agent
    /// listing at once).
    async fn follow(&mut self) -> Result<(), FollowError> {
        let client = self.client.clone();
        let namespace = self.settings.namespace.clone();
        let leases = Leases::new(&client, &namespace);
        if self.version.is_none() {
            self.version = Some(self.list(&leases).await?);
        }
        let mut recount = tokio::time::interval(RECOUNT_EVERY);
        loop {
            let version = self.version.clone().expect("listed or watched");
            let mut events = self.watch(&leases, &version).await?;
            self.answered();
            loop {
                let event = tokio::select! {
                    event = tokio::time::timeout(WATCH_SILENCE, events.next::<Lease>()) => {
                        event.map_err(|_| FollowError::Silent(WATCH_SILENCE))??
                    }
                    _ = recount.tick() => {
                        self.recount();
                        continue;
                    }
                };
                self.heard = SystemTime::now();
                let version = match event {
                    // The watch's time is up: the next one goes on from here.
                    None => break,
                    Some(WatchEvent::Added(lease) | WatchEvent::Modified(lease)) => {
                        let version = lease.metadata.resource_version.clone();
                        self.known.insert(lease.metadata.name.clone(), lease);
                        version
                    }
                    Some(WatchEvent::Deleted(lease)) => {
                        self.known.remove(&lease.metadata.name);
                        lease.metadata.resource_version
                    }
                    Some(WatchEvent::Bookmark { resource_version }) => resource_version,
                    Some(WatchEvent::Error { code: 410, .. }) => {
                        self.version = None;
                        return Ok(());
                    }
                    Some(WatchEvent::Error {
                        code,
                        reason,
                        message,
                    }) => {
                        return Err(FollowError::Watch {
                            code,
                            reason,
                            message,
                        });
                    }
                };
                self.version = Some(version);
                self.recount();
            }
        }
    }

    /// kube-apiserver answered a list or a watch: after a failure, the
    /// count may not drop for one Lease duration, since no server could
    /// renew meanwhile either and they need that long to catch up.
    fn answered(&mut self) {
        self.heard = SystemTime::now();
        if self.failing {
            let longest = self
                .known
                .values()
                .filter_map(|lease| lease.spec.lease_duration_seconds)
                .max()
                .unwrap_or(30)
                .max(0);
            self.hold_until = self.heard + Duration::from_secs(longest as u64);
            tracing::info!(
                count = *self.publish.borrow(),
                "kube-apiserver answers again: following proxy-server Leases; the count will not drop for one Lease duration"
            );
        }
        self.failing = false;
    }

    /// Lists the Leases into `known`; returns the list's resourceVersion.
    async fn list(&mut self, leases: &Leases<'_>) -> Result<String, KubeError> {
        let started = Instant::now();
        let listed = leases.list(&self.settings.selector).await;
        let took = started.elapsed();
        match &listed {
            Ok(_) => self.metrics.lease_call(LeaseCall::List, StatusCode::OK, "", took),
            Err(error) => {
                if let Some((status, reason)) = error.api_status() {
                    self.metrics.lease_call(LeaseCall::List, status, reason, took);
                }
            }
        }
        let list = listed?;
        self.known = list
            .items
            .into_iter()
            .map(|lease| (lease.metadata.name.clone(), lease))
            .collect();
        self.answered();
        self.recount();
        Ok(list.metadata.resource_version)
    }

    async fn watch(
        &self,
        leases: &Leases<'_>,
        version: &str,
    ) -> Result<konnectivity_kube::WatchStream, KubeError> {
        let started = Instant::now();
        let watched = leases
            .watch(&self.settings.selector, version, WATCH_TIMEOUT)
            .await;
        let took = started.elapsed();
        match &watched {
            Ok(_) => self
                .metrics
                .lease_call(LeaseCall::Watch, StatusCode::OK, "", took),
            Err(error) => {
                if let Some((status, reason)) = error.api_status() {
                    self.metrics.lease_call(LeaseCall::Watch, status, reason, took);
                }
            }
        }
        watched
    }

    /// Counts the valid Leases and publishes the count when it changed.
    fn recount(&self) {
        if self.heard == SystemTime::UNIX_EPOCH {
            // Never listed: nothing known, the initial count stands.
            return;
        }
        let now = SystemTime::now();
        let judged = now.min(self.heard + JUDGE_GRACE);
        let valid = self.known.values().filter(|lease| lease.is_valid(judged)).count();
        let count = u32::try_from(valid).unwrap_or(u32::MAX).max(1);
        let holding = now < self.hold_until;
        self.publish.send_if_modified(|published| {
            if *published == count || (holding && count < *published) {
                return false;
            }
            if valid == 0 {
                tracing::warn!("no valid proxy-server Lease; assuming one server");
            } else {
                tracing::info!(
                    from = *published,
                    to = count,
                    "proxy-server count from Leases changed"
                );
            }
            *published = count;
            true
        });
    }
}
