//! The [`Backend`] trait an agent implements, and [`Agent`], the runtime that answers the
//! protocol around it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use antidote_proto::agent::v1 as proto;
use antidote_proto::agent::v1::backend_server::Backend as BackendRpc;
use proto::{ErrorReason, Phase};

use super::book::{Reporter, StateBook, WatchStream};
#[cfg(feature = "entrypoint")]
use super::entrypoint::{self, Keys, Lessons};
use super::error::Error;
use super::lesson::Lesson;
use super::metrics::AgentMetrics;
use super::pipeline::{Start, Steps};
use super::{checks, errors, labels, spec};

/// When a live lesson is removed while its driver was still realising it, the pauses after
/// which the removal looks again for objects whose creation was already under way (sent to the
/// backend before the driver stopped, carried out after the first look).
const LATE_OBJECTS: [std::time::Duration; 2] = [
    std::time::Duration::from_millis(250),
    std::time::Duration::from_millis(1000),
];

/// Who an agent is, for the handshake.
#[derive(Debug, Clone)]
pub struct Description {
    /// A short name for the kind of agent, e.g. "agent-docker".
    pub name: String,
    /// The agent's build version.
    pub version: String,
    /// The major protocol versions it speaks (the highest common one is chosen).
    pub majors: Vec<u32>,
    /// The optional features it offers (see [`super::capabilities`]).
    pub capabilities: Vec<String>,
    /// Labels describing the agent, for placement affinity.
    pub labels: HashMap<String, String>,
    /// The most live lessons it takes (0: no limit).
    pub max_live_lessons: u32,
}

impl Description {
    /// An agent named `name` at `version` speaking major 1, offering `capabilities`.
    pub fn new(name: &str, version: &str, capabilities: &[&str]) -> Description {
        Description {
            name: name.to_owned(),
            version: version.to_owned(),
            majors: vec![proto::MAJOR],
            capabilities: capabilities.iter().map(|c| (*c).to_owned()).collect(),
            labels: HashMap::new(),
            max_live_lessons: 0,
        }
    }
}

/// What a backend does. [`Agent`] calls it; every protocol rule lives there, and the
/// pipeline taking a generation to READY (PROTOCOL.md [R1]–[R8]) in [`crate::pipeline`]: a
/// backend supplies its [`Steps`].
#[tonic::async_trait]
pub trait Backend: Steps {
    /// Who the agent is.
    fn describe(&self) -> Description;

    /// Backend-specific checks of a spec, after the protocol's own ([`spec::check`]). Errors are
    /// INVALID_ARGUMENT naming the field.
    fn check(&self, _spec: &proto::LessonSpec) -> Result<(), Status> {
        Ok(())
    }

    /// Work of the backend's own beside the RPCs, started once the agent serves, until
    /// `shutdown`: following the backend's events to report what happens on its own (a
    /// container that dies under a READY live lesson, [R7]) through `book`. The default
    /// starts nothing.
    fn background(&self, _book: &Arc<StateBook>, _shutdown: &tokio_util::sync::CancellationToken) {}

    /// Removes every object of a live lesson; returns once they are gone. OK when nothing exists.
    async fn remove(&self, live_lesson_id: &str) -> Result<(), Error>;

    /// The labels of every live lesson whose objects exist in the backend and carry all the
    /// `selector` labels (one entry per live lesson). This is what makes List the truth and what
    /// adoption after a restart looks for. The default finds nothing (an agent whose objects
    /// die with it).
    async fn discover(
        &self,
        _selector: &HashMap<String, String>,
    ) -> Result<Vec<HashMap<String, String>>, Error> {
        Ok(vec![])
    }

    /// Where the entrypoint reaches a presentation of a live lesson (PROTOCOL.md,
    /// "Entrypoint"): `declared` is the spec's presentation (its port on the endpoint),
    /// `presentation` what the agent reported for it. The default resolves the reported
    /// address, which is right when the entrypoint runs where learners' addresses are reachable
    /// (a cluster's Service names from inside the cluster); agent-docker goes to the container's
    /// own address when it can, saving Docker's port-publishing proxy a hop.
    async fn reach(
        &self,
        _live_lesson: &str,
        _endpoint: &proto::EndpointState,
        _declared: &proto::Presentation,
        presentation: &proto::PresentationState,
    ) -> Option<std::net::SocketAddr> {
        if presentation.address.is_empty() {
            return None;
        }
        tokio::net::lookup_host(presentation.address.as_str())
            .await
            .ok()?
            .next()
    }

