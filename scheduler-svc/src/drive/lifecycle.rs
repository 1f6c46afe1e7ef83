//! The reconciler's lifecycle decisions, apart from the runtime that carries them out
//! ([`super::reconcile`]): given a live lesson as the store holds it, what its agent answered,
//! what the clock says of its deadline and the agents' snapshot, what to do next. Nothing here
//! waits, calls an agent, reads or writes the store or looks at the clock: the runtime gathers
//! those facts, asks, and does what the answer says. Every transition is table-tested
//! (`lifecycle/tests.rs`).
//!
//! In the order a live lesson meets them:
//! - [`route`]: what a run does with the live lesson it read (remove, check, provision, nothing);
//! - [`on_recorded`] and [`choose`]: where it runs (its recorded agent, or placement's choice
//!   among the agents' snapshot), or why it cannot run yet ([`Unplaced::Yet`],
//!   [`Unplaced::Busy`]) or ever ([`Unplaced::Never`]);
//! - [`is_new`] and [`claim`]: the first Provision's flag and the write that places it (BOOTING);
//! - [`call`] and [`after_recover_error`]: Provision, or Recover after the agent restarted;
//! - [`after_call_error`] and [`unplaced`]: retry with backoff ([`backoff`]) or FAILED with a
//!   reason ([`failure_reason`]) once the deadline passed or no retry can help;
//! - [`settle`] and [`overdue`]: what the agent reported, recorded; READY or FAILED settles it,
//!   the deadline fails it, anything else is waited for;
//! - [`Waited`] (the waiter's judgement of what Watch and Get say), [`first_poll`], [`next_poll`]
//!   and [`found`] (what a run finds of a wait);
//! - [`remover`] and [`after_deprovision`]: removal;
//! - [`held`] and [`after_get`]: a READY live lesson its agent's Watch suggests is broken;
//! - [`lost_reason`] and [`after_move`]: the live lessons of a lost agent.

use std::collections::HashSet;
use std::time::Duration;

use antidote_net::errors;

use super::placement::{self, Availability, Candidate, Needs};
use crate::agents::{self, AgentReport, Observed};
use crate::error::Error;
use crate::model::{Decision, LiveLesson, LiveLessonId, PlacementRecord, Status};
use crate::settings::ReconcilerConfig;
use crate::store::Observation;

/// What a waiter waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Until {
    /// The generation READY or FAILED (provisioning).
    Settled,
    /// The objects gone (removal).
    Gone,
}

/// Why a waiter woke its live lesson.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    /// A report for the generation with another status than the one recorded, or settled
    /// (only while provisioning).
    Report,
    /// The agent does not hold the live lesson any more (Watch says deleted, Get NOT_FOUND).
    Lost,
    /// The deadline passed.
    Deadline,
}

/// Why a live lesson is suspected of being broken or gone on its agent.
#[derive(Debug)]
pub(super) struct Suspicion {
    /// The agent whose Watch said so (the live lesson may have moved since).
    pub agent: String,
    /// The FAILED state it sent, if that is what it said.
    pub report: Option<AgentReport>,
}

/// What a run does with the live lesson it read from the store.
#[derive(Debug)]
pub(super) enum Route {
    /// Removal was asked for: remove its objects, then forget it.
    Remove,
    /// A READY live lesson its agent's Watch suggests is broken or gone: ask the agent.
    Check(Suspicion),
    /// Take its generation to READY or FAILED; `recovering`: its agent restarted (Recover).
    Provision { recovering: bool },
    /// Nothing to do: settled at its generation.
    Idle,
}

/// What a run does with `lesson`: `recovering` when its agent restarted since, `suspicion`
/// when that agent's Watch suggested it broke. A suspicion counts only for a READY live lesson
/// settled at its generation on the agent that raised it; a recovery provisions even a settled
/// one.
pub(super) fn route(lesson: &LiveLesson, recovering: bool, suspicion: Option<Suspicion>) -> Route {
    if lesson.deleting {
        return Route::Remove;
    }
    if let Some(suspicion) = suspicion
        && !recovering
        && !lesson.needs_work()
        && lesson.status == Status::Ready
        && lesson.agent.as_deref() == Some(suspicion.agent.as_str())
    {
        return Route::Check(suspicion);
    }
    if !lesson.needs_work() && !recovering {
        return Route::Idle;
    }
    Route::Provision { recovering }
}

