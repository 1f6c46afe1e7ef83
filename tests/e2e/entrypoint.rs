//! The learners' way in through agent-docker's entrypoint (`--entrypoint-listen`), against a
//! real Docker engine (DOCKER_HOST) and the SSH-capable image `antidote/sshd`
//! (tests/docker/configurator.sh): the scheduler hands out per-presentation URLs with tokens it
//! signs; a WebSocket terminal runs a command and sees its output; the HTTP presentation's page
//! arrives through the proxy; no token, an expired one, one for another live lesson or
//! presentation are refused; typing keeps a lesson alive past its TTL, an idle open terminal does
//! not; a key the restarted scheduler no longer offers stops admitting while the terminal it
//! admitted stays open, and a key it revokes ends that terminal, while the agent runs on; a
//! terminal to routing-basics' client (on `antidote/sshd`) sees the stage's routes; learners
//! never see backend addresses (operators do); the per-client connection cap, directly and
//! behind a trusted proxy.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use antidote_proto::api::v1 as api;
use antidote_sdk::entrypoint::terminal::WITHDRAWN;
use antidote_sdk::entrypoint::{Claims, Keys, Signer};
use antidote_tests::config::{Agent, SchedulerConfig, secs};
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

/// A second key (`openssl genpkey -algorithm ed25519`), for rotation.
const KEY2: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIDvdymjqUWtkbAE/jY5/0wbxQ3kN8W08AaHX3XGntH8F
-----END PRIVATE KEY-----
";

fn curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/entrypoint-curriculum")
        .canonicalize()
        .expect("tests/fixtures/entrypoint-curriculum exists")
}

/// A copy of deploy/curriculum in `dir` whose routing-basics client runs on the SSH-capable
/// image `sshd` (busybox and dropbear: busybox's `ip`, a real SSH server) instead of `busybox`
/// (whose port 22 only answers a banner); the lesson's stages and configs are the shipped ones.
fn routing_curriculum(dir: &Path) -> PathBuf {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).unwrap();
            }
        }
    }
    let root = dir.join("curriculum");
    copy(&antidote_tests::example_curriculum(), &root);
    let lesson = root.join("lessons/routing-basics/lesson.meta.yaml");
    let text = std::fs::read_to_string(&lesson).unwrap();
    let client = "  - name: client\n    image: busybox\n";
    assert!(
        text.contains(client),
        "routing-basics changed shape:\n{text}"
    );
    std::fs::write(
        &lesson,
        text.replace(client, "  - name: client\n    image: sshd\n"),
    )
    .unwrap();
    let image = root.join("images/sshd");
    std::fs::create_dir_all(&image).unwrap();
    let meta = std::fs::read_to_string(curriculum().join("images/sshd/image.meta.yaml")).unwrap();
    std::fs::write(
        image.join("image.meta.yaml"),
        format!("{meta}networkInterfaces:\n  - eth1\n  - eth2\n"),
    )
    .unwrap();
    root
}

struct EntryEnv {
    dir: TempDir,
    agent: Process,
    scheduler: Scheduler,
    instance: String,
    lesson_ttl: Duration,
    curriculum: PathBuf,
}

impl EntryEnv {
    async fn start(instance: &str, lesson_ttl: Duration) -> EntryEnv {
        EntryEnv::start_with(instance, lesson_ttl, None, &[("k1", KEY)], &[]).await
    }

    /// agent-docker with its entrypoint (and `agent_args`), and a scheduler on `curriculum`
    /// (default: the fixture) signing with `keys` (id, private PEM; the last one signs).
    async fn start_with(
        instance: &str,
        lesson_ttl: Duration,
        curriculum: Option<&dyn Fn(&Path) -> PathBuf>,
        keys: &[(&str, &str)],
        agent_args: &[&str],
    ) -> EntryEnv {
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
        .chain(agent_args)
        .map(|a| a.to_string())
        .collect();
        let agent = Process::spawn(
            &workspace_bin("agent-docker"),
            &args,
            dir.path().join("agent-docker.log"),
        )
        .await
        .expect("agent-docker starts");
        let curriculum = match curriculum {
            Some(make) => make(dir.path()),
            None => self::curriculum(),
        };
        let config = config(dir.path(), instance, lesson_ttl, &curriculum, keys)
            .with_agent(Agent::new("docker", agent.url()))
            .to_toml();
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        EntryEnv {
            dir,
            agent,
            scheduler,
            instance: instance.to_owned(),
            lesson_ttl,
            curriculum,
        }
    }

