//! HTTP presentations through the entrypoint: HTTP/1.1 to the backend over keep-alive
//! connections pooled per backend address ([`Backends`]: a few idle ones per address, closed
//! after [`IDLE`] unused, so a gone lesson's connections do not linger), the path below the
//! prefix forwarded, WebSocket (any) upgrades spliced, and the answer's `Location` and
//! `Set-Cookie` kept within the prefix.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, ReadBuf};
use tokio_util::sync::CancellationToken;

use super::frames::Frames;
use super::{Activity, Body, COOKIE, Credential, Inbound, Permit, Route, Source, reply};

/// How long an idle backend connection stays in the pool.
pub const IDLE: Duration = Duration::from_secs(15);
/// Idle connections kept per backend address.
const MAX_IDLE: usize = 32;
/// How long connecting to a backend may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Keep-alive HTTP/1.1 connections to presentations, pooled per backend address (a request
/// takes an idle one or opens one; a server that closes after each answer gets a new one each
/// time).
pub(super) struct Backends {
    client: Client<HttpConnector, Inbound>,
}

impl Default for Backends {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(IDLE)
            .pool_max_idle_per_host(MAX_IDLE)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Backends { client }
    }
}

/// Headers that belong to one hop (RFC 9110 7.6.1), never forwarded as such.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        && headers.contains_key(header::UPGRADE)
}

/// Removes hop-by-hop headers, those named by `Connection` included; an upgrade keeps its
/// `Connection: upgrade` and `Upgrade`.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    let kept = upgrade
        .then(|| headers.get(header::UPGRADE).cloned())
        .flatten();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    if let Some(kept) = kept {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, kept);
    }
}

/// The path and query the backend sees: the rest of the path, without our token parameter
/// (every pair [`super::token_param`] reads as one).
fn backend_target(route: &Route, query: Option<&str>) -> String {
    let query: Vec<&str> = query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty() && super::token_param(p).is_none())
        .collect();
    if query.is_empty() {
        route.rest.clone()
    } else {
        format!("{}?{}", route.rest, query.join("&"))
    }
}

/// The request's cookies without ours (every pair [`super::cookie_pairs`] names so); `None`
/// when none is left.
fn backend_cookies(headers: &HeaderMap) -> Option<String> {
    let kept: Vec<String> = super::cookie_pairs(headers)
        .filter(|(name, _)| *name != COOKIE)
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    (!kept.is_empty()).then(|| kept.join("; "))
}

/// Removes the `Authorization` header when it carried the credential the entrypoint used
/// (read by the same parser, [`super::bearer`]: any case of `Bearer`, any spacing): our token
/// is for us, never for the lesson's server. A header with another credential (the
/// presentation's own, when the token came in the query) is the presentation's.
fn strip_credential(headers: &mut HeaderMap, credential: &Credential) {
    let ours = credential.source == Source::Header
        || headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(super::bearer)
            .any(|token| token == credential.token);
    if ours {
        headers.remove(header::AUTHORIZATION);
    }
}

/// A `Location` the backend sent, as the learner must follow it: absolute paths and URLs of
/// the backend itself go under the prefix; relative references and other sites stay.
pub fn rewrite_location(location: &str, prefix: &str, backend: SocketAddr) -> String {
    if location.starts_with('/') && !location.starts_with("//") {
        return format!("{prefix}{location}");
    }
    for scheme in ["http://", "https://"] {
        if let Some(rest) = location.strip_prefix(scheme) {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let ours = authority == backend.to_string()
                || authority
                    .rsplit_once(':')
                    .is_some_and(|(_, port)| port == backend.port().to_string())
                    && backend.ip().is_loopback();
            if ours {
                let path = if path.is_empty() { "/" } else { path };
                return format!("{prefix}{path}");
            }
        }
    }
    location.to_owned()
}

/// A `Set-Cookie` kept within the prefix: its `Path` put under it (added when missing), its
/// `Domain` dropped (the cookie belongs to the entrypoint's host).
pub fn rewrite_set_cookie(value: &str, prefix: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut had_path = false;
    for (i, part) in value.split(';').enumerate() {
        let trimmed = part.trim();
        if i == 0 {
            parts.push(trimmed.to_owned());
            continue;
        }
        let (name, attr) = trimmed.split_once('=').unwrap_or((trimmed, ""));
        if name.eq_ignore_ascii_case("path") {
            had_path = true;
            let attr = if attr.starts_with('/') { attr } else { "/" };
            parts.push(format!("Path={prefix}{attr}"));
        } else if name.eq_ignore_ascii_case("domain") {
            continue;
        } else {
            parts.push(trimmed.to_owned());
        }
    }
    if !had_path {
        parts.push(format!("Path={prefix}/"));
    }
    parts.join("; ")
}

