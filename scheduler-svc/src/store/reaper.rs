//! The reaper's statements: idle live lessons and sessions expire (persistent ones never do:
//! see [`crate::model::expiry`]), old events are pruned, and orphans are checked against the
//! store.

use std::str::FromStr as _;

use super::backend::Statement;
use super::effects::Effect;
use super::{Result, Store, mark_for_deletion};
use crate::error::Error;
use crate::model::{LiveLesson, LiveLessonId, Millis, SessionId};

/// Which rows (of `sessions` or `live_lessons`, both carry the session's flag) idle expiry may
/// take: the store's form of [`crate::model::expiry`]'s rule.
const EXPIRES: &str = "persistent = 0";

impl Store {
    /// Marks for removal every live lesson idle since before `cutoff` whose session is not
    /// persistent; returns them.
    pub async fn expire_live_lessons(
        &self,
        cutoff: Millis,
        now: Millis,
    ) -> Result<Vec<LiveLesson>> {
        self.write_lessons(
            Statement::new(mark_for_deletion(&format!(
                "{EXPIRES} AND last_active < $3"
            )))
            .bind("expired: idle past the live lesson TTL")
            .bind(now.0)
            .bind(cutoff.0),
        )
        .await
    }

    /// Expires every non-persistent session idle since before `cutoff`, marks its live lessons
    /// for removal and returns them; sessions left without live lessons are deleted at once.
    ///
    /// Three statements in one write job: a transaction on PostgreSQL; on SQLite, inside the
    /// writer's batch, or each on its own when the job runs alone. Each is idempotent and the
    /// next tick redoes whatever a failure interrupted (expired sessions accept no requests
    /// meanwhile).
    pub async fn expire_sessions(&self, cutoff: Millis, now: Millis) -> Result<Vec<LiveLesson>> {
        self.write(move |mut conn| {
                Box::pin(async move {
                    let expired = conn
                        .fetch_all(
                            Statement::new(format!(
                                "UPDATE sessions SET expired = 1 WHERE expired = 0 AND {EXPIRES} \
                                 AND last_active < $1 RETURNING id"
                            ))
                            .bind(cutoff.0),
                        )
                        .await?;
                    // Their tokens are invalid from this commit on (noted at once: what
                    // follows may fail, this statement stands).
                    let expired = expired
                        .iter()
                        .map(|row| {
                            let id: String = row.at(0)?;
                            SessionId::from_str(&id).map_err(|err| Error::Corrupt(err.to_string()))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    conn.note(Effect::Expired(expired));
                    let rows = conn
                        .fetch_lessons(
                            Statement::new(mark_for_deletion(
                                "session_id IN (SELECT id FROM sessions WHERE expired = 1)",
                            ))
                            .bind("expired: session idle past its TTL")
                            .bind(now.0),
                        )
                        .await?;
                    conn.execute(Statement::new(
                        "DELETE FROM sessions WHERE expired = 1 \
                         AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = sessions.id)",
                    ))
                    .await?;
                    Ok(rows)
                })
            })
            .await
    }

    /// Deletes events of live lessons that no longer exist, older than `cutoff`. A log's first
    /// event (the one found by live lesson id) goes only with the last of its log, so what is
    /// kept stays readable.
    pub async fn prune_events(&self, cutoff: Millis) -> Result<u64> {
        self.write_execute(
            Statement::new(
                "DELETE FROM events WHERE at < $1 \
                 AND live_lesson_id NOT IN (SELECT id FROM live_lessons) \
                 AND (seq <> log OR NOT EXISTS \
                      (SELECT 1 FROM events later WHERE later.log = events.log \
                       AND later.seq > events.seq AND later.at >= $1))",
            )
            .bind(cutoff.0),
        )
        .await
    }

    /// Whether a live lesson with this id exists.
    pub async fn exists(&self, id: LiveLessonId) -> Result<bool> {
        let found = self
            .reader
            .fetch_optional(
                Statement::new("SELECT 1 FROM live_lessons WHERE id = $1").bind(id.to_string()),
            )
            .await?;
        Ok(found.is_some())
    }
}
