//! What the store knows of agents: the instance id each reported last (a change means it
//! restarted), and how many live lessons each holds.

use super::backend::Statement;
use super::{Result, Store};
use crate::model::Millis;

impl Store {
    /// The instance id an agent reported last, if any.
    pub async fn agent_instance(&self, agent: &str) -> Result<Option<String>> {
        let row = self
            .reader
            .fetch_optional(
                Statement::new("SELECT instance_id FROM agents WHERE name = $1").bind(agent),
            )
            .await?;
        row.map(|row| row.get("instance_id")).transpose()
    }

    /// Records the instance id an agent reported.
    pub async fn set_agent_instance(&self, agent: &str, instance: &str, now: Millis) -> Result<()> {
        self.write_execute(
            Statement::new(
                "INSERT INTO agents (name, instance_id, seen_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (name) DO UPDATE SET instance_id = excluded.instance_id, \
                 seen_at = excluded.seen_at",
            )
            .bind(agent)
            .bind(instance)
            .bind(now.0),
        )
        .await?;
        Ok(())
    }

    /// How many live lessons each agent holds.
    pub async fn agent_loads(&self) -> Result<Vec<(String, u32)>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(
                "SELECT agent, COUNT(*) FROM live_lessons WHERE agent IS NOT NULL GROUP BY agent",
            ))
            .await?;
        rows.iter()
            .map(|row| {
                let n: i64 = row.at(1)?;
                Ok((row.at(0)?, u32::try_from(n).unwrap_or(u32::MAX)))
            })
            .collect()
    }
}
