//! One agent: its gRPC client, what its handshake established, the workers waiting on its Watch
//! stream, and its load. Every call goes through [`Agent::call`]: a deadline, an `agent.call`
//! span, the trace context in the metadata, latency and code counted.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use antidote_net::dial::Inbound;
use antidote_net::tls::{ClientStatus, ClientTls, Identity, TlsFiles};
use antidote_proto::agent::v1 as proto;
use antidote_proto::agent::v1::backend_client::BackendClient;
use antidote_proto::labels;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};
use tracing::Instrument as _;

use super::convert;
use super::{
    AgentReport, AgentState, AgentStatus, CheckFile, Desired, FileOutcome, Handshake, Observed,
    Plan, Snapshot,
};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{LiveLessonId, Millis};
use crate::settings::{AgentConfig, AgentTlsConfig};

/// Most live lessons asked for per List page.
const LIST_PAGE: u32 = 500;

/// How long a call to an agent that dials in waits for its connection before it fails
/// UNAVAILABLE (the supervisor's next handshake waits again).
const DIAL_WAIT: Duration = Duration::from_secs(5);

/// How the scheduler reaches an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The scheduler dials the agent's configured address.
    Dialled,
    /// The agent dialled in to the intake; `peer` is where its connection comes from, `None`
    /// while it has none.
    DialIn {
        /// The connection's remote address.
        peer: Option<std::net::SocketAddr>,
    },
}

/// One configured agent.
pub struct Agent {
    /// Its configured name.
    pub name: String,
    /// Its address, for operators (the client holds the connection).
    pub address: String,
    /// The gRPC client; cloning it is cheap and shares the connection.
    pub(super) client: BackendClient<Channel>,
    /// For an agent that dials in: its connections, which the client's channel runs over.
    inbound: Option<Inbound>,
    /// Connection state and handshake.
    status: RwLock<AgentStatus>,
    /// Workers waiting on live lessons of this agent, fed by the Watch stream.
    observers: Mutex<HashMap<LiveLessonId, watch::Sender<Observed>>>,
    /// How many live lessons the store places on it, kept in memory for placement: set from the
    /// store at start, then changed by [`Agent::claim`] and [`Agent::release`].
    load: AtomicU32,
    /// Deadline of each call.
    call_timeout: Duration,
    /// Where call latencies and errors are counted.
    metrics: Arc<Metrics>,
    /// mTLS to a dialled agent (`agents.tls`): every new connection re-reads rotated files and
    /// records the agent's certificate or why the handshake failed.
    tls: Option<Arc<ClientTls>>,
    /// The entrypoint base URL of its last handshake (empty: it runs none).
    entrypoint_url: Mutex<String>,
}

