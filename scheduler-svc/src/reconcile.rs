//! The reconciler (DESIGN.md §3): drives agents toward the desired state the store records.
//!
//! Requests only write desired state and call [`Reconciler::enqueue`]. A bounded pool of
//! workers takes live-lesson ids from a de-duplicating work queue; one id is never processed by
//! two workers at once, and an id enqueued while it is being processed is marked dirty, its
//! worker is told to stop waiting, and the id runs again right after. Each run reads the live
//! lesson from the store and does one of:
//! - removal: Deprovision (retried), wait for the objects to go, forget the live lesson;
//! - provisioning: place it, Provision (idempotent on id + generation), then wait for READY or
//!   FAILED from the agent's Watch stream, asking Get as the truth when the stream is quiet.
//!
//! Every agent call has a deadline; retryable codes back off exponentially; every generation
//! ends in READY or FAILED within `provision_timeout`. After a restart, `resume` enqueues every
//! unsettled live lesson, and Provision's idempotency means nothing is created twice.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::TraceContextExt as _;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::catalog::Catalog;
use crate::error::{Error, is_retryable};
use crate::fleet::{self, Agent, Fleet, FleetEvent, Observed};
use crate::hub::Hub;
use crate::metrics::Metrics;
use crate::model::{LiveLesson, LiveLessonId, Millis, Status};
use crate::placement;
use crate::settings::ReconcilerConfig;
use crate::store::{Observation, Store};
use crate::wire;

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
    /// The agents.
    fleet: Arc<Fleet>,
    /// Watchers of the public API.
    hub: Arc<Hub>,
    /// Pool size, deadlines, backoff.
    config: ReconcilerConfig,
    /// This scheduler's instance id, put on every object through the spec's labels.
    instance_id: String,
    /// The work queue.
    queue: WorkQueue,
    /// Live lessons whose agent restarted: their next run calls Recover.
    recover: Mutex<HashSet<LiveLessonId>>,
    /// Per live lesson: the generation being worked on, when work on it started and how many
    /// attempts failed, for deadlines and backoff.
    attempts: Mutex<HashMap<LiveLessonId, Attempt>>,
    /// Per live lesson: the trace context of whoever asked for the work (an API call, the
    /// reaper), so the work and its agent calls belong to that trace.
    origins: Mutex<HashMap<LiveLessonId, opentelemetry::Context>>,
    /// Provisioning times.
    metrics: Arc<Metrics>,
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
}

impl Reconciler {
    /// Creates the reconciler; call [`Reconciler::start`] to run its workers.
    pub fn new(
        store: Store,
        catalog: Arc<Catalog>,
        fleet: Arc<Fleet>,
        hub: Arc<Hub>,
        config: ReconcilerConfig,
        instance_id: String,
        metrics: Arc<Metrics>,
    ) -> Reconciler {
        Reconciler {
            inner: Arc::new(Inner {
                store,
                catalog,
                fleet,
                hub,
                config,
                instance_id,
                queue: WorkQueue::default(),
                recover: Mutex::new(HashSet::new()),
                attempts: Mutex::new(HashMap::new()),
                origins: Mutex::new(HashMap::new()),
                metrics,
            }),
        }
    }

