//! agent-docker against a real Docker engine (DOCKER_HOST; `tests/run` starts a private one and
//! builds the example curriculum's images), driven through the scheduler's public API.

use std::path::Path;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::{Process, Scheduler, example_curriculum, fetch, presentation, workspace_bin};
use api::LiveLessonStatus as S;
use tempfile::TempDir;
use tokio::io::AsyncReadExt;

use crate::PATIENCE;

/// A scheduler and agent-docker, with their own instance label so parallel tests never touch
/// each other's objects.
struct DockerEnv {
    dir: TempDir,
    agent: Process,
    agent_args: Vec<String>,
    scheduler: Scheduler,
    instance: String,
}

fn docker_host() -> String {
    std::env::var("DOCKER_HOST").expect(
        "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
    )
}

/// The docker CLI, for checks from outside the agent.
fn docker(args: &[&str]) -> (bool, String) {
    let output = std::process::Command::new("docker")
        .args(args)
        .env("DOCKER_HOST", docker_host())
        .output()
        .expect("the docker CLI runs");
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

async fn start_agent(dir: &Path, args: &[String]) -> Process {
    let log = dir.join(format!("agent-docker-{}.log", uuid::Uuid::new_v4()));
    Process::spawn(&workspace_bin("agent-docker"), args, log)
        .await
        .expect("agent-docker starts")
}

impl DockerEnv {
    async fn start(instance: &str, curriculum: &Path, agent_extra: &[&str]) -> DockerEnv {
        docker_host();
        let dir = tempfile::tempdir().unwrap();
        // This machine's engine runs inside a sandbox that cannot grant every capability, so
        // trusted images run with NET_ADMIN instead of --privileged here.
        let privileged =
            std::env::var("ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED").unwrap_or_else(|_| "false".into());
        let mut agent_args: Vec<String> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--trusted-privileged".into(),
            privileged,
            "--probe-timeout".into(),
            "30s".into(),
        ];
        agent_args.extend(agent_extra.iter().map(|a| a.to_string()));
        let agent = start_agent(dir.path(), &agent_args).await;
        // Restarts reuse the port the first start got.
        let pinned = agent.addr.to_string();
        agent_args[1] = pinned;
        let config = format!(
            r#"instance_id = "{instance}"
curriculum = "{curriculum}"
tier = "local"
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
[[agents]]
name = "docker"
address = "{agent}"
"#,
            curriculum = curriculum.display(),
            agent = agent.url(),
        );
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        DockerEnv {
            dir,
            agent,
            agent_args,
            scheduler,
            instance: instance.to_owned(),
        }
    }

    fn logs(&self) -> String {
        format!(
            "--- scheduler ---\n{}\n--- agent-docker ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text()
        )
    }

    /// Names of containers and networks carrying this test's instance label.
    fn labelled(&self) -> Vec<String> {
        let filter = format!("label=antidote.io/instance={}", self.instance);
        let (_, containers) = docker(&["ps", "-a", "--filter", &filter, "--format", "{{.Names}}"]);
        let (_, networks) = docker(&[
            "network",
            "ls",
            "--filter",
            &filter,
            "--format",
            "{{.Name}}",
        ]);
        containers
            .lines()
            .chain(networks.lines())
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    }

    async fn ready(&self, id: &str) -> api::LiveLesson {
        self.scheduler
            .clients
            .ready(id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()))
    }

    async fn settle(&self, id: &str) -> api::LiveLesson {
        let (_, lesson) = self
            .scheduler
            .clients
            .follow(id, PATIENCE, |l| matches!(l.status(), S::Ready | S::Failed))
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()));
        lesson
    }

    async fn delete_all(&self, ids: &[&str]) {
        let c = &self.scheduler.clients;
        for id in ids {
            c.lessons
                .clone()
                .delete_live_lesson(antidote_tests::with_token(
                    api::DeleteLiveLessonRequest { id: id.to_string() },
                    c.tokens.of_lesson(id),
                ))
                .await
                .unwrap();
        }
        for id in ids {
            c.gone(id, PATIENCE).await.unwrap();
        }
        let left = self.labelled();
        assert!(
            left.is_empty(),
            "labelled objects remain: {left:?}\n{}",
            self.logs()
        );
    }
}

/// The container name agent-docker gives an endpoint.
fn container(live_lesson: &str, endpoint: &str) -> String {
    let hex: String = live_lesson
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    format!("antidote-{hex}-{endpoint}")
}

fn ping(from: &str, to: &str) -> bool {
    docker(&["exec", from, "ping", "-c", "1", "-W", "2", to]).0
}

