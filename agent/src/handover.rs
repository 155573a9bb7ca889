//! The hand-over of a plain egress agent (`--egress-handover`, no node
//! role): its agent streams' sessions, with their connections, go to the
//! agent that replaces it on the same node, over `--handover-socket`, as a
//! node agent's go with its role (docs/handover.md, "Egress connections").
//! Only the sessions and the hand-over socket itself pass: such an agent
//! serves nothing else a successor could not open beside it.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use konnectivity_node::handover::{self, Handing, Predecessor, Role, Snapshot};
use konnectivity_node::metrics::NodeMetrics;
use konnectivity_node::sessions::{self, EgressHandover, HandedSession};
use tokio::sync::watch;

use crate::metrics::AgentMetrics;

/// How often a successor waiting for its own stream says so.
const WAITING_LOG_EVERY: Duration = Duration::from_secs(10);

/// The agent as the hand-over server sees it: the sessions, and the socket.
struct EgressRole {
    listener: socket2::Socket,
    egress: EgressHandover,
    handed_over: watch::Sender<bool>,
    /// What the last collection left here: not resumable, busy.
    kept: Mutex<(usize, usize)>,
    metrics: Arc<NodeMetrics>,
}

impl Handing for EgressRole {
    fn successor_waiting(&self, _waiting: bool) {}

    fn pause(&self) -> Result<Snapshot, String> {
        let listener = self
            .listener
            .as_fd()
            .try_clone_to_owned()
            .map_err(|error| format!("duplicating the hand-over socket: {error}"))?;
        Ok(Snapshot {
            sockets: vec![(Role::Handover, listener)],
            pods: Vec::new(),
            ruleset: String::new(),
        })
    }

    fn resume(&self) {}

    fn hand_over(&self) {
        self.handed_over.send_replace(true);
    }

    fn sessions(&self) -> Vec<HandedSession> {
        let collected = self.egress.handoff.collect(sessions::COLLECT_WAIT);
        *self.kept.lock().expect("kept lock") = (collected.not_resumable, collected.busy);
        collected.connections
    }

    fn sessions_sent(&self, sent: usize, of: usize) {
        let (not_resumable, busy) = *self.kept.lock().expect("kept lock");
        sessions::report_sent(&self.metrics, sent, of, not_resumable, busy);
    }
}

/// Takes over from the agent answering on `path`, once this agent holds a
/// stream of its own (it must carry new dials before the old one stops
/// taking them), or else binds `path` afresh; then answers a successor
/// there. `handed_over` turns true once one took the sessions. Runs until
/// then; an error leaves the agent running without a hand-over.
pub(crate) async fn run(
    path: PathBuf,
    egress: EgressHandover,
    metrics: Arc<AgentMetrics>,
    handed_over: watch::Sender<bool>,
) {
    let listener = match take_over(&path, &egress, &metrics).await {
        Ok(listener) => listener,
        Err(error) => {
            tracing::warn!(%error, socket = %path.display(), "no hand-over (--egress-handover)");
            return;
        }
    };
    let role = EgressRole {
        listener,
        egress,
        handed_over,
        kept: Mutex::new((0, 0)),
        metrics: metrics.node.clone(),
    };
    let _ = tokio::task::spawn_blocking(move || handover::serve(&role.listener, &role)).await;
}

/// The hand-over socket to serve: the predecessor's, with its sessions
/// taken over, or a fresh one when no agent answers.
async fn take_over(
    path: &std::path::Path,
    egress: &EgressHandover,
    metrics: &AgentMetrics,
) -> Result<socket2::Socket, handover::HandoverError> {
    let find = path.to_owned();
    let predecessor = tokio::task::spawn_blocking(move || Predecessor::find(&find))
        .await
        .expect("hand-over task does not panic")?;
    let Some(predecessor) = predecessor else {
        let bind = path.to_owned();
        return tokio::task::spawn_blocking(move || handover::bind(&bind))
            .await
            .expect("hand-over task does not panic");
    };
    tracing::info!(socket = %path.display(), "another agent runs: taking its sessions over once this one holds a stream");
    let mut waited = tokio::time::Instant::now();
    while metrics.open_server_connections.get() == 0 {
        if waited.elapsed() >= WAITING_LOG_EVERY {
            tracing::warn!(
                "not taking the previous agent's sessions over until this agent holds a proxy-server stream"
            );
            waited = tokio::time::Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut inheritance = tokio::task::spawn_blocking(move || predecessor.receive(false, true))
        .await
        .expect("hand-over task does not panic")?;
    let listener = inheritance.take(Role::Handover).pop().ok_or_else(|| {
        handover::HandoverError::Exchange("the previous agent handed over no hand-over socket".to_owned())
    })?;
    let inherited = match tokio::task::spawn_blocking(move || inheritance.confirm())
        .await
        .expect("hand-over task does not panic")
    {
        Ok(inherited) => inherited,
        Err((error, inherited)) => {
            tracing::warn!(%error, "the previous agent did not confirm the hand-over");
            inherited
        }
    };
    let count = inherited.sessions.len();
    for session in inherited.sessions {
        if let Err(unsent) = egress.inherited.send(session) {
            handover::reset_session(unsent.0);
        }
    }
    tracing::info!(sessions = count, "took the previous agent's sessions over");
    Ok(socket2::Socket::from(listener))
}
