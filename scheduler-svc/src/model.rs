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

/// The lifecycle of a live lesson.
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
    /// The pool session it was created in, when it was born a warm-pool member: its specs carry
    /// that session for life (agents never relabel objects), whoever owns it now
    /// (`session_id`). Unclaimed while the two are equal. `None` for a learner's own request.
    pub pool_session: Option<SessionId>,
}

impl LiveLesson {
    /// Whether it is a warm-pool member nobody has claimed yet.
    pub fn unclaimed(&self) -> bool {
        self.pool_session == Some(self.session_id)
    }

    /// Whether the reconciler has work to do on it.
    pub fn needs_work(&self) -> bool {
        self.deleting || self.observed_generation != self.generation || !self.status.is_settled()
    }
}

/// One run of a stage's check files (or, for operators, its solution files) on a live lesson.
/// The store keeps each stage's latest as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckRun {
    /// The stage whose files ran.
    pub stage: u32,
    /// Every file exited 0.
    pub passed: bool,
    /// Each file's outcome, in lesson order of the endpoints.
    pub endpoints: Vec<EndpointCheck>,
    /// When the run ended, in Unix milliseconds ([`Millis`]).
    pub at: i64,
    /// How long it took, in milliseconds.
    pub duration_ms: u64,
}

/// How one endpoint's file ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointCheck {
    /// The endpoint.
    pub endpoint: String,
    /// The file's name (`client.sh`).
    pub file_name: String,
    /// It exited 0.
    pub passed: bool,
    /// Its exit status, when it ran to its end.
    pub exit_code: i32,
    /// It was killed at the timeout.
    pub timed_out: bool,
    /// The tail of its output, or why it could not run: what the learner reads.
    pub feedback: String,
    /// The output was longer than the feedback holds.
    pub truncated: bool,
    /// How long it ran, in milliseconds.
    pub duration_ms: u64,
}

/// What the checks of a live lesson established: the stages that passed and the latest run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageChecks {
    /// Stages whose check passed at least once, ascending.
    pub passed: std::collections::BTreeSet<u32>,
    /// The latest run of any stage's checks.
    pub last: Option<CheckRun>,
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

/// A daily time window of a warm pool: from `from` to `to` (minutes after midnight in the
/// pools' time zone; `to` before `from` runs past midnight) the pool's target is `size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolWindow {
    /// Start, `HH:MM`.
    #[serde(with = "clock_time")]
    pub from: u16,
    /// End (exclusive), `HH:MM`.
    #[serde(with = "clock_time")]
    pub to: u16,
    /// The target while it holds.
    pub size: u32,
}

impl PoolWindow {
    /// Whether `minute` (after midnight) falls in the window.
    pub fn holds(&self, minute: u16) -> bool {
        if self.from <= self.to {
            (self.from..self.to).contains(&minute)
        } else {
            minute >= self.from || minute < self.to
        }
    }
}

/// A pool's target at `minute` of the day: the largest size among the windows holding then,
/// else `size`.
pub fn pool_target(size: u32, windows: &[PoolWindow], minute: u16) -> u32 {
    windows
        .iter()
        .filter(|w| w.holds(minute))
        .map(|w| w.size)
        .max()
        .unwrap_or(size)
}

/// `HH:MM` ↔ minutes after midnight.
pub mod clock_time {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Minutes after midnight of `HH:MM` (00:00 to 24:00).
    pub fn parse(text: &str) -> Result<u16, String> {
        let bad = || format!("`{text}` is not a time of day (HH:MM, 00:00 to 24:00)");
        let (h, m) = text.split_once(':').ok_or_else(bad)?;
        if h.len() != 2 || m.len() != 2 {
            return Err(bad());
        }
        let (h, m): (u16, u16) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
        if m >= 60 || h > 24 || (h == 24 && m > 0) {
            return Err(bad());
        }
        Ok(h * 60 + m)
    }

    /// `HH:MM` of minutes after midnight.
    pub fn show(minute: u16) -> String {
        format!("{:02}:{:02}", minute / 60, minute % 60)
    }

    pub(crate) fn serialize<S: Serializer>(minute: &u16, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&show(*minute))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
        parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_windows_pick_the_target() {
        let window = |from: &str, to: &str, size| PoolWindow {
            from: clock_time::parse(from).unwrap(),
            to: clock_time::parse(to).unwrap(),
            size,
        };
        let at = |t: &str| clock_time::parse(t).unwrap();
        let class = [window("08:45", "10:00", 30), window("09:30", "09:45", 40)];
        assert_eq!(pool_target(3, &class, at("08:44")), 3);
        assert_eq!(pool_target(3, &class, at("08:45")), 30);
        assert_eq!(pool_target(3, &class, at("09:40")), 40, "the larger of two");
        assert_eq!(
            pool_target(3, &class, at("10:00")),
            3,
            "the end is exclusive"
        );
        let night = [window("22:00", "02:00", 0)];
        assert_eq!(pool_target(5, &night, at("23:59")), 0);
        assert_eq!(pool_target(5, &night, at("01:00")), 0);
        assert_eq!(pool_target(5, &night, at("12:00")), 5);
        assert_eq!(at("24:00"), 1440);
        for bad in ["9:00", "25:00", "12:60", "noon", "24:01"] {
            assert!(clock_time::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(clock_time::show(at("08:05")), "08:05");
    }

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
