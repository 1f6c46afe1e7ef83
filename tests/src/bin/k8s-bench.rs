//! `k8s-bench`: agent-k8s's speed against plain kube-rs calls, measured in the same run.
//!
//! Each round, interleaved (the baseline first in odd rounds, the scheduler first in even ones):
//! the baseline creates N three-pod "lessons" with plain kube-rs calls
//! and C concurrent clients (a namespace, a NetworkPolicy, three pods and three Services; a watch
//! until each pod runs; an SSH banner read from each pod's address), then deletes the
//! namespaces and waits until they are gone; N `three-pods` live lessons go through the
//! scheduler and agent-k8s at the same concurrency (session → request → watch until READY) and
//! are deleted (until gone). It prints both wall times and their ratios.
//!
//! Needs the test control plane (`export "$(tests/k8s/controlplane.sh start | tail -n1)"`); it
//! starts its own fake kubelet, agent-k8s and scheduler. Build with
//! `cargo build --release --workspace --bins`.

use std::time::Duration;

use antidote_proto::sdk::probe::{Expect, until_ready};
use antidote_tests::{Process, Ratios, Scheduler, fan_out, workspace_bin};
use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::conditions::{is_deleted, is_pod_running};
use kube::runtime::wait::await_condition;
use serde_json::json;

const INSTANCE: &str = "k8s-bench";
const ENDPOINTS: [&str; 3] = ["alpha", "bravo", "charlie"];
const PATIENCE: Duration = Duration::from_secs(180);

#[derive(Parser)]
#[command(name = "k8s-bench", about = "agent-k8s against plain kube-rs calls")]
struct Args {
    /// Lessons per round.
    #[arg(long, default_value_t = 100)]
    lessons: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    /// Rounds (baseline and scheduler alternate within each).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Keep the directory with the fake kubelet's, agent's and scheduler's logs (its path is
    /// printed) instead of removing it at the end: for `RUST_LOG=agent_k8s=debug` timings.
    #[arg(long)]
    keep_logs: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = kube::Client::try_default().await.context(
        "no Kubernetes API: run `tests/k8s/controlplane.sh start` and export the KUBECONFIG it prints",
    )?;
    let dir = tempfile::tempdir()?;
    let _kubelet = Process::spawn(
        &workspace_bin("fake-kubelet"),
        &[
            "--instance".into(),
            INSTANCE.into(),
            "--node".into(),
            "node-k8s-bench".into(),
            "--ip-prefix".into(),
            "127.91".into(),
        ],
        dir.path().join("fake-kubelet.log"),
    )
    .await?;
    let agent = Process::spawn(
        &workspace_bin("agent-k8s"),
        &["--listen".into(), "127.0.0.1:0".into()],
        dir.path().join("agent-k8s.log"),
    )
    .await?;
    let curriculum =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/k8s-curriculum");
    let config = format!(
        "instance_id = \"{INSTANCE}\"\ncurriculum = \"{}\"\ntier = \"prod\"\n\
         [limits]\nsessions_per_ip = 0\n[reconciler]\npoll_interval = \"500ms\"\n\
         provision_timeout = \"4m\"\n[[agents]]\nname = \"k8s\"\naddress = \"{}\"\n",
        curriculum.display(),
        agent.url()
    );
    let scheduler = Scheduler::start(dir.path(), &config).await?;
    let clients = scheduler.clients.clone();
    // Warm up: one lesson through each path, so the first round pays no first-use costs.
    let id = clients
        .request(&clients.session().await?, "three-pods", 0)
        .await?
        .id;
    clients.ready(&id).await?;
    clients.delete(&id, PATIENCE).await?;
    baseline_lesson(&client, "bench-warm-up".into()).await?;
    baseline_remove(&client, "bench-warm-up".into()).await?;

    println!(
        "k8s-bench: {} lessons of 3 pods, 3 services and a policy per round, concurrency {}, {} rounds",
        args.lessons, args.concurrency, args.rounds
    );
    let mut ratios = Ratios::default();
    for round in 1..=args.rounds {
        // The first path alternates: whatever the control plane still does after a round's
        // teardown (garbage collection, etcd compaction) falls on each path in turn.
        let (baseline, scheduler) = if round % 2 == 1 {
            let baseline = baseline(&client, &args, round).await?;
            let scheduler = clients
                .lifecycles("three-pods", args.lessons, args.concurrency, PATIENCE)
                .await?;
            (baseline, scheduler)
        } else {
            let scheduler = clients
                .lifecycles("three-pods", args.lessons, args.concurrency, PATIENCE)
                .await?;
            (baseline(&client, &args, round).await?, scheduler)
        };
        ratios.round(round, baseline, scheduler);
    }
    ratios.print_medians();
    if args.keep_logs {
        println!("logs kept in {}", dir.keep().display());
    }
    Ok(())
}

