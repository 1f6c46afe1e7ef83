//! Shards of the reconcile work among scheduler replicas sharing one PostgreSQL database
//! (migration 0010): every live lesson belongs to one of [`SHARDS`] shards, the first byte of its
//! id ([`shard_of`]: ids are random UUIDs), and the replica holding a shard's lease drives all of
//! the shard's live lessons, so a reconcile run needs no lease of its own. A replica's
//! membership is the named lease `replica:ID` ([`super::leases`]); each renewal
//! ([`Store::renew_replica`]) extends it with the replica's named and shard leases and reads the
//! live members and every shard's lease in one transaction; handovers
//! ([`Store::move_shards`]) expire the shards a replica gives up and take the free ones it is
//! due. A shard's `epoch` grows by one at every take, so a write fenced by an older epoch
//! ([`Fence`]) is refused even when its replica holds the shard again.
//!
//! The statements run on SQLite too (the store tests run on both), but only PostgreSQL replicas
//! hold shards: an SQLite file has one process.

use super::backend::{Row, Statement};
use super::{Result, Store};
use crate::model::{LiveLessonId, Millis};

/// How many shards the live lessons are spread over (the rows migration 0010 inserts).
pub const SHARDS: u32 = 256;

/// The shard of a live lesson: the first byte of its id.
pub fn shard_of(id: LiveLessonId) -> u32 {
    u32::from(id.0.as_bytes()[0])
}

/// The lease name of replica `holder`'s membership.
fn member_lease(holder: &str) -> String {
    format!("replica:{holder}")
}

/// What a replica's fenced write must still hold: the lease of the live lesson's shard at the
/// epoch its run began with, unexpired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The replica's id.
    pub holder: String,
    /// The shard's lease epoch when the run began.
    pub epoch: u64,
}

/// A shard lease a replica holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLease {
    /// Which shard.
    pub shard: u32,
    /// The lease's epoch (see [`Fence`]).
    pub epoch: u64,
}

/// One shard's lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardRow {
    /// Which shard.
    pub shard: u32,
    /// Who took it last (still holding it only while unexpired).
    pub holder: Option<String>,
    /// Its epoch.
    pub epoch: u64,
    /// When it expires (0 once handed over).
    pub expires_at: Millis,
}

/// What one renewal found ([`Store::renew_replica`]).
#[derive(Debug, Clone, Default)]
pub struct Renewal {
    /// The named leases the replica still holds, renewed (its membership among them), by name.
    pub leases: Vec<String>,
    /// The shard leases it still holds, renewed, by shard.
    pub shards: Vec<ShardLease>,
    /// The live replicas (unexpired membership), by id.
    pub members: Vec<String>,
    /// Every shard's lease.
    pub table: Vec<ShardRow>,
}

impl Store {
    /// One renewal of replica `holder`, in one transaction: its membership lease is taken or
    /// extended to `until`, every named and shard lease it holds unexpired at `now` is extended
    /// to `until` (an expired one is never revived: see [`Store::renew_leases`]), and the live
    /// members and every shard's lease are read.
    pub async fn renew_replica(&self, holder: &str, now: Millis, until: Millis) -> Result<Renewal> {
        let join = Statement::new(
            "INSERT INTO leases (name, holder, expires_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET expires_at = excluded.expires_at \
             WHERE leases.holder = excluded.holder",
        )
        .bind(member_lease(holder))
        .bind(holder)
        .bind(until.0);
        let leases = Statement::new(
            "UPDATE leases SET expires_at = $1 WHERE holder = $2 AND expires_at >= $3 \
             RETURNING name",
        )
        .bind(until.0)
        .bind(holder)
        .bind(now.0);
        let shards = Statement::new(
            "UPDATE shards SET expires_at = $1 WHERE holder = $2 AND expires_at >= $3 \
             RETURNING shard, epoch",
        )
        .bind(until.0)
        .bind(holder)
        .bind(now.0);
        let members = Statement::new(
            "SELECT holder FROM leases WHERE name LIKE 'replica:%' AND expires_at >= $1 \
             ORDER BY holder",
        )
        .bind(now.0);
        let table =
            Statement::new("SELECT shard, holder, epoch, expires_at FROM shards ORDER BY shard");
        self.write_apart(move |mut conn| {
            Box::pin(async move {
                conn.execute(join).await?;
                let leases = conn.fetch_all(leases).await?;
                let shards = conn.fetch_all(shards).await?;
                let members = conn.fetch_all(members).await?;
                let table = conn.fetch_all(table).await?;
                let mut leases: Vec<String> =
                    leases.iter().map(|row| row.at(0)).collect::<Result<_>>()?;
                leases.sort();
                let mut shards: Vec<ShardLease> =
                    shards.iter().map(shard_lease).collect::<Result<_>>()?;
                shards.sort_by_key(|lease| lease.shard);
                Ok(Renewal {
                    leases,
                    shards,
                    members: members.iter().map(|row| row.at(0)).collect::<Result<_>>()?,
                    table: table.iter().map(shard_row).collect::<Result<_>>()?,
                })
            })
        })
        .await
    }

