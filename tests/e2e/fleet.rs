//! A fleet of agents: labels reported in handshakes and added by the
//! operators' configuration, requests and lessons that require or prefer labels, the decision
//! and its reason recorded for operators, FAILED_PRECONDITION at once when no agent could ever
//! take a lesson; an agent killed with `kill -9` is lost after its grace period and its live
//! lessons come back READY elsewhere (what it still holds is removed when it returns); a drained
//! agent takes no new live lesson and keeps its own, across a scheduler restart, until resumed.
//! Test agents throughout, and agent-docker in one fleet.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, ms, secs};
use antidote_tests::{Process, Scheduler, web::Web, with_token, workspace_bin};
use api::LiveLessonStatus as S;
use tempfile::TempDir;
use tonic::Code;
use tonic_types::StatusExt as _;

use crate::{PATIENCE, start_agent_with_env};

/// The fleet lessons: `anywhere`, `eu-only` (requires region=eu), `gpu-only` (requires gpu=yes,
/// which no agent has), `ansible-configured` and `napalm-configured` (an endpoint configured
/// by that type).
fn curriculum() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/fleet-curriculum")
        .canonicalize()
        .expect("tests/fixtures/fleet-curriculum exists")
}

/// One agent of a fleet: its name in the scheduler's configuration, the labels the
/// configuration adds, and its process.
struct Member {
    name: &'static str,
    /// The labels the configuration gives it.
    configured: &'static [(&'static str, &'static str)],
    process: Process,
    /// The test agent's arguments (to start it again on the same address).
    args: Vec<String>,
}

/// A scheduler driving several agents, in a temporary directory.
struct FleetEnv {
    dir: TempDir,
    members: Vec<Member>,
    scheduler: Scheduler,
    config: String,
}

