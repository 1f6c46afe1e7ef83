//! This process as one of several scheduler replicas sharing a PostgreSQL database:
//! its id as a lease holder, the shards of live lessons it drives, and the named
//! leases of duties (the reaper's, a warm pool's look). On SQLite there is no [`Replica`]: one
//! process per file.
//!
//! Live lessons belong to [`SHARDS`] shards ([`shard_of`]); a replica drives the live lessons of
//! the shards whose lease it holds, so a reconcile run takes no lease of its own: whether this
//! replica may work on a live lesson is a look at its shards, in memory. Every third of the
//! lease TTL, [`Replica::renew`] extends its membership (`replica:ID`), named leases and shard
//! leases in one transaction, reads the live members and every shard's lease, and balances: each
//! shard is due to one member ([`assign`], deterministic from the member list, so every replica
//! computes the same), a replica hands over (expires) the shards due to another and takes the
//! free ones due to it. A shard is free once handed over or expired: a replica that died (or
//! left without a word, or was frozen) keeps its shards until their leases expire, a
//! replica that left cleanly frees them at once. A shard found free at two looks in a row is
//! taken by whoever sees it, whoever it is due to, so no disagreement leaves one unowned. The
//! database lets one holder at a time have a shard unexpired, so a shard never has two owners.
//!
//! A run's writes are fenced by its shard's lease at the epoch it held when the run began
//! ([`Replica::fence`]): a replica frozen past its lease, or that handed the shard over, finds
//! its write refused, even if it holds the shard again since.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::model::{LiveLessonId, Millis};
use crate::store::{Fence, SHARDS, Store, shard_of};

/// The name of the reaper's lease: one replica at a time runs its duties.
pub const REAPER: &str = "reaper";

/// This replica.
pub struct Replica {
    /// Its id as a lease holder: a random UUID at start, so a restarted process is a new holder
    /// and never mistakes a dead predecessor's leases for its own.
    pub id: String,
    /// How long a lease lasts unless renewed.
    pub lease_ttl: Duration,
    /// What it holds and knows.
    state: Mutex<State>,
}

/// A replica's view of its shards and work.
#[derive(Default)]
struct State {
    /// The shards it holds, with their lease epochs.
    shards: HashMap<u32, u64>,
    /// Until when every lease in `shards` surely lasts: the start of the renewal (or take) that
    /// extended them, plus the TTL. Past it, nothing is taken as held.
    until: Option<Instant>,
    /// Live lessons whose work runs here (from the take of a run until it is done), with the
    /// epoch of their shard's lease when it began.
    working: HashMap<LiveLessonId, u64>,
    /// Shards free at the last look.
    free: HashSet<u32>,
}

impl State {
    /// The epoch of `shard`'s lease, if held now.
    fn holds(&self, shard: u32) -> Option<u64> {
        let fresh = self.until.is_some_and(|until| until > Instant::now());
        fresh.then(|| self.shards.get(&shard).copied()).flatten()
    }
}

impl Replica {
    /// A new replica id with leases of `lease_ttl`.
    pub fn new(lease_ttl: Duration) -> Replica {
        Replica {
            id: uuid::Uuid::new_v4().to_string(),
            lease_ttl,
            state: Mutex::new(State::default()),
        }
    }

    /// Takes (or keeps) the named lease `name` (a duty); true when this replica holds it now.
    pub async fn take(&self, store: &Store, name: &str) -> Result<bool, Error> {
        let now = Millis::now();
        store
            .acquire_lease(name, &self.id, now, now.plus(self.lease_ttl))
            .await
    }

    /// Whether this replica may run a live lesson's work now: it holds the lease of the live
    /// lesson's shard. No database call; the run's writes are fenced by that lease as it is
    /// now ([`Replica::fence`]).
    pub async fn take_lesson(&self, _store: &Store, id: LiveLessonId) -> Result<bool, Error> {
        let mut state = lock(&self.state);
        match state.holds(shard_of(id)) {
            Some(epoch) => {
                state.working.insert(id, epoch);
                Ok(true)
            }
            None => {
                state.working.remove(&id);
                Ok(false)
            }
        }
    }

    /// The live lesson's work is done for now (settled, gone, or moved on).
    pub async fn give_back(&self, _store: &Store, id: LiveLessonId) {
        lock(&self.state).working.remove(&id);
    }

    /// Forgets the live lesson's work and its shard: a write fenced by the shard's lease was
    /// refused, so the lease moved on (the next renewal says where).
    pub fn lost(&self, id: LiveLessonId) {
        let mut state = lock(&self.state);
        state.working.remove(&id);
        state.shards.remove(&shard_of(id));
    }

    /// Whether the live lesson's work runs here.
    pub fn holds(&self, id: LiveLessonId) -> bool {
        lock(&self.state).working.contains_key(&id)
    }

