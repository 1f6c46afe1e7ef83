//! `test-agent`: a small but real antidote.agent.v1 backend that runs every endpoint on
//! loopback. Each presentation is a real TCP listener on 127.0.0.1 that answers like its type
//! (an SSH banner, an HTTP response naming the lesson, endpoint and stage), and readiness is a
//! real probe of those sockets. It keeps its state in memory, so it is the agent the scheduler's
//! end-to-end tests and the load generator drive; the Docker and Kubernetes agents are the real
//! backends.
//!
//! Its objects die with it, unless `--state-dir` is given: then each live lesson has a record
//! there (labels and the ports its presentations listen on, nothing secret), the way the guide
//! tells agents whose objects cannot outlive their process to work (PROTOCOL.md [A6]). After a
//! restart the records are what `List` finds and what Recover adopts, listening again on the
//! same ports.
//!
//! Configurations are not run (the endpoints are listeners on this host, not machines); a
//! configuration "runs" for `--configure-delay` and fails, `--config-tries` times, when its
//! text contains `--fail-config`. It claims the types of `--configuration-types` (shell unless
//! told otherwise), so placement by configuration type can be tested. The conformance suite's defaults are understood: an image slug
//! containing `--missing-image` (`ghost`) never starts, and a presentation on `--silent-port`
//! (9) accepts connections and never answers, so its probe times out after `--probe-timeout`.
//!
//! Test knobs: `--boot-delay`/`--configure-delay` hold live lessons in BOOTING/CONFIGURING,
//! `--journal` appends one line per object creation (so tests can prove nothing was created
//! twice), `--fail-lesson` makes a lesson fail (`--fail-first N`: its first N provisions
//! only), `--null` does no work at all (READY at once, no sockets: the load generator's agent).

use std::collections::HashMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::output::Run;
use antidote_sdk::pipeline::{Attempt, Limits, Placement, Steps};
use antidote_sdk::{
    self as sdk, Backend, Description, Error, Lesson, Reporter, Start, capabilities, labels,
};
use clap::Parser;
use proto::PresentationType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::Status;

/// The longest a check or solution file may run, whatever the request asks.
const CHECK_CEILING: Duration = Duration::from_secs(300);

#[derive(Parser, Clone)]
#[command(
    name = "test-agent",
    about = "A loopback antidote.agent.v1 backend for tests"
)]
struct Args {
    /// The flags every agent takes: `--listen` (any loopback port by default),
    /// `--metrics-listen`, mTLS (`--tls-*`), `--connect`, the entrypoint (off unless asked for).
    #[command(flatten)]
    agent: sdk::AgentArgs,
    /// Time each new live lesson spends BOOTING.
    #[arg(long, default_value = "0ms", value_parser = humantime_duration)]
    boot_delay: Duration,
    /// Time each stage's configuration takes.
    #[arg(long, default_value = "0ms", value_parser = humantime_duration)]
    configure_delay: Duration,
    /// Time each removal takes (Deprovision answers once it is over).
    #[arg(long, default_value = "0ms", value_parser = humantime_duration)]
    remove_delay: Duration,
    /// Append "create <id> <generation>" here whenever objects are created.
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Lessons whose provisioning fails (after booting), with a reason naming them.
    #[arg(long)]
    fail_lesson: Vec<String>,
    /// With `--fail-lesson`: only the first N provisions of those lessons fail (0: all do), so
    /// a test can watch a failed live lesson's replacement succeed.
    #[arg(long, default_value_t = 0)]
    fail_first: u64,
    /// Do no work: READY at once, no sockets, no probes.
    #[arg(long)]
    null: bool,
    /// Major versions offered in the handshake (to test negotiation).
    #[arg(long, default_value = "1", value_delimiter = ',')]
    majors: Vec<u32>,
    /// Capabilities offered; default: all of them.
    #[arg(long, value_delimiter = ',')]
    capabilities: Option<Vec<String>>,
    /// The configuration types it claims to run, offered as `configuration.<type>` (PROTOCOL.md
    /// [V5]) unless `--capabilities` lists everything; it "runs" any of them alike.
    #[arg(long, default_value = "shell", value_delimiter = ',')]
    configuration_types: Vec<String>,
    /// Capacity offered in the handshake (0 = no limit).
    #[arg(long, default_value_t = 0)]
    max_live_lessons: u32,
    /// Where live lessons' records are kept across restarts (none: objects die with the agent).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Image slugs containing this never start (FAILED while booting).
    #[arg(long, default_value = "ghost")]
    missing_image: String,
    /// Configurations whose text contains this fail.
    #[arg(long, default_value = "fails on purpose")]
    fail_config: String,
    /// Tries of a failing configuration before the live lesson FAILs.
    #[arg(long, default_value_t = 3)]
    config_tries: u32,
    /// Presentations on this port accept connections and never answer (0: none).
    #[arg(long, default_value_t = 9)]
    silent_port: u32,
    /// How long a presentation may take to answer its probe before the live lesson FAILs.
    #[arg(long, default_value = "60s", value_parser = humantime_duration)]
    probe_timeout: Duration,
    /// How long calls and streams may go on after SIGTERM before their connections are cut.
    #[arg(long, default_value = "10s", value_parser = humantime_duration)]
    shutdown_grace: Duration,
    /// A label offered in the handshake, `KEY=VALUE` (repeatable), for placement.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = label)]
    labels: Vec<(String, String)>,
    /// HTTP presentations answer with the request they got (its head, after the page's usual
    /// line), once its whole body (`content-length`) is in: what tests of the entrypoint
    /// check the backend sees.
    #[arg(long)]
    echo_requests: bool,
}

