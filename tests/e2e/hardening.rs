//! Listener and entrypoint hardening, each attack refused over real sockets against the real
//! scheduler and the test agent's entrypoint (the SDK's, `--entrypoint-listen`): a client
//! dripping the HTTP/2 preface or a request body is cut on every listener; the entrypoint's
//! token never reaches the lesson's backend however the header spells it, its cookie is
//! `Secure` behind a TLS-terminating proxy, and a token signed to live for years is refused;
//! `/metrics` on the admin listener needs an `admin:read` token (or a listener of its own);
//! protobuf that does not decode is INVALID_ARGUMENT `MALFORMED_REQUEST`, not INTERNAL; a
//! stranger's Handshake under another scheduler instance id can neither sign for the real
//! scheduler nor revoke its keys.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use antidote_proto::agent::v1 as agent;
use antidote_sdk::entrypoint::{Claims, Signer};
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use antidote_tests::web::Web;
use antidote_tests::{ADMIN_READ_TOKEN, Scheduler, example_curriculum, presentation};
use hyper::StatusCode;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tonic_types::StatusExt as _;

use crate::entrypoint::KEY;
use crate::{Env, PATIENCE, start_agent};

/// The scheduler's instance id in these tests (what its tokens name).
const INSTANCE: &str = "e2e-hardening";

/// A scheduler (its configuration changed by `set`) signing entrypoint tokens with [`KEY`], and
/// a test agent (`agent_args`, plus its entrypoint on loopback with echoing HTTP
/// presentations).
async fn start(agent_args: &[&str], set: impl FnOnce(SchedulerConfig) -> SchedulerConfig) -> Env {
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let mut args = vec![
        "--entrypoint-listen",
        "127.0.0.1:0",
        "--echo-requests",
        "--entrypoint-activity-interval",
        "500ms",
    ];
    args.extend_from_slice(agent_args);
    let agent = start_agent(&dir, &args, &journal, None).await;
    let key = dir.path().join("k1.pem");
    std::fs::write(&key, KEY).unwrap();
    let config = SchedulerConfig::new(INSTANCE, &example_curriculum())
        .with_sessions_per_ip(0)
        .with_retries(ms(500), ms(50), secs(1))
        .with_entrypoint_keys(&[("k1", &key)], secs(120));
    let config = set(config)
        .with_agent(Agent::new("loopback", agent.url()))
        .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config)
        .await
        .expect("scheduler starts");
    Env {
        dir,
        agent,
        scheduler,
        journal,
        config,
    }
}

/// A READY hello-web live lesson's page: its id and the entrypoint URL the learner got (with
/// the scheduler's token in its query).
async fn page(env: &Env) -> (String, String) {
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "hello-web", 0).await.unwrap();
    let ready = c.ready(&live.id).await.unwrap();
    let url = presentation(&ready, "web", "page").entrypoint_url.clone();
    assert!(
        url.contains("antidote_token="),
        "no entrypoint URL for the learner: {url:?}\n{}",
        env.logs()
    );
    (live.id, url)
}

/// `http://host:port` of a URL and the rest (path and query).
fn split_url(url: &str) -> (SocketAddr, String) {
    let rest = url.strip_prefix("http://").expect("an http URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    (
        authority.parse().expect("a loopback address"),
        path.to_owned(),
    )
}

