//! The container runtime's CNI result cache (libcni's `cniCacheV1` files in
//! `--cni-cache-dir`/results): the runtime's own record of each pod it
//! attached to a network. libcni writes one file per attachment,
//! `NETWORK-CONTAINERID-IFNAME`, once the whole chain's ADD has succeeded,
//! and removes it on DEL. It holds the container id, the interface, the
//! network's name and the configuration the chain ran with, the CNI_ARGS the
//! runtime passed (K8S_POD_NAMESPACE, K8S_POD_NAME) and the chain's result.
//! The namespace path is a field of its own only in newer libcni; containerd
//! 1.6's has none, and the path is then the `sandbox` the result gives the
//! attachment's interface (every plugin reports the namespace it set the
//! interface up in there).
//!
//! The cache is machine-global (containerd cannot move it), so it holds the
//! attachments of every network on the machine; [`CachedAttachment::is_ours`]
//! says which are this agent's.

use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Deserialize;

use crate::cni::network::chained_agent_socket;

/// One cached attachment, as much of it as enrolment needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CachedAttachment {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub pod_namespace: String,
    pub pod_name: String,
    /// The network the runtime attached the pod to.
    pub network: String,
    /// The agent socket the chain the runtime ran handed the pod to, when
    /// that chain had konnectivity-cni in it.
    pub chained_socket: Option<PathBuf>,
}

impl CachedAttachment {
    /// Whether this attachment is a pod of this agent's: the runtime ran
    /// konnectivity-cni for it pointed at `agent_socket`, or it is on one of
    /// `our_networks` (networks whose configuration chains konnectivity-cni
    /// pointed at us now) and ran before the plugin was chained. An
    /// attachment whose chain handed it to another agent's socket is never
    /// ours, whatever its network is called.
    pub fn is_ours(&self, our_networks: &[String], agent_socket: &Path) -> bool {
        match &self.chained_socket {
            Some(socket) => socket == agent_socket,
            None => our_networks.contains(&self.network),
        }
    }
}

#[derive(Deserialize)]
struct CacheFile {
    kind: String,
    #[serde(rename = "containerId")]
    container_id: String,
    #[serde(rename = "ifName")]
    ifname: String,
    #[serde(rename = "networkName", default)]
    network: String,
    /// The configuration bytes the chain ran with (Go's `[]byte`: base64).
    #[serde(default)]
    config: String,
    #[serde(default)]
    netns: String,
    #[serde(rename = "cniArgs", default)]
    cni_args: Vec<(String, String)>,
    #[serde(default)]
    result: CachedResult,
}

#[derive(Deserialize, Default)]
struct CachedResult {
    #[serde(default)]
    interfaces: Vec<CachedInterface>,
}

#[derive(Deserialize)]
struct CachedInterface {
    #[serde(default)]
    name: String,
    #[serde(default)]
    sandbox: String,
}

impl CacheFile {
    /// The attachment's namespace: the cache's own field, or else the
    /// sandbox of the interface the attachment made, as the result reports.
    fn netns(&self) -> Option<&str> {
        if !self.netns.is_empty() {
            return Some(&self.netns);
        }
        self.result
            .interfaces
            .iter()
            .find(|interface| interface.name == self.ifname && !interface.sandbox.is_empty())
            .map(|interface| interface.sandbox.as_str())
    }
}

