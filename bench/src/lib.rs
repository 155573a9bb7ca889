//! `konnectivity-bench`: measures the tunnel (HTTP CONNECT and gRPC
//! frontends on a Unix socket, agent over mTLS) against direct loopback TCP
//! to the same targets, in one run, and prints one table of medians.
//! `hack/bench.sh` builds the release binaries and runs it.

pub mod args;
pub mod balancer;
pub mod cluster;
pub mod cpu;
pub mod go_client;
pub mod leases;
pub mod node_fleet;
pub mod pki;
pub mod report;
pub mod route;
pub mod scale;
pub mod scenarios;
pub mod stack;
pub mod targets;
pub mod token_review;
pub mod watch;

use std::time::Duration;

use anyhow::Context;

pub use crate::args::{Cli, Commands, FleetArgs, LayoutArgs, RunArgs, ScaleArgs};
use crate::report::{Figures, Table};
use crate::route::Route;
use crate::stack::{Mode, Stack};
use crate::targets::Targets;

pub fn main(cli: Cli) -> anyhow::Result<()> {
    // 10,000 idle connections need more descriptors than the usual soft
    // limit; children (targets, server, agent) inherit the raised one.
    konnectivity_plumbing::raise_open_files_limit().context("raising RLIMIT_NOFILE")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Commands::Targets => runtime.block_on(targets::serve()),
        Commands::Run(args) => runtime.block_on(run(args)),
        Commands::Scale(args) => runtime.block_on(scale::scale(args)),
        Commands::Fleet(args) => runtime.block_on(scale::fleet(args)),
        Commands::Cluster(args) => runtime.block_on(cluster::cluster(args)),
        Commands::NodeFleet(args) => runtime.block_on(node_fleet::run(args)),
        Commands::Balancer { listen, backends } => runtime.block_on(balancer::serve(listen, backends)),
        Commands::KasStandin { listen } => runtime.block_on(watch::serve(listen)),
        Commands::Relay { next } => runtime.block_on(route::relay(next)),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.layout.work)?;
    let layout = args.layout.layout();
    let (_targets_proc, targets) = stack::start_targets(&layout)?;
    // Memory first, each on a server and agent of its own that have carried
    // nothing else: resident memory depends on what a process did before.
    let mut memory = std::collections::HashMap::new();
    if args.wants("memory") {
        for (mode, index) in [(Mode::Grpc, 0), (Mode::Grpc, 1), (Mode::HttpConnect, 0)] {
            let stack = Stack::start(&layout, mode).await?;
            let route = Route::for_stack(&stack).await?.remove(index);
            eprintln!("== {}: {} idle connections", route.name(), args.idle);
            let per_connection = scenarios::memory_per_connection(&stack, &route, &targets, args.idle)
                .await
                .with_context(|| format!("measuring memory of {}", route.name()))?;
            memory.insert(route.name(), per_connection);
        }
    }
    let (_relays, first_relay) = stack::start_relays(&layout)?;
    let grpc = Stack::start(&layout, Mode::Grpc).await?;
    let connect = Stack::start(&layout, Mode::HttpConnect).await?;
    let mut routes = vec![
        (Route::Direct, false),
        (Route::Relays { first: first_relay }, false),
    ];
    for route in Route::for_stack(&grpc).await? {
        routes.push((route, true));
    }
    for route in Route::for_stack(&connect).await? {
        routes.push((route, true));
    }
    let _null_server = match (&args.go_grpc_client, args.wants("go")) {
        (Some(client), true) => {
            let (server, uds) = stack::start_null_grpc(&layout, client).await?;
            routes.push((Route::GrpcNull { uds }, false));
            Some(server)
        }
        _ => None,
    };
    let mut table = Table::default();
    for (route, tunneled) in &routes {
        eprintln!("== {}", route.name());
        let mut figures = match route {
            Route::GrpcNull { .. } => Figures::default(),
            _ => measure(&args, route, *tunneled, &targets)
                .await
                .with_context(|| format!("measuring {}", route.name()))?,
        };
        measure_with_go(&args, route, &targets, &mut figures)
            .await
            .with_context(|| format!("measuring {} with the Go client", route.name()))?;
        figures.memory_per_connection = memory.get(route.name()).copied();
        table.add(route.name(), figures);
    }
    println!("{}", table.render(&args));
    Ok(())
}

