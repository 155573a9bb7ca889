//! A watch's answer: kube-apiserver streams one JSON event per line,
//! `{"type": "ADDED", "object": {...}}`, for as long as the watch lasts.

use bytes::{Buf, BytesMut};
use http::Method;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::error::{KubeError, MAX_ANSWER};

/// One event of a watch on objects of type `T`.
#[derive(Debug)]
pub enum WatchEvent<T> {
    Added(T),
    Modified(T),
    Deleted(T),
    /// Only a newer resourceVersion to resume from (`allowWatchBookmarks`).
    Bookmark {
        resource_version: String,
    },
    /// The server ended the watch with a `Status`: 410 Gone means the
    /// resourceVersion is too old and the caller must list again.
    Error {
        code: u16,
        reason: String,
        message: String,
    },
}

pub struct WatchStream {
    server: String,
    path: String,
    body: Incoming,
    buffer: BytesMut,
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(rename = "type")]
    kind: String,
    object: serde_json::Value,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct BookmarkObject {
    #[serde(default)]
    metadata: BookmarkMetadata,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct BookmarkMetadata {
    #[serde(default)]
    resource_version: String,
}

#[derive(Deserialize, Default)]
struct StatusObject {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    message: String,
}

impl WatchStream {
    pub(super) fn new(server: String, path: String, body: Incoming) -> WatchStream {
        WatchStream {
            server,
            path,
            body,
            buffer: BytesMut::new(),
        }
    }

    /// The next event, or `None` when the server ended the watch (its
    /// `timeoutSeconds` passed, or it restarted).
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<WatchEvent<T>>, KubeError> {
        loop {
            if let Some(end) = self.buffer.iter().position(|byte| *byte == b'\n') {
                let line = self.buffer.split_to(end + 1);
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                return self.decode(line).map(Some);
            }
            if self.buffer.len() > MAX_ANSWER {
                return Err(self.bad(format!("an event longer than {MAX_ANSWER} bytes")));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(source)) => {
                    return Err(KubeError::Http {
                        server: self.server.clone(),
                        source,
                    });
                }
                Some(Ok(frame)) => {
                    if let Ok(mut data) = frame.into_data() {
                        while data.has_remaining() {
                            let chunk = data.chunk();
                            self.buffer.extend_from_slice(chunk);
                            let len = chunk.len();
                            data.advance(len);
                        }
                    }
                }
            }
        }
    }

    fn decode<T: DeserializeOwned>(&self, line: &[u8]) -> Result<WatchEvent<T>, KubeError> {
        let raw: RawEvent = serde_json::from_slice(line).map_err(|e| self.bad(e.to_string()))?;
        let object = |value| serde_json::from_value::<T>(value).map_err(|e| self.bad(e.to_string()));
        Ok(match raw.kind.as_str() {
            "ADDED" => WatchEvent::Added(object(raw.object)?),
            "MODIFIED" => WatchEvent::Modified(object(raw.object)?),
            "DELETED" => WatchEvent::Deleted(object(raw.object)?),
            "BOOKMARK" => {
                let bookmark: BookmarkObject = serde_json::from_value(raw.object).unwrap_or_default();
                WatchEvent::Bookmark {
                    resource_version: bookmark.metadata.resource_version,
                }
            }
            "ERROR" => {
                let status: StatusObject = serde_json::from_value(raw.object).unwrap_or_default();
                WatchEvent::Error {
                    code: status.code,
                    reason: status.reason,
                    message: status.message,
                }
            }
            other => return Err(self.bad(format!("unknown event type {other:?}"))),
        })
    }

    fn bad(&self, problem: String) -> KubeError {
        KubeError::Answer {
            server: self.server.clone(),
            method: Method::GET,
            path: self.path.clone(),
            problem,
        }
    }
}
