//! The multiplexer core: what the two ends of an agent stream share.
//!
//! An agent stream carries many TCP connections. Each end keeps a table of
//! them ([`Connections`]): the server's session for the frontends' tunnels,
//! the agent's session for its endpoint sockets. Both route DATA from the
//! stream into a connection's buffer, return credit with WINDOW_UPDATE as the
//! consumer writes it out, hold back their own DATA until the peer grants
//! credit, and close a connection whose peer overran its window. Those rules
//! ([`flow`]) and the table that applies them live here once, so the two ends
//! cannot drift apart; what each end does around them (dials, metrics, logs)
//! stays in its own session.
//!
//! The wire types themselves (packets, frames, ids) are in
//! `konnectivity-proto`, which knows nothing of connections.

pub mod chunk;
mod connection;
mod extensions;
pub mod flow;
pub mod mailbox;
pub mod outbound;
pub mod replay;

pub use connection::{
    ClosingPosition, Connections, Delivery, Entry, Port, Position, RecvOrQuiet, ResumePlan, Route,
    connection, restored_connection,
};
pub use extensions::Extensions;
pub use flow::Waited;
