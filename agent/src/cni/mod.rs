//! Installing the konnectivity-cni plugin on a node (`proxy-agent
//! install-cni`): the binary into the CNI bin directory and our entry into
//! the runtime's network configuration, and reading back which networks
//! chain it ([`network`]). What the agent does for each pod
//! the plugin hands it is `crate::capture` (pods, the CNI socket).

pub mod install;
pub mod network;