    /// What Provision would create, with no side effects.
    async fn plan(&self, _spec: &proto::LessonSpec) -> Result<proto::PlanResponse, Status> {
        Err(errors::agent(
            ErrorReason::NotImplemented,
            "this agent does not implement Plan",
            [("rpc", "Plan".to_owned())],
        ))
    }

    /// Runs check or solution files on a live lesson held READY (PROTOCOL.md, "Checks",
    /// [X3]): `spec` is its newest spec (credentials included), `files` passed the protocol's
    /// rules ([`checks::check_request`]), `timeout` is the request's (cap it at the backend's
    /// own limit with [`checks::check_timeout`]). One result per file, in order;
    /// [`checks::result`] builds each from how it ran, [`checks::not_run`] one that could not
    /// start. The [`Agent`] has already made sure no other run of the live lesson is going on.
    /// The default answers UNIMPLEMENTED: an agent offering `checks` overrides it.
    async fn run_checks(
        &self,
        _spec: &proto::LessonSpec,
        _files: &[proto::CheckFile],
        _timeout: Option<std::time::Duration>,
    ) -> Result<Vec<proto::CheckResult>, Status> {
        Err(not_running_checks())
    }
}

/// The refusal of RunChecks by an agent without `checks` ([X1]).
fn not_running_checks() -> Status {
    errors::agent(
        ErrorReason::NotImplemented,
        "this agent does not run checks",
        [("rpc", "RunChecks".to_owned())],
    )
}

/// Polls `work` once, here, without a waker: its first step up to its first wait. A future
/// still pending must be polled again (awaited, or spawned) so that it registers a real waker.
fn first_step<F: std::future::Future>(work: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
    work.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
}

/// One live lesson this process drives.
struct Work {
    /// The newest spec received.
    spec: proto::LessonSpec,
    /// The task taking it to READY or FAILED; `None` when the work finished on its first step,
    /// inside the Provision call.
    driver: Option<JoinHandle<()>>,
}

/// The runtime: answers `antidote.agent.v1` around a [`Backend`].
pub struct Agent<B> {
    backend: Arc<B>,
    description: Description,
    /// New on every start.
    instance_id: String,
    /// What Get/List/Watch answer.
    book: Arc<StateBook>,
    /// Live lessons this process drives.
    work: Mutex<HashMap<String, Work>>,
    /// One lock per live lesson: Provision, Deprovision and Recover of one id take turns, so a
    /// burst of identical calls creates things once.
    turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Live lessons whose check or solution files run now: one run each at a time
    /// (PROTOCOL.md [X4]).
    checking: Mutex<std::collections::HashSet<String>>,
    /// Call and provisioning metrics.
    metrics: Arc<AgentMetrics>,
    /// The entrypoint's base URL (told at handshake) and its key set (the handshake's keys
    /// join it), once [`Agent::serve_entrypoint`] runs one.
    #[cfg(feature = "entrypoint")]
    entrypoint: std::sync::OnceLock<(String, Arc<Keys>)>,
}

impl<B: Backend> Agent<B> {
    /// Wraps `backend`.
    pub fn new(backend: B) -> Arc<Agent<B>> {
        Self::with_book(backend, Arc::new(StateBook::default()))
    }

    /// Wraps `backend`, reporting through `book` (which the backend may also hold, to report
    /// changes that happen on their own, such as a crashed endpoint).
    pub fn with_book(backend: B, book: Arc<StateBook>) -> Arc<Agent<B>> {
        let description = backend.describe();
        Arc::new(Agent {
            backend: Arc::new(backend),
            description,
            instance_id: uuid::Uuid::new_v4().to_string(),
            book,
            work: Mutex::new(HashMap::new()),
            turns: Mutex::new(HashMap::new()),
            checking: Mutex::new(Default::default()),
            metrics: Arc::new(AgentMetrics::default()),
            #[cfg(feature = "entrypoint")]
            entrypoint: std::sync::OnceLock::new(),
        })
    }

