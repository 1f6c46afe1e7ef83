//! The thin layer between the store's SQL and the two databases it runs on.
//!
//! The store's statements are written once, with `$N` placeholders (PostgreSQL's, which sqlx
//! also maps to SQLite's numbered parameters), and bound through [`Statement`], whose values
//! are the few types both drivers encode alike. Rows come back as [`Row`], decoded by column
//! name into types both drivers decode alike, with [`Row::flag`] and [`Row::int`] absorbing the
//! one schema difference (flags are SQLite integers and PostgreSQL `SMALLINT`s). What differs
//! by behaviour rather than by syntax lives here too: [`Conn::lock_session`] and
//! [`Conn::lock_name`] serialise the writes whose limit checks must not interleave (SQLite's
//! single writer already does; PostgreSQL's concurrent transactions need a lock), and
//! `crate::error` says which failures are worth a retry.
//!
//! SQLite's writing connection is rusqlite's, driven on the writer's own thread (sqlx runs each
//! SQLite connection on a worker thread of its own, so every statement would be two thread
//! hand-offs); its rows come back as [`Row::Written`], owned values decoded by the same names.
//! Reads stay on sqlx's read-only pool.

use std::sync::Arc;

use rusqlite::types::{FromSql, ValueRef};
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Decode, Postgres, Row as _, Sqlite, Type};

use super::Result;
use super::effects::{Effect, Effects};
use super::traffic::Traffic;
use crate::model::{LiveLesson, LiveLessonId, SessionId};

/// One value bound to a statement: the types both backends encode the same way.
#[derive(Debug, Clone)]
pub(super) enum Value {
    /// A 64-bit integer (times, generations, stages, limits, flags).
    Int(i64),
    /// A boolean, only for expressions (`CASE WHEN $N`), never stored.
    Bool(bool),
    /// Text, or SQL NULL.
    Text(Option<String>),
    /// Bytes, or SQL NULL.
    Bytes(Option<Vec<u8>>),
}

impl From<i64> for Value {
    fn from(value: i64) -> Self {
        Value::Int(value)
    }
}

impl From<u32> for Value {
    fn from(value: u32) -> Self {
        Value::Int(i64::from(value))
    }
}

impl From<bool> for Value {
    fn from(value: bool) -> Self {
        Value::Bool(value)
    }
}

impl From<String> for Value {
    fn from(value: String) -> Self {
        Value::Text(Some(value))
    }
}

impl From<&str> for Value {
    fn from(value: &str) -> Self {
        Value::Text(Some(value.to_owned()))
    }
}

impl From<Option<String>> for Value {
    fn from(value: Option<String>) -> Self {
        Value::Text(value)
    }
}

impl From<Option<&str>> for Value {
    fn from(value: Option<&str>) -> Self {
        Value::Text(value.map(str::to_owned))
    }
}

impl From<Vec<u8>> for Value {
    fn from(value: Vec<u8>) -> Self {
        Value::Bytes(Some(value))
    }
}

impl From<Option<Vec<u8>>> for Value {
    fn from(value: Option<Vec<u8>>) -> Self {
        Value::Bytes(value)
    }
}

/// A statement and its parameters (`$1`, `$2`, ... in order).
#[derive(Debug, Clone)]
pub(super) struct Statement {
    /// The SQL, valid on both backends.
    sql: String,
    /// The values of `$1`, `$2`, ...
    args: Vec<Value>,
}

impl Statement {
    pub(super) fn new(sql: impl Into<String>) -> Statement {
        Statement {
            sql: sql.into(),
            args: Vec::new(),
        }
    }

    /// Binds the next parameter.
    pub(super) fn bind(mut self, value: impl Into<Value>) -> Statement {
        self.args.push(value.into());
        self
    }

    fn sqlite(&self) -> sqlx::query::Query<'_, Sqlite, sqlx::sqlite::SqliteArguments<'_>> {
        let mut query = sqlx::query(&self.sql);
        for arg in &self.args {
            query = match arg {
                Value::Int(value) => query.bind(*value),
                Value::Bool(value) => query.bind(*value),
                Value::Text(value) => query.bind(value.as_deref()),
                Value::Bytes(value) => query.bind(value.as_deref()),
            };
        }
        query
    }

