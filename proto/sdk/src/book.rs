//! [`StateBook`] keeps what an agent reports: every live lesson's [`LiveLessonState`] with a
//! revision counter, and turns it into the protocol's `Get`, `List` (label selector, pages) and
//! `Watch` (snapshot first, then changes, heartbeats, a resync when a watcher falls behind)
//! answers, so that every agent gets those rules right the same way; [`Reporter`] is a driver's
//! handle on one generation's entry in it.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message as _;
use tokio::sync::broadcast;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use antidote_proto::agent::v1::{
    self as proto, Deleted, Heartbeat, ListRequest, ListResponse, LiveLessonState, Phase, Resync,
    Snapshot, WatchEvent, WatchRequest, watch_event::Event,
};

/// The stream type of a `Watch` answer.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

/// Largest page `List` returns.
pub const MAX_PAGE: usize = 500;

/// How many changes a watcher may fall behind before it is resynced.
const CHANNEL: usize = 4096;

/// Longest heartbeat interval `Watch` accepts (PROTOCOL.md [W4]).
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(30);

/// Shortest heartbeat interval `Watch` accepts: a shorter one is raised to it, so a watcher
/// cannot make the agent spin (PROTOCOL.md [W4]).
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(100);

/// The heartbeat interval when the watcher asks for 0.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);

/// An agent's reported states, with revisions and change fan-out.
pub struct StateBook {
    inner: Mutex<Book>,
    /// Every change, with the labels of the live lesson it concerns (a `deleted` event carries
    /// only the id, yet watchers filter it by labels too).
    events: broadcast::Sender<(WatchEvent, HashMap<String, String>)>,
    /// Cancelled at shutdown: every Watch stream ends, so the server can drain.
    closed: CancellationToken,
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
            events: broadcast::channel(CHANNEL).0,
            closed: CancellationToken::new(),
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

