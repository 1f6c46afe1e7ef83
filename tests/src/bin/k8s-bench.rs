//! `k8s-bench`: agent-k8s on the real test node against plain kube-rs calls, measured in the
//! same run.
//!
//! **Three pods.** Each round, interleaved (the baseline first in odd rounds, agent-k8s first in
//! even ones): the baseline makes N three-pod "lessons" with plain kube-rs calls at C concurrent
//! clients, with the objects agent-k8s makes for `three-pods` (a namespace, the same
//! deny-by-default NetworkPolicy, three Services, then three pods with agent-k8s's image,
//! `imagePullPolicy`, requests and limits, security context, `/etc/hosts` entries and
//! affinity), watches each pod until it runs with an address and reads its SSH banner there
//! (agent-k8s's probe); agent-k8s's side is N `three-pods` live lessons through the scheduler
//! (session → request → watch until READY). Both sides then delete their namespaces and wait
//! until they are gone (through the scheduler: until the live lesson is gone, which agent-k8s
//! answers once the namespace is). Per side it prints each lesson's time to READY and to gone
//! (median, p10–p90) and each round's wall time (median, min–max), and the ratios of the
//! medians (agent-k8s / baseline).
//!
//! **routing-basics.** Then `--routing-rounds` rounds of the example curriculum's
//! routing-basics (three pods or containers, links, a shell configuration per endpoint) on the
//! node through agent-k8s against the same lesson on agent-docker on this machine's Docker
//! engine, one scheduler each, interleaved the same way: request→READY and delete→gone.
//!
//! Needs the test node (`tests/k8s/cluster.sh start`, KUBECONFIG exported, images imported),
//! and for routing-basics DOCKER_HOST (`tests/docker/dockerd.sh`) with the lesson images. It
//! starts its own agents and schedulers, runs agent-k8s with the same admin credentials as the
//! baseline, and removes only what it made (its namespaces carry `antidote.io/instance`
//! `k8s-bench`). Build with `cargo build --release --workspace --bins`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_sdk::probe::{Expect, until_ready};
use antidote_tests::{Clients, Process, Scheduler, example_curriculum, fan_out, workspace_bin};
use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::conditions::is_deleted;
use kube::runtime::wait::await_condition;
use serde_json::{Value, json};

const INSTANCE: &str = "k8s-bench";
const ENDPOINTS: [&str; 3] = ["alpha", "bravo", "charlie"];
const PATIENCE: Duration = Duration::from_secs(300);
/// The capabilities agent-k8s gives a lesson container after dropping all
/// (agent-k8s/src/cluster.rs, `LINUX_CAPABILITIES`).
const LINUX_CAPABILITIES: [&str; 12] = [
    "NET_ADMIN",
    "NET_RAW",
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "NET_BIND_SERVICE",
    "SETGID",
    "SETUID",
    "SYS_CHROOT",
];

#[derive(Parser)]
#[command(
    name = "k8s-bench",
    about = "agent-k8s on the real node against plain kube-rs calls"
)]
struct Args {
    /// Three-pod lessons per side per round. Each pod requests 50 millicpu and 64 MiB, and a
    /// round's lessons are all up at once: the default 4 (12 pods, 600 millicpu) leaves most
    /// of the 2-CPU test node to the tests sharing it.
    #[arg(long, default_value_t = 4)]
    lessons: usize,
    /// Concurrent clients per side.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Rounds of three-pod lessons (the side going first alternates).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Rounds of routing-basics on agent-k8s against agent-docker (0: skip, no Docker needed).
    #[arg(long, default_value_t = 5)]
    routing_rounds: usize,
    /// Keep the directory with the agents' and schedulers' logs (its path is printed) instead
    /// of removing it at the end: with `RUST_LOG=agent_k8s=debug`, agent-k8s's per-step timings.
    #[arg(long)]
    keep_logs: bool,
}

/// One side's timings of one round: wall times of the whole round's way up and down, and
/// every lesson's own.
struct RoundTimes {
    up: Duration,
    down: Duration,
    up_each: Vec<Duration>,
    down_each: Vec<Duration>,
    /// The baseline's lessons' steps: from their start until every object was created, and
    /// until every pod ran (the rest of `up_each` is the SSH banners).
    steps: Vec<(Duration, Duration)>,
}

