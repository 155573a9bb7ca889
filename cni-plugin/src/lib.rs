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
