//! Dial-in: test agents with no listening socket dial the scheduler's agent intake over mutual
//! TLS (certificates made here with rcgen), and the scheduler drives them over the connections
//! they opened: a lesson end to end, kill -9 of the scheduler (the agent dials in again, its
//! lessons stay READY and are still driven) and of the agent (Recover on its new instance:
//! provisioned again when its objects died with it, adopted when its state dir kept them),
//! refusals (another CA, a name not admitted, the name of a dialled agent), two agents whose
//! handshake labels steer placement, the conformance suite over the flipped transport, and one
//! agent dialling in to two scheduler replicas on PostgreSQL (`--connect` twice), used by both
//! and surviving kill -9 of one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, Intake, SchedulerConfig, ms, secs};
use antidote_tests::journal::{adopted, created};
use antidote_tests::pki::{Ca, Validity};
use antidote_tests::{Process, Restartable, Scheduler, example_curriculum, fetch, presentation};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::PATIENCE;
use crate::postgres::{TestDatabase, start_on};

/// Certificates of one test: a CA signing the scheduler's intake certificate (for 127.0.0.1)
/// and the agents' client certificates, and a rogue CA nobody trusts.
struct Pki {
    dir: PathBuf,
    ca: Ca,
    rogue: Ca,
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let pki = Pki {
            dir: dir.join("pki"),
            ca: Ca::new("antidote test CA"),
            rogue: Ca::new("rogue CA"),
        };
        std::fs::create_dir_all(&pki.dir).unwrap();
        pki.ca.write(&pki.path("ca.pem"));
        let intake = pki.ca.issue(&["127.0.0.1"], Validity::Until(2080, 1, 1));
        intake.write(&pki.path("intake.pem"), &pki.path("intake.key"));
        pki
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// A client certificate for `name` signed by the trusted CA (or the rogue one); returns
    /// its files and SHA-256.
    fn agent(&self, name: &str, rogue: bool) -> (PathBuf, PathBuf, String) {
        let ca = if rogue { &self.rogue } else { &self.ca };
        let leaf = ca.issue(&[name], Validity::Until(2080, 1, 1));
        let file = name.replace(['/', ':'], "_");
        let (cert, key) = (
            self.path(&format!("{file}.pem")),
            self.path(&format!("{file}.key")),
        );
        leaf.write(&cert, &key);
        (cert, key, leaf.sha256())
    }

    /// The scheduler's `[agent_intake]` on `port` (0: a port that stays free while the
    /// scheduler restarts, [`antidote_tests::port_to_keep`]).
    fn intake_config(&self, port: u16, allow: &[&str], agents: &[&str]) -> Intake {
        let port = if port == 0 {
            antidote_tests::port_to_keep()
        } else {
            port
        };
        let names = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        Intake {
            listen: format!("127.0.0.1:{port}"),
            cert: self.path("intake.pem"),
            key: self.path("intake.key"),
            client_ca: self.path("ca.pem"),
            allow: names(allow),
            agents: names(agents),
        }
    }
}

/// The scheduler's configuration, with the agents' intake `intake`: fast retries, the
/// example curriculum.
fn scheduler_config(intake: Intake) -> SchedulerConfig {
    SchedulerConfig::new("e2e", &example_curriculum())
        .with_retries(ms(500), ms(50), secs(1))
        .with_provision_timeout(secs(120))
        .with_intake(intake)
}

/// The intake's address, as the scheduler printed it.
fn intake(scheduler: &Scheduler) -> SocketAddr {
    *scheduler
        .process
        .extra
        .get("agent intake")
        .expect("the scheduler printed `agent intake listening on ADDR`")
}

/// The arguments of a test agent dialling in to `intake` as `name` (a new certificate, from
/// the rogue CA when asked), and that certificate's SHA-256.
fn dial_args(pki: &Pki, intake: SocketAddr, name: &str, rogue: bool) -> (Vec<String>, String) {
    let (cert, key, sha256) = pki.agent(name, rogue);
    let args = [
        "--connect".to_owned(),
        format!("https://{intake}"),
        "--tls-cert".into(),
        cert.display().to_string(),
        "--tls-key".into(),
        key.display().to_string(),
        "--tls-client-ca".into(),
        pki.path("ca.pem").display().to_string(),
    ]
    .into();
    (args, sha256)
}

