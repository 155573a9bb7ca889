//! containerd with its CRI plugin, the runtime kubelet drives, as a node
//! runs it: in the node's network namespace, setting pods up through libcni
//! with the conflist in its CNI configuration directory. Tests call its CRI
//! as kubelet does (`RunPodSandbox`, `CreateContainer`, `StopPodSandbox`...).
//!
//! Everything it owns is the test's: its configuration, root, state, socket,
//! CNI directories and images live under the test's directory. What 1.6
//! cannot be told to put elsewhere stays off the machine too: it runs in a
//! mount namespace of its own (held by a `sleep` process, so a restarted
//! containerd finds its shims again) with a private `/run` (its shims'
//! sockets under `/run/containerd/s`, runc's state) and a private `/var/lib`
//! whose `cni` is the test's cache directory (libcni writes its cache to
//! `/var/lib/cni` whatever it is told). Container root filesystems are
//! mounted in that namespace only and vanish with it. The one mount shared
//! with the machine's namespace is the directory where containerd pins pod
//! network namespaces (`netns_mounts_under_state_dir`): the node agent must
//! enter them, as on a node.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatusRequest, CreateContainerRequest,
    DnsConfig, ImageSpec, LinuxPodSandboxConfig, LinuxSandboxSecurityContext, ListPodSandboxRequest, Mount,
    NamespaceMode, NamespaceOption, PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest,
    RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopPodSandboxRequest, VersionRequest,
};
use sha2::{Digest, Sha256};
use tonic::transport::Channel;

use super::netns::{Netns, is_root};
use super::procs::Proc;
use super::wait_until;

/// The sandbox ("pause") image, built here from this machine's `sleep`.
pub const PAUSE_IMAGE: &str = "konnectivity.test/pause:1";
/// The image pods' containers run: this machine's curl and the kubectl on
/// PATH, with the libraries they load.
pub const CLIENT_IMAGE: &str = "konnectivity.test/client:1";
/// Where CRI keeps pod network namespaces under its state directory.
const CRI_NETNS: &str = "io.containerd.grpc.v1.cri/netns";
/// The CNI plugins of a kind node's chain, from Debian's package.
const DEBIAN_CNI_PLUGINS: &[&str] = &["ptp", "host-local", "portmap", "loopback"];

