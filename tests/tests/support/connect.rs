//! An HTTP CONNECT client as kube-apiserver's dialer behaves: one CONNECT
//! per connection, then raw bytes. It insists on upstream's exact success
//! line and reads the response head byte by byte so nothing is over-read.

use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

pub const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// A non-200 answer.
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub head: String,
    pub body: String,
}

pub async fn connect<S>(mut stream: S, target: &str) -> std::io::Result<Result<S, Refused>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8];
        if stream.read(&mut byte).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("closed inside response head {:?}", String::from_utf8_lossy(&head)),
            ));
        }
        head.push(byte[0]);
        assert!(head.len() < 16 * 1024, "response head too long");
    }
    if head == ESTABLISHED {
        return Ok(Ok(stream));
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut body = String::new();
    let _ = stream.read_to_string(&mut body).await;
    Ok(Err(Refused { status, head, body }))
}

/// CONNECT over TCP + TLS to the server's frontend.
pub async fn via_tls(
    port: u16,
    tls: Arc<rustls::ClientConfig>,
    target: &str,
) -> std::io::Result<Result<TlsStream<TcpStream>, Refused>> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    tcp.set_nodelay(true)?;
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let stream = TlsConnector::from(tls).connect(name, tcp).await?;
    connect(stream, target).await
}

/// CONNECT over the server's Unix socket frontend.
pub async fn via_uds(path: &Path, target: &str) -> std::io::Result<Result<UnixStream, Refused>> {
    connect(UnixStream::connect(path).await?, target).await
}
