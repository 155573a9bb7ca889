//! The node role of proxy-agent: transparent capture of node processes' and
//! pods' connections to the API server's service VIP, tunneled through the
//! server's node frontend to a control-plane agent.
//!
//! Reading order: [`settings`] (what the agent's flags say), [`role`] (how
//! the role starts, runs and is handed over), [`tunnel`] (the connection
//! to the node frontend), [`capture`] (what is captured: the map, the nft
//! rules, the listener that tunnels each connection), [`pods`] (pods'
//! namespaces: enrolment, their listeners, their records), [`cni`] (the
//! konnectivity-cni plugin: its installation, its socket, the runtime's
//! cache), [`handover`] (passing everything to the agent that replaces this
//! one).

pub mod capture;
pub mod cni;
pub mod fleet;
pub mod handoff;
pub mod handover;
pub mod metrics;
mod pods;
pub mod programs;
pub mod readiness;
pub mod role;
mod serving;
pub mod sessions;
pub mod settings;
mod tunnel;