/// One side's timings over all rounds.
#[derive(Default)]
struct Side {
    up: Vec<Duration>,
    down: Vec<Duration>,
    up_each: Vec<Duration>,
    down_each: Vec<Duration>,
    steps: Vec<(Duration, Duration)>,
}

impl Side {
    fn add(&mut self, round: RoundTimes) {
        self.up.push(round.up);
        self.down.push(round.down);
        self.up_each.extend(round.up_each);
        self.down_each.extend(round.down_each);
        self.steps.extend(round.steps);
    }
}

/// The median, p10, p90, min and max of some durations, in seconds.
struct Stats {
    median: f64,
    p10: f64,
    p90: f64,
    min: f64,
    max: f64,
}

fn stats(values: &[Duration]) -> Stats {
    let mut sorted: Vec<f64> = values.iter().map(Duration::as_secs_f64).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n == 0 {
        return Stats {
            median: f64::NAN,
            p10: f64::NAN,
            p90: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
        };
    }
    let at = |q: f64| sorted[((n as f64 * q).ceil() as usize).clamp(1, n) - 1];
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Stats {
        median,
        p10: at(0.10),
        p90: at(0.90),
        min: sorted[0],
        max: sorted[n - 1],
    }
}

/// Prints one measure of both sides: per lesson (median, p10–p90) and per round (median,
/// min–max), with the ratios of the medians (other / baseline).
fn report(
    what: &str,
    names: (&str, &str),
    baseline: (&[Duration], &[Duration]),
    other: (&[Duration], &[Duration]),
) {
    let (b_each, o_each) = (stats(baseline.0), stats(other.0));
    let (b_wall, o_wall) = (stats(baseline.1), stats(other.1));
    println!(
        "{what}, per lesson: {} median {:.2} s (p10 {:.2}, p90 {:.2}), {} median {:.2} s (p10 {:.2}, p90 {:.2}); ratio of medians {:.2}",
        names.0,
        b_each.median,
        b_each.p10,
        b_each.p90,
        names.1,
        o_each.median,
        o_each.p10,
        o_each.p90,
        o_each.median / b_each.median
    );
    println!(
        "{what}, per round (wall): {} median {:.2} s (min {:.2}, max {:.2}), {} median {:.2} s (min {:.2}, max {:.2}); ratio of medians {:.2}",
        names.0,
        b_wall.median,
        b_wall.min,
        b_wall.max,
        names.1,
        o_wall.median,
        o_wall.min,
        o_wall.max,
        o_wall.median / b_wall.median
    );
}

/// [`fan_out`] that also returns every job's own time and result.
async fn timed<T, F, Fut>(
    count: usize,
    concurrency: usize,
    job: F,
) -> anyhow::Result<(Duration, Vec<(Duration, T)>)>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<T>> + Send + 'static,
{
    let done = Arc::new(Mutex::new(Vec::new()));
    let wall = fan_out(count, concurrency, |i| {
        let (done, fut) = (done.clone(), job(i));
        async move {
            let start = Instant::now();
            let value = fut.await?;
            done.lock()
                .expect("not poisoned")
                .push((start.elapsed(), value));
            Ok(())
        }
    })
    .await?;
    let done = std::mem::take(&mut *done.lock().expect("not poisoned"));
    Ok((wall, done))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = kube::Client::try_default().await.context(
        "no Kubernetes API: run `tests/k8s/cluster.sh start` and export the KUBECONFIG it prints",
    )?;
    let dir = tempfile::tempdir()?;
    headroom(&client, &args).await?;
    let result = run(&args, &client, dir.path()).await;
    // Whatever happened, nothing of this run stays on the shared node.
    if let Err(err) = remove_leftovers(&client).await {
        eprintln!("k8s-bench: removing what it made: {err:#}");
    }
    if args.keep_logs {
        println!("logs kept in {}", dir.keep().display());
    }
    result
}

/// A CPU quantity (`2`, `1.5`, `250m`) in millicpu.
fn millicpu(quantity: &str) -> u64 {
    match quantity.strip_suffix('m') {
        Some(milli) => milli.parse().unwrap_or(0),
        None => quantity
            .parse::<f64>()
            .map(|cpus| (cpus * 1000.0) as u64)
            .unwrap_or(0),
    }
}

