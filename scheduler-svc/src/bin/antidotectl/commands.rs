//! One function per subcommand: build the request, make the call, hand the answer to
//! `render`. A live lesson that ends FAILED is a `Failure`, like a failed call.

use std::path::Path;
use std::process::ExitCode;

use antidote_proto::api::v1 as api;
use scheduler_svc::catalog::Tier;
use tokio_stream::StreamExt as _;

use crate::client::{Clients, Failure, Result};
use crate::render::{self, Printer};

/// `validate DIR`: loads the catalog offline; the summary on stdout, or every problem on stderr.
pub fn validate(dir: &Path, tier: Tier) -> ExitCode {
    match scheduler_svc::catalog::validate(dir, tier) {
        Ok(validation) => {
            // Warnings on stderr, the summary last on stdout, so scripts can read either.
            for warning in &validation.warnings {
                eprintln!("warning: {warning}");
            }
            println!("{}", validation.summary);
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

pub async fn lessons_list(
    c: &Clients,
    out: &Printer,
    category: String,
    collection: String,
    tag: String,
) -> Result<()> {
    let answer = c
        .curriculum
        .clone()
        .list_lessons(c.request(api::ListLessonsRequest {
            category,
            collection,
            tag,
        }))
        .await?
        .into_inner();
    out.print(&answer, "ListLessonsResponse", || {
        render::lessons_table(&answer.lessons)
    });
    Ok(())
}

pub async fn lessons_show(c: &Clients, out: &Printer, slug: String) -> Result<()> {
    let lesson = c
        .curriculum
        .clone()
        .get_lesson(c.request(api::GetLessonRequest { slug }))
        .await?
        .into_inner();
    out.print(&lesson, "Lesson", || render::lesson(&lesson));
    Ok(())
}

pub async fn session_create(c: &Clients, out: &Printer) -> Result<()> {
    let session = c
        .sessions
        .clone()
        .create_session(c.request(api::CreateSessionRequest {}))
        .await?
        .into_inner();
    // Kept for the next commands about this session, like a browser keeps its cookie.
    c.credentials.put(&session.id, &session.token)?;
    out.print(&session, "Session", || session.id.clone());
    Ok(())
}

pub async fn session_show(c: &Clients, out: &Printer, id: String) -> Result<()> {
    let session = c
        .sessions
        .clone()
        .get_session(c.learner(api::GetSessionRequest { id: id.clone() }, &id))
        .await?
        .into_inner();
    out.print(&session, "Session", || {
        render::sessions_table(std::slice::from_ref(&session))
    });
    Ok(())
}

pub async fn request(
    c: &Clients,
    out: &Printer,
    lesson: String,
    session: String,
    stage: u32,
    no_follow: bool,
    placement: Option<api::PlacementPreference>,
) -> Result<()> {
    let live = c
        .lessons
        .clone()
        .request_live_lesson(c.learner(
            api::RequestLiveLessonRequest {
                session_id: session.clone(),
                lesson_slug: lesson,
                stage,
                placement,
            },
            &session,
        ))
        .await?
        .into_inner();
    if let Some(token) = c.credentials.get(&session) {
        c.credentials.put(&live.id, &token)?;
    }
    settle(c, out, live, no_follow).await
}

pub async fn watch(c: &Clients, out: &Printer, id: String) -> Result<()> {
    follow(c, out, &id, 0).await
}

pub async fn get(c: &Clients, out: &Printer, id: String) -> Result<()> {
    let live = c
        .lessons
        .clone()
        .get_live_lesson(c.learner(api::GetLiveLessonRequest { id: id.clone() }, &id))
        .await?
        .into_inner();
    out.print(&live, "LiveLesson", || render::live_lesson(&live));
    Ok(())
}

pub async fn stage(
    c: &Clients,
    out: &Printer,
    id: String,
    stage: u32,
    no_follow: bool,
) -> Result<()> {
    let live = c
        .lessons
        .clone()
        .set_stage(c.learner(
            api::SetStageRequest {
                id: id.clone(),
                stage,
            },
            &id,
        ))
        .await?
        .into_inner();
    settle(c, out, live, no_follow).await
}

pub async fn delete(c: &Clients, out: &Printer, id: String) -> Result<()> {
    c.lessons
        .clone()
        .delete_live_lesson(c.learner(api::DeleteLiveLessonRequest { id: id.clone() }, &id))
        .await?;
    out.done(&format!("live lesson {id} is being removed"));
    Ok(())
}

pub async fn plan(c: &Clients, out: &Printer, lesson: String, stage: u32) -> Result<()> {
    let plan = c
        .admin
        .clone()
        .plan(c.operator(api::PlanRequest {
            lesson_slug: lesson,
            stage,
        }))
        .await?
        .into_inner();
    out.print(&plan, "PlanResponse", || render::plan(&plan));
    Ok(())
}

pub async fn admin_list(
    c: &Clients,
    out: &Printer,
    status: Option<String>,
    lesson: String,
    agent: String,
) -> Result<()> {
    let status = match status {
        None => 0,
        Some(name) => parse_status(&name)?,
    };
    let answer = c
        .admin
        .clone()
        .list_live_lessons(c.operator(api::AdminListLiveLessonsRequest {
            status,
            lesson_slug: lesson,
            agent,
        }))
        .await?
        .into_inner();
    out.print(&answer, "AdminListLiveLessonsResponse", || {
        render::live_lessons_table(&answer.live_lessons)
    });
    Ok(())
}

pub async fn admin_kill(c: &Clients, out: &Printer, id: String) -> Result<()> {
    c.admin
        .clone()
        .kill_live_lesson(c.operator(api::KillLiveLessonRequest { id: id.clone() }))
        .await?;
    out.done(&format!("live lesson {id} is being removed"));
    Ok(())
}

pub async fn admin_persist(c: &Clients, out: &Printer, session: String, off: bool) -> Result<()> {
    let session = c
        .admin
        .clone()
        .persist_session(c.operator(api::PersistSessionRequest {
            id: session,
            persistent: !off,
        }))
        .await?
        .into_inner();
    out.print(&session, "Session", || {
        render::sessions_table(std::slice::from_ref(&session))
    });
    Ok(())
}

pub async fn admin_sessions(c: &Clients, out: &Printer) -> Result<()> {
    let answer = c
        .admin
        .clone()
        .list_sessions(c.operator(api::ListSessionsRequest {}))
        .await?
        .into_inner();
    out.print(&answer, "ListSessionsResponse", || {
        render::sessions_table(&answer.sessions)
    });
    Ok(())
}

pub async fn admin_events(c: &Clients, out: &Printer, id: String) -> Result<()> {
    let answer = c
        .admin
        .clone()
        .list_events(c.operator(api::ListEventsRequest { live_lesson_id: id }))
        .await?
        .into_inner();
    out.print(&answer, "ListEventsResponse", || {
        render::events_table(&answer.events)
    });
    Ok(())
}

/// `--require`/`--prefer` pairs as a placement preference (none when both are empty).
pub fn placement(
    requires: &[String],
    prefers: &[String],
) -> Result<Option<api::PlacementPreference>> {
    if requires.is_empty() && prefers.is_empty() {
        return Ok(None);
    }
    let pairs = |flag: &str, items: &[String]| {
        items
            .iter()
            .map(|item| match item.split_once('=') {
                Some((key, value)) if !key.is_empty() && !value.is_empty() => {
                    Ok((key.to_owned(), value.to_owned()))
                }
                _ => Err(Failure(format!("--{flag} `{item}` should be KEY=VALUE"))),
            })
            .collect::<Result<_>>()
    };
    Ok(Some(api::PlacementPreference {
        requires: pairs("require", requires)?,
        prefers: pairs("prefer", prefers)?,
    }))
}

pub async fn admin_show(c: &Clients, out: &Printer, id: String) -> Result<()> {
    let answer = c
        .admin
        .clone()
        .get_live_lesson(c.operator(api::AdminGetLiveLessonRequest { id }))
        .await?
        .into_inner();
    out.print(&answer, "AdminLiveLesson", || {
        render::admin_live_lesson(&answer)
    });
    Ok(())
}

/// Drains an agent (`drain`) or resumes it, and prints it.
pub async fn admin_drain(c: &Clients, out: &Printer, name: String, drain: bool) -> Result<()> {
    let mut admin = c.admin.clone();
    let agent = if drain {
        admin
            .drain_agent(c.operator(api::DrainAgentRequest { name }))
            .await?
    } else {
        admin
            .resume_agent(c.operator(api::ResumeAgentRequest { name }))
            .await?
    }
    .into_inner();
    out.print(&agent, "Agent", || {
        render::agents_table(std::slice::from_ref(&agent))
    });
    Ok(())
}

pub async fn admin_pool_list(c: &Clients, out: &Printer) -> Result<()> {
    let answer = c
        .admin
        .clone()
        .list_pools(c.operator(api::ListPoolsRequest {}))
        .await?
        .into_inner();
    out.print(&answer, "ListPoolsResponse", || {
        render::pools_table(&answer.pools)
    });
    Ok(())
}

pub async fn admin_pool_set(
    c: &Clients,
    out: &Printer,
    lesson_slug: String,
    stage: u32,
    size: u32,
    windows: Vec<String>,
) -> Result<()> {
    let windows = windows
        .iter()
        .map(|text| window(text))
        .collect::<Result<Vec<_>>>()?;
    let pool = c
        .admin
        .clone()
        .set_pool(c.operator(api::SetPoolRequest {
            lesson_slug,
            stage,
            size,
            windows,
        }))
        .await?
        .into_inner();
    out.print(&pool, "Pool", || {
        render::pools_table(std::slice::from_ref(&pool))
    });
    Ok(())
}

/// `HH:MM-HH:MM=SIZE` as a window (the scheduler checks the times).
fn window(text: &str) -> Result<api::PoolWindow> {
    let usage = || {
        Failure(format!(
            "--window `{text}` should be FROM-TO=SIZE, e.g. 08:45-10:00=30"
        ))
    };
    let (span, size) = text.split_once('=').ok_or_else(usage)?;
    let (from, to) = span.split_once('-').ok_or_else(usage)?;
    Ok(api::PoolWindow {
        from: from.trim().to_owned(),
        to: to.trim().to_owned(),
        size: size.trim().parse().map_err(|_| usage())?,
    })
}

pub async fn agents_list(c: &Clients, out: &Printer) -> Result<()> {
    let answer = c
        .admin
        .clone()
        .list_agents(c.operator(api::ListAgentsRequest {}))
        .await?
        .into_inner();
    out.print(&answer, "ListAgentsResponse", || {
        render::agents_table(&answer.agents)
    });
    Ok(())
}

/// Prints `live` as answered, or follows it to READY or FAILED.
async fn settle(c: &Clients, out: &Printer, live: api::LiveLesson, no_follow: bool) -> Result<()> {
    if no_follow {
        out.print(&live, "LiveLesson", || render::live_lesson(&live));
        Ok(())
    } else {
        follow(c, out, &live.id, live.generation).await
    }
}

/// `admin test-lesson`: one lesson, or every lesson of the catalog with `all` (`concurrency`
/// at a time); a table (or one JSON document) of every stage, and a failure when anything did
/// not go as it must.
pub async fn admin_test_lesson(
    c: &Clients,
    out: &Printer,
    lesson: Option<String>,
    stage: Option<u32>,
    all: bool,
    concurrency: usize,
) -> Result<()> {
    let slugs = if all {
        c.curriculum
            .clone()
            .list_lessons(c.request(api::ListLessonsRequest::default()))
            .await?
            .into_inner()
            .lessons
            .into_iter()
            .map(|l| l.slug)
            .collect()
    } else {
        lesson.into_iter().collect::<Vec<_>>()
    };
    let runs = slugs
        .iter()
        .map(|slug| crate::test_lesson::run(c, slug, stage));
    let running =
        futures::StreamExt::buffer_unordered(futures::stream::iter(runs), concurrency.max(1));
    let mut reports: Vec<crate::test_lesson::LessonReport> =
        futures::StreamExt::collect(running).await;
    reports.sort_by(|a, b| a.lesson.cmp(&b.lesson));
    out.test_lessons(&reports);
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.ok())
        .map(|r| r.lesson.as_str())
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Failure(format!(
            "{} of {} lessons did not pass: {}",
            failed.len(),
            reports.len(),
            failed.join(", ")
        )))
    }
}

