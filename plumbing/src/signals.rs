//! Termination signals.

use tokio::signal::unix::{SignalKind, signal};

/// Waits for the next SIGTERM or SIGINT. Call it again for the next one:
/// the agent drains on the first and exits on the second, as upstream's.
pub struct Terminations {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Terminations {
    pub fn new() -> std::io::Result<Self> {
        Ok(Terminations {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves with the name of the signal received.
    pub async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