/// Forwards one request to the presentation at `backend`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn forward(
    backends: &Backends,
    mut request: Request<Inbound>,
    credential: &Credential,
    backend: SocketAddr,
    route: &Route,
    peer: SocketAddr,
    activity: Arc<Activity>,
    permit: Arc<Permit>,
    withdrawn: CancellationToken,
) -> Response<Body> {
    let upgrade = is_upgrade(request.headers());
    let websocket = request
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
    let prefix = route.prefix();
    let (parts, body) = request.into_parts();
    let mut headers = parts.headers.clone();
    let original_host = headers.get(header::HOST).cloned();
    strip_hop_by_hop(&mut headers, upgrade);
    headers.remove(header::COOKIE);
    if let Some(cookies) = backend_cookies(&parts.headers)
        && let Ok(value) = HeaderValue::from_str(&cookies)
    {
        headers.insert(header::COOKIE, value);
    }
    strip_credential(&mut headers, credential);
    if let Ok(host) = HeaderValue::from_str(&backend.to_string()) {
        headers.insert(header::HOST, host);
    }
    if let Some(host) = original_host {
        headers.insert("x-forwarded-host", host);
    }
    if let Ok(value) = HeaderValue::from_str(&prefix) {
        headers.insert("x-forwarded-prefix", value);
    }
    if let Ok(value) = HeaderValue::from_str(&peer.ip().to_string()) {
        headers.insert("x-forwarded-for", value);
    }
    let target = format!(
        "http://{backend}{}",
        backend_target(route, parts.uri.query())
    );
    let mut outgoing = Request::builder()
        .method(parts.method.clone())
        .uri(&target)
        .version(http::Version::HTTP_11)
        .body(body)
        .expect("a path from a parsed URI and a method from a parsed request build a request");
    *outgoing.headers_mut() = headers;

    let mut response = match backends.client.request(outgoing).await {
        Ok(response) => response,
        Err(err) if err.is_connect() => {
            tracing::debug!(%backend, error = %err, "presentation unreachable");
            return reply(
                StatusCode::BAD_GATEWAY,
                "the presentation does not answer (yet)",
            );
        }
        Err(err) if crate::BodyTimedOut::within(&err).is_some() => {
            tracing::debug!(%backend, %peer, "request body too slow; connection closed");
            let mut response = reply(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            );
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return response;
        }
        Err(err) => {
            tracing::debug!(%backend, error = %err, "presentation request failed");
            return reply(StatusCode::BAD_GATEWAY, "the presentation failed to answer");
        }
    };
    let switching = response.status() == StatusCode::SWITCHING_PROTOCOLS;
    if switching && let Some(client_upgrade) = client_upgrade {
        let backend_upgrade = hyper::upgrade::on(&mut response);
        let live_lesson = route.live_lesson.clone();
        let route_lesson = live_lesson.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let (client, server) = match tokio::join!(client_upgrade, backend_upgrade) {
                (Ok(client), Ok(server)) => (client, server),
                _ => return,
            };
            let (client_read, mut client_write) = tokio::io::split(TokioIo::new(client));
            let (mut server_read, mut server_write) = tokio::io::split(TokioIo::new(server));
            let mut client_read = Touching {
                inner: client_read,
                activity,
                live_lesson,
                frames: websocket.then(Frames::default),
            };
            let up = tokio::io::copy(&mut client_read, &mut server_write);
            let down = tokio::io::copy(&mut server_read, &mut client_write);
            // Either side ending ends the splice, and so does the admitting key's withdrawal.
            tokio::select! {
                _ = up => {}
                _ = down => {}
                () = withdrawn.cancelled() => {
                    tracing::info!(live_lesson = %route_lesson, "proxied upgrade ended: its token's key was withdrawn");
                }
            }
        });
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers, switching);
    if let Some(location) = parts
        .headers
        .get(header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(|l| rewrite_location(l, &prefix, backend))
        && let Ok(value) = HeaderValue::from_str(&location)
    {
        parts.headers.insert(header::LOCATION, value);
    }
    let cookies: Vec<HeaderValue> = parts
        .headers
        .get_all(header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| HeaderValue::from_str(&rewrite_set_cookie(v, &prefix)).ok())
        .collect();
    parts.headers.remove(header::SET_COOKIE);
    for cookie in cookies {
        parts.headers.append(header::SET_COOKIE, cookie);
    }
    Response::from_parts(parts, body.boxed())
}