async fn measure(
    args: &RunArgs,
    route: &Route,
    tunneled: bool,
    targets: &Targets,
) -> anyhow::Result<Figures> {
    use scenarios::*;
    let mut figures = Figures::default();
    for run in 0..args.runs {
        eprintln!("   run {} of {}", run + 1, args.runs);
        if args.wants("one") {
            figures
                .one_stream
                .push(throughput_one(route, targets, args.bytes).await?);
        }
        if args.wants("down") {
            figures
                .one_stream_down
                .push(throughput_down(route, targets, args.bytes).await?);
        }
        if args.wants("eight") {
            let rate = throughput_parallel(route, targets, args.bytes, 8).await?;
            figures.eight_streams.push(rate);
        }
        if args.wants("rtt") {
            let mut samples = round_trips(route, targets, 1024, args.round_trips).await?;
            figures.rtt_p50.push(percentile(&mut samples, 0.50));
            figures.rtt_p99.push(percentile(&mut samples, 0.99));
        }
        if args.wants("setup") {
            let (rate, mut latencies) = setups(route, targets, args.setups, 16).await?;
            figures.setups_per_second.push(rate);
            figures.dial_p50.push(percentile(&mut latencies, 0.50));
        }
    }
    if !tunneled {
        return Ok(figures);
    }
    if args.wants("stall") {
        eprintln!("   beside a stalled reader and a stalled writer");
        let limit = Duration::from_secs(20);
        figures.beside_stalled = Some(beside_stalled(route, targets, args.bytes / 4, limit).await?);
    }
    Ok(figures)
}

/// The Go client's figures, on the routes it speaks (direct, CONNECT, and
/// gRPC as kube-apiserver dials it).
async fn measure_with_go(
    args: &RunArgs,
    route: &Route,
    targets: &Targets,
    figures: &mut Figures,
) -> anyhow::Result<()> {
    if !args.wants("go") {
        return Ok(());
    }
    let (client, via) = match route {
        Route::Direct => (&args.go_client, None),
        Route::HttpConnect { uds } => (&args.go_client, Some(("proxy-uds", uds.as_path()))),
        Route::Grpc { uds } | Route::GrpcNull { uds } => {
            (&args.go_grpc_client, Some(("grpc-uds", uds.as_path())))
        }
        Route::Relays { .. } | Route::GrpcShared { .. } => return Ok(()),
    };
    // The null server echoes DATA itself: round trips and dials only.
    let bulk = !matches!(route, Route::GrpcNull { .. });
    let Some(client) = client else {
        return Ok(());
    };
    let go_to = |target| go_client::GoRun { client, via, target };
    let bytes = vec![format!("-bytes={}", args.bytes)];
    for run in 0..args.runs {
        eprintln!("   Go client, run {} of {}", run + 1, args.runs);
        if bulk {
            let up = go_to(targets.sink)
                .figure("upload", &bytes, "bytes_per_second")
                .await?;
            let down = go_to(targets.source)
                .figure("download", &bytes, "bytes_per_second")
                .await?;
            figures.go.upload.push(up);
            figures.go.download.push(down);
        }
        let count = vec![format!("-count={}", args.round_trips)];
        let rtt = go_to(targets.echo)
            .figures("rtt", &count, &["p50_us", "p99_us"])
            .await?;
        let count = vec![format!("-count={}", args.go_dials)];
        let dial = go_to(targets.echo)
            .figures("dial", &count, &["per_second", "p50_us"])
            .await?;
        let measured = &mut figures.go;
        measured.rtt_p50_us.push(rtt[0]);
        measured.rtt_p99_us.push(rtt[1]);
        measured.dials_per_second.push(dial[0]);
        measured.dial_p50_us.push(dial[1]);
    }
    Ok(())
}
