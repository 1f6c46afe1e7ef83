//! The learners' way in through agent-k8s's entrypoint (`--entrypoint-listen`), on the real
//! test node: the entrypoint-curriculum's `terminal` lesson runs `antidote/sshd` (dropbear, a
//! real SSH server, and busybox httpd) in a pod, which the entrypoint reaches at its pod address
//! as it would from inside a cluster. The scheduler hands out the URLs with tokens it signs; a
//! WebSocket terminal logs in to the pod's SSH server and runs commands there (the pod's own
//! hostname answers), the HTTP presentation's page arrives through the proxy; no token, an
//! expired one, and tokens for another live lesson or endpoint or of another key are refused;
//! keystrokes keep a lesson alive past its idle TTL, an idle open terminal does not.

use std::path::Path;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_sdk::entrypoint::{Claims, Signer};
use antidote_tests::command::output_with_input;
use antidote_tests::config::secs;
use antidote_tests::presentation;
use futures::{SinkExt as _, StreamExt as _};
use tokio_tungstenite::tungstenite::Message;

use crate::PATIENCE;
use crate::entrypoint::{KEY, get, read_until, run, unix_now, websocket, with_token};
use crate::k8s::K8sEnv;

/// agent-k8s with its entrypoint and a scheduler signing tokens for it, on the entrypoint
/// curriculum; `ttl` is the live lessons' idle TTL.
struct EntryEnv(K8sEnv);

impl std::ops::Deref for EntryEnv {
    type Target = K8sEnv;

    fn deref(&self) -> &K8sEnv {
        &self.0
    }
}

impl EntryEnv {
    async fn start(instance: &str, ttl: Duration) -> EntryEnv {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k1.pem");
        std::fs::write(&key, KEY).unwrap();
        let curriculum = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/entrypoint-curriculum")
            .canonicalize()
            .unwrap();
        let config = crate::k8s::scheduler_config(instance, &curriculum)
            .with_lesson_ttl(ttl)
            .with_entrypoint_keys(&[("k1", &key)], secs(120));
        let agent_extra = [
            "--entrypoint-listen",
            "127.0.0.1:0",
            "--entrypoint-activity-interval",
            "500ms",
        ];
        EntryEnv(K8sEnv::with_config(dir, config, &agent_extra).await)
    }

    /// A new session's `terminal` lesson, READY.
    async fn lesson(&self) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let requested = c.request(&session, "terminal", 0).await.unwrap();
        c.ready(&requested.id)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()))
    }
}

