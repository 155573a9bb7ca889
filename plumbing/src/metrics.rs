//! Prometheus text exposition with upstream's metric names.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// Label sets with static names and values, as all of ours are.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Upstream's dial latency buckets, 1 µs to 12.5 s.
pub const LATENCY_BUCKETS: [f64; 9] = [0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];

/// The content type of [`encode`]'s output (Prometheus text format 0.0.4,
/// which reads the OpenMetrics `# EOF` line as a comment).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The `/metrics` reply: the registry's text, with `alive_tasks` first set
/// to the number of tasks alive in the current runtime (a leak shows there).
pub fn reply(registry: &Registry, alive_tasks: &Gauge) -> crate::http::Reply {
    let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    alive_tasks.set(tasks as i64);
    crate::http::Reply {
        status: http::StatusCode::OK,
        content_type: CONTENT_TYPE,
        body: encode(registry),
    }
}

pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("writing to a String cannot fail");
    text
}

/// A counter exposed under exactly its registered name.
///
/// prometheus-client appends `_total` to every counter, but some of upstream's
/// counters (e.g. `konnectivity_network_proxy_server_dial_failure_count`) have
/// no such suffix, and dashboards query them by that name.
#[derive(Clone, Debug, Default)]
pub struct UnsuffixedCounter(Arc<AtomicU64>);

impl UnsuffixedCounter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl TypedMetric for UnsuffixedCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for UnsuffixedCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;

    #[test]
    fn unsuffixed_counter_keeps_its_name() {
        let mut registry = Registry::with_prefix("konnectivity_network_proxy_server");
        let failures = Family::<Vec<(String, String)>, UnsuffixedCounter>::default();
        registry.register("dial_failure_count", "Dial failures", failures.clone());
        let packets = Counter::<u64>::default();
        registry.register("stream_packets", "Packets", packets.clone());
        failures
            .get_or_create(&vec![("reason".into(), "no_agent".into())])
            .inc();
        packets.inc();
        let text = encode(&registry);
        assert!(
            text.contains("konnectivity_network_proxy_server_dial_failure_count{reason=\"no_agent\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE konnectivity_network_proxy_server_dial_failure_count counter"));
        assert!(text.contains("konnectivity_network_proxy_server_stream_packets_total 1\n"));
    }
}
