//! agent-docker against a real Docker engine (DOCKER_HOST; `tests/run` starts a private one and
//! builds the example curriculum's images), driven through the scheduler's public API. Besides
//! lifecycles: endpoints get no privilege (HostConfig inspected), no route to the host or the
//! metadata address (a listener on every host address, 169.254.169.254 added to `lo`), a pids
//! limit that stops a fork bomb, and configuration runs bounded in time and output (the agent's
//! peak RSS read from /proc).

use std::path::Path;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_tests::config::{Agent, SchedulerConfig, secs};
use antidote_tests::{
    Process, Scheduler, example_curriculum, fetch, presentation, with_token, workspace_bin,
};
use api::LiveLessonStatus as S;
use tempfile::TempDir;
use tokio::io::AsyncReadExt;

use crate::PATIENCE;

/// A scheduler and agent-docker, with their own instance label so parallel tests never touch
/// each other's objects. The configurator and vanishing tests use it too.
pub(crate) struct DockerEnv {
    pub(crate) dir: TempDir,
    pub(crate) agent: Process,
    /// The agent's arguments, which start it again on the same port.
    pub(crate) agent_args: Vec<String>,
    /// The agent's [`AGENT_TAG`] value.
    pub(crate) tag: String,
    pub(crate) scheduler: Scheduler,
    /// The scheduler's configuration, to start it again.
    pub(crate) config: String,
    pub(crate) instance: String,
}

/// The test engine's `DOCKER_HOST`.
pub(crate) fn docker_host() -> String {
    std::env::var("DOCKER_HOST").expect(
        "DOCKER_HOST is not set: run tests/run, which starts a private Docker engine and builds the images",
    )
}

/// The docker CLI, for checks from outside the agent: (success, stdout and stderr).
pub(crate) fn docker(args: &[&str]) -> (bool, String) {
    let output = std::process::Command::new("docker")
        .args(args)
        .env("DOCKER_HOST", docker_host())
        .output()
        .expect("the docker CLI runs");
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

/// Starts agent-docker; `tag` goes into its environment so the test can find its process.
pub(crate) async fn start_agent(dir: &Path, args: &[String], tag: &str) -> Process {
    let log = dir.join(format!("agent-docker-{}.log", uuid::Uuid::new_v4()));
    Process::spawn_with_env(
        &workspace_bin("agent-docker"),
        args,
        &[(AGENT_TAG, tag.to_owned())],
        log,
    )
    .await
    .expect("agent-docker starts")
}

/// The environment variable that tags a test's agent process (see [`agent_pid`]).
const AGENT_TAG: &str = "ANTIDOTE_TEST_AGENT_TAG";

impl DockerEnv {
    /// agent-docker (with `agent_extra`) and a scheduler for a real backend on `curriculum`.
    pub(crate) async fn start(
        instance: &str,
        curriculum: &Path,
        agent_extra: &[&str],
    ) -> DockerEnv {
        let config = SchedulerConfig::on_real_backend(instance, curriculum, secs(180));
        DockerEnv::with_config(config, agent_extra).await
    }

    /// agent-docker (with `agent_extra`) and a scheduler configured by `config`, to which the
    /// agent is added as `docker`.
    pub(crate) async fn with_config(config: SchedulerConfig, agent_extra: &[&str]) -> DockerEnv {
        docker_host();
        let dir = tempfile::tempdir().unwrap();
        // The agent's defaults: trusted images are not privileged (an operator's opt-in, which
        // this machine's engine could not grant anyway), lesson networks are confined.
        let mut agent_args: Vec<String> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--probe-timeout".into(),
            "30s".into(),
        ];
        agent_args.extend(agent_extra.iter().map(|a| a.to_string()));
        let tag = uuid::Uuid::new_v4().to_string();
        let agent = start_agent(dir.path(), &agent_args, &tag).await;
        // Restarts reuse the port the first start got.
        agent_args[1] = agent.addr.to_string();
        let instance = config.instance_id.clone();
        let config = config
            .with_agent(Agent::new("docker", agent.url()))
            .to_toml();
        let scheduler = Scheduler::start(dir.path(), &config)
            .await
            .expect("scheduler starts");
        DockerEnv {
            dir,
            agent,
            agent_args,
            tag,
            scheduler,
            config,
            instance,
        }
    }

    pub(crate) fn logs(&self) -> String {
        format!(
            "--- scheduler ---\n{}\n--- agent-docker ---\n{}",
            self.scheduler.process.log_text(),
            self.agent.log_text()
        )
    }

    /// Names of containers and networks carrying this test's instance label.
    pub(crate) fn labelled(&self) -> Vec<String> {
        let filter = format!("label=antidote.io/instance={}", self.instance);
        let (_, containers) = docker(&["ps", "-a", "--filter", &filter, "--format", "{{.Names}}"]);
        let (_, networks) = docker(&[
            "network",
            "ls",
            "--filter",
            &filter,
            "--format",
            "{{.Name}}",
        ]);
        containers
            .lines()
            .chain(networks.lines())
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    }

    pub(crate) async fn ready(&self, id: &str) -> api::LiveLesson {
        self.scheduler
            .clients
            .ready(id)
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()))
    }

    /// Follows a live lesson until READY or FAILED.
    pub(crate) async fn settle(&self, id: &str) -> api::LiveLesson {
        self.settle_within(id, PATIENCE).await
    }

    /// [`DockerEnv::settle`] with a limit of its own (a guard against hangs).
    pub(crate) async fn settle_within(&self, id: &str, limit: Duration) -> api::LiveLesson {
        let (_, lesson) = self
            .scheduler
            .clients
            .follow(id, limit, |l| matches!(l.status(), S::Ready | S::Failed))
            .await
            .unwrap_or_else(|err| panic!("{err:#}\n{}", self.logs()));
        lesson
    }

    pub(crate) async fn delete_all(&self, ids: &[&str]) {
        let c = &self.scheduler.clients;
        for id in ids {
            c.lessons
                .clone()
                .delete_live_lesson(with_token(
                    api::DeleteLiveLessonRequest { id: id.to_string() },
                    c.tokens.of_lesson(id),
                ))
                .await
                .unwrap();
        }
        for id in ids {
            c.gone(id, PATIENCE).await.unwrap();
        }
        let left = self.labelled();
        assert!(
            left.is_empty(),
            "labelled objects remain: {left:?}\n{}",
            self.logs()
        );
    }
}

