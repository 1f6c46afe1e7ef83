//! The agents the scheduler drives: one connection per configured agent, its handshake, its
//! Watch stream, and typed calls with deadlines.
//!
//! Each agent has a supervisor task that handshakes (retrying with backoff), then follows the
//! agent's Watch stream; when the stream breaks it marks the agent unavailable and starts over.
//! A handshake reporting a new instance id means the agent restarted: the supervisor tells the
//! reconciler, which recovers the agent's live lessons.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use antidote_proto::agent::v1 as proto;
use antidote_proto::agent::v1::backend_client::BackendClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};
use tracing::Instrument as _;

use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::Millis;
use crate::settings::{AgentConfig, ReconcilerConfig};
use crate::store::Store;

/// The label every agent puts on objects to say which scheduler owns them.
pub const LABEL_INSTANCE: &str = "antidote.io/instance";

/// Connection state of an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentState {
    /// Not yet reached.
    Connecting,
    /// Handshake done.
    Ready,
    /// Unreachable.
    Unavailable,
    /// Reached, but no common major version or a broken handshake.
    Incompatible,
}

/// What the scheduler knows about an agent right now.
#[derive(Debug, Clone)]
pub struct AgentStatus {
    /// Connection state.
    pub state: AgentState,
    /// The last successful handshake.
    pub handshake: Option<proto::HandshakeResponse>,
    /// The last error, for operators.
    pub last_error: String,
    /// When the last handshake succeeded.
    pub connected_at: Option<Millis>,
}

/// What a worker waiting on a live lesson learns from the agent's Watch stream.
#[derive(Debug, Clone)]
pub enum Observed {
    /// Nothing yet.
    Nothing,
    /// The live lesson's latest state.
    State(proto::LiveLessonState),
    /// The live lesson's objects are gone.
    Deleted,
}

/// Messages from agent supervisors to the reconciler.
#[derive(Debug)]
pub enum FleetEvent {
    /// The agent restarted (its instance id changed): recover its live lessons.
    Restarted(String),
    /// The agent reported a live lesson nobody was waiting for (e.g. a READY lesson whose
    /// container died).
    Unsolicited(String, proto::LiveLessonState),
}

/// One agent.
pub struct Agent {
    /// Its configured name.
    pub name: String,
    /// Its address.
    pub address: String,
    /// The gRPC client; cloning it is cheap and shares the connection.
    client: BackendClient<Channel>,
    /// Connection state and handshake.
    status: RwLock<AgentStatus>,
    /// Workers waiting on live lessons of this agent, fed by the Watch stream.
    observers: Mutex<HashMap<String, watch::Sender<Observed>>>,
    /// How many live lessons the store places on it (kept in memory for placement).
    pub load: AtomicU32,
    /// Deadline of each call.
    call_timeout: Duration,
    /// Where call latencies and errors are counted.
    metrics: Arc<Metrics>,
}

impl Agent {
    fn new(
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
        Ok(Agent {
            name: config.name.clone(),
            address: config.address.clone(),
            client: BackendClient::new(endpoint.connect_lazy()),
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
        })
    }

    /// A snapshot of the agent's status.
    pub fn status(&self) -> AgentStatus {
        read(&self.status).clone()
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
            .is_some_and(|h| h.capabilities.iter().any(|c| c == capability))
    }

    /// The capabilities from the last handshake.
    pub fn capabilities(&self) -> HashSet<String> {
        read(&self.status)
            .handshake
            .as_ref()
            .map(|h| h.capabilities.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The most live lessons it takes (0 = no limit).
    pub fn max_live_lessons(&self) -> u32 {
        read(&self.status)
            .handshake
            .as_ref()
            .and_then(|h| h.capacity)
            .map_or(0, |c| c.max_live_lessons)
    }

    /// Starts following a live lesson's state from the Watch stream. Call before the RPC whose
    /// effects you wait for, so no event is missed.
    pub fn observe(&self, id: &str) -> watch::Receiver<Observed> {
        let mut observers = lock(&self.observers);
        match observers.get(id) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(Observed::Nothing);
                observers.insert(id.to_owned(), tx);
                rx
            }
        }
    }

