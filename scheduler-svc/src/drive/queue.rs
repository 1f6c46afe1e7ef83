//! A de-duplicating work queue in the style of client-go's: an id is queued at most once, never
//! processed by two workers at once, and re-queued when it was added during processing. Runs
//! are short (no worker waits for an agent to settle, see `reconcile`), so an id added during
//! its run simply runs again right after.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use tokio::sync::Notify;

use crate::model::LiveLessonId;

/// A de-duplicating work queue in the style of client-go's: an id is queued at most once, never
/// processed by two workers at once, and re-queued when it was added during processing.
#[derive(Default)]
pub struct WorkQueue {
    state: Mutex<QueueState>,
    /// Wakes an idle worker.
    available: Notify,
}

#[derive(Default)]
struct QueueState {
    queue: VecDeque<LiveLessonId>,
    queued: HashSet<LiveLessonId>,
    /// Ids being processed.
    processing: HashSet<LiveLessonId>,
    /// Ids added while being processed.
    dirty: HashSet<LiveLessonId>,
}

impl WorkQueue {
    /// Queues `id`, or marks it dirty while it is being processed.
    pub fn add(&self, id: LiveLessonId) {
        let mut state = lock(&self.state);
        if state.processing.contains(&id) {
            state.dirty.insert(id);
            return;
        }
        if state.queued.insert(id) {
            state.queue.push_back(id);
            drop(state);
            self.available.notify_one();
        }
    }

    /// The next id to process.
    pub async fn next(&self) -> LiveLessonId {
        loop {
            {
                let mut state = lock(&self.state);
                if let Some(id) = state.queue.pop_front() {
                    state.queued.remove(&id);
                    state.processing.insert(id);
                    if !state.queue.is_empty() {
                        // Pass the wake-up on: more work is waiting.
                        self.available.notify_one();
                    }
                    return id;
                }
            }
            self.available.notified().await;
        }
    }

    /// Whether `id` is queued or being processed.
    pub fn contains(&self, id: LiveLessonId) -> bool {
        let state = lock(&self.state);
        state.queued.contains(&id) || state.processing.contains(&id)
    }

    /// Ends processing of `id`; a dirty id is queued again.
    pub fn done(&self, id: LiveLessonId) {
        let mut state = lock(&self.state);
        state.processing.remove(&id);
        if state.dirty.remove(&id) && state.queued.insert(id) {
            state.queue.push_back(id);
            drop(state);
            self.available.notify_one();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single collection operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn queue_deduplicates_and_requeues_dirty_ids() {
        let queue = WorkQueue::default();
        let a = LiveLessonId::new();
        let b = LiveLessonId::new();
        queue.add(a);
        queue.add(a);
        queue.add(b);
        let first = queue.next().await;
        assert_eq!(first, a);
        // Added while processing: `a` is not handed to a second worker, and comes back after
        // `done`.
        queue.add(a);
        let second = queue.next().await;
        assert_eq!(second, b);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), queue.next())
                .await
                .is_err(),
            "a dirty id waits for its run to end"
        );
        queue.done(a);
        let third = queue.next().await;
        assert_eq!(third, a);
        queue.done(a);
        queue.done(b);
        assert!(lock(&queue.state).queue.is_empty());
    }
}
