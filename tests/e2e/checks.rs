//! Stage checks end to end: CheckStage (gRPC and JSON) on agent-docker with a gated stage, the
//! live lesson's passed stages and last check on Watch, the gate on SetStage; `antidotectl admin
//! test-lesson` over the example curriculum and over a broken solution; a check that never ends
//! and one that prints 100 MB; and, on the test agent, 20 concurrent CheckStage calls, another
//! session's live lesson and an agent without the `checks` capability.

use antidote_proto::api::v1 as api;
use antidote_tests::checks::{check_stage as check, curriculum, run_solutions};
use antidote_tests::config::{SchedulerConfig, secs};
use antidote_tests::web::Web;
use antidote_tests::{example_curriculum, with_token, workspace_bin};
use api::LiveLessonStatus as S;
use hyper::{Method, StatusCode};
use tonic::Code;

use crate::docker::DockerEnv;
use crate::{Env, Knobs, PATIENCE};

/// The ErrorInfo reason and metadata of a refusal.
fn reason(status: &tonic::Status) -> (String, std::collections::HashMap<String, String>) {
    antidote_sdk::errors::reason(status).unwrap_or_else(|| panic!("no ErrorInfo: {status:?}"))
}

/// SetStage of a live lesson with its session's token.
async fn set_stage(
    c: &antidote_tests::Clients,
    id: &str,
    stage: u32,
) -> Result<api::LiveLesson, tonic::Status> {
    let request = with_token(
        api::SetStageRequest {
            id: id.into(),
            stage,
        },
        c.tokens.of_lesson(id),
    );
    Ok(c.lessons.clone().set_stage(request).await?.into_inner())
}

