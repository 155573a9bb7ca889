//! The plugin's commands.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::agent_client;
use crate::config::{NetConf, SUPPORTED_VERSIONS};
use crate::env::{self, CniEnv, Command};
use crate::error::{CniError, code};
use crate::message::{Pod, Request};

/// What to print and how to exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: String,
    pub exit_code: i32,
}

impl Outcome {
    fn success(stdout: impl Into<String>) -> Outcome {
        Outcome {
            stdout: stdout.into(),
            exit_code: 0,
        }
    }

    fn error(error: &CniError, cni_version: &str) -> Outcome {
        Outcome {
            stdout: error.to_json(cni_version),
            exit_code: 1,
        }
    }
}

/// Runs one CNI call. `vars` reads the environment; `host_netns` is the
/// host's network namespace (the plugin's own), which is never touched.
pub fn run<'a>(vars: impl Fn(&str) -> Option<&'a str>, stdin: &[u8], host_netns: &Path) -> Outcome {
    let (command, env) = match env::parse(vars) {
        Ok(parsed) => parsed,
        Err(error) => return Outcome::error(&error, newest()),
    };
    if command == Command::Version {
        return Outcome::success(version_json());
    }
    let conf = match NetConf::parse(stdin) {
        Ok(conf) => conf,
        Err(error) => return Outcome::error(&error, newest()),
    };
    let result = match command {
        Command::Add => add(&conf, &env, host_netns),
        Command::Del => del(&conf, &env),
        Command::Check => check(&conf, &env, host_netns),
        Command::Status => status(&conf),
        Command::Gc => gc(&conf),
        Command::Version => unreachable!("handled above"),
    };
    match result {
        Ok(stdout) => Outcome::success(stdout),
        Err(error) => Outcome::error(&error, &conf.cni_version),
    }
}

fn newest() -> &'static str {
    SUPPORTED_VERSIONS[SUPPORTED_VERSIONS.len() - 1]
}

fn version_json() -> String {
    serde_json::json!({ "cniVersion": newest(), "supportedVersions": SUPPORTED_VERSIONS }).to_string()
}

/// Whether this pod is left alone: an excluded namespace, or a netns that
/// is the host's own (a hostNetwork sandbox must never get our rules).
fn passed_through(conf: &NetConf, env: &CniEnv, host_netns: &Path) -> bool {
    let excluded = env
        .args
        .get("K8S_POD_NAMESPACE")
        .is_some_and(|namespace| conf.exclude_namespaces.contains(namespace));
    let same_file = |a: &Path, b: &Path| match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    };
    let host = env
        .netns
        .as_deref()
        .is_some_and(|netns| same_file(Path::new(netns), host_netns));
    excluded || host
}

fn pod(conf: &NetConf, env: &CniEnv) -> Pod {
    Pod {
        container_id: env.container_id.clone(),
        netns: env.netns.clone().unwrap_or_default(),
        ifname: env.ifname.clone(),
        ips: conf.pod_ips(),
        pod_namespace: env.args.get("K8S_POD_NAMESPACE").cloned().unwrap_or_default(),
        pod_name: env.args.get("K8S_POD_NAME").cloned().unwrap_or_default(),
    }
}

/// ADD: the agent must have the capture in place before the pod runs; if it
/// cannot be reached we fail with "try again later" so no pod runs uncaptured.
fn add(conf: &NetConf, env: &CniEnv, host_netns: &Path) -> Result<String, CniError> {
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        CniError::new(
            code::INVALID_CONFIG,
            "field \"prevResult\" is missing: konnectivity-cni is a chained plugin and must follow the main plugin",
        )
    })?;
    if !passed_through(conf, env, host_netns) {
        let reply = agent_client::call(
            &conf.agent_socket,
            &Request::Add(pod(conf, env)),
            conf.agent_timeout(),
        )
        .map_err(|e| CniError::new(code::TRY_AGAIN_LATER, e.to_string()))?;
        if !reply.ok {
            return Err(
                CniError::new(code::TRY_AGAIN_LATER, "the node agent could not capture the pod")
                    .with_details(reply.error),
            );
        }
    }
    // A chained plugin that changes nothing returns the result it was given.
    Ok(prev.get().to_owned())
}

/// DEL always succeeds: repeated, after the namespace is gone, or with the
/// agent down (it forgets pods whose namespace disappeared on its own).
fn del(conf: &NetConf, env: &CniEnv) -> Result<String, CniError> {
    let request = Request::Del {
        container_id: env.container_id.clone(),
        ifname: env.ifname.clone(),
    };
    let _ = agent_client::call(&conf.agent_socket, &request, conf.agent_timeout());
    Ok(String::new())
}

fn check(conf: &NetConf, env: &CniEnv, host_netns: &Path) -> Result<String, CniError> {
    if conf.prev_result.is_none() {
        return Err(CniError::new(
            code::INVALID_CONFIG,
            "field \"prevResult\" is missing for CHECK",
        ));
    }
    if passed_through(conf, env, host_netns) {
        return Ok(String::new());
    }
    let reply = agent_client::call(
        &conf.agent_socket,
        &Request::Check(pod(conf, env)),
        conf.agent_timeout(),
    )
    .map_err(|e| CniError::new(code::TRY_AGAIN_LATER, e.to_string()))?;
    if reply.ok {
        Ok(String::new())
    } else {
        Err(CniError::new(
            code::CAPTURE_MISSING,
            "the pod's capture rule or listener is not in place",
        )
        .with_details(reply.error))
    }
}

fn status(conf: &NetConf) -> Result<String, CniError> {
    match agent_client::call(&conf.agent_socket, &Request::Status, conf.agent_timeout()) {
        Ok(reply) if reply.ok => Ok(String::new()),
        Ok(reply) => Err(
            CniError::new(code::PLUGIN_NOT_AVAILABLE, "the node agent is not ready")
                .with_details(reply.error),
        ),
        Err(error) => Err(CniError::new(code::PLUGIN_NOT_AVAILABLE, error.to_string())),
    }
}

/// GC forwards the valid attachments; with the agent down there is nothing
/// to collect now, and the agent reconciles when it starts.
fn gc(conf: &NetConf) -> Result<String, CniError> {
    let request = Request::Gc {
        valid: conf.valid_attachments.clone(),
    };
    let _ = agent_client::call(&conf.agent_socket, &request, conf.agent_timeout());
    Ok(String::new())
}
