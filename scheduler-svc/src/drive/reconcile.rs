//! The reconciler (DESIGN.md §3): drives agents toward the desired state the store records.
//!
//! Requests only write desired state and call [`Reconciler::changed`]. A bounded pool of
//! workers takes live-lesson ids from a de-duplicating work queue ([`WorkQueue`]); one id is
//! never processed by two workers at once, and an id enqueued while it is being processed is
//! marked dirty and runs again right after. Each run reads the live lesson from the store and
//! does one of:
//! - removal ([`Reconciler::terminate`]): Deprovision (retried), wait for the objects to go (a
//!   waiter, as below, when the agent answers that removal goes on), forget the live lesson;
//! - provisioning ([`Reconciler::provision`]): place it on an agent, claim it there (placement
//!   and BOOTING are one write), call Provision (idempotent on id + generation) or Recover, then
//!   record what the agent reported. Waiting for READY or FAILED holds no worker: the run hands
//!   the wait to a waiter task ([`Reconciler::wait_for`]) and returns its worker to the pool.
//!   The waiter follows the agent's Watch reports, asks Get (the truth) from every
//!   `poll_interval` (backing off to 16 times it over a Watch stream), and wakes the live lesson (enqueues it with what it saw) when its status changes, when the
//!   agent lost it, and at the deadline; the next run records, settles, fails or waits again.
//!   A few slow live lessons therefore never starve the pool.
//!
//! A settled live lesson can break or vanish on its agent behind the scheduler's back (a
//! container removed, a namespace deleted, a Deprovision from someone else). What an agent's
//! Watch says of it while nobody waits, a FAILED state, a deletion, or its absence from a
//! snapshot, makes it a suspect ([`Reconciler::suspect`]); its next run asks the agent (a report
//! of FAILED, else Get) and records a READY live lesson FAILED with the agent's reason, or with
//! "no longer holds" on NOT_FOUND. Asking again then provisions it afresh, as after any failure.
//!
//! Every agent call has a deadline; retryable codes back off exponentially; every generation
//! ends in READY or FAILED within `provision_timeout`. After a restart, `start` enqueues every
//! unsettled live lesson, and Provision's idempotency means nothing is created twice. A periodic
//! resync enqueues any unsettled live lesson that nobody works on (not queued, not waiting for
//! a retry, and on PostgreSQL leased by no live replica), so a failed write or a dead replica
//! leaves nothing behind.
//!
//! Replicas on PostgreSQL ([`Replica`]): a worker takes the live lesson's lease before a run
//! and gives it back when the work is done (kept across retries), so one replica at a time
//! works on it; every replica hears every change ([`crate::store::Changes`]): watched live
//! lessons are read again for the [`Hub`], and changes that need work are enqueued unless this
//! replica is on that very generation already or another replica holds the lease.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use antidote_proto::sdk::{capabilities, errors};
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::TraceContextExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use super::hub::Hub;
use super::placement::{self, Needs};
use super::queue::WorkQueue;
use super::replicas::Replica;
use super::roster::Roster;
use crate::agents::{self, Agent, Desired, Fleet, FleetEvent, Observed, Observer, Report};
use crate::catalog::{Catalog, Lesson};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{Decision, LiveLesson, LiveLessonId, Millis, Status};
use crate::settings::{ReconcilerConfig, ReplicasConfig};
use crate::store::{Change, Changes, Fenced, Observation, Store};

/// Shared handle to the reconciler.
#[derive(Clone)]
pub struct Reconciler {
    inner: Arc<Inner>,
}

struct Inner {
    /// Desired and observed state.
    store: Store,
    /// The lesson definitions specs are built from.
    catalog: Arc<Catalog>,
    /// Where live lessons are placed and driven.
    fleet: Arc<Fleet>,
    /// Drained and lost agents, operators' labels: placement's view of the fleet.
    roster: Arc<Roster>,
    /// Watchers of the public API.
    hub: Arc<Hub>,
    /// Pool size, deadlines, backoff.
    config: ReconcilerConfig,
    /// This scheduler's instance id, put on every object through the spec's labels.
    instance_id: String,
    /// This deployment's cluster id (from the store), put on every object too.
    cluster_id: String,
    /// This process as a replica on PostgreSQL (leases); `None` on SQLite.
    replica: Option<Arc<Replica>>,
    /// The lease TTL and how often the store is searched for work nobody does.
    replicas: ReplicasConfig,
    /// Live lessons waiting for a retry (a timer will enqueue them): the resync leaves them be.
    retrying: Mutex<HashSet<LiveLessonId>>,
    /// The work queue.
    queue: WorkQueue,
    /// Live lessons whose agent restarted: their next run calls Recover.
    recover: Mutex<HashSet<LiveLessonId>>,
    /// Settled live lessons an agent's Watch suggests are broken or gone: their next run checks
    /// ([`Reconciler::check_held`]).
    suspects: Mutex<HashMap<LiveLessonId, Suspicion>>,
    /// Per live lesson: the generation being worked on, when work on it started and how many
    /// attempts failed, for deadlines and backoff.
    attempts: Mutex<HashMap<LiveLessonId, Attempt>>,
    /// Per live lesson: the trace context of whoever asked for the work (an API call, the
    /// reaper), so the work and its agent calls belong to that trace.
    origins: Mutex<HashMap<LiveLessonId, opentelemetry::Context>>,
    /// Where provisioning times are counted.
    metrics: Arc<Metrics>,
    /// Live lessons whose wait for READY a waiter task follows (no worker held).
    waiting: Mutex<HashMap<LiveLessonId, Waiting>>,
    /// Cancelled at shutdown: every waiter stops.
    stopping: CancellationToken,
    /// Per agent: the workers' calls in flight to it, at most `calls_per_agent`.
    calls: Mutex<HashMap<String, Arc<Semaphore>>>,
}

#[derive(Clone, Copy)]
struct Attempt {
    generation: u64,
    started: Instant,
    failures: u32,
}

