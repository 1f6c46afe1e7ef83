//! Version and capability negotiation across real processes: an agent offering only a newer
//! major is refused with a clear message while the scheduler keeps serving with the others, and
//! an agent without a capability a lesson needs is simply not chosen for it.

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms};
use antidote_tests::{Scheduler, example_curriculum};

use crate::{PATIENCE, start_agent};

#[tokio::test]
async fn a_newer_major_is_refused_and_missing_capabilities_steer_placement() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let full = start_agent(&dir, &[], &journal, None).await;
    let future = start_agent(&dir, &["--majors", "2"], &journal, None).await;
    // Only http presentations, no stage configuration: enough for nothing in the example
    // curriculum except pages, so routing-basics (ssh + configuration) must avoid it.
    let limited = start_agent(
        &dir,
        &["--capabilities", "presentation.http,watch"],
        &journal,
        None,
    )
    .await;
    let config = SchedulerConfig::new("e2e-negotiation", &example_curriculum())
        .with_backoff(ms(50), ms(500))
        .with_agent(Agent::new("future", future.url()))
        .with_agent(Agent::new("limited", limited.url()))
        .with_agent(Agent::new("full", full.url()))
        .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let c = &scheduler.clients;

    let session = c.session().await.unwrap();
    for slug in ["routing-basics", "netcat-toolbox"] {
        let lesson = c.request(&session, slug, 0).await.unwrap();
        let ready = c
            .ready(&lesson.id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", scheduler.process.log_text()));
        assert_eq!(
            c.agent_of(&ready.id).await.unwrap(),
            "full",
            "{slug} needs ssh and configuration"
        );
    }

    // The admin API has no stream of agent states: ask until every first handshake is done.
    let agents = tokio::time::timeout(PATIENCE, async {
        loop {
            let agents = c.agents().await.unwrap();
            if agents
                .iter()
                .all(|a| a.state() != api::AgentState::Connecting)
            {
                return agents;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("every agent handshakes");
    let by_name = |name: &str| agents.iter().find(|a| a.name == name).unwrap().clone();
    let refused = by_name("future");
    assert_eq!(
        refused.state(),
        api::AgentState::Incompatible,
        "{refused:?}"
    );
    assert!(
        refused.last_error.contains("no common major version"),
        "{}",
        refused.last_error
    );
    assert!(refused.last_error.contains("[2]"), "{}", refused.last_error);
    assert_eq!(by_name("limited").state(), api::AgentState::Ready);
    // The SDK pages Watch snapshots for every agent, so it offers `watch.pages` with `watch`.
    assert_eq!(
        by_name("limited").capabilities,
        vec!["presentation.http", "watch", "watch.pages"]
    );
    assert_eq!(by_name("full").live_lessons, 2);
}
