//! The processes under test: the target process, and one proxy-server with
//! one proxy-agent per frontend mode, started from the built binaries.

use std::net::SocketAddr;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::targets::Targets;

/// Where the binaries and certificates are.
#[derive(Clone, Debug)]
pub struct Layout {
    pub bin_dir: PathBuf,
    /// From `hack/gen-certs.sh`: ca, server, agent.
    pub certs: PathBuf,
    /// Sockets and logs of this run.
    pub work: PathBuf,
}

/// A child process, killed when dropped, with its process group: the
/// processes a wrapper starts (`--server-wrapper` running perf or heaptrack,
/// with the server under it) end with it.
pub struct Proc {
    child: Child,
    name: String,
    /// Where its stdout and stderr go.
    log: PathBuf,
    /// Its exit was collected: its pid, and so the group's id, may now be
    /// another process's.
    reaped: bool,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory now, from /proc/PID/status (VmRSS), in bytes.
    pub fn resident_bytes(&self) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        let line = status
            .lines()
            .find(|line| line.starts_with("VmRSS:"))
            .with_context(|| format!("{} has no VmRSS line", self.name))?;
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("unreadable VmRSS line {line:?}"))?;
        Ok(kib * 1024)
    }
}

impl Proc {
    /// The last line it logged, for an error that says why it exited.
    fn last_log_line(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let last = text.lines().rev().find(|line| !line.trim().is_empty());
        format!("{} says {:?}", self.log.display(), last.unwrap_or(""))
    }

    /// SIGKILL now, as a crash would, to it and its group, and reap it.
    pub fn kill_now(&mut self) {
        if !self.reaped {
            // Until it is reaped its pid names this group and no other.
            let group = nix::unistd::Pid::from_raw(self.pid() as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }

    /// How it exited, if it has.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.try_wait().ok().flatten()?;
        self.reaped = true;
        Some(status)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Puts the child in a process group of its own, which [`Proc::kill_now`]
/// ends whole.
fn own_group(command: &mut Command) -> &mut Command {
    std::os::unix::process::CommandExt::process_group(command, 0)
}

pub(crate) fn spawn(layout: &Layout, name: &str, program: &Path, args: &[String]) -> anyhow::Result<Proc> {
    let log_path = layout.work.join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path)?;
    let mut command = Command::new(program);
    // A harness killed mid-run (a timeout, ^C) takes its processes along.
    konnectivity_plumbing::sys::die_with_parent(&mut command);
    let child = own_group(&mut command)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    Ok(Proc {
        child,
        name: name.to_owned(),
        log: log_path,
        reaped: false,
    })
}

/// Starts this binary's `targets` subcommand and reads the ports it bound
/// from the one line it prints.
pub fn start_targets(layout: &Layout) -> anyhow::Result<(Proc, Targets)> {
    let (proc, line) = start_helper(layout, "targets", &["targets".to_owned()])?;
    let targets = Targets::from_json(line.trim()).context("the target process did not report its ports")?;
    Ok((proc, targets))
}

/// Starts `konnectivity-bench ARGS` as a process of its own, and reads the
/// one line it prints once it serves.
fn start_helper(layout: &Layout, name: &str, args: &[String]) -> anyhow::Result<(Proc, String)> {
    let log = layout.work.join(format!("{name}.log"));
    let mut command = Command::new(std::env::current_exe()?);
    // As `spawn`'s: a harness killed mid-run takes its helpers along (the
    // targets outlived a SIGTERMed cluster run).
    konnectivity_plumbing::sys::die_with_parent(&mut command);
    let mut child = own_group(&mut command)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("starting the {name} process"))?;
    let stdout = child.stdout.take().context("helper stdout")?;
    let proc = Proc {
        child,
        name: name.to_owned(),
        log,
        reaped: false,
    };
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    Ok((proc, line))
}

/// Two relay processes in a row (see `route::relay`); the first one's address.
pub fn start_relays(layout: &Layout) -> anyhow::Result<(Vec<Proc>, SocketAddr)> {
    let port = |line: String| -> anyhow::Result<SocketAddr> {
        let port: u16 = line.trim().parse().context("a relay did not report its port")?;
        Ok(SocketAddr::from(([127, 0, 0, 1], port)))
    };
    let (second, line) = start_helper(layout, "relay-2", &["relay".to_owned()])?;
    let second_addr = port(line)?;
    let (first, line) = start_helper(
        layout,
        "relay-1",
        &["relay".to_owned(), format!("--next={second_addr}")],
    )?;
    Ok((vec![first, second], port(line)?))
}

/// The null gRPC server (`bench/go/null_server.go`, in the Go gRPC
/// client's binary) on a Unix socket of the run's; ready once the socket
/// exists.
pub async fn start_null_grpc(layout: &Layout, go_grpc_client: &Path) -> anyhow::Result<(Proc, PathBuf)> {
    let uds = layout.work.join("null-grpc.sock");
    let _ = std::fs::remove_file(&uds);
    let server = spawn(
        layout,
        "null-grpc",
        go_grpc_client,
        &[format!("-serve-null-grpc={}", uds.display())],
    )?;
    for _ in 0..200 {
        if uds.exists() {
            return Ok((server, uds));
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    bail!(
        "the null gRPC server did not listen on {} within 10 s",
        uds.display()
    )
}

/// A port free at the time of asking.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    free_port_on("127.0.0.1")
}

/// A port free on `ip` at the time of asking.
pub(crate) fn free_port_on(ip: &str) -> anyhow::Result<u16> {
    Ok(TcpListener::bind((ip, 0))?.local_addr()?.port())
}

/// `error`, with which of `procs` have exited and the last line each
/// logged: a wait that timed out because a process died says so.
pub(crate) fn with_exits(error: anyhow::Error, procs: &mut [Proc]) -> anyhow::Error {
    let exited: Vec<String> = procs
        .iter_mut()
        .filter_map(|proc| {
            let status = proc.exited()?;
            Some(format!(
                "{} exited ({status}): {}",
                proc.name,
                proc.last_log_line()
            ))
        })
        .collect();
    match exited.is_empty() {
        true => error,
        false => error.context(exited.join("; ")),
    }
}

/// The frontend mode kube-apiserver would use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Grpc,
    HttpConnect,
}

impl Mode {
    pub fn flag(self) -> &'static str {
        match self {
            Mode::Grpc => "grpc",
            Mode::HttpConnect => "http-connect",
        }
    }
}