/// Starts a test agent with `args` (labels among them).
async fn test_agent(dir: &TempDir, name: &str, args: &[String]) -> Process {
    let journal = dir.path().join(format!("{name}.journal"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    start_agent_with_env(dir, &args, &journal, None, &[]).await
}

impl FleetEnv {
    /// Starts the scheduler in front of `members` (already running) with `agent_grace`.
    async fn start(dir: TempDir, members: Vec<Member>, agent_grace: Duration) -> FleetEnv {
        let instance = format!("fleet-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let config = SchedulerConfig::new(&instance, &curriculum())
            .with_sessions_per_ip(0)
            .with_lessons_per_session(10)
            .with_reaper(ms(200), ms(300), secs(1))
            .with_retries(ms(500), ms(50), secs(1))
            .with_provision_timeout(secs(120))
            .with_reconciler(|r| r.agent_grace = Some(agent_grace));
        let config = members
            .iter()
            .fold(config, |config, member| {
                config.with_agent(
                    Agent::new(member.name, member.process.url())
                        .with_labels(member.configured.iter().copied()),
                )
            })
            .to_toml();
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        let env = FleetEnv {
            dir,
            members,
            scheduler,
            config,
        };
        env.until_agents(|agents| agents.iter().all(|a| a.state() == api::AgentState::Ready))
            .await;
        env
    }

    fn logs(&self) -> String {
        let mut text = format!("--- scheduler ---\n{}\n", self.scheduler.process.log_text());
        for member in &self.members {
            text.push_str(&format!(
                "--- {} ---\n{}\n",
                member.name,
                member.process.log_text()
            ));
        }
        text
    }

    fn member(&mut self, name: &str) -> &mut Member {
        self.members
            .iter_mut()
            .find(|m| m.name == name)
            .expect("a member of the fleet")
    }

    async fn agents(&self) -> Vec<api::Agent> {
        self.scheduler
            .clients
            .agents()
            .await
            .expect("ListAgents answers")
    }

    /// Waits until ListAgents satisfies `until`.
    async fn until_agents(&self, until: impl Fn(&[api::Agent]) -> bool) -> Vec<api::Agent> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let agents = self.agents().await;
            if until(&agents) {
                return agents;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "agents never reached the condition: {agents:#?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A new session, then `lesson` requested in it with `placement`; READY.
    async fn ready(
        &self,
        lesson: &str,
        placement: Option<api::PlacementPreference>,
    ) -> api::LiveLesson {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        let live = c
            .request_placed(&session, lesson, 0, placement)
            .await
            .unwrap_or_else(|status| panic!("{status:?}\n{}", self.logs()));
        let ready = c
            .ready(&live.id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()));
        // Learners never see the backend: the agent's name is in the operators' view only,
        // which the tests below read.
        assert_eq!(ready.agent, "", "a learner's answer names no agent");
        self.admin_view(&ready.id)
            .await
            .live_lesson
            .expect("the admin view has the live lesson")
    }

    /// A request that must be refused: its status.
    async fn refused(
        &self,
        lesson: &str,
        placement: Option<api::PlacementPreference>,
    ) -> tonic::Status {
        let c = &self.scheduler.clients;
        let session = c.session().await.unwrap();
        c.request_placed(&session, lesson, 0, placement)
            .await
            .expect_err("the request is refused")
    }

    /// The operators' view of a live lesson, with its placement.
    async fn admin_view(&self, id: &str) -> api::AdminLiveLesson {
        self.scheduler
            .clients
            .admin
            .clone()
            .get_live_lesson(api::AdminGetLiveLessonRequest { id: id.into() })
            .await
            .expect("GetLiveLesson answers")
            .into_inner()
    }

    async fn events(&self, id: &str) -> Vec<api::Event> {
        self.scheduler
            .clients
            .admin
            .clone()
            .list_events(api::ListEventsRequest {
                live_lesson_id: id.into(),
            })
            .await
            .expect("ListEvents answers")
            .into_inner()
            .events
    }
}

fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn requires(pairs: &[(&str, &str)]) -> Option<api::PlacementPreference> {
    Some(api::PlacementPreference {
        requires: labels(pairs),
        prefers: HashMap::new(),
    })
}

fn prefers(pairs: &[(&str, &str)]) -> Option<api::PlacementPreference> {
    Some(api::PlacementPreference {
        requires: HashMap::new(),
        prefers: labels(pairs),
    })
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| (*a).to_owned()).collect()
}

/// The reason a placement gives for not choosing `agent`.
fn excluded<'a>(placement: &'a api::Placement, agent: &str) -> &'a str {
    placement
        .excluded
        .iter()
        .find(|e| e.agent == agent)
        .map(|e| e.reason.as_str())
        .unwrap_or_else(|| panic!("`{agent}` is not among {placement:#?}"))
}

/// The typed reason and metadata of a refusal.
fn error_info(status: &tonic::Status) -> (String, HashMap<String, String>) {
    let info = status
        .get_details_error_info()
        .expect("the refusal carries an ErrorInfo");
    (info.reason, info.metadata)
}

/// The live lessons an agent holds for this test's scheduler, straight from the agent.
async fn held(agent: &Process, instance: &str) -> Vec<String> {
    let mut client = agent::backend_client::BackendClient::connect(agent.url())
        .await
        .expect("the agent answers");
    client
        .list(agent::ListRequest {
            label_selector: labels(&[("antidote.io/instance", instance)]),
            page_size: 500,
            page_token: String::new(),
        })
        .await
        .expect("List answers")
        .into_inner()
        .items
        .into_iter()
        .map(|state| state.live_lesson_id)
        .collect()
}

