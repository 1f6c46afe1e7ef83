//! The learner page (`/learn/` on the scheduler's HTTP listener) in a real browser: Debian's
//! headless chromium driven over WebDriver by chromedriver (tests/browser/chromium.sh installs
//! both; tests/run runs it), against the real scheduler and agent-docker with its entrypoint on
//! the private Docker engine (DOCKER_HOST) and the SSH-capable image `antidote/sshd`
//! (tests/docker/configurator.sh). The page lists lessons by collection, requests one, shows
//! its progress to READY, types into a terminal tab and reads the output, shows the web tab's
//! page, changes stage, deletes the lesson. Screenshots go to `target/screenshots/browser/`
//! for a person to look at. Another test checks the page's headers (Content-Security-Policy
//! and friends) and that a guide's `<script>` and `onerror=` never run; another presses a
//! gated stage's Check button, fixes the stage in the terminal and goes on (the fixture
//! `browser-checks-curriculum`).
//!
//! WebDriver is spoken as plain HTTP/JSON over hyper (already in the workspace), so no
//! WebDriver crate (and its own HTTP and TLS stacks) joins the lock file.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, secs};
use antidote_tests::{Process, Scheduler, workspace_bin};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::PATIENCE;

/// The scheduler's entrypoint signing key (`openssl genpkey -algorithm ed25519`).
const KEY: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIOJpnp+MXLCEBFZDaMoT0KXNBLMvX5FYtd/znqWpkio2
-----END PRIVATE KEY-----
";

/// Entrypoint tokens live this long (the shortest the scheduler takes), so the test outlives
/// every URL the page was given and sees it fetch fresh ones.
const TOKEN_TTL_SECS: u64 = 10;

/// WebDriver's name for an element reference in JSON.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// WebDriver's Enter key.
const ENTER: &str = "\u{E007}";

/// The lessons with a terminal and a web tab.
fn curriculum() -> PathBuf {
    fixture("browser-curriculum")
}

/// The lesson whose stages carry checks (a gated one, then an advisory one).
fn checks_curriculum() -> PathBuf {
    fixture("browser-checks-curriculum")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
        .canonicalize()
        .unwrap_or_else(|err| panic!("tests/fixtures/{name}: {err}"))
}

fn screenshots() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/screenshots/browser");
    std::fs::create_dir_all(&dir).expect("target/ is writable");
    dir
}

/// How the entrypoint gives live lessons their origins (`--entrypoint-url`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origins {
    /// `http://{live_lesson}.localhost:PORT`: one origin per live lesson.
    PerLesson,
    /// `http://127.0.0.1:PORT`: one origin for every lesson (the path mode).
    Shared,
}

/// A port free now, for a listener whose address must be known before it starts (the page's,
/// which the agent names as the learner origin; the entrypoint's, which its URL names).
fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

/// A scheduler serving the page (with entrypoint keys) and, when asked, agent-docker with its
/// entrypoint on the private Docker engine, the page's origin its learner origin.
struct PageEnv {
    _dir: TempDir,
    agent: Option<Process>,
    scheduler: Scheduler,
    /// The entrypoint's port.
    entry_port: u16,
}

impl PageEnv {
    async fn start(instance: &str, with_agent: bool, origins: Origins) -> PageEnv {
        PageEnv::start_with(instance, &curriculum(), with_agent, origins).await
    }

    async fn start_with(
        instance: &str,
        curriculum: &Path,
        with_agent: bool,
        origins: Origins,
    ) -> PageEnv {
        let dir = tempfile::tempdir().unwrap();
        let (page_port, entry_port) = (free_port(), free_port());
        let agent = if with_agent {
            std::env::var("DOCKER_HOST").expect(
                "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
            );
            let url = match origins {
                Origins::PerLesson => format!("http://{{live_lesson}}.localhost:{entry_port}"),
                Origins::Shared => format!("http://127.0.0.1:{entry_port}"),
            };
            let args: Vec<String> = [
                "--listen",
                "127.0.0.1:0",
                "--probe-timeout",
                "30s",
                "--entrypoint-listen",
                &format!("127.0.0.1:{entry_port}"),
                "--entrypoint-url",
                &url,
                "--entrypoint-learner-origin",
                &format!("http://127.0.0.1:{page_port}"),
            ]
            .iter()
            .map(|a| a.to_string())
            .collect();
            Some(
                Process::spawn(
                    &workspace_bin("agent-docker"),
                    &args,
                    dir.path().join("agent-docker.log"),
                )
                .await
                .expect("agent-docker starts"),
            )
        } else {
            None
        };
        let key = dir.path().join("k1.pem");
        std::fs::write(&key, KEY).unwrap();
        let mut config = SchedulerConfig::on_real_backend(instance, curriculum, secs(180))
            .with_lesson_ttl(secs(30 * 60))
            .with_http_listen(&format!("127.0.0.1:{page_port}"))
            .with_entrypoint_keys(&[("k1", &key)], secs(TOKEN_TTL_SECS));
        if let Some(agent) = &agent {
            config = config.with_agent(Agent::new("docker", agent.url()));
        }
        let config = config.to_toml();
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        PageEnv {
            _dir: dir,
            agent,
            scheduler,
            entry_port,
        }
    }

