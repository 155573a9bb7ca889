//! Binding the frontend: a Unix socket (mode 0770, as kube-apiserver shares
//! it through a host path) or TCP with mandatory mTLS.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;

use crate::ServeError;

/// Binds a Unix socket at `path`, replacing a leftover file when asked to.
pub fn bind_uds(path: &Path, delete_existing: bool) -> Result<UnixListener, ServeError> {
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

/// Accepts on a Unix socket forever, serving each connection with `serve`.
pub async fn accept_uds<F, Fut>(listener: UnixListener, serve: F)
where
    F: Fn(tokio::net::UnixStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve(stream));
            }
            Err(error) => {
                tracing::warn!(%error, "frontend accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Accepts TLS connections forever (handshakes run concurrently), serving
/// each with `serve`.
pub async fn accept_tls<F, Fut>(listener: TcpListener, tls: Arc<rustls::ServerConfig>, serve: F)
where
    F: Fn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut accepted = konnectivity_plumbing::tls::accept_tls(listener, TlsAcceptor::from(tls), "frontend");
    while let Some(stream) = accepted.recv().await {
        tokio::spawn(serve(stream));
    }
}
