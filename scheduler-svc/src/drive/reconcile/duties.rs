//! The reconciler's background duties beside the workers: looking for lost agents (and moving
//! their live lessons), the periodic resync, renewing this replica's leases, following other
//! replicas' changes, and the fleet's events (agent restarts, what an agent's Watch says of
//! live lessons nobody waits for). Their judgements are [`lifecycle`]'s.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Reconciler, lock};
use crate::agents::{AgentReport, FleetEvent};
use crate::drive::lifecycle::{self, Suspicion};
use crate::drive::replicas::Replica;
use crate::error::Error;
use crate::model::{LiveLessonId, Millis};
use crate::store::{Change, Changes};

impl Reconciler {
    /// Spawns the duties on `tracker`, each stopping at `shutdown`.
    pub(super) async fn start_duties(
        &self,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        mut fleet_events: mpsc::UnboundedReceiver<FleetEvent>,
    ) -> Result<(), Error> {
        let this = self.clone();
        let lookout = shutdown.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(this.inner.roster.tick());
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = lookout.cancelled() => return,
                    _ = tick.tick() => this.look_for_lost_agents().await,
                }
            }
        });
        let this = self.clone();
        let resync = shutdown.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(this.inner.replicas.resync_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = resync.cancelled() => return,
                    _ = tick.tick() => this.resync().await,
                }
            }
        });
        if let Some(replica) = self.inner.replica.clone() {
            let this = self.clone();
            let renewal = shutdown.clone();
            tracker.spawn(async move { this.renew_leases(replica, renewal).await });
        }
        if let Some(changes) = self.inner.store.changes().await? {
            let this = self.clone();
            let follow = shutdown.clone();
            tracker.spawn(async move { this.follow_changes(changes, follow).await });
        }
        let this = self.clone();
        tracker.spawn(async move {
            loop {
                let event = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    event = fleet_events.recv() => match event {
                        Some(event) => event,
                        None => return,
                    },
                };
                this.on_fleet_event(event).await;
            }
        });
        Ok(())
    }

    /// Enqueues every unsettled live lesson nobody works on: not queued or being processed
    /// here, not waiting for a retry here, and on PostgreSQL leased by no live replica (its
    /// holder died, or a write failed between the store and the queue). On PostgreSQL the
    /// agents' loads are also read again, since every replica places on them.
    #[tracing::instrument(skip_all, level = "debug")]
    pub(super) async fn resync(&self) {
        let inner = &self.inner;
        let ids = match inner.store.unsettled().await {
            // On PostgreSQL, the live lessons of this replica's shards.
            Ok(ids) => ids
                .into_iter()
                .filter(|id| inner.replica.as_ref().is_none_or(|r| r.owns(*id)))
                .collect::<Vec<_>>(),
            Err(err) => {
                tracing::warn!(error = %err, "resync: cannot read unsettled live lessons");
                return;
            }
        };
        for id in ids {
            if !lifecycle::unattended(
                inner.queue.contains(id),
                lock(&inner.retrying).contains(&id),
                lock(&inner.waiting).contains_key(&id),
                inner.replica.as_ref().is_some_and(|r| r.holds(id)),
            ) {
                continue;
            }
            tracing::info!(live_lesson.id = %id, "resync: unsettled and nobody works on it; enqueued");
            inner.queue.add(id);
        }
        if inner.replica.is_some() {
            match inner.store.agent_loads().await {
                Ok(loads) => inner.fleet.set_loads(loads),
                Err(err) => tracing::warn!(error = %err, "resync: cannot read the agents' loads"),
            }
        }
    }

    /// Renews this replica's leases every third of their TTL until shutdown; a lost lease
    /// (expired and taken over) stops its worker. At shutdown every lease is given back, so
    /// other replicas take the work over at once.
    async fn renew_leases(&self, replica: Arc<Replica>, shutdown: CancellationToken) {
        let store = &self.inner.store;
        let mut tick = tokio::time::interval(replica.renew_every());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => match replica.renew(store).await {
                    Ok(moved) => for id in moved {
                        tracing::info!(live_lesson.id = %id, "its shard moved; running it again");
                        // Its worker stops waiting (a shard gone) or takes the work up (a shard
                        // taken).
                        self.inner.queue.add(id);
                    },
                    Err(err) => tracing::warn!(error = %err, "cannot renew leases"),
                },
            }
        }
        if let Err(err) = store.release_leases(&replica.id).await {
            tracing::warn!(error = %err, "cannot give leases back at shutdown; they will expire");
        }
    }

    /// Follows every replica's changes: watched live lessons are read again for the hub (all
    /// of them after a reconnect, when notifications may have been lost, followed by a
    /// resync); a change that needs work is enqueued unless this replica is working on that
    /// generation already or another replica holds its lease.
    async fn follow_changes(&self, mut changes: Changes, shutdown: CancellationToken) {
        loop {
            let change = tokio::select! {
                _ = shutdown.cancelled() => return,
                change = changes.next() => change,
            };
            match change {
                Change::Changed {
                    id,
                    generation,
                    needs_work,
                } => {
                    self.refresh_watchers(id).await;
                    if needs_work && !self.working_on(id, generation) {
                        self.inner.queue.add(id);
                    }
                }
                Change::Gone(id) => self.inner.hub.gone(id),
                Change::Missed => {
                    for id in self.inner.hub.watched_ids() {
                        self.refresh_watchers(id).await;
                    }
                    self.resync().await;
                }
            }
        }
    }

    /// Whether a change of `id` at `generation` is work this replica need not take up
    /// ([`lifecycle::taken_up`]).
    fn working_on(&self, id: LiveLessonId, generation: u64) -> bool {
        let Some(replica) = &self.inner.replica else {
            return false;
        };
        let holds = replica.holds(id);
        let working_on = holds
            .then(|| lock(&self.inner.attempts).get(&id).map(|a| a.generation))
            .flatten();
        lifecycle::taken_up(holds, working_on, generation, replica.held_elsewhere(id))
    }

    /// Reads a watched live lesson again and hands it to its watchers (or ends their streams
    /// when it is gone).
    async fn refresh_watchers(&self, id: LiveLessonId) {
        let hub = &self.inner.hub;
        if !hub.is_watched(id) {
            return;
        }
        match self.inner.store.find_live_lesson(id).await {
            Ok(Some(lesson)) => hub.refresh(&lesson),
            Ok(None) => hub.gone(id),
            Err(err) => {
                tracing::warn!(live_lesson.id = %id, error = %err, "cannot read a changed live lesson")
            }
        }
    }

    /// Moves the live lessons of every lost agent elsewhere: those
    /// not FAILED start over as PENDING in a new generation and are placed again (READY ones at
    /// their stage), FAILED ones lose their placement so a retry goes elsewhere. Level-driven:
    /// each look moves whatever a lost agent still holds, so a crash mid-way is redone.
    #[tracing::instrument(skip_all, level = "debug")]
    async fn look_for_lost_agents(&self) {
        for name in self.inner.roster.look(Instant::now()) {
            self.move_off(&name).await;
        }
    }

    /// Moves the live lessons of lost agent `name`, if it holds any.
    async fn move_off(&self, name: &str) {
        let inner = &self.inner;
        match inner.store.held_by(name).await {
            Ok(held) if held.is_empty() => return,
            Ok(_) => {}
            Err(err) => {
                tracing::error!(agent = %name, error = %err, "cannot list a lost agent's live lessons");
                return;
            }
        }
        let agent = inner.fleet.get(name);
        let last_error = agent
            .as_ref()
            .map(|agent| agent.status().last_error)
            .unwrap_or_default();
        let reason = lifecycle::lost_reason(name, inner.config.agent_grace, &last_error);
        let moved = match inner.store.relocate(name, &reason, Millis::now()).await {
            Ok(moved) => moved,
            Err(err) => {
                tracing::error!(agent = %name, error = %err, "cannot move a lost agent's live lessons");
                return;
            }
        };
        tracing::warn!(agent = %name, count = moved.len(), "moving the live lessons of a lost agent");
        for lesson in moved {
            if let Some(agent) = &agent {
                agent.release();
            }
            if lifecycle::after_move(&lesson) {
                self.changed(&lesson);
            } else {
                inner.hub.publish(&lesson);
            }
        }
    }

    async fn on_fleet_event(&self, event: FleetEvent) {
        match event {
            FleetEvent::Restarted(agent) => match self.inner.store.on_agent(&agent).await {
                Ok(ids) => {
                    tracing::info!(%agent, count = ids.len(), "agent restarted; recovering its live lessons");
                    lock(&self.inner.recover).extend(ids.iter().copied());
                    for id in ids {
                        self.enqueue(id);
                    }
                }
                Err(err) => {
                    tracing::error!(%agent, error = %err, "cannot list the agent's live lessons")
                }
            },
            // A settled live lesson failed on the agent (e.g. its container died).
            FleetEvent::Unsolicited(agent, report) => self.suspect(report.id, agent, Some(report)),
            // Removed on the agent, and no removal of ours waits for it.
            FleetEvent::Vanished(agent, id) => self.suspect(id, agent, None),
            FleetEvent::Snapshot(agent, held) => match self.inner.store.held_by(&agent).await {
                Ok(placed) => {
                    for id in lifecycle::missing(placed, &held) {
                        self.suspect(id, agent.clone(), None);
                    }
                }
                Err(err) => {
                    tracing::warn!(%agent, error = %err, "cannot list the agent's live lessons to compare with its snapshot")
                }
            },
        }
    }

    /// An agent's Watch suggests that a live lesson placed on it broke or is gone (`report`:
    /// the FAILED state it sent): its next run checks, unless work on it is under way already
    /// (waiting for the agent, retrying or recovering), which finds out by itself. A run in
    /// progress runs again after it ends, and checks then.
    fn suspect(&self, id: LiveLessonId, agent: String, report: Option<AgentReport>) {
        let inner = &self.inner;
        if !lifecycle::worth_checking(
            lock(&inner.waiting).contains_key(&id),
            lock(&inner.retrying).contains(&id),
            lock(&inner.recover).contains(&id),
        ) {
            return;
        }
        lock(&inner.suspects).insert(id, Suspicion { agent, report });
        inner.queue.add(id);
    }
}
