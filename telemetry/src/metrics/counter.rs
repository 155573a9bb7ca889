//! Counters and gauges as Go's client has them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};

/// A counter as Go's client exposes it: its samples carry exactly the
/// family's name (`…_total` where upstream's name has it, and nothing
/// appended where it does not, as in `dial_failure_count`), and the family
/// is typed `counter`.
#[derive(Clone, Debug, Default)]
pub struct GoCounter(Arc<AtomicU64>);

impl GoCounter {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl TypedMetric for GoCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for GoCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // A gauge's sample is the bare family name; the type stays counter.
        encoder.encode_gauge(&self.get())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Holds a gauge up by one for as long as it lives, so every exit path,
/// including a panic or a dropped future, brings the gauge back down.
#[derive(Debug)]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        GaugeGuard(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
