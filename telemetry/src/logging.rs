//! Logging through `tracing`, written the way Kubernetes components write
//! their logs, so log pipelines built for upstream's binaries keep parsing:
//!
//! - `text` (default): klog's header and structured form,
//!   `I1203 07:44:04.148937   12345 grpc.rs:282] "msg" key="value" n=3`;
//!   never coloured (container logs are pipes, and klog has no colour);
//! - `json` (`--logging-format=json`, the flag Kubernetes components use):
//!   one object per line, with the keys of Kubernetes' JSON logger:
//!   `{"ts":1764748044.148937,"caller":"grpc.rs:282","msg":"…","v":0,"key":"value"}`
//!   (`"err"` for errors, as it writes them).
//!
//! klog's `-v` maps onto levels: 0-1 info, 2-4 debug, 5+ trace, and
//! `--vmodule` raises it per file ([`filter`]); `RUST_LOG`, when set, wins.
//! Where lines go follows klog's flags ([`output`]); so do `--skip-headers`,
//! `--add-dir-header` and `--log-backtrace-at`, which shape text lines.

mod civil;
pub mod filter;
pub mod output;

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use self::civil::Civil;
pub use self::filter::V1;

/// `--logging-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Everything the klog flags set about logging.
#[derive(Debug, Clone)]
pub struct Settings {
    pub verbosity: filter::Verbosity,
    pub format: LogFormat,
    pub header: Header,
    /// `--log-backtrace-at`.
    pub backtrace_at: Option<SourceLine>,
    pub destinations: output::Destinations,
}

/// How a text line's klog header is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Header {
    #[default]
    FileName,
    /// `--add-dir-header`: the file's directory too (`capture/mod.rs:12]`).
    WithDirectory,
    /// `--skip-headers`: no header at all, the message first.
    None,
}

/// A place in the source, `file.rs:LINE` (`--log-backtrace-at`): a line
/// logged from there is followed by the stack that logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLine {
    file: String,
    line: u32,
}

impl SourceLine {
    /// klog's syntax; empty or `:0` (the default) is none.
    pub fn parse(text: &str) -> Result<Option<SourceLine>, String> {
        if text.is_empty() || text == ":0" {
            return Ok(None);
        }
        let wanted = || format!("want FILE.rs:LINE (the file's base name, a line above 0), got {text:?}");
        let (file, line) = text.split_once(':').ok_or_else(wanted)?;
        let line: u32 = line.parse().map_err(|_| wanted())?;
        if !file.contains('.') || file.contains(['/', ':']) || line == 0 {
            return Err(wanted());
        }
        Ok(Some(SourceLine {
            file: file.to_owned(),
            line,
        }))
    }

    fn is(&self, file: &str, line: u32) -> bool {
        self.line == line && self.file == file
    }
}

/// Installs the global subscriber. Fails only when `--log-file` cannot be
/// opened for writing (the error names it).
pub fn init(settings: Settings) -> std::io::Result<()> {
    let output = Arc::new(output::Output::open(settings.destinations)?);
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        // Span fields are kept as JSON objects, so both formats can write
        // them as the event's own (see `KubernetesFormat`).
        .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
        .event_format(KubernetesFormat {
            format: settings.format,
            pid: std::process::id(),
            header: settings.header,
            backtrace_at: settings.backtrace_at,
        })
        .with_writer(output::OutputWriter(output));
    match EnvFilter::try_from_default_env() {
        Ok(filter) => tracing_subscriber::registry()
            .with(layer.with_filter(filter))
            .init(),
        Err(_) => tracing_subscriber::registry()
            .with(layer.with_filter(settings.verbosity))
            .init(),
    }
    Ok(())
}

/// Formats events as klog text or Kubernetes JSON.
struct KubernetesFormat {
    format: LogFormat,
    pid: u32,
    header: Header,
    backtrace_at: Option<SourceLine>,
}

