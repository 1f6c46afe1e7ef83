//! `api-bench`: what the operability features cost, measured against a baseline in the same run.
//!
//! One test agent that does no work (`--null`) serves two schedulers: A exports no spans, B
//! exports every span over OTLP to a real receiver in this process. Each round runs the same
//! number of lesson lifecycles (session → request → READY → delete → gone) three ways, at the
//! same concurrency:
//! - baseline: gRPC against A;
//! - JSON/HTTP against A (requests as JSON, READY and gone followed as server-sent events);
//! - gRPC against B (span export on).
//!
//! It prints each round's wall times and the ratios to the baseline, then the medians.
//! Build with `cargo build --release --workspace --bins`, then run `target/release/api-bench`.

use std::time::{Duration, Instant};

use antidote_tests::otlp::Receiver;
use antidote_tests::web::Web;
use antidote_tests::{Process, Scheduler, example_curriculum, lifecycles, workspace_bin};
use anyhow::{Context as _, bail};
use clap::Parser;
use hyper::{Method, StatusCode};

#[derive(Parser)]
#[command(
    name = "api-bench",
    about = "JSON/HTTP and span export against plain gRPC"
)]
struct Args {
    /// Lifecycles per way per round.
    #[arg(long, default_value_t = 500)]
    lifecycles: usize,
    /// Lifecycles in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Lesson to request.
    #[arg(long, default_value = "hello-web")]
    lesson: String,
}

const PATIENCE: Duration = Duration::from_secs(120);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let agent = Process::spawn(
        &workspace_bin("test-agent"),
        &["--null".into()],
        dir.path().join("agent.log"),
    )
    .await?;
    let receiver = Receiver::default();
    let collector = format!("http://{}", receiver.start().await?);
    let config = |instance: &str, extra: &str| {
        format!(
            "instance_id = \"{instance}\"\ncurriculum = \"{}\"\ntier = \"local\"\n\
             [limits]\nsessions_per_ip = 0\nlive_lessons_per_session = 0\n{extra}\n\
             [[agents]]\nname = \"null\"\naddress = \"{}\"\n",
            example_curriculum().display(),
            agent.url()
        )
    };
    let dir_a = dir.path().join("a");
    let dir_b = dir.path().join("b");
    std::fs::create_dir_all(&dir_a)?;
    std::fs::create_dir_all(&dir_b)?;
    let a = Scheduler::start(&dir_a, &config("bench-a", "")).await?;
    let b = Scheduler::start(
        &dir_b,
        &config(
            "bench-b",
            &format!("[telemetry]\notlp_endpoint = \"{collector}\""),
        ),
    )
    .await?;
    let http = a.process.extra_url("http")?;
    let web = Web::default();
    let lesson: &'static str = Box::leak(args.lesson.clone().into_boxed_str());

    // Warm up every way once (handshakes, connections, caches).
    a.clients.lifecycles(lesson, 1, 1, PATIENCE).await?;
    b.clients.lifecycles(lesson, 1, 1, PATIENCE).await?;
    http_lifecycles(&web, &http, lesson, 1, 1).await?;

    println!(
        "api-bench: {} lifecycles per way per round, concurrency {}, {} rounds, lesson {lesson}",
        args.lifecycles, args.concurrency, args.rounds
    );
    let mut http_ratios = Vec::new();
    let mut otlp_ratios = Vec::new();
    for round in 1..=args.rounds {
        let grpc = total(
            a.clients
                .lifecycles(lesson, args.lifecycles, args.concurrency, PATIENCE)
                .await?,
        );
        let json =
            total(http_lifecycles(&web, &http, lesson, args.lifecycles, args.concurrency).await?);
        let exported = total(
            b.clients
                .lifecycles(lesson, args.lifecycles, args.concurrency, PATIENCE)
                .await?,
        );
        let (h, o) = (json / grpc, exported / grpc);
        println!(
            "round {round}: gRPC {grpc:.2} s ({:.0}/s) | JSON/HTTP + SSE {json:.2} s, ratio {h:.2} | \
             gRPC with OTLP export {exported:.2} s, ratio {o:.2} | spans received so far {}",
            args.lifecycles as f64 / grpc,
            receiver.spans().len()
        );
        http_ratios.push(h);
        otlp_ratios.push(o);
    }
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    println!(
        "median ratios (way/gRPC baseline, wall time of whole lifecycles): JSON/HTTP {:.2}, OTLP export {:.2}",
        median(http_ratios),
        median(otlp_ratios)
    );
    Ok(())
}

fn total((up, down): (Duration, Duration)) -> f64 {
    (up + down).as_secs_f64()
}

/// `count` lifecycles through the JSON API: (wall time to READY, wall time to gone).
async fn http_lifecycles(
    web: &Web,
    base: &str,
    lesson: &'static str,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<(Duration, Duration)> {
    // Each lifecycle is one learner: its own session cookie, on the shared connection pool.
    let browsers = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    lifecycles(
        count,
        concurrency,
        |_| {
            let (web, base, browsers) = (web.fresh_jar(), base.to_owned(), browsers.clone());
            async move {
                let session = web.post(&format!("{base}/v1/sessions"), "").await?.json()?;
                let session = session["id"].as_str().context("session id")?.to_owned();
                let body = format!(r#"{{"sessionId":"{session}","lessonSlug":"{lesson}"}}"#);
                let live = web.post(&format!("{base}/v1/live-lessons"), &body).await?;
                if live.status != StatusCode::OK {
                    bail!("request: {} {}", live.status, live.body);
                }
                let id = live.json()?["id"].as_str().context("id")?.to_owned();
                browsers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id.clone(), web.clone());
                let mut events = web
                    .events(&format!("{base}/v1/live-lessons/{id}/watch"))
                    .await?;
                let deadline = Instant::now() + PATIENCE;
                loop {
                    let event = tokio::time::timeout_at(deadline.into(), events.next())
                        .await
                        .context("READY in time")??
                        .context("stream ended before READY")?;
                    if event.data.contains("LIVE_LESSON_STATUS_READY") {
                        return Ok(id);
                    }
                    if event.data.contains("LIVE_LESSON_STATUS_FAILED") {
                        bail!("FAILED: {}", event.data);
                    }
                }
            }
        },
        |id| {
            let web = browsers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id)
                .unwrap_or_else(|| web.clone());
            let base = base.to_owned();
            async move {
                let mut events = web
                    .events(&format!("{base}/v1/live-lessons/{id}/watch"))
                    .await?;
                let deleted = web
                    .send(
                        Method::DELETE,
                        &format!("{base}/v1/live-lessons/{id}"),
                        &[],
                        None,
                    )
                    .await?;
                if deleted.status != StatusCode::OK {
                    bail!("delete: {} {}", deleted.status, deleted.body);
                }
                // The stream ends when the live lesson is gone.
                tokio::time::timeout(PATIENCE, async {
                    while events.next().await?.is_some() {}
                    Ok::<_, anyhow::Error>(())
                })
                .await
                .context("gone in time")??;
                Ok(())
            }
        },
    )
    .await
}