fn instance(config: &str) -> String {
    config
        .lines()
        .find_map(|line| line.strip_prefix("instance_id = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("the configuration names an instance id")
        .to_owned()
}

#[tokio::test]
async fn placement_follows_required_and_preferred_labels_and_explains_itself() {
    let dir = tempfile::tempdir().unwrap();
    let eu_a = test_agent(&dir, "eu-a", &args(&["--label", "region=eu"])).await;
    let us = test_agent(&dir, "us", &args(&["--label", "region=us"])).await;
    // The handshake says disk=hdd; the operators' configuration says ssd, and wins.
    let eu_b = test_agent(
        &dir,
        "eu-b",
        &args(&["--label", "region=eu", "--label", "disk=hdd"]),
    )
    .await;
    let members = vec![
        Member {
            name: "eu-a",
            configured: &[],
            process: eu_a,
            args: vec![],
        },
        Member {
            name: "us",
            configured: &[("tier", "gold")],
            process: us,
            args: vec![],
        },
        Member {
            name: "eu-b",
            configured: &[("disk", "ssd")],
            process: eu_b,
            args: vec![],
        },
    ];
    let env = FleetEnv::start(dir, members, secs(60)).await;

    // Operators see the labels placement matches: the handshake's with the configuration's.
    let agents = env.agents().await;
    let by_name = |name: &str| agents.iter().find(|a| a.name == name).unwrap().clone();
    assert_eq!(
        by_name("eu-b").labels,
        labels(&[("region", "eu"), ("disk", "ssd")])
    );
    assert_eq!(
        by_name("us").labels,
        labels(&[("region", "us"), ("tier", "gold")])
    );

    // The lesson requires region=eu, the request prefers disk=ssd: eu-b.
    let live = env
        .ready(
            "eu-only",
            Some(api::PlacementPreference {
                requires: HashMap::new(),
                prefers: labels(&[("disk", "ssd")]),
            }),
        )
        .await;
    assert_eq!(live.agent, "eu-b");
    let view = env.admin_view(&live.id).await;
    assert_eq!(
        view.live_lesson.as_ref().map(|l| l.id.as_str()),
        Some(live.id.as_str())
    );
    let placement = view.placement.expect("a placement is recorded");
    assert_eq!(placement.agent, "eu-b");
    assert_eq!(placement.requires, labels(&[("region", "eu")]));
    assert_eq!(placement.prefers, labels(&[("disk", "ssd")]));
    assert_eq!(placement.matched, labels(&[("disk", "ssd")]));
    assert!(placement.decided_at.is_some());
    assert!(
        placement.reason.starts_with("chose `eu-b`"),
        "{placement:#?}"
    );
    assert_eq!(
        excluded(&placement, "us"),
        "missing label region=eu (has region=us)"
    );
    assert!(
        excluded(&placement, "eu-a").starts_with("ranked lower"),
        "{placement:#?}"
    );
    // The same answer through the JSON API of the admin listener.
    let admin_http = env
        .scheduler
        .process
        .extra_url("admin http")
        .expect("the admin HTTP listener is up");
    let answer = Web::default()
        .send(
            hyper::Method::GET,
            &format!("{admin_http}/v1/admin/live-lessons/{}", live.id),
            &[(
                "authorization",
                &format!("Bearer {}", antidote_tests::ADMIN_TOKEN),
            )],
            None,
        )
        .await
        .unwrap();
    assert_eq!(answer.status, hyper::StatusCode::OK, "{}", answer.body);
    assert_eq!(answer.json().unwrap()["placement"]["agent"], "eu-b");

    // A request requiring region=us: the one agent there.
    let live = env.ready("anywhere", requires(&[("region", "us")])).await;
    assert_eq!(live.agent, "us");
    // A label only the configuration gives.
    let live = env.ready("anywhere", requires(&[("tier", "gold")])).await;
    assert_eq!(live.agent, "us");
    let placement = env.admin_view(&live.id).await.placement.unwrap();
    assert_eq!(excluded(&placement, "eu-a"), "missing label tier=gold");

    // Nothing any agent could ever take: refused at once, naming what is missing.
    let status = env.refused("gpu-only", None).await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("gpu=yes"), "{status:?}");
    let (reason, metadata) = error_info(&status);
    assert_eq!(reason, "PLACEMENT_IMPOSSIBLE");
    assert_eq!(metadata["lesson"], "gpu-only");
    assert_eq!(metadata["missing"], "label gpu=yes");
    let status = env
        .refused("anywhere", requires(&[("region", "mars")]))
        .await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("region=mars"), "{status:?}");
    // A request contradicting the lesson's own requirement can never be met either.
    let status = env.refused("eu-only", requires(&[("region", "us")])).await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("region=us"), "{status:?}");
}