impl<S, N> FormatEvent<S, N> for KubernetesFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let path = meta.file().unwrap_or("?");
        let file = path.rsplit('/').next().unwrap_or(path);
        let line = meta.line().unwrap_or(0);
        let backtrace = self
            .backtrace_at
            .as_ref()
            .filter(|at| at.is(file, line))
            .map(|_| {
                stack_from(
                    &std::backtrace::Backtrace::force_capture().to_string(),
                    file,
                    line,
                )
            });
        let mut fields = Fields::default();
        event.record(&mut fields);
        // The fields of the spans the event is in (a tunnel's ids, a server
        // stream's server_id), outermost first, written as the event's own
        // as logr writes a WithValues context; the event's own field of the
        // same name wins.
        let mut context: Vec<(String, Value)> = Vec::new();
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let Some(formatted) = extensions.get::<FormattedFields<N>>() else {
                    continue;
                };
                let Ok(serde_json::Value::Object(map)) = serde_json::from_str(formatted) else {
                    continue;
                };
                for (key, value) in map {
                    if fields.values.iter().any(|(own, _)| *own == key) {
                        continue;
                    }
                    let value = match value {
                        serde_json::Value::String(text) => Value::Text(text),
                        other => Value::Raw(other.to_string()),
                    };
                    context.retain(|(outer, _)| *outer != key);
                    context.push((key, value));
                }
            }
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        match self.format {
            LogFormat::Text => {
                let severity = match *meta.level() {
                    Level::ERROR => 'E',
                    Level::WARN => 'W',
                    _ => 'I',
                };
                let civil = Civil::from_unix(now.as_secs());
                // klog's --add-dir-header adds the one directory above.
                let file = match self.header {
                    Header::WithDirectory => path
                        .rsplitn(3, '/')
                        .collect::<Vec<_>>()
                        .get(..2)
                        .map_or(file.to_owned(), |parts| format!("{}/{}", parts[1], parts[0])),
                    _ => file.to_owned(),
                };
                if self.header != Header::None {
                    write!(
                        writer,
                        "{severity}{:02}{:02} {:02}:{:02}:{:02}.{:06} {:>7} {file}:{line}] ",
                        civil.month,
                        civil.day,
                        civil.hour,
                        civil.minute,
                        civil.second,
                        now.subsec_micros(),
                        self.pid,
                    )?;
                }
                write_quoted(&mut writer, &fields.message)?;
                let own = fields.values.iter().map(|(key, value)| (*key, value));
                let spans = context.iter().map(|(key, value)| (key.as_str(), value));
                for (key, value) in own.chain(spans) {
                    write!(writer, " {key}=")?;
                    match value {
                        Value::Raw(raw) => writer.write_str(raw)?,
                        Value::Text(text) => write_quoted(&mut writer, text)?,
                    }
                }
                writeln!(writer)?;
                match backtrace {
                    Some(backtrace) => writeln!(writer, "{backtrace}"),
                    None => Ok(()),
                }
            }
            LogFormat::Json => {
                let mut object = serde_json::Map::new();
                object.insert("ts".into(), serde_json::json!(now.as_secs_f64()));
                object.insert("caller".into(), format!("{file}:{line}").into());
                object.insert("msg".into(), fields.message.into());
                let verbosity = match *meta.level() {
                    Level::INFO if meta.target() == V1 => 1,
                    Level::ERROR | Level::WARN | Level::INFO => 0,
                    Level::DEBUG => 2,
                    Level::TRACE => 5,
                };
                object.insert("v".into(), verbosity.into());
                if *meta.level() == Level::WARN {
                    object.insert("level".into(), "warning".into());
                }
                let own = fields
                    .values
                    .into_iter()
                    .map(|(key, value)| (key.to_owned(), value));
                for (key, value) in own.chain(context) {
                    let key = if key == "error" { "err".to_owned() } else { key };
                    let value = match value {
                        Value::Raw(raw) => {
                            serde_json::from_str(&raw).unwrap_or(serde_json::Value::String(raw))
                        }
                        Value::Text(text) => text.into(),
                    };
                    object.insert(key, value);
                }
                if let Some(backtrace) = backtrace {
                    object.insert("stacktrace".into(), backtrace.into());
                }
                writeln!(writer, "{}", serde_json::Value::Object(object))
            }
        }
    }
}

