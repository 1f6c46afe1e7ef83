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

use crate::model::{LiveLesson, LiveLessonId, PlacementRecord, SessionId};

/// One thing a write job did that the cache must learn, in the job's order.
#[derive(Debug, Clone)]
pub(super) enum Effect {
    /// A live lesson's row as the statement left it.
    Lesson(LiveLesson),
    /// A live lesson's row deleted.
    Gone(LiveLessonId),
    /// A learner's session was created with this token hash.
    Token([u8; 32], SessionId),
    /// These sessions expired: their tokens are no longer valid.
    Expired(Vec<SessionId>),
    /// A live lesson's placement record as the statement left it.
    Placement(LiveLessonId, PlacementRecord),
    /// A live lesson created by this job: it has no placement record yet.
    Created(LiveLessonId),
}

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

/// What one write job did, as the job declared it.
#[derive(Debug, Default)]
pub(super) struct Effects {
    /// In order.
    effects: Vec<Effect>,
    /// How many live-lesson row changes the declared effects account for.
    declared: u64,
    /// How many placement record writes they account for.
    placements: u64,
    /// How many live lessons they say are gone (each takes its placement record with it).
    gone: u64,
    /// PostgreSQL: live-lesson rows with their revisions (see [`super::heard`]).
    revised: Vec<(u64, LiveLesson)>,
}

impl Effects {
    /// Live-lesson row changes (one per effect).
    pub(super) fn declare(&mut self, effects: impl Iterator<Item = Effect>) {
        for effect in effects {
            self.declared += 1;
            if matches!(effect, Effect::Gone(_)) {
                self.gone += 1;
            }
            self.effects.push(effect);
        }
    }

    /// Placement record writes (one per effect).
    pub(super) fn declare_placements(&mut self, records: impl Iterator<Item = Effect>) {
        for effect in records {
            self.placements += 1;
            self.effects.push(effect);
        }
    }

    /// Something that changed no live-lesson row.
    pub(super) fn note(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    /// PostgreSQL: a live-lesson row as the statement left it, at its revision.
    pub(super) fn revise(&mut self, revision: u64, lesson: LiveLesson) {
        self.revised.push((revision, lesson));
    }

    /// The revised rows, and the effects in order.
    pub(super) fn into_parts(self) -> (Vec<(u64, LiveLesson)>, Vec<Effect>) {
        (self.revised, self.effects)
    }
}

/// The cache, shared by the store's clones; the writer is its only writer.
#[derive(Default)]
pub(super) struct Known {
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

impl Known {
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
