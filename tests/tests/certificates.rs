//! Certificates Go accepts and rustls does not. A peer presenting one is
//! refused loudly: one WARN line per peer naming it, the problem and the
//! fix. Our own certificate files of such a shape stop start-up with exit 2
//! and the flag at fault.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::support::certs::{CertFiles, Pki};
use crate::support::image::bin;
use crate::support::procs::{Proc, Server};
use crate::support::{TempDir, free_port, wait_until};

/// curl presenting `client` to `https://127.0.0.1:port/`, as an OpenSSL
/// (or Go) client would: it sends the v1 certificate without a second
/// thought. Its outcome does not matter, the server's log does.
fn curl_with(client: &CertFiles, pki: &Pki, port: u16) {
    let status = Command::new("curl")
        .args(["-sS", "--max-time", "5", "--http2", "-o", "/dev/null"])
        .arg("--cacert")
        .arg(&pki.ca)
        .arg("--cert")
        .arg(&client.cert)
        .arg("--key")
        .arg(&client.key)
        .arg(format!("https://127.0.0.1:{port}/"))
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(
        !status.success(),
        "a v1 client certificate was served on port {port}"
    );
}

fn warnings_about_v1(proc: &Proc, listener: &str) -> Vec<String> {
    proc.log_text()
        .lines()
        .filter(|line| line.starts_with('W') && line.contains("X.509 v1") && line.contains(listener))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1_client_certificate_is_refused_with_one_warning_per_peer_on_every_listener() {
    let dir = TempDir::new("konn-certs");
    let pki = Pki::new(dir.path());
    let node_port = free_port();
    let server = Server::start(
        dir.path(),
        &pki,
        "grpc",
        false,
        &[
            format!("--node-frontend-port={node_port}"),
            "--node-frontend-bind-address=127.0.0.1".to_owned(),
            format!("--node-client-ca-cert={}", pki.node_ca.display()),
            "--node-allowed-destinations=10.96.0.0/12:443".to_owned(),
            "--control-plane-agent-ids=cp-1".to_owned(),
        ],
    )
    .await;
    // The listener names are the ones the server logs; the v1 certificate
    // is checked before its chain, so the node frontend's other CA does not
    // change the outcome.
    for (port, listener) in [
        (server.agent_port, "agent"),
        (server.tcp_port(), "frontend"),
        (node_port, "node frontend"),
    ] {
        // A peer retrying, as agents do every second.
        for _ in 0..3 {
            curl_with(&pki.v1_client, &pki, port);
        }
        wait_until(Duration::from_secs(5), "the warning", || async {
            !warnings_about_v1(&server.proc, &format!("listener=\"{listener}\"")).is_empty()
        })
        .await;
        let warnings = warnings_about_v1(&server.proc, &format!("listener=\"{listener}\""));
        assert_eq!(
            warnings.len(),
            1,
            "once per peer on the {listener} listener: {warnings:#?}"
        );
        let warning = &warnings[0];
        for needed in ["peer=\"127.0.0.1:", "-extfile", "re-issue"] {
            assert!(warning.contains(needed), "{needed:?} missing from {warning}");
        }
    }
}

/// A certificate and key of a shape openssl can make and rustls cannot use.
fn openssl_self_signed(dir: &Path, name: &str, newkey: &[&str]) -> CertFiles {
    let files = CertFiles {
        cert: dir.join(format!("{name}.crt")),
        key: dir.join(format!("{name}.key")),
    };
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN={name}"),
        ])
        .args(newkey)
        .arg("-keyout")
        .arg(&files.key)
        .arg("-out")
        .arg(&files.cert)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "openssl req for {name}");
    files
}

