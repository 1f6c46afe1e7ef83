//! The Watch stream: the first snapshot, heartbeats, deletions, label selectors, and what a
//! client that reconnects gets. Every read also checks that revisions never go back (see
//! `crate::watcher`).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use antidote_sdk::labels;
use anyhow::{Context as _, anyhow, bail, ensure};
use proto::Phase;
use proto::watch_event::Event;

use crate::report::{Verdict, describe, pass, summary};
use crate::suite::{Selected, Suite, new_id};

/// `watch-snapshot`: a Watch on our fresh instance starts with an empty snapshot. The stream is
/// kept: later checks wait for READY on it and `watch-heartbeat` and `watch-deletions` read it.
pub async fn snapshot(suite: &mut Suite) -> Verdict {
    let (watcher, items) = suite
        .open_watch(suite.selector(), Duration::from_secs(1))
        .await?;
    ensure!(
        items.is_empty(),
        "the snapshot holds {} live lessons of a fresh instance",
        items.len()
    );
    suite.watch = Some(watcher);
    pass("the first message is an (empty) snapshot")
}

/// `watch-heartbeat`: on a stream nothing matches (a selector no live lesson has), at a 1 s
/// interval, three heartbeats come, each at most 2 s after the message before, all at the
/// snapshot's revision: the last revision this stream told (PROTOCOL.md [W3], [W4]).
pub async fn heartbeat(suite: &mut Suite) -> Verdict {
    let interval = Duration::from_secs(1);
    let slack = 2 * interval;
    let selector = HashMap::from([(labels::INSTANCE.to_owned(), new_id())]);
    let stream = suite
        .client
        .watch(proto::WatchRequest {
            label_selector: selector,
            heartbeat_interval: Some(interval.try_into()?),
            ..Default::default()
        })
        .await
        .map_err(|s| anyhow!("Watch: {}", describe(&s)))?;
    let mut stream = stream.into_inner();
    let (first, _) = timed(&mut stream).await?;
    let Some(Event::Snapshot(snapshot)) = &first.event else {
        bail!("the first message is not a snapshot: {first:?}");
    };
    ensure!(
        snapshot.items.is_empty(),
        "a selector nothing has shows {} live lessons",
        snapshot.items.len()
    );
    let mut gaps = Vec::new();
    for n in 1..=3 {
        let (event, gap) = timed(&mut stream).await?;
        ensure!(
            matches!(event.event, Some(Event::Heartbeat(_))),
            "message {n} of a quiet stream is not a heartbeat: {event:?}"
        );
        ensure!(
            gap <= slack,
            "heartbeat {n} came {gap:?} after the message before, at a {interval:?} interval \
             (at most {slack:?} allowed)"
        );
        ensure!(
            event.revision == first.revision,
            "heartbeat {n} carries revision {}, but the stream's last message (the snapshot) \
             was at {}",
            event.revision,
            first.revision
        );
        gaps.push(format!("{:.2} s", gap.as_secs_f64()));
    }
    pass(format!(
        "3 heartbeats at revision {} after {}",
        first.revision,
        gaps.join(", ")
    ))
}

/// `watch-pages`: a Watch asking for pages of 1 byte gets its snapshot as one state per page
/// (no state fits in 1 byte, so none may share a page), all at one revision, `more` on every
/// page but the last, together what List shows; the stream then goes on (PROTOCOL.md [W8]).
pub async fn pages(suite: &mut Suite) -> Verdict {
    let listed = suite.list_all(0).await?;
    let want: BTreeSet<String> = listed.iter().map(|s| s.live_lesson_id.clone()).collect();
    ensure!(
        want.len() >= 2,
        "list-pages left {} live lessons; paging needs two",
        want.len()
    );
    let mut stream = suite
        .client
        .watch(proto::WatchRequest {
            label_selector: suite.selector(),
            heartbeat_interval: Some(Duration::from_secs(1).try_into()?),
            snapshot_page_bytes: 1,
        })
        .await
        .map_err(|s| anyhow!("Watch: {}", describe(&s)))?
        .into_inner();
    let mut got = BTreeSet::new();
    let mut revision = None;
    let mut pages = 0;
    loop {
        let (event, _) = timed(&mut stream).await?;
        let Some(Event::Snapshot(page)) = &event.event else {
            bail!("page {pages} of the snapshot is not a snapshot: {event:?}");
        };
        ensure!(
            *revision.get_or_insert(event.revision) == event.revision,
            "page {pages} is at revision {}, the first at {revision:?}",
            event.revision
        );
        ensure!(
            page.items.len() == 1,
            "page {pages} holds {} states in pages of 1 byte (one state per page)",
            page.items.len()
        );
        pages += 1;
        for state in &page.items {
            ensure!(
                got.insert(state.live_lesson_id.clone()),
                "{} is on two pages",
                state.live_lesson_id
            );
        }
        if !page.more {
            break;
        }
        ensure!(pages <= want.len() + 100, "the snapshot never ends");
    }
    ensure!(got == want, "the pages hold {got:?}, List shows {want:?}");
    let (after, _) = timed(&mut stream).await?;
    ensure!(
        !matches!(after.event, Some(Event::Snapshot(_))),
        "a snapshot page after the last page: {after:?}"
    );
    pass(format!(
        "{pages} pages of one state each at revision {}",
        revision.unwrap_or_default()
    ))
}

