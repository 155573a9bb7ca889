//! Counting proxy-servers by their Leases (`--count-server-leases`), as
//! upstream's agents do: every server holds a Lease with known labels and
//! renews it; the valid ones are the servers alive. The agent lists them
//! once, then watches for changes, and recounts every second, because a
//! Lease expires by the clock, without any event.
//!
//! The count follows upstream's rules: no valid Lease counts as one server.
//! Ours beyond upstream: while kube-apiserver cannot be reached (the list or
//! watch failing), the agent keeps the last count it made while connected,
//! instead of watching every Lease it saw expire one by one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::StatusCode;
use konnectivity_plumbing::kube::lease::{Lease, Leases};
use konnectivity_plumbing::kube::{KubeClient, KubeEndpoint, KubeError, WatchEvent};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::{AgentMetrics, LeaseCall};

/// How often the count is made again from what is known.
const RECOUNT_EVERY: Duration = Duration::from_secs(1);
/// How long kube-apiserver keeps a watch open before the agent starts the
/// next one (client-go picks 5 to 10 minutes at random).
const WATCH_TIMEOUT: Duration = Duration::from_secs(300);
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
            current: false,
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
}

struct Counter {
    client: Arc<KubeClient>,
    settings: LeaseCounting,
    metrics: Arc<AgentMetrics>,
    publish: watch::Sender<u32>,
    /// The Leases matching the selector, by name, as last listed or watched.
    known: HashMap<String, Lease>,
    /// Whether `known` reflects kube-apiserver now (the list succeeded and
    /// the watch runs); while not, the last count is kept.
    current: bool,
}

impl Counter {
    async fn run(mut self) {
        let mut retry = RETRY_FIRST;
        loop {
            match self.follow().await {
                // The watch's resourceVersion expired (410 Gone): list again.
                Ok(()) => retry = RETRY_FIRST,
                Err(error) => {
                    if self.current {
                        tracing::warn!(%error, count = *self.publish.borrow(), "cannot list or watch proxy-server Leases; keeping the last server count");
                    } else {
                        tracing::debug!(%error, "still cannot list or watch proxy-server Leases");
                    }
                    self.current = false;
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// Lists the Leases, then follows their changes until a watch cannot
    /// go on from the version it had (`Ok`) or a call fails (`Err`).
    async fn follow(&mut self) -> Result<(), FollowError> {
        let client = self.client.clone();
        let namespace = self.settings.namespace.clone();
        let leases = Leases::new(&client, &namespace);
        let mut version = self.list(&leases).await?;
        let mut recount = tokio::time::interval(RECOUNT_EVERY);
        loop {
            let mut events = self.watch(&leases, &version).await?;
            loop {
                let event = tokio::select! {
                    event = events.next::<Lease>() => event?,
                    _ = recount.tick() => {
                        self.recount();
                        continue;
                    }
                };
                match event {
                    // The watch's time is up: the next one goes on from here.
                    None => break,
                    Some(WatchEvent::Added(lease) | WatchEvent::Modified(lease)) => {
                        version = lease.metadata.resource_version.clone();
                        self.known.insert(lease.metadata.name.clone(), lease);
                    }
                    Some(WatchEvent::Deleted(lease)) => {
                        version = lease.metadata.resource_version.clone();
                        self.known.remove(&lease.metadata.name);
                    }
                    Some(WatchEvent::Bookmark { resource_version }) => version = resource_version,
                    Some(WatchEvent::Error { code: 410, .. }) => return Ok(()),
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
                }
                self.recount();
            }
        }
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
        self.current = true;
        self.recount();
        Ok(list.metadata.resource_version)
    }

    async fn watch(
        &self,
        leases: &Leases<'_>,
        version: &str,
    ) -> Result<konnectivity_plumbing::kube::WatchStream, KubeError> {
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
        if !self.current {
            return;
        }
        let now = SystemTime::now();
        let valid = self.known.values().filter(|lease| lease.is_valid(now)).count();
        let count = u32::try_from(valid).unwrap_or(u32::MAX).max(1);
        self.publish.send_if_modified(|published| {
            if *published == count {
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
