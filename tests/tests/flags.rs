//! Bad or conflicting flags: exit status 2 and a message naming the flag.

mod support;

use std::process::Command;

use support::procs::bin;

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
