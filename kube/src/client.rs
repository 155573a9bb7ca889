//! The client: HTTPS to kube-apiserver with the credentials of a kubeconfig
//! or of the pod, JSON in and out.

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Mutex;
use tokio_rustls::TlsConnector;

use crate::config::{Credentials, KubeEndpoint};
use crate::error::{KubeError, MAX_ANSWER, REQUEST_TIMEOUT, status_error};
use crate::watch::WatchStream;

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

    /// Starts a watch (`path` with `watch=true` in its query) on a
    /// connection of its own, which the watch holds until it is dropped.
    pub async fn watch(&self, path: &str) -> Result<WatchStream, KubeError> {
        let server = || self.endpoint.server.clone();
        self.wait_for_turn().await;
        let request = self.request(Method::GET, path, None).await?;
        let started = async {
            let mut sender = self.connect().await?;
            sender
                .send_request(request)
                .await
                .map_err(|source| KubeError::Http {
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
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Request<Full<Bytes>>, KubeError> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.endpoint.path_prefix))
            .header(header::HOST, self.authority())
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
        let request = self.request(method.clone(), path, body).await?;
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
                method,
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