async fn dial_in_agent(dir: &Path, args: &[String]) -> Process {
    Process::spawn(
        &antidote_tests::workspace_bin("test-agent"),
        args,
        dir.join(format!("agent-{}.log", uuid::Uuid::new_v4())),
    )
    .await
    .expect("test-agent starts")
}

/// How many listening TCP sockets a process holds (from /proc: its socket inodes that
/// /proc/net/tcp{,6} lists in state LISTEN).
fn listening_sockets(pid: u32) -> usize {
    let mut listening = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) == Some(&"0A")
                && let Some(inode) = fields.get(9)
            {
                listening.insert(format!("socket:[{inode}]"));
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the agent's /proc entry")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| listening.contains(&target.display().to_string()))
        .count()
}

/// Asks ListAgents until `name` is listed and `ready` holds for it; returns it.
async fn agent_when(
    scheduler: &Scheduler,
    name: &str,
    ready: impl Fn(&api::Agent) -> bool,
) -> api::Agent {
    let listed = tokio::time::timeout(PATIENCE, async {
        loop {
            let agents = scheduler
                .clients
                .agents()
                .await
                .expect("ListAgents answers");
            if let Some(agent) = agents.into_iter().find(|a| a.name == name && ready(a)) {
                return agent;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    listed.unwrap_or_else(|_| {
        panic!(
            "agent {name} never reached the condition\n--- scheduler log ---\n{}",
            scheduler.process.log_text()
        )
    })
}

fn ready(agent: &api::Agent) -> bool {
    agent.state() == api::AgentState::Ready
}

fn logs(scheduler: &Scheduler, agents: &[&Process]) -> String {
    let agents = agents.iter().map(|agent| ("agent".to_owned(), *agent));
    antidote_tests::logs(
        [("scheduler".to_owned(), &scheduler.process)]
            .into_iter()
            .chain(agents),
    )
}

#[tokio::test]
async fn a_dial_in_agent_runs_a_lesson_and_survives_kill_9_of_either_side() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let name = "edge-1.agents.test";
    let config =
        |port: u16| scheduler_config(pki.intake_config(port, &["*.agents.test"], &[])).to_toml();
    let mut scheduler = Scheduler::start(dir.path(), &config(0)).await.unwrap();
    let intake_addr = intake(&scheduler);
    let journal = dir.path().join("journal");
    let (mut args, sha256) = dial_args(&pki, intake_addr, name, false);
    args.extend(["--journal".into(), journal.display().to_string()]);
    let mut agent = dial_in_agent(dir.path(), &args).await;

    // It joins over its own connection, named by its certificate, listening on nothing.
    let listed = agent_when(&scheduler, name, ready).await;
    assert_eq!(
        listed.transport(),
        api::AgentTransport::DialIn,
        "{listed:?}"
    );
    assert_eq!(listed.address, "dial-in");
    assert!(listed.peer_address.starts_with("127.0.0.1:"), "{listed:?}");
    assert_eq!(listed.kind, "test-agent");
    assert_eq!(listed.tls_peer_sha256, sha256);
    assert_eq!(listed.tls_peer_names, vec![format!("DNS:{name}")]);
    assert_eq!(
        listening_sockets(agent.pid().unwrap()),
        0,
        "a dial-in agent listens on nothing"
    );
    let first_instance = listed.instance_id.clone();

    // A lesson end to end.
    let c = scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "routing-basics", 0).await.unwrap();
    let ready_0 = c
        .ready(&lesson.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler, &[&agent])));
    let page = fetch(presentation(&ready_0, "server", "web")).await;
    assert!(page.contains("routing-basics server stage 0"), "{page}");

    // kill -9 of the scheduler; it comes back on the same database and intake port, and the
    // agent dials in again: the same instance, so nothing is recovered.
    scheduler.process.kill9().await;
    scheduler = Scheduler::start(dir.path(), &config(intake_addr.port()))
        .await
        .unwrap();
    let again = agent_when(&scheduler, name, ready).await;
    assert_eq!(again.instance_id, first_instance);
    // The learners' tokens outlive the scheduler process (the store keeps their hashes).
    let tokens = c.tokens.clone();
    let mut c = scheduler.clients.clone();
    c.tokens = tokens;
    let still = c.get(&lesson.id).await.unwrap();
    assert_eq!(still.status(), api::LiveLessonStatus::Ready);
    // And it is still driven, over the new connection: a stage change.
    c.request(&session, "routing-basics", 1).await.unwrap();
    let (_, ready_1) = c
        .follow(&lesson.id, PATIENCE, |l| {
            l.status() == api::LiveLessonStatus::Ready && l.stage == 1
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler, &[&agent])));
    let page = fetch(presentation(&ready_1, "server", "web")).await;
    assert!(page.contains("routing-basics server stage 1"), "{page}");

    // kill -9 of the agent: it comes back with nothing in memory, dials in, and the scheduler
    // sees a new instance: Recover (NOT_FOUND here), then the live lesson is provisioned
    // again, READY on new sockets.
    agent.kill9().await;
    let agent = dial_in_agent(dir.path(), &args).await;
    let (_, after) = c
        .follow(&lesson.id, PATIENCE, |l| {
            l.status() == api::LiveLessonStatus::Ready && l.endpoints != ready_1.endpoints
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler, &[&agent])));
    assert_eq!(after.stage, 1);
    let page = fetch(presentation(&after, "server", "web")).await;
    assert!(page.contains("routing-basics server stage 1"), "{page}");
    let listed = agent_when(&scheduler, name, ready).await;
    assert_ne!(listed.instance_id, first_instance);
    assert_eq!(
        created(&journal),
        vec![lesson.id.clone(), lesson.id.clone()]
    );
}

