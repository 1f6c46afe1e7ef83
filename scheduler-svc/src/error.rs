//! The scheduler's error type. Every variant knows its gRPC code; the mapping to
//! `tonic::Status` lives in one function, [`Error::code`].

use antidote_net::errors;
use antidote_proto::api::v1::ErrorReason;
use tonic::Code;

use crate::model::{BadId, LiveLessonId, SessionId, Status};

/// Everything that can go wrong while serving a request or reconciling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A malformed id in a request.
    #[error(transparent)]
    BadId(#[from] BadId),
    /// A request field with a bad value.
    #[error("invalid `{field}`: {reason}")]
    InvalidArgument {
        /// The request field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No such session (or it expired).
    #[error("session {0} not found (unknown or expired)")]
    SessionNotFound(SessionId),
    /// No such live lesson.
    #[error("live lesson {0} not found")]
    LiveLessonNotFound(LiveLessonId),
    /// No such lesson in the loaded catalog.
    #[error("lesson `{0}` not found in the curriculum")]
    LessonNotFound(String),
    /// No such collection.
    #[error("collection `{0}` not found in the curriculum")]
    CollectionNotFound(String),
    /// A stage index beyond the lesson's stages.
    #[error("stage {stage} is out of range for lesson `{lesson}`, which has stages 0..={last}")]
    StageOutOfRange {
        /// The lesson.
        lesson: String,
        /// The stage asked for.
        stage: u32,
        /// The last valid stage.
        last: u32,
    },
    /// The caller's address holds too many sessions.
    #[error("source address {ip} already holds {limit} sessions, the configured limit")]
    TooManySessions {
        /// The address.
        ip: std::net::IpAddr,
        /// The limit.
        limit: u32,
    },
    /// The session holds too many live lessons.
    #[error("session {session} already holds {limit} live lessons, the configured limit")]
    TooManyLiveLessons {
        /// The session.
        session: SessionId,
        /// The limit.
        limit: u32,
    },
    /// A stage change while the live lesson is still working.
    #[error("live lesson {id} is {status}; change stage once it is READY or FAILED")]
    Busy {
        /// The live lesson.
        id: LiveLessonId,
        /// Its status.
        status: Status,
    },
    /// A request for a lesson whose previous live lesson is still being removed.
    /// A check asked of a live lesson that is not READY at its generation.
    #[error("live lesson {id} is {status}; check it once it is READY")]
    NotReady {
        /// The live lesson.
        id: LiveLessonId,
        /// Its status now.
        status: Status,
    },
    /// The live lesson's current stage has no files of the kind asked for.
    #[error("stage {stage} of lesson `{lesson}` has no {files}")]
    NoChecks {
        /// The lesson.
        lesson: String,
        /// The stage.
        stage: u32,
        /// `checks` or `solutions`.
        files: &'static str,
    },
    /// A check of this live lesson is running, or it ran the most allowed in a minute.
    #[error("{}", too_many_checks(*id, scope, *limit))]
    TooManyChecks {
        /// The live lesson.
        id: LiveLessonId,
        /// `running` or `minute`.
        scope: &'static str,
        /// The limit that was reached.
        limit: u32,
    },
    /// The live lesson's agent does not offer the `checks` capability.
    #[error(
        "this agent cannot run checks: agent `{agent}` does not offer the `checks` capability; the live lesson is unchanged"
    )]
    ChecksUnsupported {
        /// The agent.
        agent: String,
    },
    /// A gated stage's check has not passed, so no later stage may be asked for.
    #[error(
        "stage {stage} is gated by its check, which has not passed in this live lesson: {check}"
    )]
    CheckNotPassed {
        /// The live lesson; `None` for one asked for at a later stage from the start.
        id: Option<LiveLessonId>,
        /// The gated stage.
        stage: u32,
        /// Its check file that failed last, or its first.
        check: String,
    },
    #[error("live lesson {0} of this lesson is still being removed; ask again in a moment")]
    StillTerminating(LiveLessonId),
    /// A session or an address holds the most open Watch streams allowed.
    #[error("this {scope} already holds {limit} open watches, the configured limit")]
    TooManyStreams {
        /// `session` or `address`.
        scope: &'static str,
        /// The limit.
        limit: u32,
    },
    /// A call without a valid bearer token.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// A token without the scope the call needs.
    #[error("{identity} lacks scope `{scope}`")]
    PermissionDenied {
        /// Who called.
        identity: String,
        /// The scope the call needs.
        scope: &'static str,
    },
    /// No agent can take the lesson.
    #[error("no agent can take lesson `{lesson}`: {why}")]
    NoAgent {
        /// The lesson.
        lesson: String,
        /// Why each agent was rejected.
        why: String,
    },
    /// No agent the scheduler knows could ever take the lesson (labels, capabilities).
    #[error("no agent could ever take lesson `{lesson}`: {why}")]
    PlacementImpossible {
        /// The lesson.
        lesson: String,
        /// What no agent has (`label region=eu`), for the ErrorInfo metadata.
        missing: String,
        /// Why, naming what is missing and every agent's shortfalls.
        why: String,
    },
    /// No agent with this name.
    #[error("agent `{0}` not found")]
    AgentNotFound(String),
    /// An agent call failed.
    #[error("agent `{agent}` {call} failed: {status}")]
    Agent {
        /// The agent.
        agent: String,
        /// The RPC.
        call: &'static str,
        /// What the agent (or the transport) said.
        status: tonic::Status,
    },
    /// The database failed.
    #[error("store: {0}")]
    Store(#[from] sqlx::Error),
    /// The SQLite writer's connection failed.
    #[error("store: {0}")]
    Written(#[from] rusqlite::Error),
    /// The database failed to migrate.
    #[error("store migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A batch of writes failed to begin or to commit: nothing of it was written, and the same
    /// call may succeed when tried again.
    #[error("store commit failed: {0}")]
    Commit(String),
    /// The database cannot be opened for this process (e.g. another scheduler holds the SQLite
    /// file).
    #[error("{0}")]
    StoreOpen(String),
    /// The writer task is gone (the scheduler is shutting down).
    #[error("store writer stopped")]
    WriterStopped,
    /// Stored data could not be decoded (a bug or a hand-edited database).
    #[error("corrupt store row: {0}")]
    Corrupt(String),
}

impl Error {
    /// The code an agent answered a failed call with; `None` for errors of our own.
    pub fn agent_code(&self) -> Option<Code> {
        match self {
            Error::Agent { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    /// The gRPC code for this error: the one place errors meet gRPC.
    pub fn code(&self) -> Code {
        match self {
            Error::BadId(_) | Error::InvalidArgument { .. } | Error::StageOutOfRange { .. } => {
                Code::InvalidArgument
            }
            Error::SessionNotFound(_)
            | Error::LiveLessonNotFound(_)
            | Error::LessonNotFound(_)
            | Error::CollectionNotFound(_) => Code::NotFound,
            Error::TooManySessions { .. }
            | Error::TooManyLiveLessons { .. }
            | Error::TooManyStreams { .. } => Code::ResourceExhausted,
            Error::Busy { .. }
            | Error::PlacementImpossible { .. }
            | Error::NotReady { .. }
            | Error::NoChecks { .. }
            | Error::CheckNotPassed { .. } => Code::FailedPrecondition,
            Error::TooManyChecks { .. } => Code::ResourceExhausted,
            Error::ChecksUnsupported { .. } => Code::Unimplemented,
            Error::AgentNotFound(_) => Code::NotFound,
            Error::StillTerminating(_) => Code::Aborted,
            Error::NoAgent { .. } => Code::Unavailable,
            Error::Unauthenticated(_) => Code::Unauthenticated,
            Error::PermissionDenied { .. } => Code::PermissionDenied,
            Error::Agent { status, .. } => status.code(),
            // A busy, full, unreachable or restarting database: worth a retry.
            Error::Store(err) if transient(err) => Code::Unavailable,
            Error::Written(err) if transient_written(err) => Code::Unavailable,
            Error::Commit(_) | Error::StoreOpen(_) => Code::Unavailable,
            Error::Store(_) | Error::Written(_) | Error::Migrate(_) | Error::Corrupt(_) => {
                Code::Internal
            }
            Error::WriterStopped => Code::Unavailable,
        }
    }
}

impl Error {
    /// The ErrorInfo reason of this error and the metadata it documents
    /// (`proto/antidote/api/v1/errors.proto`).
    pub fn reason(&self) -> (ErrorReason, Vec<(&'static str, String)>) {
        use ErrorReason as R;
        match self {
            Error::BadId(bad) => (
                R::MalformedId,
                vec![
                    ("field", bad.what.replace(' ', "_")),
                    ("value", bad.given.clone()),
                ],
            ),
            Error::InvalidArgument { field, .. } => {
                (R::InvalidField, vec![("field", (*field).into())])
            }
            Error::SessionNotFound(id) => {
                (R::SessionNotFound, vec![("session_id", id.to_string())])
            }
            Error::LiveLessonNotFound(id) => (
                R::LiveLessonNotFound,
                vec![("live_lesson_id", id.to_string())],
            ),
            Error::LessonNotFound(slug) => (R::LessonNotFound, vec![("lesson", slug.clone())]),
            Error::CollectionNotFound(slug) => {
                (R::CollectionNotFound, vec![("collection", slug.clone())])
            }
            Error::StageOutOfRange {
                lesson,
                stage,
                last,
            } => (
                R::StageOutOfRange,
                vec![
                    ("lesson", lesson.clone()),
                    ("stage", stage.to_string()),
                    ("last_stage", last.to_string()),
                ],
            ),
            Error::TooManySessions { ip, limit } => (
                R::TooManySessions,
                vec![("source_ip", ip.to_string()), ("limit", limit.to_string())],
            ),
            Error::TooManyLiveLessons { session, limit } => (
                R::TooManyLiveLessons,
                vec![
                    ("session_id", session.to_string()),
                    ("limit", limit.to_string()),
                ],
            ),
            Error::Busy { id, status } => (
                R::LiveLessonBusy,
                vec![
                    ("live_lesson_id", id.to_string()),
                    ("status", status.to_string()),
                ],
            ),
            Error::NotReady { id, status } => (
                R::LiveLessonBusy,
                vec![
                    ("live_lesson_id", id.to_string()),
                    ("status", status.to_string()),
                ],
            ),
            Error::NoChecks {
                lesson,
                stage,
                files,
            } => (
                R::NoChecks,
                vec![
                    ("lesson", lesson.clone()),
                    ("stage", stage.to_string()),
                    ("files", (*files).to_owned()),
                ],
            ),
            Error::TooManyChecks { id, scope, limit } => (
                R::TooManyChecks,
                vec![
                    ("live_lesson_id", id.to_string()),
                    ("scope", (*scope).to_owned()),
                    ("limit", limit.to_string()),
                ],
            ),
            Error::ChecksUnsupported { agent } => {
                (R::ChecksUnsupported, vec![("agent", agent.clone())])
            }
            Error::CheckNotPassed { id, stage, check } => (
                R::CheckNotPassed,
                vec![
                    (
                        "live_lesson_id",
                        id.map(|id| id.to_string()).unwrap_or_default(),
                    ),
                    ("stage", stage.to_string()),
                    ("check", check.clone()),
                ],
            ),
            Error::StillTerminating(id) => (
                R::StillTerminating,
                vec![("live_lesson_id", id.to_string())],
            ),
            Error::NoAgent { lesson, .. } => (R::NoAgent, vec![("lesson", lesson.clone())]),
            Error::PlacementImpossible {
                lesson, missing, ..
            } => (
                R::PlacementImpossible,
                vec![("lesson", lesson.clone()), ("missing", missing.clone())],
            ),
            Error::AgentNotFound(agent) => (R::AgentNotFound, vec![("agent", agent.clone())]),
            Error::Unauthenticated(_) => (R::Unauthenticated, vec![]),
            Error::TooManyStreams { scope, limit } => (
                R::TooManyStreams,
                vec![("scope", (*scope).to_owned()), ("limit", limit.to_string())],
            ),
            Error::PermissionDenied { identity, scope } => (
                R::PermissionDenied,
                vec![
                    ("identity", identity.clone()),
                    ("scope", (*scope).to_owned()),
                ],
            ),
            Error::Agent {
                agent,
                call,
                status,
            } => {
                let mut metadata = vec![("agent", agent.clone()), ("rpc", (*call).to_owned())];
                if let Some((reason, _)) = errors::reason(status) {
                    metadata.push(("agent_reason", reason));
                }
                (R::AgentError, metadata)
            }
            Error::WriterStopped => (R::ShuttingDown, vec![]),
            Error::Store(err) if transient(err) => (R::StoreUnavailable, vec![]),
            Error::Written(err) if transient_written(err) => (R::StoreUnavailable, vec![]),
            Error::Commit(_) | Error::StoreOpen(_) => (R::StoreUnavailable, vec![]),
            Error::Store(_) | Error::Written(_) | Error::Migrate(_) | Error::Corrupt(_) => {
                (R::InternalError, vec![])
            }
        }
    }
}

/// The message of [`Error::TooManyChecks`].
fn too_many_checks(id: LiveLessonId, scope: &str, limit: u32) -> String {
    if scope == "running" {
        format!("a check of live lesson {id} is already running; one at a time")
    } else {
        format!(
            "live lesson {id} ran {limit} checks in the last minute, the configured limit; try again shortly"
        )
    }
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        let code = err.code();
        let (reason, metadata) = err.reason();
        let message = if code == Code::Internal {
            // Internal details go to the log, where operators look; callers get a stable text.
            tracing::error!(error = %err, "internal error");
            "internal error; the scheduler's log has the details".to_owned()
        } else {
            err.to_string()
        };
        errors::status(code, reason.as_str_name(), message, metadata)
    }
}

/// Whether an agent call that failed with this code may succeed if tried again.
/// CANCELLED is included because the scheduler never cancels its own calls: tonic reports a
/// connection that closed under a call (an agent restarting) as CANCELLED.
pub fn is_retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::Cancelled
    )
}

/// Whether a database error may pass if the same call is tried again: the database is busy,
/// full, unreachable, restarting, or chose this transaction as a deadlock's or a serialisation
/// conflict's victim. Such errors are UNAVAILABLE to callers (and retried by the reconciler),
/// never INTERNAL.
fn transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let Some(code) = db.code() else { return false };
            if let Ok(sqlite) = code.parse::<i64>() {
                // SQLite's primary result code is the low byte of the extended one: BUSY,
                // LOCKED, IOERR, FULL, CANTOPEN.
                return matches!(sqlite & 0xff, 5 | 6 | 10 | 13 | 14);
            }
            // PostgreSQL SQLSTATEs: connection exceptions (08), insufficient resources (53),
            // operator intervention such as a restart (57P01..57P03), serialisation failure
            // and deadlock (40001, 40P01), read-only transaction on a standby (25006).
            code.starts_with("08")
                || code.starts_with("53")
                || code.starts_with("57P")
                || code == "40001"
                || code == "40P01"
                || code == "25006"
        }
        _ => false,
    }
}