/// Runs a binary to its exit; its status and standard error.
fn run(binary: &str, args: &[String]) -> (Option<i32>, String) {
    let output = Command::new(bin(binary))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn our_own_certificates_of_such_shapes_stop_start_up_naming_the_flag() {
    let dir = TempDir::new("konn-certs");
    let pki = Pki::new(dir.path());
    let rsa_1024 = openssl_self_signed(dir.path(), "rsa-1024", &["-newkey", "rsa:1024"]);
    let p521 = openssl_self_signed(
        dir.path(),
        "p521",
        &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:secp521r1"],
    );
    let socket = dir.path().join("frontend.sock");
    let server_with = |cert: &CertFiles| {
        vec![
            format!("--uds-name={}", socket.display()),
            "--server-port=0".to_owned(),
            format!("--agent-port={}", free_port()),
            format!("--health-port={}", free_port()),
            format!("--admin-port={}", free_port()),
            "--agent-bind-address=127.0.0.1".to_owned(),
            "--health-bind-address=127.0.0.1".to_owned(),
            format!("--cluster-cert={}", cert.cert.display()),
            format!("--cluster-key={}", cert.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
        ]
    };
    let agent_with = |cert: &CertFiles| {
        vec![
            "--proxy-server-host=127.0.0.1".to_owned(),
            format!("--proxy-server-port={}", free_port()),
            format!("--health-server-port={}", free_port()),
            "--health-server-host=127.0.0.1".to_owned(),
            format!("--admin-server-port={}", free_port()),
            format!("--ca-cert={}", pki.ca.display()),
            format!("--agent-cert={}", cert.cert.display()),
            format!("--agent-key={}", cert.key.display()),
        ]
    };
    let cases = [
        (
            "proxy-server",
            server_with(&pki.v1_client),
            "--cluster-cert",
            &pki.v1_client,
            "X.509 v1",
        ),
        (
            "proxy-agent",
            agent_with(&pki.v1_client),
            "--agent-cert",
            &pki.v1_client,
            "X.509 v1",
        ),
        (
            "proxy-agent",
            agent_with(&rsa_1024),
            "--agent-cert",
            &rsa_1024,
            "1024-bit RSA",
        ),
        (
            "proxy-server",
            server_with(&p521),
            "--cluster-cert",
            &p521,
            "P-521",
        ),
    ];
    for (binary, args, flag, cert, problem) in cases {
        let (code, stderr) = run(binary, &args);
        assert_eq!(code, Some(2), "{binary} with {problem}: {stderr}");
        let line = stderr.trim_end();
        assert!(!line.contains('\n'), "one line: {stderr}");
        for needed in [flag, &cert.cert.display().to_string(), problem, "re-issue"] {
            assert!(line.contains(needed), "{needed:?} missing from {line}");
        }
    }
}

/// openssl's client against `port`, offering TLS 1.2 with only `cipher`
/// (OpenSSL's name) or, with `None`, TLS 1.3: the cipher negotiated, or
/// `None` when the handshake failed.
fn negotiated(port: u16, pki: &Pki, cipher: Option<&str>) -> Option<String> {
    let mut command = Command::new("openssl");
    command
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}"), "-brief"])
        .arg("-CAfile")
        .arg(&pki.ca)
        .arg("-cert")
        .arg(&pki.agent.cert)
        .arg("-key")
        .arg(&pki.agent.key);
    match cipher {
        Some(cipher) => command.args(["-tls1_2", "-cipher", cipher]),
        None => command.arg("-tls1_3"),
    };
    let output = command.stdin(std::process::Stdio::null()).output().unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    text.lines()
        .find_map(|line| line.strip_prefix("Ciphersuite: "))
        .map(str::to_owned)
}

/// `--cipher-suites` (Go's names) decides which TLS 1.2 suites every
/// listener offers, as upstream's does; TLS 1.3's are offered regardless,
/// as Go offers them. A client offering only a suite left out is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cipher_suites_limit_what_tls_1_2_clients_can_use() {
    let dir = TempDir::new("konn-ciphers");
    let pki = Pki::new(dir.path());
    let server = Server::start(
        dir.path(),
        &pki,
        "grpc",
        true,
        &["--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384".to_owned()],
    )
    .await;
    let port = server.agent_port;
    assert_eq!(
        negotiated(port, &pki, Some("ECDHE-ECDSA-AES256-GCM-SHA384")).as_deref(),
        Some("ECDHE-ECDSA-AES256-GCM-SHA384")
    );
    assert_eq!(
        negotiated(port, &pki, Some("ECDHE-ECDSA-AES128-GCM-SHA256")),
        None
    );
    assert!(negotiated(port, &pki, None).is_some_and(|suite| suite.starts_with("TLS_")));

    // Without the flag, both TLS 1.2 suites are offered.
    let open = Server::start(dir.path(), &pki, "grpc", true, &[]).await;
    assert_eq!(
        negotiated(open.agent_port, &pki, Some("ECDHE-ECDSA-AES128-GCM-SHA256")).as_deref(),
        Some("ECDHE-ECDSA-AES128-GCM-SHA256")
    );
}

