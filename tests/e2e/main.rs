//! End-to-end tests: the real `scheduler-svc` binary with a temporary SQLite file, driving the
//! real `test-agent` process over gRPC on loopback, exercised through the public API only.

mod access;
mod bad_input;
mod bounds;
mod browser;
mod checks;
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
use antidote_tests::config::{Agent, SchedulerConfig, secs};
use antidote_tests::{Process, Scheduler, example_curriculum, journal};
use tempfile::TempDir;
use tonic::transport::Channel;

/// What a test may change of an [`Env`]: the scheduler's configuration (the loopback agent is
/// added to it) and the test agent's environment.
pub struct Knobs {
    /// The scheduler's configuration, [`Env::config`] unless the test says otherwise.
    pub config: SchedulerConfig,
    /// The test agent's extra environment.
    pub agent_env: Vec<(&'static str, String)>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            config: Env::config(),
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
    /// The scheduler configuration of an [`Env`] without the agent: instance `e2e` on the
    /// example curriculum, quick reaper and retries, idle live lessons kept 30 min and sessions
    /// a day, no per-address session limit, three live lessons per session.
    pub fn config() -> SchedulerConfig {
        SchedulerConfig::quick("e2e", &example_curriculum())
            .with_lesson_ttl(secs(30 * 60))
            .with_session_ttl(secs(24 * 3600))
            .with_sessions_per_ip(0)
            .with_lessons_per_session(3)
    }

    pub async fn start(agent_args: &[&str], knobs: Knobs) -> Env {
        let dir = tempfile::tempdir().expect("temp dir");
        let journal = dir.path().join("journal");
        let agent = start_agent_with_env(&dir, agent_args, &journal, None, &knobs.agent_env).await;
        let config = knobs
            .config
            .with_agent(Agent::new("loopback", agent.url()))
            .to_toml();
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

    /// The live lessons the agent created objects for, in order, with repeats (its journal).
    pub fn creations(&self) -> Vec<String> {
        journal::created(&self.journal)
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
    Process::spawn_with_env(&antidote_tests::workspace_bin("test-agent"), &all, env, log)
        .await
        .expect("test agent starts")
}

/// A guard against hangs: generous, and never a performance assertion.
pub const PATIENCE: Duration = Duration::from_secs(90);
