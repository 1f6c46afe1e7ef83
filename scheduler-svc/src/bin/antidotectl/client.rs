//! The connection to the scheduler: one gRPC client per service, the per-call deadline, and
//! `Failure`, what every command returns when it cannot do its work.

use std::path::PathBuf;
use std::time::Duration;

use antidote_net::errors;
use antidote_proto::api::v1::ErrorReason;
use antidote_proto::api::v1::admin_service_client::AdminServiceClient;
use antidote_proto::api::v1::curriculum_service_client::CurriculumServiceClient;
use antidote_proto::api::v1::live_lesson_service_client::LiveLessonServiceClient;
use antidote_proto::api::v1::session_service_client::SessionServiceClient;
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

/// Where learners' session tokens are kept between runs, like a browser's cookie jar: one line
/// `KEY TOKEN` per session id and per live lesson id requested with it, in a file only its
/// owner can read (`$ANTIDOTE_STATE_DIR`, else `$XDG_STATE_HOME/antidote`, else
/// `~/.local/state/antidote`; file `sessions`).
pub struct Credentials {
    path: Option<PathBuf>,
}

impl Credentials {
    /// The store of this user.
    pub fn open() -> Credentials {
        let dir = std::env::var_os("ANTIDOTE_STATE_DIR")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_STATE_HOME").map(|d| PathBuf::from(d).join("antidote"))
            })
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state/antidote"))
            });
        Credentials {
            path: dir.map(|d| d.join("sessions")),
        }
    }

    /// The token kept for a session or live lesson id, else the one kept last (the current
    /// session, as a browser's cookie would be).
    pub fn get(&self, key: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.path.as_ref()?).ok()?;
        let pairs = || text.lines().filter_map(|line| line.split_once(' '));
        pairs()
            .find(|(k, _)| *k == key)
            .or_else(|| pairs().next_back())
            .map(|(_, token)| token.trim().to_owned())
    }

    /// Keeps `token` for `key` (a session or live lesson id).
    pub fn put(&self, key: &str, token: &str) -> Result<()> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let Some(path) = &self.path else {
            return Err(Failure(
                "no place to keep the session token: set ANTIDOTE_STATE_DIR or HOME".into(),
            ));
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|err| Failure(format!("cannot create {}: {err}", dir.display())))?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(|err| Failure(format!("cannot write {}: {err}", path.display())))?;
        writeln!(file, "{key} {token}")
            .map_err(|err| Failure(format!("cannot write {}: {err}", path.display())))
    }
}

/// The scheduler's four services: the learners' three on `--server`, AdminService on
/// `--admin-server`.
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
    /// The admin bearer token (`--token`).
    admin_token: Option<String>,
    /// `--session-token`, which overrides the kept ones.
    session_token: Option<String>,
    /// The kept session tokens.
    pub credentials: Credentials,
}

impl Clients {
    pub async fn connect(
        server: &str,
        admin_server: &str,
        admin_token: Option<String>,
        session_token: Option<String>,
        timeout: Duration,
    ) -> Result<Clients> {
        // The admin listener is dialled when an admin command first calls it.
        let admin = Endpoint::from_shared(admin_server.to_owned())
            .map_err(|err| {
                Failure(format!(
                    "--admin-server `{admin_server}` is not a URL: {err}"
                ))
            })?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .connect_lazy();
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
            admin: AdminServiceClient::new(admin),
            timeout,
            admin_token,
            session_token,
            credentials: Credentials::open(),
        })
    }

    /// A learner's request about `key` (a session or live lesson id), with its session token:
    /// `--session-token`, else the one kept for `key`.
    pub fn learner<T>(&self, message: T, key: &str) -> tonic::Request<T> {
        let token = self
            .session_token
            .clone()
            .or_else(|| self.credentials.get(key));
        bearer(self.request(message), token.as_deref())
    }

    /// A learner's request with a session token of the command's own (a session it made).
    pub fn as_learner<T>(&self, message: T, token: &str) -> tonic::Request<T> {
        bearer(self.request(message), Some(token))
    }

    /// An operator's request, with `--token`.
    pub fn operator<T>(&self, message: T) -> tonic::Request<T> {
        bearer(self.request(message), self.admin_token.as_deref())
    }

    /// A request with the call deadline.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }
}

/// `request` with `authorization: Bearer TOKEN` when there is a token.
fn bearer<T>(mut request: tonic::Request<T>, token: Option<&str>) -> tonic::Request<T> {
    if let Some(value) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
        request.metadata_mut().insert("authorization", value);
    }
    request
}
