//! klog's command-line flags, accepted so that upstream manifests run
//! unchanged, and applied as klog applies them: verbosity (`-v`,
//! `--vmodule`), destinations (`--logtostderr`, `--log-file`, `--log-dir`
//! and the thresholds), and the shape of text lines (`--skip-headers`,
//! `--add-dir-header`, `--log-backtrace-at`). `crate::logging` does the work.

use clap::{ArgAction, Args};

use crate::logging::filter::{VModule, Verbosity};
use crate::logging::output::{Destinations, Severity};
use crate::logging::{Header, Settings, SourceLine};
use konnectivity_plumbing::flags::parse_bool;

#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Logging (klog-compatible)")]
pub struct KlogArgs {
    /// Log verbosity: 0-1 info, 2-4 debug (every tunnel's life), 5+ trace.
    #[arg(short = 'v', long = "v", default_value_t = 0)]
    pub verbosity: u32,
    /// Log format: text (klog's) or json (one object per line, as
    /// Kubernetes components write it).
    #[arg(long, value_enum, default_value = "text")]
    pub logging_format: crate::logging::LogFormat,
    /// Per-file verbosity, pattern=N,...: a pattern names Rust source files by base name without ".rs" (tunnel,
    /// front*), and a file logs at the larger of -v and its N.
    #[arg(long, value_parser = VModule::parse, default_value = "")]
    pub vmodule: VModule,
    /// Log to standard error instead of files (then --log-file, --log-dir, --alsologtostderr and the thresholds
    /// have no effect, as in klog).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub logtostderr: bool,
    /// With --logtostderr=false: copy lines at or above --alsologtostderrthreshold to standard error.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub alsologtostderr: bool,
    /// Lines at or above this severity (INFO, WARNING, ERROR, FATAL or 0-3) go to standard error with
    /// --alsologtostderr; empty is INFO.
    #[arg(long, value_parser = parse_threshold_or_info, default_value = "")]
    pub alsologtostderrthreshold: Severity,
    /// With --logtostderr=false (and no --alsologtostderr): lines at or above this severity also go to standard
    /// error; with --logtostderr, only when --legacy-stderr-threshold-behavior=false.
    #[arg(long, value_parser = Severity::parse, default_value = "2")]
    pub stderrthreshold: Severity,
    /// With --logtostderr=false and no --log-file: write a file per severity here (PROGRAM.HOST.USER.log.SEVERITY.
    /// DATE-TIME.PID, and a link PROGRAM.SEVERITY to the newest); empty is the system's temporary directory.
    #[arg(long, default_value = "")]
    pub log_dir: String,
    /// With --logtostderr=false: write every line to this file.
    #[arg(long, default_value = "")]
    pub log_file: String,
    /// Largest --log-file in MB; past it the file is emptied and written again (0: no limit).
    #[arg(long, default_value_t = 1800)]
    pub log_file_max_size: u64,
    /// When a line is logged from FILE.rs:LINE, write the stack that logged it after it.
    #[arg(long, value_parser = parse_backtrace_at, default_value = ":0")]
    pub log_backtrace_at: BacktraceAt,
    /// In --log-dir, write each line to its own severity's file only (not also to each lower one's).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub one_output: bool,
    /// Write text lines without klog's header (severity, time, pid, file:line).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub skip_headers: bool,
    /// Do not write klog's four header lines at the top of a new log file.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub skip_log_headers: bool,
    /// Put the source file's directory in the header of text lines (capture/mod.rs:12).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub add_dir_header: bool,
    /// Ignore --stderrthreshold when --logtostderr is set (klog's legacy behaviour); false filters standard error
    /// by it.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub legacy_stderr_threshold_behavior: bool,
}

/// `--log-backtrace-at`'s value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BacktraceAt(pub Option<SourceLine>);

fn parse_backtrace_at(text: &str) -> Result<BacktraceAt, String> {
    SourceLine::parse(text).map(BacktraceAt)
}

