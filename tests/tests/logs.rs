//! Logs as Kubernetes log pipelines read them: klog's text form with no
//! terminal colour codes when written to a pipe or file (as container logs
//! are), one JSON object per line with `--logging-format=json`, and a peer's
//! clean stop logged as the normal event it is, not as a warning.

use std::time::Duration;

use crate::support::cluster::Setup;
use crate::support::procs::Proc;
use crate::support::wait_until;

/// klog's header: severity, MMDD, time with microseconds, pid, file:line.
fn is_klog_line(line: &str) -> bool {
    let bytes = line.as_bytes();
    let header = line.split_once("] ").map(|(header, _)| header);
    matches!(bytes.first(), Some(b'I' | b'W' | b'E'))
        && line
            .get(1..5)
            .is_some_and(|date| date.bytes().all(|b| b.is_ascii_digit()))
        && line.get(5..6) == Some(" ")
        && line.get(14..15) == Some(".")
        && header
            .is_some_and(|header| header.ends_with(|c: char| c.is_ascii_digit()) && header.contains(".rs:"))
}

fn lines_of(proc: &Proc) -> Vec<String> {
    proc.log_text().lines().map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_are_klog_lines_without_colour_codes() {
    let setup = Setup::start("grpc", true, &[]).await;
    for proc in [&setup.server.proc, &setup.agent.proc] {
        let lines = lines_of(proc);
        assert!(!lines.is_empty(), "{} logged nothing", proc.name);
        for line in &lines {
            assert!(
                !line.contains('\u{1b}'),
                "{}: escape sequence in {line:?}",
                proc.name
            );
            assert!(is_klog_line(line), "{}: not a klog line: {line:?}", proc.name);
        }
        // Every flag's effective value, one per line, as Kubernetes
        // components print theirs; not a Rust debug dump.
        let flags: Vec<&String> = lines.iter().filter(|l| l.contains("] \"FLAG: --")).collect();
        assert!(flags.len() > 30, "{}: {flags:?}", proc.name);
        assert!(
            flags.iter().any(|l| l.contains(r#""FLAG: --keepalive-time=\"#)),
            "{}: {flags:?}",
            proc.name
        );
        assert!(
            lines
                .iter()
                .all(|l| !l.contains("Config {") && !l.contains("PemFile")),
            "{}: {lines:?}",
            proc.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_kubernetes_object_per_line() {
    let json = vec!["--logging-format=json".to_owned()];
    let setup = Setup::with_flags("grpc", true, &json, &json).await;
    for proc in [&setup.server.proc, &setup.agent.proc] {
        let lines = lines_of(proc);
        assert!(lines.len() >= 2, "{}: {lines:?}", proc.name);
        for line in &lines {
            let object: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: {line:?}: {e}", proc.name));
            assert!(object["ts"].as_f64().is_some_and(|ts| ts > 1.7e9), "{line}");
            assert!(
                object["caller"].as_str().is_some_and(|c| c.contains(".rs:")),
                "{line}"
            );
            assert!(object["msg"].as_str().is_some_and(|m| !m.is_empty()), "{line}");
            assert!(object["v"].is_u64(), "{line}");
        }
    }
    let agent = lines_of(&setup.agent.proc);
    assert!(
        agent
            .iter()
            .any(|l| l.contains(r#""msg":"connected to proxy-server""#) && l.contains(r#""server_count":1"#)),
        "numbers stay numbers: {agent:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_of_either_peer_is_not_a_warning() {
    let mut setup = Setup::start("grpc", true, &[]).await;
    // The server stops (SIGTERM): the agent notes it and reconnects.
    setup.server.proc.signal("TERM");
    assert!(
        setup
            .server
            .proc
            .wait_exit(Duration::from_secs(5))
            .await
            .is_some(),
        "server did not exit"
    );
    let agent = &setup.agent.proc;
    wait_until(Duration::from_secs(5), "the agent to notice", || async {
        agent.log_text().contains("proxy-server stream ended")
    })
    .await;
    let noticed = lines_of(agent)
        .into_iter()
        .find(|l| l.contains("proxy-server stream ended"))
        .unwrap();
    assert!(noticed.starts_with('I'), "{noticed}");
    assert!(
        !agent.log_text().contains("lost proxy-server stream"),
        "{}",
        agent.log_text()
    );

    // The agent stops cleanly (drain, then exit): nothing above info on a server.
    setup.server.restart().await;
    setup.server.wait_backends(1).await;
    let server_lines_before = lines_of(&setup.server.proc).len();
    let agent = &mut setup.agent.proc;
    agent.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.signal("TERM");
    assert!(
        agent.wait_exit(Duration::from_secs(5)).await.is_some(),
        "agent did not exit"
    );
    let server = &setup.server.proc;
    wait_until(
        Duration::from_secs(5),
        "the server to see the agent go",
        || async { server.log_text().contains("agent stream ended") },
    )
    .await;
    for line in &lines_of(server)[server_lines_before..] {
        assert!(line.starts_with('I'), "{line}");
    }
    // Its connection closed; it did not fail the protocol.
    let ended = lines_of(server)
        .into_iter()
        .find(|l| l.contains("agent stream ended"))
        .unwrap();
    assert!(
        ended.contains("reason=\"agent closed the stream\"")
            || ended.contains("the agent's connection closed"),
        "{ended}"
    );
}

/// The value of `key` in a klog line (quoted or bare).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &line[start..];
    match rest.strip_prefix('"') {
        Some(quoted) => quoted.split('"').next(),
        None => rest.split(' ').next(),
    }
}

/// The lines of `proc` with message `msg` and `key` = `value`.
fn lines_with(proc: &Proc, msg: &str, key: &str, value: &str) -> Vec<String> {
    lines_of(proc)
        .into_iter()
        .filter(|line| line.contains(&format!("] \"{msg}\"")) && field(line, key) == Some(value))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tunnel_is_logged_at_v2_on_both_sides_with_the_ids_that_tie_them() {
    use crate::support::connect::via_tls;
    use crate::support::scrape::metric;
    use crate::support::targets;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let verbose = vec!["-v=2".to_owned()];
    // Over TCP: a Unix socket cannot carry the reset of the second tunnel.
    let setup = Setup::with_flags("http-connect", false, &verbose, &verbose).await;
    let target = targets::blob().await;
    let destination = target.addr.to_string();
    let tls = setup.pki.client_tls(Some(&setup.pki.client), &[b"http/1.1"]);
    let port = setup.server.tcp_port();

    // An echo tunnel the client closes: 17 header bytes and 5 more go to
    // the target, 5 come back.
    let mut client = via_tls(port, tls.clone(), &destination).await.unwrap().unwrap();
    targets::start_echo(&mut client).await.unwrap();
    client.write_all(b"hello").await.unwrap();
    let mut echoed = [0u8; 5];
    client.read_exact(&mut echoed).await.unwrap();
    drop(client);
    // A tunnel whose target resets.
    let mut client = via_tls(port, tls.clone(), &destination).await.unwrap().unwrap();
    targets::expect_reset(&mut client, 1000, 7).await;
    drop(client);
    // A dial the agent cannot make.
    let closed_port = crate::support::free_port();
    let refused = via_tls(port, tls, &format!("127.0.0.1:{closed_port}"))
        .await
        .unwrap();
    assert!(refused.is_err());

    let (server, agent) = (&setup.server.proc, &setup.agent.proc);
    wait_until(
        Duration::from_secs(5),
        "both tunnels to be logged closed on both sides",
        || async {
            lines_of(server)
                .iter()
                .filter(|l| l.contains("\"tunnel closed\""))
                .count()
                == 2
                && lines_of(agent)
                    .iter()
                    .filter(|l| l.contains("\"tunnel closed\""))
                    .count()
                    == 2
        },
    )
    .await;

    for (reason_on_server, reason_on_agent, to_target, from_target) in [
        ("client_closed", "server_closed", "22", "5"),
        ("target_error", "target_error", "18", "1000"),
    ] {
        let closed = lines_with(server, "tunnel closed", "reason", reason_on_server);
        let [closed] = closed.as_slice() else {
            panic!("one {reason_on_server} tunnel on the server: {closed:#?}")
        };
        let connect_id = field(closed, "connect_id").unwrap();
        let dial_id = field(closed, "dial_id").unwrap();
        assert_eq!(field(closed, "agent_id"), Some("agent-1"), "{closed}");
        assert_eq!(
            field(closed, "destination"),
            Some(destination.as_str()),
            "{closed}"
        );
        assert_eq!(field(closed, "bytes_to_target"), Some(to_target), "{closed}");
        assert_eq!(field(closed, "bytes_from_target"), Some(from_target), "{closed}");
        assert!(field(closed, "duration").is_some(), "{closed}");
        // Dial and establishment, with the same ids.
        let dialed = lines_with(server, "dial requested", "dial_id", dial_id);
        assert_eq!(dialed.len(), 1, "{dialed:#?}");
        assert_eq!(field(&dialed[0], "client"), Some("apiserver"), "{}", dialed[0]);
        let established = lines_with(server, "tunnel established", "connect_id", connect_id);
        assert!(
            established.iter().any(|l| field(l, "dial_id") == Some(dial_id)),
            "{established:#?}"
        );

        // The agent's side of the same tunnel: same connectID and dial id.
        let on_agent: Vec<String> = lines_with(agent, "tunnel closed", "connect_id", connect_id)
            .into_iter()
            .filter(|l| field(l, "dial_id") == Some(dial_id))
            .collect();
        let [on_agent] = on_agent.as_slice() else {
            panic!(
                "the agent's line for connectID {connect_id}: {:#?}",
                lines_of(agent)
            )
        };
        assert_eq!(field(on_agent, "reason"), Some(reason_on_agent), "{on_agent}");
        assert_eq!(field(on_agent, "bytes_to_target"), Some(to_target), "{on_agent}");
        assert_eq!(
            field(on_agent, "bytes_from_target"),
            Some(from_target),
            "{on_agent}"
        );
        assert!(
            field(on_agent, "server_id").is_some(),
            "the server stream's id: {on_agent}"
        );
        assert_eq!(lines_with(agent, "dial requested", "dial_id", dial_id).len(), 1);
    }

    // And counted, by reason, on both binaries.
    let ended = |reason: &str| format!("tunnels_ended_total{{reason=\"{reason}\"}}");
    let server_port = setup.server.health_port;
    let agent_port = setup.agent.health_port;
    for (port, prefix, reasons) in [
        (
            server_port,
            "konnectivity_network_proxy_server_",
            ["client_closed", "target_error", "dial_failed"],
        ),
        (
            agent_port,
            "konnectivity_network_proxy_agent_",
            ["server_closed", "target_error", "dial_failed"],
        ),
    ] {
        for reason in reasons {
            let series = format!("{prefix}{}", ended(reason));
            assert_eq!(metric(port, &series).await, Some(1.0), "{series}");
        }
    }
}

/// Starts a server with `flags` and returns what it wrote to standard error
/// once it is up (it writes nothing to standard output).
async fn server_stderr(dir: &std::path::Path, flags: &[String]) -> String {
    let pki = crate::support::certs::Pki::new(dir);
    let server = crate::support::procs::Server::start(dir, &pki, "http-connect", true, flags).await;
    server.proc.log_text()
}

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|flag| flag.to_string()).collect()
}

/// klog's destinations as upstream's own manifests use them: kind's
/// (`--log-file` with `--logtostderr=true`: standard error only, no file)
/// and the Kubernetes documentation's (`--logtostderr=false`: the file,
/// and standard error for errors only), `--alsologtostderr`, and
/// `--log-dir`'s file per severity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_go_where_klog_sends_them() {
    let dir = crate::support::TempDir::new("konn-klog");
    let path = |name: &str| dir.path().join(name);
    let started = "\"proxy-server started\"";

    // kind's example manifest: klog ignores the file when logging to stderr.
    let kind_file = path("kind.log");
    let stderr = server_stderr(
        dir.path(),
        &flags(&[
            &format!("--log-file={}", kind_file.display()),
            "--logtostderr=true",
            "--log-file-max-size=0",
        ]),
    )
    .await;
    assert!(stderr.contains(started), "{stderr}");
    assert!(
        !kind_file.exists(),
        "klog writes no --log-file with --logtostderr=true"
    );

    // The Kubernetes documentation's: the file has every line after klog's
    // file header; standard error has none below ERROR.
    let docs_file = path("docs.log");
    let stderr = server_stderr(
        dir.path(),
        &flags(&[
            &format!("--log-file={}", docs_file.display()),
            "--logtostderr=false",
            "--log-file-max-size=0",
        ]),
    )
    .await;
    let file = std::fs::read_to_string(&docs_file).unwrap();
    assert!(file.starts_with("Log file created at: "), "{file}");
    assert!(file.contains(started), "{file}");
    assert!(file.lines().skip(4).all(is_klog_line), "{file}");
    assert!(
        stderr.lines().all(|line| !line.starts_with(['I', 'W'])),
        "below ERROR on standard error:\n{stderr}"
    );

    // --alsologtostderr: both.
    let also_file = path("also.log");
    let stderr = server_stderr(
        dir.path(),
        &flags(&[
            &format!("--log-file={}", also_file.display()),
            "--logtostderr=false",
            "--alsologtostderr",
        ]),
    )
    .await;
    assert!(stderr.contains(started), "{stderr}");
    assert!(std::fs::read_to_string(&also_file).unwrap().contains(started));

    // --log-dir: a file per severity; an inert flag's warning is in the
    // WARNING file and, without --one-output, in the INFO file too.
    for one_output in [false, true] {
        let logs = path(&format!("logs-{one_output}"));
        std::fs::create_dir_all(&logs).unwrap();
        server_stderr(
            dir.path(),
            &flags(&[
                &format!("--log-dir={}", logs.display()),
                "--logtostderr=false",
                "--xfr-channel-size=5",
                &format!("--one-output={one_output}"),
            ]),
        )
        .await;
        let read = |tag: &str| std::fs::read_to_string(logs.join(format!("proxy-server.{tag}")));
        let info = read("INFO").expect("INFO file");
        let warning = read("WARNING").expect("WARNING file");
        assert!(info.contains(started), "{info}");
        let inert_warning = "has no effect in this version\" flag=\"--xfr-channel-size\"";
        assert!(warning.contains(inert_warning), "{warning}");
        assert!(!warning.contains(started), "{warning}");
        assert_eq!(info.contains(inert_warning), !one_output, "{info}");
        assert!(
            read("ERROR").is_err(),
            "an ERROR file with no error: {:?}",
            read("ERROR")
        );
    }
}

/// Kubernetes components log their flags at `-v=1`, not at the default
/// verbosity: there, start-up is one line (version, addresses, threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flags_are_logged_at_v1_and_start_up_is_one_line_at_v0() {
    let dir = crate::support::TempDir::new("konn-klog-v");
    // -v given, so the harness sets no RUST_LOG (which would win).
    let quiet = server_stderr(dir.path(), &flags(&["-v=0"])).await;
    let lines: Vec<&str> = quiet.lines().collect();
    assert!(!quiet.contains("\"FLAG: --"), "{quiet}");
    assert_eq!(lines.len(), 1, "one start-up line at -v=0:\n{quiet}");
    assert!(
        lines[0].contains("\"proxy-server started\" version=\"") && lines[0].contains(" worker_threads="),
        "{quiet}"
    );
    let verbose = server_stderr(dir.path(), &flags(&["-v=1"])).await;
    let flag_lines = verbose
        .lines()
        .filter(|line| line.contains("] \"FLAG: --"))
        .count();
    assert!(flag_lines > 30, "{flag_lines} FLAG lines at -v=1:\n{verbose}");
    // In JSON, klog's verbosity of those lines: 1.
    let json = server_stderr(dir.path(), &flags(&["-v=1", "--logging-format=json"])).await;
    let flag: serde_json::Value = json
        .lines()
        .find(|line| line.contains("FLAG: --"))
        .map(|line| serde_json::from_str(line).unwrap())
        .unwrap_or_else(|| panic!("no FLAG line:\n{json}"));
    assert_eq!(flag["v"], 1, "{flag}");
}

/// The flags that shape text lines: `--skip-headers`, `--add-dir-header`,
/// `--vmodule` (one file's debug lines at -v=0) and `--log-backtrace-at`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn klog_line_flags_shape_the_lines() {
    let dir = crate::support::TempDir::new("konn-klog-lines");
    // The open files limit is logged at debug from klog.rs.
    let debug_line = "\"open files limit\"";

    // -v given, so the harness sets no RUST_LOG (which would win).
    let plain = server_stderr(dir.path(), &flags(&["-v=0"])).await;
    assert!(!plain.contains(debug_line), "{plain}");

    let bare = server_stderr(
        dir.path(),
        &flags(&["-v=0", "--skip-headers", "--vmodule=klog=2"]),
    )
    .await;
    assert!(
        bare.lines()
            .any(|line| line == "\"proxy-server started\"" || line.starts_with("\"proxy-server started\" ")),
        "{bare}"
    );
    assert!(bare.lines().all(|line| line.starts_with('"')), "{bare}");
    assert!(
        bare.contains(debug_line),
        "--vmodule=klog=2 did not raise klog.rs:\n{bare}"
    );

    let with_dir = server_stderr(dir.path(), &flags(&["-v=1", "--add-dir-header"])).await;
    let flag_line = with_dir
        .lines()
        .find(|line| line.contains("\"FLAG: --"))
        .unwrap_or_else(|| panic!("no FLAG line:\n{with_dir}"));
    // `src/klog.rs:NNN]`: the directory, then the line the flags are logged from.
    let at = flag_line
        .split_once(" src/klog.rs:")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(line, _)| line.to_owned())
        .unwrap_or_else(|| panic!("no directory in the header: {flag_line}"));

    let traced = server_stderr(
        dir.path(),
        &flags(&["-v=1", &format!("--log-backtrace-at=klog.rs:{at}")]),
    )
    .await;
    // Each FLAG line is followed by the stack from the logging call out:
    // its first frame is at klog.rs, the next the caller's (main.rs).
    let after_flag: Vec<&str> = traced
        .lines()
        .skip_while(|line| !line.contains("\"FLAG: --"))
        .skip(1)
        .take(4)
        .collect();
    assert!(
        after_flag.len() == 4
            && after_flag[0]
                .trim_start()
                .split_once(": ")
                .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
            && after_flag[1].contains(&format!("src/klog.rs:{at}:"))
            && after_flag[3].contains("src/main.rs:"),
        "no stack from klog.rs:{at} after the FLAG line: {after_flag:#?}\n{traced}"
    );
    assert!(
        !traced.contains("tracing_subscriber"),
        "the logging machinery's frames: {traced}"
    );
}