/// Why a live lesson has no agent to run on.
#[derive(Debug)]
pub(super) enum Unplaced {
    /// Not now (its agent is away, the store could not be read): wait and try again.
    Yet(String),
    /// Not now: no agent can take it at the moment (full, down, drained or lost). A warm-pool
    /// member on a full agent fitting `needs` may give way; then wait and try again.
    Busy {
        /// Why, naming every agent.
        reason: String,
        /// What the lesson needs, for the pool member to give way.
        needs: Needs,
    },
    /// Never: its agent was removed from the configuration, or no agent could ever take it.
    Never(String),
}

/// What the scheduler sees of a configured agent a live lesson is recorded on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Presence {
    /// Ready for calls.
    Ready,
    /// Not ready for longer than `agent_grace`: the next look at lost agents moves its live
    /// lessons.
    Lost,
    /// Not ready now, with the last error seen.
    Unavailable(String),
}

/// A live lesson placed on agent `name` runs there: `agent` is that agent with what the
/// scheduler sees of it, `None` when it is no longer configured (never to come back).
pub(super) fn on_recorded<A>(name: &str, agent: Option<(A, Presence)>) -> Result<A, Unplaced> {
    match agent {
        None => Err(Unplaced::Never(format!(
            "agent `{name}` holding this live lesson is no longer configured"
        ))),
        Some((_, Presence::Lost)) => Err(Unplaced::Yet(format!(
            "agent `{name}` is lost; moving to another agent"
        ))),
        Some((_, Presence::Unavailable(last_error))) => Err(Unplaced::Yet(format!(
            "agent `{name}` is unavailable: {last_error}"
        ))),
        Some((agent, Presence::Ready)) => Ok(agent),
    }
}

/// Placement for a live lesson without an agent, by what its lesson and request need
/// (`needs`, an error when they contradict each other) among `candidates`. What no agent
/// could ever take is `Never`; the lost agent it was moved from does not count as one that
/// could take it back while it stays lost. What only full, down, drained or lost agents could
/// take is `Busy`. A live lesson moved off a lost agent says so in every reason.
pub(super) fn choose(
    lesson: &LiveLesson,
    record: &PlacementRecord,
    needs: Result<Needs, String>,
    candidates: &[Candidate],
) -> Result<Decision, Unplaced> {
    let moved = |reason: String| match &record.moved_from {
        Some(from) => format!("agent `{from}` lost; {reason}"),
        None => reason,
    };
    let needs = needs.map_err(|why| Unplaced::Never(moved(why)))?;
    let others: Vec<_> = candidates
        .iter()
        .filter(|c| {
            record.moved_from.as_deref() != Some(c.name.as_str())
                || c.availability != Availability::Lost
        })
        .cloned()
        .collect();
    placement::possible(&others, &needs).map_err(|why| {
        Unplaced::Never(moved(format!(
            "no agent could ever take lesson `{}`: {why}",
            lesson.lesson_slug
        )))
    })?;
    placement::choose(candidates, &needs).map_err(|excluded| Unplaced::Busy {
        reason: moved(format!(
            "no agent can take lesson `{}` now: {}",
            lesson.lesson_slug,
            placement::explain(&excluded)
        )),
        needs,
    })
}

/// Whether the first Provision says the live lesson is new (PROTOCOL.md [P9]): placed just now
/// (`chosen_now`) for the first time, so no agent was ever asked for it. One with a recorded
/// agent (a retry, a restart of ours), moved off a lost agent, or recovering is not new.
pub(super) fn is_new(
    lesson: &LiveLesson,
    chosen_now: bool,
    moved_from: Option<&str>,
    recovering: bool,
) -> bool {
    lesson.agent.is_none() && chosen_now && moved_from.is_none() && !recovering
}

/// The write that places a live lesson on `agent`.
#[derive(Debug)]
pub(super) struct Claim {
    /// Placement, BOOTING (from PENDING) and the decision, in one write.
    pub observation: Observation,
    /// Whether the agent's load counts it now (it was on no agent before).
    pub counts_load: bool,
}

/// Records the placement on `agent` with BOOTING and placement's `decision` (why this agent),
/// unless the live lesson is placed already and past PENDING: then nothing is written.
pub(super) fn claim(
    lesson: &LiveLesson,
    agent: &str,
    decision: Option<&Decision>,
    moved_from: Option<&str>,
) -> Option<Claim> {
    if lesson.status != Status::Pending && lesson.agent.is_some() {
        return None;
    }
    let status = if lesson.status == Status::Pending {
        Status::Booting
    } else {
        lesson.status
    };
    let reason = match moved_from {
        Some(from) => format!("agent `{from}` lost; moved to `{agent}`"),
        None => format!("placed on agent `{agent}`"),
    };
    Some(Claim {
        observation: Observation {
            agent: Some(agent.to_owned()),
            decision: decision.cloned(),
            ..Observation::status(status, reason)
        },
        counts_load: lesson.agent.is_none(),
    })
}

