use konnectivity_agent::config::{AgentCommand, Args, Config};

/// See `konnectivity_plumbing::runtime::Allocator`.
#[global_allocator]
static ALLOCATOR: konnectivity_plumbing::runtime::Allocator = konnectivity_plumbing::runtime::Allocator;

fn main() -> anyhow::Result<()> {
    let (args, flags): (Args, _) = konnectivity_plumbing::flags::parse_or_exit();
    if let Some(AgentCommand::InstallCni(install)) = &args.command {
        args.klog.init_logging()?;
        if let Err(error) = konnectivity_node::cni::install::run(install) {
            eprintln!("proxy-agent install-cni: {error}");
            std::process::exit(1);
        }
        return Ok(());
    }
    let config = Config::from_args(&args);
    let config = konnectivity_telemetry::klog::start(
        "proxy-agent",
        config,
        &flags,
        &args.klog,
        &args.inert_settings(),
    )?;
    if !args.keepalive_time.is_zero() && args.keepalive_time < konnectivity_agent::config::MIN_KEEPALIVE {
        tracing::warn!(
            requested = ?args.keepalive_time,
            applied = ?konnectivity_agent::config::MIN_KEEPALIVE,
            "--keepalive-time raised: servers refuse pings more often than every 30s"
        );
    }

    let captures = config.node.is_some();
    let runtime = konnectivity_plumbing::runtime::multi_thread(args.runtime.workers())?;
    let result = runtime.block_on(async {
        let mut signals = konnectivity_plumbing::signals::Terminations::new()?;
        konnectivity_agent::run(config, &mut signals)
            .await
            .map_err(anyhow::Error::from)
    });
    // Told to stop, the owner of the capture rules takes them away; a crash
    // leaves them, so a restarted agent finds them in place and resumes at
    // once, and an agent that handed over leaves them to its successor.
    if captures && matches!(result, Ok(konnectivity_agent::Ended::Stopped)) {
        match konnectivity_node::capture::nft::remove() {
            Ok(()) => tracing::info!("capture rules removed"),
            Err(error) => tracing::warn!(%error, "could not remove the capture rules"),
        }
    }
    if let Err(error) = result {
        // Everything run() returns stops it from starting (the health
        // listener, a certificate, the capture rules): one line, status 2,
        // as for a bad flag.
        let text = konnectivity_plumbing::error_chain(error.as_ref());
        // The log file records why; standard error gets the one line.
        if args.klog.logs_to_files() {
            tracing::error!(error = %text, "proxy-agent stopped");
        }
        eprintln!("proxy-agent: {text}");
        std::process::exit(2);
    }
    Ok(())
}
