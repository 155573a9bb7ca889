//! A stand-in kube-apiserver that answers `authentication.k8s.io/v1`
//! TokenReviews over HTTPS, as the real one does for ServiceAccount tokens:
//! it knows a fixed table of tokens, checks the reviewer's own credentials
//! and the requested audience, and counts the reviews per token.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::certs::Pki;
use super::kube_api::token_kubeconfig;

/// The token proxy-server must present to the stand-in (from its kubeconfig).
pub const REVIEWER_TOKEN: &str = "reviewer-secret";

pub struct TokenReviewer {
    pub port: u16,
    reviews: Arc<Mutex<HashMap<String, usize>>>,
    /// When each request arrived, in order.
    arrivals: Arc<Mutex<Vec<std::time::Instant>>>,
    task: JoinHandle<()>,
}

impl Drop for TokenReviewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TokenReviewer {
    /// Serves reviews; `users` maps a token to the user name it belongs to,
    /// and only tokens for `audience` are valid.
    pub async fn start(pki: &Pki, audience: &'static str, users: &[(&str, &str)]) -> TokenReviewer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = tokio_rustls::TlsAcceptor::from(pki.server_tls(&pki.server));
        let users: Arc<HashMap<String, String>> = Arc::new(
            users
                .iter()
                .map(|(token, user)| (token.to_string(), user.to_string()))
                .collect(),
        );
        let reviews = Arc::new(Mutex::new(HashMap::new()));
        let counted = reviews.clone();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let arrived = arrivals.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, users, counted, arrived) =
                    (acceptor.clone(), users.clone(), counted.clone(), arrived.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut stream = BufReader::new(tls);
                    // Keep-alive: one request after another on the connection.
                    while let Some((head, body)) = read_request(&mut stream).await {
                        arrived.lock().unwrap().push(std::time::Instant::now());
                        let (status, answer) = review(&head, &body, audience, &users, &counted);
                        let text = answer.to_string();
                        let response = format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
                            text.len()
                        );
                        if stream.get_mut().write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        TokenReviewer {
            port,
            reviews,
            arrivals,
            task,
        }
    }

    /// How many reviews of `token` were asked for.
    pub fn reviews_of(&self, token: &str) -> usize {
        self.reviews.lock().unwrap().get(token).copied().unwrap_or(0)
    }

    /// When each request arrived, in order.
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        self.arrivals.lock().unwrap().clone()
    }

    /// A kubeconfig for proxy-server pointing at this stand-in.
    pub fn kubeconfig(&self, dir: &Path, pki: &Pki) -> PathBuf {
        token_kubeconfig(&dir.join("reviewer.kubeconfig"), self.port, pki, REVIEWER_TOKEN)
    }
}

/// One HTTP/1.1 request: its head lines and its body.
async fn read_request<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut BufReader<S>,
) -> Option<(Vec<String>, Vec<u8>)> {
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await.ok()? == 0 {
            return None;
        }
        let line = line.trim_end().to_owned();
        if line.is_empty() {
            break;
        }
        head.push(line);
    }
    let length = head
        .iter()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).await.ok()?;
    Some((head, body))
}

fn header<'a>(head: &'a [String], name: &str) -> Option<&'a str> {
    head.iter().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

fn review(
    head: &[String],
    body: &[u8],
    audience: &str,
    users: &HashMap<String, String>,
    counted: &Mutex<HashMap<String, usize>>,
) -> (&'static str, Value) {
    if head.first().map(String::as_str) != Some("POST /apis/authentication.k8s.io/v1/tokenreviews HTTP/1.1") {
        return (
            "404 Not Found",
            json!({"kind": "Status", "message": format!("{:?}", head.first())}),
        );
    }
    if header(head, "authorization") != Some(&format!("Bearer {REVIEWER_TOKEN}")) {
        return (
            "401 Unauthorized",
            json!({"kind": "Status", "message": "Unauthorized"}),
        );
    }
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return (
            "400 Bad Request",
            json!({"kind": "Status", "message": "not JSON"}),
        );
    };
    assert_eq!(request["apiVersion"], "authentication.k8s.io/v1", "{request}");
    assert_eq!(request["kind"], "TokenReview", "{request}");
    let token = request["spec"]["token"].as_str().unwrap_or_default().to_owned();
    *counted.lock().unwrap().entry(token.clone()).or_default() += 1;
    let audiences = &request["spec"]["audiences"];
    let status = match users.get(&token) {
        Some(_) if *audiences != json!([audience]) => {
            json!({"authenticated": false, "error": "token audiences do not match"})
        }
        Some(user) => json!({"authenticated": true, "user": {"username": user}, "audiences": [audience]}),
        None => json!({"authenticated": false, "error": "invalid bearer token"}),
    };
    (
        "201 Created",
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}),
    )
}
