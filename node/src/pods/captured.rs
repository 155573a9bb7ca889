//! The captured pods: one capture listener inside each pod's network
//! namespace, and a state file per pod so a restarted agent re-opens them.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use konnectivity_cni::message::{Attachment, Pod};

use crate::capture::listener::{self, CaptureContext};
use crate::capture::nft;
use crate::handover::InheritedPod;
use crate::pods::netns::{self, NetnsHandle};
use crate::pods::state::PodState;
use crate::programs::NFT;
use crate::serving::Serving;

#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error(
        "netns {0:?} is not a pod network namespace (expected /var/run/netns/NAME, /run/netns/NAME, \
         a file in --pod-netns-dir or /proc/PID/ns/net)"
    )]
    NetnsPath(String),
    #[error("netns {0:?} is the host's own network namespace; it is never touched")]
    HostNetns(String),
    #[error("container id {0:?} has characters other than letters, digits, '-', '_' and '.'")]
    ContainerId(String),
    #[error("setting up capture in {netns}: {source}")]
    Setup { netns: String, source: std::io::Error },
    #[error("state directory {dir}: {source}")]
    State { dir: String, source: std::io::Error },
    #[error("this node agent handed its pods to a newer agent; try again")]
    HandedOver,
}

struct CapturedPod {
    state: PodState,
    /// The pod's namespace, held open: checks enter this one, and a path
    /// that later names another namespace (a reused PID, a recreated pin)
    /// is not this pod any more.
    netns: NetnsHandle,
    /// Its capture listeners (stopped when the pod is dropped).
    listeners: Vec<Serving<tokio::net::TcpListener>>,
}

/// Settings for pod capture.
#[derive(Clone)]
pub struct PodSettings {
    pub ruleset: String,
    pub capture_port: u16,
    pub ipv6: bool,
    pub state_dir: PathBuf,
    pub host_netns: PathBuf,
    /// `--cni-socket`: the socket konnectivity-cni hands pods to. A network
    /// whose chain points the plugin at it is ours.
    pub agent_socket: PathBuf,
    /// `--pod-netns-dir`: where the runtime pins pod namespaces (besides
    /// `/var/run/netns`), so a namespace path the runtime names there is
    /// accepted; counted at start, never scanned for pods.
    pub netns_dir: Option<PathBuf>,
    /// `--cni-cache-dir`: the runtime's CNI result cache, the record of the
    /// pods it attached; `None` turns enrolment off.
    pub cni_cache_dir: Option<PathBuf>,
    /// `--cni-conf-dir`: the runtime's network configurations, which say
    /// which networks chain konnectivity-cni pointed at this agent.
    pub cni_conf_dir: PathBuf,
    /// `--exclude-namespaces`: pods of these namespaces are not enrolled
    /// (install-cni's list, which the plugin applies to ADD).
    pub exclude_namespaces: Vec<String>,
}

/// The prefix of the ids under which agents before this one recorded any
/// pinned namespace without a runtime record. Such a record does not prove
/// a pod: it is dropped at start.
const LEGACY_UNPROVEN_PREFIX: &str = "netns-";

/// What one pass over the runtime's records did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Enrolment {
    /// The networks whose configuration chains konnectivity-cni pointed at
    /// this agent, as found in `--cni-conf-dir`.
    pub networks: Vec<String>,
    /// Pods captured by this pass.
    pub enrolled: usize,
    /// Pods of our networks whose namespace was captured already.
    pub captured_already: usize,
    /// Pods of our networks left alone for `--exclude-namespaces`.
    pub excluded: usize,
    /// Attachments of other networks, or handed to another agent.
    pub not_ours: usize,
    /// Pods of ours whose namespace is gone, is not a pin, or could not be
    /// captured.
    pub failed: usize,
}

/// The device and inode of the namespace at `path` (following symlinks).
fn namespace_identity(path: &Path) -> std::io::Result<(u64, u64)> {
    let metadata = std::fs::metadata(path)?;
    Ok((metadata.dev(), metadata.ino()))
}

pub struct Pods {
    settings: PodSettings,
    context: Arc<CaptureContext>,
    pods: Mutex<HashMap<String, CapturedPod>>,
    /// Held while a pod is being captured, so an ADD and an enrolment of
    /// the same namespace never both open a listener in it.
    capturing: Arc<tokio::sync::Mutex<()>>,
    /// Set once a successor took the pods over.
    handed_over: std::sync::atomic::AtomicBool,
}