    /// Prepared (from the connection's statement cache) and bound on the SQLite writer's
    /// connection. SQLite numbers `$N` parameters by first appearance, so each is bound by the
    /// number in its name, as sqlx does.
    fn written<'c>(
        &self,
        conn: &'c rusqlite::Connection,
    ) -> rusqlite::Result<rusqlite::CachedStatement<'c>> {
        let mut statement = conn.prepare_cached(&self.sql)?;
        for index in 1..=statement.parameter_count() {
            let number = statement
                .parameter_name(index)
                .and_then(|name| name.strip_prefix('$'))
                .and_then(|number| number.parse::<usize>().ok())
                .unwrap_or(index);
            let value = number
                .checked_sub(1)
                .and_then(|at| self.args.get(at))
                .ok_or(rusqlite::Error::InvalidParameterCount(
                    number,
                    self.args.len(),
                ))?;
            match value {
                Value::Int(value) => statement.raw_bind_parameter(index, value)?,
                Value::Bool(value) => statement.raw_bind_parameter(index, value)?,
                Value::Text(value) => statement.raw_bind_parameter(index, value.as_deref())?,
                Value::Bytes(value) => statement.raw_bind_parameter(index, value.as_deref())?,
            }
        }
        Ok(statement)
    }

    /// Runs on the SQLite writer's connection: every row, owned.
    fn written_rows(&self, conn: &rusqlite::Connection) -> rusqlite::Result<Vec<Row>> {
        let mut statement = self.written(conn)?;
        let names: Arc<[String]> = statement
            .column_names()
            .into_iter()
            .map(str::to_owned)
            .collect();
        let mut rows = statement.raw_query();
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            let values = (0..names.len())
                .map(|at| row.get_ref(at).map(rusqlite::types::Value::from))
                .collect::<rusqlite::Result<Vec<_>>>()?;
            out.push(Row::Written(Written {
                names: names.clone(),
                values,
            }));
        }
        Ok(out)
    }

    /// Runs on the SQLite writer's connection to its end (rows, if any, are dropped): how many
    /// rows it changed.
    fn written_execute(&self, conn: &rusqlite::Connection) -> rusqlite::Result<u64> {
        let mut statement = self.written(conn)?;
        let mut rows = statement.raw_query();
        while rows.next()?.is_some() {}
        Ok(conn.changes())
    }

    fn postgres(&self) -> sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments> {
        let mut query = sqlx::query(&self.sql);
        for arg in &self.args {
            query = match arg {
                Value::Int(value) => query.bind(*value),
                Value::Bool(value) => query.bind(*value),
                Value::Text(value) => query.bind(value.as_deref()),
                Value::Bytes(value) => query.bind(value.as_deref()),
            };
        }
        query
    }
}

/// A result row of either backend.
pub(super) enum Row {
    /// From SQLite's read pool.
    Sqlite(SqliteRow),
    /// From SQLite's writing connection.
    Written(Written),
    Postgres(PgRow),
}

/// A row from SQLite's writing connection: its values, owned, and the statement's column names.
pub(super) struct Written {
    names: Arc<[String]>,
    values: Vec<rusqlite::types::Value>,
}

impl Written {
    fn decode<T: FromSql>(&self, at: usize) -> Result<T> {
        let value = self
            .values
            .get(at)
            .ok_or(rusqlite::Error::InvalidColumnIndex(at))?;
        T::column_result(ValueRef::from(value)).map_err(|err| {
            rusqlite::Error::FromSqlConversionFailure(at, value.data_type(), Box::new(err)).into()
        })
    }

    fn named<T: FromSql>(&self, name: &str) -> Result<T> {
        let at = self
            .names
            .iter()
            .position(|column| column == name)
            .ok_or_else(|| rusqlite::Error::InvalidColumnName(name.to_owned()))?;
        self.decode(at)
    }
}