/// Sends `request` on a fresh connection and reads the answer until the server closes (the
/// requests say `Connection: close`).
async fn exchange(to: SocketAddr, request: &str) -> String {
    let mut stream = TcpStream::connect(to).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A GET of `path` at the entrypoint `to` with `headers` (CRLF-terminated lines).
async fn entrypoint_get(to: SocketAddr, path: &str, headers: &str) -> String {
    exchange(
        to,
        &format!("GET {path} HTTP/1.1\r\nHost: lab.example\r\n{headers}Connection: close\r\n\r\n"),
    )
    .await
}

/// The status code of a raw HTTP/1 answer (0 when there is none): the entrypoint answers in
/// its backend's HTTP version.
fn status(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// How a dripping client fared.
#[derive(Debug, PartialEq, Eq)]
enum Dripped {
    /// The server closed the connection before the client had sent everything; what it
    /// answered first, if anything.
    Cut(String),
    /// Everything was sent and the connection is still open.
    Held,
}

/// Opens a connection to `to` (from loopback address `from`), sends `head` at once and then
/// `drip` one byte per `every`, reading all the while: [`Dripped::Cut`] when the server closes
/// (EOF, a reset, or a refused write) before the drip is through.
async fn drip(
    from: Ipv4Addr,
    to: SocketAddr,
    head: &[u8],
    drip: &[u8],
    every: Duration,
) -> Dripped {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(IpAddr::V4(from), 0)).unwrap();
    let stream = socket.connect(to).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let answer = async {
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => return String::from_utf8_lossy(&answer).into_owned(),
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    };
    let send = async {
        if write.write_all(head).await.is_err() {
            return false;
        }
        for byte in drip {
            tokio::time::sleep(every).await;
            if write.write_all(&[*byte]).await.is_err() {
                return false;
            }
        }
        true
    };
    let outcome = tokio::time::timeout(PATIENCE, async {
        tokio::pin!(answer);
        tokio::select! {
            answer = &mut answer => Dripped::Cut(answer),
            sent_all = send => if sent_all {
                Dripped::Held
            } else {
                // A refused write: the server is gone; whatever it said first is readable.
                Dripped::Cut(tokio::time::timeout(Duration::from_secs(5), answer).await.unwrap_or_default())
            },
        }
    })
    .await;
    outcome.unwrap_or(Dripped::Held)
}

/// The HTTP/2 connection preface and an empty SETTINGS frame: what every HTTP/2 client sends
/// first.
const OPENING: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Finding 2. With `limits.header_read_timeout` 2 s and `limits.request_timeout` 3 s (the
/// entrypoint's flags alike), a client dripping the HTTP/2 preface one byte a second (33 s for
/// all of it) is disconnected before it is through on every listener: the learners' gRPC and
/// JSON listeners, the admin gRPC and JSON listeners and the entrypoint. A request with
/// complete headers whose body is dripped one byte a second is answered 408 and closed
/// before the body is through, on the JSON listeners (`REQUEST_TIMEOUT`) and the entrypoint
/// (whose backend waits for the whole body). Meanwhile a learner's calls are answered.
#[tokio::test]
async fn dripped_prefaces_and_bodies_are_cut_on_every_listener() {
    let env = start(
        &[
            "--entrypoint-header-read-timeout",
            "2s",
            "--entrypoint-request-timeout",
            "3s",
        ],
        |c| {
            c.with_limits(|l| {
                l.header_read_timeout = Some(secs(2));
                l.request_timeout = Some(secs(3));
            })
        },
    )
    .await;
    let (_, page_url) = page(&env).await;
    let process = &env.scheduler.process;
    let entrypoint = env.agent.extra["entrypoint"];
    let listeners = [
        ("grpc", process.addr),
        ("http", process.extra["http"]),
        ("admin", process.extra["admin"]),
        ("admin http", process.extra["admin http"]),
        ("entrypoint", entrypoint),
    ];
    let second = Duration::from_secs(1);
    let prefaces = listeners
        .iter()
        .enumerate()
        .map(|(i, (name, addr))| async move {
            let from = Ipv4Addr::new(127, 30, i as u8, 1);
            (*name, drip(from, *addr, b"", OPENING, second).await)
        });
    // Bodies: 64 bytes announced, dripped one a second.
    let body = |method: &str, path: &str| {
        format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 64\r\nAuthorization: Bearer {ADMIN_READ_TOKEN}\r\n\r\n"
        )
    };
    let (_, page_path) = split_url(&page_url);
    let bodies = [
        ("http", process.extra["http"], body("POST", "/v1/sessions")),
        (
            "admin http",
            process.extra["admin http"],
            body("POST", "/v1/admin/plan"),
        ),
        ("entrypoint", entrypoint, body("POST", &page_path)),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, addr, head))| async move {
        let from = Ipv4Addr::new(127, 31, i as u8, 1);
        let dripped = drip(from, addr, head.as_bytes(), &[b' '; 64], second).await;
        (name, dripped)
    });
    let (prefaces, bodies) = tokio::join!(
        futures::future::join_all(prefaces),
        futures::future::join_all(bodies)
    );
    for (name, dripped) in prefaces {
        assert!(
            matches!(dripped, Dripped::Cut(_)),
            "a client dripping the HTTP/2 preface to the {name} listener was held: {dripped:?}"
        );
    }
    for (name, dripped) in bodies {
        let Dripped::Cut(answer) = dripped else {
            panic!("a client dripping a body to the {name} listener was held");
        };
        assert!(
            status(&answer) == 408,
            "the {name} listener's answer to a dripped body: {answer:?}"
        );
        if name != "entrypoint" {
            assert!(answer.contains("REQUEST_TIMEOUT"), "{name}: {answer}");
        }
    }
    // The learner's own calls go on: gRPC, JSON and the page through the entrypoint.
    let c = &env.scheduler.clients;
    c.session().await.unwrap();
    let lessons = Web::default()
        .get(&format!(
            "{}/v1/lessons",
            process.extra_url("http").unwrap()
        ))
        .await
        .unwrap();
    assert_eq!(lessons.status, StatusCode::OK, "{}", lessons.body);
    let (to, path) = split_url(&page_url);
    let answer = entrypoint_get(to, &path, "").await;
    assert!(status(&answer) == 200, "{answer}");
}