fn label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("label `{text}` should be KEY=VALUE")),
    }
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
    /// Provisions failed by `--fail-lesson` so far (for `--fail-first`).
    failed: std::sync::atomic::AtomicU64,
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

    /// Where the record of live lesson `id` is kept, with `--state-dir`. Ids are UUIDs (the
    /// SDK checks every spec), so they are safe file names.
    fn record_path(&self, id: &str) -> Option<PathBuf> {
        Some(self.args.state_dir.as_ref()?.join(format!("{id}.json")))
    }

    /// The records in `--state-dir`: the objects that outlive this process.
    fn records(&self) -> Vec<Record> {
        let Some(dir) = &self.args.state_dir else {
            return vec![];
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return vec![];
        };
        entries
            .filter_map(|entry| {
                let path = entry.ok()?.path();
                if path.extension()? != "json" {
                    return None;
                }
                serde_json::from_slice(&std::fs::read(path).ok()?).ok()
            })
            .collect()
    }

    /// Writes a live lesson's record (write, then rename: a reader never sees half of one).
    fn save(&self, id: &str, record: &Record) -> Result<(), String> {
        let Some(path) = self.record_path(id) else {
            return Ok(());
        };
        let text = serde_json::to_vec(record).map_err(|err| err.to_string())?;
        let partial = path.with_extension("partial");
        std::fs::write(&partial, text)
            .and_then(|()| std::fs::rename(&partial, &path))
            .map_err(|err| format!("record {}: {err}", path.display()))
    }

    /// Creates a listener per presentation (unless they exist) and returns the endpoints. A
    /// live lesson with a record from before a restart listens on its recorded ports again.
    async fn create(&self, spec: &proto::LessonSpec) -> Result<Vec<proto::EndpointState>, String> {
        if let Some(entry) = self.entries().get(&spec.live_lesson_id) {
            return Ok(entry.endpoints.clone());
        }
        let recorded = self
            .record_path(&spec.live_lesson_id)
            .and_then(|path| std::fs::read(path).ok())
            .and_then(|bytes| serde_json::from_slice::<Record>(&bytes).ok());
        let adopted = recorded.is_some();
        let ports = recorded.map(|r| r.ports).unwrap_or_default();
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
                    let key = format!("{}/{}", endpoint.name, p.name);
                    let listener = match ports.get(&key) {
                        Some(port) => match TcpListener::bind(("127.0.0.1", *port)).await {
                            Ok(listener) => Ok(listener),
                            // Taken meanwhile: a new port, as a backend that cannot keep
                            // addresses would do.
                            Err(_) => TcpListener::bind("127.0.0.1:0").await,
                        },
                        None => TcpListener::bind("127.0.0.1:0").await,
                    }
                    .map_err(|err| format!("cannot bind a listener: {err}"))?;
                    let address = listener
                        .local_addr()
                        .map_err(|err| err.to_string())?
                        .to_string();
                    let silent = self.args.silent_port != 0 && p.port == self.args.silent_port;
                    entry.listeners.push(tokio::spawn(serve_presentation(
                        listener,
                        if silent { None } else { Some(p.r#type) },
                        spec.lesson_slug.clone(),
                        endpoint.name.clone(),
                        entry.stage.clone(),
                        self.args.echo_requests,
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
        if adopted {
            self.journal(&format!(
                "adopt {} {}",
                spec.live_lesson_id, spec.generation
            ))?;
        } else {
            self.journal(&format!(
                "create {} {}",
                spec.live_lesson_id, spec.generation
            ))?;
        }
        let record = Record {
            labels: spec.labels.clone(),
            ports: entry
                .endpoints
                .iter()
                .flat_map(|e| {
                    e.presentations.iter().filter_map(move |p| {
                        let port = p.address.rsplit(':').next()?.parse().ok()?;
                        Some((format!("{}/{}", e.name, p.name), port))
                    })
                })
                .collect(),
        };
        self.save(&spec.live_lesson_id, &record)?;
        let endpoints = entry.endpoints.clone();
        self.entries().insert(spec.live_lesson_id.clone(), entry);
        Ok(endpoints)
    }

    /// The missing image's FAILED reason, when an endpoint runs one (`--missing-image`).
    fn missing_image(&self, lesson: &Lesson) -> Result<(), Error> {
        match lesson
            .endpoints
            .iter()
            .find(|e| e.image.slug.contains(&self.args.missing_image))
        {
            Some(endpoint) => Err(Error::failed_precondition(format!(
                "endpoint `{}`: image `{}` does not start (this test agent treats images named like `{}` as missing)",
                endpoint.name, endpoint.image.slug, self.args.missing_image
            ))),
            None => Ok(()),
        }
    }
}

/// What `--state-dir` keeps of a live lesson: what `discover` finds and what adoption needs.
/// Nothing secret: passwords come back with the next Recover or Provision (PROTOCOL.md [K1]).
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    /// The spec's labels.
    labels: HashMap<String, String>,
    /// The port of each presentation, by `endpoint/presentation`.
    ports: HashMap<String, u16>,
}

/// The pipeline's steps on loopback: listeners made (after `--boot-delay` on a new live
/// lesson), a configuration "run" that fails when its text holds `--fail-config`, probes of the
/// listeners; `--null` skips the pipeline altogether.
#[tonic::async_trait]
impl Steps for Loopback {
    type Objects = Vec<proto::EndpointState>;

    fn limits(&self) -> Limits {
        Limits {
            probe_timeout: self.args.probe_timeout,
            configuration_tries: self.args.config_tries,
            // Every try fails alike: the text is what fails, not the endpoint.
            retry_pause: Duration::ZERO,
            ..Limits::default()
        }
    }

    async fn create(&self, lesson: &Lesson, _report: &Reporter) -> Result<Self::Objects, Error> {
        tokio::time::sleep(self.args.boot_delay).await;
        self.missing_image(lesson)?;
        Ok(self.create(lesson.spec()).await?)
    }

    /// Listeners held are found; a restarted agent's records listen again.
    async fn locate(
        &self,
        lesson: &Lesson,
        _report: &Reporter,
    ) -> Result<Option<Self::Objects>, Error> {
        self.missing_image(lesson)?;
        Ok(Some(self.create(lesson.spec()).await?))
    }

    async fn addresses(
        &self,
        _lesson: &Lesson,
        objects: &Self::Objects,
        _report: &Reporter,
    ) -> Result<Vec<Placement>, Error> {
        Ok(objects
            .iter()
            .map(|endpoint| {
                endpoint.presentations.iter().fold(
                    Placement::new(endpoint.internal_address.clone()),
                    |placement, p| placement.reach(p.name.clone(), p.address.clone()),
                )
            })
            .collect())
    }

    /// The stage "configures" for `--configure-delay`; the listeners then name the new stage,
    /// and a lesson of `--fail-lesson` fails.
    async fn prepare(&self, lesson: &Lesson, _objects: &mut Self::Objects) -> Result<(), Error> {
        tokio::time::sleep(self.args.configure_delay).await;
        if let Some(entry) = self.entries().get(&lesson.id) {
            *entry.stage.lock().unwrap_or_else(|p| p.into_inner()) = lesson.stage;
        }
        if self.args.fail_lesson.contains(&lesson.slug)
            && (self.args.fail_first == 0
                || self
                    .failed
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                    < self.args.fail_first)
        {
            return Err(Error::failed_precondition(format!(
                "lesson `{}` is configured to fail in this test agent",
                lesson.slug
            )));
        }
        Ok(())
    }

    async fn configure(
        &self,
        lesson: &Lesson,
        _objects: &Self::Objects,
        index: usize,
        _timeout: Duration,
    ) -> Result<Attempt, Error> {
        let mut output = sdk::output::Tail::new(sdk::output::OUTPUT_KEPT);
        let fails = lesson.endpoints[index]
            .configuration
            .as_ref()
            .is_some_and(|c| String::from_utf8_lossy(&c.contents).contains(&self.args.fail_config));
        if !fails {
            return Ok(Attempt::Ran(Run::Exited(0), output));
        }
        output.push(
            format!(
                "it contains `{}`, which this test agent fails",
                self.args.fail_config
            )
            .as_bytes(),
        );
        Ok(Attempt::Ran(Run::Exited(1), output))
    }

    /// With `--null`, no work at all: READY at once, no sockets, no probes, no reports on
    /// the way (the load generator's agent).
    async fn realise(
        &self,
        lesson: Lesson,
        start: Start,
        report: Reporter,
    ) -> Result<Vec<proto::EndpointState>, String> {
        if self.args.null {
            return self.create(lesson.spec()).await;
        }
        sdk::pipeline::realise(self, &lesson, start, &report).await
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
                capabilities::CHECKS,
            ],
        );
        if let Some(offered) = &self.args.capabilities {
            description.capabilities = offered.clone();
        }
        if self.args.capabilities.is_none() {
            // The configuration types it "runs" (PROTOCOL.md [V5]).
            description.capabilities.extend(
                self.args
                    .configuration_types
                    .iter()
                    .map(|kind| format!("{}{kind}", capabilities::CONFIGURATION_PREFIX)),
            );
        }
        description.majors = self.args.majors.clone();
        description.max_live_lessons = self.args.max_live_lessons;
        description.labels.extend(self.args.labels.iter().cloned());
        description
    }

    async fn remove(&self, live_lesson_id: &str) -> Result<(), Error> {
        tokio::time::sleep(self.args.remove_delay).await;
        self.entries().remove(live_lesson_id);
        if let Some(path) = self.record_path(live_lesson_id) {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => {
                    return Err(Error::internal(format!(
                        "cannot remove record {}: {err}",
                        path.display()
                    )));
                }
            }
        }
        Ok(())
    }

    async fn discover(
        &self,
        selector: &HashMap<String, String>,
    ) -> Result<Vec<HashMap<String, String>>, Error> {
        // Matched before anything is copied: with thousands of live lessons, copying all of
        // them for every question would be quadratic.
        let mut found: HashMap<String, HashMap<String, String>> = self
            .records()
            .into_iter()
            .filter(|r| sdk::matches(&r.labels, selector))
            .filter_map(|r| Some((r.labels.get(labels::LIVE_LESSON)?.clone(), r.labels)))
            .collect();
        let entries = self.entries();
        // Provision asks about one id: look it up rather than match every live lesson held.
        let held: Vec<&Entry> = match selector.get(labels::LIVE_LESSON) {
            Some(id) => entries.get(id).into_iter().collect(),
            None => entries.values().collect(),
        };
        for entry in held {
            // A held live lesson's own labels win over its record's.
            if let Some(id) = entry.labels.get(labels::LIVE_LESSON) {
                if sdk::matches(&entry.labels, selector) {
                    found.insert(id.clone(), entry.labels.clone());
                } else {
                    found.remove(id);
                }
            }
        }
        Ok(found.into_values().collect())
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

    /// Check and solution files run as local processes (the endpoints are this host): shell
    /// files by `sh -s`, python files by `python3 -`, their contents on standard input, one
    /// after another, each bounded by the request's timeout within [`CHECK_CEILING`] and its
    /// output by the SDK's tail, with the endpoint's name and the live lesson in the
    /// environment.
    async fn run_checks(
        &self,
        spec: &proto::LessonSpec,
        files: &[proto::CheckFile],
        timeout: Option<Duration>,
    ) -> Result<Vec<proto::CheckResult>, Status> {
        use sdk::checks;
        let timeout = checks::check_timeout(timeout, CHECK_CEILING);
        let mut results = Vec::with_capacity(files.len());
        for file in files {
            // The contents on standard input, never as an argument (PROTOCOL.md [X3], [V5]).
            let program = if file.r#type == proto::ConfigurationType::Python as i32 {
                ["python3", "-"]
            } else {
                ["sh", "-s"]
            };
            let argv = program.map(str::to_owned);
            let env = [
                ("ANTIDOTE_HOST".to_owned(), file.endpoint.clone()),
                ("ANTIDOTE_STAGE".to_owned(), spec.stage.to_string()),
                (
                    "ANTIDOTE_LIVE_LESSON".to_owned(),
                    spec.live_lesson_id.clone(),
                ),
            ];
            results.push(
                match checks::run_process(
                    &argv,
                    &env,
                    &file.contents,
                    timeout,
                    sdk::output::OUTPUT_KEPT,
                )
                .await
                {
                    Ok((ended, output, took)) => checks::result(file, ended, &output, took),
                    Err(err) => checks::not_run(file, format!("could not start it: {err}")),
                },
            );
        }
        Ok(results)
    }
}

