//! Python, ansible and napalm configurations, on real engines, with the lessons of
//! `fixtures/configurator-curriculum/` whose endpoints run a real SSH server (`antidote/sshd`:
//! Debian's dropbear, logging every login) and the configurator image (`antidote/configurator`),
//! both built by `tests/docker/configurator.sh` (tests/run calls it).
//!
//! agent-docker: the python script and the ansible playbook each log in to their endpoint and
//! leave a file there, which the test reads with `docker exec`, and leave another at stage 1
//! after SetStage (the configurator runs again with stage 1's files); the napalm driver logs in to its
//! endpoint's port 22 with the image's config credentials (dropbear's log says so) and its
//! failure is the FAILED reason; a script that exits non-zero and one that hangs past the
//! timeout are FAILED with the reason; a lesson with Jupyter guides gets a guide endpoint
//! (`antidote/jupyter`) serving stage 0's notebook, then stage 1's after SetStage. agent-k8s,
//! on the real test node (`tests/k8s/cluster.sh`), the same by their effects: configurator Jobs
//! log in to their endpoints and leave files there (read back from inside the pods), napalm
//! logs in, a failing script is FAILED with its output and exit code, a hanging one at its
//! deadline, and the guide pod's Jupyter serves each stage's notebook.

use std::path::{Path, PathBuf};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::SchedulerConfig;
use antidote_tests::{Process, with_token, workspace_bin};
use api::LiveLessonStatus as S;

use crate::PATIENCE;
use crate::docker::{DockerEnv, container, docker, docker_host};
use crate::k8s::K8sEnv;

fn curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configurator-curriculum")
}

/// How long a configured lesson may take to settle on a busy machine (a guard against hangs).
const SETTLE: Duration = Duration::from_secs(240);

/// The scheduler configuration of these tests on a real backend, without its agent.
fn scheduler_config(instance: &str) -> SchedulerConfig {
    SchedulerConfig::on_real_backend(instance, &curriculum(), SETTLE)
        .with_tier("prod")
        .with_lessons_per_session(10)
}

/// agent-docker (with `agent_extra`) and a scheduler on the configurator curriculum, once the
/// images its lessons need are there.
async fn docker_env(instance: &str, agent_extra: &[&str]) -> DockerEnv {
    for image in ["antidote/sshd:latest", "antidote/configurator:latest"] {
        let (present, out) = docker(&["image", "inspect", "-f", "{{.Id}}", image]);
        assert!(
            present,
            "{image} is missing: run tests/docker/configurator.sh\n{out}"
        );
    }
    DockerEnv::with_config(scheduler_config(instance), agent_extra).await
}

/// Whether a configurator container of this instance exists now.
fn configurators(instance: &str) -> String {
    let (_, out) = docker(&[
        "ps",
        "-a",
        "--filter",
        &format!("label=antidote.io/instance={instance}"),
        "--filter",
        "label=antidote.io/configurator-stage",
        "--format",
        "{{.Names}}",
    ]);
    out.trim().to_owned()
}