/// The attachments cached under `cache_dir` that name their namespace;
/// files that are not libcni's v1 cache, or that cannot be read, are
/// skipped (the cache is the runtime's, not ours to judge).
pub(crate) fn attachments(cache_dir: &Path) -> Vec<CachedAttachment> {
    let Ok(entries) = std::fs::read_dir(cache_dir.join("results")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| std::fs::read(entry.path()).ok())
        .filter_map(|bytes| serde_json::from_slice::<CacheFile>(&bytes).ok())
        .filter(|file| file.kind == "cniCacheV1" && !file.container_id.is_empty())
        .filter_map(|file| {
            let netns = file.netns()?.to_owned();
            let arg = |name: &str| {
                file.cni_args
                    .iter()
                    .find(|(key, _)| key == name)
                    .map(|(_, value)| value.clone())
                    .unwrap_or_default()
            };
            let chained_socket = base64::engine::general_purpose::STANDARD
                .decode(&file.config)
                .ok()
                .and_then(|bytes| serde_json::from_slice(&bytes).ok())
                .and_then(|config| chained_agent_socket(&config));
            Some(CachedAttachment {
                pod_namespace: arg("K8S_POD_NAMESPACE"),
                pod_name: arg("K8S_POD_NAME"),
                container_id: file.container_id,
                ifname: file.ifname,
                netns,
                network: file.network,
                chained_socket,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libcni_v1_cache_files_and_skips_the_rest() {
        let dir = std::env::temp_dir().join(format!("konn-cni-cache-{}", std::process::id()));
        let results = dir.join("results");
        std::fs::create_dir_all(&results).unwrap();
        // As containerd's libcni writes it (result abbreviated); the config
        // is the conflist the chain ran with, base64-encoded.
        let config = base64::engine::general_purpose::STANDARD.encode(
            r#"{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"ptp"},{"type":"konnectivity-cni","agentSocket":"/run/k/cni.sock"}]}"#,
        );
        std::fs::write(
            results.join("podnet-abc123-eth0"),
            format!(
                r#"{{"kind":"cniCacheV1","containerId":"abc123","config":"{config}","ifName":"eth0","networkName":"podnet","netns":"/var/run/netns/cni-1","cniArgs":[["IgnoreUnknown","1"],["K8S_POD_NAMESPACE","default"],["K8S_POD_NAME","web-0"]],"result":{{}}}}"#
            ),
        )
        .unwrap();
        // A chain without our plugin (a pod from before it was chained).
        std::fs::write(
            results.join("podnet-def456-eth0"),
            r#"{"kind":"cniCacheV1","containerId":"def456","config":"e30=","ifName":"eth0","networkName":"podnet","netns":"/var/run/netns/cni-2","cniArgs":[]}"#,
        )
        .unwrap();
        // containerd 1.6's libcni: no netns field; the result's interface
        // names it (its host-side veth has no sandbox).
        std::fs::write(
            results.join("kindnet-0b2455-eth0"),
            r#"{"kind":"cniCacheV1","containerId":"0b2455","config":"e30=","ifName":"eth0","networkName":"kindnet","cniArgs":[["K8S_POD_NAMESPACE","default"],["K8S_POD_NAME","pod-a"],["K8S_POD_INFRA_CONTAINER_ID","0b2455"],["K8S_POD_UID","uid-a"],["IgnoreUnknown","1"]],"capabilityArgs":{"dns":{"Servers":["10.96.0.10"]}},"result":{"cniVersion":"1.0.0","dns":{},"interfaces":[{"mac":"62:e0:94:a9:87:e2","name":"veth162f48e9"},{"mac":"1a:6d:01:08:25:4b","name":"eth0","sandbox":"/run/containerd/io.containerd.grpc.v1.cri/netns/cni-3922"}],"ips":[{"address":"10.244.1.2/24","gateway":"10.244.1.1","interface":1}]}}"#,
        )
        .unwrap();
        // Nothing names the namespace: it cannot be matched to a pin.
        std::fs::write(
            results.join("podnet-old-eth0"),
            r#"{"kind":"cniCacheV1","containerId":"old","config":"e30=","ifName":"eth0","networkName":"podnet","result":{"interfaces":[{"name":"veth1"}]}}"#,
        )
        .unwrap();
        std::fs::write(results.join("garbage"), "not json").unwrap();
        let mut found = attachments(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        found.sort_by(|a, b| a.container_id.cmp(&b.container_id));
        assert_eq!(
            found,
            [
                CachedAttachment {
                    container_id: "0b2455".into(),
                    ifname: "eth0".into(),
                    netns: "/run/containerd/io.containerd.grpc.v1.cri/netns/cni-3922".into(),
                    pod_namespace: "default".into(),
                    pod_name: "pod-a".into(),
                    network: "kindnet".into(),
                    chained_socket: None,
                },
                CachedAttachment {
                    container_id: "abc123".into(),
                    ifname: "eth0".into(),
                    netns: "/var/run/netns/cni-1".into(),
                    pod_namespace: "default".into(),
                    pod_name: "web-0".into(),
                    network: "podnet".into(),
                    chained_socket: Some("/run/k/cni.sock".into()),
                },
                CachedAttachment {
                    container_id: "def456".into(),
                    ifname: "eth0".into(),
                    netns: "/var/run/netns/cni-2".into(),
                    pod_namespace: String::new(),
                    pod_name: String::new(),
                    network: "podnet".into(),
                    chained_socket: None,
                }
            ]
        );
    }

    #[test]
    fn an_attachment_is_ours_by_the_socket_its_chain_named_or_else_by_its_network() {
        let attachment = |network: &str, socket: Option<&str>| CachedAttachment {
            container_id: "c".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/cni-1".into(),
            pod_namespace: "default".into(),
            pod_name: "p".into(),
            network: network.into(),
            chained_socket: socket.map(PathBuf::from),
        };
        let ours = ["podnet".to_owned()];
        let socket = Path::new("/run/k/cni.sock");
        // The runtime ran our plugin, pointed at us.
        assert!(attachment("podnet", Some("/run/k/cni.sock")).is_ours(&ours, socket));
        assert!(attachment("renamed", Some("/run/k/cni.sock")).is_ours(&ours, socket));
        // Pointed at another agent: never ours, even on a network of that name.
        assert!(!attachment("podnet", Some("/run/other/cni.sock")).is_ours(&ours, socket));
        // From before the plugin was chained: ours only on our network.
        assert!(attachment("podnet", None).is_ours(&ours, socket));
        assert!(!attachment("othernet", None).is_ours(&ours, socket));
        assert!(!attachment("podnet", None).is_ours(&[], socket));
    }
}
