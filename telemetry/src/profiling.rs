//! `/debug/pprof/profile`: a CPU profile in pprof's format, which `go tool
//! pprof` reads as it reads upstream's (`--enable-profiling`).
//!
//! The samples come from [`konnectivity_plumbing::sys::cpu_samples`]; this module counts
//! identical stacks, names their addresses in-process (as Go does, so that
//! the profile opens anywhere without the binary), and encodes the result.
//! Names need the binary's symbol table and lines its line tables: the
//! image keeps the first and drops the second.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use prost::Message;

use konnectivity_plumbing::sys::cpu_samples::{CpuSampling, SAMPLE_HZ, SamplingError};

/// Go's profiling flags, as upstream's server and agent both take them.
#[derive(clap::Args, Debug, Clone)]
pub struct ProfilingArgs {
    /// Serve /debug/pprof/ on the admin port: a CPU profile (/debug/pprof/profile?seconds=N) in pprof's format, and the
    /// command line. Off by default, as upstream.
    #[arg(long, value_parser = konnectivity_plumbing::flags::parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = clap::ArgAction::Set)]
    pub enable_profiling: bool,
    /// Go's lock-contention (block) profile. Not applied: it is the Go runtime's, and a Rust program has no counterpart
    /// (accepted for upstream compatibility; needs --enable-profiling, as upstream).
    #[arg(long, value_parser = konnectivity_plumbing::flags::parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = clap::ArgAction::Set)]
    pub enable_contention_profiling: bool,
}

impl ProfilingArgs {
    /// The flag at fault and why, when the two flags do not go together
    /// (upstream refuses contention profiling without profiling).
    pub fn problem(&self) -> Option<(&'static str, &'static str)> {
        (self.enable_contention_profiling && !self.enable_profiling)
            .then_some(("enable-contention-profiling", "needs --enable-profiling"))
    }
}

/// Go's default when the request names no duration.
pub const DEFAULT_SECONDS: u64 = 30;
/// The longest profile a request may ask for (Go sets no limit; a day
/// keeps a typo from holding the profiler for years).
pub const MAX_SECONDS: u64 = 86_400;
/// How often the ring of samples is emptied while profiling.
const DRAIN_EVERY: Duration = Duration::from_millis(25);

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("could not enable CPU profiling: {0}")]
    Sampling(#[from] SamplingError),
    #[error("the profiling thread failed: {0}")]
    Thread(#[from] tokio::task::JoinError),
}

impl ProfileError {
    /// A second profile while one runs is the caller's to retry, as in Go.
    pub fn is_busy(&self) -> bool {
        matches!(self, ProfileError::Sampling(SamplingError::InUse))
    }
}

/// Samples the whole process's CPU use for `duration` and returns the
/// profile as Go's runtime/pprof writes it: the protobuf, gzip-compressed
/// at the fastest level. `go tool pprof` reads it either way; scrapers
/// written for Go's endpoint (continuous profilers) may expect gzip.
pub async fn cpu_profile(duration: Duration) -> Result<Vec<u8>, ProfileError> {
    let sampling = CpuSampling::start()?;
    // The wait, the naming of addresses and the compression are blocking
    // work; a thread of the blocking pool does them, off the runtime's
    // workers.
    let profile =
        tokio::task::spawn_blocking(move || gzip(&record(&sampling, duration).encode_to_vec())).await?;
    Ok(profile)
}

fn gzip(encoded: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut compressed = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    compressed.write_all(encoded).expect("writing to a Vec");
    compressed.finish().expect("writing to a Vec")
}

/// What identifies a sampled stack: the thread's name and its addresses.
type Stack = (Vec<u8>, Vec<usize>);

fn record(sampling: &CpuSampling, duration: Duration) -> format::Profile {
    let started = SystemTime::now();
    let start = Instant::now();
    let mut counts: HashMap<Stack, i64> = HashMap::new();
    let mut count = |sample: konnectivity_plumbing::sys::cpu_samples::Sample<'_>| {
        *counts
            .entry((sample.thread.to_vec(), sample.frames.to_vec()))
            .or_default() += 1;
    };
    while start.elapsed() < duration {
        std::thread::sleep(DRAIN_EVERY.min(duration.saturating_sub(start.elapsed())));
        sampling.drain(&mut count);
    }
    sampling.stop();
    sampling.drain(&mut count);
    let lost = sampling.lost();
    let profile = ProfileBuilder::default().build(counts, started, start.elapsed(), lost);
    // Naming addresses loads the binary's symbol and line tables: 32 MiB
    // of heap for a binary with symbols only, 69 MiB with line tables.
    // Kept (by the cache, then by the allocator), they would stay resident
    // for the life of the process; a profile is rare, so they are read
    // again each time.
    backtrace::clear_symbol_cache();
    konnectivity_plumbing::sys::give_back_cached_memory();
    profile
}