#[tokio::test]
async fn only_agents_claiming_a_configuration_type_get_lessons_using_it() {
    let dir = tempfile::tempdir().unwrap();
    // First in configuration order, so it wins every tie it is eligible for.
    let shell = test_agent(&dir, "shell", &args(&["--configuration-types", "shell"])).await;
    let ansible = test_agent(
        &dir,
        "ansible",
        &args(&["--configuration-types", "shell,ansible"]),
    )
    .await;
    let members = vec![
        Member {
            name: "shell",
            configured: &[],
            process: shell,
            args: vec![],
        },
        Member {
            name: "ansible",
            configured: &[],
            process: ansible,
            args: vec![],
        },
    ];
    let env = FleetEnv::start(dir, members, secs(60)).await;
    let agents = env.agents().await;
    let offers = |name: &str| {
        agents
            .iter()
            .find(|a| a.name == name)
            .unwrap()
            .capabilities
            .clone()
    };
    assert!(!offers("shell").contains(&"configuration.ansible".to_owned()));
    assert!(offers("ansible").contains(&"configuration.ansible".to_owned()));

    // Every ansible lesson goes to the agent claiming ansible, however loaded it gets.
    for _ in 0..3 {
        let live = env.ready("ansible-configured", None).await;
        assert_eq!(live.agent, "ansible");
        let placement = env.admin_view(&live.id).await.placement.unwrap();
        assert_eq!(
            excluded(&placement, "shell"),
            "lacks capability configuration.ansible"
        );
    }
    // The other agent is eligible for the rest, and less loaded now.
    let live = env.ready("anywhere", None).await;
    assert_eq!(live.agent, "shell");
    let shell = &env.members.iter().find(|m| m.name == "shell").unwrap();
    assert!(
        held(&shell.process, &instance(&env.config))
            .await
            .contains(&live.id)
    );

    // A type no agent claims: refused at once, naming it.
    let status = env.refused("napalm-configured", None).await;
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("configuration.napalm"),
        "{status:?}"
    );
    let (reason, metadata) = error_info(&status);
    assert_eq!(reason, "PLACEMENT_IMPOSSIBLE");
    assert_eq!(metadata["lesson"], "napalm-configured");
    assert_eq!(metadata["missing"], "capability configuration.napalm");
}

