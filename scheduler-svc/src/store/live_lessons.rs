//! Live lessons: requests (create, touch, change stage, retry), heartbeats, deletion, the
//! reads of the API and the reconciler, and the reconciler's observations.

use super::backend::Statement;
use super::effects::Effect;
use super::shards::{Fence, shard_of};
use super::{
    Counts, LESSON_COLUMNS, Result, Store, lesson_from_row, mark_for_deletion, parse_lesson_id,
};
use crate::error::Error;
use crate::model::{Decision, EndpointInfo, LiveLesson, LiveLessonId, Millis, SessionId, Status};

/// What a request did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requested {
    /// A new live lesson was recorded.
    Created,
    /// The existing live lesson already matched; it was only touched.
    Touched,
    /// The existing live lesson got a new generation (stage change or retry after FAILED).
    Changed,
}

/// What the reconciler observed, to record on a live lesson.
#[derive(Debug, Clone)]
pub struct Observation {
    /// The status to enter.
    pub status: Status,
    /// Reason or progress detail.
    pub reason: String,
    /// Observed endpoints, if the agent reported them.
    pub endpoints: Option<Vec<EndpointInfo>>,
    /// The agent's handle, if it returned one.
    pub handle: Option<Vec<u8>>,
    /// The agent this places the live lesson on, if any (an existing placement never changes).
    pub agent: Option<String>,
    /// The placement decision that chose that agent, recorded in the same write when the
    /// observation is.
    pub decision: Option<Decision>,
}

impl Observation {
    /// An observation of a status and reason only.
    pub fn status(status: Status, reason: impl Into<String>) -> Observation {
        Observation {
            status,
            reason: reason.into(),
            endpoints: None,
            handle: None,
            agent: None,
            decision: None,
        }
    }
}

/// Filters for the admin listing.
#[derive(Debug, Clone, Default)]
pub struct LessonFilter {
    /// Only this status.
    pub status: Option<Status>,
    /// Only this lesson.
    pub lesson_slug: Option<String>,
    /// Only this agent.
    pub agent: Option<String>,
}

impl Store {
    /// Asks for `lesson` at `stage` in `session`: creates the live lesson, or touches it, or
    /// gives it a new generation (stage change, retry after FAILED).
    ///
    /// The common cases (create, ask again) are one statement: an insert that also checks the
    /// session and the limit, and on the unique key's conflict only touches the existing row.
    /// On PostgreSQL the session's row is locked first, so requests in one session take turns
    /// and each counts the live lessons the previous one committed.
    pub async fn request_live_lesson(
        &self,
        session: SessionId,
        lesson: &str,
        stage: u32,
        limit: u32,
        now: Millis,
    ) -> Result<(LiveLesson, Requested)> {
        let id = LiveLessonId::new();
        let insert = Statement::new(format!(
            "INSERT INTO live_lessons (id, session_id, lesson_slug, stage, generation, status, \
             reason, persistent, created_at, last_active, updated_at) \
             SELECT $1, s.id, $3, $4, 1, 'PENDING', 'requested', s.persistent, $5, $5, $5 \
             FROM sessions s WHERE s.id = $2 AND s.expired = 0 AND ($6 = 0 \
               OR (SELECT COUNT(*) FROM live_lessons WHERE session_id = $2) < $6 \
               OR EXISTS (SELECT 1 FROM live_lessons WHERE session_id = $2 AND lesson_slug = $3)) \
             ON CONFLICT (session_id, lesson_slug) DO UPDATE SET last_active = excluded.last_active \
             RETURNING {LESSON_COLUMNS}"
        ))
        .bind(id.to_string())
        .bind(session.to_string())
        .bind(lesson)
        .bind(stage)
        .bind(now.0)
        .bind(limit);
        let current = self
            .write(move |mut conn| {
                Box::pin(async move {
                    conn.lock_session(session).await?;
                    let current = conn.fetch_lesson(insert).await?;
                    if current.as_ref().is_some_and(|current| current.id == id) {
                        conn.note(Effect::Created(id));
                    }
                    Ok(current)
                })
            })
            .await?;
        let Some(current) = current else {
            // Nothing inserted or touched: say which check refused it.
            self.session(session).await?;
            return Err(Error::TooManyLiveLessons { session, limit });
        };
        if current.id == id {
            return Ok((current, Requested::Created));
        }
        self.change_stage(current, stage, now).await
    }

