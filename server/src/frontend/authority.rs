//! The `:authority` of gRPC requests on the frontends.
//!
//! kube-apiserver's gRPC egress (grpc-go, through konnectivity-client)
//! dials the Unix socket's path as its target, and grpc-go then sends that
//! path, percent-encoded, as the `:authority` of every request
//! (`%2Fetc%2Fkubernetes%2F…`); gRPC core clients send it too. No URI
//! authority looks like that, and h2 as released resets such a request
//! with PROTOCOL_ERROR before tonic sees it. Upstream's Go server ignores
//! the authority, and on a Unix socket it names nothing; so the h2 this
//! workspace builds (`vendor/h2`, see vendor/README.md) passes the request
//! on without it, marked with `h2::ext::UnparsedAuthority`.
//!
//! Over TLS a client names the host it verified: a path there is a broken
//! client, refused as h2 as released refuses it. [`RefuseUnparsedAuthority`]
//! does that on the TCP frontends: the request's stream is reset with
//! PROTOCOL_ERROR, and nothing of it reaches the frontend.

use std::task::{Context, Poll};

use futures_util::TryFutureExt;
use futures_util::future::{Either, Ready, ready};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Wraps a frontend's gRPC service: see the module's documentation. One
/// type for every listener, so that they share one server type; only the
/// TCP listeners' refuse.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RefuseUnparsedAuthorityLayer {
    pub refuse: bool,
}

impl<S> tower::Layer<S> for RefuseUnparsedAuthorityLayer {
    type Service = RefuseUnparsedAuthority<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RefuseUnparsedAuthority {
            inner,
            refuse: self.refuse,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct RefuseUnparsedAuthority<S> {
    inner: S,
    refuse: bool,
}

/// Why a request was refused. Its source is the h2 error whose reason
/// hyper resets the stream with; tonic passes it on as it is (only a
/// `Status`, or an `h2::Error` itself, would become a gRPC status).
#[derive(Debug, thiserror::Error)]
#[error("malformed :authority {authority:?} on a TCP frontend")]
pub(crate) struct MalformedAuthority {
    authority: String,
    source: h2::Error,
}

impl<S, B> tower::Service<http::Request<B>> for RefuseUnparsedAuthority<S>
where
    S: tower::Service<http::Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future =
        Either<Ready<Result<S::Response, BoxError>>, futures_util::future::ErrInto<S::Future, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match request.extensions().get::<h2::ext::UnparsedAuthority>() {
            Some(unparsed) if self.refuse => {
                let refused = MalformedAuthority {
                    authority: String::from_utf8_lossy(unparsed.as_bytes()).into_owned(),
                    source: h2::Error::from(h2::Reason::PROTOCOL_ERROR),
                };
                tracing::debug!(error = %refused, "request refused");
                Either::Left(ready(Err(refused.into())))
            }
            _ => Either::Right(self.inner.call(request).err_into()),
        }
    }
}
