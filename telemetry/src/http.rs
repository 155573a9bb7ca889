//! The small HTTP/1.1 listener behind `/healthz`, `/readyz` and `/metrics`,
//! and the admin listener (`/metrics`, and `/debug/pprof/` when asked).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

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
    /// Headers beyond Content-Type (a redirect's Location, a download's
    /// Content-Disposition).
    pub headers: Vec<(http::header::HeaderName, &'static str)>,
    pub body: Bytes,
}

impl Reply {
    pub fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: Bytes::from(body.into()),
        }
    }

    pub fn not_found() -> Self {
        Reply::text(StatusCode::NOT_FOUND, "404 page not found\n")
    }
}

/// A reply still being made (a CPU profile takes the seconds it samples).
pub type LaterReply = Pin<Box<dyn Future<Output = Reply> + Send>>;

/// Maps a request path to a reply; the binaries implement it.
pub trait Endpoints: Send + Sync + 'static {
    fn reply(&self, path: &str) -> Reply;

    /// The reply to a request that takes time, or None when [`reply`]
    /// answers it.
    ///
    /// [`reply`]: Endpoints::reply
    fn reply_later(&self, _uri: &http::Uri) -> Option<LaterReply> {
        None
    }
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
                let later = endpoints.reply_later(request.uri());
                let now = later.is_none().then(|| endpoints.reply(request.uri().path()));
                async move {
                    let reply = match (now, later) {
                        (Some(reply), _) => reply,
                        (None, Some(later)) => later.await,
                        (None, None) => unreachable!("one of the two is set"),
                    };
                    let mut response = Response::builder()
                        .status(reply.status)
                        .header(http::header::CONTENT_TYPE, reply.content_type);
                    for (name, value) in reply.headers {
                        response = response.header(name, value);
                    }
                    let response = response
                        .body(Full::new(reply.body))
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
/// configs and ServiceMonitors written for upstream point at either port,
/// and with `--enable-profiling` the `/debug/pprof/` endpoints `go tool
/// pprof` reads: a CPU profile and the command line.
pub struct AdminEndpoints {
    metrics: Arc<dyn Endpoints>,
    profiling: bool,
}

impl AdminEndpoints {
    /// `metrics` answers `/metrics`; `profiling` is `--enable-profiling`.
    pub fn new(metrics: Arc<dyn Endpoints>, profiling: bool) -> Self {
        AdminEndpoints { metrics, profiling }
    }
}

const PPROF_INDEX: &str = "<html><head><title>/debug/pprof/</title></head><body>\n\
<p>/debug/pprof/</p>\n\
<p><a href=\"profile\">profile</a>: CPU profile; add ?seconds=N (default 30)</p>\n\
<p><a href=\"cmdline\">cmdline</a>: the command line of this process</p>\n\
<p>No heap, goroutine, block or mutex profiles: this is not a Go program \
(runtime_heap_bytes in /metrics has the live heap).</p>\n\
</body></html>\n";

impl Endpoints for AdminEndpoints {
    fn reply(&self, path: &str) -> Reply {
        match path {
            "/metrics" => self.metrics.reply(path),
            "/debug/pprof" if self.profiling => Reply {
                status: StatusCode::MOVED_PERMANENTLY,
                content_type: "text/plain; charset=utf-8",
                headers: vec![(http::header::LOCATION, "/debug/pprof/")],
                body: Bytes::new(),
            },
            "/debug/pprof/" if self.profiling => Reply {
                status: StatusCode::OK,
                content_type: "text/html; charset=utf-8",
                headers: Vec::new(),
                body: Bytes::from_static(PPROF_INDEX.as_bytes()),
            },
            // Go's form: the arguments joined by NUL bytes.
            "/debug/pprof/cmdline" if self.profiling => {
                let arguments: Vec<String> = std::env::args().collect();
                Reply::text(StatusCode::OK, arguments.join("\0"))
            }
            _ if self.profiling && path.starts_with("/debug/pprof/") => Reply::text(
                StatusCode::NOT_FOUND,
                "Unknown profile: this process serves /debug/pprof/profile (CPU) and /debug/pprof/cmdline\n",
            ),
            _ => Reply::not_found(),
        }
    }

    fn reply_later(&self, uri: &http::Uri) -> Option<LaterReply> {
        if !self.profiling || uri.path() != "/debug/pprof/profile" {
            return None;
        }
        let seconds = match profile_seconds(uri.query()) {
            Ok(seconds) => seconds,
            Err(reply) => return Some(Box::pin(std::future::ready(reply))),
        };
        Some(Box::pin(async move {
            match crate::profiling::cpu_profile(Duration::from_secs(seconds)).await {
                Ok(profile) => Reply {
                    status: StatusCode::OK,
                    content_type: "application/octet-stream",
                    headers: vec![
                        (
                            http::header::CONTENT_DISPOSITION,
                            "attachment; filename=\"profile\"",
                        ),
                        (http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                    ],
                    body: Bytes::from(profile),
                },
                // Go answers 500 to a second profile while one runs; so
                // does this, with the same words.
                Err(error) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")),
            }
        }))
    }
}

/// The `seconds` of a profile request: Go's default when absent, a clear
/// 400 when it is not a whole number of seconds in range (Go would quietly
/// take 30).
fn profile_seconds(query: Option<&str>) -> Result<u64, Reply> {
    let Some(given) = query
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("seconds="))
    else {
        return Ok(crate::profiling::DEFAULT_SECONDS);
    };
    match given.parse::<u64>() {
        Ok(seconds) if (1..=crate::profiling::MAX_SECONDS).contains(&seconds) => Ok(seconds),
        _ => Err(Reply::text(
            StatusCode::BAD_REQUEST,
            format!(
                "seconds: want a whole number from 1 to {}, got {given:?}\n",
                crate::profiling::MAX_SECONDS
            ),
        )),
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
