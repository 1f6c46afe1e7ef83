//! `loadgen`: drives many concurrent lesson lifecycles (session → request → READY → delete)
//! through the scheduler's public API against a test agent that does no work (`--null`), and
//! prints lifecycles per second and request→READY latencies.
//!
//! Machines here are noisy, so every round also measures a baseline in the same run: the same
//! number of lifecycles done by calling the agent directly (Provision → Deprovision) at the same
//! concurrency. Rounds alternate baseline and scheduler; the ratio of the two is the scheduler's
//! overhead over the bare RPC cost.
//!
//! `--store-compare` instead puts three setups side by side in one run, each with its own null
//! agent: one scheduler on SQLite, one on PostgreSQL, and three replicas sharing one PostgreSQL
//! database (clients spread across them); rounds rotate through the three (with `--against`,
//! through the three of each binary). Each round prints, per setup, the store's write
//! transactions, write jobs and reads per lifecycle as its schedulers count them
//! (`antidote_store_*_total` on their metrics listeners; a build without the counters prints
//! none). When the server loads `pg_stat_statements`, each PostgreSQL round also prints the
//! transactions and statements the server counted per lifecycle, and the run ends with each
//! PostgreSQL setup's statements per lifecycle.
//!
//! `--against PATH` puts this build's scheduler beside another scheduler binary (say, the
//! previous commit's, copied aside), both on SQLite with a null agent each, rounds alternating
//! (and which goes first alternating too): before/after numbers from one run.
//!
//! Every mode also prints the scheduler's CPU time per lifecycle (user + system, from
//! `/proc/PID/stat` before and after each round, divided by the round's lifecycles).
//! `--live N` instead measures memory: the scheduler's resident set (`VmRSS`) after warm-up and
//! after N live lessons were made READY (and left live) on the null agent.
//!
//! Build with `cargo build --release --workspace --bins`, then run `target/release/loadgen`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use antidote_proto::agent::v1 as agent;
use antidote_proto::api::v1 as api;
use antidote_tests::{Clients, Process, Scheduler, example_curriculum, workspace_bin};
use clap::Parser;
use tokio::sync::Semaphore;

#[derive(Parser)]
#[command(
    name = "loadgen",
    about = "Lifecycle throughput and latency of the scheduler"
)]
struct Args {
    /// Lifecycles per round.
    #[arg(long, default_value_t = 4000)]
    lifecycles: usize,
    /// Lifecycles in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Rounds of (baseline, scheduler), alternating.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// HTTP/2 connections to spread the load over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Lesson to request.
    #[arg(long, default_value = "hello-web")]
    lesson: String,
    /// Reconciler workers in the scheduler.
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// Instead of the baseline, compare two schedulers in the same run: one whose agent is
    /// plaintext on loopback, one whose agent serves mTLS (certificates made here), alternating
    /// rounds; prints plaintext/mTLS throughput (the cost of mTLS, goal ≤ 1.10).
    #[arg(long, conflicts_with = "dial_in")]
    mtls: bool,
    /// Like `--mtls`, but the second agent dials in to the scheduler's agent intake over mTLS
    /// (`--connect`) instead of being dialled; prints plaintext/dial-in throughput (goal ≤ 1.10).
    #[arg(long)]
    dial_in: bool,
    /// Instead of the baseline, compare the stores in the same run: 1 scheduler on SQLite, 1 on
    /// PostgreSQL and 3 replicas on one PostgreSQL database (clients spread across them),
    /// rounds rotating; prints each one's lifecycles/s and p99 and the ratios.
    #[arg(long, conflicts_with_all = ["mtls", "dial_in"])]
    store_compare: bool,
    /// The PostgreSQL server for `--store-compare` (a maintenance URL: a database of loadgen's
    /// own is created on it for each setup, and dropped after); defaults to
    /// `ANTIDOTE_TEST_POSTGRES` (`tests/postgres/pg.sh start` prints it).
    #[arg(long, env = "ANTIDOTE_TEST_POSTGRES")]
    postgres: Option<String>,
    /// Instead of the baseline, compare this build's scheduler with the scheduler binary at
    /// this path (both on SQLite, a null agent each), rounds alternating; prints both and the
    /// ratio (this build / the other). With `--store-compare`, each of its three setups runs
    /// with both binaries.
    #[arg(long, value_name = "SCHEDULER_BINARY", conflicts_with_all = ["mtls", "dial_in"])]
    against: Option<std::path::PathBuf>,
    /// Instead of lifecycles, make this many live lessons READY (at `--concurrency`, left
    /// live) and print the scheduler's resident memory before and after (with `--against`,
    /// of both schedulers).
    #[arg(long, value_name = "N", conflicts_with_all = ["mtls", "dial_in", "store_compare"])]
    live: Option<usize>,
}

/// How the scheduler reaches its agent in a comparison run.
#[derive(Clone, Copy, PartialEq)]
enum Transport {
    /// Dialled, plaintext on loopback.
    Plaintext,
    /// Dialled, mTLS.
    Mtls,
    /// The agent dials in to the scheduler's agent intake (mTLS).
    DialIn,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Plaintext => "plaintext",
            Transport::Mtls => "mTLS",
            Transport::DialIn => "dial-in",
        }
    }
}

struct Stats {
    per_second: f64,
    p50: Duration,
    p99: Duration,
    /// The schedulers' CPU time (user + system) per operation, when measured.
    cpu: Option<Duration>,
}

fn stats(mut latencies: Vec<Duration>, elapsed: Duration) -> Stats {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Stats {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        cpu: None,
    }
}

