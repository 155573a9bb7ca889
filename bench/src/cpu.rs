//! Where the machine's CPU went during one phase of the cluster run. The
//! run's storms (every node coming back after a restart, one server's nodes
//! moving to another) are measured on two cores that also carry the fleets
//! playing 5,000 nodes and their 50,000 clients, the stand-in
//! kube-apiservers, the control-plane agents and the balancers. How long a
//! storm took says what the machine did; the CPU-seconds each group of
//! processes spent say what the server's own share was, which is what a
//! control-plane machine of its own would have to do, and the time its
//! threads were ready to run and waited for a CPU says whether the machine
//! held it back.

use std::time::Instant;

use crate::stack::{Proc, cpu_ticks_of};

/// The kernel's clock ticks per second (`USER_HZ`), in which /proc/PID/stat
/// and /proc/stat count.
const TICKS_PER_SECOND: f64 = 100.0;

/// A named group of processes whose CPU is counted together.
pub struct Group<'a> {
    pub name: &'static str,
    pub procs: Vec<&'a Proc>,
}

impl<'a> Group<'a> {
    pub fn of(name: &'static str, procs: impl IntoIterator<Item = &'a Proc>) -> Self {
        Group {
            name,
            procs: procs.into_iter().collect(),
        }
    }
}

/// Each group's processes' CPU so far, and the machine's.
pub struct CpuSnapshot {
    at: Instant,
    groups: Vec<(&'static str, Vec<ProcCpu>)>,
    harness: u64,
    machine: MachineTicks,
}

/// One process's CPU time and its threads' wait for a CPU, so far.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ProcCpu {
    pid: u32,
    ticks: u64,
    /// Nanoseconds its threads were runnable but not running
    /// (/proc/PID/task/*/schedstat, threads alive now).
    waited_ns: u64,
}

impl ProcCpu {
    fn read(pid: u32) -> Option<ProcCpu> {
        Some(ProcCpu {
            pid,
            ticks: cpu_ticks_of(pid).ok()?,
            waited_ns: waited_for_cpu_ns(pid),
        })
    }
}

/// What /proc/stat's first line says of all CPUs together.
#[derive(Clone, Copy, Default)]
struct MachineTicks {
    busy: u64,
    all: u64,
}

