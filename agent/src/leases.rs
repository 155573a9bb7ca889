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
use std::time::{Duration, SystemTime};

use konnectivity_kube::lease::{Lease, Leases};
use konnectivity_kube::reflector::{Call, Observer, Reflected, Reflector};
use konnectivity_kube::{KubeClient, KubeEndpoint};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::{AgentMetrics, LeaseCall};

/// How often the count is made again from what is known.
const RECOUNT_EVERY: Duration = Duration::from_secs(1);
/// How far past the last word from kube-apiserver Leases are judged.
const JUDGE_GRACE: Duration = Duration::from_secs(5);

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
}

impl Counter {
    /// Follows the Leases (list, then watch on from the last version seen;
    /// [`Reflector`]) and recounts every second meanwhile.
    async fn run(mut self) {
        let metrics = self.metrics.clone();
        let observe: Observer = Box::new(move |call, status, took| {
            let call = match call {
                Call::List => LeaseCall::List,
                Call::Watch => LeaseCall::Watch,
            };
            if let Some((status, reason)) = status {
                metrics.lease_call(call, status, reason, took);
            }
        });
        let collection =
            Leases::new(&self.client, &self.settings.namespace).matching(&self.settings.selector);
        let mut leases = Reflector::<Lease>::new(self.client.clone(), collection, observe);
        let mut recount = tokio::time::interval(RECOUNT_EVERY);
        loop {
            // The call in flight is kept across recounts, not restarted:
            // a slow answer must still arrive.
            let learned = {
                let next = leases.next();
                tokio::pin!(next);
                loop {
                    tokio::select! {
                        learned = &mut next => break learned,
                        _ = recount.tick() => {
                            // While kube-apiserver fails, the last count stands.
                            if !self.failing {
                                self.recount();
                            }
                        }
                    }
                }
            };
            match learned {
                Ok(learned) => {
                    self.answered();
                    match learned {
                        Reflected::Listed(items) => {
                            self.known = items
                                .into_iter()
                                .map(|lease| (lease.metadata.name.clone(), lease))
                                .collect();
                        }
                        Reflected::Applied(lease) => {
                            self.known.insert(lease.metadata.name.clone(), lease);
                        }
                        Reflected::Deleted(lease) => {
                            self.known.remove(&lease.metadata.name);
                        }
                        Reflected::Answered => {}
                    }
                    self.recount();
                }
                Err(error) => {
                    if self.failing {
                        tracing::debug!(%error, "still cannot list or watch proxy-server Leases");
                    } else {
                        tracing::warn!(%error, count = *self.publish.borrow(), "cannot list or watch proxy-server Leases; keeping the last server count");
                    }
                    self.failing = true;
                }
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