/// Prints the nodes' allocatable CPU against what the pods already on them request and what a
/// round of this bench adds, and warns when a round does not fit: the node is shared, and pods
/// that find no room wait (the live lesson's reason then says so).
async fn headroom(client: &kube::Client, args: &Args) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    let nodes: Api<Node> = Api::all(client.clone());
    let allocatable: u64 = nodes
        .list(&ListParams::default())
        .await?
        .into_iter()
        .filter_map(|node| node.status?.allocatable?.get("cpu").map(|q| millicpu(&q.0)))
        .sum();
    let pods: Api<Pod> = Api::all(client.clone());
    let requested: u64 = pods
        .list(&ListParams::default().fields("status.phase!=Succeeded,status.phase!=Failed"))
        .await?
        .into_iter()
        .filter_map(|pod| pod.spec)
        .filter(|spec| spec.node_name.is_some())
        .flat_map(|spec| spec.containers)
        .filter_map(|c| c.resources?.requests?.get("cpu").map(|q| millicpu(&q.0)))
        .sum();
    let needed = (args.lessons * ENDPOINTS.len()) as u64 * 50;
    println!(
        "node CPU: {allocatable}m allocatable, {requested}m requested by the pods on it, {needed}m more per round of this bench"
    );
    if requested + needed > allocatable {
        eprintln!(
            "k8s-bench: warning: a round does not fit beside what runs on the node now; pods will wait for room"
        );
    }
    Ok(())
}

/// agent-k8s on the test node's imported images, as the e2e tests run it.
async fn agent_k8s(dir: &std::path::Path, name: &str) -> anyhow::Result<Process> {
    Process::spawn(
        &workspace_bin("agent-k8s"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--image-pull-policy".into(),
            "Never".into(),
        ],
        dir.join(format!("{name}.log")),
    )
    .await
}

/// A scheduler of one instance on one agent.
async fn scheduler(
    dir: &std::path::Path,
    instance: &str,
    curriculum: &std::path::Path,
    agent: &Process,
) -> anyhow::Result<Scheduler> {
    let dir = dir.join(instance);
    std::fs::create_dir_all(&dir)?;
    let config = format!(
        "instance_id = \"{instance}\"\ncurriculum = \"{}\"\ntier = \"prod\"\n\
         [limits]\nsessions_per_ip = 0\n[reconciler]\npoll_interval = \"500ms\"\n\
         backoff_initial = \"100ms\"\nbackoff_max = \"1s\"\nprovision_timeout = \"4m\"\n\
         [[agents]]\nname = \"agent\"\naddress = \"{}\"\n",
        curriculum.display(),
        agent.url()
    );
    Scheduler::start(&dir, &config).await
}

async fn run(args: &Args, client: &kube::Client, dir: &std::path::Path) -> anyhow::Result<()> {
    let agent = agent_k8s(dir, "agent-k8s").await?;
    let curriculum =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/k8s-curriculum");
    let scheduler = scheduler(dir, INSTANCE, &curriculum, &agent).await?;
    let c = &scheduler.clients;
    // Warm up: one lesson each way, so the first round pays no first-use costs.
    agent_round(c, "three-pods", 1, 1).await?;
    baseline_round(client, 0, 1, 1).await?;

    println!(
        "k8s-bench: {} lessons of 3 pods, 3 Services, a NetworkPolicy and a namespace per side per round, concurrency {}, {} rounds",
        args.lessons, args.concurrency, args.rounds
    );
    let (mut raw, mut ours) = (Side::default(), Side::default());
    for round in 1..=args.rounds {
        // The first side alternates: whatever the cluster still does after a round's teardown
        // (garbage collection, etcd compaction, the kubelet's cleanup) falls on each in turn.
        let (baseline, agent) = if round % 2 == 1 {
            let baseline = baseline_round(client, round, args.lessons, args.concurrency).await?;
            let agent = agent_round(c, "three-pods", args.lessons, args.concurrency).await?;
            (baseline, agent)
        } else {
            let agent = agent_round(c, "three-pods", args.lessons, args.concurrency).await?;
            let baseline = baseline_round(client, round, args.lessons, args.concurrency).await?;
            (baseline, agent)
        };
        println!(
            "round {round} ({} first): to READY baseline {:.2} s, agent-k8s {:.2} s | teardown baseline {:.2} s, agent-k8s {:.2} s",
            if round % 2 == 1 {
                "baseline"
            } else {
                "agent-k8s"
            },
            baseline.up.as_secs_f64(),
            agent.up.as_secs_f64(),
            baseline.down.as_secs_f64(),
            agent.down.as_secs_f64()
        );
        raw.add(baseline);
        ours.add(agent);
        let left = namespaces_left(client).await?;
        anyhow::ensure!(
            left.is_empty(),
            "namespaces left after round {round}: {left:?}"
        );
    }
    println!(
        "CPU over the warm-up and rounds: agent-k8s {:.2} s, scheduler {:.2} s",
        cpu_seconds(&agent),
        cpu_seconds(&scheduler.process)
    );
    let (created, running): (Vec<Duration>, Vec<Duration>) = raw.steps.iter().copied().unzip();
    let (created, running) = (stats(&created), stats(&running));
    println!(
        "baseline steps per lesson: objects created after median {:.2} s (p90 {:.2}), pods running after {:.2} s (p90 {:.2}); \
         agent-k8s logs its own at debug (`objects applied`, `pods running`, `presentations answer`)",
        created.median, created.p90, running.median, running.p90
    );
    let names = ("baseline", "agent-k8s");
    report(
        "to READY",
        names,
        (&raw.up_each, &raw.up),
        (&ours.up_each, &ours.up),
    );
    report(
        "teardown",
        names,
        (&raw.down_each, &raw.down),
        (&ours.down_each, &ours.down),
    );
    drop(scheduler);
    drop(agent);
    if args.routing_rounds > 0 {
        routing(args, dir).await?;
    }
    Ok(())
}

