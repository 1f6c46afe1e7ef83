//! The `antidote.agent.v1` service of agent-docker.
//!
//! Provision records the spec and starts a driver task for the generation; the driver creates
//! (or finds) the Docker objects, runs the stage's configuration by exec (retried), probes every
//! presentation from the host through its published port, waits the ready delay, and reports
//! READY, or FAILED with a reason that quotes the engine or the configuration's output. Every
//! state change goes through the state book, which answers Get/List/Watch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_proto::agent::v1::backend_server::Backend;
use antidote_proto::sdk::{StateBook, WatchStream};
use bollard::Docker;
use futures::StreamExt;
use proto::{Phase, PresentationType};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use crate::engine::{self, EngineError, LABEL_ENDPOINT, LABEL_LIVE_LESSON};
use crate::probe::{self, Expect};
use crate::settings::Settings;

/// The capabilities agent-docker offers.
pub const CAPABILITIES: &[&str] = &[
    "presentation.ssh",
    "presentation.http",
    "stage.configuration",
    "network.isolation",
    "plan",
    "watch",
    "recover",
];

/// The agent.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

struct Inner {
    docker: Docker,
    settings: Settings,
    /// New on every start (handshake).
    instance_id: String,
    /// What Get/List/Watch answer.
    book: Arc<StateBook>,
    /// Per live lesson: the newest spec and the task driving it.
    work: Mutex<HashMap<String, Work>>,
}

struct Work {
    spec: proto::LessonSpec,
    driver: Option<JoinHandle<()>>,
}

/// How a driver starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Create (or find) every object, then configure.
    Create,
    /// Objects exist: configure the new stage.
    Configure,
}

