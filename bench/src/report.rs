//! The table: each figure for the direct route and each tunneled one, with
//! the tunneled figure's ratio to direct and the budget it is held to.

use std::fmt::Write;
use std::time::Duration;

use crate::args::RunArgs;
use crate::scenarios::{StallResult, median};

/// Everything measured on one route; one entry per run where repeated.
#[derive(Default)]
pub struct Figures {
    pub one_stream: Vec<f64>,
    pub one_stream_down: Vec<f64>,
    pub eight_streams: Vec<f64>,
    pub rtt_p50: Vec<Duration>,
    pub rtt_p99: Vec<Duration>,
    pub setups_per_second: Vec<f64>,
    pub dial_p50: Vec<Duration>,
    pub memory_per_connection: Option<f64>,
    pub beside_stalled: Option<StallResult>,
    /// The Go client's figures (direct, CONNECT and single-use gRPC routes).
    pub go: GoFigures,
}

/// What `bench/go/connect-client.go` measured, one entry per run.
#[derive(Default)]
pub struct GoFigures {
    pub upload: Vec<f64>,
    pub download: Vec<f64>,
    pub rtt_p50_us: Vec<f64>,
    pub rtt_p99_us: Vec<f64>,
    /// Dial, one 1 KiB round trip and close, one connection at a time.
    pub dials_per_second: Vec<f64>,
    pub dial_p50_us: Vec<f64>,
}

#[derive(Default)]
pub struct Table {
    routes: Vec<(&'static str, Figures)>,
}

/// How a row's figure is shown and compared.
struct Row {
    name: &'static str,
    unit: &'static str,
    budget: &'static str,
    value: fn(&mut Figures) -> Option<f64>,
}

fn mib(bytes_per_second: f64) -> f64 {
    bytes_per_second / (1024.0 * 1024.0)
}

fn median_micros(values: &[Duration]) -> Option<f64> {
    let mut micros: Vec<f64> = values.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    (!micros.is_empty()).then(|| median(&mut micros))
}

fn median_of(values: &[f64]) -> Option<f64> {
    let mut values = values.to_vec();
    (!values.is_empty()).then(|| median(&mut values))
}

const ROWS: &[Row] = &[
    Row {
        name: "throughput, 1 stream",
        unit: "MiB/s",
        budget: ">= 0.35x direct",
        value: |f| median_of(&f.one_stream).map(mib),
    },
    Row {
        name: "throughput, 1 stream down",
        unit: "MiB/s",
        budget: ">= 0.35x direct",
        value: |f| median_of(&f.one_stream_down).map(mib),
    },
    Row {
        name: "throughput, 8 streams",
        unit: "MiB/s",
        budget: "",
        value: |f| median_of(&f.eight_streams).map(mib),
    },
    Row {
        name: "1 KiB round trip p50",
        unit: "us",
        budget: "<= 3x direct",
        value: |f| median_micros(&f.rtt_p50),
    },
    Row {
        name: "1 KiB round trip p99",
        unit: "us",
        budget: "",
        value: |f| median_micros(&f.rtt_p99),
    },
    Row {
        name: "new connections",
        unit: "conn/s",
        budget: ">= 5000/s",
        value: |f| median_of(&f.setups_per_second),
    },
    Row {
        name: "dial latency p50",
        unit: "us",
        budget: "",
        value: |f| median_micros(&f.dial_p50),
    },
    Row {
        name: "RSS per idle connection",
        unit: "KiB",
        budget: "<= 8 KiB",
        value: |f| f.memory_per_connection.map(|bytes| bytes / 1024.0),
    },
    Row {
        name: "beside stalled conns",
        unit: "MiB/s",
        budget: "not stalled",
        value: |f| {
            f.beside_stalled
                .as_ref()
                .map(|stall| stall.throughput.map_or(0.0, mib))
        },
    },
    Row {
        name: "Go client: 1 stream up",
        unit: "MiB/s",
        budget: ">= 0.35x direct",
        value: |f| median_of(&f.go.upload).map(mib),
    },
    Row {
        name: "Go client: 1 stream down",
        unit: "MiB/s",
        budget: ">= 0.35x direct",
        value: |f| median_of(&f.go.download).map(mib),
    },
    Row {
        name: "Go client: 1 KiB round trip p50",
        unit: "us",
        budget: "<= 3x direct",
        value: |f| median_of(&f.go.rtt_p50_us),
    },
    Row {
        name: "Go client: 1 KiB round trip p99",
        unit: "us",
        budget: "",
        value: |f| median_of(&f.go.rtt_p99_us),
    },
    Row {
        name: "Go client: dial + round trip + close, 1 at a time",
        unit: "conn/s",
        budget: ">= 0.5x direct",
        value: |f| median_of(&f.go.dials_per_second),
    },
    Row {
        name: "Go client: dial + round trip + close p50",
        unit: "us",
        budget: "",
        value: |f| median_of(&f.go.dial_p50_us),
    },
];

impl Table {
    pub fn add(&mut self, route: &'static str, figures: Figures) {
        self.routes.push((route, figures));
    }

    /// A Markdown table, ready for the README.
    pub fn render(&mut self, args: &RunArgs) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "median of {} runs; {} MiB per transfer; {} round trips; {} set-ups (16 at a time); {} idle connections; {} Go client dials",
            args.runs,
            args.bytes >> 20,
            args.round_trips,
            args.setups,
            args.idle,
            args.go_dials
        );
        let _ = writeln!(out);
        let mut header = String::from("| figure | unit |");
        let mut rule = String::from("|---|---|");
        for (name, _) in &self.routes {
            if *name == "direct" {
                header.push_str(" direct |");
                rule.push_str("---:|");
            } else {
                let _ = write!(header, " {name} | ratio |");
                rule.push_str("---:|---:|");
            }
        }
        header.push_str(" budget |");
        rule.push_str("---|");
        let _ = writeln!(out, "{header}\n{rule}");
        for row in ROWS {
            let mut line = format!("| {} | {} |", row.name, row.unit);
            let mut direct = None;
            for (name, figures) in &mut self.routes {
                let value = (row.value)(figures);
                if *name == "direct" {
                    direct = value;
                    let _ = write!(line, " {} |", show(value));
                } else {
                    let ratio = match (value, direct) {
                        (Some(v), Some(d)) if d > 0.0 => format!("{:.2}x", v / d),
                        _ => "-".to_owned(),
                    };
                    let _ = write!(line, " {} | {ratio} |", show(value));
                }
            }
            let _ = write!(line, " {} |", row.budget);
            let _ = writeln!(out, "{line}");
        }
        for (name, figures) in &self.routes {
            if let Some(StallResult {
                throughput: None,
                moved,
            }) = &figures.beside_stalled
            {
                let _ = writeln!(
                    out,
                    "\n{name}: the transfer beside stalled connections did not finish; {} MiB moved",
                    moved >> 20
                );
            }
        }
        out
    }
}

fn show(value: Option<f64>) -> String {
    match value {
        None => "-".to_owned(),
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.1}"),
    }
}
