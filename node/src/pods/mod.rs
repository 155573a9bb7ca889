//! Pods whose connections are captured: a capture listener inside each
//! pod's network namespace ([`captured`]), entered from a thread of its own
//! ([`netns`]), and what is recorded and handed over per pod ([`state`]).

pub mod captured;
pub mod netns;
pub mod state;
