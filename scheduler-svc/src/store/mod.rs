//! The durable state: sessions, live lessons, their event log, placement records and agents'
//! instance ids, in an SQLite file (the default: one scheduler per file) or a PostgreSQL
//! database (which several scheduler replicas may share), through sqlx with migrations embedded
//! in the binary (`migrations/` for SQLite, `migrations-postgres/` for PostgreSQL).
//!
//! SQLite: writes go to one task that owns the only writing connection (SQLite has a single
//! writer anyway) and commits whatever jobs are waiting together (group commit); callers get
//! their result only after the commit. Reads use a pool of read-only connections, which WAL lets
//! run beside the writer. A lock file beside the database keeps a second process off it.
//! PostgreSQL: every write job is one transaction on a pooled connection; reads share the pool.
//!
//! Every hot-path operation is one SQL statement, so it is atomic without BEGIN/COMMIT round
//! trips: limits are checked inside the insert that they guard, the unique key on
//! `(session_id, lesson_slug)` makes concurrent identical requests meet on one row, and updates
//! are conditional on the generation the caller saw. On PostgreSQL, whose transactions run
//! concurrently, a limit's insert first takes a lock that serialises it with the writes it
//! counts ([`backend::Conn::lock_session`], [`backend::Conn::lock_name`]). Triggers (see the
//! migrations) record the event of every transition and carry activity to the session inside
//! the same statement. Every function that changes a live lesson returns its new row, so
//! callers can publish it to watchers without reading it again.
//!
//! Statements are written once for both backends ([`backend`] binds and decodes them).

mod agents;
mod audit;
mod backend;
mod changes;
mod checks;
mod cluster;
mod effects;
mod events;
mod heard;
mod leases;
mod live_lessons;
mod placements;
mod pools;
mod reaper;
mod sessions;
mod shards;
mod traffic;
mod written;

use std::fmt;
use std::fs::File;
use std::future::Future;
use std::io::{Read as _, Seek as _, Write as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{ConnectOptions as _, Connection as _};
use tokio::sync::{mpsc, oneshot};

use self::backend::{Conn, Pool, Row, Statement};
use self::effects::Effects;
use self::heard::Heard;
pub use self::traffic::{Traffic, TrafficCounts};
use self::written::Written;
use crate::error::Error;
use crate::model::{LiveLesson, LiveLessonId, Millis, Session, SessionId, Status};

type Result<T, E = Error> = std::result::Result<T, E>;

const LESSON_COLUMNS: &str = "id, session_id, lesson_slug, stage, generation, \
     observed_generation, status, reason, deleting, agent, handle, endpoints, persistent, \
     created_at, last_active, pool_session, revision";

/// The one statement that marks live lessons for removal: desired state absent, a new
/// generation, TERMINATING with `$1` as the reason at time `$2`. `condition` says which live
/// lessons, with its parameters numbered from `$3`.
fn mark_for_deletion(condition: &str) -> String {
    format!(
        "UPDATE live_lessons SET deleting = 1, generation = generation + 1, \
         status = 'TERMINATING', reason = $1, updated_at = $2 WHERE deleting = 0 AND ({condition}) \
         RETURNING {LESSON_COLUMNS}"
    )
}

const SESSION_COLUMNS: &str = "id, source_ip, persistent, created_at, last_active";

/// Where the state lives: the `database` setting. A `postgres://` or `postgresql://` URL
/// selects PostgreSQL; anything else is the path of an SQLite file (created if missing).
#[derive(Clone, PartialEq, Eq)]
pub enum Database {
    /// An SQLite file: one scheduler process at a time.
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (libpq's URL form: user, password, host or `host=` for a
    /// unix socket directory, port, database, `sslmode`...).
    Postgres(String),
}

/// Why a PostgreSQL connection to another machine is not safe from the network between (None:
/// it is verified TLS, or it never leaves the machine: a unix socket or a loopback address).
fn unverified(options: &PgConnectOptions) -> Option<&'static str> {
    use sqlx::postgres::PgSslMode;
    let host = options.get_host();
    let local = options.get_socket().is_some()
        || host.starts_with('/')
        || host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    match options.get_ssl_mode() {
        _ if local => None,
        PgSslMode::VerifyCa | PgSslMode::VerifyFull => None,
        PgSslMode::Require => Some("is encrypted but the server's certificate is not verified"),
        PgSslMode::Disable | PgSslMode::Allow | PgSslMode::Prefer => {
            Some("may be plaintext (sslmode is disable, allow or prefer)")
        }
    }
}

impl Database {
    /// Reads the setting's text.
    pub fn parse(text: &str) -> Database {
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            Database::Postgres(text.to_owned())
        } else {
            Database::Sqlite(PathBuf::from(text))
        }
    }
}

impl From<&Path> for Database {
    fn from(path: &Path) -> Self {
        Database::Sqlite(path.to_owned())
    }
}

impl From<&PathBuf> for Database {
    fn from(path: &PathBuf) -> Self {
        Database::Sqlite(path.clone())
    }
}

impl From<&Database> for Database {
    fn from(database: &Database) -> Self {
        database.clone()
    }
}

impl<'de> Deserialize<'de> for Database {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        Ok(Database::parse(&String::deserialize(de)?))
    }
}

/// Shows the database without the URL's password, so configurations can be logged.
impl fmt::Display for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Database::Sqlite(path) => write!(f, "{}", path.display()),
            Database::Postgres(url) => {
                // postgres://user:password@host/... → postgres://user:***@host/...
                let redacted = url.split_once("://").and_then(|(scheme, rest)| {
                    let authority = rest.split('/').next().unwrap_or(rest);
                    let (userinfo, _) = authority.rsplit_once('@')?;
                    let (user, _) = userinfo.split_once(':')?;
                    let after = &rest[userinfo.len()..];
                    Some(format!("{scheme}://{user}:***{after}"))
                });
                f.write_str(redacted.as_deref().unwrap_or(url))
            }
        }
    }
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Database::Sqlite(_) => write!(f, "Sqlite({self})"),
            Database::Postgres(_) => write!(f, "Postgres({self})"),
        }
    }
}

/// Live lessons per status and live sessions (see [`Store::counts`]).
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// (status as stored, count).
    pub statuses: Vec<(String, i64)>,
    /// Sessions not expired.
    pub sessions: i64,
    /// Of which persistent.
    pub persistent_sessions: i64,
    /// Warm pools: unclaimed members by pool and status, and each pool's base size.
    pub pools: Vec<PoolCount>,
}

/// Handle to the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    /// Where write jobs go.
    writer: Writer,
    /// Connections for queries (read-only ones on SQLite).
    reader: Pool,
    /// Ends when the SQLite writer task has stopped (after every sender is gone).
    writer_done: Arc<tokio::sync::Mutex<Option<oneshot::Receiver<()>>>>,
    /// SQLite: what the writer knows of the rows it wrote (live lessons, session tokens), so
    /// hot reads need no SQLite connection ([`written`]). `None` on PostgreSQL.
    written: Option<Arc<Written>>,
    /// PostgreSQL: what this replica heard of every replica's writes ([`heard`]), answering
    /// while a listener follows the notifications. `None` on SQLite.
    heard: Option<Arc<Heard>>,
    /// What it asked of the database ([`traffic`]).
    traffic: Arc<Traffic>,
}

/// The write side of each backend.
#[derive(Clone)]
enum Writer {
    /// Hands write jobs to the writer task, which owns the only writing connection.
    Sqlite(mpsc::UnboundedSender<Job>),
    /// Hands write jobs to the PostgreSQL writer tasks ([`pg_write_loop`]), which commit
    /// whatever is waiting together, on connections of this pool (the reader's).
    Postgres(mpsc::UnboundedSender<PgJob>, sqlx::PgPool),
}

/// A write job for a PostgreSQL writer task: statements to run inside the current batch's
/// transaction, or `None` when the batch could not begin (or was aborted before it) and the
/// job must not run. What it hands back says whether it succeeded and how to deliver its
/// result once the batch's fate is known.
type PgJob = Box<
    dyn for<'c> FnOnce(
            Option<&'c mut sqlx::PgConnection>,
        ) -> Pin<Box<dyn Future<Output = PgRan> + Send + 'c>>
        + Send,
>;

/// Delivers a PostgreSQL job's result: its batch committed (`None`) or failed (`Some`, why).
type PgDeliver = Box<dyn FnOnce(Option<&str>) + Send>;

/// What a PostgreSQL job hands back to its writer.
struct PgRan {
    /// Delivers its result.
    deliver: PgDeliver,
    /// Whether it succeeded: a failed job is rolled back to its savepoint.
    ok: bool,
}

