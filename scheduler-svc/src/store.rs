//! The durable state: sessions, live lessons, their event log and agents' instance ids, in an
//! SQLite file through sqlx (WAL, migrations embedded in the binary).
//!
//! Writes go to one task that owns the only writing connection (SQLite has a single writer
//! anyway) and commits whatever jobs are waiting together (group commit); callers get their
//! result only after the commit. Reads use a pool of read-only connections, which WAL lets run
//! beside the writer.
//!
//! Every hot-path operation is one SQL statement, so it is atomic without BEGIN/COMMIT round
//! trips: limits are checked inside the insert that they guard, the unique key on
//! `(session_id, lesson_slug)` makes concurrent identical requests meet on one row, and updates
//! are conditional on the generation the caller saw. Triggers (see the migration) record the
//! event of every transition and carry activity to the session inside the same statement.
//! Every function that changes a live lesson returns its new row, so callers can publish it to
//! watchers without reading it again.

use std::net::IpAddr;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection as _, Row};
use tokio::sync::{mpsc, oneshot};

use crate::error::Error;
use crate::model::{
    EndpointInfo, Event, LiveLesson, LiveLessonId, Millis, Session, SessionId, Status,
};

type Result<T, E = Error> = std::result::Result<T, E>;

const LESSON_COLUMNS: &str = "id, session_id, lesson_slug, stage, generation, \
     observed_generation, status, reason, deleting, agent, handle, endpoints, persistent, \
     created_at, last_active";

const SESSION_COLUMNS: &str = "id, source_ip, persistent, created_at, last_active";

/// Live lessons per status and live sessions (see [`Store::counts`]).
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// (status as stored, count).
    pub statuses: Vec<(String, i64)>,
    /// Sessions not expired.
    pub sessions: i64,
    /// Of which persistent.
    pub persistent_sessions: i64,
}

/// Handle to the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    /// Hands write jobs to the writer task, which owns the only writing connection.
    writer: mpsc::UnboundedSender<Job>,
    /// Read-only connections for queries.
    reader: SqlitePool,
    /// Ends when the writer task has stopped (after every sender is gone).
    writer_done: Arc<tokio::sync::Mutex<Option<oneshot::Receiver<()>>>>,
}

/// What a write job hands back after it ran: a function that delivers its result once the
/// batch's commit succeeded (`None`) or failed (`Some`).
type Deliver = Box<dyn FnOnce(Option<&sqlx::Error>) + Send>;

/// A write job: statements to run on the writing connection inside the current batch.
type Job = Box<
    dyn for<'c> FnOnce(
            &'c mut SqliteConnection,
        ) -> Pin<Box<dyn Future<Output = Deliver> + Send + 'c>>
        + Send,
>;

