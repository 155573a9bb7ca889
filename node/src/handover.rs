//! Handing the node role to the agent that replaces this one, without a gap
//! (docs/handover.md says why this way).
//!
//! The node agent listens on `--handover-socket` (a `SOCK_SEQPACKET` Unix
//! socket, so every message is one packet with its descriptors). A new agent
//! that finds an agent answering there says hello; the old one stops
//! changing pods and sends every listening socket it serves as a descriptor
//! (SCM_RIGHTS): the health and admin listeners, the capture listeners, the CNI socket,
//! each captured pod's listeners with the pod's namespace, and the hand-over
//! socket itself. Both processes then hold the same sockets. The new agent
//! starts accepting and says so (`taken`); only then does the old one stop
//! accepting, give up the ownership lock and say so (`released`), and the new
//! one takes the lock. No listener ever closes, so nothing queued on one is
//! lost, and at every moment some agent accepts.
//!
//! A successor that asks for them (`connections` in its hello) then gets
//! every established captured connection it can resume: each one's socket
//! with its state (`connection`, then the bytes the state counts, in raw
//! packets), before `released`. An agent of an earlier version ignores the
//! request and sends none: those connections drain with it, as before. A
//! successor that asks for `sessions` gets the egress sessions the same way
//! (`session`, then each of its connections as `endpoint`:
//! [`crate::sessions`]) before the captured connections.
//!
//! The ownership lock (`PATH.lock`, flock) is what makes an agent the owner
//! of the rules: only its holder may remove them, and an agent that starts
//! with no predecessor answering takes it before it touches anything.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use konnectivity_plumbing::sys::{recv_with_fds, send_with_fds};
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};

use crate::capture::handoff::{ConnectionState, HandedConnection};
use crate::pods::state::PodState;
use crate::sessions::{EndpointState, HandedEndpoint, HandedSession, SessionState};
use konnectivity_plumbing::net::reset;

/// The protocol's version; a predecessor that speaks another refuses.
const VERSION: u32 = 1;
/// How long either side waits for the other's next packet once the
/// exchange has begun; the hand-over itself takes milliseconds.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest packet (a pod's record is a few hundred bytes).
const MAX_PACKET: usize = 64 * 1024;
/// The largest raw packet of a connection's bytes.
const MAX_DATA_PACKET: usize = 60 * 1024;
/// How long an agent waits for the ownership lock.
const LOCK_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("hand-over socket {path}: {source}")]
    Socket { path: String, source: std::io::Error },
    #[error("hand-over with the previous agent: {0}")]
    Exchange(String),
    #[error(
        "{path} is held by another node agent, which does not answer on the hand-over socket; \
         two agents must not own the capture rules at once"
    )]
    Owned { path: String },
}

fn exchange(error: impl std::fmt::Display) -> HandoverError {
    HandoverError::Exchange(error.to_string())
}

/// What a listening socket is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Health,
    /// The admin listener (`--admin-server-port`), when one was bound.
    Admin,
    Capture,
    Cni,
    Handover,
}

/// One packet. The descriptors it carries are said in its text.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Packet {
    /// Successor: hand over, please; with `connections`, the established
    /// connections too (absent from an earlier version's hello).
    Hello {
        version: u32,
        #[serde(default)]
        connections: bool,
        /// The egress sessions too (absent from earlier versions' hellos).
        #[serde(default)]
        sessions: bool,
    },
    /// Predecessor: one listening socket (one descriptor).
    Socket { role: Role },
    /// Predecessor: a captured pod (descriptors: its namespace, then each
    /// of its listeners).
    Pod { state: PodState, listeners: usize },
    /// Predecessor: that was all; the rules it installed, for comparison.
    End { ruleset: String },
    /// Successor: I accept on all of it now.
    Taken,
    /// Predecessor, after `taken`: an established connection (one
    /// descriptor, its socket), followed by raw packets carrying the
    /// lengths of its `packets` unacknowledged packets (4 bytes each, little
    /// endian), then the bytes its state counts.
    Connection { state: ConnectionState, packets: usize },
    /// Predecessor, after `taken`: an egress session, followed by
    /// its `endpoints` connections.
    Session { state: SessionState, endpoints: usize },
    /// Predecessor: one connection of the session before (its socket as the
    /// descriptor, none when it is closing), followed by its packets'
    /// lengths and its bytes, as a `connection`'s.
    Endpoint { state: EndpointState, packets: usize },
    /// Predecessor: I stopped accepting and gave up the lock.
    Released,
    /// Either: no hand-over, and why.
    Refused { reason: String },
}