/// Serves one presentation: an SSH banner or an HTTP page naming lesson, endpoint and stage
/// (with `echo`, and the request's head, once its body is in); with no `kind`, a silent port
/// that accepts and never answers.
async fn serve_presentation(
    listener: TcpListener,
    kind: Option<i32>,
    lesson: String,
    endpoint: String,
    stage: Arc<Mutex<u32>>,
    echo: bool,
) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        let Some(kind) = kind else {
            // Hold the connection open without a word, until the peer gives up.
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            });
            continue;
        };
        let stage = *stage.lock().unwrap_or_else(|p| p.into_inner());
        let body = format!("{lesson} {endpoint} stage {stage}\n");
        tokio::spawn(async move {
            if kind == PresentationType::Ssh as i32 {
                let _ = stream
                    .write_all(format!("SSH-2.0-antidote_test_agent\r\n{body}").as_bytes())
                    .await;
            } else if echo {
                let head = read_request(&mut stream).await.unwrap_or_default();
                let body = format!("{body}{head}");
                let response = format!(
                    "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
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

/// Reads one HTTP/1 request: its head (returned) and then as many body bytes as its
/// `content-length` says. `None` when the peer closes first.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = stream.read(&mut buf).await.ok().filter(|n| *n > 0)?;
        read.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&read[..end]).into_owned();
    let length: usize = head
        .lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse().ok())
        .unwrap_or(0);
    let mut body = read.len() - end;
    while body < length {
        let n = stream.read(&mut buf).await.ok().filter(|n| *n > 0)?;
        body += n;
    }
    Some(head)
}

// One thread: this agent does little work per call, and as loadgen's null agent it shares the
// cores with the scheduler under test, where a second worker only added wake-ups across threads
// (loadgen at concurrency 16: agent CPU per lifecycle 157 -> 113 µs).
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.state_dir {
        std::fs::create_dir_all(dir)?;
    }
    let mut agent = args.agent.clone();
    agent.grace = args.shutdown_grace;
    let backend = Loopback {
        args,
        entries: Mutex::new(HashMap::new()),
        failed: std::sync::atomic::AtomicU64::new(0),
    };
    sdk::run("test-agent", agent, async { Ok::<_, sdk::Error>(backend) })
        .await
        .map_err(|err| anyhow::anyhow!(err))
}
