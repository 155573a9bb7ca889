//! A stand-in kube-apiserver for coordination.k8s.io/v1 Leases and core/v1
//! Nodes over HTTPS, as the real one serves them (a real kube-apiserver
//! cannot be had here): one resourceVersion sequence for every change, updates and
//! deletions refused with 409 Conflict when their resourceVersion is not
//! the stored one, `labelSelector` (equality and set-based terms) on
//! lists and watches, watches streamed as one JSON event per line from a
//! resourceVersion on (ending at `timeoutSeconds`; from a version older
//! than the history kept, one `ERROR` event with 410 Expired), and
//! `Status` objects with kube-apiserver's reasons on errors. It checks
//! the caller's bearer token (401 otherwise) and counts the calls.
//!
//! It can go away and come back on the same port with what it stored, as a
//! restarted kube-apiserver does (its store is etcd), and can refuse one
//! Lease's updates, as when a server cannot reach it.
//!
//! It also answers `authentication.k8s.io/v1` TokenReviews for a table of
//! ServiceAccount tokens ([`KubeApi::review_tokens`]), checking the audience,
//! and counts reviews per token; a token bound to a node
//! ([`KubeApi::bind_token_to_node`]) is answered with the node in the user's
//! extra, as kube-apiserver 1.30 and later answer a DaemonSet pod's token.
//!
//! Nodes are cluster-scoped; a test plays kubelet and the node controller
//! ([`KubeApi::put_node`], [`KubeApi::delete_node`]), and clients get, list
//! and watch them as they would Leases.
//!
//! Like kube-apiserver (Go's net/http), it offers HTTP/2 and HTTP/1.1 by ALPN
//! and serves what the client picks; [`KubeApi::start_http1_only`] is one
//! with HTTP/2 turned off. It records the protocol of every connection.
//!
//! The integration tests use it, and so does the scale run (`konnectivity-bench
//! cluster --leases`), where 5,000 agents count the servers by their Leases.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinSet;

/// What the stand-in serves with: a certificate valid for 127.0.0.1, and
/// the CA file that signed it, which the kubeconfigs it writes name.
#[derive(Clone)]
pub struct ServingCert {
    pub tls: Arc<rustls::ServerConfig>,
    pub ca: PathBuf,
}

/// The token callers must present (from the kubeconfig below).
pub const TOKEN: &str = "lease-client-secret";
/// The token of the pod ServiceAccount below.
pub const SERVICE_ACCOUNT_TOKEN: &str = "pod-service-account-token";
/// The audience agents' tokens are issued for, and the user of the agents'
/// ServiceAccount, as the manifests set them.
pub const AGENT_AUDIENCE: &str = "system:konnectivity-server";
pub const AGENT_USER: &str = "system:serviceaccount:kube-system:konnectivity-agent";

const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/";
const NODES: &str = "/api/v1/nodes";
const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

type Body = BoxBody<Bytes, Infallible>;

/// The kinds of object served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Resource {
    Lease,
    Node,
}

impl Resource {
    fn kind(self) -> &'static str {
        match self {
            Resource::Lease => "Lease",
            Resource::Node => "Node",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Resource::Lease => "coordination.k8s.io/v1",
            Resource::Node => "v1",
        }
    }

    /// As kube-apiserver names it in messages.
    fn group_resource(self) -> &'static str {
        match self {
            Resource::Lease => "leases.coordination.k8s.io",
            Resource::Node => "nodes",
        }
    }
}

/// An object's key: its kind, namespace ("" for Nodes) and name.
type Key = (Resource, String, String);

#[derive(Default)]
struct Store {
    objects: BTreeMap<Key, Value>,
    /// The last resourceVersion handed out.
    version: u64,
    /// Every change after `compacted`, for watches that start from a
    /// version.
    changes: Vec<Change>,
    /// Changes up to this version are forgotten (etcd compacted them, or a
    /// restarted kube-apiserver's watch cache starts after them): a watch
    /// from an older version is answered 410 Expired.
    compacted: u64,
    /// Names whose updates are answered 500 (a server that cannot renew).
    refused_updates: Vec<String>,
    /// Calls by "METHOD kind" (kind: list, watch, get, create, update, delete).
    calls: HashMap<String, usize>,
    /// The `labelSelector`s lists and watches were asked with, as sent.
    selectors: BTreeSet<String>,
    /// Bearer tokens accepted.
    tokens: Vec<String>,
    /// TokenReviews answered, when asked for.
    reviews: Option<Reviews>,
    /// The protocol of each connection accepted ("h2" or "http/1.1").
    connections: Vec<&'static str>,
}