/// routing-basics through agent-k8s on the node against agent-docker on this machine.
async fn routing(args: &Args, dir: &std::path::Path) -> anyhow::Result<()> {
    let docker = Process::spawn(
        &workspace_bin("agent-docker"),
        &["--listen".into(), "127.0.0.1:0".into()],
        dir.join("agent-docker.log"),
    )
    .await
    .context("agent-docker (set DOCKER_HOST, or --routing-rounds 0)")?;
    let k8s = agent_k8s(dir, "agent-k8s-routing").await?;
    let on_k8s = scheduler(dir, "k8s-bench-routing", &example_curriculum(), &k8s).await?;
    let on_docker = scheduler(dir, "k8s-bench-docker", &example_curriculum(), &docker).await?;
    let (k, d) = (&on_k8s.clients, &on_docker.clients);
    agent_round(k, "routing-basics", 1, 1).await?;
    agent_round(d, "routing-basics", 1, 1).await?;
    println!(
        "routing-basics: one lesson per side per round, {} rounds",
        args.routing_rounds
    );
    let (mut docker_side, mut k8s_side) = (Side::default(), Side::default());
    for round in 1..=args.routing_rounds {
        let (on_docker, on_k8s) = if round % 2 == 1 {
            let docker = agent_round(d, "routing-basics", 1, 1).await?;
            (docker, agent_round(k, "routing-basics", 1, 1).await?)
        } else {
            let k8s = agent_round(k, "routing-basics", 1, 1).await?;
            (agent_round(d, "routing-basics", 1, 1).await?, k8s)
        };
        println!(
            "routing round {round} ({} first): to READY agent-docker {:.2} s, agent-k8s {:.2} s | teardown agent-docker {:.2} s, agent-k8s {:.2} s",
            if round % 2 == 1 {
                "agent-docker"
            } else {
                "agent-k8s"
            },
            on_docker.up.as_secs_f64(),
            on_k8s.up.as_secs_f64(),
            on_docker.down.as_secs_f64(),
            on_k8s.down.as_secs_f64()
        );
        docker_side.add(on_docker);
        k8s_side.add(on_k8s);
    }
    let names = ("agent-docker", "agent-k8s");
    report(
        "routing-basics to READY",
        names,
        (&docker_side.up_each, &docker_side.up),
        (&k8s_side.up_each, &k8s_side.up),
    );
    report(
        "routing-basics teardown",
        names,
        (&docker_side.down_each, &docker_side.down),
        (&k8s_side.down_each, &k8s_side.down),
    );
    Ok(())
}