/// Per group over a phase: CPU-seconds, and seconds its threads waited for
/// a CPU; and how busy the machine was.
pub struct CpuSpent {
    wall_s: f64,
    groups: Vec<(&'static str, Spent)>,
    harness_s: f64,
    /// The machine's busy time over its whole capacity in the phase.
    machine_busy: f64,
    cpus: usize,
}

impl CpuSnapshot {
    /// A group without processes (no balancers in this run) is left out.
    pub fn take(groups: &[Group<'_>]) -> Self {
        CpuSnapshot {
            at: Instant::now(),
            groups: groups
                .iter()
                .filter(|group| !group.procs.is_empty())
                .map(|group| {
                    let ticks = group
                        .procs
                        .iter()
                        .filter_map(|proc| ProcCpu::read(proc.pid()))
                        .collect();
                    (group.name, ticks)
                })
                .collect(),
            harness: cpu_ticks_of(std::process::id()).unwrap_or_default(),
            machine: machine_ticks().unwrap_or_default(),
        }
    }

    /// What was spent from `before` to this snapshot. A process of a group
    /// that started meanwhile (a restarted server) counts from zero; one
    /// gone meanwhile (a killed server) counts nothing.
    pub fn since(&self, before: &CpuSnapshot) -> CpuSpent {
        let earlier = |name: &str, pid: u32| {
            before
                .groups
                .iter()
                .find(|(group, _)| *group == name)
                .and_then(|(_, procs)| procs.iter().find(|earlier| earlier.pid == pid).copied())
        };
        let groups = self
            .groups
            .iter()
            .map(|(name, procs)| {
                let mut spent = Spent::default();
                for now in procs {
                    let (ticks, waited_ns) =
                        earlier(name, now.pid).map_or((0, 0), |e| (e.ticks, e.waited_ns));
                    spent.cpu_s += now.ticks.saturating_sub(ticks) as f64 / TICKS_PER_SECOND;
                    spent.waited_s += now.waited_ns.saturating_sub(waited_ns) as f64 / 1e9;
                }
                (*name, spent)
            })
            .collect();
        let all = self.machine.all.saturating_sub(before.machine.all);
        let busy = self.machine.busy.saturating_sub(before.machine.busy);
        CpuSpent {
            wall_s: self.at.duration_since(before.at).as_secs_f64(),
            groups,
            harness_s: self.harness.saturating_sub(before.harness) as f64 / TICKS_PER_SECOND,
            machine_busy: if all == 0 { 0.0 } else { busy as f64 / all as f64 },
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
        }
    }
}

impl CpuSpent {
    /// One table cell: every group's CPU-seconds, then the machine's load.
    pub fn cells(&self) -> String {
        let mut cells: Vec<String> = self
            .groups
            .iter()
            .map(|(name, spent)| format!("{name} {:.1} (waited {:.1})", spent.cpu_s, spent.waited_s))
            .collect();
        cells.push(format!("harness {:.1}", self.harness_s));
        format!(
            "{} CPU-s (s waited for a CPU) in {:.1} s; the machine {:.0}% busy of {} CPUs",
            cells.join(", "),
            self.wall_s,
            self.machine_busy * 100.0,
            self.cpus
        )
    }
}

/// A group's CPU-seconds and its threads' seconds waiting for a CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Spent {
    cpu_s: f64,
    waited_s: f64,
}

/// The run-queue wait of `pid`'s threads alive now: schedstat's second
/// field. A thread that ended meanwhile takes its share along, which for
/// the run's processes (long-lived runtime threads) is little.
fn waited_for_cpu_ns(pid: u32) -> u64 {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    threads
        .flatten()
        .filter_map(|thread| std::fs::read_to_string(thread.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// /proc/stat's `cpu` line: busy is everything but idle and iowait.
fn machine_ticks() -> anyhow::Result<MachineTicks> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat
        .lines()
        .find(|line| line.starts_with("cpu "))
        .ok_or_else(|| anyhow::anyhow!("/proc/stat has no cpu line"))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    // user nice system idle iowait irq softirq steal (guest time is
    // already in user).
    let all: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    Ok(MachineTicks {
        busy: all - idle,
        all,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process's (pid, ticks, waited ns).
    type Read = (u32, u64, u64);

    fn snapshot(at: Instant, groups: Vec<(&'static str, Vec<Read>)>, busy: u64, all: u64) -> CpuSnapshot {
        let procs = |procs: Vec<Read>| {
            procs
                .into_iter()
                .map(|(pid, ticks, waited_ns)| ProcCpu {
                    pid,
                    ticks,
                    waited_ns,
                })
                .collect()
        };
        CpuSnapshot {
            at,
            groups: groups
                .into_iter()
                .map(|(name, group)| (name, procs(group)))
                .collect(),
            harness: 0,
            machine: MachineTicks { busy, all },
        }
    }

    /// A server restarted in the phase counts from its start; one killed
    /// in it counts nothing; a group's processes add up.
    #[test]
    fn a_phase_counts_each_process_from_its_own_start() {
        let start = Instant::now();
        let before = snapshot(
            start,
            vec![
                ("servers", vec![(10, 500, 1_000_000_000), (11, 700, 0)]),
                ("node fleets", vec![(20, 100, 0)]),
            ],
            1_000,
            4_000,
        );
        let after = snapshot(
            start + std::time::Duration::from_secs(10),
            // Server 11 was killed and started again as 12.
            vec![
                ("servers", vec![(10, 650, 1_500_000_000), (12, 40, 250_000_000)]),
                ("node fleets", vec![(20, 900, 4_000_000_000)]),
            ],
            2_500,
            6_000,
        );
        let spent = after.since(&before);
        let spent_of = |cpu_s, waited_s| Spent { cpu_s, waited_s };
        assert_eq!(
            spent.groups,
            vec![
                ("servers", spent_of(1.9, 0.75)),
                ("node fleets", spent_of(8.0, 4.0))
            ]
        );
        assert_eq!(spent.machine_busy, 0.75);
        assert_eq!(spent.wall_s, 10.0);
    }

    #[test]
    fn this_machine_reads() {
        let machine = machine_ticks().unwrap();
        assert!(machine.busy > 0 && machine.busy < machine.all);
        assert!(ProcCpu::read(std::process::id()).is_some());
        assert_eq!(ProcCpu::read(u32::MAX), None, "no such process");
    }
}
