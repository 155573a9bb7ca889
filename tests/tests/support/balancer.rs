//! A TCP load balancer for tests: what stands in front of several
//! proxy-servers when agents know one address.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};

/// A TCP load balancer for the test: round robin over its backends, skipping
/// one that refuses, bytes copied both ways.
pub struct RoundRobin {
    pub addr: SocketAddr,
    backends: Arc<Mutex<Vec<SocketAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RoundRobin {
    pub async fn start(backends: Vec<SocketAddr>) -> RoundRobin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backends = Arc::new(Mutex::new(backends));
        let shared = backends.clone();
        let task = tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((mut client, _)) = listener.accept().await {
                let candidates = shared.lock().unwrap().clone();
                let start = next;
                next = next.wrapping_add(1);
                tokio::spawn(async move {
                    for i in 0..candidates.len() {
                        let backend = candidates[(start + i) % candidates.len()];
                        if let Ok(mut server) = TcpStream::connect(backend).await {
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
