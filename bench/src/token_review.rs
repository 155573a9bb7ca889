//! A stand-in kube-apiserver for the scale run: it answers TokenReviews over
//! HTTPS (every `bench-token-…` is a token of the agents' ServiceAccount)
//! and counts them, so that the run can say how many reviews a reconnect
//! of every agent costs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use konnectivity_plumbing::tls::{Identity, PemFile};
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// The token proxy-server presents to the stand-in.
const REVIEWER_TOKEN: &str = "bench-reviewer";
/// What every agent's token starts with.
pub const TOKEN_PREFIX: &str = "bench-token-";

pub struct TokenReviewer {
    pub port: u16,
    reviews: Arc<Mutex<HashMap<String, usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TokenReviewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TokenReviewer {
    /// Serves with the certificate in `certs` (server.crt, valid for 127.0.0.1).
    pub async fn start(certs: &Path) -> anyhow::Result<TokenReviewer> {
        let identity = Identity {
            cert: PemFile::new("bench", certs.join("server.crt")),
            key: PemFile::new("bench", certs.join("server.key")),
        };
        let tls =
            konnectivity_plumbing::tls::server_config(&identity, None, &[b"http/1.1"], &Default::default())?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let reviews: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let counted = reviews.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, counted) = (acceptor.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |request| {
                        let counted = counted.clone();
                        async move { Ok::<_, Infallible>(review(request, &counted).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Ok(TokenReviewer { port, reviews, task })
    }

    /// Reviews asked for so far, and of how many distinct tokens.
    pub fn reviews(&self) -> (usize, usize) {
        let reviews = self.reviews.lock().unwrap();
        (reviews.values().sum(), reviews.len())
    }

    /// A kubeconfig for proxy-server pointing at the stand-in.
    pub fn kubeconfig(&self, dir: &Path, certs: &Path) -> anyhow::Result<std::path::PathBuf> {
        let path = dir.join("reviewer.kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: bench\n\
             clusters:\n- name: bench\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {ca}\n\
             users:\n- name: proxy-server\n  user:\n    token: {REVIEWER_TOKEN}\n\
             contexts:\n- name: bench\n  context:\n    cluster: bench\n    user: proxy-server\n",
            port = self.port,
            ca = certs.join("ca.crt").display(),
        );
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

async fn review(
    request: Request<hyper::body::Incoming>,
    counted: &Mutex<HashMap<String, usize>>,
) -> Response<Full<Bytes>> {
    let answer = |status: StatusCode, value: Value| {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(value.to_string())))
            .unwrap()
    };
    let authorized = request
        .headers()
        .get("authorization")
        .is_some_and(|value| value == format!("Bearer {REVIEWER_TOKEN}").as_str());
    if !authorized {
        return answer(StatusCode::UNAUTHORIZED, json!({"kind": "Status", "code": 401}));
    }
    let Ok(body) = request.into_body().collect().await else {
        return answer(StatusCode::BAD_REQUEST, json!({"kind": "Status", "code": 400}));
    };
    let request: Value = serde_json::from_slice(&body.to_bytes()).unwrap_or_default();
    let token = request["spec"]["token"].as_str().unwrap_or_default().to_owned();
    *counted.lock().unwrap().entry(token.clone()).or_default() += 1;
    let status = if token.starts_with(TOKEN_PREFIX) {
        json!({
            "authenticated": true,
            "user": {"username": "system:serviceaccount:kube-system:konnectivity-agent"},
            "audiences": request["spec"]["audiences"],
        })
    } else {
        json!({"authenticated": false, "error": "invalid bearer token"})
    };
    answer(
        StatusCode::CREATED,
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}),
    )
}