impl Agent {
    pub(super) fn new(
        config: &AgentConfig,
        call_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<Agent, Error> {
        let endpoint = Endpoint::from_shared(config.address.clone())
            .map_err(|err| Error::InvalidArgument {
                field: "agents.address",
                reason: format!("`{}`: {err}", config.address),
            })?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        let tls = config
            .tls
            .as_ref()
            .map(|tls| client_tls(config, tls).map(Arc::new))
            .transpose()?;
        let channel = match &tls {
            Some(tls) => tls.channel(endpoint),
            None => endpoint.connect_lazy(),
        };
        Ok(Agent {
            name: config.name.clone(),
            address: config.address.clone(),
            client: BackendClient::new(channel),
            inbound: None,
            status: RwLock::new(AgentStatus {
                state: AgentState::Connecting,
                handshake: None,
                last_error: String::new(),
                connected_at: None,
            }),
            observers: Mutex::new(HashMap::new()),
            load: AtomicU32::new(0),
            call_timeout,
            metrics,
            tls,
            entrypoint_url: Mutex::new(String::new()),
        })
    }

    /// With mTLS: the agent's certificate on the last connection it accepted, or why the last
    /// connection failed (TCP, TLS, or the agent refusing our certificate).
    pub fn tls_status(&self) -> Option<ClientStatus> {
        // An agent that dials in: the client certificate it presented to the intake.
        let dial_in = || {
            self.inbound.as_ref().map(|inbound| ClientStatus {
                peer: inbound.peer_cert(),
                failure: None,
            })
        };
        self.tls.as_ref().map(|tls| tls.status()).or_else(dial_in)
    }

    /// An agent that dials in (`--connect`), named by its certificate: calls run over the
    /// connection it opened, and wait up to [`DIAL_WAIT`] for it when it has none.
    pub(super) fn dial_in(name: &str, call_timeout: Duration, metrics: Arc<Metrics>) -> Agent {
        let inbound = Inbound::default();
        // The URI only labels the channel: every connection comes from `inbound`. The
        // scheduler is the HTTP/2 client on it, so its pings find an agent gone silently.
        let endpoint = Endpoint::from_static("http://dial-in.invalid")
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        Agent {
            name: name.to_owned(),
            address: "dial-in".into(),
            client: BackendClient::new(inbound.channel(endpoint, DIAL_WAIT)),
            inbound: Some(inbound),
            status: RwLock::new(AgentStatus {
                state: AgentState::Connecting,
                handshake: None,
                last_error: String::new(),
                connected_at: None,
            }),
            observers: Mutex::new(HashMap::new()),
            load: AtomicU32::new(0),
            call_timeout,
            metrics,
            tls: None,
            entrypoint_url: Mutex::new(String::new()),
        }
    }

    /// The base URL of the agent's entrypoint, from its last handshake (empty: none).
    pub fn entrypoint_url(&self) -> String {
        self.entrypoint_url
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The connections of an agent that dials in; `None` for one the scheduler dials.
    pub(super) fn inbound(&self) -> Option<&Inbound> {
        self.inbound.as_ref()
    }

    /// How the scheduler reaches the agent, for operators.
    pub fn transport(&self) -> Transport {
        match &self.inbound {
            None => Transport::Dialled,
            Some(inbound) => Transport::DialIn {
                peer: inbound.peer(),
            },
        }
    }

    /// A snapshot of the agent's status.
    pub fn status(&self) -> AgentStatus {
        read(&self.status).clone()
    }

    /// Everything placement and operators need, as of now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            name: self.name.clone(),
            address: self.address.clone(),
            status: self.status(),
            load: self.load(),
        }
    }

    /// Whether the agent completed a handshake and is reachable.
    pub fn is_ready(&self) -> bool {
        read(&self.status).state == AgentState::Ready
    }

    /// Whether the agent's handshake offered a capability.
    pub fn has(&self, capability: &str) -> bool {
        read(&self.status)
            .handshake
            .as_ref()
            .is_some_and(|h| h.capabilities.contains(capability))
    }

    /// How many live lessons are placed on it.
    pub fn load(&self) -> u32 {
        self.load.load(Ordering::Relaxed)
    }

    /// Counts a live lesson newly placed on it.
    pub fn claim(&self) {
        self.load.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a live lesson gone from it (never below zero).
    pub fn release(&self) {
        let _ = self
            .load
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    pub(super) fn set_load(&self, load: u32) {
        self.load.store(load, Ordering::Relaxed);
    }

    pub(super) fn set_status(&self, update: impl FnOnce(&mut AgentStatus)) {
        let mut status = self
            .status
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        update(&mut status);
    }

    /// Starts following a live lesson's state from the Watch stream. Call before the RPC whose
    /// effects you wait for, so no event is missed; the returned guard stops following when it
    /// is dropped.
    pub fn observe(self: &Arc<Self>, id: LiveLessonId) -> Observer {
        let mut observers = lock(&self.observers);
        let receiver = match observers.get(&id) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(Observed::Nothing);
                observers.insert(id, tx);
                rx
            }
        };
        Observer {
            agent: self.clone(),
            id,
            receiver,
        }
    }

    /// Delivers an observation to a waiting worker; returns false when nobody waits for it.
    pub(super) fn deliver(&self, id: LiveLessonId, observed: Observed) -> bool {
        let observers = lock(&self.observers);
        match observers.get(&id) {
            Some(tx) if tx.receiver_count() > 0 => {
                tx.send_replace(observed);
                true
            }
            _ => false,
        }
    }

