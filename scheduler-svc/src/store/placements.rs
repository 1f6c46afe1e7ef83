//! Placement's state: what each request asked of its agent (labels it must and should carry),
//! the last decision and why, live lessons moved off a lost agent, and drained agents.
//!
//! Plain SQL (one table per subject, JSON in TEXT columns). A record is written only while its
//! live lesson exists and a trigger deletes it with the live lesson, so the reaper's expiry tick
//! never scans the table; [`Store::prune_placements`] (run at the orphan interval) removes what
//! a race between the two leaves on PostgreSQL.

use super::backend::{Conn, Row, Statement};
use super::effects::Effect;
use super::{LESSON_COLUMNS, Result, Store, parse_lesson_id};
use crate::error::Error;
use crate::model::{Decision, LiveLesson, LiveLessonId, Millis, PlacementRecord, Wishes};

/// A JSON column's text, or a corrupt-row error naming what it held.
fn to_json<T: serde::Serialize>(value: &T, what: &str) -> Result<String> {
    serde_json::to_string(value).map_err(|err| Error::Corrupt(format!("{what}: {err}")))
}

fn from_json<T: serde::de::DeserializeOwned>(text: &str, what: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|err| Error::Corrupt(format!("{what}: {err}")))
}

impl Store {
    /// Records what a request asked of the agent that runs live lesson `id` (replacing what an
    /// earlier request asked).
    pub async fn set_wishes(&self, id: LiveLessonId, wishes: &Wishes) -> Result<()> {
        let wishes = to_json(wishes, "wishes")?;
        let statement = Statement::new(format!(
            "INSERT INTO placements (live_lesson_id, wishes) SELECT $1, $2 \
             WHERE EXISTS (SELECT 1 FROM live_lessons WHERE id = $1) \
             ON CONFLICT (live_lesson_id) DO UPDATE SET wishes = excluded.wishes \
             RETURNING {RECORD_COLUMNS}"
        ))
        .bind(id.to_string())
        .bind(wishes);
        self.write(move |mut conn| Box::pin(async move { conn.fetch_placements(statement).await }))
            .await?;
        Ok(())
    }

    /// The placement record of live lesson `id` (empty when nothing was recorded). On SQLite
    /// from the writer's cache when it knows it.
    pub async fn placement(&self, id: LiveLessonId) -> Result<PlacementRecord> {
        if let Some(record) = self
            .written
            .as_ref()
            .and_then(|written| written.placement(id))
        {
            return Ok(record);
        }
        let row = self
            .reader
            .fetch_optional(
                Statement::new(format!(
                    "SELECT {RECORD_COLUMNS} FROM placements WHERE live_lesson_id = $1"
                ))
                .bind(id.to_string()),
            )
            .await?;
        match row {
            Some(row) => Ok(record_from_row(&row)?.1),
            None => Ok(PlacementRecord::default()),
        }
    }

    /// Records the decision that placed live lesson `id` (it is no longer "moved from" anywhere).
    pub async fn record_decision(
        &self,
        id: LiveLessonId,
        decision: &Decision,
        now: Millis,
    ) -> Result<()> {
        let statement = decision_statement(id, decision, now)?;
        self.write(move |mut conn| Box::pin(async move { conn.fetch_placements(statement).await }))
            .await?;
        Ok(())
    }

