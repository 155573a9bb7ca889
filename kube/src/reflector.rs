//! Following a collection of objects as client-go's reflector does: list
//! once, then watch from the list's resourceVersion; a watch that ends, or
//! whose connection fails, is taken up again from the last resourceVersion
//! seen, so kube-apiserver coming back is not met by every follower listing
//! at once; only kube-apiserver's 410 Expired (the version was compacted
//! away) makes the follower list again.
//!
//! One concept in one place: the agent follows proxy-server Leases with it,
//! the server follows Nodes with it.

use std::time::Duration;

use http::StatusCode;
use rand::Rng;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::client::KubeClient;
use crate::error::KubeError;
use crate::watch::{WatchEvent, WatchStream};

/// The shortest time kube-apiserver is asked to keep a watch open before
/// the follower starts the next one; each watch asks for between this and
/// twice this, at random, as client-go's reflector does ([`watch_timeout`]).
const WATCH_TIMEOUT_MIN: Duration = Duration::from_secs(300);
/// A watch that delivers nothing for this long past its timeout (when
/// kube-apiserver ends it) is taken for a dead connection.
const SILENCE_GRACE: Duration = Duration::from_secs(30);
/// Waits after a failed list or watch: first, and at most (each up to
/// twice as long at random, as client-go's reflector waits).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// One watch's timeout. At random: 5,000 agents started together with one
/// fixed timeout would all watch again at the same instant, every time.
fn watch_timeout() -> Duration {
    WATCH_TIMEOUT_MIN.mul_f64(1.0 + rand::rng().random::<f64>())
}

/// An object a reflector follows: it knows its resourceVersion.
pub trait Object: DeserializeOwned {
    fn resource_version(&self) -> &str;
}

/// A list's metadata: the version to watch from.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ListMeta {
    #[serde(default)]
    pub resource_version: String,
}

/// What a list answers: the objects, and the version to watch from.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", bound = "T: DeserializeOwned")]
pub struct ObjectList<T> {
    #[serde(default)]
    pub metadata: ListMeta,
    #[serde(default = "Vec::new")]
    pub items: Vec<T>,
}

/// A collection to follow: its path (`/api/v1/nodes`) and label selector
/// (empty: every object).
#[derive(Clone, Debug)]
pub struct Collection {
    pub path: String,
    pub label_selector: String,
}

impl Collection {
    pub(crate) fn list_path(&self) -> String {
        match self.label_selector.as_str() {
            "" => self.path.clone(),
            selector => format!("{}?labelSelector={}", self.path, query_escape(selector)),
        }
    }

    fn watch_path(&self, resource_version: &str, timeout: Duration) -> String {
        let selector = match self.label_selector.as_str() {
            "" => String::new(),
            selector => format!("labelSelector={}&", query_escape(selector)),
        };
        format!(
            "{}?{selector}watch=true&allowWatchBookmarks=true&resourceVersion={}&timeoutSeconds={}",
            self.path,
            query_escape(resource_version),
            timeout.as_secs().max(1)
        )
    }
}

/// What a reflector learned.
#[derive(Debug)]
pub enum Reflected<T> {
    /// Every object there is now: what was known before is replaced.
    Listed(Vec<T>),
    /// An object was added or changed.
    Applied(T),
    Deleted(T),
    /// kube-apiserver answered (a watch began, or a bookmark came) and
    /// nothing changed.
    Answered,
}

/// A list or a watch, for the caller's metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    List,
    Watch,
}

#[derive(Debug, thiserror::Error)]
pub enum ReflectError {
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("kube-apiserver ended the watch of {path} with {code} {reason}: {message}")]
    Watch {
        path: String,
        code: u16,
        reason: String,
        message: String,
    },
    #[error("the watch of {path} delivered nothing for {silence:?}")]
    Silent { path: String, silence: Duration },
}

/// Told of every list and watch call: which, its answer's status and
/// `Status` reason (200 and "" on success; `None` when no answer came), and
/// how long it took.
pub type Observer = Box<dyn Fn(Call, Option<(StatusCode, &str)>, Duration) + Send + Sync>;

/// Follows one collection. [`Reflector::next`] may be cancelled and called
/// again without losing anything, but a cancelled list or watch starts over:
/// keep its future across timers rather than racing a fresh one each time.
pub struct Reflector<T> {
    client: std::sync::Arc<KubeClient>,
    collection: Collection,
    observe: Observer,
    /// The version the next watch starts from; `None` until the first
    /// list, and after a 410 Expired.
    version: Option<String>,
    events: Option<WatchStream>,
    /// How long the open watch may stay silent (its timeout and a grace).
    silence: Duration,
    /// Until when the open watch may stay silent.
    silent_until: Instant,
    /// After a failure: no call before then.
    retry_at: Option<Instant>,
    retry: Duration,
    _objects: std::marker::PhantomData<fn() -> T>,
}

impl<T: Object> Reflector<T> {
    pub fn new(
        client: std::sync::Arc<KubeClient>,
        collection: Collection,
        observe: Observer,
    ) -> Reflector<T> {
        Reflector {
            client,
            collection,
            observe,
            version: None,
            events: None,
            silence: WATCH_TIMEOUT_MIN + SILENCE_GRACE,
            silent_until: Instant::now(),
            retry_at: None,
            retry: RETRY_FIRST,
            _objects: std::marker::PhantomData,
        }
    }