/// Finding 3. The token the entrypoint accepted never reaches the lesson's backend (the echo
/// shows what it got), however the `Authorization` header spells it (two spaces, any case of
/// `bearer`, a tab), nor from the query or the cookie; the cookie is `Secure` when the trusted
/// proxy says the learner came over https (and not otherwise); a token signed with the
/// scheduler's own key to live ten years is refused.
#[tokio::test]
async fn the_entrypoint_strips_its_credential_marks_its_cookie_secure_and_bounds_lifetimes() {
    let env = start(&["--entrypoint-trusted-proxy", "127.0.0.1"], |c| c).await;
    let (id, url) = page(&env).await;
    let (to, path_and_query) = split_url(&url);
    let token = url.split_once("antidote_token=").unwrap().1.to_owned();
    let path = path_and_query.split_once('?').unwrap().0.to_owned();
    let leaked = |answer: &str| {
        answer.contains(&token) || answer.to_ascii_lowercase().contains("authorization:")
    };
    for spelling in [
        format!("Authorization: Bearer  {token}\r\n"),
        format!("Authorization: bearer {token}\r\n"),
        format!("authorization: BEARER\t{token} \r\n"),
        format!("Authorization:   Bearer {token}\r\n"),
    ] {
        let answer = entrypoint_get(to, &format!("{path}hello"), &spelling).await;
        assert!(status(&answer) == 200, "{spelling:?}: {answer}");
        assert!(
            answer.contains("GET /hello HTTP/1.1"),
            "the backend's echo: {answer}"
        );
        assert!(
            !leaked(&answer),
            "{spelling:?} reached the backend:\n{answer}"
        );
    }
    // The query parameter and the cookie are stripped too; the backend's own cookie passes.
    let from_query = entrypoint_get(to, &format!("{path_and_query}&q=1"), "").await;
    assert!(status(&from_query) == 200, "{from_query}");
    let (head, echo) = from_query.split_once("\r\n\r\n").unwrap();
    assert!(
        !leaked(echo),
        "the query token reached the backend:\n{echo}"
    );
    assert!(echo.contains("GET /?q=1 HTTP/1.1"), "{echo}");
    let cookie = head
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("the entrypoint sets its cookie");
    assert!(
        !cookie.contains("Secure"),
        "plain http, no proxy said https: {cookie}"
    );
    let from_cookie = entrypoint_get(
        to,
        &path,
        &format!("Cookie: app=1; antidote_entrypoint={token}\r\n"),
    )
    .await;
    assert!(status(&from_cookie) == 200, "{from_cookie}");
    assert!(
        !leaked(&from_cookie),
        "the cookie reached the backend:\n{from_cookie}"
    );
    assert!(from_cookie.contains("app=1"), "{from_cookie}");

    // Behind the trusted proxy (127.0.0.1 here) that ends TLS, the cookie is Secure.
    let behind_tls = entrypoint_get(
        to,
        &path_and_query,
        "X-Forwarded-Proto: https\r\nX-Forwarded-For: 203.0.113.9\r\n",
    )
    .await;
    let cookie = behind_tls
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("the entrypoint sets its cookie");
    assert!(
        cookie.contains("; Secure"),
        "behind a TLS-terminating proxy: {cookie}"
    );

    // A token of the scheduler's own key for this very page, living ten years: refused.
    let signer = Signer::from_pem("k1", KEY.as_bytes()).unwrap();
    let decade = signer.sign(
        &Claims::new(&id, "web", "page", Duration::from_secs(10 * 365 * 86_400))
            .issued_by(INSTANCE),
    );
    let refused = entrypoint_get(to, &format!("{path}?antidote_token={decade}"), "").await;
    assert!(status(&refused) == 401, "{refused}");
    assert!(refused.contains("lives too long"), "{refused}");
    let fine =
        signer.sign(&Claims::new(&id, "web", "page", Duration::from_secs(600)).issued_by(INSTANCE));
    let admitted = entrypoint_get(to, &format!("{path}?antidote_token={fine}"), "").await;
    assert!(status(&admitted) == 200, "{admitted}");
}