/// What a write job hands back after it ran (or was refused): a function that delivers its
/// result once the batch's commit succeeded (`None`) or failed (`Some`).
type Deliver = Box<dyn FnOnce(Option<&rusqlite::Error>) + Send>;

/// A write job for the SQLite writer: statements to run on the writing connection inside the
/// current batch, or `None` when the batch could not begin and the job must not run.
type Job = Box<
    dyn for<'c> FnOnce(
            Option<&'c mut rusqlite::Connection>,
        ) -> Pin<Box<dyn Future<Output = Ran> + Send + 'c>>
        + Send,
>;

/// What a job hands back to the writer.
struct Ran {
    /// How to deliver its result.
    deliver: Deliver,
    /// What it declared it wrote (for [`Written`]).
    effects: Effects,
    /// Whether it succeeded: a failed job's statements are rolled back (to its savepoint).
    ok: bool,
}

/// What a store function runs on the writing side.
type Work<'c, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'c>>;

/// Most jobs committed together.
const MAX_BATCH: usize = 512;

/// How long a SQLite statement waits for a lock held elsewhere before failing (BUSY). Only
/// our own connections use the file, so a wait is a checkpoint at most.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after a commit the checkpointer copies the SQLite WAL's committed pages into the
/// database file (commits meanwhile are copied with it).
const CHECKPOINT_EVERY: Duration = Duration::from_millis(20);

/// WAL pages at which the writer checkpoints by itself (SQLite's `wal_autocheckpoint`, 1,000
/// by default): the WAL restarts from its beginning only after a checkpoint that copied all of
/// it, which the checkpointer, behind a writer that goes on, rarely sees; the writer's, with
/// most pages already copied, is short. So the WAL stays within 8 MiB of 4 KiB pages.
const WRITER_CHECKPOINT_PAGES: u32 = 2_000;

/// PostgreSQL connections per scheduler: the reconcile workers' and API's writes and reads.
const POSTGRES_CONNECTIONS: u32 = 16;

/// PostgreSQL writer tasks, each committing one batch at a time on a connection of its own:
/// while some commit (waiting for the WAL's flush), another gathers the jobs that came
/// meanwhile.
const POSTGRES_WRITERS: usize = 4;

/// Most jobs one PostgreSQL transaction commits together. Each writing job is a
/// subtransaction, and PostgreSQL caches 64 of them per transaction; beyond that every other
/// session's snapshots must look subtransactions up on disk.
const POSTGRES_MAX_BATCH: usize = 48;

/// How long a call waits for a free PostgreSQL connection (or a new one) before it fails as
/// UNAVAILABLE.
const POSTGRES_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

pub use audit::AuditEntry;
pub use changes::{Change, Changes};
pub use live_lessons::{Fenced, LessonFilter, Observation, Requested};
pub use pools::{Claim, Declined, PoolCount, WarmPool};
pub use sessions::network;
pub use shards::{Fence, Renewal, SHARDS, ShardLease, ShardRow, shard_of};

impl Store {
    /// Opens (creating if needed) the database and applies migrations.
    pub async fn open(database: impl Into<Database>) -> Result<Store> {
        match database.into() {
            Database::Sqlite(path) => Store::open_sqlite(&path, SQLITE_BUSY_TIMEOUT).await,
            Database::Postgres(url) => Store::open_postgres(&url).await,
        }
    }

