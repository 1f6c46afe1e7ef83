//! The entrypoint: learners' way in to the live lessons of one agent, beside the agent.
//!
//! One HTTPS (or, on loopback, plaintext) listener serves every presentation under
//! `/l/{live_lesson}/{endpoint}/{presentation}/`:
//!
//! - HTTP presentations are proxied ([`proxy`]): the rest of the path goes to the backend,
//!   WebSocket upgrades pass through, `Location` and `Set-Cookie` paths are kept within the
//!   prefix;
//! - SSH presentations are a web terminal at `.../terminal` ([`terminal`]): a WebSocket whose
//!   far end is an SSH session the entrypoint opens with the image's credentials.
//!
//! Every request needs a token the scheduler signed for exactly that live lesson, endpoint and
//! presentation ([`token`]): in the `antidote_token` query parameter (the URL the scheduler
//! hands out; the entrypoint then sets a cookie scoped to the prefix so the page's own requests
//! carry it), an `Authorization: Bearer` header, or that cookie. No token, a bad or expired one:
//! 401; a good token for something else: 403. A token's expiry does not end what it admitted;
//! its key leaving the key set does (terminals and proxied WebSockets close with 1008, see
//! [`token::Keys`]). Each client address holds at most
//! [`Settings::per_client`] connections (upgraded ones included). Bytes from learners
//! (requests, keystrokes, WebSocket frames) mark the live lesson active; the marks are handed
//! to [`Lessons::active`] in batches.
//!
//! An agent implements [`Lessons`] (the SDK's [`super::Agent`] does, from its specs and
//! reported states) and calls [`serve`]; [`EntrypointArgs`] are the flags.

pub mod proxy;
pub mod terminal;
pub mod token;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::tls::{ServerTls, TlsError};
pub use token::{Admitted, Claims, Keys, Signer, TokenError};

/// The body of every response.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// The query parameter carrying a token.
pub const TOKEN_PARAM: &str = "antidote_token";
/// The cookie carrying a token after the first request.
pub const COOKIE: &str = "antidote_entrypoint";
/// The path every presentation lives under: `/l/{live_lesson}/{endpoint}/{presentation}/`.
pub const PREFIX: &str = "/l/";

/// A presentation's kind, as the entrypoint serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Proxied HTTP.
    Http,
    /// A web terminal over an SSH session logged in as `user` with `password`.
    Ssh {
        /// The image's SSH user.
        user: String,
        /// Its password.
        password: String,
    },
}

/// Where a presentation's server is, from where the entrypoint runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The server's address.
    pub addr: SocketAddr,
    /// How to serve it.
    pub kind: Kind,
}

/// What the entrypoint asks of its agent.
#[tonic::async_trait]
pub trait Lessons: Send + Sync + 'static {
    /// Where a presentation of a live lesson the agent holds is served; `None` when the agent
    /// holds no such live lesson, endpoint or presentation, or it has no address yet.
    async fn resolve(
        &self,
        live_lesson: &str,
        endpoint: &str,
        presentation: &str,
    ) -> Option<Target>;

    /// Learners' bytes went through for `live_lesson`, the last at `at` (called in batches).
    fn active(&self, live_lesson: &str, at: SystemTime);
}

/// How an entrypoint behaves.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Connections one client address may hold at once (upgraded ones included).
    pub per_client: usize,
    /// How often activity is handed to [`Lessons::active`].
    pub activity_interval: Duration,
    /// Set the `Secure` attribute on the token cookie (the listener serves TLS).
    pub secure_cookies: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            per_client: 32,
            activity_interval: Duration::from_secs(5),
            secure_cookies: false,
        }
    }
}

/// Connections per client address.
#[derive(Debug, Default)]
struct Clients {
    /// Open connections by address.
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place; given back when the last clone (the connection, its upgrades) drops.
pub struct Permit {
    clients: Arc<Clients>,
    ip: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut held = self.clients.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

impl Clients {
    fn admit(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<Arc<Permit>> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Arc::new(Permit {
            clients: self.clone(),
            ip,
        }))
    }
}

/// Live lessons that saw learners' bytes since the last batch.
#[derive(Debug, Default)]
pub struct Activity {
    seen: Mutex<HashMap<String, SystemTime>>,
}

impl Activity {
    /// Marks `live_lesson` active now.
    pub fn touch(&self, live_lesson: &str) {
        let now = SystemTime::now();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        match seen.get_mut(live_lesson) {
            Some(at) => *at = now,
            None => {
                seen.insert(live_lesson.to_owned(), now);
            }
        }
    }

