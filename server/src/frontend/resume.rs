//! Node tunnels whose connections outlive the `Proxy` stream under them
//! (docs/resume.md, "Node tunnels").
//!
//! A node agent carries each captured connection on a `Proxy` stream of its
//! node tunnel. When it asks (`konnectivity-rs-resume: 1` on the dial), the
//! stream gets a token, both sides number their DATA and acknowledge what
//! they wrote out, and a stream lost without a clean close keeps its
//! connection to the agent for `--agent-resume-timeout`: a new `Proxy`
//! stream that offers the token, from the same client certificate, takes it
//! over, and each side sends again what the other lacks. kube-apiserver's
//! streams never ask, and are served exactly as upstream serves them.

use std::pin::Pin;
use std::time::{Duration, Instant};

use futures_util::Stream;
use konnectivity_mux::Extensions;
use konnectivity_mux::flow::{ReceiveCredit, ReceiveGate, SendWindow, receive_window};
use konnectivity_mux::outbound::{Outbound, Writer};
use konnectivity_mux::replay::{Arrival, OffsetError, arrival};
use konnectivity_proto::{ConnectId, Frame, Packet};
use konnectivity_telemetry::metrics::Resumes;
use tokio::sync::oneshot;
use tonic::Status;

use crate::backend::resume::{ResponsePackets, Takeover, Ticket};

/// What a client sends on its `Proxy` stream.
pub(crate) type ClientPackets = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send + Sync>>;

/// What a `Proxy` stream's response carries.
pub type ResponseBody = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

/// A new `Proxy` stream that resumes a lost one.
pub struct ClientAttachment {
    pub(crate) inbound: ClientPackets,
    /// Bytes the client has received (and written out) so far.
    pub(crate) received: u64,
    pub(crate) answer: oneshot::Sender<ResumeAnswer>,
}

/// The writer that feeds a resuming stream's response, and the bytes this
/// side has received; or why the resume was refused.
pub(crate) type ResumeAnswer = Result<(Writer, u64), Status>;

/// What a resumable `Proxy` stream keeps beside the plain one's state.
pub(crate) struct StreamResume {
    pub ticket: Ticket<ClientAttachment>,
    pub timeout: Duration,
    /// Towards the client: numbered, kept until the client wrote it out.
    pub window: SendWindow,
    /// From the client: what was received, and the acknowledgements.
    pub gate: ReceiveGate,
    pub credit: ReceiveCredit,
    pub queue: Outbound,
    pub metrics: Resumes,
}

impl StreamResume {
    pub fn new(
        ticket: Ticket<ClientAttachment>,
        timeout: Duration,
        queue: Outbound,
        metrics: Resumes,
    ) -> Self {
        let (gate, credit) = receive_window(Extensions::Resume);
        StreamResume {
            ticket,
            timeout,
            window: SendWindow::new(Extensions::Resume),
            gate,
            credit,
            queue,
            metrics,
        }
    }

