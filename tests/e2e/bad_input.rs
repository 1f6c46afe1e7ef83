//! Bad input gets the right code, a message naming the problem, and changes nothing.

use antidote_proto::api::v1 as api;
use antidote_tests::workspace_bin;
use tonic::Code;
use tonic_types::StatusExt as _;

use crate::{Env, Knobs};

/// What the store holds, as the admin API shows it.
async fn snapshot(env: &Env) -> (Vec<String>, Vec<(String, i32, u64)>) {
    let c = &env.scheduler.clients;
    let sessions = c
        .admin
        .clone()
        .list_sessions(api::ListSessionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .sessions;
    let lessons = c
        .admin
        .clone()
        .list_live_lessons(api::AdminListLiveLessonsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .live_lessons;
    (
        sessions.into_iter().map(|s| s.id).collect(),
        lessons
            .into_iter()
            .map(|l| (l.id, l.stage as i32, l.generation))
            .collect(),
    )
}

/// The ErrorInfo reason of a status (domain antidote.io), or a panic saying it has none.
fn reason(status: &tonic::Status) -> String {
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.domain, "antidote.io", "{info:?}");
    info.reason
}

/// Runs one bad call and checks code, typed reason, message and that the store did not change.
async fn check<T: std::fmt::Debug>(
    env: &Env,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
    (code, why): (Code, &str),
    names: &[&str],
) {
    let before = snapshot(env).await;
    let status = call.await.expect_err("the call is refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(reason(&status), why, "{status:?}");
    for name in names {
        assert!(
            status.message().contains(name),
            "`{}` does not name `{name}`",
            status.message()
        );
    }
    assert_eq!(
        snapshot(env).await,
        before,
        "the store changed after a refused call"
    );
}

#[tokio::test]
async fn bad_requests_get_the_right_code_and_change_nothing() {
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config()
                .with_sessions_per_ip(2)
                .with_lessons_per_session(1),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let existing = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&existing.id).await.unwrap();
    let unknown = uuid::Uuid::new_v4().to_string();

    check(
        &env,
        c.request(&session, "no-such-lesson", 0),
        (Code::NotFound, "LESSON_NOT_FOUND"),
        &["no-such-lesson"],
    )
    .await;
    check(
        &env,
        c.request(&session, "", 0),
        (Code::InvalidArgument, "INVALID_FIELD"),
        &["lesson_slug"],
    )
    .await;
    check(
        &env,
        c.request(&session, &"x".repeat(5000), 0),
        (Code::InvalidArgument, "INVALID_FIELD"),
        &["lesson_slug"],
    )
    .await;
    check(
        &env,
        c.request("not-a-uuid", "hello-web", 0),
        (Code::InvalidArgument, "MALFORMED_ID"),
        &["not-a-uuid", "session id"],
    )
    .await;
    check(
        &env,
        c.request(&unknown, "hello-web", 0),
        (Code::NotFound, "SESSION_NOT_FOUND"),
        &[&unknown],
    )
    .await;
    check(
        &env,
        c.request(&session, "routing-basics", 7),
        (Code::InvalidArgument, "STAGE_OUT_OF_RANGE"),
        &["stage 7", "routing-basics"],
    )
    .await;
    // The session holds its one allowed live lesson.
    check(
        &env,
        c.request(&session, "routing-basics", 0),
        (Code::ResourceExhausted, "TOO_MANY_LIVE_LESSONS"),
        &[&session, "1 live lessons"],
    )
    .await;
    // Stage out of range on an existing live lesson.
    let set = |id: &str, stage| {
        let mut lessons = c.lessons.clone();
        let id = id.to_owned();
        async move {
            lessons
                .set_stage(api::SetStageRequest { id, stage })
                .await
                .map(|r| r.into_inner())
        }
    };
    check(
        &env,
        set(&existing.id, 3),
        (Code::InvalidArgument, "STAGE_OUT_OF_RANGE"),
        &["stage 3", "hello-web"],
    )
    .await;
    check(
        &env,
        set("garbage", 0),
        (Code::InvalidArgument, "MALFORMED_ID"),
        &["garbage", "live lesson id"],
    )
    .await;
    check(
        &env,
        set(&unknown, 0),
        (Code::NotFound, "LIVE_LESSON_NOT_FOUND"),
        &[&unknown],
    )
    .await;
    let get = |id: String| {
        let mut lessons = c.lessons.clone();
        async move {
            lessons
                .get_live_lesson(api::GetLiveLessonRequest { id })
                .await
                .map(|r| r.into_inner())
        }
    };
    check(
        &env,
        get(unknown.clone()),
        (Code::NotFound, "LIVE_LESSON_NOT_FOUND"),
        &[&unknown],
    )
    .await;
    check(
        &env,
        get("1234".into()),
        (Code::InvalidArgument, "MALFORMED_ID"),
        &["1234"],
    )
    .await;
    let delete = |id: String| {
        let mut lessons = c.lessons.clone();
        async move {
            lessons
                .delete_live_lesson(api::DeleteLiveLessonRequest { id })
                .await
                .map(|r| r.into_inner())
        }
    };
    check(
        &env,
        delete(unknown.clone()),
        (Code::NotFound, "LIVE_LESSON_NOT_FOUND"),
        &[&unknown],
    )
    .await;
    let heartbeat = |id: String| {
        let mut lessons = c.lessons.clone();
        async move {
            lessons
                .heartbeat(api::HeartbeatRequest { id })
                .await
                .map(|r| r.into_inner())
        }
    };
    check(
        &env,
        heartbeat(unknown.clone()),
        (Code::NotFound, "LIVE_LESSON_NOT_FOUND"),
        &[&unknown],
    )
    .await;

    // Per-IP session limit: 2 allowed, one taken above.
    c.session().await.unwrap();
    let create = || {
        let mut sessions = c.sessions.clone();
        async move {
            sessions
                .create_session(api::CreateSessionRequest {})
                .await
                .map(|r| r.into_inner())
        }
    };
    check(
        &env,
        create(),
        (Code::ResourceExhausted, "TOO_MANY_SESSIONS"),
        &["127.0.0.1", "2 sessions"],
    )
    .await;

    // An oversized request is refused before it reaches any handler.
    let huge = api::RequestLiveLessonRequest {
        session_id: session.clone(),
        lesson_slug: "y".repeat(200_000),
        stage: 0,
        placement: None,
    };
    let mut lessons = c.lessons.clone();
    let before = snapshot(&env).await;
    let status = lessons.request_live_lesson(huge).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(reason(&status), "REQUEST_TOO_LARGE");
    assert!(
        status.message().contains("too large") || status.message().contains("limit"),
        "{status:?}"
    );
    assert_eq!(snapshot(&env).await, before);

    // Unknown lessons in the catalog API.
    let status = c
        .curriculum
        .clone()
        .get_lesson(api::GetLessonRequest {
            slug: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(reason(&status), "LESSON_NOT_FOUND");
    assert_eq!(
        status.get_details_error_info().unwrap().metadata["lesson"],
        "nope"
    );
    assert!(status.message().contains("`nope`"), "{status:?}");
}

#[tokio::test]
async fn a_malformed_curriculum_stops_start_up_naming_file_and_problem() {
    let dir = tempfile::tempdir().unwrap();
    let curriculum = dir.path().join("curriculum");
    let lesson = curriculum.join("lessons/broken");
    std::fs::create_dir_all(&lesson).unwrap();
    std::fs::write(curriculum.join("curriculum.meta.yaml"), "name: Broken\n").unwrap();
    std::fs::write(
        lesson.join("lesson.meta.yaml"),
        "name: [unclosed\nslug: broken\n",
    )
    .unwrap();

    // `validate` reports it offline…
    let output = std::process::Command::new(workspace_bin("scheduler-svc"))
        .args(["validate", &curriculum.display().to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("lessons/broken/lesson.meta.yaml"),
        "{stderr}"
    );
    assert!(stderr.contains("malformed yaml"), "{stderr}");

    // …and `serve` refuses to start with the same message.
    let config = dir.path().join("antidote.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"{}\"\ncurriculum = \"{}\"\n",
            dir.path().join("db").display(),
            curriculum.display()
        ),
    )
    .unwrap();
    let output = std::process::Command::new(workspace_bin("scheduler-svc"))
        .args(["serve", "--config", &config.display().to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("lessons/broken/lesson.meta.yaml"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("db").exists(),
        "nothing was written before the catalog loaded"
    );

    // A bad configuration value names its key.
    std::fs::write(&config, "[ttl]\nlive_lesson = \"eventually\"\n").unwrap();
    let output = std::process::Command::new(workspace_bin("scheduler-svc"))
        .args(["serve", "--config", &config.display().to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("ttl.live_lesson"), "{stderr}");
}

/// Writes a curriculum in Antidote's format: two prod lessons, and a ptr lesson whose endpoint
/// names an image the curriculum does not define (real curricula hold such lessons).
fn tiered_curriculum(root: &std::path::Path) {
    let write = |path: &str, text: &str| {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("curriculum.meta.yaml", "name: Tiers\n");
    write(
        "images/box/image.meta.yaml",
        "slug: box\nflavor: untrusted\n",
    );
    for (dir, slug, tier, image) in [
        ("intro", "intro", "prod", "box"),
        ("routing", "routing", "prod", "box"),
        ("draft", "vqfx-draft", "ptr", "vqfx-snap1"),
    ] {
        write(
            &format!("lessons/{dir}/lesson.meta.yaml"),
            &format!(
                "slug: {slug}\nname: {slug}\ncategory: fundamentals\ntier: {tier}\n\
                 endpoints:\n- name: e\n  image: {image}\n  additionalPorts: [22]\n\
                 stages:\n- description: one\n  guideType: markdown\n"
            ),
        );
        write(&format!("lessons/{dir}/stage0/guide.md"), "# guide\n");
    }
}

#[tokio::test]
async fn a_skipped_lesson_naming_an_undefined_image_is_a_warning_and_a_loaded_one_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let curriculum = dir.path().join("curriculum");
    tiered_curriculum(&curriculum);
    let validate = |tier: &str| {
        std::process::Command::new(workspace_bin("scheduler-svc"))
            .args([
                "validate",
                &curriculum.display().to_string(),
                "--tier",
                tier,
            ])
            .output()
            .unwrap()
    };
    let problem = "lessons/draft/lesson.meta.yaml: lesson `vqfx-draft`: `endpoints[0].image`: \
                   no image with slug `vqfx-snap1`";

    // At tier prod the ptr lesson is skipped: a warning naming it, and the counts.
    let output = validate("prod");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("warning: ") && stderr.contains(problem),
        "{stderr}"
    );
    assert!(
        stdout.contains(
            "valid at tier prod: 2 lessons loaded (1 skipped below the tier), 0 collections \
             loaded (0 skipped), 1 image, 1 warning"
        ),
        "{stdout}"
    );

    // At tier ptr it loads, so its undefined image is an error naming it.
    let output = validate("ptr");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.starts_with("1 curriculum error:"), "{stderr}");
    assert!(stderr.contains(problem), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");

    // `serve` at tier prod starts and logs the warning.
    let scheduler = antidote_tests::Scheduler::start(
        dir.path(),
        &format!(
            "curriculum = \"{}\"\ntier = \"prod\"\n",
            curriculum.display()
        ),
    )
    .await
    .expect("the scheduler starts at tier prod");
    let log = scheduler.process.log_text();
    assert!(
        log.contains("curriculum warning") && log.contains("vqfx-draft"),
        "{log}"
    );
}
