//! Clients that are not ours, to show compatibility with what users run:
//! Python's grpcio (gRPC core, the C implementation) and grpc-go, the
//! library kube-apiserver's egress is built on. hack/test.sh installs both
//! (grpcio from PyPI into its virtual environment, grpc-go as Debian's
//! golang-google-grpc-dev); without them a test is skipped, except under CI,
//! where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

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

/// tests/go/kas_client.go built with Debian's Go and grpc-go (GOPATH mode:
/// Debian ships the sources under /usr/share/gocode, no module download),
/// once per test process.
pub fn grpc_go_client() -> Option<PathBuf> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let gopath = Path::new("/usr/share/gocode");
            if Command::new("go").arg("version").output().is_err()
                || !gopath.join("src/google.golang.org/grpc").is_dir()
            {
                return missing("go with Debian's golang-google-grpc-dev");
            }
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go");
            let binary = out.join("kas_client");
            let output = Command::new("go")
                .arg("build")
                .arg("-o")
                .arg(&binary)
                .arg(repo().join("tests/go/kas_client.go"))
                .env("GO111MODULE", "off")
                .env("GOPATH", gopath)
                .env("GOCACHE", out.join("cache"))
                .env("GOFLAGS", "")
                .output()
                .expect("run go build");
            assert!(
                output.status.success(),
                "go build tests/go/kas_client.go:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
            Some(binary)
        })
        .clone()
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