    /// One call: a span (child of the current one, so the caller's trace carries on in the
    /// agent), the trace context in the metadata, the deadline, and the metrics.
    async fn call<Req, Resp, F, Fut>(
        &self,
        rpc: &'static str,
        message: Req,
        send: F,
    ) -> Result<Resp, Error>
    where
        F: FnOnce(BackendClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        self.call_within(rpc, self.call_timeout, message, send)
            .await
    }

    /// [`Agent::call`] with a deadline of its own.
    async fn call_within<Req, Resp, F, Fut>(
        &self,
        rpc: &'static str,
        deadline: Duration,
        message: Req,
        send: F,
    ) -> Result<Resp, Error>
    where
        F: FnOnce(BackendClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        // A call made for a request or a reconcile joins its trace; a background call (a
        // handshake, an orphan listing) is a debug span, not a trace of its own every tick.
        let span = if antidote_net::trace::in_trace() {
            tracing::info_span!("agent.call", agent = %self.name, rpc, code = tracing::field::Empty)
        } else {
            tracing::debug_span!("agent.call", agent = %self.name, rpc, code = tracing::field::Empty)
        };
        async {
            let mut request = Request::new(message);
            request.set_timeout(deadline);
            antidote_net::trace::inject(request.metadata_mut());
            let mut outcome = CallOutcome {
                agent: self,
                rpc,
                started: Instant::now(),
                code: Code::Cancelled,
            };
            let result = send(self.client.clone(), request).await;
            outcome.code = result
                .as_ref()
                .map_or_else(tonic::Status::code, |_| Code::Ok);
            tracing::Span::current().record("code", tracing::field::debug(outcome.code));
            drop(outcome);
            result
                .map(tonic::Response::into_inner)
                .map_err(|status| self.fail(rpc, status))
        }
        .instrument(span)
        .await
    }

    pub(super) fn fail(&self, call: &'static str, status: tonic::Status) -> Error {
        // A TLS agent answers a plaintext HTTP/2 preface with a TLS alert, which HTTP/2 reads
        // as a broken frame, or closes the connection before the preface is written (a broken
        // pipe or a reset, seen at the handshake): say what is likely wrong instead of leaving
        // only the frame or socket error.
        let status = if self.tls.is_none()
            && self.inbound.is_none()
            && self.address.starts_with("http://")
            && (status.message().starts_with("h2 protocol error")
                || (call == "Handshake" && closed_by_peer(&status)))
        {
            tonic::Status::new(
                status.code(),
                format!(
                    "{}; no answer in plaintext: the agent may serve TLS (use an https:// \
                     address and its `tls` settings: ca, cert, key)",
                    status.message()
                ),
            )
        } else {
            status
        };
        Error::Agent {
            agent: self.name.clone(),
            call,
            status,
        }
    }

    /// A state the agent answered with, as a report.
    fn report(
        &self,
        call: &'static str,
        state: Option<proto::LiveLessonState>,
    ) -> Result<AgentReport, Error> {
        let state = state.ok_or_else(|| {
            self.fail(call, tonic::Status::internal("the answer carries no state"))
        })?;
        let id = state.live_lesson_id.clone();
        convert::report(state).ok_or_else(|| {
            self.fail(
                call,
                tonic::Status::internal(format!("the answer names live lesson `{id}`, not a UUID")),
            )
        })
    }

    pub(super) async fn handshake(
        &self,
        request: proto::HandshakeRequest,
    ) -> Result<Handshake, Error> {
        let response = self
            .call("Handshake", request, |mut c, r| async move {
                c.handshake(r).await
            })
            .await?;
        *self
            .entrypoint_url
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = response.entrypoint_url.clone();
        Ok(convert::handshake(response))
    }