#[tokio::test]
async fn a_lost_agents_lessons_come_back_ready_elsewhere_and_its_leftovers_go() {
    let dir = tempfile::tempdir().unwrap();
    let mut members = Vec::new();
    for (name, extra) in [
        ("a", &["--label", "pin=a", "--label", "solo=yes"][..]),
        ("b", &[][..]),
        ("c", &[][..]),
    ] {
        // Objects outlive the process (records in a state dir), as a real backend's do: what
        // the agent still holds after its restart is what must be removed.
        let state = dir.path().join(format!("{name}-state"));
        let mut list = args(extra);
        list.extend(args(&["--state-dir", &state.display().to_string()]));
        let process = test_agent(&dir, name, &list).await;
        members.push(Member {
            name,
            configured: &[],
            process,
            args: list,
        });
    }
    // The grace outlasts a quick restart of `a` below (it must not be lost then), and is
    // still short enough for the loss after its kill -9.
    let mut env = FleetEnv::start(dir, members, secs(8)).await;
    let instance = instance(&env.config);
    let c = env.scheduler.clients.clone();

    // Three live lessons prefer `a`; one requires a label only `a` carries.
    let mut moving = Vec::new();
    for _ in 0..3 {
        let live = env.ready("anywhere", prefers(&[("pin", "a")])).await;
        assert_eq!(live.agent, "a");
        moving.push(live);
    }
    let solo = env.ready("anywhere", requires(&[("solo", "yes")])).await;
    assert_eq!(solo.agent, "a");
    // One moved on to stage 1: it must come back at stage 1, not at its first stage.
    let staged = env.ready("two-stages", prefers(&[("pin", "a")])).await;
    assert_eq!(staged.agent, "a");
    c.lessons
        .clone()
        .set_stage(with_token(
            api::SetStageRequest {
                id: staged.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&staged.id),
        ))
        .await
        .unwrap();
    let (_, staged) = c
        .follow(&staged.id, PATIENCE, |l| {
            l.stage == 1 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(staged.status(), S::Ready, "{staged:?}");
    let staged = env.admin_view(&staged.id).await.live_lesson.unwrap();
    let mut on_a = held(&env.member("a").process, &instance).await;
    on_a.sort();
    assert_eq!(on_a.len(), 5, "{on_a:?}");

    // `a` restarts (its objects kept in its state dir, adopted by Recover) with every new
    // live lesson held in BOOTING: one is still booting there when `a` is lost.
    let addr = env.member("a").process.addr;
    let before = env
        .agents()
        .await
        .into_iter()
        .find(|a| a.name == "a")
        .unwrap()
        .instance_id;
    env.member("a").process.kill9().await;
    let journal = env.dir.path().join("a.journal");
    let mut slow = env.member("a").args.clone();
    slow.extend(args(&["--boot-delay", "3600s"]));
    let slow: Vec<&str> = slow.iter().map(String::as_str).collect();
    env.member("a").process =
        start_agent_with_env(&env.dir, &slow, &journal, Some(addr), &[]).await;
    env.until_agents(|agents| {
        agents.iter().any(|a| {
            a.name == "a" && a.state() == api::AgentState::Ready && a.instance_id != before
        })
    })
    .await;
    for live in moving.iter().chain([&solo, &staged]) {
        let (_, now) = c
            .follow(&live.id, PATIENCE, |l| l.status() == S::Ready)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
        assert_eq!(now.generation, live.generation, "not moved: {now:?}");
    }
    let session = c.session().await.unwrap();
    let booting = c
        .request_placed(&session, "anywhere", 0, prefers(&[("pin", "a")]))
        .await
        .unwrap();
    let (_, booting) = c
        .follow(&booting.id, PATIENCE, |l| l.status() == S::Booting)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(
        env.admin_view(&booting.id).await.live_lesson.unwrap().agent,
        "a"
    );
    // The scheduler marks it BOOTING before its Provision call: wait until `a` has taken it
    // (it lists it), so that the kill below finds it booting there, not in flight.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !held(&env.member("a").process, &instance)
        .await
        .contains(&booting.id)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "`a` never took {}\n{}",
            booting.id,
            env.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    env.member("a").process.kill9().await;

    // After the grace period the agent is LOST...
    env.until_agents(|agents| {
        agents
            .iter()
            .any(|a| a.name == "a" && a.state() == api::AgentState::Lost)
    })
    .await;
    // ...and its live lessons are READY on the others, with the move in their events: the
    // READY ones, the one at stage 1 and the one still booting there.
    for live in moving.iter().chain([&staged, &booting]) {
        // Moved: READY again in a later generation (on another agent, which only the
        // operators' view names).
        c.follow(&live.id, PATIENCE, |l| {
            l.status() == S::Ready && l.generation > live.generation
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
        let after = env.admin_view(&live.id).await.live_lesson.unwrap();
        assert!(["b", "c"].contains(&after.agent.as_str()), "{after:?}");
        assert_eq!(
            (after.stage, after.id.as_str()),
            (live.stage, live.id.as_str())
        );
        let events = env.events(&live.id).await;
        let details: Vec<&str> = events.iter().map(|e| e.detail.as_str()).collect();
        assert!(
            details
                .iter()
                .any(|d| d.starts_with("agent `a` lost") && d.ends_with("moving to another agent")),
            "{details:#?}"
        );
        let moved = format!("agent `a` lost; moved to `{}`", after.agent);
        assert!(details.contains(&moved.as_str()), "{details:#?}");
        let placement = env.admin_view(&live.id).await.placement.unwrap();
        assert_eq!(placement.agent, after.agent);
        assert_eq!(excluded(&placement, "a"), "lost");
    }
    // Stage 1 where it went: its page says so.
    let after = env.admin_view(&staged.id).await.live_lesson.unwrap();
    let page = antidote_tests::fetch(antidote_tests::presentation(&after, "web", "page")).await;
    assert!(page.contains("two-stages web stage 1"), "{page}");
    // Each moved live lesson was created once where it went, at its new generation.
    let mut creates = Vec::new();
    for name in ["b", "c"] {
        let journal = env.dir.path().join(format!("{name}.journal"));
        creates.extend(antidote_tests::journal::created(&journal));
    }
    for live in moving.iter().chain([&staged, &booting]) {
        let mine: Vec<&String> = creates.iter().filter(|id| **id == live.id).collect();
        assert_eq!(mine.len(), 1, "{}: {creates:#?}", live.id);
    }

    // The one nothing else can take FAILED, saying why.
    let (_, failed) = c
        .follow(&solo.id, PATIENCE, |l| l.status() == S::Failed)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert!(
        failed.failure_reason.starts_with("agent `a` lost")
            && failed.failure_reason.contains("solo=yes"),
        "{failed:?}"
    );

    // The agent comes back on its address with what it held; all of it was moved or failed,
    // so all of it is removed (orphans judged per agent and live lesson). The booting one had
    // no objects yet.
    let list = env.member("a").args.clone();
    let list: Vec<&str> = list.iter().map(String::as_str).collect();
    let process = start_agent_with_env(&env.dir, &list, &journal, Some(addr), &[]).await;
    env.member("a").process = process;
    assert_eq!(
        held(&env.member("a").process, &instance).await.len(),
        5,
        "the restarted agent still holds what it had"
    );
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let left = held(&env.member("a").process, &instance).await;
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "`a` still holds {left:?}\n{}",
            env.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.until_agents(|agents| {
        agents
            .iter()
            .any(|a| a.name == "a" && a.state() == api::AgentState::Ready)
    })
    .await;
    // The moved live lessons were not disturbed: still READY where they went.
    for live in moving.iter().chain([&staged, &booting]) {
        let now = env.admin_view(&live.id).await.live_lesson.unwrap();
        assert_eq!(now.status(), S::Ready, "{now:?}");
        let holder = env
            .members
            .iter()
            .find(|m| m.name == now.agent)
            .expect("placed on a member of the fleet");
        assert!(
            held(&holder.process, &instance).await.contains(&live.id),
            "{} holds {}",
            holder.name,
            live.id
        );
    }
}

/// A live lesson whose only fitting agent is full waits PENDING and is placed once room is
/// made; it never FAILs for it (only its deadline could do that).
#[tokio::test]
async fn a_lesson_whose_agents_are_full_stays_pending_until_room_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let small = test_agent(&dir, "small", &args(&["--max-live-lessons", "1"])).await;
    let members = vec![Member {
        name: "small",
        configured: &[],
        process: small,
        args: vec![],
    }];
    let env = FleetEnv::start(dir, members, secs(60)).await;
    let c = env.scheduler.clients.clone();
    let first = env.ready("anywhere", None).await;
    assert_eq!(first.agent, "small");

    let session = c.session().await.unwrap();
    let waiting = c
        .request_placed(&session, "anywhere", 0, None)
        .await
        .expect("a full agent is no reason to refuse");
    // It waits unplaced: PENDING, on no agent, no placement decided, the agent full, and
    // operators see why (learners do not: it names the agent).
    let view = tokio::time::timeout(PATIENCE, async {
        loop {
            let view = env.admin_view(&waiting.id).await;
            // "requested" until the reconciler has tried to place it.
            if view.status_reason.contains("no agent can take") {
                return view;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the operators' view says why it waits");
    let live = view.live_lesson.as_ref().unwrap();
    assert_eq!(
        (live.status(), live.agent.as_str()),
        (S::Pending, ""),
        "{view:?}"
    );
    assert!(view.placement.is_none(), "{view:?}");
    assert!(
        view.status_reason.contains("`small`") && view.status_reason.contains("full 1/1"),
        "{view:?}"
    );
    let learner = c.get(&waiting.id).await.unwrap();
    assert!(learner.failure_reason.is_empty(), "{learner:?}");
    let agents = env.agents().await;
    assert!(
        agents
            .iter()
            .any(|a| a.name == "small" && a.live_lessons == 1 && a.max_live_lessons == 1),
        "{agents:#?}"
    );

    // Room made: it is placed there and READY, never FAILED on the way.
    c.delete(&first.id, PATIENCE)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let (seen, ready) = c
        .follow(&waiting.id, PATIENCE, |l| {
            matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    assert_eq!(ready.status(), S::Ready, "{ready:?}\n{}", env.logs());
    assert!(!seen.contains(&S::Failed), "{seen:?}");
    assert_eq!(c.agent_of(&waiting.id).await.unwrap(), "small");
}

#[tokio::test]
async fn a_drained_agent_takes_nothing_new_keeps_its_own_and_stays_drained_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let a = test_agent(&dir, "a", &args(&["--label", "pin=a"])).await;
    let b = test_agent(&dir, "b", &[]).await;
    let members = vec![
        Member {
            name: "a",
            configured: &[],
            process: a,
            args: vec![],
        },
        Member {
            name: "b",
            configured: &[],
            process: b,
            args: vec![],
        },
    ];
    let mut env = FleetEnv::start(dir, members, secs(60)).await;
    let kept = env.ready("anywhere", prefers(&[("pin", "a")])).await;
    assert_eq!(kept.agent, "a");

    let drained = env
        .scheduler
        .clients
        .admin
        .clone()
        .drain_agent(api::DrainAgentRequest { name: "a".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(drained.drained && drained.name == "a", "{drained:?}");
    // Unknown agents are NOT_FOUND; a read-only token may not drain.
    let status = env
        .scheduler
        .clients
        .admin
        .clone()
        .drain_agent(api::DrainAgentRequest {
            name: "ghost".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(error_info(&status).0, "AGENT_NOT_FOUND");
    let status = env
        .scheduler
        .clients
        .admin
        .clone()
        .drain_agent(with_token(
            api::DrainAgentRequest { name: "a".into() },
            Some(antidote_tests::ADMIN_READ_TOKEN.into()),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    // New live lessons go elsewhere, even those preferring it; the one it holds stays.
    let elsewhere = env.ready("anywhere", prefers(&[("pin", "a")])).await;
    assert_eq!(elsewhere.agent, "b");
    let placement = env.admin_view(&elsewhere.id).await.placement.unwrap();
    assert_eq!(excluded(&placement, "a"), "drained");
    let still = env.admin_view(&kept.id).await.live_lesson.unwrap();
    assert_eq!((still.status(), still.agent.as_str()), (S::Ready, "a"));

    // The drain is kept in the store: a restarted scheduler still honours it.
    env.scheduler.process.terminate().await.unwrap();
    let tokens = env.scheduler.clients.tokens.clone();
    env.scheduler = Scheduler::start(env.dir.path(), &env.config)
        .await
        .expect("scheduler restarts");
    env.scheduler.clients.tokens = tokens;
    let agents = env
        .until_agents(|agents| agents.iter().all(|a| a.state() == api::AgentState::Ready))
        .await;
    assert!(
        agents.iter().any(|a| a.name == "a" && a.drained),
        "{agents:#?}"
    );
    let again = env.ready("anywhere", prefers(&[("pin", "a")])).await;
    assert_eq!(again.agent, "b");

    // Resumed, it takes live lessons again.
    // This time through the admin listener's JSON routes: drain again, then resume.
    let admin_http = env
        .scheduler
        .process
        .extra_url("admin http")
        .expect("the admin HTTP listener is up");
    let bearer = format!("Bearer {}", antidote_tests::ADMIN_TOKEN);
    for (action, drained) in [("drain", true), ("resume", false)] {
        let answer = Web::default()
            .send(
                hyper::Method::POST,
                &format!("{admin_http}/v1/admin/agents/a/{action}"),
                &[
                    ("authorization", &bearer),
                    ("content-type", "application/json"),
                ],
                None,
            )
            .await
            .unwrap();
        assert_eq!(answer.status, hyper::StatusCode::OK, "{}", answer.body);
        let json = answer.json().unwrap();
        assert_eq!(
            (json["name"].as_str(), json["drained"].as_bool()),
            (Some("a"), Some(drained)),
            "{json}"
        );
    }
    let answer = Web::default()
        .send(
            hyper::Method::POST,
            &format!("{admin_http}/v1/admin/agents/ghost/drain"),
            &[
                ("authorization", &bearer),
                ("content-type", "application/json"),
            ],
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        answer.status,
        hyper::StatusCode::NOT_FOUND,
        "{}",
        answer.body
    );
    let agents = env.agents().await;
    assert!(
        agents.iter().any(|a| a.name == "a" && !a.drained),
        "{agents:#?}"
    );
    let back = env.ready("anywhere", prefers(&[("pin", "a")])).await;
    assert_eq!(back.agent, "a");

    // Both were audited with the caller's identity.
    let audit = env
        .scheduler
        .clients
        .admin
        .clone()
        .list_audit(api::ListAuditRequest { limit: 100 })
        .await
        .unwrap()
        .into_inner()
        .entries;
    for action in ["AdminService.DrainAgent", "AdminService.ResumeAgent"] {
        assert!(
            audit.iter().any(|e| e.action == action
                && e.target == "a"
                && e.identity == "token:tests"
                && e.outcome == "ok"),
            "{action} missing from {audit:#?}"
        );
    }
}

/// agent-docker in a fleet of test agents: the operators' configuration gives it labels (it
/// reports none of its own), and a live lesson requiring them runs in Docker, READY, then goes.
#[tokio::test]
async fn agent_docker_in_the_fleet_takes_what_its_labels_ask() {
    let docker_host = std::env::var("DOCKER_HOST").expect(
        "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
    );
    let dir = tempfile::tempdir().unwrap();
    let docker = Process::spawn_with_env(
        &workspace_bin("agent-docker"),
        &args(&["--listen", "127.0.0.1:0", "--probe-timeout", "30s"]),
        &[("DOCKER_HOST", docker_host)],
        dir.path().join("agent-docker.log"),
    )
    .await
    .expect("agent-docker starts");
    let eu = test_agent(&dir, "eu", &args(&["--label", "region=eu"])).await;
    let us = test_agent(&dir, "us", &args(&["--label", "region=us"])).await;
    let members = vec![
        Member {
            name: "eu",
            configured: &[],
            process: eu,
            args: vec![],
        },
        Member {
            name: "us",
            configured: &[],
            process: us,
            args: vec![],
        },
        Member {
            name: "docker",
            configured: &[("region", "eu"), ("backend", "docker")],
            process: docker,
            args: vec![],
        },
    ];
    let env = FleetEnv::start(dir, members, secs(60)).await;
    let instance = instance(&env.config);

    let live = env
        .ready("eu-only", requires(&[("backend", "docker")]))
        .await;
    assert_eq!(live.agent, "docker");
    let placement = env.admin_view(&live.id).await.placement.unwrap();
    assert_eq!(
        placement.requires,
        labels(&[("region", "eu"), ("backend", "docker")])
    );
    assert_eq!(excluded(&placement, "eu"), "missing label backend=docker");
    assert_eq!(
        excluded(&placement, "us"),
        "missing label backend=docker, missing label region=eu (has region=us)"
    );
    let page = antidote_tests::fetch(antidote_tests::presentation(&live, "web", "page")).await;
    assert!(page.contains("200 OK"), "{page}");
    // Without the requirement, the least loaded agent in the EU: an idle test agent.
    let other = env.ready("eu-only", None).await;
    assert_eq!(other.agent, "eu");

    env.scheduler
        .clients
        .delete(&live.id, PATIENCE)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let docker = &env.members[2].process;
    assert!(held(docker, &instance).await.is_empty());
}
