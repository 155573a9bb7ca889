//! The network configuration the runtime passes on stdin.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::{CniError, code};
use crate::message::Attachment;

/// Spec versions this plugin speaks. 0.3.x is accepted too because widely
/// deployed conflists (flannel's) still declare 0.3.1; the plugin only passes
/// the previous result through, whose format it does not need to interpret.
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
pub const DEFAULT_AGENT_SOCKET: &str = "/var/run/konnectivity/cni.sock";

#[derive(Debug, Deserialize)]
pub struct NetConf {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub name: String,
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The node agent's socket (`--cni-socket`).
    #[serde(rename = "agentSocket", default = "default_socket")]
    pub agent_socket: PathBuf,
    /// Pods in these namespaces are passed through untouched.
    #[serde(rename = "excludeNamespaces", default)]
    pub exclude_namespaces: Vec<String>,
    /// How long to wait for the agent, per step.
    #[serde(rename = "agentTimeoutMillis", default = "default_timeout")]
    pub agent_timeout_millis: u64,
    /// The previous plugin's result, kept byte for byte: it is our result.
    #[serde(rename = "prevResult")]
    pub prev_result: Option<Box<RawValue>>,
    /// GC (1.1.0): the attachments that are still valid.
    #[serde(rename = "cni.dev/valid-attachments", default)]
    pub valid_attachments: Vec<Attachment>,
}

fn default_socket() -> PathBuf {
    PathBuf::from(DEFAULT_AGENT_SOCKET)
}

fn default_timeout() -> u64 {
    2000
}

impl NetConf {
    pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
        let conf: NetConf = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                code::DECODE_FAILURE,
                format!("network configuration on stdin: {e}"),
            )
        })?;
        if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("cniVersion {:?} is not supported", conf.cni_version),
            )
            .with_details(format!("supported: {}", SUPPORTED_VERSIONS.join(", "))));
        }
        if conf.name.is_empty() {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                "field \"name\" must not be empty",
            ));
        }
        if conf.agent_timeout_millis == 0 {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                "field \"agentTimeoutMillis\" must be positive",
            ));
        }
        Ok(conf)
    }

    pub fn agent_timeout(&self) -> Duration {
        Duration::from_millis(self.agent_timeout_millis)
    }

    /// The pod's addresses from the previous result (`ips[].address`).
    pub fn pod_ips(&self) -> Vec<String> {
        #[derive(Deserialize)]
        struct PrevResult {
            #[serde(default)]
            ips: Vec<Ip>,
        }
        #[derive(Deserialize)]
        struct Ip {
            address: String,
        }
        self.prev_result
            .as_ref()
            .and_then(|raw| serde_json::from_str::<PrevResult>(raw.get()).ok())
            .map(|result| result.ips.into_iter().map(|ip| ip.address).collect())
            .unwrap_or_default()
    }
}