/// What a run asks for next.
enum Next {
    /// Nothing until the live lesson is enqueued again.
    Done,
    /// Run again after a delay (retry with backoff).
    After(Duration),
    /// A waiter follows the agent until there is news, then enqueues the live lesson; the
    /// lease is kept meanwhile (as across retries).
    Wait,
}

/// A live lesson a waiter task follows until it settles or is gone.
struct Waiting {
    /// The generation waited for.
    generation: u64,
    /// What is waited for.
    until: Until,
    /// What the waiter saw when it woke the live lesson; `None` while it still waits.
    woken: Option<Woken>,
    /// Stops the waiter (newer desired state, removal, lease lost, shutdown).
    stop: CancellationToken,
}

/// What a waiter hands to the run it enqueued.
struct Woken {
    /// The live lesson's view of the agent's Watch stream, followed since before the call.
    observer: Observer,
    /// The agent's latest report.
    report: Report,
    /// Why it woke.
    why: Wake,
}

/// What a waiter waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Until {
    /// The generation READY or FAILED (provisioning).
    Settled,
    /// The objects gone (removal).
    Gone,
}

/// Why a waiter woke its live lesson.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A report for the generation with another status than the one recorded, or settled
    /// (only while provisioning).
    Report,
    /// The agent does not hold the live lesson any more (Watch says deleted, Get NOT_FOUND).
    Lost,
    /// The deadline passed.
    Deadline,
}

/// What a run finds of a wait for its generation.
enum Resume {
    /// None: call the agent.
    Fresh,
    /// A waiter still waits: nothing to do.
    Waiting,
    /// A waiter woke it with news.
    Woken(Woken),
}

