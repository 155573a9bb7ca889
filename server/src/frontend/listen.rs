//! Binding the frontend: a Unix socket (mode 0770, as kube-apiserver shares
//! it through a host path) or TCP with mandatory mTLS.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use konnectivity_plumbing::lifecycle::{Hold, Watcher};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;

use crate::serving::ServeError;

/// Binds a Unix socket at `path`, replacing a leftover file when asked to.
pub(crate) fn bind_uds(path: &Path, delete_existing: bool) -> Result<UnixListener, ServeError> {
    let bind_error = |source| ServeError::Bind {
        what: "frontend (--uds-name)",
        addr: path.display().to_string(),
        source,
    };
    if let Some(directory) = path.parent().filter(|dir| !dir.as_os_str().is_empty())
        && !directory.is_dir()
    {
        return Err(ServeError::Config(format!(
            "--uds-name {}: the directory {} does not exist; create it (kube-apiserver's and the \
             server's manifests mount it as a hostPath of type DirectoryOrCreate)",
            path.display(),
            directory.display()
        )));
    }
    if delete_existing && path.exists() {
        std::fs::remove_file(path).map_err(bind_error)?;
    }
    let listener = UnixListener::bind(path).map_err(bind_error)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o770)).map_err(bind_error)?;
    Ok(listener)
}

/// Accepts on a Unix socket until the drain is signalled, serving each
/// connection on a task of its own with `serve`, which is handed a [`Hold`]
/// to keep for as long as it serves: the drain waits for its tunnel. The
/// listening socket closes when this returns.
pub(crate) async fn accept_uds<F, Fut>(listener: UnixListener, watcher: Watcher, serve: F)
where
    F: Fn(tokio::net::UnixStream, Hold) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let stopped = watcher.signaled();
    tokio::pin!(stopped);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stopped => return,
        };
        match accepted {
            Ok((stream, _)) => {
                tokio::spawn(serve(stream, watcher.hold()));
            }
            Err(error) => {
                tracing::warn!(%error, "frontend accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Accepts TLS connections (handshakes run concurrently) until the drain is
/// signalled, serving each with `serve` as [`accept_uds`] does.
pub(crate) async fn accept_tls<F, Fut>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    watcher: Watcher,
    serve: F,
) where
    F: Fn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>, Hold) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let stop = Some(watcher.clone());
    let mut accepted =
        konnectivity_plumbing::tls::accept_tls(listener, TlsAcceptor::from(tls), "frontend", stop);
    while let Some(stream) = accepted.recv().await {
        tokio::spawn(serve(stream, watcher.hold()));
    }
}