    /// Asks the agent to realise the desired generation (idempotent on id + generation).
    /// `new_live_lesson`: no agent was asked for this live lesson before (PROTOCOL.md [P9]).
    pub async fn provision(
        &self,
        desired: &Desired<'_>,
        new_live_lesson: bool,
    ) -> Result<AgentReport, Error> {
        let request = proto::ProvisionRequest {
            spec: Some(convert::lesson_spec(desired)),
            new_live_lesson,
        };
        let response = self
            .call("Provision", request, |mut c, r| async move {
                c.provision(r).await
            })
            .await?;
        self.report("Provision", response.state)
    }

    /// Asks a restarted agent to adopt a live lesson by its handle.
    pub async fn recover(&self, desired: &Desired<'_>) -> Result<AgentReport, Error> {
        let request = proto::RecoverRequest {
            live_lesson_id: desired.live.id.to_string(),
            handle: desired.live.handle.clone(),
            spec: Some(convert::lesson_spec(desired)),
        };
        let response = self
            .call(
                "Recover",
                request,
                |mut c, r| async move { c.recover(r).await },
            )
            .await?;
        self.report("Recover", response.state)
    }

    /// The agent's current state of a live lesson.
    pub async fn get(&self, id: LiveLessonId) -> Result<AgentReport, Error> {
        let request = proto::GetRequest {
            live_lesson_id: id.to_string(),
        };
        let response = self
            .call("Get", request, |mut c, r| async move { c.get(r).await })
            .await?;
        self.report("Get", response.state)
    }

    /// Removes a live lesson's objects; returns whether everything is already gone.
    pub async fn deprovision(&self, id: LiveLessonId, handle: Vec<u8>) -> Result<bool, Error> {
        let request = proto::DeprovisionRequest {
            live_lesson_id: id.to_string(),
            handle,
        };
        self.call("Deprovision", request, |mut c, r| async move {
            c.deprovision(r).await
        })
        .await
        .map(|response| response.gone)
    }

    /// Runs check or solution files on a live lesson the agent holds READY at `generation`
    /// (RunChecks); each may run for `timeout`, one after another at worst, so the call's
    /// deadline is theirs plus the usual call timeout.
    pub async fn run_checks(
        &self,
        id: LiveLessonId,
        generation: u64,
        files: &[CheckFile],
        timeout: Duration,
    ) -> Result<Vec<FileOutcome>, Error> {
        let request = convert::run_checks(id, generation, files, timeout);
        let deadline = self.call_timeout + timeout * files.len() as u32;
        let response = self
            .call_within("RunChecks", deadline, request, |mut c, r| async move {
                c.run_checks(r).await
            })
            .await?;
        Ok(response
            .results
            .into_iter()
            .map(convert::file_outcome)
            .collect())
    }

    /// What Provision would create (no side effects).
    pub async fn plan(&self, desired: &Desired<'_>) -> Result<Plan, Error> {
        let request = proto::PlanRequest {
            spec: Some(convert::lesson_spec(desired)),
        };
        self.call("Plan", request, |mut c, r| async move { c.plan(r).await })
            .await
            .map(convert::plan)
    }

    /// Every live lesson the agent holds with our instance and cluster labels, all pages.
    /// Objects whose id is not a UUID cannot be ours and are left out; objects of another
    /// deployment (another cluster id, or none) are not asked for.
    pub async fn list_all(
        &self,
        instance_id: &str,
        cluster_id: &str,
    ) -> Result<Vec<AgentReport>, Error> {
        let mut items = Vec::new();
        let mut page_token = String::new();
        loop {
            let request = proto::ListRequest {
                label_selector: HashMap::from([
                    (labels::INSTANCE.to_owned(), instance_id.to_owned()),
                    (labels::CLUSTER.to_owned(), cluster_id.to_owned()),
                ]),
                page_size: LIST_PAGE,
                page_token,
            };
            let page = self
                .call("List", request, |mut c, r| async move { c.list(r).await })
                .await?;
            items.extend(page.items.into_iter().filter_map(convert::report));
            if page.next_page_token.is_empty() {
                return Ok(items);
            }
            page_token = page.next_page_token;
        }
    }

    /// Counts a Watch stream opened.
    pub(super) fn watch_opened(&self) {
        self.metrics.watch_opened(&self.name);
    }