    /// Stops the scheduler and starts it again with `[entrypoint] keys` = `keys` (the agent
    /// keeps running); learners' session tokens carry over. Returns once the new process has
    /// handshaken with the agent (ListAgents shows it READY).
    async fn restart_scheduler(&mut self, keys: &[(&str, &str)]) {
        self.restart_scheduler_revoking(keys, &[]).await;
    }

    /// [`EntryEnv::restart_scheduler`] with `[entrypoint] revoked` = `revoked`.
    async fn restart_scheduler_revoking(&mut self, keys: &[(&str, &str)], revoked: &[&str]) {
        self.scheduler
            .process
            .terminate()
            .await
            .expect("the scheduler stops");
        let config = config(
            self.dir.path(),
            &self.instance,
            self.lesson_ttl,
            &self.curriculum,
            keys,
        )
        .with_revoked_keys(revoked)
        .with_agent(Agent::new("docker", self.agent.url()))
        .to_toml();
        let tokens = self.scheduler.clients.tokens.clone();
        self.scheduler = Scheduler::start(self.dir.path(), &config)
            .await
            .unwrap_or_else(|err| panic!("the scheduler starts again: {err:#}\n{}", self.logs()));
        self.scheduler.clients.tokens = tokens;
        let started = std::time::Instant::now();
        loop {
            let agents = self.scheduler.clients.agents().await.expect("ListAgents");
            if agents
                .iter()
                .any(|a| a.name == "docker" && a.state() == api::AgentState::Ready)
            {
                return;
            }
            assert!(
                started.elapsed() < PATIENCE,
                "the restarted scheduler never reached the agent: {agents:#?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
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
        self.lesson_of("terminal").await
    }

    /// A READY live lesson of `slug` (stage 0) for a new session.
    async fn lesson_of(&self, slug: &str) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let lesson = c.request(&session, slug, 0).await.unwrap();
        c.ready(&lesson.id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()))
    }