/// Most jobs committed together.
const MAX_BATCH: usize = 512;

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
    /// Opens (creating if needed) the database file and applies migrations.
    pub async fn open(path: &Path) -> Result<Store> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // With WAL, NORMAL syncs at checkpoints: a power cut may lose the last transactions
            // but never corrupts the file, and commits stay fast.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let mut connection = SqliteConnection::connect_with(&options).await?;
        sqlx::migrate!("./migrations").run(&mut connection).await?;
        // No ping before each acquire: these are in-process connections to a local file, and a
        // ping would be one more round trip to the connection's worker thread per query.
        let reader = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .max_connections(4)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options.read_only(true))
            .await?;
        let (writer, jobs) = mpsc::unbounded_channel();
        // The writer runs on a thread of its own: every statement is a round trip to sqlx's
        // SQLite thread, and on the shared runtime each reply would wait behind API work for a
        // worker; here the reply wakes the writer directly.
        let (done_tx, done_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(write_loop(connection, jobs)),
                    Err(err) => tracing::error!(error = %err, "cannot start the store writer"),
                }
                let _ = done_tx.send(());
            })
            .map_err(|err| Error::Commit(format!("cannot start the store writer: {err}")))?;

        Ok(Store {
            writer,
            reader,
            writer_done: Arc::new(tokio::sync::Mutex::new(Some(done_rx))),
        })
    }

    /// Closes the readers and waits (boundedly) for the writer to finish the jobs it has; it
    /// stops once every clone of this store is dropped. Whatever is cut short is safe: every
    /// committed batch is durable and nothing else was promised.
    pub async fn close(self) {
        self.reader.close().await;
        let done = self.writer_done.clone();
        drop(self);
        if let Some(stopped) = done.lock().await.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), stopped).await;
        }
    }

    /// Runs `job` on the writing connection, in the next batch, and returns its result once
    /// the batch is committed.
    async fn write<T, F>(&self, job: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(
                &'c mut SqliteConnection,
            ) -> Pin<Box<dyn Future<Output = Result<T>> + Send + 'c>>
            + Send
            + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            Box::pin(async move {
                let result = job(conn).await;
                let deliver: Deliver = Box::new(move |commit: Option<&sqlx::Error>| {
                    let result = match commit {
                        None => result,
                        Some(err) => Err(Error::Commit(err.to_string())),
                    };
                    let _ = tx.send(result);
                });
                deliver
            })
        });
        self.writer.send(job).map_err(|_| Error::WriterStopped)?;
        rx.await.map_err(|_| Error::WriterStopped)?
    }

    // ----- sessions -----

    /// Records a new session for `ip`, unless the address already holds `limit` live sessions
    /// (0 = no limit). One statement: the check and the insert cannot be split by another
    /// writer.
    pub async fn create_session(&self, ip: IpAddr, limit: u32, now: Millis) -> Result<Session> {
        let session = Session {
            id: SessionId::new(),
            source_ip: ip,
            persistent: false,
            created_at: now,
            last_active: now,
        };
        let done = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO sessions (id, source_ip, persistent, created_at, last_active) \
             SELECT ?1, ?2, 0, ?3, ?3 WHERE ?4 = 0 OR \
             (SELECT COUNT(*) FROM sessions WHERE source_ip = ?2 AND expired = 0) < ?4",
                    )
                    .bind(session.id.to_string())
                    .bind(ip.to_string())
                    .bind(now.0)
                    .bind(limit)
                    .execute(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        if done.rows_affected() == 0 {
            return Err(Error::TooManySessions { ip, limit });
        }
        Ok(session)
    }

    /// A live (unexpired) session.
    pub async fn session(&self, id: SessionId) -> Result<Session> {
        let row = sqlx::query(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ? AND expired = 0"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.reader)
        .await?;
        row.map(|row| session_from_row(&row))
            .transpose()?
            .ok_or(Error::SessionNotFound(id))
    }

    /// Every live session, oldest first.
    pub async fn sessions(&self) -> Result<Vec<Session>> {
        let rows = sqlx::query(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE expired = 0 ORDER BY created_at, id"
        ))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(session_from_row).collect()
    }

    /// Sets or clears a session's persistent flag (a trigger copies it to its live lessons).
    pub async fn persist_session(&self, id: SessionId, persistent: bool) -> Result<Session> {
        let row = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE sessions SET persistent = ? WHERE id = ? AND expired = 0 \
             RETURNING {SESSION_COLUMNS}"
                    ))
                    .bind(persistent)
                    .bind(id.to_string())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        row.map(|row| session_from_row(&row))
            .transpose()?
            .ok_or(Error::SessionNotFound(id))
    }

    // ----- live lessons: requests -----

    /// Asks for `lesson` at `stage` in `session`: creates the live lesson, or touches it, or
    /// gives it a new generation (stage change, retry after FAILED).
    ///
    /// The common cases (create, ask again) are one statement: an insert that also checks the
    /// session and the limit, and on the unique key's conflict only touches the existing row.
    pub async fn request_live_lesson(
        &self,
        session: SessionId,
        lesson: &str,
        stage: u32,
        limit: u32,
        now: Millis,
    ) -> Result<(LiveLesson, Requested)> {
        let id = LiveLessonId::new();
        let lesson = lesson.to_owned();
        let row = self
            .write(move |conn| {
                Box::pin(async move { sqlx::query(&format!(
            "INSERT INTO live_lessons (id, session_id, lesson_slug, stage, generation, status, \
             reason, persistent, created_at, last_active, updated_at) \
             SELECT ?1, s.id, ?3, ?4, 1, 'PENDING', 'requested', s.persistent, ?5, ?5, ?5 \
             FROM sessions s WHERE s.id = ?2 AND s.expired = 0 AND (?6 = 0 \
               OR (SELECT COUNT(*) FROM live_lessons WHERE session_id = ?2) < ?6 \
               OR EXISTS (SELECT 1 FROM live_lessons WHERE session_id = ?2 AND lesson_slug = ?3)) \
             ON CONFLICT (session_id, lesson_slug) DO UPDATE SET last_active = excluded.last_active \
             RETURNING {LESSON_COLUMNS}"
        ))
        .bind(id.to_string())
        .bind(session.to_string())
        .bind(lesson.to_owned())
        .bind(stage)
        .bind(now.0)
        .bind(limit)
        .fetch_optional(&mut *conn)
        .await.map_err(Error::from) })
            })
            .await?;
        let Some(row) = row else {
            // Nothing inserted or touched: say which check refused it.
            self.session(session).await?;
            return Err(Error::TooManyLiveLessons { session, limit });
        };
        let current = lesson_from_row(&row)?;
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
        let row = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE live_lessons SET last_active = ?1 WHERE id = ?2 AND \
             session_id IN (SELECT id FROM sessions WHERE expired = 0) \
             RETURNING {LESSON_COLUMNS}"
                    ))
                    .bind(now.0)
                    .bind(id.to_string())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?
            .ok_or(Error::LiveLessonNotFound(id))?;
        self.change_stage(lesson_from_row(&row)?, stage, now).await
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
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
            "UPDATE live_lessons SET stage = ?1, generation = generation + 1, status = ?2, \
             reason = ?3, updated_at = ?4 WHERE id = ?5 AND generation = ?6 AND deleting = 0 \
             RETURNING {LESSON_COLUMNS}"
        ))
        .bind(stage)
        .bind(status.as_str())
        .bind(detail.to_owned())
        .bind(now.0)
        .bind(current.id.to_string())
        .bind(current.generation as i64)
        .fetch_optional(&mut *conn)
        .await.map_err(Error::from)
                })
            })
            .await?;
        match row {
            Some(row) => Ok((lesson_from_row(&row)?, Requested::Changed)),
            None => Err(Error::Busy {
                id: current.id,
                status: current.status,
            }),
        }
    }

    /// Records activity on a live lesson (and, through a trigger, on its session).
    pub async fn heartbeat(&self, id: LiveLessonId, now: Millis) -> Result<LiveLesson> {
        let row = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE live_lessons SET last_active = ?1 WHERE id = ?2 AND deleting = 0 \
             RETURNING {LESSON_COLUMNS}"
                    ))
                    .bind(now.0)
                    .bind(id.to_string())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?
            .ok_or(Error::LiveLessonNotFound(id))?;
        lesson_from_row(&row)
    }

    /// Marks a live lesson for removal (desired state: absent) with a new generation.
    /// `detail` says why ("deleted", "killed by an operator"). Deleting twice is not an error.
    pub async fn mark_deleting(
        &self,
        id: LiveLessonId,
        detail: &str,
        now: Millis,
    ) -> Result<LiveLesson> {
        let detail = detail.to_owned();
        let row = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE live_lessons SET deleting = 1, generation = generation + 1, \
             status = 'TERMINATING', reason = ?1, updated_at = ?2 WHERE id = ?3 AND deleting = 0 \
             RETURNING {LESSON_COLUMNS}"
                    ))
                    .bind(detail.to_owned())
                    .bind(now.0)
                    .bind(id.to_string())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        match row {
            Some(row) => lesson_from_row(&row),
            None => self.live_lesson(id).await,
        }
    }

    // ----- live lessons: reads -----

    /// One live lesson.
    pub async fn live_lesson(&self, id: LiveLessonId) -> Result<LiveLesson> {
        self.find_live_lesson(id)
            .await?
            .ok_or(Error::LiveLessonNotFound(id))
    }

    /// The live lesson if it still exists.
    pub async fn find_live_lesson(&self, id: LiveLessonId) -> Result<Option<LiveLesson>> {
        let row = sqlx::query(&format!(
            "SELECT {LESSON_COLUMNS} FROM live_lessons WHERE id = ?"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.reader)
        .await?;
        row.map(|row| lesson_from_row(&row)).transpose()
    }

    /// A session's live lessons, oldest first.
    pub async fn session_live_lessons(&self, session: SessionId) -> Result<Vec<LiveLesson>> {
        let rows = sqlx::query(&format!(
            "SELECT {LESSON_COLUMNS} FROM live_lessons WHERE session_id = ? \
             ORDER BY created_at, id"
        ))
        .bind(session.to_string())
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// Every live lesson matching the filter, oldest first.
    pub async fn live_lessons(&self, filter: &LessonFilter) -> Result<Vec<LiveLesson>> {
        let rows = sqlx::query(&format!(
            "SELECT {LESSON_COLUMNS} FROM live_lessons \
             WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR lesson_slug = ?2) \
             AND (?3 IS NULL OR agent = ?3) ORDER BY created_at, id"
        ))
        .bind(filter.status.map(Status::as_str))
        .bind(filter.lesson_slug.as_deref())
        .bind(filter.agent.as_deref())
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// How many live lessons there are per status, and how many live (not expired) sessions,
    /// persistent ones apart: what the metrics report at each scrape.
    pub async fn counts(&self) -> Result<Counts> {
        let statuses: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, COUNT(*) FROM live_lessons GROUP BY status")
                .fetch_all(&self.reader)
                .await?;
        let (sessions, persistent): (i64, i64) = sqlx::query_as(
            "SELECT COUNT(*), COALESCE(SUM(persistent), 0) FROM sessions WHERE expired = 0",
        )
        .fetch_one(&self.reader)
        .await?;
        Ok(Counts {
            statuses,
            sessions,
            persistent_sessions: persistent,
        })
    }

    /// Ids of every live lesson the reconciler still has work on (used at start-up to resume).
    pub async fn unsettled(&self) -> Result<Vec<LiveLessonId>> {
        let rows: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM live_lessons WHERE deleting = 1 OR observed_generation != generation \
             OR status NOT IN ('READY', 'FAILED') ORDER BY created_at",
        )
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(|id| parse_lesson_id(id)).collect()
    }

    /// Ids of the live lessons placed on `agent`.
    pub async fn on_agent(&self, agent: &str) -> Result<Vec<LiveLessonId>> {
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT id FROM live_lessons WHERE agent = ? ORDER BY created_at")
                .bind(agent)
                .fetch_all(&self.reader)
                .await?;
        rows.iter().map(|id| parse_lesson_id(id)).collect()
    }

    /// How many live lessons each agent holds.
    pub async fn agent_loads(&self) -> Result<Vec<(String, u32)>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT agent, COUNT(*) FROM live_lessons WHERE agent IS NOT NULL GROUP BY agent",
        )
        .fetch_all(&self.reader)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(agent, n)| (agent, u32::try_from(n).unwrap_or(u32::MAX)))
            .collect())
    }

    /// A live lesson's events, oldest first.
    pub async fn events(&self, id: LiveLessonId) -> Result<Vec<Event>> {
        let rows = sqlx::query(
            "SELECT seq, live_lesson_id, at, status, generation, stage, detail FROM events \
             WHERE live_lesson_id = ? ORDER BY seq",
        )
        .bind(id.to_string())
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(Event {
                    seq: row.try_get("seq")?,
                    live_lesson_id: parse_lesson_id(&row.try_get::<String, _>("live_lesson_id")?)?,
                    at: Millis(row.try_get("at")?),
                    status: parse_status(&row.try_get::<String, _>("status")?)?,
                    generation: row.try_get::<i64, _>("generation")? as u64,
                    stage: row.try_get("stage")?,
                    detail: row.try_get("detail")?,
                })
            })
            .collect()
    }

    // ----- live lessons: the reconciler's writes -----

    /// Records what the reconciler observed for `generation` (placing the live lesson if the
    /// observation names an agent). Returns `None`, changing nothing, when the live lesson is
    /// gone or its desired state moved on to a newer generation: a stale worker can never
    /// overwrite newer intent. A trigger records an event when the status changes.
    pub async fn observe(
        &self,
        id: LiveLessonId,
        generation: u64,
        observation: Observation,
        now: Millis,
    ) -> Result<Option<LiveLesson>> {
        let endpoints = match &observation.endpoints {
            Some(endpoints) => Some(
                serde_json::to_string(endpoints)
                    .map_err(|err| Error::Corrupt(format!("endpoints do not serialise: {err}")))?,
            ),
            None => None,
        };
        let row = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE live_lessons SET status = ?1, reason = ?2, \
             endpoints = COALESCE(?3, endpoints), handle = COALESCE(?4, handle), \
             agent = COALESCE(agent, ?5), \
             observed_generation = CASE WHEN ?6 THEN generation ELSE observed_generation END, \
             updated_at = ?7 WHERE id = ?8 AND generation = ?9 AND deleting = 0 \
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
                    .bind(generation as i64)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        row.map(|row| lesson_from_row(&row)).transpose()
    }

    /// Forgets a live lesson whose objects are gone; triggers record the final event and delete
    /// its session when the session expired and this was its last live lesson.
    pub async fn forget(&self, id: LiveLessonId) -> Result<()> {
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query("DELETE FROM live_lessons WHERE id = ?")
                    .bind(id.to_string())
                    .execute(&mut *conn)
                    .await
                    .map_err(Error::from)
            })
        })
        .await?;
        Ok(())
    }

    // ----- the reaper -----

    /// Marks for removal every live lesson idle since before `cutoff` whose session is not
    /// persistent; returns them.
    pub async fn expire_live_lessons(
        &self,
        cutoff: Millis,
        now: Millis,
    ) -> Result<Vec<LiveLesson>> {
        let rows = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE live_lessons SET deleting = 1, generation = generation + 1, \
             status = 'TERMINATING', reason = 'expired: idle past the live lesson TTL', \
             updated_at = ?1 WHERE deleting = 0 AND persistent = 0 AND last_active < ?2 \
             RETURNING {LESSON_COLUMNS}"
                    ))
                    .bind(now.0)
                    .bind(cutoff.0)
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// Expires every non-persistent session idle since before `cutoff`, marks its live lessons
    /// for removal and returns them; sessions left without live lessons are deleted at once.
    ///
    /// Three statements with no transaction around them: each is idempotent and the next tick
    /// redoes whatever a crash interrupted (expired sessions accept no requests meanwhile).
    pub async fn expire_sessions(&self, cutoff: Millis, now: Millis) -> Result<Vec<LiveLesson>> {
        let rows = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "UPDATE sessions SET expired = 1 WHERE expired = 0 AND persistent = 0 \
                         AND last_active < ?",
                    )
                    .bind(cutoff.0)
                    .execute(&mut *conn)
                    .await?;
                    let rows = sqlx::query(&format!(
                        "UPDATE live_lessons SET deleting = 1, generation = generation + 1, \
                         status = 'TERMINATING', reason = 'expired: session idle past its TTL', \
                         updated_at = ?1 WHERE deleting = 0 \
                         AND session_id IN (SELECT id FROM sessions WHERE expired = 1) \
                         RETURNING {LESSON_COLUMNS}"
                    ))
                    .bind(now.0)
                    .fetch_all(&mut *conn)
                    .await?;
                    sqlx::query(
                        "DELETE FROM sessions WHERE expired = 1 \
                         AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = sessions.id)",
                    )
                    .execute(&mut *conn)
                    .await?;
                    Ok(rows)
                })
            })
            .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// Deletes events of live lessons that no longer exist, older than `cutoff`.
    pub async fn prune_events(&self, cutoff: Millis) -> Result<u64> {
        let done = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "DELETE FROM events WHERE at < ? \
             AND live_lesson_id NOT IN (SELECT id FROM live_lessons)",
                    )
                    .bind(cutoff.0)
                    .execute(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        Ok(done.rows_affected())
    }

    /// Whether a live lesson with this id exists.
    pub async fn exists(&self, id: &str) -> Result<bool> {
        let found: Option<i64> = sqlx::query_scalar("SELECT 1 FROM live_lessons WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        Ok(found.is_some())
    }

    // ----- agents -----

    /// The instance id an agent reported last, if any.
    pub async fn agent_instance(&self, agent: &str) -> Result<Option<String>> {
        Ok(
            sqlx::query_scalar("SELECT instance_id FROM agents WHERE name = ?")
                .bind(agent)
                .fetch_optional(&self.reader)
                .await?,
        )
    }

    /// Records the instance id an agent reported.
    pub async fn set_agent_instance(&self, agent: &str, instance: &str, now: Millis) -> Result<()> {
        let (agent, instance) = (agent.to_owned(), instance.to_owned());
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO agents (name, instance_id, seen_at) VALUES (?, ?, ?) \
             ON CONFLICT (name) DO UPDATE SET instance_id = excluded.instance_id, \
             seen_at = excluded.seen_at",
                )
                .bind(agent.to_owned())
                .bind(instance.to_owned())
                .bind(now.0)
                .execute(&mut *conn)
                .await
                .map_err(Error::from)
            })
        })
        .await?;
        Ok(())
    }
}