impl Row {
    /// Column `name` as a type both backends decode alike (text, bytes, `i64` of a `BIGINT`,
    /// and their `Option`s).
    pub(super) fn get<T>(&self, name: &str) -> Result<T>
    where
        T: for<'r> Decode<'r, Sqlite>
            + Type<Sqlite>
            + for<'r> Decode<'r, Postgres>
            + Type<Postgres>
            + FromSql,
    {
        Ok(match self {
            Row::Sqlite(row) => row.try_get(name)?,
            Row::Written(row) => row.named(name)?,
            Row::Postgres(row) => row.try_get(name)?,
        })
    }

    /// An integer column (`BIGINT` on PostgreSQL, as are its counts and sums).
    pub(super) fn int(&self, name: &str) -> Result<i64> {
        self.get(name)
    }

    /// A flag column: an SQLite integer, a PostgreSQL `SMALLINT`.
    pub(super) fn flag(&self, name: &str) -> Result<bool> {
        Ok(match self {
            Row::Sqlite(row) => row.try_get::<bool, _>(name)?,
            Row::Written(row) => row.named::<bool>(name)?,
            Row::Postgres(row) => row.try_get::<i16, _>(name)? != 0,
        })
    }

    /// Column number `index` (for unnamed expressions such as `COUNT(*)`).
    pub(super) fn at<T>(&self, index: usize) -> Result<T>
    where
        T: for<'r> Decode<'r, Sqlite>
            + Type<Sqlite>
            + for<'r> Decode<'r, Postgres>
            + Type<Postgres>
            + FromSql,
    {
        Ok(match self {
            Row::Sqlite(row) => row.try_get(index)?,
            Row::Written(row) => row.decode(index)?,
            Row::Postgres(row) => row.try_get(index)?,
        })
    }
}

/// The connection a write job runs on, with the job's record of the rows it wrote: the SQLite
/// writer's (for the writer's cache: see [`super::written`]), or a PostgreSQL transaction's (for
/// what the replica heard: see [`super::heard`]).
pub(super) enum Conn<'c> {
    Sqlite(&'c mut rusqlite::Connection, &'c mut Effects),
    Postgres(&'c mut PgConnection, &'c mut Effects),
}

impl Conn<'_> {
    /// A statement that returns live-lesson rows (`RETURNING` the store's lesson columns):
    /// decoded, and recorded for the writer's cache (SQLite) or with their revisions for what
    /// the replica heard (PostgreSQL).
    pub(super) async fn fetch_lessons(&mut self, statement: Statement) -> Result<Vec<LiveLesson>> {
        let rows = self.fetch_all(statement).await?;
        let lessons = rows
            .iter()
            .map(super::lesson_from_row)
            .collect::<Result<Vec<_>>>()?;
        match self {
            Conn::Sqlite(_, effects) => {
                effects.declare(lessons.iter().cloned().map(Effect::Lesson));
            }
            Conn::Postgres(_, effects) => {
                for (row, lesson) in rows.iter().zip(&lessons) {
                    effects.revise(row.int("revision")? as u64, lesson.clone());
                }
            }
        }
        Ok(lessons)
    }

    /// [`Conn::fetch_lessons`] of a statement changing at most one live lesson.
    pub(super) async fn fetch_lesson(
        &mut self,
        statement: Statement,
    ) -> Result<Option<LiveLesson>> {
        Ok(self.fetch_lessons(statement).await?.pop())
    }

    /// A statement deleting live lesson `id` (and nothing else of `live_lessons`): recorded
    /// for the writer's cache or what the replica heard. Returns how many rows it deleted.
    pub(super) async fn forget_lesson(
        &mut self,
        statement: Statement,
        id: LiveLessonId,
    ) -> Result<u64> {
        let deleted = self.execute(statement).await?;
        let (Conn::Sqlite(_, effects) | Conn::Postgres(_, effects)) = self;
        effects.declare((0..deleted).map(|_| Effect::Gone(id)));
        Ok(deleted)
    }

    /// Records something the job did that the writer's cache (or what the replica heard)
    /// must learn but that changed no live-lesson row (a session's token, sessions that
    /// expired).
    pub(super) fn note(&mut self, effect: Effect) {
        let (Conn::Sqlite(_, effects) | Conn::Postgres(_, effects)) = self;
        effects.note(effect);
    }

    pub(super) async fn fetch_optional(&mut self, statement: Statement) -> Result<Option<Row>> {
        Ok(match self {
            Conn::Sqlite(conn, _) => statement.written_rows(conn)?.into_iter().next(),
            Conn::Postgres(conn, _) => statement
                .postgres()
                .fetch_optional(&mut **conn)
                .await?
                .map(Row::Postgres),
        })
    }

    pub(super) async fn fetch_all(&mut self, statement: Statement) -> Result<Vec<Row>> {
        Ok(match self {
            Conn::Sqlite(conn, _) => statement.written_rows(conn)?,
            Conn::Postgres(conn, _) => statement
                .postgres()
                .fetch_all(&mut **conn)
                .await?
                .into_iter()
                .map(Row::Postgres)
                .collect(),
        })
    }

    /// Runs a statement; returns how many rows it changed.
    pub(super) async fn execute(&mut self, statement: Statement) -> Result<u64> {
        Ok(match self {
            Conn::Sqlite(conn, _) => statement.written_execute(conn)?,
            Conn::Postgres(conn, _) => statement
                .postgres()
                .execute(&mut **conn)
                .await?
                .rows_affected(),
        })
    }

    /// Serialises this write with every other write on the same session until it commits: the
    /// session row is locked (`FOR UPDATE`), so a limit counted by the next statement (a new
    /// snapshot under READ COMMITTED) sees every other writer's committed rows, and the reaper
    /// cannot expire the session in between. SQLite's single writer already serialises.
    pub(super) async fn lock_session(&mut self, session: SessionId) -> Result<()> {
        if let Conn::Postgres(conn, _) = self {
            sqlx::query("SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE")
                .bind(session.to_string())
                .fetch_optional(&mut **conn)
                .await?;
        }
        Ok(())
    }

    /// Serialises this write with every other write naming `key` until it commits (a
    /// transaction-scoped advisory lock on PostgreSQL; hash collisions only serialise more).
    /// For limits over rows that have no row of their own to lock, such as sessions per
    /// network.
    pub(super) async fn lock_name(&mut self, key: &str) -> Result<()> {
        if let Conn::Postgres(conn, _) = self {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
                .bind(key)
                .execute(&mut **conn)
                .await?;
        }
        Ok(())
    }
}

