//! Where the binaries under test come from: this build (`target/<profile>/`)
//! or the image, whose root filesystem `hack/image.sh` exports to
//! `target/image/rootfs`. From the image, a binary runs in that filesystem
//! (chroot), so it uses the image's own `nft`, libc and certificates, as it
//! would in a container; the host's `/tmp` (the tests' files and sockets),
//! `/dev`, `/run` (network namespaces) and a fresh `/proc` are mounted into
//! it in a mount namespace of the process's own, which ends with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::foreign::repo;

/// Path of a workspace binary, next to the test executable's directory
/// (`target/<profile>/`). `hack/test.sh` builds them before the tests.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --bins)",
        path.display()
    );
    path
}

/// What runs the workspace's binaries.
#[derive(Clone, Debug)]
pub enum Binaries {
    /// `target/<profile>/`, on this machine's filesystem.
    Build,
    /// The image's root filesystem, as root or as another user, optionally
    /// as a pod sees it.
    Image {
        root: Arc<PathBuf>,
        user: Option<u32>,
        pod: Option<Arc<PodEnvironment>>,
    },
}

/// What a pod's container finds without asking: its ServiceAccount's token
/// and the cluster CA where the kubelet mounts them, and the `kubernetes`
/// Service in its environment.
#[derive(Debug)]
pub struct PodEnvironment {
    /// Holds `token` and `ca.crt`.
    pub service_account: PathBuf,
    /// KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT.
    pub kubernetes_service: std::net::SocketAddr,
}

/// Mounts what the process needs from the host, then enters the image with
/// the PATH a Debian image gives its processes. Run by `unshare --mount
/// --propagation slave`: mounts made here never reach the host, and network
/// namespaces the host adds later (pods) still appear under `/run/netns`.
///
/// As a pod (a service-account directory given): `/run` is the container's
/// own, holding the ServiceAccount at /var/run/secrets/kubernetes.io/
/// serviceaccount (the image's /var/run is /run), and the `kubernetes`
/// Service's address is in the environment.
const ENTER_IMAGE: &str = r#"set -e
root=$1 user=$2 account=$3 host=$4 port=$5
shift 5
mount --rbind /tmp "$root/tmp"
mount --rbind /dev "$root/dev"
mount --rbind /run "$root/run"
mount -t proc proc "$root/proc"
set -- PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
if [ -n "$account" ]; then
  mount -t tmpfs -o mode=0755 pod-run "$root/run"
  mkdir -p "$root/run/secrets/kubernetes.io/serviceaccount"
  cp "$account/token" "$account/ca.crt" "$root/run/secrets/kubernetes.io/serviceaccount/"
  set -- KUBERNETES_SERVICE_HOST="$host" KUBERNETES_SERVICE_PORT="$port" "$@"
fi
exec chroot ${user:+--userspec=$user:$user} "$root" /usr/bin/env "$@""#;

impl Binaries {
    /// The image's files, if `hack/image.sh` exported them; without them a
    /// test is skipped, except under CI, where it fails.
    pub fn image() -> Option<Binaries> {
        let root = std::env::var_os("KONNECTIVITY_IMAGE_ROOTFS")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo().join("target/image/rootfs"));
        if root.join("usr/local/bin/proxy-agent").is_file() {
            return Some(Binaries::Image {
                root: Arc::new(root),
                user: None,
                pod: None,
            });
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "the image's files are needed at {} and CI is set (hack/image.sh exports them)",
            root.display()
        );
        eprintln!(
            "skipping: no image files at {} (bash hack/image.sh builds and exports them)",
            root.display()
        );
        None
    }

    /// The image's binaries when `hack/image.sh` exported them, this build's
    /// otherwise; under CI the image's are required.
    pub fn image_or_build() -> Binaries {
        Binaries::image().unwrap_or(Binaries::Build)
    }

    /// The same binaries, run as `uid` (and gid) instead of root.
    pub fn as_user(&self, uid: u32) -> Binaries {
        match self {
            Binaries::Build => panic!("build binaries run as the test's user"),
            Binaries::Image { root, pod, .. } => Binaries::Image {
                root: root.clone(),
                user: Some(uid),
                pod: pod.clone(),
            },
        }
    }

    /// The same binaries, run as in a pod with `pod`'s ServiceAccount.
    pub fn in_pod(&self, pod: PodEnvironment) -> Binaries {
        match self {
            Binaries::Build => panic!("build binaries run on the test's filesystem"),
            Binaries::Image { root, user, .. } => Binaries::Image {
                root: root.clone(),
                user: *user,
                pod: Some(Arc::new(pod)),
            },
        }
    }

    /// The command line that runs `binary` with `args`.
    pub fn command_line(&self, binary: &str, args: &[String]) -> Vec<String> {
        match self {
            Binaries::Build => std::iter::once(bin(binary).display().to_string())
                .chain(args.iter().cloned())
                .collect(),
            Binaries::Image { root, user, pod } => [
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "--",
                "sh",
                "-c",
                ENTER_IMAGE,
                "enter-image",
            ]
            .into_iter()
            .map(str::to_owned)
            .chain([
                root.display().to_string(),
                user.map(|uid| uid.to_string()).unwrap_or_default(),
            ])
            .chain(match pod {
                Some(pod) => [
                    pod.service_account.display().to_string(),
                    pod.kubernetes_service.ip().to_string(),
                    pod.kubernetes_service.port().to_string(),
                ],
                None => Default::default(),
            })
            .chain([format!("/usr/local/bin/{binary}")])
            .chain(args.iter().cloned())
            .collect(),
        }
    }

    /// Where `binary` is on this machine's filesystem (to copy or inspect it).
    pub fn host_path(&self, binary: &str) -> PathBuf {
        match self {
            Binaries::Build => bin(binary),
            Binaries::Image { root, .. } => root.join("usr/local/bin").join(binary),
        }
    }

    /// The image's root, if these are the image's binaries.
    pub fn root(&self) -> Option<&Path> {
        match self {
            Binaries::Build => None,
            Binaries::Image { root, .. } => Some(root),
        }
    }
}
