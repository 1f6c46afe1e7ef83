//! Changes of live lessons made by any replica, through PostgreSQL's LISTEN/NOTIFY: the
//! migrations' triggers notify `antidote_live_lessons` for every inserted, changed or forgotten
//! live lesson, and `antidote_sessions` for every expired session, at commit. What a
//! notification says is heard by the store first ([`super::heard`]: the row, when it carries
//! it); changes beyond activity and persistence are then reported as [`Change`]s.
//! Notifications are lost while the listening connection is down, so the store forgets what it
//! heard and a reconnect is reported as [`Change::Missed`]: the listener re-reads whatever it
//! follows.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;

use super::heard::{Heard, Notice};
use super::{Store, Writer};
use crate::model::{LiveLesson, LiveLessonId, Millis, SessionId};

/// The channel live lessons' triggers notify.
const CHANNEL: &str = "antidote_live_lessons";

/// The channel expired sessions notify.
const SESSIONS: &str = "antidote_sessions";

/// How long to wait before listening again after the connection failed.
const RELISTEN: Duration = Duration::from_secs(1);

/// The longest listening may take (a connection from the pool, then LISTEN): a server that
/// accepts the connection but does not answer must not keep the listener away for good.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(15);

/// After this long without a notification the listening connection is checked with a query:
/// a connection that died without a word (a server gone with its host, a network that drops
/// packets) would otherwise wait for notifications forever, and every change of every other
/// replica would be missed.
const PROBE_AFTER: Duration = Duration::from_secs(10);

/// How long that check may take before the connection is taken as lost.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// The live lesson was inserted or changed: its generation, and whether it needs work (not
    /// settled at that generation, or being removed).
    Changed {
        /// Which.
        id: LiveLessonId,
        /// Its generation after the change.
        generation: u64,
        /// Whether a reconciler has work on it.
        needs_work: bool,
    },
    /// The live lesson was forgotten.
    Gone(LiveLessonId),
    /// The listening connection was lost and is back: notifications may have been missed.
    Missed,
}

/// A stream of [`Change`]s (PostgreSQL only).
pub struct Changes {
    /// The pool the listening connection is taken from (and given back to on failure).
    pool: sqlx::PgPool,
    /// The listening connection; `None` after a failure, until it listens again.
    listener: Option<PgListener>,
    /// What the store heard, which hears every notification first.
    heard: Arc<Heard>,
}

impl Drop for Changes {
    fn drop(&mut self) {
        if self.listener.is_some() {
            self.heard.lost();
        }
    }
}

impl Store {
    /// Starts listening to every replica's changes; `None` on SQLite (one process per file: its
    /// own changes are all there is).
    pub async fn changes(&self) -> super::Result<Option<Changes>> {
        let Writer::Postgres(_, pool) = &self.writer else {
            return Ok(None);
        };
        let listener = listen(pool).await.map_err(|err| {
            crate::error::Error::StoreOpen(format!("cannot listen to live-lesson changes: {err}"))
        })?;
        let heard = self
            .heard
            .clone()
            .expect("a PostgreSQL store keeps what it heard");
        heard.listening();
        Ok(Some(Changes {
            pool: pool.clone(),
            listener: Some(listener),
            heard,
        }))
    }
}