    /// The next thing learned. After an error, the next call waits a
    /// growing pause (0.5 s doubling to 30 s, each up to twice that at
    /// random) and goes on from the last
    /// version seen.
    pub async fn next(&mut self) -> Result<Reflected<T>, ReflectError> {
        if let Some(at) = self.retry_at {
            tokio::time::sleep_until(at).await;
            self.retry_at = None;
        }
        let learned = self.learn().await;
        match &learned {
            Ok(_) => self.retry = RETRY_FIRST,
            Err(_) => {
                self.events = None;
                self.retry_at = Some(Instant::now() + self.retry.mul_f64(1.0 + rand::rng().random::<f64>()));
                self.retry = (self.retry * 2).min(RETRY_MAX);
            }
        }
        learned
    }

    async fn learn(&mut self) -> Result<Reflected<T>, ReflectError> {
        loop {
            let Some(version) = self.version.clone() else {
                let list: ObjectList<T> = self
                    .timed(Call::List, self.client.get(&self.collection.list_path()))
                    .await?;
                self.version = Some(list.metadata.resource_version);
                self.events = None;
                return Ok(Reflected::Listed(list.items));
            };
            let Some(events) = &mut self.events else {
                let timeout = watch_timeout();
                let path = self.collection.watch_path(&version, timeout);
                let events = self.timed(Call::Watch, self.client.watch(&path)).await?;
                self.events = Some(events);
                self.silence = timeout + SILENCE_GRACE;
                self.silent_until = Instant::now() + self.silence;
                return Ok(Reflected::Answered);
            };
            let event = match tokio::time::timeout_at(self.silent_until, events.next::<T>()).await {
                Err(_) => {
                    return Err(ReflectError::Silent {
                        path: self.collection.path.clone(),
                        silence: self.silence,
                    });
                }
                Ok(event) => event?,
            };
            self.silent_until = Instant::now() + self.silence;
            match event {
                // The watch's time is up: the next one goes on from here.
                None => self.events = None,
                Some(WatchEvent::Added(object) | WatchEvent::Modified(object)) => {
                    self.version = Some(object.resource_version().to_owned());
                    return Ok(Reflected::Applied(object));
                }
                Some(WatchEvent::Deleted(object)) => {
                    self.version = Some(object.resource_version().to_owned());
                    return Ok(Reflected::Deleted(object));
                }
                Some(WatchEvent::Bookmark { resource_version }) => {
                    self.version = Some(resource_version);
                    return Ok(Reflected::Answered);
                }
                // The version was compacted away: list again.
                Some(WatchEvent::Error { code: 410, .. }) => {
                    self.version = None;
                    self.events = None;
                }
                Some(WatchEvent::Error {
                    code,
                    reason,
                    message,
                }) => {
                    return Err(ReflectError::Watch {
                        path: self.collection.path.clone(),
                        code,
                        reason,
                        message,
                    });
                }
            }
        }
    }

    async fn timed<R>(
        &self,
        call: Call,
        request: impl std::future::Future<Output = Result<R, KubeError>>,
    ) -> Result<R, KubeError> {
        let started = std::time::Instant::now();
        let answered = request.await;
        let status = match &answered {
            Ok(_) => Some((StatusCode::OK, "")),
            Err(error) => error.api_status(),
        };
        (self.observe)(call, status, started.elapsed());
        answered
    }
}

/// What a URL component may carry unescaped (RFC 3986's unreserved).
const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encodes a path segment or query value (a label selector holds
/// `=` and `,`).
pub(crate) fn query_escape(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, UNRESERVED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Followers started together spread their next watches over five
    /// minutes instead of all asking again at once.
    #[test]
    fn watch_timeouts_spread_from_five_to_ten_minutes() {
        let timeouts: std::collections::BTreeSet<u64> = (0..50).map(|_| watch_timeout().as_secs()).collect();
        assert!(
            timeouts.len() > 30,
            "50 watches asked for only {} timeouts",
            timeouts.len()
        );
        assert!(timeouts.iter().all(|&t| (300..600).contains(&t)), "{timeouts:?}");
    }

    #[test]
    fn list_and_watch_paths_carry_the_selector_only_when_there_is_one() {
        let nodes = Collection {
            path: "/api/v1/nodes".to_owned(),
            label_selector: String::new(),
        };
        assert_eq!(nodes.list_path(), "/api/v1/nodes");
        assert_eq!(
            nodes.watch_path("41", Duration::from_secs(300)),
            "/api/v1/nodes?watch=true&allowWatchBookmarks=true&resourceVersion=41&timeoutSeconds=300"
        );
        let leases = Collection {
            path: "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases".to_owned(),
            label_selector: "k8s-app=konnectivity-server".to_owned(),
        };
        assert_eq!(
            leases.list_path(),
            "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases?labelSelector=k8s-app%3Dkonnectivity-server"
        );
        assert_eq!(
            leases.watch_path("", Duration::from_millis(10)),
            "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases?labelSelector=k8s-app%3Dkonnectivity-server\
             &watch=true&allowWatchBookmarks=true&resourceVersion=&timeoutSeconds=1"
        );
    }
}
