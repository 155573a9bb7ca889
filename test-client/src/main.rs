//! proxy-test-client: fetches one URL path through a proxy-server, in gRPC or
//! HTTP CONNECT mode, over its Unix socket or TCP with mTLS; like upstream's
//! test client of the same name. Prints the HTTP response. (A crate of its
//! own, so that the konnectivity-client library needs no CLI dependencies.)

use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use konnectivity_plumbing::tls::{Identity, PemFile, client_config};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    Grpc,
    HttpConnect,
}

#[derive(Parser, Debug)]
#[command(
    name = "proxy-test-client",
    version,
    about = "Fetches one URL path through a proxy-server, as upstream's test client does: over gRPC \
             (ProxyService) or HTTP CONNECT, on the server's Unix socket or on TCP with mTLS; prints \
             the HTTP response"
)]
struct Args {
    /// How to talk to the proxy-server.
    #[arg(long, value_enum, default_value = "grpc")]
    mode: Mode,
    /// The server's Unix socket; when empty, TCP to --proxy-host:--proxy-port with mTLS.
    #[arg(long, default_value = "")]
    proxy_uds: String,
    /// The server's frontend host (TCP).
    #[arg(long, default_value = "localhost")]
    proxy_host: String,
    /// The server's frontend port (TCP: its --server-port).
    #[arg(long, default_value_t = 8090)]
    proxy_port: u16,
    /// CA of the server's certificate (TCP only).
    #[arg(long, default_value = "")]
    ca_cert: String,
    /// Client certificate (TCP only).
    #[arg(long, default_value = "")]
    client_cert: String,
    /// Key of --client-cert.
    #[arg(long, default_value = "")]
    client_key: String,
    /// The host to fetch from, as the agent resolves it.
    #[arg(long, default_value = "localhost")]
    request_host: String,
    /// The port to fetch from.
    #[arg(long, default_value_t = 8000)]
    request_port: u16,
    /// The path to GET.
    #[arg(long, default_value = "/")]
    request_path: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let target = format!("{}:{}", args.request_host, args.request_port);
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: proxy-test-client\r\nConnection: close\r\n\r\n",
        args.request_path
    );
    let response = match (args.mode, args.proxy_uds.is_empty()) {
        (Mode::Grpc, false) => {
            let tunnel = konnectivity_client::Tunnel::connect_uds(&args.proxy_uds).await?;
            fetch(tunnel.dial(&target).await?, &request).await?
        }
        (Mode::Grpc, true) => {
            let tls = tls(&args)?;
            let tunnel =
                konnectivity_client::Tunnel::connect_tls(&args.proxy_host, args.proxy_port, tls).await?;
            fetch(tunnel.dial(&target).await?, &request).await?
        }
        (Mode::HttpConnect, false) => {
            let stream = tokio::net::UnixStream::connect(&args.proxy_uds)
                .await
                .with_context(|| format!("connecting to {}", args.proxy_uds))?;
            fetch(http_connect(stream, &target).await?, &request).await?
        }
        (Mode::HttpConnect, true) => {
            let tcp = tokio::net::TcpStream::connect((args.proxy_host.as_str(), args.proxy_port)).await?;
            let name = konnectivity_client::net::server_name(&args.proxy_host)?;
            let stream = tokio_rustls::TlsConnector::from(tls(&args)?)
                .connect(name, tcp)
                .await?;
            fetch(http_connect(stream, &target).await?, &request).await?
        }
    };
    print!("{}", String::from_utf8_lossy(&response));
    Ok(())
}

fn tls(args: &Args) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let ca = (!args.ca_cert.is_empty()).then(|| PemFile::new("ca-cert", &args.ca_cert));
    let identity = (!args.client_cert.is_empty()).then(|| Identity {
        cert: PemFile::new("client-cert", &args.client_cert),
        key: PemFile::new("client-key", &args.client_key),
    });
    Ok(Arc::new(client_config(ca.as_ref(), identity.as_ref(), &[])?))
}

/// Sends a CONNECT and checks for the 200 line, reading no further than the head.
async fn http_connect<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, target: &str) -> anyhow::Result<S> {
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8];
        if stream.read(&mut byte).await? == 0 || head.len() > 16 * 1024 {
            bail!("proxy closed the connection during the CONNECT response");
        }
        head.push(byte[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        let mut body = Vec::new();
        let _ = stream.read_to_end(&mut body).await;
        // The status line and the server's explanation, told apart.
        bail!(
            "CONNECT refused with {:?}: {}",
            String::from_utf8_lossy(&head).lines().next().unwrap_or_default(),
            String::from_utf8_lossy(&body).trim_end()
        );
    }
    Ok(stream)
}

async fn fetch<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, request: &str) -> anyhow::Result<Vec<u8>> {
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    Ok(response)
}
