//! Talking to the node agent over its Unix socket, bounded in time.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::message::{MAX_MESSAGE, Reply, Request};

#[derive(Debug, thiserror::Error)]
pub enum AgentUnreachable {
    #[error("cannot reach the node agent at {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("the node agent at {path} sent an unreadable reply: {reason}")]
    BadReply { path: String, reason: String },
}

/// Sends one request and waits at most `timeout` for each step.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Reply, AgentUnreachable> {
    let path = socket.display().to_string();
    let io = |source| AgentUnreachable::Io {
        path: path.clone(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_vec(request).expect("requests serialize");
    line.push(b'\n');
    stream.write_all(&line).map_err(io)?;
    let mut reply = String::new();
    BufReader::new(std::io::Read::take(stream, MAX_MESSAGE as u64))
        .read_line(&mut reply)
        .map_err(io)?;
    serde_json::from_str(&reply).map_err(|e| AgentUnreachable::BadReply {
        path,
        reason: e.to_string(),
    })
}
