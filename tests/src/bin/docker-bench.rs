//! `docker-bench`: agent-docker's speed against the bare Docker API, measured in the same run.
//!
//! Each round, interleaved: the baseline creates N single-endpoint "lessons" straight through
//! the Docker API with C concurrent clients (a network, a container publishing port 8080 on
//! 127.0.0.1, start, hello-web's stage-0 configuration script run in it by exec as agent-docker
//! runs it, wait until HTTP answers), then removes them (container, network); then the
//! same number of `hello-web` live lessons go through the scheduler's public API at the same
//! concurrency (session → request → watch until READY), and are deleted (until gone). It prints
//! both wall times and their ratios.
//!
//! With `--checks N`, instead: the time of a stage check on agent-docker. One `routing-basics`
//! live lesson at stage 0, made to pass by its solutions (TestStage), then N rounds, each
//! timing, in an order that alternates: a learner's CheckStage through the public gRPC API (the
//! scheduler, RunChecks to the agent, its exec of `stage0/checks/client.sh` in the client
//! container: `ip route get` and one ping across the router), the same file run directly by
//! one Docker exec in the same container (the Docker work of the check without Antidote's
//! part), and a GetLiveLesson of the live lesson (the API's round trip). It prints p50 and p99
//! of each and the ratios of the check to each baseline.
//!
//! Needs DOCKER_HOST (tests/docker/dockerd.sh start) and the images (tests/docker/images.sh).
//! Build with `cargo build --release --workspace --bins`.

use std::collections::HashMap;
use std::time::Duration;

use antidote_proto::api::v1 as api;
use antidote_sdk::probe::{Expect, until_ready};
use antidote_tests::with_token;
use antidote_tests::{Process, Ratios, Scheduler, example_curriculum, fan_out, workspace_bin};
use anyhow::Context as _;
use bollard::Docker;
use bollard::exec::StartExecResults;
use bollard::models::{
    ContainerCreateBody, ExecConfig, HostConfig, NetworkCreateRequest, PortBinding,
};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions,
};
use clap::Parser;
use futures::StreamExt as _;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "docker-bench",
    about = "agent-docker against the bare Docker API"
)]
struct Args {
    /// Lessons per round.
    #[arg(long, default_value_t = 50)]
    lessons: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    /// Rounds (baseline and scheduler alternate within each).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// The baseline skips the lesson's configuration script, doing less Docker work than the
    /// lesson needs.
    #[arg(long)]
    baseline_without_configuration: bool,
    /// Time N stage checks (routing-basics stage 0) against the same file by Docker exec and
    /// against GetLiveLesson, instead of lifecycles.
    #[arg(long, value_name = "N")]
    checks: Option<usize>,
}

/// hello-web's stage-0 configuration, which agent-docker runs by exec in its container.
fn configuration() -> anyhow::Result<String> {
    let path = example_curriculum().join("lessons/hello-web/stage0/configs/web.sh");
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let docker = Docker::connect_with_defaults()?.negotiate_version().await.context(
        "no Docker engine: run `tests/docker/dockerd.sh start` and export the DOCKER_HOST it prints",
    )?;
    let dir = tempfile::tempdir()?;
    let privileged =
        std::env::var("ANTIDOTE_DOCKER_TRUSTED_PRIVILEGED").unwrap_or_else(|_| "false".into());
    let agent = Process::spawn(
        &workspace_bin("agent-docker"),
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--trusted-privileged".into(),
            privileged,
        ],
        dir.path().join("agent.log"),
    )
    .await?;
    let config = format!(
        "instance_id = \"docker-bench\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
         [limits]\nsessions_per_ip = 0\nchecks_per_minute = 0\n[reconciler]\npoll_interval = \"500ms\"\n\
         [[agents]]\nname = \"docker\"\naddress = \"{}\"\n",
        example_curriculum().display(),
        agent.url()
    );
    let scheduler = Scheduler::start(dir.path(), &config).await?;
    let clients = scheduler.clients.clone();
    if let Some(checks) = args.checks {
        return check_times(&docker, &clients, checks).await;
    }
    // Warm up: one lesson through each path, so the first round pays no first-use costs.
    let id = clients
        .request(&clients.session().await?, "hello-web", 0)
        .await?
        .id;
    clients.ready(&id).await?;
    clients.delete(&id, Duration::from_secs(120)).await?;
    let script = (!args.baseline_without_configuration)
        .then(configuration)
        .transpose()?;
    baseline_lesson(&docker, 0, script.as_deref(), true).await?;

    println!(
        "docker-bench: {} single-endpoint HTTP lessons per round, concurrency {}, {} rounds",
        args.lessons, args.concurrency, args.rounds
    );
    let mut ratios = Ratios::default();
    for round in 1..=args.rounds {
        let baseline = baseline(&docker, &args, script.as_deref()).await?;
        let scheduler = clients
            .lifecycles(
                "hello-web",
                args.lessons,
                args.concurrency,
                Duration::from_secs(120),
            )
            .await?;
        ratios.round(round, baseline, scheduler);
    }
    ratios.print_medians();
    Ok(())
}

