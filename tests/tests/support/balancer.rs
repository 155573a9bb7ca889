//! A TCP load balancer for tests: what stands in front of several
//! proxy-servers when agents know one address.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};

/// A TCP load balancer for the test: round robin over its backends, skipping
/// one that refuses, bytes copied both ways.
pub struct RoundRobin {
    pub addr: SocketAddr,
    backends: Arc<Mutex<Vec<SocketAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Where the balancer's connections to its backends are made.
#[derive(Clone)]
enum Side {
    /// This process's namespace.
    Here,
    /// The network namespace pinned at this path.
    In(PathBuf),
}

impl Side {
    async fn connect(&self, backend: SocketAddr) -> std::io::Result<TcpStream> {
        match self {
            Side::Here => TcpStream::connect(backend).await,
            Side::In(netns) => super::netns::connect_tcp_in(netns.clone(), &backend.to_string()),
        }
    }
}

impl RoundRobin {
    /// On a loopback port of this process's namespace.
    pub async fn start(backends: Vec<SocketAddr>) -> RoundRobin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        RoundRobin::serve(listener, backends, Side::Here)
    }

    /// On `addr` inside the test's namespace `netns`, its backends there.
    pub fn start_in(netns: &super::netns::Netns, addr: &str, backends: Vec<SocketAddr>) -> RoundRobin {
        let listener = TcpListener::from_std(netns.bind_tcp(addr)).unwrap();
        RoundRobin::serve(listener, backends, Side::In(netns.path()))
    }

    fn serve(listener: TcpListener, backends: Vec<SocketAddr>, side: Side) -> RoundRobin {
        let addr = listener.local_addr().unwrap();
        let backends = Arc::new(Mutex::new(backends));
        let shared = backends.clone();
        let task = tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((mut client, _)) = listener.accept().await {
                let candidates = shared.lock().unwrap().clone();
                let start = next;
                next = next.wrapping_add(1);
                let side = side.clone();
                // As load balancers do: Nagle's algorithm in the middle
                // would hold small writes (a TLS handshake's) for 40 ms.
                let _ = client.set_nodelay(true);
                tokio::spawn(async move {
                    for i in 0..candidates.len() {
                        let backend = candidates[(start + i) % candidates.len()];
                        if let Ok(mut server) = side.connect(backend).await {
                            let _ = server.set_nodelay(true);
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            return;
                        }
                    }
                });
            }
        });
        RoundRobin { addr, backends, task }
    }

    pub fn add(&self, backend: SocketAddr) {
        self.backends.lock().unwrap().push(backend);
    }
}

impl Drop for RoundRobin {
    fn drop(&mut self) {
        self.task.abort();
    }
}
