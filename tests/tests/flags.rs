//! Bad or conflicting flags: exit status 2 and a message naming the flag.

use std::process::Command;

use crate::support::image::bin;

/// Runs a binary with `args`; its exit code and standard error.
fn run(binary: &str, args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(bin(binary)).args(args).output().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn invalid_server_flags_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--mode=socks"], "--mode"),
        (
            &["--server-port=80", "--server-ca-cert=/nonexistent"],
            "--server-port",
        ),
        (&["--agent-port=50000"], "--agent-port"),
        (&["--agent-port=99999"], "outside 1024-49151"),
        (&["--health-port=x"], "a number in 1024-49151"),
        (&["--uds-name=/tmp/x.sock", "--server-port=8090"], "--server-port"),
        (&["--uds-name=/tmp/x.sock", "--server-port=0"], "--cluster-cert"),
        (&["--server-port=8090"], "--server-ca-cert"),
        (
            &[
                "--uds-name=/tmp/x.sock",
                "--server-port=0",
                "--cluster-cert=/nonexistent",
                "--cluster-key=/nonexistent",
            ],
            "--cluster-cert",
        ),
        (&["--keepalive-time=5"], "--keepalive-time"),
        (
            &[
                "--uds-name=/tmp/x.sock",
                "--server-port=0",
                concat!("--cluster-cert=", env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
                concat!("--cluster-key=", env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
                "--proxy-strategies=destCIDR",
            ],
            "--proxy-strategies",
        ),
        (
            &["--delete-existing-uds-file=maybe"],
            "--delete-existing-uds-file",
        ),
    ];
    for (args, flag) in cases {
        let (code, stderr) = run("proxy-server", args);
        assert_eq!(code, Some(2), "{args:?} should exit 2: {stderr}");
        assert!(
            stderr.contains(flag),
            "{args:?}: message should name {flag}: {stderr}"
        );
    }
}

#[test]
fn invalid_node_frontend_flags_exit_2_naming_the_flag() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let base = [
        "--uds-name=/tmp/x.sock".to_owned(),
        "--server-port=0".to_owned(),
        format!("--cluster-cert={file}"),
        format!("--cluster-key={file}"),
    ];
    let node = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let ca = format!("--node-client-ca-cert={file}");
    let cluster_ca = format!("--cluster-ca-cert={file}");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (node(&["--node-frontend-port=28100"]), "--node-client-ca-cert"),
        (
            node(&[
                "--node-frontend-port=28100",
                &ca,
                "--node-allowed-destinations=10.0.0.1",
            ]),
            "--node-allowed-destinations",
        ),
        (
            node(&[
                "--node-frontend-port=28100",
                &ca,
                "--node-allowed-destinations=10.0.0.1:443",
                &cluster_ca,
            ]),
            "--control-plane-agent-ids",
        ),
        (
            node(&["--control-plane-agent-ids=cp-1"]),
            "--control-plane-agent-ids",
        ),
        (
            node(&["--node-allowed-destinations=10.0.0.1:443"]),
            "--node-allowed-destinations",
        ),
    ];
    for (args, flag) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = run("proxy-server", &args);
        assert_eq!(code, Some(2), "{args:?} should exit 2: {stderr}");
        assert!(
            stderr.contains(flag),
            "{args:?}: message should name {flag}: {stderr}"
        );
    }
}

#[test]
fn invalid_agent_flags_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--agent-identifiers=zone=a"], "--agent-identifiers"),
        (&["--agent-identifiers=zone=a"], "zone"),
        (
            &["--sync-interval=20s", "--sync-interval-cap=10s"],
            "--sync-interval",
        ),
        (&["--sync-interval=1"], "--sync-interval"),
        (&["--agent-cert=/nonexistent"], "--agent-cert"),
        (&["--health-server-port=70000"], "--health-server-port"),
        (&["--xfr-channel-size=0"], "--xfr-channel-size"),
        (&["--agent-key=/etc/hostname"], "--agent-cert"),
        (&["--agent-cert=/etc/hostname"], "--agent-key"),
        (&["--admin-server-port=20"], "--admin-server-port"),
        (&["--server-count-source=lease"], "--server-count-source"),
        (&["--sync-forever=perhaps"], "--sync-forever"),
        (&["--probe-interval=0s"], "--probe-interval"),
        (&["--cni-socket=/tmp/cni.sock"], "--cni-socket"),
        (&["--capture=10.96.0.1:443"], "--capture"),
        (&["--capture=10.96.0.1:443=10.0.0.1:6443"], "--node-frontend-port"),
        (&["--capture-mark=0"], "--capture-mark"),
        (&["--agent-identifiers=ipv4="], "--agent-identifiers"),
        (&["--agent-identifiers=host=n1&ipv4="], "empty value"),
    ];
    for (args, flag) in cases {
        let (code, stderr) = run("proxy-agent", args);
        assert_eq!(code, Some(2), "{args:?} should exit 2: {stderr}");
        assert!(
            stderr.contains(flag),
            "{args:?}: message should name {flag}: {stderr}"
        );
    }
}

