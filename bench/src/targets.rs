//! The targets every route reaches: TCP servers on loopback, run in a child
//! process of their own so that their sockets and CPU are not counted
//! against the client (10,000 idle connections need 10,000 descriptors on
//! each side).

use std::net::SocketAddr;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The ports of one target process.
#[derive(Clone, Copy, Debug)]
pub struct Targets {
    /// Echoes every byte back.
    pub echo: SocketAddr,
    /// Reads an 8-byte big-endian length and that many bytes, then answers
    /// with the same 8 bytes; repeats until EOF. A transfer counts as done
    /// only when every byte has reached the target.
    pub sink: SocketAddr,
    /// Writes without end until the peer goes away.
    pub source: SocketAddr,
    /// Accepts and never reads: the peer's writes back up.
    pub blackhole: SocketAddr,
}

impl Targets {
    pub fn to_json(self) -> String {
        json!({
            "echo": self.echo.port(),
            "sink": self.sink.port(),
            "source": self.source.port(),
            "blackhole": self.blackhole.port(),
        })
        .to_string()
    }

    pub fn from_json(line: &str) -> anyhow::Result<Targets> {
        let value: serde_json::Value = serde_json::from_str(line)?;
        let port = |name: &str| -> anyhow::Result<SocketAddr> {
            let port = value[name]
                .as_u64()
                .ok_or_else(|| anyhow::anyhow!("target line {line:?} has no {name} port"))?;
            Ok(SocketAddr::from(([127, 0, 0, 1], port as u16)))
        };
        Ok(Targets {
            echo: port("echo")?,
            sink: port("sink")?,
            source: port("source")?,
            blackhole: port("blackhole")?,
        })
    }
}

/// Binds every target, prints their ports as one JSON line on stdout and
/// serves until killed.
pub async fn serve() -> anyhow::Result<()> {
    let bind = || TcpListener::bind("127.0.0.1:0");
    let (echo, sink, source, blackhole) = (bind().await?, bind().await?, bind().await?, bind().await?);
    let targets = Targets {
        echo: echo.local_addr()?,
        sink: sink.local_addr()?,
        source: source.local_addr()?,
        blackhole: blackhole.local_addr()?,
    };
    println!("{}", targets.to_json());
    tokio::spawn(accept(echo, |stream| async move {
        let (mut read, mut write) = stream.into_split();
        let _ = tokio::io::copy(&mut read, &mut write).await;
    }));
    tokio::spawn(accept(sink, sink_connection));
    tokio::spawn(accept(source, |mut stream| async move {
        let chunk = vec![0x5a_u8; 64 * 1024];
        while stream.write_all(&chunk).await.is_ok() {}
    }));
    // Held open and never read; the process ends with them.
    let mut held = Vec::new();
    loop {
        let (stream, _) = blackhole.accept().await?;
        held.push(stream);
    }
}

async fn accept<F, Fut>(listener: TcpListener, serve: F)
where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream));
            }
            // Out of descriptors for a moment: back off instead of spinning.
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
        }
    }
}

async fn sink_connection(mut stream: TcpStream) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let mut header = [0u8; 8];
        if stream.read_exact(&mut header).await.is_err() {
            return;
        }
        let mut left = u64::from_be_bytes(header);
        while left > 0 {
            let want = buf.len().min(left as usize);
            match stream.read(&mut buf[..want]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => left -= n as u64,
            }
        }
        if stream.write_all(&header).await.is_err() {
            return;
        }
    }
}
