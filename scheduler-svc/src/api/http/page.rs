//! The learner page, on the learners' HTTP listener: `/learn/` (and `/` redirecting there).
//!
//! Plain HTML, CSS and JavaScript of our own (`scheduler-svc/web/src/`, embedded at compile
//! time) over the JSON API of this same listener, plus the libraries `scheduler-svc/web/build`
//! takes from npm (xterm.js and its fit addon, marked, DOMPurify), embedded by `build.rs` when
//! they were built and otherwise missing: the page then says which command builds them.
//!
//! Guides are curriculum HTML/Markdown shown on the origin whose cookie holds learners' session
//! tokens, so every answer carries a strict Content-Security-Policy: scripts only from this
//! origin (no inline script, no `eval`), styles from this origin or carrying the answer's nonce
//! (xterm.js's DOM renderer makes `<style>` elements; `app.js` stamps them with the nonce before
//! insertion), connections and frames only to this origin and the agents' entrypoints (their
//! configured `[entrypoint] urls` and what their handshakes said, read on every page load), no
//! framing of the page itself. The page also sanitises every guide with DOMPurify.

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

use crate::api::Api;

mod assets {
    include!(concat!(env!("OUT_DIR"), "/web_assets.rs"));
}

/// The page itself; `{{nonce}}` is replaced by each answer's style nonce and `{{assets}}` by
/// the notice shown when the libraries were not built.
const INDEX: &str = include_str!("../../../web/src/index.html");
const APP_JS: &str = include_str!("../../../web/src/app.js");
const STYLE_CSS: &str = include_str!("../../../web/src/style.css");

/// Where the page lives.
pub const PATH: &str = "/learn/";

/// The notice in place of the page's work when the libraries are missing.
const MISSING: &str = "This scheduler was built without the learner page's libraries \
(xterm.js, marked, DOMPurify). Build them with <code>scheduler-svc/web/build</code> (npm), \
then build scheduler-svc again.";

/// The page's routes, for the learners' listener.
pub fn routes(router: axum::Router<Api>) -> axum::Router<Api> {
    router
        .route("/", get(|| async { Redirect::to(PATH) }))
        .route("/learn", get(|| async { Redirect::permanent(PATH) }))
        .route(PATH, get(index))
        .route(
            "/learn/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS.as_bytes()) }),
        )
        .route(
            "/learn/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE_CSS.as_bytes()) }),
        )
        .route("/learn/vendor/{name}", get(vendor))
}