/// The CPU time (user + system) the processes `pids` used so far, summed, from
/// `/proc/PID/stat`; `None` where that cannot be read (not Linux).
fn cpu_time(pids: &[u32]) -> Option<Duration> {
    let ticks_per_second = *CLOCK_TICKS;
    let mut total = 0u64;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command (which may hold spaces) in parentheses: state is field 3,
        // utime 14 and stime 15.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        total += utime + stime;
    }
    Some(Duration::from_secs_f64(
        total as f64 / ticks_per_second as f64,
    ))
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 on every Linux we run).
static CLOCK_TICKS: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100)
});

/// A process's resident set (`VmRSS` of `/proc/PID/status`), in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// [`run`], with the CPU time the processes `pids` used during it per operation.
async fn run_measured<F, Fut>(args: &Args, pids: &[u32], op: F) -> anyhow::Result<Stats>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Duration>> + Send + 'static,
{
    let before = cpu_time(pids);
    let mut stats = run(args, op).await?;
    stats.cpu = before
        .zip(cpu_time(pids))
        .map(|(before, after)| after.saturating_sub(before) / args.lifecycles as u32);
    Ok(stats)
}

/// CPU per lifecycle in µs, or `?`.
fn micros(cpu: Option<Duration>) -> String {
    cpu.map_or("?".into(), |cpu| format!("{:.0}", cpu.as_secs_f64() * 1e6))
}

/// The median of some values.
fn median<T: Copy + PartialOrd>(values: &[T]) -> T {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    sorted[sorted.len() / 2]
}

// One thread: loadgen shares the two cores with the scheduler it measures, and a second worker
// only added wake-ups across threads (its CPU per lifecycle at concurrency 16: 190 -> 137 µs).
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.mtls {
        return compare(&args, Transport::Mtls).await;
    }
    if args.dial_in {
        return compare(&args, Transport::DialIn).await;
    }
    if args.store_compare {
        return store_compare(&args).await;
    }
    if let Some(other) = args.against.clone() {
        return against(&args, &other).await;
    }
    let dir = tempfile::tempdir()?;
    let agent_process = Process::spawn(
        &workspace_bin("test-agent"),
        &["--null".into()],
        dir.path().join("agent.log"),
    )
    .await?;
    let config = format!(
        "instance_id = \"loadgen\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
         [limits]\nsessions_per_ip = 0\n[reconciler]\nworkers = {}\n\
         [[agents]]\nname = \"null\"\naddress = \"{}\"\n",
        example_curriculum().display(),
        args.workers,
        agent_process.url()
    );
    let scheduler = Scheduler::start(dir.path(), &config).await?;
    let pids: Vec<u32> = scheduler.process.pid().into_iter().collect();
    let mut clients = Vec::new();
    for _ in 0..args.connections {
        clients.push(
            Clients::connect(scheduler.process.addr, scheduler.process.extra["admin"]).await?,
        );
    }
    let mut agents = Vec::new();
    for _ in 0..args.connections {
        agents.push(agent::backend_client::BackendClient::connect(agent_process.url()).await?);
    }
    // Warm up (and wait for the agent handshake) with one lifecycle.
    lifecycle(&clients[0], &args.lesson).await?;
    if let Some(live) = args.live {
        return memory(&args, live, &[("scheduler", &pids, &clients)]).await;
    }

    println!(
        "loadgen: {} lifecycles per round, concurrency {}, {} rounds, lesson {}",
        args.lifecycles, args.concurrency, args.rounds, args.lesson
    );
    let mut ratios = Vec::new();
    let mut scheduler_rates = Vec::new();
    let mut p99s = Vec::new();
    let mut cpus = Vec::new();
    // The other two processes on the same cores: the agent and loadgen itself (the learners).
    let others: [Vec<u32>; 2] = [
        agent_process.pid().into_iter().collect(),
        vec![std::process::id()],
    ];
    let mut others_cpu: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=args.rounds {
        let baseline = run(&args, |i| {
            let mut client = agents[i % agents.len()].clone();
            async move { direct(&mut client).await }
        })
        .await?;
        let before = others.each_ref().map(|pids| cpu_time(pids));
        let measured = run_measured(&args, &pids, |i| {
            let clients = clients[i % clients.len()].clone();
            let lesson = args.lesson.clone();
            async move { lifecycle(&clients, &lesson).await }
        })
        .await?;
        let spent: Vec<Option<Duration>> = before
            .iter()
            .zip(&others)
            .map(|(before, pids)| {
                before
                    .zip(cpu_time(pids))
                    .map(|(b, a)| a.saturating_sub(b) / args.lifecycles as u32)
            })
            .collect();
        for (kept, cpu) in others_cpu.iter_mut().zip(&spent) {
            kept.extend(*cpu);
        }
        let ratio = measured.per_second / baseline.per_second;
        println!(
            "round {round}: baseline (agent direct) {:>8.0}/s p50 {:>6.2} ms p99 {:>6.2} ms | \
             scheduler {:>8.0} lifecycles/s, request→READY p50 {:>6.2} ms p99 {:>6.2} ms, \
             CPU per lifecycle: scheduler {} µs, agent {} µs, loadgen {} µs | throughput ratio {ratio:.3}",
            baseline.per_second,
            ms(baseline.p50),
            ms(baseline.p99),
            measured.per_second,
            ms(measured.p50),
            ms(measured.p99),
            micros(measured.cpu),
            micros(spent[0]),
            micros(spent[1]),
        );
        ratios.push(ratio);
        scheduler_rates.push(measured.per_second);
        p99s.push(measured.p99);
        cpus.extend(measured.cpu);
    }
    scheduler_rates.sort_by(f64::total_cmp);
    ratios.sort_by(f64::total_cmp);
    p99s.sort();
    println!(
        "median: scheduler {:.0} lifecycles/s, request→READY p99 {:.2} ms, scheduler CPU {} µs/lifecycle, \
         scheduler/baseline throughput {:.3}",
        scheduler_rates[scheduler_rates.len() / 2],
        ms(p99s[p99s.len() / 2]),
        micros((!cpus.is_empty()).then(|| median(&cpus))),
        ratios[ratios.len() / 2]
    );
    // What the machine allows: its cores' time divided by all three processes' CPU per
    // lifecycle (the scheduler's share shows how much of the ceiling is ours).
    if !cpus.is_empty() && others_cpu.iter().all(|c| !c.is_empty()) {
        let [agent, own] = others_cpu.each_ref().map(|c| median(c));
        let scheduler = median(&cpus);
        let all = scheduler + agent + own;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!(
            "CPU per lifecycle (medians): scheduler {} µs + agent {} µs + loadgen {} µs = {} µs: \
             {cores} cores allow at most {:.0} lifecycles/s with all three on them, {:.0}/s \
             with the scheduler taking no CPU at all (the scheduler is {:.0} % of it)",
            micros(Some(scheduler)),
            micros(Some(agent)),
            micros(Some(own)),
            micros(Some(all)),
            cores as f64 / all.as_secs_f64(),
            cores as f64 / (agent + own).as_secs_f64(),
            100.0 * scheduler.as_secs_f64() / all.as_secs_f64()
        );
    }
    Ok(())
}

