//! The AgentService endpoint: authenticates an agent stream's metadata,
//! answers with `serverid`/`servercount` at once, and hands the stream to
//! its session task.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::serving::peer_certificate_names;
use futures_util::Stream;
use konnectivity_mux::{Extensions, flow};
use konnectivity_proto::metadata::{
    AGENT_ID, AGENT_IDENTIFIERS, AGENT_INSTANCE, PROBE, RESUME, RESUME_TOKEN, RESUMED, SERVER_COUNT,
    SERVER_ID,
};
use konnectivity_proto::wire::agent_service_server::AgentService;
use konnectivity_proto::{AgentIdentifiers, Packet};
use konnectivity_telemetry::metrics::GaugeGuard;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::{Request, Response, Status, Streaming};

use crate::admission::Admission;
use crate::backend::registry::Registry;
use crate::backend::resume::{Attachment, PeerIdentity, ResponsePackets, Resumption, Takeover};
use crate::backend::{Announced, Backend, BackendId, session};
use crate::config::Config;
use crate::identity::ProvenNode;
use crate::metrics::ServerMetrics;
use crate::token_auth::TokenAuthenticator;
use konnectivity_kube::node::NodeName;

pub(crate) struct AgentServer {
    registry: Arc<Registry>,
    metrics: Arc<ServerMetrics>,
    /// Which of an agent's identifiers its node has.
    admission: Arc<Admission>,
    server_id: AsciiMetadataValue,
    server_count: AsciiMetadataValue,
    next_backend: AtomicU64,
    control_plane_ids: Vec<String>,
    /// `--control-plane-nodes`: where control-plane agents may run (empty:
    /// anywhere).
    control_plane_nodes: Vec<NodeName>,
    /// Set when agents authenticate by ServiceAccount token.
    token_auth: Option<TokenAuthenticator>,
    /// Resumable agent streams; `None` with `--agent-resume-timeout=0`.
    resumption: Option<Arc<Resumption>>,
}

impl AgentServer {
    /// The service for `config`'s agents (`--server-id`, `--server-count`,
    /// `--control-plane-agent-ids`, `--agent-resume-timeout`).
    pub(crate) fn new(
        config: &Config,
        registry: Arc<Registry>,
        metrics: Arc<ServerMetrics>,
        admission: Arc<Admission>,
        token_auth: Option<TokenAuthenticator>,
    ) -> Result<Self, String> {
        let server_id = &config.server_id;
        let resume_timeout = config.agent_resume_timeout;
        Ok(AgentServer {
            registry,
            metrics,
            admission,
            server_id: server_id
                .parse()
                .map_err(|_| format!("--server-id {server_id:?} is not printable ASCII"))?,
            server_count: config.server_count.to_string().parse().expect("digits are ASCII"),
            next_backend: AtomicU64::new(1),
            control_plane_ids: config.control_plane_agent_ids.clone(),
            control_plane_nodes: config.control_plane_nodes.clone(),
            token_auth,
            resumption: (!resume_timeout.is_zero()).then(|| Resumption::new(resume_timeout, server_id)),
        })
    }
}

/// The one value of a metadata key that must appear exactly once.
fn exactly_one<'a>(metadata: &'a MetadataMap, key: &str) -> Result<&'a str, Status> {
    let mut values = metadata.get_all(key).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => value
            .to_str()
            .map_err(|_| Status::invalid_argument(format!("metadata {key:?} is not ASCII"))),
        (None, _) => Err(Status::invalid_argument(format!(
            "missing metadata {key:?}: an agent must send exactly one"
        ))),
        (Some(_), Some(_)) => Err(Status::invalid_argument(format!(
            "metadata {key:?} given more than once: an agent must send exactly one"
        ))),
    }
}

fn identifiers(metadata: &MetadataMap) -> Result<AgentIdentifiers, Status> {
    let mut values = metadata.get_all(AGENT_IDENTIFIERS).iter();
    let Some(value) = values.next() else {
        return Ok(AgentIdentifiers::default());
    };
    if values.next().is_some() {
        return Err(Status::invalid_argument(format!(
            "metadata {AGENT_IDENTIFIERS:?} given more than once"
        )));
    }
    let text = value
        .to_str()
        .map_err(|_| Status::invalid_argument(format!("metadata {AGENT_IDENTIFIERS:?} is not ASCII")))?;
    AgentIdentifiers::parse_lenient(text)
        .map_err(|e| Status::invalid_argument(format!("metadata {AGENT_IDENTIFIERS:?}: {e}")))
}