    /// Moves a live lesson to another stage (same rules as asking again with a stage).
    pub async fn set_stage(
        &self,
        id: LiveLessonId,
        stage: u32,
        now: Millis,
    ) -> Result<(LiveLesson, Requested)> {
        let current = self
            .write_lesson(
                Statement::new(format!(
                    "UPDATE live_lessons SET last_active = $1 WHERE id = $2 AND \
                     session_id IN (SELECT id FROM sessions WHERE expired = 0) \
                     RETURNING {LESSON_COLUMNS}"
                ))
                .bind(now.0)
                .bind(id.to_string()),
            )
            .await?
            .ok_or(Error::LiveLessonNotFound(id))?;
        self.change_stage(current, stage, now).await
    }

    /// Applies a request for `stage` to an existing (already touched) live lesson.
    async fn change_stage(
        &self,
        current: LiveLesson,
        stage: u32,
        now: Millis,
    ) -> Result<(LiveLesson, Requested)> {
        if current.deleting {
            return Err(Error::StillTerminating(current.id));
        }
        let failed = current.status == Status::Failed;
        if current.stage == stage && !failed {
            return Ok((current, Requested::Touched));
        }
        if !current.status.is_settled() {
            return Err(Error::Busy {
                id: current.id,
                status: current.status,
            });
        }
        // A stage change keeps the endpoints: READY → CONFIGURING → READY. A retry after FAILED
        // starts over from PENDING.
        let (status, detail) = if current.stage != stage && current.status == Status::Ready {
            (Status::Configuring, format!("stage change to {stage}"))
        } else {
            (Status::Pending, "retry after failure".to_owned())
        };
        // Conditional on the generation read above, so a concurrent change cannot be lost.
        let row = self
            .write_lesson(
                Statement::new(format!(
                    "UPDATE live_lessons SET stage = $1, generation = generation + 1, \
                     status = $2, reason = $3, updated_at = $4 \
                     WHERE id = $5 AND generation = $6 AND deleting = 0 \
                     RETURNING {LESSON_COLUMNS}"
                ))
                .bind(stage)
                .bind(status.as_str())
                .bind(detail)
                .bind(now.0)
                .bind(current.id.to_string())
                .bind(current.generation as i64),
            )
            .await?;
        match row {
            Some(lesson) => Ok((lesson, Requested::Changed)),
            None => Err(Error::Busy {
                id: current.id,
                status: current.status,
            }),
        }
    }

    /// Records activity on a live lesson (and, through a trigger, on its session).
    pub async fn heartbeat(&self, id: LiveLessonId, now: Millis) -> Result<LiveLesson> {
        self.write_lesson(
            Statement::new(format!(
                "UPDATE live_lessons SET last_active = $1 WHERE id = $2 AND deleting = 0 \
                 RETURNING {LESSON_COLUMNS}"
            ))
            .bind(now.0)
            .bind(id.to_string()),
        )
        .await?
        .ok_or(Error::LiveLessonNotFound(id))
    }

    /// Marks a live lesson for removal (desired state: absent) with a new generation.
    /// `detail` says why ("deleted", "killed by an operator"). Deleting twice is not an error.
    pub async fn mark_deleting(
        &self,
        id: LiveLessonId,
        detail: &str,
        now: Millis,
    ) -> Result<LiveLesson> {
        let row = self
            .write_lesson(
                Statement::new(mark_for_deletion("id = $3"))
                    .bind(detail)
                    .bind(now.0)
                    .bind(id.to_string()),
            )
            .await?;
        match row {
            Some(lesson) => Ok(lesson),
            None => self.live_lesson(id).await,
        }
    }

    /// One live lesson.
    pub async fn live_lesson(&self, id: LiveLessonId) -> Result<LiveLesson> {
        self.find_live_lesson(id)
            .await?
            .ok_or(Error::LiveLessonNotFound(id))
    }

    /// The live lesson if it still exists: on SQLite from the writer's cache when it wrote the
    /// row since it started, on PostgreSQL from what the replica heard when it knows the row.
    pub async fn find_live_lesson(&self, id: LiveLessonId) -> Result<Option<LiveLesson>> {
        if let Some(lesson) = self.written.as_ref().and_then(|written| written.lesson(id)) {
            return Ok(Some(lesson));
        }
        if let Some(lesson) = self.heard.as_ref().and_then(|heard| heard.lesson(id)) {
            return Ok(Some(lesson));
        }
        let ticket = self.heard.as_ref().map(|heard| heard.ticket());
        let row = self
            .reader
            .fetch_optional(
                Statement::new(format!(
                    "SELECT {LESSON_COLUMNS} FROM live_lessons WHERE id = $1"
                ))
                .bind(id.to_string()),
            )
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let lesson = lesson_from_row(&row)?;
        if let (Some(heard), Some(ticket)) = (&self.heard, ticket) {
            heard.read_lesson(ticket, row.int("revision")? as u64, &lesson);
        }
        Ok(Some(lesson))
    }