/// `--live N`: the resident memory of each scheduler after warm-up, then after `live` live
/// lessons were made READY on its null agent (and left live).
async fn memory(
    args: &Args,
    live: usize,
    schedulers: &[(&str, &[u32], &[Clients])],
) -> anyhow::Result<()> {
    println!(
        "loadgen --live {live}: live lessons made READY at concurrency {}",
        args.concurrency
    );
    let mut args_live = Args::parse_from(["loadgen"]);
    args_live.lifecycles = live;
    args_live.concurrency = args.concurrency;
    for (name, pids, clients) in schedulers {
        let pid = *pids
            .first()
            .ok_or_else(|| anyhow::anyhow!("{name}: no pid"))?;
        let before = rss_kib(pid).ok_or_else(|| anyhow::anyhow!("{name}: no VmRSS"))?;
        let start = Instant::now();
        let made = run(&args_live, |i| {
            let clients = clients[i % clients.len()].clone();
            let lesson = args.lesson.clone();
            async move {
                let session = clients.session().await?;
                let started = Instant::now();
                let requested = clients.request(&session, &lesson, 0).await?;
                clients.ready(&requested.id).await?;
                Ok(started.elapsed())
            }
        })
        .await?;
        let after = rss_kib(pid).ok_or_else(|| anyhow::anyhow!("{name}: no VmRSS"))?;
        println!(
            "{name}: VmRSS {:.1} MiB after warm-up, {:.1} MiB with {live} live lessons READY \
             ({:.1} KiB per live lesson; made in {:.1} s, request→READY p99 {:.2} ms)",
            before as f64 / 1024.0,
            after as f64 / 1024.0,
            after.saturating_sub(before) as f64 / live as f64,
            start.elapsed().as_secs_f64(),
            ms(made.p99),
        );
    }
    Ok(())
}