    /// Opens an SQLite file (refused while another process has it) with the given busy timeout.
    async fn open_sqlite(path: &Path, busy_timeout: Duration) -> Result<Store> {
        let lock = lock_file(path)?;
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // With WAL, NORMAL syncs at checkpoints: a power cut may lose the last transactions
            // but never corrupts the file, and commits stay fast.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(busy_timeout)
            // No per-statement log (slow ones are still warned about): sqlx asks `enabled!` at
            // DEBUG after every statement, and with per-layer filters that leaves stale filter
            // state behind which drops the next events on this thread (tokio-rs/tracing#2519).
            .log_statements(log::LevelFilter::Off);
        let mut migrating = SqliteConnection::connect_with(&options).await?;
        sqlx::migrate!("./migrations").run(&mut migrating).await?;
        migrating.close().await?;
        let connection = open_writer(path, busy_timeout)?;
        // Every row change on the writing connection (triggers' too) is counted, so the cache
        // can tell a job that changed rows it did not declare (see `written`).
        let written = Arc::new(Written::default());
        {
            let written = written.clone();
            connection.update_hook(Some(
                move |action: rusqlite::hooks::Action, _: &str, table: &str, _: i64| {
                    written.changed(table, action == rusqlite::hooks::Action::SQLITE_DELETE)
                },
            ));
        }
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
        // The writer runs on a thread of its own, with its connection: a statement is a call on
        // this thread, not a hand-off to another, and no job waits behind API work for a worker.
        let (done_tx, done_rx) = oneshot::channel();
        let cache = written.clone();
        let traffic = Arc::new(Traffic::default());
        let counted = traffic.clone();
        let (checkpointer, committed) = Checkpointer::start(path, busy_timeout)?;
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(write_loop(
                        connection,
                        jobs,
                        Some(cache),
                        Some(committed),
                        counted,
                    )),
                    Err(err) => {
                        drop(committed);
                        tracing::error!(error = %err, "cannot start the store writer")
                    }
                }
                // It ends now that `committed` is gone with the writer.
                checkpointer.stop();
                // The file is ours until the writer and the checkpointer have closed their
                // connections.
                drop(lock);
                let _ = done_tx.send(());
            })
            .map_err(|err| Error::StoreOpen(format!("cannot start the store writer: {err}")))?;

        Ok(Store {
            writer: Writer::Sqlite(writer),
            reader: Pool::Sqlite(reader, traffic.clone()),
            writer_done: Arc::new(tokio::sync::Mutex::new(Some(done_rx))),
            written: Some(written),
            heard: None,
            traffic,
        })
    }

    /// Connects to PostgreSQL and migrates (sqlx holds an advisory lock while it migrates, so
    /// replicas starting together apply each migration once).
    async fn open_postgres(url: &str) -> Result<Store> {
        let options = PgConnectOptions::from_str(url)?
            .application_name("antidote-scheduler")
            // As for SQLite (see open_sqlite).
            .log_statements(log::LevelFilter::Off);
        if let Some(why) = unverified(&options) {
            tracing::warn!(
                host = options.get_host(),
                "the connection to PostgreSQL {why}: add sslmode=verify-full (and sslrootcert=CA \
                 unless the system's roots sign the server's certificate) to `database`, unless \
                 a mesh encrypts it"
            );
        }
        let pool = PgPoolOptions::new()
            .max_connections(POSTGRES_CONNECTIONS)
            .acquire_timeout(POSTGRES_ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await?;
        sqlx::migrate!("./migrations-postgres").run(&pool).await?;
        let (writer, jobs) = mpsc::unbounded_channel();
        let jobs = Arc::new(tokio::sync::Mutex::new(jobs));
        let traffic = Arc::new(Traffic::default());
        for _ in 0..POSTGRES_WRITERS {
            tokio::spawn(pg_write_loop(pool.clone(), jobs.clone(), traffic.clone()));
        }
        Ok(Store {
            writer: Writer::Postgres(writer, pool.clone()),
            reader: Pool::Postgres(pool, traffic.clone()),
            writer_done: Arc::new(tokio::sync::Mutex::new(None)),
            written: None,
            heard: Some(Arc::new(Heard::default())),
            traffic,
        })
    }

    /// What this store asked of its database since it opened ([`traffic`]).
    pub fn traffic(&self) -> Arc<Traffic> {
        self.traffic.clone()
    }

    /// Whether the database answers a query (the health check's readiness).
    pub async fn ping(&self) -> Result<()> {
        self.reader.fetch_one(Statement::new("SELECT 1")).await?;
        Ok(())
    }

    /// Which backend this store runs on (for logs): `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        match self.writer {
            Writer::Sqlite(_) => "sqlite",
            Writer::Postgres(..) => "postgres",
        }
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

    /// Runs `job` on the writing side and returns its result once it is committed: in the
    /// SQLite writer's next batch, or in the next batch of a PostgreSQL writer task. A job that
    /// fails changes nothing. The job runs to its end even if the caller goes away.
    async fn write<T, F>(&self, job: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(Conn<'c>) -> Work<'c, T> + Send + 'static,
    {
        match &self.writer {
            Writer::Sqlite(writer) => {
                let (tx, rx) = oneshot::channel();
                let job: Job = Box::new(move |conn| {
                    Box::pin(async move {
                        let mut effects = Effects::default();
                        let result = match conn {
                            Some(conn) => Some(job(Conn::Sqlite(conn, &mut effects)).await),
                            None => None,
                        };
                        let ok = matches!(result, Some(Ok(_)));
                        let deliver: Deliver = Box::new(move |commit: Option<&rusqlite::Error>| {
                            let result = match (commit, result) {
                                (None, Some(result)) => result,
                                (Some(err), _) => Err(Error::Commit(err.to_string())),
                                (None, None) => Err(Error::Commit("the job did not run".into())),
                            };
                            let _ = tx.send(result);
                        });
                        Ran {
                            deliver,
                            effects,
                            ok,
                        }
                    })
                });
                writer.send(job).map_err(|_| Error::WriterStopped)?;
                rx.await.map_err(|_| Error::WriterStopped)?
            }
            Writer::Postgres(writer, _) => {
                let (tx, rx) = oneshot::channel();
                // What the job wrote is heard once its batch committed, before its caller
                // hears of it, unless the listener was lost since the job began.
                let heard = self.heard.clone();
                let ticket = heard.as_ref().map(|heard| heard.ticket());
                let job: PgJob = Box::new(move |conn| {
                    Box::pin(async move {
                        let mut effects = Effects::default();
                        let result = match conn {
                            Some(conn) => Some(job(Conn::Postgres(conn, &mut effects)).await),
                            None => None,
                        };
                        let ok = matches!(result, Some(Ok(_)));
                        let deliver = Box::new(move |failed: Option<&str>| {
                            if let (None, true, Some(heard), Some(ticket)) =
                                (failed, ok, &heard, ticket)
                            {
                                heard.wrote(ticket, effects);
                            }
                            let result = match (failed, result) {
                                (None, Some(result)) => result,
                                (Some(why), _) => Err(Error::Commit(why.to_owned())),
                                (None, None) => Err(Error::Commit("the job did not run".into())),
                            };
                            let _ = tx.send(result);
                        });
                        PgRan { deliver, ok }
                    })
                });
                writer.send(job).map_err(|_| Error::WriterStopped)?;
                rx.await.map_err(|_| Error::WriterStopped)?
            }
        }
    }

    /// [`Store::write`], but on PostgreSQL as a transaction of its own, never in a batch: for
    /// writes that replicas contend for (leases), whose row locks, held until a batch's
    /// commit, would make batches of different replicas wait on each other in a cycle (a
    /// deadlock, which PostgreSQL breaks only after `deadlock_timeout`).
    async fn write_apart<T, F>(&self, job: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(Conn<'c>) -> Work<'c, T> + Send + 'static,
    {
        let Writer::Postgres(_, pool) = &self.writer else {
            return self.write(job).await;
        };
        let pool = pool.clone();
        let traffic = self.traffic.clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await?;
            traffic.began(1);
            // Leases and shards: nothing the replica's knowledge of live lessons holds.
            let mut effects = Effects::default();
            match job(Conn::Postgres(&mut tx, &mut effects)).await {
                Ok(value) => {
                    tx.commit()
                        .await
                        .map_err(|err| Error::Commit(err.to_string()))?;
                    Ok(value)
                }
                Err(err) => {
                    // Dropping the transaction would roll it back too, later.
                    let _ = tx.rollback().await;
                    Err(err)
                }
            }
        })
        .await
        .map_err(|_| Error::WriterStopped)?
    }

    /// One statement written apart from batches ([`Store::write_apart`]), its rows.
    async fn apart_all(&self, statement: Statement) -> Result<Vec<Row>> {
        self.write_apart(move |mut conn| Box::pin(async move { conn.fetch_all(statement).await }))
            .await
    }

    /// One statement written apart from batches ([`Store::write_apart`]), how many rows it
    /// changed.
    async fn apart_execute(&self, statement: Statement) -> Result<u64> {
        self.write_apart(move |mut conn| Box::pin(async move { conn.execute(statement).await }))
            .await
    }

    /// One statement on the writing side, its row if any.
    async fn write_optional(&self, statement: Statement) -> Result<Option<Row>> {
        self.write(move |mut conn| Box::pin(async move { conn.fetch_optional(statement).await }))
            .await
    }

    /// One statement on the writing side that returns live-lesson rows (`RETURNING` the lesson
    /// columns), decoded; on SQLite the writer's cache learns them.
    async fn write_lessons(&self, statement: Statement) -> Result<Vec<LiveLesson>> {
        self.write(move |mut conn| Box::pin(async move { conn.fetch_lessons(statement).await }))
            .await
    }

    /// [`Store::write_lessons`] of a statement changing at most one live lesson.
    async fn write_lesson(&self, statement: Statement) -> Result<Option<LiveLesson>> {
        self.write(move |mut conn| Box::pin(async move { conn.fetch_lesson(statement).await }))
            .await
    }

    /// One statement on the writing side, how many rows it changed.
    async fn write_execute(&self, statement: Statement) -> Result<u64> {
        self.write(move |mut conn| Box::pin(async move { conn.execute(statement).await }))
            .await
    }
}

/// Takes the lock file beside an SQLite database (`<file>.lock`) for as long as the returned
/// file is open (the process's life, in practice: the kernel drops the lock when the process
/// dies, even by SIGKILL), or refuses with the pid of the scheduler that holds it. Two
/// processes on one file would each run their own reconciler and watchers and miss each
/// other's changes.
fn lock_file(database: &Path) -> Result<File> {
    let mut name = database.as_os_str().to_owned();
    name.push(".lock");
    let path = PathBuf::from(name);
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|err| {
            Error::StoreOpen(format!("cannot open lock file {}: {err}", path.display()))
        })?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() {
                "unknown".to_owned()
            } else {
                holder.to_owned()
            };
            return Err(Error::StoreOpen(format!(
                "database {} is in use by another scheduler (pid {holder}; lock file {})",
                database.display(),
                path.display()
            )));
        }
        Err(std::fs::TryLockError::Error(err)) => {
            return Err(Error::StoreOpen(format!(
                "cannot lock {}: {err}",
                path.display()
            )));
        }
    }
    // Ours now: say who holds it, for the message above.
    let pid = std::process::id();
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{pid}"))
        .and_then(|()| file.flush());
    if let Err(err) = written {
        tracing::warn!(error = %err, path = %path.display(), "cannot write the pid to the lock file");
    }
    Ok(file)
}

/// The SQLite writer's connection: the file sqlx created and migrated, opened again by
/// rusqlite with the same settings (WAL is the file's own; `synchronous` and foreign keys are
/// per connection). It leaves checkpoints to the [`Checkpointer`] unless that falls
/// [`WRITER_CHECKPOINT_PAGES`] behind.
fn open_writer(path: &Path, busy_timeout: Duration) -> Result<rusqlite::Connection> {
    let connection = open_rusqlite(path, busy_timeout)?;
    connection.pragma_update(None, "wal_autocheckpoint", WRITER_CHECKPOINT_PAGES)?;
    // Every statement of the store, prepared once.
    connection.set_prepared_statement_cache_capacity(WRITER_STATEMENTS);
    Ok(connection)
}

/// A read-write rusqlite connection to the store's file, with the writer's settings.
fn open_rusqlite(path: &Path, busy_timeout: Duration) -> Result<rusqlite::Connection> {
    use rusqlite::OpenFlags;
    let connection = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    connection.busy_timeout(busy_timeout)?;
    connection.pragma_update(None, "synchronous", "NORMAL")?;
    connection.pragma_update(None, "foreign_keys", "ON")?;
    Ok(connection)
}

/// Checkpoints the SQLite WAL on a thread and connection of its own, [`CHECKPOINT_EVERY`]
/// after the writer commits: `PRAGMA wal_checkpoint(PASSIVE)` syncs the WAL and copies its
/// committed pages into the database file while the writer goes on committing. Left to
/// SQLite's automatic checkpoint, the commit that crossed 1,000 WAL pages did that copy and its
/// `fsync`s on the writer's thread, with every write queued behind it. With `synchronous =
/// NORMAL` a checkpoint is also what makes commits durable, so a commit is on disk within about
/// [`CHECKPOINT_EVERY`] even when none follows it. Idle, it sleeps until the next commit.
struct Checkpointer {
    /// Ends it once the writer (holding the [`Committed`] side) is gone.
    thread: std::thread::JoinHandle<()>,
}

/// The writer's side of the [`Checkpointer`]: told of every commit, never waiting.
type Committed = std::sync::mpsc::SyncSender<()>;

