//! The whole lifecycle through the public API.

use std::collections::HashMap;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use api::LiveLessonStatus as S;

use antidote_tests::{fetch, presentation};

use crate::{Env, Knobs, PATIENCE};

#[tokio::test]
async fn session_request_watch_stage_heartbeat_delete() {
    let env = Env::start(
        &["--boot-delay", "300ms", "--configure-delay", "200ms"],
        Knobs::default(),
    )
    .await;
    let c = &env.scheduler.clients;

    let lessons = c
        .curriculum
        .clone()
        .list_lessons(api::ListLessonsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        lessons.lessons.iter().any(|l| l.slug == "routing-basics"),
        "{lessons:?}"
    );

    let session = c.session().await.unwrap();
    let requested = c.request(&session, "routing-basics", 0).await.unwrap();
    assert_eq!(requested.status(), S::Pending);
    assert_eq!(requested.generation, 1);

    let (seen, ready) = c
        .follow(&requested.id, PATIENCE, |l| {
            matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(
        ready.status(),
        S::Ready,
        "{}\n{}",
        ready.failure_reason,
        env.logs()
    );
    // The watch shows the transitions in order (a fast step may be skipped, never reordered).
    let order = [S::Pending, S::Booting, S::Configuring, S::Ready];
    let positions: Vec<_> = seen
        .iter()
        .map(|s| order.iter().position(|o| o == s).expect("known status"))
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert_eq!((ready.healthy, ready.total), (4, 4), "{ready:?}");
    assert_eq!(ready.agent, "", "learners are not told the agent");
    assert_eq!(c.agent_of(&ready.id).await.unwrap(), "loopback");

    // The endpoints really answer, at stage 0.
    let web = fetch(presentation(&ready, "server", "web")).await;
    assert!(web.starts_with("HTTP/1.0 200"), "{web}");
    assert!(web.ends_with("routing-basics server stage 0\n"), "{web}");
    let ssh = fetch(presentation(&ready, "router", "cli")).await;
    assert!(ssh.starts_with("SSH-2.0-"), "{ssh}");

    // Asking again returns the same live lesson and only touches it.
    let again = c.request(&session, "routing-basics", 0).await.unwrap();
    assert_eq!(
        (again.id.as_str(), again.generation, again.status()),
        (ready.id.as_str(), 1, S::Ready)
    );

    // Stage change: READY → CONFIGURING → READY, and the endpoints now serve stage 1.
    let changed = c
        .lessons
        .clone()
        .set_stage(api::SetStageRequest {
            id: ready.id.clone(),
            stage: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (changed.status(), changed.stage, changed.generation),
        (S::Configuring, 1, 2)
    );
    let (_, staged) = c
        .follow(&ready.id, PATIENCE, |l| {
            l.generation == 2 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(staged.status(), S::Ready, "{}", staged.failure_reason);
    let web = fetch(presentation(&staged, "server", "web")).await;
    assert!(web.ends_with("routing-basics server stage 1\n"), "{web}");

    let beat = c
        .lessons
        .clone()
        .heartbeat(api::HeartbeatRequest {
            id: ready.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let expires = beat.expires_at.expect("non-persistent lessons expire");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (expires.seconds - now - 1800).abs() < 60,
        "expires {expires:?}, now {now}"
    );

    // Delete: TERMINATING, then gone, on the agent too.
    c.lessons
        .clone()
        .delete_live_lesson(api::DeleteLiveLessonRequest {
            id: ready.id.clone(),
        })
        .await
        .unwrap();
    c.gone(&ready.id, PATIENCE).await.unwrap();
    let err = c
        .lessons
        .clone()
        .get_live_lesson(api::GetLiveLessonRequest {
            id: ready.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    let listed = env
        .agent_client()
        .await
        .list(agent::ListRequest {
            label_selector: HashMap::new(),
            page_size: 0,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.items.is_empty(), "{listed:?}");
    assert!(
        tokio::net::TcpStream::connect(&presentation(&ready, "server", "web").address)
            .await
            .is_err()
    );

    // The event log kept every transition, through removal.
    let events = c
        .admin
        .clone()
        .list_events(api::ListEventsRequest {
            live_lesson_id: ready.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    let statuses: Vec<_> = events.iter().map(|e| e.status()).collect();
    assert_eq!(statuses.first(), Some(&S::Pending));
    assert!(
        statuses.contains(&S::Ready) && statuses.contains(&S::Configuring),
        "{statuses:?}"
    );
    assert_eq!(statuses.last(), Some(&S::Terminating), "{statuses:?}");
    assert_eq!(env.creations().len(), 1);
}

#[tokio::test]
async fn a_failing_lesson_is_failed_with_its_reason_and_asking_again_retries() {
    let env = Env::start(&["--fail-lesson", "hello-web"], Knobs::default()).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let first = c.request(&session, "hello-web", 0).await.unwrap();
    let (_, failed) = c
        .follow(&first.id, PATIENCE, |l| {
            matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(failed.status(), S::Failed);
    assert!(
        failed.failure_reason.contains("hello-web"),
        "{}",
        failed.failure_reason
    );

    let retried = c.request(&session, "hello-web", 0).await.unwrap();
    assert_eq!(
        (retried.id.as_str(), retried.generation, retried.status()),
        (first.id.as_str(), 2, S::Pending)
    );
    let (_, again) = c
        .follow(&first.id, PATIENCE, |l| {
            l.generation == 2 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(again.status(), S::Failed);
}

#[tokio::test]
async fn a_hundred_concurrent_identical_requests_create_one_live_lesson() {
    let env = Env::start(&["--boot-delay", "100ms"], Knobs::default()).await;
    let c = env.scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let requests = (0..100).map(|_| {
        let c = c.clone();
        let session = session.clone();
        tokio::spawn(async move { c.request(&session, "hello-web", 0).await })
    });
    let mut ids = std::collections::HashSet::new();
    for request in futures::future::join_all(requests).await {
        ids.insert(request.unwrap().expect("every request succeeds").id);
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let id = ids.into_iter().next().unwrap();
    c.ready(&id).await.unwrap();
    let all = c
        .admin
        .clone()
        .list_live_lessons(api::AdminListLiveLessonsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.live_lessons.len(), 1);
    assert_eq!(env.creations(), vec![id]);
}

#[tokio::test]
async fn health_reflection_agents_and_a_clean_sigterm() {
    let mut env = Env::start(&[], Knobs::default()).await;
    let c = &env.scheduler.clients;
    let mut health = tonic_health::pb::health_client::HealthClient::new(c.channel.clone());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "antidote.api.v1.LiveLessonService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    // The agent shows up READY once its handshake is done; a lesson request proves it.
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id).await.unwrap();
    let agents = c.agents().await.unwrap();
    assert_eq!(agents.len(), 1);
    assert_eq!(agents[0].state(), api::AgentState::Ready);
    assert_eq!(
        (agents[0].kind.as_str(), agents[0].major),
        ("test-agent", 1)
    );
    assert_eq!(agents[0].live_lessons, 1);

    let plan = c
        .admin
        .clone()
        .plan(api::PlanRequest {
            lesson_slug: "routing-basics".into(),
            stage: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(plan.agent, "loopback");
    assert_eq!(plan.objects.len(), 4, "{plan:?}");

    // Reflection lists our services, in both versions (grpcio-reflection and older grpcurl
    // know only v1alpha).
    for services in [
        reflected_services(&c.channel).await,
        reflected_services_v1alpha(&c.channel).await,
    ] {
        assert!(
            services
                .iter()
                .any(|s| s == "antidote.api.v1.LiveLessonService"),
            "{services:?}"
        );
    }

    // SIGTERM: a graceful stop with exit status 0; the live lesson stays in the store.
    let status = env.scheduler.process.terminate().await.unwrap();
    assert!(status.success(), "{status:?}\n{}", env.logs());
}

/// The service names server reflection lists.
async fn reflected_services(channel: &tonic::transport::Channel) -> Vec<String> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = ServerReflectionClient::new(channel.clone())
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = stream.message().await.unwrap().expect("one response");
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

/// The service names server reflection v1alpha lists.
async fn reflected_services_v1alpha(channel: &tonic::transport::Channel) -> Vec<String> {
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = ServerReflectionClient::new(channel.clone())
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = stream.message().await.unwrap().expect("one response");
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}
