//! Server Leases (`--enable-lease-controller`), as upstream keeps them: each
//! server holds a coordination.k8s.io/v1 Lease named
//! `konnectivity-proxy-server-<server id>`, labelled with `--lease-label`,
//! renewed every `--lease-renew-interval`; agents count the valid ones to
//! learn how many servers there are. Every server also deletes the expired
//! Leases with those labels (a server that died cannot delete its own), and
//! deletes its own when it stops.
//!
//! Conflicts are expected: a renewal that races a deletion, or a Lease
//! someone else edited, is answered 409 by kube-apiserver; the renewal then
//! reads the Lease again and retries, and a deletion is made conditional on
//! the resourceVersion it judged expired, so a renewal in between wins.
//!
//! Ours beyond upstream: a Lease is deleted only when two collections in a
//! row found it expired at the same resourceVersion. After kube-apiserver
//! was away, every server's Lease looks expired (none could renew); deleting
//! them at once would make agents count the servers out and back in. The
//! second look gives live servers one collection interval to renew.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::StatusCode;
use konnectivity_kube::lease::{Lease, LeaseSpec, Leases, MicroTime, ObjectMeta};
use konnectivity_kube::{KubeClient, KubeError};
use tokio::task::JoinHandle;

use crate::metrics::ServerMetrics;

/// How many times a renewal reads the Lease again after a conflict before
/// it waits for the next attempt (as Kubernetes' lease controller).
const UPDATE_ATTEMPTS: usize = 5;
/// The longest wait between attempts after a failed renewal.
const MAX_RETRY: Duration = Duration::from_secs(7);
/// How long deleting our Lease at shutdown may take.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// `--enable-lease-controller` and the flags that go with it.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    /// `--lease-namespace`.
    pub namespace: String,
    /// `--lease-label`: put on our Lease, and the selector of the Leases
    /// the garbage collector looks at.
    pub labels: BTreeMap<String, String>,
    /// `--lease-duration` (upstream fixes 30s).
    pub duration: Duration,
    /// `--lease-renew-interval` (upstream fixes 15s).
    pub renew_interval: Duration,
    /// `--lease-gc-interval` (upstream fixes 15s).
    pub gc_interval: Duration,
}

/// The renewal and the garbage collection, running until [`stop`](Self::stop).
pub(crate) struct LeaseController {
    client: Arc<KubeClient>,
    namespace: String,
    name: String,
    tasks: Vec<JoinHandle<()>>,
}

/// The Lease name upstream gives a server.
pub(crate) fn lease_name(server_id: &str) -> String {
    format!("konnectivity-proxy-server-{server_id}")
}

impl LeaseController {
    pub(crate) fn start(
        client: Arc<KubeClient>,
        settings: &LeaseSettings,
        server_id: &str,
        metrics: Arc<ServerMetrics>,
    ) -> LeaseController {
        let name = lease_name(server_id);
        tracing::info!(
            lease = %name,
            namespace = %settings.namespace,
            kube_apiserver = client.server(),
            "holding a server Lease and collecting expired ones"
        );
        let holder = Holder {
            client: client.clone(),
            namespace: settings.namespace.clone(),
            template: Lease {
                metadata: ObjectMeta {
                    name: name.clone(),
                    namespace: settings.namespace.clone(),
                    labels: settings.labels.clone(),
                    resource_version: String::new(),
                    other: Default::default(),
                },
                spec: LeaseSpec {
                    holder_identity: Some(server_id.to_owned()),
                    lease_duration_seconds: Some(settings.duration.as_secs() as i64),
                    acquire_time: None,
                    renew_time: None,
                    other: Default::default(),
                },
                other: Default::default(),
            },
            renew_interval: settings.renew_interval,
        };
        let collector = Collector {
            client: client.clone(),
            namespace: settings.namespace.clone(),
            selector: konnectivity_kube::lease::selector(&settings.labels),
            every: settings.gc_interval,
            metrics,
            expired: HashMap::new(),
        };
        LeaseController {
            client,
            namespace: settings.namespace.clone(),
            name,
            tasks: vec![tokio::spawn(holder.run()), tokio::spawn(collector.run())],
        }
    }

    /// Stops renewing and deletes our Lease, so that agents count one server
    /// fewer at once rather than after the Lease expires.
    pub(crate) async fn stop(self) {
        for task in &self.tasks {
            task.abort();
        }
        tracing::info!(lease = %self.name, "deleting the server Lease");
        let leases = Leases::new(&self.client, &self.namespace);
        match tokio::time::timeout(STOP_TIMEOUT, leases.delete(&self.name, None)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) if error.is_status(StatusCode::NOT_FOUND) => {}
            Ok(Err(error)) => tracing::warn!(%error, lease = %self.name, "could not delete the server Lease"),
            Err(_) => {
                tracing::warn!(lease = %self.name, "could not delete the server Lease within {STOP_TIMEOUT:?}")
            }
        }
    }
}

