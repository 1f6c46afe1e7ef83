//! Domain types of the scheduler: ids, statuses, sessions and live lessons. They know nothing of
//! protobuf or SQL; `wire` and `store` convert at the edges.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Why an id could not be parsed; carries what was given so the message can name it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{given}` is not a valid {what} (expected a UUID)")]
pub struct BadId {
    /// Which kind of id was expected ("session id", "live lesson id").
    pub what: &'static str,
    /// The text that was given, truncated to keep messages short.
    pub given: String,
}

macro_rules! uuid_id {
    ($name:ident, $what:literal) => {
        #[doc = concat!("A ", $what, " (a random UUID).")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new random id.
            pub fn new() -> Self {
                Self(Uuid::new_v4())
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.hyphenated().fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = BadId;
            fn from_str(s: &str) -> Result<Self, BadId> {
                Uuid::try_parse(s).map(Self).map_err(|_| BadId {
                    what: $what,
                    given: s.chars().take(64).collect(),
                })
            }
        }
    };
}

uuid_id!(SessionId, "session id");
uuid_id!(LiveLessonId, "live lesson id");

/// Milliseconds since the Unix epoch: how the store keeps time, and precise enough for TTLs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(pub i64);

impl Millis {
    /// The current wall-clock time.
    pub fn now() -> Self {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Self(since.as_millis() as i64)
    }

    /// This instant plus a duration (saturating).
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(d.as_millis() as i64))
    }

    /// This instant minus a duration (saturating).
    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(d.as_millis() as i64))
    }
}

/// When something idle since `last_active` expires under `ttl`: never when it is persistent (a
/// persistent session and its live lessons). The rule's one statement; the reaper's SQL applies
/// it through `store::reaper::EXPIRES`.
pub fn expiry(persistent: bool, last_active: Millis, ttl: Duration) -> Option<Millis> {
    (!persistent).then(|| last_active.plus(ttl))
}

/// The lifecycle of a live lesson (DESIGN.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Recorded; no worker has driven an agent yet.
    Pending,
    /// The agent creates and starts endpoints.
    Booting,
    /// Stage configuration and readiness checks.
    Configuring,
    /// Reachable and configured.
    Ready,
    /// Provisioning failed; terminal until asked again.
    Failed,
    /// Being removed; gone once its objects are.
    Terminating,
}

impl Status {
    /// Every status, for tests and metrics.
    pub const ALL: [Status; 6] = [
        Status::Pending,
        Status::Booting,
        Status::Configuring,
        Status::Ready,
        Status::Failed,
        Status::Terminating,
    ];

    /// The name stored in the database and shown in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "PENDING",
            Status::Booting => "BOOTING",
            Status::Configuring => "CONFIGURING",
            Status::Ready => "READY",
            Status::Failed => "FAILED",
            Status::Terminating => "TERMINATING",
        }
    }

    /// Whether the reconciler has nothing more to do for the current generation.
    pub fn is_settled(self) -> bool {
        matches!(self, Status::Ready | Status::Failed)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Status::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| format!("unknown status `{s}`"))
    }
}

/// A learner's session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Its id.
    pub id: SessionId,
    /// Where it was created from; the per-IP limit counts these.
    pub source_ip: IpAddr,
    /// Exempt from idle expiry (set by operators).
    pub persistent: bool,
    /// When it was created.
    pub created_at: Millis,
    /// When it was last used; its TTL counts from here.
    pub last_active: Millis,
}

/// Where learners reach one presentation of a live endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PresentationInfo {
    /// The presentation's name.
    pub name: String,
    /// `ssh` or `http`.
    pub kind: String,
    /// host:port.
    pub address: String,
    /// A URL for http presentations.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub url: String,
}

/// The observed state of one endpoint of a live lesson.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointInfo {
    /// The endpoint's name.
    pub name: String,
    /// Where to reach its presentations.
    pub presentations: Vec<PresentationInfo>,
    /// Passing readiness probes.
    pub healthy: u32,
    /// All readiness probes.
    pub total: u32,
}

/// A live lesson as the store keeps it: desired state (stage, generation, deleting) and observed
/// state (status, reason, endpoints, observed generation) side by side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveLesson {
    /// Its id.
    pub id: LiveLessonId,
    /// Its session.
    pub session_id: SessionId,
    /// The lesson's slug.
    pub lesson_slug: String,
    /// The desired stage.
    pub stage: u32,
    /// Bumped on every change of desired state.
    pub generation: u64,
    /// The generation the last settled status (READY/FAILED) belongs to.
    pub observed_generation: u64,
    /// Where it is in its lifecycle.
    pub status: Status,
    /// Why it failed, or what it is waiting for.
    pub reason: String,
    /// Desired state is "absent": removal was asked for.
    pub deleting: bool,
    /// The agent it is placed on.
    pub agent: Option<String>,
    /// The agent's opaque handle, passed back in Deprovision and Recover.
    pub handle: Vec<u8>,
    /// Where learners reach each endpoint, as the agent last reported.
    pub endpoints: Vec<EndpointInfo>,
    /// Its session is persistent: exempt from idle expiry.
    pub persistent: bool,
    /// When it was created.
    pub created_at: Millis,
    /// When it was last used; its TTL counts from here.
    pub last_active: Millis,
}

impl LiveLesson {
    /// Whether the reconciler has work to do on it.
    pub fn needs_work(&self) -> bool {
        self.deleting || self.observed_generation != self.generation || !self.status.is_settled()
    }
}

/// A recorded transition of a live lesson.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Position in the log.
    pub seq: i64,
    /// The live lesson.
    pub live_lesson_id: LiveLessonId,
    /// When it happened.
    pub at: Millis,
    /// The status entered.
    pub status: Status,
    /// The generation concerned.
    pub generation: u64,
    /// The stage at the time.
    pub stage: u32,
    /// Detail (failure reason, "deleted", "expired", ...).
    pub detail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_reject_garbage() {
        let id = LiveLessonId::new();
        assert_eq!(id.to_string().parse::<LiveLessonId>(), Ok(id));
        let err = "not-a-uuid".parse::<SessionId>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "`not-a-uuid` is not a valid session id (expected a UUID)"
        );
    }

    #[test]
    fn statuses_round_trip() {
        for status in Status::ALL {
            assert_eq!(status.as_str().parse::<Status>(), Ok(status));
        }
        assert!("BOGUS".parse::<Status>().is_err());
    }
}
