//! Network namespaces as test hosts. Each is uniquely named, holds only what
//! its test put there, and is deleted on drop (also when the test panics).
//! Nothing is ever added to the machine's own namespace.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use super::image::Binaries;
use super::procs::Proc;

/// Whether this process runs as root (uid 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|uid| uid == "0"))
        })
        .unwrap_or(false)
}

/// Root tests fail under CI when not root, and skip with a message otherwise.
pub fn root_or_skip(test: &str) -> bool {
    if is_root() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{test} needs root (network namespaces, nftables) and CI is set"
    );
    eprintln!("skipping {test}: needs root for network namespaces and nftables");
    false
}

/// Kills every TCP connection to `port` on loopback (`ss -K`: the socket
/// destroyed under the process, as a reset or a load balancer's cut does):
/// the connections of the one server a test started there. Needs root.
/// Returns how many were killed.
pub fn kill_connections_to(port: u16) -> usize {
    let output = std::process::Command::new("ss")
        .args([
            "-K",
            "-t",
            "-n",
            "dst",
            "127.0.0.1",
            "dport",
            "=",
            &format!(":{port}"),
        ])
        .output()
        .expect("ss runs");
    assert!(
        output.status.success(),
        "ss -K: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // One line per killed socket after the header.
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip(1)
        .filter(|line| !line.trim().is_empty())
        .count()
}

fn run(command: &mut Command) -> Output {
    let output = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

pub struct Netns {
    pub name: String,
}

impl Netns {
    /// A namespace whose loopback device is up, as a host's is.
    pub fn new(role: &str) -> Netns {
        let netns = Netns::bare(role);
        netns.ip(&["link", "set", "lo", "up"]);
        netns
    }

    /// A namespace as the kernel makes it, loopback down: a pod's, before
    /// anything but its runtime and CNI plugins touched it.
    pub fn bare(role: &str) -> Netns {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "konn-{}-{}-{role}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        run(Command::new("ip").args(["netns", "add", &name]));
        Netns { name }
    }

    /// `ip ARGS` inside the namespace.
    pub fn ip(&self, args: &[&str]) {
        run(Command::new("ip").args(["-n", &self.name]).args(args));
    }

    /// A command that runs inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name, program]);
        command
    }

    /// Runs a shell command inside the namespace; its output, whatever the status.
    pub fn sh(&self, script: &str) -> Output {
        self.command("sh").args(["-c", script]).output().unwrap()
    }

    /// Starts one of the workspace's binaries inside the namespace.
    pub fn spawn(&self, binary: &str, args: &[String], log_dir: &Path) -> Proc {
        self.spawn_from(&Binaries::Build, binary, args, log_dir)
    }

    /// Starts one of the workspace's binaries, from this build or the
    /// image, inside the namespace.
    pub fn spawn_from(&self, binaries: &Binaries, binary: &str, args: &[String], log_dir: &Path) -> Proc {
        let mut full = vec!["netns".to_owned(), "exec".to_owned(), self.name.clone()];
        full.extend(binaries.command_line(binary, args));
        Proc::spawn_named(binary, "ip", &full, log_dir)
    }

    /// Starts a program from PATH inside the namespace.
    pub fn spawn_program(&self, program: &str, args: &[String], log_dir: &Path) -> Proc {
        let mut full = vec![
            "netns".to_owned(),
            "exec".to_owned(),
            self.name.clone(),
            program.to_owned(),
        ];
        full.extend(args.iter().cloned());
        Proc::spawn_named(program, "ip", &full, log_dir)
    }

    /// Where the namespace is pinned.
    pub fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    /// A TCP listener inside the namespace, for a target this test process
    /// serves itself: bound from a short-lived thread that entered the
    /// namespace (a socket stays in the namespace it was made in).
    pub fn bind_tcp(&self, addr: &str) -> std::net::TcpListener {
        let path = format!("/var/run/netns/{}", self.name);
        let addr = addr.to_owned();
        std::thread::spawn(move || {
            let netns = std::fs::File::open(&path).unwrap();
            nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let listener = std::net::TcpListener::bind(&addr).unwrap();
            listener.set_nonblocking(true).unwrap();
            listener
        })
        .join()
        .unwrap()
    }

    /// A TCP connection from inside the namespace, as a process there makes
    /// it (its address captured by the namespace's rules like theirs):
    /// connected from a short-lived thread that entered the namespace.
    pub fn connect_tcp(&self, addr: &str) -> std::io::Result<tokio::net::TcpStream> {
        connect_tcp_in(Path::new("/var/run/netns").join(&self.name), addr)
    }

    /// GET http://127.0.0.1:PORT/PATH from inside the namespace: status and body.
    pub fn http_get(&self, port: u16, path: &str) -> (u16, String) {
        let output = self
            .command("curl")
            .args(["-s", "--max-time", "5", "-w", "\n%{http_code}"])
            .arg(format!("http://127.0.0.1:{port}{path}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (status.trim().parse().unwrap_or(0), body.to_owned())
    }

    /// One sample from `/metrics` on PORT inside the namespace.
    pub fn metric(&self, port: u16, series: &str) -> Option<f64> {
        let (_, body) = self.http_get(port, "/metrics");
        super::scrape::sample(&body, series)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace also removes its veth ends and rules.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Joins two namespaces with a veth pair and gives each end an address.
/// [`Netns::connect_tcp`] from the namespace at `netns` (a pin, a pod's).
pub fn connect_tcp_in(netns: std::path::PathBuf, addr: &str) -> std::io::Result<tokio::net::TcpStream> {
    let addr = addr.to_owned();
    let connected = std::thread::spawn(move || {
        let netns = std::fs::File::open(&netns)?;
        nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
        let stream = std::net::TcpStream::connect(&addr)?;
        stream.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(stream)
    })
    .join()
    .unwrap()?;
    tokio::net::TcpStream::from_std(connected)
}

pub fn link(a: &Netns, a_addr: &str, b: &Netns, b_addr: &str) {
    run(Command::new("ip").args([
        "link", "add", "veth0", "netns", &a.name, "type", "veth", "peer", "name", "veth0", "netns", &b.name,
    ]));
    for (netns, addr) in [(a, a_addr), (b, b_addr)] {
        netns.ip(&["addr", "add", addr, "dev", "veth0"]);
        netns.ip(&["link", "set", "veth0", "up"]);
    }
}
