//! The generated clients must call exactly the paths upstream serves.

use std::sync::{Arc, Mutex};

use konnectivity_proto::wire::agent_service_client::AgentServiceClient;
use konnectivity_proto::wire::proxy_service_client::ProxyServiceClient;
use konnectivity_proto::{AGENT_CONNECT_PATH, PROXY_PATH, Packet};

/// A gRPC "transport" that records the request path and answers UNIMPLEMENTED.
fn recording_transport(
    seen: Arc<Mutex<Vec<String>>>,
) -> impl tower::Service<
    http::Request<tonic::body::Body>,
    Response = http::Response<tonic::body::Body>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    tower::service_fn(move |req: http::Request<tonic::body::Body>| {
        seen.lock().unwrap().push(req.uri().path().to_owned());
        async move {
            Ok(http::Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", "12")
                .body(tonic::body::Body::empty())
                .unwrap())
        }
    })
}

#[tokio::test]
async fn generated_clients_use_upstream_paths() {
    let seen = Arc::new(Mutex::new(Vec::new()));

    let mut proxy = ProxyServiceClient::new(recording_transport(seen.clone()));
    let status = proxy
        .proxy(tokio_stream::iter(Vec::<Packet>::new()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unimplemented);

    let mut agent = AgentServiceClient::new(recording_transport(seen.clone()));
    let _ = agent.connect(tokio_stream::iter(Vec::<Packet>::new())).await;

    assert_eq!(*seen.lock().unwrap(), [PROXY_PATH, AGENT_CONNECT_PATH]);
    assert_eq!(PROXY_PATH, "/ProxyService/Proxy");
    assert_eq!(AGENT_CONNECT_PATH, "/AgentService/Connect");
}

#[test]
fn generated_servers_are_named_like_upstream() {
    use konnectivity_proto::wire::agent_service_server::SERVICE_NAME as AGENT;
    use konnectivity_proto::wire::proxy_service_server::SERVICE_NAME as PROXY;
    assert_eq!(PROXY, "ProxyService");
    assert_eq!(AGENT, "AgentService");
}
