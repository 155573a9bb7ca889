//! The process plumbing both binaries share: TLS from PEM files ([`tls`]),
//! the Go-style flag values upstream manifests pass ([`flags`]), signals and
//! the drain lifecycle ([`signals`], [`lifecycle`]), the runtime and its
//! allocator ([`runtime`]), limits, reconnection backoff, and the system
//! calls that have no safe wrapper ([`sys`], the only unsafe code).

pub mod backoff;
pub mod flags;
pub mod lifecycle;
pub mod limit;
pub mod net;
pub mod runtime;
pub mod signals;
pub mod sys;
pub mod tls;

/// Formats an error with all its sources (`outer: inner: root cause`), for
/// logs: transport errors say little without their causes.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Raises the soft limit on open files to the hard limit, as Go programs
/// (upstream's binaries among them) do at start: every tunnel holds
/// sockets, and the usual soft limit of 1024 would cap a server at a few
/// hundred tunnels. Returns the limit now in force.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard.max(soft))
}