/// `--against PATH`: this build's scheduler and the one at `other`, each on SQLite with a null
/// agent of its own, rounds alternating (which goes first alternates too).
async fn against(args: &Args, other: &std::path::Path) -> anyhow::Result<()> {
    anyhow::ensure!(other.exists(), "{} does not exist", other.display());
    let dirs = [tempfile::tempdir()?, tempfile::tempdir()?];
    let this = workspace_bin("scheduler-svc");
    let database = |i: usize| dirs[i].path().join("antidote.db").display().to_string();
    let setups = [
        store_setup(
            args,
            "this build".into(),
            dirs[0].path(),
            &database(0),
            1,
            &this,
            None,
        )
        .await?,
        store_setup(
            args,
            "other".into(),
            dirs[1].path(),
            &database(1),
            1,
            other,
            None,
        )
        .await?,
    ];
    if let Some(live) = args.live {
        let pids: Vec<Vec<u32>> = setups.iter().map(Setup::pids).collect();
        let schedulers: Vec<_> = setups
            .iter()
            .zip(&pids)
            .map(|(setup, pids)| {
                (
                    setup.name.as_str(),
                    pids.as_slice(),
                    setup.clients.as_slice(),
                )
            })
            .collect();
        return memory(args, live, &schedulers).await;
    }
    println!(
        "loadgen --against {}: {} lifecycles per round, concurrency {}, {} rounds, lesson {}",
        other.display(),
        args.lifecycles,
        args.concurrency,
        args.rounds,
        args.lesson
    );
    let mut results: Vec<Vec<Stats>> = vec![Vec::new(), Vec::new()];
    for round in 1..=args.rounds {
        let order = if round % 2 == 1 { [0, 1] } else { [1, 0] };
        for s in order {
            let setup = &setups[s];
            let measured = run_measured(args, &setup.pids(), |i| {
                let clients = setup.clients[i % setup.clients.len()].clone();
                let lesson = args.lesson.clone();
                async move { lifecycle(&clients, &lesson).await }
            })
            .await?;
            results[s].push(measured);
        }
        let line: Vec<String> = setups
            .iter()
            .zip(&results)
            .map(|(setup, r)| {
                let m = r.last().expect("measured this round");
                format!(
                    "{} {:.0} lifecycles/s p50 {:.2} ms p99 {:.2} ms CPU {} µs/lifecycle",
                    setup.name,
                    m.per_second,
                    ms(m.p50),
                    ms(m.p99),
                    micros(m.cpu)
                )
            })
            .collect();
        let rate = |s: usize| results[s].last().map_or(0.0, |m| m.per_second);
        println!(
            "round {round}: {} | this/other throughput {:.3}",
            line.join(" | "),
            rate(0) / rate(1)
        );
    }
    let mut rates = Vec::new();
    for (setup, r) in setups.iter().zip(&results) {
        let rate = median(&r.iter().map(|m| m.per_second).collect::<Vec<_>>());
        let p50 = median(&r.iter().map(|m| m.p50).collect::<Vec<_>>());
        let p99 = median(&r.iter().map(|m| m.p99).collect::<Vec<_>>());
        let cpus: Vec<Duration> = r.iter().filter_map(|m| m.cpu).collect();
        println!(
            "median: {} {rate:.0} lifecycles/s, request→READY p50 {:.2} ms p99 {:.2} ms, CPU {} µs/lifecycle",
            setup.name,
            ms(p50),
            ms(p99),
            micros((!cpus.is_empty()).then(|| median(&cpus)))
        );
        rates.push(rate);
    }
    let ratios: Vec<f64> = results[0]
        .iter()
        .zip(&results[1])
        .map(|(a, b)| a.per_second / b.per_second)
        .collect();
    println!(
        "median of the rounds' ratios: this/other throughput {:.3} (medians' ratio {:.3})",
        median(&ratios),
        rates[0] / rates[1]
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs `args.lifecycles` operations at `args.concurrency`; each returns its latency.
async fn run<F, Fut>(args: &Args, op: F) -> anyhow::Result<Stats>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Duration>> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(args.lifecycles);
    for i in 0..args.lifecycles {
        let permit = permits.clone().acquire_owned().await?;
        let fut = op(i);
        tasks.push(tokio::spawn(async move {
            let result = fut.await;
            drop(permit);
            result
        }));
    }
    let mut latencies = Vec::with_capacity(tasks.len());
    for task in tasks {
        latencies.push(task.await??);
    }
    Ok(stats(latencies, start.elapsed()))
}

/// One lifecycle through the scheduler; returns request→READY.
async fn lifecycle(clients: &Clients, lesson: &str) -> anyhow::Result<Duration> {
    let session = clients.session().await?;
    let start = Instant::now();
    let requested = clients.request(&session, lesson, 0).await?;
    let ready = clients.ready(&requested.id).await?;
    let latency = start.elapsed();
    clients
        .lessons
        .clone()
        .delete_live_lesson(antidote_tests::with_token(
            api::DeleteLiveLessonRequest {
                id: ready.id.clone(),
            },
            clients.tokens.of_lesson(&ready.id),
        ))
        .await?;
    Ok(latency)
}

/// The baseline: the agent's own Provision → Deprovision, with no scheduler in between;
/// returns the Provision latency.
async fn direct(
    client: &mut agent::backend_client::BackendClient<tonic::transport::Channel>,
) -> anyhow::Result<Duration> {
    let id = uuid::Uuid::new_v4().to_string();
    let session = uuid::Uuid::new_v4().to_string();
    let spec = agent::LessonSpec {
        live_lesson_id: id.clone(),
        session_id: session.clone(),
        lesson_slug: "hello-web".into(),
        generation: 1,
        endpoints: vec![agent::Endpoint {
            name: "web".into(),
            image: Some(agent::Image {
                slug: "busybox".into(),
                ..Default::default()
            }),
            presentations: vec![agent::Presentation {
                name: "page".into(),
                r#type: agent::PresentationType::Http as i32,
                port: 8080,
            }],
            ..Default::default()
        }],
        labels: HashMap::from([
            ("antidote.io/instance".to_owned(), "baseline".to_owned()),
            ("antidote.io/live-lesson".to_owned(), id.clone()),
            ("antidote.io/session".to_owned(), session),
            ("antidote.io/generation".to_owned(), "1".to_owned()),
            ("antidote.io/lesson".to_owned(), "hello-web".to_owned()),
        ]),
        ..Default::default()
    };
    let start = Instant::now();
    client
        .provision(agent::ProvisionRequest {
            spec: Some(spec),
            new_live_lesson: true,
        })
        .await?;
    let latency = start.elapsed();
    client
        .deprovision(agent::DeprovisionRequest {
            live_lesson_id: id,
            handle: Default::default(),
        })
        .await?;
    Ok(latency)
}

/// A null test agent reached over `transport` and a scheduler driving it, in `dir`; returns
/// them with `args.connections` clients, warmed up by one lifecycle.
async fn null_pair(
    args: &Args,
    dir: &std::path::Path,
    transport: Transport,
) -> anyhow::Result<(Process, Scheduler, Vec<Clients>)> {
    use antidote_tests::pki::{Ca, Validity};
    let path = |name: &str| dir.join(name).display().to_string();
    let mut agent_args = vec!["--null".to_owned()];
    let mut tls_entry = String::new();
    let mut intake = String::new();
    if transport != Transport::Plaintext {
        let (agents_ca, scheduler_ca) = (Ca::new("agents CA"), Ca::new("scheduler CA"));
        agents_ca.write(&dir.join("agents-ca.pem"));
        scheduler_ca.write(&dir.join("scheduler-ca.pem"));
        let until = Validity::Until(2040, 1, 1);
        // Dial-in: the agent's certificate names it ("null", the name the intake admits) and
        // the intake's names the loopback address the agent dials.
        let (agent_name, server_name) = match transport {
            Transport::DialIn => ("null", "127.0.0.1"),
            _ => ("agent.loadgen.test", "agent.loadgen.test"),
        };
        agents_ca
            .issue(&[agent_name], until)
            .write(&dir.join("agent.crt"), &dir.join("agent.key"));
        scheduler_ca
            .issue(&["spiffe://loadgen.test/scheduler", server_name], until)
            .write(&dir.join("scheduler.crt"), &dir.join("scheduler.key"));
        agent_args.extend([
            "--tls-cert".into(),
            path("agent.crt"),
            "--tls-key".into(),
            path("agent.key"),
        ]);
        if transport == Transport::DialIn {
            // The agent verifies the intake with the scheduler's CA; the intake admits agents
            // certified by the agents' CA.
            agent_args.extend(["--tls-client-ca".into(), path("scheduler-ca.pem")]);
            intake = format!(
                "[agent_intake]\nlisten = \"127.0.0.1:0\"\ncert = \"{}\"\nkey = \"{}\"\n\
                 client_ca = \"{}\"\nagents = [\"null\"]\n",
                path("scheduler.crt"),
                path("scheduler.key"),
                path("agents-ca.pem"),
            );
        } else {
            agent_args.extend([
                "--tls-client-ca".into(),
                path("scheduler-ca.pem"),
                "--tls-require-identity".into(),
                "spiffe://loadgen.test/scheduler".into(),
            ]);
            tls_entry = format!(
                "tls = {{ ca = \"{}\", cert = \"{}\", key = \"{}\", server_name = \"agent.loadgen.test\" }}\n",
                path("agents-ca.pem"),
                path("scheduler.crt"),
                path("scheduler.key")
            );
        }
    }
    let (agent, scheduler) = if transport == Transport::DialIn {
        let config = format!(
            "instance_id = \"loadgen\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
             [limits]\nsessions_per_ip = 0\n[reconciler]\nworkers = {}\n{intake}",
            example_curriculum().display(),
            args.workers,
        );
        let scheduler = Scheduler::start(dir, &config).await?;
        let addr = scheduler
            .process
            .extra
            .get("agent intake")
            .copied()
            .ok_or_else(|| anyhow::anyhow!("the scheduler printed no agent intake address"))?;
        agent_args.extend(["--connect".into(), format!("https://{addr}")]);
        let agent = Process::spawn(
            &workspace_bin("test-agent"),
            &agent_args,
            dir.join("agent.log"),
        )
        .await?;
        (agent, scheduler)
    } else {
        let agent = Process::spawn(
            &workspace_bin("test-agent"),
            &agent_args,
            dir.join("agent.log"),
        )
        .await?;
        let config = format!(
            "instance_id = \"loadgen\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
             [limits]\nsessions_per_ip = 0\n[reconciler]\nworkers = {}\n\
             [[agents]]\nname = \"null\"\naddress = \"{}://{}\"\n{tls_entry}",
            example_curriculum().display(),
            args.workers,
            if transport == Transport::Mtls {
                "https"
            } else {
                "http"
            },
            agent.addr,
        );
        (agent, Scheduler::start(dir, &config).await?)
    };
    let mut clients = Vec::new();
    for _ in 0..args.connections {
        clients.push(
            Clients::connect(scheduler.process.addr, scheduler.process.extra["admin"]).await?,
        );
    }
    // Warm up (and wait for the agent's handshake or its dial-in) with one lifecycle.
    let warm = Instant::now();
    loop {
        match lifecycle(&clients[0], &args.lesson).await {
            Ok(_) => break,
            Err(_) if warm.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => return Err(err),
        }
    }
    Ok((agent, scheduler, clients))
}

/// `--mtls` / `--dial-in`: a plaintext scheduler and one reaching its agent over `other`, side
/// by side, rounds alternating.
async fn compare(args: &Args, other: Transport) -> anyhow::Result<()> {
    let (plain_dir, other_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let (_plain_agent, _plain, plain) =
        null_pair(args, plain_dir.path(), Transport::Plaintext).await?;
    let (_other_agent, _other, others) = null_pair(args, other_dir.path(), other).await?;
    let flag = if other == Transport::Mtls {
        "--mtls"
    } else {
        "--dial-in"
    };
    println!(
        "loadgen {flag}: {} lifecycles per round, concurrency {}, {} rounds, lesson {}",
        args.lifecycles, args.concurrency, args.rounds, args.lesson
    );
    let mut ratios = Vec::new();
    for round in 1..=args.rounds {
        let mut rates = Vec::new();
        for clients in [&plain, &others] {
            let measured = run(args, |i| {
                let clients = clients[i % clients.len()].clone();
                let lesson = args.lesson.clone();
                async move { lifecycle(&clients, &lesson).await }
            })
            .await?;
            rates.push(measured);
        }
        let ratio = rates[0].per_second / rates[1].per_second;
        println!(
            "round {round}: plaintext {:>8.0} lifecycles/s p99 {:>6.2} ms | {} {:>8.0} lifecycles/s \
             p99 {:>6.2} ms | plaintext/{} throughput {ratio:.3}",
            rates[0].per_second,
            ms(rates[0].p99),
            other.name(),
            rates[1].per_second,
            ms(rates[1].p99),
            other.name(),
        );
        ratios.push(ratio);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median: plaintext/{} throughput {:.3} (goal <= 1.10)",
        other.name(),
        ratios[ratios.len() / 2]
    );
    Ok(())
}

/// A database of loadgen's own on the PostgreSQL server `server` (a maintenance URL), dropped
/// with the guard. Created and dropped with Debian's `psql`.
struct Database {
    server: String,
    name: String,
    url: String,
}

impl Database {
    fn create(server: &str) -> anyhow::Result<Database> {
        let name = format!("antidote_loadgen_{}", uuid::Uuid::new_v4().simple());
        psql(server, &format!("CREATE DATABASE {name}"))?;
        let root = server.rsplit_once('/').map_or(server, |(root, _)| root);
        Ok(Database {
            server: server.to_owned(),
            url: format!("{root}/{name}"),
            name,
        })
    }

    /// The server's counts for this database so far: transactions (committed and rolled back,
    /// `pg_stat_database`) and statements other than BEGIN/COMMIT/ROLLBACK
    /// (`pg_stat_statements`, when the server loads it; see [`statement_counts`]).
    fn counters(&self) -> (Option<i64>, Option<i64>) {
        let transactions = psql_value(
            &self.server,
            &format!(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{}'",
                self.name
            ),
        );
        let statements = psql_value(
            &self.server,
            &format!(
                "SELECT COALESCE(SUM(calls), 0)::bigint FROM pg_stat_statements s \
                 JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{}' \
                 AND s.query NOT IN ('BEGIN', 'COMMIT', 'ROLLBACK')",
                self.name
            ),
        );
        (transactions, statements)
    }

    /// Forgets what `pg_stat_statements` counted for this database (after the warm-up).
    fn reset_statements(&self) {
        let _ = psql_value(
            &self.server,
            &format!(
                "SELECT 1 FROM pg_stat_statements_reset(0, \
                 (SELECT oid FROM pg_database WHERE datname = '{}'), 0)",
                self.name
            ),
        );
    }

    /// The statements run on this database since the last reset, most often first: (calls,
    /// query).
    fn statements(&self, limit: usize) -> Vec<(i64, String)> {
        let Some(text) = psql_text(
            &self.server,
            &format!(
                "SELECT calls, regexp_replace(left(query, 110), '\\s+', ' ', 'g') \
                 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                 WHERE d.datname = '{}' ORDER BY calls DESC LIMIT {limit}",
                self.name
            ),
        ) else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|line| {
                let (calls, query) = line.split_once('|')?;
                Some((calls.parse().ok()?, query.to_owned()))
            })
            .collect()
    }
}

impl Setup {
    /// Its schedulers' process ids.
    fn pids(&self) -> Vec<u32> {
        self._schedulers
            .iter()
            .filter_map(|s| s.process.pid())
            .collect()
    }

    /// Its schedulers' store traffic, summed: what each serves on its metrics listener (none
    /// from a build without the counters).
    async fn traffic(&self) -> Option<Traffic> {
        let mut sum = Traffic::default();
        for scheduler in &self._schedulers {
            let one = store_traffic(*scheduler.process.extra.get("metrics")?)
                .await
                .ok()?;
            sum.transactions += one.transactions;
            sum.write_jobs += one.write_jobs;
            sum.reads += one.reads;
        }
        Some(sum)
    }
}

/// A scheduler's `antidote_store_*_total` counters.
#[derive(Debug, Default, Clone, Copy)]
struct Traffic {
    transactions: u64,
    write_jobs: u64,
    reads: u64,
}

impl Traffic {
    /// Per lifecycle from `before` to `self`: transactions, write jobs, reads.
    fn per(self, before: Traffic, lifecycles: usize) -> (f64, f64, f64) {
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / lifecycles as f64;
        (
            per(self.transactions, before.transactions),
            per(self.write_jobs, before.write_jobs),
            per(self.reads, before.reads),
        )
    }
}

/// Reads the store's counters from the metrics listener at `addr` (plain HTTP).
async fn store_traffic(addr: std::net::SocketAddr) -> anyhow::Result<Traffic> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: loadgen\r\n\r\n")
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    let value = |name: &str| -> anyhow::Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .ok_or_else(|| anyhow::anyhow!("{addr}/metrics has no {name}"))
    };
    Ok(Traffic {
        transactions: value("antidote_store_transactions_total")?,
        write_jobs: value("antidote_store_write_jobs_total")?,
        reads: value("antidote_store_reads_total")?,
    })
}

