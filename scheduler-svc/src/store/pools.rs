//! Warm pools: the `pools` table (a target per lesson and stage, from the
//! configuration or an operator) and pool members, live lessons created in a session of their
//! own (a *pool session*: no token, persistent so never reaped by TTL, `source_net` 'pool') and
//! claimed by a learner's session at most once.
//!
//! A member is unclaimed while `session_id = pool_session`. A claim is one statement: it moves
//! `session_id` to the learner's session if the member is still unclaimed, READY at its
//! generation, not being removed, of the lesson's current definition, on an agent the request
//! accepts, and the session holds no live lesson of that lesson and is under its limit. Claims
//! of one pool take turns (on PostgreSQL a transaction lock per pool, after the session's row
//! lock every request takes), so two requests never get the same member. Triggers (migration
//! 0005) record the claim as an event and delete the emptied pool session; a forgotten
//! unclaimed member takes its pool session along. Removing a member is conditional on it being
//! unclaimed, so a claim and a shrink never both win.

use super::backend::Statement;
use super::{LESSON_COLUMNS, Result, Store, lesson_from_row, mark_for_deletion};
use crate::error::Error;
use crate::model::{LiveLesson, LiveLessonId, Millis, PoolWindow, SessionId};

/// What `source_net` pool sessions carry: no learner's address is ever counted with them.
const POOL_NET: &str = "pool";

/// Unclaimed members only.
const UNCLAIMED: &str = "pool_session = session_id";

/// What a claim did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The member, now the session's.
    Claimed(Box<LiveLesson>),
    /// No READY member of the current definition on an agent the request accepts: a miss.
    NoMember,
    /// The session could take none, whatever the pool holds: neither a hit nor a miss.
    Declined(Declined),
}

impl Claim {
    /// The claimed member, if any.
    pub fn member(self) -> Option<LiveLesson> {
        match self {
            Claim::Claimed(member) => Some(*member),
            Claim::NoMember | Claim::Declined(_) => None,
        }
    }
}

/// Why a session could take no member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declined {
    /// The session has a live lesson of the lesson already (asked twice, maybe at once).
    HasLesson,
    /// The session holds its limit of live lessons.
    AtLimit,
    /// The session expired or does not exist.
    SessionGone,
}

/// A pool as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmPool {
    /// The lesson.
    pub lesson_slug: String,
    /// The stage its members are kept at.
    pub stage: u32,
    /// The target outside every window.
    pub size: u32,
    /// Daily windows with their own targets.
    pub windows: Vec<PoolWindow>,
    /// `config` or `admin`.
    pub source: String,
    /// Who set it last (`config`, or the operator's identity).
    pub updated_by: String,
    /// When.
    pub updated_at: Millis,
}

/// Unclaimed members of one pool in one status, for `/metrics` and the admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCount {
    /// The lesson.
    pub lesson_slug: String,
    /// The stage.
    pub stage: u32,
    /// The status as stored (`READY`, ...), `TERMINATING` for members being removed.
    pub status: String,
    /// How many.
    pub count: i64,
}

fn pool_from_row(row: &super::backend::Row) -> Result<WarmPool> {
    let windows: String = row.get("windows")?;
    let stage = row.int("stage")?;
    let size = row.int("size")?;
    Ok(WarmPool {
        windows: serde_json::from_str(&windows)
            .map_err(|err| Error::Corrupt(format!("windows of a pool: {err}")))?,
        lesson_slug: row.get("lesson_slug")?,
        stage: u32::try_from(stage).map_err(|_| Error::Corrupt(format!("pool stage {stage}")))?,
        size: u32::try_from(size).map_err(|_| Error::Corrupt(format!("pool size {size}")))?,
        source: row.get("source")?,
        updated_by: row.get("updated_by")?,
        updated_at: Millis(row.int("updated_at")?),
    })
}

fn windows_json(windows: &[PoolWindow]) -> Result<String> {
    serde_json::to_string(windows)
        .map_err(|err| Error::Corrupt(format!("windows do not serialise: {err}")))
}

const POOL_COLUMNS: &str = "lesson_slug, stage, size, windows, source, updated_by, updated_at";

