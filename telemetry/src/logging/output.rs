//! Where log lines go, decided as klog decides it, so that upstream's
//! manifests log where they did: `--logtostderr` (the default) writes every
//! line to standard error and nothing to files; `--logtostderr=false`
//! writes to `--log-file` (or, without one, a file per severity in
//! `--log-dir`) and copies to standard error the lines at or above a
//! threshold.
//!
//! Each line is written with one `write` call as it is logged, without
//! klog's buffering, so a crash loses nothing. A file that cannot be
//! written is reported once on standard error, and its lines go there
//! instead: logging never stops the binary (klog would exit).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

use crate::logging::civil::Civil;

/// klog's severities, in increasing order; `FATAL` is accepted in flags
/// but nothing here logs at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Info = 0,
    Warning = 1,
    Error = 2,
    Fatal = 3,
}

impl Severity {
    const NAMES: [&'static str; 4] = ["INFO", "WARNING", "ERROR", "FATAL"];

    fn of(level: &Level) -> Severity {
        match *level {
            Level::ERROR => Severity::Error,
            Level::WARN => Severity::Warning,
            _ => Severity::Info,
        }
    }

    /// A threshold as klog reads it: a name in any case or a number.
    pub fn parse(text: &str) -> Result<Severity, String> {
        let by_name = Self::NAMES
            .iter()
            .position(|name| name.eq_ignore_ascii_case(text));
        let index = match by_name {
            Some(index) => index as i64,
            None => text
                .parse::<i64>()
                .map_err(|_| format!("want INFO, WARNING, ERROR, FATAL or 0-3, got {text:?}"))?,
        };
        // klog takes any number; below INFO is everything, above FATAL nothing.
        Ok(match index {
            ..=0 => Severity::Info,
            1 => Severity::Warning,
            2 => Severity::Error,
            _ => Severity::Fatal,
        })
    }
}

/// The klog flags that choose destinations.
#[derive(Debug, Clone)]
pub struct Destinations {
    /// `--logtostderr`.
    pub to_stderr: bool,
    /// `--alsologtostderr`.
    pub also_to_stderr: bool,
    /// `--stderrthreshold`.
    pub stderr_threshold: Severity,
    /// `--alsologtostderrthreshold`.
    pub also_to_stderr_threshold: Severity,
    /// `--legacy-stderr-threshold-behavior`.
    pub legacy_stderr_threshold_behavior: bool,
    /// `--log-file`.
    pub log_file: Option<PathBuf>,
    /// `--log-file-max-size` in bytes; `None` is no limit.
    pub log_file_max_bytes: Option<u64>,
    /// `--log-dir`; the system's temporary directory when `None`.
    pub log_dir: Option<PathBuf>,
    /// `--one-output`.
    pub one_output: bool,
    /// `--skip-log-headers`.
    pub skip_log_headers: bool,
}

impl Destinations {
    /// What a binary given no logging flag does.
    pub fn stderr() -> Self {
        Destinations {
            to_stderr: true,
            also_to_stderr: false,
            stderr_threshold: Severity::Error,
            also_to_stderr_threshold: Severity::Info,
            legacy_stderr_threshold_behavior: true,
            log_file: None,
            log_file_max_bytes: None,
            log_dir: None,
            one_output: false,
            skip_log_headers: false,
        }
    }

    /// Whether a line of `severity` is written to standard error.
    pub fn stderr_gets(&self, severity: Severity) -> bool {
        if self.to_stderr {
            self.legacy_stderr_threshold_behavior || severity >= self.stderr_threshold
        } else if self.also_to_stderr {
            severity >= self.also_to_stderr_threshold
        } else {
            severity >= self.stderr_threshold
        }
    }
}

/// klog's fixed limit for the files in `--log-dir`: past it, a new file.
const LOG_DIR_FILE_MAX_BYTES: u64 = 1800 * 1024 * 1024;

/// The log's destinations, shared by every thread that logs.
pub struct Output {
    destinations: Destinations,
    files: Option<Mutex<Files>>,
}

enum Files {
    /// `--log-file`: every line, one file.
    One(LogFile),
    /// `--log-dir`: a file per severity, each made when first needed.
    PerSeverity {
        dirs: Vec<PathBuf>,
        names: FileNames,
        open: Box<[Slot; 4]>,
    },
}

/// A severity's file in `--log-dir`.
enum Slot {
    NotYet,
    Open(LogFile),
    /// It could not be created; reported once.
    Failed,
}

impl Output {
    /// Opens `--log-file` now, so that a path that cannot be written stops
    /// start-up naming the flag rather than losing the log.
    pub fn open(destinations: Destinations) -> std::io::Result<Output> {
        let files = if destinations.to_stderr {
            None
        } else if let Some(path) = &destinations.log_file {
            let max = destinations.log_file_max_bytes.unwrap_or(u64::MAX);
            let file = LogFile::open(path, max, destinations.skip_log_headers, true).map_err(|error| {
                std::io::Error::new(
                    error.kind(),
                    format!(
                        "--log-file={}: cannot open it for writing: {error}",
                        path.display()
                    ),
                )
            })?;
            Some(Files::One(file))
        } else {
            let mut dirs: Vec<PathBuf> = destinations.log_dir.iter().cloned().collect();
            dirs.push(std::env::temp_dir());
            Some(Files::PerSeverity {
                dirs,
                names: FileNames::of_this_process(),
                open: Box::new([Slot::NotYet, Slot::NotYet, Slot::NotYet, Slot::NotYet]),
            })
        };
        Ok(Output {
            destinations,
            files: files.map(Mutex::new),
        })
    }

