//! `--enable-profiling`: `/debug/pprof/` on the admin port, read by `go
//! tool pprof` as upstream's is. Run from the image when it is exported
//! (always under CI), so that the image's binaries are shown to keep the
//! symbols a profile needs.

use std::time::Duration;

use crate::support::TempDir;
use crate::support::certs::Pki;
use crate::support::foreign::go_toolchain;
use crate::support::image::Binaries;
use crate::support::procs::Server;
use crate::support::scrape::{http_get, metric};

const HEAP: &str = "konnectivity_network_proxy_server_runtime_heap_bytes";

/// Keeps the server's CPU busy answering /metrics until `stop` is set.
fn scrape_until(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u32> {
    tokio::spawn(async move {
        let mut scrapes = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if http_get(port, "/metrics").await.is_ok() {
                scrapes += 1;
            }
        }
        scrapes
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_tool_pprof_reads_a_cpu_profile_of_a_busy_server_with_its_function_names() {
    let Some(go) = go_toolchain() else {
        return;
    };
    let binaries = Binaries::image_or_build();
    let dir = TempDir::new("konn-pprof");
    let pki = Pki::new(dir.path());
    let server = Server::start_from(
        &binaries,
        dir.path(),
        &pki,
        "http-connect",
        true,
        &["--enable-profiling".to_owned()],
    )
    .await;
    let admin = server.admin_port;

    // Bad input is refused with a reason; Go's index and command line
    // are there.
    let (status, body) = http_get(admin, "/debug/pprof/profile?seconds=ten").await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (400, "seconds: want a whole number from 1 to 86400, got \"ten\"\n")
    );
    let (status, index) = http_get(admin, "/debug/pprof/").await.unwrap();
    assert_eq!(status, 200);
    assert!(index.contains("href=\"profile\""), "{index}");
    let (status, cmdline) = http_get(admin, "/debug/pprof/cmdline").await.unwrap();
    assert_eq!(status, 200);
    assert!(cmdline.contains("\0--enable-profiling"), "{cmdline:?}");
    let heap_before = metric(server.health_port, HEAP).await.expect("heap gauge");

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = scrape_until(server.health_port, stop.clone());
    let pprof_home = dir.path().join("pprof-home");
    std::fs::create_dir_all(&pprof_home).unwrap();
    let url = format!("http://127.0.0.1:{admin}/debug/pprof/profile");
    let pprof = tokio::process::Command::new(&go)
        .args(["tool", "pprof", "-traces", "-seconds", "3", &url])
        .env("HOME", &pprof_home)
        .env("PPROF_TMPDIR", &pprof_home)
        .output();
    // A second profile while the first runs is refused, as Go refuses it.
    let second = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        http_get(admin, "/debug/pprof/profile?seconds=1").await.unwrap()
    };
    let (pprof, (second_status, second_body)) = tokio::join!(pprof, second);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let scrapes = load.await.unwrap();
    let pprof = pprof.expect("run go tool pprof");
    let traces = String::from_utf8_lossy(&pprof.stdout);
    let stderr = String::from_utf8_lossy(&pprof.stderr);
    assert!(
        pprof.status.success(),
        "go tool pprof failed:\n{stderr}\n{traces}"
    );
    assert_eq!(second_status, 500, "{second_body}");
    assert!(
        second_body.contains("cpu profiling already in use"),
        "{second_body}"
    );

    // pprof found a CPU profile of this binary, with samples whose stacks
    // name the server's own code: the request handling the scrapes drove.
    assert!(traces.contains("Type: cpu"), "{traces}");
    assert!(traces.contains("File: proxy-server"), "{traces}");
    let samples = traces.matches("-----------+").count();
    assert!(samples > 5, "{samples} stacks over {scrapes} scrapes:\n{traces}");
    assert!(
        traces.contains("konnectivity_telemetry::"),
        "no frame of the server's code over {scrapes} scrapes:\n{traces}"
    );
    // Nothing the profile needed (symbol tables, samples) stays behind.
    let heap_after = metric(server.health_port, HEAP).await.expect("heap gauge");
    assert!(
        heap_after < heap_before + 1_048_576.0,
        "heap {heap_before} bytes before the profile, {heap_after} after"
    );

    // The agent serves the same on its admin port (a flag given twice
    // takes the last value, as with pflag).
    let agent_admin = crate::support::free_port();
    let _agent = crate::support::procs::Agent::start_from(
        &binaries,
        dir.path(),
        &pki,
        server.agent_port,
        "profiled-agent",
        &[
            format!("--admin-server-port={agent_admin}"),
            "--enable-profiling".to_owned(),
        ],
    );
    server.wait_backends(1).await;
    let (status, cmdline) = http_get(agent_admin, "/debug/pprof/cmdline").await.unwrap();
    assert_eq!(status, 200);
    assert!(cmdline.contains("proxy-agent\0"), "{cmdline:?}");
    // The profile is binary (protobuf): read it as bytes.
    let profile = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", agent_admin))
            .await
            .unwrap();
        stream
            .write_all(b"GET /debug/pprof/profile?seconds=1 HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        response
    };
    assert!(profile.starts_with(b"HTTP/1.0 200") || profile.starts_with(b"HTTP/1.1 200"));
    assert!(
        String::from_utf8_lossy(&profile).contains("application/octet-stream"),
        "{}",
        String::from_utf8_lossy(&profile)
    );
    // The body is gzip-compressed, as Go's net/http/pprof serves it.
    let body_at = profile
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    assert_eq!(profile[body_at..body_at + 2], [0x1f, 0x8b], "a gzip stream");

    // Off by default, as upstream: the admin port has /metrics only.
    let plain = Server::start_from(&binaries, dir.path(), &pki, "http-connect", true, &[]).await;
    let (status, _) = http_get(plain.admin_port, "/debug/pprof/profile?seconds=1")
        .await
        .unwrap();
    assert_eq!(status, 404);
}
