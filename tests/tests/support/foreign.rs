//! Software that is not ours, to show compatibility with what users run:
//! Python's grpcio (gRPC core, the C implementation), grpc-go, the library
//! kube-apiserver's egress is built on, and Go's Prometheus text parser.
//! hack/test.sh installs them (grpcio from PyPI into its virtual
//! environment, the Go libraries as Debian's -dev packages); without them a
//! test is skipped, except under CI, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root.
pub fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn missing(what: &str) -> Option<PathBuf> {
    assert!(
        std::env::var_os("CI").is_none(),
        "{what} is needed and CI is set (hack/test.sh installs it)"
    );
    eprintln!("skipping: {what} not found (hack/test.sh installs it)");
    None
}

/// A `python3` that can import grpcio and grpcio-tools, if there is one.
pub fn python_with_grpcio() -> Option<PathBuf> {
    let found = Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .output()
        .is_ok_and(|output| output.status.success());
    if found {
        Some(PathBuf::from("python3"))
    } else {
        missing("python3 with grpcio and grpcio-tools")
    }
}

/// tests/go/kas_client.go: a gRPC client on grpc-go, as kube-apiserver's.
pub fn grpc_go_client() -> Option<PathBuf> {
    go_program("kas_client", "google.golang.org/grpc")
}

/// tests/go/agent_server.go: an AgentService server on grpc-go with the
/// keepalive enforcement upstream's proxy-server sets on its agent listener.
pub fn grpc_go_agent_server() -> Option<PathBuf> {
    go_program("agent_server", "google.golang.org/grpc")
}

/// Debian's Go toolchain, for `go tool pprof`.
pub fn go_toolchain() -> Option<PathBuf> {
    match Command::new("go").arg("version").output() {
        Ok(output) if output.status.success() => Some(PathBuf::from("go")),
        _ => missing("go (Debian's golang-go)"),
    }
}

/// tests/go/metric_families.go: Go's Prometheus text parser (expfmt).
pub fn go_metric_parser() -> Option<PathBuf> {
    go_program("metric_families", "github.com/prometheus/common/expfmt")
}

/// tests/go/NAME.go built with Debian's Go and the Go libraries Debian
/// packages (GOPATH mode: the sources are under /usr/share/gocode, nothing
/// is downloaded), once per test process. `needs` is the package it imports
/// that only Debian's -dev package provides.
fn go_program(name: &'static str, needs: &str) -> Option<PathBuf> {
    static BUILT: std::sync::Mutex<Vec<(&'static str, Option<PathBuf>)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, binary)) = built.iter().find(|(built_name, _)| *built_name == name) {
        return binary.clone();
    }
    let gopath = Path::new("/usr/share/gocode");
    let binary =
        if Command::new("go").arg("version").output().is_err() || !gopath.join("src").join(needs).is_dir() {
            missing(&format!("go with Debian's package of {needs}"))
        } else {
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go");
            let binary = out.join(name);
            let output = Command::new("go")
                .arg("build")
                .arg("-o")
                .arg(&binary)
                .arg(repo().join(format!("tests/go/{name}.go")))
                .env("GO111MODULE", "off")
                .env("GOPATH", gopath)
                .env("GOCACHE", out.join("cache"))
                .env("GOFLAGS", "")
                .output()
                .expect("run go build");
            assert!(
                output.status.success(),
                "go build tests/go/{name}.go:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
            Some(binary)
        };
    built.push((name, binary.clone()));
    binary
}

/// Runs a client to completion and returns its output, failing the test
/// with everything it printed when it did not succeed or did not print
/// `success_line`.
pub async fn run_client(mut command: tokio::process::Command, success_line: &str) -> String {
    let output = command.output().await.expect("start the client");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains(success_line),
        "{command:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}
