//! The roster: what the drive layer knows of agents beyond their connections. Which ones an
//! operator drained (kept in the store, so a drain survives restarts), which ones are lost (not
//! ready for longer than `reconciler.agent_grace`), and the labels operators configured for
//! them. It turns the fleet's snapshots into placement's [`Candidate`]s.
//!
//! Loss is judged by looking: the reconciler calls [`Roster::look`] on a short tick, and an
//! agent first seen not ready at some look is lost once it has been not ready at every look
//! for the grace period. An agent never reached since this scheduler started counts from the
//! first look.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::placement::Candidate;
use crate::agents::{AgentState, Fleet, Snapshot};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::Millis;
use crate::settings::AgentConfig;
use crate::store::Store;

/// Drains, losses and configured labels.
pub struct Roster {
    /// Where drains are kept.
    store: Store,
    /// The agents.
    fleet: Arc<Fleet>,
    /// Labels operators configured per agent name (they win over the handshake's).
    configured: HashMap<String, BTreeMap<String, String>>,
    /// How long an agent may be not ready before it is lost.
    grace: Duration,
    /// Where agent states are shown.
    metrics: Arc<Metrics>,
    /// What changes at run time.
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Drained agents' names (a copy of the store's, for placement on the hot path).
    drained: BTreeSet<String>,
    /// Agents not ready at the last look, and since when.
    down_since: HashMap<String, Instant>,
    /// Agents lost: not ready for the grace period.
    lost: BTreeSet<String>,
}