/// Whether containerd can run here: root and containerd's programs. Under CI
/// a missing piece fails the test; without CI it is skipped, saying why.
pub fn containerd_or_skip(test: &str) -> bool {
    if !super::netns::root_or_skip(test) {
        return false;
    }
    let missing: Vec<&str> = [
        "containerd",
        "containerd-shim-runc-v2",
        "ctr",
        "runc",
        "nsenter",
        "unshare",
    ]
    .into_iter()
    .filter(|program| which(program).is_none())
    .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{test} needs {missing:?} (Debian's containerd and runc; hack/test.sh installs them) and CI is set"
    );
    eprintln!("skipping {test}: {missing:?} not installed (Debian's containerd and runc)");
    false
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

fn run(command: &mut Command) -> std::process::Output {
    let output = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// A running containerd and everything it made.
pub struct Containerd {
    dir: PathBuf,
    config: PathBuf,
    pub socket: PathBuf,
    /// The CNI configuration directory (CRI's `conf_dir`).
    pub cni_conf_dir: PathBuf,
    /// The CNI plugin directory (CRI's `bin_dir`): Debian's plugins, and
    /// whatever install-cni copies in.
    pub cni_bin_dir: PathBuf,
    /// libcni's cache, as containerd writes it (its `/var/lib/cni`).
    pub cni_cache_dir: PathBuf,
    /// Where containerd pins pod network namespaces.
    pub netns_dir: PathBuf,
    /// The cgroup every pod of this containerd goes under.
    cgroup_parent: String,
    /// Holds containerd's mount namespace.
    holder: Proc,
    daemon: Option<Proc>,
}

impl Containerd {
    /// Starts containerd in `node`'s network namespace, with its files under
    /// `dir`/containerd, and imports the pause and client images.
    pub async fn start(node: &Netns, dir: &Path) -> Containerd {
        assert!(is_root(), "containerd needs root");
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let base = dir.join("containerd");
        let state = base.join("state");
        let netns_dir = state.join(CRI_NETNS);
        let cni_bin_dir = base.join("cni-bin");
        let cni_conf_dir = base.join("cni-conf");
        let cni_cache_dir = base.join("cni-cache");
        for made in [
            &netns_dir,
            &cni_bin_dir,
            &cni_conf_dir,
            &cni_cache_dir,
            &base.join("root"),
        ] {
            std::fs::create_dir_all(made).unwrap();
        }
        for plugin in DEBIAN_CNI_PLUGINS {
            std::os::unix::fs::symlink(Path::new("/usr/lib/cni").join(plugin), cni_bin_dir.join(plugin))
                .unwrap();
        }
        // The pins must be seen from the machine's namespace, where the node
        // agent runs: a shared mount, whose mounts made in containerd's
        // namespace (a copy, propagation unchanged) appear here too.
        run(Command::new("mount")
            .arg("--bind")
            .arg(&netns_dir)
            .arg(&netns_dir));
        run(Command::new("mount").arg("--make-shared").arg(&netns_dir));

        let config = base.join("config.toml");
        std::fs::write(&config, config_toml(&base, &cni_bin_dir, &cni_conf_dir)).unwrap();
        let ready = base.join("namespace-ready");
        let holder = Proc::spawn_named(
            "containerd-namespace",
            "nsenter",
            &[
                format!("--net=/var/run/netns/{}", node.name),
                "unshare".to_owned(),
                "--mount".to_owned(),
                "--propagation".to_owned(),
                "unchanged".to_owned(),
                "--".to_owned(),
                "sh".to_owned(),
                "-c".to_owned(),
                // Bounded: the namespace outlives a test by an hour at most
                // if the test process itself is killed.
                format!(
                    "set -e; mount -t tmpfs konn-run /run; mount -t tmpfs konn-var-lib /var/lib; \
                     mkdir /var/lib/cni; mount --bind {cache} /var/lib/cni; touch {ready}; exec sleep 3600",
                    cache = cni_cache_dir.display(),
                    ready = ready.display()
                ),
            ],
            &base,
        );
        wait_until(
            Duration::from_secs(10),
            "containerd's mount namespace",
            || async { ready.exists() },
        )
        .await;
        let mut containerd = Containerd {
            socket: base.join("containerd.sock"),
            dir: base,
            config,
            cni_conf_dir,
            cni_bin_dir,
            cni_cache_dir,
            netns_dir,
            cgroup_parent: format!(
                "konn-cri-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ),
            holder,
            daemon: None,
        };
        containerd.start_daemon().await;
        let images = containerd.dir.join("images");
        std::fs::create_dir_all(&images).unwrap();
        for (name, entrypoint, files) in [
            (
                PAUSE_IMAGE,
                vec!["/usr/bin/sleep", "3600"],
                vec![PathBuf::from("/usr/bin/sleep")],
            ),
            (
                CLIENT_IMAGE,
                vec![],
                vec![
                    which("curl").expect("curl on PATH"),
                    which("kubectl").expect("kubectl on PATH (hack/test.sh installs it)"),
                ],
            ),
        ] {
            let archive = images.join(format!("{}.tar", name.replace(['/', ':'], "_")));
            build_image(&archive, name, &entrypoint, &files);
            containerd.ctr(&["-n", "k8s.io", "images", "import"], &archive);
        }
        containerd
    }

    /// Starts containerd itself, in the namespace the holder keeps.
    async fn start_daemon(&mut self) {
        let daemon = Proc::spawn_named(
            "containerd",
            "nsenter",
            &[
                format!("--target={}", self.holder.pid()),
                "--mount".to_owned(),
                "--net".to_owned(),
                "containerd".to_owned(),
                "--config".to_owned(),
                self.config.display().to_string(),
            ],
            &self.dir,
        );
        self.daemon = Some(daemon);
        let socket = self.socket.clone();
        wait_until(Duration::from_secs(20), "containerd's CRI to answer", || {
            let socket = socket.clone();
            async move {
                match cri_client(&socket).await {
                    Ok(mut client) => client.version(VersionRequest::default()).await.is_ok(),
                    Err(_) => false,
                }
            }
        })
        .await;
    }

    /// Stops containerd (SIGTERM, as systemd does) and starts it again; the
    /// pods and their shims run on meanwhile.
    pub async fn restart(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            daemon.signal("TERM");
            let pid = daemon.pid();
            wait_until(Duration::from_secs(20), "containerd to exit", || async move {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|stat| stat.contains(") Z "))
                    .unwrap_or(true)
            })
            .await;
            drop(daemon);
        }
        self.start_daemon().await;
    }

    /// The log containerd wrote.
    pub fn log(&self) -> String {
        self.daemon.as_ref().map(Proc::log_text).unwrap_or_default()
    }

    fn ctr(&self, args: &[&str], file: &Path) {
        run(Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(args)
            .arg(file));
    }

    /// A CRI RuntimeService client, as kubelet holds one.
    pub async fn runtime(&self) -> RuntimeServiceClient<Channel> {
        cri_client(&self.socket).await.expect("containerd's CRI socket")
    }

    /// RunPodSandbox as kubelet sends it for pod `namespace/name`.
    pub async fn run_pod(&self, name: &str, namespace: &str) -> Result<Pod, tonic::Status> {
        let uid = format!("{namespace}-{name}-uid");
        let labels = HashMap::from([
            ("io.kubernetes.pod.name".to_owned(), name.to_owned()),
            ("io.kubernetes.pod.namespace".to_owned(), namespace.to_owned()),
            ("io.kubernetes.pod.uid".to_owned(), uid.clone()),
        ]);
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.to_owned(),
                uid: uid.clone(),
                namespace: namespace.to_owned(),
                attempt: 0,
            }),
            hostname: name.to_owned(),
            log_directory: self
                .dir
                .join("pods")
                .join(format!("{namespace}_{name}_{uid}"))
                .display()
                .to_string(),
            dns_config: Some(DnsConfig {
                servers: vec!["10.96.0.10".to_owned()],
                searches: vec![
                    format!("{namespace}.svc.cluster.local"),
                    "svc.cluster.local".to_owned(),
                    "cluster.local".to_owned(),
                ],
                options: vec!["ndots:5".to_owned()],
            }),
            labels,
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("/{}/pod{uid}", self.cgroup_parent),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(NamespaceOption {
                        network: NamespaceMode::Pod as i32,
                        pid: NamespaceMode::Container as i32,
                        ipc: NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        std::fs::create_dir_all(&config.log_directory).unwrap();
        let id = self
            .runtime()
            .await
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await?
            .into_inner()
            .pod_sandbox_id;
        Ok(Pod { id, config })
    }

    /// The ids of the pod sandboxes containerd has.
    pub async fn sandboxes(&self) -> Vec<String> {
        self.runtime()
            .await
            .list_pod_sandbox(ListPodSandboxRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items
            .into_iter()
            .map(|sandbox| sandbox.id)
            .collect()
    }

    /// The pinned network namespace of `pod`, as its runtime spec names it.
    pub async fn netns_of(&self, pod: &Pod) -> PathBuf {
        let status = self
            .runtime()
            .await
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: pod.id.clone(),
                verbose: true,
            })
            .await
            .unwrap()
            .into_inner();
        let info: serde_json::Value = serde_json::from_str(&status.info["info"]).unwrap();
        let path = info["runtimeSpec"]["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|ns| ns["type"] == "network")
            .and_then(|ns| ns["path"].as_str())
            .expect("the sandbox has a network namespace path");
        PathBuf::from(path)
    }

    /// Creates and starts a container in `pod` running `command` from the
    /// client image, with `mounts` (host path, container path) read-only,
    /// waits until it exits (at most 60 s) and removes it: its exit code and
    /// what it wrote, read from the CRI log file as kubelet reads it.
    pub async fn run_to_completion(
        &self,
        pod: &Pod,
        name: &str,
        command: &[&str],
        mounts: &[(&Path, &str)],
    ) -> Completed {
        static ATTEMPT: AtomicU32 = AtomicU32::new(0);
        let attempt = ATTEMPT.fetch_add(1, Ordering::Relaxed);
        let log_path = format!("{name}/{attempt}.log");
        let mut runtime = self.runtime().await;
        let id = runtime
            .create_container(CreateContainerRequest {
                pod_sandbox_id: pod.id.clone(),
                config: Some(ContainerConfig {
                    metadata: Some(ContainerMetadata {
                        name: name.to_owned(),
                        attempt,
                    }),
                    image: Some(ImageSpec {
                        image: CLIENT_IMAGE.to_owned(),
                        ..Default::default()
                    }),
                    command: command.iter().map(|s| (*s).to_owned()).collect(),
                    mounts: mounts
                        .iter()
                        .map(|(host, container)| Mount {
                            host_path: host.display().to_string(),
                            container_path: (*container).to_owned(),
                            readonly: true,
                            ..Default::default()
                        })
                        .collect(),
                    log_path: log_path.clone(),
                    ..Default::default()
                }),
                sandbox_config: Some(pod.config.clone()),
            })
            .await
            .unwrap_or_else(|status| panic!("CreateContainer {name}: {status}"))
            .into_inner()
            .container_id;
        runtime
            .start_container(StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap_or_else(|status| panic!("StartContainer {name}: {status}"));
        let mut exit_code = None;
        for _ in 0..600 {
            let status = runtime
                .container_status(ContainerStatusRequest {
                    container_id: id.clone(),
                    verbose: false,
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            if status.state == ContainerState::ContainerExited as i32 {
                exit_code = Some(status.exit_code);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        runtime
            .remove_container(RemoveContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap();
        let log =
            std::fs::read_to_string(Path::new(&pod.config.log_directory).join(&log_path)).unwrap_or_default();
        Completed {
            exit_code: exit_code.unwrap_or_else(|| panic!("container {name} did not exit within 60 s")),
            output: cri_log_messages(&log),
        }
    }

    /// StopPodSandbox (the network is torn down: CNI DEL), as kubelet
    /// sends when a pod is deleted.
    pub async fn stop_pod(&self, pod: &Pod) -> Result<(), tonic::Status> {
        self.runtime()
            .await
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: pod.id.clone(),
            })
            .await
            .map(|_| ())
    }

    /// RemovePodSandbox, after StopPodSandbox.
    pub async fn remove_pod(&self, pod: &Pod) -> Result<(), tonic::Status> {
        self.runtime()
            .await
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: pod.id.clone(),
            })
            .await
            .map(|_| ())
    }

    /// The processes in containerd's mount namespace: containerd, its
    /// shims, the pods' processes and the holder.
    fn processes(&self) -> Vec<i32> {
        let Ok(namespace) = std::fs::read_link(format!("/proc/{}/ns/mnt", self.holder.pid())) else {
            return Vec::new();
        };
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok().as_ref() == Some(&namespace))
            .collect()
    }
}

impl Drop for Containerd {
    /// Ends every process in containerd's namespace (so its mounts go with
    /// it), unmounts the pins it shared with the machine, and removes the
    /// pods' cgroups. The directories go with the test's.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- containerd log ----\n{}", self.log());
        }
        for _ in 0..50 {
            let processes = self.processes();
            if processes.is_empty() {
                break;
            }
            let _ = Command::new("kill")
                .arg("-KILL")
                .args(processes.iter().map(i32::to_string))
                .output();
            std::thread::sleep(Duration::from_millis(100));
        }
        self.daemon.take();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut under: Vec<&str> = mounts
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .filter(|point| Path::new(point).starts_with(&self.netns_dir))
            .collect();
        under.sort_by_key(|point| std::cmp::Reverse(point.len()));
        for point in under {
            let _ = Command::new("umount").arg("--lazy").arg(point).output();
        }
        remove_cgroups(&self.cgroup_parent);
    }
}