    /// Serves the entrypoint `bound` (see [`entrypoint::EntrypointArgs::bind`]) for this
    /// agent's live lessons until `shutdown`: its URL goes out in the handshake, the scheduler's
    /// keys come in with it, learners' activity lands on the live lessons' states.
    #[cfg(feature = "entrypoint")]
    pub fn serve_entrypoint(
        self: &Arc<Self>,
        bound: entrypoint::Bound,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> JoinHandle<()> {
        let _ = self.entrypoint.set((bound.url.clone(), bound.keys.clone()));
        let entry = entrypoint::Entrypoint::new(self.clone(), bound.keys, bound.settings);
        tracing::info!(url = %bound.url, "entrypoint serving");
        tokio::spawn(entrypoint::serve(
            entry,
            bound.listener,
            bound.tls,
            shutdown,
        ))
    }

    /// The entrypoint's URL for a handshake (empty without one). This scheduler instance's
    /// keys are now exactly the request's: a key it stopped offering stops admitting, one it
    /// revokes also ends what it admitted (PROTOCOL.md, "Entrypoint").
    #[cfg(feature = "entrypoint")]
    fn entrypoint_url(&self, request: &proto::HandshakeRequest) -> String {
        let Some((url, keys)) = self.entrypoint.get() else {
            return String::new();
        };
        keys.offer_revoking(
            &request.scheduler_instance_id,
            request
                .entrypoint_keys
                .iter()
                .map(|k| (k.key_id.as_str(), k.public_key.as_slice())),
            request.revoked_entrypoint_keys.iter().map(String::as_str),
        );
        url.clone()
    }

    /// Without the entrypoint feature there is no entrypoint to name.
    #[cfg(not(feature = "entrypoint"))]
    fn entrypoint_url(&self, _request: &proto::HandshakeRequest) -> String {
        String::new()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The state book (every reported state).
    pub fn book(&self) -> &Arc<StateBook> {
        &self.book
    }

    /// The agent's metrics.
    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }

    /// This process's instance id.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The handshake's answer.
    pub fn describe(&self) -> &Description {
        &self.description
    }

    /// The gRPC service to serve.
    pub fn service(self: &Arc<Self>) -> AgentService<B> {
        AgentService(self.clone())
    }

    fn work(&self) -> std::sync::MutexGuard<'_, HashMap<String, Work>> {
        // Every critical section is one map operation; a poisoned lock is still consistent.
        self.work.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn turn(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .turns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.to_owned())
            .or_default()
            .clone();
        lock.lock_owned().await
    }

    /// RunChecks by the protocol's rules (PROTOCOL.md, "Checks"): the request's rules, a held
    /// live lesson READY at the request's generation, one run at a time; then the backend.
    async fn run_checks(
        &self,
        request: proto::RunChecksRequest,
    ) -> Result<proto::RunChecksResponse, Status> {
        let offered = &self.description.capabilities;
        if !offered.iter().any(|c| c == super::capabilities::CHECKS) {
            return Err(not_running_checks());
        }
        let id = request.live_lesson_id;
        if !spec::is_uuid(&id) {
            return Err(errors::invalid(
                "live_lesson_id",
                "a UUID, hyphenated, lower case",
            ));
        }
        let held = self.work().get(&id).map(|work| work.spec.clone());
        checks::check_request(&request.files, held.as_ref(), offered)?;
        let Some(held) = held else {
            return Err(errors::agent(
                ErrorReason::LiveLessonNotFound,
                format!("live lesson `{id}` is not held by this agent"),
                [("live_lesson_id", id.clone())],
            ));
        };
        let state = self.book.get(&id);
        let (phase, generation) = state
            .as_ref()
            .map_or((Phase::Unspecified, 0), |s| (s.phase(), s.generation));
        if phase != Phase::Ready || generation != request.generation {
            return Err(errors::agent(
                ErrorReason::NotReady,
                format!(
                    "live lesson `{id}` is {} at generation {generation}, not READY at \
                     generation {}",
                    phase.as_str_name().trim_start_matches("PHASE_"),
                    request.generation
                ),
                [
                    ("live_lesson_id", id.clone()),
                    ("phase", phase.as_str_name().to_owned()),
                    ("generation", generation.to_string()),
                ],
            ));
        }
        let _running = {
            let mut checking = self.checking.lock().unwrap_or_else(|p| p.into_inner());
            if !checking.insert(id.clone()) {
                return Err(errors::agent(
                    ErrorReason::ChecksRunning,
                    format!("a run of live lesson `{id}` is already going on; one at a time"),
                    [("live_lesson_id", id.clone())],
                ));
            }
            Running {
                checking: &self.checking,
                id: id.clone(),
            }
        };
        let results = self
            .backend
            .run_checks(&held, &request.files, checks::requested(request.timeout))
            .await?;
        if results.len() != request.files.len() {
            return Err(errors::agent(
                ErrorReason::BackendError,
                format!(
                    "the backend answered {} results for {} files",
                    results.len(),
                    request.files.len()
                ),
                [],
            ));
        }
        Ok(proto::RunChecksResponse { results })
    }

    fn check(&self, spec: Option<proto::LessonSpec>) -> Result<proto::LessonSpec, Status> {
        let spec = spec.ok_or_else(|| errors::invalid("spec", "missing"))?;
        spec::check(&spec, &self.description.capabilities)?;
        self.backend.check(&spec)?;
        Ok(spec)
    }

