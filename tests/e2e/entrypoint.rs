//! The learners' way in through agent-docker's entrypoint (`--entrypoint-listen`), against a
//! real Docker engine (DOCKER_HOST) and the SSH-capable image `antidote/sshd`
//! (tests/docker/configurator.sh): the scheduler hands out per-presentation URLs with tokens it
//! signs; a WebSocket terminal runs a command and sees its output; the HTTP presentation's page
//! arrives through the proxy; no token, an expired one, one for another live lesson or
//! presentation are refused; typing keeps a lesson alive past its TTL, an idle open terminal does
//! not.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use antidote_proto::api::v1 as api;
use antidote_proto::sdk::entrypoint::{Claims, Signer};
use antidote_tests::{Process, Scheduler, presentation, workspace_bin};
use futures::{SinkExt as _, StreamExt as _};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::tungstenite::Message;

use crate::PATIENCE;

/// The scheduler's signing key (`openssl genpkey -algorithm ed25519`); the test signs its own
/// expired and misdirected tokens with it.
pub(crate) const KEY: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIOJpnp+MXLCEBFZDaMoT0KXNBLMvX5FYtd/znqWpkio2
-----END PRIVATE KEY-----
";

fn curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/entrypoint-curriculum")
        .canonicalize()
        .expect("tests/fixtures/entrypoint-curriculum exists")
}

struct EntryEnv {
    _dir: TempDir,
    agent: Process,
    scheduler: Scheduler,
}

impl EntryEnv {
    async fn start(instance: &str, lesson_ttl: &str) -> EntryEnv {
        std::env::var("DOCKER_HOST").expect(
            "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
        );
        let dir = tempfile::tempdir().unwrap();
        let args: Vec<String> = [
            "--listen",
            "127.0.0.1:0",
            "--probe-timeout",
            "30s",
            "--entrypoint-listen",
            "127.0.0.1:0",
            "--entrypoint-activity-interval",
            "500ms",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let agent = Process::spawn(
            &workspace_bin("agent-docker"),
            &args,
            dir.path().join("agent-docker.log"),
        )
        .await
        .expect("agent-docker starts");
        let key = dir.path().join("k1.pem");
        std::fs::write(&key, KEY).unwrap();
        let config = format!(
            r#"instance_id = "{instance}"
curriculum = "{curriculum}"
tier = "local"
[ttl]
live_lesson = "{lesson_ttl}"
[limits]
sessions_per_ip = 0
[reaper]
interval = "500ms"
orphan_interval = "500ms"
orphan_grace = "1s"
[reconciler]
poll_interval = "500ms"
backoff_initial = "100ms"
backoff_max = "1s"
provision_timeout = "3m"
[entrypoint]
keys = [{{ id = "k1", file = "{key}" }}]
token_ttl = "2m"
[[agents]]
name = "docker"
address = "{agent}"
"#,
            curriculum = curriculum().display(),
            key = key.display(),
            agent = agent.url(),
        );
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        EntryEnv {
            _dir: dir,
            agent,
            scheduler,
        }
    }

    fn logs(&self) -> String {
        format!(
            "--- scheduler ---\n{}\n--- agent-docker ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text()
        )
    }

    /// A READY `terminal` live lesson of a new session.
    async fn lesson(&self) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let lesson = c.request(&session, "terminal", 0).await.unwrap();
        c.ready(&lesson.id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()))
    }

    async fn delete(&self, id: &str) {
        let c = &self.scheduler.clients;
        c.lessons
            .clone()
            .delete_live_lesson(antidote_tests::with_token(
                api::DeleteLiveLessonRequest { id: id.into() },
                c.tokens.of_lesson(id),
            ))
            .await
            .unwrap();
        c.gone(id, PATIENCE).await.unwrap();
    }
}

/// An answer: status, headers (lower-case names), body.
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Answer {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET url` over plain HTTP/1.1, with optional extra headers.
pub(crate) async fn get(url: &str, extra: &[(&str, &str)]) -> Answer {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n");
    for (k, v) in extra {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

pub(crate) type Terminal = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens a WebSocket at an `http://` URL; the refusal's HTTP status when it is refused.
pub(crate) async fn websocket(url: &str) -> Result<Terminal, u16> {
    let ws_url = url.replacen("http://", "ws://", 1);
    let authority = ws_url
        .strip_prefix("ws://")
        .and_then(|r| r.split('/').next())
        .unwrap()
        .to_owned();
    let stream = tokio::net::TcpStream::connect(&authority).await.unwrap();
    match tokio_tungstenite::client_async(ws_url, stream).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Err(response.status().as_u16())
        }
        Err(err) => panic!("websocket to {url}: {err}"),
    }
}

