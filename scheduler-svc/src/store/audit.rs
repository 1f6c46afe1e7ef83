//! The audit log: every admin call and every refused one, with the caller's identity (never the
//! token), what it asked for, on what, and how it ended.

use sqlx::Row as _;

use super::{Result, Store};
use crate::error::Error;
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
        let row = (
            identity.to_owned(),
            action.to_owned(),
            target.to_owned(),
            outcome.to_owned(),
        );
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO audit (at, identity, action, target, outcome) \
                     VALUES (?, ?, ?, ?, ?)",
                )
                .bind(at.0)
                .bind(row.0)
                .bind(row.1)
                .bind(row.2)
                .bind(row.3)
                .execute(&mut *conn)
                .await
                .map_err(Error::from)
            })
        })
        .await?;
        Ok(())
    }

    /// The newest `limit` entries, newest first.
    pub async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        let rows = sqlx::query(
            "SELECT seq, at, identity, action, target, outcome FROM audit \
             ORDER BY seq DESC LIMIT ?",
        )
        .bind(limit)
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(AuditEntry {
                    seq: row.try_get("seq")?,
                    at: Millis(row.try_get("at")?),
                    identity: row.try_get("identity")?,
                    action: row.try_get("action")?,
                    target: row.try_get("target")?,
                    outcome: row.try_get("outcome")?,
                })
            })
            .collect()
    }
}
