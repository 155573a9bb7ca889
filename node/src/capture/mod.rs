//! Capture on the host and in each pod: which original destinations are
//! captured ([`map`]), the REDIRECT rules that send them to us ([`nft`]),
//! and the listener that tunnels each captured connection ([`listener`]).

pub mod handoff;
pub(crate) mod listener;
pub mod map;
pub mod nft;
pub(crate) mod resumable;
