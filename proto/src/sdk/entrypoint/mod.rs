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
//! 401; a good token for something else: 403. Neither a token's expiry nor its key leaving the
//! key set (retired) ends what it admitted; its key's revocation does (terminals and proxied
//! WebSockets close with 1008, see [`token::Keys`]). Each client (an address, an IPv6 /64;
//! behind a trusted proxy the client `X-Forwarded-For` names) holds at most
//! [`Settings::per_client`] connections (upgraded ones included). Learners' requests and
//! bytes (keystrokes, WebSocket data frames; never pongs, pings or closes: [`frames`]) mark the
//! live lesson active; the marks are handed to [`Lessons::active`] in batches.
//!
//! An agent implements [`Lessons`] (the SDK's [`super::Agent`] does, from its specs and
//! reported states) and calls [`serve`]; [`EntrypointArgs`] are the flags.

pub mod frames;
pub mod proxy;
pub mod terminal;
pub mod token;
mod verified;

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
    /// Connections one client address (its [`network`]: an IPv6 /64) may hold at once
    /// (upgraded ones included); for connections from [`Settings::trusted_proxies`], requests
    /// in flight (WebSockets included) of the client `X-Forwarded-For` names.
    pub per_client: usize,
    /// Proxies (an ingress, a load balancer) whose `X-Forwarded-For` names the client: their
    /// connections are not capped as one client's; each request counts against the client the
    /// header's last entry (the one the proxy added) names. Empty: the header is ignored.
    pub trusted_proxies: Vec<Cidr>,
    /// How often activity is handed to [`Lessons::active`].
    pub activity_interval: Duration,
    /// Set the `Secure` attribute on the token cookie (the listener serves TLS).
    pub secure_cookies: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            per_client: PER_CLIENT,
            trusted_proxies: Vec::new(),
            activity_interval: Duration::from_secs(5),
            secure_cookies: false,
        }
    }
}

/// Connections one client address may hold by default: the scheduler API's
/// `limits.connections_per_address`.
pub const PER_CLIENT: usize = 256;

/// What a client address counts as, as the scheduler's API counts it: an IPv4 address itself
/// (an IPv4-mapped IPv6 one as that IPv4 address), an IPv6 address its /64 (one subscriber's
/// allocation; any address in it is the same client).
pub fn network(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !u128::from(u64::MAX),
            )),
        },
    }
}

/// An address block, `10.0.0.0/8` or a single address (`--entrypoint-trusted-proxy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Cidr, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("`{text}` is not an address or ADDRESS/PREFIX"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("`{text}`: the prefix must be 0 to {max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl Cidr {
    /// Whether `ip` is in the block (an IPv4-mapped IPv6 address as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            IpAddr::V4(_) => ip,
        };
        match (self.addr, ip) {
            (IpAddr::V4(block), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(block) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(block), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(block) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// The client a trusted proxy names in `X-Forwarded-For`: the last entry, the one the proxy
/// added (earlier ones come from the client and could be anything). `None`: no header, or not
/// an address.
fn forwarded_client(headers: &http::HeaderMap) -> Option<IpAddr> {
    let last = headers
        .get_all("x-forwarded-for")
        .iter()
        .next_back()?
        .to_str()
        .ok()?
        .rsplit(',')
        .next()?
        .trim();
    last.parse().ok()
}

/// Connections per client network ([`network`]).
#[derive(Debug, Default)]
struct Clients {
    /// Open connections by network.
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place; given back when the last clone (the connection, its upgrades) drops.
/// A trusted proxy's connection holds none (`ip` unset): its requests take their clients'.
pub struct Permit {
    clients: Arc<Clients>,
    ip: Option<IpAddr>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(ip) = self.ip else {
            return;
        };
        let mut held = self.clients.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&ip);
            }
        }
    }
}

impl Clients {
    fn admit(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<Arc<Permit>> {
        let ip = network(ip);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Arc::new(Permit {
            clients: self.clone(),
            ip: Some(ip),
        }))
    }

