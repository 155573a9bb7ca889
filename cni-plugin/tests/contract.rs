//! The CNI contract, table by table: environment and stdin in, stdout and
//! exit code out, against a stand-in agent on a real Unix socket.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use konnectivity_cni::message::{Reply, Request};
use konnectivity_cni::plugin::{Outcome, run};

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "konn-cni-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stand-in agent answering every request with `reply`, recording them.
struct FakeAgent {
    socket: PathBuf,
    seen: Arc<Mutex<Vec<Request>>>,
}

impl FakeAgent {
    fn start(dir: &Path, reply: Reply) -> FakeAgent {
        let socket = dir.join("cni.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut line = String::new();
                BufReader::new(&stream).read_line(&mut line).unwrap();
                record.lock().unwrap().push(serde_json::from_str(&line).unwrap());
                let mut answer = serde_json::to_vec(&reply).unwrap();
                answer.push(b'\n');
                let _ = stream.write_all(&answer);
            }
        });
        FakeAgent { socket, seen }
    }

    fn requests(&self) -> Vec<Request> {
        self.seen.lock().unwrap().clone()
    }
}

/// A previous result with unusual spacing and key order: it must come back
/// exactly as given.
const PREV_RESULT: &str = r#"{"cniVersion":"1.0.0",  "interfaces":[{"name":"eth0","sandbox":"/var/run/netns/pod"}],"ips":[{"address":"10.244.1.5/24","interface":0,"gateway":"10.244.1.1"}], "dns":{}}"#;

fn config(socket: &Path, version: &str, prev: bool, extra: &str) -> String {
    let prev = if prev {
        format!(r#","prevResult":{PREV_RESULT}"#)
    } else {
        String::new()
    };
    format!(
        r#"{{"cniVersion":"{version}","name":"k8s-pod-network","type":"konnectivity-cni","agentSocket":"{}","agentTimeoutMillis":500{extra}{prev}}}"#,
        socket.display()
    )
}

struct Call<'a> {
    env: Vec<(&'a str, String)>,
    stdin: String,
}

impl Call<'_> {
    fn run(&self, host_netns: &Path) -> Outcome {
        let vars: HashMap<&str, &str> = self.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        run(|name| vars.get(name).copied(), self.stdin.as_bytes(), host_netns)
    }
}

fn pod_env<'a>(command: &str, netns: &Path) -> Vec<(&'a str, String)> {
    vec![
        ("CNI_COMMAND", command.to_owned()),
        ("CNI_CONTAINERID", "c0ffee".to_owned()),
        ("CNI_NETNS", netns.display().to_string()),
        ("CNI_IFNAME", "eth0".to_owned()),
        (
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0".to_owned(),
        ),
        ("CNI_PATH", "/opt/cni/bin".to_owned()),
    ]
}

/// Checks an error outcome: exit code, JSON code, and words in the message.
fn assert_error(outcome: &Outcome, code: u64, words: &[&str]) {
    assert_ne!(outcome.exit_code, 0, "{outcome:?}");
    let json: serde_json::Value = serde_json::from_str(&outcome.stdout).expect("errors are JSON");
    assert_eq!(json["code"], code, "{outcome:?}");
    assert!(json["cniVersion"].is_string());
    let text = format!("{} {}", json["msg"], json["details"]);
    for word in words {
        assert!(text.contains(word), "{word:?} not in {text}");
    }
}

fn fixture() -> (Scratch, PathBuf, PathBuf) {
    let scratch = Scratch::new();
    let netns = scratch.0.join("pod-netns");
    std::fs::write(&netns, "").unwrap();
    let host = scratch.0.join("host-netns");
    std::fs::write(&host, "").unwrap();
    (scratch, netns, host)
}

#[test]
fn version_lists_the_supported_versions() {
    let (_s, _netns, host) = fixture();
    let call = Call {
        env: vec![("CNI_COMMAND", "VERSION".to_owned())],
        stdin: r#"{"cniVersion":"1.0.0"}"#.to_owned(),
    };
    let outcome = call.run(&host);
    assert_eq!(outcome.exit_code, 0);
    let json: serde_json::Value = serde_json::from_str(&outcome.stdout).unwrap();
    assert_eq!(
        json["supportedVersions"],
        serde_json::json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
    );
}