/// Types `line` into the terminal and reads output until `want` shows, returning what was read.
pub(crate) async fn run(terminal: &mut Terminal, line: &str, want: &str) -> String {
    let input = serde_json::json!({"type": "input", "data": format!("{line}\r")});
    terminal
        .send(Message::Text(input.to_string().into()))
        .await
        .unwrap();
    read_until(terminal, want).await
}

pub(crate) async fn read_until(terminal: &mut Terminal, want: &str) -> String {
    let mut seen = String::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(message) = terminal.next().await {
            if let Ok(Message::Binary(bytes)) = message {
                seen.push_str(&String::from_utf8_lossy(&bytes));
                if seen.contains(want) {
                    return true;
                }
            }
        }
        false
    })
    .await;
    assert_eq!(found, Ok(true), "`{want}` never showed; saw {seen:?}");
    seen
}

/// `url` with its token replaced by `token` (or removed).
pub(crate) fn with_token(url: &str, token: Option<&str>) -> String {
    let base = url.split_once('?').map_or(url, |(b, _)| b);
    match token {
        Some(token) => format!("{base}?antidote_token={token}"),
        None => base.to_owned(),
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
async fn entrypoint_terminal_and_http_proxy_admit_only_their_tokens() {
    let env = EntryEnv::start("e2e-entrypoint", "30m").await;
    let a = env.lesson().await;
    let b = env.lesson().await;
    let cli = presentation(&a, "box", "cli").entrypoint_url.clone();
    let web = presentation(&a, "box", "web").entrypoint_url.clone();
    let entry = env.agent.extra_url("entrypoint").unwrap();
    assert!(
        cli.starts_with(&format!(
            "{entry}/l/{}/box/cli/terminal?antidote_token=",
            a.id
        )),
        "{cli}"
    );
    assert!(
        web.starts_with(&format!("{entry}/l/{}/box/web/?antidote_token=", a.id)),
        "{web}"
    );

    // The web page through the proxy; the cookie it sets admits the page's own requests.
    let page = get(&web, &[]).await;
    assert_eq!(page.status, 200, "{}\n{}", page.body, env.logs());
    assert!(page.body.contains("antidote/sshd"), "{}", page.body);
    let cookie = page
        .header("set-cookie")
        .expect("a token cookie")
        .to_owned();
    assert!(
        cookie.contains(&format!("Path=/l/{}/box/web/", a.id)),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap();
    let again = get(&with_token(&web, None), &[("Cookie", pair)]).await;
    assert_eq!(again.status, 200, "{}", again.body);
    let missing = get(
        &format!("{}nothing-here", with_token(&web, None)),
        &[("Cookie", pair)],
    )
    .await;
    assert_eq!(missing.status, 404, "the server's own 404 comes through");

    // A terminal: a shell on the endpoint, logged in as the image's user.
    let mut terminal = websocket(&cli)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs()));
    let resize = serde_json::json!({"type": "resize", "cols": 132, "rows": 40});
    terminal
        .send(Message::Text(resize.to_string().into()))
        .await
        .unwrap();
    let out = run(&mut terminal, "echo hello-$((6*7)) && id -un", "hello-42").await;
    let out = out + &read_until(&mut terminal, "antidote").await;
    assert!(out.contains("hello-42"), "{out}");
    // Binary frames are keystrokes too; the resize reached the PTY.
    terminal
        .send(Message::Binary(b"stty size\r".to_vec().into()))
        .await
        .unwrap();
    read_until(&mut terminal, "40 132").await;
    // The shell's exit status arrives as a text frame, then the close.
    let input = serde_json::json!({"type": "input", "data": "exit 3\r"});
    terminal
        .send(Message::Text(input.to_string().into()))
        .await
        .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(Ok(message)) = terminal.next().await {
            if let Message::Text(text) = message {
                return Some(text.to_string());
            }
        }
        None
    })
    .await
    .unwrap();
    let exit: serde_json::Value = serde_json::from_str(&exit.expect("an exit message")).unwrap();
    assert_eq!(exit, serde_json::json!({"type": "exit", "status": 3}));

    // Refusals: no token, an expired one, one for another live lesson, one for another
    // presentation, one signed by a stranger.
    let signer = Signer::from_pem("k1", KEY.as_bytes()).unwrap();
    let mut expired = Claims::new(&a.id, "box", "cli", Duration::from_secs(60));
    expired.exp = unix_now() - 120;
    let expired = signer.sign(&expired);
    let other_lesson = signer.sign(&Claims::new(&b.id, "box", "cli", Duration::from_secs(60)));
    let other_presentation =
        signer.sign(&Claims::new(&a.id, "box", "web", Duration::from_secs(60)));
    let stranger =
        Signer::generate("k1").sign(&Claims::new(&a.id, "box", "cli", Duration::from_secs(60)));
    for (token, want, what) in [
        (None, 401, "no token"),
        (Some(expired.as_str()), 401, "an expired token"),
        (Some(stranger.as_str()), 401, "a token of another key"),
        (
            Some(other_lesson.as_str()),
            403,
            "a token for another live lesson",
        ),
        (
            Some(other_presentation.as_str()),
            403,
            "a token for another presentation",
        ),
    ] {
        let refused = websocket(&with_token(&cli, token)).await.err();
        assert_eq!(refused, Some(want), "terminal with {what}");
    }
    let other_web = signer.sign(&Claims::new(&b.id, "box", "web", Duration::from_secs(60)));
    for (token, want, what) in [
        (None, 401, "no token"),
        (Some(expired.as_str()), 401, "an expired token"),
        (
            Some(other_web.as_str()),
            403,
            "a token for another live lesson",
        ),
    ] {
        let refused = get(&with_token(&web, token), &[]).await;
        assert_eq!(refused.status, want, "page with {what}: {}", refused.body);
    }
    // b's own URL works for b only.
    let b_page = get(&presentation(&b, "box", "web").entrypoint_url, &[]).await;
    assert_eq!(b_page.status, 200);

    env.delete(&a.id).await;
    env.delete(&b.id).await;
}

