//! Stage checks: `CheckStage` (the learner's "Check" button), `TestStage` (operators, and
//! `antidotectl admin test-lesson`) and the gate on stage changes (`checks: gate`).
//!
//! A check calls the live lesson's agent (`RunChecks` of antidote.agent.v1) from the request
//! handler, as Plan does: it changes no desired or observed state of the live lesson, so the
//! reconciler has nothing to do. What it records is its own (`store::checks`): the stages that
//! passed and the latest run, which the live lesson's answers and Watch streams show.
//!
//! Runs are bounded per live lesson: one at a time (in this process; the agent refuses a second
//! concurrent one too, PROTOCOL.md [X4]) and, for learners, `limits.checks_per_minute` in any
//! sliding minute.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use antidote_proto::capabilities;

use crate::agents::{CheckFile, Fleet};
use crate::catalog::{Catalog, Lesson, Script, Stage};
use crate::drive::Hub;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::model::{CheckRun, EndpointCheck, LiveLesson, LiveLessonId, Millis, Status};
use crate::store::Store;

/// Which files of a stage run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Files {
    /// `stage<N>/checks/`: the result is the stage's check.
    Checks,
    /// `stage<N>/solutions/`: what a learner would do.
    Solutions,
}

impl Files {
    /// The directory's name, as messages and metadata say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Files::Checks => "checks",
            Files::Solutions => "solutions",
        }
    }

    /// The stage's files of this kind, by endpoint.
    fn of(self, stage: &Stage) -> &std::collections::BTreeMap<String, Script> {
        match self {
            Files::Checks => &stage.checks,
            Files::Solutions => &stage.solutions,
        }
    }
}

/// The runs in progress and the recent ones, per live lesson.
#[derive(Debug)]
pub struct Checks {
    /// Live lessons with a run in progress here.
    running: Mutex<HashSet<LiveLessonId>>,
    /// When each live lesson's learner runs of the last minute began, oldest first.
    recent: Mutex<HashMap<LiveLessonId, VecDeque<Instant>>>,
    /// `limits.checks_per_minute` (0: no limit).
    per_minute: u32,
}

/// The window `per_minute` counts in.
const MINUTE: Duration = Duration::from_secs(60);

/// Beyond this many live lessons in `recent`, windows that emptied are dropped at the next
/// admission, so the map holds only the live lessons checked in the last minute.
const RECENT_SWEEP: usize = 1024;

/// A run in progress: its live lesson's place, given back on drop.
pub struct Running {
    /// Whose place it holds.
    checks: Arc<Checks>,
    /// The live lesson.
    id: LiveLessonId,
}