    pub fn destinations(&self) -> &Destinations {
        &self.destinations
    }

    fn write_line(&self, severity: Severity, line: &[u8]) {
        let mut to_stderr = self.destinations.stderr_gets(severity);
        if let Some(files) = &self.files {
            let mut files = files.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Err(problem) = files.write(severity, line, &self.destinations) {
                // Once per file: the file is dropped and its lines go to
                // standard error from now on.
                let _ = writeln!(std::io::stderr(), "{problem}; its lines go to standard error");
            }
            to_stderr |= files.lost(severity);
        }
        if to_stderr {
            let _ = std::io::stderr().write_all(line);
        }
    }
}

impl Files {
    /// Writes `line` where it belongs; an error says which file failed.
    fn write(&mut self, severity: Severity, line: &[u8], destinations: &Destinations) -> Result<(), String> {
        match self {
            // At its limit, --log-file is emptied and written again.
            Files::One(file) => file.write(line, |file| {
                *file = LogFile::open(&file.path, file.max_bytes, file.skip_header, false)
                    .map_err(|error| format!("starting log file {} over: {error}", file.path.display()))?;
                Ok(())
            }),
            Files::PerSeverity { dirs, names, open } => {
                // A line goes to its severity's file and, unless
                // --one-output, to every lower severity's.
                let lowest = if destinations.one_output {
                    severity as usize
                } else {
                    0
                };
                let mut problem = Ok(());
                for index in (lowest..=severity as usize).rev() {
                    let tag = Severity::NAMES[index];
                    let reopen =
                        |startup: bool| names.create(dirs, tag, destinations.skip_log_headers, startup);
                    if matches!(open[index], Slot::NotYet) {
                        open[index] = match reopen(true) {
                            Ok(file) => Slot::Open(file),
                            Err(error) => {
                                problem = Err(error);
                                Slot::Failed
                            }
                        };
                    }
                    if let Slot::Open(file) = &mut open[index] {
                        let written = file.write(line, |file| {
                            *file = reopen(false)?;
                            Ok(())
                        });
                        problem = problem.and(written);
                    }
                }
                problem
            }
        }
    }

    /// Whether lines of `severity` have no file any more.
    fn lost(&self, severity: Severity) -> bool {
        match self {
            Files::One(file) => file.failed,
            Files::PerSeverity { open, .. } => match &open[severity as usize] {
                Slot::NotYet => false,
                Slot::Open(file) => file.failed,
                Slot::Failed => true,
            },
        }
    }
}

/// One open log file and how much it holds.
struct LogFile {
    path: PathBuf,
    file: File,
    bytes: u64,
    max_bytes: u64,
    skip_header: bool,
    /// A write failed: reported once, nothing more written to it.
    failed: bool,
}

impl LogFile {
    /// Opens `path`, appending at start-up (a restarted binary keeps its
    /// earlier lines) and truncating when it starts over, as klog does.
    fn open(path: &Path, max_bytes: u64, skip_header: bool, startup: bool) -> std::io::Result<LogFile> {
        let file = if startup {
            std::fs::OpenOptions::new().create(true).append(true).open(path)?
        } else {
            File::create(path)?
        };
        let bytes = file.metadata()?.len();
        let mut log = LogFile {
            path: path.to_owned(),
            file,
            bytes,
            max_bytes,
            skip_header,
            failed: false,
        };
        log.write_header()?;
        Ok(log)
    }

