//! Harness for Antidote's end-to-end tests and load generator: starts the real binaries on free
//! loopback ports, connects gRPC clients, and follows live lessons through the public API.
//!
//! Processes print `listening on ADDR` on stdout once they serve; the harness reads that line
//! instead of guessing ports or sleeping. Each process's stderr goes to a log file that a failing
//! test prints.
#![forbid(unsafe_code)]

pub mod checks;
pub mod command;
pub mod config;
pub mod journal;
pub mod otlp;
pub mod pki;
pub mod web;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
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

/// A free loopback port below the kernel's ephemeral range (`ip_local_port_range`), for a
/// listener that a test stops and starts again on the same port.
///
/// A port the kernel picked for `127.0.0.1:0` lies in the ephemeral range, which the kernel also
/// hands out as the local port of outgoing connections: while its listener is down (a scheduler
/// killed with -9, an agent restarting), any test's connection, or a connection to that very
/// port, may take it, and the restart fails with "Address already in use". Outgoing connections
/// never get a port below the range, and this process never hands out one port twice.
pub fn port_to_keep() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Ports from 10,000 up to the range, where nothing of the suite's fixed ports lies.
    let (first, span) = (10_000u16, low.saturating_sub(10_000).max(1));
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let start = (uuid::Uuid::new_v4().as_u128() % u128::from(span)) as u16;
    (0..span)
        .map(|i| first + (start + i) % span)
        .find(|port| {
            !given.contains(port) && std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok()
        })
        .inspect(|port| given.push(*port))
        .expect("a free port below the ephemeral range")
}

/// A running child process that serves on a loopback port, or an agent that dials in.
pub struct Process {
    child: Child,
    /// Where it serves (`listening on ADDR`), or the intake it dials (`dialling in to ADDR`: an
    /// agent with no listening socket).
    pub addr: SocketAddr,
    /// Other listeners it printed before (`http listening on ADDR` → `"http"`).
    pub extra: HashMap<String, SocketAddr>,
    /// Its stderr.
    pub log: PathBuf,
}

