//! Watch snapshots in pages (PROTOCOL.md [W8]): 10,000 live lessons on one agent make a
//! snapshot far past gRPC's default 4 MiB message limit; asked for pages, the agent sends it in
//! pages of bounded size, and the scheduler's Watch on that agent holds (the agent stays Ready).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms};
use antidote_tests::web::Web;
use antidote_tests::{Scheduler, fan_out};
use prost::Message as _;
use tonic::transport::Channel;

use crate::{PATIENCE, start_agent};

/// How many live lessons the agent holds.
const LESSONS: usize = 10_000;

/// gRPC's default largest message (tonic's decoding limit).
const GRPC_DEFAULT_LIMIT: usize = 4 * 1024 * 1024;

/// A network lesson's worth of endpoints, as a real curriculum has them.
const ENDPOINTS: [&str; 6] = [
    "router-core-1",
    "router-core-2",
    "router-edge-1",
    "switch-access",
    "server-web",
    "client-linux",
];

/// A spec of the scheduler's instance `e2e` but of another deployment (another cluster id), so
/// the scheduler's orphan collection leaves it alone however long the test runs.
fn spec(cluster: &str) -> agent::LessonSpec {
    let id = uuid::Uuid::new_v4().to_string();
    let session = uuid::Uuid::new_v4().to_string();
    agent::LessonSpec {
        live_lesson_id: id.clone(),
        session_id: session.clone(),
        lesson_slug: "routing-basics".into(),
        generation: 1,
        stage: 0,
        endpoints: ENDPOINTS
            .iter()
            .map(|name| agent::Endpoint {
                name: (*name).into(),
                image: Some(agent::Image {
                    slug: "busybox".into(),
                    ..Default::default()
                }),
                presentations: vec![agent::Presentation {
                    name: "cli".into(),
                    r#type: agent::PresentationType::Ssh as i32,
                    port: 22,
                }],
                ..Default::default()
            })
            .collect(),
        labels: HashMap::from([
            ("antidote.io/instance".to_owned(), "e2e".to_owned()),
            ("antidote.io/cluster".to_owned(), cluster.to_owned()),
            ("antidote.io/live-lesson".to_owned(), id),
            ("antidote.io/session".to_owned(), session),
            ("antidote.io/generation".to_owned(), "1".to_owned()),
            ("antidote.io/lesson".to_owned(), "routing-basics".to_owned()),
        ]),
        ..Default::default()
    }
}

/// One value of the scheduler's `/metrics` exposition, if present.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
}

#[tokio::test]
async fn ten_thousand_live_lessons_arrive_in_pages_and_the_agent_stays_ready() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--null"], &journal, None).await;
    let channel = Channel::from_shared(agent.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = agent::backend_client::BackendClient::new(channel.clone());

    // 10,000 live lessons held by the agent, straight through its own API.
    let cluster = uuid::Uuid::new_v4().to_string();
    fan_out(LESSONS, 64, |_| {
        let (mut client, spec) = (client.clone(), spec(&cluster));
        async move {
            client
                .provision(agent::ProvisionRequest {
                    spec: Some(spec),
                    new_live_lesson: true,
                })
                .await?;
            Ok(())
        }
    })
    .await
    .unwrap();

    // In one message the snapshot is past the 4 MiB a gRPC client takes by default: that is
    // what broke every Watch of such an agent.
    let selector = HashMap::from([("antidote.io/instance".to_owned(), "e2e".to_owned())]);
    let request = |page_bytes: u32| agent::WatchRequest {
        label_selector: selector.clone(),
        snapshot_page_bytes: page_bytes,
        ..Default::default()
    };
    let whole = client
        .clone()
        .max_decoding_message_size(64 * 1024 * 1024)
        .watch(request(0))
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .expect("a snapshot");
    assert!(
        whole.encoded_len() > GRPC_DEFAULT_LIMIT,
        "the test needs a snapshot past 4 MiB, this one is {} bytes",
        whole.encoded_len()
    );
    let refused = client
        .clone()
        .watch(request(0))
        .await
        .unwrap()
        .into_inner()
        .message()
        .await;
    assert!(
        refused.is_err(),
        "a default client cannot take the snapshot in one message"
    );

    // Asked for pages, the agent sends pages of at most the size asked, all at one revision,
    // `more` on all but the last, together every live lesson once.
    let page_bytes = 1024 * 1024;
    let mut stream = client
        .clone()
        .watch(request(page_bytes as u32))
        .await
        .unwrap()
        .into_inner();
    let (mut ids, mut pages) = (HashSet::new(), 0);
    // The revision of the first page (the null agent may still have been marking the last
    // provisioned live lessons READY when `whole` was taken, so it may be later than that).
    let mut revision = None;
    loop {
        let event = stream.message().await.unwrap().expect("a page");
        let first = *revision.get_or_insert(event.revision);
        assert!(
            first >= whole.revision,
            "a page older than the earlier snapshot"
        );
        assert_eq!(event.revision, first, "every page at one revision");
        let size = event.encoded_len();
        let Some(agent::watch_event::Event::Snapshot(page)) = event.event else {
            panic!("page {pages} is not a snapshot: {event:?}");
        };
        assert!(size <= page_bytes, "page {pages} is {size} bytes");
        pages += 1;
        for state in page.items {
            assert!(ids.insert(state.live_lesson_id), "a live lesson twice");
        }
        if !page.more {
            break;
        }
    }
    assert_eq!(ids.len(), LESSONS);
    assert!(pages >= 5, "{pages} pages");
    drop(stream);

    // A scheduler starting now opens its Watch on an agent holding all of them: the snapshot
    // arrives (in pages) and the stream holds.
    let mut config = SchedulerConfig::new("e2e", &antidote_tests::example_curriculum())
        .with_agent(Agent::new("loopback", agent.url()));
    config.reconciler.poll_interval = Some(ms(500));
    let config = config.to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let logs = || {
        format!(
            "--- scheduler log ---\n{}\n--- agent log ---\n{}",
            scheduler.process.log_text(),
            agent.log_text()
        )
    };
    let c = scheduler.clients.clone();
    let metrics = format!(
        "{}/metrics",
        scheduler.process.extra_url("admin http").unwrap()
    );
    let web = Web::default();
    let snapshot = r#"antidote_agent_watch_snapshot_states{agent="loopback"}"#;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let text = loop {
        let text = web.scrape(&metrics).await.unwrap().body;
        if metric(&text, snapshot) == Some(LESSONS as f64) {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no complete snapshot of {LESSONS} live lessons\n{text}\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let received = metric(
        &text,
        r#"antidote_agent_watch_snapshot_pages{agent="loopback"}"#,
    );
    assert!(received >= Some(5.0), "pages: {received:?}");

    // The agent works on: a lesson through the scheduler goes READY...
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    c.ready(&lesson.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));
    // ...on the very Watch stream the scheduler opened at start, with the agent Ready.
    let text = web.scrape(&metrics).await.unwrap().body;
    assert_eq!(
        metric(
            &text,
            r#"antidote_agent_watch_streams_total{agent="loopback"}"#
        ),
        Some(1.0),
        "the Watch stream broke and was opened again\n{}",
        logs()
    );
    let agents = c.agents().await.unwrap();
    let loopback = agents.iter().find(|a| a.name == "loopback").unwrap();
    assert_eq!(loopback.state(), api::AgentState::Ready, "{loopback:?}");
    assert!(loopback.last_error.is_empty(), "{loopback:?}");
}
