//! Who may do what: learners act only within their own session, whatever ids
//! they know; the admin API lives on its own listener and needs a bearer token with the right
//! scope; every admin call and refusal is audited without the token.

use antidote_proto::api::v1 as api;
use antidote_tests::web::Web;
use antidote_tests::{ADMIN_READ_TOKEN, ADMIN_TOKEN, with_token};
use hyper::{Method, StatusCode};
use tonic::Code;
use tonic_types::StatusExt as _;

use crate::{Env, Knobs};

/// The code and typed reason of a refused call.
fn refusal<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> (Code, String) {
    let status = result.expect_err("the call is refused");
    let reason = status
        .get_details_error_info()
        .map(|info| info.reason)
        .unwrap_or_default();
    (status.code(), reason)
}

#[tokio::test]
async fn a_learner_cannot_touch_another_learners_lesson() {
    let env = Env::start(&[], Knobs::default()).await;
    let c = &env.scheduler.clients;
    let alice = c.session().await.unwrap();
    let lesson = c.request(&alice, "hello-web", 0).await.unwrap();
    let ready = c.ready(&lesson.id).await.unwrap();
    let alice_token = c.tokens.of_session(&alice);
    let bob = c.session().await.unwrap();
    let bob_token = c.tokens.of_session(&bob);
    assert_ne!(alice_token, bob_token);

    let id = lesson.id.clone();
    // A client that sends only the tokens given (the harness's would add the latest one).
    let lessons = api::live_lesson_service_client::LiveLessonServiceClient::new(c.channel.clone());
    let as_bob = |token: Option<String>| {
        let (mut lessons, id, alice) = (lessons.clone(), id.clone(), alice.clone());
        async move {
            let not_found = (Code::NotFound, "LIVE_LESSON_NOT_FOUND".to_owned());
            let get = lessons
                .get_live_lesson(with_token(
                    api::GetLiveLessonRequest { id: id.clone() },
                    token.clone(),
                ))
                .await;
            let watch = lessons
                .watch_live_lesson(with_token(
                    api::WatchLiveLessonRequest { id: id.clone() },
                    token.clone(),
                ))
                .await;
            let stage = lessons
                .set_stage(with_token(
                    api::SetStageRequest {
                        id: id.clone(),
                        stage: 1,
                    },
                    token.clone(),
                ))
                .await;
            let beat = lessons
                .heartbeat(with_token(
                    api::HeartbeatRequest { id: id.clone() },
                    token.clone(),
                ))
                .await;
            let delete = lessons
                .delete_live_lesson(with_token(
                    api::DeleteLiveLessonRequest { id: id.clone() },
                    token.clone(),
                ))
                .await;
            let list = lessons
                .list_live_lessons(with_token(
                    api::ListLiveLessonsRequest {
                        session_id: alice.clone(),
                    },
                    token.clone(),
                ))
                .await;
            let request = lessons
                .request_live_lesson(with_token(
                    api::RequestLiveLessonRequest {
                        session_id: alice,
                        lesson_slug: "netcat-toolbox".into(),
                        stage: 0,
                        placement: None,
                    },
                    token,
                ))
                .await;
            (
                [
                    refusal(get),
                    refusal(watch),
                    refusal(stage),
                    refusal(beat),
                    refusal(delete),
                ],
                [refusal(list), refusal(request)],
                not_found,
            )
        }
    };
    // Bob's own token: every call about Alice's lesson is NOT_FOUND, as for an unknown id.
    let (lesson_calls, session_calls, not_found) = as_bob(bob_token.clone()).await;
    for refused in lesson_calls {
        assert_eq!(refused, not_found);
    }
    for refused in session_calls {
        assert_eq!(refused, (Code::NotFound, "SESSION_NOT_FOUND".to_owned()));
    }
    // No token, or a made-up one: UNAUTHENTICATED.
    for token in [None, Some("ast_0000".to_owned())] {
        let (lesson_calls, session_calls, _) = as_bob(token).await;
        for refused in lesson_calls.into_iter().chain(session_calls) {
            assert_eq!(
                refused,
                (Code::Unauthenticated, "UNAUTHENTICATED".to_owned())
            );
        }
    }

    // Over HTTP too: Bob's browser (its own session cookie) gets 404 for Alice's lesson.
    let base = env.scheduler.process.extra_url("http").unwrap();
    let browser = Web::default();
    browser
        .post(&format!("{base}/v1/sessions"), "")
        .await
        .unwrap();
    for (method, path, body) in [
        (Method::GET, format!("/v1/live-lessons/{id}"), None),
        (Method::GET, format!("/v1/live-lessons/{id}/watch"), None),
        (
            Method::PUT,
            format!("/v1/live-lessons/{id}/stage"),
            Some(r#"{"stage": 1}"#),
        ),
        (
            Method::POST,
            format!("/v1/live-lessons/{id}/heartbeat"),
            Some("{}"),
        ),
        (Method::DELETE, format!("/v1/live-lessons/{id}"), None),
    ] {
        let answer = browser
            .send(method.clone(), &format!("{base}{path}"), &[], body)
            .await
            .unwrap();
        assert_eq!(
            answer.status,
            StatusCode::NOT_FOUND,
            "{method} {path}: {}",
            answer.body
        );
        assert_eq!(answer.json().unwrap()["reason"], "LIVE_LESSON_NOT_FOUND");
    }

    // Nothing about Alice's lesson changed.
    let after = c
        .lessons
        .clone()
        .get_live_lesson(with_token(
            api::GetLiveLessonRequest { id: id.clone() },
            alice_token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            after.status(),
            after.stage,
            after.generation,
            after.last_active
        ),
        (
            ready.status(),
            ready.stage,
            ready.generation,
            ready.last_active
        )
    );
}

#[tokio::test]
async fn the_admin_api_needs_its_listener_a_token_and_the_scope() {
    let env = Env::start(&[], Knobs::default()).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id).await.unwrap();

    // The learners' listener does not serve AdminService at all.
    let mut on_learners = api::admin_service_client::AdminServiceClient::new(c.channel.clone());
    let status = on_learners
        .list_sessions(with_token(
            api::ListSessionsRequest {},
            Some(ADMIN_TOKEN.into()),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");

    // On its own listener: no token, a wrong one, a read-only one for a kill.
    let mut admin = api::admin_service_client::AdminServiceClient::new(c.admin_channel.clone());
    let kill = |token: Option<&str>| {
        with_token(
            api::KillLiveLessonRequest {
                id: lesson.id.clone(),
            },
            token.map(str::to_owned),
        )
    };
    assert_eq!(
        refusal(admin.kill_live_lesson(kill(None)).await),
        (Code::Unauthenticated, "UNAUTHENTICATED".into())
    );
    assert_eq!(
        refusal(admin.kill_live_lesson(kill(Some("guess"))).await),
        (Code::Unauthenticated, "UNAUTHENTICATED".into())
    );
    assert_eq!(
        refusal(admin.kill_live_lesson(kill(Some(ADMIN_READ_TOKEN))).await),
        (Code::PermissionDenied, "PERMISSION_DENIED".into())
    );
    // The read-only token may read; the lesson is still READY.
    let listed = admin
        .list_live_lessons(with_token(
            api::AdminListLiveLessonsRequest::default(),
            Some(ADMIN_READ_TOKEN.into()),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.live_lessons.len(), 1);
    assert_eq!(
        listed.live_lessons[0].status(),
        api::LiveLessonStatus::Ready
    );
    // The write token kills.
    admin
        .kill_live_lesson(kill(Some(ADMIN_TOKEN)))
        .await
        .unwrap();

    // Every call and refusal is audited with who did it, never the token.
    let audit = admin
        .list_audit(with_token(
            api::ListAuditRequest { limit: 10 },
            Some(ADMIN_READ_TOKEN.into()),
        ))
        .await
        .unwrap()
        .into_inner()
        .entries;
    let lines: Vec<String> = audit
        .iter()
        .rev()
        .map(|e| format!("{} {} {} {}", e.identity, e.action, e.target, e.outcome))
        .collect();
    let kill_target = &lesson.id;
    for expected in [
        format!("anonymous AdminService.KillLiveLesson {kill_target} UNAUTHENTICATED"),
        format!("token:viewer AdminService.KillLiveLesson {kill_target} PERMISSION_DENIED"),
        "token:viewer AdminService.ListLiveLessons  ok".to_owned(),
        format!("token:tests AdminService.KillLiveLesson {kill_target} ok"),
    ] {
        assert!(lines.contains(&expected), "no `{expected}` in {lines:#?}");
    }
    let text = format!("{audit:?}");
    for secret in [ADMIN_TOKEN, ADMIN_READ_TOKEN] {
        assert!(!text.contains(secret), "the audit log holds a token");
    }
    assert!(
        !env.logs().contains(ADMIN_TOKEN),
        "the scheduler's log holds a token"
    );

    // JSON: the same rules on the admin HTTP listener; the learners' answers 404.
    let admin_http = env.scheduler.process.extra_url("admin http").unwrap();
    let web = Web::default();
    let anonymous = web
        .get(&format!("{admin_http}/v1/admin/sessions"))
        .await
        .unwrap();
    assert_eq!(
        anonymous.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        anonymous.body
    );
    let read_only = format!("Bearer {ADMIN_READ_TOKEN}");
    let denied = web
        .send(
            Method::PUT,
            &format!("{admin_http}/v1/admin/sessions/{session}/persistent"),
            &[("authorization", &read_only)],
            Some(r#"{"persistent": true}"#),
        )
        .await
        .unwrap();
    assert_eq!(denied.status, StatusCode::FORBIDDEN, "{}", denied.body);
    assert_eq!(denied.json().unwrap()["reason"], "PERMISSION_DENIED");
    let learners = env.scheduler.process.extra_url("http").unwrap();
    let hidden = web
        .send(
            Method::GET,
            &format!("{learners}/v1/admin/sessions"),
            &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            None,
        )
        .await
        .unwrap();
    assert_eq!(hidden.status, StatusCode::NOT_FOUND, "{}", hidden.body);
    let metrics = web.get(&format!("{learners}/metrics")).await.unwrap();
    assert_eq!(
        metrics.status,
        StatusCode::NOT_FOUND,
        "no table scans for anyone on the learners' listener"
    );
}

/// A stranger who reaches the admin listener cannot grow the audit log at will: its refusals
/// are audited a few per client network and minute (the rest only logged), while operators'
/// calls and refusals with a known identity are always audited.
#[tokio::test]
async fn unauthenticated_refusals_are_audited_a_few_per_address() {
    let env = Env::start(&[], Knobs::default()).await;
    let c = &env.scheduler.clients;
    let mut admin = api::admin_service_client::AdminServiceClient::new(c.admin_channel.clone());
    for n in 0..50 {
        let token = (n % 2 == 0).then(|| format!("guess-{n}"));
        assert_eq!(
            refusal(
                admin
                    .list_sessions(with_token(api::ListSessionsRequest {}, token))
                    .await
            )
            .0,
            Code::Unauthenticated
        );
    }
    for _ in 0..3 {
        assert_eq!(
            refusal(
                admin
                    .kill_live_lesson(with_token(
                        api::KillLiveLessonRequest {
                            id: "00000000-0000-0000-0000-000000000000".into(),
                        },
                        Some(ADMIN_READ_TOKEN.into()),
                    ))
                    .await
            )
            .0,
            Code::PermissionDenied
        );
    }
    let audit = admin
        .list_audit(with_token(
            api::ListAuditRequest { limit: 1000 },
            Some(ADMIN_READ_TOKEN.into()),
        ))
        .await
        .unwrap()
        .into_inner()
        .entries;
    let count = |outcome: &str| audit.iter().filter(|e| e.outcome == outcome).count();
    assert_eq!(count("UNAUTHENTICATED"), 10, "{audit:#?}");
    assert_eq!(count("PERMISSION_DENIED"), 3, "{audit:#?}");
}

/// The session cookie is `Secure` when the learner came over TLS (to the proxy in front of the
/// scheduler, which says so in `X-Forwarded-Proto` or `Forwarded`), and only then.
#[tokio::test]
async fn the_session_cookie_is_secure_behind_an_https_proxy() {
    let env = Env::start(&[], Knobs::default()).await;
    let base = env.scheduler.process.extra_url("http").unwrap();
    let web = Web::default();
    let cookie = |headers: &'static [(&'static str, &'static str)]| {
        let (web, url) = (web.fresh_jar(), format!("{base}/v1/sessions"));
        async move {
            let answer = web
                .send(Method::POST, &url, headers, Some(""))
                .await
                .unwrap();
            assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
            answer.headers["set-cookie"].to_str().unwrap().to_owned()
        }
    };
    for headers in [
        &[("x-forwarded-proto", "https")][..],
        &[("forwarded", "for=192.0.2.1;proto=https")][..],
    ] {
        let set = cookie(headers).await;
        assert!(
            set.contains("; Secure") && set.contains("HttpOnly"),
            "{headers:?}: {set}"
        );
    }
    for headers in [&[][..], &[("x-forwarded-proto", "http")][..]] {
        let set = cookie(headers).await;
        assert!(!set.contains("Secure"), "{headers:?}: {set}");
    }
}

/// deploy/k8s: Prometheus scrapes `/metrics` where the scheduler serves it without a token, the
/// admin section's `metrics_listen` (the admin HTTP listener wants an admin:read token, the
/// learners' port answers 404), and the container declares that port.
/// (`deploy::deploy_scheduler_configurations_start_the_scheduler` starts this ConfigMap.)
#[test]
fn deploy_k8s_scrapes_metrics_on_the_admin_listener() {
    let docs = crate::deploy::documents(&crate::deploy::k8s_dir().join("scheduler.yaml"));
    let config = crate::deploy::scheduler_config(&docs);
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the scheduler's Deployment");
    let template = &deployment["spec"]["template"];
    let annotations = &template["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let port = annotations["prometheus.io/port"]
        .as_str()
        .expect("a prometheus.io/port annotation");
    // The port of `listen = "…"` in the TOML table `[table]`.
    let listen = |table: &str, key: &str| {
        let body = config
            .split(&format!("[{table}]\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("no [{table}] in:\n{config}"));
        let line = body
            .lines()
            .take_while(|l| !l.trim_start().starts_with('['))
            .find(|l| l.trim_start().starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("no {key} in [{table}]:\n{config}"));
        line.trim()
            .trim_end_matches('"')
            .rsplit(':')
            .next()
            .unwrap()
            .to_owned()
    };
    assert_eq!(
        port,
        listen("admin", "metrics_listen"),
        "the scrape misses the metrics listener"
    );
    assert_ne!(
        port,
        listen("http", "listen"),
        "the learners' port has no /metrics"
    );
    let declared = template["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| {
            p["containerPort"]
                .as_u64()
                .map(|n| n.to_string())
                .as_deref()
                == Some(port)
        });
    assert!(declared, "the container does not declare port {port}");
}

/// The quickstart's admin path: the scheduler with deploy/local/antidote.toml plus the token
/// block deploy/local/run appends (its own printf line, run here), and `antidotectl admin`
/// without `--token` finds the token file from a directory below the checkout's root; from a
/// directory outside it, the call is UNAUTHENTICATED.
#[tokio::test]
async fn the_quickstart_admin_token_is_found_from_any_directory_of_the_checkout() {
    use sha2::Digest as _;
    let repo = crate::deploy::repo();
    let checkout = tempfile::tempdir().unwrap();
    let quickstart = checkout.path().join("target/quickstart");
    std::fs::create_dir_all(&quickstart).unwrap();
    let token = hex::encode(sha2::Sha256::digest(
        format!("{:?}{:?}", std::time::SystemTime::now(), checkout.path()).as_bytes(),
    ));
    std::fs::write(quickstart.join("admin-token"), &token).unwrap();
    let hash = hex::encode(sha2::Sha256::digest(token.as_bytes()));
    let run = std::fs::read_to_string(repo.join("deploy/local/run")).unwrap();
    let append = run
        .lines()
        .find(|l| l.contains("[[admin.tokens]]"))
        .expect("deploy/local/run appends an [[admin.tokens]] block");
    let block = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("token_hash={hash}\n{append}"))
        .output()
        .unwrap();
    assert!(block.status.success(), "{block:?}");
    let config = std::fs::read_to_string(repo.join("deploy/local/antidote.toml")).unwrap()
        + &String::from_utf8(block.stdout).unwrap();
    let path = checkout.path().join("antidote.toml");
    std::fs::write(&path, config).unwrap();
    // Its addresses, database and curriculum moved here (the real quickstart may be running).
    let any = || "127.0.0.1:0".to_owned();
    let env = [
        ("ANTIDOTE_LISTEN", any()),
        ("ANTIDOTE_HTTP__LISTEN", any()),
        ("ANTIDOTE_ADMIN__LISTEN", any()),
        ("ANTIDOTE_ADMIN__HTTP_LISTEN", any()),
        (
            "ANTIDOTE_DATABASE",
            checkout.path().join("antidote.db").display().to_string(),
        ),
        (
            "ANTIDOTE_CURRICULUM",
            repo.join("deploy/curriculum").display().to_string(),
        ),
    ];
    let scheduler = antidote_tests::Process::spawn_with_env(
        &antidote_tests::workspace_bin("scheduler-svc"),
        &[
            "serve".into(),
            "--config".into(),
            path.display().to_string(),
        ],
        &env,
        checkout.path().join("scheduler.log"),
    )
    .await
    .expect("the scheduler starts with the quickstart's configuration");
    let ctl = |cwd: &std::path::Path| {
        std::process::Command::new(antidote_tests::workspace_bin("antidotectl"))
            .current_dir(cwd)
            .arg("--server")
            .arg(scheduler.url())
            .arg("--admin-server")
            .arg(scheduler.extra_url("admin").unwrap())
            .env("ANTIDOTE_STATE_DIR", checkout.path().join("state"))
            .env_remove("ANTIDOTE_TOKEN")
            .args(["admin", "list"])
            .output()
            .expect("antidotectl runs")
    };
    let below = checkout.path().join("some/where/deep");
    std::fs::create_dir_all(&below).unwrap();
    let found = ctl(&below);
    assert!(
        found.status.success(),
        "antidotectl admin from {} did not find the token: {}",
        below.display(),
        String::from_utf8_lossy(&found.stderr)
    );
    let outside = tempfile::tempdir().unwrap();
    let refused = ctl(outside.path());
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("UNAUTHENTICATED"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
