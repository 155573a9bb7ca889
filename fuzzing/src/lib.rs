//! What the fuzz targets in `fuzz/` exercise, as plain functions of the
//! fuzzer's bytes. Each one feeds hostile input to a real entry point and
//! checks the properties that must hold whatever the input: no panic, no
//! hang, errors instead of garbage, nothing left behind. `cargo test` runs
//! them over the committed corpora (`fuzz/corpus/TARGET/`); `cargo fuzz run
//! TARGET` (nightly) searches for new inputs.

mod resume;
pub mod seeds;
mod streams;

pub use resume::resume_handshake;
pub use streams::{agent_stream, frontend_stream, server_stream};

use konnectivity_agent::hooks::Capture;
use konnectivity_proto::AgentIdentifiers;
use konnectivity_server::hooks::{MAX_HEAD, parse_head};

/// A fuzz target's checks, applied to one input.
pub type Target = fn(&[u8]);

/// The fuzz targets, by the name of their directory under `fuzz/corpus`.
pub const TARGETS: [(&str, Target); 8] = [
    ("connect_head", connect_head),
    ("agent_identifiers", agent_identifiers),
    ("capture", capture),
    ("cni_plugin", cni_plugin),
    ("server_stream", server_stream),
    ("agent_stream", agent_stream),
    ("frontend_stream", frontend_stream),
    ("resume_handshake", resume_handshake),
];

/// The HTTP CONNECT request head parser. A request it accepts names a
/// `host:port`, ends where it says, keeps every byte after the head as
/// tunnel data, and parses the same from its own head alone.
pub fn connect_head(data: &[u8]) {
    match parse_head(data) {
        Ok(Some((request, head_len))) => {
            assert!(head_len <= data.len() && head_len <= MAX_HEAD);
            assert_eq!(
                &request.early_data[..],
                &data[head_len..],
                "bytes after the head were lost"
            );
            let (host, port) = request
                .target
                .as_str()
                .rsplit_once(':')
                .expect("target has a port");
            assert!(!host.is_empty());
            assert!(port.parse::<u16>().is_ok_and(|p| p != 0));
            let (again, again_len) = parse_head(&data[..head_len]).unwrap().unwrap();
            assert_eq!((again.target, again_len), (request.target, head_len));
        }
        Ok(None) => assert!(
            data.len() < MAX_HEAD,
            "an oversized head must be refused, not awaited"
        ),
        Err(error) => assert!((400..500).contains(&error.http_status())),
    }
}

/// `--agent-identifiers` / the `agentidentifiers` metadata. What parses
/// strictly prints back to the same identifiers; the lenient parser (the
/// server's, for peers) accepts at least what the strict one does.
pub fn agent_identifiers(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let lenient = AgentIdentifiers::parse_lenient(&text);
    if let Ok(strict) = AgentIdentifiers::parse(&text) {
        let printed = strict.to_string();
        assert_eq!(
            AgentIdentifiers::parse(&printed).as_ref(),
            Ok(&strict),
            "{printed:?}"
        );
        assert_eq!(lenient.as_ref(), Ok(&strict));
    }
}

/// `--capture VIP:PORT=TARGET:PORT`. What parses prints back to itself.
pub fn capture(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(parsed) = Capture::parse(&text) {
        let printed = format!("{}={}", parsed.destination, parsed.target);
        assert_eq!(Capture::parse(&printed), Ok(parsed), "{printed:?}");
    }
}

/// The CNI plugin's whole call: `CNI_*` environment (the input's first
/// lines, `KEY=VALUE`, up to an empty line) and the network configuration
/// on stdin (the rest). Whatever comes in, the plugin answers with JSON on
/// stdout (or nothing, for DEL and GC) and exit 0, or a CNI error (JSON with a code) and a failure exit.
/// The configuration's `agentSocket` is pointed at a path that does not
/// exist, so no input can make the plugin talk to a real socket.
pub fn cni_plugin(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (env_text, stdin) = text.split_once("\n\n").unwrap_or((&text, ""));
    let env: Vec<(String, String)> = env_text
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let stdin = match serde_json::from_str::<serde_json::Value>(stdin) {
        Ok(serde_json::Value::Object(mut conf)) => {
            conf.insert(
                "agentSocket".into(),
                "/nonexistent/konnectivity-fuzz/cni.sock".into(),
            );
            conf.insert("agentTimeoutMillis".into(), 100.into());
            serde_json::Value::Object(conf).to_string()
        }
        _ => stdin.to_owned(),
    };
    let vars = |name: &str| env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    let outcome =
        konnectivity_cni::plugin::run(vars, stdin.as_bytes(), std::path::Path::new("/proc/self/ns/net"));
    if outcome.exit_code == 0 && outcome.stdout.is_empty() {
        // DEL and GC succeed silently, as the CNI spec says.
        return;
    }
    let answer: serde_json::Value = serde_json::from_str(&outcome.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", outcome.stdout));
    if outcome.exit_code != 0 {
        assert!(
            answer["code"].as_u64().is_some_and(|code| code > 0),
            "an error names its code: {answer}"
        );
        assert!(
            answer["msg"].as_str().is_some_and(|msg| !msg.is_empty()),
            "{answer}"
        );
    }
}
