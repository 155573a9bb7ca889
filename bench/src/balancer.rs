//! The TCP load balancer in front of the servers in the cluster run with
//! `--leases` (`konnectivity-bench balancer`, a process of its own so that
//! its CPU is its own): agents that know one server address need one, and
//! count the servers by their Leases to learn how many distinct servers to
//! find through it, as upstream's HA set-up has it. Each connection goes to
//! a backend picked at random, as kube-proxy's iptables mode and a cloud
//! balancer's flow hash pick (round robin would hand agents that dial in
//! step the same server each time); a backend that refuses is skipped, as
//! a balancer's health check takes a dead server out; bytes are copied
//! both ways.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use rand::Rng;
use tokio::net::{TcpListener, TcpStream};

pub async fn serve(listen: SocketAddr, backends: Vec<SocketAddr>) -> anyhow::Result<()> {
    anyhow::ensure!(!backends.is_empty(), "--backends: at least one server address");
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("--listen={listen}"))?;
    let backends = Arc::new(backends);
    loop {
        let (client, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            // Out of descriptors, for one: the next accept may succeed.
            Err(error) => {
                eprintln!("accept: {error}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let first = rand::rng().random_range(0..backends.len());
        let backends = backends.clone();
        tokio::spawn(relay(client, backends, first));
    }
}

/// `client` to the first backend from `first` on (in a circle) that accepts.
async fn relay(mut client: TcpStream, backends: Arc<Vec<SocketAddr>>, first: usize) {
    // As balancers do: Nagle's algorithm in the middle would hold a TLS
    // handshake's small writes.
    let _ = client.set_nodelay(true);
    for k in 0..backends.len() {
        let backend = backends[(first + k) % backends.len()];
        if let Ok(mut server) = TcpStream::connect(backend).await {
            let _ = server.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            return;
        }
    }
}