fn send(socket: &Socket, packet: &Packet, fds: &[OwnedFd]) -> std::io::Result<()> {
    let text = serde_json::to_vec(packet).expect("packets serialize");
    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    send_with_fds(socket.as_fd(), &text, &borrowed)
}

fn receive(socket: &Socket) -> Result<(Packet, Vec<OwnedFd>), HandoverError> {
    let mut buffer = vec![0u8; MAX_PACKET];
    let (length, fds) = recv_with_fds(socket.as_fd(), &mut buffer).map_err(exchange)?;
    if length == 0 {
        return Err(exchange("the other agent closed the connection"));
    }
    let packet = serde_json::from_slice(&buffer[..length]).map_err(exchange)?;
    Ok((packet, fds))
}

/// The lock that makes its holder the owner of the capture rules.
pub struct Ownership {
    _file: File,
}

impl Ownership {
    /// Takes the lock next to `socket`, waiting a while for a predecessor
    /// that is letting it go.
    pub fn take(socket: &Path) -> Result<Ownership, HandoverError> {
        Ownership::take_within(socket, LOCK_WAIT)
    }

    fn take_within(socket: &Path, wait: Duration) -> Result<Ownership, HandoverError> {
        let path = lock_path(socket);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| HandoverError::Socket {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| HandoverError::Socket {
                path: path.display().to_string(),
                source,
            })?;
        let deadline = Instant::now() + wait;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(Ownership { _file: file }),
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(HandoverError::Owned {
                        path: path.display().to_string(),
                    });
                }
                Err(std::fs::TryLockError::Error(source)) => {
                    return Err(HandoverError::Socket {
                        path: path.display().to_string(),
                        source,
                    });
                }
            }
        }
    }
}

fn lock_path(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Binds a fresh hand-over socket at `path` (the owner alone does, so a
/// file left there is stale).
pub fn bind(path: &Path) -> Result<Socket, HandoverError> {
    let error = |source| HandoverError::Socket {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(error)?;
    }
    let _ = std::fs::remove_file(path);
    let socket = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None).map_err(error)?;
    socket
        .bind(&SockAddr::unix(path).map_err(error)?)
        .map_err(error)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(error)?;
    socket.listen(8).map_err(error)?;
    Ok(socket)
}

/// The agent answering on the hand-over socket, found at start.
pub struct Predecessor {
    channel: Socket,
}

impl Predecessor {
    /// Connects to the agent listening at `path`; `None` when none is (no
    /// socket file, or a file no process listens on: the agent before was
    /// killed).
    pub fn find(path: &Path) -> Result<Option<Predecessor>, HandoverError> {
        let error = |source| HandoverError::Socket {
            path: path.display().to_string(),
            source,
        };
        let channel = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None).map_err(error)?;
        match channel.connect(&SockAddr::unix(path).map_err(error)?) {
            Ok(()) => Ok(Some(Predecessor { channel })),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(error(e)),
        }
    }

    /// Asks for everything (with `connections`, the established captured
    /// connections too; with `sessions`, the egress sessions) and receives
    /// it. The predecessor keeps serving until [`Inheritance::confirm`].
    pub fn receive(self, connections: bool, sessions: bool) -> Result<Inheritance, HandoverError> {
        let channel = self.channel;
        channel
            .set_read_timeout(Some(EXCHANGE_TIMEOUT))
            .map_err(exchange)?;
        let hello = Packet::Hello {
            version: VERSION,
            connections,
            sessions,
        };
        send(&channel, &hello, &[]).map_err(exchange)?;
        let mut inheritance = Inheritance {
            sockets: Vec::new(),
            pods: Vec::new(),
            ruleset: String::new(),
            channel,
        };
        loop {
            let (packet, mut fds) = receive(&inheritance.channel)?;
            match packet {
                Packet::Socket { role } if fds.len() == 1 => {
                    inheritance.sockets.push((role, fds.remove(0)));
                }
                Packet::Pod { state, listeners } if fds.len() == listeners + 1 => {
                    let netns = File::from(fds.remove(0));
                    inheritance.pods.push(InheritedPod {
                        state,
                        netns,
                        listeners: fds,
                    });
                }
                Packet::End { ruleset } => {
                    inheritance.ruleset = ruleset;
                    return Ok(inheritance);
                }
                Packet::Refused { reason } => return Err(exchange(format!("refused: {reason}"))),
                other => {
                    return Err(exchange(format!(
                        "unexpected {other:?} with {} descriptors",
                        fds.len()
                    )));
                }
            }
        }
    }
}

