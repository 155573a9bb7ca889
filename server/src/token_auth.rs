//! Agent authentication by ServiceAccount token (upstream's
//! `--agent-namespace`, `--agent-service-account`, `--authentication-audience`):
//! the agent sends `authorization: Bearer <token>` on its stream, a
//! TokenReview asks kube-apiserver whose token it is, and only the configured
//! ServiceAccount is admitted.
//!
//! Answers are cached for a short while by the token's SHA-256, and
//! concurrent lookups of one token share one review: a fleet of agents
//! reconnecting at once (they share the ServiceAccount, and often the
//! token's audience and lifetime) costs kube-apiserver a handful of reviews,
//! not one per stream.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use konnectivity_kube::node::NodeName;
use konnectivity_kube::{KubeClient, KubeError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;
use tonic::Status;
use tonic::metadata::MetadataMap;

/// The metadata key and scheme upstream agents send their token with.
pub(crate) const AUTHORIZATION: &str = "authorization";
const BEARER: &str = "Bearer ";
const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
/// How long kube-apiserver's answer about one token is reused.
pub const CACHE_TTL: Duration = Duration::from_secs(10);
/// Distinct tokens remembered at most; past it, expired answers are dropped
/// and, if that is not enough, all of them (a flood of junk tokens must not
/// grow memory).
const CACHE_MAX: usize = 4096;

/// Who may connect as an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedAgents {
    pub namespace: String,
    pub service_account: String,
    pub audience: String,
}

/// Why a token was not admitted, as kube-apiserver's answer showed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Denied {
    #[error("token review failed: {0}")]
    ReviewError(String),
    #[error("token not valid (TokenReview: not authenticated)")]
    NotAuthenticated,
    #[error("token belongs to {0:?}, which is not a ServiceAccount")]
    NotServiceAccount(String),
    #[error(
        "token belongs to ServiceAccount {namespace}/{name}; agents must be in namespace {expected:?} (--agent-namespace)"
    )]
    WrongNamespace {
        namespace: String,
        name: String,
        expected: String,
    },
    #[error(
        "token belongs to ServiceAccount {namespace}/{name}; agents must be ServiceAccount {expected:?} (--agent-service-account)"
    )]
    WrongServiceAccount {
        namespace: String,
        name: String,
        expected: String,
    },
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct TokenReview<'a> {
    api_version: &'static str,
    kind: &'static str,
    spec: ReviewSpec<'a>,
}

#[derive(Serialize)]
struct ReviewSpec<'a> {
    token: &'a str,
    audiences: [&'a str; 1],
}

#[derive(Deserialize)]
struct ReviewAnswer {
    #[serde(default)]
    status: ReviewStatus,
}

#[derive(Deserialize, Default)]
struct ReviewStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    user: ReviewUser,
    #[serde(default)]
    error: String,
}

#[derive(Deserialize, Default)]
struct ReviewUser {
    #[serde(default)]
    username: String,
    /// With a bound token (a pod's projected token, Kubernetes 1.30 and
    /// later, KEP-4193): the node the pod runs on, among others.
    #[serde(default)]
    extra: BTreeMap<String, Vec<String>>,
}

/// The extra keys of a TokenReview naming the node a bound token's pod runs on.
const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
const NODE_UID_EXTRA: &str = "authentication.kubernetes.io/node-uid";

/// An admitted agent, as its token's review showed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AgentAccount {
    /// The ServiceAccount's user name.
    pub username: String,
    /// The node the token is bound to, when the review says (exactly one
    /// name); `None` for older clusters and tokens bound to no pod.
    pub node: Option<BoundNode>,
}

/// The node a token is bound to: its name and, when the review gives it,
/// the Node object's uid (which tells it apart from a later Node of the
/// same name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BoundNode {
    pub name: NodeName,
    pub uid: Option<String>,
}

type Verdict = Result<AgentAccount, Denied>;

struct CacheEntry {
    created: Instant,
    verdict: OnceCell<Verdict>,
}