/// Builds the profile's tables: strings, functions and locations each
/// stored once and referred to by index or id.
#[derive(Default)]
struct ProfileBuilder {
    /// The process's executable regions, as `/proc/self/maps` lists them.
    mappings: Vec<format::Mapping>,
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<format::Function>,
    function_ids: HashMap<(String, String), u64>,
    locations: Vec<format::Location>,
    location_ids: HashMap<usize, u64>,
}

impl ProfileBuilder {
    fn build(
        mut self,
        counts: HashMap<Stack, i64>,
        started: SystemTime,
        took: Duration,
        lost: u64,
    ) -> format::Profile {
        self.string(""); // index 0 is the empty string, by the format's rule
        self.map_executable_regions();
        let period = 1_000_000_000 / i64::from(SAMPLE_HZ);
        let cpu = self.value_type("cpu", "nanoseconds");
        let sample_type = vec![self.value_type("samples", "count"), cpu.clone()];
        let thread = self.string("thread");
        let mut samples = Vec::with_capacity(counts.len());
        for ((thread_name, frames), count) in counts {
            let location_id = frames
                .iter()
                .enumerate()
                // The first address is the interrupted instruction; the
                // others return addresses, whose call is the byte before.
                .map(|(depth, &address)| self.location(if depth == 0 { address } else { address - 1 }))
                .collect();
            let thread_name = self.string(&String::from_utf8_lossy(&thread_name));
            samples.push(format::Sample {
                location_id,
                value: vec![count, count * period],
                label: vec![format::Label {
                    key: thread,
                    str: thread_name,
                }],
            });
        }
        let comment = if lost > 0 {
            vec![self.string(&format!("{lost} samples lost: the ring of samples was full"))]
        } else {
            Vec::new()
        };
        format::Profile {
            sample_type,
            sample: samples,
            mapping: self.mappings,
            location: self.locations,
            function: self.functions,
            string_table: self.strings,
            time_nanos: started
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as i64,
            duration_nanos: took.as_nanos() as i64,
            period_type: Some(cpu),
            period,
            comment,
        }
    }

    fn string(&mut self, text: &str) -> i64 {
        if let Some(&id) = self.string_ids.get(text) {
            return id;
        }
        let id = self.strings.len() as i64;
        self.strings.push(text.to_owned());
        self.string_ids.insert(text.to_owned(), id);
        id
    }

    fn value_type(&mut self, kind: &str, unit: &str) -> format::ValueType {
        format::ValueType {
            r#type: self.string(kind),
            unit: self.string(unit),
        }
    }

    /// The location of one code address, named with the functions (several
    /// when calls were inlined, innermost first) and lines found there.
    fn location(&mut self, address: usize) -> u64 {
        if let Some(&id) = self.location_ids.get(&address) {
            return id;
        }
        let mut found = Vec::new();
        // `resolve` looks up the byte before the address it is given (it
        // expects return addresses); `address` is already the one to name.
        backtrace::resolve((address + 1) as *mut std::ffi::c_void, |symbol| {
            let Some(name) = symbol.name() else { return };
            let file = symbol
                .filename()
                .map(|path| path.display().to_string())
                .unwrap_or_default();
            found.push((
                format!("{name:#}"),
                String::from_utf8_lossy(name.as_bytes()).into_owned(),
                file,
                symbol.lineno().unwrap_or(0),
            ));
        });
        let line = found
            .into_iter()
            .map(|(name, system_name, file, line)| format::Line {
                function_id: self.function(name, system_name, file),
                line: i64::from(line),
            })
            .collect();
        let id = self.locations.len() as u64 + 1;
        let address = address as u64;
        let mapping_id = self
            .mappings
            .iter()
            .find(|mapping| (mapping.memory_start..mapping.memory_limit).contains(&address))
            .or(self.mappings.first())
            .map_or(0, |mapping| mapping.id);
        self.locations.push(format::Location {
            id,
            mapping_id,
            address,
            line,
        });
        self.location_ids.insert(address as usize, id);
        id
    }

