//! TTL expiry and orphan collection.

use std::collections::HashMap;
use std::time::Duration;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::with_token;
use tokio_stream::StreamExt;

use crate::{Env, Knobs, PATIENCE};

#[tokio::test]
async fn an_idle_live_lesson_is_reclaimed_after_its_ttl() {
    let env = Env::start(
        &[],
        Knobs {
            lesson_ttl: "1s",
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
        .get(&format!(
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
            lesson_ttl: "2s",
            session_ttl: "2s",
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
        let lesson = c
            .lessons
            .clone()
            .get_live_lesson(with_token(
                api::GetLiveLessonRequest { id: id.clone() },
                c.tokens.of_lesson(id),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(lesson.status(), api::LiveLessonStatus::Ready);
    }
    let kept = c
        .lessons
        .clone()
        .get_live_lesson(with_token(
            api::GetLiveLessonRequest {
                id: kept.id.clone(),
            },
            c.tokens.of_lesson(&kept.id),
        ))
        .await
        .unwrap()
        .into_inner();
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
            heartbeat_interval: None,
        })
        .await
        .unwrap()
        .into_inner();
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
        ids.contains(&known.id) && ids.contains(&foreign) && !ids.contains(&orphan),
        "{ids:?} (orphan {orphan}, foreign {foreign}, known {})\n{}",
        known.id,
        env.logs()
    );
}
