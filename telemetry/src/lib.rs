//! What both binaries tell their operators: logs in klog's text or JSON
//! form under klog's flags ([`klog`], [`logging`]), Prometheus metrics with
//! upstream's names ([`metrics`]), Go-compatible CPU profiles
//! ([`profiling`]), and the small HTTP listener that serves them beside
//! `/healthz` and `/readyz` ([`http`]).

pub mod http;
pub mod klog;
pub mod logging;
pub mod metrics;
pub mod profiling;
