//! The small HTTP/1.1 listener behind `/healthz`, `/readyz` and `/metrics`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// What an endpoint answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    pub fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    pub fn not_found() -> Self {
        Reply::text(StatusCode::NOT_FOUND, "404 page not found\n")
    }
}

/// Maps a request path to a reply; the binaries implement it.
pub trait Endpoints: Send + Sync + 'static {
    fn reply(&self, path: &str) -> Reply;
}

/// Serves `endpoints` on `listener` until the task is dropped. The listener
/// is shared so that its owner can keep it past the task (a node agent hands
/// its health listener to the agent that replaces it).
pub async fn serve(listener: Arc<TcpListener>, endpoints: Arc<dyn Endpoints>) {
    loop {
        let (tcp, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "health listener accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let endpoints = endpoints.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: http::Request<Incoming>| {
                let reply = endpoints.reply(request.uri().path());
                async move {
                    let response = Response::builder()
                        .status(reply.status)
                        .header(http::header::CONTENT_TYPE, reply.content_type)
                        .body(Full::new(Bytes::from(reply.body)))
                        .expect("static header values are valid");
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

/// Upstream's admin listener (`--admin-port` on the server,
/// `--admin-server-port` on the agent): `/metrics` there too, as scrape
/// configs and ServiceMonitors written for upstream point at either port.
/// The same exposition as the health listener's, nothing else.
pub struct AdminEndpoints(pub Arc<dyn Endpoints>);

impl Endpoints for AdminEndpoints {
    fn reply(&self, path: &str) -> Reply {
        match path {
            "/metrics" => self.0.reply(path),
            _ => Reply::not_found(),
        }
    }
}

/// Binds the admin listener. As upstream, one that cannot be bound (the
/// port taken) is logged, naming the flag, and the binary runs on without
/// it: nothing depends on it but scrapes.
pub async fn bind_admin(addr: std::net::SocketAddr, port_flag: &str) -> Option<TcpListener> {
    match TcpListener::bind(addr).await {
        Ok(listener) => Some(listener),
        Err(error) => {
            tracing::error!(
                %addr,
                %error,
                "admin listener not opened: /metrics is served on the health port only; \
                 choose a free --{port_flag} (with --admin-bind-address)"
            );
            None
        }
    }
}