/// A dial-in agent whose objects outlive it (`--state-dir`): after its kill -9 the scheduler's
/// Recover on the new instance, over the new connection, adopts the live lesson, which keeps
/// its endpoints and is not created again.
#[tokio::test]
async fn a_dial_in_agent_restarted_with_its_objects_has_them_recovered_by_the_scheduler() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let name = "edge-2.agents.test";
    let scheduler = Scheduler::start(
        dir.path(),
        &scheduler_config(pki.intake_config(0, &["*.agents.test"], &[])).to_toml(),
    )
    .await
    .unwrap();
    let journal = dir.path().join("journal");
    let (mut args, _) = dial_args(&pki, intake(&scheduler), name, false);
    args.extend(
        [
            "--journal",
            &journal.display().to_string(),
            "--state-dir",
            &dir.path().join("state").display().to_string(),
        ]
        .map(str::to_owned),
    );
    let agent = dial_in_agent(dir.path(), &args).await;
    let first_instance = agent_when(&scheduler, name, ready).await.instance_id;

    let c = scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "routing-basics", 0).await.unwrap();
    let before = c
        .ready(&lesson.id)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler, &[&agent])));

    let mut agent = agent;
    agent.kill9().await;
    let agent = dial_in_agent(dir.path(), &args).await;
    let listed = agent_when(&scheduler, name, |a| {
        ready(a) && a.instance_id != first_instance
    })
    .await;
    assert_eq!(listed.transport(), api::AgentTransport::DialIn);
    // Adopted: the journal says so (the test agent writes it when Recover finds the objects).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !adopted(&journal).contains(&lesson.id) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no Recover adopted {}\n{}",
            lesson.id,
            logs(&scheduler, &[&agent])
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, after) = c
        .follow(&lesson.id, PATIENCE, |l| {
            l.status() == api::LiveLessonStatus::Ready
        })
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", logs(&scheduler, &[&agent])));
    assert_eq!(after.endpoints, before.endpoints);
    assert_eq!(after.generation, before.generation);
    let page = fetch(presentation(&after, "server", "web")).await;
    assert!(page.contains("routing-basics server stage 0"), "{page}");
    assert_eq!(created(&journal), vec![lesson.id.clone()]);
}

