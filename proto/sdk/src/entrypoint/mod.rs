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
//! Learners' pages of different live lessons must not reach each other ([`origin`]). With an
//! origin per live lesson (`--entrypoint-url https://{live_lesson}.lab.example`) a request is
//! served only on its lesson's own host (else 403). With one origin for all (the path mode,
//! weaker) every proxied answer gets `Content-Security-Policy: sandbox ...` ([`SANDBOX`]), so a
//! page runs as an opaque origin. In both, a browser's terminal WebSocket must come from the
//! learner page's origin (`--entrypoint-learner-origin`), a proxied one from there or (per
//! lesson) the lesson's own origin: 403 otherwise.
//!
//! Every request needs a token the scheduler signed for exactly that live lesson, endpoint and
//! presentation ([`token`]): in the `antidote_token` query parameter (the URL the scheduler
//! hands out; for an HTTP presentation the entrypoint then sets a host-only cookie scoped to the
//! prefix so the page's own requests carry it; a terminal sets none), an `Authorization: Bearer`
//! header, or that cookie (only on requests the browser says are the page's own,
//! `Sec-Fetch-Site: same-origin`). No token, a bad or expired one: 401; a good token for
//! something else: 403. Neither a token's expiry nor its key leaving the
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

use antidote_net::accept::{self, Quota};

use super::tls::{ServerTls, TlsError};
pub use antidote_net::entrypoint::{
    Admitted, Claims, Keys, PLACEHOLDER, PREFIX, Signer, TOKEN_PARAM, Template, TokenError, origin,
    presentation_path, token,
};

/// The body of every response.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// The body of every request: due whole within [`Settings::request_timeout`] of its headers.
pub type Inbound = crate::BodyDeadline<Incoming>;

/// The cookie carrying a token after the first request.
pub const COOKIE: &str = "antidote_entrypoint";
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

    /// The scheduler instance that placed `live_lesson` (its spec's `antidote.io/instance`
    /// label): a token verified by another instance's key does not admit to it. `None`: not
    /// known, and any trusted key's token admits (the default, for agents that do not say).
    fn owner(&self, live_lesson: &str) -> Option<String> {
        let _ = live_lesson;
        None
    }
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
    /// Set the `Secure` attribute on the token cookie: the listener serves TLS, or learners
    /// reach it at an `https` URL (TLS ends at a proxy in front). Without it, a request gets
    /// `Secure` when a trusted proxy says it came over TLS (`X-Forwarded-Proto: https`).
    pub secure_cookies: bool,
    /// Longest a client may take to complete the TLS handshake, and then each request's
    /// headers (the silent-client and slowloris guards).
    pub header_read_timeout: Duration,
    /// Longest a request's body may take to arrive whole after its headers (the slow-body
    /// guard); a late one is a 408 and the end of the connection.
    pub request_timeout: Duration,
    /// Where learners reach the entrypoint (`--entrypoint-url`). With an origin per live
    /// lesson, a request is served only on its live lesson's own host and the cookie is
    /// partitioned, host-only and cross-site capable; otherwise (`None` too) every lesson
    /// shares one origin and proxied pages are sandboxed ([`SANDBOX`]).
    pub url: Option<Template>,
    /// The learner page's origins (`--entrypoint-learner-origin`): the only `Origin` a browser's
    /// terminal WebSocket (and, on a shared origin, any WebSocket) may come from. Empty: every
    /// browser's WebSocket is refused; clients that send no `Origin` (not browsers) are not.
    pub learner_origins: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            per_client: PER_CLIENT,
            trusted_proxies: Vec::new(),
            activity_interval: Duration::from_secs(5),
            secure_cookies: false,
            header_read_timeout: HEADER_READ_TIMEOUT,
            request_timeout: REQUEST_TIMEOUT,
            url: None,
            learner_origins: Vec::new(),
        }
    }
}

/// The policy every proxied answer gets when lessons share one origin: the page runs as an
/// opaque origin (no `allow-same-origin`), so its scripts can read neither another lesson's
/// presentations nor the entrypoint's cookies, whatever frame or tab it is opened in.
pub const SANDBOX: &str = "sandbox allow-scripts allow-forms allow-popups";