/// A codec that sends the bytes it is given as the request message and reads no answer: what
/// a client sending protobuf that does not decode needs.
#[derive(Debug, Clone, Default)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use prost::bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = ();
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<()>, tonic::Status> {
        use prost::bytes::Buf as _;
        src.advance(src.remaining());
        Ok(Some(()))
    }
}

/// Calls `method` (`/package.Service/Method`) at `addr` with `message` as the request's bytes.
async fn call_raw(addr: SocketAddr, method: &'static str, message: &[u8]) -> tonic::Status {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(message.to_vec()),
        tonic::codegen::http::uri::PathAndQuery::from_static(method),
        Raw,
    )
    .await
    .expect_err("a message that does not decode is refused")
}

/// Finding 4. `/metrics` on the admin HTTP listener answers 401 without a token or with one
/// nobody issued, 200 to an `admin:read` token, and on the listener of its own
/// (`admin.metrics_listen`) 200 without one; protobuf that does not decode (invalid UTF-8
/// in a string, a truncated field, a wrong wire type) is INVALID_ARGUMENT with ErrorInfo
/// reason `MALFORMED_REQUEST` on the learners' and the admin gRPC listeners, never INTERNAL.
#[tokio::test]
async fn metrics_need_a_token_and_malformed_protobuf_is_invalid_argument() {
    let env = start(&[], |c| c.with_metrics_listen("127.0.0.1:0")).await;
    let process = &env.scheduler.process;
    let web = Web::default();
    let admin_http = process.extra_url("admin http").unwrap();
    let anonymous = web.get(&format!("{admin_http}/metrics")).await.unwrap();
    assert_eq!(
        anonymous.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        anonymous.body
    );
    assert_eq!(anonymous.json().unwrap()["reason"], "UNAUTHENTICATED");
    let stranger = web
        .send(
            hyper::Method::GET,
            &format!("{admin_http}/metrics"),
            &[("authorization", "Bearer not-a-token-anyone-issued")],
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        stranger.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        stranger.body
    );
    let operator = web
        .send(
            hyper::Method::GET,
            &format!("{admin_http}/metrics"),
            &[("authorization", &format!("Bearer {ADMIN_READ_TOKEN}"))],
            None,
        )
        .await
        .unwrap();
    assert_eq!(operator.status, StatusCode::OK, "{}", operator.body);
    assert!(operator.body.contains("# TYPE"), "{}", operator.body);
    let scraper = web
        .get(&format!(
            "{}/metrics",
            process.extra_url("metrics").unwrap()
        ))
        .await
        .unwrap();
    assert_eq!(scraper.status, StatusCode::OK, "{}", scraper.body);
    assert!(scraper.body.contains("# TYPE"), "{}", scraper.body);

    // A string field (GetLessonRequest.slug is field 1, AdminListLiveLessonsRequest.lesson_slug
    // field 2): its value not UTF-8, its length past the end, or sent as a 32-bit value.
    let malformed = |field: u8| -> [(&'static str, Vec<u8>); 3] {
        let (string, fixed32) = (field << 3 | 2, field << 3 | 5);
        [
            ("invalid UTF-8", vec![string, 0x02, 0xff, 0xfe]),
            ("a truncated field", vec![string, 0x05, b'a']),
            ("a wrong wire type", vec![fixed32, 0, 0, 0, 0]),
        ]
    };
    for (addr, method, field) in [
        (
            process.addr,
            "/antidote.api.v1.CurriculumService/GetLesson",
            1,
        ),
        (
            process.extra["admin"],
            "/antidote.api.v1.AdminService/ListLiveLessons",
            2,
        ),
    ] {
        for (what, message) in malformed(field) {
            let message = message.as_slice();
            let status = call_raw(addr, method, message).await;
            assert_eq!(
                status.code(),
                tonic::Code::InvalidArgument,
                "{method} with {what}: {status:?}"
            );
            let info = status
                .get_details_error_info()
                .unwrap_or_else(|| panic!("{method} with {what}: no ErrorInfo in {status:?}"));
            assert_eq!(info.reason, "MALFORMED_REQUEST", "{method} with {what}");
        }
    }
}

/// Finding 5 (first half). A stranger reaching the agent's port sends a Handshake under an
/// invented scheduler instance id, offering its own keys (one under the real key's id) and
/// revoking the real key's id. Its keys are refused for tokens naming the real scheduler
/// instance (401); its own tokens, naming it or nobody, do not admit to the real scheduler's
/// live lesson (403); the real scheduler's key is not revoked: the learner's page still loads,
/// with the URL it had and a fresh one; the agent logged a warning about the new instance.
#[tokio::test]
async fn a_forged_handshake_neither_signs_for_the_scheduler_nor_revokes_its_keys() {
    let env = start(&[], |c| c).await;
    let (id, url) = page(&env).await;
    let (to, path_and_query) = split_url(&url);
    let path = path_and_query.split_once('?').unwrap().0.to_owned();
    let before = entrypoint_get(to, &path_and_query, "").await;
    assert!(status(&before) == 200, "{before}");

    let same_kid = Signer::generate("k1");
    let own_kid = Signer::generate("forged-k");
    let mut forger = env.agent_client().await;
    forger
        .handshake(agent::HandshakeRequest {
            supported_majors: vec![1],
            scheduler_instance_id: "forged-instance".into(),
            scheduler_version: "0".into(),
            capabilities: Vec::new(),
            entrypoint_keys: [&same_kid, &own_kid]
                .iter()
                .map(|s| agent::EntrypointKey {
                    key_id: s.key_id().to_owned(),
                    public_key: s.public_key().to_vec(),
                })
                .collect(),
            revoked_entrypoint_keys: vec!["k1".into()],
        })
        .await
        .expect("the agent answers any handshake");

    let token = |signer: &Signer, iss: Option<&str>| {
        let claims = Claims::new(&id, "web", "page", Duration::from_secs(600));
        signer.sign(&match iss {
            Some(iss) => claims.issued_by(iss),
            None => claims,
        })
    };
    let with = |token: String| format!("{path}?antidote_token={token}");
    for (what, forged) in [
        (
            "its key under the real id",
            token(&same_kid, Some(INSTANCE)),
        ),
        ("its own key", token(&own_kid, Some(INSTANCE))),
    ] {
        let answer = entrypoint_get(to, &with(forged), "").await;
        assert!(
            status(&answer) == 401,
            "a token naming the real instance signed with {what}: {answer}"
        );
    }
    for (what, forged) in [
        ("naming itself", token(&own_kid, Some("forged-instance"))),
        ("naming no instance", token(&own_kid, None)),
    ] {
        let answer = entrypoint_get(to, &with(forged), "").await;
        assert!(
            status(&answer) == 403,
            "the stranger's token {what}, for the real scheduler's live lesson: {answer}"
        );
    }

    // The foreign revocation of `k1` touched nothing of the real scheduler's.
    let after = entrypoint_get(to, &path_and_query, "").await;
    assert!(status(&after) == 200, "the learner's URL: {after}");
    let fresh = env.scheduler.clients.ready(&id).await.unwrap();
    let (_, fresh) = split_url(&presentation(&fresh, "web", "page").entrypoint_url);
    let answer = entrypoint_get(to, &fresh, "").await;
    assert!(status(&answer) == 200, "a fresh URL: {answer}");
    assert!(
        env.agent
            .log_text()
            .contains("a scheduler instance not seen before brings entrypoint keys"),
        "no warning in the agent's log:\n{}",
        env.agent.log_text()
    );
}