/// `count` live lessons of `lesson` through the scheduler at `concurrency` (a fresh session
/// each, request → READY), then each deleted until gone.
async fn agent_round(
    c: &Clients,
    lesson: &'static str,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<RoundTimes> {
    let mut sessions = Vec::new();
    for _ in 0..count {
        sessions.push(c.session().await?);
    }
    let (up, ready) = timed(count, concurrency, |i| {
        let (c, session) = (c.clone(), sessions[i].clone());
        async move {
            let id = c.request(&session, lesson, 0).await?.id;
            if let Err(err) = c.ready(&id).await {
                // Say where it stood: on a full node, the pods wait for room.
                let state = c
                    .admin
                    .clone()
                    .get_live_lesson(api::AdminGetLiveLessonRequest { id: id.clone() })
                    .await
                    .ok()
                    .and_then(|view| view.into_inner().live_lesson)
                    .map(|l| format!("{:?}: {}", l.status(), l.failure_reason))
                    .unwrap_or_default();
                return Err(err.context(format!("live lesson {id} of {lesson}, last {state}")));
            }
            Ok(id)
        }
    })
    .await?;
    let ids: Vec<String> = ready.iter().map(|(_, id)| id.clone()).collect();
    let (down, gone) = timed(ids.len(), concurrency, |i| {
        let (c, id) = (c.clone(), ids[i].clone());
        async move { c.delete(&id, PATIENCE).await }
    })
    .await?;
    Ok(RoundTimes {
        up,
        down,
        up_each: ready.into_iter().map(|(took, _)| took).collect(),
        down_each: gone.into_iter().map(|(took, ())| took).collect(),
        steps: Vec::new(),
    })
}

/// `count` baseline lessons at `concurrency`, then each namespace deleted until gone.
async fn baseline_round(
    client: &kube::Client,
    round: usize,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<RoundTimes> {
    let name = |i: usize| format!("k8s-bench-r{round}-{i}");
    let (up, ready) = timed(count, concurrency, |i| {
        baseline_lesson(client.clone(), name(i))
    })
    .await?;
    let (down, gone) = timed(count, concurrency, |i| {
        baseline_remove(client.clone(), name(i))
    })
    .await?;
    Ok(RoundTimes {
        up,
        down,
        up_each: ready.iter().map(|(took, _)| *took).collect(),
        down_each: gone.into_iter().map(|(took, ())| took).collect(),
        steps: ready.into_iter().map(|(_, steps)| steps).collect(),
    })
}

/// Endpoint `index`'s pod as agent-k8s makes it for `three-pods` with `--image-pull-policy
/// Never` and its default limits and requests.
fn pod(namespace: &str, index: usize, hosts: &Value) -> Value {
    let endpoint = ENDPOINTS[index];
    let mut pod = json!({
        "metadata": {
            "name": endpoint,
            "labels": {
                "antidote.io/instance": INSTANCE,
                "antidote.io/live-lesson": namespace,
                "antidote.io/endpoint": endpoint,
            },
        },
        "spec": {
            "hostname": endpoint,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "restartPolicy": "Always",
            "hostAliases": hosts,
            "containers": [{
                "name": endpoint,
                "image": "antidote/busybox:latest",
                "imagePullPolicy": "Never",
                "ports": [{ "name": "ssh-22", "containerPort": 22, "protocol": "TCP" }],
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "capabilities": { "drop": ["ALL"], "add": LINUX_CAPABILITIES },
                    "seccompProfile": { "type": "RuntimeDefault" },
                },
                "resources": {
                    "limits": { "memory": "256Mi", "cpu": "1000m" },
                    "requests": { "memory": "64Mi", "cpu": "50m" },
                },
            }],
        },
    });
    if index > 0 {
        pod["spec"]["affinity"] = json!({ "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": { "matchLabels": {
                    "antidote.io/live-lesson": namespace,
                    "antidote.io/endpoint": ENDPOINTS[0],
                } },
                "topologyKey": "kubernetes.io/hostname",
            }],
        } });
    }
    pod
}

