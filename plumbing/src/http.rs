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