impl Drop for Database {
    fn drop(&mut self) {
        let _ = psql(
            &self.server,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

/// Debian's `psql` (PostgreSQL 15's, else the one on the PATH).
fn psql_program() -> &'static str {
    ["/usr/lib/postgresql/15/bin/psql", "psql"]
        .into_iter()
        .find(|p| !p.starts_with('/') || std::path::Path::new(p).exists())
        .unwrap_or("psql")
}

fn psql(server: &str, sql: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new(psql_program())
        .args([server, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql])
        .status()?;
    anyhow::ensure!(status.success(), "psql -c {sql:?}: {status}");
    Ok(())
}

/// A query's unaligned output (`|` between columns), or `None` when it fails (quietly: the
/// server may not load `pg_stat_statements`).
fn psql_text(server: &str, sql: &str) -> Option<String> {
    let out = std::process::Command::new(psql_program())
        .args([server, "-v", "ON_ERROR_STOP=1", "-qAt", "-c", sql])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A query's one number.
fn psql_value(server: &str, sql: &str) -> Option<i64> {
    psql_text(server, sql)?.parse().ok()
}

/// Whether the server counts statements (`pg_stat_statements` in `shared_preload_libraries`):
/// then the extension is created in the maintenance database, where loadgen reads it.
fn statement_counts(server: &str) -> bool {
    psql_text(server, "SHOW shared_preload_libraries")
        .is_some_and(|libraries| libraries.contains("pg_stat_statements"))
        && psql(server, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements").is_ok()
}

/// One setup of `--store-compare`: a null agent, its schedulers and their clients.
struct Setup {
    name: String,
    _agent: Process,
    _schedulers: Vec<Scheduler>,
    clients: Vec<Clients>,
    /// Its PostgreSQL database, if on PostgreSQL.
    database: Option<Database>,
}

/// `replicas` schedulers on `database` (an SQLite path or a PostgreSQL URL) sharing one null
/// agent in `dir`; `args.connections` clients to each, warmed up by one lifecycle each.
async fn store_setup(
    args: &Args,
    name: String,
    dir: &std::path::Path,
    database: &str,
    replicas: usize,
    binary: &std::path::Path,
    postgres: Option<Database>,
) -> anyhow::Result<Setup> {
    let agent = Process::spawn(
        &workspace_bin("test-agent"),
        &["--null".into()],
        dir.join("agent.log"),
    )
    .await?;
    let path = dir.join("antidote.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"{database}\"\n\
             http.listen = \"127.0.0.1:0\"\n{}admin.metrics_listen = \"127.0.0.1:0\"\n\
             instance_id = \"loadgen\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
             [limits]\nsessions_per_ip = 0\n[reconciler]\nworkers = {}\n\
             [[agents]]\nname = \"null\"\naddress = \"{}\"\n",
            antidote_tests::admin_config(),
            example_curriculum().display(),
            args.workers,
            agent.url()
        ),
    )?;
    let mut schedulers = Vec::new();
    let mut clients = Vec::new();
    for i in 0..replicas {
        let process = Process::spawn(
            binary,
            &[
                "serve".into(),
                "--config".into(),
                path.display().to_string(),
            ],
            dir.join(format!("scheduler-{i}.log")),
        )
        .await?;
        let admin = process.extra["admin"];
        for _ in 0..args.connections {
            clients.push(Clients::connect(process.addr, admin).await?);
        }
        schedulers.push(Scheduler {
            clients: Clients::connect(process.addr, admin).await?,
            process,
            dir: dir.to_path_buf(),
        });
    }
    // Warm up every scheduler (and wait for its agent handshake).
    for scheduler in &schedulers {
        let warm = Instant::now();
        loop {
            match lifecycle(&scheduler.clients, &args.lesson).await {
                Ok(_) => break,
                Err(_) if warm.elapsed() < Duration::from_secs(30) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(err) => return Err(err),
            }
        }
    }
    // Lifecycle i goes to client i: consecutive ones to different replicas.
    let per = args.connections;
    let spread = (0..clients.len())
        .map(|i| clients[(i % replicas) * per + (i / replicas) % per].clone())
        .collect();
    if let Some(database) = &postgres {
        database.reset_statements();
    }
    Ok(Setup {
        name,
        _agent: agent,
        _schedulers: schedulers,
        clients: spread,
        database: postgres,
    })
}

/// `--store-compare`: SQLite, PostgreSQL, and 3 replicas on PostgreSQL, rounds rotating; with
/// `--against`, the same three again with the other scheduler binary (which build goes first
/// alternates by round).
async fn store_compare(args: &Args) -> anyhow::Result<()> {
    let server = args.postgres.clone().ok_or_else(|| {
        anyhow::anyhow!("--store-compare needs --postgres URL or ANTIDOTE_TEST_POSTGRES")
    })?;
    let counted = statement_counts(&server);
    let mut builds = vec![("", workspace_bin("scheduler-svc"))];
    if let Some(other) = &args.against {
        anyhow::ensure!(other.exists(), "{} does not exist", other.display());
        builds.push((" (other)", other.clone()));
    }
    let mut dirs = Vec::new();
    let mut setups = Vec::new();
    for (suffix, bin) in &builds {
        let at = dirs.len();
        for _ in 0..3 {
            dirs.push(tempfile::tempdir()?);
        }
        let sqlite = dirs[at].path().join("antidote.db").display().to_string();
        let (one, three) = (Database::create(&server)?, Database::create(&server)?);
        let (one_url, three_url) = (one.url.clone(), three.url.clone());
        setups.push(
            store_setup(
                args,
                format!("SQLite{suffix}"),
                dirs[at].path(),
                &sqlite,
                1,
                bin,
                None,
            )
            .await?,
        );
        setups.push(
            store_setup(
                args,
                format!("PostgreSQL{suffix}"),
                dirs[at + 1].path(),
                &one_url,
                1,
                bin,
                Some(one),
            )
            .await?,
        );
        setups.push(
            store_setup(
                args,
                format!("PostgreSQL x3{suffix}"),
                dirs[at + 2].path(),
                &three_url,
                3,
                bin,
                Some(three),
            )
            .await?,
        );
    }
    println!(
        "loadgen --store-compare: {} lifecycles per round, concurrency {}, {} rounds, lesson {}, \
         {} connections per scheduler{}",
        args.lifecycles,
        args.concurrency,
        args.rounds,
        args.lesson,
        args.connections,
        args.against.as_ref().map_or(String::new(), |other| format!(
            ", against {}",
            other.display()
        ))
    );
    let mut results: Vec<Vec<Stats>> = setups.iter().map(|_| Vec::new()).collect();
    // Per PostgreSQL setup and round: transactions and statements per lifecycle.
    let mut per_lifecycle: Vec<Vec<(f64, f64)>> = setups.iter().map(|_| Vec::new()).collect();
    // Per setup and round: the store's transactions, write jobs and reads per lifecycle.
    let mut traffic: Vec<Vec<(f64, f64, f64)>> = setups.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.rounds {
        let mut line = format!("round {round}:");
        let mut order: Vec<usize> = (0..setups.len()).collect();
        if round % 2 == 0 && builds.len() == 2 {
            order.rotate_left(3);
        }
        for s in order {
            let setup = &setups[s];
            let before = setup.database.as_ref().map(Database::counters);
            let traffic_before = setup.traffic().await;
            let measured = run_measured(args, &setup.pids(), |i| {
                let clients = setup.clients[i % setup.clients.len()].clone();
                let lesson = args.lesson.clone();
                async move { lifecycle(&clients, &lesson).await }
            })
            .await?;
            let mut counts = String::new();
            if let (Some(after), Some(before)) = (setup.traffic().await, traffic_before) {
                let (transactions, jobs, reads) = after.per(before, args.lifecycles);
                counts = format!(
                    " store: {transactions:.2} transactions, {jobs:.2} write jobs, {reads:.2} \
                     reads per lifecycle;"
                );
                traffic[s].push((transactions, jobs, reads));
            }
            if let (Some(database), Some(before)) = (&setup.database, before) {
                // pg_stat_database hears of a backend's transactions when it goes idle (within
                // a second).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let after = database.counters();
                let per = |b: Option<i64>, a: Option<i64>| {
                    b.zip(a)
                        .map(|(b, a)| (a - b) as f64 / args.lifecycles as f64)
                };
                let transactions = per(before.0, after.0);
                let statements = per(before.1, after.1);
                if let Some(transactions) = transactions {
                    counts.push_str(&format!(" server: {transactions:.1} transactions"));
                }
                if let Some(statements) = statements {
                    counts.push_str(&format!(" {statements:.1} statements"));
                }
                if transactions.is_some() || statements.is_some() {
                    counts.push_str(" per lifecycle");
                }
                per_lifecycle[s].push((
                    transactions.unwrap_or(f64::NAN),
                    statements.unwrap_or(f64::NAN),
                ));
            }
            line.push_str(&format!(
                " {} {:.0} lifecycles/s p99 {:.2} ms CPU {} µs/lifecycle{counts} |",
                setup.name,
                measured.per_second,
                ms(measured.p99),
                micros(measured.cpu)
            ));
            results[s].push(measured);
        }
        let rate = |s: usize| results[s].last().map_or(0.0, |m| m.per_second);
        let mut ratios = format!(
            " PostgreSQL/SQLite {:.3}, PostgreSQL x3/PostgreSQL {:.3}",
            rate(1) / rate(0),
            rate(2) / rate(1)
        );
        if builds.len() == 2 {
            ratios.push_str(&format!(
                "; this/other: SQLite {:.3}, PostgreSQL {:.3}, PostgreSQL x3 {:.3}",
                rate(0) / rate(3),
                rate(1) / rate(4),
                rate(2) / rate(5)
            ));
        }
        println!("{line}{ratios}");
    }
    let medians: Vec<(f64, Duration)> = results
        .iter()
        .map(|r| {
            let rates: Vec<f64> = r.iter().map(|s| s.per_second).collect();
            let p99s: Vec<Duration> = r.iter().map(|s| s.p99).collect();
            (median(&rates), median(&p99s))
        })
        .collect();
    for (s, ((setup, (rate, p99)), r)) in setups.iter().zip(&medians).zip(&results).enumerate() {
        let cpus: Vec<Duration> = r.iter().filter_map(|m| m.cpu).collect();
        let rates: Vec<f64> = r.iter().map(|m| m.per_second).collect();
        let (low, high) = rates
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)));
        let column =
            |k: usize| -> Vec<f64> { traffic[s].iter().map(|t| [t.0, t.1, t.2][k]).collect() };
        let mut counts = String::new();
        if !traffic[s].is_empty() {
            counts = format!(
                ", store {:.2} transactions, {:.2} write jobs and {:.2} reads per lifecycle",
                median(&column(0)),
                median(&column(1)),
                median(&column(2))
            );
        }
        if !per_lifecycle[s].is_empty() {
            let transactions: Vec<f64> = per_lifecycle[s].iter().map(|c| c.0).collect();
            let statements: Vec<f64> = per_lifecycle[s].iter().map(|c| c.1).collect();
            let statements = median(&statements);
            counts.push_str(&format!(
                " (the server counted {:.1} transactions{})",
                median(&transactions),
                if statements.is_nan() {
                    String::new()
                } else {
                    format!(" and {statements:.1} statements")
                }
            ));
        }
        println!(
            "median: {} {rate:.0} lifecycles/s ({low:.0}–{high:.0}), request→READY p99 {:.2} ms, \
             schedulers' CPU {} µs/lifecycle{counts}",
            setup.name,
            ms(*p99),
            micros((!cpus.is_empty()).then(|| median(&cpus)))
        );
    }
    // The rounds' own ratios, medians of them (each round's setups ran minutes apart at most).
    let ratio = |a: usize, b: usize| {
        let ratios: Vec<f64> = results[a]
            .iter()
            .zip(&results[b])
            .map(|(a, b)| a.per_second / b.per_second)
            .collect();
        median(&ratios)
    };
    println!(
        "median of the rounds' ratios: PostgreSQL/SQLite throughput {:.3}, PostgreSQL x3/PostgreSQL \
         {:.3}, PostgreSQL x3/SQLite {:.3}",
        ratio(1, 0),
        ratio(2, 1),
        ratio(2, 0)
    );
    if builds.len() == 2 {
        println!(
            "median of the rounds' ratios, the other build: PostgreSQL/SQLite {:.3}, \
             PostgreSQL x3/PostgreSQL {:.3}; this/other: SQLite {:.3}, PostgreSQL {:.3}, \
             PostgreSQL x3 {:.3}",
            ratio(4, 3),
            ratio(5, 4),
            ratio(0, 3),
            ratio(1, 4),
            ratio(2, 5)
        );
    }
    if counted {
        let lifecycles = (args.lifecycles * args.rounds) as f64;
        for setup in &setups {
            let Some(database) = &setup.database else {
                continue;
            };
            println!(
                "statements per lifecycle, {} (pg_stat_statements):",
                setup.name
            );
            for (calls, query) in database.statements(12) {
                println!("  {:>6.2}  {query}", calls as f64 / lifecycles);
            }
        }
    }
    Ok(())
}
