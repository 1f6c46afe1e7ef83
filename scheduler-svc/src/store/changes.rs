//! Changes of live lessons made by any replica, through PostgreSQL's LISTEN/NOTIFY: the
//! migration's trigger notifies `antidote_live_lessons` for every inserted, changed (beyond
//! activity) or forgotten live lesson, at commit. Notifications are lost while the listening
//! connection is down, so a reconnect is reported as [`Change::Missed`]: the listener re-reads
//! whatever it follows.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::PgListener;

use super::{Store, Writer};
use crate::model::LiveLessonId;

/// The channel the trigger notifies.
const CHANNEL: &str = "antidote_live_lessons";

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
        Ok(Some(Changes {
            pool: pool.clone(),
            listener: Some(listener),
        }))
    }
}

async fn listen(pool: &sqlx::PgPool) -> Result<PgListener, String> {
    let listening = async {
        let mut listener = PgListener::connect_with(pool).await?;
        // A lost connection is reported at once (Ok(None) from `try_recv`), not after sqlx has
        // waited for a new one from the pool: `next` listens again itself and says so.
        listener.eager_reconnect(false);
        listener.listen(CHANNEL).await?;
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
                    Some(change) => return change,
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
        }
    }
}

/// Reads the trigger's payload: `ID GENERATION NEEDS_WORK` or `ID gone`.
fn parse(payload: &str) -> Option<Change> {
    let mut words = payload.split(' ');
    let id = LiveLessonId::from_str(words.next()?).ok()?;
    match (words.next()?, words.next()) {
        ("gone", None) => Some(Change::Gone(id)),
        (generation, Some(needs_work)) => Some(Change::Changed {
            id,
            generation: generation.parse().ok()?,
            needs_work: needs_work == "1",
        }),
        _ => None,
    }
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
        assert_eq!(
            parse(&format!("{id} 3 1")),
            Some(Change::Changed {
                id,
                generation: 3,
                needs_work: true
            })
        );
        assert_eq!(parse(&format!("{id} gone")), Some(Change::Gone(id)));
        assert_eq!(parse("nonsense"), None);
        assert_eq!(parse(&format!("{id} x 1")), None);
    }

    on_both! {
        // The server ends the listening connection (as a restart does): the loss is reported as
        // `Missed` once the listener listens again, and later changes are heard on the new
        // connection.
        async fn a_lost_listener_listens_again_and_says_so(database, store) {
            let Some(mut changes) = store.changes().await.unwrap() else {
                return; // SQLite: nothing to hear.
            };
            let Pool::Postgres(pool) = &store.reader else { unreachable!() };
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