    /// Hands shards over for replica `holder`, in one transaction: the leases of `release` it
    /// holds expire now (the shard is free for the replica it is due to), and those of `take`
    /// that are free at `now` (never taken, or expired) become its own until `until`, each with
    /// the next epoch. Returns the shards taken.
    pub async fn move_shards(
        &self,
        holder: &str,
        release: &[u32],
        take: &[u32],
        now: Millis,
        until: Millis,
    ) -> Result<Vec<ShardLease>> {
        let list = |shards: &[u32]| {
            shards
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let release = (!release.is_empty()).then(|| {
            Statement::new(format!(
                "UPDATE shards SET expires_at = 0 WHERE holder = $1 AND shard IN ({})",
                list(release)
            ))
            .bind(holder)
        });
        let take = (!take.is_empty()).then(|| {
            Statement::new(format!(
                "UPDATE shards SET holder = $1, epoch = epoch + 1, expires_at = $2 \
                 WHERE (holder IS NULL OR expires_at < $3) AND shard IN ({}) \
                 RETURNING shard, epoch",
                list(take)
            ))
            .bind(holder)
            .bind(until.0)
            .bind(now.0)
        });
        if release.is_none() && take.is_none() {
            return Ok(Vec::new());
        }
        self.write_apart(move |mut conn| {
            Box::pin(async move {
                if let Some(release) = release {
                    conn.execute(release).await?;
                }
                let Some(take) = take else {
                    return Ok(Vec::new());
                };
                let taken = conn.fetch_all(take).await?;
                let mut taken: Vec<ShardLease> =
                    taken.iter().map(shard_lease).collect::<Result<_>>()?;
                taken.sort_by_key(|lease| lease.shard);
                Ok(taken)
            })
        })
        .await
    }

    /// Every shard's lease as stored (for tests and operators: a shard is held by its
    /// `holder` while `expires_at` is not past).
    pub async fn shard_table(&self) -> Result<Vec<ShardRow>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(
                "SELECT shard, holder, epoch, expires_at FROM shards ORDER BY shard",
            ))
            .await?;
        rows.iter().map(shard_row).collect()
    }
}

fn shard_lease(row: &Row) -> Result<ShardLease> {
    Ok(ShardLease {
        shard: row.at::<i64>(0)? as u32,
        epoch: row.at::<i64>(1)? as u64,
    })
}