    /// Records a complete Watch snapshot: how many live lessons, in how many pages.
    pub(super) fn watch_snapshot(&self, states: usize, pages: usize) {
        self.metrics.watch_snapshot(&self.name, states, pages);
    }

    /// Marks the agent reachable with what its handshake established.
    pub(super) fn connected(&self, handshake: Handshake) {
        self.set_status(|s| {
            s.state = AgentState::Ready;
            s.handshake = Some(handshake);
            s.last_error.clear();
            s.connected_at = Some(Millis::now());
        });
    }
}

/// A worker's view of one live lesson on the agent's Watch stream; dropping it stops following
/// (however the worker's run ends). It owns its agent, so a worker can hand it to the task that
/// waits for the live lesson to settle (`drive::reconcile`) and go back to the pool.
pub struct Observer {
    agent: Arc<Agent>,
    id: LiveLessonId,
    receiver: watch::Receiver<Observed>,
}

impl Observer {
    /// The agent observed.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// The next observation, once it differs from the last one seen; `None` if the stream of
    /// observations ended (it does not while the agent exists).
    pub async fn changed(&mut self) -> Option<Observed> {
        self.receiver.changed().await.ok()?;
        Some(self.receiver.borrow_and_update().clone())
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        let mut observers = lock(&self.agent.observers);
        // Our own receiver still counts: remove the sender when nobody else follows.
        if observers
            .get(&self.id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            observers.remove(&self.id);
        }
    }
}

/// Counts one call when it ends, CANCELLED if it is dropped before an answer (a worker told to
/// stop, shutdown).
struct CallOutcome<'a> {
    agent: &'a Agent,
    rpc: &'static str,
    started: Instant,
    code: Code,
}

impl Drop for CallOutcome<'_> {
    fn drop(&mut self) {
        self.agent.metrics.agent_call(
            &self.agent.name,
            self.rpc,
            self.code,
            self.started.elapsed(),
        );
    }
}

fn read(lock: &RwLock<AgentStatus>) -> std::sync::RwLockReadGuard<'_, AgentStatus> {
    // Status updates are whole-field assignments; a poisoned lock still holds a usable value.
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section is a single map operation; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The agent's TLS client, the identity to verify from `tls.server_name` or else the address's
/// host. Files that do not load yet (a Secret not yet issued) do not stop the scheduler: each
/// connection to the agent fails naming the file until they load (ListAgents `tls_error`).
fn client_tls(config: &AgentConfig, tls: &AgentTlsConfig) -> Result<ClientTls, Error> {
    let invalid = |field: &'static str, reason: String| Error::InvalidArgument {
        field,
        reason: format!("agent `{}`: {reason}", config.name),
    };
    let name = match &tls.server_name {
        Some(name) => name.clone(),
        None => config
            .address
            .parse::<tonic::transport::Uri>()
            .ok()
            .and_then(|uri| uri.host().map(|h| h.trim_matches(['[', ']']).to_owned()))
            .ok_or_else(|| {
                invalid(
                    "agents.address",
                    format!("`{}` has no host", config.address),
                )
            })?,
    };
    let identity =
        Identity::parse(&name).map_err(|err| invalid("agents.tls.server_name", err.to_string()))?;
    let files = TlsFiles {
        cert: tls.cert.clone(),
        key: tls.key.clone(),
        ca: tls.ca.clone(),
    };
    Ok(ClientTls::load_lazy(files, identity))
}

/// Whether a call failed because the peer closed the connection under it (a broken pipe or a
/// reset), as the socket error in the status's source chain says.
fn closed_by_peer(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            )
        {
            return true;
        }
        source = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::closed_by_peer;

    #[test]
    fn a_peer_closing_the_connection_is_told_from_other_failures() {
        for kind in [
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::ConnectionReset,
        ] {
            let status =
                tonic::Status::from_error(Box::new(std::io::Error::new(kind, "stream closed")));
            assert!(closed_by_peer(&status), "{kind:?}");
        }
        let refused = tonic::Status::from_error(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert!(!closed_by_peer(&refused));
        assert!(!closed_by_peer(&tonic::Status::unavailable("no")));
    }
}
