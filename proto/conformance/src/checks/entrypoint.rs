//! The entrypoint (PROTOCOL.md [H1]-[H12]), checked from outside with `--entrypoint URL`. The
//! suite is the scheduler here: every Handshake it sends hands the agent the suite's own
//! Ed25519 key ([`Suite::signer`]), and every token below is one it signs, so any agent that
//! answers an `entrypoint_url` can be checked without a scheduler. The requests are plain
//! HTTP/1.1 on connections of their own (one per request, so that each check controls its
//! headers and sees the answer exactly as a browser would).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use antidote_proto::agent::v1 as proto;
use antidote_sdk::capabilities;
use antidote_sdk::entrypoint::{Claims, Signer, TOKEN_PARAM, presentation_path};
use anyhow::{Context as _, anyhow, bail, ensure};
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper::{HeaderMap, StatusCode};
use proto::PresentationType;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::report::{Outcome, Verdict, describe, pass};
use crate::suite::{Entry, Suite, new_id};

/// How long the suite's tokens live: well inside any agent's bound on a token's lifetime.
const TTL: Duration = Duration::from_secs(600);

/// How long an agent may take to report activity ([H12]: within 10 s), with slack for the
/// Watch or Get that reads it.
const ACTIVITY_WITHIN: Duration = Duration::from_secs(15);

/// The `web` presentation's prefix of `entry`, with its final slash.
fn web_prefix(entry: &Entry) -> String {
    prefix(&entry.id, "solo", "web")
}

/// An HTTP answer, its body read whole.
#[derive(Debug)]
pub struct Answer {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body (invalid UTF-8 replaced).
    pub body: String,
}

/// The prefix of a presentation, with its final slash.
fn prefix(id: &str, endpoint: &str, presentation: &str) -> String {
    let path = presentation_path(id, endpoint, presentation);
    if path.ends_with('/') {
        path
    } else {
        format!("{path}/")
    }
}

/// One HTTP/1.1 request on a connection of its own to `connect`, with `Host: host`.
async fn request(
    connect: &str,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
) -> anyhow::Result<Answer> {
    let exchange = async {
        let tcp = TcpStream::connect(connect)
            .await
            .with_context(|| format!("connecting to {connect}"))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
        tokio::spawn(async move {
            // The connection ends with the answer; its error says nothing the answer does not.
            let _ = connection.await;
        });
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host);
        for (name, value) in headers {
            builder = builder.header(*name, value);
        }
        let response = sender
            .send_request(builder.body(Empty::<Bytes>::new())?)
            .await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        Ok::<_, anyhow::Error>(Answer {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| anyhow!("{method} {path}: no answer within 30 s"))?
        .with_context(|| format!("{method} {path}"))
}

/// A token of `signer` for one presentation, issued by `instance`.
fn token(signer: &Signer, instance: &str, id: &str, endpoint: &str, presentation: &str) -> String {
    signer.sign(&Claims::new(id, endpoint, presentation, TTL).issued_by(instance))
}

/// `path` with the token as its `antidote_token` query parameter.
fn with_token(path: &str, token: &str) -> String {
    let join = if path.contains('?') { '&' } else { '?' };
    format!("{path}{join}{TOKEN_PARAM}={token}")
}

/// Seconds since the epoch.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Checks that `answer` has `status`, naming `what` otherwise.
fn expect(answer: &Answer, status: u16, what: &str) -> anyhow::Result<()> {
    ensure!(
        answer.status.as_u16() == status,
        "{what}: expected {status}, got {} ({})",
        answer.status,
        answer.body.trim().chars().take(200).collect::<String>()
    );
    Ok(())
}

/// Where to connect for `url`, and the `Host` to send: the URL's authority, with `id` in place
/// of `{live_lesson}`; names under `localhost` reach loopback.
fn target(url: &str, id: &str) -> anyhow::Result<(String, String, bool)> {
    let rest = url
        .strip_prefix("http://")
        .context("the suite reaches the entrypoint over plain HTTP only (`--entrypoint http://…`, on loopback or behind the proxy that ends TLS)")?;
    let authority = rest.split('/').next().unwrap_or_default();
    let per_lesson = authority.contains("{live_lesson}");
    let host = authority.replace("{live_lesson}", id);
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port)) if !name.ends_with(']') || name.starts_with('[') => {
            (name.to_owned(), port.to_owned())
        }
        _ => (host.clone(), "80".to_owned()),
    };
    let connect = if name == "localhost" || name.ends_with(".localhost") {
        format!("127.0.0.1:{port}")
    } else {
        format!("{name}:{port}")
    };
    Ok((connect, host, per_lesson))
}

