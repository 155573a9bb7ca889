//! How a client reaches a target: directly, or through the tunnel in one of
//! kube-apiserver's two modes.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use konnectivity_client::Tunnel;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::stack::{Mode, Stack};

/// A connection to a target, whichever way it was made.
pub trait Conn: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Conn for T {}

/// The exact success line of the CONNECT frontend.
const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

#[derive(Clone)]
pub enum Route {
    /// Plain loopback TCP: the baseline.
    Direct,
    /// HTTP CONNECT over the server's Unix socket, one socket per connection.
    HttpConnect { uds: PathBuf },
    /// gRPC ProxyService over the server's Unix socket: one HTTP/2
    /// connection, one stream per tunneled connection.
    Grpc { tunnel: Tunnel },
}

impl Route {
    pub fn name(&self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::HttpConnect { .. } => "connect",
            Route::Grpc { .. } => "grpc",
        }
    }

    /// The tunneled route through `stack`'s frontend.
    pub async fn for_stack(stack: &Stack) -> anyhow::Result<Route> {
        Ok(match stack.mode {
            Mode::Grpc => Route::Grpc {
                tunnel: Tunnel::connect_uds(&stack.uds).await?,
            },
            Mode::HttpConnect => Route::HttpConnect {
                uds: stack.uds.clone(),
            },
        })
    }

    /// Opens a connection to `target`; it is usable when this returns (for
    /// the tunnel: the agent has dialed the target).
    pub async fn open(&self, target: SocketAddr) -> anyhow::Result<Box<dyn Conn>> {
        match self {
            Route::Direct => {
                let stream = TcpStream::connect(target).await?;
                stream.set_nodelay(true)?;
                Ok(Box::new(stream))
            }
            Route::HttpConnect { uds } => {
                let mut stream = UnixStream::connect(uds)
                    .await
                    .with_context(|| format!("connecting to {}", uds.display()))?;
                let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
                stream.write_all(request.as_bytes()).await?;
                // The success line has a fixed length and nothing follows it
                // but tunneled bytes, so read exactly that much.
                let mut answer = [0u8; ESTABLISHED.len()];
                stream.read_exact(&mut answer).await?;
                if answer != ESTABLISHED {
                    let mut rest = Vec::new();
                    let _ = stream.read_to_end(&mut rest).await;
                    bail!(
                        "CONNECT {target} refused: {}{}",
                        String::from_utf8_lossy(&answer),
                        String::from_utf8_lossy(&rest)
                    );
                }
                Ok(Box::new(stream))
            }
            Route::Grpc { tunnel } => Ok(Box::new(tunnel.dial(&target.to_string()).await?)),
        }
    }
}