async fn baseline(
    client: &kube::Client,
    args: &Args,
    round: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let name = |i: usize| format!("bench-r{round}-{i}");
    let up = fan_out(args.lessons, args.concurrency, |i| {
        baseline_lesson(client, name(i))
    })
    .await?;
    let down = fan_out(args.lessons, args.concurrency, |i| {
        baseline_remove(client, name(i))
    })
    .await?;
    Ok((up, down))
}

/// One lesson's worth of Kubernetes work with plain kube-rs calls: the namespace, a
/// deny-by-default policy, three pods (kept on the first one's node) and their Services; each
/// pod watched until it runs and its SSH banner read from its address.
fn baseline_lesson(
    client: &kube::Client,
    namespace: String,
) -> impl Future<Output = anyhow::Result<()>> + Send + 'static {
    let client = client.clone();
    async move {
        let labels = json!({ "antidote.io/instance": INSTANCE, "antidote.io/bench": "baseline" });
        let create = PostParams::default();
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &create,
                &serde_json::from_value(json!({
                    "metadata": { "name": namespace, "labels": labels },
                }))?,
            )
            .await?;
        let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &namespace);
        policies
            .create(
                &create,
                &serde_json::from_value(json!({
                    "metadata": { "name": "isolation", "labels": labels },
                    "spec": {
                        "podSelector": {},
                        "policyTypes": ["Ingress", "Egress"],
                        "ingress": [{ "from": [{ "podSelector": {} }] }],
                        "egress": [
                            { "to": [{ "podSelector": {} }] },
                            { "to": [{ "namespaceSelector": {} }],
                              "ports": [{ "protocol": "UDP", "port": 53 }] },
                        ],
                    },
                }))?,
            )
            .await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let services: Api<Service> = Api::namespaced(client.clone(), &namespace);
        for (index, endpoint) in ENDPOINTS.into_iter().enumerate() {
            let mut pod = json!({
                "metadata": {
                    "name": endpoint,
                    "labels": {
                        "antidote.io/instance": INSTANCE,
                        "antidote.io/endpoint": endpoint,
                    },
                },
                "spec": {
                    "automountServiceAccountToken": false,
                    "enableServiceLinks": false,
                    "containers": [{
                        "name": endpoint,
                        "image": "antidote/busybox:latest",
                        "ports": [{ "name": "ssh-22", "containerPort": 22 }],
                    }],
                },
            });
            if index > 0 {
                pod["spec"]["affinity"] = json!({ "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [{
                        "labelSelector": { "matchLabels": { "antidote.io/endpoint": ENDPOINTS[0] } },
                        "topologyKey": "kubernetes.io/hostname",
                    }],
                } });
            }
            pods.create(&create, &serde_json::from_value(pod)?).await?;
            services
                .create(
                    &create,
                    &serde_json::from_value(json!({
                        "metadata": { "name": endpoint, "labels": labels },
                        "spec": {
                            "selector": { "antidote.io/endpoint": endpoint },
                            "ports": [{ "name": "ssh-22", "port": 22 }],
                        },
                    }))?,
                )
                .await?;
        }
        let deadline = tokio::time::Instant::now() + PATIENCE;
        for endpoint in ENDPOINTS {
            let pod = tokio::time::timeout(
                PATIENCE,
                await_condition(pods.clone(), endpoint, is_pod_running()),
            )
            .await
            .with_context(|| format!("pod {namespace}/{endpoint} never ran"))??
            .with_context(|| format!("pod {namespace}/{endpoint} is gone"))?;
            let ip = pod
                .status
                .and_then(|s| s.pod_ip)
                .with_context(|| format!("pod {namespace}/{endpoint} runs without an address"))?;
            until_ready(&format!("{ip}:22"), Expect::SshBanner, deadline)
                .await
                .map_err(|err| anyhow::anyhow!("{namespace}/{endpoint} at {ip}:22: {err}"))?;
        }
        Ok(())
    }
}

/// Deletes a baseline namespace and waits until it is gone (as agent-k8s's Deprovision does).
fn baseline_remove(
    client: &kube::Client,
    namespace: String,
) -> impl Future<Output = anyhow::Result<()>> + Send + 'static {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    async move {
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
}