    /// Ends every Watch stream (now and later): the agent is shutting down.
    pub fn close(&self) {
        self.closed.cancel();
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

    /// The phase of every live lesson held.
    pub fn phases(&self) -> Vec<i32> {
        self.lock().states.values().map(|s| s.phase).collect()
    }

    /// Ids of every live lesson held.
    pub fn ids(&self) -> Vec<String> {
        self.lock().states.keys().cloned().collect()
    }

    /// Stores a new state (bumping the revision) and tells watchers; returns it as stored.
    pub fn put(&self, state: LiveLessonState) -> LiveLessonState {
        self.store(state, true)
    }

    /// Stores a new state (bumping the revision) without telling watchers: for a state that is
    /// replaced at once (an agent's first answer to Provision when its work needs no waiting).
    /// Watchers see the next [`StateBook::put`] or [`StateBook::update`] of it; its revision is
    /// never sent, and revisions on a stream still only increase.
    pub fn put_quietly(&self, state: LiveLessonState) -> LiveLessonState {
        self.store(state, false)
    }

    fn store(&self, mut state: LiveLessonState, tell: bool) -> LiveLessonState {
        let mut book = self.lock();
        book.revision += 1;
        state.revision = book.revision;
        book.states
            .insert(state.live_lesson_id.clone(), state.clone());
        if !tell {
            return state;
        }
        let _ = self.events.send((
            WatchEvent {
                revision: book.revision,
                event: Some(Event::Changed(state.clone())),
            },
            state.labels.clone(),
        ));
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
        let _ = self.events.send((
            WatchEvent {
                revision: book.revision,
                event: Some(Event::Deleted(Deleted {
                    live_lesson_id: id.to_owned(),
                })),
            },
            removed.labels.clone(),
        ));
        Some(removed)
    }

    /// Answers `List`: states whose labels include the selector, ordered by id, paged.
    pub fn list(&self, request: &ListRequest) -> ListResponse {
        self.list_with(request, Vec::new())
    }

    /// Answers `List` over the held states plus `found` (live lessons the backend holds that
    /// this book does not, e.g. after a restart). `found` is not stored: a live lesson removed
    /// meanwhile is not brought back.
    pub fn list_with(&self, request: &ListRequest, found: Vec<LiveLessonState>) -> ListResponse {
        let page_size = match request.page_size as usize {
            0 => MAX_PAGE,
            n => n.min(MAX_PAGE),
        };
        let after = |id: &str| request.page_token.is_empty() || id > request.page_token.as_str();
        let wanted = |s: &LiveLessonState| {
            after(&s.live_lesson_id) && matches(&s.labels, &request.label_selector)
        };
        let book = self.lock();
        let mut merged: BTreeMap<&str, &LiveLessonState> = found
            .iter()
            .filter(|s| wanted(s))
            .map(|s| (s.live_lesson_id.as_str(), s))
            .collect();
        let start = match request.page_token.as_str() {
            "" => std::ops::Bound::Unbounded,
            token => std::ops::Bound::Excluded(token.to_owned()),
        };
        // Held states win over found ones; at most a page (+1) of them is needed.
        for (id, state) in book
            .states
            .range((start, std::ops::Bound::Unbounded))
            .filter(|(_, s)| matches(&s.labels, &request.label_selector))
            .take(page_size + 1)
        {
            merged.insert(id.as_str(), state);
        }
        let mut items: Vec<LiveLessonState> =
            merged.into_values().take(page_size + 1).cloned().collect();
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

    /// A snapshot of every state matching `selector` at the current revision: one message when
    /// `page_bytes` is 0, else pages of at most `page_bytes` encoded bytes each (PROTOCOL.md
    /// [W8]): a state larger than that goes alone, every page but the last has `more`, an
    /// empty snapshot is one empty page.
    fn snapshot(&self, selector: &HashMap<String, String>, page_bytes: usize) -> Vec<WatchEvent> {
        let book = self.lock();
        let revision = book.revision;
        let states = book
            .states
            .values()
            .filter(|s| matches(&s.labels, selector));
        let page = |items: Vec<LiveLessonState>| WatchEvent {
            revision,
            event: Some(Event::Snapshot(Snapshot { items, more: true })),
        };
        let mut pages = Vec::new();
        if page_bytes == 0 {
            pages.push(page(states.cloned().collect()));
        } else {
            // The page's size without items: a `more` page, at this revision, plus the 4 bytes
            // its snapshot's length prefix may grow by as items join it.
            let empty = page(Vec::new()).encoded_len() + 4;
            let mut items = Vec::new();
            let mut size = empty;
            for state in states {
                // An item costs its tag, its length and itself.
                let len = state.encoded_len();
                let cost = 1 + prost::length_delimiter_len(len) + len;
                if !items.is_empty() && size + cost > page_bytes {
                    pages.push(page(std::mem::take(&mut items)));
                    size = empty;
                }
                size += cost;
                items.push(state.clone());
            }
            pages.push(page(items));
        }
        if let Some(WatchEvent {
            event: Some(Event::Snapshot(last)),
            ..
        }) = pages.last_mut()
        {
            last.more = false;
        }
        pages
    }

    /// Answers `Watch` (PROTOCOL.md "Watch"): a snapshot at the current revision, then every
    /// change matching the selector (each at a revision above everything sent before), a
    /// heartbeat when quiet for the interval (at the revision of the last message sent), and on
    /// falling behind a resync (at that revision) followed by a fresh snapshot.
    pub fn watch(self: &std::sync::Arc<Self>, request: WatchRequest) -> WatchStream {
        let heartbeat = heartbeat_interval(request.heartbeat_interval);
        let page_bytes = request.snapshot_page_bytes as usize;
        let selector = request.label_selector;
        let book = self.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            // Subscribe before the snapshot so that nothing falls between them.
            let mut events = book.events.subscribe();
            let snapshot = book.snapshot(&selector, page_bytes);
            // The newest revision this watcher has been told about: changes already in a
            // snapshot are not sent again, and revisions never go back.
            let mut told = snapshot.first().map_or(0, |page| page.revision);
            for page in snapshot {
                if tx.send(Ok(page)).await.is_err() {
                    return;
                }
            }
            let mut ticker = tokio::time::interval(heartbeat);
            ticker.reset();
            loop {
                let event = tokio::select! {
                    _ = tx.closed() => return,
                    _ = book.closed.cancelled() => return,
                    _ = ticker.tick() => WatchEvent {
                        revision: told,
                        event: Some(Event::Heartbeat(Heartbeat {
                            sent_at: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
                        })),
                    },
                    received = events.recv() => match received {
                        Ok((event, labels)) => {
                            if event.revision <= told || !matches(&labels, &selector) {
                                continue;
                            }
                            event
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            let resync = WatchEvent {
                                revision: told,
                                event: Some(Event::Resync(Resync {
                                    reason: format!("watcher fell behind by {n} events"),
                                })),
                            };
                            if tx.send(Ok(resync)).await.is_err() {
                                return;
                            }
                            let mut pages = book.snapshot(&selector, page_bytes);
                            // The last page is sent below, with the revision it carries.
                            let Some(last) = pages.pop() else { continue };
                            for page in pages {
                                if tx.send(Ok(page)).await.is_err() {
                                    return;
                                }
                            }
                            last
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                };
                told = told.max(event.revision);
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

/// The effective heartbeat interval of a Watch asking for `asked`: 10 s for none or 0, else
/// raised to 100 ms and capped at 30 s (PROTOCOL.md [W4]).
pub fn heartbeat_interval(asked: Option<prost_types::Duration>) -> Duration {
    asked
        .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
        .filter(|d| !d.is_zero())
        .map_or(DEFAULT_HEARTBEAT, |d| d.clamp(MIN_HEARTBEAT, MAX_HEARTBEAT))
}

/// Whether `labels` include every pair of `selector`.
pub fn matches(labels: &HashMap<String, String>, selector: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A driver's handle on its live lesson's reported state. Every change is dropped once a newer
/// generation has been received, so a stale driver can never overwrite newer news.
#[derive(Clone)]
pub struct Reporter {
    book: Arc<StateBook>,
    id: String,
    generation: u64,
}

impl Reporter {
    /// The reporter of generation `generation` of live lesson `id` in `book`.
    pub(crate) fn new(book: Arc<StateBook>, id: String, generation: u64) -> Reporter {
        Reporter {
            book,
            id,
            generation,
        }
    }

    /// Changes the reported state (watchers see it).
    pub fn update(&self, change: impl FnOnce(&mut proto::LiveLessonState)) {
        self.book.update(&self.id, |state| {
            if state.generation == self.generation {
                change(state);
            }
        });
    }

    /// Moves to `phase` with `reason`.
    pub fn phase(&self, phase: Phase, reason: impl Into<String>) {
        let reason = reason.into();
        self.update(|s| {
            s.phase = phase as i32;
            s.reason = reason;
        });
    }

    /// Reports the endpoints (addresses, health).
    pub fn endpoints(&self, endpoints: Vec<proto::EndpointState>) {
        self.update(|s| s.endpoints = endpoints);
    }

    /// Says why the live lesson is where it is, in the same phase ("pod `web` waits for a
    /// node: …").
    pub fn reason(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.update(|s| s.reason = reason);
    }

    /// Sets condition `kind` ([R8]: for people and tools that show them; the scheduler decides
    /// on none), replacing one of the same type; `None` removes it.
    pub fn condition(&self, kind: &str, condition: Option<(bool, &str, String)>) {
        self.update(|s| {
            s.conditions.retain(|c| c.r#type != kind);
            if let Some((status, reason, message)) = condition {
                s.conditions.push(proto::Condition {
                    r#type: kind.to_owned(),
                    status,
                    reason: reason.to_owned(),
                    message,
                    last_transition: Some(std::time::SystemTime::now().into()),
                });
            }
        });
    }

    /// The current reported state.
    pub fn current(&self) -> Option<proto::LiveLessonState> {
        self.book
            .get(&self.id)
            .filter(|s| s.generation == self.generation)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use tokio_stream::StreamExt as _;

    use super::*;

    fn state(id: &str, lesson: &str) -> LiveLessonState {
        LiveLessonState {
            live_lesson_id: id.into(),
            labels: HashMap::from([("antidote.io/lesson".into(), lesson.into())]),
            ..Default::default()
        }
    }

    fn selector(lesson: &str) -> HashMap<String, String> {
        HashMap::from([("antidote.io/lesson".into(), lesson.into())])
    }

    /// The next message of a Watch stream that goes on without errors (also the SDK agent's
    /// tests' helper).
    pub(crate) async fn next(stream: &mut WatchStream) -> WatchEvent {
        stream
            .next()
            .await
            .expect("the stream goes on")
            .expect("no error")
    }

    #[tokio::test]
    async fn watch_sends_a_snapshot_then_matching_changes_and_deletions() {
        let book = Arc::new(StateBook::default());
        book.put(state("a", "one"));
        book.put(state("b", "two"));
        let mut stream = book.watch(WatchRequest {
            label_selector: selector("one"),
            ..Default::default()
        });
        let first = next(&mut stream).await;
        let Some(Event::Snapshot(snapshot)) = first.event else {
            panic!("first message {first:?}");
        };
        assert_eq!(snapshot.items.len(), 1);
        assert_eq!(first.revision, 2);
        book.put(state("b", "two"));
        book.remove("b");
        book.put(state("a", "one"));
        book.remove("a");
        let changed = next(&mut stream).await;
        assert!(matches!(&changed.event, Some(Event::Changed(s)) if s.live_lesson_id == "a"));
        assert_eq!(changed.revision, 5);
        let deleted = next(&mut stream).await;
        assert!(matches!(&deleted.event, Some(Event::Deleted(d)) if d.live_lesson_id == "a"));
        assert_eq!(deleted.revision, 6);
    }

    #[tokio::test]
    async fn a_quiet_watch_gets_heartbeats_with_the_last_revision() {
        let book = Arc::new(StateBook::default());
        book.put(state("a", "one"));
        let mut stream = book.watch(WatchRequest {
            label_selector: HashMap::new(),
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 0,
                nanos: 50_000_000,
            }),
            ..Default::default()
        });
        next(&mut stream).await;
        let heartbeat = next(&mut stream).await;
        assert!(matches!(heartbeat.event, Some(Event::Heartbeat(_))));
        assert_eq!(heartbeat.revision, 1);
    }

    #[test]
    fn heartbeat_intervals_are_clamped() {
        let asked = |seconds, nanos| Some(prost_types::Duration { seconds, nanos });
        assert_eq!(heartbeat_interval(None), DEFAULT_HEARTBEAT);
        assert_eq!(heartbeat_interval(asked(0, 0)), DEFAULT_HEARTBEAT);
        assert_eq!(heartbeat_interval(asked(0, 1_000)), MIN_HEARTBEAT);
        assert_eq!(heartbeat_interval(asked(5, 0)), Duration::from_secs(5));
        assert_eq!(heartbeat_interval(asked(3600, 0)), MAX_HEARTBEAT);
        assert_eq!(heartbeat_interval(asked(-5, 0)), DEFAULT_HEARTBEAT);
    }

    #[tokio::test]
    async fn the_first_snapshot_is_at_the_current_revision_and_heartbeats_repeat_the_last_sent() {
        let book = Arc::new(StateBook::default());
        book.put(state("a", "one"));
        book.put(state("b", "two"));
        // A selector that matches nothing: the snapshot is still at the agent's revision, and
        // changes elsewhere do not move the stream's revision.
        let mut stream = book.watch(WatchRequest {
            label_selector: selector("three"),
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 0,
                nanos: 100_000_000,
            }),
            ..Default::default()
        });
        let first = next(&mut stream).await;
        assert!(matches!(first.event, Some(Event::Snapshot(_))));
        assert_eq!(first.revision, 2);
        book.put(state("a", "one"));
        let heartbeat = next(&mut stream).await;
        assert!(matches!(heartbeat.event, Some(Event::Heartbeat(_))));
        assert_eq!(
            heartbeat.revision, 2,
            "the last revision sent on this stream"
        );
    }

    #[tokio::test]
    async fn a_watcher_that_falls_behind_is_resynced_with_a_fresh_snapshot() {
        let book = Arc::new(StateBook::default());
        let mut stream = book.watch(WatchRequest::default());
        next(&mut stream).await;
        for n in 0..(CHANNEL + 500) {
            book.put(state(&format!("l{}", n % 3), "one"));
        }
        let mut revision = 0;
        loop {
            let event = next(&mut stream).await;
            assert!(event.revision >= revision, "revisions never go back");
            revision = event.revision;
            if let Some(Event::Resync(resync)) = event.event {
                assert!(resync.reason.contains("fell behind"), "{}", resync.reason);
                break;
            }
        }
        let snapshot = next(&mut stream).await;
        let Some(Event::Snapshot(snapshot_items)) = snapshot.event else {
            panic!("a snapshot follows a resync");
        };
        assert_eq!(snapshot_items.items.len(), 3);
        assert_eq!(snapshot.revision, (CHANNEL + 500) as u64);
    }

    #[tokio::test]
    async fn snapshots_come_in_pages_of_bounded_size_when_asked() {
        let book = Arc::new(StateBook::default());
        for n in 0..1000 {
            let mut s = state(&format!("l{n:04}"), "one");
            s.reason = "x".repeat(n % 300);
            book.put(s);
        }
        // One state far larger than a page goes alone.
        let mut big = state("l9999", "one");
        big.reason = "y".repeat(20_000);
        book.put(big);
        let limit = 16 * 1024;
        let mut stream = book.watch(WatchRequest {
            snapshot_page_bytes: limit as u32,
            ..Default::default()
        });
        let mut ids = Vec::new();
        let mut pages = 0;
        loop {
            let event = next(&mut stream).await;
            assert_eq!(
                event.revision, 1001,
                "every page at the snapshot's revision"
            );
            let size = event.encoded_len();
            let Some(Event::Snapshot(page)) = event.event else {
                panic!("a page of the snapshot expected, got {event:?}");
            };
            assert!(!page.items.is_empty());
            assert!(
                size <= limit || page.items.len() == 1,
                "a page of {} states is {size} bytes",
                page.items.len()
            );
            pages += 1;
            ids.extend(page.items.into_iter().map(|s| s.live_lesson_id));
            if !page.more {
                break;
            }
        }
        assert!(pages > 10, "{pages} pages");
        assert_eq!(ids.len(), 1001);
        ids.dedup();
        assert_eq!(ids.len(), 1001, "no state twice");
        // Changes follow the last page.
        book.remove("l0000");
        let deleted = next(&mut stream).await;
        assert!(
            matches!(deleted.event, Some(Event::Deleted(_))),
            "{deleted:?}"
        );
    }

    #[tokio::test]
    async fn an_empty_snapshot_is_one_empty_last_page_and_no_paging_is_one_message() {
        let book = Arc::new(StateBook::default());
        let mut stream = book.watch(WatchRequest {
            snapshot_page_bytes: 1,
            ..Default::default()
        });
        let first = next(&mut stream).await;
        assert!(
            matches!(&first.event, Some(Event::Snapshot(s)) if s.items.is_empty() && !s.more),
            "{first:?}"
        );
        for n in 0..10 {
            book.put(state(&format!("l{n}"), "one"));
        }
        let mut stream = book.watch(WatchRequest::default());
        let first = next(&mut stream).await;
        assert!(
            matches!(&first.event, Some(Event::Snapshot(s)) if s.items.len() == 10 && !s.more),
            "{first:?}"
        );
    }

    #[test]
    fn list_pages_in_id_order_with_the_last_id_as_token() {
        let book = StateBook::default();
        for id in ["c", "a", "d", "b"] {
            book.put(state(id, if id == "d" { "two" } else { "one" }));
        }
        let first = book.list(&ListRequest {
            label_selector: selector("one"),
            page_size: 2,
            page_token: String::new(),
        });
        let ids: Vec<_> = first
            .items
            .iter()
            .map(|s| s.live_lesson_id.as_str())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(first.next_page_token, "b");
        let second = book.list(&ListRequest {
            label_selector: selector("one"),
            page_size: 2,
            page_token: first.next_page_token,
        });
        let ids: Vec<_> = second
            .items
            .iter()
            .map(|s| s.live_lesson_id.as_str())
            .collect();
        assert_eq!(ids, ["c"]);
        assert!(second.next_page_token.is_empty());
    }

    #[test]
    fn list_merges_found_states_without_keeping_them() {
        let book = StateBook::default();
        book.put(state("b", "one"));
        let found = vec![state("a", "one"), state("b", "one"), state("c", "two")];
        let listed = book.list_with(
            &ListRequest {
                label_selector: selector("one"),
                page_size: 0,
                page_token: String::new(),
            },
            found,
        );
        let ids: Vec<_> = listed
            .items
            .iter()
            .map(|s| s.live_lesson_id.as_str())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(listed.items[1].revision, 1, "the held state wins");
        assert!(book.get("a").is_none(), "found states are not stored");
    }
}
