//! The real `proxy-server` and `proxy-agent` binaries as child processes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::certs::{CertFiles, Pki};
use super::image::Binaries;
use super::scrape::http_get;
use super::{free_port, wait_until};

/// A child process killed (SIGKILL) and reaped when dropped. Its output goes
/// to a log file that failing tests print.
pub struct Proc {
    child: Child,
    pub name: String,
    pub log: PathBuf,
    /// Set once the child has been waited for: its process ID, which is also
    /// its group's, may then belong to another process.
    reaped: bool,
}

impl Proc {
    /// Spawns one of the workspace's binaries.
    pub fn spawn(binary: &str, args: &[String], log_dir: &Path) -> Proc {
        Self::spawn_from(&Binaries::Build, binary, args, log_dir)
    }

    /// Spawns one of the workspace's binaries from this build or the image.
    pub fn spawn_from(binaries: &Binaries, binary: &str, args: &[String], log_dir: &Path) -> Proc {
        let line = binaries.command_line(binary, args);
        Self::spawn_path(binary, Path::new(&line[0]), &line[1..], log_dir)
    }

    /// Spawns a program from PATH (curl, socat, nginx...).
    pub fn spawn_program(program: &str, args: &[String], log_dir: &Path) -> Proc {
        Self::spawn_path(program, Path::new(program), args, log_dir)
    }

    /// Spawns `program` (e.g. `ip netns exec ...`) under the name `name`.
    pub fn spawn_named(name: &str, program: &str, args: &[String], log_dir: &Path) -> Proc {
        Self::spawn_path(name, Path::new(program), args, log_dir)
    }

