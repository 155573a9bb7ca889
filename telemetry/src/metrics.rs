//! Prometheus metrics written as upstream's Go binaries write them: the text
//! format 0.0.4 of Go's client, with upstream's names and HELP texts.
//!
//! prometheus-client speaks OpenMetrics, which differs from Go's text format
//! in ways parsers notice: a counter's `# TYPE` line omits the `_total` its
//! samples carry (Go's expfmt and Prometheus then read the samples as an
//! untyped family without help), every HELP text gets a period appended, and
//! the exposition ends with `# EOF`. So every family here is registered with
//! [`register`], which writes its name and help exactly as given, counters
//! are [`GoCounter`]s, whose samples carry exactly the family's name, and
//! [`encode`] leaves out `# EOF`.

mod counter;
mod packets;
pub mod process;
mod registry;
mod resumes;
mod tunnels;

pub use counter::{GaugeGuard, GoCounter};
pub use packets::{PacketCounters, Segment, StreamErrors, code_name};
pub use registry::{
    ApiHistograms, ApiLabels, CONTENT_TYPE, DEFAULT_BUCKETS, LATENCY_BUCKETS, Labels, binary_registry,
    encode, register, reply,
};
pub use resumes::Resumes;
pub use tunnels::{EndReason, TunnelBytes, TunnelRecord, TunnelsEnded};
