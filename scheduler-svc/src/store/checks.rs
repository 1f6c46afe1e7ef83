//! Stage checks (migration 0009): per live lesson and stage, when its check first passed and
//! its latest run. A table of its own, so that a check writes no `live_lessons` row: the
//! writer's cache and the replicas' change notifications never hear of it. A forgotten live
//! lesson's rows are deleted by a trigger.

use super::backend::Statement;
use super::{Result, Store};
use crate::error::Error;
use crate::model::{CheckRun, LiveLessonId, StageChecks};

impl Store {
    /// Records a run of a live lesson's check: its stage's latest run, and its first pass when
    /// it passed (a pass is never undone by a later failure).
    pub async fn record_check(&self, id: LiveLessonId, run: &CheckRun) -> Result<()> {
        let json = serde_json::to_string(run)
            .map_err(|err| Error::Corrupt(format!("check run of {id}: {err}")))?;
        self.write_execute(
            Statement::new(
                "INSERT INTO stage_checks (live_lesson_id, stage, passed_at, last_at, last_run) \
                 VALUES ($1, $2, CASE WHEN $3 THEN $4 END, $4, $5) \
                 ON CONFLICT (live_lesson_id, stage) DO UPDATE SET \
                 passed_at = COALESCE(stage_checks.passed_at, excluded.passed_at), \
                 last_at = excluded.last_at, last_run = excluded.last_run",
            )
            .bind(id.to_string())
            .bind(run.stage)
            .bind(run.passed)
            .bind(run.at)
            .bind(json),
        )
        .await?;
        Ok(())
    }

    /// What a live lesson's checks established (nothing for one that never ran a check).
    pub async fn stage_checks(&self, id: LiveLessonId) -> Result<StageChecks> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(
                    "SELECT stage, passed_at, last_at, last_run FROM stage_checks \
                     WHERE live_lesson_id = $1 ORDER BY stage",
                )
                .bind(id.to_string()),
            )
            .await?;
        let mut checks = StageChecks::default();
        let mut last_at = i64::MIN;
        for row in rows {
            let stage = u32::try_from(row.int("stage")?)
                .map_err(|_| Error::Corrupt(format!("stage check of {id}: a negative stage")))?;
            if row.get::<Option<i64>>("passed_at")?.is_some() {
                checks.passed.insert(stage);
            }
            let at = row.int("last_at")?;
            if at >= last_at {
                last_at = at;
                let text: String = row.get("last_run")?;
                let run = serde_json::from_str(&text)
                    .map_err(|err| Error::Corrupt(format!("stage check of {id}: {err}")))?;
                checks.last = Some(run);
            }
        }
        Ok(checks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EndpointCheck, Millis};
    use crate::store::testing::on_both;

    fn check_run(stage: u32, passed: bool, at: i64) -> CheckRun {
        CheckRun {
            stage,
            passed,
            endpoints: vec![EndpointCheck {
                endpoint: "client".into(),
                file_name: "client.sh".into(),
                passed,
                exit_code: if passed { 0 } else { 1 },
                timed_out: false,
                feedback: "no route to 10.10.2.10".into(),
                truncated: false,
                duration_ms: 12,
            }],
            at,
            duration_ms: 20,
        }
    }

    on_both! {
    async fn a_pass_stays_and_the_latest_run_is_kept(database, store) {
        let session = store
            .create_session("127.0.0.1".parse().unwrap(), [7; 32], 10, Millis(1))
            .await
            .unwrap();
        let (lesson, _) = store
            .request_live_lesson(session.id, "routing", 0, 5, Millis(1))
            .await
            .unwrap();
        assert_eq!(store.stage_checks(lesson.id).await.unwrap(), StageChecks::default());
        store.record_check(lesson.id, &check_run(1, false, 10)).await.unwrap();
        store.record_check(lesson.id, &check_run(1, true, 20)).await.unwrap();
        store.record_check(lesson.id, &check_run(1, false, 30)).await.unwrap();
        store.record_check(lesson.id, &check_run(0, false, 40)).await.unwrap();
        let checks = store.stage_checks(lesson.id).await.unwrap();
        assert_eq!(checks.passed.into_iter().collect::<Vec<_>>(), [1], "a pass is not undone");
        assert_eq!(checks.last, Some(check_run(0, false, 40)));
        // A forgotten live lesson's checks go with it.
        store.mark_deleting(lesson.id, "deleted", Millis(50)).await.unwrap();
        store.forget(lesson.id).await.unwrap();
        assert_eq!(store.stage_checks(lesson.id).await.unwrap(), StageChecks::default());
    }
    }
}