    fn page(&self) -> String {
        format!(
            "{}/learn/",
            self.scheduler.process.extra_url("http").unwrap()
        )
    }

    fn logs(&self) -> String {
        let agent = self
            .agent
            .as_ref()
            .map(Process::log_text)
            .unwrap_or_default();
        format!(
            "--- scheduler ---\n{}\n--- agent-docker ---\n{agent}",
            self.scheduler.process.log_text(),
        )
    }
}

/// An HTTP answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET url` over plain HTTP/1.1.
async fn get(url: &str) -> Answer {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
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

/// chromedriver (in its own process group, so chromium goes with it) and one headless
/// chromium session.
struct Browser {
    driver: tokio::process::Child,
    /// `127.0.0.1:PORT` of chromedriver.
    addr: String,
    session: String,
    _profile: TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and the chromium it started.
        if let Some(pid) = self.driver.id() {
            // `--`: without it procps's kill reads `-PID` as options (and signals other
            // processes than the group).
            let _ = std::process::Command::new("kill")
                .args(["-s", "KILL", "--", &format!("-{pid}")])
                .status();
        }
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|path| path.is_file())
    })
}

impl Browser {
    async fn start() -> Browser {
        let driver = which("chromedriver").expect(
            "chromedriver is missing: run tests/browser/chromium.sh (tests/run does), which installs Debian's chromium and chromium-driver",
        );
        // A free port for chromedriver (it prints none of its own choosing).
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let mut command = tokio::process::Command::new(driver);
        command
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        let child = command.spawn().expect("chromedriver starts");
        let addr = format!("127.0.0.1:{port}");
        let profile = tempfile::tempdir().unwrap();
        let mut browser = Browser {
            driver: child,
            addr,
            session: String::new(),
            _profile: profile,
        };
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Ok(status) = browser.raw("GET", "/status", None).await
                    && status["value"]["ready"] == json!(true)
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(ready.is_ok(), "chromedriver did not answer within 30 s");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"args": [
                "--headless=new",
                // Root needs it; the wrapper's /dev/shm check misfires here.
                "--no-sandbox",
                "--disable-dev-shm-usage",
                "--disable-gpu",
                "--window-size=1400,1000",
                format!("--user-data-dir={}", browser._profile.path().display()),
            ]},
        }}});
        let created = browser
            .raw("POST", "/session", Some(capabilities))
            .await
            .expect("chromedriver answers");
        browser.session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {created}"))
            .to_owned();
        browser
    }

    /// One WebDriver call: the whole JSON answer, or the error it names.
    async fn raw(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let stream = tokio::net::TcpStream::connect(&self.addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("{method} {path}: {status}: {}", value["value"]));
        }
        Ok(value)
    }

    /// A call within the session; panics on a WebDriver error.
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        match self.raw(method, &path, body).await {
            Ok(value) => value["value"].clone(),
            Err(err) => panic!("webdriver: {err}"),
        }
    }

    async fn goto(&self, url: &str) {
        self.call("POST", "/url", Some(json!({ "url": url }))).await;
    }

    /// Runs `script` (a function body; `return` gives the answer) in the current frame.
    async fn run(&self, script: &str) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    /// Waits until `script` returns something truthy (checked every 200 ms); that value.
    async fn until(&self, what: &str, script: &str, limit: Duration) -> Value {
        let started = std::time::Instant::now();
        loop {
            let value = self.run(script).await;
            let truthy = !matches!(&value, Value::Null | Value::Bool(false))
                && value != json!("")
                && value != json!(0);
            if truthy {
                return value;
            }
            if started.elapsed() > limit {
                let body = self
                    .run("return document.body ? document.body.innerText : ''")
                    .await;
                panic!("{what}: not within {limit:?}; the page shows:\n{body}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn find(&self, css: &str) -> String {
        let element = self
            .call(
                "POST",
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        element[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {element}"))
            .to_owned()
    }

    async fn click(&self, css: &str) {
        let id = self.find(css).await;
        self.call("POST", &format!("/element/{id}/click"), Some(json!({})))
            .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.call(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Into the frame `css` selects, or back to the page with `None`.
    async fn frame(&self, css: Option<&str>) {
        let id = match css {
            Some(css) => json!({ ELEMENT: self.find(css).await }),
            None => Value::Null,
        };
        self.call("POST", "/frame", Some(json!({ "id": id }))).await;
    }

    /// Saves a PNG of the window as `target/screenshots/browser/NAME.png`.
    async fn screenshot(&self, name: &str) {
        let data = self.call("GET", "/screenshot", None).await;
        let png = base64(data.as_str().expect("a base64 string"));
        assert!(png.starts_with(b"\x89PNG"), "the screenshot is a PNG");
        std::fs::write(screenshots().join(format!("{name}.png")), png).unwrap();
    }

    async fn quit(&self) {
        let _ = self
            .raw("DELETE", &format!("/session/{}", self.session), None)
            .await;
    }
}

/// Standard base64 (what WebDriver screenshots are), without a crate for eleven lines.
fn base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let sextets: Vec<u8> = text.bytes().filter_map(value).collect();
    let mut out = Vec::with_capacity(sextets.len() * 3 / 4);
    for chunk in sextets.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, s)| n | (u32::from(*s) << (18 - 6 * i)));
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len().saturating_sub(1)]);
    }
    out
}