impl Roster {
    /// The roster of `fleet`, with the operators' labels from `agents` and the drains recorded
    /// in `store`.
    pub async fn new(
        store: Store,
        fleet: Arc<Fleet>,
        agents: &[AgentConfig],
        grace: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<Roster, Error> {
        let drained = store.drained_agents().await?.into_iter().collect();
        Ok(Roster {
            store,
            fleet,
            configured: agents
                .iter()
                .map(|a| (a.name.clone(), a.labels.clone()))
                .collect(),
            grace,
            metrics,
            state: Mutex::new(State {
                drained,
                ..State::default()
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Every critical section is a few set operations; a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How often the reconciler should look: often enough that loss is noticed within a
    /// fraction of the grace period.
    pub fn tick(&self) -> Duration {
        (self.grace / 4).clamp(Duration::from_millis(50), Duration::from_secs(5))
    }

    /// Placement's view of every agent, as of now.
    pub fn candidates(&self) -> Vec<Candidate> {
        let snapshots = self.fleet.snapshot();
        let state = self.state();
        snapshots
            .iter()
            .map(|agent| self.candidate(agent, &state))
            .collect()
    }

    fn candidate(&self, agent: &Snapshot, state: &State) -> Candidate {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        Candidate::of(
            agent,
            self.configured.get(&agent.name).unwrap_or(&NONE),
            state.drained.contains(&agent.name),
            state.lost.contains(&agent.name),
        )
    }

    /// One agent's view, if it is known.
    pub fn candidate_named(&self, name: &str) -> Option<Candidate> {
        let snapshot = self.fleet.get(name)?.snapshot();
        Some(self.candidate(&snapshot, &self.state()))
    }

    /// Whether an operator drained the agent.
    pub fn is_drained(&self, name: &str) -> bool {
        self.state().drained.contains(name)
    }

    /// Whether the agent is lost.
    pub fn is_lost(&self, name: &str) -> bool {
        self.state().lost.contains(name)
    }

    /// Drains an agent (recorded first, so the drain survives a restart). NOT_FOUND for a name
    /// the fleet does not know.
    pub async fn drain(&self, name: &str, identity: &str) -> Result<(), Error> {
        if self.fleet.get(name).is_none() {
            return Err(Error::AgentNotFound(name.to_owned()));
        }
        self.store
            .drain_agent(name, identity, Millis::now())
            .await?;
        self.state().drained.insert(name.to_owned());
        tracing::info!(agent = %name, "agent drained");
        Ok(())
    }

    /// Lets placement choose a drained agent again. NOT_FOUND for a name the fleet does not
    /// know.
    pub async fn resume(&self, name: &str) -> Result<(), Error> {
        if self.fleet.get(name).is_none() {
            return Err(Error::AgentNotFound(name.to_owned()));
        }
        self.store.resume_agent(name).await?;
        self.state().drained.remove(name);
        tracing::info!(agent = %name, "agent resumed");
        Ok(())
    }

    /// Looks at the fleet at `now`: notes which agents are not ready and since when, and
    /// returns the agents lost (not ready at every look for the grace period), newly or not.
    pub fn look(&self, now: Instant) -> Vec<String> {
        let snapshots = self.fleet.snapshot();
        let mut state = self.state();
        let mut lost = Vec::new();
        for agent in &snapshots {
            let ready = agent.status.state == AgentState::Ready;
            if ready {
                state.down_since.remove(&agent.name);
                if state.lost.remove(&agent.name) {
                    tracing::info!(agent = %agent.name, "lost agent is back");
                }
            } else {
                let since = *state.down_since.entry(agent.name.clone()).or_insert(now);
                if now.duration_since(since) >= self.grace {
                    if state.lost.insert(agent.name.clone()) {
                        tracing::warn!(
                            agent = %agent.name,
                            reason = %agent.status.last_error,
                            "agent lost: not ready for reconciler.agent_grace; moving its live lessons"
                        );
                    }
                    lost.push(agent.name.clone());
                }
            }
            self.metrics.agent_state(
                &agent.name,
                ready,
                state.lost.contains(&agent.name),
                state.drained.contains(&agent.name),
            );
        }
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::ReconcilerConfig;

    async fn roster(grace: Duration) -> (tempfile::TempDir, Roster) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).await.unwrap();
        let agents = vec![AgentConfig {
            name: "a".into(),
            // Nothing listens there: the agent stays not ready.
            address: "http://127.0.0.1:9".into(),
            labels: BTreeMap::from([("region".into(), "eu".into())]),
            tls: None,
        }];
        let metrics = Arc::new(Metrics::default());
        let fleet =
            Arc::new(Fleet::new(&agents, &ReconcilerConfig::default(), metrics.clone()).unwrap());
        let roster = Roster::new(store, fleet, &agents, grace, metrics)
            .await
            .unwrap();
        (dir, roster)
    }

    #[tokio::test]
    async fn an_agent_not_ready_for_the_grace_is_lost() {
        let grace = Duration::from_secs(60);
        let (_dir, roster) = roster(grace).await;
        let t0 = Instant::now();
        assert!(roster.look(t0).is_empty());
        assert!(roster.look(t0 + grace / 2).is_empty());
        assert_eq!(roster.look(t0 + grace), ["a"]);
        assert!(roster.is_lost("a"));
        let candidate = roster.candidate_named("a").unwrap();
        assert_eq!(
            candidate.availability,
            super::super::placement::Availability::Lost
        );
        assert_eq!(candidate.labels["region"], "eu", "configured labels apply");
    }

    #[tokio::test]
    async fn drains_are_kept_and_unknown_agents_refused() {
        let (_dir, roster) = roster(Duration::from_secs(1)).await;
        roster.drain("a", "token:ops").await.unwrap();
        assert!(roster.is_drained("a"));
        assert!(roster.candidates()[0].drained);
        assert_eq!(roster.store.drained_agents().await.unwrap(), ["a"]);
        assert!(matches!(
            roster.drain("ghost", "token:ops").await,
            Err(Error::AgentNotFound(_))
        ));
        roster.resume("a").await.unwrap();
        assert!(!roster.is_drained("a"));
        assert!(roster.store.drained_agents().await.unwrap().is_empty());
    }
}
