//! Warm pools: the real scheduler keeps lessons READY on the real test agent; requests claim
//! them through the public API; operators size pools through AdminService and antidotectl.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::web::Web;
use antidote_tests::{ADMIN_TOKEN, Scheduler, fetch, presentation, workspace_bin};
use api::LiveLessonStatus as S;

use crate::{Env, Knobs, PATIENCE};

/// How often the tests look at the admin API while waiting for a pool to settle.
const POLL: Duration = Duration::from_millis(100);

/// A scheduler configuration with pools looked at often.
fn pools_config(pools: &str) -> String {
    format!("[pools]\ninterval = \"200ms\"\n{pools}")
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
async fn members(env: &Env, lesson: &str, owned: &HashSet<String>) -> Vec<api::LiveLesson> {
    env.scheduler
        .clients
        .admin
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

/// The live lesson ids the agent created objects for, with how many times.
fn creations(env: &Env) -> HashMap<String, usize> {
    let mut created = HashMap::new();
    for line in std::fs::read_to_string(&env.journal)
        .unwrap_or_default()
        .lines()
    {
        let mut words = line.split(' ');
        if words.next() == Some("create") {
            *created
                .entry(words.next().unwrap_or_default().to_owned())
                .or_default() += 1;
        }
    }
    created
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
            extra_config: pools_config(
                "[[pools.lessons]]\nlesson = \"routing-basics\"\nsize = 3\n",
            ),
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
    let waiting: HashSet<String> = members(&env, "routing-basics", &HashSet::new())
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
    let refilled: HashSet<String> = members(&env, "routing-basics", &ids)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(refilled.len(), 3);
    assert!(refilled.is_disjoint(&ids), "no member was given twice");
    let counted = pool(&env, "routing-basics", 0).await.unwrap();
    assert_eq!((counted.hits, counted.misses), (3, 7));
    // Nothing was created twice on the agent.
    let created = creations(&env);
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
        members(&env, "routing-basics", &ids)
            .await
            .into_iter()
            .map(|l| l.id)
            .collect::<HashSet<_>>(),
        refilled
    );

    // /metrics has the same.
    let metrics = Web::default()
        .get(&format!(
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
            extra_config: pools_config(
                "[[pools.lessons]]\nlesson = \"hello-web\"\nsize = 1\n\
                 [[pools.lessons]]\nlesson = \"routing-basics\"\nsize = 3\n",
            ),
            ..Knobs::default()
        },
    )
    .await;
    let c = &env.scheduler.clients;

    // A member that FAILs is removed and another takes its place (and fails too, here).
    let no_one = HashSet::new();
    let first = loop {
        if let Some(member) = members(&env, "hello-web", &no_one).await.pop() {
            break member.id;
        }
        tokio::time::sleep(POLL).await;
    };
    let start = tokio::time::Instant::now();
    loop {
        let now = members(&env, "hello-web", &no_one).await;
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
    while members(&env, "routing-basics", &mine_only).await.len() != 1 {
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
    let mut env = Env::start(
        &["--boot-delay", "2s", "--configure-delay", "300ms"],
        Knobs {
            extra_config: pools_config(
                "[[pools.lessons]]\nlesson = \"routing-basics\"\nsize = 2\n",
            ),
            ..Knobs::default()
        },
    )
    .await;
    until_pool(&env, "routing-basics", 0, "had 2 READY", |p| p.ready == 2).await;
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
            size: 4,
            windows: Vec::new(),
        })
        .await
        .unwrap();
    let owned = HashSet::from([mine.id.clone()]);
    let start = tokio::time::Instant::now();
    let before = loop {
        let now = members(&env, "routing-basics", &owned).await;
        let booting = now
            .iter()
            .filter(|l| matches!(l.status(), S::Pending | S::Booting))
            .count();
        if now.len() == 4 && booting >= 2 {
            break now;
        }
        assert!(start.elapsed() < PATIENCE, "no members booting: {now:?}");
        tokio::time::sleep(POLL).await;
    };
    let ready = before.iter().find(|l| l.status() == S::Ready).unwrap();
    c.admin
        .clone()
        .kill_live_lesson(api::KillLiveLessonRequest {
            id: ready.id.clone(),
        })
        .await
        .unwrap();
    let statuses: Vec<_> = members(&env, "routing-basics", &owned)
        .await
        .iter()
        .map(|l| l.status())
        .collect();
    env.scheduler.process.kill9().await;

    env.scheduler = Scheduler::start(env.dir.path(), &env.config).await.unwrap();
    let c = env.scheduler.clients.clone();
    let settled = until_pool(&env, "routing-basics", 0, "came back to 4 READY", |p| {
        p.ready == 4 && p.starting == 0 && p.removing == 0
    })
    .await;
    assert_eq!(settled.target, 4);
    let after: HashSet<String> = members(&env, "routing-basics", &owned)
        .await
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(after.len(), 4, "{statuses:?} before the kill");
    // Every member alive before the kill is still one (none lost) and only the killed one
    // was replaced (none doubled).
    for member in before.iter().filter(|l| l.id != ready.id) {
        assert!(after.contains(&member.id), "{} lost", member.id);
    }
    assert!(!after.contains(&ready.id));
    let created = creations(&env);
    assert!(created.values().all(|n| *n == 1), "{created:?}");
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
    let pools = format!(
        "[[pools.lessons]]\nlesson = \"routing-basics\"\nsize = 0\n\
         windows = [{{ from = \"{}\", to = \"{}\", size = 2 }}]\n\
         [[pools.lessons]]\nlesson = \"hello-web\"\nsize = 1\n\
         windows = [{{ from = \"{}\", to = \"{}\", size = 4 }}]\n",
        at(-60),
        at(60),
        at(120),
        at(180)
    );
    let env = Env::start(
        &[],
        Knobs {
            extra_config: pools_config(&pools),
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