    /// Whether the backend holds objects of a live lesson.
    async fn exists(&self, id: &str) -> Result<bool, Status> {
        let selector = HashMap::from([(labels::LIVE_LESSON.to_owned(), id.to_owned())]);
        let found = !self.backend.discover(&selector).await?.is_empty();
        self.metrics.looked(found);
        Ok(found)
    }

    /// Records `spec` as the newest and starts its driver (replacing an older one).
    /// Returns whether the work goes on in a task (it did not finish on its first step).
    fn drive(self: &Arc<Self>, spec: proto::LessonSpec, start: Start) -> bool {
        let id = spec.live_lesson_id.clone();
        let report = Reporter::new(self.book.clone(), id.clone(), spec.generation);
        let backend = self.backend.clone();
        let metrics = self.metrics.clone();
        // A child of the calling RPC's span: the work belongs to the scheduler's trace.
        let span = tracing::info_span!(
            "realise",
            live_lesson.id = %id,
            generation = spec.generation,
            stage = spec.stage,
            start = ?start,
        );
        let mut work = Box::pin(
            {
                let spec = spec.clone();
                async move {
                    let stage = spec.stage;
                    let started = std::time::Instant::now();
                    // The spec passed the protocol's checks: what a domain value cannot hold
                    // was refused there already, so this is FAILED only in theory.
                    let realised = match Lesson::try_from(spec) {
                        Ok(lesson) => backend.realise(lesson, start, report.clone()).await,
                        Err(status) => Err(status.message().to_owned()),
                    };
                    match realised {
                        Ok(endpoints) => {
                            metrics.realised(true, started);
                            report.update(|s| {
                                s.phase = Phase::Ready as i32;
                                s.reason = format!("stage {stage} ready");
                                s.endpoints = endpoints;
                            });
                        }
                        Err(reason) => {
                            metrics.realised(false, started);
                            tracing::warn!(%reason, "live lesson failed");
                            report.phase(Phase::Failed, reason);
                        }
                    }
                }
            }
            .instrument(span),
        );
        // One step here, in the Provision call: work that needs no waiting (a backend with
        // nothing to create, objects already there) is READY in Provision's own answer, and
        // the scheduler records it without waiting for a Watch event. Whatever waits goes on
        // in a task; its first poll there registers the real waker in place of this no-op one.
        // The older generation's driver stops first: its reports would be dropped anyway.
        if let Some(driver) = self.work().get(&id).and_then(|old| old.driver.as_ref()) {
            driver.abort();
        }
        let driver = match first_step(work.as_mut()) {
            std::task::Poll::Ready(()) => None,
            std::task::Poll::Pending => Some(tokio::spawn(work)),
        };
        let pending = driver.is_some();
        self.work().insert(id, Work { spec, driver });
        pending
    }

    /// Stores `state`, the first of a generation, and starts its driver; returns the state to
    /// answer Provision with. Watchers hear of `state` only if the driver did not finish on its
    /// first step: otherwise its READY (or FAILED) replaced it already, and the passing state
    /// would only be one more event to every watcher and a wait for the scheduler.
    fn start(
        self: &Arc<Self>,
        spec: proto::LessonSpec,
        start: Start,
        state: proto::LiveLessonState,
    ) -> proto::LiveLessonState {
        let id = spec.live_lesson_id.clone();
        let state = self.book.put_quietly(state);
        if self.drive(spec, start) {
            // Re-stored at a new revision, so that it reaches watchers in order (the driver may
            // have moved it on already: then this repeats its newest state).
            return self.book.update(&id, |_| {}).unwrap_or(state);
        }
        // READY already: the answer. FAILED already: watchers heard it, but Provision never
        // answers FAILED (PROTOCOL.md [P1]: failures come on the state), so the answer is the
        // state it started from, older than the failure.
        match self.book.get(&id) {
            Some(now) if now.phase == Phase::Ready as i32 => now,
            _ => state,
        }
    }