/// The writer task: takes every job waiting, runs them one after another in one transaction
/// (group commit), then delivers their results. Under load this turns many small commits into
/// few, and the connection never waits for a pool hand-over between jobs. A failing statement
/// only fails its own job (SQLite rolls back just that statement); a failing commit fails the
/// whole batch.
async fn write_loop(mut connection: SqliteConnection, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while jobs.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let grouped = batch.len() > 1;
        let begin = if grouped {
            sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut connection)
                .await
                .err()
        } else {
            None
        };
        let mut delivers = Vec::with_capacity(batch.len());
        for job in batch.drain(..) {
            delivers.push(job(&mut connection).await);
        }
        let commit = match begin {
            Some(err) => Some(err),
            None if grouped => sqlx::query("COMMIT").execute(&mut connection).await.err(),
            None => None,
        };
        if let Some(err) = &commit {
            tracing::error!(error = %err, jobs = delivers.len(), "store commit failed");
            let _ = sqlx::query("ROLLBACK").execute(&mut connection).await;
        }
        for deliver in delivers {
            deliver(commit.as_ref());
        }
    }
    let _ = connection.close().await;
}

fn parse_lesson_id(text: &str) -> Result<LiveLessonId> {
    LiveLessonId::from_str(text).map_err(|err| Error::Corrupt(err.to_string()))
}

