//! The scale run: a thousand agent streams into one proxy-server and twenty
//! thousand tunnels across them, as the largest reported installations run.
//! The agents are real proxy-agents (the agent library's `run`, the code the
//! binary runs), many in one process (`konnectivity-bench fleet`), each with
//! a ServiceAccount token of its own that the server reviews against a
//! stand-in kube-apiserver. The server is the release binary.
//!
//! Reported: server memory per agent stream and per tunnel, the dial rate
//! with and without the tunnels open, how long all agents take to connect
//! and to reconnect after the server restarts, and how many TokenReviews
//! each costs (one per distinct token is the goal).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::args::{FleetArgs, ScaleArgs};
use crate::route::Route;
use crate::scenarios;
use crate::stack::{self, Layout, Proc, cpu_ticks, raise_descriptor_limit, scrape};
use crate::token_review::{TOKEN_PREFIX, TokenReviewer};

/// At most this many tunnels' sockets in one fleet or target process.
const SOCKETS_PER_HELPER: usize = 8000;

/// Runs `agents` proxy-agents in this process until killed.
pub async fn fleet(args: FleetArgs) -> anyhow::Result<()> {
    let certs = |name: &str| args.certs.join(name).display().to_string();
    let mut triggers = Vec::with_capacity(args.agents);
    for n in args.first..args.first + args.agents {
        let flags = konnectivity_agent::config::Args::try_parse_from([
            "proxy-agent".to_owned(),
            "--proxy-server-host=127.0.0.1".to_owned(),
            format!("--proxy-server-port={}", args.server_port),
            format!("--ca-cert={}", certs("ca.crt")),
            format!("--agent-id=fleet-{n}"),
            format!(
                "--service-account-token-path={}",
                args.tokens.join(format!("agent-{n}")).display()
            ),
        ])?;
        let mut config = konnectivity_agent::config::Config::from_args(&flags)?;
        // Each agent's health and admin listeners on ports of the kernel's choosing.
        config.health_addr.set_port(0);
        config.admin_addr.set_port(0);
        let (trigger, watcher) = konnectivity_plumbing::lifecycle::channel();
        triggers.push(trigger);
        tokio::spawn(async move {
            if let Err(error) = konnectivity_agent::run_with_drain(config, watcher).await {
                eprintln!("agent fleet-{n}: {error}");
            }
        });
    }
    println!("{} agents started", args.agents);
    std::future::pending::<()>().await;
    Ok(())
}

/// One proxy-server with agent token authentication against `reviewer`.
struct ScaleServer {
    proc: Proc,
    args: Vec<String>,
    health: u16,
    agent_port: u16,
    uds: PathBuf,
}

impl ScaleServer {
    fn start(layout: &Layout, kubeconfig: &std::path::Path) -> anyhow::Result<ScaleServer> {
        let certs = |name: &str| layout.certs.join(name).display().to_string();
        let uds = layout.work.join("scale.socket");
        let (agent_port, health) = (stack::free_port()?, stack::free_port()?);
        let args = vec![
            "--mode=http-connect".to_owned(),
            format!("--uds-name={}", uds.display()),
            "--delete-existing-uds-file".to_owned(),
            "--server-port=0".to_owned(),
            format!("--agent-port={agent_port}"),
            "--agent-bind-address=127.0.0.1".to_owned(),
            format!("--cluster-cert={}", certs("server.crt")),
            format!("--cluster-key={}", certs("server.key")),
            "--agent-namespace=kube-system".to_owned(),
            "--agent-service-account=konnectivity-agent".to_owned(),
            "--authentication-audience=system:konnectivity-server".to_owned(),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--health-port={health}"),
            "--health-bind-address=127.0.0.1".to_owned(),
        ];
        let proc = stack::spawn(
            layout,
            "proxy-server-scale",
            &layout.bin_dir.join("proxy-server"),
            &args,
        )?;
        Ok(ScaleServer {
            proc,
            args,
            health,
            agent_port,
            uds,
        })
    }

    /// Kills the server and starts it again on the same ports and socket.
    fn restart(&mut self, layout: &Layout) -> anyhow::Result<()> {
        self.proc = stack::spawn(
            layout,
            "proxy-server-scale-restarted",
            &layout.bin_dir.join("proxy-server"),
            &self.args,
        )?;
        Ok(())
    }