/// A captured pod as the predecessor held it.
pub struct InheritedPod {
    pub state: PodState,
    /// Its network namespace, held open.
    pub netns: File,
    pub listeners: Vec<OwnedFd>,
}

/// Everything the predecessor served.
pub struct Inheritance {
    pub sockets: Vec<(Role, OwnedFd)>,
    pub pods: Vec<InheritedPod>,
    /// The predecessor's host ruleset.
    pub ruleset: String,
    channel: Socket,
}

impl Inheritance {
    /// The sockets with `role`, taken out.
    pub fn take(&mut self, role: Role) -> Vec<OwnedFd> {
        let (taken, kept) = std::mem::take(&mut self.sockets)
            .into_iter()
            .partition(|(r, _)| *r == role);
        self.sockets = kept;
        taken.into_iter().map(|(_, fd)| fd).collect()
    }

    /// Says that this agent accepts on everything now, and waits until the
    /// predecessor has stopped and let the lock go; the established
    /// connections and egress sessions it handed over meanwhile. On an
    /// error, what was received so far is in it.
    pub fn confirm(self) -> Result<Inherited, (HandoverError, Inherited)> {
        let mut inherited = Inherited::default();
        if let Err(error) = send(&self.channel, &Packet::Taken, &[]) {
            return Err((exchange(error), inherited));
        }
        loop {
            let next = match receive(&self.channel) {
                Ok(next) => next,
                Err(error) => return Err((error, inherited)),
            };
            let received = match next {
                (Packet::Released, _) => return Ok(inherited),
                (Packet::Connection { mut state, packets }, mut fds) if fds.len() == 1 => {
                    let socket = fds.remove(0);
                    let received = receive_lengths(&self.channel, packets).and_then(|lengths| {
                        state.unacknowledged = lengths;
                        receive_raw(&self.channel, state.data_len())
                    });
                    match received {
                        Ok(data) => {
                            inherited.connections.push(HandedConnection {
                                state,
                                data: data.into(),
                                socket,
                            });
                            Ok(())
                        }
                        Err(error) => {
                            reset(socket);
                            Err(error)
                        }
                    }
                }
                (Packet::Session { state, endpoints }, fds) if fds.is_empty() => {
                    receive_session(&self.channel, state, endpoints)
                        .map(|session| inherited.sessions.push(session))
                }
                (other, fds) => Err(exchange(format!(
                    "expected a connection, a session or released, got {other:?} with {} descriptors",
                    fds.len()
                ))),
            };
            if let Err(error) = received {
                return Err((error, inherited));
            }
        }
    }
}

/// What the predecessor handed over beside its listeners.
#[derive(Debug, Default)]
pub struct Inherited {
    pub connections: Vec<HandedConnection>,
    pub sessions: Vec<HandedSession>,
}