impl Checkpointer {
    fn start(path: &Path, busy_timeout: Duration) -> Result<(Checkpointer, Committed)> {
        let connection = open_rusqlite(path, busy_timeout)?;
        let (committed, commits) = std::sync::mpsc::sync_channel::<()>(1);
        let thread = std::thread::Builder::new()
            .name("store-checkpoint".into())
            .spawn(move || {
                let mut failing = false;
                while commits.recv().is_ok() {
                    std::thread::sleep(CHECKPOINT_EVERY);
                    while commits.try_recv().is_ok() {}
                    // (busy, WAL pages, pages checkpointed); a passive checkpoint never waits.
                    let ran =
                        connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
                    match ran {
                        Err(err) if !failing => {
                            failing = true;
                            tracing::warn!(error = %err, "the store's checkpoint failed; retrying");
                        }
                        Ok(()) if failing => {
                            failing = false;
                            tracing::info!("the store's checkpoints succeed again");
                        }
                        _ => {}
                    }
                }
                drop(connection);
            })
            .map_err(|err| Error::StoreOpen(format!("cannot start the checkpointer: {err}")))?;
        Ok((Checkpointer { thread }, committed))
    }

    /// Waits until it has ended (the writer is gone) and closed its connection.
    fn stop(self) {
        let _ = self.thread.join();
    }
}

/// Runs one transaction-control statement on the writer's connection, prepared once (parsing
/// them anew for every batch and job was a visible share of the writer's time).
fn run(connection: &rusqlite::Connection, sql: &str) -> rusqlite::Result<()> {
    connection.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Statements the writer keeps prepared (the store has fewer distinct ones).
const WRITER_STATEMENTS: usize = 256;

/// The writer task: takes every job waiting, runs them one after another in one transaction
/// (group commit), then delivers their results. Under load this turns many small commits into
/// few, and the connection never waits for a pool hand-over between jobs. Each job runs inside
/// a savepoint of its own: a job that fails is rolled back to it and changes nothing, the
/// others stay; a failing commit fails the whole batch, and a batch that cannot begin is not
/// run at all: each of its callers gets the error (UNAVAILABLE, retryable), and nothing was
/// written behind their backs. After a commit, and before any caller hears of it, the cache
/// (`written`) learns what the batch wrote.
async fn write_loop(
    connection: rusqlite::Connection,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    written: Option<Arc<Written>>,
    committed: Option<Committed>,
    traffic: Arc<Traffic>,
) {
    let mut connection = connection;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while jobs.recv_many(&mut batch, MAX_BATCH).await > 0 {
        if let Err(err) = run(&connection, "BEGIN IMMEDIATE") {
            tracing::error!(error = %err, jobs = batch.len(), "store batch cannot begin");
            let mut delivers = Vec::with_capacity(batch.len());
            for job in batch.drain(..) {
                delivers.push(job(None).await.deliver);
            }
            // In case the failure left a transaction open (it should not), end it, so the next
            // batch can begin.
            let _ = connection.execute_batch("ROLLBACK");
            for deliver in delivers {
                deliver(Some(&err));
            }
            continue;
        }
        traffic.began(batch.len());
        let mut delivers = Vec::with_capacity(batch.len());
        let mut learnt = Vec::with_capacity(batch.len());
        // Set when SQLite rolled the whole transaction back under a job (a full disk, an I/O
        // error): the jobs after it must not run outside the batch, each on its own.
        let mut aborted = None;
        for job in batch.drain(..) {
            if aborted.is_some() {
                delivers.push((job(None).await.deliver, None));
                continue;
            }
            if let Err(err) = run(&connection, "SAVEPOINT job") {
                tracing::error!(error = %err, "store job cannot begin");
                delivers.push((job(None).await.deliver, Some(err)));
                continue;
            }
            let before = written
                .as_ref()
                .map(|written| written.changes())
                .unwrap_or_default();
            let ran = job(Some(&mut connection)).await;
            let changes = written
                .as_ref()
                .map(|written| written.changes())
                .unwrap_or_default()
                - before;
            let ended = if ran.ok {
                run(&connection, "RELEASE job")
            } else {
                run(&connection, "ROLLBACK TO job").and_then(|()| run(&connection, "RELEASE job"))
            };
            // A failed job's rows are gone: none of what it declared stands, and if it changed
            // any row the cache cannot tell which (see `written`).
            let effects = if ran.ok {
                ran.effects
            } else {
                Effects::default()
            };
            learnt.push((changes, effects));
            delivers.push((ran.deliver, ended.err()));
            if connection.is_autocommit() {
                aborted = Some(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                    Some("SQLite rolled the batch's transaction back".into()),
                ));
            }
        }
        let commit = match aborted {
            Some(err) => Some(err),
            None => run(&connection, "COMMIT").err(),
        };
        if let Some(err) = &commit {
            tracing::error!(error = %err, jobs = delivers.len(), "store commit failed");
            let _ = connection.execute_batch("ROLLBACK");
        } else {
            if let Some(written) = &written {
                written.apply(learnt);
            }
            if let Some(committed) = &committed {
                // Full: the checkpointer has a commit to copy already.
                let _ = committed.try_send(());
            }
        }
        for (deliver, failed) in delivers {
            deliver(commit.as_ref().or(failed.as_ref()));
        }
    }
    if let Err((_, err)) = connection.close() {
        tracing::warn!(error = %err, "the store writer's connection did not close cleanly");
    }
}

/// A PostgreSQL writer task: takes every job waiting (up to [`POSTGRES_MAX_BATCH`]; the
/// receiver is shared by [`POSTGRES_WRITERS`] tasks, one gathering while the others commit)
/// and runs them in one transaction on a pooled connection, as the SQLite writer does: each
/// job in a savepoint of its own when the batch has several (a job that fails is rolled back
/// to it and changes nothing, the others stay), one commit (one WAL flush) for all. Results
/// are delivered after the commit. A batch that cannot begin runs none of its jobs; a batch
/// whose transaction breaks under a job (the connection lost, the savepoint gone) runs none
/// after it and fails whole; either way its callers get UNAVAILABLE and nothing was written
/// behind their backs. Savepoint changes travel with the statement that ends the previous
/// job or begins the batch (one round trip: `RELEASE ...; SAVEPOINT ...` in one simple query).
async fn pg_write_loop(
    pool: sqlx::PgPool,
    jobs: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<PgJob>>>,
    traffic: Arc<Traffic>,
) {
    let mut batch = Vec::with_capacity(POSTGRES_MAX_BATCH);
    loop {
        let taken = jobs
            .lock()
            .await
            .recv_many(&mut batch, POSTGRES_MAX_BATCH)
            .await;
        if taken == 0 {
            return;
        }
        pg_batch(&pool, &mut batch, &traffic).await;
    }
}

/// Why a batch of one job was rolled back: the job failed (its error is its result).
const LONE_JOB_FAILED: &str = "the batch's only job failed";

/// Runs one batch of jobs in one PostgreSQL transaction (see [`pg_write_loop`]).
async fn pg_batch(pool: &sqlx::PgPool, batch: &mut Vec<PgJob>, traffic: &Traffic) {
    use sqlx::Executor as _;
    let alone = batch.len() == 1;
    let began = match pool.acquire().await {
        Ok(mut conn) => {
            let begin = if alone {
                "BEGIN"
            } else {
                "BEGIN; SAVEPOINT job"
            };
            match conn.execute(begin).await {
                Ok(_) => Ok(conn),
                Err(err) => {
                    conn.close_on_drop();
                    Err(err.to_string())
                }
            }
        }
        Err(err) => Err(err.to_string()),
    };
    let mut conn = match began {
        Ok(conn) => {
            traffic.began(batch.len());
            conn
        }
        Err(why) => {
            tracing::error!(error = %why, jobs = batch.len(), "store batch cannot begin");
            for job in batch.drain(..) {
                (job(None).await.deliver)(Some(&why));
            }
            return;
        }
    };
    let mut delivers = Vec::with_capacity(batch.len());
    let count = batch.len();
    // Set when the transaction broke under a job: the jobs after it do not run.
    let mut aborted: Option<String> = None;
    for (at, job) in batch.drain(..).enumerate() {
        if aborted.is_some() {
            delivers.push(job(None).await.deliver);
            continue;
        }
        let ran = job(Some(&mut *conn)).await;
        delivers.push(ran.deliver);
        let last = at + 1 == count;
        // What ends this job and begins the next, in one round trip; the last job's end is the
        // commit (or the rollback of a batch of one that failed).
        let next = match (alone, ran.ok, last) {
            (true, true, _) => continue,
            (true, false, _) => {
                aborted = Some(LONE_JOB_FAILED.into());
                continue;
            }
            (false, true, true) => continue,
            (false, false, true) => "ROLLBACK TO SAVEPOINT job",
            (false, true, false) => "RELEASE SAVEPOINT job; SAVEPOINT job",
            (false, false, false) => {
                "ROLLBACK TO SAVEPOINT job; RELEASE SAVEPOINT job; SAVEPOINT job"
            }
        };
        if let Err(err) = conn.execute(next).await {
            aborted = Some(format!("the batch's transaction broke: {err}"));
        }
    }
    let failed = match aborted {
        Some(why) => {
            if conn.execute("ROLLBACK").await.is_err() {
                conn.close_on_drop();
            }
            Some(why)
        }
        None => match conn.execute("COMMIT").await {
            Ok(_) => None,
            Err(err) => {
                conn.close_on_drop();
                Some(err.to_string())
            }
        },
    };
    // A lone job's own failure is its result, not the batch's.
    let failed = failed.filter(|why| !(alone && why == LONE_JOB_FAILED));
    if let Some(why) = &failed {
        tracing::error!(error = %why, jobs = delivers.len(), "store batch failed");
    }
    for deliver in delivers {
        deliver(failed.as_deref());
    }
}