/// `antidotectl` against `scheduler`: (success, stdout, stderr).
fn antidotectl(scheduler: &antidote_tests::Scheduler, args: &[&str]) -> (bool, String, String) {
    let admin = scheduler.process.extra["admin"];
    let state = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(workspace_bin("antidotectl"))
        .arg("--server")
        .arg(scheduler.process.url())
        .arg("--admin-server")
        .arg(format!("http://{admin}"))
        .env("ANTIDOTE_STATE_DIR", state.path())
        .env("ANTIDOTE_TOKEN", antidote_tests::ADMIN_TOKEN)
        .env_remove("ANTIDOTE_SESSION_TOKEN")
        .args(args)
        .output()
        .expect("antidotectl runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn a_gated_stage_on_docker_fails_its_check_refuses_the_next_stage_then_passes() {
    let env = DockerEnv::start("e2e-checks-gate", &curriculum(), &[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "gated", 0).await.unwrap();
    let live = env.settle(&live.id).await;
    assert_eq!(live.status(), S::Ready, "{}", env.logs());
    assert!(live.passed_stages.is_empty() && live.last_check.is_none());

    // Nothing done yet: the check fails with the script's message.
    let failed = check(c, &live.id).await.unwrap();
    assert!(!failed.passed, "{failed:?}");
    assert_eq!(failed.stage, 0);
    let feedback = &failed.endpoints[0];
    assert_eq!(
        (feedback.endpoint.as_str(), feedback.file_name.as_str()),
        ("box", "box.sh")
    );
    assert!(!feedback.passed && feedback.exit_code == 1 && !feedback.timed_out);
    assert!(
        feedback.feedback.contains("/tmp/done is missing"),
        "{}",
        feedback.feedback
    );

    // The gate: the next stage is refused, naming the check.
    let refused = set_stage(c, &live.id, 1).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    let (why, metadata) = reason(&refused);
    assert_eq!(why, "CHECK_NOT_PASSED");
    assert_eq!(metadata["check"], "stage0/checks/box.sh");
    assert_eq!(metadata["stage"], "0");
    assert!(
        refused.message().contains("stage0/checks/box.sh"),
        "{}",
        refused.message()
    );

    // A Watch sees the fix's check arrive; the fix is done as an operator would test it.
    let watching = {
        let c = c.clone();
        let id = live.id.clone();
        tokio::spawn(async move {
            c.follow(&id, PATIENCE, |l| l.passed_stages.contains(&0))
                .await
        })
    };
    let solution = run_solutions(c, &live.id).await.unwrap();
    assert!(solution.passed, "{solution:?}");
    // The JSON API runs the same check, with the session's token.
    let http = env.scheduler.process.extra_url("http").unwrap();
    let bearer = format!("Bearer {}", c.tokens.of_lesson(&live.id).unwrap());
    let answer = Web::default()
        .send(
            Method::POST,
            &format!("{http}/v1/live-lessons/{}/check", live.id),
            &[("authorization", &bearer)],
            Some("{}"),
        )
        .await
        .unwrap();
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    let json: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(json["passed"], true, "{json}");
    assert_eq!(
        json["endpoints"][0]["feedback"], "found /tmp/done\n",
        "{json}"
    );

    let (_, watched) = watching.await.unwrap().unwrap();
    assert_eq!(watched.passed_stages, [0]);
    let last = watched.last_check.expect("the last check on Watch");
    assert!(last.passed && last.stage == 0);
    let shown = c.get(&live.id).await.unwrap();
    assert_eq!(shown.passed_stages, [0]);
    assert_eq!(shown.status(), S::Ready);
    // Operators see the same through the admin API.
    let admin = c
        .admin
        .clone()
        .get_live_lesson(api::AdminGetLiveLessonRequest {
            id: live.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .live_lesson
        .unwrap();
    assert_eq!(admin.passed_stages, [0]);
    assert_eq!(admin.last_check, shown.last_check);
    assert_eq!(
        shown.generation, live.generation,
        "a check makes no generation"
    );

    // Past the gate now.
    let moved = set_stage(c, &live.id, 1).await.unwrap();
    assert!(moved.generation > live.generation);
    let moved = env.settle(&live.id).await;
    assert_eq!(
        (moved.status(), moved.stage),
        (S::Ready, 1),
        "{}",
        env.logs()
    );
    assert_eq!(moved.passed_stages, [0], "a pass stays");
    // Stage 1 has no check.
    let none = check(c, &live.id).await.unwrap_err();
    assert_eq!(none.code(), Code::FailedPrecondition);
    assert_eq!(reason(&none).0, "NO_CHECKS");

    // Metrics: the runs by lesson, stage and result.
    let admin_http = env.scheduler.process.extra_url("admin http").unwrap();
    let metrics = Web::default()
        .scrape(&format!("{admin_http}/metrics"))
        .await
        .unwrap()
        .body;
    for result in ["failed", "passed"] {
        let line =
            format!("antidote_checks_total{{lesson=\"gated\",stage=\"0\",result=\"{result}\"}}");
        assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    }
    env.delete_all(&[&live.id]).await;
}

#[tokio::test]
async fn test_lesson_all_passes_over_the_example_curriculum_on_docker() {
    let config = SchedulerConfig::on_real_backend(
        "e2e-checks-test-lesson",
        &example_curriculum(),
        secs(180),
    )
    .with_tier("local");
    let env = DockerEnv::with_config(config, &[]).await;
    let (ok, stdout, stderr) = antidotectl(&env.scheduler, &["admin", "test-lesson", "--all"]);
    assert!(
        ok,
        "test-lesson --all failed:\n{stdout}\n{stderr}\n{}",
        env.logs()
    );
    // The lessons with checks show the full round: failed, ran, passed.
    for lesson in ["routing-basics", "netcat-toolbox"] {
        let row = stdout
            .lines()
            .find(|line| line.contains(lesson) && line.contains("failed"))
            .unwrap_or_else(|| panic!("no checked row of {lesson}:\n{stdout}"));
        assert!(
            row.contains("ran") && row.contains("passed") && row.contains("ok"),
            "{row}"
        );
    }
    assert!(
        stdout.contains("hello-web"),
        "every lesson walked:\n{stdout}"
    );
    // The same as one JSON document.
    let (ok, stdout, stderr) = antidotectl(
        &env.scheduler,
        &[
            "--output",
            "json",
            "admin",
            "test-lesson",
            "routing-basics",
            "--stage",
            "0",
        ],
    );
    assert!(ok, "{stdout}\n{stderr}");
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(json["ok"], true, "{json}");
    let stage = &json["lessons"][0]["stages"][0];
    assert_eq!(
        (
            &stage["check_before"],
            &stage["solution"],
            &stage["check_after"]
        ),
        (&"failed".into(), &"ran".into(), &"passed".into()),
        "{json}"
    );
}

#[tokio::test]
async fn test_lesson_names_the_stage_and_the_check_output_of_a_broken_solution() {
    let env = DockerEnv::start("e2e-checks-broken", &curriculum(), &[]).await;
    let (ok, stdout, stderr) =
        antidotectl(&env.scheduler, &["admin", "test-lesson", "broken-solution"]);
    assert!(!ok, "a broken solution must fail the run:\n{stdout}");
    assert!(stdout.contains("MISMATCH"), "{stdout}");
    assert!(
        stdout.contains("broken-solution stage 0: the check failed after the solution")
            && stdout.contains("/tmp/fixed is still missing"),
        "the stage and the check's output:\n{stdout}"
    );
    assert!(
        stderr.contains("1 of 1 lessons did not pass: broken-solution"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_check_that_never_ends_and_one_printing_100_mb_are_bounded_on_docker() {
    let env = DockerEnv::start("e2e-checks-bounded", &curriculum(), &[]).await;
    let pid = crate::docker::agent_pid(&env.tag);
    let before = crate::docker::peak_rss_kib(pid);
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "bounded", 0).await.unwrap();
    let live = env.settle(&live.id).await;
    assert_eq!(live.status(), S::Ready, "{}", env.logs());
    let answer = check(c, &live.id).await.unwrap();
    let after = crate::docker::peak_rss_kib(pid);
    println!(
        "agent-docker peak RSS: {before} KiB before, {after} KiB after a check printing 100 MB"
    );
    assert!(!answer.passed);
    let hanging = &answer.endpoints[0];
    assert_eq!(hanging.endpoint, "hanging");
    assert!(hanging.timed_out && !hanging.passed, "{hanging:?}");
    assert!(
        hanging
            .feedback
            .contains("waiting for something that never comes")
            && hanging
                .feedback
                .contains("ended at the check timeout of 20s"),
        "{}",
        hanging.feedback
    );
    let loud = &answer.endpoints[1];
    assert_eq!(
        (loud.endpoint.as_str(), loud.exit_code),
        ("loud", 1),
        "{loud:?}"
    );
    assert!(loud.truncated, "100 MB cannot fit");
    assert!(
        loud.feedback.len() <= 16 * 1024,
        "{} bytes",
        loud.feedback.len()
    );
    assert!(loud.feedback.ends_with("the last line of a long answer\n"));
    assert!(
        after.saturating_sub(before) < 32 * 1024,
        "the agent's peak RSS grew from {before} KiB to {after} KiB"
    );
    // Neither changed the live lesson.
    let shown = c.get(&live.id).await.unwrap();
    assert_eq!(
        (shown.status(), shown.generation),
        (S::Ready, live.generation)
    );
    env.delete_all(&[&live.id]).await;
}

/// A scheduler on the checks fixture and a test agent started with `agent_args`.
async fn on_test_agent(agent_args: &[&str]) -> Env {
    let config = SchedulerConfig::quick("e2e", &curriculum())
        .with_lesson_ttl(secs(30 * 60))
        .with_session_ttl(secs(24 * 3600))
        .with_sessions_per_ip(0)
        .with_lessons_per_session(3);
    Env::start(
        agent_args,
        Knobs {
            config,
            ..Knobs::default()
        },
    )
    .await
}

#[tokio::test]
async fn twenty_checks_at_once_on_one_live_lesson_run_one_at_a_time() {
    let env = on_test_agent(&[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "slow-check", 0).await.unwrap();
    c.ready(&live.id).await.unwrap();
    let calls = (0..20).map(|_| check(c, &live.id));
    let answers = futures::future::join_all(calls).await;
    let mut ran = 0;
    for answer in answers {
        match answer {
            Ok(run) => {
                ran += 1;
                assert!(run.passed, "a check ran beside another: {run:?}");
                assert_eq!(run.endpoints[0].feedback, "ran alone\n");
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                let (why, metadata) = reason(&status);
                assert_eq!(why, "TOO_MANY_CHECKS");
                assert_eq!(metadata["scope"], "running", "{status:?}");
            }
        }
    }
    assert!(ran >= 1, "one of them ran");
    assert!(ran < 20, "the ones sent while it ran were refused");
    // The per-minute limit (10 by default) refuses the rest of the minute's runs.
    let mut refused_for_minute = false;
    for _ in 0..12 {
        match check(c, &live.id).await {
            Ok(_) => {}
            Err(status) => {
                assert_eq!(reason(&status).1["scope"], "minute", "{status:?}");
                refused_for_minute = true;
                break;
            }
        }
    }
    assert!(refused_for_minute, "more than 10 checks in a minute ran");
}

#[tokio::test]
async fn another_sessions_live_lesson_is_not_found_to_checks() {
    let env = on_test_agent(&[]).await;
    let c = &env.scheduler.clients;
    let mine = c.session().await.unwrap();
    let live = c.request(&mine, "gated", 0).await.unwrap();
    c.ready(&live.id).await.unwrap();
    let theirs = c.session().await.unwrap();
    let stranger = c.tokens.of_session(&theirs);
    let refused = c
        .lessons
        .clone()
        .check_stage(with_token(
            api::CheckStageRequest {
                id: live.id.clone(),
            },
            stranger,
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
    assert_eq!(reason(&refused).0, "LIVE_LESSON_NOT_FOUND");
    // Not a UUID: INVALID_ARGUMENT.
    let bad = check(c, "not-a-uuid").await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    // The owner's own check runs (on the test agent, as a local process).
    let own = check(c, &live.id).await.unwrap();
    assert!(!own.passed);
}

#[tokio::test]
async fn an_agent_without_checks_answers_unimplemented_and_the_lesson_stays_ready() {
    // Every capability the test agent has but `checks`.
    let env = on_test_agent(&[
        "--capabilities",
        "presentation.ssh,presentation.http,stage.configuration,configuration.shell,plan,watch,recover",
    ])
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    // An advisory check: placed on any agent. (A gated lesson needs the capability.)
    let live = c.request(&session, "slow-check", 0).await.unwrap();
    let ready = c.ready(&live.id).await.unwrap();
    let refused = check(c, &live.id).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    let (why, metadata) = reason(&refused);
    assert_eq!(why, "CHECKS_UNSUPPORTED");
    assert_eq!(metadata["agent"], "loopback");
    assert!(
        refused.message().contains("this agent cannot run checks"),
        "{}",
        refused.message()
    );
    let shown = c.get(&live.id).await.unwrap();
    assert_eq!(
        (shown.status(), shown.generation),
        (S::Ready, ready.generation)
    );
    // A gated lesson could never pass there, so it is not placed: no agent could take it.
    let gated = c.request(&session, "gated", 0).await.unwrap_err();
    assert_eq!(gated.code(), Code::FailedPrecondition);
    let (why, metadata) = reason(&gated);
    assert_eq!(why, "PLACEMENT_IMPOSSIBLE");
    assert_eq!(metadata["missing"], "capability checks");
}
