//! A fleet of nodes in one process, for the cluster scale run: each node is
//! what the node agent DaemonSet runs on a node, a real egress agent (the
//! agents' client certificate, its own agent id) and the node role's tunnel and
//! capture path ([`konnectivity_node::fleet`]), with its clients' watches
//! through it. Thousands share a process: the run spreads them over several
//! so that no process needs more than its open-files limit.
//!
//! The fleet answers on a control port, one command a line: `open` starts
//! the bulk watches, `stats` answers one JSON line (the nodes whose tunnel
//! answers, the watches up, broken and established, and the event delays
//! since the last `stats`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use konnectivity_node::fleet::FleetNode;
use konnectivity_node::settings::NodeSettings;
use konnectivity_plumbing::tls::{Identity, PemFile};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

use crate::args::NodeFleetArgs;
use crate::pki::ClusterPki;
use crate::watch::{self, WatchStats};

/// Where node N's clients reach the node's capture (what REDIRECT would
/// send them to): an address of its own in 127.0.0.0/8, so that the
/// fleet's 50,000 connections never run short of ports.
fn capture_addr(n: usize) -> SocketAddr {
    let ip = Ipv4Addr::new(
        127,
        10 + (n / 62_500) as u8,
        ((n / 250) % 250) as u8,
        (n % 250 + 1) as u8,
    );
    SocketAddr::new(IpAddr::V4(ip), 6443)
}

/// How often a probe watch gets an event.
const PROBE_INTERVAL: Duration = Duration::from_millis(100);

pub async fn run(args: NodeFleetArgs) -> anyhow::Result<()> {
    // The warnings of this process's agents and node agents, in its log
    // (fleet-N.log), when asked: without them a node in trouble can be
    // seen only from the server's side. Warnings only: 700 nodes' info
    // lines would be the run's largest load after a restart.
    if args.warnings {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let pki = ClusterPki {
        dir: args.pki.clone(),
    };
    // First, while no agent has taken ports of the kernel's choosing.
    let control = TcpListener::bind(("127.0.0.1", 0)).await?;
    let written = args.control_file.with_extension("tmp");
    std::fs::write(&written, control.local_addr()?.port().to_string())?;
    std::fs::rename(&written, &args.control_file)?;
    let pem = |what: &'static str, path: PathBuf| PemFile::new(what, path);
    let mut nodes: Vec<(FleetNode, SocketAddr)> = Vec::with_capacity(args.nodes);
    // Held: the agents run until the process is killed.
    let mut triggers = Vec::with_capacity(args.nodes);
    for n in args.first..args.first + args.nodes {
        triggers.push(start_agent(&args, &pki, n)?);
        let node_pair = pki.node(n);
        let tls = konnectivity_plumbing::tls::client_config(
            Some(&pem("ca-cert", pki.cluster_ca())),
            Some(&Identity {
                cert: pem("node-client-cert", node_pair.cert),
                key: pem("node-client-key", node_pair.key),
            }),
            &[],
        )?;
        let settings = NodeSettings {
            captures: Default::default(),
            capture_port: 0,
            mark: 0,
            server_hosts: NodeSettings::hosts_in_node_order(&args.server_hosts, &format!("node-{n}")),
            node_frontend_port: args.node_frontend_port,
            tls: Arc::new(tls),
            sync_interval: Duration::from_secs(1),
            sync_interval_cap: Duration::from_secs(10),
            cni: None,
            handover_socket: None,
            resume_timeout: Duration::from_secs(60),
            egress: None,
        };
        let addr = capture_addr(n);
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("node-{n}'s capture listener on {addr}"))?;
        let target = args.kas[n % args.kas.len()];
        let (node, serving) = konnectivity_node::fleet::serve_without_rules(settings, listener, target);
        tokio::spawn(serving);
        nodes.push((node, addr));
    }
    println!("{} nodes started", args.nodes);

    let bulk = Arc::new(WatchStats::default());
    let probe_node = Arc::new(WatchStats::default());
    let probe_direct = Arc::new(WatchStats::default());
    for (i, (_, addr)) in nodes.iter().enumerate().take(args.probes) {
        tokio::spawn(watch::hold(*addr, PROBE_INTERVAL, probe_node.clone()));
        let kas = args.kas[(args.first + i) % args.kas.len()];
        tokio::spawn(watch::hold(kas, PROBE_INTERVAL, probe_direct.clone()));
    }
    let mut opened = false;
    loop {
        let (stream, _) = control.accept().await?;
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        while let Ok(Some(command)) = lines.next_line().await {
            let answer = match command.trim() {
                "open" if !opened => {
                    opened = true;
                    let mean = Duration::from_millis(args.event_interval_ms);
                    for (_, addr) in &nodes {
                        for _ in 0..args.watches {
                            tokio::spawn(watch::hold(*addr, mean, bulk.clone()));
                        }
                    }
                    json!({"opened": nodes.len() * args.watches})
                }
                "open" => json!({"opened": 0}),
                "stats" => {
                    let tunnels = nodes
                        .iter()
                        .filter(|(node, _)| node.readiness.tunnel_connected.load(Ordering::Relaxed))
                        .count();
                    json!({
                        "tunnels_up": tunnels,
                        "bulk": stats(&bulk),
                        "probe_node": stats(&probe_node),
                        "probe_direct": stats(&probe_direct),
                    })
                }
                other => json!({"error": format!("unknown command {other:?}")}),
            };
            write.write_all(format!("{answer}\n").as_bytes()).await?;
        }
    }
}

fn stats(watches: &WatchStats) -> serde_json::Value {
    json!({
        "up": watches.up.load(Ordering::Relaxed),
        "stuck": watches.stuck.load(Ordering::Relaxed),
        "established": watches.established.load(Ordering::Relaxed),
        "broken": watches.broken.load(Ordering::Relaxed),
        "delays_us": watches.take_samples(),
    })
}

/// Node N's egress agent: the agent library, as the binary runs it; it
/// drains when the trigger returned is pulled.
fn start_agent(
    args: &NodeFleetArgs,
    pki: &ClusterPki,
    n: usize,
) -> anyhow::Result<konnectivity_plumbing::lifecycle::Trigger> {
    let agent = pki.agent();
    let mut flags = vec![
        "proxy-agent".to_owned(),
        format!(
            "--proxy-server-host={}",
            args.agent_server_host
                .clone()
                .unwrap_or_else(|| args.server_hosts.join(","))
        ),
        format!("--proxy-server-port={}", args.server_port),
        format!("--ca-cert={}", pki.cluster_ca().display()),
        format!("--agent-cert={}", agent.cert.display()),
        format!("--agent-key={}", agent.key.display()),
        format!("--agent-id=node-{n}"),
    ];
    if let Some(kubeconfig) = &args.lease_kubeconfig {
        flags.extend(crate::leases::agent_flags(kubeconfig));
    }
    let flags = konnectivity_agent::config::Args::try_parse_from(flags)?;
    let mut config = konnectivity_agent::config::Config::from_args(&flags)?;
    // Each agent's health and admin listeners on ports of the kernel's choosing.
    config.health_addr.set_port(0);
    config.admin_addr.set_port(0);
    let (trigger, watcher) = konnectivity_plumbing::lifecycle::channel();
    tokio::spawn(async move {
        if let Err(error) = konnectivity_agent::run_with_drain(config, watcher).await {
            eprintln!("agent node-{n}: {error}");
        }
    });
    Ok(trigger)
}
