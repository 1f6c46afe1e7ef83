//! Active-active replicas on one PostgreSQL database: a Watch on one
//! replica follows a live lesson another replica drives, and killing replicas (kill -9) in the
//! middle of 200 live lessons loses none, creates none twice and leaves no orphan; the reaper's
//! duties run on one replica per tick, and another takes them over when it dies.
//!
//! The PostgreSQL server is the one `ANTIDOTE_TEST_POSTGRES` names, or the one
//! `tests/postgres/pg.sh start` starts when that is unset (as `postgres.rs`: never skipped). Each
//! test has a database of its own.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use antidote_tests::journal::created;
use antidote_tests::web::{Web, sample};
use antidote_tests::{Clients, Scheduler, Tokens, example_curriculum, with_token};
use tonic::transport::Channel;

use crate::postgres::{TestDatabase, start_on};
use crate::{PATIENCE, start_agent};

/// Replicas' configuration (without agents): the quick one, no per-address session limit,
/// three live lessons per session, many watches per address, short leases and a quick resync,
/// so a dead replica's work is taken over within about three seconds.
pub(crate) fn replica_config(instance: &str) -> SchedulerConfig {
    SchedulerConfig::quick(instance, &example_curriculum())
        .with_sessions_per_ip(0)
        .with_lessons_per_session(3)
        .with_watches_per_address(1024)
        .with_replicas(secs(2), ms(500))
}

/// [`replica_config`] on the test agent at `agent`.
fn config(agent: &str) -> String {
    replica_config("e2e-replicas")
        .with_agent(Agent::new("loopback", agent))
        .to_toml()
}

/// `count` replicas on one database, their clients sharing one token book (a session made on
/// one replica is used on the others).
async fn replicas(
    dir: &std::path::Path,
    url: &str,
    config: &str,
    count: usize,
) -> (Vec<Scheduler>, Tokens) {
    let tokens = Tokens::default();
    let mut started = Vec::new();
    for _ in 0..count {
        let mut replica = start_on(dir, url, config).await;
        replica.clients.tokens = tokens.clone();
        started.push(replica);
    }
    (started, tokens)
}

fn logs(replicas: &[Scheduler], agent: &antidote_tests::Process) -> String {
    let replicas = replicas
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("replica {i}"), &r.process));
    antidote_tests::logs(replicas.chain([("agent".to_owned(), agent)]))
}

/// The statuses a WatchLiveLesson stream delivers until it ends (the live lesson is gone).
async fn watch_to_the_end(
    clients: Clients,
    id: String,
) -> anyhow::Result<Vec<api::LiveLessonStatus>> {
    let mut stream = clients
        .lessons
        .clone()
        .watch_live_lesson(with_token(
            api::WatchLiveLessonRequest { id: id.clone() },
            clients.tokens.of_lesson(&id),
        ))
        .await?
        .into_inner();
    let mut seen = Vec::new();
    while let Some(lesson) = stream.message().await? {
        let status = lesson.status();
        if seen.last() != Some(&status) {
            seen.push(status);
        }
    }
    Ok(seen)
}

/// A Watch opened on each of two replicas follows a live lesson requested on the first to
/// READY, and ends when the second deletes it (the stream ends when the live lesson is gone). Only one replica holds the live lesson's lease
/// and drives it, so at least one of the two streams is fed by notifications alone.
#[tokio::test]
async fn a_watch_on_any_replica_follows_a_lesson_driven_by_another() {
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "1500ms"], &journal, None).await;
    let config = config(&agent.url());
    let (replicas, _) = replicas(dir.path(), &database.url, &config, 2).await;
    let (a, b) = (&replicas[0].clients, &replicas[1].clients);
    let session = a.session().await.unwrap();
    let lesson = a.request(&session, "hello-web", 0).await.unwrap();
    let watches = [a, b].map(|c| tokio::spawn(watch_to_the_end(c.clone(), lesson.id.clone())));
    // READY as seen from B, then deleted through B.
    b.ready(&lesson.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&replicas, &agent)));
    b.lessons
        .clone()
        .delete_live_lesson(with_token(
            api::DeleteLiveLessonRequest {
                id: lesson.id.clone(),
            },
            b.tokens.of_lesson(&lesson.id),
        ))
        .await
        .unwrap();
    for (name, watch) in ["A", "B"].into_iter().zip(watches) {
        let seen = tokio::time::timeout(PATIENCE, watch)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the watch on {name} never ended\n{}",
                    logs(&replicas, &agent)
                )
            })
            .unwrap()
            .unwrap_or_else(|err| panic!("watch on {name}: {err:#}\n{}", logs(&replicas, &agent)));
        let ready = seen.iter().position(|s| *s == api::LiveLessonStatus::Ready);
        let booting = seen
            .iter()
            .position(|s| *s == api::LiveLessonStatus::Booting);
        assert!(
            matches!((booting, ready), (Some(b), Some(r)) if b < r),
            "the watch on {name} saw {seen:?}\n{}",
            logs(&replicas, &agent)
        );
    }
}

