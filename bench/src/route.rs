//! How a client reaches a target: directly, or through the tunnel in one of
//! kube-apiserver's two modes.

use std::net::SocketAddr;
use std::path::PathBuf;

use std::pin::Pin;
use std::task::{Context, Poll};

use anyhow::{Context as _, bail};
use konnectivity_client::{Tunnel, TunnelStream};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
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
    /// Two plain relay processes between client and target (TCP to TCP, no
    /// TLS, no framing): the same number of hops as the tunnel, the physical
    /// anchor of a two-hop path on this machine.
    Relays { first: SocketAddr },
    /// HTTP CONNECT over the server's Unix socket, one socket per connection.
    HttpConnect { uds: PathBuf },
    /// gRPC ProxyService over the server's Unix socket as kube-apiserver
    /// dials it (konnectivity-client v0.36.0,
    /// `CreateSingleUseGrpcTunnelWithContext`): a new HTTP/2 connection per
    /// tunneled connection, closed with it.
    Grpc { uds: PathBuf },
    /// gRPC as newer clients use it: one HTTP/2 connection, one stream per
    /// tunneled connection.
    GrpcShared { tunnel: Tunnel },
    /// grpc-go's own server answering single-use tunnels alone, no agent and
    /// no target (`bench/go/null_server.go`): the ceiling of any gRPC
    /// frontend for the Go gRPC client, which alone measures it.
    GrpcNull { uds: PathBuf },
}

impl Route {
    pub fn name(&self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::Relays { .. } => "two relays",
            Route::HttpConnect { .. } => "connect",
            Route::Grpc { .. } => "grpc",
            Route::GrpcShared { .. } => "grpc, one connection",
            Route::GrpcNull { .. } => "grpc-go null server",
        }
    }

    /// The tunneled routes through `stack`'s frontend.
    pub async fn for_stack(stack: &Stack) -> anyhow::Result<Vec<Route>> {
        Ok(match stack.mode {
            Mode::Grpc => vec![
                Route::Grpc {
                    uds: stack.uds.clone(),
                },
                Route::GrpcShared {
                    tunnel: Tunnel::connect_uds(&stack.uds).await?,
                },
            ],
            Mode::HttpConnect => vec![Route::HttpConnect {
                uds: stack.uds.clone(),
            }],
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
            Route::Relays { first } => {
                let mut stream = TcpStream::connect(first).await?;
                stream.set_nodelay(true)?;
                stream.write_all(format!("{target}\n").as_bytes()).await?;
                Ok(Box::new(stream))
            }
            Route::Grpc { uds } => {
                let tunnel = Tunnel::connect_uds(uds)
                    .await
                    .with_context(|| format!("connecting to {}", uds.display()))?;
                let stream = tunnel.dial(&target.to_string()).await?;
                Ok(Box::new(SingleUse {
                    stream,
                    _tunnel: tunnel,
                }))
            }
            Route::GrpcShared { tunnel } => Ok(Box::new(tunnel.dial(&target.to_string()).await?)),
            Route::GrpcNull { .. } => bail!("the null gRPC server is measured by the Go client only"),
        }
    }
}

/// A tunneled connection with the HTTP/2 connection made for it alone: both
/// go when it is dropped.
struct SingleUse {
    stream: TunnelStream,
    _tunnel: Tunnel,
}

impl AsyncRead for SingleUse {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for SingleUse {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// A plain relay (`konnectivity-bench relay`): reads the target's address
/// as the first line, then copies bytes both ways, either to the target or
/// through the next relay; no TLS, no framing.
pub async fn relay(next: Option<SocketAddr>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", listener.local_addr()?.port());
    loop {
        let (mut client, _) = listener.accept().await?;
        tokio::spawn(async move {
            let _ = client.set_nodelay(true);
            // The address line, read a byte at a time so nothing after it
            // is taken from the connection.
            let mut line = Vec::new();
            let mut byte = [0u8; 1];
            while client.read_exact(&mut byte).await.is_ok() && byte[0] != b'\n' && line.len() < 64 {
                line.push(byte[0]);
            }
            let Ok(target) = String::from_utf8_lossy(&line).parse::<SocketAddr>() else {
                return;
            };
            let Ok(mut onward) = TcpStream::connect(next.unwrap_or(target)).await else {
                return;
            };
            let _ = onward.set_nodelay(true);
            if next.is_some() && onward.write_all(&[&line[..], b"\n"].concat()).await.is_err() {
                return;
            }
            // Buffers as large as the tunnel's writes (256 KiB), as socat -b.
            let _ =
                tokio::io::copy_bidirectional_with_sizes(&mut client, &mut onward, 256 * 1024, 256 * 1024)
                    .await;
        });
    }
}
