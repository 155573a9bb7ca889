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
//!
//! Each relayed connection holds two descriptors, and a process may hold
//! 20,000 here: 5,000 agents with a stream to each of two servers need
//! more. So several balancer processes listen on the one address
//! (`SO_REUSEPORT`), and the kernel spreads the connections over them.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use rand::Rng;
use tokio::net::{TcpListener, TcpStream};

pub async fn serve(listen: SocketAddr, backends: Vec<SocketAddr>) -> anyhow::Result<()> {
    anyhow::ensure!(!backends.is_empty(), "--backends: at least one server address");
    let listener = listen_shared(listen).with_context(|| format!("--listen={listen}"))?;
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

/// A listener on `addr` that other balancer processes share.
fn listen_shared(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(4096)
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