/// proxy-server (frontend on a Unix socket) and one proxy-agent over mTLS.
pub struct Stack {
    pub mode: Mode,
    pub uds: PathBuf,
    pub server: Proc,
    pub agent: Proc,
}

impl Stack {
    pub async fn start(layout: &Layout, mode: Mode) -> anyhow::Result<Stack> {
        let certs = |name: &str| layout.certs.join(name).display().to_string();
        let uds = layout.work.join(format!("{}.socket", mode.flag()));
        let (agent_port, server_health, agent_health) = (free_port()?, free_port()?, free_port()?);
        let server = spawn(
            layout,
            &format!("proxy-server-{}", mode.flag()),
            &layout.bin_dir.join("proxy-server"),
            &[
                format!("--mode={}", mode.flag()),
                format!("--uds-name={}", uds.display()),
                "--delete-existing-uds-file".into(),
                "--server-port=0".into(),
                format!("--agent-port={agent_port}"),
                "--agent-bind-address=127.0.0.1".into(),
                format!("--cluster-cert={}", certs("server.crt")),
                format!("--cluster-key={}", certs("server.key")),
                format!("--cluster-ca-cert={}", certs("ca.crt")),
                format!("--health-port={server_health}"),
                "--health-bind-address=127.0.0.1".into(),
            ],
        )?;
        // The agent once the server listens: an agent that dialed too early
        // backs off (1 s, growing 1.5× a try), and on a machine still busy
        // closing the previous route's 10,000 connections its next try could
        // come after the readiness wait below has given up.
        wait_listening(server_health, Duration::from_secs(20))
            .await
            .with_context(|| format!("proxy-server ({}) never listened", mode.flag()))?;
        let agent = spawn(
            layout,
            &format!("proxy-agent-{}", mode.flag()),
            &layout.bin_dir.join("proxy-agent"),
            &[
                "--proxy-server-host=127.0.0.1".into(),
                format!("--proxy-server-port={agent_port}"),
                format!("--ca-cert={}", certs("ca.crt")),
                format!("--agent-cert={}", certs("agent.crt")),
                format!("--agent-key={}", certs("agent.key")),
                "--agent-id=bench-agent".into(),
                format!("--health-server-port={agent_health}"),
                "--health-server-host=127.0.0.1".into(),
            ],
        )?;
        wait_ready(server_health, Duration::from_secs(20))
            .await
            .with_context(|| format!("proxy-server ({}) never became ready", mode.flag()))?;
        Ok(Stack {
            mode,
            uds,
            server,
            agent,
        })
    }

    /// Resident memory of server and agent.
    pub fn resident_bytes(&self) -> anyhow::Result<(u64, u64)> {
        Ok((self.server.resident_bytes()?, self.agent.resident_bytes()?))
    }
}

/// Waits until something accepts on `port`.
async fn wait_listening(port: u16, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("nothing listening on port {port} within {limit:?}")
}

/// Polls `/readyz` until it answers 200: the agent is connected.
async fn wait_ready(port: u16, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            let request = "GET /readyz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n";
            let mut response = String::new();
            if stream.write_all(request.as_bytes()).await.is_ok()
                && stream.read_to_string(&mut response).await.is_ok()
                && response.starts_with("HTTP/1.1 200")
            {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("not ready within {limit:?}")
}

/// Every tunnel is a socket in the client, the server, an agent and a
/// target: raises the open-files limit to `needed` if this process may
/// (CAP_SYS_RESOURCE), and returns the limit children will have.
pub fn raise_descriptor_limit(needed: u64) -> anyhow::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if needed > hard && setrlimit(Resource::RLIMIT_NOFILE, needed, needed).is_ok() {
        return Ok(needed);
    }
    Ok(hard)
}

/// User and system CPU time of `proc` so far, in clock ticks (1/100 s).
pub fn cpu_ticks(proc: &Proc) -> anyhow::Result<u64> {
    cpu_ticks_of(proc.pid())
}

/// [`cpu_ticks`] of any process (this one's own, say).
pub fn cpu_ticks_of(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name in parentheses: utime and stime are the 12th
    // and 13th fields.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

/// The Prometheus text a process serves on loopback `port`'s /metrics.
pub async fn scrape(port: u16) -> anyhow::Result<String> {
    scrape_at(SocketAddr::from(([127, 0, 0, 1], port))).await
}

/// [`scrape`] of a listener on another address.
pub async fn scrape_at(addr: SocketAddr) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = "GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response)
}