#[tokio::test]
async fn the_intake_admits_only_trusted_certificates_with_admitted_names() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    // A dialled agent named `loopback`, and an allow list that would match that name.
    let dialled = Process::spawn(
        &antidote_tests::workspace_bin("test-agent"),
        &["--listen".into(), "127.0.0.1:0".into()],
        dir.path().join("dialled.log"),
    )
    .await
    .unwrap();
    let config = scheduler_config(pki.intake_config(
        0,
        &["*.agents.test", "*"],
        &["spiffe://agents.test/lab"],
    ))
    .with_agent(Agent::new("loopback", dialled.url()))
    .to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let intake_addr = intake(&scheduler);

    // Listed from the start, waiting for its connection.
    let lab = agent_when(&scheduler, "spiffe://agents.test/lab", |a| {
        a.state() == api::AgentState::Connecting
    })
    .await;
    assert_eq!(lab.transport(), api::AgentTransport::DialIn);
    assert!(lab.peer_address.is_empty(), "{lab:?}");

    // Refused: a certificate of another CA; a trusted one whose name is not admitted; a
    // trusted one naming the dialled agent.
    let mut refused = Vec::new();
    for (name, rogue, why) in [
        (
            "edge-3.agents.test",
            true,
            "certificate signed by unknown authority",
        ),
        (
            "intruder.elsewhere.test",
            false,
            "`intruder.elsewhere.test` is neither in agent_intake.agents nor matched by agent_intake.allow",
        ),
        (
            "loopback",
            false,
            "`loopback` is an agent this scheduler dials ([[agents]]): it cannot dial in under that name",
        ),
    ] {
        let (args, _) = dial_args(&pki, intake_addr, name, rogue);
        refused.push(dial_in_agent(dir.path(), &args).await);
        scheduler.process.until_logged(why, PATIENCE).await.unwrap();
    }
    // Admitted: a name the allow list matches, and one listed by its spiffe:// URI.
    let (args, _) = dial_args(&pki, intake_addr, "edge-1.agents.test", false);
    let edge = dial_in_agent(dir.path(), &args).await;
    let (args, _) = dial_args(&pki, intake_addr, "spiffe://agents.test/lab", false);
    let lab = dial_in_agent(dir.path(), &args).await;
    agent_when(&scheduler, "edge-1.agents.test", ready).await;
    let lab_listed = agent_when(&scheduler, "spiffe://agents.test/lab", ready).await;
    assert_eq!(
        lab_listed.tls_peer_names,
        vec!["URI:spiffe://agents.test/lab".to_owned()]
    );
    let loopback = agent_when(&scheduler, "loopback", ready).await;
    assert_eq!(loopback.transport(), api::AgentTransport::Dialled);
    assert_eq!(loopback.address, dialled.url());

    // Exactly these three: nothing of the refused ones joined, and none took `loopback`.
    let names: Vec<String> = scheduler
        .clients
        .agents()
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.name)
        .collect();
    assert_eq!(
        names,
        ["loopback", "spiffe://agents.test/lab", "edge-1.agents.test"],
        "{}",
        logs(&scheduler, &[&edge, &lab])
    );
    // The refused agents say why on their side too, and keep trying with backoff.
    refused[0]
        .until_logged("it does not trust the CA of our certificate", PATIENCE)
        .await
        .unwrap();
    refused[1]
        .until_logged("ended the connection at once", PATIENCE)
        .await
        .unwrap();
}

