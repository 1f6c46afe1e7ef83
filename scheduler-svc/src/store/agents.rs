//! What the store knows of agents: the instance id each reported last (a change means it
//! restarted), and how many live lessons each holds.

use super::{Result, Store};
use crate::error::Error;
use crate::model::Millis;

impl Store {
    /// The instance id an agent reported last, if any.
    pub async fn agent_instance(&self, agent: &str) -> Result<Option<String>> {
        Ok(
            sqlx::query_scalar("SELECT instance_id FROM agents WHERE name = ?")
                .bind(agent)
                .fetch_optional(&self.reader)
                .await?,
        )
    }

    /// Records the instance id an agent reported.
    pub async fn set_agent_instance(&self, agent: &str, instance: &str, now: Millis) -> Result<()> {
        let (agent, instance) = (agent.to_owned(), instance.to_owned());
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO agents (name, instance_id, seen_at) VALUES (?, ?, ?) \
             ON CONFLICT (name) DO UPDATE SET instance_id = excluded.instance_id, \
             seen_at = excluded.seen_at",
                )
                .bind(agent.to_owned())
                .bind(instance.to_owned())
                .bind(now.0)
                .execute(&mut *conn)
                .await
                .map_err(Error::from)
            })
        })
        .await?;
        Ok(())
    }

    /// How many live lessons each agent holds.
    pub async fn agent_loads(&self) -> Result<Vec<(String, u32)>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT agent, COUNT(*) FROM live_lessons WHERE agent IS NOT NULL GROUP BY agent",
        )
        .fetch_all(&self.reader)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(agent, n)| (agent, u32::try_from(n).unwrap_or(u32::MAX)))
            .collect())
    }
}