/// The TokenReviews this kube-apiserver answers.
#[derive(Default)]
struct Reviews {
    audience: String,
    /// Token to the user it belongs to.
    users: HashMap<String, String>,
    /// Token to the node (name, uid) it is bound to.
    nodes: HashMap<String, (String, String)>,
    /// Reviews asked for, per token.
    counted: HashMap<String, usize>,
    /// When each review request arrived, in order.
    arrivals: Vec<Instant>,
}

/// What open watches follow, and how a test steers them.
struct Watches {
    changes: broadcast::Sender<Change>,
    /// While true, watch requests wait before they are answered.
    held: tokio::sync::watch::Sender<bool>,
    /// Each change of this ends every open watch.
    ended: tokio::sync::watch::Sender<u64>,
}

#[derive(Clone)]
struct Change {
    version: u64,
    kind: &'static str,
    resource: Resource,
    namespace: String,
    object: Value,
}

pub struct KubeApi {
    pub port: u16,
    /// The CA file clients trust (for the kubeconfigs written).
    ca: PathBuf,
    store: Arc<Mutex<Store>>,
    watches: Arc<Watches>,
    tls: tokio_rustls::TlsAcceptor,
    /// The listener and every connection, while serving.
    serving: Option<JoinSet<()>>,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

impl KubeApi {
    /// A kube-apiserver offering HTTP/2 and HTTP/1.1, as the real one.
    pub async fn start(cert: ServingCert) -> std::io::Result<KubeApi> {
        Self::start_offering(cert, &[b"h2", b"http/1.1"]).await
    }

    /// A kube-apiserver with HTTP/2 turned off (Go's `GODEBUG=http2server=0`).
    pub async fn start_http1_only(cert: ServingCert) -> std::io::Result<KubeApi> {
        Self::start_offering(cert, &[b"http/1.1"]).await
    }

    async fn start_offering(cert: ServingCert, alpn: &[&[u8]]) -> std::io::Result<KubeApi> {
        let mut tls = (*cert.tls).clone();
        tls.alpn_protocols = alpn.iter().map(|proto| proto.to_vec()).collect();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let mut api = KubeApi {
            port,
            ca: cert.ca,
            store: Arc::new(Mutex::new(Store {
                tokens: vec![TOKEN.to_owned(), SERVICE_ACCOUNT_TOKEN.to_owned()],
                ..Store::default()
            })),
            watches: Arc::new(Watches {
                changes: broadcast::channel(4096).0,
                held: tokio::sync::watch::Sender::new(false),
                ended: tokio::sync::watch::Sender::new(0),
            }),
            tls: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            serving: None,
        };
        api.serve(listener);
        Ok(api)
    }

    /// Goes away: the port refuses, open connections (watches) are cut.
    pub fn stop(&mut self) {
        if let Some(mut serving) = self.serving.take() {
            serving.abort_all();
        }
    }

