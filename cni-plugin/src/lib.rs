//! konnectivity-cni: a chained CNI plugin that hands each pod to the node's
//! proxy-agent, which captures the pod's API server traffic inside the pod's
//! own network namespace. The plugin does no networking itself.
//!
//! [`env`] and [`config`] read the CNI contract, [`plugin`] runs the commands,
//! [`agent_client`] and [`message`] are the conversation with the agent.

pub mod agent_client;
pub mod config;
pub mod env;
pub mod error;
pub mod message;
pub mod plugin;

/// What a person running the plugin by hand is told.
pub const USAGE: &str = "\
konnectivity-cni: a chained CNI plugin. For every pod it asks the node's proxy-agent (over the
agent's --cni-socket) to capture the pod's kube-apiserver traffic inside the pod's own network
namespace; it does no networking itself.

It is run by the container runtime, not by hand: the runtime sets CNI_COMMAND (ADD, DEL, CHECK,
STATUS, GC or VERSION), CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME and CNI_PATH, and writes the network
configuration (with \"agentSocket\" and the main plugin's prevResult) on standard input; the answer
is JSON on standard output. `proxy-agent install-cni` installs it and chains it into the node's CNI
configuration (docs/pod-capture.md).

Try: CNI_COMMAND=VERSION konnectivity-cni
";
