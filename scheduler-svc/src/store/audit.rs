//! The audit log: every admin call and every refused one, with the caller's identity (never the
//! token), what it asked for, on what, and how it ended.

use super::backend::Statement;
use super::{Result, Store};
use crate::model::Millis;

/// One audited admin call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    /// Position in the log.
    pub seq: i64,
    /// When it happened.
    pub at: Millis,
    /// Who (`token:NAME`, or `anonymous` when no valid token came).
    pub identity: String,
    /// The RPC.
    pub action: String,
    /// The id it acted on, or empty.
    pub target: String,
    /// `ok` or the refusal's reason.
    pub outcome: String,
}

impl Store {
    /// Records one admin call or refusal.
    pub async fn audit(
        &self,
        at: Millis,
        identity: &str,
        action: &str,
        target: &str,
        outcome: &str,
    ) -> Result<()> {
        self.write_execute(
            Statement::new(
                "INSERT INTO audit (at, identity, action, target, outcome) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(at.0)
            .bind(identity)
            .bind(action)
            .bind(target)
            .bind(outcome),
        )
        .await?;
        Ok(())
    }

    /// The newest `limit` entries, newest first.
    pub async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        let rows = self
            .reader
            .fetch_all(
                Statement::new(
                    "SELECT seq, at, identity, action, target, outcome FROM audit \
                     ORDER BY seq DESC LIMIT $1",
                )
                .bind(limit),
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(AuditEntry {
                    seq: row.int("seq")?,
                    at: Millis(row.int("at")?),
                    identity: row.get("identity")?,
                    action: row.get("action")?,
                    target: row.get("target")?,
                    outcome: row.get("outcome")?,
                })
            })
            .collect()
    }
}