/// [`transient`] for the SQLite writer's connection: busy, locked, an I/O error, a full disk,
/// a file that cannot be opened.
fn transient_written(err: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode as E;
    matches!(
        err.sqlite_error_code(),
        Some(
            E::DatabaseBusy | E::DatabaseLocked | E::SystemIoFailure | E::DiskFull | E::CannotOpen
        )
    )
}

#[cfg(test)]
mod tests {
    use tonic_types::StatusExt as _;

    use super::*;

    /// The status a caller gets for `err`: (code, reason, metadata as `key=value`, sorted).
    fn wire(err: Error) -> (Code, String, Vec<String>) {
        let status = tonic::Status::from(err);
        let info = status.get_details_error_info().expect("an ErrorInfo");
        assert_eq!(info.domain, "antidote.io");
        let mut metadata: Vec<_> = info
            .metadata
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        metadata.sort();
        (status.code(), info.reason, metadata)
    }

    #[test]
    fn every_error_carries_its_reason_and_metadata() {
        let id = LiveLessonId::new();
        assert_eq!(
            wire(Error::LiveLessonNotFound(id)),
            (
                Code::NotFound,
                "LIVE_LESSON_NOT_FOUND".into(),
                vec![format!("live_lesson_id={id}")]
            )
        );
        assert_eq!(
            wire(Error::StageOutOfRange {
                lesson: "intro".into(),
                stage: 4,
                last: 1
            }),
            (
                Code::InvalidArgument,
                "STAGE_OUT_OF_RANGE".into(),
                vec![
                    "last_stage=1".into(),
                    "lesson=intro".into(),
                    "stage=4".into()
                ]
            )
        );
        let bad = "nope".parse::<SessionId>().unwrap_err();
        assert_eq!(
            wire(Error::from(bad)),
            (
                Code::InvalidArgument,
                "MALFORMED_ID".into(),
                vec!["field=session_id".into(), "value=nope".into()]
            )
        );
        let agent = Error::Agent {
            agent: "docker".into(),
            call: "Plan",
            status: errors::status(
                Code::InvalidArgument,
                "INVALID_SPEC",
                "spec.endpoints: must not be empty",
                [("field", "spec.endpoints".to_owned())],
            ),
        };
        assert_eq!(
            wire(agent),
            (
                Code::InvalidArgument,
                "AGENT_ERROR".into(),
                vec![
                    "agent=docker".into(),
                    "agent_reason=INVALID_SPEC".into(),
                    "rpc=Plan".into()
                ]
            )
        );
        // Internal faults keep their detail in the log, not in the answer.
        let (code, reason, _) = wire(Error::Corrupt("row 7".into()));
        assert_eq!((code, reason.as_str()), (Code::Internal, "INTERNAL_ERROR"));
    }
}
