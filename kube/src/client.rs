//! The client: HTTPS to kube-apiserver with the credentials of a kubeconfig
//! or of the pod, JSON in and out.
//!
//! Like client-go, it offers HTTP/2 and HTTP/1.1 and takes what
//! kube-apiserver picks (HTTP/2, unless it runs with HTTP/2 off). Over
//! HTTP/2 every request and every watch is a stream of one connection, so
//! a burst of TokenReviews when many agents reconnect costs one TLS
//! handshake, not one each. Over HTTP/1.1 a request that finds the one
//! kept connection busy opens one of its own, and a watch holds its
//! connection until it ends.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Mutex;
use tokio_rustls::TlsConnector;

use crate::config::{Credentials, KubeEndpoint};
use crate::error::{KubeError, MAX_ANSWER, REQUEST_TIMEOUT, status_error};
use crate::watch::WatchStream;

/// client-go's HTTP/2 health check: a connection that has received nothing
/// for this long is pinged...
const PING_AFTER: Duration = Duration::from_secs(30);
/// ...and closed if the ping is not answered within this, so a request or
/// watch never waits on a connection that died silently.
const PING_TIMEOUT: Duration = Duration::from_secs(15);

type Body = Full<Bytes>;

pub struct KubeClient {
    endpoint: KubeEndpoint,
    connections: Mutex<Connections>,
}

#[derive(Default)]
struct Connections {
    /// The HTTP/2 connection every request shares, while it is open.
    shared: Option<http2::SendRequest<Body>>,
    /// An idle HTTP/1.1 connection from an earlier request.
    idle: Option<http1::SendRequest<Body>>,
    /// kube-apiserver chose HTTP/1.1 at the last handshake. Until it does
    /// (and again once it chooses HTTP/2), a request that needs a connection
    /// opens it while holding the lock, so that concurrent requests share it.
    http1: bool,
}

/// A connection to send one request on.
enum Sender {
    Http2(http2::SendRequest<Body>),
    Http1(http1::SendRequest<Body>),
}

impl Sender {
    async fn send(&mut self, request: Request<Body>) -> Result<http::Response<Incoming>, hyper::Error> {
        match self {
            Sender::Http2(sender) => sender.send_request(request).await,
            Sender::Http1(sender) => sender.send_request(request).await,
        }
    }
}

impl KubeClient {
    pub fn new(endpoint: KubeEndpoint) -> KubeClient {
        KubeClient {
            endpoint,
            connections: Mutex::new(Connections::default()),
        }
    }

    /// Waits for the endpoint's rate limit, if it has one.
    async fn wait_for_turn(&self) {
        if let Some(limit) = &self.endpoint.rate_limit {
            limit.acquire().await;
        }
    }

    pub fn server(&self) -> &str {
        &self.endpoint.server
    }

