//! Fetches a URL path from a host behind a Konnectivity agent, through a
//! proxy-server's gRPC frontend on a Unix socket.
//!
//! cargo run -p konnectivity-client --example fetch -- /path/to/server.socket 10.0.0.5:8080 /healthz

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(socket), Some(target), path) = (args.next(), args.next(), args.next()) else {
        anyhow::bail!("usage: fetch SOCKET HOST:PORT [PATH]");
    };
    let path = path.unwrap_or_else(|| "/".to_owned());

    let tunnel = konnectivity_client::Tunnel::connect_uds(&socket).await?;
    let mut stream = tunnel.dial(&target).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    print!("{}", String::from_utf8_lossy(&response));
    Ok(())
}