/// The container name agent-docker gives an endpoint.
pub(crate) fn container(live_lesson: &str, endpoint: &str) -> String {
    let hex: String = live_lesson
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    format!("antidote-{hex}-{endpoint}")
}

fn ping(from: &str, to: &str) -> bool {
    docker(&["exec", from, "ping", "-c", "1", "-W", "2", to]).0
}

#[tokio::test]
async fn docker_multi_endpoint_lesson_isolation_stage_change_and_cleanup() {
    let env = DockerEnv::start("e2e-docker-life", &example_curriculum(), &[]).await;
    let c = &env.scheduler.clients;
    let (one, two) = (c.session().await.unwrap(), c.session().await.unwrap());
    let a = c.request(&one, "routing-basics", 0).await.unwrap();
    let b = c.request(&two, "routing-basics", 0).await.unwrap();
    let a = env.ready(&a.id).await;
    let b = env.ready(&b.id).await;
    assert_eq!((a.healthy, a.total), (4, 4), "{a:?}");

    // Presentations answer on the host: an SSH banner, and the page the stage wrote.
    let page = fetch(presentation(&a, "server", "web")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let mut ssh = tokio::net::TcpStream::connect(&presentation(&a, "router", "cli").address)
        .await
        .unwrap();
    let mut banner = [0u8; 4];
    ssh.read_exact(&mut banner).await.unwrap();
    assert_eq!(&banner, b"SSH-");

    // Endpoints of one live lesson reach each other by name; another lesson's cannot reach them.
    let a_client = container(&a.id, "client");
    assert!(ping(&a_client, "server"), "{}", env.logs());
    let (_, b_server_ip) = docker(&[
        "inspect",
        "-f",
        "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
        &container(&b.id, "server"),
    ]);
    for ip in b_server_ip.split_whitespace() {
        assert!(
            !ping(&a_client, ip),
            "lesson A reached lesson B's server at {ip}"
        );
    }

    // Stage 0 has no routes across the router; stage 1's configuration adds them.
    assert!(!ping(&a_client, "10.10.2.10"));
    let changed = c
        .lessons
        .clone()
        .set_stage(with_token(
            api::SetStageRequest {
                id: a.id.clone(),
                stage: 1,
            },
            c.tokens.of_lesson(&a.id),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(changed.status(), S::Configuring);
    let (_, staged) = c
        .follow(&a.id, PATIENCE, |l| {
            l.generation == 2 && matches!(l.status(), S::Ready | S::Failed)
        })
        .await
        .unwrap();
    assert_eq!(staged.status(), S::Ready, "{}", staged.failure_reason);
    assert!(
        ping(&a_client, "10.10.2.10"),
        "stage 1 routes the client to the server\n{}",
        env.logs()
    );
    assert!(
        !ping(&container(&b.id, "client"), "10.10.2.10"),
        "lesson B is still at stage 0"
    );

    env.delete_all(&[&a.id, &b.id]).await;
}

#[tokio::test]
async fn docker_failing_configuration_and_missing_image_fail_with_reasons() {
    let curriculum = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/docker-curriculum");
    let env = DockerEnv::start("e2e-docker-fail", &curriculum, &[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let broken = c.request(&session, "broken-config", 0).await.unwrap();
    let ghost = c.request(&session, "missing-image", 0).await.unwrap();

    let broken = env.settle(&broken.id).await;
    assert_eq!(broken.status(), S::Failed);
    assert!(
        broken.failure_reason.contains("failed 3 times"),
        "{}",
        broken.failure_reason
    );
    assert!(
        broken.failure_reason.contains("broken on purpose"),
        "{}",
        broken.failure_reason
    );
    assert!(
        broken.failure_reason.contains("exit code 3"),
        "{}",
        broken.failure_reason
    );

    let ghost = env.settle(&ghost.id).await;
    assert_eq!(ghost.status(), S::Failed);
    assert!(
        ghost.failure_reason.contains("antidote/ghost:latest"),
        "{}",
        ghost.failure_reason
    );
    assert!(
        ghost.failure_reason.contains("ghost"),
        "{}",
        ghost.failure_reason
    );

    env.delete_all(&[&broken.id, &ghost.id]).await;
}

#[tokio::test]
async fn docker_agent_kill_9_mid_provision_recovers_without_recreating_and_orphans_go() {
    let mut env = DockerEnv::start(
        "e2e-docker-crash",
        &example_curriculum(),
        &["--ready-delay", "4s"],
    )
    .await;
    let c = env.scheduler.clients.clone();
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    // Containers exist and answer; the agent waits out its ready delay: kill it now.
    c.follow(&lesson.id, PATIENCE, |l| {
        l.status() == S::Configuring
            && l.endpoints
                .iter()
                .all(|e| e.presentations.iter().all(|p| !p.address.is_empty()))
    })
    .await
    .unwrap_or_else(|err| panic!("{err:#}\n{}", env.logs()));
    let web = container(&lesson.id, "web");
    let (_, before) = docker(&["inspect", "-f", "{{.Id}}", &web]);
    env.agent.kill9().await;
    env.agent = start_agent(env.dir.path(), &env.agent_args, &env.tag).await;

    let ready = env.ready(&lesson.id).await;
    let (_, after) = docker(&["inspect", "-f", "{{.Id}}", &web]);
    assert_eq!(
        before.trim(),
        after.trim(),
        "the container was adopted, not recreated"
    );
    let page = fetch(presentation(&ready, "web", "page")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");

    // A container with our labels that the scheduler does not know is an orphan: removed after
    // the grace period. One with another instance's label is left alone.
    // Both carry our cluster id (only such objects are ever reaped: PROTOCOL.md, "Labels"),
    // read off our own live lesson's container.
    let (ok, cluster) = docker(&[
        "inspect",
        "-f",
        "{{index .Config.Labels \"antidote.io/cluster\"}}",
        &web,
    ]);
    let cluster = cluster.trim().to_owned();
    assert!(
        ok && !cluster.is_empty(),
        "no cluster label on {web}: {cluster}"
    );
    let orphan = uuid::Uuid::new_v4().to_string();
    let foreign = uuid::Uuid::new_v4().to_string();
    for (id, instance) in [(&orphan, env.instance.as_str()), (&foreign, "someone-else")] {
        let (ok, out) = docker(&[
            "run",
            "-d",
            "--name",
            &container(id, "stray"),
            "--label",
            &format!("antidote.io/instance={instance}"),
            "--label",
            &format!("antidote.io/cluster={cluster}"),
            "--label",
            &format!("antidote.io/live-lesson={id}"),
            "--label",
            "antidote.io/managed-by=agent-docker",
            "antidote/busybox:latest",
        ]);
        assert!(ok, "{out}");
    }
    let gone = async {
        loop {
            let (_, left) = docker(&[
                "ps",
                "-aq",
                "--filter",
                &format!("label=antidote.io/live-lesson={orphan}"),
            ]);
            if left.trim().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    tokio::time::timeout(PATIENCE, gone)
        .await
        .unwrap_or_else(|_| panic!("the orphan was not removed\n{}", env.logs()));
    let (_, kept) = docker(&[
        "ps",
        "-aq",
        "--filter",
        &format!("label=antidote.io/live-lesson={foreign}"),
    ]);
    assert!(
        !kept.trim().is_empty(),
        "another scheduler's container was removed"
    );
    docker(&["rm", "-f", &container(&foreign, "stray")]);

    env.delete_all(&[&lesson.id]).await;
}

/// `docker inspect` of one object, as JSON.
fn inspect(name: &str) -> serde_json::Value {
    let output = std::process::Command::new("docker")
        .args(["inspect", name])
        .env("DOCKER_HOST", docker_host())
        .output()
        .expect("the docker CLI runs");
    assert!(
        output.status.success(),
        "docker inspect {name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let all: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    all[0].clone()
}

/// A container's capabilities to add, without the `CAP_` prefix the engine may put on them.
fn cap_add(host_config: &serde_json::Value) -> Vec<String> {
    host_config["CapAdd"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str())
        .map(|c| c.trim_start_matches("CAP_").to_owned())
        .collect()
}

/// Checks that an endpoint got no privilege: not privileged, every capability dropped but the
/// confined set (NET_ADMIN and NET_RAW among them, nothing like SYS_ADMIN), no-new-privileges,
/// a pids limit, memory and CPU limits.
fn assert_confined(name: &str, pids_limit: i64) {
    let host_config = inspect(name)["HostConfig"].clone();
    assert_eq!(host_config["Privileged"], false, "{name}: {host_config}");
    let dropped: Vec<&str> = host_config["CapDrop"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str())
        .collect();
    assert!(
        dropped
            .iter()
            .any(|c| c.trim_start_matches("CAP_") == "ALL"),
        "{name}: {host_config}"
    );
    let added = cap_add(&host_config);
    for needed in ["NET_ADMIN", "NET_RAW"] {
        assert!(added.iter().any(|c| c == needed), "{name}: {added:?}");
    }
    for never in ["SYS_ADMIN", "SYS_MODULE", "SYS_PTRACE", "MKNOD", "ALL"] {
        assert!(!added.iter().any(|c| c == never), "{name}: {added:?}");
    }
    assert!(
        host_config["SecurityOpt"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|o| o == "no-new-privileges:true"),
        "{name}: {host_config}"
    );
    assert_eq!(
        host_config["PidsLimit"], pids_limit,
        "{name}: {host_config}"
    );
    assert!(host_config["Memory"].as_i64().unwrap_or(0) > 0, "{name}");
    assert!(host_config["NanoCpus"].as_i64().unwrap_or(0) > 0, "{name}");
}

/// A system binary (tests run as root, whose PATH may still lack the sbin directories).
fn system_bin(name: &str) -> std::path::PathBuf {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(Into::into))
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed"))
}

/// The host firewall rules tagged with a live lesson's networks, in both iptables variants.
fn firewall_rules(live_lesson: &str) -> Vec<String> {
    let stem = container(live_lesson, "");
    let mut rules = Vec::new();
    for variant in ["iptables-nft", "iptables-legacy"] {
        for chain in ["INPUT", "DOCKER-USER"] {
            let Ok(output) = std::process::Command::new(system_bin(variant))
                .args(["-w", "-S", chain])
                .output()
            else {
                continue;
            };
            rules.extend(
                String::from_utf8_lossy(&output.stdout)
                    .lines()
                    .filter(|line| line.contains(&stem))
                    .map(str::to_owned),
            );
        }
    }
    rules
}

/// An address on the host's loopback interface for the length of a test (here: the cloud
/// metadata address, so that something answers there the way a metadata service would).
struct LoopbackAddress(&'static str);

impl LoopbackAddress {
    fn add(cidr: &'static str) -> LoopbackAddress {
        let output = std::process::Command::new(system_bin("ip"))
            .args(["addr", "add", cidr, "dev", "lo"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() || stderr.contains("exists") || stderr.contains("already"),
            "ip addr add {cidr} dev lo: {stderr}"
        );
        LoopbackAddress(cidr)
    }
}

impl Drop for LoopbackAddress {
    fn drop(&mut self) {
        let _ = std::process::Command::new(system_bin("ip"))
            .args(["addr", "del", self.0, "dev", "lo"])
            .output();
    }
}

/// Every IPv4 address of the host but loopback's 127/8: its LAN address, Docker's bridges'
/// gateways (this lesson's among them), anything added to `lo`.
fn host_addresses() -> Vec<String> {
    let output = std::process::Command::new(system_bin("ip"))
        .args(["-4", "-o", "addr", "show"])
        .output()
        .unwrap();
    let mut addresses: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().nth(3))
        .filter_map(|cidr| cidr.split('/').next())
        .filter(|ip| !ip.starts_with("127."))
        .map(str::to_owned)
        .collect();
    addresses.sort();
    addresses.dedup();
    addresses
}

/// The host's own private address: the source of its default route.
fn primary_address() -> String {
    let output = std::process::Command::new(system_bin("ip"))
        .args(["-4", "-o", "route", "get", "1.1.1.1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let mut words = text.split_whitespace();
    words
        .by_ref()
        .find(|w| *w == "src")
        .and_then(|_| words.next())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no default route to find the host's address by: {text}"))
}

/// A TCP listener on every host address, recording who connects.
struct HostListener {
    port: u16,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<std::net::SocketAddr>,
}

impl HostListener {
    async fn bind() -> HostListener {
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, arrivals) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((_, peer)) = listener.accept().await {
                if tx.send(peer).is_err() {
                    return;
                }
            }
        });
        HostListener { port, arrivals }
    }

    /// Who connected since the last call.
    fn arrived(&mut self) -> Vec<std::net::SocketAddr> {
        let mut peers = Vec::new();
        while let Ok(peer) = self.arrivals.try_recv() {
            peers.push(peer);
        }
        peers
    }
}

/// Tries every address at once from inside a container; returns those it reached.
fn reached_from(container: &str, addresses: &[String], port: u16) -> Vec<String> {
    let script = format!(
        "for a in \"$@\"; do (timeout 10 nc -w 2 \"$a\" {port} </dev/null >/dev/null 2>&1 && echo \"reached $a\") & done; wait"
    );
    let mut args = vec!["exec", container, "sh", "-c", &script, "sh"];
    args.extend(addresses.iter().map(String::as_str));
    let (_, output) = docker(&args);
    output
        .lines()
        .filter_map(|l| l.strip_prefix("reached "))
        .map(str::to_owned)
        .collect()
}

// Multi-threaded: the host listener's accept loop must run while the test waits on the docker
// CLI (a blocking call), or a connection that does arrive would never be answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_endpoints_get_no_privilege_and_no_route_to_the_host() {
    // A rule left behind for a bridge that no longer exists (its engine was purged under a
    // running lesson): the agent sweeps it away when it starts.
    let stale = [
        "INPUT",
        "-i",
        "br-0000deadbeef",
        "-m",
        "comment",
        "--comment",
        "antidote-0000deadbeef-lesson",
        "-j",
        "DROP",
    ];
    let iptables = |op: &str| {
        let mut args = vec!["-w", op];
        args.extend(stale);
        std::process::Command::new(system_bin("iptables"))
            .args(&args)
            .status()
            .unwrap()
            .success()
    };
    assert!(iptables("-I"), "adding a stale rule");
    let env = DockerEnv::start("e2e-docker-confined", &example_curriculum(), &[]).await;
    if iptables("-C") {
        iptables("-D");
        panic!("the agent left a rule for a bridge that is gone");
    }
    let _metadata = LoopbackAddress::add("169.254.169.254/32");
    let mut listener = HostListener::bind().await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "routing-basics", 0).await.unwrap();
    let lesson = env.ready(&lesson.id).await;

    // The router's image is trusted; it is no more privileged than the untrusted client.
    for endpoint in ["router", "client", "server"] {
        assert_confined(&container(&lesson.id, endpoint), 1024);
    }

    // Presentations still answer on the host, endpoints still reach each other.
    let page = fetch(presentation(&lesson, "server", "web")).await;
    assert!(page.starts_with("HTTP/1."), "{page}");
    let client = container(&lesson.id, "client");
    assert!(ping(&client, "server"), "{}", env.logs());

    // No endpoint reaches the metadata address or any address of the host.
    let mut targets = host_addresses();
    targets.push("169.254.169.254".into());
    targets.push(primary_address());
    targets.sort();
    targets.dedup();
    for endpoint in ["client", "router"] {
        let reached = reached_from(&container(&lesson.id, endpoint), &targets, listener.port);
        assert!(
            reached.is_empty(),
            "{endpoint} reached the host at {reached:?}\n{}",
            env.logs()
        );
    }
    let arrived = listener.arrived();
    assert!(arrived.is_empty(), "the host listener saw {arrived:?}");

    // The same attempt from a container the agent did not make (Docker's default bridge)
    // arrives: the check above can fail.
    for target in ["169.254.169.254".to_owned(), primary_address()] {
        let port = listener.port.to_string();
        let (ok, output) = docker(&[
            "run",
            "--rm",
            "--entrypoint",
            "timeout",
            "antidote/busybox:latest",
            "10",
            "nc",
            "-w",
            "2",
            &target,
            &port,
        ]);
        let arrived = listener.arrived();
        assert!(
            !arrived.is_empty(),
            "an unconfined container did not reach {target}:{port} ({ok}: {output})"
        );
    }

    // Two rules per network (to the host; out of the bridge), removed with the networks.
    let rules = firewall_rules(&lesson.id);
    assert_eq!(rules.len(), 2 * 3, "{rules:#?}");
    env.delete_all(&[&lesson.id]).await;
    let left = firewall_rules(&lesson.id);
    assert!(left.is_empty(), "rules outlived their networks: {left:#?}");
}

/// A network namespace the test makes, joined to the host by a veth pair: the host's end has
/// `10.254.N.1/30` (a non-loopback host address to publish presentations on), the namespace's
/// `10.254.N.2/30` (a machine "outside", routed through the host). Removed on drop.
struct OutsideHost {
    namespace: String,
    host_end: String,
    host_address: String,
    outside_address: String,
}

impl OutsideHost {
    fn add(n: u8) -> OutsideHost {
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let outside = OutsideHost {
            namespace: format!("antidote-out-{suffix}"),
            host_end: format!("vh{suffix}"),
            host_address: format!("10.254.{n}.1"),
            outside_address: format!("10.254.{n}.2"),
        };
        let ns_end = format!("vo{suffix}");
        let ip = |args: &[&str]| {
            let output = std::process::Command::new(system_bin("ip"))
                .args(args)
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        };
        let (ns, host_end) = (outside.namespace.as_str(), outside.host_end.as_str());
        ip(&["netns", "add", ns]);
        ip(&[
            "link", "add", host_end, "type", "veth", "peer", "name", &ns_end,
        ]);
        ip(&["link", "set", &ns_end, "netns", ns]);
        ip(&[
            "addr",
            "add",
            &format!("{}/30", outside.host_address),
            "dev",
            host_end,
        ]);
        ip(&["link", "set", host_end, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", ns, "ip"];
            all.extend(args);
            ip(&all);
        };
        inside(&[
            "addr",
            "add",
            &format!("{}/30", outside.outside_address),
            "dev",
            &ns_end,
        ]);
        inside(&["link", "set", &ns_end, "up"]);
        inside(&["link", "set", "lo", "up"]);
        inside(&["route", "add", "default", "via", &outside.host_address]);
        outside
    }

    /// `GET /` from inside the namespace, as a client on another machine would send it.
    fn fetch(&self, address: &str) -> String {
        let (host, port) = address.rsplit_once(':').unwrap();
        let script = format!(
            "exec 3<>/dev/tcp/{host}/{port} && printf 'GET / HTTP/1.0\r\n\r\n' >&3 && cat <&3"
        );
        let output = std::process::Command::new(system_bin("ip"))
            .args([
                "netns",
                "exec",
                &self.namespace,
                "timeout",
                "10",
                "bash",
                "-c",
                &script,
            ])
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    }
}

impl Drop for OutsideHost {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, and with it the host's.
        let _ = std::process::Command::new(system_bin("ip"))
            .args(["netns", "del", &self.namespace])
            .output();
        let _ = std::process::Command::new(system_bin("ip"))
            .args(["link", "del", &self.host_end])
            .output();
    }
}

// Multi-threaded: the host listener's accept loop must run while the test waits on the docker
// CLI (a blocking call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_presentations_published_off_loopback_answer_clients_on_other_machines() {
    // Published on an address of the host that is not loopback, a presentation is reached
    // through Docker's DNAT and FORWARD, so the container's reply leaves the lesson's bridge:
    // the firewall must let replies out while still stopping whatever the endpoint starts.
    let outside = OutsideHost::add(1);
    let env = DockerEnv::start(
        "e2e-docker-publish-off-lo",
        &example_curriculum(),
        &["--publish-host", &outside.host_address],
    )
    .await;
    let _metadata = LoopbackAddress::add("169.254.169.254/32");
    let mut listener = HostListener::bind().await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "routing-basics", 0).await.unwrap();
    let lesson = env.ready(&lesson.id).await;
    let web = presentation(&lesson, "server", "web");
    assert!(
        web.address
            .starts_with(&format!("{}:", outside.host_address)),
        "{web:?}"
    );
    let page = outside.fetch(&web.address);
    assert!(
        page.starts_with("HTTP/1."),
        "a client outside the host got no page from {}: {page}\n{}",
        web.address,
        env.logs()
    );

    // Still nothing new out of the lesson: not the outside machine, not the host.
    let client = container(&lesson.id, "client");
    assert!(
        !ping(&client, &outside.outside_address),
        "an endpoint reached the outside machine"
    );
    let mut targets = host_addresses();
    targets.push("169.254.169.254".into());
    targets.push(outside.host_address.clone());
    targets.sort();
    targets.dedup();
    let reached = reached_from(&client, &targets, listener.port);
    assert!(
        reached.is_empty(),
        "the client reached the host at {reached:?}"
    );
    assert!(
        listener.arrived().is_empty(),
        "the host listener saw an endpoint"
    );
    env.delete_all(&[&lesson.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_allow_egress_lets_endpoints_out_but_not_to_the_host_or_metadata() {
    let outside = OutsideHost::add(2);
    let env = DockerEnv::start(
        "e2e-docker-egress",
        &example_curriculum(),
        &["--allow-egress"],
    )
    .await;
    let _metadata = LoopbackAddress::add("169.254.169.254/32");
    let mut listener = HostListener::bind().await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "routing-basics", 0).await.unwrap();
    let lesson = env.ready(&lesson.id).await;
    let client = container(&lesson.id, "client");

    // Out, through the host's routing, to another machine: allowed.
    assert!(
        ping(&client, &outside.outside_address),
        "with --allow-egress an endpoint did not reach {}\n{}",
        outside.outside_address,
        env.logs()
    );
    // Still not the host (any of its addresses) nor the metadata address.
    let mut targets = host_addresses();
    targets.push("169.254.169.254".into());
    targets.push(primary_address());
    targets.sort();
    targets.dedup();
    for endpoint in ["client", "router"] {
        let reached = reached_from(&container(&lesson.id, endpoint), &targets, listener.port);
        assert!(
            reached.is_empty(),
            "{endpoint} reached the host at {reached:?}\n{}",
            env.logs()
        );
    }
    let arrived = listener.arrived();
    assert!(arrived.is_empty(), "the host listener saw {arrived:?}");
    env.delete_all(&[&lesson.id]).await;
}

#[tokio::test]
async fn docker_trusted_endpoints_are_privileged_only_when_the_agent_is_told_so() {
    let env = DockerEnv::start(
        "e2e-docker-opt-in",
        &example_curriculum(),
        &["--trusted-privileged", "true"],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "routing-basics", 0).await.unwrap();
    // READY where the engine can grant every capability; FAILED where it cannot (nested
    // sandboxes such as this machine's): the containers were created either way.
    let lesson = env.settle(&lesson.id).await;
    let router = inspect(&container(&lesson.id, "router"))["HostConfig"].clone();
    assert_eq!(router["Privileged"], true, "{router}");
    assert_confined(&container(&lesson.id, "client"), 1024);
    env.delete_all(&[&lesson.id]).await;
}

#[tokio::test]
async fn docker_fork_bomb_in_an_endpoint_is_stopped_by_the_pids_limit() {
    const LIMIT: u64 = 64;
    let env = DockerEnv::start(
        "e2e-docker-pids",
        &example_curriculum(),
        &["--pids-limit", &LIMIT.to_string()],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "hello-web", 0).await.unwrap();
    let lesson = env.ready(&lesson.id).await;
    let web = container(&lesson.id, "web");
    assert_confined(&web, LIMIT as i64);

    // Every shell starts two more and stays (a bomb whose shells exit dies out by itself when
    // forks start failing, and would prove nothing).
    let (ok, output) = docker(&[
        "exec",
        "-d",
        &web,
        "sh",
        "-c",
        "b() { b & b & sleep 1000; }; b",
    ]);
    assert!(ok, "{output}");
    // The kernel refuses its forks at the limit (the pids cgroup counts each refusal), and the
    // endpoint never holds more than the limit.
    let cgroup = PidsCgroup::of(&web);
    let refused = async {
        loop {
            let (current, refusals) = cgroup.read();
            assert!(
                current <= LIMIT,
                "{current} processes in an endpoint limited to {LIMIT}"
            );
            if refusals > 0 {
                return (current, refusals);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let (current, refusals) = tokio::time::timeout(PATIENCE, refused)
        .await
        .expect("the bomb reaches the endpoint's pids limit");
    println!(
        "fork bomb: {current} processes in the endpoint (limit {LIMIT}), {refusals} forks refused"
    );
    // The endpoint, bomb and all, goes with its live lesson.
    env.delete_all(&[&lesson.id]).await;
}

/// An endpoint's pids cgroup on this host (the tests run on the engine's host), read directly:
/// `docker stats` cannot tell a limit that was hit from one that was not.
struct PidsCgroup(std::path::PathBuf);

impl PidsCgroup {
    fn of(container: &str) -> PidsCgroup {
        let pid = inspect(container)["State"]["Pid"].as_u64().unwrap();
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        // cgroup v1's pids hierarchy if there is one, else the unified (v2) one.
        let v1 = cgroups
            .lines()
            .find_map(|l| l.split_once(":pids:").map(|(_, p)| p));
        let dir = match v1 {
            Some(path) => format!("/sys/fs/cgroup/pids{path}"),
            None => {
                let path = cgroups
                    .lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .expect("a pids cgroup");
                format!("/sys/fs/cgroup{path}")
            }
        };
        PidsCgroup(dir.into())
    }

    /// (processes now, forks refused at the limit so far).
    fn read(&self) -> (u64, u64) {
        let read = |file: &str| std::fs::read_to_string(self.0.join(file)).unwrap();
        let current = read("pids.current").trim().parse().unwrap();
        let refusals = read("pids.events")
            .lines()
            .find_map(|l| l.strip_prefix("max "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        (current, refusals)
    }
}

/// The agent process started with `tag` (its children, such as iptables, inherit the tag but
/// have another name).
pub(crate) fn agent_pid(tag: &str) -> u32 {
    let needle = format!("{AGENT_TAG}={tag}");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            comm.trim() == "agent-docker"
                && environ
                    .split(|b| *b == 0)
                    .any(|var| var == needle.as_bytes())
        })
        .expect("the agent's process")
}

/// A process's peak resident set size (VmHWM), in KiB.
pub(crate) fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

#[tokio::test]
async fn docker_lesson_with_a_short_config_timeout_fails_after_its_own_timeout() {
    // The agent keeps its 5 min default; the lesson asks for 2 s (`configTimeout: 2`), so the
    // reason names 2 s. Were the lesson's value ignored, the run would take 15 min and the
    // scheduler's provision timeout would fail it with another reason.
    let curriculum = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/docker-curriculum");
    let env = DockerEnv::start("e2e-docker-lesson-timeout", &curriculum, &[]).await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c
        .request(&session, "short-config-timeout", 0)
        .await
        .unwrap();
    let lesson = env.settle(&lesson.id).await;
    assert_eq!(lesson.status(), S::Failed, "{}", env.logs());
    for words in [
        "failed 3 times",
        "did not finish within 2s",
        "still configuring",
    ] {
        assert!(
            lesson.failure_reason.contains(words),
            "{words:?} in {}",
            lesson.failure_reason
        );
    }
    env.delete_all(&[&lesson.id]).await;
}

#[tokio::test]
async fn docker_configuration_that_never_ends_fails_after_its_timeout() {
    let curriculum = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/docker-curriculum");
    let env = DockerEnv::start(
        "e2e-docker-endless",
        &curriculum,
        &["--config-timeout", "2s"],
    )
    .await;
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "endless-config", 0).await.unwrap();
    let lesson = env.settle(&lesson.id).await;
    assert_eq!(lesson.status(), S::Failed, "{}", env.logs());
    for words in [
        "failed 3 times",
        "did not finish within 2s",
        "still configuring",
    ] {
        assert!(
            lesson.failure_reason.contains(words),
            "{words:?} in {}",
            lesson.failure_reason
        );
    }
    // Each run was killed with everything it started.
    let box_ = container(&lesson.id, "box");
    let killed = async {
        loop {
            let (_, ps) = docker(&["exec", &box_, "ps"]);
            if !ps.contains("sleep 10000") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), killed)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "timed-out runs still sleep: {}",
                docker(&["exec", &box_, "ps"]).1
            )
        });
    env.delete_all(&[&lesson.id]).await;
}

#[tokio::test]
async fn docker_configuration_printing_100_mb_leaves_the_agent_memory_bounded() {
    let curriculum = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/docker-curriculum");
    let env = DockerEnv::start("e2e-docker-loud", &curriculum, &["--config-tries", "1"]).await;
    let pid = agent_pid(&env.tag);
    let before = peak_rss_kib(pid);
    let c = &env.scheduler.clients;
    let session = c.session().await.unwrap();
    let lesson = c.request(&session, "loud-config", 0).await.unwrap();
    let lesson = env.settle(&lesson.id).await;
    let after = peak_rss_kib(pid);
    println!("agent-docker peak RSS: {before} KiB before, {after} KiB after 100 MB of output");
    assert_eq!(lesson.status(), S::Failed, "{}", env.logs());
    let reason = &lesson.failure_reason;
    assert!(
        reason.contains("exit code 4") && reason.contains("loud-done"),
        "{reason}"
    );
    assert!(
        reason.len() < 2048,
        "a short tail, not {} bytes",
        reason.len()
    );
    assert!(
        after.saturating_sub(before) < 32 * 1024,
        "the agent's peak RSS grew from {before} KiB to {after} KiB"
    );
    env.delete_all(&[&lesson.id]).await;
}
