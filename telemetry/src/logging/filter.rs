//! Which events are logged: klog's `-v` for the whole program and
//! `--vmodule` per source file, mapped onto tracing's levels (0-1 info,
//! 2-4 debug, 5+ trace).
//!
//! A `--vmodule` pattern names a source file as klog names a Go file: its
//! base name without the extension (`tunnel` for `src/tunnel.rs`), or a
//! pattern with `*`, `?` and `[…]` matched against that name. The first
//! pattern that matches sets the file's level; a file's level is the
//! larger of `-v` and its pattern's, as in klog.

use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Level, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// The target of info events klog would log at `-v=1` (`klog.V(1).Info`):
/// shown from `-v=1` on (or a `--vmodule` level of 1 for their file),
/// `"v":1` in JSON. `tracing::info!(target: V1, ...)`.
pub const V1: &str = "klog::v1";

/// `--vmodule`: `pattern=N,pattern=N`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VModule(Vec<(String, u32)>);

impl VModule {
    /// Parses klog's syntax; empty entries (a trailing comma) are skipped,
    /// as are `=0` ones, which change nothing.
    pub fn parse(text: &str) -> Result<VModule, String> {
        let mut patterns = Vec::new();
        for entry in text.split(',').filter(|entry| !entry.is_empty()) {
            let (pattern, level) = entry
                .split_once('=')
                .filter(|(pattern, level)| !pattern.is_empty() && !level.is_empty() && !level.contains('='))
                .ok_or_else(|| format!("want a comma-separated list of pattern=N, got {entry:?}"))?;
            let level: u32 = level
                .parse()
                .map_err(|_| format!("want a level from 0 up in {entry:?}"))?;
            if level > 0 {
                patterns.push((pattern.to_owned(), level));
            }
        }
        Ok(VModule(patterns))
    }

    /// The level `--vmodule` gives the file at `path`, if a pattern names it.
    fn level_for(&self, path: Option<&str>) -> Option<u32> {
        let path = path?;
        let base = path.rsplit('/').next().unwrap_or(path);
        let name = base.strip_suffix(".rs").unwrap_or(base);
        self.0
            .iter()
            .find(|(pattern, _)| glob_matches(pattern.as_bytes(), name.as_bytes()))
            .map(|(_, level)| *level)
    }
}

/// Crates whose debug output is a flood; kept at info unless `--vmodule`
/// names their file.
const CHATTY: [&str; 4] = ["h2", "hyper", "tower", "rustls"];

/// The filter of `-v` and `--vmodule`.
#[derive(Debug, Clone)]
pub struct Verbosity {
    pub global: u32,
    pub vmodule: VModule,
}

impl Verbosity {
    fn allows(&self, meta: &Metadata<'_>) -> bool {
        let for_file = self.vmodule.level_for(meta.file());
        let chatty = CHATTY
            .iter()
            .any(|name| meta.target() == *name || meta.target().starts_with(&format!("{name}::")));
        let verbosity = match for_file {
            Some(level) => level.max(self.global),
            None if chatty => 0,
            None => self.global,
        };
        if meta.target() == V1 {
            return verbosity >= 1 && *meta.level() <= Level::INFO;
        }
        *meta.level() <= level_of(verbosity)
    }
}

/// The most detailed tracing level `-v=verbosity` shows.
fn level_of(verbosity: u32) -> Level {
    match verbosity {
        0..=1 => Level::INFO,
        2..=4 => Level::DEBUG,
        _ => Level::TRACE,
    }
}

impl<S> Filter<S> for Verbosity {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        self.allows(meta)
    }

    // A callsite's answer never changes: decided once, then cached.
    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if self.allows(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        let most = self
            .vmodule
            .0
            .iter()
            .map(|(_, level)| *level)
            .fold(self.global, u32::max);
        Some(LevelFilter::from_level(level_of(most)))
    }
}

/// Go's `filepath.Match` on a name without slashes: `*` any run, `?` one
/// character, `[…]` a set or range (`^` or `!` negates), `\` escapes.
fn glob_matches(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|skip| glob_matches(rest, &name[skip..])),
        Some((b'?', rest)) => !name.is_empty() && glob_matches(rest, &name[1..]),
        Some((b'[', rest)) => {
            let Some((&first, name_rest)) = name.split_first() else {
                return false;
            };
            let Some(end) = rest
                .iter()
                .skip(1)
                .position(|&byte| byte == b']')
                .map(|at| at + 1)
            else {
                return false;
            };
            let (set, after) = (&rest[..end], &rest[end + 1..]);
            let (negated, set) = match set.split_first() {
                Some((b'^' | b'!', tail)) => (true, tail),
                _ => (false, set),
            };
            let mut inside = false;
            let mut at = 0;
            while at < set.len() {
                if at + 2 < set.len() && set[at + 1] == b'-' {
                    inside |= (set[at]..=set[at + 2]).contains(&first);
                    at += 3;
                } else {
                    inside |= set[at] == first;
                    at += 1;
                }
            }
            inside != negated && glob_matches(after, name_rest)
        }
        Some((b'\\', rest)) if !rest.is_empty() => {
            name.first() == Some(&rest[0]) && glob_matches(&rest[1..], &name[1..])
        }
        Some((&literal, rest)) => name.first() == Some(&literal) && glob_matches(rest, &name[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmodule_parses_as_klog_does() {
        assert_eq!(
            VModule::parse("tunnel=4,front*=5,,quiet=0").unwrap(),
            VModule(vec![("tunnel".into(), 4), ("front*".into(), 5)])
        );
        for bad in ["tunnel", "=3", "tunnel=", "tunnel=x", "a=1=2", "tunnel=-1"] {
            assert!(VModule::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn a_pattern_names_a_file_by_its_base_name_without_rs() {
        let vmodule = VModule::parse("tunnel=4,front*=5,mod=3,serv?r=2,[a-c]lient=6").unwrap();
        assert_eq!(vmodule.level_for(Some("server/src/tunnel.rs")), Some(4));
        assert_eq!(vmodule.level_for(Some("server/src/frontend.rs")), Some(5));
        assert_eq!(vmodule.level_for(Some("agent/src/capture/mod.rs")), Some(3));
        assert_eq!(vmodule.level_for(Some("src/server.rs")), Some(2));
        assert_eq!(vmodule.level_for(Some("src/client.rs")), Some(6));
        assert_eq!(vmodule.level_for(Some("src/tunnels.rs")), None);
        assert_eq!(vmodule.level_for(Some("src/dclient.rs")), None);
        assert_eq!(vmodule.level_for(None), None);
    }

    #[test]
    fn globs_follow_go_filepath_match() {
        for (pattern, name, matches) in [
            ("*", "anything", true),
            ("a*c", "abbbc", true),
            ("a*c", "abbbd", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("[^a]x", "bx", true),
            ("[!a]x", "ax", false),
            ("\\*", "*", true),
            ("\\*", "a", false),
        ] {
            assert_eq!(
                glob_matches(pattern.as_bytes(), name.as_bytes()),
                matches,
                "{pattern} {name}"
            );
        }
    }
}
