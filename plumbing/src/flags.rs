//! Flag values in the forms Go's `flag`/`pflag` packages accept, so upstream
//! manifests keep working unchanged: durations like `1h0m0s`, booleans as
//! `true`/`false`, and ports within the range upstream allows.

use std::time::Duration;

use crate::tls::{Identity, PemFile};

/// A flag with a bad value, or flags that conflict. Binaries exit with
/// status 2 on it, as Go's flag package does.
#[derive(Debug, thiserror::Error)]
#[error("invalid flag --{flag}: {message}")]
pub struct FlagError {
    pub flag: &'static str,
    pub message: String,
}

/// A [`FlagError`] naming `flag`.
pub fn invalid(flag: &'static str, message: impl Into<String>) -> FlagError {
    FlagError {
        flag,
        message: message.into(),
    }
}

/// An existing file given by a flag, or `None` when the flag is empty.
pub fn pem_file(flag: &'static str, value: &str) -> Result<Option<PemFile>, FlagError> {
    if value.is_empty() {
        return Ok(None);
    }
    if !std::path::Path::new(value).is_file() {
        return Err(invalid(flag, format!("{value}: no such file")));
    }
    Ok(Some(PemFile::new(flag, value)))
}

/// A certificate/key flag pair: both or neither, as upstream validates.
pub fn identity_pair(
    (cert_flag, cert): (&'static str, &str),
    (key_flag, key): (&'static str, &str),
) -> Result<Option<Identity>, FlagError> {
    match (pem_file(cert_flag, cert)?, pem_file(key_flag, key)?) {
        (Some(cert), Some(key)) => Ok(Some(Identity { cert, key })),
        (None, None) => Ok(None),
        (Some(_), None) => Err(invalid(key_flag, format!("must be set when --{cert_flag} is"))),
        (None, Some(_)) => Err(invalid(cert_flag, format!("must be set when --{key_flag} is"))),
    }
}

/// Parses a Go duration: a sequence of decimal numbers with units
/// (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`), e.g. `300ms`, `1.5s`, `1h0m0s`, or a bare `0`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("invalid duration {text:?} (expected Go form such as 100ms, 1s or 1h0m0s)");
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.is_empty() || rest.starts_with('-') {
        return Err(invalid());
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(invalid)?;
        let number: f64 = rest[..number_len].parse().map_err(|_| invalid())?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds_per_unit = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(invalid()),
        };
        total += number * seconds_per_unit;
        rest = &rest[unit_len..];
    }
    Duration::try_from_secs_f64(total).map_err(|_| invalid())
}

/// Parses a Go boolean flag value (`strconv.ParseBool`).
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("invalid boolean {text:?} (expected true or false)")),
    }
}

/// Upstream refuses ports in the ephemeral range and the privileged range,
/// where a listener would clash with outgoing connections or need root.
pub fn parse_port(text: &str) -> Result<u16, String> {
    let port: u16 = match text.parse() {
        Ok(port) => port,
        // A number, just too large for a port: the same message as for 80.
        Err(_) if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => {
            return Err(format!("port {text} is outside 1024-49151"));
        }
        Err(_) => return Err(format!("invalid port {text:?}: a number in 1024-49151")),
    };
    if !(1024..=49151).contains(&port) && port != 0 {
        return Err(format!("port {port} is outside 1024-49151"));
    }
    Ok(port)
}

/// The value of a Go string-slice flag (a newtype, so clap takes the whole
/// value rather than treating the field as a repeated flag).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GoList(pub Vec<String>);