    /// Whether this replica holds the live lesson's shard.
    pub fn owns(&self, id: LiveLessonId) -> bool {
        lock(&self.state).holds(shard_of(id)).is_some()
    }

    /// Whether the live lesson's shard is not this replica's: its holder (or, while it is free,
    /// whoever takes it next) hears the same changes and does the work.
    pub fn held_elsewhere(&self, id: LiveLessonId) -> bool {
        !self.owns(id)
    }

    /// What a write of the live lesson's run must still hold: its shard's lease at the epoch
    /// the run began with (or, for a write outside a run, the epoch held now; an epoch no lease
    /// has when neither, so the write is refused).
    pub fn fence(&self, id: LiveLessonId) -> Fence {
        let state = lock(&self.state);
        let epoch = state
            .working
            .get(&id)
            .copied()
            .or_else(|| state.holds(shard_of(id)))
            .unwrap_or(0);
        Fence {
            holder: self.id.clone(),
            epoch,
        }
    }

    /// The shards this replica holds now.
    pub fn shards(&self) -> Vec<u32> {
        let state = lock(&self.state);
        let mut shards: Vec<u32> = (0..SHARDS).filter(|s| state.holds(*s).is_some()).collect();
        shards.sort_unstable();
        shards
    }

    /// Renews this replica's membership and leases, then balances the shards (see the module's
    /// documentation). Returns the live lessons that need a run here now: those whose work ran
    /// here in a shard it no longer holds (lost or handed over: their runs stop), and the
    /// unsettled ones of the shards it took.
    pub async fn renew(&self, store: &Store) -> Result<Vec<LiveLessonId>, Error> {
        let started = Instant::now();
        let now = Millis::now();
        let renewal = store
            .renew_replica(&self.id, now, now.plus(self.lease_ttl))
            .await?;
        let kept: HashMap<u32, u64> = renewal
            .shards
            .iter()
            .map(|lease| (lease.shard, lease.epoch))
            .collect();
        let mut members = renewal.members.clone();
        if !members.contains(&self.id) {
            members.push(self.id.clone());
            members.sort();
        }
        let due = assign(&members);
        let free: HashSet<u32> = renewal
            .table
            .iter()
            .filter(|row| row.holder.is_none() || row.expires_at < now)
            .map(|row| row.shard)
            .collect();
        let (release, take) = {
            let mut state = lock(&self.state);
            state.shards = kept;
            state.until = Some(started + self.lease_ttl);
            let release: Vec<u32> = state
                .shards
                .keys()
                .copied()
                .filter(|shard| due[*shard as usize] != self.id)
                .collect();
            let mut take: Vec<u32> = free
                .iter()
                .copied()
                .filter(|shard| due[*shard as usize] == self.id || state.free.contains(shard))
                .collect();
            take.sort_unstable();
            state.free = free;
            (release, take)
        };
        let started = Instant::now();
        let now = Millis::now();
        let taken = store
            .move_shards(&self.id, &release, &take, now, now.plus(self.lease_ttl))
            .await?;
        let gained: HashSet<u32> = taken.iter().map(|lease| lease.shard).collect();
        let mut rerun = {
            let mut state = lock(&self.state);
            for shard in &release {
                state.shards.remove(shard);
            }
            for lease in &taken {
                state.shards.insert(lease.shard, lease.epoch);
                state.free.remove(&lease.shard);
            }
            if !taken.is_empty() {
                // The taken leases last from the take; the others from the renewal, earlier.
                state.until = state.until.min(Some(started + self.lease_ttl));
            }
            let State {
                shards, working, ..
            } = &*state;
            working
                .iter()
                .filter(|(id, epoch)| shards.get(&shard_of(**id)) != Some(*epoch))
                .map(|(id, _)| *id)
                .collect::<Vec<_>>()
        };
        if !gained.is_empty() {
            tracing::info!(count = gained.len(), "took shards over");
            let unsettled = store.unsettled().await?;
            rerun.extend(
                unsettled
                    .into_iter()
                    .filter(|id| gained.contains(&shard_of(*id))),
            );
        }
        if !release.is_empty() {
            tracing::info!(count = release.len(), "handed shards over");
        }
        Ok(rerun)
    }

    /// How often leases are renewed.
    pub fn renew_every(&self) -> Duration {
        self.lease_ttl / 3
    }
}

