//! Named leases of scheduler replicas sharing one PostgreSQL database: a
//! row per leased name (a duty such as `reaper`, a warm pool's look, or a replica's membership
//! `replica:ID`, see [`super::shards`]) with its holder (a replica id) and when it expires. A
//! lease is taken by one statement that inserts it or takes it over when it is expired or
//! already ours, renewed in one statement for everything a replica still holds unexpired (an
//! expired lease is never revived), and released when the work is done. Times are the
//! replicas' clocks ([`Millis`]); a lease outlives clock differences smaller than its TTL's
//! margin. Lease statements run apart from the batches of other writes
//! ([`Store::write_apart`]): replicas contend for the same rows.
//!
//! The statements run on SQLite too (the store tests run on both), but only PostgreSQL replicas
//! take leases: an SQLite file has one process.

use super::backend::Statement;
use super::{Result, Store};
use crate::model::Millis;

impl Store {
    /// Takes (or keeps) lease `name` for `holder` until `until`, unless another holder has it
    /// unexpired at `now`. True when `holder` holds it now.
    pub async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        now: Millis,
        until: Millis,
    ) -> Result<bool> {
        let statement = Statement::new(
            "INSERT INTO leases (name, holder, expires_at) VALUES ($1, $2, $3) \
                     ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, \
                     expires_at = excluded.expires_at \
                     WHERE leases.expires_at < $4 OR leases.holder = excluded.holder \
                     RETURNING holder",
        )
        .bind(name)
        .bind(holder)
        .bind(until.0)
        .bind(now.0);
        let row = self
            .write_apart(move |mut conn| {
                Box::pin(async move { conn.fetch_optional(statement).await })
            })
            .await?;
        Ok(row.is_some())
    }

    /// Extends every lease `holder` still holds at `now` to `until`; returns their names. A
    /// lease that expired is not renewed, even when nobody took it over yet: its holder's
    /// fenced writes were refused from the moment it expired, so the holder may have dropped
    /// the work, and reviving the lease would keep every other replica from it for good. The
    /// holder takes it again like anyone ([`Store::acquire_lease`]).
    pub async fn renew_leases(
        &self,
        holder: &str,
        now: Millis,
        until: Millis,
    ) -> Result<Vec<String>> {
        let rows = self
            .apart_all(
                Statement::new(
                    "UPDATE leases SET expires_at = $1 WHERE holder = $2 AND expires_at >= $3 \
                     RETURNING name",
                )
                .bind(until.0)
                .bind(holder)
                .bind(now.0),
            )
            .await?;
        rows.iter().map(|row| row.at(0)).collect()
    }

    /// Gives lease `name` up, if `holder` holds it.
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<()> {
        self.apart_execute(
            Statement::new("DELETE FROM leases WHERE name = $1 AND holder = $2")
                .bind(name)
                .bind(holder),
        )
        .await?;
        Ok(())
    }

    /// Gives leases `names` up, those of them `holder` holds, in one statement.
    pub async fn release_leases_named(&self, names: &[String], holder: &str) -> Result<()> {
        if names.is_empty() {
            return Ok(());
        }
        let placeholders: Vec<String> = (0..names.len()).map(|i| format!("${}", i + 2)).collect();
        let mut statement = Statement::new(format!(
            "DELETE FROM leases WHERE holder = $1 AND name IN ({})",
            placeholders.join(", ")
        ))
        .bind(holder);
        for name in names {
            statement = statement.bind(name.as_str());
        }
        self.apart_execute(statement).await?;
        Ok(())
    }

    /// Gives back every lease `holder` holds, named and shard leases (it is shutting down), in
    /// one transaction: its shards are free at once for the other replicas.
    pub async fn release_leases(&self, holder: &str) -> Result<()> {
        let named = Statement::new("DELETE FROM leases WHERE holder = $1").bind(holder);
        let shards =
            Statement::new("UPDATE shards SET expires_at = 0 WHERE holder = $1").bind(holder);
        self.write_apart(move |mut conn| {
            Box::pin(async move {
                conn.execute(named).await?;
                conn.execute(shards).await
            })
        })
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    use super::super::testing::on_both;
    use super::*;

    on_both! {
        async fn a_lease_is_held_renewed_and_taken_over_after_expiry(database, store) {
            let lease = "lesson-1";
            assert!(store.acquire_lease(lease, "a", Millis(100), Millis(200)).await.unwrap());
            // Held by a: b cannot take it before it expires, a may take it again.
            assert!(!store.acquire_lease(lease, "b", Millis(150), Millis(250)).await.unwrap());
            assert!(store.acquire_lease(lease, "a", Millis(150), Millis(250)).await.unwrap());
            // Renewal extends what a holds.
            assert_eq!(store.renew_leases("a", Millis(160), Millis(400)).await.unwrap(), [lease]);
            assert!(!store.acquire_lease(lease, "b", Millis(300), Millis(500)).await.unwrap());
            // Expired: b takes it over; a's renewal no longer lists it and a cannot release it.
            assert!(store.acquire_lease(lease, "b", Millis(401), Millis(600)).await.unwrap());
            assert!(store.renew_leases("a", Millis(402), Millis(700)).await.unwrap().is_empty());
            store.release_lease(lease, "a").await.unwrap();
            assert!(!store.acquire_lease(lease, "a", Millis(500), Millis(700)).await.unwrap());
            // Released by b: anyone's at once.
            store.release_lease(lease, "b").await.unwrap();
            assert!(store.acquire_lease(lease, "a", Millis(500), Millis(700)).await.unwrap());
            // Several at once, only the holder's.
            assert!(store.acquire_lease("x", "a", Millis(500), Millis(700)).await.unwrap());
            assert!(store.acquire_lease("y", "b", Millis(500), Millis(700)).await.unwrap());
            let names = [lease.to_owned(), "x".to_owned(), "y".to_owned()];
            store.release_leases_named(&names, "a").await.unwrap();
            assert!(store.renew_leases("a", Millis(600), Millis(800)).await.unwrap().is_empty());
            assert_eq!(store.renew_leases("b", Millis(600), Millis(800)).await.unwrap(), ["y"]);
            // Expired and taken by nobody: not renewed (its holder's fenced writes were refused
            // since it expired); its holder takes it again like anyone.
            assert!(store.renew_leases("b", Millis(801), Millis(900)).await.unwrap().is_empty());
            assert!(store.acquire_lease("y", "a", Millis(801), Millis(900)).await.unwrap());
        }

        async fn concurrent_takers_get_one_lease(database, store) {
            let mut takers = tokio::task::JoinSet::new();
            for i in 0..16 {
                let store = store.clone();
                takers.spawn(async move {
                    store
                        .acquire_lease("reaper", &format!("r{i}"), Millis(1), Millis(100))
                        .await
                        .unwrap()
                });
            }
            let mut won = 0;
            while let Some(taken) = takers.join_next().await {
                won += usize::from(taken.unwrap());
            }
            assert_eq!(won, 1);
        }

        async fn the_cluster_id_is_created_once(database, store) {
            let first = store.cluster_id(Millis(1)).await.unwrap();
            assert_eq!(store.cluster_id(Millis(2)).await.unwrap(), first);
            uuid::Uuid::parse_str(&first).unwrap();
            // Another replica on the same PostgreSQL database reads the same id (an SQLite file
            // has one process).
            if let crate::store::Database::Postgres(_) = &database {
                let other = Store::open(&database).await.unwrap();
                assert_eq!(other.cluster_id(Millis(3)).await.unwrap(), first);
            }
        }
    }
}