async fn index(State(api): State<Api>) -> Response {
    let nonce = nonce();
    let notice = if assets::COMPLETE { "" } else { MISSING };
    let body = INDEX
        .replace("{{nonce}}", &nonce)
        .replace("{{assets}}", notice);
    let mut response = (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The nonce is per answer.
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response();
    secure(&mut response, &policy(&entrypoint_origins(&api), &nonce));
    response
}

async fn vendor(State(api): State<Api>, Path(name): Path<String>) -> Response {
    let Some((_, bytes)) = assets::VENDOR.iter().find(|(n, _)| *n == name) else {
        let mut response = (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "no such file: the page's libraries are built by scheduler-svc/web/build\n",
        )
            .into_response();
        secure(&mut response, &policy(&entrypoint_origins(&api), ""));
        return response;
    };
    let kind = if name.ends_with(".css") {
        "text/css; charset=utf-8"
    } else if name.ends_with(".js") {
        "text/javascript; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    asset(kind, bytes)
}

/// A static file: its type, revalidated on every use (the binary may change under the same
/// name), and the same headers as the page.
fn asset(kind: &'static str, bytes: &'static [u8]) -> Response {
    let mut response = (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        bytes,
    )
        .into_response();
    secure(&mut response, "default-src 'none'; frame-ancestors 'none'");
    response
}

/// The headers every answer of the page carries.
fn secure(response: &mut Response, policy: &str) {
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(policy) {
        headers.insert(header::CONTENT_SECURITY_POLICY, value);
    }
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Entrypoint URLs carry tokens; no address of the page needs to travel anywhere.
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

/// The page's Content-Security-Policy, given the entrypoints' origins and the answer's style
/// nonce.
pub fn policy(origins: &[String], nonce: &str) -> String {
    let mut connect = vec!["'self'".to_owned()];
    let mut frames = Vec::new();
    for origin in origins {
        connect.push(origin.clone());
        frames.push(origin.clone());
        // WebSocket terminals: CSP matches schemes exactly for other hosts.
        if let Some(rest) = origin.strip_prefix("https://") {
            connect.push(format!("wss://{rest}"));
        } else if let Some(rest) = origin.strip_prefix("http://") {
            connect.push(format!("ws://{rest}"));
        }
    }
    let frames = if frames.is_empty() {
        "'none'".to_owned()
    } else {
        frames.join(" ")
    };
    let style = if nonce.is_empty() {
        "'self'".to_owned()
    } else {
        format!("'self' 'nonce-{nonce}'")
    };
    format!(
        "default-src 'none'; script-src 'self'; style-src {style}; img-src 'self' data:; \
         font-src 'self'; connect-src {}; frame-src {frames}; frame-ancestors 'none'; \
         base-uri 'none'; form-action 'none'; object-src 'none'",
        connect.join(" ")
    )
}

/// The origins of every entrypoint learners may be sent to: the configured ones and what the
/// agents' handshakes said (every live lesson's, `scheme://*.domain`, for a URL with an origin
/// per lesson).
fn entrypoint_origins(api: &Api) -> Vec<String> {
    let mut origins: Vec<String> = api
        .config
        .entrypoint
        .urls
        .values()
        .cloned()
        .chain(api.fleet.agents().iter().map(|a| a.entrypoint_url()))
        .filter_map(|url| crate::entrypoint::per_lesson_source(&url).or_else(|| origin(&url)))
        .collect();
    origins.sort();
    origins.dedup();
    origins
}

/// `scheme://host[:port]` of an http(s) URL; `None` for anything else, or for a host with
/// characters that have no place in a policy (`;`, spaces, quotes).
pub fn origin(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "http" && scheme != "https" {
        return None;
    }
    let authority = rest.split(['/', '?', '#']).next()?;
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let fine = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    fine.then(|| format!("{scheme}://{}", host.to_ascii_lowercase()))
}

/// 128 random bits, hex.
fn nonce() -> String {
    let mut bytes = [0u8; 16];
    // The OS's random source does not fail on the platforms we run on; were it to, a fixed
    // nonce would still only admit styles, never scripts.
    if getrandom::fill(&mut bytes).is_err() {
        tracing::warn!("no randomness for the page's style nonce");
    }
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_scheme_and_authority_only() {
        assert_eq!(
            origin("http://127.0.0.1:4000/l/x").as_deref(),
            Some("http://127.0.0.1:4000")
        );
        assert_eq!(
            origin("HTTPS://Lab.Example:8443").as_deref(),
            Some("https://lab.example:8443")
        );
        assert_eq!(
            origin("https://[::1]:9/?q").as_deref(),
            Some("https://[::1]:9")
        );
        assert_eq!(origin("ftp://x"), None);
        assert_eq!(origin("http://a b"), None);
        assert_eq!(origin("http://x;script-src *"), None);
        assert_eq!(origin(""), None);
    }

    #[test]
    fn the_policy_admits_scripts_from_the_page_only_and_entrypoints_for_connections() {
        let policy = policy(
            &["http://127.0.0.1:4000".into(), "https://lab.example".into()],
            "abc",
        );
        assert!(policy.contains("script-src 'self';"), "{policy}");
        assert!(!policy.contains("unsafe"), "{policy}");
        assert!(
            policy.contains(
                "connect-src 'self' http://127.0.0.1:4000 ws://127.0.0.1:4000 \
                 https://lab.example wss://lab.example;"
            ),
            "{policy}"
        );
        assert!(
            policy.contains("frame-src http://127.0.0.1:4000 https://lab.example;"),
            "{policy}"
        );
        assert!(policy.contains("style-src 'self' 'nonce-abc';"), "{policy}");
        assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
        let closed = super::policy(&[], "");
        assert!(closed.contains("frame-src 'none';"), "{closed}");
        assert!(closed.contains("connect-src 'self';"), "{closed}");
    }
}