    /// Comes back on the same port with what it stored.
    pub async fn restart(&mut self) {
        // Waits for the listener to be gone before binding its port again.
        if let Some(mut serving) = self.serving.take() {
            serving.shutdown().await;
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let listener = TcpListener::bind(addr).await.unwrap();
        self.serve(listener);
    }

    fn serve(&mut self, listener: TcpListener) {
        let mut serving = JoinSet::new();
        let (connections_tx, mut connections) = mpsc::unbounded_channel();
        let (store, watches, tls) = (self.store.clone(), self.watches.clone(), self.tls.clone());
        serving.spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let _ = connections_tx.send(tcp);
            }
        });
        // Connections run in a set this task owns, so that stopping cuts them too.
        let set = Arc::new(Mutex::new(JoinSet::new()));
        let held = set.clone();
        serving.spawn(async move {
            let _held = held;
            while let Some(tcp) = connections.recv().await {
                let (store, watches, tls) = (store.clone(), watches.clone(), tls.clone());
                set.lock().unwrap().spawn(async move {
                    let Ok(stream) = tls.accept(tcp).await else {
                        return;
                    };
                    let protocol = match stream.get_ref().1.alpn_protocol() {
                        Some(b"h2") => "h2",
                        _ => "http/1.1",
                    };
                    store.lock().unwrap().connections.push(protocol);
                    let service = hyper::service::service_fn(move |request| {
                        let (store, watches) = (store.clone(), watches.clone());
                        async move { Ok::<_, Infallible>(handle(request, &store, &watches).await) }
                    });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = if protocol == "h2" {
                        hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                            .serve_connection(io, service)
                            .await
                    } else {
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service)
                            .await
                    };
                });
            }
        });
        self.serving = Some(serving);
    }

    /// proxy-server's flags to admit agents by ServiceAccount token (no client
    /// certificates), reviewed by this stand-in: the agents' ServiceAccount
    /// is [`AGENT_USER`]'s, their tokens for [`AGENT_AUDIENCE`].
    pub fn token_auth_flags(&self, dir: &Path) -> Vec<String> {
        vec![
            "--cluster-ca-cert=".to_owned(),
            "--agent-namespace=kube-system".to_owned(),
            "--agent-service-account=konnectivity-agent".to_owned(),
            format!("--authentication-audience={AGENT_AUDIENCE}"),
            format!("--kubeconfig={}", self.kubeconfig(dir).display()),
        ]
    }

    /// A kubeconfig for proxy-server or proxy-agent pointing at this stand-in.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        self.token_kubeconfig(&dir.join("leases.kubeconfig"), TOKEN)
    }

    /// Writes a kubeconfig at `path` for this stand-in, authenticating with
    /// a bearer `token`, as kubeconfigs for ServiceAccounts and static
    /// tokens do.
    pub fn token_kubeconfig(&self, path: &Path, token: &str) -> PathBuf {
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: standin\n\
             clusters:\n- name: standin\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {ca}\n\
             users:\n- name: konnectivity\n  user:\n    token: {token}\n\
             contexts:\n- name: standin\n  context:\n    cluster: standin\n    user: konnectivity\n",
            port = self.port,
            ca = self.ca.display(),
        );
        std::fs::write(path, text).unwrap();
        path.to_owned()
    }

    /// A ServiceAccount's files as the kubelet mounts them into a pod
    /// (`token`, `ca.crt`), with [`SERVICE_ACCOUNT_TOKEN`].
    pub fn service_account(&self, dir: &Path) -> PathBuf {
        let account = dir.join("serviceaccount");
        std::fs::create_dir_all(&account).unwrap();
        std::fs::write(account.join("token"), SERVICE_ACCOUNT_TOKEN).unwrap();
        std::fs::copy(&self.ca, account.join("ca.crt")).unwrap();
        account
    }

    /// A rotated ServiceAccount token: `new` is accepted from now on, `old`
    /// no longer (it expired).
    pub fn rotate_token(&self, old: &str, new: &str) {
        let tokens = &mut self.store.lock().unwrap().tokens;
        tokens.retain(|token| token != old);
        tokens.push(new.to_owned());
    }

    /// The stored Lease, if any.
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        let store = self.store.lock().unwrap();
        store
            .objects
            .get(&(Resource::Lease, namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The names of the stored Leases of `namespace`.
    pub fn lease_names(&self, namespace: &str) -> Vec<String> {
        let store = self.store.lock().unwrap();
        store
            .objects
            .keys()
            .filter(|(resource, ns, _)| *resource == Resource::Lease && ns == namespace)
            .map(|(_, _, name)| name.clone())
            .collect()
    }

    /// Changes a stored Lease as another client would (a new
    /// resourceVersion), so that the holder's next update conflicts.
    pub fn touch(&self, namespace: &str, name: &str) {
        let mut store = self.store.lock().unwrap();
        let version = next_version(&mut store);
        let key = (Resource::Lease, namespace.to_owned(), name.to_owned());
        let lease = store.objects.get_mut(&key).expect("the Lease exists");
        lease["metadata"]["resourceVersion"] = json!(version.to_string());
        lease["metadata"]["annotations"] = json!({"touched-by": "test"});
        let object = lease.clone();
        record(
            &mut store,
            &self.watches.changes,
            "MODIFIED",
            &key,
            object,
            version,
        );
    }

    /// Creates or replaces a Node as kubelet and the node controller do
    /// (`node` is the object, without resourceVersion or uid: a new Node
    /// gets a uid, a replaced one keeps its own); returns its uid.
    pub fn put_node(&self, mut node: Value) -> String {
        let name = node["metadata"]["name"]
            .as_str()
            .expect("a Node has a name")
            .to_owned();
        let key = (Resource::Node, String::new(), name);
        let mut store = self.store.lock().unwrap();
        let version = next_version(&mut store);
        let (kind, uid) = match store.objects.get(&key) {
            Some(stored) => ("MODIFIED", stored["metadata"]["uid"].as_str().unwrap().to_owned()),
            None => ("ADDED", format!("node-uid-{version}")),
        };
        node["apiVersion"] = json!("v1");
        node["kind"] = json!("Node");
        node["metadata"]["resourceVersion"] = json!(version.to_string());
        node["metadata"]["uid"] = json!(uid);
        store.objects.insert(key.clone(), node.clone());
        record(&mut store, &self.watches.changes, kind, &key, node, version);
        uid
    }

    /// Deletes a Node, as `kubectl delete node` does.
    pub fn delete_node(&self, name: &str) {
        let key = (Resource::Node, String::new(), name.to_owned());
        let mut store = self.store.lock().unwrap();
        let mut node = store.objects.remove(&key).expect("the Node exists");
        let version = next_version(&mut store);
        node["metadata"]["resourceVersion"] = json!(version.to_string());
        record(&mut store, &self.watches.changes, "DELETED", &key, node, version);
    }

    /// Answers 500 to every update of this Lease from now on.
    pub fn refuse_updates(&self, name: &str) {
        self.store.lock().unwrap().refused_updates.push(name.to_owned());
    }

    /// Answers this Lease's updates again.
    pub fn allow_updates(&self, name: &str) {
        self.store
            .lock()
            .unwrap()
            .refused_updates
            .retain(|refused| refused != name);
    }

    /// Forgets the changes made so far, as etcd's compaction does: a watch
    /// from an older version is answered with an `ERROR` event, 410 Expired.
    pub fn compact(&self) {
        let mut store = self.store.lock().unwrap();
        store.compacted = store.version;
        store.changes.clear();
    }

    /// Ends every open watch, as kube-apiserver does when a watch's time is
    /// up; clients watch again from the last version they saw.
    pub fn end_watches(&self) {
        self.watches.ended.send_modify(|generation| *generation += 1);
    }

    /// While `hold`, watch requests wait before they are answered (a slow
    /// way back to kube-apiserver), so a test can change and compact the
    /// store between a watch's end and the next one.
    pub fn hold_watches(&self, hold: bool) {
        self.watches.held.send_replace(hold);
    }

    /// How many calls of this kind were made ("PUT update", "GET watch", ...).
    pub fn calls(&self, call: &str) -> usize {
        self.store.lock().unwrap().calls.get(call).copied().unwrap_or(0)
    }

    /// Every call so far, by kind ("GET watch": how many), for a run that
    /// reports what each of its phases cost kube-apiserver.
    pub fn all_calls(&self) -> BTreeMap<String, usize> {
        let store = self.store.lock().unwrap();
        store
            .calls
            .iter()
            .map(|(call, count)| (call.clone(), *count))
            .collect()
    }

    /// The `labelSelector`s lists and watches were asked with, as sent.
    pub fn selectors(&self) -> BTreeSet<String> {
        self.store.lock().unwrap().selectors.clone()
    }

    /// Answers TokenReviews from now on: `users` maps a token to the user
    /// it belongs to, and only tokens for `audience` are valid.
    pub fn review_tokens(&self, audience: &str, users: &[(&str, &str)]) {
        self.store.lock().unwrap().reviews = Some(Reviews {
            audience: audience.to_owned(),
            users: users
                .iter()
                .map(|(token, user)| (token.to_string(), user.to_string()))
                .collect(),
            ..Reviews::default()
        });
    }

    /// From now on `token`'s review names the node `name` (with `uid`) in
    /// the user's extra, as for a bound token of a pod on that node.
    pub fn bind_token_to_node(&self, token: &str, name: &str, uid: &str) {
        let mut store = self.store.lock().unwrap();
        let reviews = store.reviews.as_mut().expect("reviewing tokens");
        reviews
            .nodes
            .insert(token.to_owned(), (name.to_owned(), uid.to_owned()));
    }

    /// How many reviews of `token` were asked for.
    pub fn reviews_of(&self, token: &str) -> usize {
        let store = self.store.lock().unwrap();
        let reviews = store.reviews.as_ref().expect("reviewing tokens");
        reviews.counted.get(token).copied().unwrap_or(0)
    }

    /// When each review request arrived, in order.
    pub fn review_arrivals(&self) -> Vec<Instant> {
        let store = self.store.lock().unwrap();
        store.reviews.as_ref().expect("reviewing tokens").arrivals.clone()
    }

    /// The protocol of each connection accepted so far, in order.
    pub fn connections(&self) -> Vec<&'static str> {
        self.store.lock().unwrap().connections.clone()
    }
}

