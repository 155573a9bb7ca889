//! Network settings both binaries share. (Dialing TCP, with the agent's
//! mark, is `konnectivity_client::net`: a client needs it too.)

/// How long an HTTP/2 keepalive ping may go unanswered before the connection
/// counts as dead: the ping interval, at most gRPC's default of 20s.
pub fn keepalive_timeout(interval: std::time::Duration) -> std::time::Duration {
    interval.min(std::time::Duration::from_secs(20))
}