#[test]
fn bad_environment_is_code_4_naming_the_variable() {
    let (scratch, netns, host) = fixture();
    let stdin = config(&scratch.0.join("none.sock"), "1.0.0", true, "");
    let without = |var: &str| {
        let env = pod_env("ADD", &netns)
            .into_iter()
            .filter(|(k, _)| *k != var)
            .collect();
        Call {
            env,
            stdin: stdin.clone(),
        }
    };
    for var in ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"] {
        assert_error(&without(var).run(&host), 4, &[var]);
    }
    let mut unknown = without("CNI_COMMAND");
    unknown.env.push(("CNI_COMMAND", "FROB".to_owned()));
    assert_error(&unknown.run(&host), 4, &["FROB"]);
    let mut bad_args = without("CNI_ARGS");
    bad_args.env.push(("CNI_ARGS", "K8S_POD_NAME".to_owned()));
    assert_error(&bad_args.run(&host), 4, &["CNI_ARGS"]);
}

#[test]
fn bad_configuration_gets_the_spec_codes() {
    let (scratch, netns, host) = fixture();
    let socket = scratch.0.join("none.sock");
    let cases: Vec<(String, u64, Vec<&str>)> = vec![
        ("{not json".to_owned(), 6, vec!["stdin"]),
        (
            r#"{"cniVersion":"1.0.0","type":"konnectivity-cni"}"#.to_owned(),
            6,
            vec!["name"],
        ),
        (config(&socket, "0.2.0", true, ""), 1, vec!["0.2.0", "1.1.0"]),
        (config(&socket, "1.0.0", false, ""), 7, vec!["prevResult"]),
        (
            config(&socket, "1.0.0", true, "")
                .replace(r#""agentTimeoutMillis":500"#, r#""agentTimeoutMillis":0"#),
            7,
            vec!["agentTimeoutMillis"],
        ),
    ];
    for (stdin, code, words) in cases {
        let call = Call {
            env: pod_env("ADD", &netns),
            stdin: stdin.clone(),
        };
        assert_error(&call.run(&host), code, &words);
    }
}

#[test]
fn add_tells_the_agent_and_returns_prev_result_byte_for_byte() {
    let (scratch, netns, host) = fixture();
    let agent = FakeAgent::start(&scratch.0, Reply::ok());
    for version in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let call = Call {
            env: pod_env("ADD", &netns),
            stdin: config(&agent.socket, version, true, ""),
        };
        let outcome = call.run(&host);
        assert_eq!(
            outcome,
            Outcome {
                stdout: PREV_RESULT.to_owned(),
                exit_code: 0
            }
        );
    }
    let Request::Add(pod) = &agent.requests()[0] else {
        panic!("expected ADD")
    };
    assert_eq!(pod.container_id, "c0ffee");
    assert_eq!(pod.netns, netns.display().to_string());
    assert_eq!(pod.ips, ["10.244.1.5/24"]);
    assert_eq!(
        (pod.pod_namespace.as_str(), pod.pod_name.as_str()),
        ("default", "web-0")
    );
}

#[test]
fn add_without_the_agent_fails_with_try_again_later() {
    let (scratch, netns, host) = fixture();
    let call = Call {
        env: pod_env("ADD", &netns),
        stdin: config(&scratch.0.join("none.sock"), "1.0.0", true, ""),
    };
    assert_error(&call.run(&host), 11, &["node agent"]);
    let refusing = FakeAgent::start(&scratch.0, Reply::failed("nft: permission denied"));
    let call = Call {
        env: pod_env("ADD", &netns),
        stdin: config(&refusing.socket, "1.0.0", true, ""),
    };
    assert_error(&call.run(&host), 11, &["nft: permission denied"]);
}

