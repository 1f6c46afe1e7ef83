//! agent-docker's [`Backend`]: what a live lesson is on a Docker engine.
//!
//! The SDK's runtime applies the protocol's rules (generations, idempotency, adoption, Watch)
//! and calls [`Docker::realise`] once per generation: it creates (or finds) the Docker objects,
//! runs the stage's configuration by exec (retried), probes every presentation from the host
//! through its published port and waits the ready delay; an error is the FAILED reason, quoting
//! the engine or the configuration's output.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::pipeline::{Attempt, Limits, Placement, Steps};
use antidote_sdk::{Backend, Description, Error, Lesson, Reporter, StateBook, capabilities};
use futures::StreamExt;
use proto::Phase;
use tonic::Status;

use crate::configurator;
use crate::engine::{self, EngineError, LABEL_ENDPOINT, LABEL_LIVE_LESSON};
use crate::firewall::{Confinement, Firewall};
use crate::settings::Settings;

/// The condition saying whether a live lesson's networks are cut off from the engine's host.
pub const HOST_CONFINED: &str = "HostConfined";

/// The capabilities agent-docker offers.
pub const PROTOCOL_CAPABILITIES: &[&str] = &[
    capabilities::PRESENTATION_SSH,
    capabilities::PRESENTATION_HTTP,
    capabilities::STAGE_CONFIGURATION,
    capabilities::NETWORK_ISOLATION,
    capabilities::PLAN,
    capabilities::WATCH,
    capabilities::RECOVER,
    capabilities::CHECKS,
];

/// The Docker backend.
#[derive(Clone)]
pub struct Docker {
    docker: bollard::Docker,
    settings: Arc<Settings>,
    /// The host firewall confining lesson networks (or why it cannot).
    firewall: Arc<Firewall>,
    /// Whether the configurator image is there, so python, ansible and napalm run.
    configurator: bool,
    /// Whether the Jupyter image is there, so Jupyter guide endpoints run.
    jupyter: bool,
    /// Whether the entrypoint reaches containers at their own addresses.
    direct: Arc<Direct>,
}

/// Whether this agent reaches containers at their addresses on the lesson network (it runs in
/// the network namespace of the engine's host, where the lesson bridges are), found out by the
/// entrypoint's first connection and kept: then learners' bytes skip the port-publishing proxy
/// (docker-proxy) between the entrypoint and the container; otherwise (a remote engine, an agent
/// in a container of its own) they go through the published ports.
#[derive(Default)]
struct Direct(std::sync::atomic::AtomicU8);

impl Direct {
    const UNKNOWN: u8 = 0;
    const YES: u8 = 1;
    const NO: u8 = 2;

    async fn reaches(&self, addr: std::net::SocketAddr) -> bool {
        use std::sync::atomic::Ordering;
        match self.0.load(Ordering::Relaxed) {
            Self::YES => return true,
            Self::NO => return false,
            _ => {}
        }
        // A refusal is an answer from the container's kernel: the address is reachable.
        let reached = match tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(_)) => true,
            Ok(Err(err)) => err.kind() == std::io::ErrorKind::ConnectionRefused,
            Err(_) => false,
        };
        let found = if reached { Self::YES } else { Self::NO };
        if self
            .0
            .compare_exchange(Self::UNKNOWN, found, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            if reached {
                tracing::info!(%addr, "the entrypoint reaches containers at their own addresses");
            } else {
                tracing::info!(%addr, "containers are not reachable at their own addresses from here; the entrypoint uses their published ports");
            }
        }
        reached
    }
}