/// The entrypoint lesson, made by `entrypoint-tokens`.
fn entry(suite: &Suite) -> anyhow::Result<Entry> {
    suite
        .entry
        .clone()
        .context("no entrypoint live lesson (`entrypoint-tokens` did not pass)")
}

/// Sends the suite's handshake with `keys` (besides its own key) and `revoked`.
async fn handshake(
    suite: &mut Suite,
    instance: &str,
    keys: &[&Signer],
    revoked: &[&str],
) -> anyhow::Result<()> {
    let mut request = suite.handshake_request();
    request.scheduler_instance_id = instance.to_owned();
    if instance != suite.instance {
        request.entrypoint_keys.clear();
    }
    request
        .entrypoint_keys
        .extend(keys.iter().map(|signer| proto::EntrypointKey {
            key_id: signer.key_id().to_owned(),
            public_key: signer.public_key().to_vec(),
        }));
    request.revoked_entrypoint_keys = revoked.iter().map(|k| (*k).to_owned()).collect();
    suite
        .client
        .handshake(request)
        .await
        .map_err(|s| anyhow!("Handshake: {}", describe(&s)))?;
    Ok(())
}

/// `entrypoint-tokens` ([H1], [H6]): a READY live lesson's HTTP presentation, reached through
/// the entrypoint, answers as it does at its backend address with the suite's token (query
/// parameter or `Authorization: Bearer` in any spelling); without one, with a malformed,
/// expired or too long-lived one it is 401; with one for another live lesson, endpoint or
/// presentation 403; a path of a live lesson not held here is 401 without a token (the token
/// is judged first) and 404 with one for it.
pub async fn tokens(suite: &mut Suite) -> Verdict {
    let Some(url) = suite.settings.entrypoint.clone() else {
        return Ok(Outcome::Skip("needs `--entrypoint`".into()));
    };
    ensure!(
        !suite.entrypoint_url.is_empty(),
        "the handshake answers no entrypoint_url, yet --entrypoint was given"
    );
    let id = new_id();
    let mut spec = suite.solo(&id);
    spec.endpoints[0]
        .presentations
        .retain(|p| p.r#type == PresentationType::Http as i32);
    spec.endpoints[0].configuration = None;
    suite
        .provision(spec)
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
    let ready = suite.ready(&id, 1).await?;
    let backend = ready
        .endpoints
        .first()
        .and_then(|e| e.presentations.first())
        .map(|p| p.address.clone())
        .context("the READY state has no presentation address")?;
    let (connect, host, per_lesson) = target(&url, &id)?;
    let entry = Entry {
        id: id.clone(),
        connect,
        host,
        per_lesson,
        backend,
    };
    suite.entry = Some(entry.clone());
    let signer = &suite.signer;
    let instance = suite.instance.clone();
    let get = |path: String, headers: Vec<(&'static str, String)>| {
        let entry = entry.clone();
        async move { request(&entry.connect, &entry.host, "GET", &path, &headers).await }
    };
    let web = web_prefix(&entry);
    let good = token(signer, &instance, &id, "solo", "web");

    let direct = request(&entry.backend, &entry.backend, "GET", "/", &[]).await?;
    let through = get(with_token(&web, &good), vec![]).await?;
    ensure!(
        through.status == direct.status && through.body == direct.body,
        "through the entrypoint `GET {web}` answers {} ({} bytes), the presentation itself {} ({} bytes)",
        through.status,
        through.body.len(),
        direct.status,
        direct.body.len()
    );
    for (scheme, gap) in [("Bearer", " "), ("bearer", "\t"), ("BEARER", "  ")] {
        let answer = get(
            web.clone(),
            vec![("authorization", format!("{scheme}{gap}{good}"))],
        )
        .await?;
        ensure!(
            answer.status == direct.status,
            "`Authorization: {scheme}` with a good token: {} (the presentation answers {})",
            answer.status,
            direct.status
        );
    }
    let stamp = now();
    let expired = signer.sign(&Claims {
        exp: stamp - 60,
        iat: stamp - 120,
        ..Claims::new(&id, "solo", "web", TTL).issued_by(&instance)
    });
    let too_long = signer.sign(&Claims {
        exp: stamp + 400 * 24 * 3600,
        ..Claims::new(&id, "solo", "web", TTL).issued_by(&instance)
    });
    let refusals = [
        ("no token", web.clone(), 401),
        ("a malformed token", with_token(&web, "not.a.token"), 401),
        ("an expired token", with_token(&web, &expired), 401),
        ("a token living 400 days", with_token(&web, &too_long), 401),
        (
            "a token for another live lesson",
            with_token(&web, &token(signer, &instance, &new_id(), "solo", "web")),
            403,
        ),
        (
            "a token for another endpoint",
            with_token(&web, &token(signer, &instance, &id, "other", "web")),
            403,
        ),
        (
            "a token for another presentation",
            with_token(&web, &token(signer, &instance, &id, "solo", "other")),
            403,
        ),
    ];
    for (what, path, status) in refusals {
        expect(&get(path, vec![]).await?, status, what)?;
    }
    let stranger = new_id();
    let elsewhere = prefix(&stranger, "solo", "web");
    if !per_lesson {
        expect(
            &get(elsewhere.clone(), vec![]).await?,
            401,
            "a live lesson not held here, without a token",
        )?;
        expect(
            &get(
                with_token(
                    &elsewhere,
                    &token(signer, &instance, &stranger, "solo", "web"),
                ),
                vec![],
            )
            .await?,
            404,
            "a live lesson not held here, with its token",
        )?;
    }
    pass(format!(
        "the presentation answers {} through the entrypoint as at its address; 401 without a token, malformed, expired, too long-lived; 403 for another live lesson, endpoint, presentation{}",
        direct.status,
        if per_lesson {
            ""
        } else {
            "; a live lesson not held: 401, then 404 with its token"
        }
    ))
}

/// `entrypoint-keys` ([H2], [H3], [H4]): a key the suite's next Handshake leaves out (retired)
/// or revokes gets 401 from then on, while the suite's own key still admits; a key another
/// scheduler instance's Handshake brings admits nothing to the suite's live lesson (403 with a
/// token naming that instance, 401 with one naming the suite's).
pub async fn keys(suite: &mut Suite) -> Verdict {
    let entry = entry(suite)?;
    let instance = suite.instance.clone();
    let web = web_prefix(&entry);
    let get = |path: String| {
        let entry = entry.clone();
        async move { request(&entry.connect, &entry.host, "GET", &path, &[]).await }
    };
    let own = with_token(
        &web,
        &token(&suite.signer, &instance, &entry.id, "solo", "web"),
    );
    let ok = get(own.clone()).await?.status;
    ensure!(
        ok != StatusCode::UNAUTHORIZED && ok != StatusCode::FORBIDDEN,
        "the suite's own key is refused: {ok}"
    );

    let extra = Signer::generate(&format!("conformance-extra-{}", &new_id()[..8]));
    handshake(suite, &instance, &[&extra], &[]).await?;
    let extra_path = with_token(&web, &token(&extra, &instance, &entry.id, "solo", "web"));
    let admitted = get(extra_path.clone()).await?;
    ensure!(
        admitted.status == ok,
        "a key the suite's Handshake offers: {} (its own key: {ok})",
        admitted.status
    );
    handshake(suite, &instance, &[], &[]).await?;
    expect(&get(extra_path.clone()).await?, 401, "a retired key")?;

    let revoked = Signer::generate(&format!("conformance-revoked-{}", &new_id()[..8]));
    handshake(suite, &instance, &[&revoked], &[]).await?;
    let revoked_path = with_token(&web, &token(&revoked, &instance, &entry.id, "solo", "web"));
    let before = get(revoked_path.clone()).await?;
    ensure!(
        before.status == ok,
        "a key offered before its revocation: {}",
        before.status
    );
    handshake(suite, &instance, &[&revoked], &[revoked.key_id()]).await?;
    expect(&get(revoked_path).await?, 401, "a revoked key")?;

    let other = new_id();
    let stranger = Signer::generate(&format!("conformance-stranger-{}", &new_id()[..8]));
    handshake(suite, &other, &[&stranger], &[]).await?;
    let theirs = get(with_token(
        &web,
        &token(&stranger, &other, &entry.id, "solo", "web"),
    ))
    .await?;
    let claimed = get(with_token(
        &web,
        &token(&stranger, &instance, &entry.id, "solo", "web"),
    ))
    .await?;
    // The other instance's set goes; the suite's own Handshake restores its one key.
    handshake(suite, &other, &[], &[]).await?;
    handshake(suite, &instance, &[], &[]).await?;
    expect(
        &theirs,
        403,
        "another instance's key, its token naming that instance",
    )?;
    expect(
        &claimed,
        401,
        "another instance's key, its token naming the suite's instance",
    )?;
    let still = get(own).await?;
    ensure!(
        still.status == ok,
        "the suite's own key after all that: {}",
        still.status
    );
    pass(
        "retired key 401, revoked key 401, another instance's key 403 (401 naming ours), our own key still admits",
    )
}

/// `entrypoint-cookie` ([H7]): admitted by the query parameter, an HTTP presentation's answer
/// sets `antidote_entrypoint` (the token, host-only, `Path` the prefix, `HttpOnly`, a
/// `Max-Age` within the token's life, the `SameSite` of the entrypoint's kind); the cookie then
/// admits requests without `Sec-Fetch-Site` or with `same-origin`/`none`, and is 403 with
/// `cross-site` or `same-site`.
pub async fn cookie(suite: &mut Suite) -> Verdict {
    let entry = entry(suite)?;
    let web = web_prefix(&entry);
    let good = token(&suite.signer, &suite.instance, &entry.id, "solo", "web");
    let first = request(
        &entry.connect,
        &entry.host,
        "GET",
        &with_token(&web, &good),
        &[],
    )
    .await?;
    let set = first
        .headers
        .get_all(hyper::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("antidote_entrypoint="))
        .context("no `Set-Cookie: antidote_entrypoint=…` after a query-parameter admission")?
        .to_owned();
    let attributes: Vec<(String, String)> = set
        .split(';')
        .skip(1)
        .map(|a| {
            let (k, v) = a.trim().split_once('=').unwrap_or((a.trim(), ""));
            (k.to_ascii_lowercase(), v.to_owned())
        })
        .collect();
    let attribute = |name: &str| {
        attributes
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let value = set["antidote_entrypoint=".len()..]
        .split(';')
        .next()
        .unwrap_or_default();
    ensure!(value == good, "the cookie does not hold the token: {set}");
    ensure!(
        attribute("domain").is_none(),
        "the cookie is not host-only: {set}"
    );
    let path = attribute("path").unwrap_or_default();
    ensure!(
        path.trim_end_matches('/') == web.trim_end_matches('/'),
        "the cookie's Path is `{path}`, not the prefix {web}"
    );
    ensure!(
        attribute("httponly").is_some(),
        "the cookie is not HttpOnly: {set}"
    );
    let max_age: u64 = attribute("max-age")
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("the cookie has no Max-Age: {set}"))?;
    ensure!(
        max_age <= TTL.as_secs(),
        "Max-Age {max_age} outlives the token's {} s",
        TTL.as_secs()
    );
    let same_site = attribute("samesite")
        .unwrap_or_default()
        .to_ascii_lowercase();
    if entry.per_lesson {
        ensure!(
            same_site == "none"
                && attribute("secure").is_some()
                && attribute("partitioned").is_some(),
            "with an origin per live lesson the cookie must be `SameSite=None; Secure; Partitioned`: {set}"
        );
    } else {
        ensure!(
            same_site == "strict",
            "with one origin the cookie must be `SameSite=Strict`: {set}"
        );
    }
    let cookie = format!("antidote_entrypoint={good}");
    for (site, status) in [
        (None, first.status.as_u16()),
        (Some("same-origin"), first.status.as_u16()),
        (Some("none"), first.status.as_u16()),
        (Some("cross-site"), 403),
        (Some("same-site"), 403),
    ] {
        let mut headers = vec![("cookie", cookie.clone())];
        if let Some(site) = site {
            headers.push(("sec-fetch-site", site.to_owned()));
        }
        let answer = request(&entry.connect, &entry.host, "GET", &web, &headers).await?;
        expect(
            &answer,
            status,
            &format!(
                "the cookie with Sec-Fetch-Site {}",
                site.unwrap_or("(absent)")
            ),
        )?;
    }
    pass(format!(
        "`{}`; admits without Sec-Fetch-Site and with same-origin or none, 403 cross-site and same-site",
        set.replace(&good, "TOKEN")
    ))
}

/// `entrypoint-proxy` ([H5], [H8]): a path and query under the prefix reach the presentation
/// as they would at its address (the token left out), the prefix without its final slash is
/// redirected to it, and with one origin for every live lesson the answer carries the sandbox
/// policy.
pub async fn proxy(suite: &mut Suite) -> Verdict {
    let entry = entry(suite)?;
    let web = web_prefix(&entry);
    let good = token(&suite.signer, &suite.instance, &entry.id, "solo", "web");
    let rest = "conformance/a%20b?x=1&y=two";
    let direct = request(
        &entry.backend,
        &entry.backend,
        "GET",
        &format!("/{rest}"),
        &[],
    )
    .await?;
    let through = request(
        &entry.connect,
        &entry.host,
        "GET",
        &format!("{web}conformance/a%20b?x=1&{TOKEN_PARAM}={good}&y=two"),
        &[],
    )
    .await?;
    ensure!(
        through.status == direct.status && through.body == direct.body,
        "`{web}{rest}` through the entrypoint answers {} ({} bytes), the presentation itself {} ({} bytes)",
        through.status,
        through.body.len(),
        direct.status,
        direct.body.len()
    );
    if !entry.per_lesson {
        let policy = through
            .headers
            .get(hyper::header::CONTENT_SECURITY_POLICY)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        ensure!(
            policy.contains("sandbox"),
            "with one origin for every live lesson a proxied answer must carry `Content-Security-Policy: sandbox …`, got `{policy}`"
        );
    }
    let bare = web.trim_end_matches('/');
    let moved = request(
        &entry.connect,
        &entry.host,
        "GET",
        &with_token(bare, &good),
        &[],
    )
    .await?;
    let location = moved
        .headers
        .get(hyper::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    ensure!(
        moved.status.is_redirection()
            && location
                .split('?')
                .next()
                .unwrap_or_default()
                .ends_with(&web),
        "`GET {bare}` (no final slash): expected a redirect to {web}, got {} to `{location}`",
        moved.status
    );
    pass(format!(
        "path and query reach the presentation ({}), the bare prefix redirects ({}){}",
        direct.status,
        moved.status,
        if entry.per_lesson {
            ""
        } else {
            ", the answer is sandboxed"
        }
    ))
}

/// `entrypoint-activity` ([H12]): a page script's reads (`Sec-Fetch-Mode` `cors`, `no-cors`,
/// `same-origin`) leave `last_active` where it was; a navigation moves it within 10 s.
pub async fn activity(suite: &mut Suite) -> Verdict {
    let entry = entry(suite)?;
    let web = web_prefix(&entry);
    let good = token(&suite.signer, &suite.instance, &entry.id, "solo", "web");
    let auth = ("authorization", format!("Bearer {good}"));
    // The checks before counted as activity (requests without Fetch Metadata): wait until what
    // they left has been reported.
    let mut settled = last_active(suite, &entry.id).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        tokio::time::sleep(ACTIVITY_WITHIN).await;
        let now = last_active(suite, &entry.id).await?;
        if now == settled {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "last_active kept moving for 40 s with nobody using the live lesson"
        );
        settled = now;
    }
    for mode in ["cors", "no-cors", "same-origin", "websocket"] {
        request(
            &entry.connect,
            &entry.host,
            "GET",
            &web,
            &[auth.clone(), ("sec-fetch-mode", mode.to_owned())],
        )
        .await?;
    }
    tokio::time::sleep(ACTIVITY_WITHIN).await;
    let after_reads = last_active(suite, &entry.id).await?;
    ensure!(
        after_reads == settled,
        "a page script's reads (Sec-Fetch-Mode cors, no-cors, same-origin, websocket) moved last_active from {settled:?} to {after_reads:?}"
    );
    request(
        &entry.connect,
        &entry.host,
        "GET",
        &web,
        &[auth, ("sec-fetch-mode", "navigate".to_owned())],
    )
    .await?;
    let deadline = tokio::time::Instant::now() + ACTIVITY_WITHIN;
    loop {
        let now = last_active(suite, &entry.id).await?;
        if now > settled {
            return pass(format!(
                "reads left last_active alone; a navigation moved it to {}",
                now.map_or("?".into(), |(s, _)| s.to_string())
            ));
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "a navigation did not move last_active within {ACTIVITY_WITHIN:?} (still {now:?})"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The live lesson's `last_active` (seconds, nanos) from Get.
async fn last_active(suite: &mut Suite, id: &str) -> anyhow::Result<Option<(i64, i32)>> {
    let state = suite
        .get(id)
        .await
        .map_err(|s| anyhow!("Get: {}", describe(&s)))?;
    Ok(state.last_active.map(|t| (t.seconds, t.nanos)))
}

/// `entrypoint-connection-cap` ([H11]): `--entrypoint-max-per-client` connections from the
/// suite are each answered; one more is closed without an answer; closing one frees a place.
pub async fn connection_cap(suite: &mut Suite) -> Verdict {
    let entry = entry(suite)?;
    let cap = suite.settings.entrypoint_max_per_client;
    let good = token(&suite.signer, &suite.instance, &entry.id, "solo", "web");
    let ask = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {good}\r\n\r\n",
        web_prefix(&entry),
        entry.host
    );
    // Connections of the checks before may not be counted out yet: let them go.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut open = Vec::new();
    for n in 0..cap {
        let mut tcp = TcpStream::connect(&entry.connect).await?;
        tcp.write_all(ask.as_bytes()).await?;
        let mut first = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(10), tcp.read_exact(&mut first))
            .await
            .map_err(|_| anyhow!("connection {} of {cap} got no answer within 10 s", n + 1))?
            .with_context(|| format!("connection {} of {cap} was closed unanswered", n + 1))?;
        ensure!(
            first.starts_with(b"HTTP/1."),
            "connection {} answered {:?}",
            n + 1,
            String::from_utf8_lossy(&first)
        );
        open.push(tcp);
    }
    let mut extra = TcpStream::connect(&entry.connect).await?;
    // The write may already fail: the entrypoint closes at once.
    let _ = extra.write_all(ask.as_bytes()).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), extra.read_to_end(&mut got)).await;
    match read {
        Err(_) => bail!(
            "connection {} of a client capped at {cap} stayed open 10 s",
            cap + 1
        ),
        Ok(_) => ensure!(
            got.is_empty(),
            "connection {} of a client capped at {cap} was answered: {:?}",
            cap + 1,
            String::from_utf8_lossy(&got[..got.len().min(40)])
        ),
    }
    drop(open.pop());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut again = TcpStream::connect(&entry.connect).await?;
        let _ = again.write_all(ask.as_bytes()).await;
        let mut first = [0u8; 7];
        if let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_secs(5), again.read_exact(&mut first)).await
            && &first == b"HTTP/1."
        {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "a place freed by closing a connection was not given back within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(open);
    pass(format!(
        "{cap} connections answered, one more closed unanswered, a closed one frees its place"
    ))
}