    /// A session's live lessons, oldest first.
    pub async fn session_live_lessons(&self, session: SessionId) -> Result<Vec<LiveLesson>> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(format!(
                    "SELECT {LESSON_COLUMNS} FROM live_lessons WHERE session_id = $1 \
                     ORDER BY created_at, id"
                ))
                .bind(session.to_string()),
            )
            .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// Every live lesson matching the filter, oldest first.
    pub async fn live_lessons(&self, filter: &LessonFilter) -> Result<Vec<LiveLesson>> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(format!(
                    "SELECT {LESSON_COLUMNS} FROM live_lessons \
                     WHERE ($1 IS NULL OR status = $1) AND ($2 IS NULL OR lesson_slug = $2) \
                     AND ($3 IS NULL OR agent = $3) ORDER BY created_at, id"
                ))
                .bind(filter.status.map(Status::as_str))
                .bind(filter.lesson_slug.as_deref())
                .bind(filter.agent.as_deref()),
            )
            .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// How many live lessons there are per status, and how many live (not expired) sessions,
    /// persistent ones apart: what the metrics report at each scrape.
    pub async fn counts(&self) -> Result<Counts> {
        let statuses = self
            .reader
            .fetch_all(Statement::new(
                "SELECT status, COUNT(*) FROM live_lessons GROUP BY status",
            ))
            .await?
            .iter()
            .map(|row| Ok((row.at::<String>(0)?, row.at::<i64>(1)?)))
            .collect::<Result<Vec<_>>>()?;
        let row = self
            .reader
            .fetch_one(Statement::new(
                "SELECT COUNT(*), COALESCE(SUM(persistent), 0) FROM sessions \
                 WHERE expired = 0 AND source_net <> 'pool'",
            ))
            .await?;
        Ok(Counts {
            statuses,
            sessions: row.at(0)?,
            persistent_sessions: row.at(1)?,
            pools: self.pool_counts().await?,
        })
    }

    /// Ids of every live lesson the reconciler still has work on (used at start-up to resume).
    pub async fn unsettled(&self) -> Result<Vec<LiveLessonId>> {
        self.ids(Statement::new(
            "SELECT id FROM live_lessons WHERE deleting = 1 OR observed_generation != generation \
             OR status NOT IN ('READY', 'FAILED') ORDER BY created_at",
        ))
        .await
    }

    /// Ids of the live lessons placed on `agent`.
    pub async fn on_agent(&self, agent: &str) -> Result<Vec<LiveLessonId>> {
        self.ids(
            Statement::new("SELECT id FROM live_lessons WHERE agent = $1 ORDER BY created_at")
                .bind(agent),
        )
        .await
    }

    /// The live-lesson ids a query's first column holds.
    pub(super) async fn ids(&self, statement: Statement) -> Result<Vec<LiveLessonId>> {
        let rows = self.reader.fetch_all(statement).await?;
        rows.iter()
            .map(|row| parse_lesson_id(&row.at::<String>(0)?))
            .collect()
    }

    /// Records what the reconciler observed for `generation` (placing the live lesson if the
    /// observation names an agent). Returns `None`, changing nothing, when the live lesson is
    /// gone or its desired state moved on to a newer generation: a stale worker can never
    /// overwrite newer intent. A trigger records an event when the status changes. An error
    /// means nothing was recorded and the caller should try again: it never means "moved on".
    pub async fn observe(
        &self,
        id: LiveLessonId,
        generation: u64,
        observation: Observation,
        now: Millis,
    ) -> Result<Option<LiveLesson>> {
        self.write_observation(id, generation, observation, now, None)
            .await
    }

    /// The observation's write: its statement and, when it records a placement decision and
    /// was written, the decision's, in one job.
    async fn write_observation(
        &self,
        id: LiveLessonId,
        generation: u64,
        mut observation: Observation,
        now: Millis,
        fence: Option<&Fence>,
    ) -> Result<Option<LiveLesson>> {
        let decision = observation
            .decision
            .take()
            .map(|decision| super::placements::decision_statement(id, &decision, now))
            .transpose()?;
        let statement = observe_statement(id, generation, observation, now, fence)?;
        let Some(decision) = decision else {
            return self.write_lesson(statement).await;
        };
        self.write(move |mut conn| {
            Box::pin(async move {
                let lesson = conn.fetch_lesson(statement).await?;
                if lesson.is_some() {
                    conn.fetch_placements(decision).await?;
                }
                Ok(lesson)
            })
        })
        .await
    }

    /// [`Store::observe`] by a replica, fenced by the lease of the live lesson's shard: written
    /// only while `fence.holder` holds that lease unexpired at `now` at the epoch `fence`
    /// names, in the same statement. A replica that was frozen (SIGSTOP, a long pause) past its
    /// lease, or that handed the shard over, and goes on mid-run finds its write refused
    /// ([`Fenced::NotHolder`]) instead of overwriting what the shard's new holder did (a
    /// deadline that passed while it was frozen, an older report), even once it holds the
    /// shard again (a new epoch).
    pub async fn observe_fenced(
        &self,
        id: LiveLessonId,
        generation: u64,
        observation: Observation,
        now: Millis,
        fence: &Fence,
    ) -> Result<Fenced> {
        if let Some(lesson) = self
            .write_observation(id, generation, observation, now, Some(fence))
            .await?
        {
            return Ok(Fenced::Recorded(Box::new(lesson)));
        }
        // Nothing written: the lease, or the live lesson, moved on. Read which (rare).
        let held = self
            .reader
            .fetch_optional(
                Statement::new(
                    "SELECT 1 FROM shards WHERE shard = $1 AND holder = $2 AND epoch = $3 \
                     AND expires_at >= $4",
                )
                .bind(shard_of(id))
                .bind(fence.holder.as_str())
                .bind(fence.epoch as i64)
                .bind(now.0),
            )
            .await?
            .is_some();
        Ok(if held {
            Fenced::MovedOn
        } else {
            Fenced::NotHolder
        })
    }

    /// Forgets a live lesson whose objects are gone; triggers record the final event and delete
    /// its session when the session expired and this was its last live lesson.
    pub async fn forget(&self, id: LiveLessonId) -> Result<()> {
        let delete = Statement::new("DELETE FROM live_lessons WHERE id = $1").bind(id.to_string());
        self.write(move |mut conn| Box::pin(async move { conn.forget_lesson(delete, id).await }))
            .await?;
        Ok(())
    }
}

