//! mTLS between the scheduler and agents: real processes, real TLS, certificates made here
//! (`antidote_tests::pki`, rcgen). An agent serving mTLS runs lessons end to end; every other
//! caller (plaintext, a certificate from another CA, an expired one, the wrong SAN) is refused in
//! the handshake, before any RPC, and the scheduler's ListAgents says why; certificates rotated
//! on disk are what the next connection presents, on both sides, with no restart; the
//! conformance suite passes over mTLS.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, AgentTls, SchedulerConfig, ms, secs};
use antidote_tests::pki::{Ca, Leaf, Validity};
use antidote_tests::{Clients, Process, Restartable, Scheduler, example_curriculum, workspace_bin};
use tempfile::TempDir;
use tokio::net::{TcpListener, TcpStream};

use crate::PATIENCE;

/// The identity every agent here requires of its client, the scheduler.
const SCHEDULER_ID: &str = "spiffe://antidote.test/ns/antidote/sa/scheduler";
/// The DNS name on the agents' certificates.
const AGENT_NAME: &str = "agent.antidote.test";

fn file(dir: &TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

/// Writes `leaf` as `NAME.crt` and `NAME.key` in `dir`.
fn write_leaf(dir: &TempDir, name: &str, leaf: &Leaf) {
    leaf.write(
        &file(dir, &format!("{name}.crt")),
        &file(dir, &format!("{name}.key")),
    );
}

/// A test agent serving mTLS with `agent.crt`/`agent.key`, accepting clients signed by
/// `client-ca.pem` that carry [`SCHEDULER_ID`], with `/metrics`.
async fn tls_agent(dir: &TempDir, log: &str) -> Process {
    let arg = |name: &str| file(dir, name).display().to_string();
    Process::spawn(
        &workspace_bin("test-agent"),
        &[
            "--tls-cert".into(),
            arg("agent.crt"),
            "--tls-key".into(),
            arg("agent.key"),
            "--tls-client-ca".into(),
            arg("client-ca.pem"),
            "--tls-require-identity".into(),
            SCHEDULER_ID.into(),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
        ],
        file(dir, log),
    )
    .await
    .expect("the mTLS test agent starts")
}

/// One `[[agents]]` entry; `tls`: (CA file, client certificate name, server name).
fn agent_entry(dir: &TempDir, name: &str, address: &str, tls: Option<(&str, &str, &str)>) -> Agent {
    let agent = Agent::new(name, address);
    match tls {
        Some((ca, client, server_name)) => agent.with_tls(AgentTls {
            ca: file(dir, ca),
            cert: file(dir, &format!("{client}.crt")),
            key: file(dir, &format!("{client}.key")),
            server_name: server_name.to_owned(),
        }),
        None => agent,
    }
}

async fn start_scheduler(dir: &TempDir, agents: impl IntoIterator<Item = Agent>) -> Scheduler {
    let config = SchedulerConfig::new("mtls", &example_curriculum())
        .with_sessions_per_ip(0)
        .with_lessons_per_session(5)
        .with_retries(ms(500), ms(50), ms(500))
        .with_provision_timeout(secs(120));
    let config = agents.into_iter().fold(config, SchedulerConfig::with_agent);
    Scheduler::start(dir.path(), &config.to_toml())
        .await
        .expect("the scheduler starts")
}

async fn list_agents(clients: &Clients) -> Vec<api::Agent> {
    clients.agents().await.expect("ListAgents")
}

/// Asks ListAgents until agent `name` satisfies `until` (there is no event to wait on); panics
/// after [`PATIENCE`] with what it last showed and `logs`.
async fn wait_agent(
    clients: &Clients,
    name: &str,
    until: impl Fn(&api::Agent) -> bool,
    logs: impl Fn() -> String,
) -> api::Agent {
    let started = Instant::now();
    loop {
        let agent = list_agents(clients)
            .await
            .into_iter()
            .find(|a| a.name == name)
            .unwrap_or_else(|| panic!("ListAgents has no agent {name}"));
        if until(&agent) {
            return agent;
        }
        if started.elapsed() > PATIENCE {
            panic!("agent {name} never got there: {agent:#?}\n{}", logs());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn seconds(y: i32, m: u8, d: u8) -> i64 {
    // Days from the civil date, as the certificate's notAfter at midnight UTC.
    let date = rcgen::date_time_ymd(y, m, d);
    date.unix_timestamp()
}

async fn ready_lesson(clients: &Clients, logs: impl Fn() -> String) -> api::LiveLesson {
    let session = clients.session().await.expect("a session");
    let requested = clients
        .request(&session, "routing-basics", 0)
        .await
        .expect("RequestLiveLesson");
    let ready = clients.ready(&requested.id).await.unwrap_or_else(|err| {
        panic!("{err:#}\n{}", logs());
    });
    assert_eq!(
        ready.status(),
        api::LiveLessonStatus::Ready,
        "{}\n{}",
        ready.failure_reason,
        logs()
    );
    ready
}

/// How many antidote.agent.v1 calls the agent answered, from its `/metrics`.
async fn answered_rpcs(agent: &Process) -> usize {
    let url = agent
        .extra_url("metrics")
        .expect("the agent serves /metrics");
    let page = antidote_tests::web::Web::default()
        .get(&format!("{url}/metrics"))
        .await
        .expect("GET /metrics")
        .body;
    page.lines()
        .filter(|line| line.starts_with("antidote_agent_rpc_duration_seconds_count"))
        .count()
}

#[tokio::test]
async fn mtls_runs_lessons_and_refuses_every_other_caller_before_any_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let agents_ca = Ca::new("agents CA");
    let scheduler_ca = Ca::new("scheduler CA");
    let other_ca = Ca::new("another CA");
    agents_ca.write(&file(&dir, "agents-ca.pem"));
    scheduler_ca.write(&file(&dir, "client-ca.pem"));
    other_ca.write(&file(&dir, "other-ca.pem"));
    let agent_leaf = agents_ca.issue(&[AGENT_NAME], Validity::Until(2031, 1, 1));
    write_leaf(&dir, "agent", &agent_leaf);
    let until = Validity::Until(2030, 6, 1);
    write_leaf(&dir, "good", &scheduler_ca.issue(&[SCHEDULER_ID], until));
    write_leaf(&dir, "foreign", &other_ca.issue(&[SCHEDULER_ID], until));
    write_leaf(
        &dir,
        "expired",
        &scheduler_ca.issue(&[SCHEDULER_ID], Validity::Expired),
    );
    write_leaf(
        &dir,
        "intruder",
        &scheduler_ca.issue(&["spiffe://antidote.test/ns/antidote/sa/intruder"], until),
    );

    // The lesson runs on `serving`; `target` is only ever reached by callers it must refuse.
    let serving = tls_agent(&dir, "serving.log").await;
    let target = tls_agent(&dir, "target.log").await;
    let https = |agent: &Process| format!("https://{}", agent.addr);
    let agents = [
        agent_entry(
            &dir,
            "good",
            &https(&serving),
            Some(("agents-ca.pem", "good", AGENT_NAME)),
        ),
        agent_entry(
            &dir,
            "foreign-ca",
            &https(&target),
            Some(("agents-ca.pem", "foreign", AGENT_NAME)),
        ),
        agent_entry(
            &dir,
            "expired",
            &https(&target),
            Some(("agents-ca.pem", "expired", AGENT_NAME)),
        ),
        agent_entry(
            &dir,
            "wrong-san",
            &https(&target),
            Some(("agents-ca.pem", "intruder", AGENT_NAME)),
        ),
        agent_entry(&dir, "plaintext", &format!("http://{}", target.addr), None),
        agent_entry(
            &dir,
            "untrusted-agent",
            &https(&target),
            Some(("other-ca.pem", "good", AGENT_NAME)),
        ),
        agent_entry(
            &dir,
            "wrong-agent-name",
            &https(&target),
            Some(("agents-ca.pem", "good", "other.antidote.test")),
        ),
    ];
    let scheduler = start_scheduler(&dir, agents).await;
    let c = &scheduler.clients;
    let logs = || {
        format!(
            "--- scheduler ---\n{}\n--- serving agent ---\n{}\n--- target agent ---\n{}",
            scheduler.process.log_text(),
            serving.log_text(),
            target.log_text()
        )
    };

    // A lesson end to end over mTLS; ListAgents shows the agent's certificate.
    let ready = ready_lesson(c, logs).await;
    assert_eq!(c.agent_of(&ready.id).await.unwrap(), "good");
    let good = wait_agent(c, "good", |a| !a.tls_peer_sha256.is_empty(), logs).await;
    assert_eq!(good.tls_peer_sha256, agent_leaf.sha256());
    assert_eq!(
        good.tls_peer_expires_at.map(|t| t.seconds),
        Some(seconds(2031, 1, 1))
    );
    assert_eq!(good.tls_peer_names, vec![format!("DNS:{AGENT_NAME}")]);
    assert_eq!(good.tls_error, "");

    // Each refusal, as the scheduler reports it.
    for (name, reason) in [
        (
            "foreign-ca",
            "agent foreign-ca: TLS: the peer refused the handshake",
        ),
        (
            "expired",
            "agent expired: TLS: the peer refused the handshake",
        ),
        (
            "wrong-san",
            "agent wrong-san: TLS: the peer refused the handshake",
        ),
        (
            "untrusted-agent",
            "agent untrusted-agent: TLS: certificate signed by unknown authority",
        ),
        (
            "wrong-agent-name",
            "agent wrong-agent-name: TLS: certificate is not valid for DNS:other.antidote.test (it names DNS:agent.antidote.test)",
        ),
    ] {
        let agent = wait_agent(c, name, |a| a.tls_error.contains(reason), logs).await;
        assert_ne!(agent.state(), api::AgentState::Ready, "{agent:?}");
        assert_eq!(agent.tls_peer_sha256, "", "{agent:?}");
        assert!(agent.last_error.contains(reason), "{agent:?}");
    }
    // Whether the agent's TLS alert or its closing the socket reaches the scheduler first, the
    // scheduler says the same thing.
    let plaintext = wait_agent(
        c,
        "plaintext",
        |a| a.last_error.contains("no answer in plaintext"),
        logs,
    )
    .await;
    assert_ne!(plaintext.state(), api::AgentState::Ready, "{plaintext:?}");
    // It says what is likely wrong, not only the frame error a TLS alert makes in HTTP/2.
    assert!(
        plaintext.last_error.contains(
            "no answer in plaintext: the agent may serve TLS (use an https:// address and its \
             `tls` settings: ca, cert, key)"
        ),
        "{plaintext:?}"
    );

    // The test's own plaintext client fares no better.
    let refused = antidote_proto::agent::v1::backend_client::BackendClient::connect(format!(
        "http://{}",
        target.addr
    ))
    .await
    .expect("TCP and HTTP/2 setup is lazy enough to connect")
    .handshake(antidote_proto::agent::v1::HandshakeRequest::default())
    .await;
    assert!(refused.is_err(), "{refused:?}");

    // The target agent says why it refused each one, and answered no RPC at all.
    for why in [
        "certificate signed by unknown authority",
        "certificate has expired",
        &format!(
            "certificate is not valid for URI:{SCHEDULER_ID} (it names URI:spiffe://antidote.test/ns/antidote/sa/intruder)"
        ),
        "the peer does not speak TLS (plaintext?)",
        "the peer refused the handshake",
    ] {
        target.until_logged(why, PATIENCE).await.unwrap();
    }
    assert!(target.log_text().contains("refused a connection"));
    assert_eq!(answered_rpcs(&target).await, 0, "{}", target.log_text());
    assert!(
        answered_rpcs(&serving).await > 0,
        "the serving agent's metrics count RPCs"
    );
}

/// A TCP forwarder between the scheduler and an agent, so the test can cut the scheduler's
/// connections and make it connect anew without restarting either process.
struct Cutter {
    addr: SocketAddr,
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Cutter {
    async fn start(target: SocketAddr) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let connections = connections.clone();
            async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    let forward = tokio::spawn(async move {
                        if let Ok(mut outbound) = TcpStream::connect(target).await {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                    });
                    connections.lock().unwrap().push(forward.abort_handle());
                }
            }
        });
        Cutter {
            addr,
            connections,
            task,
        }
    }

    /// Drops every connection made so far: both ends see them close.
    fn cut(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

impl Drop for Cutter {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}

#[tokio::test]
async fn rotated_certificates_serve_the_next_connection_on_both_sides_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let agents_ca = Ca::new("agents CA");
    let first_ca = Ca::new("scheduler CA 1");
    let second_ca = Ca::new("scheduler CA 2");
    agents_ca.write(&file(&dir, "agents-ca.pem"));
    first_ca.write(&file(&dir, "client-ca.pem"));
    let agent_v1 = agents_ca.issue(&[AGENT_NAME], Validity::Until(2031, 1, 1));
    write_leaf(&dir, "agent", &agent_v1);
    write_leaf(
        &dir,
        "scheduler",
        &first_ca.issue(&[SCHEDULER_ID], Validity::Until(2030, 6, 1)),
    );
    let agent = tls_agent(&dir, "agent.log").await;
    let cutter = Cutter::start(agent.addr).await;
    let scheduler = start_scheduler(
        &dir,
        [agent_entry(
            &dir,
            "rotating",
            &format!("https://{}", cutter.addr),
            Some(("agents-ca.pem", "scheduler", AGENT_NAME)),
        )],
    )
    .await;
    let c = &scheduler.clients;
    let logs = || {
        format!(
            "--- scheduler ---\n{}\n--- agent ---\n{}",
            scheduler.process.log_text(),
            agent.log_text()
        )
    };
    ready_lesson(c, logs).await;
    let seen = wait_agent(c, "rotating", |a| !a.tls_peer_sha256.is_empty(), logs).await;
    assert_eq!(seen.tls_peer_sha256, agent_v1.sha256());

    // A replacement that does not load keeps the previous pair (and says so): the next
    // connection still works, with the old certificate.
    std::fs::write(file(&dir, "agent.crt"), "not a certificate\n").unwrap();
    cutter.cut();
    ready_lesson(c, logs).await;
    agent
        .until_logged("TLS files changed but do not load", PATIENCE)
        .await
        .unwrap();
    assert!(agent.log_text().contains("agent.crt: no CERTIFICATE block"));
    let seen = wait_agent(c, "rotating", |a| a.state() == api::AgentState::Ready, logs).await;
    assert_eq!(seen.tls_peer_sha256, agent_v1.sha256());

    // Rotation on both sides, and of the CA the agent trusts for clients: the next connection
    // works only if the agent presents its new certificate and accepts the scheduler's new one,
    // which only the new CA signs.
    let agent_v2 = agents_ca.issue(&[AGENT_NAME], Validity::Until(2032, 2, 2));
    write_leaf(&dir, "agent", &agent_v2);
    second_ca.write(&file(&dir, "client-ca.pem"));
    write_leaf(
        &dir,
        "scheduler",
        &second_ca.issue(&[SCHEDULER_ID], Validity::Until(2030, 7, 7)),
    );
    cutter.cut();
    let seen = wait_agent(
        c,
        "rotating",
        |a| a.tls_peer_sha256 == agent_v2.sha256(),
        logs,
    )
    .await;
    assert_eq!(
        seen.tls_peer_expires_at.map(|t| t.seconds),
        Some(seconds(2032, 2, 2))
    );
    ready_lesson(c, logs).await;
    agent
        .until_logged("new certificate loaded", PATIENCE)
        .await
        .unwrap();
    // Nobody restarted: one process each, from the start.
    assert_eq!(
        agent.log_text().matches("TLS certificate loaded").count(),
        1
    );
}

#[tokio::test]
async fn conformance_passes_over_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let agents_ca = Ca::new("agents CA");
    let scheduler_ca = Ca::new("scheduler CA");
    let other_ca = Ca::new("another CA");
    agents_ca.write(&file(&dir, "agents-ca.pem"));
    scheduler_ca.write(&file(&dir, "client-ca.pem"));
    write_leaf(
        &dir,
        "agent",
        &agents_ca.issue(&[AGENT_NAME], Validity::Until(2031, 1, 1)),
    );
    let until = Validity::Until(2030, 6, 1);
    write_leaf(&dir, "suite", &scheduler_ca.issue(&[SCHEDULER_ID], until));
    write_leaf(&dir, "stranger", &other_ca.issue(&[SCHEDULER_ID], until));
    // Restartable (the restart checks run too): the harness starts it again on the same
    // address, with the same certificates and state dir.
    let arg = |name: &str| file(&dir, name).display().to_string();
    let agent = Restartable::spawn(
        &workspace_bin("test-agent"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--tls-cert".into(),
            arg("agent.crt"),
            "--tls-key".into(),
            arg("agent.key"),
            "--tls-client-ca".into(),
            arg("client-ca.pem"),
            "--tls-require-identity".into(),
            SCHEDULER_ID.into(),
            "--state-dir".into(),
            arg("state"),
            "--max-live-lessons".into(),
            "3".into(),
            "--probe-timeout".into(),
            "5s".into(),
        ],
        &[],
        dir.path(),
        "tls-agent",
    )
    .await
    .expect("the mTLS test agent starts");
    let restart = agent.restart_cmd();
    let suite = |client: &str| {
        let (dir, addr) = (dir.path().to_owned(), agent.addr);
        let (client, restart) = (client.to_owned(), restart.clone());
        async move {
            let path = |name: String| dir.join(name).display().to_string();
            tokio::process::Command::new(workspace_bin("antidote-conformance"))
                .args([
                    "--agent".to_owned(),
                    format!("https://{addr}"),
                    "--tls-ca".into(),
                    path("agents-ca.pem".into()),
                    "--tls-cert".into(),
                    path(format!("{client}.crt")),
                    "--tls-key".into(),
                    path(format!("{client}.key")),
                    "--tls-server-name".into(),
                    AGENT_NAME.into(),
                    "--restart-cmd".into(),
                    restart,
                ])
                .output()
                .await
                .expect("antidote-conformance runs")
        }
    };
    let output = suite("suite").await;
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && report.contains(" 0 failed"),
        "conformance over mTLS failed ({}):\n{report}\n{}\n--- agent ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
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
        "PASS  handshake",
        "PASS  restart-recover",
        "PASS  restart-adopt",
        "PASS  capacity-refusal",
    ] {
        assert!(report.contains(passed), "{report}");
    }
    // A client the agent does not trust cannot even begin.
    let output = suite("stranger").await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("TLS: the peer refused the handshake"),
        "{stderr}"
    );
}

#[tokio::test]
async fn plaintext_off_loopback_is_an_explicit_choice() {
    let dir = tempfile::tempdir().unwrap();
    let refused = Process::spawn(
        &workspace_bin("test-agent"),
        &["--listen".into(), "0.0.0.0:0".into()],
        file(&dir, "refused.log"),
    )
    .await;
    let err = format!(
        "{:#}",
        refused.err().expect("plaintext on 0.0.0.0 is refused")
    );
    assert!(
        err.contains("refusing to serve plaintext on 0.0.0.0")
            && err.contains("--insecure-plaintext"),
        "{err}"
    );
    let mesh = Process::spawn(
        &workspace_bin("test-agent"),
        &[
            "--listen".into(),
            "0.0.0.0:0".into(),
            "--insecure-plaintext".into(),
        ],
        file(&dir, "mesh.log"),
    )
    .await
    .expect("with --insecure-plaintext the agent serves");
    assert!(
        mesh.log_text()
            .contains("SERVING PLAINTEXT WITHOUT AUTHENTICATION"),
        "{}",
        mesh.log_text()
    );
}