    /// klog's four header lines, which log tools skip by their shape.
    fn write_header(&mut self) -> std::io::Result<()> {
        if self.skip_header {
            return Ok(());
        }
        let civil = Civil::now();
        let header = format!(
            "Log file created at: {:04}/{:02}/{:02} {:02}:{:02}:{:02}\n\
             Running on machine: {}\n\
             Binary: Built with rustc for {}/{}\n\
             Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg\n",
            civil.year,
            civil.month,
            civil.day,
            civil.hour,
            civil.minute,
            civil.second,
            short_hostname(),
            std::env::consts::OS,
            go_arch(),
        );
        self.file.write_all(header.as_bytes())?;
        self.bytes += header.len() as u64;
        Ok(())
    }

    /// Writes one line; a file that would pass its limit is first replaced
    /// by `start_over` (klog's rotation: the same file emptied for
    /// --log-file, a new one in --log-dir).
    fn write(
        &mut self,
        line: &[u8],
        start_over: impl FnOnce(&mut LogFile) -> Result<(), String>,
    ) -> Result<(), String> {
        if self.failed {
            return Ok(());
        }
        if self.bytes.saturating_add(line.len() as u64) >= self.max_bytes
            && let Err(problem) = start_over(self)
        {
            self.failed = true;
            return Err(problem);
        }
        match self.file.write_all(line) {
            Ok(()) => {
                self.bytes += line.len() as u64;
                Ok(())
            }
            Err(error) => {
                self.failed = true;
                Err(format!("writing log file {}: {error}", self.path.display()))
            }
        }
    }
}

/// The names klog gives the files in `--log-dir`:
/// `PROGRAM.HOST.USER.log.SEVERITY.YYYYMMDD-HHMMSS.PID`, with a symbolic
/// link `PROGRAM.SEVERITY` to the newest. Times are UTC, as in the lines.
struct FileNames {
    program: String,
    host: String,
    user: String,
    pid: u32,
}

impl FileNames {
    fn of_this_process() -> Self {
        let program = std::env::args_os()
            .next()
            .map(PathBuf::from)
            .and_then(|path| path.file_name().map(|name| name.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "konnectivity".to_owned());
        let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
            .ok()
            .flatten()
            .map_or_else(|| "unknownuser".to_owned(), |user| user.name);
        FileNames {
            program,
            host: short_hostname(),
            user,
            pid: std::process::id(),
        }
    }

    /// Creates the newest file for `tag` in the first directory that
    /// takes it.
    fn create(
        &self,
        dirs: &[PathBuf],
        tag: &str,
        skip_header: bool,
        startup: bool,
    ) -> Result<LogFile, String> {
        let civil = Civil::now();
        let name = format!(
            "{}.{}.{}.log.{tag}.{:04}{:02}{:02}-{:02}{:02}{:02}.{}",
            self.program,
            self.host,
            self.user,
            civil.year,
            civil.month,
            civil.day,
            civil.hour,
            civil.minute,
            civil.second,
            self.pid
        );
        let mut problems = Vec::new();
        for dir in dirs {
            match LogFile::open(&dir.join(&name), LOG_DIR_FILE_MAX_BYTES, skip_header, startup) {
                Ok(file) => {
                    let link = dir.join(format!("{}.{tag}", self.program));
                    let _ = std::fs::remove_file(&link);
                    let _ = std::os::unix::fs::symlink(&name, &link);
                    return Ok(file);
                }
                Err(error) => problems.push(format!("{}: {error}", dir.display())),
            }
        }
        Err(format!(
            "cannot create log file {name} (--log-dir): {}",
            problems.join("; ")
        ))
    }
}

fn short_hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|name| name.into_string().ok())
        .map(|name| name.split('.').next().unwrap_or_default().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknownhost".to_owned())
}

/// The architecture as Go names it in that header line.
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Hands the formatter a writer that knows the event's severity.
pub struct OutputWriter(pub std::sync::Arc<Output>);

/// One event's writer: the formatter writes the whole line at once.
pub struct LineWriter<'a> {
    output: &'a Output,
    severity: Severity,
}

impl<'a> MakeWriter<'a> for OutputWriter {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            output: &self.0,
            severity: Severity::Info,
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        LineWriter {
            output: &self.0,
            severity: Severity::of(meta.level()),
        }
    }
}