impl Process {
    /// Starts `program` and waits until it prints `listening on ADDR` (or, for an agent that
    /// dials in, `dialling in to ADDR`).
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
        // `--listen 127.0.0.1:0` gets a port that stays free while the process restarts.
        let mut args = args.to_vec();
        if let Some(at) = args
            .windows(2)
            .position(|w| w == ["--listen", "127.0.0.1:0"])
        {
            args[at + 1] = format!("127.0.0.1:{}", port_to_keep());
        }
        let mut child = Command::new(program)
            .args(&args)
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
                if let Some(addr) = line
                    .strip_prefix("listening on ")
                    .or_else(|| line.strip_prefix("dialling in to "))
                {
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

    /// Its process id (`None` once it was waited for).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
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

    /// Waits until its stderr contains `needle` (see [`until_text`]).
    pub async fn until_logged(&self, needle: &str, limit: Duration) -> anyhow::Result<()> {
        until_text(|| self.log_text(), needle, limit).await
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

/// Waits until `text()` (a log, read again every 100 ms: a file has no event to wait on)
/// contains `needle`; after `limit` (a guard against hangs, not a timing assertion) fails with
/// what it last read.
pub async fn until_text(
    text: impl Fn() -> String,
    needle: &str,
    limit: Duration,
) -> anyhow::Result<()> {
    let found = tokio::time::timeout(limit, async {
        while !text().contains(needle) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    if found.is_err() {
        bail!("`{needle}` never showed within {limit:?}:\n{}", text());
    }
    Ok(())
}

/// The logs of processes, each under a `--- NAME log ---` header, for failure messages.
pub fn logs<'a>(processes: impl IntoIterator<Item = (String, &'a Process)>) -> String {
    processes
        .into_iter()
        .map(|(name, process)| format!("--- {name} log ---\n{}\n", process.log_text()))
        .collect()
}

/// The URL of one of the suite's servers: the one `var` names (`tests/run` starts each and sets
/// its variable), or the one `script start` (a path below `tests/`) starts and prints as the
/// last line `VAR=URL` when `var` is unset.
pub fn server_url(var: &str, script: &str) -> String {
    if let Ok(url) = std::env::var(var)
        && !url.is_empty()
    {
        return url;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let output = std::process::Command::new(&script)
        .arg("start")
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|err| panic!("cannot run {}: {err}", script.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let prefix = format!("{var}=");
    match stdout
        .lines()
        .last()
        .and_then(|line| line.strip_prefix(prefix.as_str()))
    {
        Some(url) if output.status.success() => url.to_owned(),
        _ => panic!(
            "{var} is unset and {} start failed: {stdout}",
            script.display()
        ),
    }
}

/// An agent that the conformance suite restarts by itself (`--restart-cmd`): a harness task
/// starts it again, with the same arguments and on the same address, whenever it exits, and
/// [`Restartable::restart_cmd`] is the shell command that stops the running process (SIGTERM;
/// the task keeps its pid in a file). Dropping this ends the task and kills the process.
pub struct Restartable {
    /// Where it serves, the same across restarts.
    pub addr: SocketAddr,
    /// The file holding the running process's pid.
    pidfile: PathBuf,
    /// The stderr log of every start, in order.
    logs: Arc<Mutex<Vec<PathBuf>>>,
    /// The task that starts it again.
    task: tokio::task::JoinHandle<()>,
}

impl Restartable {
    /// Starts `program` with `args`, which hold `--listen ADDR` (port 0 is fine: restarts use
    /// the address it printed) or `--connect URL` (an agent that dials in), logging to
    /// `dir/NAME-N.log` for the N-th start.
    pub async fn spawn(
        program: &Path,
        args: &[String],
        env: &[(&str, String)],
        dir: &Path,
        name: &str,
    ) -> anyhow::Result<Restartable> {
        let log = {
            let (dir, name) = (dir.to_owned(), name.to_owned());
            move |n: usize| dir.join(format!("{name}-{n}.log"))
        };
        let mut process = Process::spawn_with_env(program, args, env, log(0)).await?;
        let addr = process.addr;
        let mut args = args.to_vec();
        // An agent that dials in (no --listen) dials the same intake again.
        if let Some(listen) = args.iter().position(|a| a == "--listen") {
            *args
                .get_mut(listen + 1)
                .context("--listen without a value")? = addr.to_string();
        }
        let pidfile = dir.join(format!("{name}.pid"));
        let write_pid = {
            let pidfile = pidfile.clone();
            move |process: &Process| {
                let pid = process
                    .child
                    .id()
                    .map(|p| p.to_string())
                    .unwrap_or_default();
                std::fs::write(&pidfile, pid)
            }
        };
        write_pid(&process)?;
        let logs = Arc::new(Mutex::new(vec![log(0)]));
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let task = tokio::spawn({
            let (program, logs) = (program.to_owned(), logs.clone());
            async move {
                for n in 1.. {
                    let _ = process.child.wait().await;
                    let env: Vec<(&str, String)> =
                        env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
                    logs.lock().unwrap_or_else(|p| p.into_inner()).push(log(n));
                    process = match Process::spawn_with_env(&program, &args, &env, log(n)).await {
                        Ok(process) => process,
                        // The log says why; the suite reports the agent unreachable.
                        Err(_) => return,
                    };
                    let _ = write_pid(&process);
                }
            }
        });
        Ok(Restartable {
            addr,
            pidfile,
            logs,
            task,
        })
    }

    /// `sh` code that restarts the agent: it stops the running process, the harness starts it
    /// again.
    pub fn restart_cmd(&self) -> String {
        format!("kill -TERM \"$(cat '{}')\"", self.pidfile.display())
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The stderr of every start so far, each under a header.
    pub fn log_text(&self) -> String {
        let logs = self.logs.lock().unwrap_or_else(|p| p.into_inner()).clone();
        logs.iter()
            .map(|log| {
                format!(
                    "--- {} ---\n{}",
                    log.display(),
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            })
            .collect()
    }
}

impl Drop for Restartable {
    fn drop(&mut self) {
        // The task owns the running process, which is killed when the task's future drops.
        self.task.abort();
    }
}

/// The admin token every test scheduler accepts (scope `admin:write`).
pub const ADMIN_TOKEN: &str = "antidote-tests-admin-token-0123456789abcdef";

/// An admin token every test scheduler accepts with scope `admin:read` only.
pub const ADMIN_READ_TOKEN: &str = "antidote-tests-read-only-token-fedcba9876543210";

/// The configuration lines that give a test scheduler its admin listeners, [`ADMIN_TOKEN`] and
/// [`ADMIN_READ_TOKEN`] (configured by their SHA-256, as operators do).
pub fn admin_config() -> String {
    use sha2::Digest as _;
    let hash = |token: &str| hex::encode(sha2::Sha256::digest(token.as_bytes()));
    format!(
        "admin.listen = \"127.0.0.1:0\"\nadmin.http_listen = \"127.0.0.1:0\"\n\
         admin.tokens = [{{ name = \"tests\", sha256 = \"{}\", scopes = [\"admin:write\"] }}, \
         {{ name = \"viewer\", sha256 = \"{}\", scopes = [\"admin:read\"] }}]\n",
        hash(ADMIN_TOKEN),
        hash(ADMIN_READ_TOKEN)
    )
}

/// Learners' session tokens, by session and by live lesson, so that the harness's calls carry
/// the right one; a call made without one (a test's own raw call) gets the latest session's.
#[derive(Clone, Default)]
pub struct Tokens(Arc<Mutex<TokenBook>>);

#[derive(Default)]
struct TokenBook {
    by_session: HashMap<String, String>,
    by_lesson: HashMap<String, String>,
    latest: Option<String>,
}

impl Tokens {
    fn book(&self) -> std::sync::MutexGuard<'_, TokenBook> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The token of a session the harness created.
    pub fn of_session(&self, session: &str) -> Option<String> {
        self.book().by_session.get(session).cloned()
    }

    /// The token of the session a live lesson belongs to (one the harness requested).
    pub fn of_lesson(&self, lesson: &str) -> Option<String> {
        self.book().by_lesson.get(lesson).cloned()
    }
}

/// Adds `authorization: Bearer TOKEN` to calls that carry none: the admin token for the admin
/// client, the latest session's token for the learners' clients.
#[derive(Clone)]
pub struct Bearer {
    admin: bool,
    tokens: Tokens,
}

impl tonic::service::Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if request.metadata().contains_key("authorization") {
            return Ok(request);
        }
        let token = if self.admin {
            Some(ADMIN_TOKEN.to_owned())
        } else {
            self.tokens.book().latest.clone()
        };
        if let Some(token) = token
            && let Ok(value) = format!("Bearer {token}").parse()
        {
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}

/// A channel whose calls carry a bearer token.
pub type Authed = tonic::service::interceptor::InterceptedService<Channel, Bearer>;

/// A request carrying `token` (when known).
pub fn with_token<T>(message: T, token: Option<String>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// gRPC clients for every public service of one scheduler: the learners' services on its
/// public listener, AdminService on its admin listener with [`ADMIN_TOKEN`].
#[derive(Clone)]
pub struct Clients {
    /// CurriculumService.
    pub curriculum: CurriculumServiceClient<Authed>,
    /// SessionService.
    pub sessions: SessionServiceClient<Authed>,
    /// LiveLessonService.
    pub lessons: LiveLessonServiceClient<Authed>,
    /// AdminService, on the admin listener.
    pub admin: AdminServiceClient<Authed>,
    /// The learners' channel, for health checks and other clients.
    pub channel: Channel,
    /// The admin listener's channel.
    pub admin_channel: Channel,
    /// The session tokens of the sessions these clients created.
    pub tokens: Tokens,
}

impl Clients {
    /// Connects to a scheduler's learners' listener and its admin listener.
    pub async fn connect(addr: SocketAddr, admin: SocketAddr) -> anyhow::Result<Clients> {
        let connect = |addr: SocketAddr| async move {
            Channel::from_shared(format!("http://{addr}"))?
                .tcp_nodelay(true)
                .connect()
                .await
                .map_err(anyhow::Error::from)
        };
        let (channel, admin_channel) = (connect(addr).await?, connect(admin).await?);
        let tokens = Tokens::default();
        let learner = Bearer {
            admin: false,
            tokens: tokens.clone(),
        };
        let operator = Bearer {
            admin: true,
            tokens: tokens.clone(),
        };
        Ok(Clients {
            curriculum: CurriculumServiceClient::with_interceptor(channel.clone(), learner.clone()),
            sessions: SessionServiceClient::with_interceptor(channel.clone(), learner.clone()),
            lessons: LiveLessonServiceClient::with_interceptor(channel.clone(), learner),
            admin: AdminServiceClient::with_interceptor(admin_channel.clone(), operator),
            channel,
            admin_channel,
            tokens,
        })
    }

    /// Opens a session; its token is kept for the calls about it.
    pub async fn session(&self) -> anyhow::Result<String> {
        let session = self
            .sessions
            .clone()
            .create_session(api::CreateSessionRequest {})
            .await?
            .into_inner();
        let mut book = self.tokens.book();
        book.by_session
            .insert(session.id.clone(), session.token.clone());
        book.latest = Some(session.token);
        Ok(session.id)
    }

    /// Requests a lesson at a stage, with the session's token.
    pub async fn request(
        &self,
        session: &str,
        lesson: &str,
        stage: u32,
    ) -> Result<api::LiveLesson, tonic::Status> {
        self.request_placed(session, lesson, stage, None).await
    }

    /// [`Clients::request`] with a placement preference (labels the agent must or should
    /// carry).
    pub async fn request_placed(
        &self,
        session: &str,
        lesson: &str,
        stage: u32,
        placement: Option<api::PlacementPreference>,
    ) -> Result<api::LiveLesson, tonic::Status> {
        let token = self.tokens.of_session(session);
        let lesson = self
            .lessons
            .clone()
            .request_live_lesson(with_token(
                api::RequestLiveLessonRequest {
                    session_id: session.into(),
                    lesson_slug: lesson.into(),
                    stage,
                    placement,
                },
                token.clone(),
            ))
            .await?
            .into_inner();
        if let Some(token) = token {
            self.tokens
                .book()
                .by_lesson
                .insert(lesson.id.clone(), token);
        }
        Ok(lesson)
    }

    /// A live lesson as its learner sees it (GetLiveLesson with its session's token).
    pub async fn get(&self, id: &str) -> Result<api::LiveLesson, tonic::Status> {
        let request = with_token(
            api::GetLiveLessonRequest { id: id.into() },
            self.tokens.of_lesson(id),
        );
        Ok(self
            .lessons
            .clone()
            .get_live_lesson(request)
            .await?
            .into_inner())
    }

    /// The agents, as ListAgents shows them to operators.
    pub async fn agents(&self) -> Result<Vec<api::Agent>, tonic::Status> {
        let mut admin = self.admin.clone();
        Ok(admin
            .list_agents(api::ListAgentsRequest {})
            .await?
            .into_inner()
            .agents)
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
            .watch_live_lesson(with_token(
                api::WatchLiveLessonRequest { id: id.into() },
                self.tokens.of_lesson(id),
            ))
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
            .watch_live_lesson(with_token(
                api::WatchLiveLessonRequest { id: id.into() },
                self.tokens.of_lesson(id),
            ))
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

    /// The agent a live lesson is placed on, as the admin API tells operators (learners'
    /// answers never name it).
    pub async fn agent_of(&self, id: &str) -> anyhow::Result<String> {
        let view = self
            .admin
            .clone()
            .get_live_lesson(api::AdminGetLiveLessonRequest { id: id.into() })
            .await?
            .into_inner();
        Ok(view.live_lesson.map(|l| l.agent).unwrap_or_default())
    }

    /// Deletes a live lesson and waits until it is gone.
    pub async fn delete(&self, id: &str, limit: Duration) -> anyhow::Result<()> {
        self.lessons
            .clone()
            .delete_live_lesson(with_token(
                api::DeleteLiveLessonRequest { id: id.into() },
                self.tokens.of_lesson(id),
            ))
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
        Self::start_with_env(dir, config, &[]).await
    }

    /// [`Scheduler::start`] with extra environment variables for the process.
    pub async fn start_with_env(
        dir: &Path,
        config: &str,
        env: &[(&str, String)],
    ) -> anyhow::Result<Scheduler> {
        let path = dir.join("antidote.toml");
        let http = if config.contains("[http]") {
            ""
        } else {
            "http.listen = \"127.0.0.1:0\"\n"
        };
        // Tests that read presentations' backend addresses from learners' answers run as an
        // operator who exposes them (`[entrypoint] backend_addresses`); a configuration with an
        // `[entrypoint]` table says for itself.
        let backend_addresses = if config.contains("[entrypoint]") {
            ""
        } else {
            "entrypoint.backend_addresses = true\n"
        };
        let full = format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"{}\"\n{http}{backend_addresses}{}{config}",
            dir.join("antidote.db").display(),
            admin_config()
        );
        std::fs::write(&path, full)?;
        let log = dir.join(format!(
            "scheduler-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos()
        ));
        let process = Process::spawn_with_env(
            &workspace_bin("scheduler-svc"),
            &[
                "serve".into(),
                "--config".into(),
                path.display().to_string(),
            ],
            env,
            log,
        )
        .await?;
        let admin = *process
            .extra
            .get("admin")
            .context("the scheduler printed no `admin listening on ADDR`")?;
        let clients = Clients::connect(process.addr, admin).await?;
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

    /// Prints the median ratios of the rounds recorded, and their spread (min–max).
    pub fn print_medians(mut self) {
        let summary = |values: &mut Vec<f64>| {
            values.sort_by(f64::total_cmp);
            let median = match values.len() {
                0 => f64::NAN,
                n if n % 2 == 1 => values[n / 2],
                n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
            };
            let first = values.first().copied().unwrap_or(f64::NAN);
            let last = values.last().copied().unwrap_or(f64::NAN);
            format!("{median:.2} ({first:.2}–{last:.2})")
        };
        println!(
            "median ratios (scheduler/baseline) over {} rounds, min–max in brackets: to READY {}, teardown {}",
            self.ready.len(),
            summary(&mut self.ready),
            summary(&mut self.teardown)
        );
    }
}