/// Ends every process left in the cgroups under `/sys/fs/cgroup/*/NAME`
/// (the pods' processes, in mount namespaces of their own, when containerd
/// went before it could stop them), then removes those cgroups, deepest
/// first (an empty cgroup is removed with rmdir).
fn remove_cgroups(name: &str) {
    fn cgroups(dir: &Path, found: &mut Vec<PathBuf>) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    cgroups(&entry.path(), found);
                }
            }
            found.push(dir.to_owned());
        }
    }
    let mut found = Vec::new();
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        cgroups(&hierarchy.path().join(name), &mut found);
    }
    for _ in 0..50 {
        let left: Vec<String> = found
            .iter()
            .filter_map(|cgroup| std::fs::read_to_string(cgroup.join("cgroup.procs")).ok())
            .flat_map(|procs| procs.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .collect();
        if left.is_empty() {
            break;
        }
        let _ = Command::new("kill").arg("-KILL").args(&left).output();
        std::thread::sleep(Duration::from_millis(100));
    }
    for cgroup in found {
        let _ = std::fs::remove_dir(cgroup);
    }
}

/// A pod sandbox: its id and the configuration it was created with (which
/// CreateContainer is given again, as kubelet does).
pub struct Pod {
    pub id: String,
    pub config: PodSandboxConfig,
}