    /// Schedules a live lesson for reconciliation. The work joins the current span's trace.
    pub fn enqueue(&self, id: LiveLessonId) {
        let context = tracing::Span::current().context();
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
        for (agent, load) in self.inner.store.agent_loads().await? {
            if let Some(agent) = self.inner.fleet.get(&agent) {
                agent.load.store(load, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let unsettled = self.inner.store.unsettled().await?;
        if !unsettled.is_empty() {
            tracing::info!(count = unsettled.len(), "resuming unfinished live lessons");
        }
        for id in unsettled {
            self.enqueue(id);
        }
        for _ in 0..self.inner.config.workers {
            let this = self.clone();
            let shutdown = shutdown.clone();
            tracker.spawn(async move { this.work(shutdown).await });
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

    /// Enqueues `id` again after `delay` (a retry with backoff), unless shutdown comes first.
    fn enqueue_after(&self, id: LiveLessonId, delay: Duration, shutdown: &CancellationToken) {
        let queue = self.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(delay) => queue.enqueue(id),
            }
        });
    }

    async fn on_fleet_event(&self, event: FleetEvent) {
        match event {
            FleetEvent::Restarted(agent) => match self.inner.store.on_agent(&agent).await {
                Ok(ids) => {
                    tracing::info!(%agent, count = ids.len(), "agent restarted; recovering its live lessons");
                    let mut recover = lock(&self.inner.recover);
                    recover.extend(ids.iter().copied());
                    drop(recover);
                    for id in ids {
                        self.enqueue(id);
                    }
                }
                Err(err) => {
                    tracing::error!(%agent, error = %err, "cannot list the agent's live lessons")
                }
            },
            FleetEvent::Unsolicited(agent, state) => {
                // A settled live lesson failed on the agent (e.g. its container died): record it
                // so learners see it, unless the store moved on.
                let Ok(id) = state.live_lesson_id.parse::<LiveLessonId>() else {
                    return;
                };
                let Ok(Some(lesson)) = self.inner.store.find_live_lesson(id).await else {
                    return;
                };
                if lesson.agent.as_deref() == Some(agent.as_str())
                    && lesson.generation == state.generation
                    && lesson.status == Status::Ready
                {
                    let observation = wire::observation(&state, Status::Failed);
                    self.record(&lesson, observation).await;
                }
            }
        }
    }

    async fn work(&self, shutdown: CancellationToken) {
        loop {
            let (id, cancel) = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = self.inner.queue.next() => next,
            };
            let span = tracing::info_span!("reconcile", live_lesson.id = %id);
            let origin = lock(&self.inner.origins).remove(&id);
            if let Some(origin) = &origin {
                let _ = span.set_parent(origin.clone());
            }
            let next = tokio::select! {
                // Work in flight is dropped at shutdown; the store still holds the desired state
                // and the next process resumes it.
                _ = shutdown.cancelled() => return,
                next = self.run(id, &cancel).instrument(span) => next,
            };
            if let (Some(origin), Ok(Next::After(_)) | Err(_)) = (origin, &next) {
                // A retry still belongs to the trace that asked, unless a newer request came.
                lock(&self.inner.origins).entry(id).or_insert(origin);
            }
            match next {
                Ok(Next::Done) => {}
                Ok(Next::After(delay)) => self.enqueue_after(id, delay, &shutdown),
                Err(err) => {
                    let delay = self.backoff(id, None);
                    tracing::error!(live_lesson.id = %id, error = %err, ?delay, "reconcile failed; retrying");
                    self.enqueue_after(id, delay, &shutdown);
                }
            }
            self.inner.queue.done(id);
        }
    }

    async fn run(&self, id: LiveLessonId, cancel: &Notify) -> Result<Next, Error> {
        let Some(lesson) = self.inner.store.find_live_lesson(id).await? else {
            self.inner.hub.gone(id);
            lock(&self.inner.attempts).remove(&id);
            return Ok(Next::Done);
        };
        if lesson.deleting {
            return self.terminate(lesson, cancel).await;
        }
        let recovering = lock(&self.inner.recover).remove(&id);
        if !lesson.needs_work() && !recovering {
            lock(&self.inner.attempts).remove(&id);
            return Ok(Next::Done);
        }
        self.provision(lesson, recovering, cancel).await
    }

    #[tracing::instrument(skip_all, fields(generation = lesson.generation, stage = lesson.stage, lesson = %lesson.lesson_slug))]
    async fn provision(
        &self,
        lesson: LiveLesson,
        recovering: bool,
        cancel: &Notify,
    ) -> Result<Next, Error> {
        let inner = &self.inner;
        let attempt = self.attempt(&lesson);
        let deadline = attempt.started + inner.config.provision_timeout;
        let Some(definition) = inner.catalog.lesson(&lesson.lesson_slug) else {
            return self
                .fail(
                    &lesson,
                    format!(
                        "lesson `{}` is no longer in the curriculum",
                        lesson.lesson_slug
                    ),
                )
                .await;
        };

        // Placement.
        let agent = match &lesson.agent {
            Some(name) => {
                match inner.fleet.get(name) {
                    Some(agent) => agent.clone(),
                    None => {
                        return self
                        .fail(&lesson, format!("agent `{name}` holding this live lesson is no longer configured"))
                        .await;
                    }
                }
            }
            None => match placement::choose(inner.fleet.agents(), &placement::needs(definition)) {
                Ok(agent) => agent,
                Err(why) => {
                    let reason =
                        format!("no agent can take lesson `{}`: {why}", lesson.lesson_slug);
                    if Instant::now() >= deadline {
                        return self.fail(&lesson, reason).await;
                    }
                    self.note(&lesson, Status::Pending, reason).await;
                    return Ok(Next::After(self.backoff(lesson.id, Some(&lesson))));
                }
            },
        };
        if !agent.is_ready() {
            let status = agent.status();
            let reason = format!(
                "agent `{}` is unavailable: {}",
                agent.name, status.last_error
            );
            if Instant::now() >= deadline {
                return self.fail(&lesson, reason).await;
            }
            self.note(&lesson, lesson.status, reason).await;
            return Ok(Next::After(self.backoff(lesson.id, Some(&lesson))));
        }

        let mut current = lesson.clone();
        if current.status == Status::Pending || current.agent.is_none() {
            // Placement and BOOTING are one write: the live lesson is on this agent from now on.
            let observation = Observation {
                agent: Some(agent.name.clone()),
                ..Observation::status(Status::Booting, format!("placed on agent `{}`", agent.name))
            };
            let status = if current.status == Status::Pending {
                Status::Booting
            } else {
                current.status
            };
            let observation = Observation {
                status,
                ..observation
            };
            match self.record(&current, observation).await {
                Some(updated) => {
                    if current.agent.is_none() {
                        agent
                            .load
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    current = updated;
                }
                None => return Ok(Next::Done),
            }
        }

        let spec = wire::lesson_spec(&inner.instance_id, &current, definition, &inner.catalog);
        let key = current.id.to_string();
        let mut observed = agent.observe(&key);
        let _unobserve = Unobserve(&agent, &key);

        let first = if recovering && !current.handle.is_empty() && agent.has("recover") {
            match agent
                .recover(&key, current.handle.clone(), spec.clone())
                .await
            {
                Err(Error::Agent { status, .. }) if status.code() == tonic::Code::NotFound => {
                    tracing::info!("agent lost the live lesson; provisioning it again");
                    agent.provision(spec).await
                }
                other => other,
            }
        } else {
            agent.provision(spec).await
        };
        let mut state = match first {
            Ok(state) => state,
            Err(err) => return self.agent_error(&current, err, deadline).await,
        };
        let mut last_poll = Instant::now();
        loop {
            if state.generation == current.generation
                && let Some(status) = wire::phase_status(state.phase)
            {
                if status != current.status || status.is_settled() {
                    match self
                        .record(&current, wire::observation(&state, status))
                        .await
                    {
                        Some(updated) => current = updated,
                        None => return Ok(Next::Done),
                    }
                }
                if status.is_settled() {
                    self.settled(&current, status == Status::Ready);
                    return Ok(Next::Done);
                }
            }
            let poll_at = last_poll + inner.config.poll_interval;
            tokio::select! {
                biased;
                _ = cancel.notified() => return Ok(Next::Done),
                _ = tokio::time::sleep_until(deadline) => {
                    let reason = format!(
                        "not READY within {} (last status {}: {})",
                        humantime::format_duration(inner.config.provision_timeout),
                        current.status,
                        state.reason
                    );
                    return self.fail(&current, reason).await;
                }
                changed = observed.changed() => {
                    if changed.is_err() {
                        continue;
                    }
                    match observed.borrow_and_update().clone() {
                        Observed::State(next) => state = next,
                        Observed::Deleted => {
                            tracing::warn!("agent reports the live lesson deleted while provisioning; provisioning again");
                            return Ok(Next::After(Duration::ZERO));
                        }
                        Observed::Nothing => {}
                    }
                }
                _ = tokio::time::sleep_until(poll_at) => {
                    last_poll = Instant::now();
                    match agent.get(&key).await {
                        Ok(next) => state = next,
                        Err(Error::Agent { status, .. }) if status.code() == tonic::Code::NotFound => {
                            tracing::warn!("agent does not know the live lesson; provisioning again");
                            return Ok(Next::After(Duration::ZERO));
                        }
                        Err(err) => tracing::warn!(error = %err, "Get failed; waiting on"),
                    }
                }
            }
        }
    }

    #[tracing::instrument(skip_all)]
    async fn terminate(&self, lesson: LiveLesson, cancel: &Notify) -> Result<Next, Error> {
        let inner = &self.inner;
        let attempt = self.attempt(&lesson);
        let deadline = attempt.started + inner.config.terminate_timeout;
        let agent = lesson
            .agent
            .as_deref()
            .and_then(|name| inner.fleet.get(name))
            .cloned();
        if let Some(agent) = &agent {
            let key = lesson.id.to_string();
            let mut observed = agent.observe(&key);
            let _unobserve = Unobserve(agent, &key);
            match agent.deprovision(&key, lesson.handle.clone()).await {
                Ok(true) => {}
                Ok(false) => {
                    // Wait for the objects to go: Watch says Deleted, or Get says NOT_FOUND.
                    loop {
                        let poll_at = Instant::now() + inner.config.poll_interval;
                        tokio::select! {
                            biased;
                            _ = tokio::time::sleep_until(deadline) => {
                                tracing::warn!("removal still unfinished; leaving the rest to the orphan reaper");
                                break;
                            }
                            changed = observed.changed() => {
                                if changed.is_ok() && matches!(*observed.borrow_and_update(), Observed::Deleted) {
                                    break;
                                }
                            }
                            _ = tokio::time::sleep_until(poll_at) => match agent.get(&key).await {
                                Err(Error::Agent { status, .. }) if status.code() == tonic::Code::NotFound => break,
                                _ => {}
                            },
                        }
                    }
                }
                Err(err) => {
                    let retryable =
                        matches!(&err, Error::Agent { status, .. } if is_retryable(status.code()));
                    if retryable && Instant::now() < deadline {
                        tracing::warn!(error = %err, "Deprovision failed; retrying");
                        return Ok(Next::After(self.backoff(lesson.id, Some(&lesson))));
                    }
                    tracing::error!(error = %err, "Deprovision failed; forgetting the live lesson, the orphan reaper will retry");
                }
            }
        }
        let _ = cancel;
        inner.store.forget(lesson.id).await?;
        if let Some(agent) = &agent {
            fleet::release(agent);
        }
        lock(&inner.attempts).remove(&lesson.id);
        inner.hub.gone(lesson.id);
        Ok(Next::Done)
    }

    /// Handles a failed Provision/Recover call: back off on retryable codes until the deadline,
    /// FAILED otherwise.
    async fn agent_error(
        &self,
        lesson: &LiveLesson,
        err: Error,
        deadline: Instant,
    ) -> Result<Next, Error> {
        let retryable = matches!(&err, Error::Agent { status, .. } if is_retryable(status.code()));
        if retryable && Instant::now() < deadline {
            tracing::warn!(error = %err, "agent call failed; retrying");
            self.note(lesson, lesson.status, err.to_string()).await;
            return Ok(Next::After(self.backoff(lesson.id, Some(lesson))));
        }
        let reason = match err {
            Error::Agent {
                agent,
                call,
                status,
            } => {
                format!(
                    "agent `{agent}` {call}: {} ({:?})",
                    status.message(),
                    status.code()
                )
            }
            other => other.to_string(),
        };
        self.fail(lesson, reason).await
    }

    async fn fail(&self, lesson: &LiveLesson, reason: String) -> Result<Next, Error> {
        tracing::warn!(%reason, "live lesson failed");
        self.record(lesson, Observation::status(Status::Failed, reason))
            .await;
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
        self.record(lesson, Observation::status(status, reason))
            .await;
    }

    /// Writes an observation for the live lesson's generation and publishes the new state.
    /// `None` when the desired state moved on (the queue runs the live lesson again).
    async fn record(&self, lesson: &LiveLesson, observation: Observation) -> Option<LiveLesson> {
        match self
            .inner
            .store
            .observe(lesson.id, lesson.generation, observation, Millis::now())
            .await
        {
            Ok(Some(updated)) => {
                self.inner.hub.publish(&updated);
                Some(updated)
            }
            Ok(None) => None,
            Err(err) => {
                tracing::error!(error = %err, "cannot record observation");
                None
            }
        }
    }

    /// The attempt record for the live lesson's current generation.
    fn attempt(&self, lesson: &LiveLesson) -> Attempt {
        let mut attempts = lock(&self.inner.attempts);
        let entry = attempts.entry(lesson.id).or_insert(Attempt {
            generation: lesson.generation,
            started: Instant::now(),
            failures: 0,
        });
        if entry.generation != lesson.generation {
            *entry = Attempt {
                generation: lesson.generation,
                started: Instant::now(),
                failures: 0,
            };
        }
        *entry
    }

    /// The next retry delay: exponential from `backoff_initial` to `backoff_max`, with jitter.
    fn backoff(&self, id: LiveLessonId, lesson: Option<&LiveLesson>) -> Duration {
        let config = &self.inner.config;
        let mut attempts = lock(&self.inner.attempts);
        let failures = match attempts.get_mut(&id) {
            Some(attempt) => {
                attempt.failures += 1;
                attempt.failures
            }
            None => {
                if let Some(lesson) = lesson {
                    attempts.insert(
                        id,
                        Attempt {
                            generation: lesson.generation,
                            started: Instant::now(),
                            failures: 1,
                        },
                    );
                }
                1
            }
        };
        let exp = config
            .backoff_initial
            .saturating_mul(1u32 << failures.saturating_sub(1).min(16));
        let capped = exp.min(config.backoff_max);
        // Up to 20 % jitter spreads retries of many live lessons hitting one agent.
        let jitter = capped.mul_f64(f64::from(id.0.as_u128() as u32 % 1000) / 5000.0);
        capped + jitter
    }
}

/// Stops observing a live lesson on an agent when a run ends, however it ends.
struct Unobserve<'a>(&'a Agent, &'a str);

impl Drop for Unobserve<'_> {
    fn drop(&mut self) {
        self.0.unobserve(self.1);
    }
}

/// A de-duplicating work queue in the style of client-go's: an id is queued at most once, never
/// processed by two workers at once, and re-queued when it was added during processing.
#[derive(Default)]
struct WorkQueue {
    state: Mutex<QueueState>,
    /// Wakes an idle worker.
    available: Notify,
}

#[derive(Default)]
struct QueueState {
    queue: VecDeque<LiveLessonId>,
    queued: HashSet<LiveLessonId>,
    /// Ids being processed, with the signal that tells their worker to stop waiting.
    processing: HashMap<LiveLessonId, Arc<Notify>>,
    /// Ids added while being processed.
    dirty: HashSet<LiveLessonId>,
}

impl WorkQueue {
    fn add(&self, id: LiveLessonId) {
        let mut state = lock(&self.state);
        if let Some(cancel) = state.processing.get(&id) {
            cancel.notify_one();
            state.dirty.insert(id);
            return;
        }
        if state.queued.insert(id) {
            state.queue.push_back(id);
            drop(state);
            self.available.notify_one();
        }
    }

