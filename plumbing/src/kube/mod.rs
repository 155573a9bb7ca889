//! Just enough of a kube-apiserver client for what the proxy needs of it
//! (TokenReviews): HTTPS with the credentials of a kubeconfig or of the
//! pod, JSON in and out, one kept-alive connection reused between requests.

mod config;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Mutex;
use tokio_rustls::TlsConnector;

pub use config::{Credentials, KubeConfigError, KubeEndpoint};

/// How long one request may take, connection set-up included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The most of an answer we read; a TokenReview is a few KiB.
const MAX_ANSWER: usize = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("connecting to kube-apiserver {server}: {source}")]
    Connect { server: String, source: std::io::Error },
    #[error("talking to kube-apiserver {server}: {source}")]
    Http { server: String, source: hyper::Error },
    #[error("no answer from kube-apiserver {server} within {REQUEST_TIMEOUT:?}")]
    Timeout { server: String },
    #[error("reading the token file {path}: {source}", path = path.display())]
    TokenFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("kube-apiserver {server} answered {status} to POST {path}: {body}")]
    Status {
        server: String,
        path: String,
        status: StatusCode,
        body: String,
    },
    #[error("kube-apiserver {server} sent a bad answer to POST {path}: {problem}")]
    Answer {
        server: String,
        path: String,
        problem: String,
    },
}

pub struct KubeClient {
    endpoint: KubeEndpoint,
    /// An idle connection from an earlier request; concurrent requests open
    /// their own, and only one is kept.
    idle: Mutex<Option<SendRequest<Full<Bytes>>>>,
}

impl KubeClient {
    pub fn new(endpoint: KubeEndpoint) -> KubeClient {
        KubeClient {
            endpoint,
            idle: Mutex::new(None),
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
        let server = || self.endpoint.server.clone();
        let body = serde_json::to_vec(body).expect("request types serialize");
        let (status, answer) = tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(path, body.into()))
            .await
            .map_err(|_| KubeError::Timeout { server: server() })??;
        if !status.is_success() {
            return Err(KubeError::Status {
                server: server(),
                path: path.to_owned(),
                status,
                body: String::from_utf8_lossy(&answer[..answer.len().min(512)]).into_owned(),
            });
        }
        serde_json::from_slice(&answer).map_err(|e| KubeError::Answer {
            server: server(),
            path: path.to_owned(),
            problem: e.to_string(),
        })
    }

    async fn exchange(&self, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), KubeError> {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.endpoint.path_prefix))
            .header(header::HOST, self.authority())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json")
            .header(
                header::USER_AGENT,
                concat!("konnectivity-rs/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(token) = self.token().await? {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Full::new(body)).expect("a valid request");

        let idle = self.idle.lock().await.take();
        let mut sender = match idle {
            Some(sender) if sender.is_ready() => sender,
            _ => self.connect().await?,
        };
        let http = |source| KubeError::Http {
            server: self.endpoint.server.clone(),
            source,
        };
        let response = sender.send_request(request).await.map_err(http)?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| KubeError::Answer {
                server: self.endpoint.server.clone(),
                path: path.to_owned(),
                problem: e.to_string(),
            })?
            .to_bytes();
        *self.idle.lock().await = Some(sender);
        Ok((status, body))
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

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, KubeError> {
        let connect_error = |source| KubeError::Connect {
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
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|source| KubeError::Http {
                server: self.endpoint.server.clone(),
                source,
            })?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "kube-apiserver connection ended");
            }
        });
        Ok(sender)
    }
}