#[tonic::async_trait]
impl AgentService for AgentServer {
    type ConnectStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

    async fn connect(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let agent_id = exactly_one(request.metadata(), AGENT_ID)?.to_owned();
        let identifiers = identifiers(request.metadata())?;
        let probe = request.metadata().get(PROBE).is_some_and(|value| value == "1");
        // Held by the stream's session: its token counts as live meanwhile.
        let mut live_token = None;
        // What the agent proved: bound into a resume token.
        let mut username = None;
        let mut token_node = None;
        if let Some(token_auth) = &self.token_auth {
            let admitted = if probe {
                token_auth.authenticate_probe(request.metadata()).await
            } else {
                token_auth
                    .authenticate(request.metadata())
                    .await
                    .map(|(account, live)| {
                        tracing::debug!(%agent_id, username = %account.username, "agent authenticated by token");
                        live_token = Some(live);
                        username = Some(account.username);
                        token_node = account.node;
                    })
            };
            if let Err(refused) = admitted {
                tracing::warn!(%agent_id, error = refused.message(), "agent refused");
                return Err(refused);
            }
        }
        let control_plane = self.control_plane_ids.contains(&agent_id);
        let flow_control = request
            .metadata()
            .get(flow::HEADER)
            .is_some_and(|value| value == flow::VERSION);
        let certificate_names = peer_certificate_names(&request);
        let proven_node = ProvenNode::of(token_node.as_ref(), &certificate_names);
        if control_plane {
            // The role comes from our configuration, bound to the verified
            // certificate: an agent cannot promote itself by its id alone.
            let names = &certificate_names;
            if !names.contains(&agent_id) {
                tracing::warn!(%agent_id, ?names, "refused a control-plane agent id not named by its certificate");
                return Err(Status::permission_denied(format!(
                    "agent id {agent_id:?} is a control-plane id (--control-plane-agent-ids) but the client \
                     certificate names {names:?}"
                )));
            }
            let node = proven_node.as_ref().map(ProvenNode::name);
            if !self.control_plane_nodes.is_empty()
                && !node.is_some_and(|node| self.control_plane_nodes.contains(node))
            {
                let node = node.map_or("no node".to_owned(), |node| format!("node {node:?}"));
                tracing::warn!(%agent_id, %node, "refused a control-plane agent on a node --control-plane-nodes does not name");
                return Err(Status::permission_denied(format!(
                    "agent id {agent_id:?} is a control-plane id, but its credential names {node}, not one of \
                     --control-plane-nodes"
                )));
            }
        }
        if probe {
            // An agent checking the connection and the server count: the
            // headers are the answer; nothing is registered.
            self.metrics.agent_probes.inc();
            let empty = futures_util::stream::empty();
            return Ok(self.with_headers(
                Response::new(Box::pin(empty) as Self::ConnectStream),
                flow_control,
            ));
        }
        let resumption = self
            .resumption
            .as_ref()
            .filter(|_| flow_control && request.metadata().get(RESUME).is_some_and(|value| value == "1"));
        let identity = PeerIdentity {
            agent_id: agent_id.clone(),
            proof: match &username {
                Some(user) => format!("token user {user}"),
                None => format!("certificate {certificate_names:?}"),
            },
        };
        if let Some(resumption) = resumption {
            let offered: Vec<&str> = request
                .metadata()
                .get_all(RESUME_TOKEN)
                .iter()
                .filter_map(|value| value.to_str().ok())
                .collect();
            let found = resumption.find(&offered, &identity).map_err(|mut refused| {
                tracing::warn!(%agent_id, error = refused.message(), "agent stream's resume refused");
                // The agent learns which server refused: it gives up that
                // server's lost stream, and connects afresh.
                refused.metadata_mut().insert(SERVER_ID, self.server_id.clone());
                refused
            })?;
            if let Some(session) = found {
                return self.resume(session, request.into_inner()).await;
            }
        }
        let instance = request
            .metadata()
            .get(AGENT_INSTANCE)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        if let Some(resumption) = &self.resumption {
            resumption.restarted(&identity, instance.as_deref());
        }
        let extensions = match (flow_control, resumption.is_some()) {
            (true, true) => Extensions::Resume,
            (true, false) => Extensions::FlowControl,
            (false, _) => Extensions::Upstream,
        };
        // A new stream (a resumed one keeps its session's routes): which of
        // its claims its node has.
        let mut admitted = self
            .admission
            .admit(&agent_id, identifiers, proven_node, control_plane)
            .await
            .inspect_err(|refused| tracing::warn!(%agent_id, error = refused.message(), "agent refused"))?;
        let seen = admitted.take_seen();
        let announced = Announced {
            agent_id,
            identifiers: admitted.identifiers,
            binding: admitted.binding,
            control_plane,
            extensions,
        };
        let id = BackendId(self.next_backend.fetch_add(1, Ordering::Relaxed));
        let (backend, queues) = Backend::open(id, announced, self.metrics.clone());
        tracing::info!(
            agent_id = %backend.agent_id,
            identifiers = %backend.identifiers(),
            control_plane,
            flow_control,
            "agent connected"
        );
        self.registry.add(backend.clone());
        self.admission.registered(&backend, seen);

        let open = GaugeGuard::new(&self.metrics.grpc_connections("Connect"));
        let registry = self.registry.clone();
        let metrics = self.metrics.clone();
        let resume = resumption.map(|resumption| session::Resume {
            ticket: resumption.issue(identity, instance),
            timeout: resumption.timeout,
        });
        let token = resume
            .as_ref()
            .and_then(|resume| AsciiMetadataValue::try_from(resume.ticket.token.as_str()).ok());
        tokio::spawn(async move {
            let _open = open;
            let _live_token = live_token;
            session::run(
                backend,
                request.into_inner(),
                queues.commands,
                registry,
                metrics,
                resume,
            )
            .await;
        });

        // Returning the response sends its headers at once: upstream agents
        // wait for `serverid` before anything else, with no timeout.
        let packets = ResponsePackets::new(queues.to_agent);
        let mut response = self.with_headers(
            Response::new(Box::pin(packets) as Self::ConnectStream),
            flow_control,
        );
        if let Some(token) = token {
            let metadata = response.metadata_mut();
            metadata.insert(RESUME, AsciiMetadataValue::from_static("1"));
            metadata.insert(RESUME_TOKEN, token);
        }
        Ok(response)
    }
}