/// What a container did.
pub struct Completed {
    pub exit_code: i32,
    /// stdout and stderr, in order.
    pub output: String,
}

/// The messages of a CRI log file (`TIME STREAM TAG MESSAGE` per line; tag
/// `P` a partial line continued on the next, `F` a full one).
fn cri_log_messages(log: &str) -> String {
    let mut messages = String::new();
    for line in log.lines() {
        let mut fields = line.splitn(4, ' ');
        let (_time, _stream, tag, message) = (fields.next(), fields.next(), fields.next(), fields.next());
        messages.push_str(message.unwrap_or_default());
        if tag == Some("F") {
            messages.push('\n');
        }
    }
    messages
}

async fn cri_client(socket: &Path) -> Result<RuntimeServiceClient<Channel>, tonic::transport::Error> {
    let socket = socket.to_owned();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await?;
    Ok(RuntimeServiceClient::new(channel))
}

/// containerd 1.6's configuration, every path the test's.
fn config_toml(base: &Path, cni_bin_dir: &Path, cni_conf_dir: &Path) -> String {
    let base = base.display();
    format!(
        r#"version = 2
root = "{base}/root"
state = "{base}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{base}/containerd.sock"
[ttrpc]
  address = "{base}/containerd.sock.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Root here lacks CAP_SYS_RESOURCE: the sandbox's oom_score_adj of -998
  # would make runc fail.
  restrict_oom_score_adj = true
  # Pod namespaces pinned under the state directory, not /var/run/netns.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
        bin = cni_bin_dir.display(),
        conf = cni_conf_dir.display(),
    )
}