fn parse_status(text: &str) -> Result<Status> {
    Status::from_str(text).map_err(Error::Corrupt)
}

fn session_from_row(row: &SqliteRow) -> Result<Session> {
    let id: String = row.try_get("id")?;
    let ip: String = row.try_get("source_ip")?;
    Ok(Session {
        id: SessionId::from_str(&id).map_err(|err| Error::Corrupt(err.to_string()))?,
        source_ip: ip
            .parse()
            .map_err(|_| Error::Corrupt(format!("bad source ip `{ip}`")))?,
        persistent: row.try_get("persistent")?,
        created_at: Millis(row.try_get("created_at")?),
        last_active: Millis(row.try_get("last_active")?),
    })
}

fn lesson_from_row(row: &SqliteRow) -> Result<LiveLesson> {
    let id: String = row.try_get("id")?;
    let session: String = row.try_get("session_id")?;
    let endpoints: String = row.try_get("endpoints")?;
    Ok(LiveLesson {
        id: parse_lesson_id(&id)?,
        session_id: SessionId::from_str(&session).map_err(|err| Error::Corrupt(err.to_string()))?,
        lesson_slug: row.try_get("lesson_slug")?,
        stage: row.try_get("stage")?,
        generation: row.try_get::<i64, _>("generation")? as u64,
        observed_generation: row.try_get::<i64, _>("observed_generation")? as u64,
        status: parse_status(&row.try_get::<String, _>("status")?)?,
        reason: row.try_get("reason")?,
        deleting: row.try_get("deleting")?,
        agent: row.try_get("agent")?,
        handle: row.try_get("handle")?,
        endpoints: serde_json::from_str(&endpoints)
            .map_err(|err| Error::Corrupt(format!("endpoints of {id}: {err}")))?,
        persistent: row.try_get("persistent")?,
        created_at: Millis(row.try_get("created_at")?),
        last_active: Millis(row.try_get("last_active")?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("t.db")).await.unwrap();
        (dir, store)
    }

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn session_limit_per_ip() {
        let (_dir, store) = store().await;
        let now = Millis(1_000);
        store.create_session(IP, 2, now).await.unwrap();
        store.create_session(IP, 2, now).await.unwrap();
        let err = store.create_session(IP, 2, now).await.unwrap_err();
        assert!(
            matches!(err, Error::TooManySessions { limit: 2, .. }),
            "{err}"
        );
        assert_eq!(store.sessions().await.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn request_creates_touches_changes_and_retries() {
        let (_dir, store) = store().await;
        let session = store.create_session(IP, 0, Millis(1)).await.unwrap();
        let (first, outcome) = store
            .request_live_lesson(session.id, "intro", 0, 3, Millis(2))
            .await
            .unwrap();
        assert_eq!(outcome, Requested::Created);
        assert_eq!((first.status, first.generation), (Status::Pending, 1));

        let (again, outcome) = store
            .request_live_lesson(session.id, "intro", 0, 3, Millis(3))
            .await
            .unwrap();
        assert_eq!(outcome, Requested::Touched);
        assert_eq!((again.id, again.last_active), (first.id, Millis(3)));

        // Still PENDING: a stage change must wait.
        let err = store
            .request_live_lesson(session.id, "intro", 1, 3, Millis(4))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Busy { .. }), "{err}");

        let ready = Observation {
            endpoints: Some(vec![]),
            handle: Some(b"h".to_vec()),
            agent: Some("a".into()),
            ..Observation::status(Status::Ready, "ready")
        };
        let observed = store
            .observe(first.id, 1, ready, Millis(5))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(observed.observed_generation, 1);
        assert_eq!(observed.agent.as_deref(), Some("a"));
        assert!(!observed.needs_work());

        let (changed, outcome) = store.set_stage(first.id, 1, Millis(6)).await.unwrap();
        assert_eq!(outcome, Requested::Changed);
        assert_eq!(
            (changed.status, changed.generation, changed.stage),
            (Status::Configuring, 2, 1)
        );
        // A stale observation for generation 1 is dropped.
        let stale = Observation::status(Status::Failed, "late");
        assert!(
            store
                .observe(first.id, 1, stale, Millis(7))
                .await
                .unwrap()
                .is_none()
        );
        let events = store.events(first.id).await.unwrap();
        let statuses: Vec<_> = events.iter().map(|e| e.status).collect();
        assert_eq!(
            statuses,
            [Status::Pending, Status::Ready, Status::Configuring]
        );
    }

    #[tokio::test]
    async fn live_lesson_limit_and_expiry() {
        let (_dir, store) = store().await;
        let session = store.create_session(IP, 0, Millis(1)).await.unwrap();
        store
            .request_live_lesson(session.id, "a", 0, 1, Millis(2))
            .await
            .unwrap();
        let err = store
            .request_live_lesson(session.id, "b", 0, 1, Millis(2))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::TooManyLiveLessons { .. }), "{err}");

        let expired = store.expire_sessions(Millis(10), Millis(11)).await.unwrap();
        assert_eq!(expired.len(), 1);
        assert!(expired[0].deleting);
        assert!(matches!(
            store.session(session.id).await,
            Err(Error::SessionNotFound(_))
        ));
        store.forget(expired[0].id).await.unwrap();
        // The expired session went with its last live lesson.
        assert!(store.sessions().await.unwrap().is_empty());
        let raw: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sessions")
            .fetch_one(&store.reader)
            .await
            .unwrap();
        assert_eq!(raw, 0);
    }
}
