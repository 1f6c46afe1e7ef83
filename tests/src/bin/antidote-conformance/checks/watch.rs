//! The Watch stream: the first snapshot, heartbeats, deletions, label selectors. Every read
//! also checks that revisions never go back (see `crate::watcher`).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};

use crate::report::{Outcome, Verdict, pass};
use crate::suite::{Selected, Suite};

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

/// `watch-heartbeat`: a heartbeat arrives within 5 s at a 1 s interval.
pub async fn heartbeat(suite: &mut Suite) -> Verdict {
    let watcher = suite.watcher()?;
    let before = watcher.heartbeats;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while watcher.heartbeats == before {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        ensure!(!left.is_zero(), "no heartbeat within 5 s at a 1 s interval");
        watcher.next(left).await?;
    }
    pass("a heartbeat arrives when nothing changes")
}

/// `watch-deletions`: a `deleted` event for every live lesson `deprovision` removed.
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
    pass("a `deleted` event per live lesson, revisions always rising")
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

/// `watch-resync`: not decided from outside.
pub async fn resync(_suite: &mut Suite) -> Verdict {
    Ok(Outcome::Skip(
        "not forced from outside (it needs thousands of changes while a watcher stalls); \
         the SDK's StateBook tests cover it"
            .to_owned(),
    ))
}
