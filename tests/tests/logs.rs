//! Logs as Kubernetes log pipelines read them: klog's text form with no
//! terminal colour codes when written to a pipe or file (as container logs
//! are), one JSON object per line with `--logging-format=json`, and a peer's
//! clean stop logged as the normal event it is, not as a warning.

mod support;

use std::time::Duration;

use support::cluster::Setup;
use support::procs::Proc;
use support::wait_until;

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
        // The effective configuration reads as text, not as byte arrays.
        let config = lines
            .iter()
            .find(|l| l.contains("effective configuration"))
            .unwrap();
        assert!(!config.contains("[104, 50]"), "{config}");
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
}