/// How long a client may take for its TLS handshake and each request's headers, by default
/// (`--entrypoint-header-read-timeout`).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a request's body may take after its headers, by default
/// (`--entrypoint-request-timeout`): generous, since a presentation may take uploads.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// Connections one client address may hold by default: the scheduler API's
/// `limits.connections_per_address`.
pub const PER_CLIENT: usize = 256;

/// What a client address counts as, as the scheduler's API counts it (`antidote_net`'s).
pub use antidote_net::accept::network;

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

/// Whether a trusted proxy says the request reached it over TLS: `X-Forwarded-Proto: https`
/// (its first entry: the proxy nearest the client) or `Forwarded: proto=https`.
fn forwarded_https(headers: &http::HeaderMap) -> bool {
    let says_https = |value: &str| value.trim().trim_matches('"').eq_ignore_ascii_case("https");
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').next().is_some_and(says_https))
        || headers
            .get(header::FORWARDED)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split([';', ','])
                    .filter_map(|pair| pair.trim().split_once('='))
                    .any(|(k, v)| k.eq_ignore_ascii_case("proto") && says_https(v))
            })
}

/// Connections per client network ([`network`]): the quota every listener of ours keeps.
#[derive(Debug)]
struct Clients {
    /// Open connections by network.
    quota: Quota<IpAddr>,
}

/// One connection's place; given back when the last clone (the connection, its upgrades) drops.
/// A trusted proxy's connection holds none (`place` unset): its requests take their clients'.
pub struct Permit {
    place: Option<accept::Permit<IpAddr>>,
}

impl Clients {
    /// At most `max` connections per client network.
    fn new(max: usize) -> Clients {
        Clients {
            quota: Quota::new(u32::try_from(max).unwrap_or(u32::MAX)),
        }
    }

    fn admit(&self, ip: IpAddr) -> Option<Arc<Permit>> {
        let place = self.quota.take(network(ip))?;
        Some(Arc::new(Permit { place: Some(place) }))
    }