/// Writes a `docker save` archive of image `name` holding `files` and the
/// shared libraries each loads (as `ldd` lists them), with `entrypoint`.
fn build_image(archive: &Path, name: &str, entrypoint: &[&str], files: &[PathBuf]) {
    let work = archive.with_extension("d");
    let root = work.join("rootfs");
    let copy = |path: &Path| {
        let target = root.join(path.strip_prefix("/").unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(path, &target).unwrap_or_else(|e| panic!("copying {}: {e}", path.display()));
    };
    for file in files {
        // Where the image's PATH finds it.
        let target = Path::new("/usr/bin").join(file.file_name().unwrap());
        let dest = root.join(target.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(file, &dest).unwrap();
        let ldd = Command::new("ldd").arg(file).output().unwrap();
        for library in String::from_utf8_lossy(&ldd.stdout)
            .split_whitespace()
            .filter(|word| word.starts_with('/'))
        {
            copy(Path::new(library));
        }
    }
    for dir in ["tmp", "etc", "proc", "sys", "dev", "root"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    let layer = work.join("layer.tar");
    run(Command::new("tar")
        .arg("-C")
        .arg(&root)
        .args(["--owner=0", "--group=0", "--numeric-owner", "-cf"])
        .arg(&layer)
        .arg("."));
    let diff_id = format!("sha256:{:x}", Sha256::digest(std::fs::read(&layer).unwrap()));
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    })
    .to_string();
    let config_name = format!("{:x}.json", Sha256::digest(config.as_bytes()));
    std::fs::write(work.join(&config_name), config).unwrap();
    let manifest = serde_json::json!([{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]);
    std::fs::write(work.join("manifest.json"), manifest.to_string()).unwrap();
    run(Command::new("tar")
        .arg("-C")
        .arg(&work)
        .arg("-cf")
        .arg(archive)
        .args(["manifest.json", &config_name, "layer.tar"]));
    let _ = std::fs::remove_dir_all(&work);
}
