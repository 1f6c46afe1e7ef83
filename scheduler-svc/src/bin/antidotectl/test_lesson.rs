//! `admin test-lesson`: lessons that test themselves. Each lesson is started in a session of
//! its own and walked through its stages; at every stage with both checks and solutions the
//! check must fail, the solution is run (every file must exit 0), and the check must then pass.
//! Every stage change must reach READY. The live lesson is deleted at the end, whatever
//! happened.
//!
//! Checks and solutions run through `AdminService.TestStage` (admin:write), so the learners'
//! per-minute limit does not apply and a gated stage's pass counts for the walk.

use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use futures::StreamExt as _;
use serde::Serialize;

use crate::client::{Clients, Failure, Result};

/// One stage of a walk.
#[derive(Debug, Clone, Serialize)]
pub struct StageRow {
    /// The stage.
    pub stage: u32,
    /// The check before the solution: `failed` is what a fresh stage must say.
    pub check_before: String,
    /// The solution: `ran` when every file exited 0.
    pub solution: String,
    /// The check after the solution: `passed` is what it must say.
    pub check_after: String,
    /// Seconds spent at this stage (the stage change, checks and solution).
    pub seconds: f64,
    /// What did not go as it must; `None` when the stage is fine.
    pub problem: Option<String>,
}

/// One lesson's walk.
#[derive(Debug, Clone, Serialize)]
pub struct LessonReport {
    /// The lesson's slug.
    pub lesson: String,
    /// The live lesson it ran as, once requested.
    pub live_lesson_id: String,
    /// The stages walked.
    pub stages: Vec<StageRow>,
    /// Why the walk stopped before its end (a stage that did not come READY, a refused call).
    pub error: Option<String>,
}

impl LessonReport {
    /// Whether everything went as it must.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.stages.iter().all(|row| row.problem.is_none())
    }
}

/// The walk of `slug`; `only` tests that stage alone (the stages before it are passed through,
/// their gates passed with their solutions).
pub async fn run(c: &Clients, slug: &str, only: Option<u32>) -> LessonReport {
    let mut report = LessonReport {
        lesson: slug.to_owned(),
        live_lesson_id: String::new(),
        stages: Vec::new(),
        error: None,
    };
    let mut live = None;
    if let Err(err) = walk(c, slug, only, &mut report, &mut live).await {
        report.error = Some(err.0);
    }
    // Whatever happened, the live lesson goes.
    if let Some((id, token)) = live {
        let deleted = c
            .lessons
            .clone()
            .delete_live_lesson(c.as_learner(api::DeleteLiveLessonRequest { id }, &token))
            .await;
        if let Err(status) = deleted
            && report.error.is_none()
        {
            report.error = Some(format!(
                "deleting the live lesson: {}",
                Failure::from(status)
            ));
        }
    }
    report
}

