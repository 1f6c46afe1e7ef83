//! The audit log: every admin call and every refused one, with the caller's identity (never the
//! token), what it asked for, on what, and how it ended. Kept for `reaper.event_retention`
//! (the reaper prunes it); refusals of unauthenticated callers are written at most
//! [`crate::api`]'s few per client address and minute, so a stranger cannot grow it.

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

    /// Deletes the entries older than `cutoff` (the reaper, at `reaper.event_retention`); the
    /// number deleted.
    pub async fn prune_audit(&self, cutoff: Millis) -> Result<u64> {
        self.write_execute(Statement::new("DELETE FROM audit WHERE at < $1").bind(cutoff.0))
            .await
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::on_both;

    on_both! {
    async fn old_audit_entries_are_pruned_and_new_ones_kept(database, store) {
        for at in [10, 20, 30] {
            store.audit(Millis(at), "anonymous", "ListSessions", "", "UNAUTHENTICATED").await.unwrap();
        }
        store.audit(Millis(40), "token:ops", "KillLiveLesson", "x", "ok").await.unwrap();
        assert_eq!(store.prune_audit(Millis(30)).await.unwrap(), 2);
        let kept = store.audit_log(10).await.unwrap();
        assert_eq!(kept.iter().map(|e| e.at).collect::<Vec<_>>(), [Millis(40), Millis(30)]);
        assert_eq!(store.prune_audit(Millis(30)).await.unwrap(), 0, "nothing older is left");
        // New entries go on after the pruned ones.
        store.audit(Millis(50), "token:ops", "ListAgents", "", "ok").await.unwrap();
        let log = store.audit_log(1).await.unwrap();
        assert!(log[0].seq > kept[0].seq);
    }
    }
}