#[tokio::test]
async fn two_dial_in_agents_get_the_lessons_their_handshake_labels_ask_for() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let config = scheduler_config(pki.intake_config(0, &["*.agents.test"], &[])).to_toml();
    let scheduler = Scheduler::start(dir.path(), &config).await.unwrap();
    let intake_addr = intake(&scheduler);
    let mut agents = Vec::new();
    for (name, zone) in [
        ("north.agents.test", "north"),
        ("south.agents.test", "south"),
    ] {
        let (mut args, _) = dial_args(&pki, intake_addr, name, false);
        args.extend(["--label".into(), format!("zone={zone}")]);
        agents.push(dial_in_agent(dir.path(), &args).await);
        let listed = agent_when(&scheduler, name, ready).await;
        assert_eq!(listed.labels.get("zone").map(String::as_str), Some(zone));
    }
    let c = scheduler.clients.clone();
    for (zone, agent) in [
        ("south", "south.agents.test"),
        ("north", "north.agents.test"),
        ("south", "south.agents.test"),
    ] {
        let session = c.session().await.unwrap();
        let placement = api::PlacementPreference {
            requires: HashMap::from([("zone".to_owned(), zone.to_owned())]),
            prefers: HashMap::new(),
        };
        let lesson = c
            .request_placed(&session, "hello-web", 0, Some(placement))
            .await
            .unwrap();
        c.ready(&lesson.id).await.unwrap_or_else(|err| {
            panic!("{err:#}\n{}", logs(&scheduler, &[&agents[0], &agents[1]]))
        });
        let placed = c
            .admin
            .clone()
            .get_live_lesson(api::AdminGetLiveLessonRequest {
                id: lesson.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            placed.placement.map(|p| p.agent).as_deref(),
            Some(agent),
            "zone={zone}"
        );
    }
}

#[tokio::test]
async fn the_conformance_suite_passes_over_dial_in() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    // The suite listens as an intake would, with the intake's certificate.
    let mut suite =
        tokio::process::Command::new(antidote_tests::workspace_bin("antidote-conformance"))
            .args([
                "--accept-agent",
                "127.0.0.1:0",
                "--tls-cert",
                &pki.path("intake.pem").display().to_string(),
                "--tls-key",
                &pki.path("intake.key").display().to_string(),
                "--tls-ca",
                &pki.path("ca.pem").display().to_string(),
                "--tls-server-name",
                "conformant.agents.test",
                "--restart-cmd",
                &format!(
                    "kill -TERM \"$(cat '{}')\"",
                    dir.path().join("test-agent.pid").display()
                ),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
    let mut stdout = BufReader::new(suite.stdout.take().unwrap()).lines();
    let intake_addr: SocketAddr = loop {
        let line = stdout
            .next_line()
            .await
            .unwrap()
            .expect("the suite prints where it listens");
        if let Some(addr) = line.strip_prefix("intake listening on ") {
            break addr.parse().unwrap();
        }
    };
    // The agent dials in, restartable (the restart checks): it comes back dialling the same
    // intake.
    let state = dir.path().join("state");
    let (mut args, _) = dial_args(&pki, intake_addr, "conformant.agents.test", false);
    args.extend(
        [
            "--state-dir",
            &state.display().to_string(),
            "--max-live-lessons",
            "3",
            "--probe-timeout",
            "5s",
        ]
        .map(str::to_owned),
    );
    let agent = Restartable::spawn(
        &antidote_tests::workspace_bin("test-agent"),
        &args,
        &[],
        dir.path(),
        "test-agent",
    )
    .await
    .unwrap();
    let mut report = String::new();
    while let Some(line) = stdout.next_line().await.unwrap() {
        report.push_str(&line);
        report.push('\n');
    }
    let output = suite.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && report.contains(" 0 failed"),
        "conformance over dial-in failed ({}):\n{report}\n{stderr}\n--- agent ---\n{}",
        output.status,
        agent.log_text()
    );
    // Every check ran but the resync (not forced here), those no agent here can run, the
    // Jupyter guide, which the test agent does not offer, the entrypoint (not served) and
    // checks-unimplemented (the test agent offers `checks`);
    // the restart checks included.
    let skipped: Vec<&str> = report
        .lines()
        .filter_map(|line| line.strip_prefix("  SKIP  "))
        .filter_map(|rest| rest.split(':').next())
        .collect();
    assert_eq!(
        skipped,
        [
            "watch-resync",
            "configuration-python",
            "configuration-ansible",
            "configuration-napalm",
            "guide-jupyter",
            "entrypoint-tokens",
            "entrypoint-keys",
            "entrypoint-cookie",
            "entrypoint-proxy",
            "entrypoint-activity",
            "entrypoint-connection-cap",
            "entrypoint-terminal",
            "checks-unimplemented",
        ],
        "{report}"
    );
    for passed in [
        "PASS  restart-recover",
        "PASS  restart-adopt",
        "PASS  handshake",
    ] {
        assert!(report.contains(passed), "{report}");
    }
    assert!(
        stderr.contains("agent conformant.agents.test dialled in"),
        "{stderr}"
    );
}