impl Write for LineWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.output.write_line(self.severity, bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of the test's own, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let path = std::env::temp_dir().join(format!("konn-log-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Scratch(path)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn to_files() -> Destinations {
        Destinations {
            to_stderr: false,
            ..Destinations::stderr()
        }
    }

    #[test]
    fn standard_error_gets_what_klog_sends_it() {
        use Severity::*;
        let cases = [
            // --logtostderr (the default): everything, whatever the threshold...
            (Destinations::stderr(), [true, true, true]),
            // ...unless the legacy behaviour is turned off.
            (
                Destinations {
                    legacy_stderr_threshold_behavior: false,
                    stderr_threshold: Warning,
                    ..Destinations::stderr()
                },
                [false, true, true],
            ),
            // To files: ERROR and above by default...
            (to_files(), [false, false, true]),
            // ...everything from --alsologtostderrthreshold (INFO) with --alsologtostderr.
            (
                Destinations {
                    also_to_stderr: true,
                    ..to_files()
                },
                [true, true, true],
            ),
            (
                Destinations {
                    also_to_stderr: true,
                    also_to_stderr_threshold: Error,
                    ..to_files()
                },
                [false, false, true],
            ),
        ];
        for (destinations, expected) in cases {
            let got = [Info, Warning, Error].map(|severity| destinations.stderr_gets(severity));
            assert_eq!(got, expected, "{destinations:?}");
        }
    }

    #[test]
    fn thresholds_parse_as_klog_parses_them() {
        assert_eq!(Severity::parse("warning"), Ok(Severity::Warning));
        assert_eq!(Severity::parse("ERROR"), Ok(Severity::Error));
        assert_eq!(Severity::parse("2"), Ok(Severity::Error));
        assert_eq!(Severity::parse("7"), Ok(Severity::Fatal));
        assert_eq!(Severity::parse("-1"), Ok(Severity::Info));
        assert!(
            Severity::parse("loud")
                .unwrap_err()
                .contains("INFO, WARNING, ERROR, FATAL")
        );
    }

    #[test]
    fn a_log_file_at_its_limit_is_emptied_and_starts_with_its_header_again() {
        let scratch = Scratch::new("rotate");
        let path = scratch.0.join("server.log");
        std::fs::write(&path, "from the last run\n").unwrap();
        let output = Output::open(Destinations {
            log_file: Some(path.clone()),
            log_file_max_bytes: Some(300),
            ..to_files()
        })
        .unwrap();
        // Kept at start-up: a restarted binary appends.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("from the last run\nLog file created at: "),
            "{text}"
        );
        for n in 0..20 {
            output.write_line(Severity::Info, format!("line {n:02}\n").as_bytes());
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.len() < 300, "{} bytes", text.len());
        assert!(text.starts_with("Log file created at: "), "{text}");
        assert!(!text.contains("from the last run"), "{text}");
        assert!(text.ends_with("line 19\n"), "{text}");
        assert!(text.contains("Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg\n"));
    }

    #[test]
    fn a_log_file_that_cannot_be_opened_stops_start_up_naming_the_flag() {
        let scratch = Scratch::new("unopenable");
        let path = scratch.0.join("no-such-dir/server.log");
        let error = Output::open(Destinations {
            log_file: Some(path.clone()),
            ..to_files()
        })
        .err()
        .expect("no error");
        assert!(
            error
                .to_string()
                .starts_with(&format!("--log-file={}: cannot open", path.display())),
            "{error}"
        );
    }

    #[test]
    fn log_dir_files_hold_their_severity_and_every_higher_one_unless_one_output() {
        for one_output in [false, true] {
            let scratch = Scratch::new(&format!("dir-{one_output}"));
            let output = Output::open(Destinations {
                log_dir: Some(scratch.0.clone()),
                one_output,
                skip_log_headers: true,
                ..to_files()
            })
            .unwrap();
            output.write_line(Severity::Info, b"an info line\n");
            output.write_line(Severity::Warning, b"a warning line\n");
            let program = FileNames::of_this_process().program;
            let read = |tag: &str| std::fs::read_to_string(scratch.0.join(format!("{program}.{tag}")));
            let info = read("INFO").unwrap();
            let warning = read("WARNING").unwrap();
            assert_eq!(warning, "a warning line\n");
            if one_output {
                assert_eq!(info, "an info line\n");
            } else {
                assert_eq!(info, "an info line\na warning line\n");
            }
            assert!(read("ERROR").is_err(), "no ERROR file before an error");
            // The links point at klog-named files.
            let target = std::fs::read_link(scratch.0.join(format!("{program}.INFO"))).unwrap();
            let name = target.to_string_lossy();
            assert!(name.starts_with(&format!("{program}.")), "{name}");
            assert!(name.contains(".log.INFO."), "{name}");
            assert!(name.ends_with(&format!(".{}", std::process::id())), "{name}");
        }
    }
}
