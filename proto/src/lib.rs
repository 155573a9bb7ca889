//! The Konnectivity wire protocol: generated messages and services, identity
//! newtypes, and a validated view of packets ([`Frame`]).
//!
//! The `.proto` files are in the empty package, exactly as upstream, so the
//! gRPC paths are `/ProxyService/Proxy` and `/AgentService/Connect`.

#![allow(clippy::large_enum_variant)]

pub mod codec;
mod frame;
mod identifiers;
mod ids;
mod target;
pub mod wire;

pub use frame::{Frame, PacketError, ResumeEntry};
pub use identifiers::{AgentIdentifiers, IdentifiersError};
pub use ids::{ConnectId, DialId};
pub use target::{DialTarget, TargetError};

pub use wire::{Packet, PacketType};

/// gRPC path of the frontend service that kube-apiserver and tunnel clients use.
pub const PROXY_PATH: &str = "/ProxyService/Proxy";
/// gRPC path of the service that agents call on the server.
pub const AGENT_CONNECT_PATH: &str = "/AgentService/Connect";

/// Metadata keys; lowercase as they travel on the wire.
pub mod metadata {
    /// Agent → server: exactly one value, the agent's identity.
    pub const AGENT_ID: &str = "agentid";
    /// Agent → server: at most one value, a URL query string of identifiers.
    pub const AGENT_IDENTIFIERS: &str = "agentidentifiers";
    /// Server → agent response header: the server's identity. Our node
    /// frontend sends it too, on every answer and on the refusal of a token
    /// that names another server, so that a node agent behind one address
    /// with several servers can look for the one its stream lives at.
    pub const SERVER_ID: &str = "serverid";
    /// Server → agent response header: how many servers the agent should hold.
    pub const SERVER_COUNT: &str = "servercount";
    /// Agent → server, our extension: this stream is a probe of the
    /// connection. A server that knows the key answers with its usual
    /// headers and ends the stream at once, without registering a backend;
    /// upstream servers ignore it (so agents probe only servers that
    /// answered with the flow-control header, i.e. ours).
    pub const PROBE: &str = "konnectivity-rs-probe";
    /// Agent request and server response headers, our extension: both
    /// sides keep a lost stream's connections for the next stream to resume
    /// (docs/resume.md). Sent only beside the flow-control header.
    pub const RESUME: &str = "konnectivity-rs-resume";
    /// Server → agent response header: the token that resumes this
    /// stream's session (`<session><secret>@<server id>`). Agent → server:
    /// one value per lost stream the agent wants resumed.
    pub const RESUME_TOKEN: &str = "konnectivity-rs-resume-token";
    /// Server → agent response header: this stream resumed the session the
    /// agent's token named.
    pub const RESUMED: &str = "konnectivity-rs-resumed";
    /// Agent → server, with resume: the agent process's own random id. A
    /// stream from the same agent with another instance means the process
    /// that held the lost streams is gone: they will not resume.
    pub const AGENT_INSTANCE: &str = "konnectivity-rs-agent-instance";

    /// This process's random id, sent as [`AGENT_INSTANCE`] with every
    /// resumable stream it opens (agent streams and node tunnels' streams):
    /// a server that holds lost streams of the same peer under another id
    /// knows the process that held them is gone.
    pub fn instance_id() -> &'static str {
        static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        INSTANCE.get_or_init(|| format!("{:016x}{:016x}", crate::ids::rand_i64(), crate::ids::rand_i64()))
    }
    /// A node tunnel's `Proxy` stream that resumes a lost one (with
    /// [`RESUME_TOKEN`]): the client's request header says how many bytes
    /// it has received, the server's response header how many it has.
    pub const RESUME_RECEIVED: &str = "konnectivity-rs-resume-received";
}

/// The largest gRPC message Go peers accept by default; we never send more.
pub const MAX_GRPC_MESSAGE: usize = 4 * 1024 * 1024;

/// How much one DATA packet carries when we read a socket. Upstream Go peers
/// send 4 KiB; larger packets cut per-packet work (fewer wake-ups, fewer
/// frames: 64 KiB → 256 KiB took a bulk transfer from 700 to 840 MiB/s in
/// `hack/bench.sh`) and stay far below [`MAX_GRPC_MESSAGE`].
pub const DATA_CHUNK: usize = 256 * 1024;

/// The ALPN protocol our servers' agent listener prefers to `h2`: HTTP/2
/// all the same, and the server's word that its client may PING the
/// connection as often as it likes. Agents offer it beside `h2`; one that
/// negotiates it watches the connection by PINGs every `--probe-interval`
/// rather than by probe streams. Without it (upstream's server, an older
/// one of ours, anything between that ends TLS) the agent pings no more
/// than `--keepalive-time` asks: gRPC servers in Go close a connection
/// pinged more often than every 30 s (ENHANCE_YOUR_CALM, "too_many_pings").
pub const ALPN_PINGS: &[u8] = b"konnectivity-rs.h2-pings";

/// The largest HTTP/2 frame we accept (SETTINGS_MAX_FRAME_SIZE), on every
/// gRPC connection we serve or open. The protocol default of 16 KiB splits
/// each DATA packet into many frames; peers may use less.
pub const H2_MAX_FRAME_SIZE: u32 = 256 * 1024;