    async fn provision(
        self: &Arc<Self>,
        spec: proto::LessonSpec,
        new_live_lesson: bool,
    ) -> Result<proto::LiveLessonState, Status> {
        let id = spec.live_lesson_id.clone();
        let _turn = self.turn(&id).await;
        let held = self.work().get(&id).map(|w| w.spec.clone());
        if let Some(held) = held
            && let Some(current) = self.book.get(&id)
        {
            if spec.generation < held.generation {
                return Err(errors::agent(
                    ErrorReason::GenerationOutdated,
                    format!(
                        "generation {} of live lesson {id} is older than generation {} held here",
                        spec.generation, held.generation
                    ),
                    [
                        ("live_lesson_id", id.clone()),
                        ("generation", spec.generation.to_string()),
                        ("held_generation", held.generation.to_string()),
                    ],
                ));
            }
            if spec.generation == held.generation {
                if spec != held {
                    return Err(errors::agent(
                        ErrorReason::SpecConflict,
                        format!(
                            "live lesson {id} generation {} was provisioned with another spec",
                            spec.generation
                        ),
                        [
                            ("live_lesson_id", id.clone()),
                            ("generation", spec.generation.to_string()),
                        ],
                    ));
                }
                return Ok(current);
            }
            // Only the stage and what goes with it change between generations.
            spec::same_lesson(&held, &spec)?;
            // A newer generation changes the live lesson in place; after a failed creation
            // (nothing placed yet), it creates again: every step finds what exists.
            let created = current
                .endpoints
                .iter()
                .any(|e| e.presentations.iter().any(|p| !p.address.is_empty()));
            let start = if created || current.phase != Phase::Failed as i32 {
                Start::Change
            } else {
                Start::Create
            };
            let mut state = spec::initial_state(
                &spec,
                Phase::Configuring,
                format!("changing to stage {}", spec.stage),
            );
            state.endpoints = current.endpoints;
            return Ok(self.start(spec, start, state));
        }
        let max = self.description.max_live_lessons;
        if max > 0 && self.work().len() as u32 >= max {
            return Err(errors::agent(
                ErrorReason::CapacityExhausted,
                format!(
                    "{} holds {max} live lessons, its limit",
                    self.description.name
                ),
                [("max_live_lessons", max.to_string())],
            ));
        }
        // Unknown here but present in the backend (this agent restarted): adopt, never duplicate.
        // A live lesson the scheduler calls new has nothing to adopt (PROTOCOL.md [P9]): no look (Create
        // finds what exists anyway).
        let (start, phase, reason) = if !new_live_lesson && self.exists(&id).await? {
            (
                Start::Adopt,
                Phase::Configuring,
                "adopting existing objects",
            )
        } else {
            (Start::Create, Phase::Pending, "accepted")
        };
        let state = spec::initial_state(&spec, phase, reason);
        Ok(self.start(spec, start, state))
    }

    async fn deprovision(&self, id: &str) -> Result<(), Status> {
        let _turn = self.turn(id).await;
        let work = self.work().remove(id);
        let mut interrupted = false;
        if let Some(work) = work {
            // Stop the driver and wait until it has stopped: a task running on another worker
            // thread finishes its current step first, and whatever that step creates must exist
            // before the removal below looks for it (PROTOCOL.md [D2]).
            if let Some(driver) = work.driver {
                interrupted = !driver.is_finished();
                driver.abort();
                let _ = driver.await;
            }
        }
        // One step of the removal first: watchers hear TERMINATING only when it has to wait
        // (a backend with nothing to remove is done at once, and the deletion says it all).
        let mut removal = std::pin::pin!(self.backend.remove(id));
        let removed = match first_step(removal.as_mut()) {
            std::task::Poll::Ready(removed) => removed,
            std::task::Poll::Pending => {
                self.book.update(id, |s| {
                    s.phase = Phase::Terminating as i32;
                    s.reason = "removing".into();
                });
                removal.await
            }
        };
        removed?;
        if interrupted {
            // A request the stopped driver had already sent (a container being created) is
            // still carried out by the backend after the removal looked: look again once it
            // has had time to land. Only for lessons removed while being realised.
            for pause in LATE_OBJECTS {
                tokio::time::sleep(pause).await;
                self.backend.remove(id).await?;
            }
        }
        self.book.remove(id);
        self.turns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        Ok(())
    }

    async fn list(&self, request: &proto::ListRequest) -> Result<proto::ListResponse, Status> {
        // The backend is the truth: live lessons it holds that this process does not know (it
        // restarted and nobody recovered them yet) are listed from their labels.
        let found = self
            .backend
            .discover(&request.label_selector)
            .await?
            .into_iter()
            .filter_map(|labels| {
                let id = labels.get(labels::LIVE_LESSON)?.clone();
                let generation = labels
                    .get(labels::GENERATION)
                    .and_then(|g| g.parse().ok())
                    .unwrap_or(0);
                Some(proto::LiveLessonState {
                    live_lesson_id: id.clone(),
                    generation,
                    phase: Phase::Booting as i32,
                    reason: "found in the backend; not recovered yet".into(),
                    handle: id.into_bytes().into(),
                    labels,
                    ..Default::default()
                })
            })
            .collect();
        Ok(self.book.list_with(request, found))
    }

