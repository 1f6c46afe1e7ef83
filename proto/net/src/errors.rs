//! Typed errors (PROTOCOL.md, "Errors"): every non-OK status carries a `google.rpc.ErrorInfo`
//! in its details, with `domain` = [`DOMAIN`], `reason` = the name of an `ErrorReason` value
//! (`antidote.agent.v1.ErrorReason` from agents, `antidote.api.v1.ErrorReason` from the
//! scheduler) and the metadata the reason documents. Clients decide on the code and the reason,
//! never on the message text.
//!
//! [`agent`] builds an agent's error (the code follows from the reason, one table:
//! [`code_of`]); [`typed`] gives a status that has no ErrorInfo yet (say, from a backend's own
//! code) one that fits its code; [`reason`] reads it back. [`RequestTooLarge`] turns tonic's
//! answer to an oversized message (OUT_OF_RANGE) into RESOURCE_EXHAUSTED, as gRPC's status-code
//! table says it must be.

use std::collections::HashMap;
use std::task::{Context, Poll};

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt as _};

use antidote_proto::agent::v1::ErrorReason;

/// The ErrorInfo domain of every Antidote error.
pub const DOMAIN: &str = "antidote.io";

/// A status with an ErrorInfo of `reason` (an `ErrorReason` value name) and `metadata`.
pub fn status<'a>(
    code: Code,
    reason: &str,
    message: impl Into<String>,
    metadata: impl IntoIterator<Item = (&'a str, String)>,
) -> Status {
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .collect();
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason, DOMAIN, metadata),
    )
}

/// The gRPC code that goes with an agent's reason.
pub fn code_of(reason: ErrorReason) -> Code {
    match reason {
        ErrorReason::InvalidSpec => Code::InvalidArgument,
        ErrorReason::GenerationOutdated | ErrorReason::NoCommonMajor | ErrorReason::NotReady => {
            Code::FailedPrecondition
        }
        ErrorReason::SpecConflict => Code::AlreadyExists,
        ErrorReason::CapacityExhausted | ErrorReason::RequestTooLarge => Code::ResourceExhausted,
        ErrorReason::LiveLessonNotFound => Code::NotFound,
        ErrorReason::NotImplemented => Code::Unimplemented,
        ErrorReason::BeingRemoved | ErrorReason::ChecksRunning => Code::Aborted,
        ErrorReason::BackendUnavailable => Code::Unavailable,
        ErrorReason::BackendError | ErrorReason::Unspecified => Code::Internal,
    }
}

/// An agent's error: the code [`code_of`] the reason, an ErrorInfo with `metadata`.
pub fn agent<'a>(
    reason: ErrorReason,
    message: impl Into<String>,
    metadata: impl IntoIterator<Item = (&'a str, String)>,
) -> Status {
    status(code_of(reason), reason.as_str_name(), message, metadata)
}

/// INVALID_ARGUMENT with reason INVALID_SPEC naming `field`; the message is `field: why`.
pub fn invalid(field: impl Into<String>, why: impl std::fmt::Display) -> Status {
    let field = field.into();
    agent(
        ErrorReason::InvalidSpec,
        format!("{field}: {why}"),
        [("field", field)],
    )
}

/// The status itself if it already carries an ErrorInfo; otherwise the same code and message
/// with the agent reason that fits the code (a backend's INVALID_ARGUMENT is an invalid spec,
/// its UNAVAILABLE an unavailable backend, and so on).
pub fn typed(status: Status) -> Status {
    if status.code() == Code::Ok || status.get_details_error_info().is_some() {
        return status;
    }
    let reason = match status.code() {
        Code::InvalidArgument | Code::OutOfRange => ErrorReason::InvalidSpec,
        Code::NotFound => ErrorReason::LiveLessonNotFound,
        Code::AlreadyExists => ErrorReason::SpecConflict,
        Code::FailedPrecondition => ErrorReason::GenerationOutdated,
        Code::ResourceExhausted => ErrorReason::CapacityExhausted,
        Code::Unimplemented => ErrorReason::NotImplemented,
        Code::Aborted => ErrorReason::BeingRemoved,
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
            ErrorReason::BackendUnavailable
        }
        _ => ErrorReason::BackendError,
    };
    let field = (reason == ErrorReason::InvalidSpec)
        .then(|| status.message().split_once(':').map(|(f, _)| f.to_owned()))
        .flatten();
    self::status(
        status.code(),
        reason.as_str_name(),
        status.message(),
        field.map(|f| ("field", f)),
    )
}