    /// Moves every live lesson off `agent`, which is lost: those not FAILED lose their placement,
    /// endpoints and handle and start over as PENDING in a new generation (so nothing a worker
    /// still waiting on the lost agent observes can be recorded), with `reason` as the event's
    /// detail and `agent` as where they were moved from; FAILED ones only lose their placement
    /// (a retry places them anew). Live lessons being removed stay: their removal forgets them.
    /// Returns the live lessons moved (FAILED ones included).
    ///
    /// Two statements in one write job (a transaction on PostgreSQL, a savepoint in the
    /// writer's batch on SQLite): each is idempotent and the reconciler's next look at the lost agent redoes
    /// whatever a crash interrupted.
    pub async fn relocate(
        &self,
        agent: &str,
        reason: &str,
        now: Millis,
    ) -> Result<Vec<LiveLesson>> {
        let moved = Statement::new(format!(
            "INSERT INTO placements (live_lesson_id, moved_from) \
             SELECT id, $1 FROM live_lessons \
             WHERE agent = $1 AND deleting = 0 AND status != 'FAILED' \
             ON CONFLICT (live_lesson_id) DO UPDATE SET moved_from = excluded.moved_from \
             RETURNING {RECORD_COLUMNS}"
        ))
        .bind(agent);
        // The empty handle is bound (`$4`), not written as a literal: SQLite's `x''` and
        // PostgreSQL's `'\x'` differ.
        let reset = Statement::new(format!(
            "UPDATE live_lessons SET agent = NULL, handle = $4, \
             endpoints = CASE WHEN status = 'FAILED' THEN endpoints ELSE '[]' END, \
             generation = CASE WHEN status = 'FAILED' THEN generation \
                          ELSE generation + 1 END, \
             reason = CASE WHEN status = 'FAILED' THEN reason ELSE $2 END, \
             status = CASE WHEN status = 'FAILED' THEN status ELSE 'PENDING' END, \
             updated_at = $3 WHERE agent = $1 AND deleting = 0 \
             RETURNING {LESSON_COLUMNS}"
        ))
        .bind(agent)
        .bind(reason)
        .bind(now.0)
        .bind(Vec::<u8>::new());
        self.write(move |mut conn| {
            Box::pin(async move {
                conn.fetch_placements(moved).await?;
                conn.fetch_lessons(reset).await
            })
        })
        .await
    }

    /// Which agent the store places live lesson `id` on: `None` when the store does not know
    /// the live lesson, `Some(None)` while it is unplaced. The orphan check asks this per
    /// (agent, live lesson): objects of a live lesson placed elsewhere are orphans too.
    pub async fn holder(&self, id: LiveLessonId) -> Result<Option<Option<String>>> {
        let row = self
            .reader
            .fetch_optional(
                Statement::new("SELECT agent FROM live_lessons WHERE id = $1").bind(id.to_string()),
            )
            .await?;
        row.map(|row| row.get("agent")).transpose()
    }

    /// Deletes the placement records of live lessons that no longer exist: only a write racing
    /// the live lesson's deletion on PostgreSQL leaves one (a scan of every record: the reaper
    /// runs it at the orphan interval, not every tick).
    pub async fn prune_placements(&self) -> Result<u64> {
        self.write_execute(Statement::new(
            "DELETE FROM placements WHERE live_lesson_id NOT IN (SELECT id FROM live_lessons)",
        ))
        .await
    }

    /// Marks an agent drained by `identity` (draining twice keeps the first record).
    pub async fn drain_agent(&self, agent: &str, identity: &str, now: Millis) -> Result<()> {
        self.write_execute(
            Statement::new(
                "INSERT INTO drained_agents (name, drained_at, identity) VALUES ($1, $2, $3) \
                 ON CONFLICT (name) DO NOTHING",
            )
            .bind(agent)
            .bind(now.0)
            .bind(identity),
        )
        .await?;
        Ok(())
    }

    /// Lets placement choose an agent again.
    pub async fn resume_agent(&self, agent: &str) -> Result<()> {
        self.write_execute(
            Statement::new("DELETE FROM drained_agents WHERE name = $1").bind(agent),
        )
        .await?;
        Ok(())
    }

    /// The names of every drained agent.
    pub async fn drained_agents(&self) -> Result<Vec<String>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(
                "SELECT name FROM drained_agents ORDER BY name",
            ))
            .await?;
        rows.iter().map(|row| row.get("name")).collect()
    }

    /// Ids of the live lessons placed on `agent` that are not being removed (what moving off
    /// a lost agent concerns).
    pub async fn held_by(&self, agent: &str) -> Result<Vec<LiveLessonId>> {
        self.ids(
            Statement::new(
                "SELECT id FROM live_lessons WHERE agent = $1 AND deleting = 0 \
                 ORDER BY created_at",
            )
            .bind(agent),
        )
        .await
    }
}