impl Drop for Running {
    fn drop(&mut self) {
        lock(&self.checks.running).remove(&self.id);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Checks {
    /// Limits of `per_minute` learner runs per live lesson (0: none), one at a time.
    pub fn new(per_minute: u32) -> Checks {
        Checks {
            running: Mutex::default(),
            recent: Mutex::default(),
            per_minute,
        }
    }

    /// Admits a run of `id` at `now`, or refuses it: one is running, or (`limited`: a learner's)
    /// the live lesson ran `per_minute` in the last minute.
    fn admit(
        self: &Arc<Self>,
        id: LiveLessonId,
        limited: bool,
        now: Instant,
    ) -> Result<Running, Error> {
        let mut running = lock(&self.running);
        if running.contains(&id) {
            return Err(Error::TooManyChecks {
                id,
                scope: "running",
                limit: 1,
            });
        }
        if limited && self.per_minute > 0 {
            let mut recent = lock(&self.recent);
            if recent.len() > RECENT_SWEEP {
                recent.retain(|_, runs| {
                    runs.back()
                        .is_some_and(|last| now.duration_since(*last) < MINUTE)
                });
            }
            let runs = recent.entry(id).or_default();
            while runs
                .front()
                .is_some_and(|first| now.duration_since(*first) >= MINUTE)
            {
                runs.pop_front();
            }
            if runs.len() >= self.per_minute as usize {
                return Err(Error::TooManyChecks {
                    id,
                    scope: "minute",
                    limit: self.per_minute,
                });
            }
            runs.push_back(now);
        }
        running.insert(id);
        Ok(Running {
            checks: self.clone(),
            id,
        })
    }
}

/// What a run of stage files reaches: the lessons, the agents, where checks are recorded, the
/// live lessons' watchers and the metrics.
pub struct RunParts<'a> {
    /// The lessons, for the stage's files.
    pub catalog: &'a Catalog,
    /// The agents, for the live lesson's.
    pub fleet: &'a Fleet,
    /// Where a check's run is recorded.
    pub store: &'a Store,
    /// Who hears that a check ended.
    pub hub: &'a Hub,
    /// Where runs are counted.
    pub metrics: &'a Metrics,
}

impl Checks {
    /// Runs the `files` of `live`'s current stage on its agent; `limited` for a learner's run
    /// (the per-minute limit). A check's run is recorded (passed stages, the latest run) and
    /// the live lesson's watchers hear of it.
    pub async fn run(
        self: &Arc<Self>,
        parts: RunParts<'_>,
        live: &LiveLesson,
        files: Files,
        limited: bool,
    ) -> Result<CheckRun, Error> {
        let RunParts {
            catalog,
            fleet,
            store,
            hub,
            metrics,
        } = parts;
        let lesson = catalog
            .lesson(&live.lesson_slug)
            .ok_or_else(|| Error::LessonNotFound(live.lesson_slug.clone()))?;
        let stage =
            lesson
                .stages
                .get(live.stage as usize)
                .ok_or_else(|| Error::StageOutOfRange {
                    lesson: lesson.slug.clone(),
                    stage: live.stage,
                    last: (lesson.stages.len() as u32).saturating_sub(1),
                })?;
        let scripts = files.of(stage);
        if scripts.is_empty() {
            return Err(Error::NoChecks {
                lesson: lesson.slug.clone(),
                stage: live.stage,
                files: files.as_str(),
            });
        }
        let settled_ready = live.status == Status::Ready
            && live.observed_generation == live.generation
            && !live.deleting;
        let agent = match live.agent.as_deref() {
            Some(agent) if settled_ready => agent,
            _ => {
                let status = if live.deleting {
                    Status::Terminating
                } else {
                    live.status
                };
                return Err(Error::NotReady {
                    id: live.id,
                    status,
                });
            }
        };
        let agent = fleet
            .get(agent)
            .ok_or_else(|| Error::AgentNotFound(agent.to_owned()))?;
        // PROTOCOL.md [V4]: never a call whose capability the agent did not offer.
        if !agent.has(capabilities::CHECKS) {
            return Err(Error::ChecksUnsupported {
                agent: agent.name.clone(),
            });
        }
        let _running = self.admit(live.id, limited, Instant::now())?;
        let sent: Vec<CheckFile> = lesson
            .endpoints
            .iter()
            .filter_map(|endpoint| {
                scripts.get(&endpoint.name).map(|script| CheckFile {
                    endpoint: endpoint.name.clone(),
                    kind: script.kind,
                    file_name: script.file_name(),
                    contents: script.contents.clone(),
                })
            })
            .collect();
        let started = Instant::now();
        let answer = agent
            .run_checks(live.id, live.generation, &sent, lesson.check_timeout)
            .await;
        let took = started.elapsed();
        let outcomes = match answer {
            Ok(outcomes) => outcomes,
            Err(err) => {
                if files == Files::Checks {
                    metrics.checked(&lesson.slug, live.stage, "error", took);
                }
                // An agent that offered the capability and then answers UNIMPLEMENTED (an
                // older build behind the same address) cannot run checks either.
                if err.agent_code() == Some(tonic::Code::Unimplemented) {
                    return Err(Error::ChecksUnsupported {
                        agent: agent.name.clone(),
                    });
                }
                return Err(err);
            }
        };
        let endpoints: Vec<EndpointCheck> = outcomes
            .into_iter()
            .map(|outcome| {
                let passed = outcome.passed();
                let feedback = if !outcome.error.is_empty() {
                    outcome.error
                } else if outcome.timed_out {
                    let mut text = outcome.output;
                    if !text.is_empty() && !text.ends_with('\n') {
                        text.push('\n');
                    }
                    text.push_str(&format!(
                        "(ended at the check timeout of {}s)",
                        lesson.check_timeout.as_secs()
                    ));
                    text
                } else {
                    outcome.output
                };
                EndpointCheck {
                    endpoint: outcome.endpoint,
                    file_name: outcome.file_name,
                    passed,
                    exit_code: outcome.exit_code,
                    timed_out: outcome.timed_out,
                    feedback,
                    truncated: outcome.truncated,
                    duration_ms: outcome.duration.as_millis() as u64,
                }
            })
            .collect();
        // Every file sent must have answered, and passed.
        let passed = endpoints.len() == sent.len() && endpoints.iter().all(|e| e.passed);
        let run = CheckRun {
            stage: live.stage,
            passed,
            endpoints,
            at: Millis::now().0,
            duration_ms: took.as_millis() as u64,
        };
        tracing::info!(
            live_lesson.id = %live.id,
            lesson = %lesson.slug,
            agent = %agent.name,
            files = files.as_str(),
            passed,
            "stage files ran"
        );
        if files == Files::Checks {
            let result = if passed { "passed" } else { "failed" };
            metrics.checked(&lesson.slug, live.stage, result, took);
            store.record_check(live.id, &run).await?;
            // Watchers read the checks again on every update; the live lesson itself did
            // not change, so they are woken with its current state.
            match store.live_lesson(live.id).await {
                Ok(current) => hub.publish(&current),
                Err(Error::LiveLessonNotFound(_)) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(run)
    }
}

/// Refuses a move of a live lesson of `lesson` from stage `from` to `to` past a gated stage
/// (`checks: gate`) whose check has not passed in it, by what `store` recorded. `id` is the live
/// lesson, `None` for one not yet created (nothing has passed).
pub async fn gate(
    store: &Store,
    lesson: &Lesson,
    id: Option<LiveLessonId>,
    from: u32,
    to: u32,
) -> Result<(), Error> {
    let gated: Vec<&Stage> = lesson
        .stages
        .iter()
        .filter(|stage| stage.index >= from && stage.index < to && stage.gated())
        .collect();
    if gated.is_empty() {
        return Ok(());
    }
    let checks = match id {
        Some(id) => store.stage_checks(id).await?,
        None => Default::default(),
    };
    for stage in gated {
        if checks.passed.contains(&stage.index) {
            continue;
        }
        // The file that failed last, else the stage's first check file.
        let failed = checks
            .last
            .as_ref()
            .filter(|run| run.stage == stage.index)
            .and_then(|run| run.endpoints.iter().find(|e| !e.passed))
            .map(|e| e.file_name.clone());
        let first = || stage.checks.values().next().map(Script::file_name);
        let file = failed.or_else(first).unwrap_or_default();
        return Err(Error::CheckNotPassed {
            id,
            stage: stage.index,
            check: format!("stage{}/checks/{file}", stage.index),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_run_at_a_time_and_a_bounded_number_per_minute() {
        let checks = Arc::new(Checks::new(3));
        let (a, b) = (LiveLessonId::new(), LiveLessonId::new());
        let start = Instant::now();
        let first = checks.admit(a, true, start).expect("the first run");
        let refused = checks
            .admit(a, true, start)
            .err()
            .expect("a second at once");
        assert!(matches!(
            refused,
            Error::TooManyChecks {
                scope: "running",
                ..
            }
        ));
        // Another live lesson is not held up.
        drop(checks.admit(b, true, start).expect("another live lesson"));
        drop(first);
        drop(checks.admit(a, true, start).expect("after the first ended"));
        drop(
            checks
                .admit(a, true, start)
                .expect("the third of the minute"),
        );
        let refused = checks.admit(a, true, start).err().expect("a fourth");
        assert!(matches!(
            refused,
            Error::TooManyChecks {
                scope: "minute",
                limit: 3,
                ..
            }
        ));
        // Operators' runs are not counted against the minute.
        drop(checks.admit(a, false, start).expect("an operator's run"));
        // A minute after them, the minute's places are free again.
        let later = start + MINUTE;
        for _ in 0..3 {
            drop(checks.admit(a, true, later).expect("a minute later"));
        }
        assert!(checks.admit(a, true, later).is_err());
    }

    #[test]
    fn no_limit_per_minute_at_zero() {
        let checks = Arc::new(Checks::new(0));
        let id = LiveLessonId::new();
        let now = Instant::now();
        for _ in 0..100 {
            drop(checks.admit(id, true, now).expect("no limit"));
        }
    }
}
