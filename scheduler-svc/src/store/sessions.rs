//! Sessions: created under the per-address limit, read, made persistent.

use std::net::IpAddr;

use super::{Result, SESSION_COLUMNS, Store, session_from_row};
use crate::error::Error;
use crate::model::{Millis, Session, SessionId};

impl Store {
    /// Records a new session for `ip`, unless the address already holds `limit` live sessions
    /// (0 = no limit). One statement: the check and the insert cannot be split by another
    /// writer.
    pub async fn create_session(&self, ip: IpAddr, limit: u32, now: Millis) -> Result<Session> {
        let session = Session {
            id: SessionId::new(),
            source_ip: ip,
            persistent: false,
            created_at: now,
            last_active: now,
        };
        let done = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO sessions (id, source_ip, persistent, created_at, last_active) \
             SELECT ?1, ?2, 0, ?3, ?3 WHERE ?4 = 0 OR \
             (SELECT COUNT(*) FROM sessions WHERE source_ip = ?2 AND expired = 0) < ?4",
                    )
                    .bind(session.id.to_string())
                    .bind(ip.to_string())
                    .bind(now.0)
                    .bind(limit)
                    .execute(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        if done.rows_affected() == 0 {
            return Err(Error::TooManySessions { ip, limit });
        }
        Ok(session)
    }

    /// A live (unexpired) session.
    pub async fn session(&self, id: SessionId) -> Result<Session> {
        let row = sqlx::query(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ? AND expired = 0"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.reader)
        .await?;
        row.map(|row| session_from_row(&row))
            .transpose()?
            .ok_or(Error::SessionNotFound(id))
    }

    /// Every live session, oldest first.
    pub async fn sessions(&self) -> Result<Vec<Session>> {
        let rows = sqlx::query(&format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE expired = 0 ORDER BY created_at, id"
        ))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(session_from_row).collect()
    }

    /// Sets or clears a session's persistent flag (a trigger copies it to its live lessons).
    pub async fn persist_session(&self, id: SessionId, persistent: bool) -> Result<Session> {
        let row = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(&format!(
                        "UPDATE sessions SET persistent = ? WHERE id = ? AND expired = 0 \
             RETURNING {SESSION_COLUMNS}"
                    ))
                    .bind(persistent)
                    .bind(id.to_string())
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(Error::from)
                })
            })
            .await?;
        row.map(|row| session_from_row(&row))
            .transpose()?
            .ok_or(Error::SessionNotFound(id))
    }
}
