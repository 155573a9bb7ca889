//! What the two ends of a stream negotiated beyond upstream's protocol.

/// What the two ends of a stream agreed on beyond upstream's protocol.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Extensions {
    /// Nothing: an upstream peer, upstream's behaviour.
    #[default]
    Upstream,
    /// Per-connection flow control ([`flow`], docs/flow-control.md).
    FlowControl,
    /// Flow control, and connections that outlive their stream
    /// ([`replay`], docs/resume.md).
    Resume,
}

impl Extensions {
    pub fn flow_control(self) -> bool {
        self != Extensions::Upstream
    }

    pub fn resume(self) -> bool {
        self == Extensions::Resume
    }
}
