//! The conformance suite (`antidote-conformance`) run as a process against real agents: the
//! loopback test agent, agent-docker on the real engine, and the Python agent (a third-party
//! agent written from the proto files and the guide alone), which also runs a lesson end to end
//! through the scheduler. Each agent runs restartable (`--restart-cmd`) with a small capacity,
//! so every check runs; the report must list every check, and only those the agent cannot
//! support (a capability it does not offer) may be skipped. Its flags are tested here too:
//! `--list`, `--check` and an unknown check name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use antidote_tests::{Process, Restartable, Scheduler, fetch, presentation, workspace_bin};

/// Runs `antidote-conformance` with `args`.
async fn run_suite(args: &[&str]) -> Output {
    tokio::process::Command::new(workspace_bin("antidote-conformance"))
        .args(args)
        .output()
        .await
        .expect("antidote-conformance runs")
}

/// Runs the suite against the agent at `url`; panics with its report (and the agent's log)
/// unless no check failed.
async fn conformance(url: &str, log: impl Fn() -> String, extra: &[&str]) -> String {
    let mut args = vec!["--agent", url];
    args.extend_from_slice(extra);
    let output = run_suite(&args).await;
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && report.contains(" 0 failed"),
        "conformance failed ({}):\n{report}\n{}\n--- agent log ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        log()
    );
    report
}

/// Runs the whole suite against a restartable agent (`--restart-cmd`); panics unless no check
/// failed, every check is reported, and exactly `skipped` were skipped.
async fn whole_suite(agent: &Restartable, extra: &[&str], skipped: &[&str]) -> String {
    let restart = agent.restart_cmd();
    let mut args = vec!["--restart-cmd", restart.as_str()];
    args.extend_from_slice(extra);
    let report = conformance(&agent.url(), || agent.log_text(), &args).await;
    let listed = run_suite(&["--list"]).await;
    let every: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    assert_eq!(
        reported_checks(&report),
        every,
        "the report does not list every check:\n{report}"
    );
    let skips: BTreeSet<&str> = report
        .lines()
        .filter_map(|line| line.strip_prefix("  SKIP  "))
        .filter_map(|rest| rest.split(':').next())
        .collect();
    assert_eq!(
        skips,
        skipped.iter().copied().collect(),
        "other checks skipped than expected:\n{report}"
    );
    report
}

/// What every agent here skips: these runs offer no python, ansible or napalm configurations
/// (agent-docker runs them without its configurator image; tests/e2e/configurators.rs runs the
/// suite's configuration and Jupyter guide checks against agent-docker and agent-k8s with their
/// configurator, Jupyter and SSH endpoint images). Every run forces a resync (`--force-resync`).
const ALWAYS_SKIPPED: [&str; 3] = [
    "configuration-python",
    "configuration-ansible",
    "configuration-napalm",
];

/// The entrypoint checks that run with `--entrypoint` alone (`entrypoint-terminal` needs an
/// image with a real SSH server too): an agent without an entrypoint skips them all.
const ENTRYPOINT_CHECKS: [&str; 6] = [
    "entrypoint-tokens",
    "entrypoint-keys",
    "entrypoint-cookie",
    "entrypoint-proxy",
    "entrypoint-activity",
    "entrypoint-connection-cap",
];

/// A port free now, for the entrypoint, whose URL the agent must be told before it listens.
fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

/// The SDK's entrypoint flags for plaintext on loopback at `port`, reporting activity every
/// 500 ms, and the suite's `--entrypoint` for it.
fn entrypoint_flags(port: u16) -> (Vec<String>, String) {
    let url = format!("http://127.0.0.1:{port}");
    let agent = [
        "--entrypoint-listen",
        &format!("127.0.0.1:{port}"),
        "--entrypoint-url",
        &url,
        "--entrypoint-insecure-plaintext",
        "--entrypoint-activity-interval",
        "500ms",
    ]
    .map(String::from)
    .to_vec();
    (agent, url)
}

/// The names of the checks a report has a line for, in report order.
fn reported_checks(report: &str) -> Vec<&str> {
    report
        .lines()
        .filter_map(|line| {
            ["  PASS  ", "  FAIL  ", "  SKIP  "]
                .iter()
                .find_map(|tag| line.strip_prefix(tag))
        })
        .map(|rest| rest.split(':').next().unwrap_or_default())
        .collect()
}

/// Starts the loopback test agent in `dir`.
async fn test_agent(dir: &Path) -> Process {
    Process::spawn(
        &workspace_bin("test-agent"),
        &["--listen".into(), "127.0.0.1:0".into()],
        dir.join("test-agent.log"),
    )
    .await
    .expect("test-agent starts")
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
    let state = dir.path().join("state");
    let (entrypoint, url) = entrypoint_flags(free_port());
    let mut args = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--state-dir".into(),
        state.display().to_string(),
        "--max-live-lessons".into(),
        "3".into(),
        "--probe-timeout".into(),
        "5s".into(),
    ];
    args.extend(entrypoint);
    let agent = Restartable::spawn(
        &workspace_bin("test-agent"),
        &args,
        &[],
        dir.path(),
        "test-agent",
    )
    .await
    .expect("test-agent starts");
    // It runs no Jupyter guides, and its SSH presentations answer a banner only: no terminal.
    // It runs checks, so the check of an agent without them does not apply.
    let mut skipped = ALWAYS_SKIPPED.to_vec();
    skipped.extend([
        "guide-jupyter",
        "entrypoint-terminal",
        "checks-unimplemented",
    ]);
    let report = whole_suite(&agent, &["--force-resync", "--entrypoint", &url], &skipped).await;
    for adopted in [
        "PASS  restart-adopt",
        "PASS  capacity-refusal",
        "PASS  failed-probe",
        "PASS  watch-resync",
        "PASS  entrypoint-tokens",
    ] {
        assert!(report.contains(adopted), "{report}");
    }
}

