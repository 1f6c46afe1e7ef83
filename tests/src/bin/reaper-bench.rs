//! `reaper-bench`: how long the reaper's expiry tick takes among many live lessons.
//!
//! Seeds a store (SQLite in a temporary directory, or the PostgreSQL database `--database`
//! names) through the scheduler's own store API with `--live` live lessons, each in a session
//! of its own with a placement record, of which `--idle` are idle past their TTL. Then it times
//! the tick the reaper runs every `reaper.interval` (`drive::reaper::Reaper::expire`: expire
//! idle live lessons, expire idle sessions, prune events): the first tick (which finds and marks
//! the idle ones) and `--ticks` more (nothing left to expire: the steady state), and prints each
//! and the median (goal: < 50 ms per tick at 100,000 live). Then it forgets the expired live
//! lessons (their placement records go with them) and times the placement pruning the reaper
//! runs at the orphan interval.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use clap::Parser;
use scheduler_svc::model::{Millis, Wishes};
use scheduler_svc::store::{Database, Store};
use tokio::task::JoinSet;

#[derive(Parser)]
#[command(
    name = "reaper-bench",
    about = "The reaper's expiry tick among many live lessons"
)]
struct Args {
    /// Live lessons (each in a session of its own).
    #[arg(long, default_value_t = 100_000)]
    live: usize,
    /// Of which idle past the TTL (expired by the first tick).
    #[arg(long, default_value_t = 100)]
    idle: usize,
    /// Steady-state ticks timed after the first.
    #[arg(long, default_value_t = 5)]
    ticks: usize,
    /// The store: an SQLite path or a PostgreSQL URL (an empty database of the bench's own);
    /// a temporary SQLite file by default.
    #[arg(long)]
    database: Option<String>,
}

/// The live lessons' TTL the tick applies (the default `ttl.live_lesson` and `ttl.session`).
const TTL: Duration = Duration::from_secs(3600);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let database = match &args.database {
        Some(text) => Database::parse(text),
        None => Database::Sqlite(dir.path().join("antidote.db")),
    };
    let store = Store::open(&database).await?;
    let now = Millis::now();
    let idle_at = now.minus(TTL * 2);
    let seeding = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..args.live {
        // Group commit wants many writers at once; a few hundred keep the writer busy.
        if tasks.len() >= 512 {
            tasks.join_next().await.expect("a task is running")??;
        }
        let store = store.clone();
        let at = if i < args.idle { idle_at } else { now };
        tasks.spawn(async move {
            let mut token = [0u8; 32];
            token[..8].copy_from_slice(&(i as u64).to_le_bytes());
            token[8] = 0xbe;
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32));
            let session = store.create_session(ip, token, 0, at).await?;
            let (lesson, _) = store
                .request_live_lesson(session.id, "hello-web", 0, 0, at)
                .await?;
            store.set_wishes(lesson.id, &Wishes::default()).await?;
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    println!(
        "reaper-bench: {} live lessons ({} idle past the TTL) on {} seeded in {:.1} s",
        args.live,
        args.idle,
        store.backend(),
        seeding.elapsed().as_secs_f64()
    );

    let mut steady = Vec::new();
    let mut expired = Vec::new();
    for tick in 0..=args.ticks {
        let now = Millis::now();
        let start = Instant::now();
        let lessons = store.expire_live_lessons(now.minus(TTL), now).await?;
        let sessions = store.expire_sessions(now.minus(TTL), now).await?;
        let events = store
            .prune_events(now.minus(Duration::from_secs(86_400)))
            .await?;
        let took = start.elapsed();
        println!(
            "tick {tick}: {:.2} ms ({} live lessons and {} sessions' live lessons expired, \
             {events} events pruned)",
            took.as_secs_f64() * 1e3,
            lessons.len(),
            sessions.len(),
        );
        if tick > 0 {
            steady.push(took);
        } else {
            expired.extend(lessons.iter().chain(&sessions).map(|lesson| lesson.id));
        }
    }
    for id in &expired {
        store.forget(*id).await?;
    }
    let start = Instant::now();
    let pruned = store.prune_placements().await?;
    println!(
        "placement pruning (at the orphan interval): {:.2} ms, {pruned} records pruned after \
         {} live lessons were forgotten",
        start.elapsed().as_secs_f64() * 1e3,
        expired.len()
    );
    steady.sort();
    if let Some(median) = steady.get(steady.len() / 2) {
        println!(
            "median steady tick: {:.2} ms among {} live lessons (goal < 50 ms)",
            median.as_secs_f64() * 1e3,
            args.live
        );
    }
    store.close().await;
    Ok(())
}