impl Drop for LeaseController {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Keeps our Lease renewed.
struct Holder {
    client: Arc<KubeClient>,
    namespace: String,
    /// Our Lease as we want it, without times or version.
    template: Lease,
    renew_interval: Duration,
}

impl Holder {
    async fn run(self) {
        let leases = Leases::new(&self.client, &self.namespace);
        // The Lease as kube-apiserver last returned it: updates carry its
        // resourceVersion; `None` reads it afresh first.
        let mut latest: Option<Lease> = None;
        let mut retry = Duration::from_millis(200);
        let mut failing = false;
        loop {
            let wait = match self.renew(&leases, &mut latest).await {
                Ok(()) => {
                    if failing {
                        tracing::info!(lease = %self.template.metadata.name, "server Lease renewed again");
                        failing = false;
                    }
                    retry = Duration::from_millis(200);
                    jittered(self.renew_interval)
                }
                Err(error) => {
                    tracing::warn!(%error, lease = %self.template.metadata.name, "could not renew the server Lease; retrying");
                    failing = true;
                    let wait = retry.min(self.renew_interval);
                    retry = (retry * 2).min(MAX_RETRY);
                    wait
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// One renewal: updates the Lease we know, reading it again (or creating
    /// it) when kube-apiserver says it changed or is gone.
    async fn renew(&self, leases: &Leases<'_>, latest: &mut Option<Lease>) -> Result<(), KubeError> {
        let mut last_error = None;
        for _ in 0..UPDATE_ATTEMPTS {
            let base = match latest.take() {
                Some(lease) => lease,
                None => match leases.get(&self.template.metadata.name).await {
                    Ok(lease) => lease,
                    Err(error) if error.is_status(StatusCode::NOT_FOUND) => {
                        let mut lease = self.template.clone();
                        lease.spec.renew_time = Some(MicroTime::now());
                        let created = leases.create(&lease).await?;
                        tracing::info!(lease = %created.metadata.name, "server Lease created");
                        *latest = Some(created);
                        return Ok(());
                    }
                    Err(error) => return Err(error),
                },
            };
            let mut lease = base.clone();
            lease
                .metadata
                .labels
                .extend(self.template.metadata.labels.clone());
            lease.spec.holder_identity = self.template.spec.holder_identity.clone();
            lease.spec.lease_duration_seconds = self.template.spec.lease_duration_seconds;
            lease.spec.renew_time = Some(MicroTime::now());
            match leases.update(&lease).await {
                Ok(updated) => {
                    *latest = Some(updated);
                    return Ok(());
                }
                // Changed or deleted since we read it: read it again.
                Err(error)
                    if error.is_status(StatusCode::CONFLICT) || error.is_status(StatusCode::NOT_FOUND) =>
                {
                    tracing::debug!(%error, "server Lease changed under us; reading it again");
                    last_error = Some(error);
                }
                Err(error) => {
                    *latest = Some(base);
                    return Err(error);
                }
            }
        }
        Err(last_error.expect("every attempt that loops records its error"))
    }
}

/// Deletes expired server Leases.
struct Collector {
    client: Arc<KubeClient>,
    namespace: String,
    selector: String,
    every: Duration,
    metrics: Arc<ServerMetrics>,
    /// The Leases the last collection found expired: name → resourceVersion.
    expired: HashMap<String, String>,
}

impl Collector {
    async fn run(mut self) {
        let client = self.client.clone();
        let namespace = self.namespace.clone();
        let leases = Leases::new(&client, &namespace);
        loop {
            self.collect(&leases).await;
            tokio::time::sleep(self.every).await;
        }
    }

    async fn collect(&mut self, leases: &Leases<'_>) {
        let started = Instant::now();
        let listed = leases.list(&self.selector).await;
        let took = started.elapsed();
        let list = match listed {
            Ok(list) => {
                self.metrics.lease_listed(StatusCode::OK, "", took);
                list
            }
            Err(error) => {
                if let Some((status, reason)) = error.api_status() {
                    self.metrics.lease_listed(status, reason, took);
                }
                tracing::warn!(%error, "could not list server Leases to collect expired ones");
                // Back from an outage, look twice again.
                self.expired.clear();
                return;
            }
        };
        let now = SystemTime::now();
        let seen_before = std::mem::take(&mut self.expired);
        for lease in list.items.iter().filter(|lease| !lease.is_valid(now)) {
            let name = &lease.metadata.name;
            let version = &lease.metadata.resource_version;
            if seen_before.get(name) != Some(version) {
                tracing::debug!(lease = %name, "server Lease expired; deleted if still so at the next collection");
                self.expired.insert(name.clone(), version.clone());
                continue;
            }
            let started = Instant::now();
            let deleted = leases.delete(name, Some(&lease.metadata.resource_version)).await;
            let took = started.elapsed();
            match deleted {
                Ok(()) => {
                    self.metrics.lease_deleted(StatusCode::OK, "", took);
                    self.metrics.lease_culled();
                    tracing::info!(lease = %name, "deleted an expired server Lease");
                }
                Err(error) => {
                    if let Some((status, reason)) = error.api_status() {
                        self.metrics.lease_deleted(status, reason, took);
                    }
                    if error.is_status(StatusCode::NOT_FOUND) {
                        tracing::debug!(lease = %name, "expired server Lease was already deleted");
                    } else if error.is_status(StatusCode::CONFLICT) {
                        tracing::debug!(lease = %name, "expired server Lease was renewed meanwhile; kept");
                    } else {
                        tracing::warn!(%error, lease = %name, "could not delete an expired server Lease");
                    }
                }
            }
        }
    }
}

/// `interval` plus up to 4% (Kubernetes' lease controller's jitter), so
/// that servers started together do not renew in step.
fn jittered(interval: Duration) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    interval + interval.mul_f64(0.04 * f64::from(nanos % 1000) / 1000.0)
}
