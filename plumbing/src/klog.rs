//! klog's command-line flags, accepted so that upstream manifests run
//! unchanged. `-v`, `--log-file`, `--logtostderr` and `--alsologtostderr`
//! act; the others only format klog's own output and have no equivalent
//! here, so a non-default value is reported once at start-up.

use clap::{ArgAction, Args};

use crate::flags::parse_bool;

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
    /// klog's per-module verbosity. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, default_value = "")]
    pub vmodule: String,
    /// Log to standard error (the default).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub logtostderr: bool,
    /// Log to standard error as well as to --log-file.
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub alsologtostderr: bool,
    /// klog severity threshold for --alsologtostderr. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, default_value = "")]
    pub alsologtostderrthreshold: String,
    /// klog severity threshold for standard error. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, default_value = "2")]
    pub stderrthreshold: String,
    /// klog log directory. Not applied in this version (accepted for upstream compatibility): use --log-file.
    #[arg(long, default_value = "")]
    pub log_dir: String,
    /// Log to this file instead of standard error.
    #[arg(long, default_value = "")]
    pub log_file: String,
    /// klog log file rotation size in MB. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, default_value_t = 1800)]
    pub log_file_max_size: u64,
    /// klog stack trace trigger. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, default_value = ":0")]
    pub log_backtrace_at: String,
    /// klog: write each severity to its own file only. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub one_output: bool,
    /// klog: omit the header of each line. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub skip_headers: bool,
    /// klog: omit the header of log files. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub skip_log_headers: bool,
    /// klog: put the source directory in the header. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "false", action = ArgAction::Set)]
    pub add_dir_header: bool,
    /// klog: apply --stderrthreshold only with --logtostderr=false. Not applied in this version (accepted for upstream compatibility).
    #[arg(long, value_parser = parse_bool, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value = "true", action = ArgAction::Set)]
    pub legacy_stderr_threshold_behavior: bool,
}

impl KlogArgs {
    /// The klog flags set to something other than their default, which this
    /// implementation does not act on.
    pub fn inert_settings(&self) -> Vec<&'static str> {
        [
            ("vmodule", !self.vmodule.is_empty()),
            (
                "alsologtostderrthreshold",
                !self.alsologtostderrthreshold.is_empty(),
            ),
            ("stderrthreshold", self.stderrthreshold != "2"),
            ("log-dir", !self.log_dir.is_empty()),
            ("log-file-max-size", self.log_file_max_size != 1800),
            ("log-backtrace-at", self.log_backtrace_at != ":0"),
            ("one-output", self.one_output),
            ("skip-headers", self.skip_headers),
            ("skip-log-headers", self.skip_log_headers),
            ("add-dir-header", self.add_dir_header),
            (
                "legacy-stderr-threshold-behavior",
                !self.legacy_stderr_threshold_behavior,
            ),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }

    /// Installs logging as these flags ask.
    pub fn init_logging(&self) -> std::io::Result<()> {
        let file = (!self.log_file.is_empty()).then(|| std::path::PathBuf::from(&self.log_file));
        crate::logging::init(self.verbosity, self.logging_format, file.as_deref())
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
    flags: &crate::flags::EffectiveFlags,
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
    flags.log();
    warn_inert(inert);
    match crate::raise_open_files_limit() {
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

/// Command-line values for every klog flag that this implementation
/// accepts without acting on it, for the binaries' help tests.
pub const INERT_KLOG_SETTINGS: &[&str] = &[
    "--vmodule=session=4",
    "--alsologtostderrthreshold=1",
    "--stderrthreshold=1",
    "--log-dir=/tmp",
    "--log-file-max-size=5",
    "--log-backtrace-at=session.go:1",
    "--one-output",
    "--skip-headers",
    "--skip-log-headers",
    "--add-dir-header",
    "--legacy-stderr-threshold-behavior=false",
];