fn next_version(store: &mut Store) -> u64 {
    store.version += 1;
    store.version
}

fn record(
    store: &mut Store,
    changes: &broadcast::Sender<Change>,
    kind: &'static str,
    key: &Key,
    object: Value,
    version: u64,
) {
    let change = Change {
        version,
        kind,
        resource: key.0,
        namespace: key.1.clone(),
        object,
    };
    store.changes.push(change.clone());
    let _ = changes.send(change);
}

/// A TokenReview, answered as kube-apiserver answers one for a
/// ServiceAccount token: authenticated (with the user) only for a known
/// token whose audiences are the ones asked for.
async fn review(request: Request<Incoming>, store: &Arc<Mutex<Store>>) -> Response<Body> {
    let arrived = Instant::now();
    let Ok(body) = request.into_body().collect().await else {
        return body_lost();
    };
    let body = body.to_bytes();
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return failure(StatusCode::BAD_REQUEST, "BadRequest", "not JSON".to_owned());
    };
    assert_eq!(request["apiVersion"], "authentication.k8s.io/v1", "{request}");
    assert_eq!(request["kind"], "TokenReview", "{request}");
    let mut store = store.lock().unwrap();
    let Some(reviews) = store.reviews.as_mut() else {
        return failure(
            StatusCode::NOT_FOUND,
            "NotFound",
            "no TokenReviews here".to_owned(),
        );
    };
    reviews.arrivals.push(arrived);
    let token = request["spec"]["token"].as_str().unwrap_or_default().to_owned();
    *reviews.counted.entry(token.clone()).or_default() += 1;
    let audience = reviews.audience.clone();
    let status = match reviews.users.get(&token) {
        Some(_) if request["spec"]["audiences"] != json!([audience]) => {
            json!({"authenticated": false, "error": "token audiences do not match"})
        }
        Some(user) => {
            let mut user =
                json!({"username": user, "groups": ["system:serviceaccounts", "system:authenticated"]});
            if let Some((node, uid)) = reviews.nodes.get(&token) {
                // As kube-apiserver 1.31 writes a DaemonSet pod's bound token.
                user["extra"] = json!({
                    "authentication.kubernetes.io/credential-id": ["JTI=7c9e2f0a"],
                    "authentication.kubernetes.io/node-name": [node],
                    "authentication.kubernetes.io/node-uid": [uid],
                    "authentication.kubernetes.io/pod-name": ["konnectivity-agent-x7k2p"],
                    "authentication.kubernetes.io/pod-uid": ["0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"],
                });
            }
            json!({"authenticated": true, "user": user, "audiences": [audience]})
        }
        None => json!({"authenticated": false, "error": "invalid bearer token"}),
    };
    answer(
        StatusCode::CREATED,
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}),
    )
}

