//! Raw gRPC to a server's agent port, for tests that play an agent
//! themselves to see exactly how the server answers.

use std::sync::Arc;

use konnectivity_proto::wire::agent_service_client::AgentServiceClient;
use tonic::transport::Channel;

/// Plays an agent named played-agent on the server's agent port, with a
/// bearer `token` and `identifiers` when given and no client certificate;
/// how the server answered the stream.
pub async fn play_agent(
    port: u16,
    pki: &super::certs::Pki,
    token: Option<&str>,
    identifiers: Option<&str>,
) -> Result<(), tonic::Status> {
    let mut client = agent_client(port, pki.client_tls(None, &[b"h2"])).await;
    let mut request = tonic::Request::new(tokio_stream::pending::<konnectivity_proto::Packet>());
    let metadata = request.metadata_mut();
    metadata.insert(
        "agentid",
        tonic::metadata::MetadataValue::from_static("played-agent"),
    );
    if let Some(token) = token {
        metadata.insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    if let Some(identifiers) = identifiers {
        metadata.insert("agentidentifiers", identifiers.parse().unwrap());
    }
    client.connect(request).await.map(drop)
}

/// An AgentService client on 127.0.0.1:`port` over `tls` (which must offer h2).
pub async fn agent_client(port: u16, tls: Arc<rustls::ClientConfig>) -> AgentServiceClient<Channel> {
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let tls = tls.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
                let stream = tokio_rustls::TlsConnector::from(tls).connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    AgentServiceClient::new(channel)
}
