//! Connections that outlive their stream (docs/resume.md), the same on both
//! binaries: how many resumed, what was sent again, what the resume timeout
//! closed, and how long streams were away.

use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::counter::GoCounter;
use crate::metrics::registry::register;

/// Seconds from a lost stream to the stream that resumed it.
const RESUME_BUCKETS: [f64; 10] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0];

#[derive(Debug, Clone)]
pub struct Resumes {
    /// Connections carried over to a new stream.
    pub resumed: GoCounter,
    /// DATA bytes sent again because the lost stream lost them.
    pub resent_bytes: GoCounter,
    /// Connections closed because no stream resumed them in time.
    pub timed_out: GoCounter,
    /// Connections a resume could not carry over (the peer no longer had
    /// them, or named positions nothing sent explains).
    pub dropped: GoCounter,
    /// From the loss of a stream to the stream that resumed it.
    pub duration: Histogram,
}

impl Default for Resumes {
    fn default() -> Self {
        Resumes {
            resumed: GoCounter::default(),
            resent_bytes: GoCounter::default(),
            timed_out: GoCounter::default(),
            dropped: GoCounter::default(),
            duration: Histogram::new(RESUME_BUCKETS),
        }
    }
}

impl Resumes {
    pub fn register(registry: &mut Registry) -> Resumes {
        let resumes = Resumes::default();
        register(
            registry,
            "resumed_connections_total",
            "Connections carried over to a new stream after theirs was lost (docs/resume.md).",
            resumes.resumed.clone(),
        );
        register(
            registry,
            "resume_resent_bytes_total",
            "DATA bytes sent again on a resumed stream because the lost stream lost them.",
            resumes.resent_bytes.clone(),
        );
        register(
            registry,
            "resume_timeouts_total",
            "Connections closed because no stream resumed them within the resume timeout.",
            resumes.timed_out.clone(),
        );
        register(
            registry,
            "resume_dropped_connections_total",
            "Connections a resume could not carry over: the peer no longer had them, or its byte counts did not match what was sent.",
            resumes.dropped.clone(),
        );
        register(
            registry,
            "resume_duration_seconds",
            "Seconds from the loss of a stream to the stream that resumed its connections.",
            resumes.duration.clone(),
        );
        resumes
    }
}
