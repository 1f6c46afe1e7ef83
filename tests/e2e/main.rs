//! End-to-end tests: the real `scheduler-svc` binary with a temporary SQLite file, driving the
//! real `test-agent` process over gRPC on loopback, exercised through the public API only.

mod access;
mod bad_input;
mod bounds;
mod browser;
mod cli;
mod clock;
mod configurators;
mod conformance;
mod deploy;
mod deploy_ha;
mod dialin;
mod docker;
mod entrypoint;
mod faults;
mod fleet;
mod hardening;
mod k8s;
mod k8s_deploy;
mod k8s_entrypoint;
mod k8s_pools;
mod lifecycle;
mod mesh;
mod mtls;
mod negotiation;
mod oidc;
mod operability;
mod paging;
mod pools;
mod postgres;
mod reaping;
mod replicas;
mod restart;
mod shutdown;
mod starvation;
mod vanished;

use std::path::PathBuf;
use std::time::Duration;

use antidote_proto::agent::v1::backend_client::BackendClient;
use antidote_tests::{Process, Scheduler, example_curriculum};
use tempfile::TempDir;
use tonic::transport::Channel;

/// Scheduler settings a test may change; everything else is fixed for speed.
pub struct Knobs {
    pub lesson_ttl: &'static str,
    pub session_ttl: &'static str,
    pub sessions_per_ip: u32,
    pub lessons_per_session: u32,
    /// Appended to the scheduler's configuration.
    pub extra_config: String,
    /// More keys of its `[limits]` table.
    pub limits_extra: &'static str,
    /// The test agent's extra environment.
    pub agent_env: Vec<(&'static str, String)>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            lesson_ttl: "30m",
            session_ttl: "24h",
            sessions_per_ip: 0,
            lessons_per_session: 3,
            extra_config: String::new(),
            limits_extra: "",
            agent_env: Vec::new(),
        }
    }
}

/// A scheduler and one test agent, in a temporary directory.
pub struct Env {
    pub dir: TempDir,
    pub agent: Process,
    pub scheduler: Scheduler,
    pub journal: PathBuf,
    pub config: String,
}

impl Env {
    pub async fn start(agent_args: &[&str], knobs: Knobs) -> Env {
        let dir = tempfile::tempdir().expect("temp dir");
        let journal = dir.path().join("journal");
        let agent = start_agent_with_env(&dir, agent_args, &journal, None, &knobs.agent_env).await;
        let config = format!(
            r#"instance_id = "e2e"
curriculum = "{curriculum}"
tier = "local"
[ttl]
live_lesson = "{lesson_ttl}"
session = "{session_ttl}"
[limits]
sessions_per_ip = {sessions_per_ip}
live_lessons_per_session = {lessons_per_session}
{limits_extra}
[reaper]
interval = "200ms"
orphan_interval = "200ms"
orphan_grace = "500ms"
[reconciler]
poll_interval = "500ms"
backoff_initial = "50ms"
backoff_max = "1s"
provision_timeout = "2m"
[[agents]]
name = "loopback"
address = "{agent}"
{extra}
"#,
            curriculum = example_curriculum().display(),
            lesson_ttl = knobs.lesson_ttl,
            session_ttl = knobs.session_ttl,
            sessions_per_ip = knobs.sessions_per_ip,
            lessons_per_session = knobs.lessons_per_session,
            agent = agent.url(),
            extra = knobs.extra_config,
            limits_extra = knobs.limits_extra,
        );
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        Env {
            dir,
            agent,
            scheduler,
            journal,
            config,
        }
    }

    /// A client of the agent itself, to check what really exists there.
    pub async fn agent_client(&self) -> BackendClient<Channel> {
        BackendClient::connect(self.agent.url())
            .await
            .expect("agent reachable")
    }

    /// The agent's creation journal: one "create <id> <generation>" line per creation.
    pub fn creations(&self) -> Vec<String> {
        std::fs::read_to_string(&self.journal)
            .unwrap_or_default()
            .lines()
            .map(|line| line.split(' ').nth(1).unwrap_or_default().to_owned())
            .collect()
    }

    /// Both processes' logs, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- scheduler log ---\n{}\n--- agent log ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text()
        )
    }
}

pub async fn start_agent(
    dir: &TempDir,
    args: &[&str],
    journal: &std::path::Path,
    listen: Option<std::net::SocketAddr>,
) -> Process {
    start_agent_with_env(dir, args, journal, listen, &[]).await
}

pub async fn start_agent_with_env(
    dir: &TempDir,
    args: &[&str],
    journal: &std::path::Path,
    listen: Option<std::net::SocketAddr>,
    env: &[(&str, String)],
) -> Process {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.push("--journal".into());
    all.push(journal.display().to_string());
    if let Some(listen) = listen {
        all.push("--listen".into());
        all.push(listen.to_string());
    }
    let log = dir
        .path()
        .join(format!("agent-{}.log", uuid::Uuid::new_v4()));
    Process::spawn_with_env(
        &antidote_tests::workspace_bin("test-agent"),
        &all,
        env,
        log,
    )
    .await
    .expect("test agent starts")
}

/// A guard against hangs: generous, and never a performance assertion.
pub const PATIENCE: Duration = Duration::from_secs(90);
