use clap::Parser;
use konnectivity_server::config::{Args, Config};

/// mimalloc keeps freed memory for reuse: with the system allocator every
/// encoded 64 KiB packet cost fresh pages (page faults and unmaps were 5% of
/// the CPU time of a bulk transfer).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = match Config::from_args(&args) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("proxy-server: {error}");
            std::process::exit(2);
        }
    };
    args.klog.init_logging()?;
    tracing::info!(?config, "effective configuration");
    konnectivity_plumbing::klog::warn_inert(&args.inert_settings());
    match konnectivity_plumbing::raise_open_files_limit() {
        Ok(limit) => tracing::debug!(limit, "open files limit"),
        Err(error) => tracing::warn!(%error, "cannot raise the open files limit"),
    }

    let runtime = konnectivity_plumbing::runtime::multi_thread()?;
    runtime.block_on(async {
        let mut signals = konnectivity_plumbing::signals::Terminations::new()?;
        let shutdown = async move {
            let signal = signals.next().await;
            tracing::info!(signal, "shutting down");
        };
        konnectivity_server::run(config, shutdown).await?;
        Ok(())
    })
}
