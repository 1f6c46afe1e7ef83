//! Building blocks for agents written in Rust (the start of the agent SDK).
//!
//! [`StateBook`] keeps what an agent reports: every live lesson's [`LiveLessonState`] with a
//! revision counter, and turns it into the protocol's `Get`, `List` (label selector, pages) and
//! `Watch` (snapshot first, then changes, heartbeats, a resync when a watcher falls behind)
//! answers, so that every agent gets those rules right the same way.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use futures_core::Stream;
use tokio::sync::broadcast;
use tonic::Status;

use crate::agent::v1::{
    Deleted, Heartbeat, ListRequest, ListResponse, LiveLessonState, Resync, Snapshot, WatchEvent,
    WatchRequest, watch_event::Event,
};

/// The stream type of a `Watch` answer.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

/// Largest page `List` returns.
pub const MAX_PAGE: usize = 500;

/// Longest heartbeat interval `Watch` accepts.
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(30);

/// An agent's reported states, with revisions and change fan-out.
pub struct StateBook {
    inner: Mutex<Book>,
    events: broadcast::Sender<WatchEvent>,
}

struct Book {
    revision: u64,
    states: BTreeMap<String, LiveLessonState>,
}

impl Default for StateBook {
    fn default() -> Self {
        StateBook {
            inner: Mutex::new(Book {
                revision: 0,
                states: BTreeMap::new(),
            }),
            events: broadcast::channel(4096).0,
        }
    }
}

impl StateBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        // Every critical section leaves the map consistent; a poisoned lock is still usable.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The state of one live lesson.
    pub fn get(&self, id: &str) -> Option<LiveLessonState> {
        self.lock().states.get(id).cloned()
    }

    /// How many live lessons are held.
    pub fn len(&self) -> usize {
        self.lock().states.len()
    }

    /// Whether no live lesson is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ids of every live lesson held.
    pub fn ids(&self) -> Vec<String> {
        self.lock().states.keys().cloned().collect()
    }

    /// Stores a new state (bumping the revision) and tells watchers; returns it as stored.
    pub fn put(&self, mut state: LiveLessonState) -> LiveLessonState {
        let mut book = self.lock();
        book.revision += 1;
        state.revision = book.revision;
        book.states
            .insert(state.live_lesson_id.clone(), state.clone());
        let _ = self.events.send(WatchEvent {
            revision: book.revision,
            event: Some(Event::Changed(state.clone())),
        });
        state
    }

    /// Changes a held state in place; `None` when the live lesson is not held.
    pub fn update(
        &self,
        id: &str,
        change: impl FnOnce(&mut LiveLessonState),
    ) -> Option<LiveLessonState> {
        let mut state = self.get(id)?;
        change(&mut state);
        Some(self.put(state))
    }

    /// Forgets a live lesson and tells watchers it is gone.
    pub fn remove(&self, id: &str) -> Option<LiveLessonState> {
        let mut book = self.lock();
        let removed = book.states.remove(id)?;
        book.revision += 1;
        let _ = self.events.send(WatchEvent {
            revision: book.revision,
            event: Some(Event::Deleted(Deleted {
                live_lesson_id: id.to_owned(),
            })),
        });
        Some(removed)
    }

    /// Answers `List`: states whose labels include the selector, ordered by id, paged.
    pub fn list(&self, request: &ListRequest) -> ListResponse {
        let page_size = match request.page_size as usize {
            0 => MAX_PAGE,
            n => n.min(MAX_PAGE),
        };
        let book = self.lock();
        let start = match request.page_token.as_str() {
            "" => std::ops::Bound::Unbounded,
            token => std::ops::Bound::Excluded(token.to_owned()),
        };
        let mut items: Vec<_> = book
            .states
            .range((start, std::ops::Bound::Unbounded))
            .filter(|(_, s)| matches(&s.labels, &request.label_selector))
            .take(page_size + 1)
            .map(|(_, s)| s.clone())
            .collect();
        let next_page_token = if items.len() > page_size {
            items.truncate(page_size);
            items
                .last()
                .map(|s| s.live_lesson_id.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        ListResponse {
            items,
            next_page_token,
            revision: book.revision,
        }
    }

    fn snapshot(&self, selector: &HashMap<String, String>) -> WatchEvent {
        let book = self.lock();
        WatchEvent {
            revision: book.revision,
            event: Some(Event::Snapshot(Snapshot {
                items: book
                    .states
                    .values()
                    .filter(|s| matches(&s.labels, selector))
                    .cloned()
                    .collect(),
            })),
        }
    }

    fn revision(&self) -> u64 {
        self.lock().revision
    }

    /// Answers `Watch`: a snapshot, then every change matching the selector, a heartbeat when
    /// quiet, and on falling behind a resync followed by a fresh snapshot.
    pub fn watch(self: &std::sync::Arc<Self>, request: WatchRequest) -> WatchStream {
        let heartbeat = request
            .heartbeat_interval
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(10))
            .min(MAX_HEARTBEAT);
        let selector = request.label_selector;
        let book = self.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            // Subscribe before the snapshot so that nothing falls between them.
            let mut events = book.events.subscribe();
            if tx.send(Ok(book.snapshot(&selector))).await.is_err() {
                return;
            }
            let mut ticker = tokio::time::interval(heartbeat);
            ticker.reset();
            loop {
                let event = tokio::select! {
                    _ = tx.closed() => return,
                    _ = ticker.tick() => WatchEvent {
                        revision: book.revision(),
                        event: Some(Event::Heartbeat(Heartbeat {
                            sent_at: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
                        })),
                    },
                    received = events.recv() => match received {
                        Ok(event) => {
                            if let Some(Event::Changed(state)) = &event.event
                                && !matches(&state.labels, &selector)
                            {
                                continue;
                            }
                            event
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            let resync = WatchEvent {
                                revision: book.revision(),
                                event: Some(Event::Resync(Resync {
                                    reason: format!("watcher fell behind by {n} events"),
                                })),
                            };
                            if tx.send(Ok(resync)).await.is_err() {
                                return;
                            }
                            book.snapshot(&selector)
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                };
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

/// Whether `labels` include every pair of `selector`.
pub fn matches(labels: &HashMap<String, String>, selector: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}