/// What became of a fenced observation ([`Store::observe_fenced`]).
#[derive(Debug)]
pub enum Fenced {
    /// Written; the live lesson as it is now.
    Recorded(Box<LiveLesson>),
    /// Nothing written: the live lesson is gone or its desired state moved on.
    MovedOn,
    /// Nothing written: the writer does not hold the lease of the live lesson's shard at its
    /// run's epoch (it expired, or was handed over, and another replica may have taken it);
    /// its work on the live lesson must stop.
    NotHolder,
}

/// The statement of an observation, fenced by a shard lease when given.
fn observe_statement(
    id: LiveLessonId,
    generation: u64,
    observation: Observation,
    now: Millis,
    fence: Option<&Fence>,
) -> Result<Statement> {
    let endpoints = match &observation.endpoints {
        Some(endpoints) => Some(
            serde_json::to_string(endpoints)
                .map_err(|err| Error::Corrupt(format!("endpoints do not serialise: {err}")))?,
        ),
        None => None,
    };
    let fenced = if fence.is_some() {
        " AND EXISTS (SELECT 1 FROM shards WHERE shards.shard = $11 AND shards.holder = $10 \
         AND shards.epoch = $12 AND shards.expires_at >= $7)"
    } else {
        ""
    };
    let statement = Statement::new(format!(
        "UPDATE live_lessons SET status = $1, reason = $2, \
             endpoints = COALESCE($3, endpoints), handle = COALESCE($4, handle), \
             agent = COALESCE(agent, $5), \
             observed_generation = CASE WHEN $6 THEN generation \
                                   ELSE observed_generation END, \
             updated_at = $7 WHERE id = $8 AND generation = $9 AND deleting = 0{fenced} \
             RETURNING {LESSON_COLUMNS}"
    ))
    .bind(observation.status.as_str())
    .bind(observation.reason)
    .bind(endpoints)
    .bind(observation.handle)
    .bind(observation.agent)
    .bind(observation.status.is_settled())
    .bind(now.0)
    .bind(id.to_string())
    .bind(generation as i64);
    Ok(match fence {
        Some(fence) => statement
            .bind(fence.holder.as_str())
            .bind(shard_of(id))
            .bind(fence.epoch as i64),
        None => statement,
    })
}