async fn listen(pool: &sqlx::PgPool) -> Result<PgListener, String> {
    let listening = async {
        let mut listener = PgListener::connect_with(pool).await?;
        // A lost connection is reported at once (Ok(None) from `try_recv`), not after sqlx has
        // waited for a new one from the pool: `next` listens again itself and says so.
        listener.eager_reconnect(false);
        listener.listen_all([CHANNEL, SESSIONS]).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    match tokio::time::timeout(LISTEN_TIMEOUT, listening).await {
        Ok(Ok(listener)) => Ok(listener),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {LISTEN_TIMEOUT:?}")),
    }
}

impl Changes {
    /// The next change. A lost connection (an error, the server closing it, or no answer to
    /// the check after [`PROBE_AFTER`] of silence) is listened to again (retried every second
    /// until it works), then reported as [`Change::Missed`].
    pub async fn next(&mut self) -> Change {
        loop {
            let Some(listener) = &mut self.listener else {
                match listen(&self.pool).await {
                    Ok(listener) => {
                        tracing::info!("listening to live-lesson changes again");
                        self.listener = Some(listener);
                        self.heard.listening();
                        return Change::Missed;
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "cannot listen to live-lesson changes; retrying");
                        tokio::time::sleep(RELISTEN).await;
                        continue;
                    }
                }
            };
            // `try_recv` is cancel-safe (sqlx documents that no notification is dropped), so
            // the silence timer may interrupt it.
            let received = tokio::time::timeout(PROBE_AFTER, listener.try_recv()).await;
            let lost = match received {
                Ok(Ok(Some(notification))) => match parse(notification.payload()) {
                    Some((notice, change)) => {
                        if let Some(notice) = notice {
                            self.heard.heard(notice);
                        }
                        match change {
                            Some(change) => return change,
                            None => continue,
                        }
                    }
                    None => {
                        tracing::warn!(
                            payload = notification.payload(),
                            "unreadable live-lesson notification"
                        );
                        continue;
                    }
                },
                Ok(Ok(None)) => "the server closed the connection".to_owned(),
                Ok(Err(err)) => err.to_string(),
                Err(_) => {
                    let probe = sqlx::query("SELECT 1").execute(&mut *listener);
                    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                        Ok(Ok(_)) => continue,
                        Ok(Err(err)) => format!("the check after a quiet while failed: {err}"),
                        Err(_) => format!(
                            "no answer to the check after a quiet while within {PROBE_TIMEOUT:?}"
                        ),
                    }
                }
            };
            // A fresh listener makes the reconnect explicit, so that it is always followed by
            // `Missed`.
            tracing::warn!(error = %lost, "lost the live-lesson change listener");
            self.listener = None;
            self.heard.lost();
        }
    }
}

/// Reads a notification's payload: what the store hears of it, and the change it reports
/// (none for activity and persistence, and for an expired session).
///
/// `ID GENERATION NEEDS_WORK [REVISION KIND [ROW]]` (see migration 0011; a replica of an
/// older version sends the first three words only), `ID gone`, or a session's `ID expired`.
fn parse(payload: &str) -> Option<(Option<Notice>, Option<Change>)> {
    let mut words = payload.splitn(6, ' ');
    let first = words.next()?;
    let second = words.next()?;
    let Some(third) = words.next() else {
        return match second {
            "gone" => {
                let id = LiveLessonId::from_str(first).ok()?;
                Some((Some(Notice::Gone(id)), Some(Change::Gone(id))))
            }
            "expired" => {
                let session = SessionId::from_str(first).ok()?;
                Some((Some(Notice::Expired(session)), None))
            }
            _ => None,
        };
    };
    let id = LiveLessonId::from_str(first).ok()?;
    let generation: u64 = second.parse().ok()?;
    let change = Change::Changed {
        id,
        generation,
        needs_work: third == "1",
    };
    let Some(revision) = words.next() else {
        return Some((Some(Notice::Changed(id)), Some(change)));
    };
    let revision: u64 = revision.parse().ok()?;
    let change = match words.next()? {
        "c" => Some(change),
        "q" => None,
        _ => return None,
    };
    let notice = match words.next() {
        Some(row) => Notice::Row(revision, Box::new(row_of(id, generation, row)?)),
        None => Notice::Revised(id, revision),
    };
    Some((Some(notice), change))
}