    fn drain(&self) -> HashMap<String, SystemTime> {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// An entrypoint: what every connection shares.
pub struct Entrypoint {
    /// The agent's answers.
    lessons: Arc<dyn Lessons>,
    /// The scheduler's public keys.
    keys: Arc<Keys>,
    /// Connection caps.
    clients: Arc<Clients>,
    /// Activity not handed over yet.
    activity: Arc<Activity>,
    settings: Settings,
}

impl Entrypoint {
    /// An entrypoint for `lessons`, admitting tokens `keys` verify.
    pub fn new(lessons: Arc<dyn Lessons>, keys: Arc<Keys>, settings: Settings) -> Arc<Entrypoint> {
        Arc::new(Entrypoint {
            lessons,
            keys,
            clients: Arc::default(),
            activity: Arc::default(),
            settings,
        })
    }
}

/// A connection, plaintext or TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Serves `listener` until `shutdown`, TLS when `tls` is given; activity is handed over every
/// [`Settings::activity_interval`] (and once more at the end).
pub async fn serve(
    entry: Arc<Entrypoint>,
    listener: TcpListener,
    tls: Option<ServerTls>,
    shutdown: CancellationToken,
) {
    let tls = tls.map(Arc::new);
    let flusher = tokio::spawn({
        let entry = entry.clone();
        let shutdown = shutdown.clone();
        async move {
            let mut tick = tokio::time::interval(entry.settings.activity_interval);
            loop {
                let stop = tokio::select! {
                    () = shutdown.cancelled() => true,
                    _ = tick.tick() => false,
                };
                for (id, at) in entry.activity.drain() {
                    entry.lessons.active(&id, at);
                }
                if stop {
                    return;
                }
            }
        }
    });
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(error = %err, "entrypoint accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(permit) = entry.clients.admit(peer.ip(), entry.settings.per_client) else {
            tracing::warn!(peer = %peer, "entrypoint: client at its connection cap; refused");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (entry, tls, shutdown) = (entry.clone(), tls.clone(), shutdown.clone());
        tokio::spawn(async move {
            let io: Box<dyn Io> = match tls {
                Some(tls) => match tls.accept(stream).await {
                    Ok(stream) => Box::new(stream),
                    Err(err) => {
                        tracing::debug!(peer = %peer, error = %err, "entrypoint TLS handshake failed");
                        return;
                    }
                },
                None => Box::new(stream),
            };
            let service = hyper::service::service_fn({
                let permit = permit.clone();
                move |request| {
                    let (entry, permit) = (entry.clone(), permit.clone());
                    async move { Ok::<_, Infallible>(handle(entry, peer, permit, request).await) }
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(err) = result {
                        tracing::debug!(peer = %peer, error = %err, "entrypoint connection ended");
                    }
                }
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
                }
            }
            drop(permit);
        });
    }
    let _ = flusher.await;
}

/// A presentation's path: `/l/{live_lesson}/{endpoint}/{presentation}` and the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The live lesson id.
    pub live_lesson: String,
    /// The endpoint's name.
    pub endpoint: String,
    /// The presentation's name.
    pub presentation: String,
    /// The path after the prefix, starting with `/` (empty when the request named the prefix
    /// alone).
    pub rest: String,
}

impl Route {
    /// Parses a request path; `None` outside `/l/`.
    pub fn parse(path: &str) -> Option<Route> {
        let tail = path.strip_prefix(PREFIX)?;
        let mut parts = tail.splitn(4, '/');
        let live_lesson = parts.next().filter(|s| !s.is_empty())?;
        let endpoint = parts.next().filter(|s| !s.is_empty())?;
        let presentation = parts.next().filter(|s| !s.is_empty())?;
        let rest = parts.next().map(|r| format!("/{r}")).unwrap_or_default();
        Some(Route {
            live_lesson: live_lesson.to_owned(),
            endpoint: endpoint.to_owned(),
            presentation: presentation.to_owned(),
            rest,
        })
    }

