//! The agent's CNI socket: one request line from the plugin, one reply line.
//! Mode 0600, owned by root; oversized or malformed requests are refused.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use konnectivity_cni::message::{MAX_MESSAGE, Reply, Request};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::pods::captured::Pods;
use crate::readiness::NodeReadiness;

/// How long the plugin may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the socket, replacing a stale file from an earlier run.
pub(crate) fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

pub(crate) async fn serve(listener: Arc<UnixListener>, pods: Arc<Pods>, readiness: Arc<NodeReadiness>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(handle(stream, pods.clone(), readiness.clone()));
            }
            Err(error) => {
                tracing::warn!(%error, "CNI socket accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn handle(stream: UnixStream, pods: Arc<Pods>, readiness: Arc<NodeReadiness>) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_MESSAGE as u64));
    let reply = match tokio::time::timeout(READ_TIMEOUT, reader.read_line(&mut line)).await {
        Err(_) => Reply::failed("request not received in time"),
        Ok(Err(error)) => Reply::failed(format!("reading the request: {error}")),
        Ok(Ok(_)) if !line.ends_with('\n') => {
            Reply::failed(format!("request larger than {MAX_MESSAGE} bytes or cut short"))
        }
        Ok(Ok(_)) => match serde_json::from_str::<Request>(&line) {
            Ok(request) => answer(request, &pods, &readiness).await,
            Err(error) => Reply::failed(format!("malformed request: {error}")),
        },
    };
    let mut bytes = serde_json::to_vec(&reply).expect("replies serialize");
    bytes.push(b'\n');
    let _ = write.write_all(&bytes).await;
}

async fn answer(request: Request, pods: &Pods, readiness: &NodeReadiness) -> Reply {
    match request {
        Request::Add(pod) => match pods.add(&pod).await {
            Ok(()) => Reply::ok(),
            Err(error) => {
                tracing::warn!(container_id = %pod.container_id, %error, "pod capture failed");
                Reply::failed(error.to_string())
            }
        },
        Request::Del { container_id, .. } => {
            pods.remove(&container_id);
            Reply::ok()
        }
        Request::Check(pod) => match pods.check(&pod.container_id).await {
            Ok(()) => Reply::ok(),
            Err(error) => Reply::failed(error),
        },
        Request::Status if readiness.is_ready() => Reply::ok(),
        Request::Status => Reply::failed("capture rules or node tunnel not in place"),
        Request::Gc { valid } => {
            pods.retain(&valid);
            Reply::ok()
        }
    }
}