/// A replica's configuration: the replicas tests' (short leases, a quick resync, several live
/// lessons per session) with the scheduler's own reaper, the intake `intake`.
fn replica_config(intake: Intake) -> String {
    let mut config = crate::replicas::replica_config("e2e-dialin-replicas").with_intake(intake);
    config.reaper = Default::default();
    config.to_toml()
}

/// Requests `count` live lessons through `clients` (three per session), concurrently;
/// returns their ids once every request was acknowledged.
async fn request_many(clients: &antidote_tests::Clients, count: usize) -> Vec<String> {
    let slugs = ["hello-web", "routing-basics", "netcat-toolbox"];
    let mut requests = tokio::task::JoinSet::new();
    for first in (0..count).step_by(slugs.len()) {
        let clients = clients.clone();
        let wanted: Vec<&str> = slugs
            .iter()
            .copied()
            .take((count - first).min(slugs.len()))
            .collect();
        requests.spawn(async move {
            let session = clients.session().await?;
            let mut ids = Vec::new();
            for slug in wanted {
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
    assert_eq!(ids.len(), count);
    ids
}

/// Waits until every one of `ids` is READY, as `clients` reads them.
async fn all_ready(clients: &antidote_tests::Clients, ids: &[String], logs: impl Fn() -> String) {
    let mut waits = tokio::task::JoinSet::new();
    for id in ids {
        let (clients, id) = (clients.clone(), id.clone());
        waits.spawn(async move { (clients.ready(&id).await, id) });
    }
    while let Some(result) = waits.join_next().await {
        let (ready, id) = result.unwrap();
        if let Err(err) = ready {
            panic!("live lesson {id}: {err:#}\n{}", logs());
        }
    }
}

/// How many times the agent's log says it dialled in to `intake`.
fn dials_to(agent: &Process, intake: SocketAddr) -> usize {
    // The log is coloured: `scheduler`, `=` and the value are apart.
    let mut plain = String::new();
    let mut escape = false;
    for c in agent.log_text().chars() {
        match (escape, c) {
            (false, '\x1b') => escape = true,
            (true, 'm') => escape = false,
            (false, c) => plain.push(c),
            (true, _) => {}
        }
    }
    plain
        .lines()
        .filter(|line| {
            line.contains("dialled in; serving on the connection")
                && line.contains(&format!("scheduler={intake}"))
        })
        .count()
}

/// Two scheduler replicas on one PostgreSQL database, each with its own agent intake, and one
/// test agent dialling in to both (`--connect` twice). Any replica may hold a live lesson's
/// lease and drive it, so with a connection to one replica only, the live lessons the other
/// leases would stall: here every one requested through either replica is READY. Then one
/// replica is killed (-9) while live lessons it drives are still booting: the survivor takes
/// them over, drives the ones requested through it, and the agent's connection to it is not
/// disturbed. The dead replica comes back on its intake port, the agent dials in to it again,
/// and it drives and deletes live lessons again. Every live lesson is created exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_in_agent_connected_to_every_replica_is_used_by_all_and_survives_one_dying() {
    const PER_REPLICA: usize = 9;
    let database = TestDatabase::create();
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let name = "edge-1.agents.test";
    let config = |port: u16| replica_config(pki.intake_config(port, &["*.agents.test"], &[]));
    let tokens = antidote_tests::Tokens::default();
    let start = |port: u16| {
        let (config, tokens, url, dir) = (
            config(port),
            tokens.clone(),
            database.url.clone(),
            dir.path().to_path_buf(),
        );
        async move {
            let mut replica = start_on(&dir, &url, &config).await;
            replica.clients.tokens = tokens;
            replica
        }
    };
    let mut a = start(0).await;
    let b = start(0).await;
    let (intake_a, intake_b) = (intake(&a), intake(&b));

    let journal = dir.path().join("journal");
    let (mut args, _) = dial_args(&pki, intake_a, name, false);
    args.extend([
        "--connect".into(),
        format!("https://{intake_b}"),
        "--journal".into(),
        journal.display().to_string(),
        "--boot-delay".into(),
        "1500ms".into(),
    ]);
    let agent = dial_in_agent(dir.path(), &args).await;
    let logs = |replicas: &[&Scheduler]| {
        let mut text = String::new();
        for (i, replica) in replicas.iter().enumerate() {
            text.push_str(&format!(
                "--- replica {i} ---\n{}\n",
                replica.process.log_text()
            ));
        }
        text.push_str(&format!("--- agent ---\n{}", agent.log_text()));
        text
    };

    // One connection to each replica: both list it READY, each from its own connection.
    let on_a = agent_when(&a, name, ready).await;
    let on_b = agent_when(&b, name, ready).await;
    assert_eq!(on_a.transport(), api::AgentTransport::DialIn);
    assert_eq!(on_b.transport(), api::AgentTransport::DialIn);
    assert_ne!(
        on_a.peer_address, on_b.peer_address,
        "two connections, one per replica"
    );
    assert_eq!(on_a.instance_id, on_b.instance_id);

    // Live lessons requested through both replicas (each leases what it was asked for).
    let (through_a, through_b) = tokio::join!(
        request_many(&a.clients, PER_REPLICA),
        request_many(&b.clients, PER_REPLICA)
    );
    all_ready(&a.clients, &through_a, || logs(&[&a, &b])).await;
    all_ready(&b.clients, &through_b, || logs(&[&a, &b])).await;

    // More through both, then A dies while they boot: B takes A's over when their leases
    // expire, and drives those requested through it after A died.
    let (booting_a, booting_b) = tokio::join!(
        request_many(&a.clients, PER_REPLICA),
        request_many(&b.clients, PER_REPLICA)
    );
    a.process.kill9().await;
    let after_death = request_many(&b.clients, PER_REPLICA).await;
    let mut survivors: Vec<String> = [&through_a, &through_b, &booting_a, &booting_b, &after_death]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    all_ready(&b.clients, &survivors, || logs(&[&a, &b])).await;
    // The agent's connection to B carried all that: it never ended.
    assert_eq!(dials_to(&agent, intake_b), 1, "{}", logs(&[&a, &b]));

    // A comes back on its intake port: the agent dials in to it again, and it drives live
    // lessons again.
    a = start(intake_a.port()).await;
    let again = agent_when(&a, name, ready).await;
    assert_eq!(again.instance_id, on_a.instance_id);
    assert!(dials_to(&agent, intake_a) >= 2, "{}", logs(&[&a, &b]));
    let through_new_a = request_many(&a.clients, PER_REPLICA).await;
    all_ready(&a.clients, &through_new_a, || logs(&[&a, &b])).await;
    survivors.extend(through_new_a);

    // Each created exactly once.
    let creations = created(&journal);
    let distinct: std::collections::BTreeSet<&String> = creations.iter().collect();
    let expected: std::collections::BTreeSet<&String> = survivors.iter().collect();
    assert_eq!(
        (creations.len(), distinct),
        (survivors.len(), expected),
        "the agent created each live lesson exactly once\n{}",
        logs(&[&a, &b])
    );

    // Deleted through either replica, every one is gone.
    let mut deletes = tokio::task::JoinSet::new();
    for (i, id) in survivors.iter().enumerate() {
        let clients = if i % 2 == 0 { &a } else { &b }.clients.clone();
        let id = id.clone();
        deletes.spawn(async move { (clients.delete(&id, PATIENCE).await, id) });
    }
    while let Some(result) = deletes.join_next().await {
        let (deleted, id) = result.unwrap();
        if let Err(err) = deleted {
            panic!("delete {id}: {err:#}\n{}", logs(&[&a, &b]));
        }
    }
}
