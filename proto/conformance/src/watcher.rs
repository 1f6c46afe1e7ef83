//! A Watch stream that checks, as it reads, that revisions never go back (and rise on every
//! change and deletion), and remembers what it was told.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use anyhow::{anyhow, bail, ensure};
use proto::Phase;
use proto::watch_event::Event;
use tonic::Streaming;

use crate::report::{describe, summary};

/// A Watch stream and what it has shown.
pub struct Watcher {
    /// The stream itself.
    stream: Streaming<proto::WatchEvent>,
    /// The newest revision seen, which the next message may not go below.
    last_revision: u64,
    /// Every state the stream delivered, by live lesson.
    pub seen: HashMap<String, proto::LiveLessonState>,
    /// Live lessons the stream said were deleted.
    pub deleted: BTreeSet<String>,
    /// How many `deleted` events came for each live lesson.
    pub deletions: HashMap<String, usize>,
    /// The phase each deleted live lesson had last been shown in before its `deleted` event.
    pub phase_before_deletion: HashMap<String, i32>,
    /// Live lessons shown `changed` after their `deleted` event.
    pub changed_after_deletion: BTreeSet<String>,
    /// How many heartbeats arrived.
    pub heartbeats: usize,
}

impl Watcher {
    pub fn new(stream: Streaming<proto::WatchEvent>) -> Watcher {
        Watcher {
            stream,
            last_revision: 0,
            seen: HashMap::new(),
            deleted: BTreeSet::new(),
            deletions: HashMap::new(),
            phase_before_deletion: HashMap::new(),
            changed_after_deletion: BTreeSet::new(),
            heartbeats: 0,
        }
    }

    /// The newest revision the stream has told.
    pub fn last_revision(&self) -> u64 {
        self.last_revision
    }

    /// The next event, checking that revisions never go back (and rise on changes).
    pub async fn next(&mut self, within: Duration) -> anyhow::Result<proto::WatchEvent> {
        let event = tokio::time::timeout(within, self.stream.message())
            .await
            .map_err(|_| anyhow!("no Watch message within {within:?}"))?
            .map_err(|status| anyhow!("Watch broke: {}", describe(&status)))?
            .ok_or_else(|| anyhow!("Watch ended"))?;
        match &event.event {
            Some(Event::Changed(state)) => {
                ensure!(
                    event.revision > self.last_revision,
                    "Watch revision went from {} to {} on a change",
                    self.last_revision,
                    event.revision
                );
                if self.deleted.contains(&state.live_lesson_id) {
                    self.changed_after_deletion
                        .insert(state.live_lesson_id.clone());
                }
                self.seen
                    .insert(state.live_lesson_id.clone(), state.clone());
            }
            Some(Event::Deleted(deleted)) => {
                ensure!(
                    event.revision > self.last_revision,
                    "Watch revision went from {} to {} on a deletion",
                    self.last_revision,
                    event.revision
                );
                let id = deleted.live_lesson_id.clone();
                if let Some(state) = self.seen.get(&id) {
                    self.phase_before_deletion.insert(id.clone(), state.phase);
                }
                *self.deletions.entry(id.clone()).or_default() += 1;
                self.deleted.insert(id);
            }
            Some(Event::Heartbeat(_)) => self.heartbeats += 1,
            Some(Event::Snapshot(snapshot)) => {
                for state in &snapshot.items {
                    self.seen
                        .insert(state.live_lesson_id.clone(), state.clone());
                }
            }
            Some(Event::Resync(_)) => {}
            None => bail!("a Watch message without an event"),
        }
        ensure!(
            event.revision >= self.last_revision,
            "Watch revision went back from {} to {}",
            self.last_revision,
            event.revision
        );
        self.last_revision = event.revision;
        Ok(event)
    }

    /// Reads the stream until `done` holds for the state of `id`, FAILED included.
    pub async fn until_settled(
        &mut self,
        id: &str,
        timeout: Duration,
        done: impl Fn(&proto::LiveLessonState) -> bool,
    ) -> anyhow::Result<proto::LiveLessonState> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(state) = self.seen.get(id).filter(|s| done(s)) {
                return Ok(state.clone());
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            ensure!(
                !left.is_zero(),
                "not settled within {timeout:?}; last seen: {}",
                self.seen
                    .get(id)
                    .map(summary)
                    .unwrap_or_else(|| "nothing".into())
            );
            self.next(left).await?;
        }
    }

    /// Reads the stream until `done` holds for the state of `id`; FAILED ends it early.
    pub async fn until(
        &mut self,
        id: &str,
        timeout: Duration,
        done: impl Fn(&proto::LiveLessonState) -> bool,
    ) -> anyhow::Result<proto::LiveLessonState> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(state) = self.seen.get(id) {
                if done(state) {
                    return Ok(state.clone());
                }
                if state.phase == Phase::Failed as i32 {
                    bail!("live lesson FAILED: {}", state.reason);
                }
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            ensure!(
                !left.is_zero(),
                "not there within {timeout:?}; last seen: {}",
                self.seen
                    .get(id)
                    .map(summary)
                    .unwrap_or_else(|| "nothing".into())
            );
            self.next(left).await?;
        }
    }
}