#[test]
fn konnectivity_cni_run_by_hand_says_what_it_is() {
    // --help: the usage, on stdout, status 0.
    let help = Command::new(bin("konnectivity-cni"))
        .arg("--help")
        .output()
        .unwrap();
    assert_eq!(help.status.code(), Some(0));
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("CNI_COMMAND") && text.contains("install-cni"),
        "{text}"
    );

    // No CNI_COMMAND (and stdin left open, as at a terminal): the spec's
    // JSON error on stdout, ending with a newline, the usage on stderr, and
    // no wait for input.
    let mut child = Command::new(bin("konnectivity-cni"))
        .env_remove("CNI_COMMAND")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let _stdin = child.stdin.take();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("konnectivity-cni waited for a configuration on stdin");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.ends_with("}\n"), "{stdout:?}");
    let error: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(error["code"], 4, "{error}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("run by the container runtime"));

    // VERSION, as a runtime asks: JSON on one line.
    let version = Command::new(bin("konnectivity-cni"))
        .env("CNI_COMMAND", "VERSION")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(version.status.code(), Some(0));
    let text = String::from_utf8_lossy(&version.stdout);
    assert!(
        text.ends_with("}\n") && text.contains("supportedVersions"),
        "{text:?}"
    );
    assert!(version.stderr.is_empty(), "a runtime's call gets no usage text");
}

#[test]
fn a_missing_socket_directory_stops_start_up_with_one_line_naming_the_flag() {
    let pki_dir = crate::support::TempDir::new("konn-flags");
    let pki = crate::support::certs::Pki::new(pki_dir.path());
    let args = [
        "--uds-name=/nonexistent-konnectivity/konnectivity-server.socket".to_owned(),
        "--server-port=0".to_owned(),
        format!("--agent-port={}", crate::support::free_port()),
        format!("--health-port={}", crate::support::free_port()),
        format!("--cluster-cert={}", pki.server.cert.display()),
        format!("--cluster-key={}", pki.server.key.display()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, stderr) = run("proxy-server", &args);
    assert_eq!(code, Some(2), "{stderr}");
    // The start-up lines before it are logs; the error is one line of its own.
    let last = stderr.lines().last().unwrap_or_default();
    assert_eq!(stderr.matches("does not exist").count(), 1, "{stderr}");
    assert!(last.starts_with("proxy-server: --uds-name"), "{stderr}");
    assert!(
        last.contains("/nonexistent-konnectivity does not exist"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("panicked at") && !stderr.contains("stack backtrace"),
        "{stderr}"
    );
}

/// Threads of a process named as tokio names its runtime workers.
fn runtime_workers(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter(|task| {
            let comm = task.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).is_ok_and(|name| name.trim() == "tokio-rt-worker")
        })
        .count()
}

/// `--worker-threads` sizes each binary's runtime; left at 0 it is half the
/// CPUs this process may use, at least one (not tokio's one per CPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_threads_sizes_the_runtime_and_defaults_to_half_the_cpus() {
    let cpus = std::thread::available_parallelism().unwrap().get();
    let default = (cpus / 2).max(1);
    let setup =
        crate::support::cluster::Setup::with_flags("http-connect", true, &["--worker-threads=3".into()], &[])
            .await;
    assert_eq!(runtime_workers(setup.server.proc.pid()), 3, "--worker-threads=3");
    assert_eq!(
        runtime_workers(setup.agent.proc.pid()),
        default,
        "the default on {cpus} CPUs"
    );
    let (code, stderr) = run("proxy-agent", &["--worker-threads=x"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--worker-threads"), "{stderr}");
}