/// Receives a session's `count` endpoints; on an error the sockets received
/// are reset (a session arrives whole or not at all).
fn receive_session(
    channel: &Socket,
    state: SessionState,
    count: usize,
) -> Result<HandedSession, HandoverError> {
    let mut session = HandedSession {
        state,
        endpoints: Vec::with_capacity(count.min(1024)),
    };
    for _ in 0..count {
        let endpoint = match receive(channel) {
            Ok((Packet::Endpoint { mut state, packets }, mut fds))
                if fds.len() == usize::from(!state.closing) =>
            {
                let socket = fds.pop();
                let data = receive_lengths(channel, packets).and_then(|lengths| {
                    state.unacknowledged = lengths;
                    receive_raw(channel, state.data_len())
                });
                match data {
                    Ok(data) => Ok(HandedEndpoint {
                        state,
                        data: data.into(),
                        socket,
                    }),
                    Err(error) => {
                        if let Some(socket) = socket {
                            reset(socket);
                        }
                        Err(error)
                    }
                }
            }
            Ok((other, fds)) => Err(exchange(format!(
                "expected a session's endpoint, got {other:?} with {} descriptors",
                fds.len()
            ))),
            Err(error) => Err(error),
        };
        match endpoint {
            Ok(endpoint) => session.endpoints.push(endpoint),
            Err(error) => {
                reset_session(session);
                return Err(error);
            }
        }
    }
    Ok(session)
}

/// Resets a session's sockets: it could not be handed over, and its
/// clients must see a failure, not a clean end.
pub fn reset_session(session: HandedSession) {
    for endpoint in session.endpoints {
        if let Some(socket) = endpoint.socket {
            reset(socket);
        }
    }
}

/// What the node role gives a successor, taken while it changes nothing.
pub struct Snapshot {
    pub sockets: Vec<(Role, OwnedFd)>,
    pub pods: Vec<(PodState, Vec<OwnedFd>)>,
    pub ruleset: String,
}

/// The node role as the hand-over server sees it.
pub trait Handing: Send + Sync {
    /// A successor connected and waits to take over (`true`), or went away
    /// without (`false`).
    fn successor_waiting(&self, waiting: bool);
    /// Stops changing pods and accepting pod requests; what it serves.
    fn pause(&self) -> Result<Snapshot, String>;
    /// The successor did not take over: carry on as before.
    fn resume(&self);
    /// The successor accepts on everything: stop accepting and give up the
    /// ownership lock.
    fn hand_over(&self);
    /// After [`Handing::hand_over`], for a successor that asked: the
    /// established connections to give it, each stopped for it.
    fn connections(&self) -> Vec<HandedConnection> {
        Vec::new()
    }
    /// Said once, after the connections went (or failed to: `sent` of them).
    fn connections_sent(&self, _sent: usize, _of: usize) {}
    /// After [`Handing::hand_over`] and before the connections, for a successor that asked: the egress
    /// sessions to give it, each stopped for it.
    fn sessions(&self) -> Vec<HandedSession> {
        Vec::new()
    }
    /// Said once, after the sessions went (or failed to: `sent` of them).
    fn sessions_sent(&self, _sent: usize, _of: usize) {}
}