impl Docker {
    /// The backend of the engine Docker's own clients would use (`DOCKER_HOST`, else the
    /// default socket), its lesson networks confined as `settings` ask (see [`Firewall`];
    /// rules of lesson networks that are gone swept), offering the configuration types and
    /// Jupyter guides whose images the engine has.
    pub async fn start(settings: Settings) -> Result<Docker, Error> {
        let host = std::env::var("DOCKER_HOST").ok();
        let named = host.as_deref().unwrap_or("unix:///var/run/docker.sock");
        let docker = bollard::Docker::connect_with_defaults().map_err(|err| {
            Error::unavailable(format!("cannot use the Docker engine at {named}: {err}"))
        })?;
        let docker = docker.negotiate_version().await.map_err(|err| {
            Error::unavailable(format!(
                "no Docker engine answers at {named}: start one (tests/docker/dockerd.sh start prints a DOCKER_HOST for a private engine) and set DOCKER_HOST: {err}"
            ))
        })?;
        let version = docker
            .version()
            .await
            .map_err(|err| Error::unavailable(format!("the Docker engine at {named}: {err}")))?;
        tracing::info!(engine = ?version.version, api = ?version.api_version, "connected to Docker");
        let firewall =
            Firewall::detect(settings.firewall, settings.allow_egress, host.as_deref()).await;
        if let Some(why) = firewall.unavailable() {
            if firewall.required() {
                return Err(Error::failed_precondition(format!(
                    "--firewall required, but lesson networks cannot be confined: {why}"
                )));
            }
            firewall.warn_at_start();
        }
        match firewall.sweep().await {
            Ok(0) => {}
            Ok(count) => tracing::info!(
                count,
                "removed firewall rules of lesson networks that are gone"
            ),
            Err(err) => tracing::warn!(error = %err, "could not sweep stale firewall rules"),
        }
        let configurator = configurator::available(&docker, &settings).await;
        let jupyter = crate::guide::available(&docker, &settings).await;
        Ok(Docker::new(docker, settings, firewall)
            .with_configurator(configurator)
            .with_jupyter(jupyter))
    }

    /// A backend driving `docker`, confining lesson networks with `firewall`.
    pub fn new(docker: bollard::Docker, settings: Settings, firewall: Firewall) -> Docker {
        Docker {
            docker,
            settings: Arc::new(settings),
            firewall: Arc::new(firewall),
            configurator: false,
            jupyter: false,
            direct: Arc::new(Direct::default()),
        }
    }

    /// Offers Jupyter guides when `available` (the Jupyter image is on the engine:
    /// [`crate::guide::available`]).
    pub fn with_jupyter(mut self, available: bool) -> Docker {
        self.jupyter = available;
        self
    }

    /// Offers python, ansible and napalm configurations when `available` (the configurator
    /// image is on the engine: [`crate::configurator::available`]).
    pub fn with_configurator(mut self, available: bool) -> Docker {
        self.configurator = available;
        self
    }