/// The live lesson a notification's JSON row describes (see [`parse`]).
fn row_of(id: LiveLessonId, generation: u64, row: &str) -> Option<LiveLesson> {
    #[allow(clippy::type_complexity)]
    let (
        session,
        slug,
        stage,
        observed,
        status,
        reason,
        deleting,
        agent,
        handle,
        endpoints,
        persistent,
        created_at,
        last_active,
        pool_session,
    ): (
        String,
        String,
        u32,
        u64,
        String,
        String,
        i64,
        Option<String>,
        String,
        String,
        i64,
        i64,
        i64,
        Option<String>,
    ) = serde_json::from_str(row).ok()?;
    Some(LiveLesson {
        id,
        session_id: SessionId::from_str(&session).ok()?,
        lesson_slug: slug,
        stage,
        generation,
        observed_generation: observed,
        status: super::parse_status(&status).ok()?,
        reason,
        deleting: deleting != 0,
        agent,
        handle: hex::decode(handle).ok()?,
        endpoints: serde_json::from_str(&endpoints).ok()?,
        persistent: persistent != 0,
        created_at: Millis(created_at),
        last_active: Millis(last_active),
        pool_session: pool_session
            .map(|session| SessionId::from_str(&session))
            .transpose()
            .ok()?,
    })
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::super::backend::Pool;
    use super::super::testing::on_both;
    use super::*;
    use crate::model::{Millis, Status};
    use crate::store::Observation;

    async fn next(changes: &mut Changes) -> Change {
        tokio::time::timeout(Duration::from_secs(10), changes.next())
            .await
            .expect("a change")
    }

    #[test]
    fn payloads_are_read() {
        let id = LiveLessonId::new();
        let changed = Change::Changed {
            id,
            generation: 3,
            needs_work: true,
        };
        assert_eq!(
            parse(&format!("{id} 3 1")),
            Some((Some(Notice::Changed(id)), Some(changed)))
        );
        assert_eq!(
            parse(&format!("{id} 3 1 7 c")),
            Some((Some(Notice::Revised(id, 7)), Some(changed)))
        );
        let session = SessionId::new();
        let row = format!(
            "[\"{session}\", \"a\", 2, 1, \"READY\", \"ready\", 0, \"null\", \"0a0b\", \"[]\", 1, \
             5, 6, null]"
        );
        let Some((Some(Notice::Row(7, lesson)), None)) = parse(&format!("{id} 3 0 7 q {row}"))
        else {
            panic!("a quiet change with its row");
        };
        assert_eq!(
            (
                lesson.id,
                lesson.session_id,
                lesson.stage,
                lesson.generation
            ),
            (id, session, 2, 3)
        );
        assert_eq!(lesson.status, Status::Ready);
        assert_eq!(lesson.handle, vec![10, 11]);
        assert_eq!(lesson.agent.as_deref(), Some("null"));
        assert!(lesson.persistent && !lesson.deleting);
        assert_eq!(lesson.last_active, Millis(6));
        assert_eq!(
            parse(&format!("{id} gone")),
            Some((Some(Notice::Gone(id)), Some(Change::Gone(id))))
        );
        assert_eq!(
            parse(&format!("{session} expired")),
            Some((Some(Notice::Expired(session)), None))
        );
        assert_eq!(parse("nonsense"), None);
        assert_eq!(parse(&format!("{id} x 1")), None);
        assert_eq!(parse(&format!("{id} 3 1 7 c [1, 2]")), None);
    }

    on_both! {
        // The server ends the listening connection (as a restart does): the loss is reported as
        // `Missed` once the listener listens again, and later changes are heard on the new
        // connection.
        async fn a_lost_listener_listens_again_and_says_so(database, store) {
            let Some(mut changes) = store.changes().await.unwrap() else {
                return; // SQLite: nothing to hear.
            };
            let Pool::Postgres(pool, _) = &store.reader else { unreachable!() };
            let ended: i64 = sqlx::query_scalar(
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND query LIKE 'LISTEN %'",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            assert_eq!(ended, 1, "one listening connection");
            assert_eq!(next(&mut changes).await, Change::Missed);
            let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
            let session = store.create_session(ip, [8; 32], 0, Millis(1)).await.unwrap();
            let (lesson, _) = store
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            assert_eq!(
                next(&mut changes).await,
                Change::Changed { id: lesson.id, generation: 1, needs_work: true }
            );
        }

        // What a replica heard of another's writes answers its reads: each change's row
        // (activity too, which reports no change), and a session's expiry takes its token away.
        async fn a_replica_answers_from_what_it_heard(database, store) {
            let Some(mut changes) = store.changes().await.unwrap() else {
                return; // SQLite: one writer, its own cache.
            };
            let heard = store.heard.clone().unwrap();
            let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
            let other = Store::open(&database).await.unwrap();
            let session = other.create_session(ip, [9; 32], 0, Millis(1)).await.unwrap();
            // A token read from the database is kept.
            assert_eq!(store.session_by_token([9; 32]).await.unwrap(), Some(session.id));
            assert_eq!(heard.session(&[9; 32]), Some(session.id));
            let (lesson, _) = other
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            assert!(matches!(next(&mut changes).await, Change::Changed { .. }));
            assert_eq!(heard.lesson(lesson.id), Some(lesson.clone()));
            other.heartbeat(lesson.id, Millis(30)).await.unwrap();
            let ready = Observation::status(Status::Ready, "ready");
            let ready = other.observe(lesson.id, 1, ready, Millis(31)).await.unwrap().unwrap();
            assert!(matches!(next(&mut changes).await, Change::Changed { .. }));
            assert_eq!(ready.last_active, Millis(30));
            assert_eq!(heard.lesson(lesson.id), Some(ready.clone()), "the heartbeat's row too");
            assert_eq!(store.find_live_lesson(lesson.id).await.unwrap(), Some(ready));
            // The session expires on the other replica: its token is gone here by the time the
            // live lessons' removal (same transaction, notified after) is heard.
            let marked = other.expire_sessions(Millis(1_000), Millis(1_001)).await.unwrap();
            assert_eq!(marked.len(), 1);
            assert!(matches!(next(&mut changes).await, Change::Changed { .. }));
            assert_eq!(heard.session(&[9; 32]), None);
            assert_eq!(store.session_by_token([9; 32]).await.unwrap(), None);
            assert_eq!(heard.lesson(lesson.id), Some(marked[0].clone()));
            other.forget(lesson.id).await.unwrap();
            assert_eq!(next(&mut changes).await, Change::Gone(lesson.id));
            assert_eq!(heard.lesson(lesson.id), None);
            assert_eq!(store.find_live_lesson(lesson.id).await.unwrap(), None);
            // Its own writes are kept at once; without a listener it answers nothing.
            let own = store.create_session(ip, [10; 32], 0, Millis(2_000)).await.unwrap();
            assert_eq!(heard.session(&[10; 32]), Some(own.id));
            drop(changes);
            assert_eq!(heard.session(&[10; 32]), None);
            assert_eq!(store.session_by_token([10; 32]).await.unwrap(), Some(own.id));
        }

        // Another store on the same database (another replica) sees every change but activity.
        async fn every_replica_hears_every_change(database, store) {
            let Some(mut changes) = store.changes().await.unwrap() else {
                return; // SQLite: nothing to hear.
            };
            let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
            let other = Store::open(&database).await.unwrap();
            let session = other.create_session(ip, [7; 32], 0, Millis(1)).await.unwrap();
            let (lesson, _) = other
                .request_live_lesson(session.id, "a", 0, 0, Millis(2))
                .await
                .unwrap();
            assert_eq!(
                next(&mut changes).await,
                Change::Changed { id: lesson.id, generation: 1, needs_work: true }
            );
            other.heartbeat(lesson.id, Millis(3)).await.unwrap();
            let ready = Observation::status(Status::Ready, "ready");
            other.observe(lesson.id, 1, ready, Millis(4)).await.unwrap().unwrap();
            // The heartbeat notified nobody: the next change is READY.
            assert_eq!(
                next(&mut changes).await,
                Change::Changed { id: lesson.id, generation: 1, needs_work: false }
            );
            other.mark_deleting(lesson.id, "deleted", Millis(5)).await.unwrap();
            assert_eq!(
                next(&mut changes).await,
                Change::Changed { id: lesson.id, generation: 2, needs_work: true }
            );
            other.forget(lesson.id).await.unwrap();
            assert_eq!(next(&mut changes).await, Change::Gone(lesson.id));
        }
    }
}
