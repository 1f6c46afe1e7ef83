//! `test-agent`: a small but real antidote.agent.v1 backend that runs every endpoint on
//! loopback. Each presentation is a real TCP listener on 127.0.0.1 that answers like its type
//! (an SSH banner, an HTTP response naming the lesson, endpoint and stage), and readiness is a
//! real probe of those sockets. It keeps its state in memory, so it is the agent the scheduler's
//! end-to-end tests and the load generator drive; the Docker and Kubernetes agents are the real
//! backends.
//!
//! Test knobs: `--boot-delay`/`--configure-delay` hold live lessons in BOOTING/CONFIGURING,
//! `--journal` appends one line per object creation (so tests can prove nothing was created
//! twice), `--fail-lesson` makes a lesson fail, `--null` does no work at all (READY at once, no
//! sockets: the load generator's agent).

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_proto::agent::v1::backend_server::{Backend, BackendServer};
use antidote_proto::sdk::{StateBook, WatchStream};
use clap::Parser;
use proto::{Phase, PresentationType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

#[derive(Parser, Clone)]
#[command(
    name = "test-agent",
    about = "A loopback antidote.agent.v1 backend for tests"
)]
struct Args {
    /// Where to serve antidote.agent.v1.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Time each new live lesson spends BOOTING.
    #[arg(long, default_value = "0ms", value_parser = humantime_duration)]
    boot_delay: Duration,
    /// Time each stage's configuration takes.
    #[arg(long, default_value = "0ms", value_parser = humantime_duration)]
    configure_delay: Duration,
    /// Append "create <id> <generation>" here whenever objects are created.
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Lessons whose provisioning fails (after booting), with a reason naming them.
    #[arg(long)]
    fail_lesson: Vec<String>,
    /// Do no work: READY at once, no sockets, no probes.
    #[arg(long)]
    null: bool,
    /// Major versions offered in the handshake (to test negotiation).
    #[arg(long, default_value = "1", value_delimiter = ',')]
    majors: Vec<u32>,
    /// Capabilities offered; default: all of them.
    #[arg(long, value_delimiter = ',')]
    capabilities: Option<Vec<String>>,
    /// Capacity offered in the handshake (0 = no limit).
    #[arg(long, default_value_t = 0)]
    max_live_lessons: u32,
}

fn humantime_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = number
        .parse()
        .map_err(|_| format!("bad duration `{text}`"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        _ => Err(format!("bad duration unit in `{text}` (use ms or s)")),
    }
}

/// One live lesson held by the agent.
struct Entry {
    /// The newest spec received (its reported state lives in the state book).
    spec: proto::LessonSpec,
    /// Listener tasks, one per presentation; aborted on Deprovision.
    listeners: Vec<JoinHandle<()>>,
    /// The stage the listeners report, shared with them.
    stage: Arc<Mutex<u32>>,
    /// The task driving it to READY.
    driver: Option<JoinHandle<()>>,
}

struct Agent {
    args: Args,
    instance_id: String,
    entries: Mutex<BTreeMap<String, Entry>>,
    /// What Get/List/Watch answer (the SDK's rules for revisions, pages and streams).
    book: Arc<StateBook>,
}

impl Agent {
    /// Changes a live lesson's reported state (watchers see it).
    fn update(&self, id: &str, change: impl FnOnce(&mut proto::LiveLessonState)) {
        self.book.update(id, change);
    }

    fn journal(&self, line: &str) {
        if let Some(path) = &self.args.journal {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .expect("journal file opens");
            writeln!(file, "{line}").expect("journal line is written");
        }
    }

