//! What the plugin and the node agent say to each other over the agent's
//! Unix socket: one JSON request line, one JSON reply line.

use serde::{Deserialize, Serialize};

/// The largest message either side accepts.
pub const MAX_MESSAGE: usize = 64 * 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "UPPERCASE")]
pub enum Request {
    /// A pod was attached: capture inside its namespace.
    Add(Pod),
    /// A pod was detached: forget it (its rules die with its namespace).
    Del {
        #[serde(rename = "containerId")]
        container_id: String,
        ifname: String,
    },
    /// Are the rule and the listener in place for this pod?
    Check(Pod),
    /// Is the agent ready to take pods?
    Status,
    /// Forget every pod not in this list.
    Gc { valid: Vec<Attachment> },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    #[serde(rename = "containerId")]
    pub container_id: String,
    /// `/var/run/netns/...` or `/proc/PID/ns/net`.
    pub netns: String,
    pub ifname: String,
    pub ips: Vec<String>,
    #[serde(rename = "podNamespace", default)]
    pub pod_namespace: String,
    #[serde(rename = "podName", default)]
    pub pod_name: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply {
            ok: true,
            error: String::new(),
        }
    }

    pub fn failed(error: impl Into<String>) -> Reply {
        Reply {
            ok: false,
            error: error.into(),
        }
    }
}