    async fn recover(
        self: &Arc<Self>,
        request: proto::RecoverRequest,
    ) -> Result<proto::LiveLessonState, Status> {
        let id = request.live_lesson_id;
        // The spec is required, whatever the id (PROTOCOL.md [A4]).
        let spec = self.check(request.spec)?;
        if spec.live_lesson_id != id {
            return Err(errors::invalid(
                "spec.live_lesson_id",
                format!(
                    "`{}` is not the recovered live lesson {id}",
                    spec.live_lesson_id
                ),
            ));
        }
        let turn = self.turn(&id).await;
        if self.work().contains_key(&id) {
            // Held here: the Provision table answers (PROTOCOL.md [A1]).
            drop(turn);
            return self.provision(spec, false).await;
        }
        if !self.exists(&id).await? {
            self.book.remove(&id);
            return Err(errors::agent(
                ErrorReason::LiveLessonNotFound,
                format!("live lesson {id} has no objects in this backend"),
                [("live_lesson_id", id.clone())],
            ));
        }
        let state = self.book.put(spec::initial_state(
            &spec,
            Phase::Configuring,
            "adopting existing objects",
        ));
        self.drive(spec, Start::Adopt);
        Ok(state)
    }
}

#[cfg(feature = "entrypoint")]
#[tonic::async_trait]
impl<B: Backend> Lessons for Agent<B> {
    async fn resolve(
        &self,
        live_lesson: &str,
        endpoint: &str,
        presentation: &str,
    ) -> Option<entrypoint::Target> {
        let spec = self.work().get(live_lesson).map(|w| w.spec.clone())?;
        let wanted = spec.endpoints.iter().find(|e| e.name == endpoint)?;
        let declared = wanted
            .presentations
            .iter()
            .find(|p| p.name == presentation)?;
        let state = self.book.get(live_lesson)?;
        let reported = state.endpoints.iter().find(|e| e.name == endpoint)?;
        let at = reported
            .presentations
            .iter()
            .find(|p| p.name == presentation)?;
        let addr = self
            .backend
            .reach(live_lesson, reported, declared, at)
            .await?;
        let kind = match declared.r#type() {
            proto::PresentationType::Http => entrypoint::Kind::Http,
            proto::PresentationType::Ssh => {
                let image = wanted.image.clone().unwrap_or_default();
                entrypoint::Kind::Ssh {
                    user: image.ssh_user,
                    password: image.ssh_password,
                }
            }
            proto::PresentationType::Unspecified => return None,
        };
        Some(entrypoint::Target { addr, kind })
    }

    fn active(&self, live_lesson: &str, at: std::time::SystemTime) {
        self.book.update(live_lesson, |s| {
            s.last_active = Some(prost_types::Timestamp::from(at));
        });
    }

    fn owner(&self, live_lesson: &str) -> Option<String> {
        self.work()
            .get(live_lesson)
            .and_then(|w| w.spec.labels.get(labels::INSTANCE).cloned())
    }
}

/// A live lesson's place among the runs going on, given back on drop.
struct Running<'a> {
    /// The runs going on.
    checking: &'a Mutex<std::collections::HashSet<String>>,
    /// The live lesson.
    id: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.checking
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// The generated service trait, implemented over an [`Agent`].
pub struct AgentService<B>(Arc<Agent<B>>);

impl<B> Clone for AgentService<B> {
    fn clone(&self) -> Self {
        AgentService(self.0.clone())
    }
}

