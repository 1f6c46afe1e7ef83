//! The connection to the scheduler: one gRPC client per service, the per-call deadline, and
//! `Failure`, what every command returns when it cannot do its work.

use std::time::Duration;

use antidote_proto::api::v1::ErrorReason;
use antidote_proto::api::v1::admin_service_client::AdminServiceClient;
use antidote_proto::api::v1::curriculum_service_client::CurriculumServiceClient;
use antidote_proto::api::v1::live_lesson_service_client::LiveLessonServiceClient;
use antidote_proto::api::v1::session_service_client::SessionServiceClient;
use antidote_proto::sdk::errors;
use tonic::transport::{Channel, Endpoint};

/// A failure worth one line on stderr.
#[derive(Debug)]
pub struct Failure(pub String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<tonic::Status> for Failure {
    /// `CODE: message (REASON)`. The decision is the typed reason's (ErrorInfo), never the
    /// message's: a status without one did not come from the scheduler (the transport failed).
    fn from(status: tonic::Status) -> Self {
        let code = scheduler_svc::api::http::code_name(status.code());
        match errors::reason(&status) {
            Some((reason, _)) if reason == ErrorReason::ShuttingDown.as_str_name() => Failure(
                format!("{code}: the scheduler is shutting down; try again ({reason})"),
            ),
            Some((reason, _)) => Failure(format!("{code}: {} ({reason})", status.message())),
            None if status.code() == tonic::Code::Unavailable => Failure(format!(
                "{code}: the scheduler is unreachable ({})",
                status.message()
            )),
            None => Failure(format!("{code}: {}", status.message())),
        }
    }
}

pub type Result<T> = std::result::Result<T, Failure>;

/// The scheduler's four services over one channel.
pub struct Clients {
    /// Lessons and their catalog.
    pub curriculum: CurriculumServiceClient<Channel>,
    /// Learner sessions.
    pub sessions: SessionServiceClient<Channel>,
    /// Live lessons: request, follow, change stage, delete.
    pub lessons: LiveLessonServiceClient<Channel>,
    /// Operators' calls.
    pub admin: AdminServiceClient<Channel>,
    /// The deadline of each unary call (`--timeout`).
    timeout: Duration,
}

impl Clients {
    pub async fn connect(server: &str, timeout: Duration) -> Result<Clients> {
        let endpoint = Endpoint::from_shared(server.to_owned())
            .map_err(|err| Failure(format!("--server `{server}` is not a URL: {err}")))?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true);
        let channel = endpoint.connect().await.map_err(|err| {
            // The deepest cause says what happened ("Connection refused").
            let mut cause: &dyn std::error::Error = &err;
            while let Some(source) = cause.source() {
                cause = source;
            }
            Failure(format!(
                "cannot reach the scheduler at {server}: {cause} (is it running? set --server or ANTIDOTE_SERVER)"
            ))
        })?;
        Ok(Clients {
            curriculum: CurriculumServiceClient::new(channel.clone()),
            sessions: SessionServiceClient::new(channel.clone()),
            lessons: LiveLessonServiceClient::new(channel.clone()),
            admin: AdminServiceClient::new(channel),
            timeout,
        })
    }

    /// A request with the call deadline.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }
}
