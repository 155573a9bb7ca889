//! Streams whose connections outlive them (docs/resume.md): the token each
//! resumable stream is given, and the check a new stream passes to take over
//! a lost one's session. Agent streams and node tunnels' `Proxy` streams
//! (`crate::frontend::resume`) share it; `A` is what a resuming stream hands
//! the session it resumes.
//!
//! A token names the session and carries a random secret; the server also
//! keeps who the stream's agent proved to be (its id, and its token's user
//! or its certificate's names). A new stream resumes a session only with
//! the right secret, from the same identity, on this server; anything else
//! is refused with a status saying why, and changes nothing.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_util::Stream;
use konnectivity_mux::mailbox::{self, mailbox};
use konnectivity_mux::outbound::Writer;
use konnectivity_proto::Packet;
use rand::RngCore;
use tokio::sync::oneshot;
use tonic::Status;

/// What an agent stream's packets arrive as.
pub type Inbound = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// A new stream for a session that lost its own: the session answers with
/// the writer that feeds the stream's response.
pub struct Attachment {
    pub inbound: Inbound,
    pub writer: oneshot::Sender<Writer>,
}

impl Attachment {
    /// The service that accepted the stream gave up on it before the
    /// session took it (the agent reset the stream: its own attempt timed
    /// out): taking it would only leave the stream the session has now.
    pub fn abandoned(&self) -> bool {
        self.writer.is_closed()
    }
}

/// A resumable stream's response: the packets its writer sends. A writer
/// superseded by a newer stream of its session ends the response with
/// ABORTED: its peer may still be reading it (the newer stream was an
/// attempt the peer gave up on), and must learn to resume again rather than
/// wait on a silent stream.
pub struct ResponsePackets {
    writer: Option<Writer>,
}

impl ResponsePackets {
    pub fn new(writer: Writer) -> ResponsePackets {
        ResponsePackets {
            writer: Some(writer.ending_when_superseded()),
        }
    }
}

impl Stream for ResponsePackets {
    type Item = Result<Packet, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(writer) = self.writer.as_mut() else {
            return Poll::Ready(None);
        };
        if let Some(packet) = ready!(Pin::new(&mut *writer).poll_next(cx)) {
            return Poll::Ready(Some(Ok(packet)));
        }
        let superseded = writer.is_superseded();
        self.writer = None;
        Poll::Ready(superseded.then(|| {
            Err(Status::aborted(
                "superseded: a newer stream resumed this stream's connections; resume again",
            ))
        }))
    }
}

/// What reaches a resumable session from the service that accepted a new
/// stream.
///
/// Eight bytes, the stream that resumes boxed: a session's mailbox holds
/// one only while it is on its way (every node-frontend stream has a
/// session, and a resume is rare).
pub enum Takeover<A = Attachment> {
    /// A stream that resumes it.
    Resume(Box<A>),
    /// The same agent opened a new stream without this session's token: the
    /// process that held it is gone (a restart), and with it the other end
    /// of every connection, so a session waiting for a resume ends now.
    Restarted,
}

/// Who an agent stream's peer proved to be.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerIdentity {
    pub agent_id: String,
    /// Its ServiceAccount token's user, or its client certificate's names.
    pub proof: String,
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "agent {:?} ({})", self.agent_id, self.proof)
    }
}

struct Resumable<A> {
    secret: [u8; 16],
    identity: PeerIdentity,
    /// The agent process's id (`konnectivity-rs-agent-instance`), if sent.
    instance: Option<String>,
    attach: mailbox::Sender<Takeover<A>>,
}

/// The server's resumable sessions, by session id.
pub struct Resumption<A = Attachment> {
    /// `--agent-resume-timeout`: how long a lost stream's connections wait.
    pub timeout: Duration,
    server_id: String,
    sessions: Mutex<HashMap<u64, Resumable<A>>>,
    /// Each peer's last process id: only a change of it makes
    /// [`Resumption::restarted`] look through every session (a node opens a
    /// stream per connection; looking through 50,000 sessions each time
    /// would cost more than the connection).
    instances: Mutex<HashMap<PeerIdentity, String>>,
}

/// How many peers' process ids are remembered; past it the memory starts
/// again (costing one look through the sessions per peer).
const REMEMBERED_INSTANCES: usize = 100_000;