/// Every live lesson of instance `e2e-replicas` the agent holds.
async fn held(agent: &mut agent::backend_client::BackendClient<Channel>) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut page_token = String::new();
    loop {
        let page = agent
            .list(agent::ListRequest {
                label_selector: HashMap::from([(
                    "antidote.io/instance".to_owned(),
                    "e2e-replicas".to_owned(),
                )]),
                page_size: 500,
                page_token,
            })
            .await
            .unwrap()
            .into_inner();
        ids.extend(page.items.into_iter().map(|s| s.live_lesson_id));
        if page.next_page_token.is_empty() {
            return ids;
        }
        page_token = page.next_page_token;
    }
}

/// Statuses of `ids` as `clients` reads them.
async fn statuses(clients: &Clients, ids: &[String]) -> HashMap<api::LiveLessonStatus, usize> {
    let mut counts = HashMap::new();
    for id in ids {
        let status = match clients.get(id).await {
            Ok(lesson) => lesson.status(),
            Err(_) => api::LiveLessonStatus::Unspecified,
        };
        *counts.entry(status).or_default() += 1;
    }
    counts
}

/// Three replicas, clients spread over them, 200 live lessons in flight on a test agent that
/// holds each in BOOTING for 3 s; one replica is killed (-9) right after the last request was
/// acknowledged, another a second later. The survivor takes every live lesson over when the
/// dead replicas' leases expire: all 200 READY, each created exactly once on the agent, and
/// after deleting them all nothing is left there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_replicas_mid_load_loses_nothing_and_creates_nothing_twice() {
    const LESSONS: usize = 200;
    let slugs = ["hello-web", "routing-basics", "netcat-toolbox"];
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "3s"], &journal, None).await;
    let config = config(&agent.url());
    let (mut replicas, _) = replicas(dir.path(), &database.url, &config, 3).await;

    let start = Instant::now();
    let mut requests = tokio::task::JoinSet::new();
    for s in 0..LESSONS.div_ceil(slugs.len()) {
        let clients = replicas[s % replicas.len()].clients.clone();
        let wanted: Vec<_> = slugs
            .iter()
            .take((LESSONS - s * slugs.len()).min(slugs.len()))
            .map(|slug| slug.to_string())
            .collect();
        requests.spawn(async move {
            let session = clients.session().await?;
            let mut ids = Vec::new();
            for slug in wanted {
                ids.push(clients.request(&session, &slug, 0).await?.id);
            }
            anyhow::Ok(ids)
        });
    }
    let mut ids = Vec::new();
    while let Some(result) = requests.join_next().await {
        ids.extend(
            result
                .unwrap()
                .unwrap_or_else(|err| panic!("request: {err:#}")),
        );
    }
    assert_eq!(ids.len(), LESSONS);
    let acknowledged = start.elapsed();

    replicas[0].process.kill9().await;
    let survivor = replicas[2].clients.clone();
    let before = statuses(&survivor, &ids).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    replicas[1].process.kill9().await;
    let killed = Instant::now();

    // Every live lesson READY, read through the survivor.
    let ready = tokio::time::timeout(PATIENCE, async {
        loop {
            let counts = statuses(&survivor, &ids).await;
            if counts.get(&api::LiveLessonStatus::Ready) == Some(&LESSONS) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    if ready.is_err() {
        let counts = statuses(&survivor, &ids).await;
        panic!("not all READY: {counts:?}\n{}", logs(&replicas, &agent));
    }
    let settled = killed.elapsed();
    // The survivor took over work the dead replicas held (their shard leases expired).
    let survivor_log = replicas[2].process.log_text();
    let taken_over = survivor_log
        .matches("its shard moved; running it again")
        .count();
    assert!(
        taken_over > 0,
        "the survivor took nothing over\n{}",
        logs(&replicas, &agent)
    );
    println!(
        "replicas: {LESSONS} requests acknowledged in {acknowledged:?}; statuses when the first \
         replica died: {before:?}; all READY {settled:?} after the second died; the survivor \
         took {taken_over} live lessons over"
    );

    // Each created exactly once.
    let creations = created(&journal);
    let distinct: BTreeSet<_> = creations.iter().cloned().collect();
    let expected: BTreeSet<_> = ids.iter().cloned().collect();
    assert_eq!(
        creations.len(),
        LESSONS,
        "{} creations for {LESSONS} live lessons",
        creations.len()
    );
    assert_eq!(
        distinct, expected,
        "the agent created exactly the requested live lessons"
    );
    let mut agent_client = agent::backend_client::BackendClient::connect(agent.url())
        .await
        .unwrap();
    assert_eq!(
        held(&mut agent_client).await,
        expected,
        "nothing else on the agent"
    );

    // Removal through the survivor leaves nothing behind.
    let removal = Instant::now();
    let mut deletes = tokio::task::JoinSet::new();
    for id in ids.clone() {
        let clients = survivor.clone();
        deletes.spawn(async move { clients.delete(&id, PATIENCE).await });
    }
    while let Some(result) = deletes.join_next().await {
        result
            .unwrap()
            .unwrap_or_else(|err| panic!("delete: {err:#}\n{}", logs(&replicas, &agent)));
    }
    let left = held(&mut agent_client).await;
    assert!(left.is_empty(), "left on the agent: {left:?}");
    println!("replicas: {LESSONS} deleted in {:?}", removal.elapsed());
}

/// A reaper counter of `replica`: `antidote_reaper_duty_runs_total{duty="..."}` or
/// `antidote_reaper_actions_total{action="..."}` (0 until first counted).
async fn reaper_count(web: &Web, replica: &Scheduler, series: &str) -> f64 {
    let url = format!(
        "{}/metrics",
        replica.process.extra_url("admin http").unwrap()
    );
    let text = web.scrape(&url).await.unwrap().body;
    sample(&text, series).unwrap_or(0.0)
}

/// The reaper's duties run on one replica per tick (the `reaper` lease): over a window, the
/// duty runs counted by two replicas add up to at most one per tick (both running would give
/// twice that), lessons idle past their TTL are expired once each, and when the replica on
/// duty is killed the other takes the duties over and expires what goes idle afterwards.
#[tokio::test]
async fn the_reaper_runs_its_duties_on_one_replica_per_tick() {
    const EXPIRE_RUNS: &str = "antidote_reaper_duty_runs_total{duty=\"expire\"}";
    const ORPHAN_RUNS: &str = "antidote_reaper_duty_runs_total{duty=\"orphans\"}";
    const EXPIRED: &str = "antidote_reaper_actions_total{action=\"expire_live_lesson\"}";
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &[], &journal, None).await;
    let config = replica_config("e2e-replicas")
        .with_lesson_ttl(secs(3))
        .with_agent(Agent::new("loopback", agent.url()))
        .to_toml();
    let (mut replicas, _) = replicas(dir.path(), &database.url, &config, 2).await;
    let web = Web::default();

    // Three lessons, never touched again: each expired once, by whichever replica is on duty.
    let c = replicas[0].clients.clone();
    let session = c.session().await.unwrap();
    for slug in ["hello-web", "routing-basics", "netcat-toolbox"] {
        c.request(&session, slug, 0).await.unwrap();
    }
    let start = Instant::now();
    loop {
        let mut expired = 0.0;
        for replica in &replicas {
            expired += reaper_count(&web, replica, EXPIRED).await;
        }
        if expired >= 3.0 {
            assert_eq!(expired, 3.0, "{}", logs(&replicas, &agent));
            break;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "expired {expired} of 3\n{}",
            logs(&replicas, &agent)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A window of about 3 s: at most one run per 200 ms tick in all, per duty.
    let mut before = Vec::new();
    for replica in &replicas {
        before.push((
            reaper_count(&web, replica, EXPIRE_RUNS).await,
            reaper_count(&web, replica, ORPHAN_RUNS).await,
        ));
    }
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut deltas = Vec::new();
    for (replica, (expire, orphans)) in replicas.iter().zip(&before) {
        deltas.push((
            reaper_count(&web, replica, EXPIRE_RUNS).await - expire,
            reaper_count(&web, replica, ORPHAN_RUNS).await - orphans,
        ));
    }
    let ticks = window.elapsed().as_secs_f64() / 0.2;
    let expire_runs: f64 = deltas.iter().map(|d| d.0).sum();
    let orphan_runs: f64 = deltas.iter().map(|d| d.1).sum();
    for (duty, runs) in [("expire", expire_runs), ("orphans", orphan_runs)] {
        assert!(
            runs >= 1.0 && runs <= ticks + 2.0,
            "{duty}: {runs} runs over {ticks:.1} ticks ({deltas:?})\n{}",
            logs(&replicas, &agent)
        );
    }

    // The replica on duty dies; the other takes the lease over and expires a new idle lesson.
    let on_duty = if deltas[0].0 >= deltas[1].0 { 0 } else { 1 };
    let mut dead = replicas.remove(on_duty);
    dead.process.kill9().await;
    let survivor = &replicas[0];
    let runs = reaper_count(&web, survivor, EXPIRE_RUNS).await;
    let expired = reaper_count(&web, survivor, EXPIRED).await;
    let c = survivor.clients.clone();
    let session = c.session().await.unwrap();
    c.request(&session, "hello-web", 0).await.unwrap();
    let start = Instant::now();
    loop {
        let now = (
            reaper_count(&web, survivor, EXPIRE_RUNS).await,
            reaper_count(&web, survivor, EXPIRED).await,
        );
        if now.0 > runs && now.1 > expired {
            break;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the survivor never took the duties over: runs {runs} -> {}, expired {expired} -> {}\n{}",
            now.0,
            now.1,
            logs(&replicas, &agent)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A replica's id as a lease holder, from its start-up line (`store open ... replica="ID"`),
/// waiting for the line to reach its log.
async fn replica_id(replica: &Scheduler) -> String {
    let start = Instant::now();
    loop {
        let log = replica.process.log_text();
        // Without the terminal's colour codes, if any.
        let mut plain = String::with_capacity(log.len());
        let mut chars = log.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        if let Some(at) = plain.find("replica=") {
            let id: String = plain[at + "replica=".len()..]
                .trim_start_matches('"')
                .chars()
                .take_while(|c| c.is_ascii_hexdigit() || *c == '-')
                .collect();
            if id.len() == 36 {
                return id;
            }
        }
        assert!(
            start.elapsed() < PATIENCE,
            "no replica id in the log:\n{plain}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Who holds each shard's lease unexpired now, read from the store (`None`: nobody).
async fn shard_holders(store: &scheduler_svc::store::Store) -> Vec<Option<String>> {
    let now = scheduler_svc::model::Millis::now();
    store
        .shard_table()
        .await
        .expect("the shard table")
        .into_iter()
        .map(|row| row.holder.filter(|_| row.expires_at >= now))
        .collect()
}

/// Waits until every shard is held by one of `live` (the ids of the live replicas) and each
/// holds its share, to within one; returns how long that took. Panics naming the holders after
/// [`PATIENCE`].
async fn shards_settle_on(
    store: &scheduler_svc::store::Store,
    live: &[String],
    what: impl Fn() -> String,
) -> Duration {
    let start = Instant::now();
    loop {
        let holders = shard_holders(store).await;
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for holder in holders.iter().flatten() {
            *counts.entry(holder.as_str()).or_default() += 1;
        }
        let all_live = holders
            .iter()
            .all(|h| h.as_ref().is_some_and(|h| live.contains(h)));
        let share = scheduler_svc::store::SHARDS as usize / live.len();
        let balanced = live.iter().all(|id| {
            counts
                .get(id.as_str())
                .is_some_and(|n| *n == share || *n == share + 1)
        });
        if all_live && balanced {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < PATIENCE,
            "shards not settled on {live:?}: {counts:?}, {} unheld\n{}",
            holders.iter().filter(|h| h.is_none()).count(),
            what()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Three replicas share the shards of the reconcile work, read from the store: every shard
/// held by exactly one live replica, balanced to within one. In the middle of the load (live
/// lessons booting, more being requested), one replica is killed (-9) and another one added:
/// the shards settle on the three live replicas again (the time it took is printed beside the
/// lease TTL), and every live lesson requested, before and after, through any replica, is
/// READY, created exactly once on the agent, and removed without leaving anything there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_follow_replicas_that_die_and_join_and_no_lesson_is_lost() {
    const WAVE: usize = 90;
    const SLUGS: [&str; 3] = ["hello-web", "routing-basics", "netcat-toolbox"];
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = dir.path().join("journal");
    let agent = start_agent(&dir, &["--boot-delay", "2s"], &journal, None).await;
    let config = config(&agent.url());
    let (mut replicas, tokens) = replicas(dir.path(), &database.url, &config, 3).await;
    let store = scheduler_svc::store::Store::open(scheduler_svc::store::Database::Postgres(
        database.url.clone(),
    ))
    .await
    .expect("the store");
    let mut ids = Vec::new();
    for replica in &replicas {
        ids.push(replica_id(replica).await);
    }
    let first = shards_settle_on(&store, &ids, || logs(&replicas, &agent)).await;
    println!("shards: balanced over 3 replicas {first:?} after the last started");

    // A wave of requests spread over `clients`, a session per three live lessons.
    let wave = |clients: Vec<Clients>| async move {
        let mut requests = tokio::task::JoinSet::new();
        for s in 0..WAVE / SLUGS.len() {
            let clients = clients[s % clients.len()].clone();
            requests.spawn(async move {
                let session = clients.session().await?;
                let mut ids = Vec::new();
                for slug in SLUGS {
                    ids.push(clients.request(&session, slug, 0).await?.id);
                }
                anyhow::Ok(ids)
            });
        }
        let mut ids = Vec::new();
        while let Some(result) = requests.join_next().await {
            ids.extend(
                result
                    .unwrap()
                    .unwrap_or_else(|err| panic!("request: {err:#}")),
            );
        }
        ids
    };
    let mut lessons = wave(replicas.iter().map(|r| r.clients.clone()).collect()).await;

    // Mid load (the first wave booting): one dies, one joins, and a second wave goes through
    // the live ones, the new one among them.
    replicas[0].process.kill9().await;
    let changed = Instant::now();
    let mut joined = start_on(dir.path(), &database.url, &config).await;
    joined.clients.tokens = tokens.clone();
    replicas.push(joined);
    let mut live = Vec::new();
    for replica in &replicas[1..] {
        live.push(replica_id(replica).await);
    }
    lessons.extend(wave(replicas[1..].iter().map(|r| r.clients.clone()).collect()).await);
    shards_settle_on(&store, &live, || logs(&replicas, &agent)).await;
    println!(
        "shards: settled on the 3 live replicas {:?} after one died and one joined \
         (lease TTL 2 s)",
        changed.elapsed()
    );
    let dead = &ids[0];
    assert!(
        shard_holders(&store)
            .await
            .iter()
            .flatten()
            .all(|h| h != dead),
        "the dead replica holds nothing"
    );

    // Every live lesson READY, read through the new replica.
    let reader = replicas[3].clients.clone();
    let total = lessons.len();
    let ready = tokio::time::timeout(PATIENCE, async {
        loop {
            let counts = statuses(&reader, &lessons).await;
            if counts.get(&api::LiveLessonStatus::Ready) == Some(&total) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    if ready.is_err() {
        let counts = statuses(&reader, &lessons).await;
        panic!("not all READY: {counts:?}\n{}", logs(&replicas, &agent));
    }
    println!(
        "shards: all {total} READY {:?} after the kill",
        changed.elapsed()
    );

    // Each created exactly once, nothing else on the agent.
    let creations = created(&journal);
    let expected: BTreeSet<_> = lessons.iter().cloned().collect();
    assert_eq!(
        creations.len(),
        total,
        "{} creations for {total} live lessons",
        creations.len()
    );
    assert_eq!(creations.iter().cloned().collect::<BTreeSet<_>>(), expected);
    let mut agent_client = agent::backend_client::BackendClient::connect(agent.url())
        .await
        .unwrap();
    assert_eq!(
        held(&mut agent_client).await,
        expected,
        "nothing else on the agent"
    );

    // Removal through the live replicas leaves nothing behind.
    let mut deletes = tokio::task::JoinSet::new();
    for (i, id) in lessons.iter().cloned().enumerate() {
        let clients = replicas[1 + i % 3].clients.clone();
        deletes.spawn(async move { clients.delete(&id, PATIENCE).await });
    }
    while let Some(result) = deletes.join_next().await {
        result
            .unwrap()
            .unwrap_or_else(|err| panic!("delete: {err:#}\n{}", logs(&replicas, &agent)));
    }
    let left = held(&mut agent_client).await;
    assert!(left.is_empty(), "left on the agent: {left:?}");
    store.close().await;
}
