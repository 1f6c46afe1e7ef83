//! Crashes: the scheduler killed mid-provisioning resumes from its store; an agent that restarts
//! gets its live lessons back.

use antidote_proto::api::v1 as api;
use antidote_tests::Scheduler;

use crate::{Env, Knobs, PATIENCE, start_agent};

#[tokio::test]
async fn kill_9_while_provisioning_then_restart_every_lesson_ready_nothing_twice() {
    let mut env = Env::start(&["--boot-delay", "1500ms"], Knobs::default()).await;
    let c = env.scheduler.clients.clone();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let session = c.session().await.unwrap();
        for lesson in ["hello-web", "routing-basics"] {
            ids.push(c.request(&session, lesson, 0).await.unwrap().id);
        }
    }
    // Wait until the agent is working on every one of them, then kill the scheduler.
    for id in &ids {
        c.follow(id, PATIENCE, |l| {
            l.status() == api::LiveLessonStatus::Booting
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    }
    env.scheduler.process.kill9().await;

    env.scheduler = Scheduler::start(env.dir.path(), &env.config).await.unwrap();
    // The learners' tokens outlive the scheduler process (the store keeps their hashes).
    let tokens = c.tokens.clone();
    let mut c = env.scheduler.clients.clone();
    c.tokens = tokens;
    for id in &ids {
        c.ready(id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    }
    let mut created = env.creations();
    created.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(
        created, expected,
        "each live lesson was created exactly once"
    );
}

#[tokio::test]
async fn a_restarted_agent_gets_its_live_lessons_back() {
    let mut env = Env::start(&[], Knobs::default()).await;
    let c = env.scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    let before = c.ready(&lesson.id).await.unwrap();

    // The agent dies and comes back on the same address, with nothing in memory.
    let addr = env.agent.addr;
    env.agent.kill9().await;
    env.agent = start_agent(&env.dir, &[], &env.journal, Some(addr)).await;

    // The scheduler notices the new instance id, Recover says NOT_FOUND, and it provisions
    // again: READY with new sockets, same live lesson.
    let (_, after) = c
        .follow(&lesson.id, PATIENCE, |l| {
            l.status() == api::LiveLessonStatus::Ready && l.endpoints != before.endpoints
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(after.id, before.id);
    assert_eq!(env.creations(), vec![lesson.id.clone(), lesson.id.clone()]);
}
