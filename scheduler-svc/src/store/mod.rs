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

mod agents;
mod audit;
mod events;
mod live_lessons;
mod reaper;
mod sessions;

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
use crate::model::{LiveLesson, LiveLessonId, Millis, Session, SessionId, Status};

type Result<T, E = Error> = std::result::Result<T, E>;

const LESSON_COLUMNS: &str = "id, session_id, lesson_slug, stage, generation, \
     observed_generation, status, reason, deleting, agent, handle, endpoints, persistent, \
     created_at, last_active";

/// The one statement that marks live lessons for removal: desired state absent, a new
/// generation, TERMINATING with `?1` as the reason at time `?2`. `condition` says which live
/// lessons, with its parameters numbered from `?3`.
fn mark_for_deletion(condition: &str) -> String {
    format!(
        "UPDATE live_lessons SET deleting = 1, generation = generation + 1, \
         status = 'TERMINATING', reason = ?1, updated_at = ?2 WHERE deleting = 0 AND ({condition}) \
         RETURNING {LESSON_COLUMNS}"
    )
}

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

pub use audit::AuditEntry;
pub use live_lessons::{LessonFilter, Observation, Requested};
pub use sessions::network;

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
    use std::net::IpAddr;

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
        store.create_session(IP, [1; 32], 2, now).await.unwrap();
        store.create_session(IP, [2; 32], 2, now).await.unwrap();
        let err = store.create_session(IP, [3; 32], 2, now).await.unwrap_err();
        assert!(
            matches!(err, Error::TooManySessions { limit: 2, .. }),
            "{err}"
        );
        assert_eq!(store.sessions().await.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn request_creates_touches_changes_and_retries() {
        let (_dir, store) = store().await;
        let session = store
            .create_session(IP, [4; 32], 0, Millis(1))
            .await
            .unwrap();
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
        let session = store
            .create_session(IP, [5; 32], 0, Millis(1))
            .await
            .unwrap();
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
