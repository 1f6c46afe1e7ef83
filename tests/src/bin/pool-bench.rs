//! `pool-bench`: request→READY through the public API for a lesson with a warm pool against a
//! lesson without one (`--cold-lesson`, by default another lesson: hello-web, one endpoint, so
//! on agent-docker the cold side boots less than the pooled lesson would), in the same run.
//!
//! One scheduler and one agent (the test agent with `--boot-delay` standing for a lesson's boot
//! time, agent-docker with `--docker`, or agent-k8s on the test node with `--k8s`: KUBECONFIG
//! exported, images imported, `--image-pull-policy Never`; its pods request 50 millicpu each,
//! so size `--requests` to what the node holds, e.g. `--requests 8 --lesson hello-web
//! --cold-lesson netcat-toolbox`). `--lesson` has a warm pool as large as a round's
//! requests, filled before each round; `--cold-lesson` has none. Each round, `--requests` fresh
//! sessions ask for the pooled lesson, then as many for the cold one, at `--concurrency`; the
//! time from sending the request to READY (the answer itself for a hit, the watch otherwise) is
//! recorded, and every live lesson is deleted after its round. Prints p50/p90/p99 per side and
//! the pooled side's hits. At the end the pool shrinks to nothing and its members are removed,
//! so nothing of the bench stays on the agent.
//!
//! `cargo build --release --workspace --bins`, then `target/release/pool-bench`.

use std::time::{Duration, Instant};

use antidote_proto::api::v1 as api;
use antidote_tests::{Clients, Process, Scheduler, example_curriculum, fan_out, workspace_bin};
use clap::Parser;

/// The scheduler's instance id: the label of everything the agent makes for this bench.
const INSTANCE: &str = "pool-bench";

#[derive(Parser)]
#[command(
    name = "pool-bench",
    about = "Pooled against cold request→READY latency"
)]
struct Args {
    /// Requests per round (and the pool's size).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Rounds of (pooled, cold).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The test agent's boot delay (a lesson's boot time); ignored with `--docker` and `--k8s`.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    boot_delay: Duration,
    /// Run agent-docker (DOCKER_HOST) instead of the test agent.
    #[arg(long, conflicts_with = "k8s")]
    docker: bool,
    /// Run agent-k8s on the cluster KUBECONFIG names (the test node: images imported, pulls
    /// never) instead of the test agent.
    #[arg(long)]
    k8s: bool,
    /// The pooled lesson.
    #[arg(long, default_value = "routing-basics")]
    lesson: String,
    /// The lesson requested cold (no pool).
    #[arg(long, default_value = "hello-web")]
    cold_lesson: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let agent = if args.k8s {
        Process::spawn(
            &workspace_bin("agent-k8s"),
            &[
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--image-pull-policy".into(),
                "Never".into(),
            ],
            dir.path().join("agent.log"),
        )
        .await?
    } else if args.docker {
        Process::spawn(
            &workspace_bin("agent-docker"),
            &["--listen".into(), "127.0.0.1:0".into()],
            dir.path().join("agent.log"),
        )
        .await?
    } else {
        Process::spawn(
            &workspace_bin("test-agent"),
            &[
                "--boot-delay".into(),
                humantime::format_duration(args.boot_delay).to_string(),
            ],
            dir.path().join("agent.log"),
        )
        .await?
    };
    let config = format!(
        r#"instance_id = "{INSTANCE}"
curriculum = "{curriculum}"
tier = "local"
[limits]
sessions_per_ip = 0
watches_per_address = 4096
[reconciler]
backoff_initial = "50ms"
backoff_max = "1s"
[pools]
interval = "200ms"
batch = 64
[[pools.lessons]]
lesson = "{lesson}"
size = {size}
[[agents]]
name = "agent"
address = "{agent}"
"#,
        curriculum = example_curriculum().display(),
        lesson = args.lesson,
        size = args.requests,
        agent = agent.url(),
    );
    let scheduler = Scheduler::start(dir.path(), &config).await?;
    let measured = measure(&scheduler.clients, &args).await;
    // The pool's members would outlive the scheduler on the agent (unclaimed, never reaped):
    // the pool shrinks to nothing and its members are removed before the bench ends.
    let drained = drain(&scheduler.clients, &args.lesson).await;
    drop(scheduler);
    if args.k8s {
        remove_namespaces().await?;
    }
    measured.and(drained)
}