impl Store {
    /// Makes the configured pools (`(lesson, stage, size, windows)`) the `config` rows: new
    /// ones inserted, changed ones updated, those no longer configured deleted. Rows an
    /// operator set (`admin`) are left as they are.
    pub async fn sync_configured_pools(
        &self,
        pools: &[(String, u32, u32, Vec<PoolWindow>)],
        now: Millis,
    ) -> Result<()> {
        let mut statements = Vec::new();
        let mut keep = Vec::new();
        for (lesson, stage, size, windows) in pools {
            statements.push(
                Statement::new(format!(
                    "INSERT INTO pools ({POOL_COLUMNS}) VALUES ($1, $2, $3, $4, 'config', \
                     'config', $5) ON CONFLICT (lesson_slug, stage) DO UPDATE SET \
                     size = excluded.size, windows = excluded.windows, \
                     updated_at = excluded.updated_at \
                     WHERE pools.source = 'config' AND (pools.size <> excluded.size \
                       OR pools.windows <> excluded.windows)"
                ))
                .bind(lesson.as_str())
                .bind(*stage)
                .bind(*size)
                .bind(windows_json(windows)?)
                .bind(now.0),
            );
            keep.push(format!("{lesson}\n{stage}"));
        }
        let configured = self
            .reader
            .fetch_all(Statement::new(
                "SELECT lesson_slug, stage FROM pools WHERE source = 'config'",
            ))
            .await?;
        for row in configured {
            let (lesson, stage): (String, i64) = (row.at(0)?, row.at(1)?);
            if !keep.contains(&format!("{lesson}\n{stage}")) {
                statements.push(
                    Statement::new(
                        "DELETE FROM pools WHERE lesson_slug = $1 AND stage = $2 \
                         AND source = 'config'",
                    )
                    .bind(lesson)
                    .bind(stage),
                );
            }
        }
        self.write(move |mut conn| {
            Box::pin(async move {
                for statement in statements {
                    conn.execute(statement).await?;
                }
                Ok(())
            })
        })
        .await
    }

    /// Sets a pool's base size and windows for an operator (`identity`); the configuration no
    /// longer overwrites it.
    pub async fn set_pool(
        &self,
        lesson: &str,
        stage: u32,
        size: u32,
        windows: &[PoolWindow],
        identity: &str,
        now: Millis,
    ) -> Result<WarmPool> {
        let row = self
            .write_optional(
                Statement::new(format!(
                    "INSERT INTO pools ({POOL_COLUMNS}) VALUES ($1, $2, $3, $4, 'admin', $5, $6) \
                     ON CONFLICT (lesson_slug, stage) DO UPDATE SET size = excluded.size, \
                     windows = excluded.windows, source = 'admin', \
                     updated_by = excluded.updated_by, updated_at = excluded.updated_at \
                     RETURNING {POOL_COLUMNS}"
                ))
                .bind(lesson)
                .bind(stage)
                .bind(size)
                .bind(windows_json(windows)?)
                .bind(identity)
                .bind(now.0),
            )
            .await?
            .ok_or_else(|| Error::Corrupt("a pool upsert returned nothing".into()))?;
        pool_from_row(&row)
    }