    /// A place for a trusted proxy's connection: uncounted.
    fn proxy(self: &Arc<Self>) -> Arc<Permit> {
        Arc::new(Permit {
            clients: self.clone(),
            ip: None,
        })
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
    /// Tokens verified lately.
    verified: verified::Verified,
    /// Pooled connections to HTTP presentations.
    backends: proxy::Backends,
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
            verified: verified::Verified::default(),
            backends: proxy::Backends::default(),
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
        let trusted = entry
            .settings
            .trusted_proxies
            .iter()
            .any(|p| p.contains(peer.ip()));
        let permit = if trusted {
            Some(entry.clients.proxy())
        } else {
            entry.clients.admit(peer.ip(), entry.settings.per_client)
        };
        let Some(permit) = permit else {
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

/// Whether a request is the learner's own doing, so it marks the live lesson active (PROTOCOL.md,
/// "Activity"). Browsers say how each request was made (Fetch Metadata, `Sec-Fetch-Mode`): a
/// navigation (a link followed, a form sent, a reload) or a request that changes something (any
/// method but GET, HEAD and OPTIONS) is the learner's; a page script's GET (`cors`,
/// `same-origin`, `no-cors`: polling, auto-refresh, the assets of a page already counted) is
/// not, so an open tab that polls its server keeps nothing alive. A WebSocket's opening is not
/// either (a page reconnects on its own): its data frames from the learner are. A request
/// without the header (not a browser) counts.
fn learners_doing<B>(request: &Request<B>) -> bool {
    let Some(mode) = request.headers().get("sec-fetch-mode") else {
        return true;
    };
    match mode.as_bytes() {
        b"navigate" => true,
        b"websocket" => false,
        _ => !matches!(
            *request.method(),
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        ),
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
    // Through a trusted proxy: the client its X-Forwarded-For names (else the proxy itself)
    // is the peer, and this request (with its upgrade) takes one of the client's places.
    let (peer, permit) = if permit.ip.is_none() {
        let client = forwarded_client(request.headers()).unwrap_or(peer.ip());
        match entry.clients.admit(client, entry.settings.per_client) {
            Some(permit) => (SocketAddr::new(client, peer.port()), permit),
            None => {
                tracing::warn!(client = %client, proxy = %peer, "entrypoint: client at its connection cap; refused");
                return reply(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many connections from your address",
                );
            }
        }
    } else {
        (peer, permit)
    };
    let Some(route) = Route::parse(request.uri().path()) else {
        return reply(StatusCode::NOT_FOUND, "not a presentation");
    };
    let (token, from_query) = match find_token(&request) {
        Found::Query(token) => (token, true),
        Found::Held(token) => (token, false),
        Found::None => return reply(StatusCode::UNAUTHORIZED, "a token is required"),
    };
    let (claims, withdrawn) = match entry.verified.admit(&entry.keys, &token) {
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
    if learners_doing(&request) {
        entry.activity.touch(&route.live_lesson);
    }
    let mut response = match target.kind {
        Kind::Http => {
            proxy::forward(
                &entry.backends,
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
    /// Connections one client address (an IPv6 /64) may hold at once: the scheduler API's
    /// `limits.connections_per_address` by default.
    #[arg(long = "entrypoint-max-per-client", default_value_t = PER_CLIENT)]
    pub entrypoint_max_per_client: usize,
    /// A proxy (ingress, load balancer) whose `X-Forwarded-For` names the client, as
    /// ADDRESS or ADDRESS/PREFIX; repeatable (the variable: comma-separated). Unset: the header
    /// is ignored and each connection counts against its peer's address.
    #[arg(
        long = "entrypoint-trusted-proxy",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_TRUSTED_PROXIES",
        value_delimiter = ',',
        value_name = "CIDR"
    )]
    pub entrypoint_trusted_proxies: Vec<String>,
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
        let trusted_proxies = self
            .entrypoint_trusted_proxies
            .iter()
            .map(|p| {
                p.parse::<Cidr>()
                    .map_err(|err| TlsError::Flags(format!("--entrypoint-trusted-proxy {err}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
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
                trusted_proxies,
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
    fn only_what_the_learner_does_is_activity() {
        let request = |method: &str, mode: Option<&str>| {
            let mut builder = Request::builder().method(method).uri("/l/a/b/c/");
            if let Some(mode) = mode {
                builder = builder.header("sec-fetch-mode", mode);
            }
            builder.body(()).unwrap()
        };
        // Navigations, changes and requests from outside a browser count.
        assert!(learners_doing(&request("GET", Some("navigate"))));
        assert!(learners_doing(&request("POST", Some("cors"))));
        assert!(learners_doing(&request("PUT", Some("same-origin"))));
        assert!(learners_doing(&request("GET", None)));
        // A page's own reads (polling, assets) and a WebSocket's opening do not.
        assert!(!learners_doing(&request("GET", Some("cors"))));
        assert!(!learners_doing(&request("GET", Some("same-origin"))));
        assert!(!learners_doing(&request("GET", Some("no-cors"))));
        assert!(!learners_doing(&request("HEAD", Some("cors"))));
        assert!(!learners_doing(&request("GET", Some("websocket"))));
    }

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

        // An IPv6 client is its /64, as the API counts it; an IPv4-mapped one its IPv4.
        let v6 = |s: &str| s.parse::<IpAddr>().unwrap();
        let c = clients.admit(v6("2001:db8:1:2::1"), 2).unwrap();
        let d = clients.admit(v6("2001:db8:1:2:ffff::9"), 2).unwrap();
        assert!(clients.admit(v6("2001:db8:1:2::77"), 2).is_none());
        assert!(clients.admit(v6("2001:db8:1:3::1"), 2).is_some());
        assert_eq!(network(v6("::ffff:10.0.0.1")), ip);
        // A trusted proxy's connection holds no place.
        let proxied = clients.proxy();
        drop((c, d, proxied));
        assert!(clients.held.lock().unwrap().is_empty());
    }

    #[test]
    fn trusted_proxies_and_forwarded_clients() {
        let block: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(block.contains("10.1.200.3".parse().unwrap()));
        assert!(block.contains("::ffff:10.1.0.1".parse().unwrap()));
        assert!(!block.contains("10.2.0.1".parse().unwrap()));
        let one: Cidr = "fd00::1".parse().unwrap();
        assert!(one.contains("fd00::1".parse().unwrap()));
        assert!(!one.contains("fd00::2".parse().unwrap()));
        assert!(
            "0.0.0.0/0"
                .parse::<Cidr>()
                .unwrap()
                .contains("8.8.8.8".parse().unwrap())
        );
        for bad in ["10.0.0.0/33", "ingress", "10.0.0.0/x"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        let mut headers = http::HeaderMap::new();
        assert_eq!(forwarded_client(&headers), None);
        headers.insert(
            "x-forwarded-for",
            "6.6.6.6, 198.51.100.2 , 203.0.113.7".parse().unwrap(),
        );
        assert_eq!(
            forwarded_client(&headers),
            Some("203.0.113.7".parse().unwrap()),
            "a spoofed first entry is ignored"
        );
        headers.insert("x-forwarded-for", "not-an-address".parse().unwrap());
        assert_eq!(forwarded_client(&headers), None);
    }
}