#[tonic::async_trait]
impl<B: Backend> BackendRpc for AgentService<B> {
    async fn handshake(
        &self,
        request: Request<proto::HandshakeRequest>,
    ) -> Result<Response<proto::HandshakeResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("Handshake", async move {
                let request = request.into_inner();
                let d = &agent.description;
                let Some(major) = d
                    .majors
                    .iter()
                    .copied()
                    .filter(|m| request.supported_majors.contains(m))
                    .max()
                else {
                    let list = |majors: &[u32]| {
                        majors
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(",")
                    };
                    return Err(errors::agent(
                        ErrorReason::NoCommonMajor,
                        format!(
                            "no common major version: the scheduler speaks {:?}, {} speaks {:?}",
                            request.supported_majors, d.name, d.majors
                        ),
                        [
                            ("scheduler_majors", list(&request.supported_majors)),
                            ("agent_majors", list(&d.majors)),
                        ],
                    ));
                };
                Ok(Response::new(proto::HandshakeResponse {
                    major,
                    agent_name: d.name.clone(),
                    build_version: d.version.clone(),
                    instance_id: agent.instance_id.clone(),
                    capabilities: offered(&d.capabilities),
                    capacity: Some(proto::Capacity {
                        max_live_lessons: d.max_live_lessons,
                        live_lessons: agent.work().len() as u32,
                    }),
                    labels: d.labels.clone(),
                    entrypoint_url: agent.entrypoint_url(&request),
                }))
            })
            .await
    }

    async fn plan(
        &self,
        request: Request<proto::PlanRequest>,
    ) -> Result<Response<proto::PlanResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("Plan", async move {
                let spec = agent.check(request.into_inner().spec)?;
                Ok(Response::new(agent.backend.plan(&spec).await?))
            })
            .await
    }

    async fn provision(
        &self,
        request: Request<proto::ProvisionRequest>,
    ) -> Result<Response<proto::ProvisionResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("Provision", async move {
                let request = request.into_inner();
                let spec = agent.check(request.spec)?;
                let state = agent.provision(spec, request.new_live_lesson).await?;
                Ok(Response::new(proto::ProvisionResponse {
                    state: Some(state),
                }))
            })
            .await
    }

    async fn deprovision(
        &self,
        request: Request<proto::DeprovisionRequest>,
    ) -> Result<Response<proto::DeprovisionResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("Deprovision", async move {
                let id = request.into_inner().live_lesson_id;
                // An id that is not a UUID names nothing held, and never reaches the backend's
                // names or paths (PROTOCOL.md [G4]).
                if spec::is_uuid(&id) {
                    agent.deprovision(&id).await?;
                }
                Ok(Response::new(proto::DeprovisionResponse { gone: true }))
            })
            .await
    }

    async fn get(
        &self,
        request: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("Get", async move {
                let id = request.into_inner().live_lesson_id;
                let state = agent.book.get(&id).ok_or_else(|| {
                    errors::agent(
                        ErrorReason::LiveLessonNotFound,
                        format!("live lesson `{id}` is not held by this agent"),
                        [("live_lesson_id", id.clone())],
                    )
                })?;
                Ok(Response::new(proto::GetResponse { state: Some(state) }))
            })
            .await
    }

    async fn list(
        &self,
        request: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("List", async move {
                Ok(Response::new(agent.list(&request.into_inner()).await?))
            })
            .await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<proto::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new(self.0.book.watch(request.into_inner())))
    }

    async fn recover(
        &self,
        request: Request<proto::RecoverRequest>,
    ) -> Result<Response<proto::RecoverResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("Recover", async move {
                let state = agent.recover(request.into_inner()).await?;
                Ok(Response::new(proto::RecoverResponse { state: Some(state) }))
            })
            .await
    }

    async fn run_checks(
        &self,
        request: Request<proto::RunChecksRequest>,
    ) -> Result<Response<proto::RunChecksResponse>, Status> {
        let agent = self.0.clone();
        agent
            .metrics
            .clone()
            .rpc("RunChecks", async move {
                Ok(Response::new(agent.run_checks(request.into_inner()).await?))
            })
            .await
    }
}