/// Which call realises the live lesson on its agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    /// Provision (idempotent on id + generation); `new`: no agent was asked before.
    Provision { new: bool },
    /// Recover by the handle, after the agent restarted.
    Recover,
}

/// Recover when the agent restarted (`recovering`), the live lesson has a handle and the agent
/// offers `recover`; Provision otherwise.
pub(super) fn call(lesson: &LiveLesson, recovering: bool, offers_recover: bool, new: bool) -> Call {
    if recovering && !lesson.handle.is_empty() && offers_recover {
        Call::Recover
    } else {
        Call::Provision { new }
    }
}

/// After a failed Recover: Provision again (not new) when the agent lost the live lesson;
/// `None`: the error stands.
pub(super) fn after_recover_error(err: &Error) -> Option<Call> {
    agents::lost_it(err).then_some(Call::Provision { new: false })
}

/// A step back: no agent can take the live lesson yet, or a call to it failed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Setback {
    /// FAILED with this reason: the generation is settled.
    Fail(String),
    /// A progress note (unless the same one is recorded), then a retry after backoff.
    Retry { status: Status, reason: String },
}

/// A failed Provision or Recover: retried while its code is retryable and the deadline has not
/// passed, FAILED with the agent's reason otherwise.
pub(super) fn after_call_error(lesson: &LiveLesson, err: &Error, past_deadline: bool) -> Setback {
    if agents::retryable(err) && !past_deadline {
        return Setback::Retry {
            status: lesson.status,
            reason: err.to_string(),
        };
    }
    Setback::Fail(failure_reason(err))
}

