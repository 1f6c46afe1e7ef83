//! The agents layer: the scheduler's side of `antidote.agent.v1`. One connection per configured
//! agent ([`Agent`]), its handshake and Watch stream ([`supervisor`]), typed calls with
//! deadlines, and load accounting. Callers get domain values ([`AgentReport`], [`Handshake`],
//! [`Plan`]); every agent.v1 type stays inside this folder ([`convert`]).

mod agent;
mod convert;
pub mod intake;
mod supervisor;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use antidote_net::dial::Link;

pub use agent::{Agent, Observer, Transport};
pub use convert::{lost_it, retryable, stage_spec_bytes};
pub use supervisor::{SCHEDULER_CAPABILITIES, SupervisorContext};

use crate::catalog::{Catalog, Lesson};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{EndpointInfo, LiveLesson, LiveLessonId, Millis, Status};
use crate::settings::{AgentConfig, ReconcilerConfig};

/// Connection state of an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentState {
    /// Not yet reached.
    Connecting,
    /// Handshake done; placement may choose it.
    Ready,
    /// Unreachable; retried with backoff.
    Unavailable,
    /// Reached, but no common major version or a broken handshake.
    Incompatible,
}

/// What a handshake established.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Handshake {
    /// The major version the agent chose.
    pub major: u32,
    /// The kind of agent ("agent-docker").
    pub kind: String,
    /// Its build version.
    pub build_version: String,
    /// New on every agent start: a change means it restarted.
    pub instance_id: String,
    /// What it offers (`antidote_proto::capabilities`).
    pub capabilities: BTreeSet<String>,
    /// The most live lessons it takes; 0 means no limit.
    pub max_live_lessons: u32,
    /// What the agent says of itself (region, cluster), for placement.
    pub labels: BTreeMap<String, String>,
}

/// What the scheduler knows about an agent's connection right now.
#[derive(Debug, Clone)]
pub struct AgentStatus {
    pub state: AgentState,
    /// The last successful handshake.
    pub handshake: Option<Handshake>,
    /// The last error, for operators.
    pub last_error: String,
    /// When the last handshake succeeded.
    pub connected_at: Option<Millis>,
}

/// One agent as of now: what placement chooses among and what operators list.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Its configured name.
    pub name: String,
    /// Its address, for operators.
    pub address: String,
    /// Whether it is reachable and what its handshake offered.
    pub status: AgentStatus,
    /// Live lessons placed on it.
    pub load: u32,
}

/// What an agent reports about one live lesson.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentReport {
    /// The live lesson.
    pub id: LiveLessonId,
    /// The generation the agent is working on or reached.
    pub generation: u64,
    /// The status this means for the scheduler; `None` for phases that say nothing about
    /// provisioning (being removed).
    pub status: Option<Status>,
    /// Progress or failure detail.
    pub reason: String,
    /// Where learners reach the endpoints.
    pub endpoints: Vec<EndpointInfo>,
    /// The agent's opaque handle (empty when it gave none).
    pub handle: Vec<u8>,
}

/// A check or solution file to run on a live lesson (RunChecks).
#[derive(Debug, Clone)]
pub struct CheckFile {
    /// Its endpoint.
    pub endpoint: String,
    /// Shell (inside the endpoint) or Python (from the configurator).
    pub kind: crate::catalog::ConfigurationType,
    /// Its name (`client.sh`).
    pub file_name: String,
    /// Its text.
    pub contents: String,
}

/// How one file ran, as its agent answered.
#[derive(Debug, Clone)]
pub struct FileOutcome {
    /// Its endpoint.
    pub endpoint: String,
    /// Its name.
    pub file_name: String,
    /// It ran to its end, so `exit_code` is its status.
    pub exited: bool,
    /// Its exit status.
    pub exit_code: i32,
    /// Killed at the timeout.
    pub timed_out: bool,
    /// The tail of its output.
    pub output: String,
    /// The output was longer.
    pub truncated: bool,
    /// How long it ran.
    pub duration: Duration,
    /// Why it could not run; empty when it ran.
    pub error: String,
}

impl FileOutcome {
    /// It ran to its end and exited 0.
    pub fn passed(&self) -> bool {
        self.exited && self.exit_code == 0 && !self.timed_out && self.error.is_empty()
    }
}

/// What Provision would create.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The objects Provision would create, in order.
    pub objects: Vec<PlannedObject>,
    /// Problems found, as `severity field: message`.
    pub diagnostics: Vec<String>,
}

/// One object of a plan.
#[derive(Debug, Clone)]
pub struct PlannedObject {
    /// Its kind in the backend ("container", "Pod").
    pub kind: String,
    /// Its name in the backend, derived from the live lesson id.
    pub name: String,
    /// Ports it exposes.
    pub ports: Vec<u32>,
    /// Anything else worth showing.
    pub detail: String,
}

/// What a worker waiting on a live lesson learns from the agent's Watch stream.
#[derive(Debug, Clone)]
pub enum Observed {
    /// Nothing since the worker began to observe.
    Nothing,
    /// The live lesson's latest state.
    Report(AgentReport),
    /// The live lesson's objects are gone.
    Deleted,
}

/// Messages from agent supervisors to the reconciler.
#[derive(Debug)]
pub enum FleetEvent {
    /// The agent restarted (its instance id changed): recover its live lessons.
    Restarted(String),
    /// The agent reported a failure nobody was waiting for (e.g. a READY lesson whose
    /// container died).
    Unsolicited(String, AgentReport),
    /// The agent's Watch said a live lesson was deleted, and nobody was waiting for it (it was
    /// removed behind the scheduler's back, or the scheduler's own removal ended).
    Vanished(String, LiveLessonId),
    /// A complete Watch snapshot of an agent that did not restart since the scheduler last
    /// reached it: the live lessons it holds. One placed on it and missing here is gone.
    Snapshot(String, HashSet<LiveLessonId>),
}

