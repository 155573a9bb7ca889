//! Plumbing that proxy-server and proxy-agent share: TLS loading, the small
//! HTTP listener for health and metrics, logging set-up, signals and the
//! Go-style flag values upstream manifests pass.

pub mod flags;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod signals;
pub mod tls;
