//! Warm pools on agent-k8s and the real test node: the scheduler keeps members READY as
//! namespaces with running pods, a request is answered with one of them READY, its pod serves
//! the page its configuration wrote, and the pool makes a new member in its place.

use std::collections::HashSet;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Pool, ms};
use antidote_tests::{Clients, example_curriculum, fetch, presentation};
use api::LiveLessonStatus as S;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, ListParams};

use crate::PATIENCE;
use crate::k8s::{K8sEnv, exec, scheduler_config};

const INSTANCE: &str = "e2e-k8s-pools";

/// The pool of hello-web at stage 0, as the admin API shows it.
async fn pool(c: &Clients) -> Option<api::Pool> {
    c.admin
        .clone()
        .list_pools(api::ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pools
        .into_iter()
        .find(|p| p.lesson_slug == "hello-web" && p.stage == 0)
}

/// hello-web's live lessons, by id.
async fn live_lessons(c: &Clients) -> Vec<api::LiveLesson> {
    c.admin
        .clone()
        .list_live_lessons(api::AdminListLiveLessonsRequest {
            lesson_slug: "hello-web".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .live_lessons
}

/// Polls until `done` holds of the pool (a guard against hangs, not a timing assertion).
async fn until_pool(
    c: &Clients,
    what: &str,
    logs: impl Fn() -> String,
    done: impl Fn(&api::Pool) -> bool,
) {
    let start = tokio::time::Instant::now();
    loop {
        let seen = pool(c).await;
        if seen.as_ref().is_some_and(&done) {
            return;
        }
        assert!(
            start.elapsed() < PATIENCE * 2,
            "the pool never {what}: {seen:?}\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_warm_pool_on_the_node_hands_out_a_ready_member_whose_pod_serves_and_refills() {
    // The environment deletes the instance's namespaces when the test ends, passed or not:
    // pool members would otherwise keep running on the shared node.
    let config = scheduler_config(INSTANCE, &example_curriculum())
        .with_pools_interval(ms(200))
        .with_pool(Pool::new("hello-web", 2));
    let env = K8sEnv::with_config(tempfile::tempdir().unwrap(), config, &[]).await;
    let (client, c) = (&env.client, &env.scheduler.clients);
    let logs = || env.logs();
    until_pool(c, "had 2 READY members", logs, |p| p.ready == 2).await;
    let waiting: HashSet<String> = live_lessons(c).await.into_iter().map(|l| l.id).collect();
    assert_eq!(waiting.len(), 2, "{waiting:?}");

    // The answer to the request is a READY member, with its endpoints' addresses.
    let session = c.session().await.unwrap();
    let mine = c.request(&session, "hello-web", 0).await.unwrap();
    assert_eq!(mine.status(), S::Ready, "{mine:?}\n{}", logs());
    assert!(
        waiting.contains(&mine.id),
        "{} is not a pool member",
        mine.id
    );

    // Its pod runs on the node and serves the page stage 0's configuration wrote.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &format!("antidote-{}", mine.id));
    let web = pods.get("web").await.unwrap();
    let status = web.status.clone().unwrap_or_default();
    assert_eq!(status.phase.as_deref(), Some("Running"), "{status:?}");
    let answer = fetch(presentation(&mine, "web", "page")).await;
    assert!(answer.starts_with("HTTP/1."), "{answer}");
    assert!(answer.contains("Hello from Antidote"), "{answer}");
    let inside = exec(&pods, "web", "cat /www/index.html").await;
    assert_eq!(inside.code, 0, "{inside:?}");
    assert!(inside.output.contains("Hello from Antidote"), "{inside:?}");

    // The pool makes a new member in its place: two READY again, neither of them mine, each a
    // namespace on the cluster.
    until_pool(c, "refilled", logs, |p| p.ready == 2 && p.starting == 0).await;
    let refilled: HashSet<String> = live_lessons(c)
        .await
        .into_iter()
        .map(|l| l.id)
        .filter(|id| *id != mine.id)
        .collect();
    assert_eq!(refilled.len(), 2, "{refilled:?}");
    assert!(
        refilled.difference(&waiting).count() == 1,
        "one new member beside the one left: {refilled:?} (before: {waiting:?})"
    );
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let on_cluster: HashSet<String> = namespaces
        .list(&ListParams::default().labels(&format!("antidote.io/instance={INSTANCE}")))
        .await
        .unwrap()
        .into_iter()
        .filter_map(|ns| ns.metadata.name)
        .collect();
    for id in refilled.iter().chain([&mine.id]) {
        assert!(
            on_cluster.contains(&format!("antidote-{id}")),
            "{id} has no namespace: {on_cluster:?}"
        );
    }

    // Deleting the claimed lesson removes its namespace; the pool's members stay.
    c.delete(&mine.id, PATIENCE).await.unwrap();
    assert!(
        namespaces
            .get_opt(&format!("antidote-{}", mine.id))
            .await
            .unwrap()
            .is_none(),
        "the claimed lesson's namespace outlived it"
    );
    assert_eq!(pool(c).await.map(|p| p.ready), Some(2));
}