fn full(value: &Value) -> Body {
    Full::new(Bytes::from(value.to_string())).boxed()
}

fn answer(status: StatusCode, value: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(&value))
        .unwrap()
}

/// A `Status` error as kube-apiserver sends it.
fn failure(status: StatusCode, reason: &str, message: String) -> Response<Body> {
    answer(
        status,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason,
            "code": status.as_u16(),
        }),
    )
}

/// Whether `labels` satisfy every term of `selector`, as kube-apiserver
/// evaluates them: `k=v`/`k==v`, `k!=v` (also when `k` is absent), `k in
/// (a,b)`, `k notin (a,b)` (also when absent), `k`, `!k`, `k>n`, `k<n`.
/// Written apart from the agent's own parser on purpose: the agent's
/// selector must mean here what it means to kube-apiserver.
fn matches(selector: &str, labels: &Value) -> bool {
    let label = |key: &str| labels.get(key.trim()).and_then(Value::as_str).map(str::to_owned);
    let set = |list: &str| -> Vec<String> {
        let list = list.trim().trim_start_matches('(').trim_end_matches(')');
        list.split(',').map(|value| value.trim().to_owned()).collect()
    };
    let mut terms = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|term| !term.is_empty())
        .all(|term| {
            if let Some((key, list)) = term.split_once(" notin ") {
                label(key).is_none_or(|value| !set(list).contains(&value))
            } else if let Some((key, list)) = term.split_once(" in ") {
                label(key).is_some_and(|value| set(list).contains(&value))
            } else if let Some((key, value)) = term.split_once("!=") {
                label(key).is_none_or(|actual| actual != value.trim())
            } else if let Some((key, value)) = term.split_once('=') {
                label(key) == Some(value.trim_start_matches('=').trim().to_owned())
            } else if let Some((key, bound)) = term.split_once('>') {
                let bound: i64 = bound.trim().parse().expect("an integer after >");
                label(key)
                    .and_then(|value| value.parse::<i64>().ok())
                    .is_some_and(|value| value > bound)
            } else if let Some((key, bound)) = term.split_once('<') {
                let bound: i64 = bound.trim().parse().expect("an integer after <");
                label(key)
                    .and_then(|value| value.parse::<i64>().ok())
                    .is_some_and(|value| value < bound)
            } else if let Some(key) = term.strip_prefix('!') {
                label(key).is_none()
            } else {
                label(term).is_some()
            }
        })
}

