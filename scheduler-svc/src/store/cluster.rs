//! The deployment's cluster id: one row, created by the first scheduler that opens the database
//! and read by every one after (replicas on one PostgreSQL database share it; two deployments,
//! each with its own database, never do, whatever their `instance_id`).

use super::backend::Statement;
use super::{Result, Store};
use crate::error::Error;
use crate::model::Millis;

impl Store {
    /// The cluster id, created (a random UUID) if the database has none yet. Concurrent first
    /// calls meet on the one row: every caller reads the id that was inserted first.
    pub async fn cluster_id(&self, now: Millis) -> Result<String> {
        let fresh = uuid::Uuid::new_v4().to_string();
        self.write_execute(
            Statement::new(
                "INSERT INTO cluster (singleton, id, created_at) VALUES (1, $1, $2) \
                 ON CONFLICT (singleton) DO NOTHING",
            )
            .bind(fresh)
            .bind(now.0),
        )
        .await?;
        let row = self
            .reader
            .fetch_optional(Statement::new("SELECT id FROM cluster WHERE singleton = 1"))
            .await?
            .ok_or_else(|| Error::Corrupt("the cluster row is missing".into()))?;
        row.get("id")
    }
}