/// `entrypoint-terminal` ([H9], [H4], [H5]): a web terminal to `--terminal-image`'s SSH
/// presentation runs what is typed (a JSON input frame and a binary one), tells the shell's
/// exit status and closes; a WebSocket from another site's page is 403; a terminal opened with a
/// key that is then revoked is closed with 1008.
pub async fn terminal(suite: &mut Suite) -> Verdict {
    let Some(image) = suite.settings.terminal_image.clone() else {
        return Ok(Outcome::Skip("needs `--terminal-image`".into()));
    };
    ensure!(
        suite.offers(capabilities::PRESENTATION_SSH),
        "the agent does not offer presentation.ssh"
    );
    let Some(url) = suite.settings.entrypoint.clone() else {
        return Ok(Outcome::Skip("needs `--entrypoint`".into()));
    };
    let id = new_id();
    let mut spec = suite.solo(&id);
    let endpoint = &mut spec.endpoints[0];
    endpoint
        .presentations
        .retain(|p| p.r#type == PresentationType::Ssh as i32);
    endpoint.configuration = None;
    if let Some(image_spec) = endpoint.image.as_mut() {
        image_spec.slug = image;
        image_spec.ssh_user = suite.settings.ssh_user.clone();
        image_spec.ssh_password = suite.settings.ssh_password.clone();
    }
    suite
        .provision(spec)
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
    suite.ready(&id, 1).await?;
    let (connect, host, _) = target(&url, &id)?;
    let path = format!("{}terminal", prefix(&id, "solo", "cli"));
    let instance = suite.instance.clone();
    let good = token(&suite.signer, &instance, &id, "solo", "cli");

    let refused = request(
        &connect,
        &host,
        "GET",
        &with_token(&path, &good),
        &[
            ("connection", "Upgrade".into()),
            ("upgrade", "websocket".into()),
            ("sec-websocket-version", "13".into()),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==".into()),
            ("origin", "https://elsewhere.example".into()),
        ],
    )
    .await?;
    expect(&refused, 403, "a terminal opened from another site's page")?;

    let mut shell = open_terminal(&connect, &host, &with_token(&path, &good)).await?;
    shell
        .send(Message::Text(
            r#"{"type":"input","data":"echo conformance-$((6*7))\r"}"#.into(),
        ))
        .await?;
    read_until(&mut shell, |text| text.contains("conformance-42")).await?;
    shell
        .send(Message::Binary(b"exit 7\r".to_vec().into()))
        .await?;
    let mut status = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let message = tokio::time::timeout(left, shell.next())
            .await
            .map_err(|_| anyhow!("no exit and close within 30 s of `exit 7`"))?;
        match message {
            Some(Ok(Message::Text(text))) => {
                let json: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("a text frame that is not JSON: {text}"))?;
                if json["type"] == "exit" {
                    status = json["status"].as_i64();
                }
            }
            Some(Ok(Message::Close(frame))) => {
                ensure!(
                    status == Some(7),
                    "closed before `{{\"type\":\"exit\",\"status\":7}}` (exit status seen: {status:?})"
                );
                if let Some(frame) = frame {
                    ensure!(
                        frame.code == CloseCode::Normal,
                        "closed with {} after the exit, not 1000",
                        u16::from(frame.code)
                    );
                }
                break;
            }
            Some(Ok(_)) => {}
            Some(Err(err)) => bail!("the terminal broke before its close: {err}"),
            None => bail!("the terminal ended without a close frame"),
        }
    }

    let doomed = Signer::generate(&format!("conformance-terminal-{}", &new_id()[..8]));
    handshake(suite, &instance, &[&doomed], &[]).await?;
    let mut open = open_terminal(
        &connect,
        &host,
        &with_token(&path, &token(&doomed, &instance, &id, "solo", "cli")),
    )
    .await?;
    open.send(Message::Binary(b"echo still-$((40+2))\r".to_vec().into()))
        .await?;
    read_until(&mut open, |text| text.contains("still-42")).await?;
    handshake(suite, &instance, &[&doomed], &[doomed.key_id()]).await?;
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(message) = open.next().await {
            if let Ok(Message::Close(frame)) = message {
                return Some(frame.map(|f| u16::from(f.code)));
            }
        }
        None
    })
    .await
    .map_err(|_| anyhow!("a terminal whose key was revoked stayed open 15 s"))?;
    handshake(suite, &instance, &[], &[]).await?;
    ensure!(
        closed == Some(Some(1008)),
        "a terminal whose key was revoked ended with {closed:?}, not a close 1008"
    );
    suite.remove(&id).await?;
    pass(
        "a JSON and a binary input frame ran, exit status 7 then a close; another site's page 403; revoking the key closed an open terminal with 1008",
    )
}

