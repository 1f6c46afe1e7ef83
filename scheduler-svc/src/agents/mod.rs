//! The agents layer: the scheduler's side of `antidote.agent.v1`. One connection per configured
//! agent ([`Agent`]), its handshake and Watch stream ([`supervisor`]), typed calls with
//! deadlines, and load accounting. Callers get domain values ([`Report`], [`Handshake`],
//! [`Plan`]); every agent.v1 type stays inside this folder ([`convert`]).

mod agent;
mod convert;
mod supervisor;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use agent::{Agent, Observer};
pub use convert::{lost_it, retryable};
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
    /// What it offers (`antidote_proto::sdk::capabilities`).
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
pub struct Report {
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
    Report(Report),
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
    Unsolicited(String, Report),
}

/// Everything an agent needs to realise a live lesson at its desired generation.
#[derive(Clone, Copy)]
pub struct Desired<'a> {
    /// This scheduler's instance id, put on every object through the labels.
    pub instance_id: &'a str,
    /// The live lesson (id, session, stage, generation, handle).
    pub live: &'a LiveLesson,
    /// Its lesson's definition.
    pub lesson: &'a Lesson,
    /// Where its images are defined.
    pub catalog: &'a Catalog,
}

/// Every configured agent.
pub struct Fleet {
    /// In configuration order.
    agents: Vec<Arc<Agent>>,
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
        Ok(Fleet { agents })
    }

    /// Every agent, in configuration order.
    pub fn agents(&self) -> &[Arc<Agent>] {
        &self.agents
    }

    /// The agent with this name.
    pub fn get(&self, name: &str) -> Option<&Arc<Agent>> {
        self.agents.iter().find(|agent| agent.name == name)
    }

    /// Every agent as of now, in configuration order.
    pub fn snapshot(&self) -> Vec<Snapshot> {
        self.agents.iter().map(|agent| agent.snapshot()).collect()
    }

    /// Sets each agent's load from the store's counts (at start-up).
    pub fn set_loads(&self, loads: impl IntoIterator<Item = (String, u32)>) {
        for (name, load) in loads {
            if let Some(agent) = self.get(&name) {
                agent.set_load(load);
            }
        }
    }

    /// Starts one supervisor per agent.
    pub fn spawn_supervisors(
        &self,
        tracker: &tokio_util::task::TaskTracker,
        ctx: SupervisorContext,
    ) {
        for agent in &self.agents {
            tracker.spawn(supervisor::supervise(agent.clone(), ctx.clone()));
        }
    }
}
