//! What is recorded of each captured pod: in its state file, so that a
//! restarted agent re-opens it, and in a hand-over.

use serde::{Deserialize, Serialize};

/// What is persisted per pod (and handed to a successor).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodState {
    #[serde(rename = "containerId")]
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
}
