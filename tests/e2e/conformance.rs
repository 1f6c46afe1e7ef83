//! The conformance suite (`antidote-conformance`) run as a process against real agents: the
//! loopback test agent, agent-docker on the real engine, and the Python agent (a third-party
//! agent written from the proto files and the guide alone), which also runs a lesson end to end
//! through the scheduler.

use std::path::{Path, PathBuf};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::{Process, Scheduler, fetch, presentation, workspace_bin};

/// Runs the suite against `agent`; panics with its report unless every check passed.
async fn conformance(agent: &Process, extra: &[&str]) -> String {
    let output = tokio::process::Command::new(workspace_bin("antidote-conformance"))
        .arg("--agent")
        .arg(agent.url())
        .args(extra)
        .output()
        .await
        .expect("antidote-conformance runs");
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && report.contains(" 0 failed"),
        "conformance failed ({}):\n{report}\n{}\n--- agent log ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        agent.log_text()
    );
    report
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository root exists")
}

#[tokio::test]
async fn the_test_agent_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Process::spawn(
        &workspace_bin("test-agent"),
        &["--listen".into(), "127.0.0.1:0".into()],
        dir.path().join("test-agent.log"),
    )
    .await
    .expect("test-agent starts");
    let report = conformance(&agent, &[]).await;
    assert!(
        report.contains("PASS  the live lesson becomes READY"),
        "{report}"
    );
}

#[tokio::test]
async fn agent_docker_conforms() {
    // The agent inherits DOCKER_HOST.
    std::env::var("DOCKER_HOST").expect(
        "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
    );
    let dir = tempfile::tempdir().unwrap();
    let agent = Process::spawn(
        &workspace_bin("agent-docker"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--trusted-privileged".into(),
            "false".into(),
            "--probe-timeout".into(),
            "30s".into(),
        ],
        dir.path().join("agent-docker.log"),
    )
    .await
    .expect("agent-docker starts");
    let report = conformance(&agent, &["--image", "busybox"]).await;
    assert!(report.contains("(container, network)"), "{report}");
}

/// Starts the Python agent through its `run` script (virtualenv and stubs from PyPI, cached
/// outside the repository).
async fn python_agent(dir: &Path, state: &Path) -> Process {
    Process::spawn(
        &repo().join("tests/python-agent/run"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--state-dir".into(),
            state.display().to_string(),
        ],
        dir.join(format!("python-agent-{}.log", uuid::Uuid::new_v4())),
    )
    .await
    .expect("the Python agent starts")
}

#[tokio::test]
async fn the_python_agent_conforms_and_runs_a_lesson_through_the_scheduler() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("python-state");
    let agent = python_agent(dir.path(), &state).await;
    conformance(&agent, &[]).await;

    let config = format!(
        r#"instance_id = "python-e2e"
curriculum = "{curriculum}"
tier = "prod"
[reconciler]
poll_interval = "500ms"
backoff_initial = "100ms"
backoff_max = "1s"
[[agents]]
name = "python"
address = "{agent}"
"#,
        curriculum = repo().join("tests/fixtures/local-curriculum").display(),
        agent = agent.url(),
    );
    let scheduler = Scheduler::start(dir.path(), &config)
        .await
        .expect("scheduler starts");
    let c = &scheduler.clients;
    let session = c.session().await.unwrap();
    let requested = c.request(&session, "two-pages", 0).await.unwrap();
    let ready = c.ready(&requested.id).await.unwrap_or_else(|err| {
        panic!(
            "{err:#}\n--- scheduler ---\n{}\n--- agent ---\n{}",
            scheduler.process.log_text(),
            agent.log_text()
        )
    });
    assert_eq!(ready.endpoints.len(), 2);
    let page = fetch(presentation(&ready, "left", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    assert!(
        page.contains("two-pages") && page.contains("left"),
        "{page}"
    );
    let banner = fetch(presentation(&ready, "left", "cli")).await;
    assert!(banner.starts_with("SSH-2.0-"), "{banner}");

    // A stage change reaches the pages.
    let staged = c.request(&session, "two-pages", 1).await.unwrap();
    let (_, staged) = c
        .follow(&staged.id, Duration::from_secs(60), |l| {
            l.stage == 1 && l.status() == api::LiveLessonStatus::Ready
        })
        .await
        .unwrap();
    let page = fetch(presentation(&staged, "right", "page")).await;
    assert!(page.contains("X-Antidote-Stage: 1"), "{page}");

    // Deleting it stops the agent's processes: nothing answers there any more.
    let address = presentation(&staged, "right", "page").address.clone();
    c.lessons
        .clone()
        .delete_live_lesson(api::DeleteLiveLessonRequest {
            id: staged.id.clone(),
        })
        .await
        .unwrap();
    c.gone(&staged.id, Duration::from_secs(60)).await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(&address).await.is_err(),
        "{address} still answers after the live lesson was deleted"
    );
}
