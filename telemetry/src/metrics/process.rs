//! The `process_*` families Go's Prometheus client exposes for every
//! program (upstream's binaries included), read from /proc at each scrape,
//! with Go's names, HELP texts and types, so restart, descriptor and memory
//! dashboards and alerts keep working after the swap.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;

/// Linux's fixed unit of the times in /proc/PID/stat (USER_HZ), as Go's
/// procfs assumes it too.
const USER_HZ: f64 = 100.0;

/// What `process_*` reports, read once per scrape.
#[derive(Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    pub start_time_seconds: f64,
    pub open_fds: f64,
    pub max_fds: f64,
    pub virtual_max_bytes: f64,
    pub network_receive_bytes: f64,
    pub network_transmit_bytes: f64,
}

impl ProcessStats {
    /// This process's figures; a file that cannot be read leaves its
    /// figures at 0 rather than failing the scrape.
    pub fn current() -> ProcessStats {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let mut stats = ProcessStats::default();
        if let Some(stat) = parse_stat(&read("/proc/self/stat")) {
            let page_size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
                .ok()
                .flatten()
                .unwrap_or(4096) as f64;
            stats.cpu_seconds = (stat.utime + stat.stime) as f64 / USER_HZ;
            stats.virtual_bytes = stat.vsize as f64;
            stats.resident_bytes = stat.rss_pages as f64 * page_size;
            if let Some(boot_time) = boot_time(&read("/proc/stat")) {
                stats.start_time_seconds = boot_time as f64 + stat.start_ticks as f64 / USER_HZ;
            }
        }
        stats.open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count()) as f64;
        let limits = read("/proc/self/limits");
        stats.max_fds = soft_limit(&limits, "Max open files").unwrap_or(0.0);
        stats.virtual_max_bytes = soft_limit(&limits, "Max address space").unwrap_or(0.0);
        if let Some((received, sent)) = ip_octets(&read("/proc/self/net/netstat")) {
            stats.network_receive_bytes = received;
            stats.network_transmit_bytes = sent;
        }
        stats
    }
}

/// The fields of /proc/PID/stat that matter here.
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

/// proc(5): the command name is in parentheses and may hold spaces, so
/// fields are counted from the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let fields: Vec<&str> = text.get(text.rfind(')')? + 1..)?.split_whitespace().collect();
    // `fields[0]` is field 3 (state).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        start_ticks: field(22)?,
        vsize: field(23)?,
        rss_pages: field(24)?,
    })
}

fn boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// A soft limit from /proc/PID/limits; "unlimited" is the largest u64, as
/// Go's procfs reads it.
fn soft_limit(limits: &str, name: &str) -> Option<f64> {
    let rest = limits.lines().find_map(|line| line.strip_prefix(name))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX as f64),
        value => value.parse::<u64>().ok().map(|v| v as f64),
    }
}

/// `IpExt: InOctets OutOctets` of the process's network namespace, as Go's
/// procfs `Netstat()` reads it (what Go's client reports as the process's
/// network bytes).
fn ip_octets(netstat: &str) -> Option<(f64, f64)> {
    let mut lines = netstat.lines().filter(|line| line.starts_with("IpExt:"));
    let names: Vec<&str> = lines.next()?.split_whitespace().collect();
    let values: Vec<&str> = lines.next()?.split_whitespace().collect();
    let value = |name: &str| -> Option<f64> {
        let index = names.iter().position(|n| *n == name)?;
        values.get(index)?.parse().ok()
    };
    Some((value("InOctets")?, value("OutOctets")?))
}

/// Collects [`ProcessStats`] at every scrape.
#[derive(Debug)]
pub struct ProcessCollector;

/// One value, of either type, written with the family's name as is.
#[derive(Debug)]
struct Value(MetricType, f64);

impl EncodeMetric for Value {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        encoder.encode_gauge(&self.1)
    }

    fn metric_type(&self) -> MetricType {
        self.0
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        use MetricType::{Counter, Gauge};
        let stats = ProcessStats::current();
        // Go's client: names, HELP texts and types of its process collector.
        let families = [
            (
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
                Counter,
                stats.cpu_seconds,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors.",
                Gauge,
                stats.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors.",
                Gauge,
                stats.max_fds,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                Gauge,
                stats.virtual_bytes,
            ),
            (
                "process_virtual_memory_max_bytes",
                "Maximum amount of virtual memory available in bytes.",
                Gauge,
                stats.virtual_max_bytes,
            ),
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                Gauge,
                stats.resident_bytes,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                Gauge,
                stats.start_time_seconds,
            ),
            (
                "process_network_receive_bytes_total",
                "Number of bytes received by the process over the network.",
                Counter,
                stats.network_receive_bytes,
            ),
            (
                "process_network_transmit_bytes_total",
                "Number of bytes sent by the process over the network.",
                Counter,
                stats.network_transmit_bytes,
            ),
        ];
        for (name, help, kind, value) in families {
            let metric = Value(kind, value);
            metric.encode(encoder.encode_descriptor(name, help, None, kind)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_proc_files_as_procfs_does() {
        let stat = "4711 (proxy (agent) x) S 1 4711 4711 0 -1 4194560 1234 0 0 0 250 130 0 0 20 0 6 0 \
                    987654 123456789 2048 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                utime: 250,
                stime: 130,
                start_ticks: 987654,
                vsize: 123456789,
                rss_pages: 2048,
            })
        );
        assert_eq!(
            boot_time("cpu  1 2 3\nbtime 1764000000\nprocesses 9\n"),
            Some(1764000000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max address space         unlimited            unlimited            bytes\n\
                      Max open files            1048576              1048576              files\n";
        assert_eq!(soft_limit(limits, "Max open files"), Some(1048576.0));
        assert_eq!(soft_limit(limits, "Max address space"), Some(u64::MAX as f64));
        let netstat = "TcpExt: SyncookiesSent SyncookiesRecv\nTcpExt: 0 0\n\
                       IpExt: InNoRoutes InTruncatedPkts InMcastPkts OutMcastPkts InBcastPkts OutBcastPkts InOctets OutOctets\n\
                       IpExt: 0 0 0 0 0 0 1500 900\n";
        assert_eq!(ip_octets(netstat), Some((1500.0, 900.0)));
    }

    #[test]
    fn this_process_has_figures() {
        let stats = ProcessStats::current();
        assert!(stats.resident_bytes > 0.0 && stats.virtual_bytes >= stats.resident_bytes);
        assert!(stats.open_fds >= 3.0 && stats.max_fds >= stats.open_fds);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(stats.start_time_seconds > now - 86_400.0 && stats.start_time_seconds <= now + 1.0);
    }
}
