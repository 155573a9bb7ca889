//! What can go wrong talking to kube-apiserver, and the limits that bound
//! a request.

use std::time::Duration;

use http::{Method, StatusCode};

/// How long one request may take, connection set-up included.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The most of an answer we read; a TokenReview is a few KiB, a list of a
/// thousand Leases under a MiB.
pub(crate) const MAX_ANSWER: usize = 4 * 1024 * 1024;

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
    #[error("kube-apiserver {server} answered {status} to {method} {path}: {body}")]
    Status {
        server: String,
        method: Method,
        path: String,
        status: StatusCode,
        /// The `reason` of the `Status` object the answer carried (e.g.
        /// `Conflict`), empty when it carried none.
        reason: String,
        body: String,
    },
    #[error("kube-apiserver {server} sent a bad answer to {method} {path}: {problem}")]
    Answer {
        server: String,
        method: Method,
        path: String,
        problem: String,
    },
}

impl KubeError {
    /// The HTTP status and `Status` reason of an answer that was an error,
    /// as upstream labels its metrics; `None` when no answer came.
    pub fn api_status(&self) -> Option<(StatusCode, &str)> {
        match self {
            KubeError::Status { status, reason, .. } => Some((*status, reason)),
            _ => None,
        }
    }

    pub fn is_status(&self, wanted: StatusCode) -> bool {
        self.api_status().is_some_and(|(status, _)| status == wanted)
    }
}

/// The error for a non-2xx answer: kube-apiserver sends a `Status` object
/// whose `reason` (`NotFound`, `Conflict`, …) upstream's metrics carry.
pub(crate) fn status_error(
    server: String,
    method: Method,
    path: &str,
    status: StatusCode,
    body: &[u8],
) -> KubeError {
    #[derive(serde::Deserialize)]
    struct ApiStatus {
        #[serde(default)]
        reason: String,
    }
    let reason = serde_json::from_slice::<ApiStatus>(body)
        .map(|s| s.reason)
        .unwrap_or_default();
    KubeError::Status {
        server,
        method,
        path: path.to_owned(),
        status,
        reason,
        body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
    }
}
