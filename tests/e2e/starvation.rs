//! Waiting for READY holds no reconcile worker (ARCHITECTURE.md, `reconcile`):
//! with two workers and six live lessons whose endpoints take ten minutes to be ready, a lesson
//! requested afterwards still goes READY, while every slow one is still on its way. Were a
//! worker held for each wait, the two workers would sit on two slow lessons and nothing else
//! would even be placed.

use std::path::{Path, PathBuf};

use antidote_proto::api::v1 as api;
use antidote_tests::Scheduler;
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use api::LiveLessonStatus as S;

use crate::{PATIENCE, start_agent};

/// Reconcile workers: fewer than the slow lessons.
const WORKERS: usize = 2;

/// Slow live lessons: three times the workers.
const SLOW: usize = 3 * WORKERS;

/// `slow` (ready delay of 600 s) and `fast` (none), one HTTP endpoint each.
fn curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/starvation-curriculum")
        .canonicalize()
        .expect("tests/fixtures/starvation-curriculum exists")
}

#[tokio::test]
async fn slow_lessons_do_not_hold_the_workers_a_fast_one_needs() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &[], &journal, None).await;
    let config = SchedulerConfig::new("e2e-starvation", &curriculum())
        .with_retries(ms(500), ms(50), secs(1))
        .with_provision_timeout(secs(15 * 60))
        .with_reconciler(|r| r.workers = Some(WORKERS as u32))
        .with_agent(Agent::new("loopback", agent.url()))
        .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let c = &scheduler.clients;
    let logs = || {
        format!(
            "--- scheduler log ---\n{}\n--- agent log ---\n{}",
            scheduler.process.log_text(),
            agent.log_text()
        )
    };

    // Every slow live lesson is placed and provisioned: the agent works on all of them at
    // once, though only two workers exist.
    let mut slow = Vec::new();
    for _ in 0..SLOW {
        let session = c.session().await.unwrap();
        slow.push(c.request(&session, "slow", 0).await.unwrap().id);
    }
    for id in &slow {
        let (_, lesson) = c
            .follow(id, PATIENCE, |l| matches!(l.status(), S::Configuring))
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));
        assert!(lesson.failure_reason.is_empty(), "{lesson:?}");
    }

    // A fast lesson requested now goes READY...
    let session = c.session().await.unwrap();
    let fast = c.request(&session, "fast", 0).await.unwrap();
    c.ready(&fast.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));

    // ...while every slow one is still waiting for its endpoints.
    for id in &slow {
        let lesson = c.get(id).await.unwrap();
        assert_eq!(
            lesson.status(),
            S::Configuring,
            "slow live lesson {id}: {lesson:?}\n{}",
            logs()
        );
    }
}