/// Which member each shard is due to (indexed by shard): every shard ranks the members by a
/// hash of (member, shard), highest first (rendezvous hashing, so a member joining or leaving
/// moves few shards), and goes to the first that has not its share yet (`SHARDS / members`,
/// one more for the first `SHARDS % members` members), so the shards are balanced to within
/// one. Deterministic in `members` (sorted ids), so every replica that sees the same members
/// computes the same.
pub fn assign(members: &[String]) -> Vec<String> {
    if members.is_empty() {
        return vec![String::new(); SHARDS as usize];
    }
    let n = members.len();
    let shares: Vec<usize> = (0..n)
        .map(|m| SHARDS as usize / n + usize::from(m < SHARDS as usize % n))
        .collect();
    let mut counts = vec![0usize; n];
    (0..SHARDS)
        .map(|shard| {
            let mut ranked: Vec<usize> = (0..n).collect();
            ranked.sort_by_key(|m| std::cmp::Reverse(weight(&members[*m], shard)));
            // The shares add up to SHARDS, so some member always has room.
            let chosen = ranked
                .into_iter()
                .find(|m| counts[*m] < shares[*m])
                .unwrap_or(0);
            counts[chosen] += 1;
            members[chosen].clone()
        })
        .collect()
}

/// FNV-1a of the member's id and the shard: stable across builds and platforms (replicas of
/// different versions must agree).
fn weight(member: &str, shard: u32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in member.bytes().chain(shard.to_le_bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<String> {
        let mut ids: Vec<String> = (0..n).map(|i| format!("replica-{i}")).collect();
        ids.sort();
        ids
    }

    #[test]
    fn shards_are_balanced_to_within_one_and_move_little() {
        for n in 1..=7 {
            let due = assign(&members(n));
            let mut counts: HashMap<&str, usize> = HashMap::new();
            for member in &due {
                *counts.entry(member.as_str()).or_default() += 1;
            }
            assert_eq!(counts.len(), n, "every member gets shards");
            let (low, high) = (
                counts.values().min().unwrap(),
                counts.values().max().unwrap(),
            );
            assert!(high - low <= 1, "{n}: {counts:?}");
        }
        // A fourth member joining three: about a quarter of the shards move, not most.
        let (three, four) = (assign(&members(3)), assign(&members(4)));
        let moved = three.iter().zip(&four).filter(|(a, b)| a != b).count();
        assert!(moved < SHARDS as usize / 2, "{moved} shards moved");
        // Same members, same answer, whatever order they were listed in elsewhere.
        assert_eq!(assign(&members(3)), three);
    }

    /// Three replicas on one database, each renewing in turn as its task would: within two
    /// renewals every shard is held by exactly one of them, balanced; one leaves cleanly and
    /// the other two hold everything after their next renewal; one joins and gets its share.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_share_the_shards_and_hand_them_over() {
        let Some(scratch) = crate::store::testing::Scratch::postgres_if_given().await else {
            return;
        };
        let store = Store::open(&scratch.database).await.unwrap();
        let ttl = Duration::from_secs(60);
        let replicas: Vec<Replica> = (0..3).map(|_| Replica::new(ttl)).collect();
        let holders = |store: Store| async move {
            let now = Millis::now();
            store
                .shard_table()
                .await
                .unwrap()
                .into_iter()
                .map(|row| row.holder.filter(|_| row.expires_at >= now))
                .collect::<Vec<_>>()
        };
        // The first renewal of each makes them members; the second balances.
        for _ in 0..3 {
            for replica in &replicas {
                replica.renew(&store).await.unwrap();
            }
        }
        let held = holders(store.clone()).await;
        assert!(
            held.iter().all(Option::is_some),
            "every shard held: {held:?}"
        );
        for replica in &replicas {
            let mine = replica.shards();
            assert!((85..=86).contains(&mine.len()), "{} shards", mine.len());
            assert!(
                mine.iter()
                    .all(|s| held[*s as usize].as_deref() == Some(replica.id.as_str()))
            );
        }
        // One leaves (its shutdown releases everything): the others take its shards over.
        store.release_leases(&replicas[2].id).await.unwrap();
        for _ in 0..2 {
            for replica in &replicas[..2] {
                replica.renew(&store).await.unwrap();
            }
        }
        let held = holders(store.clone()).await;
        let ids = [replicas[0].id.clone(), replicas[1].id.clone()];
        assert!(
            held.iter()
                .all(|h| h.as_ref().is_some_and(|h| ids.contains(h))),
            "{held:?}"
        );
        assert_eq!(
            replicas[0].shards().len() + replicas[1].shards().len(),
            SHARDS as usize
        );
        // A new one joins: after two rounds it holds its share, nobody else holds those.
        let joined = Replica::new(ttl);
        for _ in 0..3 {
            for replica in [&replicas[0], &replicas[1], &joined] {
                replica.renew(&store).await.unwrap();
            }
        }
        let held = holders(store.clone()).await;
        assert!(held.iter().all(Option::is_some), "{held:?}");
        assert!(
            (85..=86).contains(&joined.shards().len()),
            "{}",
            joined.shards().len()
        );
        let total: usize = [&replicas[0], &replicas[1], &joined]
            .iter()
            .map(|r| r.shards().len())
            .sum();
        assert_eq!(total, SHARDS as usize, "no shard counted twice");
    }
}