    /// The live lesson as its owner sees it now (fresh entrypoint URLs).
    async fn get(&self, id: &str) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        c.get(id)
            .await
            .unwrap_or_else(|err| panic!("GetLiveLesson {id}: {err}\n{}", self.logs()))
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

/// The scheduler's configuration (without the agent); writes the key files into `dir`.
fn config(
    dir: &Path,
    instance: &str,
    lesson_ttl: Duration,
    curriculum: &Path,
    keys: &[(&str, &str)],
) -> SchedulerConfig {
    let files: Vec<(&str, PathBuf)> = keys
        .iter()
        .map(|(id, pem)| {
            let file = dir.join(format!("{id}.pem"));
            std::fs::write(&file, pem).unwrap();
            (*id, file)
        })
        .collect();
    let keys: Vec<(&str, &Path)> = files.iter().map(|(id, f)| (*id, f.as_path())).collect();
    SchedulerConfig::on_real_backend(instance, curriculum, secs(180))
        .with_lesson_ttl(lesson_ttl)
        .with_entrypoint_keys(&keys, secs(120))
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
    let env = EntryEnv::start("e2e-entrypoint", secs(30 * 60)).await;
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
    // One line of output holds both answers: reading for one and then the other misses the
    // second when both arrive in one frame.
    run(
        &mut terminal,
        "echo hello-$((6*7))-$(id -un)",
        "hello-42-antidote",
    )
    .await;
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
pub(crate) async fn alive(c: &antidote_tests::Clients, id: &str) -> bool {
    match c.get(id).await {
        Ok(lesson) => lesson.status() == api::LiveLessonStatus::Ready,
        Err(_) => false,
    }
}

#[tokio::test]
async fn entrypoint_typing_keeps_a_lesson_alive_past_its_ttl_and_an_idle_terminal_does_not() {
    const TTL: Duration = Duration::from_secs(15);
    let env = EntryEnv::start("e2e-entrypoint-ttl", secs(15)).await;
    let (busy, idle, polled) = tokio::join!(env.lesson(), env.lesson(), env.lesson());
    // A tab whose page polls its server (a script's GETs, as a browser marks them) is idle too.
    let polled_page = presentation(&polled, "box", "web").entrypoint_url.clone();
    let mut polled_gone = None;
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
        if idle_gone.is_none() && !alive(&env.scheduler.clients, &idle.id).await {
            idle_gone = Some(started.elapsed());
        }
        if polled_gone.is_none() {
            if alive(&env.scheduler.clients, &polled.id).await {
                let poll = get(&polled_page, &[("sec-fetch-mode", "cors")]).await;
                assert_eq!(poll.status, 200, "{}", poll.body);
            } else {
                polled_gone = Some(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(
        polled_gone.is_some(),
        "a tab polling its page kept its lesson alive past twice its TTL\n{}",
        env.logs()
    );
    let idle_gone = idle_gone.unwrap_or_else(|| {
        panic!(
            "the idle terminal's lesson outlived its TTL by {:?}\n{}",
            started.elapsed(),
            env.logs()
        )
    });
    assert!(
        alive(&env.scheduler.clients, &busy.id).await,
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

/// Reads until the terminal closes; the close frame's code and reason.
async fn closed(terminal: &mut Terminal) -> Option<(u16, String)> {
    tokio::time::timeout(PATIENCE, async {
        while let Some(message) = terminal.next().await {
            match message {
                Ok(Message::Close(frame)) => {
                    return frame.map(|f| (u16::from(f.code), f.reason.to_string()));
                }
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    })
    .await
    .expect("the terminal closes")
}

#[tokio::test]
async fn entrypoint_a_retired_key_stops_admitting_keeps_open_terminals_and_a_revoked_one_ends_them()
{
    let mut env = EntryEnv::start_with(
        "e2e-entrypoint-keys",
        secs(30 * 60),
        None,
        &[("k1", KEY)],
        &[],
    )
    .await;
    let agent_pid = env.agent.pid();
    let a = env.lesson().await;
    let k1 = Signer::from_pem("k1", KEY.as_bytes()).unwrap();
    let k2 = Signer::from_pem("k2", KEY2.as_bytes()).unwrap();
    let sign = |signer: &Signer, presentation: &str| {
        signer.sign(&Claims::new(
            &a.id,
            "box",
            presentation,
            Duration::from_secs(600),
        ))
    };
    let cli = presentation(&a, "box", "cli").entrypoint_url.clone();
    let web = presentation(&a, "box", "web").entrypoint_url.clone();

    // Opened with k1, the only key: a terminal, and the web page's cookie.
    let mut by_k1 = websocket(&cli)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs()));
    run(&mut by_k1, "echo one-$((1+1))", "one-2").await;
    let page = get(&web, &[]).await;
    assert_eq!(page.status, 200, "{}", page.body);
    let k1_cookie = page
        .header("set-cookie")
        .and_then(|c| c.split(';').next())
        .expect("a token cookie")
        .to_owned();

    // Rotation, step one: the scheduler restarts offering k1 and k2 and signing with k2. The
    // open terminal goes on; k1's tokens still admit; the scheduler's fresh URLs carry k2's.
    env.restart_scheduler(&[("k1", KEY), ("k2", KEY2)]).await;
    run(&mut by_k1, "echo two-$((1+2))", "two-3").await;
    assert!(
        websocket(&with_token(&cli, Some(&sign(&k1, "cli"))))
            .await
            .is_ok()
    );
    let fresh = env.get(&a.id).await;
    let fresh_cli = presentation(&fresh, "box", "cli").entrypoint_url.clone();
    let only_k2 = Keys::default();
    only_k2.insert("k2", k2.public_key());
    let fresh_token = fresh_cli.split_once("antidote_token=").unwrap().1;
    assert!(
        only_k2.verify(fresh_token).is_ok(),
        "the restarted scheduler signs with k2"
    );
    let mut by_k2 = websocket(&fresh_cli)
        .await
        .unwrap_or_else(|status| panic!("k2's terminal refused with {status}\n{}", env.logs()));
    run(&mut by_k2, "echo three-$((1+3))", "three-4").await;

    // Step two (k1 retired): the scheduler restarts offering k2 alone. The agent, never
    // restarted, refuses k1's tokens and cookie for new requests from then on, but the terminal
    // k1 admitted stays open; k2's terminal and tokens go on.
    env.restart_scheduler(&[("k2", KEY2)]).await;
    assert_eq!(env.agent.pid(), agent_pid, "the agent was not restarted");
    assert_eq!(
        websocket(&with_token(&cli, Some(&sign(&k1, "cli"))))
            .await
            .err(),
        Some(401),
        "a terminal with a token of the retired key"
    );
    let refused = get(&with_token(&web, Some(&sign(&k1, "web"))), &[]).await;
    assert_eq!(refused.status, 401, "{}", refused.body);
    let refused = get(&with_token(&web, None), &[("Cookie", &k1_cookie)]).await;
    assert_eq!(refused.status, 401, "k1's cookie: {}", refused.body);
    run(&mut by_k1, "echo kept-$((2+2))", "kept-4").await;
    run(&mut by_k2, "echo four-$((1+4))", "four-5").await;
    let fresh = env.get(&a.id).await;
    let page = get(&presentation(&fresh, "box", "web").entrypoint_url, &[]).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        websocket(&with_token(&cli, Some(&sign(&k2, "cli"))))
            .await
            .is_ok()
    );

    // Revocation (the emergency path): the scheduler restarts with `revoked = ["k1"]`. The
    // terminal k1 admitted ends (close 1008); k2's goes on; k1's tokens stay refused.
    env.restart_scheduler_revoking(&[("k2", KEY2)], &["k1"])
        .await;
    assert_eq!(env.agent.pid(), agent_pid, "the agent was not restarted");
    let close = closed(&mut by_k1).await;
    assert_eq!(
        close,
        Some((1008, WITHDRAWN.to_owned())),
        "the terminal k1 admitted ends\n{}",
        env.logs()
    );
    assert_eq!(
        websocket(&with_token(&cli, Some(&sign(&k1, "cli"))))
            .await
            .err(),
        Some(401),
        "a terminal with a token of the revoked key"
    );
    run(&mut by_k2, "echo five-$((1+5))", "five-6").await;

    env.delete(&a.id).await;
}

#[tokio::test]
async fn entrypoint_terminal_to_routing_basics_client_sees_the_stage_routes() {
    let env = EntryEnv::start_with(
        "e2e-entrypoint-routing",
        secs(30 * 60),
        Some(&routing_curriculum),
        &[("k1", KEY)],
        &[],
    )
    .await;
    let lesson = env.lesson_of("routing-basics").await;
    let route = "10.10.2.0/24 via 10.10.1.1 dev eth1";

    // Stage 0: the client's link is addressed, nothing routes across the router.
    let mut terminal = websocket(&presentation(&lesson, "client", "cli").entrypoint_url)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs()));
    let out = run(
        &mut terminal,
        "ip route; echo routes-$((2*21))",
        "routes-42",
    )
    .await;
    assert!(out.contains("10.10.1.0/24 dev eth1"), "{out}");
    assert!(
        !out.contains("10.10.2.0/24"),
        "stage 0 routes nothing across: {out}"
    );
    drop(terminal);

    // Stage 1: its client configuration adds the route through the router.
    let c = &env.scheduler.clients;
    c.lessons
        .clone()
        .set_stage(antidote_tests::with_token(
            api::SetStageRequest {
                id: lesson.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&lesson.id),
        ))
        .await
        .unwrap();
    let (_, staged) = c
        .follow(&lesson.id, PATIENCE, |l| {
            l.generation == 2
                && matches!(
                    l.status(),
                    api::LiveLessonStatus::Ready | api::LiveLessonStatus::Failed
                )
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(
        staged.status(),
        api::LiveLessonStatus::Ready,
        "{}\n{}",
        staged.failure_reason,
        env.logs()
    );
    let mut terminal = websocket(&presentation(&staged, "client", "cli").entrypoint_url)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs()));
    let out = run(
        &mut terminal,
        "ip route; echo routes-$((2*22))",
        "routes-44",
    )
    .await;
    assert!(out.contains(route), "stage 1's route: {out}");
    env.delete(&lesson.id).await;
}

/// What the admin API answers for a live lesson.
async fn admin_view(env: &EntryEnv, id: &str) -> api::LiveLesson {
    env.scheduler
        .clients
        .admin
        .clone()
        .get_live_lesson(api::AdminGetLiveLessonRequest { id: id.into() })
        .await
        .unwrap_or_else(|err| panic!("admin GetLiveLesson {id}: {err}\n{}", env.logs()))
        .into_inner()
        .live_lesson
        .expect("the admin answer holds the live lesson")
}

/// The learner's JSON answer for a live lesson (`GET /v1/live-lessons/{id}`).
async fn learner_json(env: &EntryEnv, id: &str) -> Answer {
    let http = env.scheduler.process.extra_url("http").unwrap();
    let token = env.scheduler.clients.tokens.of_lesson(id).unwrap();
    get(
        &format!("{http}/v1/live-lessons/{id}"),
        &[("authorization", &format!("Bearer {token}"))],
    )
    .await
}

#[tokio::test]
async fn entrypoint_learners_never_see_backend_addresses_and_operators_do() {
    let mut env = EntryEnv::start("e2e-entrypoint-addresses", secs(30 * 60)).await;
    let lesson = env.lesson().await;
    let admin = admin_view(&env, &lesson.id).await;
    for (endpoint, name) in [("box", "cli"), ("box", "web")] {
        let learner = presentation(&lesson, endpoint, name);
        let operator = presentation(&admin, endpoint, name);
        assert!(
            learner.address.is_empty() && learner.url.is_empty(),
            "the learner got a backend address beside the entrypoint URL: {learner:?}"
        );
        assert!(!learner.entrypoint_url.is_empty(), "{learner:?}");
        assert!(
            !operator.address.is_empty(),
            "operators keep the backend address: {operator:?}"
        );
        assert!(
            operator.entrypoint_url.is_empty(),
            "operators get no learner's token: {operator:?}"
        );
    }
    let web = presentation(&admin, "box", "web");
    assert!(
        !web.url.is_empty(),
        "operators keep the backend URL: {web:?}"
    );
    let json = learner_json(&env, &lesson.id).await;
    assert_eq!(json.status, 200, "{}", json.body);
    assert!(json.body.contains("antidote_token="), "{}", json.body);
    for backend in [&web.address, &presentation(&admin, "box", "cli").address] {
        assert!(
            !json.body.contains(backend.as_str()),
            "the learner's JSON names the backend address {backend}: {}",
            json.body
        );
    }

    // Without signing keys learners get no entrypoint URL, and still no backend address
    // (`[entrypoint] backend_addresses` is off by default).
    env.restart_scheduler(&[]).await;
    let without = env.get(&lesson.id).await;
    let admin = admin_view(&env, &lesson.id).await;
    for (endpoint, name) in [("box", "cli"), ("box", "web")] {
        let learner = presentation(&without, endpoint, name);
        assert!(
            learner.address.is_empty()
                && learner.url.is_empty()
                && learner.entrypoint_url.is_empty(),
            "{learner:?}"
        );
        assert!(!presentation(&admin, endpoint, name).address.is_empty());
    }
    env.delete(&lesson.id).await;
}

/// Opens a WebSocket at an `http://` URL from the local address `from` (any 127/8 address is
/// this host's), with `headers`; the refusal's HTTP status when answered, 0 when the
/// connection closed unanswered (the entrypoint's connection cap).
async fn websocket_from(from: &str, url: &str, headers: &[(&str, &str)]) -> Result<Terminal, u16> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let ws_url = url.replacen("http://", "ws://", 1);
    let authority: std::net::SocketAddr = ws_url
        .strip_prefix("ws://")
        .and_then(|r| r.split('/').next())
        .unwrap()
        .parse()
        .unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(format!("{from}:0").parse().unwrap())
        .unwrap_or_else(|err| panic!("bind {from}: {err}"));
    let stream = socket.connect(authority).await.unwrap();
    let mut request = ws_url.into_client_request().unwrap();
    for (name, value) in headers {
        request.headers_mut().insert(
            tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    match tokio_tungstenite::client_async(request, stream).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Err(response.status().as_u16())
        }
        Err(_) => Err(0),
    }
}

#[tokio::test]
async fn entrypoint_caps_connections_per_client_address_and_per_forwarded_client_behind_a_trusted_proxy()
 {
    let env = EntryEnv::start_with(
        "e2e-entrypoint-caps",
        secs(30 * 60),
        None,
        &[("k1", KEY)],
        &[
            "--entrypoint-max-per-client",
            "2",
            "--entrypoint-trusted-proxy",
            "127.0.0.3",
        ],
    )
    .await;
    let lesson = env.lesson().await;
    let cli = presentation(&lesson, "box", "cli").entrypoint_url.clone();
    let open = |from: &'static str, headers: &'static [(&'static str, &'static str)]| {
        let cli = cli.clone();
        async move { websocket_from(from, &cli, headers).await }
    };

    // Two terminals from 127.0.0.2 hold its two places: the third connection is closed
    // unanswered, while another address is served.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            open("127.0.0.2", &[])
                .await
                .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", env.logs())),
        );
    }
    assert_eq!(
        open("127.0.0.2", &[]).await.err(),
        Some(0),
        "the 3rd connection from one address"
    );
    let mut other = open("127.0.0.4", &[])
        .await
        .unwrap_or_else(|status| panic!("another address refused with {status}\n{}", env.logs()));
    run(&mut other, "echo other-$((2+3))", "other-5").await;
    // X-Forwarded-For from an untrusted address changes nothing.
    assert_eq!(
        open("127.0.0.2", &[("x-forwarded-for", "198.51.100.99")])
            .await
            .err(),
        Some(0)
    );

    // Through the trusted proxy (127.0.0.3) each client its X-Forwarded-For names has its own
    // two places; the proxy itself is not one client.
    let client_a: &'static [(&str, &str)] = &[("x-forwarded-for", "6.6.6.6, 198.51.100.7")];
    let mut proxied = Vec::new();
    for _ in 0..2 {
        proxied.push(open("127.0.0.3", client_a).await.unwrap_or_else(|status| {
            panic!("proxied terminal refused with {status}\n{}", env.logs())
        }));
    }
    assert_eq!(
        open("127.0.0.3", client_a).await.err(),
        Some(429),
        "the 3rd request of one forwarded client"
    );
    let mut client_b = open("127.0.0.3", &[("x-forwarded-for", "198.51.100.8")])
        .await
        .unwrap_or_else(|status| panic!("another forwarded client refused with {status}"));
    run(&mut client_b, "echo proxied-$((3+4))", "proxied-7").await;

    // A place is given back when its terminal closes.
    let mut first = held.remove(0);
    first.close(None).await.unwrap();
    drop(first);
    let started = std::time::Instant::now();
    loop {
        if let Ok(mut again) = open("127.0.0.2", &[]).await {
            run(&mut again, "echo again-$((1+5))", "again-6").await;
            break;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "127.0.0.2 never got its place back\n{}",
            env.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.delete(&lesson.id).await;
}