fn shard_row(row: &Row) -> Result<ShardRow> {
    Ok(ShardRow {
        shard: row.at::<i64>(0)? as u32,
        holder: row.at(1)?,
        epoch: row.at::<i64>(2)? as u64,
        expires_at: Millis(row.at(3)?),
    })
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::super::testing::on_both;
    use super::super::{Fenced, Observation};
    use super::*;
    use crate::model::Status;

    on_both! {
        // The table holds every shard, free; a replica's renewal makes it a member and lists
        // every shard; taking gives the next epoch, only where free; a renewal extends what is
        // held unexpired and never revives an expired lease; a released shard is free at once
        // and its next taker gets a higher epoch; shutdown's release frees everything.
        async fn shards_are_taken_renewed_handed_over_and_released(database, store) {
            let table = store.shard_table().await.unwrap();
            assert_eq!(table.len(), SHARDS as usize);
            assert!(table.iter().all(|row| row.holder.is_none() && row.epoch == 0));

            let a = store.renew_replica("a", Millis(100), Millis(200)).await.unwrap();
            assert_eq!(a.members, ["a"]);
            assert_eq!(a.leases, ["replica:a"]);
            assert!(a.shards.is_empty());
            assert_eq!(a.table.len(), SHARDS as usize);
            let taken = store.move_shards("a", &[], &[1, 2, 3], Millis(100), Millis(200)).await.unwrap();
            assert_eq!(taken, [1, 2, 3].map(|shard| ShardLease { shard, epoch: 1 }));
            // Held by a: b takes nothing of it.
            let b = store.renew_replica("b", Millis(150), Millis(250)).await.unwrap();
            assert_eq!(b.members, ["a", "b"]);
            assert!(store.move_shards("b", &[], &[2, 3, 4], Millis(150), Millis(250)).await.unwrap()
                == [ShardLease { shard: 4, epoch: 1 }]);
            // a hands 3 over: free at once, b takes it with the next epoch.
            let a = store.renew_replica("a", Millis(160), Millis(260)).await.unwrap();
            assert_eq!(a.shards.iter().map(|s| s.shard).collect::<Vec<_>>(), [1, 2, 3]);
            assert!(store.move_shards("a", &[3], &[], Millis(160), Millis(260)).await.unwrap().is_empty());
            assert_eq!(
                store.move_shards("b", &[], &[3], Millis(161), Millis(261)).await.unwrap(),
                [ShardLease { shard: 3, epoch: 2 }]
            );
            // a stops renewing: its membership and shards expire, and a renewal after that
            // revives neither its shards nor (until it joins again) anything else.
            store.renew_replica("b", Millis(240), Millis(340)).await.unwrap();
            let b = store.renew_replica("b", Millis(270), Millis(370)).await.unwrap();
            assert_eq!(b.members, ["b"]);
            assert_eq!(b.shards.iter().map(|s| s.shard).collect::<Vec<_>>(), [3, 4]);
            let a = store.renew_replica("a", Millis(300), Millis(400)).await.unwrap();
            assert!(a.shards.is_empty(), "{a:?}");
            assert_eq!(a.members, ["a", "b"]);
            // b takes a's expired shard 1 over; a takes 2 back itself, with a new epoch.
            assert_eq!(
                store.move_shards("b", &[], &[1], Millis(301), Millis(401)).await.unwrap(),
                [ShardLease { shard: 1, epoch: 2 }]
            );
            assert_eq!(
                store.move_shards("a", &[], &[2], Millis(301), Millis(401)).await.unwrap(),
                [ShardLease { shard: 2, epoch: 2 }]
            );
            // Shutdown: everything b holds is free at once, membership gone.
            store.release_leases("b").await.unwrap();
            let a = store.renew_replica("a", Millis(302), Millis(402)).await.unwrap();
            assert_eq!(a.members, ["a"]);
            let free: Vec<u32> = a
                .table
                .iter()
                .filter(|row| row.expires_at < Millis(302))
                .map(|row| row.shard)
                .collect();
            assert_eq!(free.len(), SHARDS as usize - 1, "only a's shard 2 is held");
        }

        // An observation fenced by a shard lease is written only while the writer holds the
        // live lesson's shard at the epoch its run began with: not before it took the shard,
        // not after the shard moved on, not after it took the shard again (a new epoch).
        async fn observations_are_fenced_by_the_shard_lease(database, store) {
            let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
            let session = store.create_session(ip, [7; 32], 0, Millis(1)).await.unwrap();
            let (lesson, _) = store.request_live_lesson(session.id, "a", 0, 0, Millis(2)).await.unwrap();
            let (id, shard) = (lesson.id, shard_of(lesson.id));
            let fence = |holder: &str, epoch| Fence { holder: holder.into(), epoch };
            let booting = || Observation::status(Status::Booting, "booting");
            // Nobody holds the shard: refused.
            let fenced = store.observe_fenced(id, 1, booting(), Millis(5), &fence("r1", 0)).await.unwrap();
            assert!(matches!(fenced, Fenced::NotHolder), "{fenced:?}");
            // r1 holds it at epoch 1: written; not with another epoch.
            let taken = store.move_shards("r1", &[], &[shard], Millis(5), Millis(20)).await.unwrap();
            assert_eq!(taken, [ShardLease { shard, epoch: 1 }]);
            let fenced = store.observe_fenced(id, 1, booting(), Millis(6), &fence("r1", 1)).await.unwrap();
            assert!(matches!(&fenced, Fenced::Recorded(l) if l.status == Status::Booting), "{fenced:?}");
            let fenced = store.observe_fenced(id, 1, booting(), Millis(6), &fence("r1", 0)).await.unwrap();
            assert!(matches!(fenced, Fenced::NotHolder), "{fenced:?}");
            // Another generation: moved on, not a lost lease.
            let fenced = store.observe_fenced(id, 2, booting(), Millis(7), &fence("r1", 1)).await.unwrap();
            assert!(matches!(fenced, Fenced::MovedOn), "{fenced:?}");
            // r1's lease expired and r2 took the shard: r1's FAILED is refused, r2's READY kept.
            store.move_shards("r2", &[], &[shard], Millis(21), Millis(40)).await.unwrap();
            let failed = Observation::status(Status::Failed, "deadline passed");
            let fenced = store.observe_fenced(id, 1, failed.clone(), Millis(22), &fence("r1", 1)).await.unwrap();
            assert!(matches!(fenced, Fenced::NotHolder), "{fenced:?}");
            let ready = Observation::status(Status::Ready, "ready");
            let fenced = store.observe_fenced(id, 1, ready, Millis(23), &fence("r2", 2)).await.unwrap();
            assert!(matches!(&fenced, Fenced::Recorded(l) if l.status == Status::Ready), "{fenced:?}");
            // r2 hands it back and r1 takes it again (epoch 3): r1's run from epoch 1 is still
            // refused.
            store.move_shards("r2", &[shard], &[], Millis(24), Millis(40)).await.unwrap();
            store.move_shards("r1", &[], &[shard], Millis(25), Millis(45)).await.unwrap();
            let fenced = store.observe_fenced(id, 1, failed, Millis(26), &fence("r1", 1)).await.unwrap();
            assert!(matches!(fenced, Fenced::NotHolder), "{fenced:?}");
            let now = store.find_live_lesson(id).await.unwrap().unwrap();
            assert_eq!(now.status, Status::Ready);
        }
    }

    #[test]
    fn shards_are_the_first_byte_of_the_id() {
        let id: LiveLessonId = "a7000000-0000-4000-8000-000000000000".parse().unwrap();
        assert_eq!(shard_of(id), 0xa7);
        assert!((0..1000).all(|_| shard_of(LiveLessonId::new()) < SHARDS));
    }
}