#[tokio::test]
async fn docker_multi_endpoint_lesson_isolation_stage_change_and_cleanup() {
    let env = DockerEnv::start("e2e-docker-life", &example_curriculum(), &[]).await;
    let c = &env.scheduler.clients;
    let (one, two) = (c.session().await.unwrap(), c.session().await.unwrap());
    let a = c.request(&one, "routing-basics", 0).await.unwrap();
    let b = c.request(&two, "routing-basics", 0).await.unwrap();
    let a = env.ready(&a.id).await;
    let b = env.ready(&b.id).await;
    assert_eq!((a.healthy, a.total), (4, 4), "{a:?}");

    // Presentations answer on the host: an SSH banner, and the page the stage wrote.
    let page = fetch(presentation(&a, "server", "web")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let mut ssh = tokio::net::TcpStream::connect(&presentation(&a, "router", "cli").address)
        .await
        .unwrap();
    let mut banner = [0u8; 4];
    ssh.read_exact(&mut banner).await.unwrap();
    assert_eq!(&banner, b"SSH-");

    // Endpoints of one live lesson reach each other by name; another lesson's cannot reach them.
    let a_client = container(&a.id, "client");
    assert!(ping(&a_client, "server"), "{}", env.logs());
    let (_, b_server_ip) = docker(&[
        "inspect",
        "-f",
        "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
        &container(&b.id, "server"),
    ]);
    for ip in b_server_ip.split_whitespace() {
        assert!(
            !ping(&a_client, ip),
            "lesson A reached lesson B's server at {ip}"
        );
    }

    // Stage 0 has no routes across the router; stage 1's configuration adds them.
    assert!(!ping(&a_client, "10.10.2.10"));
    let changed = c
        .lessons
        .clone()
        .set_stage(antidote_tests::with_token(
            api::SetStageRequest {
                id: a.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&a.id),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(changed.status(), S::Configuring);
    let (_, staged) = c
        .follow(&a.id, PATIENCE, |l| {
            l.generation == 2 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(staged.status(), S::Ready, "{}", staged.failure_reason);
    assert!(
        ping(&a_client, "10.10.2.10"),
        "stage 1 routes the client to the server\n{}",
        env.logs()
    );
    assert!(
        !ping(&container(&b.id, "client"), "10.10.2.10"),
        "lesson B is still at stage 0"
    );

    env.delete_all(&[&a.id, &b.id]).await;
}

#[tokio::test]
async fn docker_failing_configuration_and_missing_image_fail_with_reasons() {
    let curriculum = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/docker-curriculum");
    let env = DockerEnv::start("e2e-docker-fail", &curriculum, &[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let broken = c.request(&session, "broken-config", 0).await.unwrap();
    let ghost = c.request(&session, "missing-image", 0).await.unwrap();

    let broken = env.settle(&broken.id).await;
    assert_eq!(broken.status(), S::Failed);
    assert!(
        broken.failure_reason.contains("failed 3 times"),
        "{}",
        broken.failure_reason
    );
    assert!(
        broken.failure_reason.contains("broken on purpose"),
        "{}",
        broken.failure_reason
    );
    assert!(
        broken.failure_reason.contains("exit code 3"),
        "{}",
        broken.failure_reason
    );

    let ghost = env.settle(&ghost.id).await;
    assert_eq!(ghost.status(), S::Failed);
    assert!(
        ghost.failure_reason.contains("antidote/ghost:latest"),
        "{}",
        ghost.failure_reason
    );
    assert!(
        ghost.failure_reason.contains("ghost"),
        "{}",
        ghost.failure_reason
    );

    env.delete_all(&[&broken.id, &ghost.id]).await;
}

#[tokio::test]
async fn docker_agent_kill_9_mid_provision_recovers_without_recreating_and_orphans_go() {
    let mut env = DockerEnv::start(
        "e2e-docker-crash",
        &example_curriculum(),
        &["--ready-delay", "4s"],
    )
    .await;
    let c = env.scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    // Containers exist and answer; the agent waits out its ready delay: kill it now.
    c.follow(&lesson.id, PATIENCE, |l| {
        l.status() == S::Configuring
            && l.endpoints
                .iter()
                .all(|e| e.presentations.iter().all(|p| !p.address.is_empty()))
    })
    .await
    .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let web = container(&lesson.id, "web");
    let (_, before) = docker(&["inspect", "-f", "{{.Id}}", &web]);
    env.agent.kill9().await;
    env.agent = start_agent(env.dir.path(), &env.agent_args).await;

    let ready = env.ready(&lesson.id).await;
    let (_, after) = docker(&["inspect", "-f", "{{.Id}}", &web]);
    assert_eq!(
        before.trim(),
        after.trim(),
        "the container was adopted, not recreated"
    );
    let page = fetch(presentation(&ready, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");

    // A container with our labels that the scheduler does not know is an orphan: removed after
    // the grace period. One with another instance's label is left alone.
    let orphan = uuid::Uuid::new_v4().to_string();
    let foreign = uuid::Uuid::new_v4().to_string();
    for (id, instance) in [(&orphan, env.instance.as_str()), (&foreign, "someone-else")] {
        let (ok, out) = docker(&[
            "run",
            "-d",
            "--name",
            &container(id, "stray"),
            "--label",
            &format!("antidote.io/instance={instance}"),
            "--label",
            &format!("antidote.io/live-lesson={id}"),
            "--label",
            "antidote.io/managed-by=agent-docker",
            "antidote/busybox:latest",
        ]);
        assert!(ok, "{out}");
    }
    let gone = async {
        loop {
            let (_, left) = docker(&[
                "ps",
                "-aq",
                "--filter",
                &format!("label=antidote.io/live-lesson={orphan}"),
            ]);
            if left.trim().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    tokio::time::timeout(PATIENCE, gone)
        .await
        .unwrap_or_else(|_| panic!("the orphan was not removed\n{}", env.logs()));
    let (_, kept) = docker(&[
        "ps",
        "-aq",
        "--filter",
        &format!("label=antidote.io/live-lesson={foreign}"),
    ]);
    assert!(
        !kept.trim().is_empty(),
        "another scheduler's container was removed"
    );
    docker(&["rm", "-f", &container(&foreign, "stray")]);

    env.delete_all(&[&lesson.id]).await;
}