/// The reason and metadata of an Antidote status, if it carries an ErrorInfo of our domain.
pub fn reason(status: &Status) -> Option<(String, HashMap<String, String>)> {
    let info = status.get_details_error_info()?;
    (info.domain == DOMAIN).then_some((info.reason, info.metadata))
}

/// A tower layer for gRPC servers: tonic refuses a request message over the server's limit with
/// OUT_OF_RANGE before any handler runs; gRPC's status-code table says RESOURCE_EXHAUSTED. The
/// answer becomes RESOURCE_EXHAUSTED with reason `reason` (REQUEST_TOO_LARGE of the serving
/// protocol). Other answers pass untouched: our handlers never answer OUT_OF_RANGE.
#[derive(Debug, Clone, Copy)]
pub struct RequestTooLarge {
    /// The reason to put in the ErrorInfo.
    pub reason: &'static str,
}

impl<S> tower::Layer<S> for RequestTooLarge {
    type Service = RequestTooLargeService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestTooLargeService {
            inner,
            reason: self.reason,
        }
    }
}

/// The service [`RequestTooLarge`] wraps around a server's routes.
#[derive(Debug, Clone)]
pub struct RequestTooLargeService<S> {
    inner: S,
    reason: &'static str,
}

impl<S, Req, B> tower::Service<Req> for RequestTooLargeService<S>
where
    S: tower::Service<Req, Response = http::Response<B>>,
    S::Future: Send + 'static,
    B: Default + Send + 'static,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<http::Response<B>, S::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let answer = self.inner.call(request);
        let reason = self.reason;
        Box::pin(async move {
            let response = answer.await?;
            // A refusal before any handler is a trailers-only answer: the status is a header.
            let out_of_range = response
                .headers()
                .get("grpc-status")
                .is_some_and(|v| v.as_bytes() == b"11");
            if !out_of_range {
                return Ok(response);
            }
            let message = response
                .headers()
                .get("grpc-message")
                .and_then(|v| v.to_str().ok())
                .map(|m| {
                    percent_decode(m).replace(
                        "Error, decoded message length too large",
                        "request too large",
                    )
                })
                .unwrap_or_else(|| "request too large".to_owned());
            let limit = message
                .rsplit("the limit is: ")
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                .unwrap_or_default()
                .to_owned();
            Ok(status(Code::ResourceExhausted, reason, message, [("limit", limit)]).into_http())
        })
    }
}

/// Decodes gRPC's percent-encoding of `grpc-message` (only `%XX` escapes are used).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_code_and_survives_the_wire() {
        let status = agent(
            ErrorReason::GenerationOutdated,
            "old",
            [("generation", "1".to_owned())],
        );
        assert_eq!(status.code(), Code::FailedPrecondition);
        let (reason, metadata) = super::reason(&status).unwrap();
        assert_eq!(reason, "GENERATION_OUTDATED");
        assert_eq!(metadata["generation"], "1");
        // Through the HTTP form and back, as a client sees it.
        let back = Status::from_header_map(status.into_http::<()>().headers()).unwrap();
        assert_eq!(super::reason(&back).unwrap().0, "GENERATION_OUTDATED");
    }

    #[test]
    fn untyped_statuses_get_the_reason_of_their_code() {
        let typed = typed(Status::invalid_argument("spec.endpoints[0].image: unknown"));
        let (reason, metadata) = super::reason(&typed).unwrap();
        assert_eq!(reason, "INVALID_SPEC");
        assert_eq!(metadata["field"], "spec.endpoints[0].image");
        assert_eq!(
            super::reason(&super::typed(Status::unavailable("engine down")))
                .unwrap()
                .0,
            "BACKEND_UNAVAILABLE"
        );
        // A typed status keeps its own reason.
        let own = agent(ErrorReason::CapacityExhausted, "full", []);
        assert_eq!(
            super::reason(&super::typed(own)).unwrap().0,
            "CAPACITY_EXHAUSTED"
        );
    }

    #[test]
    fn grpc_messages_are_percent_decoded() {
        assert_eq!(
            percent_decode("Error,%20decoded%20message%20length%20too%20large%25"),
            "Error, decoded message length too large%"
        );
        assert_eq!(percent_decode("100%"), "100%");
    }
}
