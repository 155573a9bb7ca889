//! Registries that write what Go's client writes: the process families at
//! the root, the binary's own under its prefix, each registered with its
//! name and help exactly as given, and the text format 0.0.4.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::process;

/// Label sets with static names and values, as all of ours are.
pub type Labels = Vec<(&'static str, &'static str)>;

/// Upstream's dial latency buckets, 1 µs to 12.5 s.
pub const LATENCY_BUCKETS: [f64; 9] = [0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];

/// The Go client's default histogram buckets, 5 ms to 10 s, which upstream's
/// lease metrics use.
pub const DEFAULT_BUCKETS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Labels of a kube-apiserver call's outcome: an HTTP status code, and for
/// counters the `Status` reason (`Conflict`, …; empty on success).
pub type ApiLabels = Vec<(&'static str, String)>;

/// Histograms by [`ApiLabels`], each made with the family's buckets.
pub type ApiHistograms = Family<ApiLabels, Histogram, fn() -> Histogram>;

/// The content type of [`encode`]'s output (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A registry for one binary: the process families (unprefixed, as Go's
/// client exposes them) at its root, and a sub-registry with `prefix`
/// (e.g. `konnectivity_network_proxy_server`) for everything else, which
/// `fill` registers.
pub fn binary_registry(prefix: &str, fill: impl FnOnce(&mut Registry)) -> Registry {
    let mut root = Registry::default();
    root.register_collector(Box::new(process::ProcessCollector));
    fill(root.sub_registry_with_prefix(prefix));
    root
}

/// Registers `metric` as the family `name` (after the registry's prefix)
/// with exactly `help` as its HELP text.
pub fn register<M>(registry: &mut Registry, name: &'static str, help: &'static str, metric: M)
where
    M: EncodeMetric + std::fmt::Debug + Send + Sync + 'static,
{
    registry.register_collector(Box::new(Described { name, help, metric }));
}

/// A metric with its family's name and help, encoded without changes.
#[derive(Debug)]
struct Described<M> {
    name: &'static str,
    help: &'static str,
    metric: M,
}

impl<M: EncodeMetric + std::fmt::Debug + Send + Sync + 'static> Collector for Described<M> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let metric_encoder =
            encoder.encode_descriptor(self.name, self.help, None, self.metric.metric_type())?;
        self.metric.encode(metric_encoder)
    }
}

/// The `/metrics` reply: the registry's text, with `alive_tasks` first set
/// to the number of tasks alive in the current runtime and `heap_bytes` to
/// the bytes allocated and not freed (a leak shows in one or the other).
pub fn reply(registry: &Registry, alive_tasks: &Gauge, heap_bytes: &Gauge) -> crate::http::Reply {
    let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    alive_tasks.set(tasks as i64);
    heap_bytes.set(konnectivity_plumbing::sys::heap_bytes());
    crate::http::Reply {
        status: http::StatusCode::OK,
        content_type: CONTENT_TYPE,
        headers: Vec::new(),
        body: encode(registry).into(),
    }
}

/// The registry in the text format 0.0.4 (no OpenMetrics `# EOF`).
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode_registry(&mut text, registry)
        .expect("writing to a String cannot fail");
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::counter::GoCounter;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn families_read_as_gos_client_writes_them() {
        let failures = Family::<Labels, GoCounter>::default();
        let packets = GoCounter::default();
        let latency = Histogram::new([0.5]);
        let registry = binary_registry("konnectivity_network_proxy_server", |registry| {
            register(
                registry,
                "dial_failure_count",
                "Number of dial failures observed. Multiple failures can occur for a single dial request.",
                failures.clone(),
            );
            register(
                registry,
                "stream_packets_total",
                "Count of packets processed",
                packets.clone(),
            );
            register(
                registry,
                "dial_duration_seconds",
                "Latency of dial to the remote endpoint in seconds",
                latency.clone(),
            );
        });
        failures.get_or_create(&vec![("reason", "no_agent")]).inc();
        packets.inc_by(3);
        latency.observe(0.25);
        let text = encode(&registry);
        for line in [
            "# HELP konnectivity_network_proxy_server_dial_failure_count Number of dial failures observed. Multiple failures can occur for a single dial request.\n",
            "# TYPE konnectivity_network_proxy_server_dial_failure_count counter\n",
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"no_agent\"} 1\n",
            "# HELP konnectivity_network_proxy_server_stream_packets_total Count of packets processed\n",
            "# TYPE konnectivity_network_proxy_server_stream_packets_total counter\n",
            "konnectivity_network_proxy_server_stream_packets_total 3\n",
            // No period appended to a help text that has none.
            "# HELP konnectivity_network_proxy_server_dial_duration_seconds Latency of dial to the remote endpoint in seconds\n",
            "konnectivity_network_proxy_server_dial_duration_seconds_count 1\n",
            "# TYPE process_cpu_seconds_total counter\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
}