    /// Follows the engine's container events: a container of a READY live lesson that dies
    /// (or is killed for memory) turns the live lesson FAILED in `book` with the reason.
    pub async fn follow_events(
        self,
        book: Arc<StateBook>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
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
            let mut events = self.docker.events(Some(options));
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
                book.update(id, |state| {
                    if state.phase == Phase::Ready as i32 {
                        state.phase = Phase::Failed as i32;
                        state.reason = if action == "oom" {
                            format!("endpoint `{endpoint}` ran out of memory")
                        } else {
                            format!("endpoint `{endpoint}` stopped (exit code {exit})")
                        };
                        for state in &mut state.endpoints {
                            if &state.name == endpoint {
                                state.healthy = 0;
                            }
                        }
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

    /// Where an existing live lesson's endpoints are (for stage changes and recovery), with its
    /// networks' firewall rules put back if they went missing (a host reboot, an agent killed
    /// between creating a network and confining it).
    async fn find(
        &self,
        spec: &proto::LessonSpec,
    ) -> Result<(HashMap<String, engine::Placed>, Confinement), EngineError> {
        let confinement = engine::confine_networks(
            &self.docker,
            &self.firewall,
            &spec.live_lesson_id,
            &HashMap::new(),
        )
        .await?;
        let lesson_net = engine::lesson_network(&spec.live_lesson_id);
        let mut placed = HashMap::new();
        for endpoint in &spec.endpoints {
            let name = engine::container_name(&spec.live_lesson_id, &endpoint.name);
            placed.insert(
                endpoint.name.clone(),
                engine::inspect(&self.docker, &name, &lesson_net).await?,
            );
        }
        Ok((placed, confinement))
    }
}

/// What a live lesson is on the engine, between the pipeline's steps.
pub struct Objects {
    /// Every endpoint's container: its addresses on the lesson network and published ports.
    placed: HashMap<String, engine::Placed>,
    /// The stage's configurator container, while its configurations run.
    configurator: Option<configurator::Configurator>,
}

/// The `HostConfined` condition of a live lesson confined as `confinement` says.
fn report_confinement(report: &Reporter, confinement: &Confinement) {
    let unconfined = match confinement {
        Confinement::Unconfined(why) => Some((
            false,
            "FirewallUnavailable",
            format!("endpoints can reach the engine's host and the metadata address: {why}"),
        )),
        _ => None,
    };
    report.condition(HOST_CONFINED, unconfined);
}

fn failed(err: EngineError) -> Error {
    Error::unavailable(err.to_string())
}

/// The pipeline's steps on a Docker engine: containers created (a missing image is a FAILED
/// reason naming it, there is no pull) or found, configured by exec (shell) or in a
/// configurator container (python, ansible, napalm), probed from the host through their
/// published ports.
#[tonic::async_trait]
impl Steps for Docker {
    type Objects = Objects;

    fn limits(&self) -> Limits {
        Limits {
            probe_timeout: self.settings.probe_timeout,
            configuration_tries: self.settings.config_tries,
            configuration_timeout: self.settings.config_timeout,
            extra_ready_delay: self.settings.ready_delay,
            ..Limits::default()
        }
    }

    async fn create(&self, lesson: &Lesson, report: &Reporter) -> Result<Objects, Error> {
        let (placed, confinement) =
            engine::create(&self.docker, &self.settings, &self.firewall, lesson.spec())
                .await
                .map_err(failed)?;
        report_confinement(report, &confinement);
        Ok(Objects {
            placed,
            configurator: None,
        })
    }

    /// A live lesson whose containers were removed behind the agent's back (`docker rm -f`)
    /// is gone: it went FAILED, and a newer generation creates them again.
    async fn locate(&self, lesson: &Lesson, report: &Reporter) -> Result<Option<Objects>, Error> {
        match self.find(lesson.spec()).await {
            Ok((placed, confinement)) => {
                report_confinement(report, &confinement);
                Ok(Some(Objects {
                    placed,
                    configurator: None,
                }))
            }
            Err(EngineError::Docker(err)) if engine::is_not_found(&err) => Ok(None),
            Err(err) => Err(failed(err)),
        }
    }

    /// The published ports (probed from the host, where learners' entrypoint connects).
    async fn addresses(
        &self,
        lesson: &Lesson,
        objects: &Objects,
        _report: &Reporter,
    ) -> Result<Vec<Placement>, Error> {
        Ok(lesson
            .endpoints
            .iter()
            .map(|endpoint| {
                let place = objects
                    .placed
                    .get(&endpoint.name)
                    .cloned()
                    .unwrap_or_default();
                endpoint.presentations.iter().fold(
                    Placement::new(place.internal_address.clone()),
                    |placement, p| match place.published.get(&p.port.get()) {
                        Some(address) => placement.reach(p.name.clone(), address.clone()),
                        None => placement,
                    },
                )
            })
            .collect())
    }

    /// The stage's notebook first (the guide is what the learner reads while waiting), then
    /// one configurator container for the stage's python, ansible and napalm configurations.
    async fn prepare(&self, lesson: &Lesson, objects: &mut Objects) -> Result<(), Error> {
        let spec = lesson.spec();
        crate::guide::write(&self.docker, spec)
            .await
            .map_err(|err| Error::unavailable(format!("writing the jupyter guide: {err}")))?;
        if spec.endpoints.iter().any(|e| {
            e.configuration
                .as_ref()
                .is_some_and(configurator::runs_here)
        }) {
            objects.configurator = Some(
                configurator::Configurator::start(&self.docker, &self.settings, spec)
                    .await
                    .map_err(|err| {
                        Error::unavailable(format!("starting the configurator: {err}"))
                    })?,
            );
        }
        Ok(())
    }

    /// Shell scripts by exec in the endpoint, the other types in the configurator; output kept
    /// to its last 64 KiB.
    async fn configure(
        &self,
        lesson: &Lesson,
        objects: &Objects,
        index: usize,
        timeout: Duration,
    ) -> Result<Attempt, Error> {
        let spec = lesson.spec();
        let endpoint = &spec.endpoints[index];
        let Some(configuration) = &endpoint.configuration else {
            return Ok(Attempt::Settled(Ok(())));
        };
        let run = match &objects.configurator {
            Some(configurator) if configurator::runs_here(configuration) => {
                configurator
                    .run(&self.docker, endpoint, configuration, spec.stage, timeout)
                    .await
            }
            _ => {
                let script = String::from_utf8_lossy(&configuration.contents);
                let container = engine::container_name(&spec.live_lesson_id, &endpoint.name);
                engine::exec_shell(&self.docker, &container, &script, timeout).await
            }
        };
        let (run, output) = run.map_err(failed)?;
        Ok(Attempt::Ran(run, output))
    }

    /// The configurator goes when the stage's configuration is over, whatever its outcome.
    async fn finish(&self, _lesson: &Lesson, objects: &mut Objects) {
        if let Some(configurator) = objects.configurator.take() {
            configurator.finish(&self.docker).await;
        }
    }
}

#[tonic::async_trait]
impl Backend for Docker {
    fn describe(&self) -> Description {
        let mut offered = PROTOCOL_CAPABILITIES.to_vec();
        offered.extend(configurator::capabilities(self.configurator));
        if self.jupyter {
            offered.push(capabilities::GUIDE_JUPYTER);
        }
        let mut description = Description::new("agent-docker", env!("CARGO_PKG_VERSION"), &offered);
        description.max_live_lessons = self.settings.max_live_lessons;
        description.labels = HashMap::from([("backend".to_owned(), "docker".to_owned())]);
        description
    }

    fn background(&self, book: &Arc<StateBook>, shutdown: &tokio_util::sync::CancellationToken) {
        tokio::spawn(self.clone().follow_events(book.clone(), shutdown.clone()));
    }

    async fn reach(
        &self,
        _live_lesson: &str,
        endpoint: &proto::EndpointState,
        declared: &proto::Presentation,
        presentation: &proto::PresentationState,
    ) -> Option<std::net::SocketAddr> {
        if let (Ok(ip), Ok(port)) = (
            endpoint.internal_address.parse::<std::net::IpAddr>(),
            u16::try_from(declared.port),
        ) {
            let own = std::net::SocketAddr::new(ip, port);
            if self.direct.reaches(own).await {
                return Some(own);
            }
        }
        tokio::net::lookup_host(presentation.address.as_str())
            .await
            .ok()?
            .next()
    }

    async fn remove(&self, live_lesson_id: &str) -> Result<(), Error> {
        engine::remove(&self.docker, &self.firewall, live_lesson_id)
            .await
            .map_err(failed)
    }

    async fn discover(
        &self,
        selector: &HashMap<String, String>,
    ) -> Result<Vec<HashMap<String, String>>, Error> {
        // Containers and networks both count: a creation may have stopped between them.
        let mut found: HashMap<String, HashMap<String, String>> = HashMap::new();
        let containers = engine::containers(&self.docker, selector)
            .await
            .map_err(failed)?
            .into_iter()
            .map(|(_, labels, _)| labels);
        let networks = engine::network_lessons(&self.docker, selector)
            .await
            .map_err(failed)?;
        for mut labels in containers.chain(networks) {
            labels.remove(LABEL_ENDPOINT);
            labels.remove(engine::LABEL_MANAGED);
            if let Some(id) = labels.get(LABEL_LIVE_LESSON) {
                found.entry(id.clone()).or_insert(labels);
            }
        }
        Ok(found.into_values().collect())
    }

    async fn plan(&self, spec: &proto::LessonSpec) -> Result<proto::PlanResponse, Status> {
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
            let image = self.settings.image_of(e);
            if let Err(err) = self.docker.inspect_image(&image).await {
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
        if spec.endpoints.iter().any(|e| {
            e.configuration
                .as_ref()
                .is_some_and(configurator::runs_here)
        }) {
            objects.push(proto::PlannedObject {
                kind: "container".into(),
                name: configurator::container_name(id),
                ports: vec![],
                detail: format!(
                    "image {}; runs stage {}'s python, ansible and napalm configurations, then removed",
                    self.settings.configurator_image, spec.stage
                ),
            });
        }
        Ok(proto::PlanResponse {
            objects,
            diagnostics,
        })
    }

    /// Check and solution files (PROTOCOL.md, "Checks"): shell files by exec in their
    /// endpoint's container, python files by exec in a configurator container of their own
    /// (started for the run, removed after it), one after another in the request's order, each
    /// bounded by the request's timeout within `--config-timeout` and its output by the exec's
    /// tail.
    async fn run_checks(
        &self,
        spec: &proto::LessonSpec,
        files: &[proto::CheckFile],
        timeout: Option<Duration>,
    ) -> Result<Vec<proto::CheckResult>, Status> {
        use antidote_sdk::checks::{self, Ended};
        use antidote_sdk::output::Run;
        let docker = &self.docker;
        let timeout = checks::check_timeout(timeout, self.settings.config_timeout);
        let python = files
            .iter()
            .any(|f| f.r#type == proto::ConfigurationType::Python as i32);
        let configurator = if python && self.configurator {
            Some(configurator::Configurator::start_for_checks(docker, &self.settings, spec).await)
        } else {
            None
        };
        let mut results = Vec::with_capacity(files.len());
        for file in files {
            let started = std::time::Instant::now();
            let script = String::from_utf8_lossy(&file.contents).into_owned();
            let endpoint = spec.endpoints.iter().find(|e| e.name == file.endpoint);
            let run = if file.r#type == proto::ConfigurationType::Python as i32 {
                match (&configurator, endpoint) {
                    (Some(Ok(configurator)), Some(endpoint)) => {
                        configurator
                            .run_python(
                                docker,
                                endpoint,
                                &file.file_name,
                                &script,
                                spec.stage,
                                timeout,
                            )
                            .await
                    }
                    (Some(Err(err)), _) => {
                        results.push(checks::not_run(
                            file,
                            format!("the configurator did not start: {err}"),
                        ));
                        continue;
                    }
                    _ => {
                        results.push(checks::not_run(
                            file,
                            "python files need the configurator image, which this agent lacks",
                        ));
                        continue;
                    }
                }
            } else {
                let container = engine::container_name(&spec.live_lesson_id, &file.endpoint);
                engine::exec_shell(docker, &container, &script, timeout).await
            };
            results.push(match run {
                Ok((Run::Exited(code), output)) => {
                    let code = i32::try_from(code).unwrap_or(-1);
                    checks::result(file, Ended::Exited(code), &output, started.elapsed())
                }
                Ok((Run::TimedOut, output)) => {
                    checks::result(file, Ended::TimedOut, &output, started.elapsed())
                }
                Err(err) => checks::not_run(file, err.to_string()),
            });
        }
        if let Some(Ok(configurator)) = configurator {
            configurator.finish(docker).await;
        }
        Ok(results)
    }
}
