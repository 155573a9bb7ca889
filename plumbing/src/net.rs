//! Network settings both binaries share. (Dialing TCP, with the agent's
//! mark, is `konnectivity_client::net`: a client needs it too.)

/// How long an HTTP/2 keepalive ping may go unanswered before the connection
/// counts as dead: the ping interval, at most gRPC's default of 20s.
pub fn keepalive_timeout(interval: std::time::Duration) -> std::time::Duration {
    interval.min(std::time::Duration::from_secs(20))
}

/// Whether the error under `status` is the connection's end (EOF, reset,
/// broken pipe, or the server's GOAWAY without error) rather than
/// something the server said or did wrong.
pub fn grpc_connection_ended(status: &tonic::Status) -> bool {
    let closed = |io: &std::io::Error| {
        matches!(
            io.kind(),
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
        )
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return closed(io);
        }
        // h2 reports an I/O failure of the connection as its own error, whose
        // source skips the io::Error itself.
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.get_io().is_some_and(closed)
                || (h2.is_go_away() && h2.reason() == Some(h2::Reason::NO_ERROR));
        }
        source = error.source();
    }
    false
}

/// Ends a TCP connection with a reset rather than a clean close: its peer
/// sees a failure at once and retries, instead of taking what it got for
/// the whole answer. The reset goes when the last descriptor of the socket
/// closes (this only sets `SO_LINGER` to zero).
pub fn reset(connection: impl std::os::fd::AsFd) {
    let _ = socket2::SockRef::from(&connection).set_linger(Some(std::time::Duration::ZERO));
}