impl Reconciler {
    /// Creates the reconciler from its parts; call [`Reconciler::start`] to run its workers.
    pub fn new(parts: ReconcilerParts) -> Reconciler {
        let ReconcilerParts {
            store,
            catalog,
            fleet,
            roster,
            hub,
            config,
            identity:
                Identity {
                    instance_id,
                    cluster_id,
                    replica,
                },
            replicas,
            metrics,
        } = parts;
        Reconciler {
            inner: Arc::new(Inner {
                store,
                catalog,
                fleet,
                roster,
                hub,
                config,
                instance_id,
                cluster_id,
                replica,
                replicas,
                retrying: Mutex::new(HashSet::new()),
                queue: WorkQueue::default(),
                recover: Mutex::new(HashSet::new()),
                suspects: Mutex::new(HashMap::new()),
                attempts: Mutex::new(HashMap::new()),
                origins: Mutex::new(HashMap::new()),
                metrics,
                waiting: Mutex::new(HashMap::new()),
                stopping: CancellationToken::new(),
                calls: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The desired state of `lesson` changed (it was just written to the store): watchers see
    /// the new state and the live lesson is reconciled. Every writer of desired state calls this.
    pub fn changed(&self, lesson: &LiveLesson) {
        self.inner.hub.publish(lesson);
        self.enqueue(lesson.id);
    }

    /// This deployment's cluster id.
    pub fn cluster_id(&self) -> &str {
        &self.inner.cluster_id
    }

    /// Drained and lost agents and the operators' labels: what placement and operators see.
    pub fn roster(&self) -> &Arc<Roster> {
        &self.inner.roster
    }

    /// Whether some agent the scheduler knows (in any state) could ever take `lesson` with
    /// the request's `wishes`: FAILED_PRECONDITION naming what is missing otherwise. Requests
    /// are refused with it at once instead of waiting for a deadline that cannot help.
    pub fn check_possible(
        &self,
        lesson: &Lesson,
        wishes: &crate::model::Wishes,
    ) -> Result<(), Error> {
        let impossible = |missing: String, why: String| Error::PlacementImpossible {
            lesson: lesson.slug.clone(),
            missing,
            why,
        };
        let needs = Needs::of(lesson, wishes).map_err(|why| impossible(String::new(), why))?;
        placement::possible(&self.inner.roster.candidates(), &needs)
            .map_err(|why| impossible(why.missing.clone(), why.to_string()))
    }

    /// Schedules a live lesson for reconciliation. The work joins the current span's trace.
    fn enqueue(&self, id: LiveLessonId) {
        let context = antidote_proto::sdk::trace::current_context();
        if context.span().span_context().is_valid() {
            lock(&self.inner.origins).insert(id, context);
        }
        self.inner.queue.add(id);
    }

    /// Starts the workers and the fleet-event handler, and enqueues every unsettled live lesson
    /// from the store (resuming work a previous process left unfinished).
    pub async fn start(
        &self,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        mut fleet_events: mpsc::UnboundedReceiver<FleetEvent>,
    ) -> Result<(), Error> {
        self.inner
            .fleet
            .set_loads(self.inner.store.agent_loads().await?);
        let unsettled = self.inner.store.unsettled().await?;
        if !unsettled.is_empty() {
            tracing::info!(count = unsettled.len(), "resuming unfinished live lessons");
        }
        for id in unsettled {
            self.enqueue(id);
        }
        {
            // Waiters are not tracked tasks: they only wait, and stop with this.
            let (shutdown, stopping) = (shutdown.clone(), self.inner.stopping.clone());
            tokio::spawn(async move {
                shutdown.cancelled().await;
                stopping.cancel();
            });
        }
        for _ in 0..self.inner.config.workers {
            let this = self.clone();
            let shutdown = shutdown.clone();
            tracker.spawn(async move { this.work(shutdown).await });
        }
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

    /// A slot for one worker's call to agent `name`, held until dropped; `None` while
    /// `calls_per_agent` calls to it are in flight (a slow or unreachable agent): the live lesson
    /// is tried again shortly, and the worker goes on to another agent's work meanwhile.
    fn call_slot(&self, name: &str) -> Option<OwnedSemaphorePermit> {
        let semaphore = lock(&self.inner.calls)
            .entry(name.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(self.inner.config.calls_per_agent)))
            .clone();
        let slot = semaphore.try_acquire_owned().ok();
        if slot.is_none() {
            tracing::debug!(agent = %name, "calls_per_agent calls to this agent in flight; trying again shortly");
        }
        slot
    }

    /// Enqueues `id` again after `delay` (a retry with backoff), unless shutdown comes first.
    fn enqueue_after(&self, id: LiveLessonId, delay: Duration, shutdown: &CancellationToken) {
        lock(&self.inner.retrying).insert(id);
        let queue = self.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => {
                    queue.enqueue(id);
                    lock(&queue.inner.retrying).remove(&id);
                }
            }
        });
    }

    /// Enqueues every unsettled live lesson nobody works on: not queued or being processed
    /// here, not waiting for a retry here, and on PostgreSQL leased by no live replica (its
    /// holder died, or a write failed between the store and the queue). On PostgreSQL the
    /// agents' loads are also read again, since every replica places on them.
    #[tracing::instrument(skip_all, level = "debug")]
    async fn resync(&self) {
        let inner = &self.inner;
        let ids = match inner.store.unleased_unsettled(Millis::now()).await {
            Ok(ids) => ids,
            Err(err) => {
                tracing::warn!(error = %err, "resync: cannot read unsettled live lessons");
                return;
            }
        };
        for id in ids {
            if inner.queue.contains(id)
                || lock(&inner.retrying).contains(&id)
                || lock(&inner.waiting).contains_key(&id)
                || inner.replica.as_ref().is_some_and(|r| r.holds(id))
            {
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
                    Ok(lost) => for id in lost {
                        tracing::warn!(live_lesson.id = %id, "lease lost to another replica; stopping");
                        // Its worker is told to stop waiting and runs again, finding the lease
                        // taken.
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

    /// Whether a change of `id` at `generation` is work this replica need not take up: it
    /// holds the lease and works on that generation, or another replica holds the lease (its
    /// holder hears the same change).
    fn working_on(&self, id: LiveLessonId, generation: u64) -> bool {
        let Some(replica) = &self.inner.replica else {
            return false;
        };
        let ours = replica.holds(id)
            && lock(&self.inner.attempts)
                .get(&id)
                .is_some_and(|attempt| attempt.generation == generation);
        ours || replica.held_elsewhere(id)
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

    /// Moves the live lessons of every lost agent elsewhere (DESIGN.md §3, placement): those
    /// not FAILED start over as PENDING in a new generation and are placed again (READY ones at
    /// their stage), FAILED ones lose their placement so a retry goes elsewhere. Level-driven:
    /// each look moves whatever a lost agent still holds, so a crash mid-way is redone.
    #[tracing::instrument(skip_all, level = "debug")]
    async fn look_for_lost_agents(&self) {
        let inner = &self.inner;
        for name in inner.roster.look(Instant::now()) {
            match inner.store.held_by(&name).await {
                Ok(held) if held.is_empty() => continue,
                Ok(_) => {}
                Err(err) => {
                    tracing::error!(agent = %name, error = %err, "cannot list a lost agent's live lessons");
                    continue;
                }
            }
            let last_error = inner
                .fleet
                .get(&name)
                .map(|agent| agent.status().last_error)
                .unwrap_or_default();
            let reason = format!(
                "agent `{name}` lost (not ready for {}{}); moving to another agent",
                humantime::format_duration(self.grace()),
                if last_error.is_empty() {
                    String::new()
                } else {
                    format!(": {last_error}")
                }
            );
            let moved = match inner.store.relocate(&name, &reason, Millis::now()).await {
                Ok(moved) => moved,
                Err(err) => {
                    tracing::error!(agent = %name, error = %err, "cannot move a lost agent's live lessons");
                    continue;
                }
            };
            tracing::warn!(agent = %name, count = moved.len(), "moving the live lessons of a lost agent");
            let agent = inner.fleet.get(&name);
            for lesson in moved {
                if let Some(agent) = &agent {
                    agent.release();
                }
                if lesson.status == Status::Failed {
                    inner.hub.publish(&lesson);
                } else {
                    self.changed(&lesson);
                }
            }
        }
    }

    /// How long an agent may be not ready before it is lost.
    fn grace(&self) -> Duration {
        self.inner.config.agent_grace
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
                    for id in placed.into_iter().filter(|id| !held.contains(id)) {
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
    fn suspect(&self, id: LiveLessonId, agent: String, report: Option<Report>) {
        let inner = &self.inner;
        if lock(&inner.waiting).contains_key(&id)
            || lock(&inner.retrying).contains(&id)
            || lock(&inner.recover).contains(&id)
        {
            return;
        }
        lock(&inner.suspects).insert(id, Suspicion { agent, report });
        inner.queue.add(id);
    }

    /// Checks a READY live lesson its agent's Watch suggests is broken or gone: the agent's
    /// FAILED report of its generation, or else Get, decides. FAILED (the agent's reason) or
    /// NOT_FOUND (it does not hold the live lesson any more) is recorded FAILED, with no
    /// endpoint healthy; anything else leaves it be. An agent that cannot answer is asked again
    /// after `backoff_max`.
    #[tracing::instrument(skip_all, fields(agent = %suspicion.agent))]
    async fn check_held(&self, lesson: LiveLesson, suspicion: Suspicion) -> Result<Next, Error> {
        let failed = |report: &Report| {
            report.generation == lesson.generation && report.status == Some(Status::Failed)
        };
        let Suspicion { agent, report } = suspicion;
        let report = match report.filter(failed) {
            Some(report) => report,
            None => {
                let Some(agent) = self.inner.fleet.get(&agent) else {
                    return Ok(Next::Done);
                };
                match agent.get(lesson.id).await {
                    Ok(report) if failed(&report) => report,
                    Ok(_) => return Ok(Next::Done),
                    Err(err) if agents::lost_it(&err) => Report {
                        id: lesson.id,
                        generation: lesson.generation,
                        status: Some(Status::Failed),
                        reason: format!(
                            "agent `{}` no longer holds this live lesson: it was removed without the scheduler asking; ask again for a new one",
                            agent.name
                        ),
                        endpoints: lesson.endpoints.clone(),
                        handle: Vec::new(),
                    },
                    Err(err) => {
                        tracing::warn!(error = %err, "cannot ask the agent whether it still holds the live lesson; asking again");
                        let suspicion = Suspicion {
                            agent: agent.name.clone(),
                            report: None,
                        };
                        lock(&self.inner.suspects).insert(lesson.id, suspicion);
                        return Ok(Next::After(self.inner.config.backoff_max));
                    }
                }
            }
        };
        tracing::warn!(reason = %report.reason, "a READY live lesson broke on its agent");
        let mut observation = observation(&report, Status::Failed);
        // Whatever the agent last measured, nothing of it answers now.
        if let Some(endpoints) = &mut observation.endpoints {
            for endpoint in endpoints {
                endpoint.healthy = 0;
            }
        }
        self.record(&lesson, observation).await?;
        Ok(Next::Done)
    }

    async fn work(&self, shutdown: CancellationToken) {
        loop {
            let id = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = self.inner.queue.next() => next,
            };
            if let Some(replica) = &self.inner.replica {
                match replica.take_lesson(&self.inner.store, id).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Another replica works on it; it hears every change, and if it dies
                        // the lease expires and a resync here takes the work over.
                        tracing::debug!(live_lesson.id = %id, "leased by another replica");
                        self.stop_waiting(id);
                        lock(&self.inner.attempts).remove(&id);
                        lock(&self.inner.origins).remove(&id);
                        self.inner.queue.done(id);
                        continue;
                    }
                    Err(err) => {
                        let delay = self.backoff(id, None);
                        tracing::warn!(live_lesson.id = %id, error = %err, ?delay, "cannot take the lease; retrying");
                        self.enqueue_after(id, delay, &shutdown);
                        self.inner.queue.done(id);
                        continue;
                    }
                }
            }
            let span = tracing::info_span!("reconcile", live_lesson.id = %id);
            let origin = lock(&self.inner.origins).remove(&id);
            if let Some(origin) = &origin {
                let _ = span.set_parent(origin.clone());
            }
            let next = tokio::select! {
                // Work in flight is dropped at shutdown; the store still holds the desired state
                // and the next process resumes it.
                _ = shutdown.cancelled() => return,
                // The origin is also current (not only the span's parent), so that it is passed
                // on to the agent when spans are not recorded.
                next = self
                    .run(id)
                    .instrument(span)
                    .with_context(origin.clone().unwrap_or_default()) => next,
            };
            if let (Some(origin), Ok(Next::After(_) | Next::Wait) | Err(_)) = (origin, &next) {
                // A retry still belongs to the trace that asked, unless a newer request came.
                lock(&self.inner.origins).entry(id).or_insert(origin);
            }
            match next {
                Ok(Next::Done) => {
                    // Done for now (settled, gone, or moved on): the lease goes back, so any
                    // replica may take the next change up.
                    if let Some(replica) = &self.inner.replica {
                        replica.give_back(&self.inner.store, id).await;
                    }
                }
                Ok(Next::After(delay)) => self.enqueue_after(id, delay, &shutdown),
                // Its waiter enqueues it when there is news; the lease is kept meanwhile.
                Ok(Next::Wait) => {}
                Err(err) => {
                    let delay = self.backoff(id, None);
                    tracing::error!(live_lesson.id = %id, error = %err, ?delay, "reconcile failed; retrying");
                    self.enqueue_after(id, delay, &shutdown);
                }
            }
            self.inner.queue.done(id);
        }
    }

    async fn run(&self, id: LiveLessonId) -> Result<Next, Error> {
        let Some(lesson) = self.inner.store.find_live_lesson(id).await? else {
            self.stop_waiting(id);
            self.inner.hub.gone(id);
            lock(&self.inner.attempts).remove(&id);
            return Ok(Next::Done);
        };
        if lesson.deleting {
            // A removal in progress is resumed by `terminate`; any other wait is stopped there.
            return self.terminate(lesson).await;
        }
        let recovering = lock(&self.inner.recover).remove(&id);
        let suspicion = lock(&self.inner.suspects).remove(&id);
        if let Some(suspicion) = suspicion
            && !recovering
            && !lesson.needs_work()
            && lesson.status == Status::Ready
            && lesson.agent.as_deref() == Some(suspicion.agent.as_str())
        {
            return self.check_held(lesson, suspicion).await;
        }
        if !lesson.needs_work() && !recovering {
            self.stop_waiting(id);
            lock(&self.inner.attempts).remove(&id);
            return Ok(Next::Done);
        }
        self.provision(lesson, recovering).await
    }

    /// Takes the live lesson's current generation to READY or FAILED: place, claim, call,
    /// await (a waiter's news, when one woke it).
    #[tracing::instrument(skip_all, fields(generation = lesson.generation, stage = lesson.stage, lesson = %lesson.lesson_slug))]
    async fn provision(&self, lesson: LiveLesson, recovering: bool) -> Result<Next, Error> {
        let inner = &self.inner;
        let deadline = self.attempt(&lesson).started + inner.config.provision_timeout;
        // After an agent restart the live lesson is recovered afresh, whatever was awaited.
        match if recovering {
            self.stop_waiting(lesson.id);
            Resume::Fresh
        } else {
            self.resume(&lesson, Until::Settled)
        } {
            Resume::Fresh => {}
            Resume::Waiting => return Ok(Next::Wait),
            Resume::Woken(woken) => return self.woken(lesson, woken, deadline).await,
        }
        let Some(definition) = inner.catalog.lesson(&lesson.lesson_slug) else {
            let reason = format!(
                "lesson `{}` is no longer in the curriculum",
                lesson.lesson_slug
            );
            return self.fail(&lesson, reason).await;
        };
        let placed = match self.place(&lesson, definition).await {
            Ok(placed) => placed,
            Err(Unplaced::Never(reason)) => return self.fail(&lesson, reason).await,
            Err(Unplaced::Yet(reason)) => return self.wait(&lesson, reason, deadline).await,
        };
        let agent = placed.agent.clone();
        let Some(_call) = self.call_slot(&agent.name) else {
            return Ok(Next::After(inner.config.backoff_initial));
        };
        // Placed just now for the first time: no agent was ever asked for it (PROTOCOL.md [P9]).
        // A live lesson with a recorded agent (a retry, a restart of ours) or moved off a lost
        // agent is not new.
        let new = lesson.agent.is_none()
            && placed.decision.is_some()
            && placed.moved_from.is_none()
            && !recovering;
        let Some(current) = self.claim(lesson, placed).await? else {
            return Ok(Next::Done);
        };
        let observer = agent.observe(current.id);
        let report = match self
            .call(&agent, &current, definition, recovering, new)
            .await
        {
            Ok(report) => report,
            Err(err) => return self.agent_error(&current, err, deadline).await,
        };
        self.await_settled(current, report, observer, deadline)
            .await
    }

    /// The agent the live lesson is (or is to be) placed on, ready for calls: the recorded one,
    /// or placement's choice among every agent by the lesson's and its request's needs. A live
    /// lesson no agent could ever take is `Never` (FAILED at once); one whose agents are only
    /// full, down, drained or lost is `Yet` (PENDING with the reason until its deadline).
    async fn place(&self, lesson: &LiveLesson, definition: &Lesson) -> Result<Placed, Unplaced> {
        let inner = &self.inner;
        if let Some(name) = &lesson.agent {
            let agent = inner.fleet.get(name).ok_or_else(|| {
                Unplaced::Never(format!(
                    "agent `{name}` holding this live lesson is no longer configured"
                ))
            })?;
            if inner.roster.is_lost(name) {
                // The next look at lost agents moves it (a new generation re-runs it).
                return Err(Unplaced::Yet(format!(
                    "agent `{name}` is lost; moving to another agent"
                )));
            }
            if !agent.is_ready() {
                return Err(Unplaced::Yet(format!(
                    "agent `{}` is unavailable: {}",
                    agent.name,
                    agent.status().last_error
                )));
            }
            return Ok(Placed {
                agent,
                decision: None,
                moved_from: None,
            });
        }
        let record = inner
            .store
            .placement(lesson.id)
            .await
            .map_err(|err| Unplaced::Yet(format!("cannot read the placement record: {err}")))?;
        // A live lesson moved off a lost agent says so in every reason.
        let moved = |reason: String| match &record.moved_from {
            Some(from) => format!("agent `{from}` lost; {reason}"),
            None => reason,
        };
        let needs =
            Needs::of(definition, &record.wishes).map_err(|why| Unplaced::Never(moved(why)))?;
        let candidates = inner.roster.candidates();
        // The agent it was moved from does not count as one that could take it back while it
        // stays lost: nothing else fitting means FAILED now, not at the deadline.
        let others: Vec<_> = candidates
            .iter()
            .filter(|c| {
                record.moved_from.as_deref() != Some(c.name.as_str())
                    || c.availability != placement::Availability::Lost
            })
            .cloned()
            .collect();
        placement::possible(&others, &needs).map_err(|why| {
            Unplaced::Never(moved(format!(
                "no agent could ever take lesson `{}`: {why}",
                lesson.lesson_slug
            )))
        })?;
        let decision = match placement::choose(&candidates, &needs) {
            Ok(decision) => decision,
            Err(excluded) => {
                // Full agents that fit: an unclaimed warm-pool member makes room.
                match super::pools::give_way(&inner.store, &candidates, &needs, lesson).await {
                    Ok(Some(member)) => self.changed(&member),
                    Ok(None) => {}
                    Err(err) => tracing::warn!(error = %err, "cannot make a pool member give way"),
                }
                return Err(Unplaced::Yet(moved(format!(
                    "no agent can take lesson `{}` now: {}",
                    lesson.lesson_slug,
                    placement::explain(&excluded)
                ))));
            }
        };
        // `choose` picks from the fleet's own snapshot, so the name is known.
        let agent = inner.fleet.get(&decision.agent).ok_or_else(|| {
            Unplaced::Yet(format!(
                "agent `{}` left the fleet while placing",
                decision.agent
            ))
        })?;
        Ok(Placed {
            agent,
            decision: Some(decision),
            moved_from: record.moved_from,
        })
    }

    /// Records the placement with BOOTING and the decision (why this agent) in one write (the
    /// live lesson is on this agent from now on), and counts it in the agent's load. `None` when the
    /// desired state moved on; an error when the store could not record it (retried).
    async fn claim(&self, lesson: LiveLesson, placed: Placed) -> Result<Option<LiveLesson>, Error> {
        if lesson.status != Status::Pending && lesson.agent.is_some() {
            return Ok(Some(lesson));
        }
        let agent = &placed.agent;
        let status = if lesson.status == Status::Pending {
            Status::Booting
        } else {
            lesson.status
        };
        let reason = match &placed.moved_from {
            Some(from) => format!("agent `{from}` lost; moved to `{}`", agent.name),
            None => format!("placed on agent `{}`", agent.name),
        };
        let observation = Observation {
            agent: Some(agent.name.clone()),
            decision: placed.decision.clone(),
            ..Observation::status(status, reason)
        };
        let Some(updated) = self.record(&lesson, observation).await? else {
            return Ok(None);
        };
        if lesson.agent.is_none() {
            agent.claim();
        }
        if let Some(decision) = &placed.decision {
            tracing::info!(agent = %agent.name, reason = %decision.reason, "placed");
        }
        Ok(Some(updated))
    }

    /// Provision (saying whether the live lesson is `new`), or Recover after the agent restarted
    /// (Provision again if it lost the lesson).
    async fn call(
        &self,
        agent: &Agent,
        current: &LiveLesson,
        definition: &Lesson,
        recovering: bool,
        new: bool,
    ) -> Result<Report, Error> {
        let desired = Desired {
            instance_id: &self.inner.instance_id,
            cluster_id: &self.inner.cluster_id,
            live: current,
            lesson: definition,
            catalog: &self.inner.catalog,
        };
        if !(recovering && !current.handle.is_empty() && agent.has(capabilities::RECOVER)) {
            return agent.provision(&desired, new).await;
        }
        match agent.recover(&desired).await {
            Err(err) if agents::lost_it(&err) => {
                tracing::info!("agent lost the live lesson; provisioning it again");
                agent.provision(&desired, false).await
            }
            other => other,
        }
    }

    /// Records what the agent reported for the generation, then settles it (READY or FAILED),
    /// fails it past the deadline, or hands the wait to a waiter ([`Reconciler::wait_for`]) and
    /// gives the worker back to the pool.
    async fn await_settled(
        &self,
        mut current: LiveLesson,
        report: Report,
        observer: Observer,
        deadline: Instant,
    ) -> Result<Next, Error> {
        if report.generation == current.generation
            && let Some(status) = report.status
        {
            if status != current.status || status.is_settled() {
                match self.record(&current, observation(&report, status)).await? {
                    Some(updated) => current = updated,
                    None => return Ok(Next::Done),
                }
            }
            if status.is_settled() {
                self.settled(&current, status == Status::Ready);
                return Ok(Next::Done);
            }
        }
        if Instant::now() >= deadline {
            let reason = format!(
                "not READY within {} (last status {}: {})",
                humantime::format_duration(self.inner.config.provision_timeout),
                current.status,
                report.reason
            );
            return self.fail(&current, reason).await;
        }
        self.wait_for(&current, Until::Settled, report, observer, deadline);
        Ok(Next::Wait)
    }

    /// A waiter woke the live lesson with news: re-provision what the agent lost, else record,
    /// settle, fail at the deadline or wait again.
    async fn woken(
        &self,
        current: LiveLesson,
        woken: Woken,
        deadline: Instant,
    ) -> Result<Next, Error> {
        let Woken {
            observer,
            report,
            why,
        } = woken;
        if why == Wake::Lost {
            tracing::warn!(
                "the agent does not hold the live lesson while provisioning; provisioning again"
            );
            return Ok(Next::After(Duration::ZERO));
        }
        self.await_settled(current, report, observer, deadline)
            .await
    }

    /// Hands the wait for `current`'s generation to a waiter task, which holds no worker: it
    /// follows the agent's Watch reports through `observer` (made before the agent was called,
    /// so nothing is missed), asks Get from every `poll_interval` (Watch is a speed-up, Get the
    /// truth; over a Watch stream the interval doubles up to 16 times), and wakes the live lesson (keeps what it saw and enqueues it) when the agent
    /// does not hold it any more (Watch says deleted, Get NOT_FOUND), at the deadline, and,
    /// `until` it settles, on a report of the generation with another status than the
    /// recorded one. It stops, waking nothing, when [`Reconciler::stop_waiting`] or shutdown
    /// stops it.
    fn wait_for(
        &self,
        current: &LiveLesson,
        until: Until,
        report: Report,
        observer: Observer,
        deadline: Instant,
    ) {
        let (id, generation, recorded) = (current.id, current.generation, current.status);
        let stop = self.inner.stopping.child_token();
        let waiting = Waiting {
            generation,
            until,
            woken: None,
            stop: stop.clone(),
        };
        if let Some(previous) = lock(&self.inner.waiting).insert(id, waiting) {
            previous.stop.cancel();
        }
        let poll_interval = self.inner.config.poll_interval;
        let this = self.clone();
        let span = tracing::debug_span!("wait", live_lesson.id = %id, generation);
        let waiter = async move {
            let (mut observer, mut report) = (observer, report);
            let agent = observer.agent().clone();
            // Whether a report is news for the run: the generation's status changed or settled.
            let news = |report: &Report| {
                until == Until::Settled
                    && report.generation == generation
                    && report
                        .status
                        .is_some_and(|status| status != recorded || status.is_settled())
            };
            // Get is the truth, Watch the speed-up. Over a Watch stream (which reports every
            // change, and whose snapshot after a reconnect repeats every state) polls back off
            // from `poll_interval` to 16 times it, so thousands of waiting live lessons do not
            // flood their agent; without Watch they stay at `poll_interval`. The first poll is
            // spread by up to a fifth of the interval (from the id), like retries.
            let backs_off = agent.has(capabilities::WATCH);
            let mut poll_every = poll_interval;
            let mut poll_at = Instant::now() + poll_interval + poll_interval.mul_f64(spread(id));
            // False once the agent's observations ended (they do not while it exists): Get
            // alone then.
            let mut observing = true;
            let why = loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep_until(deadline) => break Wake::Deadline,
                    observed = observer.changed(), if observing => match observed {
                        Some(Observed::Report(next)) => {
                            report = next;
                            if news(&report) {
                                break Wake::Report;
                            }
                        }
                        Some(Observed::Deleted) => break Wake::Lost,
                        Some(Observed::Nothing) => {}
                        None => observing = false,
                    },
                    _ = tokio::time::sleep_until(poll_at) => {
                        if backs_off {
                            poll_every = (poll_every * 2).min(poll_interval * 16);
                        }
                        poll_at = Instant::now() + poll_every;
                        let got = tokio::select! {
                            _ = stop.cancelled() => return,
                            got = agent.get(id) => got,
                        };
                        match got {
                            Ok(next) => {
                                report = next;
                                if news(&report) {
                                    break Wake::Report;
                                }
                            }
                            Err(err) if agents::lost_it(&err) => break Wake::Lost,
                            Err(err) => tracing::warn!(error = %err, "Get failed; waiting on"),
                        }
                    }
                }
            };
            let woke = match lock(&this.inner.waiting).get_mut(&id) {
                Some(waiting) if waiting.generation == generation && !stop.is_cancelled() => {
                    waiting.woken = Some(Woken {
                        observer,
                        report,
                        why,
                    });
                    true
                }
                _ => false,
            };
            if woke {
                this.inner.queue.add(id);
            }
        };
        tokio::spawn(waiter.instrument(span));
    }

    /// What became of a wait of `lesson`'s generation `until` something: a waiter still waits
    /// (nothing to do), it woke the live lesson with news, or there is none to resume (another
    /// generation, another agent, a wait for something else): any waiter left is stopped.
    fn resume(&self, lesson: &LiveLesson, until: Until) -> Resume {
        let mut waiting = lock(&self.inner.waiting);
        if let Some(entry) = waiting.get_mut(&lesson.id)
            && entry.generation == lesson.generation
            && entry.until == until
        {
            match entry.woken.take() {
                None => return Resume::Waiting,
                Some(woken)
                    if lesson.agent.as_deref() == Some(woken.observer.agent().name.as_str()) =>
                {
                    waiting.remove(&lesson.id);
                    return Resume::Woken(woken);
                }
                Some(_) => {}
            }
        }
        if let Some(entry) = waiting.remove(&lesson.id) {
            entry.stop.cancel();
        }
        Resume::Fresh
    }

    /// Stops the waiter of a live lesson, if it has one.
    fn stop_waiting(&self, id: LiveLessonId) {
        if let Some(entry) = lock(&self.inner.waiting).remove(&id) {
            entry.stop.cancel();
        }
    }

    /// Removes the live lesson's objects from its agent (if it has one), then forgets it. When
    /// the agent answers that removal goes on, a waiter waits for the objects to go and the
    /// next run (the waiter's news) forgets it.
    #[tracing::instrument(skip_all)]
    async fn terminate(&self, lesson: LiveLesson) -> Result<Next, Error> {
        let inner = &self.inner;
        let deadline = self.attempt(&lesson).started + inner.config.terminate_timeout;
        let agent = lesson
            .agent
            .as_deref()
            .and_then(|name| inner.fleet.get(name));
        // A lost agent is not waited for: if it comes back, what it still holds of this live
        // lesson is an orphan the reaper removes.
        let lost = agent
            .as_ref()
            .is_some_and(|agent| inner.roster.is_lost(&agent.name));
        let resumed = if agent.is_some() && !lost {
            self.resume(&lesson, Until::Gone)
        } else {
            self.stop_waiting(lesson.id);
            Resume::Fresh
        };
        match resumed {
            Resume::Waiting => return Ok(Next::Wait),
            Resume::Woken(woken) => {
                if woken.why == Wake::Deadline {
                    tracing::warn!(
                        "removal still unfinished; leaving the rest to the orphan reaper"
                    );
                }
            }
            Resume::Fresh => {
                if let Some(agent) = agent.as_ref().filter(|_| !lost) {
                    let Some(_call) = self.call_slot(&agent.name) else {
                        return Ok(Next::After(inner.config.backoff_initial));
                    };
                    let observer = agent.observe(lesson.id);
                    match agent.deprovision(lesson.id, lesson.handle.clone()).await {
                        Ok(true) => {}
                        Ok(false) => {
                            // The objects go in the background: a waiter waits for Watch to say
                            // deleted or Get NOT_FOUND (or the deadline), holding no worker.
                            let nothing = Report {
                                id: lesson.id,
                                generation: lesson.generation,
                                status: None,
                                reason: String::new(),
                                endpoints: Vec::new(),
                                handle: Vec::new(),
                            };
                            self.wait_for(&lesson, Until::Gone, nothing, observer, deadline);
                            return Ok(Next::Wait);
                        }
                        Err(err) => {
                            if agents::retryable(&err) && Instant::now() < deadline {
                                tracing::warn!(error = %err, "Deprovision failed; retrying");
                                return Ok(Next::After(self.backoff(lesson.id, Some(&lesson))));
                            }
                            tracing::error!(error = %err, "Deprovision failed; forgetting the live lesson, the orphan reaper will retry");
                        }
                    }
                }
            }
        }
        inner.store.forget(lesson.id).await?;
        if let Some(agent) = &agent {
            agent.release();
        }
        lock(&inner.attempts).remove(&lesson.id);
        inner.hub.gone(lesson.id);
        Ok(Next::Done)
    }

    /// No agent yet: note why and retry with backoff, or FAILED once the deadline passed.
    async fn wait(
        &self,
        lesson: &LiveLesson,
        reason: String,
        deadline: Instant,
    ) -> Result<Next, Error> {
        if Instant::now() >= deadline {
            return self.fail(lesson, reason).await;
        }
        // Unplaced lessons stay PENDING; a placed one keeps its status while its agent is away.
        let status = if lesson.agent.is_none() {
            Status::Pending
        } else {
            lesson.status
        };
        self.note(lesson, status, reason).await;
        Ok(Next::After(self.backoff(lesson.id, Some(lesson))))
    }

    /// Handles a failed Provision/Recover call: back off on retryable codes until the deadline,
    /// FAILED otherwise.
    async fn agent_error(
        &self,
        lesson: &LiveLesson,
        err: Error,
        deadline: Instant,
    ) -> Result<Next, Error> {
        if agents::retryable(&err) && Instant::now() < deadline {
            tracing::warn!(error = %err, "agent call failed; retrying");
            self.note(lesson, lesson.status, err.to_string()).await;
            return Ok(Next::After(self.backoff(lesson.id, Some(lesson))));
        }
        let reason = match err {
            Error::Agent {
                agent,
                call,
                status,
            } => match errors::reason(&status) {
                Some((reason, _)) => format!(
                    "agent `{agent}` {call}: {} ({:?}, {reason})",
                    status.message(),
                    status.code()
                ),
                None => format!(
                    "agent `{agent}` {call}: {} ({:?})",
                    status.message(),
                    status.code()
                ),
            },
            other => other.to_string(),
        };
        self.fail(lesson, reason).await
    }

    async fn fail(&self, lesson: &LiveLesson, reason: String) -> Result<Next, Error> {
        tracing::warn!(%reason, "live lesson failed");
        // A store error returns before `settled`: the run is retried and fails it again.
        self.record(lesson, Observation::status(Status::Failed, reason))
            .await?;
        self.settled(lesson, false);
        Ok(Next::Done)
    }

    /// A generation ended READY (`ready`) or FAILED: forget its attempt, count its time.
    fn settled(&self, lesson: &LiveLesson, ready: bool) {
        if let Some(attempt) = lock(&self.inner.attempts).remove(&lesson.id) {
            self.inner
                .metrics
                .provisioned(&lesson.lesson_slug, ready, attempt.started.elapsed());
        }
    }

    /// Records a progress note without settling.
    async fn note(&self, lesson: &LiveLesson, status: Status, reason: String) {
        if lesson.reason == reason && lesson.status == status {
            return;
        }
        if let Err(err) = self
            .record(lesson, Observation::status(status, reason))
            .await
        {
            // Only a progress note: the run goes on and its next write retries.
            tracing::warn!(error = %err, "cannot record a progress note");
        }
    }

    /// Writes an observation for the live lesson's generation and publishes the new state.
    /// `None` when the desired state moved on (the queue runs the live lesson again); an error
    /// when the store could not write it, which is never read as "moved on": the caller returns
    /// it and the run is retried with backoff. On PostgreSQL the write is fenced by the live
    /// lesson's lease: a replica that lost it (frozen past its TTL, say, while another took
    /// over) writes nothing, drops the live lesson (`None`: the run ends) and leaves it to the
    /// lease's holder.
    async fn record(
        &self,
        lesson: &LiveLesson,
        observation: Observation,
    ) -> Result<Option<LiveLesson>, Error> {
        let store = &self.inner.store;
        let now = Millis::now();
        let updated = match &self.inner.replica {
            None => {
                store
                    .observe(lesson.id, lesson.generation, observation, now)
                    .await?
            }
            Some(replica) => match store
                .observe_fenced(lesson.id, lesson.generation, observation, now, &replica.id)
                .await?
            {
                Fenced::Recorded(updated) => Some(*updated),
                Fenced::MovedOn => None,
                Fenced::NotHolder => {
                    tracing::warn!(live_lesson.id = %lesson.id, "lease lost to another replica; write refused, dropping the live lesson");
                    replica.lost(lesson.id);
                    self.stop_waiting(lesson.id);
                    lock(&self.inner.attempts).remove(&lesson.id);
                    return Ok(None);
                }
            },
        };
        if let Some(updated) = &updated {
            self.inner.hub.publish(updated);
        }
        Ok(updated)
    }

    /// The attempt record for the live lesson's current generation.
    fn attempt(&self, lesson: &LiveLesson) -> Attempt {
        let fresh = Attempt {
            generation: lesson.generation,
            started: Instant::now(),
            failures: 0,
        };
        let mut attempts = lock(&self.inner.attempts);
        let entry = attempts.entry(lesson.id).or_insert(fresh);
        if entry.generation != lesson.generation {
            *entry = fresh;
        }
        *entry
    }

    /// The next retry delay: exponential from `backoff_initial` to `backoff_max`, with jitter.
    fn backoff(&self, id: LiveLessonId, lesson: Option<&LiveLesson>) -> Duration {
        let failures = {
            let mut attempts = lock(&self.inner.attempts);
            match (attempts.get_mut(&id), lesson) {
                (Some(attempt), _) => {
                    attempt.failures += 1;
                    attempt.failures
                }
                (None, Some(lesson)) => {
                    let attempt = Attempt {
                        generation: lesson.generation,
                        started: Instant::now(),
                        failures: 1,
                    };
                    attempts.insert(id, attempt);
                    1
                }
                (None, None) => 1,
            }
        };
        backoff(&self.inner.config, id, failures)
    }
}

/// What the reconciler is made of, named so that its construction reads as a list of parts.
pub struct ReconcilerParts {
    /// Desired and observed state.
    pub store: Store,
    /// The lesson definitions specs are built from.
    pub catalog: Arc<Catalog>,
    /// Where live lessons are placed and driven.
    pub fleet: Arc<Fleet>,
    /// Drained and lost agents, operators' labels: placement's view of the fleet.
    pub roster: Arc<Roster>,
    /// Watchers of the public API.
    pub hub: Arc<Hub>,
    /// Pool size, deadlines, backoff.
    pub config: ReconcilerConfig,
    /// Who this scheduler is to agents and to other replicas.
    pub identity: Identity,
    /// The lease TTL and how often the store is searched for work nobody does.
    pub replicas: ReplicasConfig,
    /// Where provisioning times are counted.
    pub metrics: Arc<Metrics>,
}

/// Who this scheduler is to agents and to other replicas.
pub struct Identity {
    /// The configured instance id (a label on every object).
    pub instance_id: String,
    /// The deployment's cluster id from the store (a label on every object).
    pub cluster_id: String,
    /// This process as a replica on PostgreSQL; `None` on SQLite.
    pub replica: Option<Arc<Replica>>,
}

/// Why a live lesson is suspected of being broken or gone on its agent.
struct Suspicion {
    /// The agent whose Watch said so (the live lesson may have moved since).
    agent: String,
    /// The FAILED state it sent, if that is what it said.
    report: Option<Report>,
}

/// Where a live lesson runs, and why when placement chose just now.
struct Placed {
    /// The agent.
    agent: Arc<Agent>,
    /// Placement's decision; `None` for a live lesson already placed.
    decision: Option<Decision>,
    /// The lost agent it was moved from, if it was.
    moved_from: Option<String>,
}

/// Why a live lesson has no agent to run on.
enum Unplaced {
    /// Not now (none ready, none with room): wait and try again.
    Yet(String),
    /// Never: its agent was removed from the configuration, or no agent could ever take it.
    Never(String),
}

/// What to record for an agent's report, entering `status`.
fn observation(report: &Report, status: Status) -> Observation {
    Observation {
        status,
        reason: report.reason.clone(),
        endpoints: Some(report.endpoints.clone()),
        handle: (!report.handle.is_empty()).then(|| report.handle.clone()),
        agent: None,
        decision: None,
    }
}

/// The delay before retry number `failures`: exponential from `backoff_initial`, capped at
/// `backoff_max`, plus up to 20 % jitter derived from the id, which spreads retries of many
/// live lessons hitting one agent.
fn backoff(config: &ReconcilerConfig, id: LiveLessonId, failures: u32) -> Duration {
    let exp = config
        .backoff_initial
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    let capped = exp.min(config.backoff_max);
    capped + capped.mul_f64(spread(id))
}

/// A fraction from 0 to 0.2 derived from the id: spreads the retries and polls of many live
/// lessons started together.
fn spread(id: LiveLessonId) -> f64 {
    f64::from(id.0.as_u128() as u32 % 1000) / 5000.0
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
