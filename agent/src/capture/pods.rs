//! The captured pods: one capture listener inside each pod's network
//! namespace, and a state file per pod so a restarted agent re-opens them.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use konnectivity_cni::message::{Attachment, Pod};
use serde::{Deserialize, Serialize};
use tokio::task::AbortHandle;

use super::listener::{self, CaptureContext};
use super::netns::{self, NetnsHandle};
use super::nft;
use crate::programs::NFT;

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
}

/// What is persisted per pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct PodState {
    #[serde(rename = "containerId")]
    container_id: String,
    netns: String,
    ifname: String,
}

struct CapturedPod {
    state: PodState,
    /// The pod's namespace, held open: checks enter this one, and a path
    /// that later names another namespace (a reused PID, a recreated pin)
    /// is not this pod any more.
    netns: NetnsHandle,
    listeners: Vec<AbortHandle>,
}

impl Drop for CapturedPod {
    fn drop(&mut self) {
        for listener in &self.listeners {
            listener.abort();
        }
    }
}

/// Settings for pod capture.
#[derive(Clone)]
pub(super) struct PodSettings {
    pub ruleset: String,
    pub capture_port: u16,
    pub ipv6: bool,
    pub state_dir: PathBuf,
    pub host_netns: PathBuf,
    /// `--pod-netns-dir`: where the runtime pins pod namespaces, enrolled
    /// at start; `None` turns enrolment off.
    pub netns_dir: Option<PathBuf>,
    /// `--cni-cache-dir`: the runtime's CNI result cache, which says which
    /// pod a pinned namespace belongs to.
    pub cni_cache_dir: Option<PathBuf>,
    /// `--exclude-namespaces`: pods of these namespaces are not enrolled
    /// (install-cni's list, which the plugin applies to ADD).
    pub exclude_namespaces: Vec<String>,
}

/// The prefix of the ids of pods enrolled without a cache entry: the
/// runtime knows them under another id, so CNI GC must not drop them.
const ENROLLED_PREFIX: &str = "netns-";

/// The device and inode of the namespace at `path` (following symlinks).
fn namespace_identity(path: &Path) -> std::io::Result<(u64, u64)> {
    let metadata = std::fs::metadata(path)?;
    Ok((metadata.dev(), metadata.ino()))
}

pub(super) struct Pods {
    settings: PodSettings,
    context: Arc<CaptureContext>,
    pods: Mutex<HashMap<String, CapturedPod>>,
    /// Held while a pod is being captured, so an ADD and an enrolment of
    /// the same namespace never both open a listener in it.
    capturing: tokio::sync::Mutex<()>,
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
    pub(super) fn new(settings: PodSettings, context: Arc<CaptureContext>) -> Result<Pods, PodError> {
        std::fs::create_dir_all(&settings.state_dir).map_err(|source| PodError::State {
            dir: settings.state_dir.display().to_string(),
            source,
        })?;
        Ok(Pods {
            settings,
            context,
            pods: Mutex::new(HashMap::new()),
            capturing: tokio::sync::Mutex::new(()),
        })
    }

    fn state_file(&self, container_id: &str) -> PathBuf {
        self.settings.state_dir.join(format!("{container_id}.json"))
    }

    /// Captures a pod: rules and listener inside its namespace, then the
    /// state file. Answered only when both are in place.
    pub(super) async fn add(&self, pod: &Pod) -> Result<(), PodError> {
        self.capture(pod, true).await.map(|_| ())
    }

    /// Captures `pod` unless its namespace is captured already: then, with
    /// `take_over` (an ADD), the capture is recorded under this pod's id;
    /// without (an enrolment), it is left as it is. Whether it captured.
    async fn capture(&self, pod: &Pod, take_over: bool) -> Result<bool, PodError> {
        let _capturing = self.capturing.lock().await;
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
        let mut handles = Vec::new();
        for listener in listeners {
            let listener = tokio::net::TcpListener::from_std(listener).map_err(setup_error)?;
            handles.push(tokio::spawn(listener::serve(listener, self.context.clone())).abort_handle());
        }
        let previous = self.pods.lock().expect("pods lock").insert(
            state.container_id.clone(),
            CapturedPod {
                state,
                netns,
                listeners: handles,
            },
        );
        drop(previous);
        Ok(())
    }

    /// Forgets a pod: listeners closed, state removed. Its rules die with
    /// its namespace. Unknown pods are fine (DEL is repeated).
    pub(super) fn remove(&self, container_id: &str) {
        let removed = self.pods.lock().expect("pods lock").remove(container_id);
        if removed.is_some() {
            tracing::info!(%container_id, "pod released");
        }
        let _ = std::fs::remove_file(self.state_file(container_id));
    }

