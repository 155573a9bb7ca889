//! The Rust konnectivity-client: dial TCP connections through a Konnectivity
//! proxy-server's gRPC `ProxyService`, as kube-apiserver does.
//!
//! One [`Tunnel`] holds one HTTP/2 connection to the server, over a Unix
//! socket or TCP with mTLS. Each [`Tunnel::dial`] opens one `Proxy` stream on
//! it and returns a [`TunnelStream`] that reads and writes like a socket.
//! Many dials run concurrently over the one connection.
//!
//! ```no_run
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let tunnel = konnectivity_client::Tunnel::connect_uds("/run/konnectivity/konnectivity-server.socket").await?;
//! let mut stream = tunnel.dial("10.0.0.5:10250").await?;
//! stream.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").await?;
//! let mut response = Vec::new();
//! stream.read_to_end(&mut response).await?;
//! # Ok(())
//! # }
//! ```
//!
//! `examples/fetch.rs` is the same as a runnable program.

pub mod net;
mod stream;
mod tunnel;

pub use stream::TunnelStream;
pub use tunnel::{ConnectError, DialError, Pings, Tunnel, dial_response};