    /// `/l/{live_lesson}/{endpoint}/{presentation}` (no trailing slash).
    pub fn prefix(&self) -> String {
        format!(
            "{PREFIX}{}/{}/{}",
            self.live_lesson, self.endpoint, self.presentation
        )
    }
}

/// The path of a presentation (what the scheduler appends to the entrypoint's base URL).
pub fn presentation_path(live_lesson: &str, endpoint: &str, presentation: &str) -> String {
    format!("{PREFIX}{live_lesson}/{endpoint}/{presentation}/")
}

/// A small response of our own.
pub(crate) fn reply(status: StatusCode, text: &str) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(format!("{text}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Where the request's token is.
enum Found {
    /// The query parameter: the cookie is set on the answer.
    Query(String),
    /// The header or the cookie.
    Held(String),
    None,
}

fn find_token(request: &Request<Incoming>) -> Found {
    if let Some(query) = request.uri().query() {
        for pair in query.split('&') {
            if let Some(value) = pair
                .strip_prefix(TOKEN_PARAM)
                .and_then(|v| v.strip_prefix('='))
            {
                return Found::Query(value.to_owned());
            }
        }
    }
    if let Some(bearer) = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return Found::Held(bearer.trim().to_owned());
    }
    match cookie(request.headers(), COOKIE) {
        Some(value) => Found::Held(value),
        None => Found::None,
    }
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie(headers: &http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

async fn handle(
    entry: Arc<Entrypoint>,
    peer: SocketAddr,
    permit: Arc<Permit>,
    request: Request<Incoming>,
) -> Response<Body> {
    let Some(route) = Route::parse(request.uri().path()) else {
        return reply(StatusCode::NOT_FOUND, "not a presentation");
    };
    let (token, from_query) = match find_token(&request) {
        Found::Query(token) => (token, true),
        Found::Held(token) => (token, false),
        Found::None => return reply(StatusCode::UNAUTHORIZED, "a token is required"),
    };
    let (claims, withdrawn) = match entry.keys.admit(&token) {
        Ok(admitted) => (admitted.claims, admitted.withdrawn),
        Err(err) => {
            tracing::debug!(peer = %peer, error = %err, "entrypoint refused a token");
            return reply(StatusCode::UNAUTHORIZED, &err.to_string());
        }
    };
    if !claims.admits(&route.live_lesson, &route.endpoint, &route.presentation) {
        return reply(
            StatusCode::FORBIDDEN,
            "the token is for another presentation",
        );
    }
    if route.rest.is_empty() {
        // Relative links resolve against the prefix only with its trailing slash.
        let query = request
            .uri()
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        let mut response = reply(StatusCode::PERMANENT_REDIRECT, "moved");
        if let Ok(location) = HeaderValue::from_str(&format!("{}/{query}", route.prefix())) {
            response.headers_mut().insert(header::LOCATION, location);
        }
        return response;
    }
    let Some(target) = entry
        .lessons
        .resolve(&route.live_lesson, &route.endpoint, &route.presentation)
        .await
    else {
        return reply(
            StatusCode::NOT_FOUND,
            "no such presentation here (not ready, or gone)",
        );
    };
    entry.activity.touch(&route.live_lesson);
    let mut response = match target.kind {
        Kind::Http => {
            proxy::forward(
                request,
                target.addr,
                &route,
                peer,
                entry.activity.clone(),
                permit,
                withdrawn,
            )
            .await
        }
        Kind::Ssh { user, password } => {
            if route.rest != "/terminal" {
                return reply(
                    StatusCode::NOT_FOUND,
                    "an ssh presentation serves a WebSocket terminal at .../terminal",
                );
            }
            terminal::open(
                request,
                target.addr,
                (&user, &password),
                &route,
                entry.activity.clone(),
                permit,
                withdrawn,
            )
            .await
        }
    };
    if from_query {
        let max_age = claims.exp.saturating_sub(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        );
        let secure = if entry.settings.secure_cookies {
            "; Secure"
        } else {
            ""
        };
        let value = format!(
            "{COOKIE}={token}; Path={}/; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}",
            route.prefix()
        );
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().append(header::SET_COOKIE, value);
        }
    }
    response
}

/// An agent's entrypoint flags, for `#[command(flatten)]`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EntrypointArgs {
    /// Serve learners' way in (web terminals, proxied HTTP presentations) on this address.
    #[arg(
        long = "entrypoint-listen",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_LISTEN",
        value_name = "ADDR"
    )]
    pub entrypoint_listen: Option<SocketAddr>,
    /// The base URL learners reach the entrypoint at (told to the scheduler at handshake);
    /// default: http(s)://the bound address.
    #[arg(
        long = "entrypoint-url",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_URL",
        value_name = "URL"
    )]
    pub entrypoint_url: Option<String>,
    /// The entrypoint's certificate chain (PEM); with --entrypoint-tls-key it serves HTTPS.
    #[arg(
        long = "entrypoint-tls-cert",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_TLS_CERT",
        value_name = "PEM"
    )]
    pub entrypoint_tls_cert: Option<PathBuf>,
    /// The entrypoint's private key (PEM).
    #[arg(
        long = "entrypoint-tls-key",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_TLS_KEY",
        value_name = "PEM"
    )]
    pub entrypoint_tls_key: Option<PathBuf>,
    /// Serve the entrypoint in plaintext on an address other than loopback (behind a
    /// TLS-terminating load balancer or ingress only).
    #[arg(
        long = "entrypoint-insecure-plaintext",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_INSECURE_PLAINTEXT"
    )]
    pub entrypoint_insecure_plaintext: bool,
    /// A scheduler public key verifying tokens, `KID=PEM-FILE` (SPKI PEM); repeatable. The
    /// scheduler's handshake adds its own keys.
    #[arg(long = "entrypoint-key", value_name = "KID=PEM")]
    pub entrypoint_keys: Vec<String>,
    /// Connections one client address may hold at once.
    #[arg(long = "entrypoint-max-per-client", default_value_t = 32)]
    pub entrypoint_max_per_client: usize,
    /// How often learners' activity is reported (on the live lessons' states).
    #[arg(long = "entrypoint-activity-interval", value_parser = humantime::parse_duration, default_value = "5s")]
    pub entrypoint_activity_interval: Duration,
}