/// `--alsologtostderrthreshold`: empty (what upstream's help shows as the
/// default) is klog's default, INFO.
fn parse_threshold_or_info(text: &str) -> Result<Severity, String> {
    if text.is_empty() {
        Ok(Severity::Info)
    } else {
        Severity::parse(text)
    }
}

impl KlogArgs {
    /// What these flags ask of logging.
    pub fn settings(&self) -> Settings {
        let header = if self.skip_headers {
            Header::None
        } else if self.add_dir_header {
            Header::WithDirectory
        } else {
            Header::FileName
        };
        let path = |text: &str| (!text.is_empty()).then(|| std::path::PathBuf::from(text));
        Settings {
            verbosity: Verbosity {
                global: self.verbosity,
                vmodule: self.vmodule.clone(),
            },
            format: self.logging_format,
            header,
            backtrace_at: self.log_backtrace_at.0.clone(),
            destinations: Destinations {
                to_stderr: self.logtostderr,
                also_to_stderr: self.alsologtostderr,
                stderr_threshold: self.stderrthreshold,
                also_to_stderr_threshold: self.alsologtostderrthreshold,
                legacy_stderr_threshold_behavior: self.legacy_stderr_threshold_behavior,
                log_file: path(&self.log_file),
                log_file_max_bytes: (self.log_file_max_size > 0)
                    .then(|| self.log_file_max_size.saturating_mul(1024 * 1024)),
                log_dir: path(&self.log_dir),
                one_output: self.one_output,
                skip_log_headers: self.skip_log_headers,
            },
        }
    }

    /// Installs logging as these flags ask.
    pub fn init_logging(&self) -> std::io::Result<()> {
        crate::logging::init(self.settings())
    }

    /// Whether lines go to files (`--logtostderr=false`): then a binary
    /// that stops logs why there too, besides its one line on standard
    /// error.
    pub fn logs_to_files(&self) -> bool {
        !self.logtostderr
    }
}

/// How both binaries start once their flags are parsed: the configuration,
/// or its error on one line as `BINARY: error` with status 2, as for a bad
/// flag; then logging as the klog flags ask, every flag's effective value
/// and the inert flags logged, and the open files limit raised to its hard
/// limit (every tunnel is a descriptor or two).
pub fn start<C, E: std::fmt::Display>(
    binary: &str,
    config: Result<C, E>,
    flags: &konnectivity_plumbing::flags::EffectiveFlags,
    klog: &KlogArgs,
    inert: &[&str],
) -> std::io::Result<C> {
    let config = match config {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{binary}: {error}");
            std::process::exit(2);
        }
    };
    klog.init_logging()?;
    // One line per flag, as Kubernetes components print theirs, at -v=1
    // as they do: at the default verbosity the start-up is one line.
    for (name, value) in flags.iter() {
        tracing::info!(target: crate::logging::V1, "FLAG: --{name}={value:?}");
    }
    warn_inert(inert);
    match konnectivity_plumbing::raise_open_files_limit() {
        Ok(limit) => tracing::debug!(limit, "open files limit"),
        Err(error) => tracing::warn!(%error, "cannot raise the open files limit"),
    }
    Ok(config)
}

/// Logs, once, each flag that was given a non-default value but has no
/// effect yet, so nothing changes behaviour silently.
pub fn warn_inert(flags: &[&str]) {
    for flag in flags {
        tracing::warn!(flag = %format!("--{flag}"), "flag is accepted for compatibility with upstream but has no effect in this version");
    }
}

/// What every `--help` promises, checked by each binary's tests: every flag
/// has a description, and each of `inert` (flags accepted but not acted on)
/// says so with the words "Not applied".
pub fn help_problems(command: &clap::Command, inert: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    for arg in command.get_arguments().filter(|arg| !arg.is_hide_set()) {
        let name = arg.get_long().unwrap_or(arg.get_id().as_str());
        match arg.get_help().map(ToString::to_string) {
            None => problems.push(format!("--{name} has no description")),
            Some(help) if inert.contains(&name) && !help.contains("Not applied") => problems.push(format!(
                "--{name} has no effect but its help does not say so: {help:?}"
            )),
            Some(_) => {}
        }
    }
    problems
}