#[tokio::test]
async fn docker_python_ansible_and_napalm_configure_endpoints_over_ssh() {
    let env = docker_env("e2e-configurators", &[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let both = c.request(&session, "python-ansible", 0).await.unwrap();
    let napalm = c.request(&session, "napalm-login", 0).await.unwrap();

    let both = env.settle_within(&both.id, SETTLE).await;
    assert_eq!(
        both.status(),
        S::Ready,
        "{}\n{}",
        both.failure_reason,
        env.logs()
    );
    // Each configuration changed its endpoint, seen from outside.
    let (ok, python) = docker(&[
        "exec",
        &container(&both.id, "pybox"),
        "cat",
        "/tmp/python-stage",
    ]);
    assert!(ok && python.trim() == "configured-by-python", "{python}");
    let (ok, ansible) = docker(&[
        "exec",
        &container(&both.id, "ansiblebox"),
        "cat",
        "/tmp/ansible-stage",
    ]);
    assert!(ok && ansible.trim() == "configured-by-ansible", "{ansible}");
    // They logged in over SSH with the image's config user.
    for endpoint in ["pybox", "ansiblebox"] {
        let (_, log) = docker(&["logs", &container(&both.id, endpoint)]);
        assert!(
            log.contains("Password auth succeeded for 'antidote'"),
            "{endpoint}: {log}"
        );
    }
    // A stage change runs the configurator again, with stage 1's files
    // (`/antidote/stage1/configs/`), and is removed after it too.
    c.lessons
        .clone()
        .set_stage(with_token(
            api::SetStageRequest {
                id: both.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&both.id),
        ))
        .await
        .unwrap();
    let (_, staged) = c
        .follow(&both.id, Duration::from_secs(240), |l| {
            l.generation == 2 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(
        staged.status(),
        S::Ready,
        "{}\n{}",
        staged.failure_reason,
        env.logs()
    );
    for (endpoint, file, mark) in [
        (
            "pybox",
            "/tmp/python-stage",
            "configured-by-python-at-stage-1",
        ),
        (
            "ansiblebox",
            "/tmp/ansible-stage",
            "configured-by-ansible-at-stage-1",
        ),
    ] {
        let (ok, text) = docker(&["exec", &container(&both.id, endpoint), "cat", file]);
        assert!(ok && text.trim() == mark, "{endpoint}: {text}");
    }

    // NAPALM: the junos driver logs in to port 22 with the config credentials; the endpoint is
    // no Junos device, so the driver fails and says why.
    let napalm = env.settle_within(&napalm.id, SETTLE).await;
    assert_eq!(napalm.status(), S::Failed, "{}", env.logs());
    let reason = &napalm.failure_reason;
    assert!(
        reason.contains("configuration vqfx-junos.txt of endpoint `vqfx`")
            && reason.contains("failed 3 times"),
        "{reason}"
    );
    assert!(reason.contains("ConnectError"), "{reason}");
    let (_, log) = docker(&["logs", &container(&napalm.id, "vqfx")]);
    assert!(
        log.contains("Password auth succeeded for 'antidote'"),
        "the NAPALM driver did not log in: {log}"
    );
    // No secret in the reason or the agent's log.
    assert!(!reason.contains("antidotepassword"), "{reason}");
    assert!(
        !env.agent.log_text().contains("antidotepassword"),
        "the agent logged a password"
    );
    // The configurator is removed after the stage's run, whatever its outcome.
    assert_eq!(configurators(&env.instance), "");

    env.delete_all(&[&both.id, &napalm.id]).await;
}

/// The guide endpoint's notebook as its Jupyter server serves it (`/files/`: the file's bytes).
async fn served_notebook(lesson: &api::LiveLesson) -> String {
    let web = antidote_tests::presentation(lesson, "jupyter-guide", "web");
    assert_eq!(web.r#type, "http");
    let url = format!("http://{}/files/guide.ipynb", web.address);
    let answer = antidote_tests::web::Web::default()
        .get(&url)
        .await
        .unwrap_or_else(|err| panic!("GET {url}: {err:#}"));
    assert_eq!(
        answer.status,
        hyper::StatusCode::OK,
        "{url}: {}",
        answer.body
    );
    answer.body
}

#[tokio::test]
async fn docker_jupyter_guide_serves_the_current_stages_notebook() {
    let (present, out) = docker(&[
        "image",
        "inspect",
        "-f",
        "{{.Id}}",
        "antidote/jupyter:latest",
    ]);
    assert!(
        present,
        "antidote/jupyter:latest is missing: run tests/docker/configurator.sh jupyter\n{out}"
    );
    let env = docker_env("e2e-jupyter-guide", &[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "jupyter-guide", 0).await.unwrap();
    let live = env.settle_within(&live.id, SETTLE).await;
    assert_eq!(
        live.status(),
        S::Ready,
        "{}\n{}",
        live.failure_reason,
        env.logs()
    );
    // The lesson's own endpoint, and the guide endpoint the scheduler added.
    let names: Vec<&str> = live.endpoints.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["box", "jupyter-guide"]);
    let notebook = served_notebook(&live).await;
    assert!(notebook.contains("notebook-of-stage-zero"), "{notebook}");
    // The same through Jupyter's contents API, parsed as a notebook.
    let web = antidote_tests::presentation(&live, "jupyter-guide", "web");
    let contents = antidote_tests::web::Web::default()
        .get(&format!("http://{}/api/contents/guide.ipynb", web.address))
        .await
        .unwrap();
    let contents: serde_json::Value = serde_json::from_str(&contents.body).unwrap();
    assert_eq!(contents["type"], "notebook", "{contents}");
    assert_eq!(contents["content"]["nbformat"], 4, "{contents}");

    // SetStage swaps the notebook in the running server.
    c.lessons
        .clone()
        .set_stage(with_token(
            api::SetStageRequest {
                id: live.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&live.id),
        ))
        .await
        .unwrap();
    let (_, staged) = c
        .follow(&live.id, PATIENCE, |l| {
            l.generation == 2 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(
        staged.status(),
        S::Ready,
        "{}\n{}",
        staged.failure_reason,
        env.logs()
    );
    let notebook = served_notebook(&staged).await;
    assert!(notebook.contains("notebook-of-stage-one"), "{notebook}");
    assert!(!notebook.contains("notebook-of-stage-zero"), "{notebook}");

    env.delete_all(&[&live.id]).await;
}

#[tokio::test]
async fn docker_python_that_fails_or_hangs_is_failed_with_the_reason() {
    let env = docker_env(
        "e2e-configurators-fail",
        &["--config-timeout", "3s", "--config-tries", "3"],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let fails = c.request(&session, "python-fails", 0).await.unwrap();
    let hangs = c.request(&session, "python-hangs", 0).await.unwrap();

    let fails = env.settle_within(&fails.id, SETTLE).await;
    assert_eq!(fails.status(), S::Failed, "{}", env.logs());
    let reason = &fails.failure_reason;
    assert!(
        reason.contains("configuration box.py of endpoint `box`")
            && reason.contains("failed 3 times")
            && reason.contains("exit code 4")
            && reason.contains("python configuration broken on purpose"),
        "{reason}"
    );

    let hangs = env.settle_within(&hangs.id, SETTLE).await;
    assert_eq!(hangs.status(), S::Failed, "{}", env.logs());
    let reason = &hangs.failure_reason;
    assert!(
        reason.contains("configuration box.py of endpoint `box`")
            && reason.contains("did not finish within 3s")
            && reason.contains("python configuration sleeping forever"),
        "{reason}"
    );
    assert_eq!(configurators(&env.instance), "");

    env.delete_all(&[&fails.id, &hangs.id]).await;
}

#[tokio::test]
async fn docker_agent_claims_configuration_types_by_its_configurator_image() {
    use antidote_proto::agent::v1 as agent;
    docker_host();
    let dir = tempfile::tempdir().unwrap();
    let mut claimed = Vec::new();
    for image in [
        "antidote/configurator:latest",
        "antidote/no-such-configurator:latest",
    ] {
        let agent_process = Process::spawn(
            &workspace_bin("agent-docker"),
            &[
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--configurator-image".into(),
                image.into(),
            ],
            dir.path()
                .join(format!("agent-{}.log", uuid::Uuid::new_v4())),
        )
        .await
        .expect("agent-docker starts");
        let mut client = agent::backend_client::BackendClient::connect(agent_process.url())
            .await
            .unwrap();
        let answer = client
            .handshake(agent::HandshakeRequest {
                supported_majors: vec![1],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut types: Vec<String> = answer
            .capabilities
            .into_iter()
            .filter(|c| c.starts_with("configuration."))
            .collect();
        types.sort();
        claimed.push(types);
    }
    assert_eq!(
        claimed,
        vec![
            vec![
                "configuration.ansible".to_owned(),
                "configuration.napalm".into(),
                "configuration.python".into(),
                "configuration.shell".into(),
            ],
            vec!["configuration.shell".to_owned()],
        ]
    );
}

/// A scheduler on the configurator curriculum and agent-k8s (as its ServiceAccount, with `extra`
/// flags and the node's local images), on the real test node.
async fn k8s_env(instance: &str, extra: &[&str]) -> K8sEnv {
    let config = crate::k8s::scheduler_config(instance, &curriculum());
    K8sEnv::with_config(tempfile::tempdir().unwrap(), config, extra).await
}

#[tokio::test]
async fn k8s_python_ansible_and_napalm_configure_endpoints_over_ssh() {
    use k8s_openapi::api::batch::v1::Job;
    use kube::api::Api;

    let env = k8s_env(
        "k8s-configurators",
        &[
            "--configurator-image",
            "antidote/configurator:latest",
            "--config-timeout",
            "90s",
        ],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let both = c.request(&session, "python-ansible", 0).await.unwrap();
    let napalm = c.request(&session, "napalm-login", 0).await.unwrap();
    let both = env.settle(&both.id, 1, SETTLE).await;
    assert_eq!(
        both.status(),
        S::Ready,
        "{}\n{}",
        both.failure_reason,
        env.logs()
    );
    // Each configurator Job logged in to its endpoint by name (the lesson's /etc/hosts, no DNS)
    // over the lesson's network and changed it: read back from inside the endpoint's pod.
    assert_eq!(
        env.exec(&both.id, "pybox", "cat /tmp/python-stage")
            .await
            .output
            .trim(),
        "configured-by-python"
    );
    assert_eq!(
        env.exec(&both.id, "ansiblebox", "cat /tmp/ansible-stage")
            .await
            .output
            .trim(),
        "configured-by-ansible"
    );
    for endpoint in ["pybox", "ansiblebox"] {
        let log = env.log_of(&both.id, endpoint).await;
        assert!(
            log.contains("Password auth succeeded for 'antidote'"),
            "{endpoint}: {log}"
        );
    }
    // The credentials reach the Job only from the Secret, never in its spec.
    let jobs: Api<Job> = env.namespaced(&both.id);
    let job = serde_json::to_value(jobs.get("config-pybox-g1").await.unwrap()).unwrap();
    assert!(!job.to_string().contains("antidotepassword"), "{job}");

    // A stage change runs the configurators again, with stage 1's files.
    c.lessons
        .clone()
        .set_stage(with_token(
            api::SetStageRequest {
                id: both.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&both.id),
        ))
        .await
        .unwrap();
    let staged = env.settle(&both.id, 2, SETTLE).await;
    assert_eq!(
        staged.status(),
        S::Ready,
        "{}\n{}",
        staged.failure_reason,
        env.logs()
    );
    for (endpoint, file, mark) in [
        (
            "pybox",
            "/tmp/python-stage",
            "configured-by-python-at-stage-1",
        ),
        (
            "ansiblebox",
            "/tmp/ansible-stage",
            "configured-by-ansible-at-stage-1",
        ),
    ] {
        let text = env.exec(&both.id, endpoint, &format!("cat {file}")).await;
        assert_eq!(text.output.trim(), mark, "{endpoint}");
    }

    // NAPALM: the junos driver logs in to the endpoint's port 22 with the config credentials;
    // the endpoint is no Junos device, so the driver fails and says why.
    let napalm = env.settle(&napalm.id, 1, SETTLE).await;
    assert_eq!(napalm.status(), S::Failed, "{}", env.logs());
    let reason = &napalm.failure_reason;
    assert!(
        reason.contains("configuration vqfx-junos.txt of endpoint `vqfx`"),
        "{reason}"
    );
    let log = env.log_of(&napalm.id, "vqfx").await;
    assert!(
        log.contains("Password auth succeeded for 'antidote'"),
        "the NAPALM driver did not log in: {log}"
    );
    assert!(!reason.contains("antidotepassword"), "{reason}");
    assert!(
        !env.agent.log_text().contains("antidotepassword"),
        "the agent logged a password"
    );
    env.delete_all(&[&both.id, &napalm.id]).await;
}

#[tokio::test]
async fn k8s_python_that_fails_or_hangs_is_failed_with_the_reason() {
    // Real python in the configurator image: the failing script's own output and exit code
    // reach the reason through its pod's termination message
    // (`terminationMessagePolicy: FallbackToLogsOnError`); the hanging one is ended by the
    // pod's and the Job's deadlines.
    let env = k8s_env(
        "k8s-configurators-fail",
        &[
            "--configurator-image",
            "antidote/configurator:latest",
            "--config-timeout",
            "3s",
            "--config-backoff-limit",
            "1",
        ],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let fails = c.request(&session, "python-fails", 0).await.unwrap();
    let hangs = c.request(&session, "python-hangs", 0).await.unwrap();

    let fails = env.settle(&fails.id, 1, SETTLE).await;
    assert_eq!(fails.status(), S::Failed, "{}", env.logs());
    let reason = &fails.failure_reason;
    for words in [
        "configuration box.py of endpoint `box` for stage 0 failed (2 tries",
        "BackoffLimitExceeded",
        "last try: exit code 4: ",
        "python configuration broken on purpose",
    ] {
        assert!(reason.contains(words), "{words:?} in {reason}");
    }

    let hangs = env.settle(&hangs.id, 1, SETTLE).await;
    assert_eq!(hangs.status(), S::Failed, "{}", env.logs());
    let reason = &hangs.failure_reason;
    for words in [
        "configuration box.py of endpoint `box`",
        "did not finish within",
        "DeadlineExceeded",
    ] {
        assert!(reason.contains(words), "{words:?} in {reason}");
    }
    assert!(!reason.contains("antidotepassword"), "{reason}");

    env.delete_all(&[&fails.id, &hangs.id]).await;
}

#[tokio::test]
async fn k8s_jupyter_guide_serves_the_current_stages_notebook() {
    let env = k8s_env(
        "k8s-jupyter-guide",
        &["--jupyter-image", "antidote/jupyter:latest"],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let live = c.request(&session, "jupyter-guide", 0).await.unwrap();
    let live = env.settle(&live.id, 1, SETTLE).await;
    assert_eq!(
        live.status(),
        S::Ready,
        "{}\n{}",
        live.failure_reason,
        env.logs()
    );
    let names: Vec<&str> = live.endpoints.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["box", "jupyter-guide"]);
    // A real Jupyter server in the guide pod serves stage 0's notebook, then stage 1's as soon
    // as that stage is READY.
    let text = served_notebook(&live).await;
    assert!(text.contains("notebook-of-stage-zero"), "{text}");
    c.lessons
        .clone()
        .set_stage(with_token(
            api::SetStageRequest {
                id: live.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&live.id),
        ))
        .await
        .unwrap();
    let staged = env.settle(&live.id, 2, SETTLE).await;
    assert_eq!(
        staged.status(),
        S::Ready,
        "{}\n{}",
        staged.failure_reason,
        env.logs()
    );
    let text = served_notebook(&staged).await;
    assert!(text.contains("notebook-of-stage-one"), "{text}");
    assert!(!text.contains("notebook-of-stage-zero"), "{text}");
    env.delete_all(&[&live.id]).await;
}

/// deploy/k8s/agent-k8s.yaml's agent offers every configuration type and Jupyter guides: its
/// Deployment's environment names both images (the real agent-k8s, started with those
/// variables, claims them in its handshake). The references there are what an operator
/// replaces with the images pushed where the cluster pulls from.
#[tokio::test]
async fn k8s_agent_of_deploy_k8s_offers_configurators_and_jupyter_guides() {
    use antidote_proto::agent::v1 as agent;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/agent-k8s.yaml");
    let docs = crate::deploy::documents(&manifest);
    let env = crate::deploy::container_env(crate::deploy::find(&docs, "Deployment", "agent-k8s"));
    let mut chosen: Vec<(&str, String)> = env
        .iter()
        .filter(|(k, _)| {
            k == "ANTIDOTE_K8S_CONFIGURATOR_IMAGE" || k == "ANTIDOTE_K8S_JUPYTER_IMAGE"
        })
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    assert_eq!(chosen.len(), 2, "{env:?}");
    assert!(chosen.iter().all(|(_, v)| !v.is_empty()), "{chosen:?}");
    let dir = tempfile::tempdir().unwrap();
    let client = crate::k8s::admin().await;
    let kubeconfig = crate::k8s::agent_kubeconfig(&client, dir.path()).await;
    chosen.push(("KUBECONFIG", kubeconfig.display().to_string()));
    let agent_process = Process::spawn_with_env(
        &workspace_bin("agent-k8s"),
        &["--listen".into(), "127.0.0.1:0".into()],
        &chosen,
        dir.path().join("agent-k8s.log"),
    )
    .await
    .expect("agent-k8s starts");
    let mut client = agent::backend_client::BackendClient::connect(agent_process.url())
        .await
        .unwrap();
    let answer = client
        .handshake(agent::HandshakeRequest {
            supported_majors: vec![1],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    for capability in [
        "configuration.shell",
        "configuration.python",
        "configuration.ansible",
        "configuration.napalm",
        "guide.jupyter",
    ] {
        assert!(
            answer.capabilities.iter().any(|c| c == capability),
            "{capability} not in {:?}",
            answer.capabilities
        );
    }
}

/// The conformance suite's configurator and Jupyter guide checks against the agent at `url`,
/// with the SSH endpoint image: `configuration-python` and `configuration-ansible` (which log in
/// to the endpoint with the credentials `--config-user`/`--config-password` put in the spec) and
/// `guide-jupyter` pass. `configuration-napalm` needs an image NAPALM can configure
/// (`--napalm-image`), which cannot be built here: it is skipped, and the napalm path is covered
/// by the tests above, which log in to the endpoint's port 22 as NAPALM does.
async fn conformance_configurator_checks(url: &str, agent_log: impl Fn() -> String) {
    let output = tokio::process::Command::new(workspace_bin("antidote-conformance"))
        .args([
            "--agent",
            url,
            "--image",
            "sshd",
            "--config-user",
            "antidote",
            "--config-password",
            "antidotepassword",
            "--check",
            "configuration-python",
            "--check",
            "configuration-ansible",
            "--check",
            "configuration-napalm",
            "--check",
            "guide-jupyter",
        ])
        .output()
        .await
        .expect("antidote-conformance runs");
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    let logs = || {
        format!(
            "{report}\n{}\n--- agent ---\n{}",
            String::from_utf8_lossy(&output.stderr),
            agent_log()
        )
    };
    assert!(output.status.success(), "{}", logs());
    for line in [
        "PASS  configuration-python",
        "PASS  configuration-ansible",
        "SKIP  configuration-napalm",
        "PASS  guide-jupyter",
    ] {
        assert!(report.contains(line), "{line:?}:\n{}", logs());
    }
    assert!(report.contains(" 0 failed"), "{}", logs());
    assert!(!report.contains("antidotepassword"), "{report}");
}

#[tokio::test]
async fn agent_docker_passes_the_conformance_configurator_and_jupyter_checks() {
    let env = docker_env("e2e-configurators-conformance", &[]).await;
    conformance_configurator_checks(&env.agent.url(), || env.agent.log_text()).await;
}

/// The same checks against agent-k8s on the test node, with its configurator and Jupyter
/// images: every configuration type it claims and `guide.jupyter` pass there too.
#[tokio::test]
async fn agent_k8s_passes_the_conformance_configurator_and_jupyter_checks() {
    let env = k8s_env(
        "k8s-configurators-conformance",
        &[
            "--configurator-image",
            "antidote/configurator:latest",
            "--jupyter-image",
            "antidote/jupyter:latest",
            "--config-timeout",
            "90s",
        ],
    )
    .await;
    conformance_configurator_checks(&env.agent.url(), || env.agent.log_text()).await;
}