    fn spawn_path(binary: &str, path: &Path, args: &[String], log_dir: &Path) -> Proc {
        static SPAWNED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = log_dir.join(format!("{binary}-{n}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(path);
        // Debug logs for failing tests to show, unless the test chose a
        // verbosity itself (-v), which RUST_LOG would override.
        if !args
            .iter()
            .any(|arg| arg.starts_with("-v=") || arg.starts_with("--v="))
        {
            command.env("RUST_LOG", "debug,h2=info,hyper=info,tower=info,rustls=info");
        } else {
            command.env_remove("RUST_LOG");
        }
        // A process group of its own, so that what the program forks (nginx's
        // workers, a shell's children) goes with it: see `kill`.
        use std::os::unix::process::CommandExt;
        command.process_group(0);
        let child = command
            .args(args)
            // mimalloc returns freed pages only on later activity on the same
            // thread, so an idle process's resident memory says little about
            // leaks. Returning them at once makes it comparable: what stays
            // resident is then what is still allocated.
            .env("MIMALLOC_PURGE_DELAY", "0")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {binary}: {e}"));
        Proc {
            child,
            name: binary.to_owned(),
            log,
            reaped: false,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would, to the process and everything it forked
    /// that stayed in its process group: nginx's master dies without
    /// stopping its workers, which would go on running, holding their
    /// sockets and log files, in a network namespace already deleted.
    /// Only while the child is not reaped: until then (running or a
    /// zombie) its ID cannot be another process's.
    pub fn kill(&mut self) {
        if !self.reaped {
            let group = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.reaped = true;
        }
    }

    /// The child's exit status if it has exited, without reaping it (so
    /// that `kill` can still reach its group).
    fn exited(&self) -> std::io::Result<Option<nix::sys::wait::WaitStatus>> {
        use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
        if self.reaped {
            return Ok(None);
        }
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        match waitid(Id::Pid(nix::unistd::Pid::from_raw(self.child.id() as i32)), flags)? {
            WaitStatus::StillAlive => Ok(None),
            status => Ok(Some(status)),
        }
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit by itself, up to `limit`.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if self.exited().unwrap().is_some() {
                // Its group goes too, as with `kill`.
                let group = nix::unistd::Pid::from_raw(self.child.id() as i32);
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
                let status = self.child.wait().unwrap();
                self.reaped = true;
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A process that died on its own (a crash) is the first thing to
        // know when a test fails: it leaves no log line behind.
        let exited = self.exited();
        self.kill();
        if std::thread::panicking() {
            let status = match exited {
                Ok(Some(status)) => format!("had exited by itself: {status:?}"),
                Ok(None) => "was running".to_owned(),
                Err(error) => format!("state unknown: {error}"),
            };
            eprintln!(
                "---- {} log ({}; {status}) ----\n{}",
                self.name,
                self.log.display(),
                self.log_text()
            );
        }
    }
}

/// How the server's frontend listens.
pub enum Frontend {
    /// TCP with mTLS on this port.
    Tcp(u16),
    /// A Unix socket at this path.
    Uds(PathBuf),
}

pub struct Server {
    pub proc: Proc,
    pub frontend: Frontend,
    pub agent_port: u16,
    pub health_port: u16,
    /// `--admin-port`: /metrics, and /debug/pprof/ with --enable-profiling.
    pub admin_port: u16,
    /// What it was started with, to start it again.
    binaries: Binaries,
    args: Vec<String>,
    dir: std::path::PathBuf,
}

impl Server {
    /// Starts proxy-server in `mode` with a TCP (mTLS) or UDS frontend and
    /// agent mTLS; `extra` flags are appended.
    pub async fn start(dir: &Path, pki: &Pki, mode: &str, uds: bool, extra: &[String]) -> Server {
        Server::start_from(&Binaries::Build, dir, pki, mode, uds, extra).await
    }

    /// [`Server::start`] with the binary from this build or the image.
    pub async fn start_from(
        binaries: &Binaries,
        dir: &Path,
        pki: &Pki,
        mode: &str,
        uds: bool,
        extra: &[String],
    ) -> Server {
        let agent_port = free_port();
        let health_port = free_port();
        let admin_port = free_port();
        let mut args = vec![
            format!("--mode={mode}"),
            format!("--agent-port={agent_port}"),
            format!("--health-port={health_port}"),
            format!("--admin-port={admin_port}"),
            format!("--cluster-cert={}", pki.server.cert.display()),
            format!("--cluster-key={}", pki.server.key.display()),
            format!("--cluster-ca-cert={}", pki.ca.display()),
            "--agent-bind-address=127.0.0.1".to_owned(),
            "--health-bind-address=127.0.0.1".to_owned(),
        ];
        let frontend = if uds {
            let path = dir.join(format!("frontend-{agent_port}.sock"));
            args.push(format!("--uds-name={}", path.display()));
            args.push("--server-port=0".to_owned());
            Frontend::Uds(path)
        } else {
            let port = free_port();
            args.extend([
                format!("--server-port={port}"),
                "--server-bind-address=127.0.0.1".to_owned(),
                format!("--server-cert={}", pki.server.cert.display()),
                format!("--server-key={}", pki.server.key.display()),
                format!("--server-ca-cert={}", pki.ca.display()),
            ]);
            Frontend::Tcp(port)
        };
        args.extend(extra.iter().cloned());
        let proc = Proc::spawn_from(binaries, "proxy-server", &args, dir);
        wait_healthy(health_port).await;
        Server {
            proc,
            frontend,
            agent_port,
            health_port,
            admin_port,
            binaries: binaries.clone(),
            args,
            dir: dir.to_owned(),
        }
    }

    /// Starts the server again on the same ports and socket after it died
    /// (a stale socket file is replaced, as --delete-existing-uds-file does).
    pub async fn restart(&mut self) {
        self.proc.kill();
        let mut args = self.args.clone();
        args.push("--delete-existing-uds-file".to_owned());
        self.proc = Proc::spawn_from(&self.binaries, "proxy-server", &args, &self.dir);
        wait_healthy(self.health_port).await;
    }

    pub fn tcp_port(&self) -> u16 {
        match self.frontend {
            Frontend::Tcp(port) => port,
            Frontend::Uds(_) => panic!("server has a UDS frontend"),
        }
    }

    pub fn uds_path(&self) -> &Path {
        match &self.frontend {
            Frontend::Uds(path) => path,
            Frontend::Tcp(_) => panic!("server has a TCP frontend"),
        }
    }

    /// Waits until `count` agent streams are connected.
    pub async fn wait_backends(&self, count: u32) {
        let port = self.health_port;
        wait_until(Duration::from_secs(15), "agents to connect", || async move {
            super::scrape::metric(
                port,
                "konnectivity_network_proxy_server_ready_backend_connections",
            )
            .await
                == Some(f64::from(count))
        })
        .await;
    }
}

async fn wait_healthy(health_port: u16) {
    wait_until(Duration::from_secs(10), "proxy-server /healthz", || async {
        http_get(health_port, "/healthz")
            .await
            .is_ok_and(|(status, _)| status == 200)
    })
    .await;
}

pub struct Agent {
    pub proc: Proc,
    pub health_port: u16,
}

/// The flags every test's proxy-agent starts with: dialing `server`
/// (`host:port`) with mTLS as `identity` under the test CA, named `id`, its
/// health on `health_port`, reconnecting quickly.
pub fn agent_args(
    server: (&str, u16),
    pki: &Pki,
    identity: &CertFiles,
    id: &str,
    health_port: u16,
) -> Vec<String> {
    let (host, port) = server;
    vec![
        format!("--proxy-server-host={host}"),
        format!("--proxy-server-port={port}"),
        format!("--ca-cert={}", pki.ca.display()),
        format!("--agent-cert={}", identity.cert.display()),
        format!("--agent-key={}", identity.key.display()),
        format!("--agent-id={id}"),
        format!("--health-server-port={health_port}"),
        "--sync-interval=100ms".to_owned(),
        "--sync-interval-cap=500ms".to_owned(),
    ]
}

impl Agent {
    /// Starts proxy-agent against a server's agent port, with mTLS.
    pub fn start(dir: &Path, pki: &Pki, server_agent_port: u16, id: &str, extra: &[String]) -> Agent {
        Agent::start_from(&Binaries::Build, dir, pki, server_agent_port, id, extra)
    }

    /// [`Agent::start`] with the binary from this build or the image.
    pub fn start_from(
        binaries: &Binaries,
        dir: &Path,
        pki: &Pki,
        server_agent_port: u16,
        id: &str,
        extra: &[String],
    ) -> Agent {
        let health_port = free_port();
        let server = ("127.0.0.1", server_agent_port);
        let mut args = agent_args(server, pki, &pki.agent, id, health_port);
        args.push("--health-server-host=127.0.0.1".to_owned());
        args.push(format!("--admin-server-port={}", free_port()));
        args.extend(extra.iter().cloned());
        Agent {
            proc: Proc::spawn_from(binaries, "proxy-agent", &args, dir),
            health_port,
        }
    }
}