    /// Every pool, by lesson and stage.
    pub async fn pools(&self) -> Result<Vec<WarmPool>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(format!(
                "SELECT {POOL_COLUMNS} FROM pools ORDER BY lesson_slug, stage"
            )))
            .await?;
        rows.iter().map(pool_from_row).collect()
    }

    /// Every (lesson, stage) with unclaimed members, pools or not (a pool deleted from the
    /// configuration still has members to remove).
    pub async fn pooled_lessons(&self) -> Result<Vec<(String, u32)>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(format!(
                "SELECT DISTINCT lesson_slug, stage FROM live_lessons WHERE {UNCLAIMED} \
                 ORDER BY lesson_slug, stage"
            )))
            .await?;
        rows.iter()
            .map(|row| {
                let stage: i64 = row.at(1)?;
                Ok((
                    row.at(0)?,
                    u32::try_from(stage)
                        .map_err(|_| Error::Corrupt(format!("stage {stage} of a member")))?,
                ))
            })
            .collect()
    }

    /// The unclaimed members of a pool (those being removed too), oldest first, each with the
    /// fingerprint of the definition it was made from.
    pub async fn pool_members(
        &self,
        lesson: &str,
        stage: u32,
    ) -> Result<Vec<(LiveLesson, Option<String>)>> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(format!(
                    "SELECT {LESSON_COLUMNS}, pool_fingerprint FROM live_lessons \
                     WHERE lesson_slug = $1 AND stage = $2 AND {UNCLAIMED} \
                     ORDER BY created_at, id"
                ))
                .bind(lesson)
                .bind(stage),
            )
            .await?;
        rows.iter()
            .map(|row| Ok((lesson_from_row(row)?, row.get("pool_fingerprint")?)))
            .collect()
    }

    /// The unclaimed members placed on `agent` (those being removed too), oldest first.
    pub async fn pool_members_on(&self, agent: &str) -> Result<Vec<LiveLesson>> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(format!(
                    "SELECT {LESSON_COLUMNS} FROM live_lessons WHERE agent = $1 AND {UNCLAIMED} \
                     ORDER BY created_at, id"
                ))
                .bind(agent),
            )
            .await?;
        rows.iter().map(lesson_from_row).collect()
    }

    /// Creates a member of pool (`lesson`, `stage`) made from definition `fingerprint`, in a
    /// pool session of its own: PENDING, for the reconciler to place and provision.
    pub async fn add_pool_member(
        &self,
        lesson: &str,
        stage: u32,
        fingerprint: &str,
        now: Millis,
    ) -> Result<LiveLesson> {
        let (session, id) = (SessionId::new(), LiveLessonId::new());
        let insert_session = Statement::new(
            "INSERT INTO sessions (id, source_ip, source_net, persistent, created_at, \
             last_active) VALUES ($1, '0.0.0.0', $2, 1, $3, $3)",
        )
        .bind(session.to_string())
        .bind(POOL_NET)
        .bind(now.0);
        let insert_lesson = Statement::new(format!(
            "INSERT INTO live_lessons (id, session_id, lesson_slug, stage, generation, status, \
             reason, persistent, created_at, last_active, updated_at, pool_session, \
             pool_fingerprint) \
             VALUES ($1, $2, $3, $4, 1, 'PENDING', 'warm pool member', 1, $5, $5, $5, $2, $6) \
             RETURNING {LESSON_COLUMNS}"
        ))
        .bind(id.to_string())
        .bind(session.to_string())
        .bind(lesson)
        .bind(stage)
        .bind(now.0)
        .bind(fingerprint);
        let row = self
            .write(move |mut conn| {
                Box::pin(async move {
                    conn.execute(insert_session).await?;
                    conn.fetch_optional(insert_lesson).await
                })
            })
            .await?
            .ok_or_else(|| Error::Corrupt("a member insert returned nothing".into()))?;
        lesson_from_row(&row)
    }

    /// Marks an unclaimed member for removal (`detail` says why). `None` when it was claimed
    /// meanwhile, or is gone or already being removed.
    pub async fn remove_pool_member(
        &self,
        id: LiveLessonId,
        detail: &str,
        now: Millis,
    ) -> Result<Option<LiveLesson>> {
        let row = self
            .write_optional(
                Statement::new(mark_for_deletion(&format!("id = $3 AND {UNCLAIMED}")))
                    .bind(detail)
                    .bind(now.0)
                    .bind(id.to_string()),
            )
            .await?;
        row.map(|row| lesson_from_row(&row)).transpose()
    }

    /// Hands a READY member of pool (`lesson`, `pool_stage`) made from `fingerprint` and placed
    /// on one of `agents` to `session`, unless the session already has a live lesson of
    /// `lesson`, is expired, or holds `limit` live lessons (0: no limit). Each agent comes with
    /// how many of the request's preferred labels it carries: the member is taken from an agent
    /// carrying the most, the oldest there. The member's TTL counts from `now` and follows the
    /// session's persistence from then on.
    #[allow(clippy::too_many_arguments)]
    pub async fn claim_pool_member(
        &self,
        session: SessionId,
        lesson: &str,
        pool_stage: u32,
        fingerprint: &str,
        agents: &[(String, usize)],
        limit: u32,
        now: Millis,
    ) -> Result<Claim> {
        if agents.is_empty() {
            return Ok(Claim::NoMember);
        }
        let placeholders: Vec<String> = (0..agents.len()).map(|i| format!("${}", i + 7)).collect();
        // Rank by preferred labels carried (numbers of ours, never the request's text).
        let rank: String = placeholders
            .iter()
            .zip(agents)
            .map(|(placeholder, (_, matched))| format!(" WHEN {placeholder} THEN {matched}"))
            .collect();
        let mut claim = Statement::new(format!(
            "UPDATE live_lessons SET session_id = $1, \
             persistent = (SELECT persistent FROM sessions WHERE id = $1), \
             last_active = $5, updated_at = $5, reason = 'claimed from the warm pool' \
             WHERE id = (SELECT id FROM live_lessons WHERE lesson_slug = $2 AND stage = $3 \
                 AND {UNCLAIMED} AND status = 'READY' AND observed_generation = generation \
                 AND deleting = 0 AND pool_fingerprint = $4 AND agent IN ({agents}) \
                 ORDER BY CASE agent{rank} ELSE 0 END DESC, created_at, id LIMIT 1) \
             AND {UNCLAIMED} AND deleting = 0 \
             AND EXISTS (SELECT 1 FROM sessions WHERE id = $1 AND expired = 0) \
             AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = $1 \
                 AND lesson_slug = $2) \
             AND ($6 = 0 OR (SELECT COUNT(*) FROM live_lessons WHERE session_id = $1) < $6) \
             RETURNING {LESSON_COLUMNS}",
            agents = placeholders.join(", ")
        ))
        .bind(session.to_string())
        .bind(lesson)
        .bind(pool_stage)
        .bind(fingerprint)
        .bind(now.0)
        .bind(limit);
        for (agent, _) in agents {
            claim = claim.bind(agent.as_str());
        }
        // Why nothing was claimed, read under the same locks: the session's doing, or no member.
        let declined = Statement::new(
            "SELECT (SELECT COUNT(*) FROM sessions WHERE id = $1 AND expired = 0), \
             (SELECT COUNT(*) FROM live_lessons WHERE session_id = $1 AND lesson_slug = $2), \
             (SELECT COUNT(*) FROM live_lessons WHERE session_id = $1)",
        )
        .bind(session.to_string())
        .bind(lesson);
        let pool = format!("pool {lesson} {pool_stage}");
        let (row, why) = self
            .write(move |mut conn| {
                Box::pin(async move {
                    // The session first, as every request does, then the pool: claims of one
                    // pool take turns, each choosing among members the previous left.
                    conn.lock_session(session).await?;
                    conn.lock_name(&pool).await?;
                    match conn.fetch_optional(claim).await? {
                        Some(row) => Ok((Some(row), None)),
                        None => Ok((None, conn.fetch_optional(declined).await?)),
                    }
                })
            })
            .await?;
        if let Some(row) = row {
            return Ok(Claim::Claimed(Box::new(lesson_from_row(&row)?)));
        }
        let Some(why) = why else {
            return Ok(Claim::NoMember);
        };
        let (open, has_lesson, held): (i64, i64, i64) = (why.at(0)?, why.at(1)?, why.at(2)?);
        Ok(if open == 0 {
            Claim::Declined(Declined::SessionGone)
        } else if has_lesson > 0 {
            Claim::Declined(Declined::HasLesson)
        } else if limit > 0 && held >= i64::from(limit) {
            Claim::Declined(Declined::AtLimit)
        } else {
            Claim::NoMember
        })
    }

    /// Whether `session` has a live lesson of `lesson`.
    pub async fn has_live_lesson(&self, session: SessionId, lesson: &str) -> Result<bool> {
        let row = self
            .reader
            .fetch_optional(
                Statement::new(
                    "SELECT 1 FROM live_lessons WHERE session_id = $1 AND lesson_slug = $2",
                )
                .bind(session.to_string())
                .bind(lesson),
            )
            .await?;
        Ok(row.is_some())
    }

    /// Unclaimed members per pool and status (members being removed as `TERMINATING`).
    pub async fn pool_counts(&self) -> Result<Vec<PoolCount>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(format!(
                "SELECT lesson_slug, stage, CASE WHEN deleting = 1 THEN 'TERMINATING' \
                 ELSE status END AS state, COUNT(*) FROM live_lessons WHERE {UNCLAIMED} \
                 GROUP BY lesson_slug, stage, state ORDER BY lesson_slug, stage, state"
            )))
            .await?;
        rows.iter()
            .map(|row| {
                let stage: i64 = row.at(1)?;
                Ok(PoolCount {
                    lesson_slug: row.at(0)?,
                    stage: u32::try_from(stage)
                        .map_err(|_| Error::Corrupt(format!("stage {stage} of a member")))?,
                    status: row.at(2)?,
                    count: row.at(3)?,
                })
            })
            .collect()
    }

    /// How many learners' live lessons wait for an agent with room (PENDING, unplaced, not
    /// being removed): while any do, pools do not grow into the room they wait for.
    pub async fn waiting_for_room(&self) -> Result<i64> {
        let row = self
            .reader
            .fetch_one(Statement::new(
                "SELECT COUNT(*) FROM live_lessons WHERE status = 'PENDING' AND agent IS NULL \
                 AND deleting = 0 AND (pool_session IS NULL OR pool_session <> session_id)",
            ))
            .await?;
        row.at(0)
    }

    /// Deletes pool sessions left without a live lesson before `cutoff` (a member's creation
    /// interrupted between its two inserts).
    pub async fn sweep_pool_sessions(&self, cutoff: Millis) -> Result<u64> {
        self.write_execute(
            Statement::new(
                "DELETE FROM sessions WHERE source_net = $1 AND created_at < $2 \
                 AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = sessions.id)",
            )
            .bind(POOL_NET)
            .bind(cutoff.0),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::IpAddr;

    use super::super::Observation;
    use super::super::testing::on_both;
    use crate::model::{Millis, PoolWindow, Status, clock_time};
    use crate::store::{Claim, Declined, Requested};

    const FP: &str = "fp1";

    /// A member taken to READY on `agent` as the reconciler would.
    async fn ready_member(
        store: &crate::store::Store,
        lesson: &str,
        agent: &str,
    ) -> crate::model::LiveLesson {
        ready_member_at(store, lesson, agent, Millis(1_000)).await
    }

    /// [`ready_member`] created at `at`.
    async fn ready_member_at(
        store: &crate::store::Store,
        lesson: &str,
        agent: &str,
        at: Millis,
    ) -> crate::model::LiveLesson {
        let member = store.add_pool_member(lesson, 0, FP, at).await.unwrap();
        store
            .observe(
                member.id,
                1,
                Observation {
                    agent: Some(agent.into()),
                    ..Observation::status(Status::Booting, "placed")
                },
                Millis(1_100),
            )
            .await
            .unwrap()
            .unwrap();
        store
            .observe(
                member.id,
                1,
                Observation::status(Status::Ready, "ready"),
                Millis(1_200),
            )
            .await
            .unwrap()
            .unwrap()
    }

    async fn learner(store: &crate::store::Store, n: u8) -> crate::model::SessionId {
        let ip: IpAddr = format!("10.0.0.{n}").parse().unwrap();
        store
            .create_session(ip, [n; 32], 0, Millis(1_000))
            .await
            .unwrap()
            .id
    }

    on_both! {
        async fn pools_are_configured_then_set_by_operators(database, store) {
            let window = PoolWindow {
                from: clock_time::parse("08:45").unwrap(),
                to: clock_time::parse("10:00").unwrap(),
                size: 30,
            };
            let configured = vec![
                ("a".to_owned(), 0, 3, vec![window]),
                ("b".to_owned(), 1, 2, vec![]),
            ];
            store.sync_configured_pools(&configured, Millis(1)).await.unwrap();
            let pools = store.pools().await.unwrap();
            assert_eq!(pools.len(), 2);
            assert_eq!((pools[0].size, pools[0].windows.clone()), (3, vec![window]));
            // An operator's size survives the configuration's next sync; a pool no longer
            // configured goes unless an operator set it.
            let set = store.set_pool("a", 0, 5, &[], "token:ops", Millis(2)).await.unwrap();
            assert_eq!((set.size, set.source.as_str(), set.updated_by.as_str()), (5, "admin", "token:ops"));
            store.sync_configured_pools(&configured[..1], Millis(3)).await.unwrap();
            let pools = store.pools().await.unwrap();
            assert_eq!(pools.len(), 1, "{pools:?}");
            assert_eq!((pools[0].lesson_slug.as_str(), pools[0].size), ("a", 5));
        }
    }

    on_both! {
        async fn members_are_claimed_once_and_removed_only_unclaimed(database, store) {
            let first = ready_member(&store, "lesson", "one").await;
            let second = ready_member(&store, "lesson", "two").await;
            assert!(first.unclaimed() && first.persistent);
            // Pool sessions are nobody's: not listed, not counted.
            assert!(store.sessions().await.unwrap().is_empty());
            let counts = store.counts().await.unwrap();
            assert_eq!(counts.sessions, 0);
            assert_eq!(counts.pools.len(), 1);
            assert_eq!((counts.pools[0].status.as_str(), counts.pools[0].count), ("READY", 2));

            let alice = learner(&store, 1).await;
            // Only on an agent the request accepts.
            let only_two = [("two".to_owned(), 0)];
            let claimed = store
                .claim_pool_member(alice, "lesson", 0, FP, &only_two, 3, Millis(5_000))
                .await
                .unwrap()
                .member()
                .expect("a READY member on `two`");
            assert_eq!(claimed.id, second.id);
            assert_eq!(claimed.session_id, alice);
            assert_eq!(claimed.pool_session, second.pool_session, "specs keep the pool session");
            assert!(!claimed.unclaimed() && !claimed.persistent);
            assert_eq!(claimed.last_active, Millis(5_000));
            assert_eq!(claimed.status, Status::Ready);
            // The claim is an event; the pool session went.
            let events = store.events(claimed.id).await.unwrap();
            assert_eq!(events.last().unwrap().detail, "claimed from the warm pool");
            assert_eq!(store.session_live_lessons(alice).await.unwrap().len(), 1);
            // Asking again in the same session claims nothing more: it has that lesson.
            let both = [("one".to_owned(), 0), ("two".to_owned(), 0)];
            assert_eq!(
                store
                    .claim_pool_member(alice, "lesson", 0, FP, &both, 3, Millis(5_001))
                    .await
                    .unwrap(),
                Claim::Declined(Declined::HasLesson)
            );
            let (again, outcome) = store
                .request_live_lesson(alice, "lesson", 0, 3, Millis(5_002))
                .await
                .unwrap();
            assert_eq!((again.id, outcome), (second.id, Requested::Touched));
            // A member of another definition, or none READY: nothing.
            let bob = learner(&store, 2).await;
            assert_eq!(
                store
                    .claim_pool_member(bob, "lesson", 0, "fp2", &both, 3, Millis(5_003))
                    .await
                    .unwrap(),
                Claim::NoMember
            );
            // A claimed lesson is never removed as a member.
            assert!(store
                .remove_pool_member(second.id, "pool shrank", Millis(6_000))
                .await
                .unwrap()
                .is_none());
            let removed = store
                .remove_pool_member(first.id, "pool shrank", Millis(6_000))
                .await
                .unwrap()
                .expect("unclaimed");
            assert!(removed.deleting);
            assert_eq!(
                store
                    .claim_pool_member(bob, "lesson", 0, FP, &both, 3, Millis(6_001))
                    .await
                    .unwrap(),
                Claim::NoMember,
                "a member being removed is never handed out"
            );
            // Forgetting it takes its pool session along.
            store.forget(first.id).await.unwrap();
            assert!(store.pool_members("lesson", 0).await.unwrap().is_empty());
            assert_eq!(store.sweep_pool_sessions(Millis(i64::MAX)).await.unwrap(), 0);
        }
    }

    on_both! {
        async fn concurrent_claims_never_share_a_member(database, store) {
            let mut members = HashSet::new();
            for i in 0..4 {
                members.insert(ready_member(&store, "lesson", if i % 2 == 0 { "a" } else { "b" }).await.id);
            }
            let mut sessions = Vec::new();
            for n in 0..12 {
                sessions.push(learner(&store, n + 10).await);
            }
            let agents = vec![("a".to_owned(), 0), ("b".to_owned(), 0)];
            let claims = sessions.iter().map(|session| {
                let (store, agents, session) = (store.clone(), agents.clone(), *session);
                tokio::spawn(async move {
                    store
                        .claim_pool_member(session, "lesson", 0, FP, &agents, 3, Millis(9_000))
                        .await
                        .unwrap()
                })
            });
            let won: Vec<_> = futures::future::join_all(claims)
                .await
                .into_iter()
                .filter_map(|claim| claim.unwrap().member())
                .collect();
            assert_eq!(won.len(), 4, "every member claimed once: {won:?}");
            let ids: HashSet<_> = won.iter().map(|l| l.id).collect();
            assert_eq!(ids, members);
            let owners: HashSet<_> = won.iter().map(|l| l.session_id).collect();
            assert_eq!(owners.len(), 4, "each by a different session");
            assert!(store.pool_members("lesson", 0).await.unwrap().is_empty());
            // The same session asking twice at once still gets one live lesson.
            for _ in 0..2 {
                ready_member(&store, "lesson", "a").await;
            }
            let carol = learner(&store, 99).await;
            let twice = (0..2).map(|_| {
                let (store, agents) = (store.clone(), agents.clone());
                tokio::spawn(async move {
                    store
                        .claim_pool_member(carol, "lesson", 0, FP, &agents, 3, Millis(9_500))
                        .await
                        .unwrap()
                })
            });
            let twice: Vec<_> = futures::future::join_all(twice)
                .await
                .into_iter()
                .map(|claim| claim.unwrap())
                .collect();
            assert!(
                twice.contains(&Claim::Declined(Declined::HasLesson)),
                "the loser is declined, not a miss: {twice:?}"
            );
            let twice = twice.into_iter().map(Ok::<_, tokio::task::JoinError>);
            let got: Vec<_> = twice
                .filter_map(|claim| claim.unwrap().member())
                .collect();
            assert_eq!(got.len(), 1, "{got:?}");
            assert_eq!(store.pool_members("lesson", 0).await.unwrap().len(), 1);
        }
    }

    on_both! {
        async fn a_session_at_its_limit_or_expired_takes_no_member(database, store) {
            let member = ready_member(&store, "lesson", "a").await;
            let agents = [("a".to_owned(), 0)];
            let dave = learner(&store, 3).await;
            store
                .request_live_lesson(dave, "other", 0, 1, Millis(4_000))
                .await
                .unwrap();
            assert_eq!(
                store
                    .claim_pool_member(dave, "lesson", 0, FP, &agents, 1, Millis(4_100))
                    .await
                    .unwrap(),
                Claim::Declined(Declined::AtLimit)
            );
            let nobody = crate::model::SessionId::new();
            assert_eq!(
                store
                    .claim_pool_member(nobody, "lesson", 0, FP, &agents, 1, Millis(4_200))
                    .await
                    .unwrap(),
                Claim::Declined(Declined::SessionGone)
            );
            let left = store.pool_members("lesson", 0).await.unwrap();
            assert_eq!(left.len(), 1);
            assert!(left[0].0.unclaimed() && left[0].0.id == member.id, "{left:?}");
            // Under its limit (or with none), the same session takes it.
            let claimed = store
                .claim_pool_member(dave, "lesson", 0, FP, &agents, 2, Millis(4_300))
                .await
                .unwrap()
                .member()
                .expect("under the limit");
            assert_eq!((claimed.id, claimed.session_id), (member.id, dave));
        }
    }

    on_both! {
        async fn a_claim_takes_from_the_agent_carrying_most_preferred_labels(database, store) {
            let old = ready_member_at(&store, "lesson", "plain", Millis(900)).await;
            let preferred = ready_member_at(&store, "lesson", "ssd", Millis(1_000)).await;
            let erin = learner(&store, 4).await;
            let claimed = store
                .claim_pool_member(
                    erin,
                    "lesson",
                    0,
                    FP,
                    &[("plain".to_owned(), 0), ("ssd".to_owned(), 1)],
                    3,
                    Millis(5_000),
                )
                .await
                .unwrap()
                .member()
                .unwrap();
            assert_eq!(claimed.id, preferred.id, "the preferred agent's, though newer");
            // Without preferences, the oldest.
            ready_member_at(&store, "lesson", "ssd", Millis(1_000)).await;
            let frank = learner(&store, 5).await;
            let claimed = store
                .claim_pool_member(
                    frank,
                    "lesson",
                    0,
                    FP,
                    &[("plain".to_owned(), 0), ("ssd".to_owned(), 0)],
                    3,
                    Millis(5_100),
                )
                .await
                .unwrap()
                .member()
                .unwrap();
            assert_eq!(claimed.id, old.id);
        }
    }
}
