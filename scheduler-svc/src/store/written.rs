//! What the SQLite writer knows (SQLite only): a write-through cache of the live lessons it
//! wrote, of their placement records and of the learners' session tokens, so the hot path's
//! reads (the reconciler's run and placement, Watch's first answer, a token's session) need no
//! round trip to an SQLite connection's thread. PostgreSQL replicas share no memory, so there
//! is none there.
//!
//! Only the writer fills it, after the batch that wrote the rows committed and before their
//! callers hear of it: a read that finds a row here sees a committed state at least as new as
//! the caller's own last write. A miss reads SQLite as before.
//!
//! Every live-lesson row a job changes must be one it declared (returned by a statement
//! through [`super::backend::Conn::fetch_lessons`], or deleted through `forget_lesson`).
//! SQLite's update hook counts every row change of `live_lessons` on the writing connection,
//! triggers' and failed statements' included; a job that changed more rows than it declared
//! (a trigger such as the one carrying a session's persistence, a statement written without
//! the helpers, a failure half-way) empties the lesson cache, so an unknown change can cost
//! speed but never serve a stale row. A batch whose commit fails changes nothing here.
//!
//! Placement records: a live lesson's record is known exactly from the write that created the
//! live lesson (none: records are written only while their live lesson exists, and a trigger
//! deletes them with it) or from a write that returned the record (`RETURNING` it, through
//! [`super::backend::Conn::fetch_placements`]), until the live lesson is gone. The update hook
//! counts `placements` row writes and deletions apart: a job that wrote more records than it
//! declared, or deleted more than the live lessons it declared gone, empties this part of the
//! cache, as for live lessons.
//!
//! Tokens: a session's token hash maps to its id from the write that created the session
//! until the write that expired it (`expire_sessions`, the only statement that sets
//! `sessions.expired`; learners' sessions are deleted only once expired).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::effects::{Effect, Effects};
use crate::model::{LiveLesson, LiveLessonId, PlacementRecord, SessionId};

/// Row changes the update hook counted on the writing connection, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Changes {
    /// Of `live_lessons` (any kind).
    pub(super) lessons: u64,
    /// Inserts and updates of `placements`.
    pub(super) placements: u64,
    /// Deletions of `placements`.
    pub(super) placements_deleted: u64,
}

impl std::ops::Sub for Changes {
    type Output = Changes;

    fn sub(self, before: Changes) -> Changes {
        Changes {
            lessons: self.lessons - before.lessons,
            placements: self.placements - before.placements,
            placements_deleted: self.placements_deleted - before.placements_deleted,
        }
    }
}

/// The cache, shared by the store's clones; the writer is its only writer.
#[derive(Default)]
pub(super) struct Written {
    /// Live lessons by id, as last written.
    lessons: Mutex<HashMap<LiveLessonId, LiveLesson>>,
    /// Learners' session tokens (SHA-256) → their live sessions.
    tokens: Mutex<HashMap<[u8; 32], SessionId>>,
    /// Placement records by live lesson, exactly (a default record: none).
    placements: Mutex<HashMap<LiveLessonId, PlacementRecord>>,
    /// Row changes of `live_lessons` on the writing connection (SQLite's update hook).
    changes: AtomicU64,
    /// Inserts and updates of `placements` on it.
    placement_writes: AtomicU64,
    /// Deletions of `placements` on it.
    placement_deletes: AtomicU64,
}

impl Written {
    /// The live lesson `id` as last written, if known.
    pub(super) fn lesson(&self, id: LiveLessonId) -> Option<LiveLesson> {
        lock(&self.lessons).get(&id).cloned()
    }

    /// The live session of a token hash, if known.
    pub(super) fn session(&self, token_hash: &[u8; 32]) -> Option<SessionId> {
        lock(&self.tokens).get(token_hash).copied()
    }

    /// The placement record of live lesson `id`, if known.
    pub(super) fn placement(&self, id: LiveLessonId) -> Option<PlacementRecord> {
        lock(&self.placements).get(&id).cloned()
    }

    /// Called by the update hook for every row change on the writing connection.
    pub(super) fn changed(&self, table: &str, deleted: bool) {
        let counter = match table {
            "live_lessons" => &self.changes,
            "placements" if deleted => &self.placement_deletes,
            "placements" => &self.placement_writes,
            _ => return,
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }

    /// Row changes so far (the writer reads them around each job).
    pub(super) fn changes(&self) -> Changes {
        Changes {
            lessons: self.changes.load(Ordering::SeqCst),
            placements: self.placement_writes.load(Ordering::SeqCst),
            placements_deleted: self.placement_deletes.load(Ordering::SeqCst),
        }
    }

    /// Learns what the jobs of a committed batch did, in order: `changes` is what each job
    /// changed by the update hook's count.
    pub(super) fn apply(&self, jobs: Vec<(Changes, Effects)>) {
        let mut lessons = lock(&self.lessons);
        let mut placements = lock(&self.placements);
        for (changes, effects) in jobs {
            let unknown = changes.lessons > effects.declared;
            if unknown {
                lessons.clear();
            }
            let unknown_placements = changes.placements > effects.placements
                || changes.placements_deleted > effects.gone;
            if unknown_placements {
                placements.clear();
            }
            for effect in effects.effects {
                match effect {
                    Effect::Lesson(lesson) if !unknown => {
                        lessons.insert(lesson.id, lesson);
                    }
                    Effect::Lesson(_) => {}
                    Effect::Gone(id) => {
                        lessons.remove(&id);
                        placements.remove(&id);
                    }
                    Effect::Placement(id, record) if !unknown_placements => {
                        placements.insert(id, record);
                    }
                    Effect::Created(id) if !unknown_placements => {
                        placements.insert(id, PlacementRecord::default());
                    }
                    Effect::Placement(..) | Effect::Created(_) => {}
                    Effect::Token(hash, session) => {
                        lock(&self.tokens).insert(hash, session);
                    }
                    Effect::Expired(sessions) if !sessions.is_empty() => {
                        let sessions: HashSet<SessionId> = sessions.into_iter().collect();
                        lock(&self.tokens).retain(|_, session| !sessions.contains(session));
                    }
                    Effect::Expired(_) => {}
                }
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are single map operations; a poisoned lock is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