    async fn next(&self) -> (LiveLessonId, Arc<Notify>) {
        loop {
            {
                let mut state = lock(&self.state);
                if let Some(id) = state.queue.pop_front() {
                    state.queued.remove(&id);
                    let cancel = Arc::new(Notify::new());
                    state.processing.insert(id, cancel.clone());
                    if !state.queue.is_empty() {
                        // Pass the wake-up on: more work is waiting.
                        self.available.notify_one();
                    }
                    return (id, cancel);
                }
            }
            self.available.notified().await;
        }
    }

    fn done(&self, id: LiveLessonId) {
        let mut state = lock(&self.state);
        state.processing.remove(&id);
        if state.dirty.remove(&id) && state.queued.insert(id) {
            state.queue.push_back(id);
            drop(state);
            self.available.notify_one();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_deduplicates_and_requeues_dirty_ids() {
        let queue = WorkQueue::default();
        let a = LiveLessonId::new();
        let b = LiveLessonId::new();
        queue.add(a);
        queue.add(a);
        queue.add(b);
        let (first, cancel) = queue.next().await;
        assert_eq!(first, a);
        // Added while processing: the worker is told, and `a` comes back after `done`.
        queue.add(a);
        tokio::time::timeout(Duration::from_secs(1), cancel.notified())
            .await
            .expect("the worker is told to stop waiting");
        let (second, _) = queue.next().await;
        assert_eq!(second, b);
        queue.done(a);
        let (third, _) = queue.next().await;
        assert_eq!(third, a);
        queue.done(a);
        queue.done(b);
        assert!(lock(&queue.state).queue.is_empty());
    }
}
