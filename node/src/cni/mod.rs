//! The konnectivity-cni plugin's side of the node: installing it and
//! chaining it into the runtime's network configuration ([`install`]),
//! reading back which networks chain it ([`network`]), the socket it hands
//! pods to ([`socket`]), and the runtime's record of the pods it attached
//! ([`cache`]).

pub mod cache;
pub mod install;
pub mod network;
pub mod socket;