impl AgentServer {
    /// Hands a new stream to the session it resumes, which answers with the
    /// writer of the stream's response (its RESUME list first).
    async fn resume(
        &self,
        session: konnectivity_mux::mailbox::Sender<Takeover>,
        inbound: Streaming<Packet>,
    ) -> Result<Response<<Self as AgentService>::ConnectStream>, Status> {
        let gone = || Status::not_found("resume refused: the session ended meanwhile");
        let (writer, answer) = tokio::sync::oneshot::channel();
        let attachment = Attachment {
            inbound: Box::pin(inbound),
            writer,
        };
        session
            .send(Takeover::Resume(Box::new(attachment)))
            .map_err(|_| gone())?;
        let writer = answer.await.map_err(|_| gone())?;
        let packets = ResponsePackets::new(writer);
        let mut response = self.with_headers(
            Response::new(Box::pin(packets) as <Self as AgentService>::ConnectStream),
            true,
        );
        let metadata = response.metadata_mut();
        metadata.insert(RESUME, AsciiMetadataValue::from_static("1"));
        metadata.insert(RESUMED, AsciiMetadataValue::from_static("1"));
        Ok(response)
    }
}

impl AgentServer {
    /// Adds the headers every agent stream's answer carries.
    fn with_headers<T>(&self, mut response: Response<T>, flow_control: bool) -> Response<T> {
        let metadata = response.metadata_mut();
        metadata.insert(SERVER_ID, self.server_id.clone());
        metadata.insert(SERVER_COUNT, self.server_count.clone());
        if flow_control {
            metadata.insert(flow::HEADER, AsciiMetadataValue::from_static(flow::VERSION));
        }
        response
    }
}