/// Parses a Go string-slice flag: comma-separated, with `[]` (how Go prints
/// an empty list) and the empty string both meaning no entries.
pub fn parse_list(text: &str) -> Result<GoList, String> {
    let inner = text
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(text);
    Ok(GoList(
        inner
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(str::to_owned)
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_string_lists() {
        let list = |items: &[&str]| Ok(GoList(items.iter().map(|s| s.to_string()).collect()));
        assert_eq!(parse_list("[]"), list(&[]));
        assert_eq!(parse_list(""), list(&[]));
        assert_eq!(parse_list("a,b"), list(&["a", "b"]));
        assert_eq!(parse_list("[h2,http/1.1]"), list(&["h2", "http/1.1"]));
    }

    #[test]
    fn go_durations() {
        let ms = Duration::from_millis;
        for (text, expected) in [
            ("0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("100ms", ms(100)),
            ("1s", ms(1000)),
            ("1.5s", ms(1500)),
            ("1h0m0s", Duration::from_secs(3600)),
            ("2m30s", Duration::from_secs(150)),
            ("10us", Duration::from_micros(10)),
            ("5ns", Duration::from_nanos(5)),
        ] {
            assert_eq!(parse_duration(text), Ok(expected), "{text}");
        }
        for bad in ["", "1", "s", "1x", "-1s", "1.2.3s"] {
            assert!(parse_duration(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn go_booleans() {
        assert_eq!(parse_bool("true"), Ok(true));
        assert_eq!(parse_bool("F"), Ok(false));
        assert!(parse_bool("yes").is_err());
    }

    #[test]
    fn ports_outside_upstream_range_are_refused() {
        assert_eq!(parse_port("8090"), Ok(8090));
        assert_eq!(parse_port("0"), Ok(0));
        assert!(parse_port("80").unwrap_err().contains("1024-49151"));
        assert!(parse_port("50000").is_err());
        assert!(parse_port("x").is_err());
    }
}

/// Parses the command line as `T` describes it, exiting with status 2 and
/// clap's message on a bad one. For an unknown flag, the tip names a known
/// flag only when it is a near miss: a unique prefix (`--uds` for
/// `--uds-name`) or within two edits of a long name (`--agent-identifierz`).
pub fn parse_or_exit<T: clap::Parser>() -> (T, EffectiveFlags) {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let command = T::command();
    let parsed = command.clone().try_get_matches().and_then(|matches| {
        Ok((
            T::from_arg_matches(&matches)?,
            EffectiveFlags::new(&command, &matches),
        ))
    });
    let mut error = match parsed {
        Ok(parsed) => return parsed,
        Err(error) => error,
    };
    if error.kind() == ErrorKind::UnknownArgument
        && let Some(ContextValue::String(given)) = error.get(ContextKind::InvalidArg)
        && let Some(known) = near_miss(given, &T::command())
    {
        error.insert(
            ContextKind::SuggestedArg,
            ContextValue::String(format!("--{known}")),
        );
    }
    error.exit()
}

/// Every flag a binary ran with and its effective value, given or default,
/// in the order `--help` lists them: what the start-up log shows.
#[derive(Debug, Clone, Default)]
pub struct EffectiveFlags(Vec<(String, String)>);

impl EffectiveFlags {
    fn new(command: &clap::Command, matches: &clap::ArgMatches) -> Self {
        let flags = command
            .get_arguments()
            .filter(|arg| !arg.is_positional())
            .filter(|arg| !matches!(arg.get_action(), clap::ArgAction::Help | clap::ArgAction::Version))
            .filter_map(|arg| {
                let name = arg.get_long()?.to_owned();
                let values = matches.try_get_raw(arg.get_id().as_str()).ok().flatten();
                let value = values
                    .map(|values| {
                        values
                            .map(|value| value.to_string_lossy().into_owned())
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default();
                Some((name, value))
            })
            .collect();
        EffectiveFlags(flags)
    }

    /// Every long flag's name and effective value, in `--help`'s order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(name, value)| (name.as_str(), value.as_str()))
    }
}

/// The one long flag of `command` that `given` (`--name` or `--name=value`)
/// nearly spells, if there is one.
fn near_miss(given: &str, command: &clap::Command) -> Option<String> {
    let name = given.trim_start_matches('-').split('=').next()?;
    if name.is_empty() {
        return None;
    }
    let longs: Vec<&str> = command.get_arguments().filter_map(|arg| arg.get_long()).collect();
    let prefixed: Vec<&&str> = longs.iter().filter(|long| long.starts_with(name)).collect();
    if let [only] = prefixed.as_slice() {
        return Some((**only).to_owned());
    }
    let close: Vec<&&str> = longs
        .iter()
        .filter(|long| edit_distance(name, long) <= 2.min(name.len() / 4))
        .collect();
    match close.as_slice() {
        [only] => Some((**only).to_owned()),
        _ => None,
    }
}

/// Levenshtein distance, on bytes (flag names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, &x) in a.iter().enumerate() {
        let mut current = vec![i + 1];
        for (j, &y) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(x != y);
            current.push(substitution.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod suggestion_tests {
    use super::*;

    fn command() -> clap::Command {
        [
            "uds-name",
            "agent-identifiers",
            "agent-id",
            "mode",
            "xfr-channel-size",
            "cluster-key",
            "server-cert",
            "agent-cert",
        ]
        .into_iter()
        .fold(clap::Command::new("t"), |command, name| {
            command.arg(clap::Arg::new(name).long(name))
        })
    }

    #[test]
    fn only_near_misses_are_suggested() {
        let cases = [
            ("--uds", Some("uds-name")),
            ("--mod=grpc", Some("mode")),
            ("--agent-identifierz=ipv4=1", Some("agent-identifiers")),
            ("--agent-ip", Some("agent-id")),
            // Unrelated: clap's own similarity proposed these.
            ("--ca", None),
            ("--cert", None),
            ("--id", None),
            // Ambiguous prefix.
            ("--agent", None),
        ];
        for (given, expected) in cases {
            assert_eq!(near_miss(given, &command()).as_deref(), expected, "{given}");
        }
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "ab"), 2);
        assert_eq!(edit_distance("same", "same"), 0);
    }
}
