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
use antidote_sdk::probe::{self, Expect};
use antidote_sdk::{self as sdk, Backend, Description, Reporter, Start, StateBook, capabilities};
use futures::StreamExt;
use proto::{Phase, PresentationType};
use tonic::Status;

use crate::configurator;
use crate::engine::{self, EngineError, LABEL_ENDPOINT, LABEL_LIVE_LESSON, Run};
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
];

/// The Docker backend.
#[derive(Clone)]
pub struct Docker {
    docker: bollard::Docker,
    settings: Arc<Settings>,
    /// The host firewall confining lesson networks (or why it cannot).
    firewall: Arc<Firewall>,
    /// The runtime's state book, for changes that happen on their own (a container dies).
    book: Arc<StateBook>,
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
    /// A backend driving `docker`, confining lesson networks with `firewall`, reporting
    /// through `book` (give the same book to [`sdk::Agent::with_book`]).
    pub fn new(
        docker: bollard::Docker,
        settings: Settings,
        firewall: Firewall,
        book: Arc<StateBook>,
    ) -> Docker {
        Docker {
            docker,
            settings: Arc::new(settings),
            firewall: Arc::new(firewall),
            book,
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
                self.book.update(id, |state| {
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

    async fn take_to_ready(
        &self,
        spec: &proto::LessonSpec,
        start: Start,
        report: &Reporter,
    ) -> Result<Vec<proto::EndpointState>, String> {
        let docker = &self.docker;
        let settings = &self.settings;
        if start == Start::Create {
            // A missing image surfaces from the container's creation (404), named there.
            report.phase(Phase::Booting, "creating networks and containers");
        }
        let (placed, confinement) = match start {
            Start::Create => engine::create(docker, settings, &self.firewall, spec).await,
            Start::Adopt => self.locate(spec).await,
            Start::Change => match self.locate(spec).await {
                // Its containers were removed behind the agent's back (`docker rm -f`): the
                // live lesson went FAILED, and a newer generation creates them again.
                Err(EngineError::Docker(err)) if engine::is_not_found(&err) => {
                    report.phase(Phase::Booting, "endpoints gone; creating them again");
                    engine::create(docker, settings, &self.firewall, spec).await
                }
                located => located,
            },
        }
        .map_err(|err| err.to_string())?;
        let endpoints = endpoint_states(spec, &placed);
        report.update(|s| {
            s.phase = Phase::Configuring as i32;
            s.reason = format!("configuring stage {}", spec.stage);
            s.endpoints = endpoints.clone();
            s.conditions.retain(|c| c.r#type != HOST_CONFINED);
            if let Confinement::Unconfined(why) = &confinement {
                s.conditions.push(proto::Condition {
                    r#type: HOST_CONFINED.into(),
                    status: false,
                    reason: "FirewallUnavailable".into(),
                    message: format!(
                        "endpoints can reach the engine's host and the metadata address: {why}"
                    ),
                    last_transition: Some(std::time::SystemTime::now().into()),
                });
            }
        });

        // The stage's notebook, before anything can fail on configuration: the guide is what
        // the learner reads while waiting.
        crate::guide::write(docker, spec)
            .await
            .map_err(|err| format!("writing the jupyter guide: {err}"))?;

        // Python, ansible and napalm run from one configurator container for the whole stage,
        // removed when the stage's configuration is over, whatever its outcome.
        let mut configurator = None;
        if spec.endpoints.iter().any(|e| {
            e.configuration
                .as_ref()
                .is_some_and(configurator::runs_here)
        }) {
            configurator = Some(
                configurator::Configurator::start(docker, settings, spec)
                    .await
                    .map_err(|err| format!("starting the configurator: {err}"))?,
            );
        }
        let configured = self.configure(spec, configurator.as_ref()).await;
        if let Some(configurator) = configurator {
            configurator.finish(docker).await;
        }
        configured?;

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
                let expect: Expect = probe::expect(presentation.r#type);
                probe::until_ready(address, expect, deadline).await.map_err(|last| {
                    format!(
                        "endpoint `{}` presentation `{}` ({:?} at {address}) not ready within {:?}: {last}",
                        endpoint.name, presentation.name, expect, settings.probe_timeout
                    )
                })?;
                state.healthy += 1;
            }
        }
        let delay = sdk::spec::ready_delay(spec) + settings.ready_delay;
        if !delay.is_zero() {
            report.update(|s| {
                s.reason = format!("reachable; waiting the ready delay of {delay:?}");
                s.endpoints = states.clone();
            });
            tokio::time::sleep(delay).await;
        }
        Ok(states)
    }

    /// Runs the stage's configuration of every endpoint, in lesson order: shell scripts by exec
    /// in the endpoint, the other types in `configurator`. Each is tried `--config-tries` times
    /// ([R3]), each try killed at the lesson's configuration timeout capped by
    /// `--config-timeout`; the error names the file and ends with the last try's output.
    async fn configure(
        &self,
        spec: &proto::LessonSpec,
        configurator: Option<&configurator::Configurator>,
    ) -> Result<(), String> {
        let docker = &self.docker;
        let settings = &self.settings;
        let id = &spec.live_lesson_id;
        let tries = settings.config_tries.max(1);
        let timeout = sdk::spec::configuration_timeout(spec, settings.config_timeout);
        for endpoint in &spec.endpoints {
            let Some(configuration) = &endpoint.configuration else {
                continue;
            };
            let mut last = String::new();
            let mut done = false;
            for attempt in 1..=tries {
                let run = match configurator {
                    Some(configurator) if configurator::runs_here(configuration) => {
                        configurator
                            .run(docker, endpoint, configuration, spec.stage, timeout)
                            .await
                    }
                    _ => {
                        let script = String::from_utf8_lossy(&configuration.contents);
                        let container = engine::container_name(id, &endpoint.name);
                        engine::exec_shell(docker, &container, &script, timeout).await
                    }
                };
                match run {
                    Ok((Run::Exited(0), _)) => {
                        done = true;
                        break;
                    }
                    Ok((run, output)) => last = sdk::output::failed_try(run, &output, timeout),
                    Err(err) => last = err.to_string(),
                }
                tracing::warn!(live_lesson.id = %id, endpoint = %endpoint.name, attempt, "configuration failed");
                if attempt < tries {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            if !done {
                return Err(format!(
                    "configuration {} of endpoint `{}` for stage {} failed {tries} times; last: {last}",
                    configuration.file_name, endpoint.name, spec.stage,
                ));
            }
        }
        Ok(())
    }

    /// Where an existing live lesson's endpoints are (for stage changes and recovery), with its
    /// networks' firewall rules put back if they went missing (a host reboot, an agent killed
    /// between creating a network and confining it).
    async fn locate(
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

fn unavailable(err: EngineError) -> Status {
    Status::unavailable(err.to_string())
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

    async fn realise(
        &self,
        spec: proto::LessonSpec,
        start: Start,
        report: Reporter,
    ) -> Result<Vec<proto::EndpointState>, String> {
        self.take_to_ready(&spec, start, &report).await
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

    async fn remove(&self, live_lesson_id: &str) -> Result<(), Status> {
        engine::remove(&self.docker, &self.firewall, live_lesson_id)
            .await
            .map_err(unavailable)
    }

    async fn discover(
        &self,
        selector: &HashMap<String, String>,
    ) -> Result<Vec<HashMap<String, String>>, Status> {
        // Containers and networks both count: a creation may have stopped between them.
        let mut found: HashMap<String, HashMap<String, String>> = HashMap::new();
        let containers = engine::containers(&self.docker, selector)
            .await
            .map_err(unavailable)?
            .into_iter()
            .map(|(_, labels, _)| labels);
        let networks = engine::network_lessons(&self.docker, selector)
            .await
            .map_err(unavailable)?;
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
}
