//! The scheduler's error type. Every variant knows its gRPC code; the mapping to
//! `tonic::Status` lives in one function, [`Error::code`].

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
    #[error("live lesson {0} of this lesson is still being removed; ask again in a moment")]
    StillTerminating(LiveLessonId),
    /// No agent can take the lesson.
    #[error("no agent can take lesson `{lesson}`: {why}")]
    NoAgent {
        /// The lesson.
        lesson: String,
        /// Why each agent was rejected.
        why: String,
    },
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
    /// The database failed to migrate.
    #[error("store migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A batch of writes failed to commit.
    #[error("store commit failed: {0}")]
    Commit(String),
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
            Error::TooManySessions { .. } | Error::TooManyLiveLessons { .. } => {
                Code::ResourceExhausted
            }
            Error::Busy { .. } => Code::FailedPrecondition,
            Error::StillTerminating(_) => Code::Aborted,
            Error::NoAgent { .. } => Code::Unavailable,
            Error::Agent { status, .. } => status.code(),
            Error::Store(_) | Error::Migrate(_) | Error::Corrupt(_) | Error::Commit(_) => {
                Code::Internal
            }
            Error::WriterStopped => Code::Unavailable,
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        let code = err.code();
        if code == Code::Internal {
            // Internal details go to the log, where operators look; callers get a stable text.
            tracing::error!(error = %err, "internal error");
            return tonic::Status::internal("internal error; the scheduler's log has the details");
        }
        tonic::Status::new(code, err.to_string())
    }
}

/// Whether an agent call that failed with this code may succeed if tried again (DESIGN.md §4).
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
