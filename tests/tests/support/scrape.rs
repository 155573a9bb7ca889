//! Plain HTTP GETs against the health listeners, and metric lookups.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// GET `path` on 127.0.0.1:`port`; the status and body.
pub async fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response {response:?}")))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of the sample named exactly `series` (name plus labels as
/// exposed, e.g. `foo{reason="x"}`) in a metrics text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
}

/// Scrapes `/metrics` on `port` and returns one sample.
pub async fn metric(port: u16, series: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics").await.ok()?;
    sample(&body, series)
}
