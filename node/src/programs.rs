//! Every program a konnectivity-rs binary runs, in one place. proxy-agent is
//! the only one that runs any (proxy-server and konnectivity-cni run none),
//! and the image must ship each of them: `tests/tests/image.rs` checks every
//! entry here against the image's own filesystem.
//!
//! nftables rules go through the `nft` program, as kube-proxy's nftables
//! mode does: its text format is the stable interface, and one `nft -f -`
//! transaction makes a ruleset change atomic. Everything else the agent
//! does to the network (a pod's loopback, its listeners) is done with
//! system calls and netlink from the agent itself.

use std::process::Command;

/// A program the agent runs, and where it comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Program {
    /// Looked up in PATH.
    pub name: &'static str,
    /// The Debian package that ships it (the image installs it).
    pub package: &'static str,
    /// What it is run for.
    pub purpose: &'static str,
}

impl Program {
    pub fn command(&self) -> Command {
        Command::new(self.name)
    }
}

/// nftables' command-line tool.
pub const NFT: Program = Program {
    name: "nft",
    package: "nftables",
    purpose: "capture rules in the node's and in each pod's network namespace",
};

/// All of them.
pub const ALL: &[Program] = &[NFT];
