//! [`Error`], what every step of a backend fails with.

use tonic::{Code, Status};

/// Why a backend step failed, in words a person can act on ("image antidote/ghost:latest is not
/// present on the engine", "Namespace antidote-… is not managed by agent-k8s; left alone").
///
/// While a generation is realised the message is the FAILED reason; from `remove` and
/// `discover` it answers the call, with the gRPC code the error was made with (mapped to the
/// protocol's typed error in one place, [`From<Error> for Status`](#impl-From<Error>-for-Status)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The code a call failing with it answers.
    code: Code,
    /// What went wrong, naming the offending object.
    message: String,
}

impl Error {
    /// The backend (an engine, an API server) cannot be reached or refused for now: the caller
    /// may try again.
    pub fn unavailable(message: impl Into<String>) -> Error {
        Error::new(Code::Unavailable, message)
    }

    /// The backend refuses the agent's credentials.
    pub fn permission_denied(message: impl Into<String>) -> Error {
        Error::new(Code::PermissionDenied, message)
    }

    /// What exists in the backend forbids the step (an object someone else manages).
    pub fn failed_precondition(message: impl Into<String>) -> Error {
        Error::new(Code::FailedPrecondition, message)
    }

    /// A fault of the agent or its host (a file it cannot write).
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(Code::Internal, message)
    }

    /// An error with its own `code`.
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }

    /// The code a call failing with it answers.
    pub fn code(&self) -> Code {
        self.code
    }

    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<Error> for Status {
    /// The typed error of its code (PROTOCOL.md, "Errors").
    fn from(error: Error) -> Status {
        crate::errors::typed(Status::new(error.code, error.message))
    }
}

impl From<String> for Error {
    /// A reason with no code of its own: the backend is unavailable for now.
    fn from(message: String) -> Error {
        Error::unavailable(message)
    }
}

impl From<Error> for String {
    /// While a generation is realised, the FAILED reason.
    fn from(error: Error) -> String {
        error.message
    }
}
