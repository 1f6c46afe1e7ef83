//! Time: idle TTLs are measured on the monotonic clock, so a step of the system clock expires
//! nothing early, and a step back keeps nothing alive late. The step is libfaketime's, for the scheduler process only (Debian's
//! `faketime`; never the machine's clock, which TLS, JWT and etcd share).

use std::path::Path;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use antidote_tests::{Scheduler, example_curriculum};

use crate::{PATIENCE, start_agent};

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Two live lessons idle since 10 s apart, TTL 20 s; the scheduler's wall clock then jumps a day
/// ahead. The older one expires when its 20 s are up, and at that moment the younger one, with
/// about 10 s left, is still READY. Read from the wall clock, both would expire at the first
/// reaper tick after the step. A step back then does not keep the younger one alive.
#[tokio::test]
async fn clock_steps_forward_and_back_expire_nothing_early_or_late() {
    assert!(
        Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} is missing: apt-get install faketime (tests/run installs it)"
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &[], &journal, None).await;
    let offset = dir.path().join("faketime");
    std::fs::write(&offset, "+0\n").unwrap();
    let mut config = SchedulerConfig::new("e2e-clock", &example_curriculum())
        .with_lesson_ttl(secs(20))
        .with_session_ttl(secs(24 * 3600))
        .with_agent(Agent::new("loopback", agent.url()));
    config.reaper.interval = Some(ms(200));
    let config = config.to_toml();
    let env = [
        ("LD_PRELOAD", LIBFAKETIME.to_owned()),
        ("FAKETIME_TIMESTAMP_FILE", offset.display().to_string()),
        ("FAKETIME_NO_CACHE", "1".to_owned()),
        // Only the wall clock moves; the monotonic clock is the real one.
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
    ];
    let scheduler = Scheduler::start_with_env(dir.path(), &config, &env)
        .await
        .expect("the scheduler starts under libfaketime");
    let logs = || {
        format!(
            "--- scheduler log ---\n{}\n--- agent log ---\n{}",
            scheduler.process.log_text(),
            agent.log_text()
        )
    };
    let c = scheduler.clients.clone();
    let older = c
        .request(&c.session().await.unwrap(), "hello-web", 0)
        .await
        .unwrap();
    c.ready(&older.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));
    // The idle-time difference the test is about, not a synchronisation.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let younger = c
        .request(&c.session().await.unwrap(), "hello-web", 0)
        .await
        .unwrap();
    c.ready(&younger.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));

    std::fs::write(&offset, "+1d\n").unwrap();
    c.follow(&older.id, PATIENCE, |l| {
        l.status() == api::LiveLessonStatus::Terminating
    })
    .await
    .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));
    let now = c
        .get(&younger.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs()));
    assert_eq!(
        now.status(),
        api::LiveLessonStatus::Ready,
        "the younger live lesson expired with the older one\n{}",
        logs()
    );

    // Then a step back by two days (a day behind the real time): the younger one still expires
    // when its own 20 s are up. Read from the wall clock, it would live another two days.
    std::fs::write(&offset, "-2d\n").unwrap();
    c.follow(&younger.id, PATIENCE, |l| {
        l.status() == api::LiveLessonStatus::Terminating
    })
    .await
    .unwrap_or_else(|err| {
        panic!(
            "the younger one outlived its TTL after a step back: {err:#}\n{}",
            logs()
        )
    });
}
