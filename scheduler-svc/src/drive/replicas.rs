//! This process as one of several scheduler replicas sharing a PostgreSQL database (DESIGN.md
//! §3, replicas): its id as a lease holder, the leases it holds, and what it learnt of leases
//! others hold. The reconciler takes a live lesson's lease before working on it and gives it
//! back when the work is done; the reaper takes the `reaper` lease before each duty; a task
//! renews everything this replica holds every third of the TTL. On SQLite there is no
//! [`Replica`]: one process per file.

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

    /// Gives a live lesson's lease back (its work is done); a failure only delays others until
    /// the lease expires.
    pub async fn give_back(&self, store: &Store, id: LiveLessonId) {
        if !lock(&self.held).remove(&id) {
            return;
        }
        if let Err(err) = store.release_lease(&id.to_string(), &self.id).await {
            tracing::warn!(live_lesson.id = %id, error = %err, "cannot give a lease back; it will expire");
        }
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
    /// (it expired and another replica took it: their workers must stop).
    pub async fn renew(&self, store: &Store) -> Result<Vec<LiveLessonId>, Error> {
        let kept: HashSet<String> = store
            .renew_leases(&self.id, Millis::now().plus(self.lease_ttl))
            .await?
            .into_iter()
            .collect();
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
