//! The reconciler: drives agents toward the desired state the store records.
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
//!   the wait to a waiter task ([`Reconciler::wait_for`], in [`waiter`]) and returns its worker to the pool.
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
//! What to do at each step is decided in [`super::lifecycle`], out of the facts a run gathers
//! (the live lesson, the agent's answer, the agents' snapshot, whether the deadline passed);
//! this module is the runtime that gathers them and carries the decisions out: the workers
//! and their steps here, the waiters in [`waiter`], the background duties (resync, leases,
//! changes heard from other replicas, lost agents, the fleet's events) in [`duties`].
//!
//! Replicas on PostgreSQL ([`Replica`]): live lessons belong to shards, each leased to one
//! replica; a worker runs a live lesson only while this replica holds its shard's lease (no
//! database call), so one replica at a time works on it, and its writes are fenced by that
//! lease's epoch. Every replica hears every change ([`crate::store::Changes`]): watched live
//! lessons are read again for the [`Hub`], and changes that need work are enqueued unless this
//! replica is on that very generation already or another replica holds the shard.

mod duties;
mod waiter;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use antidote_proto::capabilities;
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::TraceContextExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use self::waiter::{Resume, Waiting, Woken};
use super::hub::Hub;
use super::lifecycle::{
    self, Call, Held, Presence, Removal, Route, Setback, Suspicion, Unplaced, Until, Wake,
};
use super::placement::{self, Needs};
use super::queue::WorkQueue;
use super::replicas::Replica;
use super::roster::Roster;
use crate::agents::{Agent, AgentReport, Desired, Fleet, FleetEvent, Observer};
use crate::catalog::{Catalog, Lesson};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{Decision, LiveLesson, LiveLessonId, Millis, Status};
use crate::settings::{ReconcilerConfig, ReplicasConfig};
use crate::store::{Fenced, Observation, Store};

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
        let context = antidote_net::trace::current_context();
        if context.span().span_context().is_valid() {
            lock(&self.inner.origins).insert(id, context);
        }
        self.inner.queue.add(id);
    }

    /// Starts the workers and the background duties ([`duties`]), and enqueues every unsettled
    /// live lesson from the store (resuming work a previous process left unfinished).
    pub async fn start(
        &self,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        fleet_events: mpsc::UnboundedReceiver<FleetEvent>,
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
        self.start_duties(tracker, shutdown, fleet_events).await
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

    /// One worker: takes ids from the queue until shutdown, each under its lease on PostgreSQL,
    /// runs it in a `reconcile` span of the trace that asked for it, and does what the run asks
    /// next.
    async fn work(&self, shutdown: CancellationToken) {
        loop {
            let id = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = self.inner.queue.next() => next,
            };
            if !self.take_lease(id, &shutdown).await {
                self.inner.queue.done(id);
                continue;
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
            self.then(id, next, &shutdown).await;
            self.inner.queue.done(id);
        }
    }

    /// On PostgreSQL, whether this replica holds the lease of the live lesson's shard before a
    /// run: false when another replica holds it (it hears every change, and if it dies its
    /// shards are handed over and a resync here takes the work over) or when it cannot be said
    /// (retried after backoff).
    async fn take_lease(&self, id: LiveLessonId, shutdown: &CancellationToken) -> bool {
        let Some(replica) = &self.inner.replica else {
            return true;
        };
        match replica.take_lesson(&self.inner.store, id).await {
            Ok(true) => true,
            Ok(false) => {
                tracing::debug!(live_lesson.id = %id, "leased by another replica");
                self.stop_waiting(id);
                lock(&self.inner.attempts).remove(&id);
                lock(&self.inner.origins).remove(&id);
                false
            }
            Err(err) => {
                let delay = self.backoff(id, None);
                tracing::warn!(live_lesson.id = %id, error = %err, ?delay, "cannot take the lease; retrying");
                self.enqueue_after(id, delay, shutdown);
                false
            }
        }
    }

    /// Does what a run asked for next.
    async fn then(
        &self,
        id: LiveLessonId,
        next: Result<Next, Error>,
        shutdown: &CancellationToken,
    ) {
        match next {
            Ok(Next::Done) => {
                // Done for now (settled, gone, or moved on): this replica stops counting it as
                // its work; the shard's holder takes the next change up.
                if let Some(replica) = &self.inner.replica {
                    replica.give_back(&self.inner.store, id).await;
                }
            }
            Ok(Next::After(delay)) => self.enqueue_after(id, delay, shutdown),
            // Its waiter enqueues it when there is news; it stays this replica's work.
            Ok(Next::Wait) => {}
            Err(err) => {
                let delay = self.backoff(id, None);
                tracing::error!(live_lesson.id = %id, error = %err, ?delay, "reconcile failed; retrying");
                self.enqueue_after(id, delay, shutdown);
            }
        }
    }

    /// One run: reads the live lesson and does what [`lifecycle::route`] says.
    async fn run(&self, id: LiveLessonId) -> Result<Next, Error> {
        let Some(lesson) = self.inner.store.find_live_lesson(id).await? else {
            self.stop_waiting(id);
            self.inner.hub.gone(id);
            lock(&self.inner.attempts).remove(&id);
            return Ok(Next::Done);
        };
        // A removal in progress is resumed by `terminate`, which stops any other wait; what
        // else is pending for the live lesson stays until a run that is not a removal.
        let (recovering, suspicion) = if lesson.deleting {
            (false, None)
        } else {
            (
                lock(&self.inner.recover).remove(&id),
                lock(&self.inner.suspects).remove(&id),
            )
        };
        match lifecycle::route(&lesson, recovering, suspicion) {
            Route::Remove => self.terminate(lesson).await,
            Route::Check(suspicion) => self.check_held(lesson, suspicion).await,
            Route::Provision { recovering } => self.provision(lesson, recovering).await,
            Route::Idle => {
                self.stop_waiting(id);
                lock(&self.inner.attempts).remove(&id);
                Ok(Next::Done)
            }
        }
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
            Err(Unplaced::Yet(reason) | Unplaced::Busy { reason, .. }) => {
                return self.unplaced(&lesson, reason, deadline).await;
            }
        };
        let agent = placed.agent.clone();
        let Some(_call) = self.call_slot(&agent.name) else {
            return Ok(Next::After(inner.config.backoff_initial));
        };
        let new = lifecycle::is_new(
            &lesson,
            placed.decision.is_some(),
            placed.moved_from.as_deref(),
            recovering,
        );
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

    /// The agent the live lesson is (or is to be) placed on, ready for calls: the recorded one
    /// ([`lifecycle::on_recorded`]), or placement's choice among every agent by the lesson's and
    /// its request's needs ([`lifecycle::choose`]). When none can take it now, an unclaimed
    /// warm-pool member on a full agent that fits may give way first.
    async fn place(&self, lesson: &LiveLesson, definition: &Lesson) -> Result<Placed, Unplaced> {
        let inner = &self.inner;
        if let Some(name) = &lesson.agent {
            let agent = inner.fleet.get(name).map(|agent| {
                let presence = if inner.roster.is_lost(name) {
                    Presence::Lost
                } else if !agent.is_ready() {
                    Presence::Unavailable(agent.status().last_error)
                } else {
                    Presence::Ready
                };
                (agent, presence)
            });
            return Ok(Placed {
                agent: lifecycle::on_recorded(name, agent)?,
                decision: None,
                moved_from: None,
            });
        }
        let record = inner
            .store
            .placement(lesson.id)
            .await
            .map_err(|err| Unplaced::Yet(format!("cannot read the placement record: {err}")))?;
        let needs = Needs::of(definition, &record.wishes);
        let candidates = inner.roster.candidates();
        let decision = match lifecycle::choose(lesson, &record, needs, &candidates) {
            Ok(decision) => decision,
            Err(Unplaced::Busy { reason, needs }) => {
                match super::room::give_way(&inner.store, &candidates, &needs, lesson).await {
                    Ok(Some(member)) => self.changed(&member),
                    Ok(None) => {}
                    Err(err) => tracing::warn!(error = %err, "cannot make a pool member give way"),
                }
                return Err(Unplaced::Busy { reason, needs });
            }
            Err(unplaced) => return Err(unplaced),
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

    /// Records the placement ([`lifecycle::claim`]: BOOTING and the decision in one write; the
    /// live lesson is on this agent from now on), and counts it in the agent's load. `None`
    /// when the desired state moved on; an error when the store could not record it (retried).
    async fn claim(&self, lesson: LiveLesson, placed: Placed) -> Result<Option<LiveLesson>, Error> {
        let agent = &placed.agent;
        let Some(claim) = lifecycle::claim(
            &lesson,
            &agent.name,
            placed.decision.as_ref(),
            placed.moved_from.as_deref(),
        ) else {
            return Ok(Some(lesson));
        };
        let Some(updated) = self.record(&lesson, claim.observation).await? else {
            return Ok(None);
        };
        if claim.counts_load {
            agent.claim();
        }
        if let Some(decision) = &placed.decision {
            tracing::info!(agent = %agent.name, reason = %decision.reason, "placed");
        }
        Ok(Some(updated))
    }

    /// Provision (saying whether the live lesson is `new`), or Recover after the agent restarted
    /// (Provision again if it lost the lesson): [`lifecycle::call`].
    async fn call(
        &self,
        agent: &Agent,
        current: &LiveLesson,
        definition: &Lesson,
        recovering: bool,
        new: bool,
    ) -> Result<AgentReport, Error> {
        let desired = Desired {
            instance_id: &self.inner.instance_id,
            cluster_id: &self.inner.cluster_id,
            live: current,
            lesson: definition,
            catalog: &self.inner.catalog,
        };
        let offers_recover = recovering && agent.has(capabilities::RECOVER);
        let new = match lifecycle::call(current, recovering, offers_recover, new) {
            Call::Provision { new } => return agent.provision(&desired, new).await,
            Call::Recover => match agent.recover(&desired).await {
                Err(err) => match lifecycle::after_recover_error(&err) {
                    Some(Call::Provision { new }) => new,
                    _ => return Err(err),
                },
                recovered => return recovered,
            },
        };
        tracing::info!("agent lost the live lesson; provisioning it again");
        agent.provision(&desired, new).await
    }

    /// Records what the agent reported for the generation, then settles it (READY or FAILED),
    /// fails it past the deadline, or hands the wait to a waiter ([`Reconciler::wait_for`]) and
    /// gives the worker back to the pool: [`lifecycle::settle`], [`lifecycle::overdue`].
    async fn await_settled(
        &self,
        mut current: LiveLesson,
        report: AgentReport,
        observer: Observer,
        deadline: Instant,
    ) -> Result<Next, Error> {
        let settle = lifecycle::settle(&current, &report);
        if let Some(observation) = settle.record {
            match self.record(&current, observation).await? {
                Some(updated) => current = updated,
                None => return Ok(Next::Done),
            }
        }
        if let Some(ready) = settle.settled {
            self.settled(&current, ready);
            return Ok(Next::Done);
        }
        let timeout = self.inner.config.provision_timeout;
        if let Some(reason) =
            lifecycle::overdue(&current, &report, Instant::now() >= deadline, timeout)
        {
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

    /// Removes the live lesson's objects from its agent (if it has one, [`lifecycle::remover`]),
    /// then forgets it. When the agent answers that removal goes on, a waiter waits for the
    /// objects to go and the next run (the waiter's news) forgets it.
    #[tracing::instrument(skip_all)]
    async fn terminate(&self, lesson: LiveLesson) -> Result<Next, Error> {
        let inner = &self.inner;
        let deadline = self.attempt(&lesson).started + inner.config.terminate_timeout;
        let agent = lesson
            .agent
            .as_deref()
            .and_then(|name| inner.fleet.get(name));
        let lost = agent
            .as_ref()
            .is_some_and(|agent| inner.roster.is_lost(&agent.name));
        let remover = lifecycle::remover(agent.clone(), lost);
        let resumed = if remover.is_some() {
            self.resume(&lesson, Until::Gone)
        } else {
            self.stop_waiting(lesson.id);
            Resume::Fresh
        };
        match (resumed, remover) {
            (Resume::Waiting, _) => return Ok(Next::Wait),
            (Resume::Woken(woken), _) if woken.why == Wake::Deadline => {
                tracing::warn!("removal still unfinished; leaving the rest to the orphan reaper");
            }
            (Resume::Fresh, Some(remover)) => {
                if let Some(next) = self.deprovision(&lesson, &remover, deadline).await {
                    return Ok(next);
                }
            }
            _ => {}
        }
        inner.store.forget(lesson.id).await?;
        if let Some(agent) = &agent {
            agent.release();
        }
        lock(&inner.attempts).remove(&lesson.id);
        inner.hub.gone(lesson.id);
        Ok(Next::Done)
    }

    /// Asks `agent` to remove the live lesson's objects and does what
    /// [`lifecycle::after_deprovision`] says: `None` to forget the live lesson now, else what
    /// the run asks for next (a retry, a wait for the objects to go).
    async fn deprovision(
        &self,
        lesson: &LiveLesson,
        agent: &Arc<Agent>,
        deadline: Instant,
    ) -> Option<Next> {
        let Some(_call) = self.call_slot(&agent.name) else {
            return Some(Next::After(self.inner.config.backoff_initial));
        };
        let observer = agent.observe(lesson.id);
        let result = agent.deprovision(lesson.id, lesson.handle.clone()).await;
        match lifecycle::after_deprovision(&result, Instant::now() >= deadline) {
            Removal::Forget => {
                if let Err(err) = result {
                    tracing::error!(error = %err, "Deprovision failed; forgetting the live lesson, the orphan reaper will retry");
                }
                None
            }
            Removal::WaitGone => {
                let nothing = AgentReport {
                    id: lesson.id,
                    generation: lesson.generation,
                    status: None,
                    reason: String::new(),
                    endpoints: Vec::new(),
                    handle: Vec::new(),
                };
                self.wait_for(lesson, Until::Gone, nothing, observer, deadline);
                Some(Next::Wait)
            }
            Removal::Retry => {
                if let Err(err) = result {
                    tracing::warn!(error = %err, "Deprovision failed; retrying");
                }
                Some(Next::After(self.backoff(lesson.id, Some(lesson))))
            }
        }
    }

    /// Checks a READY live lesson its agent's Watch suggests is broken or gone: the agent's
    /// FAILED report of its generation, or else Get, decides ([`lifecycle::held`],
    /// [`lifecycle::after_get`]). FAILED (the agent's reason) or NOT_FOUND (it does not hold the
    /// live lesson any more) is recorded FAILED, with no endpoint healthy; anything else leaves
    /// it be. An agent that cannot answer is asked again after `backoff_max`.
    #[tracing::instrument(skip_all, fields(agent = %suspicion.agent))]
    async fn check_held(&self, lesson: LiveLesson, suspicion: Suspicion) -> Result<Next, Error> {
        let Suspicion { agent, report } = suspicion;
        let observation = match lifecycle::held(&lesson, report) {
            Some(observation) => observation,
            None => {
                let Some(agent) = self.inner.fleet.get(&agent) else {
                    return Ok(Next::Done);
                };
                match lifecycle::after_get(&lesson, &agent.name, agent.get(lesson.id).await) {
                    Held::Broken(observation) => observation,
                    Held::Fine => return Ok(Next::Done),
                    Held::AskAgain(err) => {
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
        tracing::warn!(reason = %observation.reason, "a READY live lesson broke on its agent");
        self.record(&lesson, observation).await?;
        Ok(Next::Done)
    }

    /// No agent yet: note why and retry with backoff, or FAILED once the deadline passed
    /// ([`lifecycle::unplaced`]).
    async fn unplaced(
        &self,
        lesson: &LiveLesson,
        reason: String,
        deadline: Instant,
    ) -> Result<Next, Error> {
        let setback = lifecycle::unplaced(lesson, reason, Instant::now() >= deadline);
        self.set_back(lesson, setback).await
    }

    /// Handles a failed Provision/Recover call: back off on retryable codes until the deadline,
    /// FAILED otherwise ([`lifecycle::after_call_error`]).
    async fn agent_error(
        &self,
        lesson: &LiveLesson,
        err: Error,
        deadline: Instant,
    ) -> Result<Next, Error> {
        let setback = lifecycle::after_call_error(lesson, &err, Instant::now() >= deadline);
        if let Setback::Retry { .. } = &setback {
            tracing::warn!(error = %err, "agent call failed; retrying");
        }
        self.set_back(lesson, setback).await
    }

    /// Records a setback: FAILED, or a progress note and a retry after backoff.
    async fn set_back(&self, lesson: &LiveLesson, setback: Setback) -> Result<Next, Error> {
        match setback {
            Setback::Fail(reason) => self.fail(lesson, reason).await,
            Setback::Retry { status, reason } => {
                self.note(lesson, status, reason).await;
                Ok(Next::After(self.backoff(lesson.id, Some(lesson))))
            }
        }
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

    /// Records a progress note without settling ([`lifecycle::note`]).
    async fn note(&self, lesson: &LiveLesson, status: Status, reason: String) {
        let Some(observation) = lifecycle::note(lesson, status, reason) else {
            return;
        };
        if let Err(err) = self.record(lesson, observation).await {
            // Only a progress note: the run goes on and its next write retries.
            tracing::warn!(error = %err, "cannot record a progress note");
        }
    }

    /// Writes an observation for the live lesson's generation and publishes the new state.
    /// `None` when the desired state moved on (the queue runs the live lesson again); an error
    /// when the store could not write it, which is never read as "moved on": the caller returns
    /// it and the run is retried with backoff. On PostgreSQL the write is fenced by the lease of
    /// the live lesson's shard at its epoch: a replica that lost it (frozen past its TTL, say,
    /// while another took over) writes nothing, drops the live lesson (`None`: the run ends)
    /// and leaves it to the shard's holder.
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
                .observe_fenced(
                    lesson.id,
                    lesson.generation,
                    observation,
                    now,
                    &replica.fence(lesson.id),
                )
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

    /// The next retry delay: exponential from `backoff_initial` to `backoff_max`, with jitter
    /// ([`lifecycle::backoff`]).
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
        lifecycle::backoff(&self.inner.config, id, failures)
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

/// Where a live lesson runs, and why when placement chose just now.
struct Placed {
    /// The agent.
    agent: Arc<Agent>,
    /// Placement's decision; `None` for a live lesson already placed.
    decision: Option<Decision>,
    /// The lost agent it was moved from, if it was.
    moved_from: Option<String>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