    /// A place for a trusted proxy's connection: uncounted.
    fn proxy(&self) -> Arc<Permit> {
        Arc::new(Permit { place: None })
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
            clients: Arc::new(Clients::new(settings.per_client)),
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
    accept::each(&listener, &shutdown, |stream, peer| {
        let trusted = entry
            .settings
            .trusted_proxies
            .iter()
            .any(|p| p.contains(peer.ip()));
        let permit = if trusted {
            Some(entry.clients.proxy())
        } else {
            entry.clients.admit(peer.ip())
        };
        let Some(permit) = permit else {
            tracing::warn!(peer = %peer, "entrypoint: client at its connection cap; refused");
            return;
        };
        let (entry, tls, shutdown) = (entry.clone(), tls.clone(), shutdown.clone());
        tokio::spawn(async move {
            let (header_read_timeout, body_within) = (
                entry.settings.header_read_timeout,
                entry.settings.request_timeout,
            );
            let io: Box<dyn Io> = match tls {
                // A client that opens a connection and drips (or never sends) its TLS hello
                // is cut after the header timeout, as one that drips its headers is.
                Some(tls) => {
                    match tokio::time::timeout(header_read_timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => Box::new(stream),
                        Ok(Err(err)) => {
                            tracing::debug!(peer = %peer, error = %err, "entrypoint TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(peer = %peer, "entrypoint TLS handshake not done within the header timeout");
                            return;
                        }
                    }
                }
                None => Box::new(stream),
            };
            let service = hyper::service::service_fn({
                let permit = permit.clone();
                move |request: Request<Incoming>| {
                    let (entry, permit) = (entry.clone(), permit.clone());
                    let request =
                        request.map(|body| crate::BodyDeadline::new(body, body_within));
                    async move { Ok::<_, Infallible>(handle(entry, peer, permit, request).await) }
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
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
    })
    .await;
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

/// Where a request's token was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The `antidote_token` query parameter: the cookie is set on the answer.
    Query,
    /// The `Authorization: Bearer` header.
    Header,
    /// The `antidote_entrypoint` cookie.
    Cookie,
}

/// The token a request carries and where: the first of the query parameter, the bearer header
/// and the cookie. The proxy strips what this found with the same parsers ([`token_param`],
/// [`bearer`], [`cookie_pairs`]), so a credential the entrypoint accepted never reaches the
/// lesson's backend, however it was spelt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Credential {
    /// The token.
    pub token: String,
    /// Where it was.
    pub source: Source,
}

/// The value of an `antidote_token` query pair (`antidote_token=VALUE`), if `pair` is one.
pub(crate) fn token_param(pair: &str) -> Option<&str> {
    pair.strip_prefix(TOKEN_PARAM)?.strip_prefix('=')
}

/// The credential of an `Authorization` value of the Bearer scheme (RFC 9110 11.1: the scheme
/// in any case, then one or more spaces or tabs; the credential trimmed), if it is one.
pub(crate) fn bearer(value: &str) -> Option<&str> {
    let value = value.trim();
    let (scheme, credential) = value.split_once([' ', '\t'])?;
    let credential = credential.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !credential.is_empty()).then_some(credential)
}

/// Every `name=value` pair of the request's `Cookie` headers, trimmed.
pub(crate) fn cookie_pairs(headers: &http::HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
}

fn find_token<B>(request: &Request<B>) -> Option<Credential> {
    let found = |token: &str, source| {
        Some(Credential {
            token: token.to_owned(),
            source,
        })
    };
    if let Some(token) = request
        .uri()
        .query()
        .and_then(|query| query.split('&').find_map(token_param))
    {
        return found(token, Source::Query);
    }
    if let Some(token) = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
    {
        return found(token, Source::Header);
    }
    cookie(request.headers(), COOKIE).and_then(|token| found(&token, Source::Cookie))
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

/// Whether the browser says the request comes from the page's own origin, or from the
/// learner themselves (`Sec-Fetch-Site: same-origin` or `none`: typed, bookmarked); a request
/// without the header (not a browser, or an old one) is taken as such.
fn same_origin_request(headers: &http::HeaderMap) -> bool {
    headers
        .get("sec-fetch-site")
        .is_none_or(|site| matches!(site.as_bytes(), b"same-origin" | b"none"))
}

/// Whether a WebSocket's opening may go on. Browsers always name the page that opens one
/// (`Origin`): a terminal's must be the learner page's (`--entrypoint-learner-origin`); a
/// proxied WebSocket's the learner page's or, with an origin per live lesson, that lesson's
/// own. A request that is no WebSocket opening, or names no origin (not a browser: it holds
/// its own token and no page can make it send one), goes on. The error says why not.
fn websocket_origin<B>(
    settings: &Settings,
    request: &Request<B>,
    route: &Route,
    terminal: bool,
) -> Result<(), String> {
    let upgrade = request
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("websocket"));
    let Some(origin) = request.headers().get(header::ORIGIN) else {
        return Ok(());
    };
    if !upgrade {
        return Ok(());
    }
    let origin = origin.to_str().unwrap_or("?").trim().to_ascii_lowercase();
    if settings.learner_origins.contains(&origin) {
        return Ok(());
    }
    let own = settings
        .url
        .as_ref()
        .filter(|url| url.per_lesson())
        .map(|url| url.origin(&route.live_lesson));
    if !terminal && own.as_deref() == Some(origin.as_str()) {
        return Ok(());
    }
    Err(format!(
        "a WebSocket from origin `{origin}` is refused: {} (--entrypoint-learner-origin)",
        if settings.learner_origins.is_empty() {
            "this entrypoint names no learner page origin".to_owned()
        } else {
            format!(
                "only the learner page ({}) may open one",
                settings.learner_origins.join(", ")
            )
        }
    ))
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie(headers: &http::HeaderMap, name: &str) -> Option<String> {
    cookie_pairs(headers)
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

async fn handle(
    entry: Arc<Entrypoint>,
    peer: SocketAddr,
    permit: Arc<Permit>,
    request: Request<Inbound>,
) -> Response<Body> {
    // Through a trusted proxy: the client its X-Forwarded-For names (else the proxy itself)
    // is the peer, and this request (with its upgrade) takes one of the client's places.
    let via_trusted_proxy = permit.place.is_none();
    let (peer, permit) = if via_trusted_proxy {
        let client = forwarded_client(request.headers()).unwrap_or(peer.ip());
        match entry.clients.admit(client) {
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
    // An origin per live lesson: a presentation is served on its own lesson's host only, so
    // a page of one lesson cannot reach another's presentations as same-origin requests.
    let per_lesson = entry.settings.url.as_ref().filter(|url| url.per_lesson());
    if let Some(url) = per_lesson {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .or(request.uri().host())
            .unwrap_or_default();
        if !url
            .lesson_of_host(host)
            .is_some_and(|lesson| lesson.eq_ignore_ascii_case(&route.live_lesson))
        {
            return reply(
                StatusCode::FORBIDDEN,
                &format!(
                    "live lesson {} is served at its own origin, {}, not on host `{host}`",
                    route.live_lesson,
                    url.origin(&route.live_lesson)
                ),
            );
        }
    }
    let Some(credential) = find_token(&request) else {
        return reply(StatusCode::UNAUTHORIZED, "a token is required");
    };
    // The cookie admits the presentation's own page only: a request another site (or another
    // lesson's origin, the same site) made the browser send is refused, whatever it carries.
    if credential.source == Source::Cookie && !same_origin_request(request.headers()) {
        return reply(
            StatusCode::FORBIDDEN,
            "the entrypoint's cookie admits only the presentation's own requests: open it from the learner page",
        );
    }
    let from_query = credential.source == Source::Query;
    // `Secure` when learners reach us over TLS: ours, an https URL, or a trusted proxy's.
    let secure_cookie =
        entry.settings.secure_cookies || via_trusted_proxy && forwarded_https(request.headers());
    let (claims, withdrawn, instance) = match entry.verified.admit(&entry.keys, &credential.token) {
        Ok(admitted) => (admitted.claims, admitted.withdrawn, admitted.instance),
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
    // Keys are bound to their scheduler instance: one instance's key (a stranger's Handshake
    // under an invented instance id, say) admits only to the live lessons that instance placed.
    if let Some(instance) = &instance
        && let Some(owner) = entry.lessons.owner(&route.live_lesson)
        && *instance != owner
    {
        tracing::warn!(live_lesson = %route.live_lesson, scheduler_instance = %instance, owner = %owner, "entrypoint refused a token of another scheduler instance's key");
        return reply(
            StatusCode::FORBIDDEN,
            "the token's scheduler instance did not place this live lesson",
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
    let terminal = matches!(target.kind, Kind::Ssh { .. });
    if let Err(refusal) = websocket_origin(&entry.settings, &request, &route, terminal) {
        tracing::warn!(live_lesson = %route.live_lesson, peer = %peer, "entrypoint refused a WebSocket: {refusal}");
        return reply(StatusCode::FORBIDDEN, &refusal);
    }
    if learners_doing(&request) {
        entry.activity.touch(&route.live_lesson);
    }
    let mut response = match target.kind {
        Kind::Http => {
            proxy::forward(
                &entry.backends,
                request,
                &credential,
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
    if per_lesson.is_none() && !terminal {
        // One origin for every lesson: the page runs sandboxed, as an opaque origin.
        response.headers_mut().append(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(SANDBOX),
        );
    }
    // A terminal sets no cookie: the learner page opens every terminal with a fresh token.
    if from_query && !terminal {
        let max_age = claims.exp.saturating_sub(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        );
        // Per lesson, the cookie is host-only (no Domain) on the lesson's own host, and must
        // reach the lesson's page framed by a learner page of another site (the quickstart's
        // `localhost`): partitioned by that top-level site (CHIPS), which needs `SameSite=None`
        // and `Secure` (kept on https and on `localhost` names, the only per-lesson URLs
        // allowed). Other sites' requests are refused above (`Sec-Fetch-Site`). One origin
        // for every lesson: strict, and the sandboxed page's requests carry no cookie at all.
        let attributes = if per_lesson.is_some() {
            "SameSite=None; Secure; Partitioned"
        } else if secure_cookie {
            "SameSite=Strict; Secure"
        } else {
            "SameSite=Strict"
        };
        let value = format!(
            "{COOKIE}={}; Path={}/; Max-Age={max_age}; HttpOnly; {attributes}",
            credential.token,
            route.prefix()
        );
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().append(header::SET_COOKIE, value);
        }
    }
    response
}

/// An agent's entrypoint flags, for `#[command(flatten)]`.
#[derive(Debug, Clone, clap::Args)]
pub struct EntrypointArgs {
    /// Serve learners' way in (web terminals, proxied HTTP presentations) on this address.
    #[arg(
        long = "entrypoint-listen",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_LISTEN",
        value_name = "ADDR"
    )]
    pub entrypoint_listen: Option<SocketAddr>,
    /// The URL learners reach the entrypoint at (told to the scheduler at handshake), best
    /// with an origin per live lesson: `https://{live_lesson}.lab.example` (a wildcard DNS
    /// name and certificate; `http://{live_lesson}.localhost:PORT` needs neither). Without
    /// the placeholder every lesson shares one origin (weaker: pages are sandboxed). Default:
    /// http(s)://the bound address.
    #[arg(
        long = "entrypoint-url",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_URL",
        value_name = "URL"
    )]
    pub entrypoint_url: Option<String>,
    /// The learner page's origin (`https://learn.example`, the scheduler's page as browsers
    /// reach it): the only origin a browser may open a terminal from (and, on a shared
    /// origin, any WebSocket); repeatable (the variable: comma-separated). Unset: browsers'
    /// WebSockets are refused.
    #[arg(
        long = "entrypoint-learner-origin",
        env = "ANTIDOTE_AGENT_ENTRYPOINT_LEARNER_ORIGINS",
        value_delimiter = ',',
        value_name = "ORIGIN"
    )]
    pub entrypoint_learner_origins: Vec<String>,
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
    /// Longest a client may take for its TLS handshake and then each request's headers.
    #[arg(long = "entrypoint-header-read-timeout", value_parser = humantime::parse_duration, default_value = "30s")]
    pub entrypoint_header_read_timeout: Duration,
    /// Longest a request's body may take to arrive whole after its headers (a late one is a
    /// 408); generous by default, for uploads to a presentation.
    #[arg(long = "entrypoint-request-timeout", value_parser = humantime::parse_duration, default_value = "5m")]
    pub entrypoint_request_timeout: Duration,
    /// The longest a token may still have to live when it is presented (its `exp` from now,
    /// and from its `iat`): a token signed to live longer is refused. At least twice the
    /// scheduler's `[entrypoint] token_ttl` (10m by default, at most 12h).
    #[arg(long = "entrypoint-max-token-lifetime", value_parser = humantime::parse_duration, default_value = "24h")]
    pub entrypoint_max_token_lifetime: Duration,
}

impl Default for EntrypointArgs {
    /// No entrypoint; every other flag at its command-line default.
    fn default() -> Self {
        EntrypointArgs {
            entrypoint_listen: None,
            entrypoint_url: None,
            entrypoint_learner_origins: Vec::new(),
            entrypoint_tls_cert: None,
            entrypoint_tls_key: None,
            entrypoint_insecure_plaintext: false,
            entrypoint_keys: Vec::new(),
            entrypoint_max_per_client: PER_CLIENT,
            entrypoint_trusted_proxies: Vec::new(),
            entrypoint_activity_interval: Duration::from_secs(5),
            entrypoint_header_read_timeout: HEADER_READ_TIMEOUT,
            entrypoint_request_timeout: REQUEST_TIMEOUT,
            entrypoint_max_token_lifetime: token::MAX_LIFETIME,
        }
    }
}

/// A bound entrypoint, ready to serve.
pub struct Bound {
    /// The socket.
    pub listener: TcpListener,
    /// TLS, when configured.
    pub tls: Option<ServerTls>,
    /// The URL to announce (with [`PLACEHOLDER`] when each live lesson has its own origin).
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
        let keys = Arc::new(Keys::with_max_lifetime(self.entrypoint_max_token_lifetime));
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
        let learner_origins = self
            .entrypoint_learner_origins
            .iter()
            .map(|o| {
                origin::parse_origin(o)
                    .map_err(|err| TlsError::Flags(format!("--entrypoint-learner-origin {err}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if learner_origins.is_empty() {
            tracing::warn!(
                "no --entrypoint-learner-origin: browsers' terminals (WebSockets) are refused"
            );
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = Template::parse(
            &self
                .entrypoint_url
                .clone()
                .unwrap_or_else(|| format!("{scheme}://{local}")),
        )
        .map_err(|err| TlsError::Flags(format!("--entrypoint-url: {err}")))?;
        if !url.per_lesson() {
            tracing::warn!(url = %url.as_str(), "the entrypoint serves every live lesson from one origin (no {PLACEHOLDER} in --entrypoint-url): pages are sandboxed, an origin per lesson is stronger");
        }
        // Learners reach an https URL over TLS, whoever ends it (a proxy in front of a
        // plaintext entrypoint, the documented Kubernetes setup): the cookie is then `Secure`.
        let https_url = url.https();
        Ok(Some(Bound {
            listener,
            settings: Settings {
                per_client: self.entrypoint_max_per_client.max(1),
                trusted_proxies,
                activity_interval: self.entrypoint_activity_interval,
                secure_cookies: tls.is_some() || https_url,
                header_read_timeout: self.entrypoint_header_read_timeout,
                request_timeout: self.entrypoint_request_timeout,
                url: Some(url.clone()),
                learner_origins,
            },
            tls,
            url: url.as_str().to_owned(),
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
        let clients = Clients::new(2);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let a = clients.admit(ip).unwrap();
        let b = clients.admit(ip).unwrap();
        assert!(clients.admit(ip).is_none());
        assert!(clients.admit("10.0.0.2".parse().unwrap()).is_some());
        let upgraded = a.clone();
        drop(a);
        assert!(clients.admit(ip).is_none(), "an upgrade holds its place");
        drop(upgraded);
        assert!(clients.admit(ip).is_some());
        drop(b);

        // An IPv6 client is its /64, as the API counts it; an IPv4-mapped one its IPv4.
        let v6 = |s: &str| s.parse::<IpAddr>().unwrap();
        let c = clients.admit(v6("2001:db8:1:2::1")).unwrap();
        let d = clients.admit(v6("2001:db8:1:2:ffff::9")).unwrap();
        assert!(clients.admit(v6("2001:db8:1:2::77")).is_none());
        assert!(clients.admit(v6("2001:db8:1:3::1")).is_some());
        assert_eq!(network(v6("::ffff:10.0.0.1")), ip);
        // A trusted proxy's connection holds no place.
        let proxied = clients.proxy();
        drop((c, d, proxied));
        assert_eq!(clients.quota.held(&network(ip)), 0);
        assert_eq!(clients.quota.held(&network(v6("2001:db8:1:2::1"))), 0);
    }

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        entrypoint: EntrypointArgs,
    }

    #[tokio::test]
    async fn an_https_url_makes_the_cookie_secure_and_defaults_match_the_flags() {
        use clap::Parser as _;
        let parsed = |args: &[&str]| Flags::parse_from(["agent"].iter().chain(args)).entrypoint;
        let defaults = parsed(&[]);
        let manual = EntrypointArgs::default();
        assert_eq!(format!("{defaults:?}"), format!("{manual:?}"));
        let bind = |args: &[&str]| {
            let mut args: Vec<&str> = args.to_vec();
            args.extend(["--entrypoint-listen", "127.0.0.1:0"]);
            let flags = parsed(&args);
            async move { flags.bind().await.unwrap().unwrap().settings }
        };
        assert!(!bind(&[]).await.secure_cookies, "plain http on loopback");
        assert!(
            bind(&["--entrypoint-url", "HTTPS://lab.example:8443"])
                .await
                .secure_cookies,
            "TLS ends in front of the entrypoint"
        );
        let mut headers = http::HeaderMap::new();
        assert!(!forwarded_https(&headers));
        headers.insert("x-forwarded-proto", "https, http".parse().unwrap());
        assert!(forwarded_https(&headers));
        headers.insert("x-forwarded-proto", "http".parse().unwrap());
        assert!(!forwarded_https(&headers));
        headers.insert(
            header::FORWARDED,
            "for=1.2.3.4;proto=\"https\"".parse().unwrap(),
        );
        assert!(forwarded_https(&headers));
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
