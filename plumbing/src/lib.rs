//! Plumbing that proxy-server and proxy-agent share: TLS loading, the small
//! HTTP listener for health and metrics, logging set-up, signals and the
//! Go-style flag values upstream manifests pass.

pub mod flags;
pub mod http;
pub mod klog;
pub mod kube;
pub mod limit;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod signals;
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
