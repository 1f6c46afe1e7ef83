//! In-process fan-out of live-lesson changes to API watchers.
//!
//! Only live lessons that someone watches have a channel: publishing to a live lesson nobody
//! watches costs one map lookup. Each channel holds the latest state only (a `watch` channel), so
//! a slow watcher skips intermediate states instead of slowing the reconciler; the full history
//! is in the store's event log.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

use crate::model::{LiveLesson, LiveLessonId};

/// What a watcher sees: the latest state, or `None` once the live lesson is gone.
pub type Update = Option<LiveLesson>;

/// The fan-out.
#[derive(Default)]
pub struct Hub {
    /// One channel per watched live lesson.
    channels: Mutex<HashMap<LiveLessonId, watch::Sender<Update>>>,
}

impl Hub {
    /// Subscribes to a live lesson's changes. Subscribe before reading the current state, so
    /// that no change can fall between the read and the subscription.
    pub fn subscribe(&self, id: LiveLessonId) -> watch::Receiver<Update> {
        let mut channels = self.lock();
        match channels.get(&id) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(None);
                channels.insert(id, tx);
                rx
            }
        }
    }

    /// Forgets a live lesson's channel if nobody holds a receiver any more (a watch that ended
    /// before it began, e.g. of an unknown id: nothing else would ever remove the entry).
    pub fn release(&self, id: LiveLessonId) {
        let mut channels = self.lock();
        if channels.get(&id).is_some_and(|tx| tx.receiver_count() == 0) {
            channels.remove(&id);
        }
    }

    /// Publishes a live lesson's new state to its watchers, if any.
    pub fn publish(&self, lesson: &LiveLesson) {
        let mut channels = self.lock();
        if let Some(tx) = channels.get(&lesson.id) {
            if tx.receiver_count() == 0 {
                channels.remove(&lesson.id);
            } else {
                tx.send_replace(Some(lesson.clone()));
            }
        }
    }

    /// Publishes a state read back from the store after another replica changed it (or after
    /// notifications may have been missed), unless watchers already have exactly that state.
    pub fn refresh(&self, lesson: &LiveLesson) {
        let mut channels = self.lock();
        if let Some(tx) = channels.get(&lesson.id) {
            if tx.receiver_count() == 0 {
                channels.remove(&lesson.id);
            } else {
                tx.send_if_modified(|current| {
                    if current.as_ref() == Some(lesson) {
                        return false;
                    }
                    *current = Some(lesson.clone());
                    true
                });
            }
        }
    }

    /// Whether someone watches the live lesson.
    pub fn is_watched(&self, id: LiveLessonId) -> bool {
        self.lock().contains_key(&id)
    }

    /// Every watched live lesson.
    pub fn watched_ids(&self) -> Vec<LiveLessonId> {
        self.lock().keys().copied().collect()
    }

    /// Tells watchers the live lesson is gone, ending their streams.
    pub fn gone(&self, id: LiveLessonId) {
        if let Some(tx) = self.lock().remove(&id) {
            tx.send_replace(None);
        }
    }

    /// How many live lessons are watched (for tests and metrics).
    pub fn watched(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LiveLessonId, watch::Sender<Update>>> {
        // A panic while holding this lock cannot leave the map inconsistent (every operation is
        // a single insert/remove/send), so a poisoned lock is safe to keep using.
        self.channels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_that_never_began_leaves_nothing_behind() {
        let hub = Hub::default();
        let id = LiveLessonId::new();
        let rx = hub.subscribe(id);
        hub.release(id);
        assert_eq!(hub.watched(), 1, "still watched while a receiver lives");
        drop(rx);
        hub.release(id);
        assert_eq!(hub.watched(), 0);
    }
}
