//! The event log: every transition of a live lesson, written by triggers, read by the admin API.

use sqlx::Row as _;

use super::{Result, Store, parse_lesson_id, parse_status};
use crate::model::{Event, LiveLessonId, Millis};

impl Store {
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
}