pub(crate) struct TokenAuthenticator {
    kube: Arc<KubeClient>,
    allowed: AllowedAgents,
    cache: Mutex<HashMap<[u8; 32], Arc<CacheEntry>>>,
    /// The tokens of the agent streams open now (by SHA-256), with how
    /// many streams were admitted with each.
    live: Arc<Mutex<HashMap<[u8; 32], usize>>>,
}

/// An admitted agent stream's token, counted as live until dropped (when
/// the stream ends).
pub(crate) struct LiveToken {
    live: Arc<Mutex<HashMap<[u8; 32], usize>>>,
    key: [u8; 32],
}

impl Drop for LiveToken {
    fn drop(&mut self) {
        let mut live = self.live.lock().expect("live tokens lock");
        if let Some(count) = live.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                live.remove(&self.key);
            }
        }
    }
}

fn token_key(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl TokenAuthenticator {
    pub(crate) fn new(kube: Arc<KubeClient>, allowed: AllowedAgents) -> Self {
        TokenAuthenticator {
            kube,
            allowed,
            cache: Mutex::new(HashMap::new()),
            live: Arc::default(),
        }
    }

    /// Checks an agent stream's token; the error is what the agent sees.
    /// Returns who the token belongs to, and the token counted as live for
    /// as long as the caller holds it.
    pub(crate) async fn authenticate(
        &self,
        metadata: &MetadataMap,
    ) -> Result<(AgentAccount, LiveToken), Status> {
        let token = bearer_token(metadata)?;
        let account = self.check(token).await?;
        let key = token_key(token);
        *self
            .live
            .lock()
            .expect("live tokens lock")
            .entry(key)
            .or_default() += 1;
        let live = LiveToken {
            live: self.live.clone(),
            key,
        };
        Ok((account, live))
    }

    /// Checks a probe's token. The token of an agent stream open now is
    /// admitted without a review: the probe learns no more than that stream
    /// already does, and an agent probes every second, which would cost
    /// kube-apiserver a review per agent each time the cache expires
    /// (1,000 agents: 100 reviews a second, for nothing).
    pub(crate) async fn authenticate_probe(&self, metadata: &MetadataMap) -> Result<(), Status> {
        let token = bearer_token(metadata)?;
        if self
            .live
            .lock()
            .expect("live tokens lock")
            .contains_key(&token_key(token))
        {
            return Ok(());
        }
        self.check(token).await.map(drop)
    }

    async fn check(&self, token: &str) -> Result<AgentAccount, Status> {
        match self.review(token).await {
            Ok(Ok(account)) => Ok(account),
            Ok(Err(denied)) => Err(Status::unauthenticated(format!("agent token refused: {denied}"))),
            Err(error) => Err(Status::unavailable(format!(
                "cannot verify the agent's token: {}",
                konnectivity_plumbing::error_chain(&error)
            ))),
        }
    }

    /// kube-apiserver's verdict on `token`, from the cache when fresh.
    /// Transport failures are not cached: the next stream asks again.
    async fn review(&self, token: &str) -> Result<Verdict, KubeError> {
        let entry = self.cache_entry(token_key(token));
        entry
            .verdict
            .get_or_try_init(|| async {
                let request = TokenReview {
                    api_version: "authentication.k8s.io/v1",
                    kind: "TokenReview",
                    spec: ReviewSpec {
                        token,
                        audiences: [&self.allowed.audience],
                    },
                };
                let answer: ReviewAnswer = self.kube.post(TOKEN_REVIEWS, &request).await?;
                Ok(judge(&answer.status, &self.allowed))
            })
            .await
            .cloned()
    }

    fn cache_entry(&self, key: [u8; 32]) -> Arc<CacheEntry> {
        let mut cache = self.cache.lock().expect("cache lock");
        let now = Instant::now();
        if let Some(entry) = cache.get(&key)
            && now.duration_since(entry.created) < CACHE_TTL
        {
            return entry.clone();
        }
        if cache.len() >= CACHE_MAX {
            cache.retain(|_, entry| now.duration_since(entry.created) < CACHE_TTL);
            if cache.len() >= CACHE_MAX {
                cache.clear();
            }
        }
        let entry = Arc::new(CacheEntry {
            created: now,
            verdict: OnceCell::new(),
        });
        cache.insert(key, entry.clone());
        entry
    }
}

/// The token of `authorization: Bearer <token>`, which must appear once.
fn bearer_token(metadata: &MetadataMap) -> Result<&str, Status> {
    let mut values = metadata.get_all(AUTHORIZATION).iter();
    let value = match (values.next(), values.next()) {
        (Some(value), None) => value,
        (None, _) => {
            return Err(Status::unauthenticated(
                "agent token missing: this server authenticates agents by ServiceAccount token \
                 (--agent-namespace) and the stream carries no \"authorization\" metadata; \
                 start the agent with --service-account-token-path",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(Status::unauthenticated(
                "more than one \"authorization\" metadata value: an agent must send exactly one token",
            ));
        }
    };
    let text = value
        .to_str()
        .map_err(|_| Status::unauthenticated("\"authorization\" metadata is not ASCII"))?;
    let token = text.strip_prefix(BEARER).ok_or_else(|| {
        Status::unauthenticated(format!("\"authorization\" metadata must start with {BEARER:?}"))
    })?;
    if token.trim().is_empty() {
        return Err(Status::unauthenticated(
            "\"authorization\" metadata carries an empty token",
        ));
    }
    Ok(token.trim())
}

/// Upstream's checks on a TokenReview's status, in its order.
fn judge(status: &ReviewStatus, allowed: &AllowedAgents) -> Verdict {
    if !status.error.is_empty() {
        return Err(Denied::ReviewError(status.error.clone()));
    }
    if !status.authenticated {
        return Err(Denied::NotAuthenticated);
    }
    let username = &status.user.username;
    // A ServiceAccount's user name is system:serviceaccount:NAMESPACE:NAME.
    let parts: Vec<&str> = username.split(':').collect();
    let (namespace, name) = match parts.as_slice() {
        ["system", "serviceaccount", namespace, name] => (*namespace, *name),
        _ => return Err(Denied::NotServiceAccount(username.clone())),
    };
    if namespace != allowed.namespace {
        return Err(Denied::WrongNamespace {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            expected: allowed.namespace.clone(),
        });
    }
    if name != allowed.service_account {
        return Err(Denied::WrongServiceAccount {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            expected: allowed.service_account.clone(),
        });
    }
    Ok(AgentAccount {
        username: username.clone(),
        node: bound_node(&status.user.extra),
    })
}

/// The node a review's extra names: exactly one non-empty name (anything
/// else names no node), with its uid when there is exactly one.
fn bound_node(extra: &BTreeMap<String, Vec<String>>) -> Option<BoundNode> {
    let only = |key: &str| match extra.get(key).map(Vec::as_slice) {
        Some([value]) if !value.is_empty() => Some(value.clone()),
        _ => None,
    };
    Some(BoundNode {
        name: NodeName(only(NODE_NAME_EXTRA)?),
        uid: only(NODE_UID_EXTRA),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed() -> AllowedAgents {
        AllowedAgents {
            namespace: "kube-system".to_owned(),
            service_account: "konnectivity-agent".to_owned(),
            audience: "system:konnectivity-server".to_owned(),
        }
    }

    fn status(authenticated: bool, username: &str, error: &str) -> ReviewStatus {
        ReviewStatus {
            authenticated,
            user: ReviewUser {
                username: username.to_owned(),
                extra: BTreeMap::new(),
            },
            error: error.to_owned(),
        }
    }

    #[test]
    fn only_the_configured_service_account_is_admitted() {
        let admitted = "system:serviceaccount:kube-system:konnectivity-agent";
        assert_eq!(
            judge(&status(true, admitted, ""), &allowed()),
            Ok(AgentAccount {
                username: admitted.to_owned(),
                node: None,
            })
        );
        assert_eq!(
            judge(&status(false, "", "token expired"), &allowed()),
            Err(Denied::ReviewError("token expired".to_owned()))
        );
        assert_eq!(
            judge(&status(false, "", ""), &allowed()),
            Err(Denied::NotAuthenticated)
        );
        for user in [
            "alice",
            "system:node:n1",
            "system:serviceaccount:kube-system",
            "system:serviceaccount:kube-system:konnectivity-agent:extra",
        ] {
            assert_eq!(
                judge(&status(true, user, ""), &allowed()),
                Err(Denied::NotServiceAccount(user.to_owned())),
                "{user}"
            );
        }
        let wrong_ns = judge(
            &status(true, "system:serviceaccount:default:konnectivity-agent", ""),
            &allowed(),
        );
        assert!(
            matches!(wrong_ns, Err(Denied::WrongNamespace { .. })),
            "{wrong_ns:?}"
        );
        let wrong_sa = judge(
            &status(true, "system:serviceaccount:kube-system:default", ""),
            &allowed(),
        );
        assert_eq!(
            wrong_sa.unwrap_err().to_string(),
            "token belongs to ServiceAccount kube-system/default; agents must be ServiceAccount \
             \"konnectivity-agent\" (--agent-service-account)"
        );
    }

    /// A TokenReview's answer for a DaemonSet pod's projected token, as
    /// kube-apiserver 1.31 writes it.
    #[test]
    fn a_bound_tokens_node_is_read_from_the_review() {
        let answer: ReviewAnswer = serde_json::from_str(
            r#"{"kind":"TokenReview","apiVersion":"authentication.k8s.io/v1","status":{
                "authenticated":true,
                "user":{"username":"system:serviceaccount:kube-system:konnectivity-agent",
                        "uid":"3b7c9a52-5e1f-4c57-a0d4-0b4f0a0b9a11",
                        "groups":["system:serviceaccounts","system:serviceaccounts:kube-system","system:authenticated"],
                        "extra":{"authentication.kubernetes.io/credential-id":["JTI=5a1f"],
                                 "authentication.kubernetes.io/node-name":["node-a"],
                                 "authentication.kubernetes.io/node-uid":["6b0c6d2e-0d6f-4bb5-9a43-1d1b2c1f6e0a"],
                                 "authentication.kubernetes.io/pod-name":["konnectivity-agent-x7k2p"],
                                 "authentication.kubernetes.io/pod-uid":["0e6a2b1c-8f3d-4d7e-9c1a-2b3c4d5e6f70"]}},
                "audiences":["system:konnectivity-server"]}}"#,
        )
        .unwrap();
        let account = judge(&answer.status, &allowed()).unwrap();
        assert_eq!(
            account.node,
            Some(BoundNode {
                name: NodeName("node-a".to_owned()),
                uid: Some("6b0c6d2e-0d6f-4bb5-9a43-1d1b2c1f6e0a".to_owned()),
            })
        );
        // Two names, or an empty one, name no node.
        let mut extra = BTreeMap::new();
        extra.insert(NODE_NAME_EXTRA.to_owned(), vec!["a".to_owned(), "b".to_owned()]);
        assert_eq!(bound_node(&extra), None);
        extra.insert(NODE_NAME_EXTRA.to_owned(), vec![String::new()]);
        assert_eq!(bound_node(&extra), None);
        extra.insert(NODE_NAME_EXTRA.to_owned(), vec!["a".to_owned()]);
        assert_eq!(bound_node(&extra).map(|node| node.uid), Some(None));
    }

    #[test]
    fn the_token_must_come_once_as_a_bearer_token() {
        let mut metadata = MetadataMap::new();
        let missing = bearer_token(&metadata).unwrap_err();
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(
            missing.message().contains("--service-account-token-path"),
            "{missing:?}"
        );
        metadata.insert(AUTHORIZATION, "Basic abc".parse().unwrap());
        assert!(bearer_token(&metadata).unwrap_err().message().contains("Bearer"));
        metadata.insert(AUTHORIZATION, "Bearer tok.en".parse().unwrap());
        assert_eq!(bearer_token(&metadata).unwrap(), "tok.en");
        metadata.append(AUTHORIZATION, "Bearer other".parse().unwrap());
        assert!(
            bearer_token(&metadata)
                .unwrap_err()
                .message()
                .contains("more than one")
        );
    }
}