#[tokio::test]
async fn the_suite_lists_its_checks_with_their_needs() {
    let output = run_suite(&["--list"]).await;
    let list = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}\n{list}", output.status);
    let line = |name: &str| {
        list.lines()
            .find(|line| line.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("`{name}` is not listed:\n{list}"))
            .to_owned()
    };
    for name in ["health", "handshake", "bad-spec-codes", "deprovision"] {
        line(name);
    }
    assert!(
        line("provision-ready").contains("the live lesson becomes READY (needs handshake)"),
        "{list}"
    );
    assert!(
        line("recover-held").contains("needs stage-change, capability recover"),
        "{list}"
    );
    assert!(
        line("restart-recover").contains("needs handshake, flag --restart-cmd"),
        "{list}"
    );
    assert!(!line("health").contains("needs"), "{list}");

    // With --check, only what would run.
    let output = run_suite(&["--list", "--check", "stage-change"]).await;
    let list = String::from_utf8_lossy(&output.stdout);
    let names: Vec<_> = list
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert_eq!(
        names,
        ["handshake", "provision-ready", "stage-change"],
        "{list}"
    );
}

#[tokio::test]
async fn one_check_runs_after_what_it_needs_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let agent = test_agent(dir.path()).await;
    let report = conformance(
        &agent.url(),
        || agent.log_text(),
        &["--check", "idempotent-provision"],
    )
    .await;
    assert_eq!(
        reported_checks(&report),
        ["handshake", "provision-ready", "idempotent-provision"],
        "{report}"
    );
    assert!(report.contains("3 passed, 0 failed, 0 skipped"), "{report}");
}

#[tokio::test]
async fn an_unknown_check_is_a_usage_error_naming_the_valid_ones() {
    // Nothing listens on port 1: the name is refused before any connection.
    let output = run_suite(&["--agent", "http://127.0.0.1:1", "--check", "no-such-check"]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no-such-check"), "{stderr}");
    for valid in ["handshake", "provision-ready", "watch-deletions"] {
        assert!(stderr.contains(valid), "`{valid}` is not named:\n{stderr}");
    }
    assert!(
        output.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[tokio::test]
async fn agent_docker_conforms() {
    // The agent inherits DOCKER_HOST.
    std::env::var("DOCKER_HOST").expect(
        "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
    );
    let dir = tempfile::tempdir().unwrap();
    let (entrypoint, url) = entrypoint_flags(free_port());
    let mut args = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--trusted-privileged".into(),
        "false".into(),
        "--probe-timeout".into(),
        "30s".into(),
        "--max-live-lessons".into(),
        "3".into(),
        // Shell only: no configurator image, so python, ansible and napalm are not offered
        // (tests/e2e/configurators.rs runs them with the configurator and sshd images).
        "--configurator-image".into(),
        String::new(),
    ];
    args.extend(entrypoint);
    let agent = Restartable::spawn(
        &workspace_bin("agent-docker"),
        &args,
        &[],
        dir.path(),
        "agent-docker",
    )
    .await
    .expect("agent-docker starts");
    // The web terminal logs in to `sshd` (dropbear) as the entrypoint curriculum's image does.
    let report = whole_suite(
        &agent,
        &[
            "--image",
            "busybox",
            "--force-resync",
            "--entrypoint",
            &url,
            "--terminal-image",
            "sshd",
            "--ssh-user",
            "antidote",
            "--ssh-password",
            "antidotepassword",
        ],
        &[&ALWAYS_SKIPPED[..], &["checks-unimplemented"]].concat(),
    )
    .await;
    assert!(report.contains("PASS  entrypoint-terminal"), "{report}");
    assert!(report.contains("PASS  checks-timeout"), "{report}");
    assert!(report.contains("(container, network)"), "{report}");
    assert!(report.contains("PASS  restart-adopt"), "{report}");
}

/// Starts the Python agent, restartable, through its `run` script (virtualenv and stubs from
/// PyPI, cached outside the repository).
async fn python_agent(dir: &Path, state: &Path) -> Restartable {
    Restartable::spawn(
        &repo().join("tests/python-agent/run"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--state-dir".into(),
            state.display().to_string(),
            "--max-live-lessons".into(),
            "3".into(),
            "--probe-timeout".into(),
            "5".into(),
        ],
        &[],
        dir,
        "python-agent",
    )
    .await
    .expect("the Python agent starts")
}

#[tokio::test]
async fn the_python_agent_conforms_and_runs_a_lesson_through_the_scheduler() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("python-state");
    let agent = python_agent(dir.path(), &state).await;
    // It runs no configuration (no `stage.configuration`): nothing to fail there either; and it
    // serves no entrypoint.
    let mut skipped = ALWAYS_SKIPPED.to_vec();
    skipped.extend([
        "configuration-shell",
        "failed-config",
        "watch-pages",
        "guide-jupyter",
        "entrypoint-terminal",
    ]);
    skipped.extend(ENTRYPOINT_CHECKS);
    // It runs shell check files as local processes (`checks`).
    skipped.push("checks-unimplemented");
    let report = whole_suite(&agent, &["--force-resync"], &skipped).await;
    assert!(report.contains("PASS  watch-resync"), "{report}");
    assert!(report.contains("PASS  restart-adopt"), "{report}");

    let config = SchedulerConfig::new(
        "python-e2e",
        &repo().join("tests/fixtures/local-curriculum"),
    )
    .with_tier("prod")
    .with_retries(ms(500), ms(100), secs(1))
    .with_agent(Agent::new("python", agent.url()))
    .to_toml();
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