    /// Waits, up to the resume timeout, for a stream that resumes this one;
    /// returns its packets once it is attached. A resume this stream cannot
    /// honour is refused with the reason and changes nothing.
    pub async fn wait_for_resume(&mut self, connect_id: ConnectId) -> Option<ClientPackets> {
        self.queue.detach();
        let lost_at = Instant::now();
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let takeover = tokio::time::timeout_at(deadline, self.ticket.attachments.recv()).await;
            match takeover {
                Ok(Some(Takeover::Resume(attachment))) => {
                    if let Some(packets) = self.attach(connect_id, *attachment) {
                        self.metrics.duration.observe(lost_at.elapsed().as_secs_f64());
                        return Some(packets);
                    }
                }
                Ok(Some(Takeover::Restarted)) => {
                    self.metrics.dropped.inc();
                    tracing::info!(
                        connect_id = connect_id.get(),
                        "the node agent process that held this node tunnel stream is gone (the node's next stream \
                         came from another process); closing its connection"
                    );
                    return None;
                }
                Ok(None) => return None,
                Err(_) => {
                    self.metrics.timed_out.inc();
                    tracing::info!(
                        connect_id = connect_id.get(),
                        timeout = ?self.timeout,
                        "node tunnel stream not resumed within --agent-resume-timeout; closing its connection"
                    );
                    return None;
                }
            }
        }
    }

    /// Admits DATA from the client: numbered, continuing what was received,
    /// within its window.
    pub fn admit(&self, offset: Option<u64>, len: usize) -> Result<Arrival, String> {
        let offset = offset.ok_or_else(|| "DATA without an offset on a resumable stream".to_owned())?;
        let arrival = arrival(self.gate.written(), offset, len).map_err(|gap| gap.to_string())?;
        if arrival == Arrival::Next {
            self.gate
                .admit_negotiated(len)
                .map_err(|refused| refused.to_string())?;
        }
        Ok(arrival)
    }

    /// Attaches a resuming stream: checks the client's position, puts what
    /// it lacks ahead of everything queued, and answers it.
    pub fn attach(&mut self, connect_id: ConnectId, attachment: ClientAttachment) -> Option<ClientPackets> {
        // Checked first, as it changes nothing: taken, it would supersede
        // the stream the node is on for one nobody reads.
        if attachment.answer.is_closed() {
            tracing::debug!(
                connect_id = connect_id.get(),
                "a resume attempt went away before it was served (the node gave up on it); ignored"
            );
            return None;
        }
        let resend = self
            .window
            .grant(0, Some(attachment.received))
            .and_then(|()| self.window.resend_since(connect_id, attachment.received));
        let resend = match resend {
            Ok(resend) => resend,
            Err(error) => {
                let refused =
                    Status::out_of_range(format!("resume refused for connectID {connect_id}: {error}"));
                match error {
                    // The node's count only grows, and it acknowledged more
                    // since: an attempt it gave up on, overtaken by a later
                    // one. Refusing it is all there is to do.
                    OffsetError::BeforeAcknowledged { .. } => tracing::debug!(
                        connect_id = connect_id.get(),
                        %error,
                        "an abandoned resume attempt refused"
                    ),
                    _ => {
                        tracing::warn!(connect_id = connect_id.get(), %error, "node tunnel stream's resume refused")
                    }
                }
                let _ = attachment.answer.send(Err(refused));
                return None;
            }
        };
        let (writer, ahead) = self.queue.attach_resuming();
        let resent: usize = resend
            .iter()
            .map(|frame| match frame {
                Frame::Data { data, .. } => data.len(),
                _ => 0,
            })
            .sum();
        for frame in resend {
            ahead.send(frame);
        }
        ahead.open();
        if attachment.answer.send(Ok((writer, self.gate.written()))).is_err() {
            // The resuming request went away meanwhile: wait for the next.
            self.queue.detach();
            return None;
        }
        self.metrics.resumed.inc();
        self.metrics.resent_bytes.inc_by(resent as u64);
        tracing::info!(
            connect_id = connect_id.get(),
            resent,
            "node tunnel stream resumed"
        );
        Some(attachment.inbound)
    }
}

/// The response body of a resumable stream: what its writer sends.
pub(crate) fn response_body(writer: Writer) -> ResponseBody {
    Box::pin(ResponsePackets::new(writer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::resume::{PeerIdentity, Resumption};
    use futures_util::StreamExt;
    use konnectivity_mux::outbound::outbound;

    fn attempt(received: u64) -> (ClientAttachment, oneshot::Receiver<ResumeAnswer>) {
        let (answer, answered) = oneshot::channel();
        let attachment = ClientAttachment {
            inbound: Box::pin(futures_util::stream::empty()),
            received,
            answer,
        };
        (attachment, answered)
    }

    /// A resume attempt whose request went away before the session served
    /// it (the node reset it when its own bound ran out) changes nothing:
    /// the stream attached now keeps its writer. Taken, it superseded the
    /// stream the node was on for one nobody reads.
    #[tokio::test]
    async fn an_attempt_gone_before_it_is_served_leaves_the_attached_stream_alone() {
        let resumption = Resumption::<ClientAttachment>::new(Duration::from_secs(60), "server-a");
        let identity = PeerIdentity {
            agent_id: "node-1".to_owned(),
            proof: "CN=node-1".to_owned(),
        };
        let ticket = resumption.issue(identity, None);
        let queue = outbound(8);
        let mut live = queue.attach().ending_when_superseded();
        let mut resume =
            StreamResume::new(ticket, Duration::from_secs(60), queue.clone(), Resumes::default());
        let connect_id = ConnectId::new(7).unwrap();
        let close = || -> Packet { Frame::CloseRequest { connect_id }.into() };

        let (gone, answered) = attempt(0);
        drop(answered);
        assert!(resume.attach(connect_id, gone).is_none());
        assert!(!live.is_superseded());
        queue.send(close()).await.unwrap();
        let next = tokio::time::timeout(Duration::from_secs(1), live.next()).await;
        assert_eq!(
            next,
            Ok(Some(close())),
            "the attached stream still carries the queue"
        );

        // One still awaited is taken, and the stream before it ends.
        let (waited, answered) = attempt(0);
        assert!(resume.attach(connect_id, waited).is_some());
        let (mut taken, server_received) = answered.await.unwrap().unwrap();
        assert_eq!(server_received, 0);
        assert_eq!(live.next().await, None);
        queue.send(close()).await.unwrap();
        assert_eq!(taken.next().await, Some(close()));
    }
}
