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
    /// The current time by this process's [`Clock`]: the wall clock as it read at start-up,
    /// advanced by the monotonic clock since. Every time the store keeps (activity, TTL
    /// cutoffs, events) comes from here.
    pub fn now() -> Self {
        static CLOCK: std::sync::OnceLock<Clock> = std::sync::OnceLock::new();
        CLOCK.get_or_init(Clock::system).now()
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

/// Where timestamps come from: the wall clock read once, then advanced by the monotonic clock
/// (`CLOCK_MONOTONIC`, which NTP slews but nothing steps). A step of the system clock while the
/// scheduler runs (an operator's `date -s`, a VM resumed from a snapshot, NTP stepping a badly
/// wrong clock) therefore moves no TTL: otherwise a step forward would expire every live lesson
/// at the reaper's next tick, and a step back would keep them all past their TTL. Stored times
/// stay Unix milliseconds, comparable across restarts; a step between two runs of the process
/// counts as downtime, as idle time should.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// The wall-clock time at `start`.
    anchor: Millis,
    /// When the anchor was read, on the monotonic clock.
    start: std::time::Instant,
}

impl Clock {
    /// Reads the wall clock once, now.
    pub fn system() -> Clock {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Clock::anchored(Millis(since.as_millis() as i64), std::time::Instant::now())
    }

    /// A clock that read `anchor` on the wall clock at `start`.
    pub fn anchored(anchor: Millis, start: std::time::Instant) -> Clock {
        Clock { anchor, start }
    }

    /// The time at `instant` (of the monotonic clock).
    pub fn at(&self, instant: std::time::Instant) -> Millis {
        self.anchor
            .plus(instant.saturating_duration_since(self.start))
    }

    /// The time now.
    pub fn now(&self) -> Millis {
        self.at(std::time::Instant::now())
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

/// Labels a request asks of the agent that runs its live lesson (on top of the lesson's own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wishes {
    /// Labels the agent must carry, every pair.
    #[serde(default)]
    pub requires: std::collections::BTreeMap<String, String>,
    /// Labels the agent should carry: more matches win over lower load.
    #[serde(default)]
    pub prefers: std::collections::BTreeMap<String, String>,
}

impl Wishes {
    /// Whether the request asked for nothing.
    pub fn is_empty(&self) -> bool {
        self.requires.is_empty() && self.prefers.is_empty()
    }
}

/// Why placement chose an agent, as recorded with the live lesson for operators.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The agent chosen.
    pub agent: String,
    /// The preferred labels it carries.
    pub matched: std::collections::BTreeMap<String, String>,
    /// Its load when chosen (this live lesson not counted).
    pub load: u32,
    /// Its capacity; 0 for no limit.
    pub capacity: u32,
    /// Every other agent and why it was not chosen.
    pub excluded: Vec<(String, String)>,
    /// The whole decision in one sentence.
    pub reason: String,
}

/// What the store keeps of a live lesson's placement: what its request asked for, the last
/// decision, and the agent it was moved from after that agent was lost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementRecord {
    /// The request's labels.
    pub wishes: Wishes,
    /// The last decision, if placement ever chose.
    pub decision: Option<Decision>,
    /// When the last decision was made.
    pub decided_at: Option<Millis>,
    /// The lost agent the live lesson was last moved from, until it is placed again.
    pub moved_from: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_moves_with_the_monotonic_clock_only() {
        let start = std::time::Instant::now();
        let clock = Clock::anchored(Millis(1_000), start);
        assert_eq!(clock.at(start), Millis(1_000));
        assert_eq!(clock.at(start + Duration::from_secs(90)), Millis(91_000));
        // An instant before the anchor (another thread's) is the anchor, never earlier.
        assert_eq!(clock.at(start - Duration::from_millis(5)), Millis(1_000));
        let (a, b) = (Millis::now(), Millis::now());
        assert!(a <= b);
    }

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