async fn baseline(
    docker: &Docker,
    args: &Args,
    script: Option<&str>,
) -> anyhow::Result<(Duration, Duration)> {
    let up = fan_out(args.lessons, args.concurrency, |i| {
        let docker = docker.clone();
        let script = script.map(str::to_owned);
        async move { baseline_lesson(&docker, i, script.as_deref(), false).await }
    })
    .await?;
    let down = fan_out(args.lessons, args.concurrency, |i| {
        let docker = docker.clone();
        async move { baseline_remove(&docker, i).await }
    })
    .await?;
    Ok((up, down))
}

fn baseline_name(i: usize) -> String {
    format!("bench-baseline-{i}")
}

/// One lesson's worth of Docker work, done directly: network, container, start, the
/// configuration `script` (if any) by exec, HTTP answers.
async fn baseline_lesson(
    docker: &Docker,
    i: usize,
    script: Option<&str>,
    and_remove: bool,
) -> anyhow::Result<()> {
    let name = baseline_name(i);
    docker
        .create_network(NetworkCreateRequest {
            name: name.clone(),
            driver: Some("bridge".into()),
            labels: Some(HashMap::from([(
                "antidote.io/bench".to_owned(),
                "baseline".to_owned(),
            )])),
            ..Default::default()
        })
        .await?;
    docker
        .create_container(
            Some(CreateContainerOptions {
                name: Some(name.clone()),
                ..Default::default()
            }),
            ContainerCreateBody {
                image: Some("antidote/busybox:latest".into()),
                labels: Some(HashMap::from([(
                    "antidote.io/bench".to_owned(),
                    "baseline".to_owned(),
                )])),
                exposed_ports: Some(vec!["8080/tcp".into()]),
                host_config: Some(HostConfig {
                    network_mode: Some(name.clone()),
                    port_bindings: Some(HashMap::from([(
                        "8080/tcp".to_owned(),
                        Some(vec![PortBinding {
                            host_ip: Some("127.0.0.1".into()),
                            host_port: Some(String::new()),
                        }]),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await?;
    docker.start_container(&name, None).await?;
    let info = docker.inspect_container(&name, None).await?;
    let port = info
        .network_settings
        .and_then(|n| n.ports)
        .and_then(|p| p.get("8080/tcp").cloned().flatten())
        .and_then(|b| b.first().and_then(|b| b.host_port.clone()))
        .context("port 8080 was not published")?;
    if let Some(script) = script {
        configure(docker, &name, script).await?;
    }
    let address = format!("127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    until_ready(&address, Expect::Http, deadline)
        .await
        .map_err(|err| anyhow::anyhow!("{address} never answered HTTP: {err}"))?;
    if and_remove {
        baseline_remove(docker, i).await?;
    }
    Ok(())
}

/// Runs `script` in `container` with `sh -c`, its output read to the end, and checks that it
/// exited 0: exec create, start (attached), inspect.
async fn configure(docker: &Docker, container: &str, script: &str) -> anyhow::Result<()> {
    let exec = docker
        .create_exec(
            container,
            ExecConfig {
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                cmd: Some(vec!["sh".into(), "-c".into(), script.into()]),
                ..Default::default()
            },
        )
        .await?;
    if let StartExecResults::Attached { mut output, .. } = docker.start_exec(&exec.id, None).await?
    {
        while let Some(chunk) = output.next().await {
            chunk?;
        }
    }
    let code = docker.inspect_exec(&exec.id).await?.exit_code;
    anyhow::ensure!(
        code == Some(0),
        "the configuration in {container} exited {code:?}"
    );
    Ok(())
}

async fn baseline_remove(docker: &Docker, i: usize) -> anyhow::Result<()> {
    let name = baseline_name(i);
    docker
        .remove_container(
            &name,
            Some(RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await?;
    docker.remove_network(&name).await?;
    Ok(())
}

/// The `routing-basics` check the learner's Check runs (stage 0, on the client).
fn check_file() -> anyhow::Result<String> {
    let path = example_curriculum().join("lessons/routing-basics/stage0/checks/client.sh");
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// `--checks N`: N interleaved rounds of CheckStage, the check file by direct Docker exec and
/// GetLiveLesson on one routing-basics live lesson whose stage 0 passes.
async fn check_times(
    docker: &Docker,
    clients: &antidote_tests::Clients,
    rounds: usize,
) -> anyhow::Result<()> {
    anyhow::ensure!(rounds > 0, "--checks needs at least one check");
    let script = check_file()?;
    let id = clients
        .request(&clients.session().await?, "routing-basics", 0)
        .await?
        .id;
    clients.ready(&id).await?;
    let solved = clients
        .admin
        .clone()
        .test_stage(api::TestStageRequest {
            live_lesson_id: id.clone(),
            files: api::StageFiles::Solutions as i32,
        })
        .await?
        .into_inner();
    anyhow::ensure!(
        solved.passed,
        "routing-basics' solutions failed: {solved:?}"
    );
    let container = endpoint_container(docker, &id, "client").await?;

    let check = || async {
        let request = with_token(
            api::CheckStageRequest { id: id.clone() },
            clients.tokens.of_lesson(&id),
        );
        let started = Instant::now();
        let run = clients
            .lessons
            .clone()
            .check_stage(request)
            .await?
            .into_inner();
        let took = started.elapsed();
        anyhow::ensure!(run.passed, "the check failed: {run:?}");
        let agent = run
            .endpoints
            .first()
            .and_then(|e| e.duration)
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default();
        Ok::<_, anyhow::Error>((took, agent))
    };
    let exec = || async {
        let started = Instant::now();
        configure(docker, &container, &script).await?;
        Ok::<_, anyhow::Error>(started.elapsed())
    };
    let get = || async {
        let started = Instant::now();
        clients.get(&id).await?;
        Ok::<_, anyhow::Error>(started.elapsed())
    };
    // Warm up each path.
    for _ in 0..5 {
        check().await?;
        exec().await?;
        get().await?;
    }
    println!(
        "docker-bench --checks: {rounds} rounds on routing-basics stage 0 (client.sh), each: \
         CheckStage, the file by Docker exec, GetLiveLesson (order alternating)"
    );
    let (mut checks, mut inside, mut execs, mut gets) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        if round % 2 == 0 {
            let (took, agent) = check().await?;
            checks.push(took);
            inside.push(agent);
            execs.push(exec().await?);
        } else {
            execs.push(exec().await?);
            let (took, agent) = check().await?;
            checks.push(took);
            inside.push(agent);
        }
        gets.push(get().await?);
    }
    clients.delete(&id, Duration::from_secs(120)).await?;

    let (check_p50, check_p99) = quantiles(&mut checks);
    let (inside_p50, inside_p99) = quantiles(&mut inside);
    let (exec_p50, exec_p99) = quantiles(&mut execs);
    let (get_p50, get_p99) = quantiles(&mut gets);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "CheckStage:              p50 {:.2} ms, p99 {:.2} ms",
        ms(check_p50),
        ms(check_p99)
    );
    println!(
        "  the file, as the agent timed it: p50 {:.2} ms, p99 {:.2} ms",
        ms(inside_p50),
        ms(inside_p99)
    );
    println!(
        "the file by Docker exec: p50 {:.2} ms, p99 {:.2} ms",
        ms(exec_p50),
        ms(exec_p99)
    );
    println!(
        "GetLiveLesson:           p50 {:.2} ms, p99 {:.2} ms",
        ms(get_p50),
        ms(get_p99)
    );
    println!(
        "ratios: CheckStage / Docker exec p50 {:.2}, p99 {:.2}; CheckStage - Docker exec at p50 {:.2} ms; \
         CheckStage / GetLiveLesson p50 {:.1}",
        ms(check_p50) / ms(exec_p50),
        ms(check_p99) / ms(exec_p99),
        ms(check_p50) - ms(exec_p50),
        ms(check_p50) / ms(get_p50)
    );
    Ok(())
}

/// p50 and p99 (nearest rank) of `values`.
fn quantiles(values: &mut [Duration]) -> (Duration, Duration) {
    values.sort();
    let at = |q: f64| {
        let i = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1;
        values[i]
    };
    (at(0.50), at(0.99))
}

/// The container of endpoint `endpoint` of live lesson `id`, found by agent-docker's labels.
async fn endpoint_container(docker: &Docker, id: &str, endpoint: &str) -> anyhow::Result<String> {
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![
            format!("antidote.io/live-lesson={id}"),
            format!("antidote.io/endpoint={endpoint}"),
        ],
    )]);
    let found = docker
        .list_containers(Some(ListContainersOptions {
            filters: Some(filters),
            ..Default::default()
        }))
        .await?;
    found
        .first()
        .and_then(|c| c.id.clone())
        .with_context(|| format!("no container of endpoint {endpoint} of live lesson {id}"))
}
