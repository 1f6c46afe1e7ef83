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

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_proto::sdk::{self, Agent, Backend, Description, Report, Start, capabilities};
use clap::Parser;
use proto::{Phase, PresentationType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::Status;

#[derive(Parser, Clone)]
#[command(
    name = "test-agent",
    about = "A loopback antidote.agent.v1 backend for tests"
)]
struct Args {
    /// Where to serve antidote.agent.v1.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to serve Prometheus `/metrics` (off when unset).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
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

/// One live lesson's objects: a listener per presentation.
struct Entry {
    /// The spec's labels (what `discover` matches).
    labels: HashMap<String, String>,
    /// Listener tasks, one per presentation; aborted on removal.
    listeners: Vec<JoinHandle<()>>,
    /// Where each endpoint's presentations listen.
    endpoints: Vec<proto::EndpointState>,
    /// The stage the listeners report, shared with them.
    stage: Arc<Mutex<u32>>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        for listener in &self.listeners {
            listener.abort();
        }
    }
}

/// The backend: live lessons as loopback listeners.
struct Loopback {
    args: Args,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Loopback {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // Every critical section is one map operation; a poisoned lock is still consistent.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn journal(&self, line: &str) -> Result<(), String> {
        if let Some(path) = &self.args.journal {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|err| format!("journal {}: {err}", path.display()))?;
            // One write(2) per line: `writeln!` writes the line and its newline separately, and
            // two drivers appending at once then interleave ("create A 1create B 1\n\n").
            file.write_all(format!("{line}\n").as_bytes())
                .map_err(|err| format!("journal {}: {err}", path.display()))?;
        }
        Ok(())
    }

    /// Creates a listener per presentation (unless they exist) and returns the endpoints.
    async fn create(&self, spec: &proto::LessonSpec) -> Result<Vec<proto::EndpointState>, String> {
        if let Some(entry) = self.entries().get(&spec.live_lesson_id) {
            return Ok(entry.endpoints.clone());
        }
        // Built inside an Entry, whose Drop stops the listeners if this future is dropped.
        let mut entry = Entry {
            labels: spec.labels.clone(),
            listeners: Vec::new(),
            endpoints: Vec::new(),
            stage: Arc::new(Mutex::new(spec.stage)),
        };
        for endpoint in &spec.endpoints {
            let mut presentations = Vec::new();
            if !self.args.null {
                for p in &endpoint.presentations {
                    let listener = TcpListener::bind("127.0.0.1:0")
                        .await
                        .map_err(|err| format!("cannot bind a listener: {err}"))?;
                    let address = listener
                        .local_addr()
                        .map_err(|err| err.to_string())?
                        .to_string();
                    entry.listeners.push(tokio::spawn(serve_presentation(
                        listener,
                        p.r#type,
                        spec.lesson_slug.clone(),
                        endpoint.name.clone(),
                        entry.stage.clone(),
                    )));
                    presentations.push(sdk::spec::presentation_state(&p.name, p.r#type, address));
                }
            }
            entry.endpoints.push(proto::EndpointState {
                name: endpoint.name.clone(),
                total: presentations.len() as u32,
                healthy: 0,
                presentations,
                internal_address: "127.0.0.1".into(),
            });
        }
        self.journal(&format!(
            "create {} {}",
            spec.live_lesson_id, spec.generation
        ))?;
        let endpoints = entry.endpoints.clone();
        self.entries().insert(spec.live_lesson_id.clone(), entry);
        Ok(endpoints)
    }
}

#[tonic::async_trait]
impl Backend for Loopback {
    fn describe(&self) -> Description {
        let mut description = Description::new(
            "test-agent",
            env!("CARGO_PKG_VERSION"),
            &[
                capabilities::PRESENTATION_SSH,
                capabilities::PRESENTATION_HTTP,
                capabilities::STAGE_CONFIGURATION,
                capabilities::PLAN,
                capabilities::WATCH,
                capabilities::RECOVER,
            ],
        );
        if let Some(offered) = &self.args.capabilities {
            description.capabilities = offered.clone();
        }
        description.majors = self.args.majors.clone();
        description.max_live_lessons = self.args.max_live_lessons;
        description
    }

    async fn realise(
        &self,
        spec: proto::LessonSpec,
        start: Start,
        report: Report,
    ) -> Result<Vec<proto::EndpointState>, String> {
        if start == Start::Create && !self.args.null {
            report.phase(Phase::Booting, "booting");
            tokio::time::sleep(self.args.boot_delay).await;
        }
        let mut endpoints = self.create(&spec).await?;
        if self.args.null {
            return Ok(endpoints);
        }
        report.update(|s| {
            s.phase = Phase::Configuring as i32;
            s.reason = format!("configuring stage {}", spec.stage);
            s.endpoints = endpoints.clone();
        });
        tokio::time::sleep(self.args.configure_delay).await;
        if let Some(entry) = self.entries().get(&spec.live_lesson_id) {
            *entry.stage.lock().unwrap_or_else(|p| p.into_inner()) = spec.stage;
        }
        if self.args.fail_lesson.contains(&spec.lesson_slug) {
            return Err(format!(
                "lesson `{}` is configured to fail in this test agent",
                spec.lesson_slug
            ));
        }
        // Probe until every presentation answers like its type.
        for endpoint in &mut endpoints {
            for p in &endpoint.presentations {
                let expect = sdk::probe::expect(p.r#type);
                while sdk::probe::probe(&p.address, expect, Duration::from_secs(2))
                    .await
                    .is_err()
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            endpoint.healthy = endpoint.total;
        }
        Ok(endpoints)
    }

    async fn remove(&self, live_lesson_id: &str) -> Result<(), Status> {
        self.entries().remove(live_lesson_id);
        Ok(())
    }

    async fn discover(
        &self,
        selector: &HashMap<String, String>,
    ) -> Result<Vec<HashMap<String, String>>, Status> {
        Ok(self
            .entries()
            .values()
            .filter(|e| sdk::matches(&e.labels, selector))
            .map(|e| e.labels.clone())
            .collect())
    }

    async fn plan(&self, spec: &proto::LessonSpec) -> Result<proto::PlanResponse, Status> {
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
        Ok(proto::PlanResponse {
            objects,
            diagnostics: vec![],
        })
    }
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = sdk::trace::init_logging("test-agent")?;
    let args = Args::parse();
    let listener = TcpListener::bind(args.listen).await?;
    let metrics = sdk::metrics::bind(args.metrics_listen).await?;
    let agent = Agent::new(Loopback {
        args,
        entries: Mutex::new(HashMap::new()),
    });
    println!("listening on {}", listener.local_addr()?);
    sdk::run(agent, listener, metrics, telemetry, sdk::shutdown_signal())
        .await
        .map_err(|err| anyhow::anyhow!(err))
}
