//! The reaper: idle live lessons and sessions expire (persistent sessions excepted), objects that
//! agents hold but the store does not know (orphans) are removed after a grace period, and old
//! events of removed live lessons are pruned. Nothing is wiped at start-up: state is durable.
//!
//! The reaper only marks live lessons for removal in the store; the reconciler does the removal,
//! exactly as for a user's delete.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::fleet::Fleet;
use crate::hub::Hub;
use crate::metrics::{Metrics, ReaperAction};
use crate::model::Millis;
use crate::reconcile::Reconciler;
use crate::settings::{ReaperConfig, TtlConfig};
use crate::store::Store;

/// What the reaper needs.
pub struct Reaper {
    /// Desired state.
    pub store: Store,
    /// Where removals are driven.
    pub reconciler: Reconciler,
    /// Watchers to tell about TERMINATING.
    pub hub: Arc<Hub>,
    /// The agents to list for orphans.
    pub fleet: Arc<Fleet>,
    /// TTLs.
    pub ttl: TtlConfig,
    /// Schedule.
    pub config: ReaperConfig,
    /// Our instance label value.
    pub instance_id: String,
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
        // (agent, live lesson id) → when first seen as an orphan.
        let mut suspects: HashMap<(String, String), Instant> = HashMap::new();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = expiry.tick() => self.expire().await,
                _ = orphans.tick() => self.collect_orphans(&mut suspects).await,
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
                        self.hub.publish(&lesson);
                        self.reconciler.enqueue(lesson.id);
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
    async fn collect_orphans(&self, suspects: &mut HashMap<(String, String), Instant>) {
        let now = Instant::now();
        let mut seen = std::collections::HashSet::new();
        for agent in self.fleet.agents() {
            if !agent.is_ready() {
                // Keep its suspects: an agent's absence says nothing about its objects.
                seen.extend(
                    suspects
                        .keys()
                        .filter(|(name, _)| *name == agent.name)
                        .cloned(),
                );
                continue;
            }
            let items = match agent.list_all(&self.instance_id).await {
                Ok(items) => items,
                Err(err) => {
                    tracing::warn!(agent = %agent.name, error = %err, "cannot list for orphans");
                    continue;
                }
            };
            for item in items {
                match self.store.exists(&item.live_lesson_id).await {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(err) => {
                        tracing::error!(error = %err, "orphan check failed");
                        continue;
                    }
                }
                let key = (agent.name.clone(), item.live_lesson_id.clone());
                let first_seen = *suspects.entry(key.clone()).or_insert(now);
                seen.insert(key.clone());
                if now.duration_since(first_seen) < self.config.orphan_grace {
                    continue;
                }
                tracing::info!(agent = %agent.name, live_lesson.id = %item.live_lesson_id, "removing orphan");
                match agent
                    .deprovision(&item.live_lesson_id, item.handle.to_vec())
                    .await
                {
                    Ok(_) => {
                        self.metrics.reaped(ReaperAction::RemoveOrphan, 1);
                        seen.remove(&key);
                    }
                    Err(err) => tracing::warn!(error = %err, "orphan removal failed; will retry"),
                }
            }
        }
        suspects.retain(|key, _| seen.contains(key));
    }
}
