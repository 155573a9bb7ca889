//! Logging through `tracing`, with klog's `-v` levels mapped onto it.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `verbosity` is klog's `-v`: 0-1 log at
/// info, 2-4 at debug, 5 and more at trace. `RUST_LOG`, when set, wins.
pub fn init(verbosity: u32, log_file: Option<&std::path::Path>) -> std::io::Result<()> {
    let level = match verbosity {
        0..=1 => "info",
        2..=4 => "debug",
        _ => "trace",
    };
    // h2 and hyper are very chatty at debug; keep them at info unless asked.
    let default = format!("{level},h2=info,hyper=info,tower=info,rustls=info");
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match log_file {
        Some(path) => {
            let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
            builder
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .init();
        }
        None => builder.with_writer(std::io::stderr).init(),
    }
    Ok(())
}