async fn walk(
    c: &Clients,
    slug: &str,
    only: Option<u32>,
    report: &mut LessonReport,
    live: &mut Option<(String, String)>,
) -> Result<()> {
    let lesson = c
        .curriculum
        .clone()
        .get_lesson(c.request(api::GetLessonRequest {
            slug: slug.to_owned(),
        }))
        .await?
        .into_inner();
    let last = lesson.stages.len().saturating_sub(1) as u32;
    if let Some(stage) = only
        && stage > last
    {
        return Err(Failure(format!(
            "lesson `{slug}` has stages 0..={last}, not {stage}"
        )));
    }
    let session = c
        .sessions
        .clone()
        .create_session(c.request(api::CreateSessionRequest {}))
        .await?
        .into_inner();
    let token = session.token;
    let started = Instant::now();
    let first = c
        .lessons
        .clone()
        .request_live_lesson(c.as_learner(
            api::RequestLiveLessonRequest {
                session_id: session.id,
                lesson_slug: slug.to_owned(),
                stage: 0,
                placement: None,
            },
            &token,
        ))
        .await?
        .into_inner();
    let id = first.id.clone();
    report.live_lesson_id = id.clone();
    *live = Some((id.clone(), token.clone()));
    settle(c, &id, &token, first.generation).await?;
    let end = only.unwrap_or(last);
    let mut stage_started = started;
    for stage in &lesson.stages {
        let index = stage.index;
        if index > end {
            break;
        }
        if index > 0 {
            stage_started = Instant::now();
            let moved = c
                .lessons
                .clone()
                .set_stage(c.as_learner(
                    api::SetStageRequest {
                        id: id.clone(),
                        stage: index,
                    },
                    &token,
                ))
                .await?
                .into_inner();
            settle(c, &id, &token, moved.generation).await?;
        }
        let tested = only.is_none_or(|only| only == index);
        let has_checks = !stage.checks.is_empty();
        let gated = stage.checks == "gate";
        let mut row = StageRow {
            stage: index,
            check_before: "-".into(),
            solution: "-".into(),
            check_after: "-".into(),
            seconds: 0.0,
            problem: None,
        };
        match (has_checks, stage.has_solutions) {
            (true, true) => {
                if tested {
                    let before = test_stage(c, &id, api::StageFiles::Checks).await?;
                    row.check_before = verdict(&before);
                    if before.passed {
                        row.problem = Some(format!(
                            "the check passed before the solution ran: {}",
                            feedback(&before)
                        ));
                    }
                }
                // Also through a gated stage before the one tested, to go on.
                if tested || gated {
                    let solution = test_stage(c, &id, api::StageFiles::Solutions).await?;
                    row.solution = if solution.passed {
                        "ran".into()
                    } else {
                        "failed".into()
                    };
                    if !solution.passed && row.problem.is_none() {
                        row.problem = Some(format!("the solution failed: {}", feedback(&solution)));
                    }
                    let after = test_stage(c, &id, api::StageFiles::Checks).await?;
                    row.check_after = verdict(&after);
                    if !after.passed && row.problem.is_none() {
                        row.problem = Some(format!(
                            "the check failed after the solution: {}",
                            feedback(&after)
                        ));
                    }
                }
            }
            (true, false) if gated && index < end => {
                row.problem =
                    Some("the stage is gated by its check and has no solution to pass it".into());
            }
            _ => {}
        }
        row.seconds = stage_started.elapsed().as_secs_f64();
        let stop = row.problem.is_some() && gated;
        report.stages.push(row);
        if stop {
            // The gate holds: the next stages cannot be reached.
            break;
        }
    }
    Ok(())
}

/// Runs a stage's checks or solutions as an operator.
async fn test_stage(c: &Clients, id: &str, files: api::StageFiles) -> Result<api::StageCheck> {
    let mut request = c.operator(api::TestStageRequest {
        live_lesson_id: id.to_owned(),
        files: files as i32,
    });
    // A run may take the lesson's checkTimeout per file: longer than the usual deadline.
    request.set_timeout(Duration::from_secs(15 * 60));
    Ok(c.admin.clone().test_stage(request).await?.into_inner())
}

/// `passed` or `failed`.
fn verdict(check: &api::StageCheck) -> String {
    if check.passed { "passed" } else { "failed" }.into()
}

/// The failing files' feedback, one line each.
fn feedback(check: &api::StageCheck) -> String {
    let failed: Vec<String> = check
        .endpoints
        .iter()
        .filter(|e| !e.passed)
        .map(|e| {
            let text = e.feedback.trim();
            let exit = if e.timed_out {
                "timed out".to_owned()
            } else {
                format!("exit {}", e.exit_code)
            };
            format!("{} ({exit}): {text}", e.file_name)
        })
        .collect();
    if failed.is_empty() {
        check
            .endpoints
            .iter()
            .map(|e| format!("{}: {}", e.file_name, e.feedback.trim()))
            .collect::<Vec<_>>()
            .join("; ")
    } else {
        failed.join("; ")
    }
}

/// Waits until the live lesson is READY at `generation` or newer; FAILED is an error.
async fn settle(c: &Clients, id: &str, token: &str, generation: u64) -> Result<()> {
    let mut request = c.as_learner(api::WatchLiveLessonRequest { id: id.to_owned() }, token);
    request.metadata_mut().remove("grpc-timeout");
    let mut stream = c
        .lessons
        .clone()
        .watch_live_lesson(request)
        .await?
        .into_inner();
    while let Some(item) = stream.next().await {
        let live = item?;
        if live.generation < generation {
            continue;
        }
        match live.status() {
            api::LiveLessonStatus::Ready => return Ok(()),
            api::LiveLessonStatus::Failed => {
                return Err(Failure(format!(
                    "stage {} FAILED: {}",
                    live.stage, live.failure_reason
                )));
            }
            _ => {}
        }
    }
    Err(Failure(format!("live lesson {id} went away")))
}
