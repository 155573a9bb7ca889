use konnectivity_server::config::{Args, Config};

/// See `konnectivity_plumbing::runtime::Allocator`.
#[global_allocator]
static ALLOCATOR: konnectivity_plumbing::runtime::Allocator = konnectivity_plumbing::runtime::Allocator;

fn main() -> anyhow::Result<()> {
    let (args, flags): (Args, _) = konnectivity_plumbing::flags::parse_or_exit();
    let config = Config::from_args(&args);
    let config = konnectivity_telemetry::klog::start(
        "proxy-server",
        config,
        &flags,
        &args.klog,
        &args.inert_settings(),
    )?;

    let runtime = konnectivity_plumbing::runtime::multi_thread(args.runtime.workers())?;
    let result = runtime.block_on(async {
        let mut signals = konnectivity_plumbing::signals::Terminations::new()?;
        let shutdown = async move {
            let signal = signals.next().await;
            tracing::info!(signal, "shutting down");
        };
        konnectivity_server::run(config, shutdown)
            .await
            .map_err(anyhow::Error::from)
    });
    if let Err(error) = result {
        // One line, as for a bad flag; status 2 when the server could not
        // start (a listener, a certificate), 1 when it failed later.
        let starting = error
            .downcast_ref::<konnectivity_server::ServeError>()
            .is_some_and(konnectivity_server::ServeError::at_start_up);
        // The log file records why; standard error gets the one line.
        if args.klog.logs_to_files() {
            tracing::error!(error = %konnectivity_plumbing::error_chain(error.as_ref()), "proxy-server stopped");
        }
        eprintln!(
            "proxy-server: {}",
            konnectivity_plumbing::error_chain(error.as_ref())
        );
        std::process::exit(if starting { 2 } else { 1 });
    }
    Ok(())
}