/// Answers hand-over requests on `listener`, one at a time, until one
/// succeeds; runs on a thread of its own (the exchange is a few blocking
/// packets).
pub fn serve(listener: &Socket, role: &dyn Handing) {
    loop {
        let channel = match listener.accept() {
            Ok((channel, _)) => channel,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(error) => {
                tracing::warn!(%error, "hand-over socket accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        role.successor_waiting(true);
        let outcome = hand_over_on(&channel, role);
        role.successor_waiting(false);
        match outcome {
            Ok(()) => return,
            Err(error) => tracing::warn!(%error, "no hand-over; carrying on"),
        }
    }
}

fn hand_over_on(channel: &Socket, role: &dyn Handing) -> Result<(), HandoverError> {
    // A successor connects as soon as it starts, and says hello once its own
    // node tunnel answers (it must be able to serve what it takes): that
    // may take a while. It closes the connection if it dies meanwhile.
    channel.set_read_timeout(None).map_err(exchange)?;
    let hello = receive(channel)?;
    channel
        .set_read_timeout(Some(EXCHANGE_TIMEOUT))
        .map_err(exchange)?;
    channel
        .set_write_timeout(Some(EXCHANGE_TIMEOUT))
        .map_err(exchange)?;
    let (connections, sessions) = match hello {
        (
            Packet::Hello {
                version: VERSION,
                connections,
                sessions,
            },
            _,
        ) => (connections, sessions),
        (Packet::Hello { version, .. }, _) => {
            return Err(refuse(
                channel,
                format!("this agent speaks hand-over version {VERSION}, not {version}"),
            ));
        }
        (other, _) => return Err(exchange(format!("expected hello, got {other:?}"))),
    };
    let snapshot = role.pause().map_err(|reason| refuse(channel, reason))?;
    let sent = send_snapshot(channel, snapshot).and_then(|()| match receive(channel)? {
        (Packet::Taken, _) => Ok(()),
        (other, _) => Err(exchange(format!("expected taken, got {other:?}"))),
    });
    if let Err(error) = sent {
        role.resume();
        return Err(error);
    }
    role.hand_over();
    // The sessions first: each serves on a while after its DRAIN (for the
    // dials the server sent before it) before it stops, and the captured
    // connections, which stop at once, must not wait for that: the successor
    // resumes everything only once `released` comes.
    if sessions {
        let handed = role.sessions();
        let of = handed.len();
        let sent = send_sessions(channel, handed);
        role.sessions_sent(sent, of);
    }
    if connections {
        let handed = role.connections();
        let of = handed.len();
        let sent = send_connections(channel, handed);
        role.connections_sent(sent, of);
    }
    // Said once everything stopped and the lock is free; if the successor
    // is gone by now, it has the sockets and the lock is free all the same.
    let _ = send(channel, &Packet::Released, &[]);
    Ok(())
}

/// Sends each connection and its bytes; how many went. A connection that
/// could not go is reset: its client sees a failure, not a clean end that
/// would pass for the whole answer.
fn send_connections(channel: &Socket, connections: Vec<HandedConnection>) -> usize {
    let mut sent = 0;
    let mut failed = false;
    for connection in connections {
        if !failed {
            match send_connection(channel, &connection) {
                Ok(()) => {
                    sent += 1;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(%error, "handing established connections over failed; the rest are reset");
                    failed = true;
                }
            }
        }
        reset(connection.socket);
    }
    sent
}

/// Sends each session whole; how many went. The sessions that could not go
/// are reset.
fn send_sessions(channel: &Socket, sessions: Vec<HandedSession>) -> usize {
    let mut sent = 0;
    let mut failed = false;
    for session in sessions {
        if !failed {
            match send_session(channel, &session) {
                Ok(()) => {
                    sent += 1;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(%error, "handing egress sessions over failed; the rest are reset");
                    failed = true;
                }
            }
        }
        reset_session(session);
    }
    sent
}

fn send_session(channel: &Socket, session: &HandedSession) -> std::io::Result<()> {
    let packet = Packet::Session {
        state: session.state.clone(),
        endpoints: session.endpoints.len(),
    };
    send(channel, &packet, &[])?;
    for endpoint in &session.endpoints {
        let state = &endpoint.state;
        let packet = Packet::Endpoint {
            state: state.clone(),
            packets: state.unacknowledged.len(),
        };
        send(channel, &packet, endpoint.socket.as_slice())?;
        send_lengths(channel, &state.unacknowledged)?;
        send_raw(channel, &endpoint.data)?;
    }
    Ok(())
}

fn send_lengths(channel: &Socket, lengths: &[usize]) -> std::io::Result<()> {
    let raw: Vec<u8> = lengths
        .iter()
        .flat_map(|len| (*len as u32).to_le_bytes())
        .collect();
    send_raw(channel, &raw)
}

fn send_connection(channel: &Socket, connection: &HandedConnection) -> std::io::Result<()> {
    let state = &connection.state;
    let packet = Packet::Connection {
        state: state.clone(),
        packets: state.unacknowledged.len(),
    };
    send(channel, &packet, std::slice::from_ref(&connection.socket))?;
    send_lengths(channel, &state.unacknowledged)?;
    send_raw(channel, &connection.data)
}

/// `bytes` in raw packets of at most [`MAX_DATA_PACKET`].
fn send_raw(channel: &Socket, bytes: &[u8]) -> std::io::Result<()> {
    for piece in bytes.chunks(MAX_DATA_PACKET) {
        send_with_fds(channel.as_fd(), piece, &[])?;
    }
    Ok(())
}

/// Receives `len` bytes sent by [`send_raw`], into one buffer.
fn receive_raw(channel: &Socket, len: usize) -> Result<Vec<u8>, HandoverError> {
    let mut data = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        let end = len.min(filled + MAX_DATA_PACKET);
        let (length, fds) = recv_with_fds(channel.as_fd(), &mut data[filled..end]).map_err(exchange)?;
        if length == 0 || !fds.is_empty() {
            return Err(exchange(format!(
                "a connection's bytes: a packet of {length} with {} to come",
                len - filled
            )));
        }
        filled += length;
    }
    Ok(data)
}

/// Receives the lengths of `count` packets.
fn receive_lengths(channel: &Socket, count: usize) -> Result<Vec<usize>, HandoverError> {
    // At most a window of packets: each costs at least flow control's
    // per-packet cost.
    let most = (konnectivity_mux::flow::WINDOW / konnectivity_mux::flow::PACKET_COST) as usize;
    if count > most {
        return Err(exchange(format!(
            "a connection with {count} packets unacknowledged"
        )));
    }
    let raw = receive_raw(channel, 4 * count)?;
    Ok(raw
        .chunks_exact(4)
        .map(|length| u32::from_le_bytes(length.try_into().expect("four bytes")) as usize)
        .collect())
}

/// Tells the successor there is no hand-over, and why; the error to log.
fn refuse(channel: &Socket, reason: String) -> HandoverError {
    let _ = send(
        channel,
        &Packet::Refused {
            reason: reason.clone(),
        },
        &[],
    );
    exchange(reason)
}

fn send_snapshot(channel: &Socket, snapshot: Snapshot) -> Result<(), HandoverError> {
    for (role, fd) in snapshot.sockets {
        send(channel, &Packet::Socket { role }, &[fd]).map_err(exchange)?;
    }
    for (state, fds) in snapshot.pods {
        let listeners = fds.len() - 1;
        send(channel, &Packet::Pod { state, listeners }, &fds).map_err(exchange)?;
    }
    send(
        channel,
        &Packet::End {
            ruleset: snapshot.ruleset,
        },
        &[],
    )
    .map_err(exchange)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::Mutex;

    struct Dir(PathBuf);
    impl Dir {
        fn new(tag: &str) -> Dir {
            let dir = std::env::temp_dir().join(format!("konn-handover-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A role that serves one TCP listener and one established connection,
    /// and records what happened.
    struct Fake {
        listener: std::net::TcpListener,
        /// The established connection's client end, and this agent's.
        client: Mutex<Option<std::net::TcpStream>>,
        established: Mutex<Option<std::net::TcpStream>>,
        /// An egress session's endpoint socket.
        egress: Mutex<Option<std::net::TcpStream>>,
        events: Mutex<Vec<String>>,
    }

    fn established_state() -> ConnectionState {
        ConnectionState {
            connect_id: 9,
            token: "0123@server".to_owned(),
            acknowledged: 1_000,
            unacknowledged: vec![70_000, 1],
            unsent: 29_999,
            written: 2_000,
            close_requested: false,
        }
    }

    /// More than one raw packet's worth.
    fn established_bytes() -> Vec<u8> {
        (0..100_000u32).map(|i| (i % 251) as u8).collect()
    }

    impl Handing for Fake {
        fn successor_waiting(&self, _: bool) {}

        fn pause(&self) -> Result<Snapshot, String> {
            self.events.lock().unwrap().push("pause".to_owned());
            Ok(Snapshot {
                sockets: vec![(Role::Capture, self.listener.as_fd().try_clone_to_owned().unwrap())],
                pods: Vec::new(),
                ruleset: "rules".to_owned(),
            })
        }
        fn resume(&self) {
            self.events.lock().unwrap().push("resume".to_owned());
        }
        fn hand_over(&self) {
            self.events.lock().unwrap().push("hand_over".to_owned());
        }
        fn connections(&self) -> Vec<HandedConnection> {
            self.events.lock().unwrap().push("connections".to_owned());
            let Some(established) = self.established.lock().unwrap().take() else {
                return Vec::new();
            };
            let bytes = established_bytes();
            vec![HandedConnection {
                state: established_state(),
                data: bytes.into(),
                socket: established.into(),
            }]
        }
        fn connections_sent(&self, sent: usize, of: usize) {
            self.events.lock().unwrap().push(format!("sent {sent} of {of}"));
        }
        fn sessions(&self) -> Vec<HandedSession> {
            let socket = self.egress.lock().unwrap().take().map(OwnedFd::from);
            vec![HandedSession {
                state: session_state(),
                endpoints: vec![
                    HandedEndpoint {
                        state: endpoint_state(false),
                        data: bytes::Bytes::from_static(b"abcdef"),
                        socket,
                    },
                    HandedEndpoint {
                        state: endpoint_state(true),
                        data: bytes::Bytes::from_static(b"abcdef"),
                        socket: None,
                    },
                ],
            }]
        }
        fn sessions_sent(&self, sent: usize, of: usize) {
            self.events
                .lock()
                .unwrap()
                .push(format!("sessions {sent} of {of}"));
        }
    }

    fn session_state() -> SessionState {
        SessionState {
            server_id: "server-1".to_owned(),
            token: "0123@server-1".to_owned(),
            agent_id: "node-1".to_owned(),
            address: None,
            next_connect_id: 12,
        }
    }

    fn endpoint_state(closing: bool) -> EndpointState {
        EndpointState {
            connect_id: if closing { 4 } else { 5 },
            acknowledged: 7,
            unacknowledged: vec![1, 2],
            unsent: 1,
            written: 9,
            in_hand: 4,
            in_hand_rest: 2,
            closing,
            error: closing.then(|| "connection reset by peer".to_owned()),
        }
    }

    fn fake() -> Fake {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (established, _) = listener.accept().unwrap();
        let _egress_peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (egress, _) = listener.accept().unwrap();
        Fake {
            listener,
            client: Mutex::new(Some(client)),
            established: Mutex::new(Some(established)),
            egress: Mutex::new(Some(egress)),
            events: Mutex::new(Vec::new()),
        }
    }

    #[test]
    fn a_connection_queued_before_the_hand_over_is_accepted_by_the_successor() {
        let dir = Dir::new("queued");
        let path = dir.0.join("handover.sock");
        let listener = bind(&path).unwrap();
        let old = std::sync::Arc::new(fake());
        // A client whose connection waits in the listener's queue: nobody
        // accepted it before the hand-over.
        let mut client = std::net::TcpStream::connect(old.listener.local_addr().unwrap()).unwrap();
        client.write_all(b"queued").unwrap();
        let serving = old.clone();
        let server = std::thread::spawn(move || serve(&listener, &*serving));

        let mut inheritance = Predecessor::find(&path)
            .unwrap()
            .expect("an agent answers")
            .receive(true, true)
            .unwrap();
        assert_eq!(inheritance.ruleset, "rules");
        let capture = inheritance.take(Role::Capture);
        assert_eq!(capture.len(), 1);
        let inherited = inheritance.confirm().unwrap();
        let connections = inherited.connections;
        server.join().unwrap();
        assert_eq!(
            *old.events.lock().unwrap(),
            [
                "pause",
                "hand_over",
                "sessions 1 of 1",
                "connections",
                "sent 1 of 1"
            ]
        );
        // The egress session came whole: its state, each endpoint's state
        // and bytes, a socket for the open one and none for the closing one.
        let [session] = <[HandedSession; 1]>::try_from(inherited.sessions).unwrap();
        assert_eq!(session.state, session_state());
        assert_eq!(session.endpoints.len(), 2);
        for endpoint in &session.endpoints {
            assert_eq!(endpoint.state, endpoint_state(endpoint.state.closing));
            assert_eq!(endpoint.data, "abcdef");
            assert_eq!(endpoint.socket.is_some(), !endpoint.state.closing);
        }
        // The established connection came with its state and every byte, in
        // the packets its state says.
        let [connection] = <[HandedConnection; 1]>::try_from(connections).unwrap();
        assert_eq!(connection.state, established_state());
        let (packets, unsent) = connection.packets().unwrap();
        assert_eq!(packets.len(), 2);
        assert_eq!(packets[0][..], established_bytes()[..70_000]);
        assert_eq!(packets[1][..], established_bytes()[70_000..70_001]);
        assert_eq!(unsent.unwrap()[..], established_bytes()[70_001..]);
        // Its socket is the client's connection.
        let mut socket = std::net::TcpStream::from(connection.socket);
        socket.write_all(b"from the successor").unwrap();
        let mut text = [0u8; 18];
        old.client
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .read_exact(&mut text)
            .unwrap();
        assert_eq!(&text, b"from the successor");
        // The old process closes its copy; the socket lives on in ours.
        drop(old);
        let taken = std::net::TcpListener::from(capture.into_iter().next().unwrap());
        let (mut accepted, _) = taken.accept().unwrap();
        let mut text = [0u8; 6];
        accepted.read_exact(&mut text).unwrap();
        assert_eq!(&text, b"queued");
    }

    #[test]
    fn a_successor_that_goes_away_before_taking_over_leaves_the_predecessor_serving() {
        let dir = Dir::new("gone");
        let path = dir.0.join("handover.sock");
        let listener = bind(&path).unwrap();
        let old = std::sync::Arc::new(fake());
        let serving = old.clone();
        let server = std::thread::spawn(move || serve(&listener, &*serving));
        // Receives everything, then dies without saying `taken`.
        let inheritance = Predecessor::find(&path)
            .unwrap()
            .unwrap()
            .receive(true, false)
            .unwrap();
        drop(inheritance);
        let deadline = Instant::now() + Duration::from_secs(5);
        while old.events.lock().unwrap().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(*old.events.lock().unwrap(), ["pause", "resume"]);
        // And a later successor is served; one that does not ask for the
        // established connections (an earlier version) gets none, and they
        // stay with this agent.
        let mut inheritance = Predecessor::find(&path)
            .unwrap()
            .unwrap()
            .receive(false, false)
            .unwrap();
        assert_eq!(inheritance.take(Role::Capture).len(), 1);
        assert!(inheritance.confirm().unwrap().connections.is_empty());
        server.join().unwrap();
        assert_eq!(
            *old.events.lock().unwrap(),
            ["pause", "resume", "pause", "hand_over"]
        );
    }

    /// The previous version's packets, as it parses them: a rollout from it
    /// starts with its agent reading this version's hello.
    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum PreviousPacket {
        Hello { version: u32 },
    }

    /// An agent of the previous version reads this version's hello (it
    /// ignores the request for connections and hands over as before), and
    /// this version reads the previous one's (no connections asked).
    #[test]
    fn hellos_are_read_across_the_previous_version() {
        let ours = serde_json::to_vec(&Packet::Hello {
            version: VERSION,
            connections: true,
            sessions: true,
        })
        .unwrap();
        let PreviousPacket::Hello { version } = serde_json::from_slice(&ours).unwrap();
        assert_eq!(version, VERSION);
        let previous = br#"{"hello":{"version":1}}"#;
        assert!(matches!(
            serde_json::from_slice::<Packet>(previous).unwrap(),
            Packet::Hello {
                version: 1,
                connections: false,
                sessions: false,
            }
        ));
    }

    #[test]
    fn no_predecessor_answers_on_a_missing_or_stale_socket() {
        let dir = Dir::new("stale");
        let path = dir.0.join("handover.sock");
        assert!(Predecessor::find(&path).unwrap().is_none());
        // A socket file left by a killed agent: nobody listens on it.
        drop(bind(&path).unwrap());
        assert!(path.exists());
        assert!(Predecessor::find(&path).unwrap().is_none());
    }

    #[test]
    fn one_owner_at_a_time() {
        let dir = Dir::new("owner");
        let path = dir.0.join("handover.sock");
        let first = Ownership::take_within(&path, Duration::ZERO).unwrap();
        assert!(matches!(
            Ownership::take_within(&path, Duration::from_millis(100)),
            Err(HandoverError::Owned { .. })
        ));
        drop(first);
        Ownership::take_within(&path, Duration::ZERO).unwrap();
    }
}