#[tokio::test]
async fn k8s_entrypoint_terminal_and_http_proxy_reach_pods_with_their_tokens() {
    let env = EntryEnv::start("k8s-entry", secs(30 * 60)).await;
    let (dir, agent, scheduler) = (&env.dir, &env.agent, &env.scheduler);
    let logs = || env.logs();
    let c = &scheduler.clients;
    let session = c.session().await.unwrap();
    let requested = c.request(&session, "terminal", 0).await.unwrap();
    let lesson = c
        .ready(&requested.id)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs()));
    let entry = agent.extra_url("entrypoint").unwrap();
    let cli = presentation(&lesson, "box", "cli").entrypoint_url.clone();
    let page = presentation(&lesson, "box", "web").entrypoint_url.clone();
    assert!(
        cli.starts_with(&format!(
            "{entry}/l/{}/box/cli/terminal?antidote_token=",
            lesson.id
        )),
        "{cli}"
    );
    // The pod's page, through the proxy, from its own httpd.
    let answer = get(&page, &[]).await;
    assert_eq!(answer.status, 200, "{}\n{}", answer.body, logs());
    assert!(
        answer.body.contains("antidote/sshd"),
        "the pod's page: {}",
        answer.body
    );
    assert_eq!(
        get(&with_token(&page, None), &[]).await.status,
        401,
        "the page without a token"
    );

    // A terminal on the box pod: the entrypoint logs in to its SSH server with the image's
    // credentials, and the shell is the pod's own (its hostname is the endpoint's name).
    let mut terminal = websocket(&cli)
        .await
        .unwrap_or_else(|status| panic!("terminal refused with {status}\n{}", logs()));
    let out = run(
        &mut terminal,
        "echo hello-$((6*7))-$(hostname)",
        "hello-42-box",
    )
    .await;
    assert!(out.contains("hello-42-box"), "{out}");
    terminal
        .send(Message::Binary(b"echo typed-$((2+3))\r".to_vec().into()))
        .await
        .unwrap();
    read_until(&mut terminal, "typed-5").await;
    drop(terminal);

    // Refusals: no token, an expired one, one for another live lesson, one for another
    // endpoint, one signed by a stranger.
    let signer = Signer::from_pem("k1", KEY.as_bytes()).unwrap();
    let mut expired = Claims::new(&lesson.id, "box", "cli", Duration::from_secs(60));
    expired.exp = unix_now() - 120;
    let expired = signer.sign(&expired);
    let other_lesson = signer.sign(&Claims::new(
        &format!("{}x", lesson.id),
        "box",
        "cli",
        Duration::from_secs(60),
    ));
    let other_page = signer.sign(&Claims::new(
        &format!("{}x", lesson.id),
        "box",
        "web",
        Duration::from_secs(60),
    ));
    let web_cli = signer.sign(&Claims::new(
        &lesson.id,
        "nobox",
        "cli",
        Duration::from_secs(60),
    ));
    let stranger = Signer::generate("k1").sign(&Claims::new(
        &lesson.id,
        "box",
        "cli",
        Duration::from_secs(60),
    ));
    for (token, want, what) in [
        (None, 401, "no token"),
        (Some(expired.as_str()), 401, "an expired token"),
        (Some(stranger.as_str()), 401, "a token of another key"),
        (
            Some(other_lesson.as_str()),
            403,
            "a token for another live lesson",
        ),
        (Some(web_cli.as_str()), 403, "a token for another endpoint"),
    ] {
        let refused = websocket(&with_token(&cli, token)).await.err();
        assert_eq!(refused, Some(want), "terminal with {what}");
    }
    for (token, want, what) in [
        (None, 401, "no token"),
        (Some(expired.as_str()), 401, "an expired token"),
        (
            Some(other_page.as_str()),
            403,
            "a token for another live lesson",
        ),
    ] {
        let refused = get(&with_token(&page, token), &[]).await;
        assert_eq!(refused.status, want, "page with {what}: {}", refused.body);
    }

    // antidotectl ssh: the same way in from a terminal (here a pipe), the remote shell's exit
    // status for its own; without the session's token it gets nothing.
    let ctl = |token: Option<String>, endpoint: &str, input: &'static str| {
        let mut command = std::process::Command::new(antidote_tests::workspace_bin("antidotectl"));
        command
            .args([
                "--server",
                &scheduler.process.url(),
                "ssh",
                &lesson.id,
                endpoint,
            ])
            .env("ANTIDOTE_STATE_DIR", dir.path().join("ctl-state"));
        if let Some(token) = token {
            command.env("ANTIDOTE_SESSION_TOKEN", token);
        }
        // A refused `ssh` exits before it reads its input: what it printed and its exit
        // status are the test's, not the write.
        async move {
            output_with_input(command, input.as_bytes(), Duration::from_secs(60))
                .await
                .expect("antidotectl ssh ends")
        }
    };
    let token = c.tokens.of_lesson(&lesson.id);
    let out = ctl(token.clone(), "box", "echo via-$((40+2))\nexit 7\n").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("via-42"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(7), "{stdout}");
    let stranger = ctl(None, "box", "exit 0\n").await;
    let stderr = String::from_utf8_lossy(&stranger.stderr);
    assert_eq!(stranger.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("UNAUTHENTICATED"), "{stderr}");
    let nowhere = ctl(token, "nowhere", "exit 0\n").await;
    let stderr = String::from_utf8_lossy(&nowhere.stderr);
    assert!(
        stderr.contains("no endpoint `nowhere`") && stderr.contains("box"),
        "{stderr}"
    );

    c.lessons
        .clone()
        .delete_live_lesson(antidote_tests::with_token(
            api::DeleteLiveLessonRequest {
                id: lesson.id.clone(),
            },
            c.tokens.of_lesson(&lesson.id),
        ))
        .await
        .unwrap();
    c.gone(&lesson.id, PATIENCE).await.unwrap();
}

/// Keystrokes through the entrypoint keep a lesson on the real node alive past its idle TTL;
/// a terminal left open and untouched does not, and it ends when its lesson goes.
#[tokio::test]
async fn k8s_typing_keeps_a_lesson_alive_past_its_ttl_and_an_idle_terminal_does_not() {
    const TTL: Duration = Duration::from_secs(20);
    let env = EntryEnv::start("k8s-entry-ttl", TTL).await;
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
        if idle_gone.is_none() && !crate::entrypoint::alive(&env.scheduler.clients, &idle.id).await
        {
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
        crate::entrypoint::alive(&env.scheduler.clients, &busy.id).await,
        "the typing learner's lesson was reaped (the idle one went after {idle_gone:?})\n{}",
        env.logs()
    );
    // The idle terminal ends with its lesson's pod.
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
    drop(typing);
    let c = &env.scheduler.clients;
    c.delete(&busy.id, PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", env.logs()));
}
