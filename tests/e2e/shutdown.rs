//! Bounded shutdown: streams that never end by themselves (a grpc.health.v1 Watch, a server
//! reflection stream, a learner's WatchLiveLesson over gRPC and as server-sent events, the
//! agent's Watch) do not keep a process
//! alive past its shutdown grace. On SIGTERM the scheduler tells health watchers it is
//! NOT_SERVING, waits `shutdown_grace` for calls to end, then cuts the connections still open
//! and exits 0; an agent on the SDK does the same.

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, secs};
use antidote_tests::web::Web;
use antidote_tests::{Scheduler, with_token};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

use crate::start_agent;

/// Streams that stay open until the server ends them: a health Watch, a reflection stream
/// (its request side held open) and whatever else the caller adds.
struct Open {
    health: tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    reflection: tonic::Streaming<ServerReflectionResponse>,
    /// Keeps the reflection stream's request side open.
    _requests: mpsc::Sender<ServerReflectionRequest>,
}

/// Opens a health Watch of `service` and a reflection stream on `channel`, each past its first
/// answer (so both are really open when shutdown begins).
async fn open(channel: Channel, service: &str) -> Open {
    let mut health = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = health
        .message()
        .await
        .unwrap()
        .expect("a first health status");
    assert_eq!(first.status(), ServingStatus::Serving);
    let (requests, receiver) = mpsc::channel(1);
    requests
        .send(ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        })
        .await
        .unwrap();
    let mut reflection = ServerReflectionClient::new(channel)
        .server_reflection_info(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    reflection
        .message()
        .await
        .unwrap()
        .expect("a reflection answer");
    Open {
        health,
        reflection,
        _requests: requests,
    }
}

#[tokio::test]
async fn sigterm_ends_the_scheduler_within_its_grace_despite_open_streams() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &[], &journal, None).await;
    let config = SchedulerConfig::new("e2e-shutdown", &antidote_tests::example_curriculum())
        .with_shutdown_grace(secs(1))
        .with_agent(Agent::new("loopback", agent.url()))
        .to_toml();
    let mut scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let c = scheduler.clients.clone();

    // A learner follows a READY live lesson; nothing will ever end that stream by itself.
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id).await.unwrap();
    let mut watch = c
        .lessons
        .clone()
        .watch_live_lesson(with_token(
            api::WatchLiveLessonRequest {
                id: lesson.id.clone(),
            },
            c.tokens.of_lesson(&lesson.id),
        ))
        .await
        .unwrap()
        .into_inner();
    watch.message().await.unwrap().expect("the current state");
    // A browser follows one as server-sent events.
    let base = scheduler.process.extra_url("http").unwrap();
    let browser = Web::default();
    let created = browser
        .post(&format!("{base}/v1/sessions"), "")
        .await
        .unwrap();
    let session = created.json().unwrap()["id"].as_str().unwrap().to_owned();
    let requested = browser
        .post(
            &format!("{base}/v1/live-lessons"),
            &format!(r#"{{"sessionId": "{session}", "lessonSlug": "hello-web"}}"#),
        )
        .await
        .unwrap();
    let live = requested.json().unwrap()["id"].as_str().unwrap().to_owned();
    let mut events = browser
        .events(&format!("{base}/v1/live-lessons/{live}/watch"))
        .await
        .unwrap();
    events.next().await.unwrap().expect("a first event");
    // Health and reflection on both gRPC listeners.
    let mut learners = open(c.channel.clone(), "").await;
    let admin = open(c.admin_channel.clone(), "").await;

    let status = scheduler.process.terminate().await.unwrap_or_else(|err| {
        panic!(
            "the scheduler did not exit after SIGTERM: {err:#}\n{}",
            scheduler.process.log_text()
        )
    });
    assert!(
        status.success(),
        "exit status {status}\n{}",
        scheduler.process.log_text()
    );
    // Health watchers were told before the end.
    let told = learners.health.message().await;
    assert!(
        matches!(&told, Ok(Some(s)) if s.status() == ServingStatus::NotServing),
        "{told:?}"
    );
    // Every stream ended with the process.
    while let Ok(Some(_)) = learners.health.message().await {}
    assert!(!matches!(learners.reflection.message().await, Ok(Some(_))));
    drop(admin);
    while let Ok(Some(_)) = watch.message().await {}
    while let Ok(Some(_)) = events.next().await {}
}

#[tokio::test]
async fn sigterm_ends_an_sdk_agent_within_its_grace_despite_open_streams() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let mut agent = start_agent(&dir, &["--shutdown-grace", "1s"], &journal, None).await;
    let channel = Channel::from_shared(agent.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut open = open(channel.clone(), "antidote.agent.v1.Backend").await;
    let mut watch = agent::backend_client::BackendClient::new(channel)
        .watch(agent::WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    watch.message().await.unwrap().expect("a snapshot");

    let status = agent.terminate().await.unwrap_or_else(|err| {
        panic!(
            "the agent did not exit after SIGTERM: {err:#}\n{}",
            agent.log_text()
        )
    });
    assert!(
        status.success(),
        "exit status {status}\n{}",
        agent.log_text()
    );
    let told = open.health.message().await;
    assert!(
        matches!(&told, Ok(Some(s)) if s.status() == ServingStatus::NotServing),
        "{told:?}"
    );
    while let Ok(Some(_)) = open.health.message().await {}
    assert!(!matches!(open.reflection.message().await, Ok(Some(_))));
}
