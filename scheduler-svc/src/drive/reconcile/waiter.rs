//! Waiters: a live lesson waiting for its agent (READY or FAILED, or its objects gone) holds no
//! worker. A waiter task follows the agent's Watch reports and asks Get, and wakes the live
//! lesson (keeps what it saw, enqueues it) when there is news; the next run takes that news
//! ([`Reconciler::resume`]). What is news is decided by [`lifecycle::Waited`].

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::{Reconciler, lock};
use crate::agents::{AgentReport, Observer};
use crate::drive::lifecycle::{self, Found, Until, Waited, Wake};
use crate::model::{LiveLesson, LiveLessonId};

/// A live lesson a waiter task follows until it settles or is gone.
pub(super) struct Waiting {
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
pub(super) struct Woken {
    /// The live lesson's view of the agent's Watch stream, followed since before the call.
    pub observer: Observer,
    /// The agent's latest report.
    pub report: AgentReport,
    /// Why it woke.
    pub why: Wake,
}

/// What a run finds of a wait for its generation.
pub(super) enum Resume {
    /// None: call the agent.
    Fresh,
    /// A waiter still waits: nothing to do.
    Waiting,
    /// A waiter woke it with news.
    Woken(Woken),
}

impl Reconciler {
    /// Hands the wait for `current`'s generation to a waiter task, which holds no worker: it
    /// follows the agent's Watch reports through `observer` (made before the agent was called,
    /// so nothing is missed), asks Get from every `poll_interval` (Watch is a speed-up, Get the
    /// truth; over a Watch stream the interval doubles up to 16 times), and wakes the live
    /// lesson (keeps what it saw and enqueues it) when the agent does not hold it any more
    /// (Watch says deleted, Get NOT_FOUND), at the deadline, and, `until` it settles, on a
    /// report of the generation with another status than the recorded one. It stops, waking
    /// nothing, when [`Reconciler::stop_waiting`] or shutdown stops it.
    pub(super) fn wait_for(
        &self,
        current: &LiveLesson,
        until: Until,
        report: AgentReport,
        observer: Observer,
        deadline: Instant,
    ) {
        let (id, generation) = (current.id, current.generation);
        let waited = Waited {
            until,
            generation,
            recorded: current.status,
        };
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
        let this = self.clone();
        let span = tracing::debug_span!("wait", live_lesson.id = %id, generation);
        let waiter = async move {
            let (mut observer, mut report) = (observer, report);
            let Some(why) = this
                .follow(id, waited, &mut observer, &mut report, deadline, &stop)
                .await
            else {
                return;
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

    /// Follows the agent until there is news for `waited` (keeping the latest report in
    /// `report`) or the deadline; `None` when stopped.
    async fn follow(
        &self,
        id: LiveLessonId,
        waited: Waited,
        observer: &mut Observer,
        report: &mut AgentReport,
        deadline: Instant,
        stop: &CancellationToken,
    ) -> Option<Wake> {
        let agent = observer.agent().clone();
        let poll_interval = self.inner.config.poll_interval;
        let backs_off = agent.has(super::capabilities::WATCH);
        let mut poll_every = poll_interval;
        let mut poll_at = Instant::now() + lifecycle::first_poll(poll_interval, id);
        // False once the agent's observations ended (they do not while it exists): Get alone
        // then.
        let mut observing = true;
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep_until(deadline) => return Some(Wake::Deadline),
                observed = observer.changed(), if observing => match observed {
                    Some(observed) => {
                        if let Some(why) = waited.watched(observed, report) {
                            return Some(why);
                        }
                    }
                    None => observing = false,
                },
                _ = tokio::time::sleep_until(poll_at) => {
                    poll_every = lifecycle::next_poll(poll_every, poll_interval, backs_off);
                    poll_at = Instant::now() + poll_every;
                    let got = tokio::select! {
                        _ = stop.cancelled() => return None,
                        got = agent.get(id) => got,
                    };
                    if let Some(why) = waited.got(got, report) {
                        return Some(why);
                    }
                }
            }
        }
    }

    /// What became of a wait of `lesson`'s generation `until` something: a waiter still waits
    /// (nothing to do), it woke the live lesson with news, or there is none to resume (another
    /// generation, another agent, a wait for something else): any waiter left is stopped
    /// ([`lifecycle::found`]).
    pub(super) fn resume(&self, lesson: &LiveLesson, until: Until) -> Resume {
        let mut waiting = lock(&self.inner.waiting);
        if let Some(entry) = waiting.get(&lesson.id) {
            let woken_on = entry
                .woken
                .as_ref()
                .map(|woken| woken.observer.agent().name.as_str());
            match lifecycle::found(lesson, until, entry.generation, entry.until, woken_on) {
                Found::Waiting => return Resume::Waiting,
                Found::News => {
                    if let Some(woken) = waiting.remove(&lesson.id).and_then(|entry| entry.woken) {
                        return Resume::Woken(woken);
                    }
                }
                Found::Stale => {}
            }
        }
        if let Some(entry) = waiting.remove(&lesson.id) {
            entry.stop.cancel();
        }
        Resume::Fresh
    }

    /// Stops the waiter of a live lesson, if it has one.
    pub(super) fn stop_waiting(&self, id: LiveLessonId) {
        if let Some(entry) = lock(&self.inner.waiting).remove(&id) {
            entry.stop.cancel();
        }
    }
}