    /// Drives a live lesson from its current phase to READY (or FAILED): boot, configure,
    /// probe every presentation for real.
    fn drive(self: &Arc<Self>, id: String, generation: u64, boot: bool) -> JoinHandle<()> {
        let agent = self.clone();
        tokio::spawn(async move {
            if boot {
                tokio::time::sleep(agent.args.boot_delay).await;
                agent.update(&id, |s| {
                    s.phase = Phase::Configuring as i32;
                    s.reason = "configuring".into();
                });
            }
            tokio::time::sleep(agent.args.configure_delay).await;
            let (slug, stage, targets) = {
                let entries = agent.entries.lock().unwrap();
                let Some(entry) = entries.get(&id) else {
                    return;
                };
                let Some(state) = agent.book.get(&id).filter(|s| s.generation == generation) else {
                    return;
                };
                *entry.stage.lock().unwrap() = entry.spec.stage;
                let targets: Vec<(usize, i32, String)> = state
                    .endpoints
                    .iter()
                    .enumerate()
                    .flat_map(|(i, e)| {
                        e.presentations
                            .iter()
                            .map(move |p| (i, p.r#type, p.address.clone()))
                    })
                    .collect();
                (entry.spec.lesson_slug.clone(), entry.spec.stage, targets)
            };
            if agent.args.fail_lesson.contains(&slug) {
                agent.update(&id, |s| {
                    s.phase = Phase::Failed as i32;
                    s.reason = format!("lesson `{slug}` is configured to fail in this test agent");
                });
                return;
            }
            // Probe until every presentation answers like its type.
            let mut healthy = vec![0u32; targets.len()];
            loop {
                for (n, (_, kind, address)) in targets.iter().enumerate() {
                    if healthy[n] == 0 && probe(*kind, address).await {
                        healthy[n] = 1;
                    }
                }
                if healthy.iter().all(|h| *h == 1) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            agent.update(&id, |s| {
                if s.generation != generation {
                    return;
                }
                for endpoint in &mut s.endpoints {
                    endpoint.healthy = endpoint.total;
                }
                s.phase = Phase::Ready as i32;
                s.reason = format!("stage {stage} ready");
            });
        })
    }
}

/// A real readiness probe: an SSH banner, or any HTTP status line.
async fn probe(kind: i32, address: &str) -> bool {
    let attempt = async {
        let mut stream = TcpStream::connect(address).await.ok()?;
        if kind == PresentationType::Http as i32 {
            stream.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok()?;
        }
        let mut buf = [0u8; 16];
        let n = stream.read(&mut buf).await.ok()?;
        let head = &buf[..n];
        Some(if kind == PresentationType::Ssh as i32 {
            head.starts_with(b"SSH-")
        } else {
            head.starts_with(b"HTTP/")
        })
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Serves one presentation: an SSH banner or an HTTP page naming lesson, endpoint and stage.
async fn serve_presentation(
    listener: TcpListener,
    kind: i32,
    lesson: String,
    endpoint: String,
    stage: Arc<Mutex<u32>>,
) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        let stage = *stage.lock().unwrap();
        let body = format!("{lesson} {endpoint} stage {stage}\n");
        tokio::spawn(async move {
            if kind == PresentationType::Ssh as i32 {
                let _ = stream
                    .write_all(format!("SSH-2.0-antidote_test_agent\r\n{body}").as_bytes())
                    .await;
            } else {
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf).await;
                let response = format!(
                    "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            }
        });
    }
}

fn validate(spec: &proto::LessonSpec) -> Result<(), Status> {
    if spec.live_lesson_id.is_empty() {
        return Err(Status::invalid_argument("spec.live_lesson_id is empty"));
    }
    if spec.generation == 0 {
        return Err(Status::invalid_argument(
            "spec.generation must be at least 1",
        ));
    }
    if spec.endpoints.is_empty() {
        return Err(Status::invalid_argument("spec.endpoints is empty"));
    }
    for (i, endpoint) in spec.endpoints.iter().enumerate() {
        for (j, p) in endpoint.presentations.iter().enumerate() {
            if p.port == 0 || p.port > 65535 {
                return Err(Status::invalid_argument(format!(
                    "spec.endpoints[{i}].presentations[{j}].port {} is not 1..65535",
                    p.port
                )));
            }
            if PresentationType::try_from(p.r#type).unwrap_or(PresentationType::Unspecified)
                == PresentationType::Unspecified
            {
                return Err(Status::invalid_argument(format!(
                    "spec.endpoints[{i}].presentations[{j}].type is unspecified"
                )));
            }
        }
    }
    Ok(())
}

/// The gRPC face of the agent (a local type, so it can implement the generated trait).
#[derive(Clone)]
struct Service(Arc<Agent>);

impl std::ops::Deref for Service {
    type Target = Arc<Agent>;
    fn deref(&self) -> &Arc<Agent> {
        &self.0
    }
}

#[tonic::async_trait]
impl Backend for Service {
    async fn handshake(
        &self,
        request: Request<proto::HandshakeRequest>,
    ) -> Result<Response<proto::HandshakeResponse>, Status> {
        let request = request.into_inner();
        let Some(major) = self
            .args
            .majors
            .iter()
            .copied()
            .filter(|m| request.supported_majors.contains(m))
            .max()
        else {
            return Err(Status::failed_precondition(format!(
                "no common major version: scheduler speaks {:?}, this agent speaks {:?}",
                request.supported_majors, self.args.majors
            )));
        };
        let capabilities = self.args.capabilities.clone().unwrap_or_else(|| {
            [
                "presentation.ssh",
                "presentation.http",
                "stage.configuration",
                "plan",
                "watch",
                "recover",
            ]
            .map(String::from)
            .to_vec()
        });
        Ok(Response::new(proto::HandshakeResponse {
            major,
            agent_name: "test-agent".into(),
            build_version: env!("CARGO_PKG_VERSION").into(),
            instance_id: self.instance_id.clone(),
            capabilities,
            capacity: Some(proto::Capacity {
                max_live_lessons: self.args.max_live_lessons,
                live_lessons: self.book.len() as u32,
            }),
            labels: HashMap::new(),
        }))
    }

    async fn plan(
        &self,
        request: Request<proto::PlanRequest>,
    ) -> Result<Response<proto::PlanResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec is missing"))?;
        validate(&spec)?;
        let objects = spec
            .endpoints
            .iter()
            .flat_map(|e| {
                e.presentations.iter().map(move |p| proto::PlannedObject {
                    kind: "listener".into(),
                    name: format!("{}/{}", e.name, p.name),
                    ports: vec![p.port],
                    detail: "a TCP listener on 127.0.0.1".into(),
                })
            })
            .collect();
        Ok(Response::new(proto::PlanResponse {
            objects,
            diagnostics: vec![],
        }))
    }

    async fn provision(
        &self,
        request: Request<proto::ProvisionRequest>,
    ) -> Result<Response<proto::ProvisionResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec is missing"))?;
        validate(&spec)?;
        let id = spec.live_lesson_id.clone();
        let generation = spec.generation;

        // An existing live lesson: same generation → current state; newer → stage change.
        {
            let mut entries = self.entries.lock().unwrap();
            if let Some(entry) = entries.get_mut(&id)
                && let Some(mut state) = self.book.get(&id)
            {
                if generation < state.generation {
                    return Err(Status::failed_precondition(format!(
                        "generation {generation} is older than the {} this agent holds",
                        state.generation
                    )));
                }
                if generation == state.generation {
                    return Ok(Response::new(proto::ProvisionResponse {
                        state: Some(state),
                    }));
                }
                entry.spec = spec.clone();
                state.generation = generation;
                state.stage = spec.stage;
                state.labels = spec.labels.clone();
                if self.args.null {
                    state.phase = Phase::Ready as i32;
                    *entry.stage.lock().unwrap() = spec.stage;
                } else {
                    state.phase = Phase::Configuring as i32;
                    state.reason = format!("configuring stage {}", spec.stage);
                }
                let state = self.book.put(state);
                if !self.args.null {
                    if let Some(old) = entry.driver.take() {
                        old.abort();
                    }
                    drop(entries);
                    let driver = self.drive(id.clone(), generation, false);
                    if let Some(entry) = self.entries.lock().unwrap().get_mut(&id) {
                        entry.driver = Some(driver);
                    }
                }
                return Ok(Response::new(proto::ProvisionResponse {
                    state: Some(state),
                }));
            }
        }

        // A new live lesson: create its listeners.
        let stage = Arc::new(Mutex::new(spec.stage));
        let mut listeners = Vec::new();
        let mut endpoints = Vec::new();
        for endpoint in &spec.endpoints {
            let mut presentations = Vec::new();
            if !self.args.null {
                for p in &endpoint.presentations {
                    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|err| {
                        Status::unavailable(format!("cannot bind a listener: {err}"))
                    })?;
                    let address = listener
                        .local_addr()
                        .map_err(|err| Status::internal(err.to_string()))?
                        .to_string();
                    listeners.push(tokio::spawn(serve_presentation(
                        listener,
                        p.r#type,
                        spec.lesson_slug.clone(),
                        endpoint.name.clone(),
                        stage.clone(),
                    )));
                    presentations.push(proto::PresentationState {
                        name: p.name.clone(),
                        r#type: p.r#type,
                        url: if p.r#type == PresentationType::Http as i32 {
                            format!("http://{address}/")
                        } else {
                            String::new()
                        },
                        address,
                    });
                }
            }
            endpoints.push(proto::EndpointState {
                name: endpoint.name.clone(),
                total: presentations.len() as u32,
                healthy: 0,
                presentations,
                internal_address: "127.0.0.1".into(),
            });
        }
        let mut entries = self.entries.lock().unwrap();
        if entries.contains_key(&id) {
            // A concurrent identical Provision won the race: keep its objects, drop ours.
            for listener in listeners {
                listener.abort();
            }
            return Ok(Response::new(proto::ProvisionResponse {
                state: self.book.get(&id),
            }));
        }
        self.journal(&format!("create {id} {generation}"));
        let state = proto::LiveLessonState {
            live_lesson_id: id.clone(),
            generation,
            stage: spec.stage,
            phase: if self.args.null {
                Phase::Ready
            } else {
                Phase::Booting
            } as i32,
            reason: String::new(),
            endpoints,
            handle: id.clone().into_bytes().into(),
            conditions: vec![],
            labels: spec.labels.clone(),
            revision: 0,
        };
        // Stored under the entries lock, so a concurrent Provision sees both or neither.
        let state = self.book.put(state);
        entries.insert(
            id.clone(),
            Entry {
                spec,
                listeners,
                stage,
                driver: None,
            },
        );
        drop(entries);
        if !self.args.null {
            let driver = self.drive(id.clone(), generation, true);
            if let Some(entry) = self.entries.lock().unwrap().get_mut(&id) {
                entry.driver = Some(driver);
            }
        }
        Ok(Response::new(proto::ProvisionResponse {
            state: Some(state),
        }))
    }

    async fn deprovision(
        &self,
        request: Request<proto::DeprovisionRequest>,
    ) -> Result<Response<proto::DeprovisionResponse>, Status> {
        let id = request.into_inner().live_lesson_id;
        let removed = self.entries.lock().unwrap().remove(&id);
        if let Some(entry) = removed {
            for listener in entry.listeners {
                listener.abort();
            }
            if let Some(driver) = entry.driver {
                driver.abort();
            }
        }
        self.book.remove(&id);
        Ok(Response::new(proto::DeprovisionResponse { gone: true }))
    }

    async fn get(
        &self,
        request: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let id = request.into_inner().live_lesson_id;
        let state = self.book.get(&id).ok_or_else(|| {
            Status::not_found(format!("live lesson `{id}` is not held by this agent"))
        })?;
        Ok(Response::new(proto::GetResponse { state: Some(state) }))
    }

    async fn list(
        &self,
        request: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListResponse>, Status> {
        Ok(Response::new(self.book.list(&request.into_inner())))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<proto::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new(self.book.watch(request.into_inner())))
    }

    async fn recover(
        &self,
        request: Request<proto::RecoverRequest>,
    ) -> Result<Response<proto::RecoverResponse>, Status> {
        let id = request.into_inner().live_lesson_id;
        let state = self.book.get(&id).ok_or_else(|| {
            Status::not_found(format!("live lesson `{id}` has no objects on this agent"))
        })?;
        Ok(Response::new(proto::RecoverResponse { state: Some(state) }))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let listener = TcpListener::bind(args.listen).await?;
    let address = listener.local_addr()?;
    let agent = Arc::new(Agent {
        args,
        instance_id: uuid::Uuid::new_v4().to_string(),
        entries: Mutex::new(BTreeMap::new()),
        book: Arc::new(StateBook::default()),
    });
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(proto::SERVICE_NAME, tonic_health::ServingStatus::Serving)
        .await;
    println!("listening on {address}");
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health_service)
        .add_service(BackendServer::new(Service(agent)))
        .serve_with_incoming_shutdown(
            // TCP_NODELAY on every connection, or small replies wait ~40 ms for delayed ACKs.
            TcpListenerStream::new(listener).map(|stream| {
                let stream = stream?;
                stream.set_nodelay(true)?;
                Ok::<_, std::io::Error>(stream)
            }),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
    Ok(())
}