/// Everything an agent needs to realise a live lesson at its desired generation.
#[derive(Clone, Copy)]
pub struct Desired<'a> {
    /// This scheduler's instance id, put on every object through the labels.
    pub instance_id: &'a str,
    /// This deployment's cluster id (from its database), put on every object too.
    pub cluster_id: &'a str,
    /// The live lesson (id, session, stage, generation, handle).
    pub live: &'a LiveLesson,
    /// Its lesson's definition.
    pub lesson: &'a Lesson,
    /// Where its images are defined.
    pub catalog: &'a Catalog,
}

/// Every agent: those configured (dialled), then those that dialled in (they join at run time,
/// through the intake, and stay: an agent away is unavailable, as a dialled one would be).
pub struct Fleet {
    /// Configured agents in configuration order, then agents that dialled in, in order of
    /// arrival. Never shrinks, so a name once known always finds its agent.
    agents: RwLock<Vec<Arc<Agent>>>,
    /// Whether agents may dial in (the intake is configured): only then does a name the store
    /// knows but the configuration does not become a dial-in agent waiting for its connection.
    dial_in: OnceLock<()>,
    /// How supervisors of agents joining at run time are started: set by
    /// [`Fleet::spawn_supervisors`].
    supervising: OnceLock<(tokio_util::task::TaskTracker, SupervisorContext)>,
    /// Deadline of each call, for agents joining at run time.
    call_timeout: Duration,
    /// Where their calls are counted.
    metrics: Arc<Metrics>,
}

impl Fleet {
    /// Creates clients for every configured agent (connections are made lazily).
    pub fn new(
        configs: &[AgentConfig],
        reconciler: &ReconcilerConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Fleet, Error> {
        let agents = configs
            .iter()
            .map(|config| {
                Agent::new(config, reconciler.call_timeout, metrics.clone()).map(Arc::new)
            })
            .collect::<Result<_, _>>()?;
        Ok(Fleet {
            agents: RwLock::new(agents),
            dial_in: OnceLock::new(),
            supervising: OnceLock::new(),
            call_timeout: reconciler.call_timeout,
            metrics,
        })
    }

    /// Lets agents dial in, and lists those `expected` (by certificate name) at once, waiting
    /// for their connection. Call before [`Fleet::set_loads`], so agents holding live lessons
    /// are known before they dial in again.
    pub fn accept_dial_ins(&self, expected: &[String]) {
        let _ = self.dial_in.set(());
        for name in expected {
            self.dial_in_agent(name);
        }
    }

    /// Every agent, configured ones first.
    pub fn agents(&self) -> Vec<Arc<Agent>> {
        read(&self.agents).clone()
    }

    /// The agent with this name.
    pub fn get(&self, name: &str) -> Option<Arc<Agent>> {
        read(&self.agents)
            .iter()
            .find(|agent| agent.name == name)
            .cloned()
    }

    /// Every agent as of now, configured ones first.
    pub fn snapshot(&self) -> Vec<Snapshot> {
        read(&self.agents)
            .iter()
            .map(|agent| agent.snapshot())
            .collect()
    }

    /// Sets each agent's load from the store's counts (at start-up). With the intake on, a
    /// name that is not configured is an agent that dialled in before the restart: it is
    /// listed, waiting to dial in again, so its live lessons keep their agent.
    pub fn set_loads(&self, loads: impl IntoIterator<Item = (String, u32)>) {
        for (name, load) in loads {
            let agent = match self.get(&name) {
                Some(agent) => Some(agent),
                None if self.dial_in.get().is_some() => Some(self.dial_in_agent(&name)),
                None => None,
            };
            if let Some(agent) = agent {
                agent.set_load(load);
            }
        }
    }

    /// Starts one supervisor per agent; agents joining later get theirs when they join.
    pub fn spawn_supervisors(
        &self,
        tracker: &tokio_util::task::TaskTracker,
        ctx: SupervisorContext,
    ) {
        let agents = {
            // Under the lock, so an agent joining now is either in this list or sees the
            // context set.
            let agents = read(&self.agents);
            let _ = self.supervising.set((tracker.clone(), ctx.clone()));
            agents.clone()
        };
        for agent in agents {
            tracker.spawn(supervisor::supervise(agent, ctx.clone()));
        }
    }

    /// An admitted connection of the agent `name` (its certificate's name): the agent joins
    /// the fleet if it is new, and its calls move to this connection.
    pub fn dialled_in(&self, name: &str, link: Link) {
        let agent = self.dial_in_agent(name);
        match agent.inbound() {
            Some(inbound) => inbound.offer(link),
            // The intake never admits the name of a dialled agent (`intake::Admission`).
            None => {
                tracing::error!(agent = %name, "a dialled agent's name dialled in; connection dropped")
            }
        }
    }

    /// The agent of this name, created as a dial-in agent (with its supervisor, once
    /// supervisors run) if it is not known.
    fn dial_in_agent(&self, name: &str) -> Arc<Agent> {
        let mut agents = self
            .agents
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(agent) = agents.iter().find(|agent| agent.name == name) {
            return agent.clone();
        }
        let agent = Arc::new(Agent::dial_in(
            name,
            self.call_timeout,
            self.metrics.clone(),
        ));
        agents.push(agent.clone());
        if let Some((tracker, ctx)) = self.supervising.get() {
            tracker.spawn(supervisor::supervise(agent.clone(), ctx.clone()));
        }
        tracing::info!(agent = %name, "agent joined the fleet (dial-in)");
        agent
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Writers only push whole agents; a poisoned lock still holds a consistent list.
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}
