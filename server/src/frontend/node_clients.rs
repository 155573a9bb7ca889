//! Which nodes hold node tunnels (the node frontend): a node's client
//! certificate names it (`system:node:NAME`, as kubelet's do;
//! [`crate::identity::certificate_node`]). Each stream is counted by whether
//! its certificate names a node, and the log (-v=2) says when a node's first
//! stream opens and its last one ends, so an operator can tell which nodes
//! reach the API server through this server; every tunnel's lines there
//! carry its node. (A metric label per node would
//! be one series per node, thousands in a large cluster: the log carries the
//! names, the metrics the counts.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use konnectivity_kube::node::NodeName;

use crate::metrics::ServerMetrics;

/// The nodes with node tunnel streams open, and how many each has.
pub(crate) struct NodeClients {
    open: Mutex<HashMap<NodeName, usize>>,
    metrics: Arc<ServerMetrics>,
}

/// One node tunnel stream of a node, for as long as the stream (and any
/// tunnel it carries) lives.
#[derive(Debug)]
pub struct NodeClient {
    pub(crate) name: NodeName,
    clients: Arc<NodeClients>,
}

impl std::fmt::Debug for NodeClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeClients").finish_non_exhaustive()
    }
}

impl NodeClients {
    pub(crate) fn new(metrics: Arc<ServerMetrics>) -> Arc<NodeClients> {
        Arc::new(NodeClients {
            open: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// A node tunnel stream opened; `node` is the node its certificate
    /// names, if any.
    pub(crate) fn opened(self: &Arc<Self>, node: Option<NodeName>) -> Option<Arc<NodeClient>> {
        let identity = if node.is_some() { "node" } else { "no_node" };
        self.metrics.node_stream_opened(identity);
        let name = node?;
        let mut open = self.open.lock().expect("node clients lock poisoned");
        let streams = open.entry(name.clone()).or_default();
        *streams += 1;
        if *streams == 1 {
            tracing::debug!(node = %name, "node connected: its first node tunnel stream opened");
        }
        self.metrics.set_node_frontend_nodes(open.len());
        Some(Arc::new(NodeClient {
            name,
            clients: self.clone(),
        }))
    }
}

impl Drop for NodeClient {
    fn drop(&mut self) {
        let mut open = self.clients.open.lock().expect("node clients lock poisoned");
        if let Some(streams) = open.get_mut(&self.name) {
            *streams -= 1;
            if *streams == 0 {
                open.remove(&self.name);
                tracing::debug!(node = %self.name, "node disconnected: its last node tunnel stream ended");
            }
        }
        self.clients.metrics.set_node_frontend_nodes(open.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_counts_while_any_of_its_streams_lives() {
        let metrics = Arc::new(ServerMetrics::default());
        let clients = NodeClients::new(metrics);
        let node = |name: &str| Some(NodeName(name.to_owned()));
        let a1 = clients.opened(node("a")).unwrap();
        let a2 = clients.opened(node("a")).unwrap();
        let b = clients.opened(node("b")).unwrap();
        assert!(clients.opened(None).is_none());
        let count = || clients.open.lock().unwrap().len();
        assert_eq!(count(), 2);
        drop(a1);
        assert_eq!(count(), 2, "node a still has a stream");
        drop(a2);
        drop(b);
        assert_eq!(count(), 0);
    }
}
