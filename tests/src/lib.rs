//! Harness for Antidote's end-to-end tests and load generator: starts the real binaries on free
//! loopback ports, connects gRPC clients, and follows live lessons through the public API.
//!
//! Processes print `listening on ADDR` on stdout once they serve; the harness reads that line
//! instead of guessing ports or sleeping. Each process's stderr goes to a log file that a failing
//! test prints.
#![forbid(unsafe_code)]

pub mod otlp;
pub mod web;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use anyhow::{Context as _, bail};
use api::admin_service_client::AdminServiceClient;
use api::curriculum_service_client::CurriculumServiceClient;
use api::live_lesson_service_client::LiveLessonServiceClient;
use api::session_service_client::SessionServiceClient;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::Channel;

/// A binary of this workspace, next to the running test executable (`target/<profile>/`).
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let mut dir = exe
        .parent()
        .expect("the test executable is in a directory")
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace's binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// A running child process that serves on a loopback port.
pub struct Process {
    child: Child,
    /// Where it serves.
    pub addr: SocketAddr,
    /// Other listeners it printed before (`http listening on ADDR` → `"http"`).
    pub extra: HashMap<String, SocketAddr>,
    /// Its stderr.
    pub log: PathBuf,
}

impl Process {
    /// Starts `program` and waits until it prints `listening on ADDR`.
    pub async fn spawn(program: &Path, args: &[String], log: PathBuf) -> anyhow::Result<Process> {
        Self::spawn_with_env(program, args, &[], log).await
    }

    /// [`Process::spawn`] with extra environment variables.
    pub async fn spawn_with_env(
        program: &Path,
        args: &[String],
        env: &[(&str, String)],
        log: PathBuf,
    ) -> anyhow::Result<Process> {
        let stderr = std::fs::File::create(&log)?;
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info,scheduler_svc=debug".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", program.display()))?;
        let stdout = child.stdout.take().context("stdout is piped")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut extra = HashMap::new();
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(addr) = line.strip_prefix("listening on ") {
                    return Ok::<_, anyhow::Error>(Some(addr.trim().parse::<SocketAddr>()?));
                }
                if let Some((name, addr)) = line.split_once(" listening on ") {
                    extra.insert(name.trim().to_owned(), addr.trim().parse::<SocketAddr>()?);
                }
            }
            Ok(None)
        })
        .await
        .with_context(|| format!("{} did not start within 60 s", program.display()))??;
        let Some(addr) = addr else {
            let _ = child.wait().await;
            bail!(
                "{} exited before serving:\n{}",
                program.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Process {
            child,
            addr,
            extra,
            log,
        })
    }

    /// `kill -9`: no chance to clean up.
    pub async fn kill9(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// SIGTERM, then waits for the exit.
    pub async fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        if let Some(pid) = self.child.id() {
            std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()?;
        }
        Ok(tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await??)
    }

    /// The process's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://ADDR` of a listener printed as `NAME listening on ADDR`.
    pub fn extra_url(&self, name: &str) -> anyhow::Result<String> {
        let addr = self
            .extra
            .get(name)
            .with_context(|| format!("the process printed no `{name} listening on ADDR`"))?;
        Ok(format!("http://{addr}"))
    }
}

/// gRPC clients for every public service of one scheduler.
#[derive(Clone)]
pub struct Clients {
    /// CurriculumService.
    pub curriculum: CurriculumServiceClient<Channel>,
    /// SessionService.
    pub sessions: SessionServiceClient<Channel>,
    /// LiveLessonService.
    pub lessons: LiveLessonServiceClient<Channel>,
    /// AdminService.
    pub admin: AdminServiceClient<Channel>,
    /// The channel, for health checks and other clients.
    pub channel: Channel,
}

impl Clients {
    /// Connects to a scheduler.
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Clients> {
        let channel = Channel::from_shared(format!("http://{addr}"))?
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok(Clients {
            curriculum: CurriculumServiceClient::new(channel.clone()),
            sessions: SessionServiceClient::new(channel.clone()),
            lessons: LiveLessonServiceClient::new(channel.clone()),
            admin: AdminServiceClient::new(channel.clone()),
            channel,
        })
    }

    /// Opens a session.
    pub async fn session(&self) -> anyhow::Result<String> {
        Ok(self
            .sessions
            .clone()
            .create_session(api::CreateSessionRequest {})
            .await?
            .into_inner()
            .id)
    }

    /// Requests a lesson at a stage.
    pub async fn request(
        &self,
        session: &str,
        lesson: &str,
        stage: u32,
    ) -> Result<api::LiveLesson, tonic::Status> {
        Ok(self
            .lessons
            .clone()
            .request_live_lesson(api::RequestLiveLessonRequest {
                session_id: session.into(),
                lesson_slug: lesson.into(),
                stage,
            })
            .await?
            .into_inner())
    }

