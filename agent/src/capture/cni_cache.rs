//! The container runtime's CNI result cache (libcni's `cniCacheV1` files in
//! `--cni-cache-dir`/results): what tells a pinned network namespace that is
//! a pod's from any other, and which pod it is. libcni writes one file per
//! attachment, `NETWORK-CONTAINERID-IFNAME`, with the container id, the
//! interface, the namespace path (libcni 1.1 and later) and the CNI_ARGS the
//! runtime passed (K8S_POD_NAMESPACE, K8S_POD_NAME).

use std::path::Path;

use serde::Deserialize;

/// One cached attachment, as much of it as enrolment needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct CachedAttachment {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub pod_namespace: String,
    pub pod_name: String,
}

#[derive(Deserialize)]
struct CacheFile {
    kind: String,
    #[serde(rename = "containerId")]
    container_id: String,
    #[serde(rename = "ifName")]
    ifname: String,
    #[serde(default)]
    netns: String,
    #[serde(rename = "cniArgs", default)]
    cni_args: Vec<(String, String)>,
}

/// The attachments cached under `cache_dir` that name their namespace;
/// files that are not libcni's v1 cache, or that cannot be read, are
/// skipped (the cache is the runtime's, not ours to judge).
pub(super) fn attachments(cache_dir: &Path) -> Vec<CachedAttachment> {
    let Ok(entries) = std::fs::read_dir(cache_dir.join("results")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| std::fs::read(entry.path()).ok())
        .filter_map(|bytes| serde_json::from_slice::<CacheFile>(&bytes).ok())
        .filter(|file| file.kind == "cniCacheV1" && !file.netns.is_empty() && !file.container_id.is_empty())
        .map(|file| {
            let arg = |name: &str| {
                file.cni_args
                    .iter()
                    .find(|(key, _)| key == name)
                    .map(|(_, value)| value.clone())
                    .unwrap_or_default()
            };
            CachedAttachment {
                pod_namespace: arg("K8S_POD_NAMESPACE"),
                pod_name: arg("K8S_POD_NAME"),
                container_id: file.container_id,
                ifname: file.ifname,
                netns: file.netns,
            }
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
        // As containerd's libcni writes it (config and result abbreviated).
        std::fs::write(
            results.join("podnet-abc123-eth0"),
            r#"{"kind":"cniCacheV1","containerId":"abc123","config":"e30=","ifName":"eth0","networkName":"podnet","netns":"/var/run/netns/cni-1","cniArgs":[["IgnoreUnknown","1"],["K8S_POD_NAMESPACE","default"],["K8S_POD_NAME","web-0"]],"result":{}}"#,
        )
        .unwrap();
        // Older libcni: no netns, so it cannot be matched to a pin.
        std::fs::write(
            results.join("podnet-old-eth0"),
            r#"{"kind":"cniCacheV1","containerId":"old","config":"e30=","ifName":"eth0","networkName":"podnet"}"#,
        )
        .unwrap();
        std::fs::write(results.join("garbage"), "not json").unwrap();
        let found = attachments(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            found,
            [CachedAttachment {
                container_id: "abc123".into(),
                ifname: "eth0".into(),
                netns: "/var/run/netns/cni-1".into(),
                pod_namespace: "default".into(),
                pod_name: "web-0".into(),
            }]
        );
    }
}
