//! The reaper's statements: idle live lessons and sessions expire (persistent ones never do:
//! see [`crate::model::expiry`]), old events are pruned, and orphans are checked against the
//! store.

use super::{Result, Store, lesson_from_row, mark_for_deletion};
use crate::error::Error;
use crate::model::{LiveLesson, LiveLessonId, Millis};

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
        let rows = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&mark_for_deletion(&format!(
                        "{EXPIRES} AND last_active < ?3"
                    )))
                    .bind("expired: idle past the live lesson TTL")
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
                    sqlx::query(&format!(
                        "UPDATE sessions SET expired = 1 WHERE expired = 0 AND {EXPIRES} \
                         AND last_active < ?"
                    ))
                    .bind(cutoff.0)
                    .execute(&mut *conn)
                    .await?;
                    let rows = sqlx::query(&mark_for_deletion(
                        "session_id IN (SELECT id FROM sessions WHERE expired = 1)",
                    ))
                    .bind("expired: session idle past its TTL")
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
    pub async fn exists(&self, id: LiveLessonId) -> Result<bool> {
        let found: Option<i64> = sqlx::query_scalar("SELECT 1 FROM live_lessons WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.reader)
            .await?;
        Ok(found.is_some())
    }
}