/// The rounds, and their summary.
async fn measure(c: &Clients, args: &Args) -> anyhow::Result<()> {
    let mut pooled_all = Vec::new();
    let mut cold_all = Vec::new();
    for round in 1..=args.rounds {
        wait_for_pool(c, &args.lesson, args.requests).await?;
        let (pooled, hits) = round_of(c, &args.lesson, args).await?;
        let (cold, _) = round_of(c, &args.cold_lesson, args).await?;
        println!(
            "round {round}: pooled {} (hits {hits}/{}), cold {}",
            summary(&pooled),
            args.requests,
            summary(&cold)
        );
        pooled_all.extend(pooled);
        cold_all.extend(cold);
    }
    println!(
        "all rounds, concurrency {}: pooled {}; cold {}",
        args.concurrency,
        summary(&pooled_all),
        summary(&cold_all)
    );
    Ok(())
}

/// Sets the pool of `lesson` to size 0 and waits until none of its live lessons is left.
async fn drain(c: &Clients, lesson: &str) -> anyhow::Result<()> {
    c.admin
        .clone()
        .set_pool(api::SetPoolRequest {
            lesson_slug: lesson.into(),
            stage: 0,
            size: 0,
            windows: Vec::new(),
        })
        .await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = c
            .admin
            .clone()
            .list_live_lessons(api::AdminListLiveLessonsRequest {
                lesson_slug: lesson.into(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .live_lessons
            .len();
        if left == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{left} pool members of {lesson} were never removed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// On agent-k8s: deletes whatever namespaces of this bench's instance are left (after a
/// failed run), and only those.
async fn remove_namespaces() -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, DeleteParams, ListParams};
    let namespaces: Api<Namespace> = Api::all(kube::Client::try_default().await?);
    let left = namespaces
        .list(&ListParams::default().labels(&format!("antidote.io/instance={INSTANCE}")))
        .await?;
    for name in left.into_iter().filter_map(|ns| ns.metadata.name) {
        eprintln!("pool-bench: removing namespace {name}, left by the run");
        match namespaces.delete(&name, &DeleteParams::foreground()).await {
            Ok(_) | Err(kube::Error::Api(_)) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

/// Waits until the pool has `size` READY members.
async fn wait_for_pool(c: &Clients, lesson: &str, size: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let pools = c
            .admin
            .clone()
            .list_pools(api::ListPoolsRequest {})
            .await?
            .into_inner()
            .pools;
        if pools
            .iter()
            .any(|p| p.lesson_slug == lesson && p.ready as usize >= size && p.starting == 0)
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the pool never filled: {pools:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One round: fresh sessions ask for `lesson`; request→READY per request, and how many were
/// READY in the answer. Every live lesson is deleted afterwards.
async fn round_of(
    c: &Clients,
    lesson: &str,
    args: &Args,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let mut sessions = Vec::new();
    for _ in 0..args.requests {
        sessions.push(c.session().await?);
    }
    let results = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    fan_out(args.requests, args.concurrency, |i| {
        let (c, session, lesson, results) = (
            c.clone(),
            sessions[i].clone(),
            lesson.to_owned(),
            results.clone(),
        );
        async move {
            let start = Instant::now();
            let answer = c.request(&session, &lesson, 0).await?;
            let hit = answer.status() == api::LiveLessonStatus::Ready;
            if !hit {
                c.ready(&answer.id).await?;
            }
            results
                .lock()
                .expect("not poisoned")
                .push((start.elapsed(), hit, answer.id));
            Ok(())
        }
    })
    .await?;
    let results = std::mem::take(&mut *results.lock().expect("not poisoned"));
    let hits = results.iter().filter(|(_, hit, _)| *hit).count();
    let ids: Vec<String> = results.iter().map(|(_, _, id)| id.clone()).collect();
    fan_out(ids.len(), args.concurrency, |i| {
        let (c, id) = (c.clone(), ids[i].clone());
        async move { c.delete(&id, Duration::from_secs(300)).await }
    })
    .await?;
    Ok((results.into_iter().map(|(took, _, _)| took).collect(), hits))
}

fn summary(latencies: &[Duration]) -> String {
    let mut sorted = latencies.to_vec();
    sorted.sort();
    let at = |q: f64| {
        let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[i]
    };
    format!("p50 {:?} p90 {:?} p99 {:?}", at(0.50), at(0.90), at(0.99))
}