impl Agent {
    /// An agent driving `docker`.
    pub fn new(docker: Docker, settings: Settings) -> Agent {
        Agent {
            inner: Arc::new(Inner {
                docker,
                settings,
                instance_id: uuid::Uuid::new_v4().to_string(),
                book: Arc::new(StateBook::default()),
                work: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn work(&self) -> std::sync::MutexGuard<'_, HashMap<String, Work>> {
        // Every critical section is a single map operation; a poisoned lock is still consistent.
        self.inner.work.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Follows the engine's container events: a container of a READY live lesson that dies
    /// (or is killed for memory) turns the live lesson FAILED with the reason.
    pub async fn follow_events(self, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            let options = bollard::query_parameters::EventsOptions {
                filters: Some(HashMap::from([
                    ("type".to_owned(), vec!["container".to_owned()]),
                    (
                        "label".to_owned(),
                        vec![format!("{}=agent-docker", engine::LABEL_MANAGED)],
                    ),
                ])),
                ..Default::default()
            };
            let mut events = self.inner.docker.events(Some(options));
            loop {
                let event = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    event = events.next() => event,
                };
                let Some(Ok(event)) = event else { break };
                let action = event.action.unwrap_or_default();
                if !matches!(action.as_str(), "die" | "oom") {
                    continue;
                }
                let attributes = event.actor.and_then(|a| a.attributes).unwrap_or_default();
                let (Some(id), Some(endpoint)) = (
                    attributes.get(LABEL_LIVE_LESSON),
                    attributes.get(LABEL_ENDPOINT),
                ) else {
                    continue;
                };
                let exit = attributes.get("exitCode").cloned().unwrap_or_default();
                self.inner.book.update(id, |state| {
                    if state.phase == Phase::Ready as i32 {
                        state.phase = Phase::Failed as i32;
                        state.reason = if action == "oom" {
                            format!("endpoint `{endpoint}` ran out of memory")
                        } else {
                            format!("endpoint `{endpoint}` stopped (exit code {exit})")
                        };
                    }
                });
            }
            // The event stream broke (engine restart?): reconnect after a pause.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Starts (or restarts) the driver of a live lesson's newest spec.
    fn drive(&self, spec: proto::LessonSpec, start: Start) {
        let agent = self.clone();
        let id = spec.live_lesson_id.clone();
        let task = tokio::spawn({
            let spec = spec.clone();
            async move { agent.run(spec, start).await }
        });
        let mut work = self.work();
        let entry = work.entry(id).or_insert(Work {
            spec: spec.clone(),
            driver: None,
        });
        entry.spec = spec;
        if let Some(old) = entry.driver.replace(task) {
            old.abort();
        }
    }

    /// Takes one generation to READY or FAILED.
    async fn run(&self, spec: proto::LessonSpec, start: Start) {
        let id = spec.live_lesson_id.clone();
        let generation = spec.generation;
        match self.realise(&spec, start).await {
            Ok(()) => {}
            Err(reason) => {
                tracing::warn!(live_lesson.id = %id, %reason, "live lesson failed");
                self.inner.book.update(&id, |s| {
                    if s.generation == generation {
                        s.phase = Phase::Failed as i32;
                        s.reason = reason;
                    }
                });
            }
        }
    }

    fn set(&self, spec: &proto::LessonSpec, change: impl FnOnce(&mut proto::LiveLessonState)) {
        self.inner.book.update(&spec.live_lesson_id, |s| {
            if s.generation == spec.generation {
                change(s);
            }
        });
    }

    async fn realise(&self, spec: &proto::LessonSpec, start: Start) -> Result<(), String> {
        let docker = &self.inner.docker;
        let settings = &self.inner.settings;
        let id = &spec.live_lesson_id;
        if start == Start::Create {
            // A missing image surfaces from the container's creation (404), named there.
            self.set(spec, |s| {
                s.phase = Phase::Booting as i32;
                s.reason = "creating networks and containers".into();
            });
        }
        let placed = match start {
            Start::Create => engine::create(docker, settings, spec).await,
            Start::Configure => self.locate(spec).await,
        }
        .map_err(|err| err.to_string())?;
        let endpoints = endpoint_states(spec, &placed);
        self.set(spec, |s| {
            s.phase = Phase::Configuring as i32;
            s.reason = format!("configuring stage {}", spec.stage);
            s.endpoints = endpoints.clone();
        });

        for endpoint in &spec.endpoints {
            let Some(configuration) = &endpoint.configuration else {
                continue;
            };
            if configuration.r#type != proto::ConfigurationType::Shell as i32 {
                return Err(format!(
                    "endpoint `{}`: configuration type {:?} is not supported by agent-docker (only shell scripts run in containers)",
                    endpoint.name,
                    proto::ConfigurationType::try_from(configuration.r#type)
                        .unwrap_or(proto::ConfigurationType::Unspecified)
                ));
            }
            let script = String::from_utf8_lossy(&configuration.contents);
            let container = engine::container_name(id, &endpoint.name);
            let mut last = String::new();
            let mut done = false;
            for attempt in 1..=settings.config_tries.max(1) {
                match engine::exec_shell(docker, &container, &script).await {
                    Ok((0, _)) => {
                        done = true;
                        break;
                    }
                    Ok((code, output)) => {
                        last = format!("exit code {code}: {}", tail(&output, 2000));
                    }
                    Err(err) => last = err.to_string(),
                }
                tracing::warn!(live_lesson.id = %id, endpoint = %endpoint.name, attempt, "configuration failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if !done {
                return Err(format!(
                    "configuration {} of endpoint `{}` for stage {} failed {} times; last: {last}",
                    configuration.file_name,
                    endpoint.name,
                    spec.stage,
                    settings.config_tries.max(1)
                ));
            }
        }

        // Readiness, from the host through the published ports.
        let deadline = tokio::time::Instant::now() + settings.probe_timeout;
        let mut states = endpoints;
        for (endpoint, state) in spec.endpoints.iter().zip(states.iter_mut()) {
            for presentation in &endpoint.presentations {
                let Some(address) = placed
                    .get(&endpoint.name)
                    .and_then(|p| p.published.get(&(presentation.port as u16)))
                else {
                    return Err(format!(
                        "endpoint `{}` port {} was not published",
                        endpoint.name, presentation.port
                    ));
                };
                let expect = match PresentationType::try_from(presentation.r#type) {
                    Ok(PresentationType::Ssh) => Expect::SshBanner,
                    Ok(PresentationType::Http) => Expect::Http,
                    _ => Expect::Tcp,
                };
                probe::until_ready(address, expect, deadline).await.map_err(|last| {
                    format!(
                        "endpoint `{}` presentation `{}` ({:?} at {address}) not ready within {:?}: {last}",
                        endpoint.name, presentation.name, expect, settings.probe_timeout
                    )
                })?;
                state.healthy += 1;
            }
        }
        let delay = spec
            .ready_delay
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
            .unwrap_or_default()
            + settings.ready_delay;
        if !delay.is_zero() {
            self.set(spec, |s| {
                s.reason = format!("reachable; waiting the ready delay of {delay:?}");
                s.endpoints = states.clone();
            });
            tokio::time::sleep(delay).await;
        }
        self.set(spec, |s| {
            s.phase = Phase::Ready as i32;
            s.reason = format!("stage {} ready", spec.stage);
            s.endpoints = states;
        });
        Ok(())
    }

    /// Where an existing live lesson's endpoints are (for stage changes and recovery).
    async fn locate(
        &self,
        spec: &proto::LessonSpec,
    ) -> Result<HashMap<String, engine::Placed>, EngineError> {
        let lesson_net = engine::lesson_network(&spec.live_lesson_id);
        let mut placed = HashMap::new();
        for endpoint in &spec.endpoints {
            let name = engine::container_name(&spec.live_lesson_id, &endpoint.name);
            placed.insert(
                endpoint.name.clone(),
                engine::inspect(&self.inner.docker, &name, &lesson_net).await?,
            );
        }
        Ok(placed)
    }

    /// Whether the engine holds containers of this live lesson.
    async fn exists(&self, id: &str) -> Result<bool, Status> {
        let selector = HashMap::from([(LABEL_LIVE_LESSON.to_owned(), id.to_owned())]);
        let found = engine::containers(&self.inner.docker, &selector)
            .await
            .map_err(unavailable)?;
        Ok(!found.is_empty())
    }

    fn initial_state(
        &self,
        spec: &proto::LessonSpec,
        phase: Phase,
        reason: &str,
    ) -> proto::LiveLessonState {
        proto::LiveLessonState {
            live_lesson_id: spec.live_lesson_id.clone(),
            generation: spec.generation,
            stage: spec.stage,
            phase: phase as i32,
            reason: reason.into(),
            endpoints: spec
                .endpoints
                .iter()
                .map(|e| proto::EndpointState {
                    name: e.name.clone(),
                    total: e.presentations.len() as u32,
                    ..Default::default()
                })
                .collect(),
            handle: spec.live_lesson_id.clone().into_bytes().into(),
            conditions: vec![],
            labels: engine::labels(spec),
            revision: 0,
        }
    }
}

/// Endpoint states with published addresses (healthy counts start at 0).
fn endpoint_states(
    spec: &proto::LessonSpec,
    placed: &HashMap<String, engine::Placed>,
) -> Vec<proto::EndpointState> {
    spec.endpoints
        .iter()
        .map(|endpoint| {
            let place = placed.get(&endpoint.name).cloned().unwrap_or_default();
            proto::EndpointState {
                name: endpoint.name.clone(),
                presentations: endpoint
                    .presentations
                    .iter()
                    .map(|p| {
                        let address = place
                            .published
                            .get(&(p.port as u16))
                            .cloned()
                            .unwrap_or_default();
                        proto::PresentationState {
                            name: p.name.clone(),
                            r#type: p.r#type,
                            url: if p.r#type == PresentationType::Http as i32 {
                                format!("http://{address}/")
                            } else {
                                String::new()
                            },
                            address,
                        }
                    })
                    .collect(),
                healthy: 0,
                total: endpoint.presentations.len() as u32,
                internal_address: place.internal_address,
            }
        })
        .collect()
}

fn tail(text: &str, max: usize) -> String {
    let text = text.trim();
    if text.len() <= max {
        return text.to_owned();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

fn unavailable(err: EngineError) -> Status {
    Status::unavailable(err.to_string())
}

/// Checks a spec; every problem names its field.
fn validate(spec: &proto::LessonSpec) -> Result<(), Status> {
    let bad = |field: String, why: &str| Err(Status::invalid_argument(format!("{field}: {why}")));
    if uuid::Uuid::try_parse(&spec.live_lesson_id).is_err() {
        return bad("spec.live_lesson_id".into(), "must be a UUID");
    }
    if spec.generation == 0 {
        return bad("spec.generation".into(), "must be at least 1");
    }
    if spec.endpoints.is_empty() {
        return bad("spec.endpoints".into(), "must not be empty");
    }
    for (i, endpoint) in spec.endpoints.iter().enumerate() {
        let valid_name = !endpoint.name.is_empty()
            && endpoint.name.len() <= 40
            && endpoint
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !valid_name {
            return bad(
                format!("spec.endpoints[{i}].name"),
                "must be 1-40 of a-z, 0-9 and -",
            );
        }
        if endpoint
            .image
            .as_ref()
            .is_none_or(|image| image.slug.is_empty())
        {
            return bad(format!("spec.endpoints[{i}].image.slug"), "is empty");
        }
        for (j, p) in endpoint.presentations.iter().enumerate() {
            if p.port == 0 || p.port > 65535 {
                return bad(
                    format!("spec.endpoints[{i}].presentations[{j}].port"),
                    "must be 1..65535",
                );
            }
            if !matches!(
                PresentationType::try_from(p.r#type),
                Ok(PresentationType::Ssh | PresentationType::Http)
            ) {
                return bad(
                    format!("spec.endpoints[{i}].presentations[{j}].type"),
                    "must be SSH or HTTP",
                );
            }
        }
    }
    for (i, c) in spec.connections.iter().enumerate() {
        for end in [&c.a, &c.b] {
            if !spec.endpoints.iter().any(|e| &e.name == end) {
                return bad(
                    format!("spec.connections[{i}]"),
                    &format!("names unknown endpoint `{end}`"),
                );
            }
        }
    }
    Ok(())
}

#[tonic::async_trait]
impl Backend for Agent {
    async fn handshake(
        &self,
        request: Request<proto::HandshakeRequest>,
    ) -> Result<Response<proto::HandshakeResponse>, Status> {
        let request = request.into_inner();
        if !request.supported_majors.contains(&proto::MAJOR) {
            return Err(Status::failed_precondition(format!(
                "no common major version: the scheduler speaks {:?}, agent-docker speaks [{}]",
                request.supported_majors,
                proto::MAJOR
            )));
        }
        Ok(Response::new(proto::HandshakeResponse {
            major: proto::MAJOR,
            agent_name: "agent-docker".into(),
            build_version: env!("CARGO_PKG_VERSION").into(),
            instance_id: self.inner.instance_id.clone(),
            capabilities: CAPABILITIES.iter().map(|c| (*c).to_owned()).collect(),
            capacity: Some(proto::Capacity {
                max_live_lessons: self.inner.settings.max_live_lessons,
                live_lessons: self.inner.book.len() as u32,
            }),
            labels: HashMap::from([("backend".to_owned(), "docker".to_owned())]),
        }))
    }

    async fn plan(
        &self,
        request: Request<proto::PlanRequest>,
    ) -> Result<Response<proto::PlanResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec: missing"))?;
        validate(&spec)?;
        let id = &spec.live_lesson_id;
        let mut objects = vec![proto::PlannedObject {
            kind: "network".into(),
            name: engine::lesson_network(id),
            ports: vec![],
            detail: "bridge; every endpoint, reachable by name".into(),
        }];
        for (i, c) in spec.connections.iter().enumerate() {
            objects.push(proto::PlannedObject {
                kind: "network".into(),
                name: engine::connection_network(id, i),
                ports: vec![],
                detail: format!(
                    "internal link {}–{}{}",
                    c.a,
                    c.b,
                    if c.subnet.is_empty() {
                        String::new()
                    } else {
                        format!(" on {}", c.subnet)
                    }
                ),
            });
        }
        let mut diagnostics = Vec::new();
        for (i, e) in spec.endpoints.iter().enumerate() {
            let slug = e.image.as_ref().map(|i| i.slug.clone()).unwrap_or_default();
            let image = self.inner.settings.image(&slug);
            if let Err(err) = self.inner.docker.inspect_image(&image).await {
                diagnostics.push(proto::Diagnostic {
                    severity: proto::Severity::Error as i32,
                    field: format!("endpoints[{i}].image.slug"),
                    message: if engine::is_not_found(&err) {
                        format!("image `{image}` is not present on the engine")
                    } else {
                        err.to_string()
                    },
                });
            }
            objects.push(proto::PlannedObject {
                kind: "container".into(),
                name: engine::container_name(id, &e.name),
                ports: e
                    .presentations
                    .iter()
                    .map(|p| p.port)
                    .chain(e.additional_ports.iter().copied())
                    .collect(),
                detail: format!("image {image}"),
            });
        }
        Ok(Response::new(proto::PlanResponse {
            objects,
            diagnostics,
        }))
    }

    async fn provision(
        &self,
        request: Request<proto::ProvisionRequest>,
    ) -> Result<Response<proto::ProvisionResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec: missing"))?;
        validate(&spec)?;
        let id = spec.live_lesson_id.clone();
        let driven = self.work().contains_key(&id);
        if let Some(current) = self.inner.book.get(&id).filter(|_| driven) {
            if spec.generation < current.generation {
                return Err(Status::failed_precondition(format!(
                    "generation {} is older than generation {} held for live lesson {id}",
                    spec.generation, current.generation
                )));
            }
            if spec.generation == current.generation {
                return Ok(Response::new(proto::ProvisionResponse {
                    state: Some(current),
                }));
            }
            // A newer generation: a stage change on the existing objects (or, after a failed
            // creation, creation again: every step finds what exists).
            let start = if current.phase == Phase::Failed as i32
                && current
                    .endpoints
                    .iter()
                    .all(|e| e.presentations.iter().all(|p| p.address.is_empty()))
            {
                Start::Create
            } else {
                Start::Configure
            };
            let mut state = self.initial_state(&spec, Phase::Configuring, "stage change");
            state.endpoints = current.endpoints;
            let state = self.inner.book.put(state);
            self.drive(spec, start);
            return Ok(Response::new(proto::ProvisionResponse {
                state: Some(state),
            }));
        }
        if let Some(max) = std::num::NonZeroU32::new(self.inner.settings.max_live_lessons)
            && self.inner.book.len() as u32 >= max.get()
        {
            return Err(Status::resource_exhausted(format!(
                "agent-docker holds {} live lessons, its limit",
                max
            )));
        }
        // Unknown here but present on the engine (this agent restarted): adopt, never duplicate.
        let adopted = self.exists(&id).await?;
        let state = self.inner.book.put(self.initial_state(
            &spec,
            if adopted {
                Phase::Configuring
            } else {
                Phase::Pending
            },
            if adopted {
                "adopting existing containers"
            } else {
                "accepted"
            },
        ));
        self.drive(
            spec,
            if adopted {
                Start::Configure
            } else {
                Start::Create
            },
        );
        Ok(Response::new(proto::ProvisionResponse {
            state: Some(state),
        }))
    }

    async fn deprovision(
        &self,
        request: Request<proto::DeprovisionRequest>,
    ) -> Result<Response<proto::DeprovisionResponse>, Status> {
        let id = request.into_inner().live_lesson_id;
        if let Some(work) = self.work().remove(&id)
            && let Some(driver) = work.driver
        {
            driver.abort();
        }
        self.inner.book.update(&id, |s| {
            s.phase = Phase::Terminating as i32;
            s.reason = "removing containers and networks".into();
        });
        engine::remove(&self.inner.docker, &id)
            .await
            .map_err(unavailable)?;
        self.inner.book.remove(&id);
        Ok(Response::new(proto::DeprovisionResponse { gone: true }))
    }

    async fn get(
        &self,
        request: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let id = request.into_inner().live_lesson_id;
        let state = self.inner.book.get(&id).ok_or_else(|| {
            Status::not_found(format!("live lesson {id} is not held by this agent"))
        })?;
        Ok(Response::new(proto::GetResponse { state: Some(state) }))
    }

    async fn list(
        &self,
        request: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListResponse>, Status> {
        let request = request.into_inner();
        // The engine is the truth: live lessons with containers but not (yet) in the book (this
        // agent restarted and nobody recovered them) are listed from their labels.
        let docker = &self.inner.docker;
        let mut found: Vec<HashMap<String, String>> =
            engine::containers(docker, &request.label_selector)
                .await
                .map_err(unavailable)?
                .into_iter()
                .map(|(_, labels, _)| labels)
                .collect();
        found.extend(
            engine::network_lessons(docker, &request.label_selector)
                .await
                .map_err(unavailable)?,
        );
        for labels in found {
            let Some(id) = labels.get(LABEL_LIVE_LESSON) else {
                continue;
            };
            if self.inner.book.get(id).is_none() {
                let mut labels = labels.clone();
                labels.remove(LABEL_ENDPOINT);
                let generation = labels
                    .get("antidote.io/generation")
                    .and_then(|g| g.parse().ok())
                    .unwrap_or(0);
                self.inner.book.put(proto::LiveLessonState {
                    live_lesson_id: id.clone(),
                    generation,
                    phase: Phase::Booting as i32,
                    reason: "found on the engine; not recovered yet".into(),
                    handle: id.clone().into_bytes().into(),
                    labels,
                    ..Default::default()
                });
            }
        }
        Ok(Response::new(self.inner.book.list(&request)))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<proto::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new(self.inner.book.watch(request.into_inner())))
    }

    async fn recover(
        &self,
        request: Request<proto::RecoverRequest>,
    ) -> Result<Response<proto::RecoverResponse>, Status> {
        let request = request.into_inner();
        let id = request.live_lesson_id;
        if let Some(state) = self.inner.book.get(&id)
            && state.generation > 0
            && self.work().contains_key(&id)
        {
            return Ok(Response::new(proto::RecoverResponse { state: Some(state) }));
        }
        if !self.exists(&id).await? {
            self.inner.book.remove(&id);
            return Err(Status::not_found(format!(
                "live lesson {id} has no containers on this engine"
            )));
        }
        let spec = request.spec.ok_or_else(|| {
            Status::invalid_argument("spec: missing (needed to adopt the containers)")
        })?;
        validate(&spec)?;
        let state = self.inner.book.put(self.initial_state(
            &spec,
            Phase::Configuring,
            "adopting existing containers",
        ));
        self.drive(spec, Start::Configure);
        Ok(Response::new(proto::RecoverResponse { state: Some(state) }))
    }
}