/// One lesson's worth of Kubernetes work with plain kube-rs calls, in agent-k8s's order: the
/// namespace, the deny-by-default policy, the Services (their cluster IPs go into every pod's
/// `/etc/hosts`), the pods; then each pod watched until it runs with an address and its SSH
/// banner read there. Returns when every object was created and when every pod ran.
async fn baseline_lesson(
    client: kube::Client,
    namespace: String,
) -> anyhow::Result<(Duration, Duration)> {
    let start = Instant::now();
    let labels = json!({ "antidote.io/instance": INSTANCE, "antidote.io/live-lesson": namespace });
    let create = PostParams::default();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &create,
            &serde_json::from_value(
                json!({ "metadata": { "name": namespace, "labels": labels } }),
            )?,
        )
        .await?;
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &namespace);
    policies
        .create(
            &create,
            &serde_json::from_value(json!({
                "metadata": { "name": "antidote-isolation", "labels": labels },
                "spec": {
                    "podSelector": {},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": [
                        { "from": [{ "podSelector": {} }] },
                        { "from": [{ "namespaceSelector": { "matchLabels": { "antidote.io/access": "true" } } }] },
                    ],
                    "egress": [{ "to": [{ "podSelector": {} }] }],
                },
            }))?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), &namespace);
    let mut ips = BTreeMap::new();
    for endpoint in ENDPOINTS {
        let service = services
            .create(
                &create,
                &serde_json::from_value(json!({
                    "metadata": { "name": endpoint, "labels": labels },
                    "spec": {
                        "selector": {
                            "antidote.io/live-lesson": namespace,
                            "antidote.io/endpoint": endpoint,
                        },
                        "ports": [{ "name": "ssh-22", "port": 22, "targetPort": 22, "protocol": "TCP" }],
                    },
                }))?,
            )
            .await?;
        let ip = service.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
        ips.insert(endpoint, ip);
    }
    let hosts: Value = ips
        .iter()
        .map(|(name, ip)| json!({ "ip": ip, "hostnames": [name] }))
        .collect();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    for index in 0..ENDPOINTS.len() {
        pods.create(
            &create,
            &serde_json::from_value(pod(&namespace, index, &hosts))?,
        )
        .await?;
    }
    let created = start.elapsed();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let runs = |pod: Option<&Pod>| {
        pod.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            s.phase.as_deref() == Some("Running")
                && s.pod_ip.as_ref().is_some_and(|ip| !ip.is_empty())
        })
    };
    let mut addresses = Vec::new();
    for endpoint in ENDPOINTS {
        let pod = tokio::time::timeout(PATIENCE, await_condition(pods.clone(), endpoint, runs))
            .await
            .with_context(|| format!("pod {namespace}/{endpoint} never ran"))??
            .with_context(|| format!("pod {namespace}/{endpoint} is gone"))?;
        let ip = pod.status.and_then(|s| s.pod_ip).unwrap_or_default();
        addresses.push((endpoint, ip));
    }
    let running = start.elapsed();
    for (endpoint, ip) in addresses {
        until_ready(&format!("{ip}:22"), Expect::SshBanner, deadline)
            .await
            .map_err(|err| anyhow::anyhow!("{namespace}/{endpoint} at {ip}:22: {err}"))?;
    }
    Ok((created, running))
}

/// Deletes a baseline namespace and waits until it is gone (as agent-k8s's Deprovision does).
async fn baseline_remove(client: kube::Client, namespace: String) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client);
    let uid = namespaces
        .get(&namespace)
        .await?
        .metadata
        .uid
        .context("a namespace without uid")?;
    namespaces
        .delete(&namespace, &DeleteParams::foreground())
        .await?;
    tokio::time::timeout(
        PATIENCE,
        await_condition(namespaces, &namespace, is_deleted(&uid)),
    )
    .await
    .with_context(|| format!("namespace {namespace} was never deleted"))??;
    Ok(())
}

/// The CPU time (user and system) a child process has used so far, from `/proc/PID/stat`
/// (in clock ticks of 1/100 s, Linux's `USER_HZ`); NaN where it cannot be read.
fn cpu_seconds(process: &Process) -> f64 {
    let Some(stat) = process
        .pid()
        .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
    else {
        return f64::NAN;
    };
    // The fields after the command name (which may hold spaces, inside parentheses): state is
    // field 3, utime 14 and stime 15.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    match (ticks(11), ticks(12)) {
        (Some(user), Some(system)) => (user + system) / 100.0,
        _ => f64::NAN,
    }
}

/// The namespaces of this bench's instances still on the cluster.
async fn namespaces_left(client: &kube::Client) -> anyhow::Result<Vec<String>> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut left = Vec::new();
    for instance in [INSTANCE, "k8s-bench-routing"] {
        let list = namespaces
            .list(&ListParams::default().labels(&format!("antidote.io/instance={instance}")))
            .await?;
        left.extend(list.into_iter().filter_map(|ns| ns.metadata.name));
    }
    Ok(left)
}

/// Deletes whatever namespaces of this bench's instances a failed run left (only those).
async fn remove_leftovers(client: &kube::Client) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for name in namespaces_left(client).await? {
        match namespaces.delete(&name, &DeleteParams::foreground()).await {
            Ok(_) | Err(kube::Error::Api(_)) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}