/// A reader that marks its live lesson active when learner data arrives: for a WebSocket, its
/// data frames only ([`Frames`]: pongs, pings and closes are no activity); for another
/// upgrade, any bytes.
struct Touching<R> {
    inner: R,
    activity: Arc<Activity>,
    live_lesson: String,
    frames: Option<Frames>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Touching<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let read = &buf.filled()[before..];
        let active = match &mut this.frames {
            Some(frames) => frames.feed(read),
            None => !read.is_empty(),
        };
        if active {
            this.activity.touch(&this.live_lesson);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations() {
        let backend: SocketAddr = "127.0.0.1:32768".parse().unwrap();
        let check = |location: &str, want: &str| {
            assert_eq!(rewrite_location(location, "/l/a/b/c", backend), want);
        };
        check("/login", "/l/a/b/c/login");
        check("/", "/l/a/b/c/");
        check("next", "next");
        check("http://127.0.0.1:32768/x?y", "/l/a/b/c/x?y");
        check("http://127.0.0.1:32768", "/l/a/b/c/");
        check("http://localhost:32768/x", "/l/a/b/c/x");
        check("https://example.org/x", "https://example.org/x");
        check("//example.org/x", "//example.org/x");
    }

    #[test]
    fn set_cookies() {
        let check = |value: &str, want: &str| {
            assert_eq!(rewrite_set_cookie(value, "/l/a/b/c"), want);
        };
        check("s=1; Path=/", "s=1; Path=/l/a/b/c/");
        check(
            "s=1; path=/app; HttpOnly",
            "s=1; Path=/l/a/b/c/app; HttpOnly",
        );
        check("s=1", "s=1; Path=/l/a/b/c/");
        check(
            "s=1; Domain=example.org; Secure",
            "s=1; Secure; Path=/l/a/b/c/",
        );
    }

    #[test]
    fn forwarded_parts() {
        let route = Route::parse("/l/a/b/c/x").unwrap();
        assert_eq!(
            backend_target(&route, Some("antidote_token=ey.x.y&q=1")),
            "/x?q=1"
        );
        assert_eq!(backend_target(&route, Some("antidote_token=t")), "/x");
        assert_eq!(backend_target(&route, None), "/x");
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("antidote_entrypoint=t; app=1"),
        );
        assert_eq!(backend_cookies(&headers).as_deref(), Some("app=1"));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("antidote_entrypoint=t"),
        );
        assert_eq!(backend_cookies(&headers), None);
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static(" antidote_entrypoint=t ;app=1;  antidote_entrypoint=u"),
        );
        assert_eq!(backend_cookies(&headers).as_deref(), Some("app=1"));
    }

    #[test]
    fn the_credential_used_never_reaches_the_backend_however_it_is_spelt() {
        let used = |token: &str, source| Credential {
            token: token.to_owned(),
            source,
        };
        for value in [
            "Bearer ey.x.y",
            "Bearer  ey.x.y",
            "bearer ey.x.y",
            "BEARER\tey.x.y ",
            " Bearer ey.x.y",
        ] {
            let request = Request::builder()
                .uri("/l/a/b/c/x")
                .header(header::AUTHORIZATION, value)
                .body(())
                .unwrap();
            let found = super::super::find_token(&request).expect(value);
            assert_eq!(found, used("ey.x.y", Source::Header), "{value:?}");
            let mut headers = request.headers().clone();
            strip_credential(&mut headers, &found);
            assert!(headers.get(header::AUTHORIZATION).is_none(), "{value:?}");
        }
        // The token came in the query: the same token in the header goes too, another
        // credential (the presentation's own) stays.
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  t1"),
        );
        strip_credential(&mut headers, &used("t1", Source::Query));
        assert!(headers.get(header::AUTHORIZATION).is_none());
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer app"),
        );
        strip_credential(&mut headers, &used("t1", Source::Query));
        assert!(headers.get(header::AUTHORIZATION).is_some());
        // Not a bearer credential at all: nothing found.
        for value in ["Bearer", "Bearer   ", "Basic dTpw", "Bearerey.x.y"] {
            assert_eq!(super::super::bearer(value), None, "{value:?}");
        }
    }
}