/// A session's registration: its token, and the streams that resume it.
/// Dropping it (the session ended) makes the token unknown.
pub struct Ticket<A = Attachment> {
    pub token: String,
    pub attachments: mailbox::Receiver<Takeover<A>>,
    id: u64,
    resumption: Arc<Resumption<A>>,
}

impl<A> Drop for Ticket<A> {
    fn drop(&mut self) {
        self.resumption.sessions().remove(&self.id);
    }
}

impl<A> Resumption<A> {
    pub fn new(timeout: Duration, server_id: &str) -> Arc<Resumption<A>> {
        Arc::new(Resumption {
            timeout,
            server_id: server_id.to_owned(),
            sessions: Mutex::new(HashMap::new()),
            instances: Mutex::new(HashMap::new()),
        })
    }

    /// The server id its tokens name (`--server-id`).
    pub fn server_id(&self) -> &str {
        &self.server_id
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Resumable<A>>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a new resumable session of `identity`.
    pub fn issue(self: &Arc<Self>, identity: PeerIdentity, instance: Option<String>) -> Ticket<A> {
        let mut rng = rand::rng();
        let mut secret = [0u8; 16];
        rng.fill_bytes(&mut secret);
        let (attach, attachments) = mailbox();
        let mut sessions = self.sessions();
        let id = loop {
            let id = rng.next_u64();
            if !sessions.contains_key(&id) {
                break id;
            }
        };
        sessions.insert(
            id,
            Resumable {
                secret,
                identity,
                instance,
                attach,
            },
        );
        Ticket {
            token: format!("{id:016x}{}@{}", hex(&secret), self.server_id),
            attachments,
            id,
            resumption: self.clone(),
        }
    }

    /// The session a new stream asks to resume, from the tokens it offers
    /// (one per server it lost a stream to): `None` when none is this
    /// server's (the stream is a new one), an error naming why when this
    /// server's token does not resume anything for `identity`.
    pub fn find(
        &self,
        offered: &[&str],
        identity: &PeerIdentity,
    ) -> Result<Option<mailbox::Sender<Takeover<A>>>, Status> {
        let Some(token) = offered.iter().find_map(|offered| {
            let (token, server_id) = offered.split_once('@')?;
            (server_id == self.server_id).then_some(token)
        }) else {
            return Ok(None);
        };
        let parsed = (token.len() == 48)
            .then(|| {
                let id = u64::from_str_radix(&token[..16], 16).ok()?;
                let secret = unhex(&token[16..])?;
                Some((id, secret))
            })
            .flatten();
        let Some((id, secret)) = parsed else {
            return Err(Status::invalid_argument(format!(
                "resume refused: the token offered to server {} is malformed",
                self.server_id
            )));
        };
        let sessions = self.sessions();
        let Some(session) = sessions.get(&id) else {
            return Err(Status::not_found(format!(
                "resume refused: server {} has no session {id:016x} (its --agent-resume-timeout ran out, or the \
                 server restarted)",
                self.server_id
            )));
        };
        // Compared in full whatever differs, so the time taken tells nothing.
        let matches = session
            .secret
            .iter()
            .zip(secret.iter())
            .fold(0u8, |differ, (a, b)| differ | (a ^ b))
            == 0;
        if !matches {
            return Err(Status::permission_denied(format!(
                "resume refused: wrong secret for session {id:016x}"
            )));
        }
        if session.identity != *identity {
            return Err(Status::permission_denied(format!(
                "resume refused: session {id:016x} belongs to {}, not to {identity}",
                session.identity
            )));
        }
        Ok(Some(session.attach.clone()))
    }

    /// `identity` opened a stream that resumes nothing here, from process
    /// `instance`: its sessions held by another process wait for a resume
    /// that will not come (see [`Takeover::Restarted`]).
    pub fn restarted(&self, identity: &PeerIdentity, instance: Option<&str>) {
        if let Some(instance) = instance {
            let mut instances = self.instances.lock().unwrap_or_else(PoisonError::into_inner);
            if instances.get(identity).is_some_and(|last| last == instance) {
                return;
            }
            if instances.len() >= REMEMBERED_INSTANCES {
                instances.clear();
            }
            instances.insert(identity.clone(), instance.to_owned());
        }
        for session in self.sessions().values() {
            if session.identity == *identity && session.instance.as_deref() != instance {
                let _ = session.attach.send(Takeover::Restarted);
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 16]> {
    let mut secret = [0u8; 16];
    for (i, byte) in secret.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every session had a channel holding a block of 32 of these from the
    /// start (1.06 KiB per node-frontend stream when the stream itself was
    /// in it, heaptrack at 1,000 nodes and 10,000 watches); its mailbox
    /// holds them only on their way, and still: keep it a pointer.
    #[test]
    fn a_takeover_is_a_pointer() {
        // Whatever the stream (the node frontend's is `ClientAttachment`).
        assert_eq!(std::mem::size_of::<Takeover>(), 8);
        assert_eq!(std::mem::size_of::<Takeover<[u8; 256]>>(), 8);
    }

    fn identity(agent_id: &str, proof: &str) -> PeerIdentity {
        PeerIdentity {
            agent_id: agent_id.to_owned(),
            proof: proof.to_owned(),
        }
    }

    /// Only this server's token, with its secret, from the same identity,
    /// finds the session; every other offer says why it was refused, and
    /// a session that ended is unknown.
    #[test]
    fn a_token_resumes_only_its_session_for_its_identity() {
        let resumption: Arc<Resumption> = Resumption::new(Duration::from_secs(60), "server-a");
        let agent = identity(
            "agent-1",
            "user system:serviceaccount:kube-system:konnectivity-agent",
        );
        let ticket = resumption.issue(agent.clone(), Some("instance-1".to_owned()));
        assert!(ticket.token.ends_with("@server-a"));
        let token = ticket.token.as_str();

        assert!(resumption.find(&[token], &agent).unwrap().is_some());
        // Another server's tokens alongside are passed over.
        assert!(
            resumption
                .find(&["00@server-b", token], &agent)
                .unwrap()
                .is_some()
        );
        // Only another server's: a new stream.
        assert!(resumption.find(&["00@server-b"], &agent).unwrap().is_none());
        assert!(resumption.find(&[], &agent).unwrap().is_none());

        let other = identity("agent-1", "user system:serviceaccount:default:intruder");
        let refused = resumption.find(&[token], &other).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused.message().contains("belongs to agent \"agent-1\""),
            "{}",
            refused.message()
        );

        let (secret_start, wrong) = (token.len() - "@server-a".len() - 1, "0");
        let mut forged = token.to_owned();
        let flipped = if &forged[secret_start..=secret_start] == wrong {
            "1"
        } else {
            wrong
        };
        forged.replace_range(secret_start..=secret_start, flipped);
        let refused = resumption.find(&[&forged], &agent).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("wrong secret"));

        let refused = resumption.find(&["zz@server-a"], &agent).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);

        let kept = token.to_owned();
        drop(ticket);
        let refused = resumption.find(&[&kept], &agent).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::NotFound);
        assert!(refused.message().contains("--agent-resume-timeout"));
    }