    /// One mapping per executable region of the process, each marked as
    /// named already: `go tool pprof` then shows the names found here
    /// instead of asking the server to name addresses (`/debug/pprof/symbol`)
    /// or looking for the binary on the reader's machine. An address in no
    /// region (none expected) goes with the first, the executable.
    fn map_executable_regions(&mut self) {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        for region in maps.lines() {
            // start-limit perms offset device inode [path]
            let fields: Vec<&str> = region.split_whitespace().collect();
            let (Some(range), Some(perms), Some(offset)) = (fields.first(), fields.get(1), fields.get(2))
            else {
                continue;
            };
            let Some((start, limit)) = range.split_once('-') else {
                continue;
            };
            let hex = |text: &str| u64::from_str_radix(text, 16).ok();
            let (Some(memory_start), Some(memory_limit), Some(file_offset)) =
                (hex(start), hex(limit), hex(offset))
            else {
                continue;
            };
            if !perms.contains('x') {
                continue;
            }
            let filename = self.string(fields.get(5).copied().unwrap_or_default());
            self.mappings.push(format::Mapping {
                id: self.mappings.len() as u64 + 1,
                memory_start,
                memory_limit,
                file_offset,
                filename,
                has_functions: true,
                has_filenames: true,
                has_line_numbers: true,
                has_inline_frames: true,
            });
        }
    }

    fn function(&mut self, name: String, system_name: String, file: String) -> u64 {
        let key = (name, file);
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let function = format::Function {
            id,
            name: self.string(&key.0),
            system_name: self.string(&system_name),
            filename: self.string(&key.1),
        };
        self.functions.push(function);
        self.function_ids.insert(key, id);
        id
    }
}

/// The messages of pprof's `profile.proto` (package perftools.profiles)
/// that a CPU profile uses, with the format's field numbers.
mod format {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process has one profiler; these tests take turns.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// Burns CPU until told to stop; its name must show in the profile.
    #[inline(never)]
    fn spin_until(stop: &std::sync::atomic::AtomicBool) -> u64 {
        let mut x = 1u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        x
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_profile_names_the_function_that_used_the_cpu_and_its_thread() {
        let _turn = ONE_AT_A_TIME.lock().await;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinner = std::thread::Builder::new()
            .name("busy-spinner".into())
            .spawn({
                let stop = stop.clone();
                move || spin_until(&stop)
            })
            .unwrap();
        let encoded = cpu_profile(Duration::from_secs(1)).await.unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spinner.join().unwrap();

        // gzip, as Go's: its magic, then the protobuf.
        assert_eq!(encoded[..2], [0x1f, 0x8b], "a gzip stream");
        let mut decompressed = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(encoded.as_slice()),
            &mut decompressed,
        )
        .unwrap();
        let profile = format::Profile::decode(decompressed.as_slice()).unwrap();
        let text = |id: i64| profile.string_table[id as usize].as_str();
        assert_eq!(text(0), "");
        assert_eq!(profile.period, 10_000_000);
        let spinner_samples: i64 = profile
            .sample
            .iter()
            .filter(|sample| sample.label.iter().any(|label| text(label.str) == "busy-spinner"))
            .map(|sample| sample.value[0])
            .sum();
        // One second of one busy thread at 100 Hz: about 100 samples; the
        // machine's other work may take some of its CPU.
        assert!((30..=130).contains(&spinner_samples), "{spinner_samples} samples");
        let names: Vec<&str> = profile
            .function
            .iter()
            .map(|function| text(function.name))
            .collect();
        assert!(
            names.iter().any(|name| name.ends_with("spin_until")),
            "no spin_until among {names:?}"
        );
        // The leaf of the spinner's samples is in spin_until itself (or
        // what was inlined into it), and no frame is the signal handler's.
        let spinner_stacks: Vec<Vec<Vec<&str>>> = profile
            .sample
            .iter()
            .filter(|sample| sample.label.iter().any(|label| text(label.str) == "busy-spinner"))
            .map(|sample| {
                sample
                    .location_id
                    .iter()
                    .map(|&id| {
                        profile.location[id as usize - 1]
                            .line
                            .iter()
                            .map(|line| text(profile.function[line.function_id as usize - 1].name))
                            .collect()
                    })
                    .collect()
            })
            .collect();
        assert!(
            spinner_stacks
                .iter()
                .any(|stack| stack[0].iter().any(|name| name.ends_with("spin_until"))),
            "{spinner_stacks:?}"
        );
        assert!(
            spinner_stacks
                .iter()
                .flatten()
                .flatten()
                .all(|name| !name.contains("on_sigprof")),
            "{spinner_stacks:?}"
        );
    }

    #[tokio::test]
    async fn one_profile_at_a_time() {
        let _turn = ONE_AT_A_TIME.lock().await;
        let first = tokio::spawn(cpu_profile(Duration::from_millis(500)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let second = cpu_profile(Duration::from_millis(10)).await;
        assert!(
            second.as_ref().is_err_and(ProfileError::is_busy),
            "{:?}",
            second.map(|p| p.len())
        );
        assert!(first.await.unwrap().is_ok());
        // Once the first is done, the next may start.
        assert!(cpu_profile(Duration::from_millis(10)).await.is_ok());
    }
}