    /// Agent streams connected now.
    async fn agents(&self) -> Option<f64> {
        let text = scrape(self.health).await.ok()?;
        text.lines()
            .find_map(|line| {
                line.strip_prefix("konnectivity_network_proxy_server_ready_backend_connections ")
            })
            .and_then(|value| value.trim().parse().ok())
    }

    /// Waits until `count` agent streams are connected; returns how long it took.
    async fn wait_agents(&self, count: usize, limit: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let mut last = None;
        while started.elapsed() < limit {
            last = self.agents().await;
            if last == Some(count as f64) {
                return Ok(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bail!("{count} agents not connected within {limit:?} (last seen: {last:?})")
    }
}

/// Dials (open + close through the tunnel, 16 at a time): the rate, and
/// the server's CPU time per dial.
async fn dial_rate(
    server: &ScaleServer,
    route: &Route,
    targets: &crate::targets::Targets,
    dials: usize,
) -> anyhow::Result<(f64, f64)> {
    let before = cpu_ticks(&server.proc)?;
    let (rate, _) = scenarios::setups(route, targets, dials, 16).await?;
    let used = (cpu_ticks(&server.proc)? - before) as f64 / 100.0;
    Ok((rate, used * 1e6 / dials as f64))
}

/// The share of one CPU `proc` used over `window`.
async fn cpu_share(proc: &Proc, window: Duration) -> anyhow::Result<f64> {
    let (before, started) = (cpu_ticks(proc)?, Instant::now());
    tokio::time::sleep(window).await;
    let used = (cpu_ticks(proc)? - before) as f64 / 100.0;
    Ok(used / started.elapsed().as_secs_f64())
}

/// Settles, then the server's resident memory.
async fn settled_memory(server: &ScaleServer) -> anyhow::Result<u64> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.proc.resident_bytes()
}

pub async fn scale(mut args: ScaleArgs) -> anyhow::Result<()> {
    // The server holds a socket per tunnel and per agent stream.
    let margin = 1000;
    let limit = raise_descriptor_limit((args.tunnels + args.agents + margin) as u64)? as usize;
    if args.tunnels + args.agents + margin > limit {
        let fits = limit.saturating_sub(args.agents + margin);
        eprintln!(
            "note: open files are capped at {limit} per process here and cannot be raised \
             (no CAP_SYS_RESOURCE): {fits} tunnels instead of {}",
            args.tunnels
        );
        args.tunnels = fits;
    }
    std::fs::create_dir_all(&args.layout.work)?;
    let layout = args.layout.layout();
    // Agents and targets hold a socket per tunnel too: spread over processes.
    let helpers = args.tunnels.div_ceil(SOCKETS_PER_HELPER).max(1);
    let mut target_procs = Vec::new();
    let mut echoes = Vec::new();
    for _ in 0..helpers {
        let (proc, targets) = stack::start_targets(&layout)?;
        target_procs.push(proc);
        echoes.push(targets);
    }
    let targets = echoes[0];
    let reviewer = TokenReviewer::start(&layout.certs).await?;
    let kubeconfig = reviewer.kubeconfig(&layout.work, &layout.certs)?;
    let tokens = layout.work.join("tokens");
    std::fs::create_dir_all(&tokens)?;
    for n in 0..args.agents {
        std::fs::write(tokens.join(format!("agent-{n}")), format!("{TOKEN_PREFIX}{n}\n"))?;
    }

    let mut server = ScaleServer::start(&layout, &kubeconfig)?;
    server.wait_agents(0, Duration::from_secs(20)).await?;
    let bare = settled_memory(&server).await?;

    eprintln!("== {} agents in {helpers} processes", args.agents);
    let mut fleets = Vec::new();
    let per_fleet = args.agents.div_ceil(helpers);
    for first in (0..args.agents).step_by(per_fleet) {
        fleets.push(stack::spawn(
            &layout,
            &format!("fleet-{first}"),
            &std::env::current_exe()?,
            &[
                "fleet".to_owned(),
                format!("--first={first}"),
                format!("--agents={}", per_fleet.min(args.agents - first)),
                format!("--server-port={}", server.agent_port),
                format!("--certs={}", layout.certs.display()),
                format!("--tokens={}", tokens.display()),
            ],
        )?);
    }
    let connected_in = server.wait_agents(args.agents, Duration::from_secs(180)).await?;
    let (first_reviews, first_tokens) = reviewer.reviews();
    let with_agents = settled_memory(&server).await?;
    // What holding the agents costs while nothing is tunneled (keepalives,
    // our agents' probes of their servers).
    let idle_cpu = cpu_share(&server.proc, Duration::from_secs(5)).await?;
    let fleet_cpu = {
        let mut total = 0.0;
        for fleet in &fleets {
            total += cpu_share(fleet, Duration::from_secs(1)).await?;
        }
        total
    };
    let route = Route::HttpConnect {
        uds: server.uds.clone(),
    };
    let (idle_rate, idle_dial_cpu) = dial_rate(&server, &route, &targets, args.dials).await?;

    eprintln!("== {} tunnels", args.tunnels);
    let opening = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut held = scenarios::concurrently(args.tunnels, 64, || {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (route, echo) = (route.clone(), echoes[n % echoes.len()].echo);
        async move { route.open(echo).await }
    })
    .await?;
    let open_rate = args.tunnels as f64 / opening.elapsed().as_secs_f64();
    // Every tenth proves its tunnel carries bytes end to end.
    for conn in held.iter_mut().step_by(10) {
        conn.write_all(b"x").await?;
        let mut byte = [0u8; 1];
        conn.read_exact(&mut byte).await?;
    }
    let with_tunnels = settled_memory(&server).await?;
    let (loaded_rate, loaded_dial_cpu) = dial_rate(&server, &route, &targets, args.dials).await?;
    drop(held);

    eprintln!("== restart");
    server.proc.kill_now();
    let restarted = Instant::now();
    server.restart(&layout)?;
    let reconnected_in = server.wait_agents(args.agents, Duration::from_secs(300)).await?;
    let all_back = restarted.elapsed();
    let (reviews, distinct) = reviewer.reviews();

    let kib = |bytes: f64| bytes / 1024.0;
    println!(
        "| scale figure ({} agents, {} tunnels) | value |",
        args.agents, args.tunnels
    );
    println!("|---|---:|");
    println!(
        "| server memory per agent stream | {:.1} KiB |",
        kib(with_agents.saturating_sub(bare) as f64 / args.agents as f64)
    );
    println!(
        "| server memory per idle tunnel | {:.1} KiB |",
        kib(with_tunnels.saturating_sub(with_agents) as f64 / args.tunnels as f64)
    );
    println!(
        "| server resident: bare / with agents / with tunnels | {:.0} / {:.0} / {:.0} MiB |",
        kib(kib(bare as f64)),
        kib(kib(with_agents as f64)),
        kib(kib(with_tunnels as f64))
    );
    println!(
        "| CPU while idle with the agents: server / agents' processes | {:.0}% / {:.0}% of a CPU |",
        idle_cpu * 100.0,
        fleet_cpu * 100.0
    );
    println!(
        "| all agents connected after start | {:.2} s |",
        connected_in.as_secs_f64()
    );
    println!(
        "| TokenReviews for the first connections (distinct tokens) | {first_reviews} ({first_tokens}) |"
    );
    println!("| tunnels opened, 64 at a time | {open_rate:.0} /s |");
    println!(
        "| dial + close, 16 at a time, agents only | {idle_rate:.0} /s (server CPU {idle_dial_cpu:.0} µs per dial) |"
    );
    println!(
        "| dial + close, 16 at a time, beside {} open tunnels | {loaded_rate:.0} /s (server CPU {loaded_dial_cpu:.0} µs per dial) |",
        args.tunnels
    );
    println!(
        "| all agents reconnected after a server restart | {:.2} s (from the restart: {:.2} s) |",
        reconnected_in.as_secs_f64(),
        all_back.as_secs_f64()
    );
    println!(
        "| TokenReviews for the reconnect (distinct tokens) | {} ({}) |",
        reviews - first_reviews,
        distinct
    );
    Ok(())
}