fn parse_lesson_id(text: &str) -> Result<LiveLessonId> {
    LiveLessonId::from_str(text).map_err(|err| Error::Corrupt(err.to_string()))
}

fn parse_status(text: &str) -> Result<Status> {
    Status::from_str(text).map_err(Error::Corrupt)
}

fn session_from_row(row: &Row) -> Result<Session> {
    let id: String = row.get("id")?;
    let ip: String = row.get("source_ip")?;
    Ok(Session {
        id: SessionId::from_str(&id).map_err(|err| Error::Corrupt(err.to_string()))?,
        source_ip: ip
            .parse()
            .map_err(|_| Error::Corrupt(format!("bad source ip `{ip}`")))?,
        persistent: row.flag("persistent")?,
        created_at: Millis(row.int("created_at")?),
        last_active: Millis(row.int("last_active")?),
    })
}

fn lesson_from_row(row: &Row) -> Result<LiveLesson> {
    let id: String = row.get("id")?;
    let session: String = row.get("session_id")?;
    let endpoints: String = row.get("endpoints")?;
    let stage = row.int("stage")?;
    Ok(LiveLesson {
        id: parse_lesson_id(&id)?,
        session_id: SessionId::from_str(&session).map_err(|err| Error::Corrupt(err.to_string()))?,
        lesson_slug: row.get("lesson_slug")?,
        stage: u32::try_from(stage)
            .map_err(|_| Error::Corrupt(format!("stage {stage} of {id}")))?,
        generation: row.int("generation")? as u64,
        observed_generation: row.int("observed_generation")? as u64,
        status: parse_status(&row.get::<String>("status")?)?,
        reason: row.get("reason")?,
        deleting: row.flag("deleting")?,
        agent: row.get("agent")?,
        handle: row.get("handle")?,
        endpoints: serde_json::from_str(&endpoints)
            .map_err(|err| Error::Corrupt(format!("endpoints of {id}: {err}")))?,
        persistent: row.flag("persistent")?,
        created_at: Millis(row.int("created_at")?),
        last_active: Millis(row.int("last_active")?),
        pool_session: row
            .get::<Option<String>>("pool_session")?
            .map(|s| SessionId::from_str(&s).map_err(|err| Error::Corrupt(err.to_string())))
            .transpose()?,
    })
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::task::JoinSet;
    use tonic::Code;

    use super::testing::on_both;
    use super::*;
    use crate::model::{Decision, Event, PlacementRecord, Wishes};

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    on_both! {
        async fn session_limit_per_ip(database, store) {
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

        async fn request_creates_touches_changes_and_retries(database, store) {
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
            // The request was activity on the session too (a trigger).
            assert_eq!(store.session(session.id).await.unwrap().last_active, Millis(3));

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
            assert_eq!(observed.handle, b"h");
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
            assert_eq!(events[2].stage, 1);
            assert!(events.windows(2).all(|w| w[0].seq < w[1].seq));

            // Persistence follows the session (a trigger) and shows in the counts.
            store.persist_session(session.id, true).await.unwrap();
            assert!(store.live_lesson(first.id).await.unwrap().persistent);
            let counts = store.counts().await.unwrap();
            assert_eq!((counts.sessions, counts.persistent_sessions), (1, 1));
            assert_eq!(counts.statuses, [("CONFIGURING".to_owned(), 1)]);
            assert_eq!(store.unsettled().await.unwrap(), [first.id]);
            assert_eq!(store.on_agent("a").await.unwrap(), [first.id]);
            assert_eq!(store.agent_loads().await.unwrap(), [("a".to_owned(), 1)]);
        }

        // Reads see every committed write, whether the SQLite writer's cache learnt it (the
        // declared rows, a session's token) or must forget what it knew (a change it was not
        // told of, an expired session).
        async fn reads_follow_writes_declared_or_not(database, store) {
            let token = [11; 32];
            let session = store.create_session(IP, token, 0, Millis(1)).await.unwrap();
            assert_eq!(store.session_by_token(token).await.unwrap(), Some(session.id));
            let (lesson, _) = store
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            assert_eq!(store.live_lesson(lesson.id).await.unwrap(), lesson);
            // A write that does not declare the row it changes.
            store
                .write_execute(
                    Statement::new("UPDATE live_lessons SET reason = 'undeclared' WHERE id = $1")
                        .bind(lesson.id.to_string()),
                )
                .await
                .unwrap();
            assert_eq!(store.live_lesson(lesson.id).await.unwrap().reason, "undeclared");
            let observed = store
                .observe(lesson.id, 1, Observation::status(Status::Booting, "b"), Millis(3))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(store.live_lesson(lesson.id).await.unwrap(), observed);

            // Placement records: none for a new live lesson, then what each write left, also
            // after a write that does not declare the record it changes.
            assert_eq!(store.placement(lesson.id).await.unwrap(), PlacementRecord::default());
            let wishes = Wishes {
                requires: [("zone".to_owned(), "a".to_owned())].into(),
                ..Wishes::default()
            };
            store.set_wishes(lesson.id, &wishes).await.unwrap();
            assert_eq!(store.placement(lesson.id).await.unwrap().wishes, wishes);
            store
                .write_execute(
                    Statement::new("UPDATE placements SET moved_from = 'x' WHERE live_lesson_id = $1")
                        .bind(lesson.id.to_string()),
                )
                .await
                .unwrap();
            assert_eq!(
                store.placement(lesson.id).await.unwrap().moved_from.as_deref(),
                Some("x")
            );
            let decision = Decision { agent: "y".into(), ..Decision::default() };
            store.record_decision(lesson.id, &decision, Millis(4)).await.unwrap();
            let record = store.placement(lesson.id).await.unwrap();
            assert_eq!(
                (record.wishes, record.decision, record.moved_from),
                (wishes, Some(decision), None)
            );

            store.forget(lesson.id).await.unwrap();
            assert!(store.find_live_lesson(lesson.id).await.unwrap().is_none());
            assert_eq!(store.placement(lesson.id).await.unwrap(), PlacementRecord::default());
            store.expire_sessions(Millis(10), Millis(11)).await.unwrap();
            assert_eq!(store.session_by_token(token).await.unwrap(), None);
        }

        // The traffic counters: a write is one transaction with one job (many at once share
        // transactions), a query a read, and what a cache answers no read.
        async fn traffic_counts_transactions_jobs_and_reads(database, store) {
            let start = store.traffic().counts();
            let session = store.create_session(IP, [12; 32], 0, Millis(1)).await.unwrap();
            let wrote = store.traffic().counts();
            assert_eq!(
                (wrote.transactions - start.transactions, wrote.write_jobs - start.write_jobs),
                (1, 1)
            );
            store.counts().await.unwrap();
            let read = store.traffic().counts();
            assert!(read.reads > wrote.reads, "{read:?} after {wrote:?}");
            assert_eq!(read.transactions, wrote.transactions);
            let (lesson, _) = store
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            if store.backend() == "sqlite" {
                // The writer's cache knows the live lesson it wrote.
                let before = store.traffic().counts();
                assert_eq!(store.live_lesson(lesson.id).await.unwrap(), lesson);
                assert_eq!(store.traffic().counts().reads, before.reads);
            }
            let before = store.traffic().counts();
            let writes = (0..20).map(|i| {
                let store = store.clone();
                async move { store.create_session(IP, [100 + i; 32], 0, Millis(3)).await }
            });
            for created in futures::future::join_all(writes).await {
                created.unwrap();
            }
            let after = store.traffic().counts();
            assert_eq!(after.write_jobs - before.write_jobs, 20);
            assert!(
                (1..=20).contains(&(after.transactions - before.transactions)),
                "{after:?} after {before:?}"
            );
        }

        async fn live_lesson_limit_and_expiry(database, store) {
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
            let raw: i64 = store
                .reader
                .fetch_one(Statement::new("SELECT COUNT(*) FROM sessions"))
                .await
                .unwrap()
                .at(0)
                .unwrap();
            assert_eq!(raw, 0);
            // Forgetting was the last event.
            let events = store.events(expired[0].id).await.unwrap();
            assert_eq!(events.last().map(|e| e.detail.as_str()), Some("removed"));
        }

        async fn idle_live_lessons_expire_and_events_are_pruned(database, store) {
            let session = store
                .create_session(IP, [6; 32], 0, Millis(1))
                .await
                .unwrap();
            let (idle, _) = store
                .request_live_lesson(session.id, "idle", 0, 0, Millis(2))
                .await
                .unwrap();
            let (busy, _) = store
                .request_live_lesson(session.id, "busy", 0, 0, Millis(2))
                .await
                .unwrap();
            store.heartbeat(busy.id, Millis(20)).await.unwrap();
            let expired = store.expire_live_lessons(Millis(10), Millis(21)).await.unwrap();
            assert_eq!(expired.iter().map(|l| l.id).collect::<Vec<_>>(), [idle.id]);
            assert_eq!(expired[0].status, Status::Terminating);
            assert!(store.exists(idle.id).await.unwrap());
            // Marking again is not an error and changes nothing.
            let again = store.mark_deleting(idle.id, "deleted", Millis(22)).await.unwrap();
            assert_eq!(again.generation, expired[0].generation);
            store.forget(idle.id).await.unwrap();
            assert!(!store.exists(idle.id).await.unwrap());
            assert!(store.prune_events(Millis(1_000_000_000_000_000)).await.unwrap() >= 3);
            assert!(store.events(idle.id).await.unwrap().is_empty());
            assert!(!store.events(busy.id).await.unwrap().is_empty());
        }

        // Events are kept by log (the seq of a live lesson's first event): interleaved live
        // lessons keep their own, readable after the live lesson is gone, and pruning keeps a
        // log's first event while later ones are kept.
        async fn events_are_kept_by_log_and_read_after_the_live_lesson_is_gone(database, store) {
            let session = store
                .create_session(IP, [7; 32], 0, Millis(1))
                .await
                .unwrap();
            let (a, _) = store
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            let (b, _) = store
                .request_live_lesson(session.id, "b", 0, 0, Millis(3))
                .await
                .unwrap();
            let ready = |detail| Observation::status(Status::Ready, detail);
            store.observe(b.id, 1, ready("b ready"), Millis(4)).await.unwrap();
            store.observe(a.id, 1, ready("a ready"), Millis(5)).await.unwrap();
            store.set_stage(a.id, 1, Millis(6)).await.unwrap();
            let details = |events: &[Event]| {
                events.iter().map(|e| e.detail.clone()).collect::<Vec<_>>()
            };
            let of_a = store.events(a.id).await.unwrap();
            assert!(of_a.iter().all(|e| e.live_lesson_id == a.id), "{of_a:?}");
            assert_eq!(
                of_a.iter().map(|e| e.status).collect::<Vec<_>>(),
                [Status::Pending, Status::Ready, Status::Configuring]
            );
            assert_eq!(details(&of_a)[1], "a ready");
            assert_eq!(details(&store.events(b.id).await.unwrap())[1], "b ready");

            // Gone: its events are still read by its id, the removal last.
            store.mark_deleting(a.id, "deleted", Millis(7)).await.unwrap();
            store.forget(a.id).await.unwrap();
            let gone = store.events(a.id).await.unwrap();
            assert_eq!(gone.len(), 5, "{gone:?}");
            assert_eq!(gone[..3], of_a[..]);
            assert_eq!(gone.last().unwrap().detail, "removed");

            // Pruned before 7: the deletion at 7 and the removal (written at the wall clock's
            // time) are kept, and so is the first event, through which they are found; the
            // others go.
            store.prune_events(Millis(7)).await.unwrap();
            let kept = store.events(a.id).await.unwrap();
            assert_eq!(
                kept.iter().map(|e| e.seq).collect::<Vec<_>>(),
                [gone[0].seq, gone[3].seq, gone[4].seq],
                "{kept:?}"
            );
            // b still exists: nothing of it is pruned.
            assert_eq!(store.events(b.id).await.unwrap().len(), 2);
            store.prune_events(Millis(i64::MAX)).await.unwrap();
            assert!(store.events(a.id).await.unwrap().is_empty());
            assert_eq!(store.events(b.id).await.unwrap().len(), 2);
        }

        async fn filters_agents_and_audit(database, store) {
            let session = store
                .create_session(IP, [8; 32], 0, Millis(1))
                .await
                .unwrap();
            let (a, _) = store
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            store
                .request_live_lesson(session.id, "b", 0, 0, Millis(3))
                .await
                .unwrap();
            let only_a = LessonFilter {
                lesson_slug: Some("a".into()),
                ..LessonFilter::default()
            };
            let found = store.live_lessons(&only_a).await.unwrap();
            assert_eq!(found.iter().map(|l| l.id).collect::<Vec<_>>(), [a.id]);
            let pending = LessonFilter {
                status: Some(Status::Pending),
                ..LessonFilter::default()
            };
            assert_eq!(store.live_lessons(&pending).await.unwrap().len(), 2);
            assert_eq!(store.session_live_lessons(session.id).await.unwrap().len(), 2);

            assert_eq!(store.agent_instance("x").await.unwrap(), None);
            store.set_agent_instance("x", "i1", Millis(4)).await.unwrap();
            store.set_agent_instance("x", "i2", Millis(5)).await.unwrap();
            assert_eq!(store.agent_instance("x").await.unwrap().as_deref(), Some("i2"));

            store.audit(Millis(6), "token:ops", "KillLiveLesson", "x", "ok").await.unwrap();
            store.audit(Millis(7), "anonymous", "ListAgents", "", "unauthenticated").await.unwrap();
            let log = store.audit_log(1).await.unwrap();
            assert_eq!(log.len(), 1);
            assert_eq!((log[0].identity.as_str(), log[0].at), ("anonymous", Millis(7)));
            let token = [8; 32];
            assert_eq!(store.session_by_token(token).await.unwrap(), Some(session.id));
        }

        // The limits are checked inside the statement that inserts: writers racing each other
        // (PostgreSQL runs them as concurrent transactions) can never exceed them.
        async fn limits_hold_under_concurrent_writers(database, store) {
            let mut sessions = JoinSet::new();
            for i in 0..24u8 {
                let store = store.clone();
                sessions.spawn(async move {
                    store.create_session(IP, [100 + i; 32], 5, Millis(1)).await
                });
            }
            let mut created = Vec::new();
            while let Some(result) = sessions.join_next().await {
                match result.unwrap() {
                    Ok(session) => created.push(session),
                    Err(err) => assert!(matches!(err, Error::TooManySessions { .. }), "{err}"),
                }
            }
            assert_eq!(created.len(), 5);
            assert_eq!(store.sessions().await.unwrap().len(), 5);

            let session = created[0].id;
            let mut lessons = JoinSet::new();
            for i in 0..24 {
                let store = store.clone();
                lessons.spawn(async move {
                    store
                        .request_live_lesson(session, &format!("l{}", i % 12), 0, 3, Millis(2))
                        .await
                });
            }
            while let Some(result) = lessons.join_next().await {
                if let Err(err) = result.unwrap() {
                    assert!(matches!(err, Error::TooManyLiveLessons { .. }), "{err}");
                }
            }
            assert_eq!(store.session_live_lessons(session).await.unwrap().len(), 3);
        }
    }

    /// A second process (or a second open in this one) on an SQLite file is refused, naming
    /// the holder; closing the first lets it in.
    #[tokio::test]
    async fn an_sqlite_file_has_one_owner() {
        let scratch = testing::Scratch::sqlite();
        let first = Store::open(&scratch.database).await.unwrap();
        let err = Store::open(&scratch.database).await.err().expect("refused");
        let message = err.to_string();
        assert!(
            message.contains("is in use by another scheduler")
                && message.contains(&format!("(pid {}", std::process::id())),
            "{message}"
        );
        first.close().await;
        Store::open(&scratch.database).await.unwrap().close().await;
    }

    /// Another connection holds SQLite's write lock past the busy timeout: every caller is told
    /// UNAVAILABLE (retryable), nothing was written behind their backs, and the same calls
    /// succeed once the lock is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn writes_that_cannot_lock_are_unavailable_and_leave_nothing() {
        let scratch = testing::Scratch::sqlite();
        let Database::Sqlite(path) = &scratch.database else {
            unreachable!()
        };
        let store = Store::open_sqlite(path, Duration::from_millis(200))
            .await
            .unwrap();
        let session = store
            .create_session(IP, [9; 32], 0, Millis(1))
            .await
            .unwrap();
        let mut other = SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(path))
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        let mut calls = JoinSet::new();
        for i in 0..16 {
            let store = store.clone();
            calls.spawn(async move {
                store
                    .request_live_lesson(session.id, &format!("l{i}"), 0, 0, Millis(2))
                    .await
            });
        }
        while let Some(result) = calls.join_next().await {
            let err = result
                .unwrap()
                .expect_err("no write while the lock is held");
            assert_eq!(err.code(), Code::Unavailable, "{err}");
        }
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
        assert!(
            store
                .session_live_lessons(session.id)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(store.unsettled().await.unwrap().is_empty());
        let (lesson, outcome) = store
            .request_live_lesson(session.id, "l0", 0, 0, Millis(3))
            .await
            .unwrap();
        assert_eq!(
            (outcome, lesson.status),
            (Requested::Created, Status::Pending)
        );
    }

    /// A batch whose BEGIN fails runs none of its jobs (they would otherwise each commit on
    /// their own while their callers are told the batch failed), and the writer goes on.
    #[tokio::test]
    async fn a_batch_that_cannot_begin_runs_nothing() {
        let scratch = testing::Scratch::sqlite();
        let Database::Sqlite(path) = &scratch.database else {
            unreachable!()
        };
        let connection = rusqlite::Connection::open(path).unwrap();
        connection
            .execute_batch("CREATE TABLE t (n INTEGER)")
            .unwrap();
        // A transaction already open makes the batch's BEGIN IMMEDIATE fail.
        connection.execute_batch("BEGIN").unwrap();
        let (writer, jobs) = mpsc::unbounded_channel();
        let ran = Arc::new(AtomicUsize::new(0));
        let mut results = Vec::new();
        for _ in 0..3 {
            let (job, result) = counting_job(ran.clone());
            writer.send(job).unwrap();
            results.push(result);
        }
        let (job, last) = counting_job(ran.clone());
        let writer_task = tokio::spawn(write_loop(
            connection,
            jobs,
            None,
            None,
            Arc::new(Traffic::default()),
        ));
        for result in results {
            let err = result.await.unwrap().unwrap_err();
            assert_eq!(err.code(), Code::Unavailable, "{err}");
        }
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "no job of the failed batch ran"
        );
        // The writer recovered: the next job runs and commits.
        writer.send(job).unwrap();
        last.await.unwrap().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        drop(writer);
        writer_task.await.unwrap();
        let rows: i64 = rusqlite::Connection::open(path)
            .unwrap()
            .query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
            .unwrap();
        assert_eq!(rows, 1);
    }

    /// A job that fails after its first statement leaves nothing of it in the batch, and the
    /// batch's other jobs commit.
    #[tokio::test]
    async fn a_failed_job_is_rolled_back_alone() {
        let scratch = testing::Scratch::sqlite();
        let Database::Sqlite(path) = &scratch.database else {
            unreachable!()
        };
        let connection = rusqlite::Connection::open(path).unwrap();
        connection
            .execute_batch("CREATE TABLE t (n INTEGER UNIQUE)")
            .unwrap();
        let (writer, jobs) = mpsc::unbounded_channel();
        let mut results = Vec::new();
        // One batch: the writer starts after all three are queued.
        for statements in [
            &["INSERT INTO t (n) VALUES (1)"][..],
            &[
                "INSERT INTO t (n) VALUES (2)",
                "INSERT INTO t (n) VALUES (1)",
            ],
            &["INSERT INTO t (n) VALUES (3)"],
        ] {
            let (job, rx) = sql_job(statements, Arc::default());
            writer.send(job).unwrap();
            results.push(rx);
        }
        let writer_task = tokio::spawn(write_loop(
            connection,
            jobs,
            None,
            None,
            Arc::new(Traffic::default()),
        ));
        let outcomes: Vec<bool> = futures::future::join_all(results)
            .await
            .into_iter()
            .map(|result| result.unwrap().is_ok())
            .collect();
        assert_eq!(outcomes, [true, false, true]);
        drop(writer);
        writer_task.await.unwrap();
        let rows: Vec<i64> = rusqlite::Connection::open(path)
            .unwrap()
            .prepare("SELECT n FROM t ORDER BY n")
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(rows, [1, 3], "the failed job's first row was rolled back");
    }

    /// The PostgreSQL test server's pool on a fresh database with table `t`, or `None` when no
    /// server is given.
    async fn pg_table() -> Option<(testing::Scratch, sqlx::PgPool)> {
        let scratch = testing::Scratch::postgres_if_given().await?;
        let Database::Postgres(url) = &scratch.database else {
            unreachable!("a PostgreSQL scratch")
        };
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::raw_sql("CREATE TABLE t (n INTEGER UNIQUE)")
            .execute(&pool)
            .await
            .unwrap();
        Some((scratch, pool))
    }

    /// The rows of `t`, in order.
    async fn pg_rows(pool: &sqlx::PgPool) -> Vec<i32> {
        sqlx::query_scalar("SELECT n FROM t ORDER BY n")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    /// A PostgreSQL job running `statements` in order (stopping at the first that fails), and
    /// where its result arrives.
    fn pg_sql_job(statements: &'static [&'static str]) -> (PgJob, oneshot::Receiver<Result<()>>) {
        use sqlx::Executor as _;
        let (tx, rx) = oneshot::channel();
        let job: PgJob = Box::new(move |conn| {
            Box::pin(async move {
                let result = match conn {
                    Some(conn) => {
                        let mut result = Ok(());
                        for sql in statements {
                            if let Err(err) = conn.execute(*sql).await {
                                result = Err(Error::from(err));
                                break;
                            }
                        }
                        Some(result)
                    }
                    None => None,
                };
                let ok = matches!(result, Some(Ok(())));
                let deliver = Box::new(move |failed: Option<&str>| {
                    let _ = tx.send(match (failed, result) {
                        (Some(why), _) => Err(Error::Commit(why.to_owned())),
                        (None, Some(result)) => result,
                        (None, None) => Err(Error::Commit("did not run".into())),
                    });
                });
                PgRan { deliver, ok }
            })
        });
        (job, rx)
    }

    /// A PostgreSQL batch: a job that fails after its first statement leaves nothing of it
    /// (rolled back to its savepoint), the others commit in the same transaction; a batch of
    /// one failing job hands back the job's own error and writes nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_postgres_job_is_rolled_back_alone() {
        let Some((_scratch, pool)) = pg_table().await else {
            return;
        };
        let mut batch = Vec::new();
        let mut results = Vec::new();
        for statements in [
            &["INSERT INTO t (n) VALUES (1)"][..],
            &[
                "INSERT INTO t (n) VALUES (2)",
                "INSERT INTO t (n) VALUES (1)",
            ],
            &["INSERT INTO t (n) VALUES (3)"],
            &["INSERT INTO t (n) VALUES (4)", "SELECT 1/0"],
        ] {
            let (job, rx) = pg_sql_job(statements);
            batch.push(job);
            results.push(rx);
        }
        pg_batch(&pool, &mut batch, &Traffic::default()).await;
        let mut outcomes = Vec::new();
        for result in results {
            outcomes.push(result.await.unwrap().is_ok());
        }
        assert_eq!(outcomes, [true, false, true, false]);
        assert_eq!(
            pg_rows(&pool).await,
            [1, 3],
            "the failed jobs' rows were rolled back"
        );

        let (job, rx) = pg_sql_job(&[
            "INSERT INTO t (n) VALUES (5)",
            "INSERT INTO t (n) VALUES (3)",
        ]);
        pg_batch(&pool, &mut vec![job], &Traffic::default()).await;
        let err = rx.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Store(_)), "the job's own error: {err}");
        assert_eq!(pg_rows(&pool).await, [1, 3]);
    }

    /// A PostgreSQL batch whose connection dies under a job (its backend terminated, as a
    /// server restart does): the jobs after it do not run, every caller gets UNAVAILABLE, and
    /// nothing of the batch is written, also what ran before; the next batch commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_postgres_batch_whose_connection_dies_fails_whole() {
        let Some((_scratch, pool)) = pg_table().await else {
            return;
        };
        let mut batch = Vec::new();
        let mut results = Vec::new();
        for statements in [
            &["INSERT INTO t (n) VALUES (1)"][..],
            &["SELECT pg_terminate_backend(pg_backend_pid())"],
            &["INSERT INTO t (n) VALUES (2)"],
        ] {
            let (job, rx) = pg_sql_job(statements);
            batch.push(job);
            results.push(rx);
        }
        pg_batch(&pool, &mut batch, &Traffic::default()).await;
        for result in results {
            let err = result.await.unwrap().unwrap_err();
            assert_eq!(err.code(), Code::Unavailable, "{err}");
        }
        assert!(
            pg_rows(&pool).await.is_empty(),
            "nothing of the batch committed"
        );
        let (job, rx) = pg_sql_job(&["INSERT INTO t (n) VALUES (3)"]);
        pg_batch(&pool, &mut vec![job], &Traffic::default()).await;
        rx.await.unwrap().unwrap();
        assert_eq!(pg_rows(&pool).await, [3]);
    }

    /// A job inserting a row into `t` and counting its runs, and where its result arrives.
    fn counting_job(ran: Arc<AtomicUsize>) -> (Job, oneshot::Receiver<Result<()>>) {
        sql_job(&["INSERT INTO t (n) VALUES (1)"], ran)
    }

    /// A job running `statements` in order (stopping at the first that fails) and counting
    /// its runs, and where its result arrives.
    fn sql_job(
        statements: &'static [&'static str],
        ran: Arc<AtomicUsize>,
    ) -> (Job, oneshot::Receiver<Result<()>>) {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            Box::pin(async move {
                let result = match conn {
                    Some(conn) => {
                        ran.fetch_add(1, Ordering::SeqCst);
                        statements
                            .iter()
                            .try_for_each(|sql| conn.execute(sql, []).map(|_| ()))
                            .map_err(Error::from)
                    }
                    None => Ok(()),
                };
                let ok = result.is_ok();
                let deliver: Deliver = Box::new(move |failed| {
                    let _ = tx.send(match failed {
                        Some(err) => Err(Error::Commit(err.to_string())),
                        None => result,
                    });
                });
                Ran {
                    deliver,
                    effects: Effects::default(),
                    ok,
                }
            })
        });
        (job, rx)
    }

    /// A commit reaches the database file itself (not only the WAL) within a few checkpoint
    /// periods, without the writer's own checkpoint, which waits for 10,000 WAL pages: a copy
    /// of the file alone, without its WAL, soon holds a session just created.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checkpointer_copies_commits_into_the_database_file() {
        let scratch = testing::Scratch::sqlite();
        let Database::Sqlite(path) = &scratch.database else {
            unreachable!("an SQLite scratch")
        };
        let store = Store::open(&scratch.database).await.unwrap();
        let session = store
            .create_session(IP, [9; 32], 0, Millis(1))
            .await
            .unwrap();
        let copy = path.with_file_name("copy.db");
        let in_the_copy = || {
            let _ = std::fs::remove_file(path.with_file_name("copy.db-wal"));
            std::fs::copy(path, &copy).ok()?;
            let connection = rusqlite::Connection::open(&copy).ok()?;
            connection
                .query_row(
                    "SELECT COUNT(*) FROM sessions WHERE id = ?1",
                    [session.id.to_string()],
                    |row| row.get::<_, i64>(0),
                )
                .ok()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while in_the_copy() != Some(1) {
            assert!(
                std::time::Instant::now() < deadline,
                "the session is still only in the WAL"
            );
            tokio::time::sleep(CHECKPOINT_EVERY / 2).await;
        }
        store.close().await;
    }

    /// A database written before events had logs (migrations up to 0007): migration 0008 puts
    /// each live lesson's events in one log, and its later events join it.
    async fn events_of_an_older_database_are_kept(scratch: testing::Scratch) {
        let (a, b) = (LiveLessonId::new(), LiveLessonId::new());
        let old = format!(
            "INSERT INTO sessions (id, source_ip, created_at, last_active) \
                 VALUES ('{session}', '127.0.0.1', 1, 1); \
             INSERT INTO live_lessons (id, session_id, lesson_slug, stage, generation, status, \
                 created_at, last_active, updated_at) \
                 VALUES ('{a}', '{session}', 'a', 0, 1, 'PENDING', 2, 2, 2); \
             INSERT INTO live_lessons (id, session_id, lesson_slug, stage, generation, status, \
                 created_at, last_active, updated_at) \
                 VALUES ('{b}', '{session}', 'b', 0, 1, 'PENDING', 3, 3, 3); \
             UPDATE live_lessons SET status = 'READY', reason = 'a ready', updated_at = 4 \
                 WHERE id = '{a}';",
            session = SessionId::new(),
        );
        let before = |m: &sqlx::migrate::Migration| m.version < 8;
        match &scratch.database {
            Database::Sqlite(path) => {
                let mut migrator = sqlx::migrate!("./migrations");
                migrator.migrations = migrator
                    .migrations
                    .iter()
                    .filter(|m| before(m))
                    .cloned()
                    .collect::<Vec<_>>()
                    .into();
                let options = SqliteConnectOptions::new()
                    .filename(path)
                    .create_if_missing(true);
                let mut conn = SqliteConnection::connect_with(&options).await.unwrap();
                migrator.run(&mut conn).await.unwrap();
                sqlx::raw_sql(&old).execute(&mut conn).await.unwrap();
                conn.close().await.unwrap();
            }
            Database::Postgres(url) => {
                let mut migrator = sqlx::migrate!("./migrations-postgres");
                migrator.migrations = migrator
                    .migrations
                    .iter()
                    .filter(|m| before(m))
                    .cloned()
                    .collect::<Vec<_>>()
                    .into();
                let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
                migrator.run(&mut conn).await.unwrap();
                sqlx::raw_sql(&old).execute(&mut conn).await.unwrap();
                conn.close().await.unwrap();
            }
        }
        let store = Store::open(&scratch.database).await.unwrap();
        let of_a = store.events(a).await.unwrap();
        assert_eq!(
            of_a.iter()
                .map(|e| (e.status, e.detail.as_str()))
                .collect::<Vec<_>>(),
            [(Status::Pending, ""), (Status::Ready, "a ready")]
        );
        store.mark_deleting(a, "deleted", Millis(5)).await.unwrap();
        store.forget(a).await.unwrap();
        let gone = store.events(a).await.unwrap();
        assert_eq!(gone.len(), 4, "{gone:?}");
        assert_eq!(store.events(b).await.unwrap().len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_of_an_older_sqlite_database_are_kept() {
        events_of_an_older_database_are_kept(testing::Scratch::sqlite()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_of_an_older_postgres_database_are_kept() {
        if let Some(scratch) = testing::Scratch::postgres_if_given().await {
            events_of_an_older_database_are_kept(scratch).await;
        }
    }

    #[test]
    fn connections_leaving_the_machine_unverified_are_named() {
        let why = |url: &str| unverified(&PgConnectOptions::from_str(url).unwrap());
        assert_eq!(why("postgres://u@127.0.0.1:5432/d"), None);
        assert_eq!(why("postgres://u@localhost/d?sslmode=disable"), None);
        assert_eq!(why("postgres://u@[::1]:5432/d"), None);
        assert_eq!(why("postgres://u@db.example/d?host=/run/postgresql"), None);
        assert_eq!(why("postgres://u@db.example/d?sslmode=verify-full"), None);
        assert_eq!(why("postgres://u@db.example/d?sslmode=verify-ca"), None);
        assert!(
            why("postgres://u@db.example/d?sslmode=require")
                .is_some_and(|w| w.contains("not verified"))
        );
        assert!(why("postgres://u@db.example/d").is_some_and(|w| w.contains("plaintext")));
        assert!(why("postgres://u@10.0.0.5/d?sslmode=prefer").is_some());
    }

    #[test]
    fn database_settings_select_the_backend_and_hide_passwords() {
        assert_eq!(
            Database::parse("/var/lib/antidote/antidote.db"),
            Database::Sqlite("/var/lib/antidote/antidote.db".into())
        );
        let url = "postgres://antidote:s3cret@db.example:5432/antidote?sslmode=require";
        assert_eq!(Database::parse(url), Database::Postgres(url.into()));
        let shown = format!("{:?} {}", Database::parse(url), Database::parse(url));
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("postgres://antidote:***@db.example:5432/antidote"),
            "{shown}"
        );
        assert_eq!(
            Database::parse("postgresql://h/db").to_string(),
            "postgresql://h/db"
        );
    }
}