fn query(request: &Request<Incoming>) -> HashMap<String, String> {
    request
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(key, value)| (key.to_owned(), percent_decode(value)))
        .collect()
}

fn percent_decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// The answer to a request whose body never arrived: the client reset its
/// stream (a request it gave up on, as 5,000 agents' do when kube-apiserver
/// is slow), so no one reads this.
fn body_lost() -> Response<Body> {
    failure(
        StatusCode::BAD_REQUEST,
        "BadRequest",
        "the request's body did not arrive".to_owned(),
    )
}

async fn handle(request: Request<Incoming>, store: &Arc<Mutex<Store>>, watches: &Watches) -> Response<Body> {
    let changes = &watches.changes;
    let authorized = {
        let tokens = &store.lock().unwrap().tokens;
        let bearer = request
            .headers()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        bearer.is_some_and(|bearer| tokens.iter().any(|token| token == bearer))
    };
    if !authorized {
        return failure(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized".to_owned(),
        );
    }
    let path = request.uri().path().to_owned();
    if path == TOKEN_REVIEWS && request.method() == Method::POST {
        return review(request, store).await;
    }
    let Some((resource, namespace, name)) = route(&path) else {
        return failure(StatusCode::NOT_FOUND, "NotFound", format!("no route {path}"));
    };
    let query = query(&request);
    let method = request.method().clone();
    let Ok(body) = request.into_body().collect().await else {
        return body_lost();
    };
    let body = body.to_bytes();
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap_or(Value::Null)
    };
    let selector = query.get("labelSelector").cloned().unwrap_or_default();
    if method == Method::GET && name.is_none() {
        store.lock().unwrap().selectors.insert(selector.clone());
    }
    // Calls are counted by kind, and for Nodes apart ("GET list node").
    let call = |kind: &str| {
        let suffix = if resource == Resource::Node { " node" } else { "" };
        *store
            .lock()
            .unwrap()
            .calls
            .entry(format!("{method} {kind}{suffix}"))
            .or_default() += 1;
    };
    let key = |name: &str| (resource, namespace.clone(), name.to_owned());
    match (&method, name) {
        (&Method::GET, None) if query.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            call("watch");
            let from: u64 = query
                .get("resourceVersion")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let timeout = query
                .get("timeoutSeconds")
                .and_then(|seconds| seconds.parse().ok())
                .map(Duration::from_secs);
            let _ = watches.held.subscribe().wait_for(|held| !held).await;
            watch(store, watches, (resource, namespace), selector, from, timeout)
        }
        (&Method::GET, None) => {
            call("list");
            let store = store.lock().unwrap();
            let items: Vec<Value> = store
                .objects
                .iter()
                .filter(|((r, ns, _), object)| {
                    *r == resource && *ns == namespace && matches(&selector, &object["metadata"]["labels"])
                })
                .map(|(_, object)| object.clone())
                .collect();
            answer(
                StatusCode::OK,
                json!({
                    "kind": format!("{}List", resource.kind()), "apiVersion": resource.api_version(),
                    "metadata": {"resourceVersion": store.version.to_string()},
                    "items": items,
                }),
            )
        }
        (&Method::GET, Some(name)) => {
            call("get");
            match store.lock().unwrap().objects.get(&key(&name)) {
                Some(object) => answer(StatusCode::OK, object.clone()),
                None => not_found(resource, &name),
            }
        }
        // Nodes are written by the test ([`KubeApi::put_node`]) only.
        _ if resource == Resource::Node => failure(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} {path}"),
        ),
        (&Method::POST, None) => {
            call("create");
            let mut store = store.lock().unwrap();
            let mut lease = body;
            assert_eq!(lease["kind"], "Lease", "{lease}");
            assert_eq!(lease["apiVersion"], "coordination.k8s.io/v1", "{lease}");
            let name = lease["metadata"]["name"].as_str().unwrap_or_default().to_owned();
            let key = key(&name);
            if store.objects.contains_key(&key) {
                return failure(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    format!("leases.coordination.k8s.io \"{name}\" already exists"),
                );
            }
            let version = next_version(&mut store);
            lease["metadata"]["resourceVersion"] = json!(version.to_string());
            lease["metadata"]["namespace"] = json!(namespace);
            lease["metadata"]["uid"] = json!(format!("uid-{version}"));
            store.objects.insert(key.clone(), lease.clone());
            record(&mut store, changes, "ADDED", &key, lease.clone(), version);
            answer(StatusCode::CREATED, lease)
        }
        (&Method::PUT, Some(name)) => {
            call("update");
            let mut store = store.lock().unwrap();
            if store.refused_updates.contains(&name) {
                return failure(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "refused by the test".to_owned(),
                );
            }
            let key = key(&name);
            let Some(stored) = store.objects.get(&key) else {
                return not_found(resource, &name);
            };
            let mut lease = body;
            let given = lease["metadata"]["resourceVersion"].as_str().unwrap_or_default();
            if given != stored["metadata"]["resourceVersion"].as_str().unwrap_or_default() {
                return conflict(&name);
            }
            let uid = stored["metadata"]["uid"].clone();
            let version = next_version(&mut store);
            lease["metadata"]["resourceVersion"] = json!(version.to_string());
            lease["metadata"]["uid"] = uid;
            store.objects.insert(key.clone(), lease.clone());
            record(&mut store, changes, "MODIFIED", &key, lease.clone(), version);
            answer(StatusCode::OK, lease)
        }
        (&Method::DELETE, Some(name)) => {
            call("delete");
            let mut store = store.lock().unwrap();
            let key = key(&name);
            let Some(stored) = store.objects.get(&key) else {
                return not_found(resource, &name);
            };
            if let Some(wanted) = body["preconditions"]["resourceVersion"].as_str()
                && wanted != stored["metadata"]["resourceVersion"].as_str().unwrap_or_default()
            {
                return conflict(&name);
            }
            let mut lease = store.objects.remove(&key).unwrap();
            let version = next_version(&mut store);
            lease["metadata"]["resourceVersion"] = json!(version.to_string());
            record(&mut store, changes, "DELETED", &key, lease, version);
            answer(
                StatusCode::OK,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
            )
        }
        _ => failure(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} {path}"),
        ),
    }
}

