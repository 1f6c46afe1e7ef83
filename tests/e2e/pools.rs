//! Warm pools: the real scheduler keeps lessons READY on the real test agent; requests claim
//! them through the public API; operators size pools through AdminService and antidotectl.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, Pool, SchedulerConfig, ms, secs};
use antidote_tests::journal;
use antidote_tests::web::Web;
use antidote_tests::{ADMIN_TOKEN, Scheduler, fetch, presentation, workspace_bin};
use api::LiveLessonStatus as S;

use crate::{Env, Knobs, PATIENCE};

/// How often the tests look at the admin API while waiting for a pool to settle.
const POLL: Duration = Duration::from_millis(100);

/// `config` with `pools`, looked at often.
fn pooled(config: SchedulerConfig, pools: impl IntoIterator<Item = Pool>) -> SchedulerConfig {
    pools.into_iter().fold(
        config.with_pools_interval(ms(200)),
        SchedulerConfig::with_pool,
    )
}

/// The pool of `lesson` at `stage` as the admin API shows it.
async fn pool(env: &Env, lesson: &str, stage: u32) -> Option<api::Pool> {
    env.scheduler
        .clients
        .admin
        .clone()
        .list_pools(api::ListPoolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pools
        .into_iter()
        .find(|p| p.lesson_slug == lesson && p.stage == stage)
}

/// Unclaimed members of a lesson: live lessons the admin API lists that no test session owns.
async fn members(
    c: &antidote_tests::Clients,
    lesson: &str,
    owned: &HashSet<String>,
) -> Vec<api::LiveLesson> {
    c.admin
        .clone()
        .list_live_lessons(api::AdminListLiveLessonsRequest {
            lesson_slug: lesson.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .live_lessons
        .into_iter()
        .filter(|l| !owned.contains(&l.id))
        .collect()
}

/// Waits until `done` holds of the pool (a guard against hangs, not a timing assertion).
async fn until_pool(
    env: &Env,
    lesson: &str,
    stage: u32,
    what: &str,
    done: impl Fn(&api::Pool) -> bool,
) -> api::Pool {
    let start = tokio::time::Instant::now();
    loop {
        let seen = pool(env, lesson, stage).await;
        if let Some(seen) = &seen
            && done(seen)
        {
            return seen.clone();
        }
        assert!(
            start.elapsed() < PATIENCE,
            "pool {lesson}/{stage} never {what}: {seen:?}\n{}",
            env.logs()
        );
        tokio::time::sleep(POLL).await;
    }
}

async fn events(env: &Env, id: &str) -> Vec<String> {
    env.scheduler
        .clients
        .admin
        .clone()
        .list_events(api::ListEventsRequest {
            live_lesson_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .events
        .into_iter()
        .map(|e| e.detail)
        .collect()
}

#[tokio::test]
async fn a_pool_of_three_serves_ten_learners_and_refills() {
    // Members boot slowly, so a member created after the requests cannot be READY in time
    // to be claimed by one of them: exactly the three waiting members are hits.
    let env = Env::start(
        &["--boot-delay", "1500ms", "--configure-delay", "100ms"],
        Knobs {
            config: pooled(Env::config(), [Pool::new("routing-basics", 3)]),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;
    let full = until_pool(&env, "routing-basics", 0, "had 3 READY", |p| p.ready == 3).await;
    assert_eq!(
        (full.target, full.size, full.source.as_str()),
        (3, 3, "config")
    );
    let waiting: HashSet<String> =
        members(&env.scheduler.clients, "routing-basics", &HashSet::new())
            .await
            .into_iter()
            .map(|l| l.id)
            .collect();
    assert_eq!(
        waiting.len(),
        3,
        "only the members exist before any request"
    );

    // Ten sessions ask at once.
    let mut sessions = Vec::new();
    for _ in 0..10 {
        sessions.push(c.session().await.unwrap());
    }
    let answers = futures::future::join_all(sessions.iter().map(|session| {
        let c = c.clone();
        let session = session.clone();
        async move { c.request(&session, "routing-basics", 0).await.unwrap() }
    }))
    .await;
    let ids: HashSet<String> = answers.iter().map(|a| a.id.clone()).collect();
    assert_eq!(ids.len(), 10, "ten different live lessons");
    let hits: Vec<&api::LiveLesson> = answers.iter().filter(|a| a.status() == S::Ready).collect();
    assert_eq!(
        hits.len(),
        3,
        "the three members, READY at once: {answers:?}"
    );
    for hit in &hits {
        assert!(
            waiting.contains(&hit.id),
            "{} was not a waiting member",
            hit.id
        );
        assert_eq!(hit.failure_reason, "", "{hit:?}");
        // It answers on its presentations now, for its new owner.
        let web = fetch(presentation(hit, "server", "web")).await;
        assert!(web.ends_with("routing-basics server stage 0\n"), "{web}");
        let events = events(&env, &hit.id).await;
        assert!(
            events.iter().any(|e| e == "claimed from the warm pool"),
            "{events:?}"
        );
    }
    // The other seven are provisioned as usual.
    for answer in answers.iter().filter(|a| a.status() != S::Ready) {
        assert_eq!(answer.status(), S::Pending, "{answer:?}");
        let ready = c
            .ready(&answer.id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
        assert!(
            !events(&env, &ready.id)
                .await
                .iter()
                .any(|e| e.contains("warm pool")),
            "a provisioned lesson did not come from the pool"
        );
    }
    // Each learner owns exactly its own: another session's token finds nothing.
    let mine = c
        .lessons
        .clone()
        .get_live_lesson(antidote_tests::with_token(
            api::GetLiveLessonRequest {
                id: hits[0].id.clone(),
            },
            c.tokens.of_lesson(&hits[1].id),
        ))
        .await
        .unwrap_err();
    assert_eq!(mine.code(), tonic::Code::NotFound);

    // The pool is back to three READY, all new.
    until_pool(&env, "routing-basics", 0, "refilled", |p| {
        p.ready == 3 && p.starting == 0
    })
    .await;
    let refilled: HashSet<String> = members(&env.scheduler.clients, "routing-basics", &ids)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(refilled.len(), 3);
    assert!(refilled.is_disjoint(&ids), "no member was given twice");
    // Asking again returns the same live lesson, neither a hit nor a miss.
    let again = c.request(&sessions[0], "routing-basics", 0).await.unwrap();
    assert_eq!(again.id, answers[0].id);
    let counted = pool(&env, "routing-basics", 0).await.unwrap();
    assert_eq!((counted.hits, counted.misses), (3, 7));
    // Nothing was created twice on the agent.
    let created = journal::creations_by_lesson(&env.journal);
    assert!(created.values().all(|n| *n == 1), "{created:?}");
    assert_eq!(
        created.len(),
        13,
        "10 live lessons and 3 new members: {created:?}"
    );

    // Deleting a claimed lesson leaves the pool alone.
    c.delete(&hits[0].id, PATIENCE).await.unwrap();
    let after = pool(&env, "routing-basics", 0).await.unwrap();
    assert_eq!((after.ready, after.removing), (3, 0));
    assert_eq!(
        members(&env.scheduler.clients, "routing-basics", &ids)
            .await
            .into_iter()
            .map(|l| l.id)
            .collect::<HashSet<_>>(),
        refilled
    );

    // /metrics has the same.
    let metrics = Web::default()
        .scrape(&format!(
            "{}/metrics",
            env.scheduler.process.extra_url("admin http").unwrap()
        ))
        .await
        .unwrap()
        .body;
    for sample in [
        "antidote_pool_target{lesson=\"routing-basics\",stage=\"0\"} 3",
        "antidote_pool_members{lesson=\"routing-basics\",stage=\"0\",status=\"READY\"} 3",
        "antidote_pool_claims_total{lesson=\"routing-basics\",result=\"hit\"} 3",
        "antidote_pool_claims_total{lesson=\"routing-basics\",result=\"miss\"} 7",
    ] {
        assert!(metrics.contains(sample), "{sample} not in\n{metrics}");
    }
}

#[tokio::test]
async fn failed_members_are_replaced_and_shrinking_removes_unclaimed_only() {
    let env = Env::start(
        &["--fail-lesson", "hello-web"],
        Knobs {
            config: pooled(
                Env::config(),
                [Pool::new("hello-web", 1), Pool::new("routing-basics", 3)],
            ),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;

    // A member that FAILs is removed and another takes its place (and fails too, here).
    let no_one = HashSet::new();
    let first = loop {
        if let Some(member) = members(&env.scheduler.clients, "hello-web", &no_one)
            .await
            .pop()
        {
            break member.id;
        }
        tokio::time::sleep(POLL).await;
    };
    let start = tokio::time::Instant::now();
    loop {
        let now = members(&env.scheduler.clients, "hello-web", &no_one).await;
        if now.iter().all(|l| l.id != first) && !now.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "failed member {first} never replaced\n{}",
            env.logs()
        );
        tokio::time::sleep(POLL).await;
    }
    let events = events(&env, &first).await;
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("warm pool member failed")),
        "{events:?}"
    );

    // Three READY; a learner claims one; the pool shrinks to one: two unclaimed go, the
    // claimed one stays the learner's.
    until_pool(&env, "routing-basics", 0, "had 3 READY", |p| p.ready == 3).await;
    let session = c.session().await.unwrap();
    let mine = c.request(&session, "routing-basics", 0).await.unwrap();
    assert_eq!(mine.status(), S::Ready);
    until_pool(&env, "routing-basics", 0, "refilled", |p| p.ready == 3).await;
    let shrunk = c
        .admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: "routing-basics".into(),
            stage: 0,
            size: 1,
            windows: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((shrunk.size, shrunk.source.as_str()), (1, "admin"));
    let mine_only = HashSet::from([mine.id.clone()]);
    let start = tokio::time::Instant::now();
    while members(&env.scheduler.clients, "routing-basics", &mine_only)
        .await
        .len()
        != 1
    {
        assert!(
            start.elapsed() < PATIENCE,
            "the pool never shrank\n{}",
            env.logs()
        );
        tokio::time::sleep(POLL).await;
    }
    let kept = c
        .ready(&mine.id)
        .await
        .unwrap_or_else(|err| panic!("the claimed lesson was touched: {err:#}"));
    assert_eq!(kept.generation, mine.generation);
    let left = until_pool(&env, "routing-basics", 0, "settled at 1", |p| {
        p.ready == 1 && p.removing == 0 && p.starting == 0
    })
    .await;
    assert_eq!(left.target, 1);

    // Bad sizes and unknown lessons are refused, naming what is wrong.
    let err = c
        .admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: "routing-basics".into(),
            stage: 0,
            size: 5000,
            windows: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("5000"), "{err:?}");
    let err = c
        .admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: "routing-basics".into(),
            stage: 0,
            size: 1,
            windows: vec![api::PoolWindow {
                from: "9:00".into(),
                to: "10:00".into(),
                size: 3,
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("windows[0]"), "{err:?}");
    let err = c
        .admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: "no-such-lesson".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}

#[tokio::test]
async fn a_scheduler_killed_with_members_in_every_state_loses_none_and_duplicates_none() {
    // The agent keeps a record per live lesson it holds (its objects), so the test can see
    // that a member being removed at the kill was deleted on the agent afterwards. Stages
    // take 2s to configure, so a stage change is still running at the kill, and removals 2s,
    // so the member killed just before is still TERMINATING.
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    let mut env = Env::start(
        &[
            "--boot-delay",
            "2s",
            "--configure-delay",
            "2s",
            "--remove-delay",
            "2s",
            "--state-dir",
            &state_dir,
        ],
        Knobs {
            config: pooled(Env::config(), [Pool::new("routing-basics", 3)]),
            ..Knobs::default()
        },
    )
    .await;
    until_pool(&env, "routing-basics", 0, "had 3 READY", |p| p.ready == 3).await;
    let c = env.scheduler.clients.clone();
    // One claimed, one READY waiting, new ones booting, one being removed.
    let session = c.session().await.unwrap();
    let mine = c.request(&session, "routing-basics", 0).await.unwrap();
    assert_eq!(mine.status(), S::Ready);
    c.admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: "routing-basics".into(),
            stage: 0,
            size: 5,
            windows: Vec::new(),
        })
        .await
        .unwrap();
    let owned = HashSet::from([mine.id.clone()]);
    let start = tokio::time::Instant::now();
    let before = loop {
        let now = members(&env.scheduler.clients, "routing-basics", &owned).await;
        let booting = now
            .iter()
            .filter(|l| matches!(l.status(), S::Pending | S::Booting))
            .count();
        if now.len() == 5 && booting >= 2 {
            break now;
        }
        assert!(start.elapsed() < PATIENCE, "no members booting: {now:?}");
        tokio::time::sleep(POLL).await;
    };
    let ready = before.iter().find(|l| l.status() == S::Ready).unwrap();
    assert!(
        state.path().join(format!("{}.json", ready.id)).exists(),
        "the agent holds the member about to be removed"
    );
    c.admin
        .clone()
        .kill_live_lesson(api::KillLiveLessonRequest {
            id: ready.id.clone(),
        })
        .await
        .unwrap();
    let statuses: Vec<_> = members(&env.scheduler.clients, "routing-basics", &owned)
        .await
        .iter()
        .map(|l| l.status())
        .collect();
    assert!(statuses.contains(&S::Ready), "{statuses:?}");
    assert!(statuses.contains(&S::Terminating), "{statuses:?}");
    assert!(
        statuses
            .iter()
            .any(|s| matches!(s, S::Pending | S::Booting)),
        "{statuses:?}"
    );
    // Another learner asks for stage 1: the last READY member is claimed and is changing
    // stage (CONFIGURING) at the kill.
    let other = c.session().await.unwrap();
    let theirs = c.request(&other, "routing-basics", 1).await.unwrap();
    assert_eq!(
        (theirs.status(), theirs.stage),
        (S::Configuring, 1),
        "{theirs:?}"
    );
    let owned = HashSet::from([mine.id.clone(), theirs.id.clone()]);
    env.scheduler.process.kill9().await;

    env.scheduler = Scheduler::start(env.dir.path(), &env.config).await.unwrap();
    let c = env.scheduler.clients.clone();
    let settled = until_pool(&env, "routing-basics", 0, "came back to 5 READY", |p| {
        p.ready == 5 && p.starting == 0 && p.removing == 0
    })
    .await;
    assert_eq!(settled.target, 5);
    let after: HashSet<String> = members(&env.scheduler.clients, "routing-basics", &owned)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(after.len(), 5, "{statuses:?} before the kill");
    // Every member alive before the kill is still one (none lost) and only the killed one
    // was replaced (none doubled).
    for member in before
        .iter()
        .filter(|l| l.id != ready.id && l.id != theirs.id)
    {
        assert!(after.contains(&member.id), "{} lost", member.id);
    }
    assert!(!after.contains(&ready.id));
    let created = journal::creations_by_lesson(&env.journal);
    assert!(created.values().all(|n| *n == 1), "{created:?}");
    // The member being removed at the kill was deleted on the agent; every live one is there.
    assert!(
        !state.path().join(format!("{}.json", ready.id)).exists(),
        "{} still on the agent",
        ready.id
    );
    for id in after.iter().chain([&mine.id, &theirs.id]) {
        assert!(
            state.path().join(format!("{id}.json")).exists(),
            "{id} not on the agent"
        );
    }
    // The stage change cut short by the kill finished: READY at stage 1, the learner's.
    let start = tokio::time::Instant::now();
    let their_view = loop {
        let view = c
            .admin
            .clone()
            .get_live_lesson(api::AdminGetLiveLessonRequest {
                id: theirs.id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .live_lesson
            .unwrap();
        if view.stage == 1 && matches!(view.status(), S::Ready | S::Failed) {
            break view;
        }
        assert!(start.elapsed() < PATIENCE, "{view:?}");
        tokio::time::sleep(POLL).await;
    };
    assert_eq!(
        their_view.status(),
        S::Ready,
        "{}",
        their_view.failure_reason
    );
    assert_eq!(their_view.session_id, other);
    // The learner's lesson is still the learner's, READY.
    let admin_view = c
        .admin
        .clone()
        .get_live_lesson(api::AdminGetLiveLessonRequest {
            id: mine.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let theirs = admin_view.live_lesson.unwrap();
    assert_eq!(
        (theirs.status(), theirs.session_id.as_str()),
        (S::Ready, session.as_str())
    );
}

#[tokio::test]
async fn time_windows_set_targets_and_antidotectl_sizes_pools() {
    // A window around now (UTC, the default zone) and one that does not hold now.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let minute = ((now / 60) % 1440) as i64;
    let at = |offset: i64| {
        let m = (minute + offset).rem_euclid(1440);
        format!("{:02}:{:02}", m / 60, m % 60)
    };
    let pools = [
        Pool::new("routing-basics", 0).with_window(&at(-60), &at(60), 2),
        Pool::new("hello-web", 1).with_window(&at(120), &at(180), 4),
    ];
    let env = Env::start(
        &[],
        Knobs {
            config: pooled(Env::config(), pools),
            ..Knobs::default()
        },
    )
    .await;
    let inside = until_pool(&env, "routing-basics", 0, "had 2 READY", |p| p.ready == 2).await;
    assert_eq!((inside.size, inside.target), (0, 2));
    assert_eq!(inside.windows.len(), 1);
    let outside = until_pool(&env, "hello-web", 0, "had 1 READY", |p| p.ready == 1).await;
    assert_eq!((outside.size, outside.target), (1, 1));

    // antidotectl sets a pool (with a window) and lists them.
    let ctl = |args: &[&str]| {
        let mut all: Vec<String> = vec![
            "--server".into(),
            env.scheduler.process.url(),
            "--admin-server".into(),
            format!("http://{}", env.scheduler.process.extra["admin"]),
            "--token".into(),
            ADMIN_TOKEN.into(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        std::process::Command::new(workspace_bin("antidotectl"))
            .args(&all)
            .env("ANTIDOTE_STATE_DIR", env.dir.path())
            .output()
            .expect("antidotectl runs")
    };
    let window = format!("{}-{}=3", at(-30), at(30));
    let set = ctl(&[
        "admin",
        "pool",
        "set",
        "hello-web",
        "--size",
        "0",
        "--window",
        &window,
    ]);
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let table = String::from_utf8_lossy(&set.stdout);
    assert!(
        table.contains("hello-web") && table.contains(&window),
        "{table}"
    );
    until_pool(&env, "hello-web", 0, "had 3 READY", |p| {
        p.ready == 3 && p.target == 3
    })
    .await;
    let list = ctl(&["admin", "pool", "list", "--output", "json"]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let pools = json["pools"].as_array().unwrap();
    assert_eq!(pools.len(), 2, "{json}");
    assert_eq!(pools[0]["lessonSlug"], "hello-web");
    assert_eq!(pools[0]["source"], "admin");
    // The JSON route is the same call.
    let answer = Web::default()
        .send(
            hyper::Method::PUT,
            &format!(
                "{}/v1/admin/pools/routing-basics/0",
                env.scheduler.process.extra_url("admin http").unwrap()
            ),
            &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            Some(r#"{"size": 1, "windows": []}"#),
        )
        .await
        .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    let pool: serde_json::Value = answer.json().unwrap();
    assert_eq!(
        (pool["size"].as_u64(), pool["target"].as_u64()),
        (Some(1), Some(1)),
        "{pool}"
    );
    let bad = ctl(&[
        "admin",
        "pool",
        "set",
        "hello-web",
        "--size",
        "1",
        "--window",
        "08:00",
    ]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("FROM-TO=SIZE"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

#[tokio::test]
async fn an_unclaimed_member_gives_way_to_a_learner_when_agents_are_full() {
    // The agent takes two live lessons; the pool fills both.
    let env = Env::start(
        &["--max-live-lessons", "2"],
        Knobs {
            config: pooled(Env::config(), [Pool::new("routing-basics", 2)]),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;
    until_pool(&env, "routing-basics", 0, "had 2 READY", |p| p.ready == 2).await;
    let before: HashSet<String> =
        members(&env.scheduler.clients, "routing-basics", &HashSet::new())
            .await
            .into_iter()
            .map(|l| l.id)
            .collect();

    // A learner asks for another lesson: a member makes room for it.
    let session = c.session().await.unwrap();
    let asked = c.request(&session, "hello-web", 0).await.unwrap();
    let ready = c
        .ready(&asked.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let owned = HashSet::from([ready.id.clone()]);
    let left: HashSet<String> = members(&env.scheduler.clients, "routing-basics", &owned)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(left.len(), 1, "one member gave way: {left:?}");
    let gone = before
        .difference(&left)
        .next()
        .expect("a member went")
        .clone();
    let events = events(&env, &gone).await;
    let gave_way = format!("gave way to live lesson {}", ready.id);
    assert!(events.contains(&gave_way), "{events:?}");
    // The pool does not take the room back while the learner holds it.
    let pool = pool(&env, "routing-basics", 0).await.unwrap();
    assert_eq!(
        (pool.target, pool.ready, pool.starting),
        (2, 1, 0),
        "{pool:?}"
    );

    // Once the learner is done, the pool refills.
    c.delete(&ready.id, PATIENCE).await.unwrap();
    until_pool(&env, "routing-basics", 0, "refilled", |p| p.ready == 2).await;
}

#[tokio::test]
async fn replicas_on_postgresql_keep_one_pool_not_one_each() {
    let database = crate::postgres::TestDatabase::create();
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    let agent = crate::start_agent(&dir, &["--boot-delay", "300ms"], &journal, None).await;
    let config = SchedulerConfig::new("e2e-pools", &antidote_tests::example_curriculum())
        .with_replicas(secs(2), ms(500))
        .with_backoff(ms(50), secs(1))
        .with_agent(Agent::new("loopback", agent.url()));
    let config = pooled(config, [Pool::new("routing-basics", 3)]).to_toml();
    let a = crate::postgres::start_on(dir.path(), &database.url, &config).await;
    let b = crate::postgres::start_on(dir.path(), &database.url, &config).await;
    let all = |c: &antidote_tests::Clients| {
        let c = c.clone();
        async move {
            c.admin
                .clone()
                .list_pools(api::ListPoolsRequest {})
                .await
                .unwrap()
                .into_inner()
                .pools
        }
    };
    let start = tokio::time::Instant::now();
    loop {
        let pools = all(&a.clients).await;
        if pools
            .first()
            .is_some_and(|p| p.ready == 3 && p.starting == 0)
        {
            break;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "{pools:?}\n{}",
            a.process.log_text()
        );
        tokio::time::sleep(POLL).await;
    }
    // Both replicas see the same pool, and exactly three members were ever made.
    let seen_by_b = all(&b.clients).await;
    assert_eq!(
        (seen_by_b[0].ready, seen_by_b[0].target),
        (3, 3),
        "{seen_by_b:?}"
    );
    let created = journal::created(&journal);
    let ids: HashSet<&String> = created.iter().collect();
    assert_eq!(ids.len(), 3, "{created:?}");

    // A learner on replica B claims one; the pool refills to three, not more.
    let session = b.clients.session().await.unwrap();
    let mine = b
        .clients
        .request(&session, "routing-basics", 0)
        .await
        .unwrap();
    assert_eq!(mine.status(), S::Ready);
    let start = tokio::time::Instant::now();
    loop {
        let pools = all(&b.clients).await;
        if pools
            .first()
            .is_some_and(|p| p.ready == 3 && p.starting == 0)
        {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "{pools:?}");
        tokio::time::sleep(POLL).await;
    }
    let created = journal::created(&journal);
    let ids: HashSet<&String> = created.iter().collect();
    assert_eq!(ids.len(), 4, "three members and one refill: {created:?}");
}

/// The docker CLI against the tests' engine.
fn docker(args: &[&str]) -> String {
    let host = std::env::var("DOCKER_HOST").expect(
        "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
    );
    let output = std::process::Command::new("docker")
        .args(args)
        .env("DOCKER_HOST", host)
        .output()
        .expect("the docker CLI runs");
    assert!(output.status.success(), "docker {args:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The container agent-docker names for `endpoint` of live lesson `id`.
fn endpoint_container(id: &str, endpoint: &str) -> String {
    let hex: String = id
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    format!("antidote-{hex}-{endpoint}")
}

/// Whether one ping from container `from` reaches `to`.
fn pinged(from: &str, to: &str) -> bool {
    std::process::Command::new("docker")
        .args(["exec", from, "ping", "-c", "1", "-W", "2", to])
        .env("DOCKER_HOST", std::env::var("DOCKER_HOST").unwrap())
        .output()
        .expect("the docker CLI runs")
        .status
        .success()
}

/// The first four bytes `endpoint`'s `cli` presentation sends.
async fn ssh_banner(lesson: &api::LiveLesson, endpoint: &str) -> [u8; 4] {
    use tokio::io::AsyncReadExt as _;
    let mut ssh = tokio::net::TcpStream::connect(&presentation(lesson, endpoint, "cli").address)
        .await
        .unwrap();
    let mut banner = [0u8; 4];
    ssh.read_exact(&mut banner).await.unwrap();
    banner
}

/// Labels of the containers of live lesson `id`, one map per container.
fn container_labels(instance: &str, id: &str) -> Vec<HashMap<String, String>> {
    let names = docker(&[
        "ps",
        "-a",
        "--filter",
        &format!("label=antidote.io/instance={instance}"),
        "--filter",
        &format!("label=antidote.io/live-lesson={id}"),
        "--format",
        "{{.Names}}",
    ]);
    names
        .lines()
        .filter(|n| !n.is_empty())
        .map(|name| {
            let json = docker(&["inspect", "-f", "{{json .Config.Labels}}", name]);
            serde_json::from_str(json.trim()).expect("labels are JSON")
        })
        .collect()
}

#[tokio::test]
async fn agent_docker_pool_members_are_claimed_at_their_stage_or_moved_on() {
    let instance = "e2e-pools-docker";
    let dir = tempfile::tempdir().unwrap();
    let agent = antidote_tests::Process::spawn(
        &workspace_bin("agent-docker"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--probe-timeout".into(),
            "30s".into(),
        ],
        dir.path().join("agent-docker.log"),
    )
    .await
    .expect("agent-docker starts");
    let config = SchedulerConfig::new(instance, &antidote_tests::example_curriculum())
        .with_sessions_per_ip(0)
        .with_backoff(ms(100), secs(1))
        .with_provision_timeout(secs(180))
        .with_agent(Agent::new("docker", agent.url()));
    let config = pooled(config, [Pool::new("routing-basics", 2)]).to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let c = &scheduler.clients;
    let logs = || {
        format!(
            "--- scheduler ---\n{}\n--- agent-docker ---\n{}",
            scheduler.process.log_text(),
            agent.log_text()
        )
    };
    let pools = || async {
        c.admin
            .clone()
            .list_pools(api::ListPoolsRequest {})
            .await
            .unwrap()
            .into_inner()
            .pools
            .pop()
            .unwrap()
    };
    let start = tokio::time::Instant::now();
    while pools().await.ready != 2 {
        assert!(
            start.elapsed() < PATIENCE,
            "{:?}\n{}",
            pools().await,
            logs()
        );
        tokio::time::sleep(POLL).await;
    }

    // Stage 0: READY at once, answering on its presentations.
    let (one, two) = (c.session().await.unwrap(), c.session().await.unwrap());
    let mine = c.request(&one, "routing-basics", 0).await.unwrap();
    assert_eq!(mine.status(), S::Ready, "{mine:?}");
    let page = fetch(presentation(&mine, "server", "web")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    assert!(
        page.contains("Stage 0: no route back"),
        "the page stage 0 wrote: {page}"
    );
    for endpoint in ["client", "router", "server"] {
        assert_eq!(
            &ssh_banner(&mine, endpoint).await,
            b"SSH-",
            "{endpoint}'s cli"
        );
    }
    // Stage 0 has no route from the client to the server's network.
    assert!(!pinged(
        &endpoint_container(&mine.id, "client"),
        "10.10.2.10"
    ));
    // Its containers are never relabelled: they carry the pool's mark and the pool session;
    // the scheduler records the learner's session.
    let labels = container_labels(instance, &mine.id);
    assert!(!labels.is_empty());
    for container in &labels {
        assert_eq!(
            container.get("antidote.io/pool").map(String::as_str),
            Some("true")
        );
        assert_ne!(container["antidote.io/session"], one, "{container:?}");
    }
    let owner = c
        .admin
        .clone()
        .get_live_lesson(api::AdminGetLiveLessonRequest {
            id: mine.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .live_lesson
        .unwrap();
    assert_eq!(owner.session_id, one);

    // Stage 1 has no pool: a stage-0 member is claimed, then configured for stage 1.
    let theirs = c.request(&two, "routing-basics", 1).await.unwrap();
    assert_eq!(
        (theirs.status(), theirs.stage),
        (S::Configuring, 1),
        "{theirs:?}"
    );
    let (_, staged) = c
        .follow(&theirs.id, PATIENCE, |l| {
            l.stage == 1 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(
        staged.status(),
        S::Ready,
        "{}\n{}",
        staged.failure_reason,
        logs()
    );
    // Stage 1 took effect on the member moved on: its routes, its page.
    assert!(
        pinged(&endpoint_container(&theirs.id, "client"), "10.10.2.10"),
        "stage 1 routes the client to the server\n{}",
        logs()
    );
    let page = fetch(presentation(&staged, "server", "web")).await;
    assert!(page.contains("Stage 1: routed"), "{page}");

    // Deleting a claimed lesson removes its containers and nothing of the pool's.
    let start = tokio::time::Instant::now();
    while pools().await.ready != 2 {
        assert!(
            start.elapsed() < PATIENCE,
            "the pool never refilled\n{}",
            logs()
        );
        tokio::time::sleep(POLL).await;
    }
    let claimed = HashSet::from([mine.id.clone(), theirs.id.clone()]);
    let waiting: Vec<String> = members(c, "routing-basics", &claimed)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(waiting.len(), 2);
    c.delete(&mine.id, PATIENCE).await.unwrap();
    assert!(container_labels(instance, &mine.id).is_empty());
    for member in &waiting {
        assert!(
            !container_labels(instance, member).is_empty(),
            "{member} was touched"
        );
    }
    assert_eq!(pools().await.ready, 2);
    c.delete(&theirs.id, PATIENCE).await.unwrap();

    // The pool shrinks to nothing, and its members' containers go with it: nothing of this
    // test outlives it in the engine (the members would otherwise keep running, unclaimed and
    // never reaped, after the scheduler is gone).
    c.admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: "routing-basics".into(),
            stage: 0,
            size: 0,
            windows: Vec::new(),
        })
        .await
        .unwrap();
    let left = || {
        let filter = format!("label=antidote.io/instance={instance}");
        let containers = docker(&["ps", "-aq", "--filter", &filter]);
        let networks = docker(&["network", "ls", "-q", "--filter", &filter]);
        containers.lines().chain(networks.lines()).count()
    };
    let start = tokio::time::Instant::now();
    while left() > 0 {
        assert!(
            start.elapsed() < PATIENCE,
            "the pool's members were not all removed when it shrank to 0 ({} containers and \
             networks left)\n{}",
            left(),
            logs()
        );
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test]
async fn a_changed_lesson_replaces_its_unclaimed_members_only() {
    let dir = tempfile::tempdir().unwrap();
    let curriculum = dir.path().join("curriculum");
    let copied = std::process::Command::new("cp")
        .arg("-r")
        .arg(antidote_tests::example_curriculum())
        .arg(&curriculum)
        .status()
        .unwrap();
    assert!(copied.success());
    let journal = dir.path().join("journal");
    let agent = crate::start_agent(&dir, &[], &journal, None).await;
    let configured = |curriculum: &std::path::Path| {
        let config = SchedulerConfig::new("e2e-pools-change", curriculum)
            .with_backoff(ms(50), secs(1))
            .with_agent(Agent::new("loopback", agent.url()));
        pooled(config, [Pool::new("hello-web", 2)]).to_toml()
    };
    let config = configured(&curriculum);
    let mut scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let ready_members = |scheduler: &Scheduler, owned: HashSet<String>| {
        let c = scheduler.clients.clone();
        async move {
            let start = tokio::time::Instant::now();
            loop {
                let now = members(&c, "hello-web", &owned).await;
                if now.len() == 2 && now.iter().all(|l| l.status() == S::Ready) {
                    return now.into_iter().map(|l| l.id).collect::<HashSet<_>>();
                }
                assert!(start.elapsed() < PATIENCE, "{now:?}");
                tokio::time::sleep(POLL).await;
            }
        }
    };
    ready_members(&scheduler, HashSet::new()).await;
    let c = scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let mine = c.request(&session, "hello-web", 0).await.unwrap();
    assert_eq!(mine.status(), S::Ready);
    let owned = HashSet::from([mine.id.clone()]);
    let before = ready_members(&scheduler, owned.clone()).await;

    // The curriculum moves to another path (another replica's mount) and only its description
    // changes while the scheduler is down: agents would get the same specs, so the members
    // stay.
    scheduler.process.terminate().await.unwrap();
    let moved = dir.path().join("mounted-elsewhere");
    std::fs::rename(&curriculum, &moved).unwrap();
    let curriculum = moved;
    let config = configured(&curriculum);
    let meta = curriculum.join("lessons/hello-web/lesson.meta.yaml");
    let text = std::fs::read_to_string(&meta).unwrap();
    let edited = text.replace(
        "shortDescription: One endpoint, one web page",
        "shortDescription: One endpoint, one web page, edited",
    );
    assert_ne!(text, edited);
    std::fs::write(&meta, edited).unwrap();
    scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    // Long enough for several looks (interval 200ms) to have replaced them, had they differed.
    for _ in 0..10 {
        assert_eq!(ready_members(&scheduler, owned.clone()).await, before);
        tokio::time::sleep(POLL).await;
    }

    // The stage's configuration (what agents run) changes: the members are replaced.
    scheduler.process.terminate().await.unwrap();
    let config_file = curriculum.join("lessons/hello-web/stage0/configs/web.sh");
    let mut script = std::fs::read_to_string(&config_file).unwrap();
    script.push_str("\n# edited\n");
    std::fs::write(&config_file, script).unwrap();
    scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let start = tokio::time::Instant::now();
    let after = loop {
        let after = ready_members(&scheduler, owned.clone()).await;
        if after.is_disjoint(&before) {
            break after;
        }
        assert!(start.elapsed() < PATIENCE, "members never replaced");
        tokio::time::sleep(POLL).await;
    };
    assert_eq!(after.len(), 2);
    let old = before.iter().next().unwrap();
    let events: Vec<String> = scheduler
        .clients
        .admin
        .clone()
        .list_events(api::ListEventsRequest {
            live_lesson_id: old.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .events
        .into_iter()
        .map(|e| e.detail)
        .collect();
    assert!(
        events.iter().any(|e| e.contains("definition changed")),
        "{events:?}"
    );
    // The learner's lesson is the learner's: not replaced.
    let theirs = scheduler
        .clients
        .admin
        .clone()
        .get_live_lesson(api::AdminGetLiveLessonRequest {
            id: mine.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .live_lesson
        .unwrap();
    assert_eq!(
        (theirs.status(), theirs.session_id.as_str()),
        (S::Ready, session.as_str())
    );
}

/// Two test agents labelled `region=eu` and `region=us` (configured as `eu` and `us`) and a
/// scheduler on `curriculum` at `tier` with `pool`.
async fn two_regions(
    dir: &tempfile::TempDir,
    instance: &str,
    curriculum: &std::path::Path,
    tier: &str,
    pool: Pool,
) -> (antidote_tests::Process, antidote_tests::Process, Scheduler) {
    let agent = |region: &'static str| async move {
        crate::start_agent(
            dir,
            &["--label", &format!("region={region}")],
            &dir.path().join(region),
            None,
        )
        .await
    };
    let eu = agent("eu").await;
    let us = agent("us").await;
    let config = SchedulerConfig::new(instance, curriculum)
        .with_tier(tier)
        .with_sessions_per_ip(0)
        .with_backoff(ms(50), secs(1))
        .with_agent(Agent::new("eu", eu.url()))
        .with_agent(Agent::new("us", us.url()));
    let config = pooled(config, [pool]).to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    (eu, us, scheduler)
}

#[tokio::test]
async fn a_claim_honours_the_request_s_placement_labels() {
    let dir = tempfile::tempdir().unwrap();
    let (_eu, _us, scheduler) = two_regions(
        &dir,
        "e2e-pools-labels",
        &antidote_tests::example_curriculum(),
        "local",
        Pool::new("routing-basics", 4),
    )
    .await;
    let c = &scheduler.clients;
    // Members are spread over the agents that fit, by load (placements running at once may
    // see the same loads, so not necessarily two each).
    let start = tokio::time::Instant::now();
    loop {
        let now = members(c, "routing-basics", &HashSet::new()).await;
        let ready: Vec<&str> = now
            .iter()
            .filter(|l| l.status() == S::Ready)
            .map(|l| l.agent.as_str())
            .collect();
        if ready.len() == 4 {
            assert!(ready.contains(&"eu") && ready.contains(&"us"), "{ready:?}");
            break;
        }
        assert!(start.elapsed() < PATIENCE, "{now:?}");
        tokio::time::sleep(POLL).await;
    }
    for region in ["eu", "us"] {
        let session = c.session().await.unwrap();
        let placement = api::PlacementPreference {
            requires: HashMap::from([("region".to_owned(), region.to_owned())]),
            ..Default::default()
        };
        let claimed = c
            .request_placed(&session, "routing-basics", 0, Some(placement))
            .await
            .unwrap();
        assert_eq!(claimed.status(), S::Ready, "{claimed:?}");
        assert_eq!(c.agent_of(&claimed.id).await.unwrap(), region);
    }

    // Preferred labels: once both agents hold a READY member, a request preferring the region
    // of the newest one gets a member there, not the oldest member (on the other agent).
    let start = tokio::time::Instant::now();
    let newest = loop {
        let mut ready: Vec<api::LiveLesson> = members(c, "routing-basics", &HashSet::new())
            .await
            .into_iter()
            .filter(|l| l.status() == S::Ready && c.tokens.of_lesson(&l.id).is_none())
            .collect();
        ready.sort_by_key(|l| {
            let at = l.created_at.unwrap_or_default();
            (at.seconds, at.nanos)
        });
        if let (Some(oldest), Some(newest)) = (ready.first(), ready.last())
            && oldest.agent != newest.agent
        {
            break newest.agent.clone();
        }
        assert!(start.elapsed() < PATIENCE, "{ready:?}");
        tokio::time::sleep(POLL).await;
    };
    let session = c.session().await.unwrap();
    let placement = api::PlacementPreference {
        prefers: HashMap::from([("region".to_owned(), newest.clone())]),
        ..Default::default()
    };
    let claimed = c
        .request_placed(&session, "routing-basics", 0, Some(placement))
        .await
        .unwrap();
    assert_eq!(claimed.status(), S::Ready, "{claimed:?}");
    assert_eq!(c.agent_of(&claimed.id).await.unwrap(), newest);

    // Draining an agent moves its unclaimed members to the others; claimed lessons stay.
    c.admin
        .clone()
        .drain_agent(api::DrainAgentRequest { name: "eu".into() })
        .await
        .unwrap();
    let start = tokio::time::Instant::now();
    loop {
        let now = members(c, "routing-basics", &HashSet::new()).await;
        let unclaimed: Vec<&api::LiveLesson> = now
            .iter()
            .filter(|l| c.tokens.of_lesson(&l.id).is_none())
            .collect();
        if unclaimed.len() == 4
            && unclaimed
                .iter()
                .all(|l| l.agent == "us" && l.status() == S::Ready)
        {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "{now:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// A lesson's own `placement.requires` binds its pool as it binds a request: members are placed
/// only on agents carrying the labels, and a claim preferring other labels still gets one of
/// them (READY at once), never a lesson on an agent the lesson refuses.
#[tokio::test]
async fn a_pool_of_a_lesson_requiring_labels_keeps_and_hands_out_members_where_it_may_run() {
    let dir = tempfile::tempdir().unwrap();
    let curriculum = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/fleet-curriculum")
        .canonicalize()
        .unwrap();
    let (_eu, _us, scheduler) = two_regions(
        &dir,
        "e2e-pools-lesson-labels",
        &curriculum,
        "prod",
        Pool::new("eu-only", 3),
    )
    .await;
    let c = &scheduler.clients;
    let settled = |want: usize| async move {
        let start = tokio::time::Instant::now();
        loop {
            let now = members(c, "eu-only", &HashSet::new()).await;
            let unclaimed: Vec<&api::LiveLesson> = now
                .iter()
                .filter(|l| c.tokens.of_lesson(&l.id).is_none())
                .collect();
            assert!(
                now.iter().all(|l| l.agent.is_empty() || l.agent == "eu"),
                "a member of eu-only on an agent without region=eu: {now:?}"
            );
            if unclaimed.len() == want && unclaimed.iter().all(|l| l.status() == S::Ready) {
                return;
            }
            assert!(start.elapsed() < PATIENCE, "{now:?}");
            tokio::time::sleep(POLL).await;
        }
    };
    settled(3).await;
    let session = c.session().await.unwrap();
    let placement = api::PlacementPreference {
        prefers: HashMap::from([("region".to_owned(), "us".to_owned())]),
        ..Default::default()
    };
    let claimed = c
        .request_placed(&session, "eu-only", 0, Some(placement))
        .await
        .unwrap();
    assert_eq!(claimed.status(), S::Ready, "a pool hit: {claimed:?}");
    assert_eq!(c.agent_of(&claimed.id).await.unwrap(), "eu");
    // The pool refills, on eu again.
    settled(3).await;
    // A request requiring what the lesson refuses is answered with the reason, and takes no
    // member.
    let session = c.session().await.unwrap();
    let placement = api::PlacementPreference {
        requires: HashMap::from([("region".to_owned(), "us".to_owned())]),
        ..Default::default()
    };
    let refused = c
        .request_placed(&session, "eu-only", 0, Some(placement))
        .await;
    match refused {
        Err(status) => assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}"),
        Ok(lesson) => panic!("eu-only placed against its own labels: {lesson:?}"),
    }
    settled(3).await;
}

#[tokio::test]
async fn unclaimed_members_outlive_the_ttl_and_a_claimed_one_lives_by_it() {
    let env = Env::start(
        &[],
        Knobs {
            config: pooled(
                Env::config().with_lesson_ttl(secs(2)),
                [Pool::new("routing-basics", 2)],
            ),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;
    until_pool(&env, "routing-basics", 0, "had 2 READY", |p| p.ready == 2).await;
    let first: HashSet<String> = members(c, "routing-basics", &HashSet::new())
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    let session = c.session().await.unwrap();
    let mine = c.request(&session, "routing-basics", 0).await.unwrap();
    assert_eq!(mine.status(), S::Ready);
    let expires = mine.expires_at.expect("a learner's lesson expires");
    assert!(
        expires.seconds
            <= std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64
                + 3,
        "the TTL counts from the claim: {expires:?}"
    );
    // The claimed lesson, idle, is reaped by its TTL; the other member, idle since before
    // the claim, is not.
    c.gone(&mine.id, PATIENCE)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let left: HashSet<String> = members(c, "routing-basics", &HashSet::new())
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    let other = first.iter().find(|id| **id != mine.id).unwrap();
    assert!(left.contains(other), "{left:?}");
    let events = events(&env, &mine.id).await;
    assert!(
        events.iter().any(|e| e.starts_with("expired")),
        "{events:?}"
    );
}

#[tokio::test]
async fn identical_requests_at_once_get_one_lesson_and_a_session_at_its_limit_takes_no_member() {
    let env = Env::start(
        &[],
        Knobs {
            config: pooled(
                Env::config().with_lessons_per_session(1),
                [Pool::new("hello-web", 2), Pool::new("routing-basics", 1)],
            ),
            ..Knobs::default()
        },
    )
    .await;
    until_pool(&env, "hello-web", 0, "had 2 READY", |p| p.ready == 2).await;
    until_pool(&env, "routing-basics", 0, "had 1 READY", |p| p.ready == 1).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    // One session asks for the pooled lesson four times at once: one live lesson, one hit.
    let answers =
        futures::future::join_all((0..4).map(|_| c.request(&session, "hello-web", 0))).await;
    let ids: HashSet<String> = answers
        .into_iter()
        .map(|answer| answer.expect("every identical request succeeds").id)
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let theirs: Vec<api::LiveLesson> = c
        .admin
        .clone()
        .list_live_lessons(api::AdminListLiveLessonsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .live_lessons
        .into_iter()
        .filter(|l| l.session_id == session)
        .collect();
    assert_eq!(theirs.len(), 1, "{theirs:?}");
    assert_eq!(theirs[0].status(), S::Ready, "claimed, READY at once");
    // At its limit (1), the session asks for another pooled lesson: refused, the member stays.
    let refused = c
        .request(&session, "routing-basics", 0)
        .await
        .expect_err("the session holds its limit");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    let routing = pool(&env, "routing-basics", 0).await.unwrap();
    assert_eq!((routing.ready, routing.hits, routing.misses), (1, 0, 0));
    let hello = until_pool(&env, "hello-web", 0, "refilled", |p| p.ready == 2).await;
    assert_eq!(
        (hello.hits, hello.misses),
        (1, 0),
        "the duplicates and the refused request are neither hits nor misses"
    );
    let metrics = Web::default()
        .scrape(&format!(
            "{}/metrics",
            env.scheduler.process.extra_url("admin http").unwrap()
        ))
        .await
        .unwrap()
        .body;
    assert!(
        metrics.contains("antidote_pool_claims_total{lesson=\"hello-web\",result=\"hit\"} 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("result=\"miss\""),
        "no request found the pool empty:\n{metrics}"
    );
}

#[tokio::test]
async fn a_failed_member_s_replacement_reaches_ready() {
    // The agent fails the lesson's first two provisions, then provisions it.
    let env = Env::start(
        &["--fail-lesson", "hello-web", "--fail-first", "2"],
        Knobs {
            config: pooled(Env::config(), [Pool::new("hello-web", 2)]),
            ..Knobs::default()
        },
    )
    .await;
    let full = until_pool(&env, "hello-web", 0, "had 2 READY", |p| {
        p.ready == 2 && p.failed == 0 && p.starting == 0 && p.removing == 0
    })
    .await;
    assert_eq!(full.target, 2);
    let ready: HashSet<String> = members(&env.scheduler.clients, "hello-web", &HashSet::new())
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(ready.len(), 2);
    // Two members failed and were replaced: four made in all, each once, the failed ones gone.
    let created = journal::creations_by_lesson(&env.journal);
    assert!(created.values().all(|n| *n == 1), "{created:?}");
    assert_eq!(created.len(), 4, "{created:?}");
    let failed: Vec<&String> = created.keys().filter(|id| !ready.contains(*id)).collect();
    assert_eq!(failed.len(), 2, "{created:?}");
    for id in failed {
        let events = events(&env, id).await;
        assert!(
            events.iter().any(|e| e.contains("warm pool member failed")),
            "{id}: {events:?}"
        );
    }
}

#[tokio::test]
async fn a_scheduler_killed_while_a_member_is_failed_replaces_it_once() {
    // The agent fails the lesson's first provision. Pools are looked at every 30s, so the
    // FAILED member is still FAILED (not yet being removed) when the scheduler is killed; the
    // restarted scheduler's first look removes it from the agent and makes one replacement,
    // and the READY member is kept.
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().display().to_string();
    let mut env = Env::start(
        &[
            "--fail-lesson",
            "hello-web",
            "--fail-first",
            "1",
            "--state-dir",
            &state_dir,
        ],
        Knobs {
            config: Env::config()
                .with_pools_interval(secs(30))
                .with_pool(Pool::new("hello-web", 2)),
            ..Knobs::default()
        },
    )
    .await;
    until_pool(&env, "hello-web", 0, "had one READY and one FAILED", |p| {
        p.ready == 1 && p.failed == 1
    })
    .await;
    let before = members(&env.scheduler.clients, "hello-web", &HashSet::new()).await;
    let failed = before.iter().find(|l| l.status() == S::Failed).unwrap();
    let ready = before.iter().find(|l| l.status() == S::Ready).unwrap();
    assert!(
        state.path().join(format!("{}.json", failed.id)).exists(),
        "the agent holds the failed member's objects"
    );
    env.scheduler.process.kill9().await;

    env.scheduler = Scheduler::start(env.dir.path(), &env.config).await.unwrap();
    until_pool(&env, "hello-web", 0, "came back to 2 READY", |p| {
        p.ready == 2 && p.failed == 0 && p.starting == 0 && p.removing == 0
    })
    .await;
    let after: HashSet<String> = members(&env.scheduler.clients, "hello-web", &HashSet::new())
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert!(after.contains(&ready.id), "the READY member was lost");
    assert!(!after.contains(&failed.id), "the FAILED member was kept");
    assert_eq!(after.len(), 2, "{after:?}");
    // Three made in all (two first, one replacement), each once; the failed one is gone from
    // the agent.
    let created = journal::creations_by_lesson(&env.journal);
    assert!(created.values().all(|n| *n == 1), "{created:?}");
    assert_eq!(created.len(), 3, "{created:?}");
    assert!(
        !state.path().join(format!("{}.json", failed.id)).exists(),
        "{} still on the agent",
        failed.id
    );
    let events = events(&env, &failed.id).await;
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("warm pool member failed")),
        "{events:?}"
    );
}
