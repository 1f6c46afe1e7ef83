//! The event log: every transition of a live lesson, written by triggers, read by the admin API.

use super::backend::Statement;
use super::{Result, Store, parse_lesson_id, parse_status};
use crate::error::Error;
use crate::model::{Event, LiveLessonId, Millis};

impl Store {
    /// A live lesson's events, oldest first: its log (`log`, the seq of its first event,
    /// indexed with `seq`), found by its first event (the only one indexed by live lesson id)
    /// even after the live lesson is gone.
    pub async fn events(&self, id: LiveLessonId) -> Result<Vec<Event>> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(
                    "SELECT seq, live_lesson_id, at, status, generation, stage, detail \
                     FROM events WHERE log IN \
                     (SELECT log FROM events WHERE live_lesson_id = $1 AND seq = log) \
                     ORDER BY seq",
                )
                .bind(id.to_string()),
            )
            .await?;
        rows.iter()
            .map(|row| {
                let stage = row.int("stage")?;
                Ok(Event {
                    seq: row.int("seq")?,
                    live_lesson_id: parse_lesson_id(&row.get::<String>("live_lesson_id")?)?,
                    at: Millis(row.int("at")?),
                    status: parse_status(&row.get::<String>("status")?)?,
                    generation: row.int("generation")? as u64,
                    stage: u32::try_from(stage)
                        .map_err(|_| Error::Corrupt(format!("stage {stage} of an event")))?,
                    detail: row.get("detail")?,
                })
            })
            .collect()
    }
}
