//! Pods: the CNI plugin tells the agent about each pod over a Unix socket;
//! the agent enters the pod's network namespace, installs the same REDIRECT
//! rules there and opens a capture listener inside it. Pod connections then
//! go through the node tunnel exactly like host ones.
//!
//! [`server`] answers the plugin, [`pods`] keeps the captured pods and their
//! state files.

pub mod install;
pub mod pods;
pub mod server;