/// What a path names: the kind, namespace ("" for Nodes) and, for one
/// object, its name.
fn route(path: &str) -> Option<(Resource, String, Option<String>)> {
    if let Some(rest) = path.strip_prefix(NODES) {
        return match rest {
            "" => Some((Resource::Node, String::new(), None)),
            _ => rest
                .strip_prefix('/')
                .filter(|name| !name.is_empty() && !name.contains('/'))
                .map(|name| (Resource::Node, String::new(), Some(name.to_owned()))),
        };
    }
    let (namespace, rest) = path.strip_prefix(LEASES)?.split_once('/')?;
    let name = match rest {
        "leases" => None,
        _ => Some(rest.strip_prefix("leases/")?.to_owned()),
    };
    Some((Resource::Lease, namespace.to_owned(), name))
}

fn not_found(resource: Resource, name: &str) -> Response<Body> {
    failure(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", resource.group_resource()),
    )
}

fn conflict(name: &str) -> Response<Body> {
    failure(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
        ),
    )
}

/// A watch: the changes after `from` that match, then each new one, one
/// JSON event per line, until `timeout`, the client goes, the test ends the
/// watches or the stand-in stops. From a version older than the history
/// kept: one `ERROR` event, 410 Expired, as kube-apiserver's watch cache
/// answers (the HTTP status is 200: the watch itself was accepted).
fn watch(
    store: &Arc<Mutex<Store>>,
    watches: &Watches,
    (resource, namespace): (Resource, String),
    selector: String,
    from: u64,
    timeout: Option<Duration>,
) -> Response<Body> {
    let (events, body) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
    let line = |value: Value| Ok(Frame::data(Bytes::from(value.to_string() + "\n")));
    // Subscribed before reading the past, so nothing falls in between.
    let mut live = watches.changes.subscribe();
    let mut ended = watches.ended.subscribe();
    let (past, compacted) = {
        let store = store.lock().unwrap();
        let past: Vec<Change> = store
            .changes
            .iter()
            .filter(|change| change.version > from)
            .cloned()
            .collect();
        (past, store.compacted)
    };
    if from != 0 && from < compacted {
        let expired = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {from} ({compacted})"),
            "reason": "Expired", "code": 410,
        }});
        let _ = events.try_send(line(expired));
    } else {
        tokio::spawn(async move {
            let event = |change: &Change| line(json!({"type": change.kind, "object": change.object}));
            let wanted = |change: &Change| {
                change.resource == resource
                    && change.namespace == namespace
                    && matches(&selector, &change.object["metadata"]["labels"])
            };
            let follow = async {
                let mut last = from;
                for change in past {
                    last = change.version;
                    if wanted(&change) && events.send(event(&change)).await.is_err() {
                        return;
                    }
                }
                while let Ok(change) = live.recv().await {
                    if change.version <= last {
                        continue;
                    }
                    last = change.version;
                    if wanted(&change) && events.send(event(&change)).await.is_err() {
                        return;
                    }
                }
            };
            let time_up = async {
                match timeout {
                    Some(timeout) => tokio::time::sleep(timeout).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = follow => {}
                _ = time_up => {}
                _ = ended.changed() => {}
            }
        });
    }
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(body),
        )))
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A selector arrives percent-encoded; a malformed escape is taken as
    /// written rather than ending the connection's task.
    #[test]
    fn query_values_are_percent_decoded_and_malformed_escapes_kept() {
        assert_eq!(
            percent_decode("k8s-app%3Dkonnectivity-server"),
            "k8s-app=konnectivity-server"
        );
        assert_eq!(percent_decode("a%zzb%4"), "a%zzb%4");
    }
}