/// A script answering the text the terminal tab `presentation` (`endpoint/presentation`) shows
/// when it contains `want`, else false.
fn terminal_shows(presentation: &str, want: &str) -> String {
    format!(
        "const rows = document.querySelector('[data-terminal=\"{presentation}\"] .xterm-rows'); \
         const text = rows ? rows.innerText : ''; \
         return text.includes({want:?}) ? text : false"
    )
}

/// Types a line into a terminal tab and waits until `want` shows there.
async fn type_line(browser: &Browser, presentation: &str, line: &str, want: &str) {
    browser
        .type_into(
            &format!("[data-terminal=\"{presentation}\"] .xterm-helper-textarea"),
            &format!("{line}{ENTER}"),
        )
        .await;
    browser
        .until(
            &format!("`{want}` in the terminal after `{line}`"),
            &terminal_shows(presentation, want),
            Duration::from_secs(30),
        )
        .await;
}

/// The text of the web tab's frame (from inside it), until it contains `want`.
async fn web_tab_shows(browser: &Browser, frame: &str, want: &str) {
    let started = std::time::Instant::now();
    loop {
        browser.frame(Some(frame)).await;
        let text = browser
            .run("return document.body ? document.body.innerText : ''")
            .await;
        browser.frame(None).await;
        if text.as_str().is_some_and(|t| t.contains(want)) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the web tab never showed `{want}`; it shows {text}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The page's policy violations other than the guide's inline handlers (the fixture's
/// `onerror=`, refused while DOMPurify parses the guide, before it removes them).
async fn unexpected_violations(browser: &Browser) -> Vec<String> {
    let all: Vec<String> =
        serde_json::from_value(browser.run("return window.antidoteCspViolations").await).unwrap();
    all.into_iter()
        .filter(|v| !(v.starts_with("script-src-attr ") && v.contains("/learn/vendor/purify.js")))
        .collect()
}

#[tokio::test]
async fn browser_learner_page_runs_a_lesson_with_a_terminal_and_a_web_tab() {
    let env = PageEnv::start("e2e-browser", true, Origins::PerLesson).await;
    let browser = Browser::start().await;
    browser.goto(&env.page()).await;

    // The lesson list, by collection.
    browser
        .until(
            "the lesson in its collection",
            "return document.querySelector('[data-collection=\"browser-tests\"] [data-lesson=\"web-terminal\"]') !== null",
            PATIENCE,
        )
        .await;
    let others = browser
        .run("const s = document.querySelector('[data-collection=\"\"]'); return s ? s.innerText : ''")
        .await;
    assert!(
        others
            .as_str()
            .is_some_and(|t| t.contains("Other lessons") && t.contains("Loose Box")),
        "a lesson outside any collection is listed apart: {others}"
    );
    browser.screenshot("01-lessons").await;

    // The lesson: its first stage's guide, then a request followed to READY. Every status the
    // page shows is recorded as it is shown.
    browser.click("[data-lesson=\"web-terminal\"]").await;
    browser
        .until(
            "stage one's guide",
            "return document.querySelector('#guide #guide-marker') !== null",
            PATIENCE,
        )
        .await;
    browser
        .run(
            "window.seen = []; new MutationObserver(() => { \
               const s = document.body.getAttribute('data-status'); \
               if (s && window.seen[window.seen.length - 1] !== s) window.seen.push(s); \
             }).observe(document.body, {attributes: true, attributeFilter: ['data-status']}); \
             return true",
        )
        .await;
    browser.click("#start").await;
    let ready = browser
        .until(
            "READY",
            "const s = document.body.getAttribute('data-status'); \
             if (s === 'FAILED') return 'FAILED: ' + document.getElementById('status').innerText; \
             return s === 'READY' ? s : false",
            Duration::from_secs(180),
        )
        .await;
    assert_eq!(ready, json!("READY"), "{}", env.logs());
    let seen: Vec<String> =
        serde_json::from_value(browser.run("return window.seen").await).unwrap();
    let order = ["PENDING", "BOOTING", "CONFIGURING", "READY"];
    let ranks: Vec<usize> = seen
        .iter()
        .map(|s| {
            order
                .iter()
                .position(|o| o == s)
                .unwrap_or_else(|| panic!("status {s} on the way to READY: {seen:?}"))
        })
        .collect();
    assert!(
        ranks.windows(2).all(|w| w[0] < w[1]) && seen.len() >= 2 && seen[0] == "PENDING",
        "the page showed the way to READY in order, from PENDING: {seen:?}"
    );
    let status = browser
        .run("return document.getElementById('status').innerText")
        .await;
    assert!(
        status
            .as_str()
            .is_some_and(|s| s.contains("probes healthy")),
        "endpoint health is shown: {status}"
    );
    browser.screenshot("02-ready").await;
    let id = browser
        .run("return document.getElementById('live-id').innerText")
        .await
        .as_str()
        .unwrap()
        .to_owned();

    // The terminal tab (the first): the SSH prompt, then commands and their output.
    browser
        .until(
            "the shell's prompt in the terminal tab",
            &terminal_shows("box/cli", "$"),
            Duration::from_secs(30),
        )
        .await;
    type_line(&browser, "box/cli", "echo hello-$((6*7))", "hello-42").await;
    type_line(
        &browser,
        "box/cli",
        "cat /tmp/antidote-stage",
        "stage-one-configured",
    )
    .await;
    browser.screenshot("03-terminal").await;

    // The web tab: the endpoint's page, through the entrypoint, in a frame.
    browser.click("#tab-box-web").await;
    web_tab_shows(&browser, "#panel-box-web iframe", "stage one page").await;
    browser.screenshot("04-web").await;

    // The next stage: configured again, its guide, its page, its file.
    browser.click("#stage-forward").await;
    browser
        .until(
            "stage two READY",
            "return document.body.getAttribute('data-status') === 'READY' \
               && document.getElementById('stage-label').innerText === 'Stage 2 of 2' \
               && document.querySelector('#guide #guide-marker-two') !== null",
            Duration::from_secs(120),
        )
        .await;
    browser.click("#panel-box-web .toolbar button").await;
    web_tab_shows(&browser, "#panel-box-web iframe", "stage two page").await;
    browser.click("#tab-box-cli").await;
    type_line(
        &browser,
        "box/cli",
        "cat /tmp/antidote-stage",
        "stage-two-configured",
    )
    .await;
    browser.screenshot("05-stage-two").await;
    // And back.
    browser.click("#stage-back").await;
    browser
        .until(
            "stage one READY again",
            "return document.body.getAttribute('data-status') === 'READY' \
               && document.getElementById('stage-label').innerText === 'Stage 1 of 2' \
               && document.querySelector('#guide #guide-marker') !== null",
            Duration::from_secs(120),
        )
        .await;

    // Every token the page was given so far expires; the shell exits; Reconnect opens a new
    // terminal and Reload the page again, each with a fresh URL from GetLiveLesson.
    type_line(&browser, "box/cli", "exit 0", "exited with status 0").await;
    browser
        .until(
            "the Reconnect button",
            "const b = [...document.querySelectorAll('#panel-box-cli .toolbar button')]; \
             return b.length === 1 && !b[0].hidden",
            Duration::from_secs(30),
        )
        .await;
    // Not a synchronisation: the clock must pass the tokens' expiry.
    tokio::time::sleep(Duration::from_secs(TOKEN_TTL_SECS + 1)).await;
    browser.click("#panel-box-cli .toolbar button").await;
    browser
        .until(
            "the terminal connected again",
            "return document.querySelector('#panel-box-cli .toolbar [role=status]').innerText === 'Connected.'",
            Duration::from_secs(30),
        )
        .await;
    type_line(&browser, "box/cli", "echo again-$((1+1))", "again-2").await;
    browser.click("#tab-box-web").await;
    browser.click("#panel-box-web .toolbar button").await;
    web_tab_shows(&browser, "#panel-box-web iframe", "stage one page").await;

    // xterm.js (its <style> elements), the terminal's WebSocket and the web tab's frame ran
    // under the policy without a violation.
    assert_eq!(
        unexpected_violations(&browser).await,
        Vec::<String>::new(),
        "policy violations on the page"
    );

    // Delete: the page follows it to the end.
    browser.click("#delete").await;
    browser
        .until(
            "the lesson deleted",
            "return document.body.getAttribute('data-status') === 'DELETED'",
            PATIENCE,
        )
        .await;
    browser.screenshot("06-deleted").await;
    let left = env
        .scheduler
        .clients
        .admin
        .clone()
        .list_live_lessons(api::AdminListLiveLessonsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        left.live_lessons.iter().all(|l| l.id != id),
        "live lesson {id} is still listed after the page deleted it"
    );
    browser.quit().await;
}

#[tokio::test]
async fn browser_learner_page_sends_a_strict_policy_and_never_runs_guide_scripts() {
    let env = PageEnv::start("e2e-browser-policy", false, Origins::PerLesson).await;
    let page = get(&env.page()).await;
    assert_eq!(page.status, 200, "{}", page.body);
    let policy = page
        .header("content-security-policy")
        .expect("a Content-Security-Policy")
        .to_owned();
    for part in [
        "default-src 'none'",
        "script-src 'self';",
        "frame-ancestors 'none'",
        "object-src 'none'",
        "base-uri 'none'",
    ] {
        assert!(policy.contains(part), "`{part}` in {policy}");
    }
    assert!(
        !policy.contains("unsafe-inline") && !policy.contains("unsafe-eval"),
        "{policy}"
    );
    assert_eq!(page.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(page.header("x-frame-options"), Some("DENY"));
    assert!(
        page.body.contains("src=\"/learn/app.js\"") && !page.body.contains("<script>"),
        "scripts only from files"
    );
    // The libraries were built (scheduler-svc/web/build) and embedded.
    let xterm = get(&format!("{}vendor/xterm.js", env.page())).await;
    assert_eq!(
        xterm.status, 200,
        "the page's libraries are missing: run scheduler-svc/web/build, then build again"
    );
    assert_eq!(xterm.header("x-content-type-options"), Some("nosniff"));
    let licence = get(&format!("{}vendor/LICENSE.xterm", env.page())).await;
    assert_eq!(licence.status, 200, "the libraries' licences are served");
    assert!(licence.body.contains("MIT") || licence.body.contains("Permission is hereby granted"));
    let root = get(&format!(
        "{}/",
        env.scheduler.process.extra_url("http").unwrap()
    ))
    .await;
    assert_eq!(root.status, 303);
    assert_eq!(root.header("location"), Some("/learn/"));

    // In the browser: the guide is rendered, sanitised, and nothing in it ran.
    let browser = Browser::start().await;
    browser
        .goto(&format!("{}#/lessons/web-terminal", env.page()))
        .await;
    browser
        .until(
            "stage one's guide",
            "return document.querySelector('#guide #guide-marker') !== null",
            PATIENCE,
        )
        .await;
    // The broken image's load has failed (when an `onerror` would have run).
    browser
        .until(
            "the guide's broken image tried",
            "const img = document.querySelector('#guide img'); return img !== null && img.complete",
            PATIENCE,
        )
        .await;
    let ran = browser
        .run(
            "return [typeof window.antidoteGuideScript, typeof window.antidoteGuideOnerror, \
             document.querySelectorAll('#guide script, #guide [onerror], #guide a[href^=\"javascript:\"]').length, \
             document.querySelector('#guide h1').innerText]",
        )
        .await;
    assert_eq!(
        ran,
        json!([
            "undefined",
            "undefined",
            0,
            "Stage one: a terminal and a page"
        ]),
        "the guide is shown and nothing of its script ran"
    );
    // The guide's `onerror=` was refused by the policy too, when DOMPurify parsed the guide
    // (Chrome checks inline handlers even in the inert document it parses into).
    let violations: Vec<String> =
        serde_json::from_value(browser.run("return window.antidoteCspViolations").await).unwrap();
    assert!(
        violations.iter().any(|v| v.starts_with("script-src-attr ")),
        "the guide's handler met the policy: {violations:?}"
    );
    assert_eq!(
        unexpected_violations(&browser).await,
        Vec::<String>::new(),
        "policy violations on the page"
    );
    browser.screenshot("guide-sanitised").await;
    browser.quit().await;
}

/// The page learner A writes into their own web presentation and sends learner B: its script,
/// running in B's browser, tries to read B's presentation (with B's cookies) and to open B's
/// terminal and type there, the same-origin way (a path on its own host) and on B's lesson's
/// host; it shows what happened as JSON in `#result`.
fn attack_page(b: &str, entry_port: u16) -> String {
    let script = r#"(async () => {
  const b = 'B_ID', theirs = 'B_ID.localhost:PORT', here = location.host;
  const read = async (url) => {
    try {
      const r = await fetch(url, { credentials: 'include' });
      const t = await r.text();
      return t.includes('secret-of-b-42') ? 'READ B' : 'status ' + r.status;
    } catch (e) { return 'refused ' + e.name; }
  };
  const shell = (url) => new Promise((done) => {
    let ws;
    try { ws = new WebSocket(url); } catch (e) { done('refused ' + e.name); return; }
    ws.binaryType = 'arraybuffer';
    ws.onopen = () => {
      ws.send(new TextEncoder().encode('touch /tmp/pwned-by-a; echo PWNED\r'));
      setTimeout(() => done('OPENED B'), 2000);
    };
    ws.onclose = (e) => done('closed ' + e.code);
  });
  const out = {};
  out.pathHere = await read('/l/' + b + '/box/web/secret.html');
  out.theirHost = await read('http://' + theirs + '/l/' + b + '/box/web/secret.html');
  out.shellHere = await shell('ws://' + here + '/l/' + b + '/box/cli/terminal');
  out.shellTheirs = await shell('ws://' + theirs + '/l/' + b + '/box/cli/terminal');
  out.ran = true;
  document.getElementById('result').textContent = JSON.stringify(out);
})();"#
        .replace("B_ID", b)
        .replace("PORT", &entry_port.to_string());
    format!(
        "<html><body><p>cute cat pictures</p><pre id=\"result\"></pre><script>{script}</script></body></html>"
    )
}

/// Standard base64 of `bytes` (for a file typed into a terminal as one line).
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

/// A terminal WebSocket at an `http://` entrypoint URL, connected to the entrypoint's loopback
/// port whatever the URL's host (`<id>.localhost` is loopback to browsers, not to this
/// system's resolver); a client that is no browser, so it sends no `Origin`.
async fn terminal_at(url: &str, entry_port: u16) -> crate::entrypoint::Terminal {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", entry_port))
        .await
        .unwrap();
    let ws_url = url.replacen("http://", "ws://", 1);
    match tokio_tungstenite::client_async(ws_url, stream).await {
        Ok((ws, _)) => ws,
        Err(err) => panic!("terminal at {url}: {err}"),
    }
}

/// Whether a file exists in the `box` container of live lesson `id` (looked at from outside,
/// with the docker CLI on the private engine).
fn exists_in_box(id: &str, path: &str) -> bool {
    let prefix: String = id.chars().filter(|c| *c != '-').take(12).collect();
    let docker = |args: &[&str]| {
        let output = std::process::Command::new("docker")
            .args(args)
            .output()
            .expect("the docker CLI runs");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let (_, names) = docker(&["ps", "--format", "{{.Names}}"]);
    let name = names
        .lines()
        .find(|n| n.starts_with(&format!("antidote-{prefix}")) && n.ends_with("-box"))
        .unwrap_or_else(|| panic!("no box container of {id} in {names}"))
        .to_owned();
    docker(&["exec", &name, "test", "-e", path]).0
}

/// Learner B's browser runs the lesson on the learner page (a terminal typed into, the web tab
/// shown: the page works in this mode) and keeps the cookies that gives it; learner A, whose
/// own lesson on the same agent serves a page A wrote, sends B the link, and B opens it. A's
/// page can neither read B's presentation nor open B's terminal.
async fn learners_labs_stay_apart(instance: &str, origins: Origins) {
    let env = PageEnv::start(instance, true, origins).await;
    let browser = Browser::start().await;

    // B, on the learner page.
    browser
        .goto(&format!("{}#/lessons/web-terminal", env.page()))
        .await;
    browser
        .until(
            "stage one's guide",
            "return document.querySelector('#guide #guide-marker') !== null",
            PATIENCE,
        )
        .await;
    browser.click("#start").await;
    let ready = browser
        .until(
            "READY",
            "const s = document.body.getAttribute('data-status'); \
             if (s === 'FAILED') return 'FAILED: ' + document.getElementById('status').innerText; \
             return s === 'READY' ? s : false",
            Duration::from_secs(180),
        )
        .await;
    assert_eq!(ready, json!("READY"), "{}", env.logs());
    let b = browser
        .run("return document.getElementById('live-id').innerText")
        .await
        .as_str()
        .unwrap()
        .to_owned();
    browser
        .until(
            "the shell's prompt in B's terminal tab",
            &terminal_shows("box/cli", "$"),
            Duration::from_secs(30),
        )
        .await;
    type_line(
        &browser,
        "box/cli",
        "echo secret-of-b-$((6*7)) > /www/secret.html && echo saved-$((2*3))",
        "saved-6",
    )
    .await;
    assert!(exists_in_box(&b, "/www/secret.html"), "B's secret page");
    browser.click("#tab-box-web").await;
    web_tab_shows(&browser, "#panel-box-web iframe", "stage one page").await;
    assert_eq!(
        unexpected_violations(&browser).await,
        Vec::<String>::new(),
        "policy violations on the page"
    );
    browser
        .screenshot(&format!("apart-{origins:?}-1-b-learns"))
        .await;

    // A: a lesson of their own on the same agent, and a page written into it from A's terminal.
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let a = c.request(&session, "web-terminal", 0).await.unwrap();
    let a = c
        .ready(&a.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let a_cli = &antidote_tests::presentation(&a, "box", "cli").entrypoint_url;
    let a_web = antidote_tests::presentation(&a, "box", "web")
        .entrypoint_url
        .clone();
    if origins == Origins::PerLesson {
        assert!(
            a_web.starts_with(&format!("http://{}.localhost:{}/l/", a.id, env.entry_port)),
            "A's lesson has its own origin: {a_web}"
        );
    }
    let mut terminal = terminal_at(a_cli, env.entry_port).await;
    // In lines the shell's line editor takes whole.
    let page = base64_encode(attack_page(&b, env.entry_port).as_bytes());
    for (i, part) in page.as_bytes().chunks(400).enumerate() {
        let part = std::str::from_utf8(part).unwrap();
        crate::entrypoint::run(
            &mut terminal,
            &format!("echo {part} >> /tmp/attack.b64 && echo part-$(({i}+1000))"),
            &format!("part-{}", i + 1000),
        )
        .await;
    }
    crate::entrypoint::run(
        &mut terminal,
        "base64 -d /tmp/attack.b64 > /www/attack.html && echo written-$((1+1))",
        "written-2",
    )
    .await;
    drop(terminal);

    // B opens A's link while B's cookies are fresh.
    let (base, query) = a_web.split_once('?').unwrap();
    browser.goto(&format!("{base}attack.html?{query}")).await;
    let result = browser
        .until(
            "A's page's script to finish",
            "const r = document.getElementById('result'); return r ? r.textContent : false",
            Duration::from_secs(60),
        )
        .await;
    browser
        .screenshot(&format!("apart-{origins:?}-2-a-attacks"))
        .await;
    let result: Value = serde_json::from_str(result.as_str().unwrap()).unwrap();
    eprintln!("A's page in B's browser ({origins:?}): {result}");
    assert_eq!(result["ran"], json!(true), "{result}");
    for (probe, what) in [
        ("pathHere", "B's page by path on A's page's own host"),
        ("theirHost", "B's page on B's host"),
        ("shellHere", "B's terminal by path on A's page's own host"),
        ("shellTheirs", "B's terminal on B's host"),
    ] {
        let got = result[probe].as_str().unwrap_or_default();
        assert!(
            got != "READ B" && got != "OPENED B",
            "A's page reached {what}: {result}\n{}",
            env.logs()
        );
    }
    if origins == Origins::PerLesson {
        // Same-origin to A's page, so readable: the entrypoint refused a path of B's on A's host.
        assert_eq!(result["pathHere"], json!("status 403"), "{result}");
    }
    assert!(
        !exists_in_box(&b, "/tmp/pwned-by-a"),
        "A's page typed into B's shell: {result}"
    );
    browser.quit().await;
}

#[tokio::test]
async fn browser_learners_labs_stay_apart_with_an_origin_per_lesson() {
    learners_labs_stay_apart("e2e-browser-apart-own", Origins::PerLesson).await;
}

#[tokio::test]
async fn browser_learners_labs_stay_apart_on_one_shared_origin() {
    learners_labs_stay_apart("e2e-browser-apart-shared", Origins::Shared).await;
}

/// What the page's stage bar and check feedback show: for each of `check`, `stage-forward`,
/// `passed`, `held`, `feedback` and `error`, whether it is hidden, whether it is disabled and
/// its text.
async fn check_ui(browser: &Browser) -> Value {
    browser
        .run(
            "const out = {}; \
             for (const id of ['check', 'stage-forward', 'passed', 'held', 'feedback', 'error']) { \
               const e = document.getElementById(id); \
               out[id] = { hidden: e.hidden, disabled: !!e.disabled, text: e.textContent }; \
             } \
             out.label = document.getElementById('stage-label').innerText; \
             return out",
        )
        .await
}

/// A script answering the feedback box's text once it shows a check whose `passed` is
/// `passed` and whose text contains `want`, else false.
fn feedback_shows(passed: bool, want: &str) -> String {
    format!(
        "const f = document.getElementById('feedback'); \
         return !f.hidden && f.dataset.passed === '{passed}' && f.textContent.includes({want:?}) \
           ? f.textContent : false"
    )
}

/// A learner on the learner page meets a gated stage: Check fails with the check's message
/// (what the learner typed shown as text, never markup), the next stage stays disabled; the
/// fix typed in the web terminal passes, the stage is marked and the next stage opens. On the
/// next stage (an advisory check) a check the operator started is running, so the learner's
/// Check is refused with words saying so; when it ends its result reaches the page over the
/// Watch stream.
#[tokio::test]
async fn browser_learner_checks_a_gated_stage_fixes_it_in_the_terminal_and_goes_on() {
    let env = PageEnv::start_with(
        "e2e-browser-checks",
        &checks_curriculum(),
        true,
        Origins::PerLesson,
    )
    .await;
    let browser = Browser::start().await;
    browser
        .goto(&format!("{}#/lessons/checked-answer", env.page()))
        .await;
    browser
        .until(
            "stage one's guide",
            "return document.querySelector('#guide #guide-answer') !== null",
            PATIENCE,
        )
        .await;
    let before = check_ui(&browser).await;
    assert_eq!(
        (
            &before["check"]["hidden"],
            &before["check"]["disabled"],
            &before["held"]["hidden"],
        ),
        (&json!(false), &json!(true), &json!(true)),
        "before the lesson runs, Check is shown but cannot be pressed: {before}"
    );
    browser.click("#start").await;
    let ready = browser
        .until(
            "READY",
            "const s = document.body.getAttribute('data-status'); \
             if (s === 'FAILED') return 'FAILED: ' + document.getElementById('status').innerText; \
             return s === 'READY' ? s : false",
            Duration::from_secs(180),
        )
        .await;
    assert_eq!(ready, json!("READY"), "{}", env.logs());
    let id = browser
        .run("return document.getElementById('live-id').innerText")
        .await
        .as_str()
        .unwrap()
        .to_owned();
    browser
        .until(
            "the shell's prompt in the terminal tab",
            &terminal_shows("box/cli", "$"),
            Duration::from_secs(30),
        )
        .await;
    let ui = check_ui(&browser).await;
    assert_eq!(ui["label"], json!("Stage 1 of 2"), "{ui}");
    assert_eq!(
        ui["check"]["disabled"],
        json!(false),
        "Check is offered: {ui}"
    );
    assert_eq!(
        ui["stage-forward"]["disabled"],
        json!(true),
        "the gate holds: {ui}"
    );
    assert_eq!(
        ui["held"]["hidden"],
        json!(false),
        "the gate is explained: {ui}"
    );
    assert_eq!(ui["passed"]["hidden"], json!(true), "{ui}");
    assert_eq!(
        ui["feedback"]["hidden"],
        json!(true),
        "no check ran yet: {ui}"
    );

    // Check before doing anything: the check's own message, the stage still held.
    browser.click("#check").await;
    let failed = browser
        .until(
            "the failed check's message",
            &feedback_shows(false, "/tmp/answer is missing"),
            PATIENCE,
        )
        .await;
    let failed = failed.as_str().unwrap();
    assert!(
        failed.contains("Not yet: the check failed.") && failed.contains("box (box.sh): failed"),
        "the verdict and the endpoint's file: {failed}"
    );
    let ui = check_ui(&browser).await;
    assert_eq!(
        (
            &ui["stage-forward"]["disabled"],
            &ui["passed"]["hidden"],
            &ui["held"]["hidden"],
            &ui["check"]["disabled"],
            &ui["error"]["hidden"],
        ),
        (
            &json!(true),
            &json!(true),
            &json!(false),
            &json!(false),
            &json!(true)
        ),
        "a failed check: next stage disabled, not marked, Check again possible: {ui}"
    );
    browser.screenshot("checks-1-failed").await;

    // A wrong answer holding markup: the check's output quotes it, and the page shows it as
    // text.
    type_line(
        &browser,
        "box/cli",
        "echo '<img src=x id=typed-markup>' > /tmp/answer && echo wrote-$((40+1))",
        "wrote-41",
    )
    .await;
    browser.click("#check").await;
    browser
        .until(
            "the wrong answer quoted",
            &feedback_shows(false, "holds \"<img src=x id=typed-markup>\", which is not"),
            PATIENCE,
        )
        .await;
    let markup = browser
        .run(
            "return [document.getElementById('typed-markup') === null, \
             document.querySelectorAll('#feedback img').length]",
        )
        .await;
    assert_eq!(
        markup,
        json!([true, 0]),
        "the check's output is text, not markup"
    );
    assert_eq!(
        check_ui(&browser).await["stage-forward"]["disabled"],
        json!(true)
    );

    // The fix, typed in the terminal: the check passes, the stage is marked, the gate opens.
    type_line(
        &browser,
        "box/cli",
        "echo 42 > /tmp/answer && echo wrote-$((40+2))",
        "wrote-42",
    )
    .await;
    browser.click("#check").await;
    let passed = browser
        .until(
            "the passed check",
            &feedback_shows(true, "/tmp/answer holds the answer, 42"),
            PATIENCE,
        )
        .await;
    assert!(
        passed.as_str().unwrap().contains("Check passed."),
        "{passed}"
    );
    let ui = browser
        .until(
            "the stage marked and the next one open",
            "const p = document.getElementById('passed'); \
             const f = document.getElementById('stage-forward'); \
             return !p.hidden && !f.disabled ? p.textContent : false",
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(ui, json!("✓ Stage passed"));
    let ui = check_ui(&browser).await;
    assert_eq!(ui["held"]["hidden"], json!(true), "{ui}");
    // The scheduler says the same, to the learner's own session (GetLiveLesson over JSON,
    // from the page with its cookie).
    browser
        .run(&format!(
            "window.recorded = null; \
             fetch('/v1/live-lessons/{id}', {{ credentials: 'same-origin' }}) \
               .then((r) => r.json()).then((j) => {{ window.recorded = j; }}); \
             return true"
        ))
        .await;
    let recorded = browser
        .until(
            "GetLiveLesson from the page",
            "return window.recorded",
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(recorded["passedStages"], json!([0]), "{recorded}");
    assert_eq!(
        (
            &recorded["lastCheck"]["passed"],
            &recorded["lastCheck"]["stage"]
        ),
        (&json!(true), &json!(0)),
        "{recorded}"
    );
    browser.screenshot("checks-2-passed").await;

    // The next stage: its guide; its check only advises, none ran in it yet.
    browser.click("#stage-forward").await;
    browser
        .until(
            "stage two READY",
            "return document.body.getAttribute('data-status') === 'READY' \
               && document.getElementById('stage-label').innerText === 'Stage 2 of 2' \
               && document.querySelector('#guide #guide-wait') !== null",
            Duration::from_secs(120),
        )
        .await;
    let ui = check_ui(&browser).await;
    assert_eq!(
        (
            &ui["check"]["hidden"],
            &ui["passed"]["hidden"],
            &ui["held"]["hidden"],
            &ui["feedback"]["hidden"],
        ),
        (&json!(false), &json!(true), &json!(true), &json!(true)),
        "stage two: Check offered, not passed, nothing held, stage one's feedback gone: {ui}"
    );

    // An operator's check of this stage is running (it waits for /tmp/release): the learner's
    // Check is refused, and the page says why.
    let operator = {
        let mut admin = env.scheduler.clients.admin.clone();
        let id = id.clone();
        tokio::spawn(async move {
            admin
                .test_stage(api::TestStageRequest {
                    live_lesson_id: id,
                    files: api::StageFiles::Checks as i32,
                })
                .await
                .map(tonic::Response::into_inner)
        })
    };
    let started = std::time::Instant::now();
    while !exists_in_box(&id, "/tmp/checking") {
        assert!(
            started.elapsed() < PATIENCE,
            "the operator's check never started\n{}",
            env.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    browser.click("#check").await;
    let refused = browser
        .until(
            "the refusal shown",
            "const e = document.getElementById('error'); \
             const c = document.getElementById('check'); \
             return !e.hidden && !c.disabled ? e.textContent : false",
            PATIENCE,
        )
        .await;
    assert_eq!(
        refused,
        json!("A check of this lesson is running already: its result shows here when it ends."),
    );
    browser.screenshot("checks-3-refused").await;

    // The learner releases the running check from the terminal; its result reaches the page
    // over the Watch stream, and the newer result clears the refusal.
    type_line(
        &browser,
        "box/cli",
        "touch /tmp/release && echo released-$((2+3))",
        "released-5",
    )
    .await;
    let result = operator
        .await
        .unwrap()
        .unwrap_or_else(|err| panic!("the operator's check: {err:?}\n{}", env.logs()));
    assert!(result.passed && result.stage == 1, "{result:?}");
    browser
        .until(
            "the operator's check on the page",
            &feedback_shows(true, "released: /tmp/release exists"),
            PATIENCE,
        )
        .await;
    let ui = check_ui(&browser).await;
    assert_eq!(
        (&ui["passed"]["hidden"], &ui["error"]["hidden"]),
        (&json!(false), &json!(true)),
        "stage two marked, the refusal cleared: {ui}"
    );
    assert_eq!(
        unexpected_violations(&browser).await,
        Vec::<String>::new(),
        "policy violations on the page"
    );
    browser.screenshot("checks-4-watched").await;

    browser.click("#delete").await;
    browser
        .until(
            "the lesson deleted",
            "return document.body.getAttribute('data-status') === 'DELETED'",
            PATIENCE,
        )
        .await;
    browser.quit().await;
}