/// A placement record's columns, as statements return them.
pub(super) const RECORD_COLUMNS: &str = "live_lesson_id, wishes, decision, decided_at, moved_from";

/// A row of [`RECORD_COLUMNS`]: whose record, and the record.
pub(super) fn record_from_row(row: &Row) -> Result<(LiveLessonId, PlacementRecord)> {
    let id = parse_lesson_id(&row.get::<String>("live_lesson_id")?)?;
    let wishes: String = row.get("wishes")?;
    let decision: Option<String> = row.get("decision")?;
    Ok((
        id,
        PlacementRecord {
            wishes: from_json(&wishes, &format!("wishes of {id}"))?,
            decision: decision
                .map(|text| from_json::<Decision>(&text, &format!("decision of {id}")))
                .transpose()?,
            decided_at: row.get::<Option<i64>>("decided_at")?.map(Millis),
            moved_from: row.get("moved_from")?,
        },
    ))
}

/// The statement recording the decision that placed live lesson `id` (it is no longer "moved
/// from" anywhere); nothing when the live lesson is gone.
pub(super) fn decision_statement(
    id: LiveLessonId,
    decision: &Decision,
    now: Millis,
) -> Result<Statement> {
    Ok(Statement::new(format!(
        "INSERT INTO placements (live_lesson_id, decision, decided_at) \
         SELECT $1, $2, $3 WHERE EXISTS (SELECT 1 FROM live_lessons WHERE id = $1) \
         ON CONFLICT (live_lesson_id) DO UPDATE SET \
         decision = excluded.decision, decided_at = excluded.decided_at, \
         moved_from = NULL RETURNING {RECORD_COLUMNS}"
    ))
    .bind(id.to_string())
    .bind(to_json(decision, "decision")?)
    .bind(now.0))
}