/// The capabilities a handshake offers: the backend's, plus `watch.pages` with `watch` (the
/// [`StateBook`] pages snapshots for every agent, PROTOCOL.md [W8]).
fn offered(capabilities: &[String]) -> Vec<String> {
    let mut offered = capabilities.to_vec();
    if offered.iter().any(|c| c == super::capabilities::WATCH)
        && !offered
            .iter()
            .any(|c| c == super::capabilities::WATCH_PAGES)
    {
        offered.push(super::capabilities::WATCH_PAGES.to_owned());
    }
    offered
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::tests::next;
    use antidote_proto::agent::v1::{WatchEvent, WatchRequest, watch_event::Event};

    /// A backend whose realisation and removal are done at once, or wait for `gate`, or fail
    /// at once, by the lesson's slug.
    #[derive(Default)]
    struct Scripted {
        gate: Arc<tokio::sync::Notify>,
    }

    /// The runtime is under test, not the pipeline (`pipeline::tests`): its steps are never
    /// taken.
    #[tonic::async_trait]
    impl Steps for Scripted {
        type Objects = ();

        fn limits(&self) -> crate::pipeline::Limits {
            crate::pipeline::Limits::default()
        }

        async fn create(&self, _: &Lesson, _: &Reporter) -> Result<(), Error> {
            unreachable!("realise is the script's")
        }

        async fn addresses(
            &self,
            _: &Lesson,
            _: &(),
            _: &Reporter,
        ) -> Result<Vec<crate::pipeline::Placement>, Error> {
            unreachable!("realise is the script's")
        }

        async fn configure(
            &self,
            _: &Lesson,
            _: &(),
            _: usize,
            _: std::time::Duration,
        ) -> Result<crate::pipeline::Attempt, Error> {
            unreachable!("realise is the script's")
        }

        async fn realise(
            &self,
            lesson: Lesson,
            _start: Start,
            _report: Reporter,
        ) -> Result<Vec<proto::EndpointState>, String> {
            match lesson.slug.as_str() {
                "waits" => self.gate.notified().await,
                "fails" => return Err("no such image".into()),
                _ => {}
            }
            Ok(vec![])
        }
    }

    #[tonic::async_trait]
    impl Backend for Scripted {
        fn describe(&self) -> Description {
            Description::new("scripted", "0", &[])
        }

        async fn remove(&self, live_lesson_id: &str) -> Result<(), Error> {
            if live_lesson_id.starts_with("slow") {
                self.gate.notified().await;
            }
            Ok(())
        }
    }

    fn spec(id: &str, lesson: &str) -> proto::LessonSpec {
        proto::LessonSpec {
            live_lesson_id: id.into(),
            lesson_slug: lesson.into(),
            generation: 1,
            ..Default::default()
        }
    }

    /// The phase of a Changed event, or "deleted".
    fn seen(event: &WatchEvent) -> String {
        match &event.event {
            Some(Event::Changed(state)) => format!(
                "{} {:?}",
                state.live_lesson_id,
                Phase::try_from(state.phase).unwrap_or(Phase::Unspecified)
            ),
            Some(Event::Deleted(deleted)) => format!("{} deleted", deleted.live_lesson_id),
            other => format!("{other:?}"),
        }
    }

    async fn watching(agent: &Arc<Agent<Scripted>>) -> WatchStream {
        let mut stream = agent.book.watch(WatchRequest::default());
        let first = next(&mut stream).await;
        assert!(matches!(first.event, Some(Event::Snapshot(_))), "{first:?}");
        stream
    }

    #[tokio::test]
    async fn work_with_nothing_to_wait_for_is_ready_in_provisions_answer_with_no_passing_events() {
        let agent = Agent::new(Scripted::default());
        let mut stream = watching(&agent).await;
        let answered = agent.provision(spec("a", "instant"), true).await.unwrap();
        assert_eq!(answered.phase, Phase::Ready as i32, "{answered:?}");
        let event = next(&mut stream).await;
        assert_eq!(seen(&event), "a Ready");
        assert_eq!(event.revision, answered.revision);
        agent.deprovision("a").await.unwrap();
        let event = next(&mut stream).await;
        assert_eq!(seen(&event), "a deleted", "no TERMINATING before it");
        assert!(event.revision > answered.revision);
    }

    #[tokio::test]
    async fn work_that_waits_answers_its_first_state_and_watchers_see_every_one() {
        let backend = Scripted::default();
        let gate = backend.gate.clone();
        let agent = Agent::new(backend);
        let mut stream = watching(&agent).await;
        let answered = agent
            .provision(spec("slow-a", "waits"), true)
            .await
            .unwrap();
        assert_eq!(answered.phase, Phase::Pending as i32, "{answered:?}");
        let pending = next(&mut stream).await;
        assert_eq!(seen(&pending), "slow-a Pending");
        assert_eq!(pending.revision, answered.revision);
        gate.notify_one();
        let ready = next(&mut stream).await;
        assert_eq!(seen(&ready), "slow-a Ready");
        assert!(ready.revision > pending.revision);
        let removing = tokio::spawn({
            let agent = agent.clone();
            async move { agent.deprovision("slow-a").await }
        });
        let terminating = next(&mut stream).await;
        assert_eq!(seen(&terminating), "slow-a Terminating");
        gate.notify_one();
        removing.await.unwrap().unwrap();
        assert_eq!(seen(&next(&mut stream).await), "slow-a deleted");
    }

    #[tokio::test]
    async fn work_failing_on_its_first_step_is_never_provisions_answer() {
        let agent = Agent::new(Scripted::default());
        let mut stream = watching(&agent).await;
        let answered = agent.provision(spec("b", "fails"), true).await.unwrap();
        assert_eq!(answered.phase, Phase::Pending as i32, "[P1]: {answered:?}");
        let failed = next(&mut stream).await;
        assert_eq!(seen(&failed), "b Failed");
        assert!(failed.revision > answered.revision);
        assert_eq!(
            agent.book.get("b").map(|s| s.phase),
            Some(Phase::Failed as i32)
        );
    }
}