/// Follows a live lesson until READY or FAILED (of `generation` or newer, when given): a
/// progress bar on a terminal, then the live lesson; each state as a JSON line with `--output
/// json`. FAILED is an error.
async fn follow(c: &Clients, out: &Printer, id: &str, generation: u64) -> Result<()> {
    let mut stream = c
        .lessons
        .clone()
        .watch_live_lesson({
            let mut request = c.learner(api::WatchLiveLessonRequest { id: id.to_owned() }, id);
            // Following has no deadline.
            request.metadata_mut().remove("grpc-timeout");
            request
        })
        .await?
        .into_inner();
    let progress = out.progress();
    let mut last = None;
    while let Some(item) = stream.next().await {
        let live = item?;
        progress.update(&live);
        let settled = matches!(
            live.status(),
            api::LiveLessonStatus::Ready | api::LiveLessonStatus::Failed
        ) && live.generation >= generation;
        last = Some(live);
        if settled {
            break;
        }
    }
    progress.finish();
    let Some(live) = last else {
        return Err(Failure(format!("live lesson {id} is gone")));
    };
    out.settled(&live);
    match live.status() {
        api::LiveLessonStatus::Ready => Ok(()),
        api::LiveLessonStatus::Failed => Err(Failure(format!(
            "live lesson {id} FAILED: {}",
            live.failure_reason
        ))),
        _ => Err(Failure(format!(
            "live lesson {id} went away while {}",
            render::status_name(live.status)
        ))),
    }
}

/// `--status READY` (in any case, or the upper-case enum name) as the enum's number.
fn parse_status(name: &str) -> Result<i32> {
    let full = format!(
        "LIVE_LESSON_STATUS_{}",
        name.trim_start_matches("LIVE_LESSON_STATUS_")
            .to_uppercase()
    );
    api::LiveLessonStatus::from_str_name(&full)
        .map(|s| s as i32)
        .ok_or_else(|| {
            Failure(format!(
                "--status `{name}`: one of PENDING, BOOTING, CONFIGURING, READY, FAILED, TERMINATING"
            ))
        })
}
