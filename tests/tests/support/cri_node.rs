//! A node as a cluster has one: the node → kube-apiserver topology
//! (support::kas), containerd with a kind node's CNI chain in the node's
//! namespace (support::containerd), and the node agent with pod capture.
//! install-cni, the plugin, proxy-server and both agents come from the
//! image when `hack/image.sh` exported it (always under CI), from this
//! build otherwise.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::json;

use super::containerd::{Completed, Containerd, Pod};
use super::image::Binaries;
use super::kas::*;
use super::procs::Proc;

/// A node: the topology, containerd in its namespace, and the node agent.
/// Dropped in that order reversed: containerd's pins are unmounted before
/// the topology's directory, which holds them, is removed.
pub struct Node {
    pub containerd: Containerd,
    pub agent: Option<Proc>,
    pub topology: Topology,
}

impl Node {
    /// The topology (with the 200 MiB file when `blob`), containerd with a
    /// kind node's CNI chain and, with `chained`, konnectivity-cni installed
    /// into it and the node agent running.
    pub async fn start(chained: bool, blob: bool) -> Node {
        let topology = build_from(blob, Binaries::image_or_build()).await;
        let containerd = Containerd::start(&topology.node, topology.dir.path()).await;
        // A network name of the test's own: on a real node libcni's cache
        // holds every network's attachments.
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let network = format!(
            "konn-{}-{}-kindnet",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let conflist = json!({
            "cniVersion": "1.0.0",
            "name": network,
            "plugins": [
                {
                    "type": "ptp",
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": topology.dir.path().join("ipam").display().to_string(),
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "ranges": [[{"subnet": "10.244.1.0/24"}]],
                    },
                    "mtu": 1500,
                },
                {"type": "portmap", "capabilities": {"portMappings": true}},
            ],
        });
        std::fs::write(
            containerd.cni_conf_dir.join("10-kindnet.conflist"),
            serde_json::to_vec_pretty(&conflist).unwrap(),
        )
        .unwrap();
        let mut node = Node {
            topology,
            containerd,
            agent: None,
        };
        if chained {
            node.install_cni();
            node.start_agent();
            node.topology.wait_node_ready().await;
        }
        node
    }

    pub fn dir(&self) -> &Path {
        self.topology.dir.path()
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir().join("pods")
    }

    /// `proxy-agent install-cni`, as the DaemonSet's sidecar runs it.
    pub fn install_cni(&self) {
        let line = self.topology.binaries.command_line(
            "proxy-agent",
            &[
                "install-cni".to_owned(),
                format!("--cni-bin-dir={}", self.containerd.cni_bin_dir.display()),
                format!("--cni-conf-dir={}", self.containerd.cni_conf_dir.display()),
                format!("--agent-socket={}", self.dir().join("cni.sock").display()),
                "--exclude-namespaces=kube-system".to_owned(),
            ],
        );
        let installed = Command::new(&line[0]).args(&line[1..]).output().unwrap();
        assert!(installed.status.success(), "install-cni: {}", text(&installed));
    }

    /// The node agent with pod capture, pointed at containerd's directories.
    pub fn start_agent(&mut self) {
        let args = [
            format!("--cni-socket={}", self.dir().join("cni.sock").display()),
            format!("--state-dir={}", self.state_dir().display()),
            format!("--pod-netns-dir={}", self.containerd.netns_dir.display()),
            format!("--cni-cache-dir={}", self.containerd.cni_cache_dir.display()),
            format!("--cni-conf-dir={}", self.containerd.cni_conf_dir.display()),
            "--exclude-namespaces=kube-system".to_owned(),
            // Long-lived connections of the tests' own, from pods too.
            STREAMS_CAPTURE.to_owned(),
            // A replaced agent must hand its connections over: a drain
            // this short could not hide one that was not.
            "--drain-timeout=5s".to_owned(),
        ];
        self.agent = Some(self.topology.start_node_agent(&args));
    }

    pub fn kill_agent(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            agent.kill();
        }
    }

    /// `kubectl get --raw /version` in a container of `pod`, with the
    /// kubeconfig and CA a pod would have mounted.
    pub async fn kubectl_version(&self, pod: &Pod) -> Completed {
        let kubeconfig = self.dir().join("pod-kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text("/etc/kubernetes/ca.crt")).unwrap();
        self.containerd
            .run_to_completion(
                pod,
                "kubectl",
                &[
                    "kubectl",
                    "--kubeconfig=/etc/kubernetes/kubeconfig",
                    "--request-timeout=10s",
                    "get",
                    "--raw",
                    "/version",
                ],
                &[
                    (&kubeconfig, "/etc/kubernetes/kubeconfig"),
                    (&self.topology.pki.ca, "/etc/kubernetes/ca.crt"),
                ],
            )
            .await
    }

    /// Asserts that kubectl in `pod` gets the API server's version.
    pub async fn assert_reaches_the_api_server(&self, pod: &Pod, when: &str) {
        let kubectl = self.kubectl_version(pod).await;
        assert!(
            kubectl.exit_code == 0 && kubectl.output.contains("v1.31.0-konnectivity-standin"),
            "{when}: kubectl in the pod exited {}: {}\n---- node agent log ----\n{}",
            kubectl.exit_code,
            kubectl.output,
            self.agent.as_ref().map(Proc::log_text).unwrap_or_default()
        );
    }

    /// Whether our table is in `pod`'s network namespace.
    pub async fn has_table(&self, pod: &Pod) -> bool {
        let netns = self.containerd.netns_of(pod).await;
        let tables = Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["nft", "list", "tables"])
            .output()
            .unwrap();
        assert!(tables.status.success(), "{}", text(&tables));
        String::from_utf8_lossy(&tables.stdout).contains("konnectivity")
    }

    pub fn record_of(&self, pod: &Pod) -> PathBuf {
        self.state_dir().join(format!("{}.json", pod.id))
    }
}