    /// A new stream from another process of the same peer tells that peer's
    /// sessions held for other processes; the same process's next streams,
    /// and other peers' processes, tell nothing.
    #[test]
    fn only_a_new_process_of_the_same_peer_ends_its_lost_sessions() {
        let resumption: Arc<Resumption> = Resumption::new(Duration::from_secs(60), "server-a");
        let node = identity("node tunnel", "node node-1");
        let restarted = |ticket: &mut Ticket| {
            let mut context = std::task::Context::from_waker(std::task::Waker::noop());
            matches!(
                ticket.attachments.poll_recv(&mut context),
                std::task::Poll::Ready(Some(Takeover::Restarted))
            )
        };
        resumption.restarted(&node, Some("first"));
        let mut first = resumption.issue(node.clone(), Some("first".to_owned()));
        resumption.restarted(&node, Some("first"));
        assert!(!restarted(&mut first), "the same process");
        resumption.restarted(&identity("node tunnel", "node node-2"), Some("other"));
        assert!(!restarted(&mut first), "another node");
        resumption.restarted(&node, Some("second"));
        assert!(restarted(&mut first), "the node's next process");
        // The second process's own next streams tell nothing.
        let mut second = resumption.issue(node.clone(), Some("second".to_owned()));
        resumption.restarted(&node, Some("second"));
        assert!(!restarted(&mut second));
    }
}
