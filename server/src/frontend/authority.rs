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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower::ServiceExt;

    /// One HTTP/2 request as gRPC core sends it on a Unix socket, frame by
    /// frame: the preface, empty SETTINGS, and a HEADERS frame whose fields
    /// are HPACK literals (RFC 7541 §6.2.2) with the socket's path as
    /// `:authority`.
    fn client_bytes(authority: &str) -> Vec<u8> {
        let mut block = Vec::new();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/ProxyService/Proxy"),
            (":authority", authority),
            ("te", "trailers"),
        ] {
            block.push(0x00);
            block.push(name.len() as u8);
            block.extend_from_slice(name.as_bytes());
            block.push(value.len() as u8);
            block.extend_from_slice(value.as_bytes());
        }
        let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
            let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
            out.extend_from_slice(&[kind, flags]);
            out.extend_from_slice(&stream.to_be_bytes());
            out.extend_from_slice(payload);
            out
        };
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(0x4, 0, 0, &[]));
        // HEADERS, END_HEADERS | END_STREAM, stream 1.
        bytes.extend(frame(0x1, 0x4 | 0x1, 1, &block));
        bytes
    }

    /// The request h2 hands the service for those bytes.
    async fn accepted(authority: &str) -> http::Request<h2::RecvStream> {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        client_write.write_all(&client_bytes(authority)).await.unwrap();
        // What the server writes (its SETTINGS, acknowledgements) is read
        // and dropped, as a client would.
        tokio::spawn(async move { while client_read.read(&mut [0; 1024]).await.is_ok_and(|n| n > 0) {} });
        let mut connection = h2::server::handshake(server).await.unwrap();
        // h2 as released resets such a stream and waits for the next one.
        let (request, _respond) =
            tokio::time::timeout(std::time::Duration::from_secs(5), connection.accept())
                .await
                .unwrap_or_else(|_| panic!("h2 never handed over the request with :authority {authority:?}"))
                .expect("a request")
                .unwrap();
        tokio::spawn(async move { while connection.accept().await.is_some() {} });
        request
    }

    fn refused(error: &BoxError) -> Option<h2::Reason> {
        let malformed = error.downcast_ref::<MalformedAuthority>()?;
        std::error::Error::source(malformed)?
            .downcast_ref::<h2::Error>()?
            .reason()
    }

    #[tokio::test]
    async fn the_patched_h2_passes_a_socket_path_authority_on_without_it() {
        let request = accepted("%2Ftmp%2Fkas.sock").await;
        assert_eq!(request.uri().authority(), None);
        assert_eq!(request.uri().path(), "/ProxyService/Proxy");
        let unparsed = request.extensions().get::<h2::ext::UnparsedAuthority>();
        assert_eq!(unparsed.map(|u| u.as_bytes()), Some(&b"%2Ftmp%2Fkas.sock"[..]));
        // A URI authority is parsed as ever, and nothing is marked.
        let request = accepted("localhost:8090").await;
        assert_eq!(
            request.uri().authority().map(|a| a.as_str()),
            Some("localhost:8090")
        );
        assert!(request.extensions().get::<h2::ext::UnparsedAuthority>().is_none());
    }

    #[tokio::test]
    async fn tcp_listeners_refuse_it_with_protocol_error_and_the_socket_serves_it() {
        let inner = tower::service_fn(|_: http::Request<h2::RecvStream>| async {
            Ok::<_, std::convert::Infallible>("served")
        });
        let tcp = RefuseUnparsedAuthorityLayer { refuse: true };
        let socket = RefuseUnparsedAuthorityLayer { refuse: false };

        let error = tower::Layer::layer(&tcp, inner)
            .oneshot(accepted("%2Ftmp%2Fkas.sock").await)
            .await
            .unwrap_err();
        assert_eq!(refused(&error), Some(h2::Reason::PROTOCOL_ERROR), "{error}");
        assert!(error.to_string().contains("%2Ftmp%2Fkas.sock"), "{error}");

        let served = tower::Layer::layer(&socket, inner)
            .oneshot(accepted("%2Ftmp%2Fkas.sock").await)
            .await
            .unwrap();
        assert_eq!(served, "served");
        let served = tower::Layer::layer(&tcp, inner)
            .oneshot(accepted("localhost:8090").await)
            .await
            .unwrap();
        assert_eq!(served, "served");
    }
}
