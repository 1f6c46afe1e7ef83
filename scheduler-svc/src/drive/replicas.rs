//! This process as one of several scheduler replicas sharing a PostgreSQL database:
//! its id as a lease holder, the leases it holds, and what it learnt of leases
//! others hold. The reconciler takes a live lesson's lease before working on it and gives it
//! back when the work is done; the reaper takes the `reaper` lease before each duty; a task
//! renews everything this replica holds every third of the TTL. On SQLite there is no
//! [`Replica`]: one process per file.
//!
//! A lease costs a transaction to take and one to give back, and a live lesson's life has
//! several runs (to READY, a stage change, removal), often seconds apart: so a lease given back
//! is kept *idle* for one renewal period and released with the others of that period in one
//! statement, and a lease this replica still holds (held or idle, and renewed recently enough
//! that it cannot have expired) is taken again without asking the database. While idle, the
//! live lesson's changes are still this replica's to take up (it hears them like every
//! replica, and [`Replica::holds`] is false for idle leases, so it does not skip them); other
//! replicas find the lease taken until it is released, at most two renewal periods later.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::model::{LiveLessonId, Millis};
use crate::store::Store;

/// The name of the reaper's lease: one replica at a time runs its duties.
pub const REAPER: &str = "reaper";

/// This replica.
pub struct Replica {
    /// Its id as a lease holder: a random UUID at start, so a restarted process is a new holder
    /// and never mistakes a dead predecessor's leases for its own.
    pub id: String,
    /// How long a lease lasts unless renewed.
    pub lease_ttl: Duration,
    /// Live lessons whose lease this replica holds.
    held: Mutex<HashSet<LiveLessonId>>,
    /// Live lessons whose lease this replica gave back but still holds (idle), and since when:
    /// released at the first renewal after one renewal period.
    idle: Mutex<HashMap<LiveLessonId, Instant>>,
    /// When the last renewal that succeeded began: every lease held then lasts until at least
    /// that time plus the TTL.
    renewed: Mutex<Option<Instant>>,
    /// Live lessons another replica held when this one last tried to take them, and until when
    /// that lease lasts at most: notifications about them need no attempt before then (their
    /// holder hears the same notifications).
    elsewhere: Mutex<HashMap<LiveLessonId, Instant>>,
}

impl Replica {
    /// A new replica id with leases of `lease_ttl`.
    pub fn new(lease_ttl: Duration) -> Replica {
        Replica {
            id: uuid::Uuid::new_v4().to_string(),
            lease_ttl,
            held: Mutex::new(HashSet::new()),
            idle: Mutex::new(HashMap::new()),
            renewed: Mutex::new(None),
            elsewhere: Mutex::new(HashMap::new()),
        }
    }

    /// Takes (or keeps) lease `name`; true when this replica holds it now.
    pub async fn take(&self, store: &Store, name: &str) -> Result<bool, Error> {
        let now = Millis::now();
        store
            .acquire_lease(name, &self.id, now, now.plus(self.lease_ttl))
            .await
    }

    /// Takes (or keeps) the lease of a live lesson's work; false while another replica holds
    /// it.
    pub async fn take_lesson(&self, store: &Store, id: LiveLessonId) -> Result<bool, Error> {
        // Still ours, surely: held or idle, and the last renewal was recent enough that the
        // lease cannot have expired (a lease lost otherwise is reported by the next renewal,
        // which stops the work, as for any held lease).
        let fresh =
            lock(&self.renewed).is_some_and(|renewed| renewed.elapsed() < self.lease_ttl / 2);
        if fresh {
            // An idle lease about to be released (kept a whole period) goes through the
            // database, so that a release and a take never race on the same lease.
            let idle = lock(&self.idle)
                .remove(&id)
                .is_some_and(|since| since.elapsed() < self.renew_every());
            let mut held = lock(&self.held);
            if idle || held.contains(&id) {
                held.insert(id);
                return Ok(true);
            }
        }
        lock(&self.idle).remove(&id);
        let taken = self.take(store, &id.to_string()).await?;
        if taken {
            lock(&self.held).insert(id);
            lock(&self.elsewhere).remove(&id);
        } else {
            lock(&self.held).remove(&id);
            lock(&self.elsewhere).insert(id, Instant::now() + self.lease_ttl);
        }
        Ok(taken)
    }

    /// Gives a live lesson's lease back (its work is done): kept idle until the next renewal
    /// after one renewal period, which releases it (see the module's documentation).
    pub async fn give_back(&self, _store: &Store, id: LiveLessonId) {
        if lock(&self.held).remove(&id) {
            lock(&self.idle).insert(id, Instant::now());
        }
    }

    /// Forgets a live lesson's lease this replica found it does not hold any more (a write
    /// fenced by the lease was refused): not held, not idle, and held elsewhere for a TTL.
    pub fn lost(&self, id: LiveLessonId) {
        lock(&self.held).remove(&id);
        lock(&self.idle).remove(&id);
        lock(&self.elsewhere).insert(id, Instant::now() + self.lease_ttl);
    }

    /// Whether this replica holds the live lesson's lease.
    pub fn holds(&self, id: LiveLessonId) -> bool {
        lock(&self.held).contains(&id)
    }

    /// Whether another replica held the live lesson's lease at the last attempt and it cannot
    /// have expired yet.
    pub fn held_elsewhere(&self, id: LiveLessonId) -> bool {
        lock(&self.elsewhere)
            .get(&id)
            .is_some_and(|until| *until > Instant::now())
    }

    /// Renews every lease this replica holds; returns the live lessons whose lease it lost
    /// (it expired, whether or not another replica took it yet: their workers must stop).
    pub async fn renew(&self, store: &Store) -> Result<Vec<LiveLessonId>, Error> {
        // Idle leases of more than a renewal period are released first, all in one statement;
        // a failure leaves them idle for the next try (and they expire if it never comes).
        let now = Instant::now();
        let stale: Vec<LiveLessonId> = lock(&self.idle)
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= self.renew_every())
            .map(|(id, _)| *id)
            .collect();
        if !stale.is_empty() {
            let names: Vec<String> = stale.iter().map(ToString::to_string).collect();
            match store.release_leases_named(&names, &self.id).await {
                Ok(()) => {
                    let mut idle = lock(&self.idle);
                    for id in &stale {
                        // Taken again meanwhile? Then it is held, not idle, and the release
                        // above gave its lease up: the next renewal reports it lost, and its
                        // worker runs again and takes it anew.
                        idle.remove(id);
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, count = stale.len(), "cannot release idle leases; retrying")
                }
            }
        }
        let started = Instant::now();
        let now = Millis::now();
        let kept: HashSet<String> = store
            .renew_leases(&self.id, now, now.plus(self.lease_ttl))
            .await?
            .into_iter()
            .collect();
        *lock(&self.renewed) = Some(started);
        lock(&self.idle).retain(|id, _| kept.contains(&id.to_string()));
        let mut held = lock(&self.held);
        let lost: Vec<_> = held
            .iter()
            .filter(|id| !kept.contains(&id.to_string()))
            .copied()
            .collect();
        for id in &lost {
            held.remove(id);
        }
        drop(held);
        // Forget what is long past, so the map does not grow with every live lesson ever seen.
        let now = Instant::now();
        lock(&self.elsewhere).retain(|_, until| *until > now);
        Ok(lost)
    }

    /// How often leases are renewed.
    pub fn renew_every(&self) -> Duration {
        self.lease_ttl / 3
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