fn validate(
    pod_netns: &str,
    container_id: &str,
    host_netns: &Path,
    netns_dir: Option<&Path>,
) -> Result<(), PodError> {
    let in_netns_dir = netns_dir.is_some_and(|dir| {
        let path = Path::new(pod_netns);
        path.parent() == Some(dir)
            && path
                .file_name()
                .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
    });
    let is_proc = pod_netns
        .strip_prefix("/proc/")
        .and_then(|rest| rest.strip_suffix("/ns/net"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
    let is_named = ["/var/run/netns/", "/run/netns/"].iter().any(|prefix| {
        pod_netns
            .strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && !n.contains('/'))
    });
    if !(is_proc || is_named || in_netns_dir) {
        return Err(PodError::NetnsPath(pod_netns.to_owned()));
    }
    let same = match (std::fs::metadata(pod_netns), std::fs::metadata(host_netns)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    if same {
        return Err(PodError::HostNetns(pod_netns.to_owned()));
    }
    let id_ok = !container_id.is_empty()
        && container_id.len() <= 256
        && container_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !id_ok {
        return Err(PodError::ContainerId(container_id.to_owned()));
    }
    Ok(())
}

impl Pods {
    pub fn new(settings: PodSettings, context: Arc<CaptureContext>) -> Result<Pods, PodError> {
        std::fs::create_dir_all(&settings.state_dir).map_err(|source| PodError::State {
            dir: settings.state_dir.display().to_string(),
            source,
        })?;
        Ok(Pods {
            settings,
            context,
            pods: Mutex::new(HashMap::new()),
            capturing: Arc::new(tokio::sync::Mutex::new(())),
            handed_over: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn state_file(&self, container_id: &str) -> PathBuf {
        self.settings.state_dir.join(format!("{container_id}.json"))
    }

    /// Captures a pod: rules and listener inside its namespace, then the
    /// state file. Answered only when both are in place.
    pub async fn add(&self, pod: &Pod) -> Result<(), PodError> {
        self.capture(pod, true).await.map(|_| ())
    }

    /// Captures `pod` unless its namespace is captured already: then, with
    /// `take_over` (an ADD), the capture is recorded under this pod's id;
    /// without (an enrolment), it is left as it is. Whether it captured.
    async fn capture(&self, pod: &Pod, take_over: bool) -> Result<bool, PodError> {
        let _capturing = self.capturing.lock().await;
        // A request that waited through a hand-over is the successor's: it
        // fails here, and the runtime's retry reaches the successor.
        if self.handed_over.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(PodError::HandedOver);
        }
        validate(
            &pod.netns,
            &pod.container_id,
            &self.settings.host_netns,
            self.settings.netns_dir.as_deref(),
        )?;
        let state = PodState {
            container_id: pod.container_id.clone(),
            netns: pod.netns.clone(),
            ifname: pod.ifname.clone(),
        };
        let captured = namespace_identity(Path::new(&state.netns))
            .ok()
            .and_then(|identity| self.captured_as(identity));
        match captured {
            Some(_) if !take_over => return Ok(false),
            Some(old_id) => self.adopt(&old_id, &state),
            None => self.open(state.clone()).await?,
        }
        self.record(&state)?;
        tracing::info!(container_id = %pod.container_id, netns = %pod.netns, namespace = %pod.pod_namespace, name = %pod.pod_name, "pod captured");
        Ok(true)
    }

    /// The id under which the namespace with `identity` is captured.
    fn captured_as(&self, identity: (u64, u64)) -> Option<String> {
        self.pods
            .lock()
            .expect("pods lock")
            .iter()
            .find(|(_, pod)| pod.netns.identity() == identity)
            .map(|(id, _)| id.clone())
    }

    /// A namespace already captured as `old_id` (a repeated ADD, or the ADD
    /// of a pod this agent enrolled while the runtime retried) is taken over
    /// under the new record, without a second listener.
    fn adopt(&self, old_id: &str, state: &PodState) {
        let mut pods = self.pods.lock().expect("pods lock");
        if let Some(mut pod) = pods.remove(old_id) {
            pod.state = state.clone();
            pods.insert(state.container_id.clone(), pod);
        }
        if old_id != state.container_id {
            let _ = std::fs::remove_file(self.state_file(old_id));
        }
    }

    /// Writes a pod's state file (atomically).
    fn record(&self, state: &PodState) -> Result<(), PodError> {
        let text = serde_json::to_vec(&state).expect("state serializes");
        let path = self.state_file(&state.container_id);
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, &path))
            .map_err(|source| PodError::State {
                dir: self.settings.state_dir.display().to_string(),
                source,
            })
    }

    /// Enters the namespace, applies the rules, binds the listeners there,
    /// and serves them from this runtime.
    async fn open(&self, state: PodState) -> Result<(), PodError> {
        let ruleset = self.settings.ruleset.clone();
        let port = self.settings.capture_port;
        let ipv6 = self.settings.ipv6;
        let setup_error = |source| PodError::Setup {
            netns: state.netns.clone(),
            source,
        };
        let netns = NetnsHandle::open(Path::new(&state.netns)).map_err(setup_error)?;
        let entered = netns.clone();
        let listeners = tokio::task::spawn_blocking(move || {
            entered.run(move || {
                // The loopback device carries the redirected connections.
                netns::set_loopback_up()?;
                nft::apply(&ruleset).map_err(std::io::Error::other)?;
                let mut listeners = vec![std::net::TcpListener::bind(("127.0.0.1", port))?];
                if ipv6 {
                    listeners.push(std::net::TcpListener::bind(("::1", port))?);
                }
                for listener in &listeners {
                    listener.set_nonblocking(true)?;
                }
                Ok(listeners)
            })
        })
        .await
        .expect("netns task does not panic")
        .map_err(setup_error)?;
        let listeners = listeners.into_iter().map(OwnedFd::from).collect();
        let path = state.netns.clone();
        self.serve(state, netns, listeners)
            .map_err(|source| PodError::Setup { netns: path, source })
    }

    /// Serves a pod's capture listeners and records it in memory.
    fn serve(&self, state: PodState, netns: NetnsHandle, listeners: Vec<OwnedFd>) -> std::io::Result<()> {
        let mut serving = Vec::new();
        for fd in listeners {
            let listener = std::net::TcpListener::from(fd);
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let context = self.context.clone();
            serving.push(Serving::start(listener, |listener| {
                listener::serve(listener, context)
            }));
        }
        let previous = self.pods.lock().expect("pods lock").insert(
            state.container_id.clone(),
            CapturedPod {
                state,
                netns,
                listeners: serving,
            },
        );
        drop(previous);
        Ok(())
    }

    /// Takes on the pods a predecessor captured: their namespaces as it
    /// held them, their listeners as they are (still accepting there until
    /// it stops). Their records are already in the state directory.
    pub fn inherit(&self, pods: Vec<InheritedPod>) {
        for pod in pods {
            let id = pod.state.container_id.clone();
            let served = NetnsHandle::from_file(pod.netns)
                .and_then(|netns| self.serve(pod.state, netns, pod.listeners));
            if let Err(error) = served {
                tracing::warn!(container_id = %id, %error, "could not take over a pod's capture");
            }
        }
    }

    /// Stops the pods' listeners (a successor accepts on them now), and
    /// refuses every pod change from now on.
    pub fn stop_serving(&self) {
        self.handed_over.store(true, std::sync::atomic::Ordering::Relaxed);
        for pod in self.pods.lock().expect("pods lock").values() {
            for listener in &pod.listeners {
                listener.stop();
            }
        }
    }

    /// Applies the current ruleset again in every captured pod (atomically:
    /// the table is replaced in one transaction), after a configuration
    /// change.
    pub async fn reapply_rules(&self) {
        let pods: Vec<(String, NetnsHandle)> = self
            .pods
            .lock()
            .expect("pods lock")
            .iter()
            .map(|(id, pod)| (id.clone(), pod.netns.clone()))
            .collect();
        for (id, netns) in pods {
            let ruleset = self.settings.ruleset.clone();
            let applied = tokio::task::spawn_blocking(move || {
                netns.run(move || nft::apply(&ruleset).map_err(std::io::Error::other))
            })
            .await
            .expect("netns task does not panic");
            if let Err(error) = applied {
                tracing::warn!(container_id = %id, %error, "could not replace a pod's capture rules");
            }
        }
    }

    /// Every captured pod with its descriptors (its namespace, then its
    /// listeners), for a successor; taken while pod changes are held (see
    /// [`Pods::hold_changes`]).
    pub fn snapshot(&self) -> std::io::Result<Vec<(PodState, Vec<OwnedFd>)>> {
        let pods = self.pods.lock().expect("pods lock");
        let mut snapshot = Vec::new();
        for pod in pods.values() {
            let mut fds = vec![pod.netns.duplicate()?];
            for listener in &pod.listeners {
                fds.push(listener.duplicate()?);
            }
            snapshot.push((pod.state.clone(), fds));
        }
        Ok(snapshot)
    }

    /// Holds every pod change (ADD, enrolment) until the guard is dropped;
    /// waits for one under way. From a thread outside the runtime.
    pub fn hold_changes(&self, runtime: &tokio::runtime::Handle) -> tokio::sync::OwnedMutexGuard<()> {
        runtime.block_on(self.capturing.clone().lock_owned())
    }

    /// Forgets a pod: listeners closed, state removed. Its rules die with
    /// its namespace. Unknown pods are fine (DEL is repeated).
    pub fn remove(&self, container_id: &str) {
        let removed = self.pods.lock().expect("pods lock").remove(container_id);
        if removed.is_some() {
            tracing::info!(%container_id, "pod released");
        }
        let _ = std::fs::remove_file(self.state_file(container_id));
    }

    /// Whether a pod's listener runs and its rules are in its namespace.
    pub async fn check(&self, container_id: &str) -> Result<(), String> {
        let netns = {
            let pods = self.pods.lock().expect("pods lock");
            let pod = pods
                .get(container_id)
                .ok_or_else(|| format!("pod {container_id} is not captured by this agent"))?;
            if pod.listeners.iter().any(Serving::is_stopped) {
                return Err(format!(
                    "the capture listener of pod {container_id} is not running"
                ));
            }
            pod.netns.clone()
        };
        let listed = tokio::task::spawn_blocking(move || {
            netns.run(|| {
                NFT.command()
                    .args(["list", "table", nft::TABLE_FAMILY, nft::TABLE_NAME])
                    .output()
            })
        })
        .await
        .expect("netns task does not panic")
        .map_err(|e| format!("entering the pod's network namespace: {e}"))?;
        if listed.status.success() {
            Ok(())
        } else {
            Err(format!(
                "the capture rules are missing in pod {container_id}'s namespace"
            ))
        }
    }

    /// Keeps only the listed attachments (CNI GC).
    pub fn retain(&self, valid: &[Attachment]) {
        let stale: Vec<String> = self
            .pods
            .lock()
            .expect("pods lock")
            .keys()
            .filter(|id| !valid.iter().any(|a| &a.container_id == *id))
            .cloned()
            .collect();
        for id in stale {
            self.remove(&id);
        }
    }

    /// Enrols the pods of our networks that the runtime recorded and that
    /// are not captured: pods that ran before this agent or before the
    /// plugin was chained, and pods created while the primary CNI had
    /// rewritten its configuration without our entry. A pod is what the
    /// runtime's CNI cache records as attached to a network of ours
    /// ([`CachedAttachment::is_ours`]), in a namespace pinned where pods are
    /// pinned, that still exists, and not of `--exclude-namespaces`. Nothing
    /// else is entered: a namespace pinned by `ip netns add`, a VPN, a lab
    /// tool or another agent has no such record, and is never touched.
    ///
    /// libcni writes an entry once the whole chain's ADD has succeeded, so a
    /// pod whose ADD is still running (and which our plugin may yet capture,
    /// or pass through as excluded) is never taken early. `at_start` says
    /// failures at warning level; the re-checks while running would repeat
    /// them every few seconds.
    ///
    /// [`CachedAttachment::is_ours`]: crate::cni::cache::CachedAttachment::is_ours
    pub async fn enrol_recorded(&self, at_start: bool) -> Enrolment {
        let mut enrolment = Enrolment::default();
        let Some(cache_dir) = self.settings.cni_cache_dir.clone() else {
            return enrolment;
        };
        enrolment.networks =
            crate::cni::network::networks_chaining(&self.settings.cni_conf_dir, &self.settings.agent_socket)
                .unwrap_or_else(|error| {
                    if at_start {
                        tracing::warn!(dir = %self.settings.cni_conf_dir.display(), %error, "cannot read the CNI configuration directory (--cni-conf-dir); only pods whose chain named this agent's socket are enrolled");
                    }
                    Vec::new()
                });
        for attachment in crate::cni::cache::attachments(&cache_dir) {
            if !attachment.is_ours(&enrolment.networks, &self.settings.agent_socket) {
                enrolment.not_ours += 1;
                continue;
            }
            if self
                .settings
                .exclude_namespaces
                .contains(&attachment.pod_namespace)
            {
                enrolment.excluded += 1;
                continue;
            }
            // A pin keeps naming its namespace; a cached /proc/PID path may
            // name whatever process reused the PID since.
            let identity = if attachment.netns.starts_with("/proc/") {
                None
            } else {
                namespace_identity(Path::new(&attachment.netns)).ok()
            };
            let Some(identity) = identity else {
                tracing::debug!(netns = %attachment.netns, container_id = %attachment.container_id, "not enrolling a recorded pod whose namespace is gone or not pinned");
                enrolment.failed += 1;
                continue;
            };
            if self.captured_as(identity).is_some() {
                enrolment.captured_already += 1;
                continue;
            }
            let pod = Pod {
                container_id: attachment.container_id.clone(),
                netns: attachment.netns.clone(),
                ifname: attachment.ifname.clone(),
                ips: Vec::new(),
                pod_namespace: attachment.pod_namespace.clone(),
                pod_name: attachment.pod_name.clone(),
            };
            match self.capture(&pod, false).await {
                Ok(true) => enrolment.enrolled += 1,
                Ok(false) => enrolment.captured_already += 1,
                Err(error) => {
                    enrolment.failed += 1;
                    if at_start {
                        tracing::warn!(netns = %attachment.netns, container_id = %attachment.container_id, %error, "could not enrol a running pod");
                    } else {
                        tracing::debug!(netns = %attachment.netns, container_id = %attachment.container_id, %error, "could not enrol a running pod");
                    }
                }
            }
        }
        enrolment
    }

    /// How many namespaces pinned in `--pod-netns-dir` are not captured
    /// pods (nor the host's): counted for the start-up line, never entered.
    pub fn pinned_left_alone(&self) -> usize {
        let Some(dir) = &self.settings.netns_dir else {
            return 0;
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        let host = namespace_identity(&self.settings.host_netns).ok();
        entries
            .flatten()
            .filter_map(|entry| namespace_identity(&entry.path()).ok())
            .filter(|identity| Some(*identity) != host && self.captured_as(*identity).is_none())
            .count()
    }

    /// Forgets the pods whose namespace is gone, or whose path now names
    /// another namespace.
    pub fn forget_gone(&self) {
        let gone: Vec<String> = self
            .pods
            .lock()
            .expect("pods lock")
            .iter()
            .filter(|(_, pod)| {
                namespace_identity(Path::new(&pod.state.netns)).ok() != Some(pod.netns.identity())
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            tracing::info!(container_id = %id, "the pod's network namespace is gone");
            self.remove(&id);
        }
    }

    /// Re-opens every pod recorded in the state directory whose namespace
    /// still exists; drops the records of the others, and those an earlier
    /// agent made for pinned namespaces the runtime never recorded. How
    /// many pods it re-opened.
    pub async fn restore(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.settings.state_dir) else {
            return 0;
        };
        let mut restored = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|ext| ext != "json") {
                continue;
            }
            let state: Option<PodState> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let Some(state) = state else {
                tracing::warn!(file = %path.display(), "unreadable pod state; removing it");
                let _ = std::fs::remove_file(&path);
                continue;
            };
            if state.container_id.starts_with(LEGACY_UNPROVEN_PREFIX) {
                // Our table may still redirect that namespace's connections
                // to the API server; it is not removed here, because the
                // same table name may be another agent's in a namespace that
                // is that agent's host.
                tracing::warn!(netns = %state.netns, record = %path.display(), "dropping a record an earlier agent made for a pinned namespace that is no pod the runtime recorded; if that namespace is no node agent's own, remove the rules left there with: nsenter --net={} nft delete table inet konnectivity", state.netns);
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !Path::new(&state.netns).exists() {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let id = state.container_id.clone();
            match self.open(state).await {
                Ok(()) => {
                    restored += 1;
                    tracing::info!(container_id = %id, "pod capture restored");
                }
                Err(error) => tracing::warn!(container_id = %id, %error, "could not restore pod capture"),
            }
        }
        restored
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pod_netns_paths_and_safe_ids_are_accepted() {
        let host = Path::new("/proc/self/ns/net");
        assert!(validate("/var/run/netns/cni-1234", "abc123", host, None).is_ok());
        assert!(validate("/proc/4242/ns/net", "abc", host, None).is_ok());
        for bad in [
            "/etc/passwd",
            "/var/run/netns/../x",
            "/proc/self/ns/net",
            "relative",
            "/var/run/netns/",
        ] {
            assert!(
                matches!(validate(bad, "abc", host, None), Err(PodError::NetnsPath(_))),
                "{bad}"
            );
        }
        let own = format!("/proc/{}/ns/net", std::process::id());
        let dir = Path::new("/srv/netns");
        assert!(validate("/srv/netns/cni-1", "abc", host, Some(dir)).is_ok());
        assert!(matches!(
            validate("/srv/netns/cni-1", "abc", host, None),
            Err(PodError::NetnsPath(_))
        ));
        assert!(matches!(
            validate("/srv/netns/.hidden", "abc", host, Some(dir)),
            Err(PodError::NetnsPath(_))
        ));
        assert!(matches!(
            validate(&own, "abc", Path::new("/proc/self/ns/net"), None),
            Err(PodError::HostNetns(_))
        ));
        assert!(matches!(
            validate("/var/run/netns/x", "../../etc", host, None),
            Err(PodError::ContainerId(_))
        ));
    }
}