/// What a learner reads of a failed agent call: the agent, the call, its message, code and the
/// agent's reason when it gave one.
pub(super) fn failure_reason(err: &Error) -> String {
    match err {
        Error::Agent {
            agent,
            call,
            status,
        } => match errors::reason(status) {
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
    }
}

/// No agent yet (`reason`): FAILED once the deadline passed, else a note and a retry. An
/// unplaced live lesson stays PENDING; a placed one keeps its status while its agent is away.
pub(super) fn unplaced(lesson: &LiveLesson, reason: String, past_deadline: bool) -> Setback {
    if past_deadline {
        return Setback::Fail(reason);
    }
    let status = if lesson.agent.is_none() {
        Status::Pending
    } else {
        lesson.status
    };
    Setback::Retry { status, reason }
}

/// A progress note to record, `None` when the live lesson says just that already.
pub(super) fn note(lesson: &LiveLesson, status: Status, reason: String) -> Option<Observation> {
    (lesson.reason != reason || lesson.status != status)
        .then(|| Observation::status(status, reason))
}

/// What to record of an agent's report for the live lesson's generation.
#[derive(Debug)]
pub(super) struct Settle {
    /// The report's status and details, when it changes the status or settles it.
    pub record: Option<Observation>,
    /// `Some(ready)` when the generation settled READY (`true`) or FAILED (`false`).
    pub settled: Option<bool>,
}

/// What `report` means for `current`: a report of another generation, or of no status
/// (being removed), records nothing; one with a new status, or a settled one, is recorded;
/// READY or FAILED settles the generation.
pub(super) fn settle(current: &LiveLesson, report: &AgentReport) -> Settle {
    let Some(status) = report
        .status
        .filter(|_| report.generation == current.generation)
    else {
        return Settle {
            record: None,
            settled: None,
        };
    };
    Settle {
        record: (status != current.status || status.is_settled())
            .then(|| observation(report, status)),
        settled: status.is_settled().then_some(status == Status::Ready),
    }
}

/// After an unsettling report was recorded (`current` as it is now): the reason to record it
/// FAILED with when the deadline passed, `None` to wait on.
pub(super) fn overdue(
    current: &LiveLesson,
    report: &AgentReport,
    past_deadline: bool,
    timeout: Duration,
) -> Option<String> {
    past_deadline.then(|| {
        format!(
            "not READY within {} (last status {}: {})",
            humantime::format_duration(timeout),
            current.status,
            report.reason
        )
    })
}

/// What to record for an agent's report, entering `status`.
pub(super) fn observation(report: &AgentReport, status: Status) -> Observation {
    Observation {
        status,
        reason: report.reason.clone(),
        endpoints: Some(report.endpoints.clone()),
        handle: (!report.handle.is_empty()).then(|| report.handle.clone()),
        agent: None,
        decision: None,
    }
}

/// A waiter's judgement of what it hears of one generation of a live lesson.
#[derive(Debug, Clone, Copy)]
pub(super) struct Waited {
    /// What it waits for.
    pub until: Until,
    /// The generation.
    pub generation: u64,
    /// The status recorded when the wait began.
    pub recorded: Status,
}

impl Waited {
    /// Whether a report is news for the run: while provisioning, the generation's status
    /// changed or settled.
    pub fn news(&self, report: &AgentReport) -> bool {
        self.until == Until::Settled
            && report.generation == self.generation
            && report
                .status
                .is_some_and(|status| status != self.recorded || status.is_settled())
    }

    /// What the agent's Watch said (`Some`; `None` when its observations ended, which the
    /// runtime handles): the latest report is kept in `latest`; wake on news or a deletion.
    pub fn watched(&self, observed: Observed, latest: &mut AgentReport) -> Option<Wake> {
        match observed {
            Observed::Report(report) => self.heard(report, latest),
            Observed::Deleted => Some(Wake::Lost),
            Observed::Nothing => None,
        }
    }

    /// What Get answered: a report as from Watch, NOT_FOUND wakes (the agent lost it), any
    /// other error waits on (Get is asked again at the next poll).
    pub fn got(&self, got: Result<AgentReport, Error>, latest: &mut AgentReport) -> Option<Wake> {
        match got {
            Ok(report) => self.heard(report, latest),
            Err(err) if agents::lost_it(&err) => Some(Wake::Lost),
            Err(err) => {
                tracing::warn!(error = %err, "Get failed; waiting on");
                None
            }
        }
    }

    fn heard(&self, report: AgentReport, latest: &mut AgentReport) -> Option<Wake> {
        *latest = report;
        self.news(latest).then_some(Wake::Report)
    }
}

/// When a waiter first asks Get: after `interval`, spread by up to a fifth of it (from the id)
/// like retries.
pub(super) fn first_poll(interval: Duration, id: LiveLessonId) -> Duration {
    interval + interval.mul_f64(spread(id))
}

/// The interval after a poll every `every`: over a Watch stream (`backs_off`; it reports every
/// change, and its snapshot after a reconnect repeats every state) it doubles up to 16 times
/// `interval`, so thousands of waiting live lessons do not flood their agent; without Watch it
/// stays.
pub(super) fn next_poll(every: Duration, interval: Duration, backs_off: bool) -> Duration {
    if backs_off {
        (every * 2).min(interval * 16)
    } else {
        every
    }
}

/// What a run finds of a wait for its live lesson.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// A waiter still waits for this very thing: nothing to do.
    Waiting,
    /// Its waiter woke it with news to take.
    News,
    /// None to resume (another generation, another agent, a wait for something else): any
    /// waiter left is stopped and the agent called afresh.
    Stale,
}

/// What a run of `lesson` waiting `until` something finds of the wait recorded for it: for
/// `generation`, waiting `for_what`, woken with news from agent `woken_on` (`None` while it
/// still waits).
pub(super) fn found(
    lesson: &LiveLesson,
    until: Until,
    generation: u64,
    for_what: Until,
    woken_on: Option<&str>,
) -> Found {
    if generation != lesson.generation || for_what != until {
        return Found::Stale;
    }
    match woken_on {
        None => Found::Waiting,
        Some(agent) if lesson.agent.as_deref() == Some(agent) => Found::News,
        Some(_) => Found::Stale,
    }
}

/// The agent to ask for a removal: the live lesson's, unless it has none (removed before
/// placement), is not configured, or is lost (not waited for: what it still holds is an orphan
/// the reaper removes if it comes back).
pub(super) fn remover<A>(agent: Option<A>, lost: bool) -> Option<A> {
    agent.filter(|_| !lost)
}

/// What follows a Deprovision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Removal {
    /// Forget the live lesson: its objects are gone, or the orphan reaper retries.
    Forget,
    /// The objects go in the background: a waiter waits for Watch to say deleted or Get
    /// NOT_FOUND (or the deadline), holding no worker.
    WaitGone,
    /// A retryable failure before the deadline: retry after backoff.
    Retry,
}

/// What follows a Deprovision that answered `result` (whether everything is gone).
pub(super) fn after_deprovision(result: &Result<bool, Error>, past_deadline: bool) -> Removal {
    match result {
        Ok(true) => Removal::Forget,
        Ok(false) => Removal::WaitGone,
        Err(err) if agents::retryable(err) && !past_deadline => Removal::Retry,
        Err(_) => Removal::Forget,
    }
}

