//! What one write job did, as it declares it: the effects both stores' caches learn from
//! ([`super::written`] for SQLite's writer, [`super::heard`] for a PostgreSQL replica), in the
//! job's order.

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

/// What one write job did, as the job declared it.
#[derive(Debug, Default)]
pub(super) struct Effects {
    /// In order.
    pub(super) effects: Vec<Effect>,
    /// How many live-lesson row changes the declared effects account for.
    pub(super) declared: u64,
    /// How many placement record writes they account for.
    pub(super) placements: u64,
    /// How many live lessons they say are gone (each takes its placement record with it).
    pub(super) gone: u64,
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