    /// Stops following a live lesson (when its worker is done).
    pub fn unobserve(&self, id: &str) {
        let mut observers = lock(&self.observers);
        if observers.get(id).is_some_and(|tx| tx.receiver_count() <= 1) {
            observers.remove(id);
        }
    }

    /// Delivers a state to a waiting worker; returns false when nobody waits for it.
    fn deliver(&self, id: &str, observed: Observed) -> bool {
        let observers = lock(&self.observers);
        match observers.get(id) {
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
        // A call made for a request or a reconcile joins its trace; a background call (a
        // handshake, an orphan listing) is a debug span, not a trace of its own every tick.
        let span = if antidote_proto::sdk::trace::in_trace() {
            tracing::info_span!("agent.call", agent = %self.name, rpc, code = tracing::field::Empty)
        } else {
            tracing::debug_span!("agent.call", agent = %self.name, rpc, code = tracing::field::Empty)
        };
        async {
            let mut request = Request::new(message);
            request.set_timeout(self.call_timeout);
            antidote_proto::sdk::trace::inject(request.metadata_mut());
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

    fn fail(&self, call: &'static str, status: tonic::Status) -> Error {
        Error::Agent {
            agent: self.name.clone(),
            call,
            status,
        }
    }

    /// Handshake.
    pub async fn handshake(
        &self,
        request: proto::HandshakeRequest,
    ) -> Result<proto::HandshakeResponse, Error> {
        self.call("Handshake", request, |mut c, r| async move {
            c.handshake(r).await
        })
        .await
    }

    /// Provision.
    pub async fn provision(
        &self,
        spec: proto::LessonSpec,
    ) -> Result<proto::LiveLessonState, Error> {
        let request = proto::ProvisionRequest { spec: Some(spec) };
        self.call("Provision", request, |mut c, r| async move {
            c.provision(r).await
        })
        .await?
        .state
        .ok_or_else(|| self.fail("Provision", tonic::Status::internal("answer has no state")))
    }

    /// Recover.
    pub async fn recover(
        &self,
        id: &str,
        handle: Vec<u8>,
        spec: proto::LessonSpec,
    ) -> Result<proto::LiveLessonState, Error> {
        let request = proto::RecoverRequest {
            live_lesson_id: id.to_owned(),
            handle,
            spec: Some(spec),
        };
        self.call(
            "Recover",
            request,
            |mut c, r| async move { c.recover(r).await },
        )
        .await?
        .state
        .ok_or_else(|| self.fail("Recover", tonic::Status::internal("answer has no state")))
    }

    /// Get.
    pub async fn get(&self, id: &str) -> Result<proto::LiveLessonState, Error> {
        let request = proto::GetRequest {
            live_lesson_id: id.to_owned(),
        };
        self.call("Get", request, |mut c, r| async move { c.get(r).await })
            .await?
            .state
            .ok_or_else(|| self.fail("Get", tonic::Status::internal("answer has no state")))
    }

    /// Deprovision; returns whether everything is already gone.
    pub async fn deprovision(&self, id: &str, handle: Vec<u8>) -> Result<bool, Error> {
        let request = proto::DeprovisionRequest {
            live_lesson_id: id.to_owned(),
            handle,
        };
        self.call("Deprovision", request, |mut c, r| async move {
            c.deprovision(r).await
        })
        .await
        .map(|response| response.gone)
    }

    /// Plan.
    pub async fn plan(&self, spec: proto::LessonSpec) -> Result<proto::PlanResponse, Error> {
        let request = proto::PlanRequest { spec: Some(spec) };
        self.call("Plan", request, |mut c, r| async move { c.plan(r).await })
            .await
    }

    /// Every live lesson the agent holds with our instance label, all pages.
    pub async fn list_all(&self, instance_id: &str) -> Result<Vec<proto::LiveLessonState>, Error> {
        let mut items = Vec::new();
        let mut page_token = String::new();
        loop {
            let request = proto::ListRequest {
                label_selector: HashMap::from([(
                    LABEL_INSTANCE.to_owned(),
                    instance_id.to_owned(),
                )]),
                page_size: 500,
                page_token,
            };
            let page = self
                .call("List", request, |mut c, r| async move { c.list(r).await })
                .await?;
            items.extend(page.items);
            if page.next_page_token.is_empty() {
                return Ok(items);
            }
            page_token = page.next_page_token;
        }
    }

    fn set_status(&self, update: impl FnOnce(&mut AgentStatus)) {
        let mut status = self
            .status
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        update(&mut status);
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

/// Every configured agent.
pub struct Fleet {
    /// In configuration order.
    agents: Vec<Arc<Agent>>,
}

impl Fleet {
    /// Creates clients for every configured agent (connections are made lazily).
    pub fn new(
        configs: &[AgentConfig],
        reconciler: &ReconcilerConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Fleet, Error> {
        let agents = configs
            .iter()
            .map(|config| {
                Agent::new(config, reconciler.call_timeout, metrics.clone()).map(Arc::new)
            })
            .collect::<Result<_, _>>()?;
        Ok(Fleet { agents })
    }

    /// Every agent, in configuration order.
    pub fn agents(&self) -> &[Arc<Agent>] {
        &self.agents
    }

    /// The agent with this name.
    pub fn get(&self, name: &str) -> Option<&Arc<Agent>> {
        self.agents.iter().find(|agent| agent.name == name)
    }

    /// Starts one supervisor per agent.
    pub fn spawn_supervisors(
        &self,
        tracker: &tokio_util::task::TaskTracker,
        ctx: SupervisorContext,
    ) {
        for agent in &self.agents {
            tracker.spawn(supervise(agent.clone(), ctx.clone()));
        }
    }
}

/// What supervisors need.
#[derive(Clone)]
pub struct SupervisorContext {
    /// Where instance ids are kept.
    pub store: Store,
    /// This scheduler's instance id and version, sent in handshakes.
    pub instance_id: String,
    /// Where restarts and unsolicited states are reported.
    pub events: mpsc::UnboundedSender<FleetEvent>,
    /// Stops the supervisor.
    pub shutdown: CancellationToken,
    /// Backoff bounds.
    pub backoff: (Duration, Duration),
}

/// The capabilities this scheduler understands, sent in the handshake.
pub const SCHEDULER_CAPABILITIES: &[&str] = &[
    "presentation.ssh",
    "presentation.http",
    "stage.configuration",
    "network.isolation",
    "plan",
    "watch",
    "recover",
];

// Debug level: it lasts as long as the process, so as a trace it would never end.
#[tracing::instrument(skip_all, level = "debug", fields(agent = %agent.name))]
async fn supervise(agent: Arc<Agent>, ctx: SupervisorContext) {
    let (initial, max) = ctx.backoff;
    let mut delay = initial;
    loop {
        let outcome = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            outcome = connect_and_follow(&agent, &ctx) => outcome,
        };
        match outcome {
            Ok(()) => delay = initial,
            Err(Failure::Unavailable(reason)) => {
                tracing::warn!(%reason, "agent unavailable");
                agent.set_status(|s| {
                    s.state = AgentState::Unavailable;
                    s.last_error = reason;
                });
            }
            Err(Failure::Incompatible(reason)) => {
                tracing::error!(%reason, "agent incompatible");
                agent.set_status(|s| {
                    s.state = AgentState::Incompatible;
                    s.last_error = reason;
                });
                // An incompatible agent will not change until it is upgraded: ask rarely.
                delay = max;
            }
        }
        tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(max);
    }
}

enum Failure {
    Unavailable(String),
    Incompatible(String),
}

/// Handshakes, then follows the Watch stream until it ends. Returns `Ok` when a healthy stream
/// ended (so the backoff restarts from its initial value).
async fn connect_and_follow(agent: &Agent, ctx: &SupervisorContext) -> Result<(), Failure> {
    let request = proto::HandshakeRequest {
        supported_majors: vec![proto::MAJOR],
        scheduler_instance_id: ctx.instance_id.clone(),
        scheduler_version: env!("CARGO_PKG_VERSION").to_owned(),
        capabilities: SCHEDULER_CAPABILITIES
            .iter()
            .map(|c| (*c).to_owned())
            .collect(),
    };
    let handshake = match agent.handshake(request).await {
        Ok(handshake) => handshake,
        Err(Error::Agent { status, .. }) => {
            return Err(match status.code() {
                Code::Unimplemented => Failure::Incompatible(format!(
                    "agent does not serve {} (it may speak another major version): {}",
                    proto::SERVICE_NAME,
                    status.message()
                )),
                Code::FailedPrecondition | Code::InvalidArgument => {
                    Failure::Incompatible(format!("handshake refused: {}", status.message()))
                }
                _ => Failure::Unavailable(format!("handshake failed: {status}")),
            });
        }
        Err(err) => return Err(Failure::Unavailable(err.to_string())),
    };
    if handshake.major != proto::MAJOR {
        return Err(Failure::Incompatible(format!(
            "agent chose major version {} but this scheduler speaks only {}",
            handshake.major,
            proto::MAJOR
        )));
    }
    if handshake.instance_id.is_empty() {
        return Err(Failure::Incompatible(
            "handshake carries no instance_id".into(),
        ));
    }
    let previous = ctx.store.agent_instance(&agent.name).await.ok().flatten();
    if previous.as_deref() != Some(handshake.instance_id.as_str())
        && let Err(err) = ctx
            .store
            .set_agent_instance(&agent.name, &handshake.instance_id, Millis::now())
            .await
    {
        return Err(Failure::Unavailable(format!(
            "cannot record instance id: {err}"
        )));
    }
    tracing::info!(
        kind = %handshake.agent_name,
        version = %handshake.build_version,
        instance = %handshake.instance_id,
        capabilities = ?handshake.capabilities,
        "agent ready"
    );
    let restarted = previous
        .as_deref()
        .is_some_and(|previous| previous != handshake.instance_id);
    let watch = handshake.capabilities.iter().any(|c| c == "watch");
    agent.set_status(|s| {
        s.state = AgentState::Ready;
        s.handshake = Some(handshake);
        s.last_error.clear();
        s.connected_at = Some(Millis::now());
    });
    if restarted {
        let _ = ctx.events.send(FleetEvent::Restarted(agent.name.clone()));
    }
    if !watch {
        // Without Watch, waiting workers poll with Get; the supervisor re-handshakes now and
        // then to notice restarts.
        tokio::time::sleep(Duration::from_secs(10)).await;
        return Ok(());
    }
    follow(agent, ctx).await
}

async fn follow(agent: &Agent, ctx: &SupervisorContext) -> Result<(), Failure> {
    let request = proto::WatchRequest {
        label_selector: HashMap::from([(LABEL_INSTANCE.to_owned(), ctx.instance_id.clone())]),
        heartbeat_interval: Some(prost_types::Duration {
            seconds: 5,
            nanos: 0,
        }),
    };
    // No deadline on the stream itself: heartbeats prove it is alive.
    let mut stream = agent
        .client
        .clone()
        .watch({
            let mut request = Request::new(request);
            antidote_proto::sdk::trace::inject(request.metadata_mut());
            request
        })
        .await
        .map_err(|status| Failure::Unavailable(format!("Watch failed: {status}")))?
        .into_inner();
    let quiet_limit = Duration::from_secs(20);
    loop {
        let next = tokio::time::timeout(quiet_limit, stream.next()).await;
        let event = match next {
            Err(_) => {
                return Err(Failure::Unavailable(format!(
                    "no Watch message for {quiet_limit:?}"
                )));
            }
            Ok(None) => return Ok(()),
            Ok(Some(Err(status))) => {
                return Err(Failure::Unavailable(format!("Watch broke: {status}")));
            }
            Ok(Some(Ok(event))) => event,
        };
        use proto::watch_event::Event;
        match event.event {
            Some(Event::Snapshot(snapshot)) => {
                for state in snapshot.items {
                    route(agent, ctx, state);
                }
            }
            Some(Event::Changed(state)) => route(agent, ctx, state),
            Some(Event::Deleted(deleted)) => {
                agent.deliver(&deleted.live_lesson_id, Observed::Deleted);
            }
            Some(Event::Heartbeat(_)) | Some(Event::Resync(_)) | None => {}
        }
    }
}

fn route(agent: &Agent, ctx: &SupervisorContext, state: proto::LiveLessonState) {
    let id = state.live_lesson_id.clone();
    if !agent.deliver(&id, Observed::State(state.clone()))
        && state.phase == proto::Phase::Failed as i32
    {
        let _ = ctx
            .events
            .send(FleetEvent::Unsolicited(agent.name.clone(), state));
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

/// Decrements an agent's load counter without wrapping below zero.
pub fn release(agent: &Agent) {
    let _ = agent
        .load
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
}