    /// Follows a live lesson until `until` holds for its state, returning every status seen on
    /// the way (deduplicated) and the final state. Fails if the stream ends first, or after
    /// `limit` (a guard against hangs, not a performance assertion).
    pub async fn follow(
        &self,
        id: &str,
        limit: Duration,
        until: impl Fn(&api::LiveLesson) -> bool,
    ) -> anyhow::Result<(Vec<api::LiveLessonStatus>, api::LiveLesson)> {
        let mut stream = self
            .lessons
            .clone()
            .watch_live_lesson(api::WatchLiveLessonRequest { id: id.into() })
            .await?
            .into_inner();
        let mut seen = Vec::new();
        tokio::time::timeout(limit, async {
            while let Some(lesson) = stream.message().await? {
                let status = lesson.status();
                if seen.last() != Some(&status) {
                    seen.push(status);
                }
                if until(&lesson) {
                    return Ok((seen, lesson));
                }
            }
            bail!("the watch of {id} ended before the condition held; saw {seen:?}")
        })
        .await
        .with_context(|| format!("live lesson {id} did not reach the condition within {limit:?}"))?
    }

    /// Follows a live lesson until it is READY (or fails with its reason).
    pub async fn ready(&self, id: &str) -> anyhow::Result<api::LiveLesson> {
        let (_, lesson) = self
            .follow(id, Duration::from_secs(120), |l| {
                matches!(
                    l.status(),
                    api::LiveLessonStatus::Ready | api::LiveLessonStatus::Failed
                )
            })
            .await?;
        if lesson.status() != api::LiveLessonStatus::Ready {
            bail!("live lesson {id} FAILED: {}", lesson.failure_reason);
        }
        Ok(lesson)
    }

    /// Waits until a live lesson is gone: its watch stream ends.
    pub async fn gone(&self, id: &str, limit: Duration) -> anyhow::Result<()> {
        let stream = self
            .lessons
            .clone()
            .watch_live_lesson(api::WatchLiveLessonRequest { id: id.into() })
            .await;
        let mut stream = match stream {
            Ok(stream) => stream.into_inner(),
            Err(status) if status.code() == tonic::Code::NotFound => return Ok(()),
            Err(status) => return Err(status.into()),
        };
        tokio::time::timeout(limit, async {
            while stream.message().await?.is_some() {}
            Ok::<_, anyhow::Error>(())
        })
        .await
        .with_context(|| format!("live lesson {id} still exists after {limit:?}"))?
    }

    /// Deletes a live lesson and waits until it is gone.
    pub async fn delete(&self, id: &str, limit: Duration) -> anyhow::Result<()> {
        self.lessons
            .clone()
            .delete_live_lesson(api::DeleteLiveLessonRequest { id: id.into() })
            .await?;
        self.gone(id, limit).await
    }

    /// The benchmarks' scheduler side: `count` lifecycles of `lesson` at `concurrency` (session →
    /// request → READY), then all deleted until gone. Returns both wall times.
    pub async fn lifecycles(
        &self,
        lesson: &'static str,
        count: usize,
        concurrency: usize,
        limit: Duration,
    ) -> anyhow::Result<(Duration, Duration)> {
        lifecycles(
            count,
            concurrency,
            |_| {
                let clients = self.clone();
                async move {
                    let session = clients.session().await?;
                    let id = clients.request(&session, lesson, 0).await?.id;
                    clients.ready(&id).await?;
                    Ok(id)
                }
            },
            |id| {
                let clients = self.clone();
                async move { clients.delete(&id, limit).await }
            },
        )
        .await
    }
}

/// `count` lifecycles at `concurrency`: every `up` (returning the live lesson's id, READY),
/// then every `down` of those ids. Returns the wall times of the two phases.
pub async fn lifecycles<U, UF, D, DF>(
    count: usize,
    concurrency: usize,
    up: U,
    down: D,
) -> anyhow::Result<(Duration, Duration)>
where
    U: Fn(usize) -> UF,
    UF: std::future::Future<Output = anyhow::Result<String>> + Send + 'static,
    D: Fn(String) -> DF,
    DF: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let ids = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let up_time = fan_out(count, concurrency, |i| {
        let (ids, fut) = (ids.clone(), up(i));
        async move {
            let id = fut.await?;
            ids.lock().expect("not poisoned").push(id);
            Ok(())
        }
    })
    .await?;
    let ids = std::mem::take(&mut *ids.lock().expect("not poisoned"));
    let down_time = fan_out(ids.len(), concurrency, |i| down(ids[i].clone())).await?;
    Ok((up_time, down_time))
}

/// A scheduler process with its own directory (configuration and SQLite file), which survives
/// restarts.
pub struct Scheduler {
    /// The process.
    pub process: Process,
    /// Clients connected to it.
    pub clients: Clients,
    /// Where its files are.
    pub dir: PathBuf,
}

