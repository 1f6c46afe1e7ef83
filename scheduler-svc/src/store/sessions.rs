//! Sessions: created under the per-address limit, read, made persistent.

use std::net::IpAddr;

use super::backend::Statement;
use super::effects::Effect;
use super::{Result, SESSION_COLUMNS, Store, session_from_row};
use crate::error::Error;
use crate::model::{Millis, Session, SessionId};

impl Store {
    /// Records a new session for `ip` whose token hashes to `token_hash`, unless the address's
    /// network ([`network`]) already holds `limit` live sessions (0 = no limit). One statement:
    /// the check and the insert cannot be split by another writer (on PostgreSQL, writers for
    /// the same network take turns: the count is taken after the previous one committed).
    pub async fn create_session(
        &self,
        ip: IpAddr,
        token_hash: [u8; 32],
        limit: u32,
        now: Millis,
    ) -> Result<Session> {
        let session = Session {
            id: SessionId::new(),
            source_ip: ip,
            persistent: false,
            created_at: now,
            last_active: now,
        };
        let net = network(ip);
        let session_id = session.id;
        let insert = Statement::new(
            "INSERT INTO sessions (id, source_ip, source_net, token_hash, persistent, \
             created_at, last_active) \
             SELECT $1, $2, $5, $6, 0, $3, $3 WHERE $4 = 0 OR \
             (SELECT COUNT(*) FROM sessions WHERE source_net = $5 AND expired = 0) < $4",
        )
        .bind(session.id.to_string())
        .bind(ip.to_string())
        .bind(now.0)
        .bind(limit)
        .bind(net.clone())
        .bind(token_hash.to_vec());
        let inserted = self
            .write(move |mut conn| {
                Box::pin(async move {
                    if limit > 0 {
                        conn.lock_name(&format!("sessions of {net}")).await?;
                    }
                    let inserted = conn.execute(insert).await?;
                    if inserted > 0 {
                        conn.note(Effect::Token(token_hash, session_id));
                    }
                    Ok(inserted)
                })
            })
            .await?;
        if inserted == 0 {
            return Err(Error::TooManySessions { ip, limit });
        }
        Ok(session)
    }

    /// The live session whose token hashes to `token_hash` (from the writer's cache on SQLite,
    /// from what the replica heard on PostgreSQL, when they know it).
    pub async fn session_by_token(&self, token_hash: [u8; 32]) -> Result<Option<SessionId>> {
        if let Some(session) = self
            .written
            .as_ref()
            .and_then(|written| written.session(&token_hash))
        {
            return Ok(Some(session));
        }
        if let Some(session) = self
            .heard
            .as_ref()
            .and_then(|heard| heard.session(&token_hash))
        {
            return Ok(Some(session));
        }
        let ticket = self.heard.as_ref().map(|heard| heard.ticket());
        let row = self
            .reader
            .fetch_optional(
                Statement::new("SELECT id FROM sessions WHERE token_hash = $1 AND expired = 0")
                    .bind(token_hash.to_vec()),
            )
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let session: SessionId = row
            .get::<String>("id")?
            .parse()
            .map_err(|err: crate::model::BadId| Error::Corrupt(err.to_string()))?;
        if let (Some(heard), Some(ticket)) = (&self.heard, ticket) {
            heard.read_token(ticket, token_hash, session);
        }
        Ok(Some(session))
    }

    /// A live (unexpired) session.
    pub async fn session(&self, id: SessionId) -> Result<Session> {
        let row = self
            .reader
            .fetch_optional(
                Statement::new(format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1 AND expired = 0"
                ))
                .bind(id.to_string()),
            )
            .await?;
        row.map(|row| session_from_row(&row))
            .transpose()?
            .ok_or(Error::SessionNotFound(id))
    }

    /// Every live session, oldest first.
    pub async fn sessions(&self) -> Result<Vec<Session>> {
        let rows = self
            .reader
            .fetch_all(Statement::new(format!(
                "SELECT {SESSION_COLUMNS} FROM sessions WHERE expired = 0 \
                 AND source_net <> 'pool' ORDER BY created_at, id"
            )))
            .await?;
        rows.iter().map(session_from_row).collect()
    }

    /// Sets or clears a session's persistent flag (a trigger copies it to its live lessons).
    pub async fn persist_session(&self, id: SessionId, persistent: bool) -> Result<Session> {
        let row = self
            .write_optional(
                Statement::new(format!(
                    "UPDATE sessions SET persistent = $1 WHERE id = $2 AND expired = 0 \
                     RETURNING {SESSION_COLUMNS}"
                ))
                .bind(i64::from(persistent))
                .bind(id.to_string()),
            )
            .await?;
        row.map(|row| session_from_row(&row))
            .transpose()?
            .ok_or(Error::SessionNotFound(id))
    }
}

/// What the per-address session limit counts by: an IPv4 address itself, the /64 of an IPv6
/// one (a single host is routinely given a whole /64). IPv4-mapped IPv6 addresses count as
/// their IPv4 address.
pub fn network(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = v6.segments();
                format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::network;

    #[test]
    fn ipv6_addresses_count_by_their_64() {
        let net = |ip: &str| network(ip.parse().unwrap());
        assert_eq!(net("203.0.113.7"), "203.0.113.7");
        assert_eq!(
            net("2001:db8:1:2::1"),
            net("2001:db8:1:2:ffff:ffff:ffff:ffff")
        );
        assert_eq!(net("2001:db8:1:2::1"), "2001:db8:1:2::/64");
        assert_ne!(net("2001:db8:1:2::1"), net("2001:db8:1:3::1"));
        assert_eq!(net("::ffff:203.0.113.7"), "203.0.113.7");
    }
}