/// Whether the live lesson is still there and not being removed.
async fn alive(env: &EntryEnv, id: &str) -> bool {
    let c = &env.scheduler.clients;
    match c
        .lessons
        .clone()
        .get_live_lesson(antidote_tests::with_token(
            api::GetLiveLessonRequest { id: id.into() },
            c.tokens.of_lesson(id),
        ))
        .await
    {
        Ok(lesson) => lesson.into_inner().status() == api::LiveLessonStatus::Ready,
        Err(_) => false,
    }
}

#[tokio::test]
async fn entrypoint_typing_keeps_a_lesson_alive_past_its_ttl_and_an_idle_terminal_does_not() {
    const TTL: Duration = Duration::from_secs(15);
    let env = EntryEnv::start("e2e-entrypoint-ttl", "15s").await;
    let (busy, idle) = tokio::join!(env.lesson(), env.lesson());
    let mut typing = websocket(&presentation(&busy, "box", "cli").entrypoint_url)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs()));
    let mut open = websocket(&presentation(&idle, "box", "cli").entrypoint_url)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs()));
    let started = std::time::Instant::now();
    let mut idle_gone = None;
    let mut n = 1000;
    // Type every 2 s for more than twice the TTL; the other terminal stays open, untouched.
    while started.elapsed() < TTL * 2 + Duration::from_secs(5) {
        n += 1;
        run(
            &mut typing,
            &format!("echo tick-$(({n}+1))"),
            &format!("tick-{}", n + 1),
        )
        .await;
        if idle_gone.is_none() && !alive(&env, &idle.id).await {
            idle_gone = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let idle_gone = idle_gone.unwrap_or_else(|| {
        panic!(
            "the idle terminal's lesson outlived its TTL by {:?}\n{}",
            started.elapsed(),
            env.logs()
        )
    });
    assert!(
        alive(&env, &busy.id).await,
        "the typing learner's lesson was reaped (the idle one went after {idle_gone:?})\n{}",
        env.logs()
    );
    // The idle terminal ends with its lesson's endpoint.
    let ended = tokio::time::timeout(PATIENCE, async {
        while let Some(Ok(message)) = open.next().await {
            if matches!(message, Message::Close(_)) {
                break;
            }
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the idle terminal stayed open after its lesson went"
    );
    env.delete(&busy.id).await;
}