/// The printed stack `backtrace` from the frame at `file:line` outwards:
/// the frames inside the logging machinery above it say nothing about the
/// caller. Without line tables (the image's binaries) no frame can be found
/// by its line, and the whole stack is kept.
fn stack_from(backtrace: &str, file: &str, line: u32) -> String {
    let lines: Vec<&str> = backtrace.lines().collect();
    let is_frame_start = |text: &str| {
        let text = text.trim_start();
        text.split_once(": ")
            .is_some_and(|(number, _)| !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
    };
    let location = format!("/{file}:{line}:");
    let start = lines
        .iter()
        .position(|text| text.trim_start().starts_with("at ") && text.contains(&location))
        .and_then(|at| lines[..at].iter().rposition(|text| is_frame_start(text)));
    match start {
        Some(start) => lines[start..].join("\n"),
        None => backtrace.trim_end().to_owned(),
    }
}

/// A field's value: numbers and booleans as they are, the rest as text.
enum Value {
    Raw(String),
    Text(String),
}

#[derive(Default)]
struct Fields {
    message: String,
    values: Vec<(&'static str, Value)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.text(field, value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.text(field, format!("{value:?}"));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.text(field, konnectivity_plumbing::error_chain(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.values.push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.values.push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.values.push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.values.push((field.name(), Value::Raw(value.to_string())));
    }
}

impl Fields {
    fn text(&mut self, field: &Field, text: String) {
        if field.name() == "message" {
            self.message = text;
        } else {
            self.values.push((field.name(), Value::Text(text)));
        }
    }
}

/// A string quoted as klog quotes values (Go's `%q`: backslash escapes for
/// quotes, backslashes and control characters).
fn write_quoted(writer: &mut impl fmt::Write, text: &str) -> fmt::Result {
    writer.write_char('"')?;
    for c in text.chars() {
        match c {
            '"' => writer.write_str("\\\"")?,
            '\\' => writer.write_str("\\\\")?,
            '\n' => writer.write_str("\\n")?,
            '\r' => writer.write_str("\\r")?,
            '\t' => writer.write_str("\\t")?,
            c if c.is_control() => write!(writer, "\\u{:04x}", c as u32)?,
            c => writer.write_char(c)?,
        }
    }
    writer.write_char('"')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `format` writes for one event inside a tunnel-like span.
    fn rendered(format: LogFormat) -> String {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(KubernetesFormat {
                format,
                pid: 1,
                header: Header::FileName,
                backtrace_at: None,
            })
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let stream = tracing::info_span!("server stream", server_id = "s-1");
            let _stream = stream.enter();
            let tunnel = tracing::debug_span!(
                "tunnel",
                dial_id = 7,
                destination = "10.0.0.1:443",
                connect_id = tracing::field::Empty
            );
            tunnel.record("connect_id", 3);
            let _tunnel = tunnel.enter();
            tracing::debug!(reason = "target_closed", destination = "own", "tunnel closed");
        });
        String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
    }

    /// Span fields, recorded at creation or later, are written as the
    /// event's own keys in both formats, so one tunnel's lines can be
    /// matched by their ids (and JSON readers find them at the top level).
    #[test]
    fn span_fields_are_written_as_the_events_own() {
        let text = rendered(LogFormat::Text);
        assert!(
            text.ends_with(
                "] \"tunnel closed\" reason=\"target_closed\" destination=\"own\" server_id=\"s-1\" \
                 connect_id=3 dial_id=7\n"
            ),
            "{text}"
        );
        let json: serde_json::Value = serde_json::from_str(&rendered(LogFormat::Json)).unwrap();
        assert_eq!(json["msg"], "tunnel closed");
        assert_eq!(json["server_id"], "s-1");
        assert_eq!(json["connect_id"], 3);
        assert_eq!(json["dial_id"], 7);
        assert_eq!(json["destination"], "own", "the event's own field wins");
        assert_eq!(json["v"], 2);
    }

    /// Events at klog's `-v=1` (target [`V1`]): hidden at `-v=0`, shown
    /// from `-v=1` on and by a `--vmodule` level of 1 for their file, and
    /// `"v":1` in JSON.
    #[test]
    fn v1_events_need_verbosity_one() {
        use std::sync::{Arc, Mutex};
        use tracing_subscriber::layer::SubscriberExt;
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let logged = |global: u32, vmodule: &str, emit: &dyn Fn()| {
            let buffer = Buffer::default();
            let writer = buffer.clone();
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                .event_format(KubernetesFormat {
                    format: LogFormat::Json,
                    pid: 1,
                    header: Header::FileName,
                    backtrace_at: None,
                })
                .with_writer(move || writer.clone())
                .with_filter(filter::Verbosity {
                    global,
                    vmodule: filter::VModule::parse(vmodule).unwrap(),
                });
            tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), emit);
            String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
        };
        // A callsite each: tracing caches a callsite's interest.
        assert_eq!(logged(0, "", &|| tracing::info!(target: V1, "flag")), "");
        let shown = logged(1, "", &|| tracing::info!(target: V1, "flag"));
        let json: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(
            (json["msg"].as_str(), json["v"].as_u64()),
            (Some("flag"), Some(1)),
            "{shown}"
        );
        assert!(!logged(0, "logging=1", &|| tracing::info!(target: V1, "flag")).is_empty());
        assert!(logged(0, "other=1", &|| tracing::info!(target: V1, "flag")).is_empty());
        // Plain info events stay at -v=0, with "v":0.
        let plain = logged(0, "", &|| tracing::info!("started"));
        assert!(plain.contains("\"v\":0"), "{plain}");
    }

    #[test]
    fn values_are_quoted_as_go_quotes_them() {
        let mut out = String::new();
        write_quoted(&mut out, "a \"b\"\\c\nd\u{1}").unwrap();
        assert_eq!(out, r#""a \"b\"\\c\nd\u0001""#);
    }
}
