//! The reaper: idle live lessons and sessions expire (persistent sessions excepted), objects that
//! agents hold but the store does not place on them (orphans: unknown live lessons, or live
//! lessons moved to another agent while this one was lost) are removed after a grace period, and
//! old events (every tick) and placement records of removed live lessons (at the orphan interval)
//! are pruned. Nothing is wiped at start-up: state is durable.
//!
//! The reaper only marks live lessons for removal in the store; the reconciler does the removal,
//! exactly as for a user's delete.
//!
//! Orphans are only looked for among objects carrying both our instance label and our cluster
//! label (the cluster id created in our database): another deployment's objects, even with the
//! same instance id, and objects without a cluster label are never touched. Replicas on
//! PostgreSQL run these duties once per tick between them: only the holder of the `reaper`
//! lease does.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::reconcile::Reconciler;
use super::replicas::{self, Replica};
use crate::agents::Fleet;
use crate::metrics::{Metrics, ReaperAction, ReaperDuty};
use crate::model::{LiveLessonId, Millis};
use crate::settings::{ReaperConfig, TtlConfig};
use crate::store::Store;

/// What the reaper needs.
pub struct Reaper {
    /// Where expiry marks live lessons and orphans are checked.
    pub store: Store,
    /// Where removals are driven (and watchers told about TERMINATING).
    pub reconciler: Reconciler,
    /// The agents to list for orphans.
    pub fleet: Arc<Fleet>,
    /// How long idle live lessons and sessions live.
    pub ttl: TtlConfig,
    /// How often each duty runs, the orphan grace, event retention.
    pub config: ReaperConfig,
    /// Our instance label value.
    pub instance_id: String,
    /// Our cluster label value.
    pub cluster_id: String,
    /// This process as a replica on PostgreSQL (the duties need the `reaper` lease); `None` on
    /// SQLite.
    pub replica: Option<Arc<Replica>>,
    /// Where actions are counted.
    pub metrics: Arc<Metrics>,
}

impl Reaper {
    /// Runs until shutdown.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut expiry = tokio::time::interval(self.config.interval);
        expiry.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut orphans = tokio::time::interval(self.config.orphan_interval);
        orphans.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut suspects = Suspects::default();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = expiry.tick() => if self.on_duty().await {
                    self.metrics.duty_ran(ReaperDuty::Expire);
                    self.expire().await;
                },
                _ = orphans.tick() => if self.on_duty().await {
                    self.metrics.duty_ran(ReaperDuty::Orphans);
                    self.collect_orphans(&mut suspects).await;
                } else {
                    // Another replica collects; should this one take over, its suspects start
                    // their grace again.
                    suspects = Suspects::default();
                },
            }
        }
    }

    /// Whether this process runs the duties now: always on SQLite; on PostgreSQL when it holds
    /// (or just took) the `reaper` lease, which the reconciler's renewal keeps while it lives.
    async fn on_duty(&self) -> bool {
        let Some(replica) = &self.replica else {
            return true;
        };
        match replica.take(&self.store, replicas::REAPER).await {
            Ok(taken) => taken,
            Err(err) => {
                tracing::warn!(error = %err, "cannot take the reaper's lease; skipping a tick");
                false
            }
        }
    }

    // Debug level: a span every tick would be a trace every tick in the collector.
    #[tracing::instrument(skip_all, level = "debug")]
    async fn expire(&self) {
        let now = Millis::now();
        let lessons = self
            .store
            .expire_live_lessons(now.minus(self.ttl.live_lesson), now)
            .await;
        let sessions = self
            .store
            .expire_sessions(now.minus(self.ttl.session), now)
            .await;
        for (result, action) in [
            (lessons, ReaperAction::ExpireLiveLesson),
            (sessions, ReaperAction::ExpireSession),
        ] {
            match result {
                Ok(expired) => {
                    self.metrics.reaped(action, expired.len() as u64);
                    for lesson in expired {
                        tracing::info!(live_lesson.id = %lesson.id, "idle past its TTL; removing");
                        self.reconciler.changed(&lesson);
                    }
                }
                Err(err) => tracing::error!(error = %err, "expiry failed"),
            }
        }
        match self
            .store
            .prune_events(now.minus(self.config.event_retention))
            .await
        {
            Ok(0) => {}
            Ok(n) => {
                self.metrics.reaped(ReaperAction::PruneEvents, n);
                tracing::debug!(events = n, "pruned old events");
            }
            Err(err) => tracing::error!(error = %err, "event pruning failed"),
        }
    }

    #[tracing::instrument(skip_all, level = "debug")]
    async fn collect_orphans(&self, suspects: &mut Suspects) {
        // A scan of every placement record, so at this slower pace: records go with their live
        // lesson (a trigger), and only a write racing a deletion on PostgreSQL leaves one.
        if let Err(err) = self.store.prune_placements().await {
            tracing::error!(error = %err, "placement pruning failed");
        }
        // The audit log is kept as long as events (by an index on its time, so no scan).
        match self
            .store
            .prune_audit(Millis::now().minus(self.config.event_retention))
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::debug!(entries = n, "pruned old audit entries"),
            Err(err) => tracing::error!(error = %err, "audit pruning failed"),
        }
        let now = Instant::now();
        suspects.begin();
        for agent in self.fleet.agents() {
            if !agent.is_ready() {
                // An agent's absence says nothing about its objects.
                suspects.keep(&agent.name);
                continue;
            }
            let items = match agent.list_all(&self.instance_id, &self.cluster_id).await {
                Ok(items) => items,
                Err(err) => {
                    tracing::warn!(agent = %agent.name, error = %err, "cannot list for orphans");
                    suspects.keep(&agent.name);
                    continue;
                }
            };
            for item in items {
                // Judged per (agent, live lesson): objects of a live lesson the store places on
                // another agent (moved off this one while it was lost) are orphans here too.
                match self.store.holder(item.id).await {
                    Ok(Some(holder)) if holder.as_deref() == Some(agent.name.as_str()) => continue,
                    Ok(_) => {}
                    Err(err) => {
                        tracing::error!(error = %err, "orphan check failed");
                        suspects.keep_one(&agent.name, item.id);
                        continue;
                    }
                }
                if !suspects.due(&agent.name, item.id, now, self.config.orphan_grace) {
                    continue;
                }
                tracing::info!(agent = %agent.name, live_lesson.id = %item.id, "removing orphan");
                match agent.deprovision(item.id, item.handle).await {
                    Ok(_) => {
                        self.metrics.reaped(ReaperAction::RemoveOrphan, 1);
                        suspects.removed(&agent.name, item.id);
                    }
                    Err(err) => tracing::warn!(error = %err, "orphan removal failed; will retry"),
                }
            }
        }
        suspects.end();
    }
}