    /// POSTs `body` as JSON to `path` (e.g. `/apis/…/tokenreviews`) and
    /// decodes the 2xx answer.
    pub async fn post<T: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &T,
    ) -> Result<R, KubeError> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// PUTs `body` (an update, with its resourceVersion) to `path`.
    pub async fn put<T: Serialize, R: DeserializeOwned>(&self, path: &str, body: &T) -> Result<R, KubeError> {
        self.call(Method::PUT, path, Some(body)).await
    }

    pub async fn get<R: DeserializeOwned>(&self, path: &str) -> Result<R, KubeError> {
        self.call(Method::GET, path, None::<&()>).await
    }

    /// DELETEs `path`, with `options` (a `DeleteOptions`, e.g. with a
    /// precondition) as the body when given; the answer is not looked at.
    pub async fn delete<T: Serialize>(&self, path: &str, options: Option<&T>) -> Result<(), KubeError> {
        self.call::<T, serde::de::IgnoredAny>(Method::DELETE, path, options)
            .await
            .map(|_| ())
    }

    /// One request whose 2xx answer is decoded as `R`; any other status is
    /// a [`KubeError::Status`] carrying the answer's reason.
    async fn call<T: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&T>,
    ) -> Result<R, KubeError> {
        let server = || self.endpoint.server.clone();
        self.wait_for_turn().await;
        let body = body.map(|body| serde_json::to_vec(body).expect("request types serialize"));
        let (status, answer) =
            tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(method.clone(), path, body))
                .await
                .map_err(|_| KubeError::Timeout { server: server() })??;
        if !status.is_success() {
            return Err(status_error(server(), method, path, status, &answer));
        }
        serde_json::from_slice(&answer).map_err(|e| KubeError::Answer {
            server: server(),
            method,
            path: path.to_owned(),
            problem: e.to_string(),
        })
    }

    /// Starts a watch (`path` with `watch=true` in its query): a stream of
    /// the shared HTTP/2 connection, or an HTTP/1.1 connection of its own,
    /// held until the watch is dropped.
    pub async fn watch(&self, path: &str) -> Result<WatchStream, KubeError> {
        let server = || self.endpoint.server.clone();
        self.wait_for_turn().await;
        let started = async {
            let mut sender = self.sender().await?;
            let request = self.request(&sender, Method::GET, path, None).await?;
            sender.send(request).await.map_err(|source| KubeError::Http {
                server: server(),
                source,
            })
        };
        let response = tokio::time::timeout(REQUEST_TIMEOUT, started)
            .await
            .map_err(|_| KubeError::Timeout { server: server() })??;
        let status = response.status();
        if !status.is_success() {
            let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map(|collected| collected.to_bytes())
                .unwrap_or_default();
            return Err(status_error(server(), Method::GET, path, status, &body));
        }
        Ok(WatchStream::new(server(), path.to_owned(), response.into_body()))
    }

    async fn request(
        &self,
        sender: &Sender,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Request<Body>, KubeError> {
        let target = format!("{}{path}", self.endpoint.path_prefix);
        let mut request = match sender {
            // HTTP/2 carries the scheme and authority in the request itself.
            Sender::Http2(_) => Request::builder().uri(format!("https://{}{target}", self.authority())),
            Sender::Http1(_) => Request::builder()
                .uri(target)
                .header(header::HOST, self.authority()),
        };
        request = request
            .method(method)
            .header(header::ACCEPT, "application/json")
            .header(
                header::USER_AGENT,
                concat!("konnectivity-rs/", env!("CARGO_PKG_VERSION")),
            );
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(token) = self.token().await? {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        Ok(request
            .body(Full::new(body.map(Bytes::from).unwrap_or_default()))
            .expect("a valid request"))
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), KubeError> {
        let mut sender = self.sender().await?;
        let request = self.request(&sender, method.clone(), path, body).await?;
        let http = |source| KubeError::Http {
            server: self.endpoint.server.clone(),
            source,
        };
        let response = sender.send(request).await.map_err(http)?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| KubeError::Answer {
                server: self.endpoint.server.clone(),
                method,
                path: path.to_owned(),
                problem: e.to_string(),
            })?
            .to_bytes();
        if let Sender::Http1(sender) = sender {
            let mut connections = self.connections.lock().await;
            if connections.idle.is_none() {
                connections.idle = Some(sender);
            }
        }
        Ok((status, body))
    }

    /// A connection for one request: the shared HTTP/2 connection, an idle
    /// HTTP/1.1 one, or a new one.
    async fn sender(&self) -> Result<Sender, KubeError> {
        let mut connections = self.connections.lock().await;
        if let Some(shared) = connections.shared.as_ref().filter(|shared| !shared.is_closed()) {
            return Ok(Sender::Http2(shared.clone()));
        }
        connections.shared = None;
        if let Some(idle) = connections.idle.take().filter(|idle| idle.is_ready()) {
            return Ok(Sender::Http1(idle));
        }
        if connections.http1 {
            // One connection per request: no reason to make the others wait.
            drop(connections);
            let sender = self.connect().await?;
            if let Sender::Http2(shared) = &sender {
                // HTTP/2 again (kube-apiserver was restarted with it on).
                let mut connections = self.connections.lock().await;
                connections.http1 = false;
                connections.shared.get_or_insert_with(|| shared.clone());
            }
            return Ok(sender);
        }
        let sender = self.connect().await?;
        match &sender {
            Sender::Http2(shared) => connections.shared = Some(shared.clone()),
            Sender::Http1(_) => connections.http1 = true,
        }
        Ok(sender)
    }

    fn authority(&self) -> String {
        let host = &self.endpoint.host;
        if host.contains(':') {
            format!("[{host}]:{}", self.endpoint.port)
        } else {
            format!("{host}:{}", self.endpoint.port)
        }
    }

    async fn token(&self) -> Result<Option<String>, KubeError> {
        match &self.endpoint.credentials {
            Credentials::None => Ok(None),
            Credentials::Token(token) => Ok(Some(token.clone())),
            Credentials::TokenFile(path) => {
                let text = tokio::fs::read_to_string(path)
                    .await
                    .map_err(|source| KubeError::TokenFile {
                        path: path.clone(),
                        source,
                    })?;
                Ok(Some(text.trim().to_owned()))
            }
        }
    }

    /// A new connection, in the protocol kube-apiserver chose.
    async fn connect(&self) -> Result<Sender, KubeError> {
        let connect_error = |source| KubeError::Connect {
            server: self.endpoint.server.clone(),
            source,
        };
        let http_error = |source| KubeError::Http {
            server: self.endpoint.server.clone(),
            source,
        };
        let tcp = tokio::net::TcpStream::connect((self.endpoint.host.as_str(), self.endpoint.port))
            .await
            .map_err(connect_error)?;
        let _ = tcp.set_nodelay(true);
        // The kubeconfig's host, without an IPv6 address's brackets.
        let name = rustls_pki_types::ServerName::try_from(
            self.endpoint.server_name.trim_matches(['[', ']']).to_owned(),
        )
        .map_err(|error| connect_error(std::io::Error::new(std::io::ErrorKind::InvalidInput, error)))?;
        let tls = TlsConnector::from(self.endpoint.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(connect_error)?;
        let http2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        tracing::debug!(
            server = %self.endpoint.server,
            protocol = if http2 { "HTTP/2" } else { "HTTP/1.1" },
            "connected to kube-apiserver"
        );
        let io = TokioIo::new(tls);
        if http2 {
            let (sender, connection) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(PING_AFTER)
                .keep_alive_timeout(PING_TIMEOUT)
                .keep_alive_while_idle(true)
                .handshake(io)
                .await
                .map_err(http_error)?;
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "kube-apiserver connection ended");
                }
            });
            Ok(Sender::Http2(sender))
        } else {
            let (sender, connection) = http1::handshake(io).await.map_err(http_error)?;
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "kube-apiserver connection ended");
                }
            });
            Ok(Sender::Http1(sender))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures_util::StreamExt;

    use super::*;

    /// A kube-apiserver stand-in offering `alpn` (Go's net/http offers h2
    /// and http/1.1): answers every GET with `{}`, a watch with one event
    /// it then holds open, and counts the connections it accepted.
    struct Server {
        endpoint: KubeEndpoint,
        connections: Arc<AtomicUsize>,
        http2: Arc<AtomicUsize>,
    }

    async fn server(alpn: &[&[u8]]) -> Server {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(vec![]).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&key, &rcgen::Issuer::new(ca, ca_key))
            .unwrap();
        let mut tls =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![cert.der().clone()],
                    rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
                )
                .unwrap();
        tls.alpn_protocols = alpn.iter().map(|proto| proto.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (connections, http2) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (accepted, accepted_http2) = (connections.clone(), http2.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                accepted.fetch_add(1, Ordering::Relaxed);
                let accepted_http2 = accepted_http2.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(
                        |request: Request<hyper::body::Incoming>| async move {
                            let watch = request.uri().query().unwrap_or_default().contains("watch=true");
                            let body: http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible> =
                                if watch {
                                    let event = Bytes::from_static(
                                b"{\"type\":\"BOOKMARK\",\"object\":{\"metadata\":{\"resourceVersion\":\"7\"}}}\n",
                            );
                                    let held =
                                        futures_util::stream::iter([Ok(hyper::body::Frame::data(event))])
                                            .chain(futures_util::stream::pending());
                                    BodyExt::boxed(http_body_util::StreamBody::new(held))
                                } else {
                                    BodyExt::boxed(Full::new(Bytes::from_static(b"{}")))
                                };
                            Ok::<_, std::convert::Infallible>(http::Response::new(body))
                        },
                    );
                    let io = TokioIo::new(tls);
                    if io.inner().get_ref().1.alpn_protocol() == Some(b"h2") {
                        accepted_http2.fetch_add(1, Ordering::Relaxed);
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, service)
                            .await;
                    } else {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service)
                            .await;
                    }
                });
            }
        });
        let dir = std::env::temp_dir().join(format!("kube-client-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ca.crt"), ca_cert.pem()).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
                 clusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: ca.crt\n\
                 users:\n- name: u\n  user:\n    token: t\n\
                 contexts:\n- name: c\n  context: {{cluster: c, user: u}}\n"
            ),
        )
        .unwrap();
        let endpoint = KubeEndpoint::from_kubeconfig(&kubeconfig).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        Server {
            endpoint,
            connections,
            http2,
        }
    }

    /// Fifty requests at once and a watch held open: one connection, as
    /// client-go's, when kube-apiserver offers HTTP/2.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_and_watches_share_one_http2_connection() {
        let server = server(&[b"h2", b"http/1.1"]).await;
        let client = KubeClient::new(server.endpoint.clone());
        let mut watch = client.watch("/apis/x?watch=true").await.unwrap();
        let event = watch.next::<serde_json::Value>().await.unwrap();
        assert!(
            matches!(event, Some(crate::watch::WatchEvent::Bookmark { ref resource_version }) if resource_version == "7")
        );
        let requests = (0..50).map(|_| client.get::<serde_json::Value>("/apis/x"));
        for answer in futures_util::future::join_all(requests).await {
            answer.unwrap();
        }
        assert_eq!(server.connections.load(Ordering::Relaxed), 1);
        assert_eq!(server.http2.load(Ordering::Relaxed), 1);
    }

    /// With HTTP/2 off, HTTP/1.1: concurrent requests open connections of
    /// their own, and each one's answer arrives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_without_http2_is_spoken_to_in_http1() {
        let server = server(&[b"http/1.1"]).await;
        let client = KubeClient::new(server.endpoint.clone());
        let requests = (0..5).map(|_| client.get::<serde_json::Value>("/apis/x"));
        for answer in futures_util::future::join_all(requests).await {
            answer.unwrap();
        }
        // One kept idle is reused by the next request.
        let opened = server.connections.load(Ordering::Relaxed);
        client.get::<serde_json::Value>("/apis/x").await.unwrap();
        assert_eq!(server.connections.load(Ordering::Relaxed), opened);
        assert_eq!(server.http2.load(Ordering::Relaxed), 0);
    }
}