#[test]
fn excluded_namespaces_and_the_host_netns_are_passed_through_untouched() {
    let (scratch, netns, host) = fixture();
    // No agent listens: passing through must not need it.
    let socket = scratch.0.join("none.sock");
    let excluded = Call {
        env: pod_env("ADD", &netns),
        stdin: config(&socket, "1.0.0", true, r#","excludeNamespaces":["default"]"#),
    };
    assert_eq!(
        excluded.run(&host),
        Outcome {
            stdout: PREV_RESULT.to_owned(),
            exit_code: 0
        }
    );
    let host_pod = Call {
        env: pod_env("ADD", &host),
        stdin: config(&socket, "1.0.0", true, ""),
    };
    assert_eq!(
        host_pod.run(&host),
        Outcome {
            stdout: PREV_RESULT.to_owned(),
            exit_code: 0
        }
    );
}

#[test]
fn del_always_succeeds() {
    let (scratch, netns, host) = fixture();
    let down = config(&scratch.0.join("none.sock"), "1.0.0", false, "");
    let mut without_netns = pod_env("DEL", &netns);
    without_netns.retain(|(k, _)| *k != "CNI_NETNS");
    for env in [pod_env("DEL", &netns), pod_env("DEL", &netns), without_netns] {
        let outcome = Call {
            env,
            stdin: down.clone(),
        }
        .run(&host);
        assert_eq!(
            outcome,
            Outcome {
                stdout: String::new(),
                exit_code: 0
            }
        );
    }
    let agent = FakeAgent::start(&scratch.0, Reply::failed("unknown pod"));
    let call = Call {
        env: pod_env("DEL", &netns),
        stdin: config(&agent.socket, "1.0.0", false, ""),
    };
    assert_eq!(call.run(&host).exit_code, 0);
    assert!(matches!(agent.requests()[0], Request::Del { .. }));
}

#[test]
fn check_reports_a_missing_capture() {
    let (scratch, netns, host) = fixture();
    let present = FakeAgent::start(&scratch.0, Reply::ok());
    let call = Call {
        env: pod_env("CHECK", &netns),
        stdin: config(&present.socket, "1.0.0", true, ""),
    };
    assert_eq!(
        call.run(&host),
        Outcome {
            stdout: String::new(),
            exit_code: 0
        }
    );
    std::fs::remove_file(&present.socket).unwrap();
    let missing = FakeAgent::start(&scratch.0, Reply::failed("no listener in the pod"));
    let call = Call {
        env: pod_env("CHECK", &netns),
        stdin: config(&missing.socket, "1.0.0", true, ""),
    };
    assert_error(&call.run(&host), 100, &["no listener in the pod"]);
    let down = Call {
        env: pod_env("CHECK", &netns),
        stdin: config(&scratch.0.join("none.sock"), "1.0.0", true, ""),
    };
    assert_error(&down.run(&host), 11, &["node agent"]);
}

#[test]
fn status_and_gc_for_1_1_0() {
    let (scratch, _netns, host) = fixture();
    let env = |command: &str| vec![("CNI_COMMAND", command.to_owned())];
    let down = config(&scratch.0.join("none.sock"), "1.1.0", false, "");
    assert_error(
        &Call {
            env: env("STATUS"),
            stdin: down.clone(),
        }
        .run(&host),
        50,
        &["node agent"],
    );
    assert_eq!(
        Call {
            env: env("GC"),
            stdin: down
        }
        .run(&host)
        .exit_code,
        0
    );

    let agent = FakeAgent::start(&scratch.0, Reply::ok());
    let up = config(
        &agent.socket,
        "1.1.0",
        false,
        r#","cni.dev/valid-attachments":[{"containerID":"c0ffee","ifname":"eth0"}]"#,
    );
    assert_eq!(
        Call {
            env: env("STATUS"),
            stdin: up.clone()
        }
        .run(&host)
        .exit_code,
        0
    );
    assert_eq!(
        Call {
            env: env("GC"),
            stdin: up
        }
        .run(&host)
        .exit_code,
        0
    );
    let Request::Gc { valid } = &agent.requests()[1] else {
        panic!("expected GC")
    };
    assert_eq!(valid[0].container_id, "c0ffee");
}
