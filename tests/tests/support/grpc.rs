//! Raw gRPC to a server's agent port, for tests that play an agent
//! themselves to see exactly how the server answers.

use std::sync::Arc;

use konnectivity_proto::wire::agent_service_client::AgentServiceClient;
use tonic::transport::Channel;

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
