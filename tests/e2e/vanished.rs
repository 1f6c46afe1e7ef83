//! Live lessons that disappear behind the scheduler's back: their containers removed with the
//! Docker API, their namespace or one of their pods deleted on the real Kubernetes node, or a local process
//! deprovisioning them through the agent's own port. A learner (and a watcher of the public API)
//! sees the READY live lesson turn FAILED with a reason saying what went; asking again
//! provisions it afresh. A live lesson the scheduler deletes itself is never reported FAILED.

use std::collections::HashMap;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_sdk::labels;
use antidote_tests::{Process, Scheduler, example_curriculum, fetch, presentation};
use api::LiveLessonStatus as S;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams};
use tempfile::TempDir;

use crate::PATIENCE;
use crate::docker::DockerEnv;
use crate::k8s::{K8sEnv, Leftovers};

/// A scheduler and one agent, for one test.
struct Vanishing {
    dir: TempDir,
    agent: Process,
    scheduler: Scheduler,
    /// The scheduler's configuration, to start it again.
    config: String,
    /// The instance's lesson namespaces, deleted at the end (agent-k8s).
    _leftovers: Option<Leftovers>,
}

impl Vanishing {
    /// A scheduler driving agent-docker on the test engine (DOCKER_HOST).
    async fn docker(instance: &str) -> Vanishing {
        let DockerEnv {
            dir,
            agent,
            scheduler,
            config,
            ..
        } = DockerEnv::start(instance, &example_curriculum(), &[]).await;
        Vanishing {
            dir,
            agent,
            scheduler,
            config,
            _leftovers: None,
        }
    }

    /// A scheduler driving agent-k8s (as its ServiceAccount) on the test node (KUBECONFIG).
    async fn k8s(instance: &str) -> Vanishing {
        let K8sEnv {
            dir,
            agent,
            scheduler,
            config,
            leftovers,
            ..
        } = K8sEnv::start(instance, &[]).await;
        Vanishing {
            dir,
            agent,
            scheduler,
            config,
            _leftovers: Some(leftovers),
        }
    }