impl Conn<'_> {
    /// A statement that writes placement records and returns them (`RETURNING` the record
    /// columns, [`RECORD_COLUMNS`]): decoded, and on SQLite recorded for the
    /// writer's cache.
    pub(super) async fn fetch_placements(
        &mut self,
        statement: Statement,
    ) -> Result<Vec<(LiveLessonId, PlacementRecord)>> {
        let rows = self.fetch_all(statement).await?;
        let records = rows
            .iter()
            .map(record_from_row)
            .collect::<Result<Vec<_>>>()?;
        if let Conn::Sqlite(_, effects) = self {
            effects.declare_placements(
                records
                    .iter()
                    .map(|(id, record)| Effect::Placement(*id, record.clone())),
            );
        }
        Ok(records)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::model::Status;
    use crate::store::Observation;
    use crate::store::testing::on_both;

    const IP: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    on_both! {
    async fn wishes_decisions_and_moves_are_recorded(database, store) {
        let session = store
            .create_session(IP, [7; 32], 0, Millis(1))
            .await
            .unwrap();
        let (ready, _) = store
            .request_live_lesson(session.id, "a", 0, 0, Millis(2))
            .await
            .unwrap();
        let (failed, _) = store
            .request_live_lesson(session.id, "b", 0, 0, Millis(2))
            .await
            .unwrap();
        let wishes = Wishes {
            requires: BTreeMap::from([("region".into(), "eu".into())]),
            prefers: BTreeMap::new(),
        };
        store.set_wishes(ready.id, &wishes).await.unwrap();
        let decision = Decision {
            agent: "x".into(),
            reason: "chose `x`".into(),
            ..Decision::default()
        };
        store
            .record_decision(ready.id, &decision, Millis(3))
            .await
            .unwrap();
        for (lesson, status) in [(&ready, Status::Ready), (&failed, Status::Failed)] {
            let observation = Observation {
                agent: Some("x".into()),
                endpoints: Some(vec![]),
                handle: Some(b"h".to_vec()),
                ..Observation::status(status, "settled")
            };
            store
                .observe(lesson.id, 1, observation, Millis(4))
                .await
                .unwrap()
                .unwrap();
        }
        assert_eq!(store.holder(ready.id).await.unwrap(), Some(Some("x".into())));
        assert_eq!(store.holder(LiveLessonId::new()).await.unwrap(), None);
        assert_eq!(store.held_by("x").await.unwrap().len(), 2);

        let moved = store
            .relocate("x", "agent `x` lost", Millis(5))
            .await
            .unwrap();
        assert_eq!(moved.len(), 2);
        let ready_now = store.live_lesson(ready.id).await.unwrap();
        assert_eq!(
            (ready_now.status, ready_now.generation, ready_now.agent.clone()),
            (Status::Pending, 2, None)
        );
        assert!(ready_now.needs_work() && ready_now.handle.is_empty());
        let failed_now = store.live_lesson(failed.id).await.unwrap();
        assert_eq!(
            (failed_now.status, failed_now.generation, failed_now.agent.clone()),
            (Status::Failed, 1, None)
        );
        let record = store.placement(ready.id).await.unwrap();
        assert_eq!(record.wishes, wishes);
        assert_eq!(record.decision, Some(decision.clone()));
        assert_eq!(record.moved_from.as_deref(), Some("x"));
        // Placed again, the decision written with the placing observation: no longer moved. A
        // stale observation writes neither.
        let placing = |agent: &str| Observation {
            agent: Some(agent.into()),
            decision: Some(Decision {
                agent: agent.into(),
                reason: format!("chose `{agent}`"),
                ..Decision::default()
            }),
            ..Observation::status(Status::Booting, format!("placed on agent `{agent}`"))
        };
        let placed = store
            .observe(ready.id, 2, placing("y"), Millis(6))
            .await
            .unwrap()
            .expect("written");
        assert_eq!(placed.agent.as_deref(), Some("y"));
        let record = store.placement(ready.id).await.unwrap();
        assert_eq!(record.moved_from, None);
        assert_eq!(record.decided_at, Some(Millis(6)));
        assert_eq!(record.decision.map(|d| d.agent).as_deref(), Some("y"));
        assert!(
            store
                .observe(ready.id, 1, placing("z"), Millis(7))
                .await
                .unwrap()
                .is_none()
        );
        let record = store.placement(ready.id).await.unwrap();
        assert_eq!(record.decision.map(|d| d.agent).as_deref(), Some("y"));
        // Nothing is left on the lost agent: a second look moves nothing.
        assert!(store.relocate("x", "again", Millis(7)).await.unwrap().is_empty());

        // The record goes with its live lesson, and a late write (a decision racing the
        // deletion) does not bring it back: pruning finds nothing.
        store.forget(ready.id).await.unwrap();
        assert_eq!(
            store.placement(ready.id).await.unwrap(),
            PlacementRecord::default()
        );
        store
            .record_decision(ready.id, &decision, Millis(8))
            .await
            .unwrap();
        store.set_wishes(ready.id, &wishes).await.unwrap();
        assert_eq!(
            store.placement(ready.id).await.unwrap(),
            PlacementRecord::default()
        );
        assert_eq!(store.prune_placements().await.unwrap(), 0);
    }

    async fn drains_survive_reopening(database, store) {
        store.drain_agent("b", "token:ops", Millis(1)).await.unwrap();
        store.drain_agent("a", "token:ops", Millis(1)).await.unwrap();
        store.drain_agent("a", "token:ops", Millis(2)).await.unwrap();
        store.resume_agent("b").await.unwrap();
        store.resume_agent("never-drained").await.unwrap();
        store.close().await;
        let store = Store::open(&database).await.unwrap();
        assert_eq!(store.drained_agents().await.unwrap(), ["a"]);
    }
    }
}
