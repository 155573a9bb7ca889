//! The image as users run it: its binaries on its own filesystem (its libc,
//! its nft), from the root filesystem `hack/image.sh` exports. The capture
//! scenarios run from the image too (`from_the_image_*` in node_capture.rs
//! and pod_capture.rs); here the image's contents and its egress path.

use std::path::Path;

use crate::support::TempDir;
use crate::support::certs::Pki;
use crate::support::cluster::Setup;
use crate::support::connect::via_uds;
use crate::support::image::Binaries;
use crate::support::netns::root_or_skip;
use crate::support::procs::{Agent, Server};
use crate::support::targets::{self, pattern_digest};
use konnectivity_client::Tunnel;

const MIB: u64 = 1024 * 1024;

/// Whether `name` is an executable file in one of the image's PATH
/// directories.
fn in_image_path(root: &Path, name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    [
        "usr/local/sbin",
        "usr/local/bin",
        "usr/sbin",
        "usr/bin",
        "sbin",
        "bin",
    ]
    .iter()
    .map(|dir| root.join(dir).join(name))
    .any(|path| std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

#[test]
fn every_program_the_binaries_run_is_in_the_image() {
    let Some(image) = Binaries::image() else {
        return;
    };
    let root = image.root().expect("image binaries");
    for program in konnectivity_node::programs::ALL {
        assert!(
            in_image_path(root, program.name),
            "the image lacks {} (Debian package {}), which proxy-agent runs for {}",
            program.name,
            program.package,
            program.purpose
        );
    }
    for binary in [
        "proxy-server",
        "proxy-agent",
        "konnectivity-cni",
        "proxy-test-client",
    ] {
        assert!(in_image_path(root, binary), "the image lacks {binary}");
    }
}

/// proxy-server and proxy-agent from the image carry HTTP CONNECT and gRPC
/// dials over the Unix socket, bytes intact; the agent runs as uid 65532,
/// as the egress manifests run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_from_the_image_carries_connect_and_grpc_with_a_non_root_agent() {
    // Entering the image's filesystem needs root (mount, chroot).
    if !root_or_skip("egress_from_the_image_carries_connect_and_grpc_with_a_non_root_agent") {
        return;
    }
    let Some(image) = Binaries::image() else {
        return;
    };
    let target = targets::blob().await;
    for mode in ["http-connect", "grpc"] {
        let dir = TempDir::new("konn-image");
        let pki = Pki::new(dir.path());
        let server = Server::start_from(&image, dir.path(), &pki, mode, true, &[]).await;
        let agent = Agent::start_from(
            &image.as_user(65532),
            dir.path(),
            &pki,
            server.agent_port,
            "image-agent",
            &[],
        );
        server.wait_backends(1).await;
        let setup = Setup {
            dir,
            pki,
            server,
            agent,
        };
        let address = target.addr.to_string();
        let expected = pattern_digest(64 * MIB, 7);
        let pulled = if mode == "grpc" {
            let tunnel = Tunnel::connect_uds(setup.server.uds_path()).await.unwrap();
            let mut stream = tunnel.dial(&address).await.unwrap();
            let (sent, received) = targets::push(&mut stream, 64 * MIB, 6).await.unwrap();
            assert_eq!(sent, received, "{mode}: pushed bytes changed on the way");
            targets::pull(&mut stream, 64 * MIB, 7).await.unwrap()
        } else {
            let mut stream = via_uds(setup.server.uds_path(), &address).await.unwrap().unwrap();
            let (sent, received) = targets::push(&mut stream, 64 * MIB, 6).await.unwrap();
            assert_eq!(sent, received, "{mode}: pushed bytes changed on the way");
            targets::pull(&mut stream, 64 * MIB, 7).await.unwrap()
        };
        assert_eq!(pulled, expected, "{mode}: pulled bytes changed on the way");
        // unshare execs the shell, which execs chroot, then env, then the
        // agent: the spawned process's pid is the agent's.
        let uid = std::fs::read_to_string(format!("/proc/{}/status", setup.agent.proc.pid()))
            .unwrap()
            .lines()
            .find(|line| line.starts_with("Uid:"))
            .map(|line| line.split_whitespace().nth(1).unwrap().to_owned());
        assert_eq!(uid.as_deref(), Some("65532"), "the agent runs as 65532");
        setup.assert_gauges_return_to_zero().await;
    }
}
