//! What the SQLite writer knows (SQLite only): a write-through cache of the live lessons it
//! wrote and of the learners' session tokens, so the hot path's reads (the reconciler's run,
//! Watch's first answer, a token's session) need no round trip to an SQLite connection's
//! thread. PostgreSQL replicas share no memory, so there is none there.
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
//! Tokens: a session's token hash maps to its id from the write that created the session
//! until the write that expired it (`expire_sessions`, the only statement that sets
//! `sessions.expired`; learners' sessions are deleted only once expired).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::{LiveLesson, LiveLessonId, SessionId};

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
}

/// What one write job did, as the job declared it.
#[derive(Debug, Default)]
pub(super) struct Effects {
    /// In order.
    effects: Vec<Effect>,
    /// How many live-lesson row changes the declared effects account for.
    declared: u64,
}

impl Effects {
    /// Live-lesson row changes (one per effect).
    pub(super) fn declare(&mut self, effects: impl Iterator<Item = Effect>) {
        for effect in effects {
            self.declared += 1;
            self.effects.push(effect);
        }
    }

    /// Something that changed no live-lesson row.
    pub(super) fn note(&mut self, effect: Effect) {
        self.effects.push(effect);
    }
}

/// The cache, shared by the store's clones; the writer is its only writer.
#[derive(Default)]
pub(super) struct Known {
    /// Live lessons by id, as last written.
    lessons: Mutex<HashMap<LiveLessonId, LiveLesson>>,
    /// Learners' session tokens (SHA-256) → their live sessions.
    tokens: Mutex<HashMap<[u8; 32], SessionId>>,
    /// Row changes of `live_lessons` on the writing connection (SQLite's update hook).
    changes: AtomicU64,
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

    /// Called by the update hook for every row change on the writing connection.
    pub(super) fn changed(&self, table: &str) {
        if table == "live_lessons" {
            self.changes.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Row changes of `live_lessons` so far (the writer reads it around each job).
    pub(super) fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// Learns what the jobs of a committed batch did, in order: `changes` is how many
    /// live-lesson rows each job changed by the update hook's count.
    pub(super) fn apply(&self, jobs: Vec<(u64, Effects)>) {
        let mut lessons = lock(&self.lessons);
        for (changes, effects) in jobs {
            let unknown = changes > effects.declared;
            if unknown {
                lessons.clear();
            }
            for effect in effects.effects {
                match effect {
                    Effect::Lesson(lesson) if !unknown => {
                        lessons.insert(lesson.id, lesson);
                    }
                    Effect::Lesson(_) => {}
                    Effect::Gone(id) => {
                        lessons.remove(&id);
                    }
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
