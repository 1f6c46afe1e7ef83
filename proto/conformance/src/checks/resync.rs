//! `watch-resync` (PROTOCOL.md [W7]), forced from outside for any agent: one Watch stream of
//! the suite stops reading, on a connection whose HTTP/2 window holds a few events, while the
//! suite pushes more generations of one live lesson than an agent may hold for a watcher
//! (8,192 events). The stalled watcher must then get a `resync` at the last revision it was
//! told, then a fresh snapshot, and its view must end at the newest generation; the suite's
//! other stream and its calls must go on meanwhile.

use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::labels;
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::Phase;
use proto::watch_event::Event;

use crate::report::{Verdict, describe, pass, summary};
use crate::suite::{Suite, new_id};
use crate::watcher::Watcher;

/// What an agent may hold for a watcher that does not read, beyond the transport ([W7]).
const BOUND: usize = 8192;

/// The stalled connection's HTTP/2 windows: a few dozen events.
pub const STALLED_WINDOW: u32 = 16 * 1024;

/// How many generations are pushed on a stalled connection of its own: more than [`BOUND`]
/// plus what its window holds, at one change at least each.
const GENERATIONS: u64 = 10_000;

/// The same over the suite's one connection (dial-in), whose window is the library's default
/// (a few MiB): more, to fill it as well.
const GENERATIONS_SHARED: u64 = 20_000;

/// Events the stalled stream's window may have let through before it stalled, on top of
/// [`BOUND`], before the agent counts as holding more than the rule lets it.
const WINDOW_EVENTS: usize = 200;

/// `watch-resync`: see the module's documentation.
pub async fn resync(suite: &mut Suite) -> Verdict {
    let id = new_id();
    let mut spec = suite.solo(&id);
    spec.endpoints[0].configuration = None;
    suite
        .provision(spec.clone())
        .await
        .map_err(|s| anyhow!("Provision: {}", describe(&s)))?;
    suite.ready(&id, 1).await?;

    let (channel, generations) = match suite.stalled_channel.clone() {
        Some(channel) => (channel, GENERATIONS),
        None => (suite.channel.clone(), GENERATIONS_SHARED),
    };
    let selector = std::collections::HashMap::from([(labels::LIVE_LESSON.to_owned(), id.clone())]);
    let stream = proto::backend_client::BackendClient::new(channel)
        .watch(proto::WatchRequest {
            label_selector: selector,
            heartbeat_interval: Some(Duration::from_secs(30).try_into()?),
            ..Default::default()
        })
        .await
        .map_err(|s| anyhow!("Watch: {}", describe(&s)))?
        .into_inner();
    let mut stalled = Watcher::new(stream);
    let first = stalled.next(Duration::from_secs(10)).await?;
    ensure!(
        matches!(first.event, Some(Event::Snapshot(_))),
        "the first Watch message is not a snapshot: {first:?}"
    );

    // Push the generations while the suite's own stream (when there is one) keeps reading.
    let client = suite.client.clone();
    let pushed_spec = spec.clone();
    let started = tokio::time::Instant::now();
    let mut push = tokio::spawn(async move {
        let mut client = client;
        for generation in 2..=generations {
            let mut spec = pushed_spec.clone();
            spec.generation = generation;
            spec.labels
                .insert(labels::GENERATION.to_owned(), generation.to_string());
            client
                .provision(proto::ProvisionRequest {
                    spec: Some(spec),
                    new_live_lesson: false,
                })
                .await
                .map_err(|s| anyhow!("Provision of generation {generation}: {}", describe(&s)))?;
        }
        Ok::<_, anyhow::Error>(())
    });
    let pushed = loop {
        match suite.watch.as_mut() {
            Some(watcher) => {
                tokio::select! {
                    done = &mut push => break done,
                    read = watcher.next(Duration::from_secs(60)) => {
                        read.context("the suite's other Watch stream, while one stalled")?;
                    }
                }
            }
            None => break (&mut push).await,
        }
    };
    pushed.context("the pushing task")??;
    let took = started.elapsed();
    let newest = suite.ready(&id, generations).await?;

    // Now read the stalled stream.
    let mut messages = 0usize;
    let mut resync: Option<(usize, String)> = None;
    let deadline = tokio::time::Instant::now() + suite.settings.ready_timeout;
    loop {
        let before = stalled.last_revision();
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        ensure!(
            !left.is_zero(),
            "the stalled watcher's view did not reach generation {generations} READY within {:?}; last seen: {}",
            suite.settings.ready_timeout,
            stalled
                .seen
                .get(&id)
                .map(summary)
                .unwrap_or_else(|| "nothing".into())
        );
        let event = stalled.next(left).await?;
        messages += 1;
        match &event.event {
            Some(Event::Resync(r)) if resync.is_none() => {
                ensure!(
                    event.revision == before,
                    "the resync carries revision {}, not the last one the stream told ({before}) [W3]",
                    event.revision
                );
                resync = Some((messages, r.reason.clone()));
                let next = stalled.next(Duration::from_secs(30)).await?;
                let Some(Event::Snapshot(snapshot)) = &next.event else {
                    bail!("the message after the resync is not a snapshot: {next:?}");
                };
                ensure!(
                    snapshot.items.iter().any(|s| s.live_lesson_id == id),
                    "the snapshot after the resync lacks the live lesson"
                );
                messages += 1;
            }
            _ => {}
        }
        if resync.is_none() && messages > BOUND + WINDOW_EVENTS {
            bail!(
                "{messages} messages reached a watcher that read nothing while {} generations were pushed, and no resync: an agent may hold at most {BOUND} events for it [W7]",
                generations - 1
            );
        }
        if let Some(state) = stalled.seen.get(&id)
            && state.generation == generations
            && state.phase == Phase::Ready as i32
        {
            break;
        }
    }
    ensure!(
        newest.generation == generations,
        "Get shows generation {}, not {generations}",
        newest.generation
    );
    suite.remove(&id).await?;
    match resync {
        Some((at, reason)) => pass(format!(
            "{} generations pushed in {took:.1?} while a watcher stalled; it got a resync after {at} messages (\"{reason}\"), then a snapshot, and its view reached generation {generations} READY",
            generations - 1
        )),
        None => pass(format!(
            "{} generations pushed in {took:.1?} while a watcher stalled; the agent sent only the latest changes ({messages} messages, within its bound, so no resync was needed) and the view reached generation {generations} READY",
            generations - 1
        )),
    }
}