    /// Whether a pod's listener runs and its rules are in its namespace.
    pub(super) async fn check(&self, container_id: &str) -> Result<(), String> {
        let netns = {
            let pods = self.pods.lock().expect("pods lock");
            let pod = pods
                .get(container_id)
                .ok_or_else(|| format!("pod {container_id} is not captured by this agent"))?;
            if pod.listeners.iter().any(AbortHandle::is_finished) {
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
    pub(super) fn retain(&self, valid: &[Attachment]) {
        let stale: Vec<String> = self
            .pods
            .lock()
            .expect("pods lock")
            .keys()
            .filter(|id| !id.starts_with(ENROLLED_PREFIX) && !valid.iter().any(|a| &a.container_id == *id))
            .cloned()
            .collect();
        for id in stale {
            self.remove(&id);
        }
    }

    /// Enrols the pods that were running before this agent (or before the
    /// plugin was chained): every namespace pinned in `--pod-netns-dir` that
    /// is not the host's and not captured yet gets the capture ADD would
    /// give it, recorded like any pod: under the container id, interface
    /// and pod name the runtime's CNI cache gives for that namespace (pods
    /// of `--exclude-namespaces` are skipped, as ADD skips them), or as
    /// `netns-NAME` when the cache has no entry for it. Only that directory
    /// is looked at: a namespace elsewhere (another program's, a test's) may
    /// not be a pod's, and is never touched.
    ///
    /// With `uncached` false, only namespaces the cache names are enrolled:
    /// libcni writes an entry once the whole chain's ADD has succeeded, so a
    /// pod whose ADD is still running (and which our plugin may yet capture,
    /// or pass through as excluded) is never taken early. That is how the
    /// agent re-checks while it runs, for pods created while the primary CNI
    /// had dropped our entry from its configuration.
    pub(super) async fn enrol_existing(&self, uncached: bool) {
        let Some(dir) = self.settings.netns_dir.clone() else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(&dir) else {
            tracing::debug!(dir = %dir.display(), "no pod network namespace directory");
            return;
        };
        let host = namespace_identity(&self.settings.host_netns).ok();
        let cached: Vec<((u64, u64), super::cni_cache::CachedAttachment)> = self
            .settings
            .cni_cache_dir
            .as_deref()
            .map(super::cni_cache::attachments)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|attachment| {
                Some((namespace_identity(Path::new(&attachment.netns)).ok()?, attachment))
            })
            .collect();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let Ok(identity) = namespace_identity(&path) else {
                continue;
            };
            if Some(identity) == host {
                continue;
            }
            let known = cached.iter().find(|(id, _)| *id == identity).map(|(_, a)| a);
            if known.is_none() && !uncached {
                continue;
            }
            if let Some(attachment) = known
                && self
                    .settings
                    .exclude_namespaces
                    .contains(&attachment.pod_namespace)
            {
                tracing::debug!(netns = %path.display(), namespace = %attachment.pod_namespace, "not enrolling a pod of an excluded namespace");
                continue;
            }
            let pod = match known {
                Some(attachment) => Pod {
                    container_id: attachment.container_id.clone(),
                    netns: path.display().to_string(),
                    ifname: attachment.ifname.clone(),
                    ips: Vec::new(),
                    pod_namespace: attachment.pod_namespace.clone(),
                    pod_name: attachment.pod_name.clone(),
                },
                None => Pod {
                    container_id: format!("{ENROLLED_PREFIX}{name}"),
                    netns: path.display().to_string(),
                    ifname: "eth0".to_owned(),
                    ips: Vec::new(),
                    pod_namespace: String::new(),
                    pod_name: String::new(),
                },
            };
            match self.capture(&pod, false).await {
                Ok(false) => {}
                Ok(true) => {
                    tracing::info!(netns = %path.display(), container_id = %pod.container_id, "enrolled a running pod the plugin had not captured")
                }
                // Said once at start; the re-checks while running would
                // repeat it every few seconds.
                Err(error) if uncached => {
                    tracing::warn!(netns = %path.display(), %error, "could not enrol a running pod")
                }
                Err(error) => {
                    tracing::debug!(netns = %path.display(), %error, "could not enrol a running pod")
                }
            }
        }
    }

    /// Forgets the pods whose namespace is gone, or whose path now names
    /// another namespace.
    pub(super) fn forget_gone(&self) {
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
    /// still exists; drops the records of the others.
    pub(super) async fn restore(&self) {
        let Ok(entries) = std::fs::read_dir(&self.settings.state_dir) else {
            return;
        };
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
            if !Path::new(&state.netns).exists() {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let id = state.container_id.clone();
            match self.open(state).await {
                Ok(()) => tracing::info!(container_id = %id, "pod capture restored"),
                Err(error) => tracing::warn!(container_id = %id, %error, "could not restore pod capture"),
            }
        }
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