/// A WebSocket stream to a web terminal.
type Terminal = tokio_tungstenite::WebSocketStream<TcpStream>;

/// Opens the terminal at `path` (its token in the query).
async fn open_terminal(connect: &str, host: &str, path: &str) -> anyhow::Result<Terminal> {
    let tcp = TcpStream::connect(connect).await?;
    let url = format!("ws://{host}{path}");
    let (stream, _) = tokio::time::timeout(
        Duration::from_secs(30),
        tokio_tungstenite::client_async(url.as_str(), tcp),
    )
    .await
    .map_err(|_| anyhow!("the terminal did not open within 30 s"))?
    .with_context(|| format!("opening the terminal {path}"))?;
    Ok(stream)
}

/// Reads the terminal's output until `done` holds for all of it.
async fn read_until(terminal: &mut Terminal, done: impl Fn(&str) -> bool) -> anyhow::Result<()> {
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done(&seen) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, terminal.next()).await {
            Err(_) => {
                bail!("the terminal's output did not show what was typed within 30 s: {seen:?}")
            }
            Ok(Some(Ok(Message::Binary(bytes)))) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            Ok(Some(Ok(Message::Close(frame)))) => {
                bail!("the terminal closed ({frame:?}); output: {seen:?}")
            }
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(err))) => bail!("the terminal broke: {err}"),
            Ok(None) => bail!("the terminal ended; output: {seen:?}"),
        }
    }
    Ok(())
}