/// The read side: SQLite's read-only pool, or the PostgreSQL pool, counting its queries.
#[derive(Clone)]
pub(super) enum Pool {
    Sqlite(SqlitePool, Arc<Traffic>),
    Postgres(PgPool, Arc<Traffic>),
}

impl Pool {
    /// Counts one query.
    fn count(&self) {
        match self {
            Pool::Sqlite(_, traffic) | Pool::Postgres(_, traffic) => traffic.read(),
        }
    }

    pub(super) async fn fetch_optional(&self, statement: Statement) -> Result<Option<Row>> {
        self.count();
        Ok(match self {
            Pool::Sqlite(pool, _) => statement
                .sqlite()
                .fetch_optional(pool)
                .await?
                .map(Row::Sqlite),
            Pool::Postgres(pool, _) => statement
                .postgres()
                .fetch_optional(pool)
                .await?
                .map(Row::Postgres),
        })
    }

    pub(super) async fn fetch_one(&self, statement: Statement) -> Result<Row> {
        self.count();
        Ok(match self {
            Pool::Sqlite(pool, _) => Row::Sqlite(statement.sqlite().fetch_one(pool).await?),
            Pool::Postgres(pool, _) => Row::Postgres(statement.postgres().fetch_one(pool).await?),
        })
    }

    pub(super) async fn fetch_all(&self, statement: Statement) -> Result<Vec<Row>> {
        self.count();
        Ok(match self {
            Pool::Sqlite(pool, _) => statement
                .sqlite()
                .fetch_all(pool)
                .await?
                .into_iter()
                .map(Row::Sqlite)
                .collect(),
            Pool::Postgres(pool, _) => statement
                .postgres()
                .fetch_all(pool)
                .await?
                .into_iter()
                .map(Row::Postgres)
                .collect(),
        })
    }

    pub(super) async fn close(&self) {
        match self {
            Pool::Sqlite(pool, _) => pool.close().await,
            Pool::Postgres(pool, _) => pool.close().await,
        }
    }
}