/// Which live lessons agents hold that the store does not know, and since when: an orphan is
/// removed only after it was seen in every round for `orphan_grace` (a request being written
/// right now must not lose its objects). A round is one pass over every agent.
#[derive(Debug, Default)]
struct Suspects {
    /// (agent, live lesson) → when first seen unknown.
    first_seen: HashMap<(String, LiveLessonId), Instant>,
    /// Suspects seen (or kept) in the current round; the others are forgotten at its end.
    seen: HashSet<(String, LiveLessonId)>,
}

impl Suspects {
    fn begin(&mut self) {
        self.seen.clear();
    }

    /// Keeps every suspect of an agent that could not be listed this round.
    fn keep(&mut self, agent: &str) {
        let keys = self.first_seen.keys().filter(|(name, _)| name == agent);
        self.seen.extend(keys.cloned());
    }

    /// Keeps one suspect whose check failed this round.
    fn keep_one(&mut self, agent: &str, id: LiveLessonId) {
        let key = (agent.to_owned(), id);
        if self.first_seen.contains_key(&key) {
            self.seen.insert(key);
        }
    }

    /// Records that `agent` holds `id`, unknown to the store, at `now`; true when it has been
    /// an orphan for `grace` and is due for removal.
    fn due(&mut self, agent: &str, id: LiveLessonId, now: Instant, grace: Duration) -> bool {
        let key = (agent.to_owned(), id);
        let first = *self.first_seen.entry(key.clone()).or_insert(now);
        self.seen.insert(key);
        now.duration_since(first) >= grace
    }

    /// Forgets a suspect whose objects were removed.
    fn removed(&mut self, agent: &str, id: LiveLessonId) {
        let key = (agent.to_owned(), id);
        self.first_seen.remove(&key);
        self.seen.remove(&key);
    }

    /// Ends a round: suspects not seen in it went away (or the store learnt them).
    fn end(&mut self) {
        let seen = &self.seen;
        self.first_seen.retain(|key, _| seen.contains(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(60);

    #[test]
    fn an_orphan_is_due_only_after_its_grace() {
        let mut suspects = Suspects::default();
        let (id, t0) = (LiveLessonId::new(), Instant::now());
        for (after, due) in [(0, false), (30, false), (59, false), (60, true), (61, true)] {
            suspects.begin();
            let now = t0 + Duration::from_secs(after);
            assert_eq!(suspects.due("a", id, now, GRACE), due, "after {after} s");
            suspects.end();
        }
    }

    #[test]
    fn an_orphan_missing_from_a_round_starts_over() {
        let mut suspects = Suspects::default();
        let (id, t0) = (LiveLessonId::new(), Instant::now());
        suspects.begin();
        assert!(!suspects.due("a", id, t0, GRACE));
        suspects.end();
        // The store learnt it (or the agent dropped it): a round without it.
        suspects.begin();
        suspects.end();
        suspects.begin();
        assert!(!suspects.due("a", id, t0 + GRACE, GRACE), "grace restarts");
        suspects.end();
    }

    #[test]
    fn an_unreachable_agent_keeps_its_suspects() {
        let mut suspects = Suspects::default();
        let (a, b, t0) = (LiveLessonId::new(), LiveLessonId::new(), Instant::now());
        suspects.begin();
        assert!(!suspects.due("x", a, t0, GRACE));
        assert!(!suspects.due("y", b, t0, GRACE));
        suspects.end();
        suspects.begin();
        suspects.keep("x");
        suspects.end();
        suspects.begin();
        assert!(
            suspects.due("x", a, t0 + GRACE, GRACE),
            "x's suspect kept its age"
        );
        assert!(
            !suspects.due("y", b, t0 + GRACE, GRACE),
            "y's suspect was forgotten"
        );
        suspects.end();
    }

    #[test]
    fn a_removed_orphan_is_forgotten() {
        let mut suspects = Suspects::default();
        let (id, t0) = (LiveLessonId::new(), Instant::now());
        suspects.begin();
        assert!(suspects.due("a", id, t0, Duration::ZERO));
        suspects.removed("a", id);
        suspects.end();
        assert!(suspects.first_seen.is_empty());
    }
}