/// A bound entrypoint, ready to serve.
pub struct Bound {
    /// The socket.
    pub listener: TcpListener,
    /// TLS, when configured.
    pub tls: Option<ServerTls>,
    /// The base URL to announce.
    pub url: String,
    /// The key set (flags' keys loaded; the handshake adds more).
    pub keys: Arc<Keys>,
    /// Settings from the flags.
    pub settings: Settings,
}

impl EntrypointArgs {
    /// Binds the listener the flags ask for (`None`: no entrypoint), loading TLS and keys;
    /// plaintext off loopback only when asked.
    pub async fn bind(&self) -> Result<Option<Bound>, TlsError> {
        let Some(listen) = self.entrypoint_listen else {
            return Ok(None);
        };
        let tls = match (&self.entrypoint_tls_cert, &self.entrypoint_tls_key) {
            (Some(cert), Some(key)) => Some(ServerTls::load_web(cert.clone(), key.clone())?),
            (None, None) => None,
            _ => {
                return Err(TlsError::Flags(
                    "the entrypoint's TLS needs both --entrypoint-tls-cert and --entrypoint-tls-key"
                        .into(),
                ));
            }
        };
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|err| TlsError::Flags(format!("cannot listen on {listen}: {err}")))?;
        let local = listener
            .local_addr()
            .map_err(|err| TlsError::Flags(format!("entrypoint has no address: {err}")))?;
        if tls.is_none() && !local.ip().is_loopback() {
            if !self.entrypoint_insecure_plaintext {
                return Err(TlsError::Flags(format!(
                    "refusing to serve the entrypoint in plaintext on {local}: give \
                     --entrypoint-tls-cert and --entrypoint-tls-key, listen on loopback, or pass \
                     --entrypoint-insecure-plaintext behind a TLS-terminating proxy"
                )));
            }
            tracing::warn!(listen = %local, "entrypoint serves plaintext off loopback (--entrypoint-insecure-plaintext)");
        }
        let keys = Arc::new(Keys::default());
        for spec in &self.entrypoint_keys {
            let (kid, path) = spec.split_once('=').ok_or_else(|| {
                TlsError::Flags(format!("--entrypoint-key `{spec}` is not KID=PEM-FILE"))
            })?;
            let pem = std::fs::read(path).map_err(|source| TlsError::Read {
                path: path.into(),
                source,
            })?;
            keys.insert_pem(kid, &pem).map_err(|err| TlsError::File {
                path: path.into(),
                reason: err.to_string(),
            })?;
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = self
            .entrypoint_url
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{local}"))
            .trim_end_matches('/')
            .to_owned();
        Ok(Some(Bound {
            listener,
            settings: Settings {
                per_client: self.entrypoint_max_per_client.max(1),
                activity_interval: self.entrypoint_activity_interval,
                secure_cookies: tls.is_some(),
            },
            tls,
            url,
            keys,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let check = |path: &str, want: Option<(&str, &str, &str, &str)>| {
            let got = Route::parse(path);
            let got = got.as_ref().map(|r| {
                (
                    r.live_lesson.as_str(),
                    r.endpoint.as_str(),
                    r.presentation.as_str(),
                    r.rest.as_str(),
                )
            });
            assert_eq!(got, want, "{path}");
        };
        check("/l/a/b/c/", Some(("a", "b", "c", "/")));
        check("/l/a/b/c", Some(("a", "b", "c", "")));
        check("/l/a/b/c/x/y?z", Some(("a", "b", "c", "/x/y?z")));
        check("/l/a/b/c/terminal", Some(("a", "b", "c", "/terminal")));
        check("/l/a/b", None);
        check("/l//b/c/", None);
        check("/x/a/b/c/", None);
    }

    #[test]
    fn connection_caps() {
        let clients = Arc::new(Clients::default());
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let a = clients.admit(ip, 2).unwrap();
        let b = clients.admit(ip, 2).unwrap();
        assert!(clients.admit(ip, 2).is_none());
        assert!(clients.admit("10.0.0.2".parse().unwrap(), 2).is_some());
        let upgraded = a.clone();
        drop(a);
        assert!(clients.admit(ip, 2).is_none(), "an upgrade holds its place");
        drop(upgraded);
        assert!(clients.admit(ip, 2).is_some());
        drop(b);
    }
}