/// A suite this build does not have, or TLS 1.0/1.1, stops start-up naming
/// the flag and what is available.
#[test]
fn unavailable_cipher_suites_and_old_tls_versions_are_refused_at_start() {
    let dir = TempDir::new("konn-ciphers");
    let pki = Pki::new(dir.path());
    for (flag, expected) in [
        ("--cipher-suites=TLS_RSA_WITH_AES_128_CBC_SHA", "--cipher-suites"),
        ("--tls-min-version=VersionTLS10", "--tls-min-version"),
        ("--tls-min-version=VersionTLS11", "--tls-min-version"),
    ] {
        let output = Command::new(bin("proxy-server"))
            .args([
                "--mode=grpc",
                "--server-port=0",
                "--uds-name=/tmp/never-bound.sock",
                flag,
            ])
            .arg(format!("--cluster-cert={}", pki.server.cert.display()))
            .arg(format!("--cluster-key={}", pki.server.key.display()))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(expected), "{flag}: {stderr}");
        if flag.starts_with("--cipher-suites") {
            assert!(
                stderr.contains("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"),
                "names what is available: {stderr}"
            );
        } else {
            assert!(stderr.contains("VersionTLS12"), "{stderr}");
        }
    }
}

/// An agent whose TLS set-up does not fit the server says which flag to
/// fix: a name the server's certificate does not carry, no --ca-cert, no
/// client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_tls_failures_name_the_flag_to_fix() {
    let dir = TempDir::new("konn-agent-tls");
    let pki = Pki::new(dir.path());
    // On every loopback address, so that 127.0.0.2 reaches it too.
    let server = Server::start(
        dir.path(),
        &pki,
        "grpc",
        true,
        &["--agent-bind-address=".to_owned()],
    )
    .await;
    let port = server.agent_port.to_string();
    let ca = format!("--ca-cert={}", pki.ca.display());
    let cert = format!("--agent-cert={}", pki.agent.cert.display());
    let key = format!("--agent-key={}", pki.agent.key.display());
    for (flags, hint) in [
        // 127.0.0.2 is loopback too, but not in the server's certificate.
        (
            vec!["--proxy-server-host=127.0.0.2", &ca, &cert, &key],
            "give --proxy-server-host a name it carries",
        ),
        (
            vec!["--proxy-server-host=127.0.0.1", &cert, &key],
            "give --ca-cert the CA that signed it",
        ),
        (
            vec!["--proxy-server-host=127.0.0.1", &ca],
            "set --agent-cert and --agent-key",
        ),
    ] {
        let mut args: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
        args.push(format!("--proxy-server-port={port}"));
        args.push(format!("--health-server-port={}", free_port()));
        let agent = Proc::spawn("proxy-agent", &args, dir.path());
        wait_until(Duration::from_secs(10), hint, || async {
            agent.log_text().contains(hint)
        })
        .await;
    }
}