    /// Calls the agent's Deprovision directly, as any local process reaching its port may.
    async fn deprovision_behind_the_back(&self, id: &str) {
        let mut client = agent::backend_client::BackendClient::connect(self.agent.url())
            .await
            .unwrap();
        client
            .deprovision(agent::DeprovisionRequest {
                live_lesson_id: id.to_owned(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    fn logs(&self) -> String {
        format!(
            "--- scheduler ---\n{}\n--- agent ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text()
        )
    }

    /// A new session's live lesson of `lesson`, READY; returns the session too.
    async fn ready(&self, lesson: &str) -> (String, api::LiveLesson) {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let requested = c.request(&session, lesson, 0).await.unwrap();
        let ready = c
            .ready(&requested.id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()));
        (session, ready)
    }

    /// Starts a watcher of the public API on a READY live lesson and waits until it has seen
    /// READY; the returned task ends with everything it saw until the live lesson settled
    /// again in FAILED (or was re-provisioned to a new generation).
    async fn watcher(
        &self,
        id: &str,
    ) -> tokio::task::JoinHandle<anyhow::Result<(Vec<S>, api::LiveLesson)>> {
        let c = self.scheduler.clients.clone();
        let (seen_ready, ready) = tokio::sync::oneshot::channel();
        let id = id.to_owned();
        let task = tokio::spawn(async move {
            let seen_ready = std::sync::Mutex::new(Some(seen_ready));
            c.follow(&id, PATIENCE * 2, move |l| {
                if l.status() == S::Ready
                    && let Some(tx) = seen_ready.lock().unwrap().take()
                {
                    let _ = tx.send(());
                }
                l.status() == S::Failed
            })
            .await
        });
        ready.await.expect("the watcher saw the live lesson READY");
        task
    }

    /// The live lesson as a learner reads it.
    async fn get(&self, id: &str) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        c.get(id).await.unwrap()
    }

    /// Asks for the FAILED live lesson again: a new generation is provisioned and is READY.
    async fn asked_again(&self, session: &str, failed: &api::LiveLesson) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let retried = c.request(session, &failed.lesson_slug, 0).await.unwrap();
        assert_eq!(
            retried.id, failed.id,
            "asking again retries the same live lesson"
        );
        let (_, again) = c
            .follow(&failed.id, PATIENCE * 2, |l| {
                l.generation > failed.generation && matches!(l.status(), S::Ready | S::Failed)
            })
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()));
        assert_eq!(
            again.status(),
            S::Ready,
            "{}\n{}",
            again.failure_reason,
            self.logs()
        );
        again
    }

    /// Deletes the live lesson through the public API and returns every status a watcher saw
    /// until it was gone.
    async fn deleted(&self, id: &str) -> Vec<S> {
        let c = &self.scheduler.clients;
        let mut stream = c
            .lessons
            .clone()
            .watch_live_lesson(antidote_tests::with_token(
                api::WatchLiveLessonRequest { id: id.into() },
                c.tokens.of_lesson(id),
            ))
            .await
            .unwrap()
            .into_inner();
        c.lessons
            .clone()
            .delete_live_lesson(antidote_tests::with_token(
                api::DeleteLiveLessonRequest { id: id.into() },
                c.tokens.of_lesson(id),
            ))
            .await
            .unwrap();
        let mut seen = Vec::new();
        tokio::time::timeout(PATIENCE, async {
            while let Some(lesson) = stream.message().await.unwrap() {
                if seen.last() != Some(&lesson.status()) {
                    seen.push(lesson.status());
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("live lesson {id} still exists\n{}", self.logs()));
        seen
    }
}

/// The watcher's outcome: the FAILED state it ended on, having seen READY before.
async fn failed_seen_by(
    watcher: tokio::task::JoinHandle<anyhow::Result<(Vec<S>, api::LiveLesson)>>,
    env: &Vanishing,
) -> api::LiveLesson {
    let (seen, failed) = watcher
        .await
        .unwrap()
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(seen.first(), Some(&S::Ready), "{seen:?}");
    assert_eq!(failed.status(), S::Failed);
    failed
}

#[tokio::test]
async fn docker_containers_removed_behind_the_schedulers_back_turn_a_ready_lesson_failed() {
    let env = Vanishing::docker("e2e-vanished-docker").await;
    let (session, ready) = env.ready("hello-web").await;
    let page = fetch(presentation(&ready, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let watcher = env.watcher(&ready.id).await;

    // An operator (or a crash) removes the lesson's containers, as `docker rm -f` does.
    let docker = bollard::Docker::connect_with_defaults().unwrap();
    let containers = docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([(
                "label".to_owned(),
                vec![format!("{}={}", labels::LIVE_LESSON, ready.id)],
            )])),
            ..Default::default()
        }))
        .await
        .unwrap();
    assert!(!containers.is_empty(), "the lesson has containers");
    for container in containers {
        docker
            .remove_container(
                container.id.as_deref().unwrap(),
                Some(bollard::query_parameters::RemoveContainerOptions {
                    force: true,
                    ..Default::default()
                }),
            )
            .await
            .unwrap();
    }

    let failed = failed_seen_by(watcher, &env).await;
    assert!(
        failed.failure_reason.contains("`web`"),
        "the reason names the endpoint that went: {}",
        failed.failure_reason
    );
    let read = env.get(&ready.id).await;
    assert_eq!(
        (read.status(), read.failure_reason.as_str()),
        (S::Failed, failed.failure_reason.as_str())
    );

    let again = env.asked_again(&session, &failed).await;
    let page = fetch(presentation(&again, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let seen = env.deleted(&again.id).await;
    assert!(
        !seen.contains(&S::Failed),
        "a deliberate delete is not a failure: {seen:?}"
    );
}

#[tokio::test]
async fn docker_a_deprovision_through_the_agents_port_turns_a_ready_lesson_failed() {
    let env = Vanishing::docker("e2e-vanished-deprovision").await;
    let (session, ready) = env.ready("hello-web").await;
    let watcher = env.watcher(&ready.id).await;

    // Anyone who reaches the agent's port may call it: here, to remove the live lesson.
    env.deprovision_behind_the_back(&ready.id).await;

    let failed = failed_seen_by(watcher, &env).await;
    assert!(
        failed.failure_reason.contains("no longer holds"),
        "{}",
        failed.failure_reason
    );
    let read = env.get(&ready.id).await;
    assert_eq!(read.status(), S::Failed);

    let again = env.asked_again(&session, &failed).await;
    let page = fetch(presentation(&again, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let seen = env.deleted(&again.id).await;
    assert!(!seen.contains(&S::Failed), "{seen:?}");
}

#[tokio::test]
async fn docker_a_lesson_removed_while_the_scheduler_is_down_is_failed_when_it_comes_back() {
    let mut env = Vanishing::docker("e2e-vanished-down").await;
    let (session, ready) = env.ready("hello-web").await;
    let tokens = env.scheduler.clients.tokens.clone();

    // No Watch stream sees the removal: the scheduler is down meanwhile.
    env.scheduler.process.kill9().await;
    env.deprovision_behind_the_back(&ready.id).await;
    env.scheduler = Scheduler::start(env.dir.path(), &env.config)
        .await
        .expect("scheduler starts again");
    // The learners' tokens outlive the scheduler process (the store keeps their hashes).
    env.scheduler.clients.tokens = tokens;

    let (_, failed) = env
        .scheduler
        .clients
        .follow(&ready.id, PATIENCE, |l| l.status() == S::Failed)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert!(
        failed.failure_reason.contains("no longer holds"),
        "{}",
        failed.failure_reason
    );
    let again = env.asked_again(&session, &failed).await;
    let seen = env.deleted(&again.id).await;
    assert!(!seen.contains(&S::Failed), "{seen:?}");
}

#[tokio::test]
async fn k8s_a_namespace_deleted_behind_the_schedulers_back_turns_a_ready_lesson_failed() {
    let env = Vanishing::k8s("e2e-vanished-k8s").await;
    let (session, ready) = env.ready("sandboxed").await;
    let watcher = env.watcher(&ready.id).await;

    // An operator deletes the lesson's namespace, as `kubectl delete namespace` does.
    let namespace = format!("antidote-{}", ready.id);
    let namespaces: Api<Namespace> = Api::all(crate::k8s::admin().await);
    namespaces
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();

    let failed = failed_seen_by(watcher, &env).await;
    assert!(
        failed.failure_reason.contains(&namespace),
        "the reason names the namespace: {}",
        failed.failure_reason
    );
    let read = env.get(&ready.id).await;
    assert_eq!(read.status(), S::Failed);

    // Asked again, the live lesson gets a new namespace once the old one is gone.
    let again = env.asked_again(&session, &failed).await;
    let page = fetch(presentation(&again, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let seen = env.deleted(&again.id).await;
    assert!(!seen.contains(&S::Failed), "{seen:?}");
}

#[tokio::test]
async fn k8s_a_pod_deleted_behind_the_schedulers_back_turns_a_ready_lesson_failed() {
    let env = Vanishing::k8s("e2e-vanished-k8s-pod").await;
    let (session, ready) = env.ready("sandboxed").await;
    let watcher = env.watcher(&ready.id).await;

    // An operator (or an eviction) deletes one endpoint's pod; nothing recreates a bare pod.
    let namespace = format!("antidote-{}", ready.id);
    let pods: Api<Pod> = Api::namespaced(crate::k8s::admin().await, &namespace);
    pods.delete("web", &DeleteParams::default()).await.unwrap();

    let failed = failed_seen_by(watcher, &env).await;
    assert!(
        failed
            .failure_reason
            .contains(&format!("Pod {namespace}/web")),
        "the reason names the pod: {}",
        failed.failure_reason
    );
    assert_eq!(env.get(&ready.id).await.status(), S::Failed);

    // Asked again, the live lesson runs again.
    let again = env.asked_again(&session, &failed).await;
    let page = fetch(presentation(&again, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let seen = env.deleted(&again.id).await;
    assert!(!seen.contains(&S::Failed), "{seen:?}");
}