/// A suspected READY live lesson whose agent sent `report`: its FAILED report of this
/// generation is recorded at once; `None`: ask the agent (Get).
pub(super) fn held(lesson: &LiveLesson, report: Option<AgentReport>) -> Option<Observation> {
    report.filter(|r| failed(lesson, r)).map(|r| broken(&r))
}

/// What a Get tells of a suspected live lesson.
#[derive(Debug)]
pub(super) enum Held {
    /// FAILED on the agent, or NOT_FOUND there: record this.
    Broken(Observation),
    /// Anything else: it is fine, leave it be.
    Fine,
    /// The agent cannot answer: ask again after `backoff_max`.
    AskAgain(Error),
}

/// What agent `agent`'s answer to Get means for a suspected `lesson`.
pub(super) fn after_get(lesson: &LiveLesson, agent: &str, got: Result<AgentReport, Error>) -> Held {
    match got {
        Ok(report) if failed(lesson, &report) => Held::Broken(broken(&report)),
        Ok(_) => Held::Fine,
        Err(err) if agents::lost_it(&err) => Held::Broken(broken(&AgentReport {
            id: lesson.id,
            generation: lesson.generation,
            status: Some(Status::Failed),
            reason: format!(
                "agent `{agent}` no longer holds this live lesson: it was removed without the scheduler asking; ask again for a new one"
            ),
            endpoints: lesson.endpoints.clone(),
            handle: Vec::new(),
        })),
        Err(err) => Held::AskAgain(err),
    }
}

fn failed(lesson: &LiveLesson, report: &AgentReport) -> bool {
    report.generation == lesson.generation && report.status == Some(Status::Failed)
}

/// FAILED with the report's reason; whatever the agent last measured, no endpoint answers now.
fn broken(report: &AgentReport) -> Observation {
    let mut observation = observation(report, Status::Failed);
    if let Some(endpoints) = &mut observation.endpoints {
        for endpoint in endpoints {
            endpoint.healthy = 0;
        }
    }
    observation
}

/// The live lessons placed on an agent (`placed`, per the store) missing from a complete
/// snapshot of what it holds (`held`): each is suspected of being gone.
pub(super) fn missing(
    placed: Vec<LiveLessonId>,
    held: &HashSet<LiveLessonId>,
) -> impl Iterator<Item = LiveLessonId> {
    placed.into_iter().filter(|id| !held.contains(id))
}

/// Whether a suspicion is worth a check of its own: not while a waiter, a retry or a recovery
/// works on the live lesson, which finds out by itself.
pub(super) fn worth_checking(waiting: bool, retrying: bool, recovering: bool) -> bool {
    !(waiting || retrying || recovering)
}

/// Why the live lessons of agent `name`, not ready for `grace`, move elsewhere (with its last
/// error, when there is one).
pub(super) fn lost_reason(name: &str, grace: Duration, last_error: &str) -> String {
    format!(
        "agent `{name}` lost (not ready for {}{}); moving to another agent",
        humantime::format_duration(grace),
        if last_error.is_empty() {
            String::new()
        } else {
            format!(": {last_error}")
        }
    )
}

/// Whether a live lesson moved off a lost agent needs work (a new generation, PENDING and
/// unplaced): a FAILED one was only unplaced, its watchers are told and a retry goes elsewhere.
pub(super) fn after_move(moved: &LiveLesson) -> bool {
    moved.status != Status::Failed
}

/// Whether the resync enqueues an unsettled live lesson: nobody works on it here (queued,
/// being processed, waiting for a retry or for its agent) and this replica holds no lease on it.
pub(super) fn unattended(queued: bool, retrying: bool, waiting: bool, leased_here: bool) -> bool {
    !(queued || retrying || waiting || leased_here)
}

/// Whether a change of a live lesson to `generation` heard from the store is work this replica
/// need not take up: it holds the lease and works on that generation (`working_on`, the
/// generation of its attempt), or another replica holds the lease (and hears the same change).
pub(super) fn taken_up(
    holds: bool,
    working_on: Option<u64>,
    generation: u64,
    held_elsewhere: bool,
) -> bool {
    (holds && working_on == Some(generation)) || held_elsewhere
}

/// The delay before retry number `failures`: exponential from `backoff_initial`, capped at
/// `backoff_max`, plus up to 20 % jitter derived from the id, which spreads retries of many
/// live lessons hitting one agent.
pub(super) fn backoff(config: &ReconcilerConfig, id: LiveLessonId, failures: u32) -> Duration {
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

#[cfg(test)]
mod tests;
