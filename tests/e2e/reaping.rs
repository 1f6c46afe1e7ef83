//! TTL expiry and orphan collection.

use std::collections::HashMap;
use std::time::Duration;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::config::secs;
use antidote_tests::with_token;
use tokio_stream::StreamExt;

use crate::{Env, Knobs, PATIENCE};

#[tokio::test]
async fn an_idle_live_lesson_is_reclaimed_after_its_ttl() {
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config().with_lesson_ttl(secs(1)),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id).await.unwrap();
    c.gone(&lesson.id, PATIENCE).await.unwrap();
    let events = c
        .admin
        .clone()
        .list_events(api::ListEventsRequest {
            live_lesson_id: lesson.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    assert!(
        events.iter().any(|e| e.detail.contains("live lesson TTL")),
        "{events:?}"
    );
    let listed = env
        .agent_client()
        .await
        .list(agent::ListRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.items.is_empty(), "{listed:?}");
    // The reaper's action is counted.
    let metrics = antidote_tests::web::Web::default()
        .scrape(&format!(
            "{}/metrics",
            env.scheduler.process.extra_url("admin http").unwrap()
        ))
        .await
        .unwrap()
        .body;
    assert_eq!(
        antidote_tests::web::sample(
            &metrics,
            r#"antidote_reaper_actions_total{action="expire_live_lesson"}"#
        ),
        Some(1.0),
        "{metrics}"
    );
    // The session itself is still alive: its TTL is separate.
    c.sessions
        .clone()
        .get_session(api::GetSessionRequest { id: session })
        .await
        .unwrap();
}

#[tokio::test]
async fn heartbeats_and_persistent_sessions_keep_lessons_alive() {
    let env = Env::start(
        &[],
        Knobs {
            config: Env::config()
                .with_lesson_ttl(secs(2))
                .with_session_ttl(secs(2)),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;
    let beating_session = c.session().await.unwrap();
    let beating = c.request(&beating_session, "hello-web", 0).await.unwrap();
    let persistent_session = c.session().await.unwrap();
    c.admin
        .clone()
        .persist_session(api::PersistSessionRequest {
            id: persistent_session.clone(),
            persistent: true,
        })
        .await
        .unwrap();
    let kept = c
        .request(&persistent_session, "hello-web", 0)
        .await
        .unwrap();
    let idle_session = c.session().await.unwrap();
    let idle = c.request(&idle_session, "hello-web", 0).await.unwrap();
    for id in [&beating.id, &kept.id, &idle.id] {
        c.ready(id).await.unwrap();
    }
    // Heartbeat well within the TTL until the idle one is gone (which takes at least 2 s).
    let mut lessons = c.lessons.clone();
    let beat = beating.id.clone();
    let beat_token = c.tokens.of_lesson(&beat);
    let heartbeats = tokio::spawn(async move {
        loop {
            lessons
                .heartbeat(with_token(
                    api::HeartbeatRequest { id: beat.clone() },
                    beat_token.clone(),
                ))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    c.gone(&idle.id, PATIENCE).await.unwrap();
    // The idle session went with it.
    let status = c
        .sessions
        .clone()
        .get_session(with_token(
            api::GetSessionRequest {
                id: idle_session.clone(),
            },
            c.tokens.of_session(&idle_session),
        ))
        .await
        .unwrap_err();
    // Its token went with it.
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    // Give the reaper two more TTLs to (wrongly) take the others.
    tokio::time::sleep(Duration::from_secs(4)).await;
    heartbeats.abort();
    for id in [&beating.id, &kept.id] {
        let lesson = c.get(id).await.unwrap();
        assert_eq!(lesson.status(), api::LiveLessonStatus::Ready);
    }
    let kept = c.get(&kept.id).await.unwrap();
    assert!(
        kept.expires_at.is_none(),
        "persistent lessons do not expire"
    );
}

#[tokio::test]
async fn orphans_on_an_agent_are_removed_after_the_grace_period() {
    let env = Env::start(&[], Knobs::default()).await;
    let c = &env.scheduler.clients;
    // Make sure the scheduler is connected to the agent before planting the orphan.
    let session = c.session().await.unwrap();
    let known = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&known.id).await.unwrap();

    let mut agent_client = env.agent_client().await;
    let mut events = agent_client
        .watch(agent::WatchRequest {
            label_selector: HashMap::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // The scheduler's cluster id, from the labels it put on its own live lesson.
    let cluster = cluster_of(&mut agent_client, &known.id).await;
    let orphan = uuid::Uuid::new_v4().to_string();
    let spec = agent::LessonSpec {
        live_lesson_id: orphan.clone(),
        session_id: uuid::Uuid::new_v4().to_string(),
        lesson_slug: "hello-web".into(),
        generation: 1,
        stage: 0,
        endpoints: vec![agent::Endpoint {
            name: "web".into(),
            image: Some(agent::Image {
                slug: "busybox".into(),
                ..Default::default()
            }),
            presentations: vec![agent::Presentation {
                name: "page".into(),
                r#type: agent::PresentationType::Http as i32,
                port: 8080,
            }],
            ..Default::default()
        }],
        labels: HashMap::from([
            ("antidote.io/instance".to_owned(), "e2e".to_owned()),
            ("antidote.io/cluster".to_owned(), cluster.clone()),
            ("antidote.io/live-lesson".to_owned(), orphan.clone()),
            (
                "antidote.io/session".to_owned(),
                uuid::Uuid::new_v4().to_string(),
            ),
            ("antidote.io/generation".to_owned(), "1".to_owned()),
            ("antidote.io/lesson".to_owned(), "hello-web".to_owned()),
        ]),
        ..Default::default()
    };
    agent_client
        .provision(agent::ProvisionRequest {
            spec: Some(spec.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    // A foreign object (another scheduler's instance) must be left alone.
    let foreign = uuid::Uuid::new_v4().to_string();
    let mut foreign_spec = spec.clone();
    foreign_spec.live_lesson_id = foreign.clone();
    foreign_spec
        .labels
        .insert("antidote.io/instance".into(), "someone-else".into());
    foreign_spec
        .labels
        .insert("antidote.io/live-lesson".into(), foreign.clone());
    agent_client
        .provision(agent::ProvisionRequest {
            spec: Some(foreign_spec),
            ..Default::default()
        })
        .await
        .unwrap();

    // Objects without a cluster label (a scheduler before the cluster id made them, or
    // something else did) are never reaped, even with our instance id.
    let legacy = uuid::Uuid::new_v4().to_string();
    let mut legacy_spec = spec.clone();
    legacy_spec.live_lesson_id = legacy.clone();
    legacy_spec.labels.remove("antidote.io/cluster");
    legacy_spec
        .labels
        .insert("antidote.io/live-lesson".into(), legacy.clone());
    agent_client
        .provision(agent::ProvisionRequest {
            spec: Some(legacy_spec),
            ..Default::default()
        })
        .await
        .unwrap();

    tokio::time::timeout(PATIENCE, async {
        while let Some(event) = events.next().await {
            if let Some(agent::watch_event::Event::Deleted(deleted)) = event.unwrap().event {
                assert_eq!(deleted.live_lesson_id, orphan, "only the orphan is removed");
                return;
            }
        }
        panic!("the watch ended");
    })
    .await
    .expect("the orphan is removed");
    let items = agent_client
        .list(agent::ListRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    let ids: Vec<_> = items.into_iter().map(|s| s.live_lesson_id).collect();
    assert!(
        ids.contains(&known.id)
            && ids.contains(&foreign)
            && ids.contains(&legacy)
            && !ids.contains(&orphan),
        "{ids:?} (orphan {orphan}, foreign {foreign}, legacy {legacy}, known {})\n{}",
        known.id,
        env.logs()
    );
}

/// The `antidote.io/cluster` label an agent reports for one of its live lessons.
async fn cluster_of(
    agent_client: &mut agent::backend_client::BackendClient<tonic::transport::Channel>,
    id: &str,
) -> String {
    let state = agent_client
        .get(agent::GetRequest {
            live_lesson_id: id.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .state
        .expect("a state");
    let cluster = state
        .labels
        .get("antidote.io/cluster")
        .cloned()
        .unwrap_or_default();
    assert!(!cluster.is_empty(), "no cluster label: {:?}", state.labels);
    cluster
}

/// Two deployments (each its own SQLite database, so its own cluster id) with the SAME instance
/// id share one agent: neither takes the other's live lessons for orphans, however many orphan
/// rounds pass (every 200 ms, grace 500 ms).
#[tokio::test]
async fn two_deployments_with_one_instance_id_never_reap_each_other() {
    let env = Env::start(&[], Knobs::default()).await;
    let other_dir = tempfile::tempdir().expect("temp dir");
    // The same configuration: instance id `e2e`, the same agent, the same reaper knobs.
    let other = antidote_tests::Scheduler::start(other_dir.path(), &env.config)
        .await
        .expect("the second deployment starts");
    let (a, b) = (&env.scheduler.clients, &other.clients);
    let session_a = a.session().await.unwrap();
    let lesson_a = a.request(&session_a, "hello-web", 0).await.unwrap();
    let session_b = b.session().await.unwrap();
    let lesson_b = b.request(&session_b, "hello-web", 0).await.unwrap();
    a.ready(&lesson_a.id).await.unwrap();
    b.ready(&lesson_b.id).await.unwrap();
    let mut agent_client = env.agent_client().await;
    let (cluster_a, cluster_b) = (
        cluster_of(&mut agent_client, &lesson_a.id).await,
        cluster_of(&mut agent_client, &lesson_b.id).await,
    );
    assert_ne!(cluster_a, cluster_b, "each database has its own cluster id");
    let mut events = agent_client
        .watch(agent::WatchRequest {
            label_selector: HashMap::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Ten times the orphan grace: each scheduler lists the agent some 25 times meanwhile, and
    // each sees the other's live lesson under its own instance id. No deletion may come.
    let quiet = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(event) = events.next().await {
            if let Some(agent::watch_event::Event::Deleted(deleted)) = event.unwrap().event {
                return Some(deleted.live_lesson_id);
            }
        }
        None
    })
    .await;
    let logs = || {
        format!(
            "{}\n--- second scheduler log ---\n{}",
            env.logs(),
            other.process.log_text()
        )
    };
    assert!(
        quiet.is_err(),
        "a live lesson was removed: {quiet:?}\n{}",
        logs()
    );
    for (clients, id) in [(a, &lesson_a.id), (b, &lesson_b.id)] {
        let lesson = clients.get(id).await.unwrap();
        assert_eq!(lesson.status(), api::LiveLessonStatus::Ready, "{}", logs());
    }
    let mut created = env.creations();
    created.sort();
    let mut expected = vec![lesson_a.id.clone(), lesson_b.id.clone()];
    expected.sort();
    assert_eq!(
        created, expected,
        "each created once, none removed and re-created"
    );
    // Each deployment still removes its own.
    a.delete(&lesson_a.id, PATIENCE).await.unwrap();
    b.delete(&lesson_b.id, PATIENCE).await.unwrap();
}