/// The next message of `stream` and how long it took to come.
async fn timed(
    stream: &mut tonic::Streaming<proto::WatchEvent>,
) -> anyhow::Result<(proto::WatchEvent, Duration)> {
    let started = tokio::time::Instant::now();
    let event = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .map_err(|_| anyhow!("no Watch message within 10 s"))?
        .map_err(|s| anyhow!("Watch broke: {}", describe(&s)))?
        .ok_or_else(|| anyhow!("Watch ended"))?;
    Ok((event, started.elapsed()))
}

/// `watch-deletions`: for every live lesson `deprovision` removed, the stream showed it
/// TERMINATING, then one `deleted` event, and nothing after (PROTOCOL.md [D2]).
pub async fn deletions(suite: &mut Suite) -> Verdict {
    let expected = suite.removed.clone();
    let watcher = suite.watcher()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !expected.is_subset(&watcher.deleted) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        ensure!(
            !left.is_zero(),
            "Watch told of {:?} deleted, expected {expected:?}",
            watcher.deleted
        );
        watcher.next(left).await?;
    }
    for id in &expected {
        let before = watcher.phase_before_deletion.get(id).copied();
        ensure!(
            before == Some(Phase::Terminating as i32),
            "{id} was last shown {:?} before its `deleted` event, not TERMINATING",
            before.map(|p| Phase::try_from(p).unwrap_or(Phase::Unspecified))
        );
        ensure!(
            watcher.deletions.get(id) == Some(&1),
            "{id} was deleted {} times on the stream",
            watcher.deletions.get(id).unwrap_or(&0)
        );
        ensure!(
            !watcher.changed_after_deletion.contains(id),
            "{id} changed after its `deleted` event"
        );
    }
    pass(format!(
        "{} live lessons: TERMINATING, then one `deleted` each, revisions always rising",
        expected.len()
    ))
}

/// `watch-selector`: the Watch `list-pages` opened on one live lesson tells of its deletion and
/// of nothing else.
pub async fn selector(suite: &mut Suite) -> Verdict {
    let Some(Selected { id, watch }) = suite.selected.take() else {
        bail!("`list-pages` opened no Watch on one live lesson");
    };
    let mut watcher = watch.context("Watch with a live lesson selector")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !watcher.deleted.contains(&id) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        ensure!(!left.is_zero(), "no deletion of the selected live lesson");
        watcher.next(left).await?;
    }
    let others: BTreeSet<_> = watcher
        .seen
        .keys()
        .chain(watcher.deleted.iter())
        .filter(|other| **other != id)
        .cloned()
        .collect();
    ensure!(
        others.is_empty(),
        "a selector for one live lesson also showed {others:?}"
    );
    pass("only the selected live lesson's events")
}

/// `watch-reconnect`: v1 has no resume, so a reconnecting client relies on the new stream's
/// snapshot: it must hold, in one message, every live lesson List shows, at a revision no older
/// than anything the first stream told, each state no newer than the snapshot and the same as
/// Get's (PROTOCOL.md [W1], [W5]).
pub async fn reconnect(suite: &mut Suite) -> Verdict {
    let told = suite.watcher().map(|w| w.last_revision()).unwrap_or(0);
    let listed = suite.list_all(0).await?;
    let (watcher, items) = suite
        .open_watch(suite.selector(), Duration::from_secs(1))
        .await?;
    let snapshot_revision = watcher.last_revision();
    let want: BTreeSet<&str> = listed.iter().map(|s| s.live_lesson_id.as_str()).collect();
    let got: BTreeSet<&str> = items.iter().map(|s| s.live_lesson_id.as_str()).collect();
    ensure!(
        want == got,
        "the new stream's snapshot holds {got:?}, List shows {want:?}"
    );
    ensure!(
        snapshot_revision >= told,
        "the new stream's snapshot is at revision {snapshot_revision}, older than {told} the \
         first stream told"
    );
    for state in &items {
        ensure!(
            state.revision <= snapshot_revision,
            "{} is at revision {} in a snapshot at {snapshot_revision}",
            state.live_lesson_id,
            state.revision
        );
        let got = suite
            .get(&state.live_lesson_id)
            .await
            .map_err(|s| anyhow!("Get: {}", describe(&s)))?;
        ensure!(
            got.generation == state.generation && got.phase == state.phase,
            "the snapshot shows {} as {}, Get as {}",
            state.live_lesson_id,
            summary(state),
            summary(&got)
        );
    }
    pass(format!(
        "{} live lessons in one snapshot at revision {snapshot_revision} (the first stream had \
         told {told})",
        items.len()
    ))
}