impl Scheduler {
    /// Writes `config` (TOML, without `listen` and `database`, which this sets; with an
    /// `[http]` table only if it sets `listen` there) into `dir` and starts the scheduler
    /// binary with it. The HTTP listener is on a free port unless `config` says otherwise.
    pub async fn start(dir: &Path, config: &str) -> anyhow::Result<Scheduler> {
        let path = dir.join("antidote.toml");
        let http = if config.contains("[http]") {
            ""
        } else {
            "http.listen = \"127.0.0.1:0\"\n"
        };
        let full = format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"{}\"\n{http}{config}",
            dir.join("antidote.db").display()
        );
        std::fs::write(&path, full)?;
        let log = dir.join(format!(
            "scheduler-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos()
        ));
        let process = Process::spawn(
            &workspace_bin("scheduler-svc"),
            &[
                "serve".into(),
                "--config".into(),
                path.display().to_string(),
            ],
            log,
        )
        .await?;
        let clients = Clients::connect(process.addr).await?;
        Ok(Scheduler {
            process,
            clients,
            dir: dir.to_path_buf(),
        })
    }
}

/// The example curriculum shipped in `deploy/curriculum`.
pub fn example_curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/curriculum")
        .canonicalize()
        .expect("deploy/curriculum exists")
}

/// One presentation of a live lesson; panics naming what is missing.
pub fn presentation<'a>(
    lesson: &'a api::LiveLesson,
    endpoint: &str,
    name: &str,
) -> &'a api::LivePresentation {
    lesson
        .endpoints
        .iter()
        .find(|e| e.name == endpoint)
        .and_then(|e| e.presentations.iter().find(|p| p.name == name))
        .unwrap_or_else(|| panic!("{endpoint}/{name} missing from {lesson:?}"))
}

/// Reads what a presentation answers: the SSH banner, or the whole HTTP response to `GET /`.
pub async fn fetch(presentation: &api::LivePresentation) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(&presentation.address)
        .await
        .expect("the presentation accepts connections");
    if presentation.r#type == "http" {
        stream
            .write_all(b"GET / HTTP/1.0\r\n\r\n")
            .await
            .expect("the request is sent");
    }
    // HTTP: the whole response (the server closes). SSH: the banner line (a real SSH server
    // waits for the client's banner, so there is no EOF to wait for).
    let ssh = presentation.r#type == "ssh";
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&buf[..n]);
            if ssh && bytes.contains(&b'\n') {
                break;
            }
        }
    })
    .await;
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Runs `count` jobs with `concurrency` in flight and returns the wall time (the benchmarks'
/// driver); the first error is returned after all jobs finished.
pub async fn fan_out<F, Fut>(count: usize, concurrency: usize, job: F) -> anyhow::Result<Duration>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
    let start = std::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..count {
        let permit = permits.clone().acquire_owned().await?;
        let fut = job(i);
        tasks.push(tokio::spawn(async move {
            let result = fut.await;
            drop(permit);
            result
        }));
    }
    let mut first_error = None;
    for task in tasks {
        if let Err(err) = task.await? {
            first_error.get_or_insert(err);
        }
    }
    match first_error {
        Some(err) => Err(err),
        None => Ok(start.elapsed()),
    }
}

/// The benchmarks' scheduler/baseline ratios, round by round: each round's wall times to READY
/// and for teardown are printed with their ratios, then the medians.
#[derive(Default)]
pub struct Ratios {
    ready: Vec<f64>,
    teardown: Vec<f64>,
}

impl Ratios {
    /// Records and prints one round: `(to READY, teardown)` of the baseline and the scheduler.
    pub fn round(
        &mut self,
        round: usize,
        baseline: (Duration, Duration),
        scheduler: (Duration, Duration),
    ) {
        let secs = |d: Duration| d.as_secs_f64();
        let ready = secs(scheduler.0) / secs(baseline.0);
        let teardown = secs(scheduler.1) / secs(baseline.1);
        println!(
            "round {round}: to READY: baseline {:.2} s, scheduler {:.2} s, ratio {ready:.2} | \
             teardown: baseline {:.2} s, scheduler {:.2} s, ratio {teardown:.2}",
            secs(baseline.0),
            secs(scheduler.0),
            secs(baseline.1),
            secs(scheduler.1)
        );
        self.ready.push(ready);
        self.teardown.push(teardown);
    }

    /// Prints the median ratios of the rounds recorded.
    pub fn print_medians(mut self) {
        let median = |values: &mut Vec<f64>| {
            values.sort_by(f64::total_cmp);
            values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
        };
        println!(
            "median ratios (scheduler/baseline): to READY {:.2}, teardown {:.2}",
            median(&mut self.ready),
            median(&mut self.teardown)
        );
    }
}
