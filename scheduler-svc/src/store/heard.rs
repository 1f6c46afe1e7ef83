//! What a PostgreSQL replica heard (PostgreSQL only): the live lessons and learners' session
//! tokens it knows, kept coherent with every replica's writes by the notifications
//! ([`super::changes`]), so the hot path's reads (a reconcile run's live lesson, Watch's first
//! answer, a watcher's refresh, a token's session) need no round trip to the server.
//!
//! Every change of a live lesson's row notifies, at commit and in commit order, with the row's
//! revision (counted by the database at every change: migration 0011) and, when it fits in a
//! notification, the row itself; a forgotten live lesson notifies that it is gone, an expired
//! session that its token is no longer valid. Three sources fill it, each kept only when it is
//! newer than what is known: the notifications, this replica's own writes (after their batch
//! committed, before their callers hear of it) and reads of the database that missed it. A
//! notification without the row makes the live lesson unknown until a read (or a later
//! notification) at least as new fills it.
//!
//! It answers only while a listener hears the notifications ([`Heard::listening`]): when the
//! listening connection is lost, notifications may be lost with it, so it forgets everything
//! and answers nothing until the listener is back; a read or write that began before the loss
//! fills nothing ([`Ticket`]). A forgotten live lesson stays known as gone (the last
//! [`TOMBSTONES`]), so a late write's row cannot bring it back. What it answers is what the
//! replica heard so far: another replica's change that committed an instant ago may not have
//! arrived yet, as it would not have reached this replica's watchers either; this replica's
//! own writes are always there.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use super::effects::{Effect, Effects};
use crate::model::{LiveLesson, LiveLessonId, SessionId};

/// How many forgotten live lessons are remembered as gone.
const TOMBSTONES: usize = 65_536;

/// Most session tokens kept (beyond that, the oldest half is forgotten: a miss reads).
const MOST_TOKENS: usize = 200_000;

/// Most live lessons kept (beyond that, everything is forgotten: misses read).
const MOST_LESSONS: usize = 500_000;

/// What a notification says of one live lesson.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Notice {
    /// Its row at this revision.
    Row(u64, Box<LiveLesson>),
    /// It changed to this revision (the row did not fit in the notification).
    Revised(LiveLessonId, u64),
    /// It changed, revision unknown (a replica of an older version wrote it).
    Changed(LiveLessonId),
    /// It was forgotten.
    Gone(LiveLessonId),
    /// This session expired: its token is no longer valid.
    Expired(SessionId),
}

/// When a read or write began: what it learns is kept only if nothing it could have missed
/// happened since.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticket {
    /// Losses of the listener so far.
    epoch: u64,
    /// Session expiries heard so far.
    expiries: u64,
}

/// One live lesson as known.
enum Entry {
    /// Its row at a revision.
    Row(u64, Box<LiveLesson>),
    /// Changed to at least this revision; the row is not known.
    Unknown(u64),
}

impl Entry {
    fn revision(&self) -> u64 {
        match self {
            Entry::Row(revision, _) | Entry::Unknown(revision) => *revision,
        }
    }
}

#[derive(Default)]
struct State {
    /// Listeners hearing every notification now.
    listeners: usize,
    /// Losses of a listener so far.
    epoch: u64,
    /// Session expiries heard so far.
    expiries: u64,
    lessons: HashMap<LiveLessonId, Entry>,
    /// Forgotten live lessons, the most recent [`TOMBSTONES`], oldest first.
    gone: HashSet<LiveLessonId>,
    gone_order: VecDeque<LiveLessonId>,
    /// Learners' session tokens (SHA-256) → their live sessions, and back.
    tokens: HashMap<[u8; 32], SessionId>,
    sessions: HashMap<SessionId, [u8; 32]>,
}

impl State {
    fn answers(&self) -> bool {
        self.listeners > 0
    }

    fn current(&self, ticket: Ticket) -> bool {
        self.answers() && ticket.epoch == self.epoch
    }

    /// Keeps `lesson` at `revision` unless something at least as new is known.
    fn keep(&mut self, revision: u64, lesson: LiveLesson) {
        if self.gone.contains(&lesson.id) {
            return;
        }
        match self.lessons.get(&lesson.id) {
            Some(Entry::Row(known, _)) if *known >= revision => return,
            Some(Entry::Unknown(known)) if *known > revision => return,
            _ => {}
        }
        if self.lessons.len() >= MOST_LESSONS {
            self.lessons.clear();
        }
        self.lessons
            .insert(lesson.id, Entry::Row(revision, Box::new(lesson)));
    }

    fn forget(&mut self, id: LiveLessonId) {
        self.lessons.remove(&id);
        if self.gone.insert(id) {
            self.gone_order.push_back(id);
            if self.gone_order.len() > TOMBSTONES
                && let Some(oldest) = self.gone_order.pop_front()
            {
                self.gone.remove(&oldest);
            }
        }
    }

    fn token(&mut self, hash: [u8; 32], session: SessionId) {
        if self.tokens.len() >= MOST_TOKENS {
            self.tokens.clear();
            self.sessions.clear();
        }
        self.tokens.insert(hash, session);
        self.sessions.insert(session, hash);
    }

    fn expire(&mut self, session: SessionId) {
        self.expiries += 1;
        if let Some(hash) = self.sessions.remove(&session) {
            self.tokens.remove(&hash);
        }
    }

    /// Forgets what may have gone stale (not the gone: they never come back).
    fn clear(&mut self) {
        self.epoch += 1;
        self.lessons.clear();
        self.tokens.clear();
        self.sessions.clear();
    }
}

/// The replica's knowledge, shared by the store's clones and its listeners.
#[derive(Default)]
pub(super) struct Heard {
    state: Mutex<State>,
}

impl Heard {
    /// A listener hears every notification from now on (it just listened): what was known
    /// before may have missed some, so it is forgotten.
    pub(super) fn listening(&self) {
        let mut state = self.lock();
        state.clear();
        state.listeners += 1;
    }

    /// A listener stopped hearing (its connection was lost, or it was dropped).
    pub(super) fn lost(&self) {
        let mut state = self.lock();
        state.clear();
        state.listeners = state.listeners.saturating_sub(1);
    }

    /// Taken before a read or a write whose result may be kept.
    pub(super) fn ticket(&self) -> Ticket {
        let state = self.lock();
        Ticket {
            epoch: state.epoch,
            expiries: state.expiries,
        }
    }

    /// The live lesson as last heard, when known.
    pub(super) fn lesson(&self, id: LiveLessonId) -> Option<LiveLesson> {
        let state = self.lock();
        if !state.answers() {
            return None;
        }
        match state.lessons.get(&id) {
            Some(Entry::Row(_, lesson)) => Some((**lesson).clone()),
            _ => None,
        }
    }

    /// The live session of a token hash, when known.
    pub(super) fn session(&self, token_hash: &[u8; 32]) -> Option<SessionId> {
        let state = self.lock();
        if !state.answers() {
            return None;
        }
        state.tokens.get(token_hash).copied()
    }

    /// A read of the database found the live lesson at `revision`.
    pub(super) fn read_lesson(&self, ticket: Ticket, revision: u64, lesson: &LiveLesson) {
        let mut state = self.lock();
        if state.current(ticket) {
            state.keep(revision, lesson.clone());
        }
    }

    /// A read of the database found a token's live session.
    pub(super) fn read_token(&self, ticket: Ticket, token_hash: [u8; 32], session: SessionId) {
        let mut state = self.lock();
        if state.current(ticket) && state.expiries == ticket.expiries {
            state.token(token_hash, session);
        }
    }

    /// A write job begun at `ticket` committed with these effects.
    pub(super) fn wrote(&self, ticket: Ticket, effects: Effects) {
        let mut state = self.lock();
        let current = state.current(ticket);
        let (revised, effects) = effects.into_parts();
        for effect in effects {
            match effect {
                Effect::Gone(id) => state.forget(id),
                Effect::Expired(sessions) => {
                    for session in sessions {
                        state.expire(session);
                    }
                }
                Effect::Token(hash, session) if current && state.expiries == ticket.expiries => {
                    state.token(hash, session)
                }
                _ => {}
            }
        }
        if current {
            for (revision, lesson) in revised {
                state.keep(revision, lesson);
            }
        }
    }

    /// What a notification said (heard in commit order).
    pub(super) fn heard(&self, notice: Notice) {
        let mut state = self.lock();
        match notice {
            Notice::Row(revision, lesson) => state.keep(revision, *lesson),
            Notice::Revised(id, revision) => {
                if !state.gone.contains(&id)
                    && state
                        .lessons
                        .get(&id)
                        .is_none_or(|entry| entry.revision() < revision)
                {
                    state.lessons.insert(id, Entry::Unknown(revision));
                }
            }
            Notice::Changed(id) => {
                // No revision: no read can be known to be as new; a later notification with
                // a row fills it again.
                if !state.gone.contains(&id) {
                    state.lessons.insert(id, Entry::Unknown(u64::MAX));
                }
            }
            Notice::Gone(id) => state.forget(id),
            Notice::Expired(session) => state.expire(session),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Critical sections are map operations; a poisoned lock is still consistent.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Millis, Status};

    fn lesson(id: LiveLessonId, status: Status) -> LiveLesson {
        LiveLesson {
            id,
            session_id: SessionId::new(),
            lesson_slug: "a".into(),
            stage: 0,
            generation: 1,
            observed_generation: 0,
            status,
            reason: String::new(),
            deleting: false,
            agent: None,
            handle: Vec::new(),
            endpoints: Vec::new(),
            persistent: false,
            created_at: Millis(1),
            last_active: Millis(1),
            pool_session: None,
        }
    }

    fn row(revision: u64, lesson: &LiveLesson) -> Notice {
        Notice::Row(revision, Box::new(lesson.clone()))
    }

    #[test]
    fn nothing_is_answered_without_a_listener() {
        let heard = Heard::default();
        let id = LiveLessonId::new();
        heard.heard(row(1, &lesson(id, Status::Pending)));
        assert_eq!(heard.lesson(id), None, "no listener: no answer");
        heard.listening();
        assert_eq!(heard.lesson(id), None, "forgotten when the listener began");
        heard.heard(row(2, &lesson(id, Status::Booting)));
        assert_eq!(heard.lesson(id).unwrap().status, Status::Booting);
        heard.lost();
        assert_eq!(
            heard.lesson(id),
            None,
            "a lost listener forgets and answers nothing"
        );
    }

    #[test]
    fn only_newer_revisions_replace_what_is_known() {
        let heard = Heard::default();
        heard.listening();
        let id = LiveLessonId::new();
        let ticket = heard.ticket();
        heard.heard(row(3, &lesson(id, Status::Ready)));
        // A read (or a write's row) at an older revision arrives after the notification.
        heard.read_lesson(ticket, 2, &lesson(id, Status::Booting));
        assert_eq!(heard.lesson(id).unwrap().status, Status::Ready);
        heard.read_lesson(ticket, 4, &lesson(id, Status::Terminating));
        assert_eq!(heard.lesson(id).unwrap().status, Status::Terminating);
        // A change too big for its notification: unknown until a read at least as new.
        heard.heard(Notice::Revised(id, 6));
        assert_eq!(heard.lesson(id), None);
        heard.read_lesson(ticket, 5, &lesson(id, Status::Ready));
        assert_eq!(heard.lesson(id), None, "older than the change heard");
        heard.read_lesson(ticket, 6, &lesson(id, Status::Failed));
        assert_eq!(heard.lesson(id).unwrap().status, Status::Failed);
        // A change of a replica that sends no revision: unknown until its next row.
        heard.heard(Notice::Changed(id));
        heard.read_lesson(ticket, 9, &lesson(id, Status::Ready));
        assert_eq!(heard.lesson(id), None);
    }

    #[test]
    fn what_began_before_a_loss_fills_nothing() {
        let heard = Heard::default();
        heard.listening();
        let id = LiveLessonId::new();
        let ticket = heard.ticket();
        heard.lost();
        heard.listening();
        heard.read_lesson(ticket, 1, &lesson(id, Status::Ready));
        assert_eq!(heard.lesson(id), None);
        let mut effects = Effects::default();
        effects.revise(1, lesson(id, Status::Ready));
        heard.wrote(ticket, effects);
        assert_eq!(heard.lesson(id), None);
    }

    #[test]
    fn the_gone_stay_gone() {
        let heard = Heard::default();
        heard.listening();
        let id = LiveLessonId::new();
        let ticket = heard.ticket();
        heard.heard(row(1, &lesson(id, Status::Ready)));
        heard.heard(Notice::Gone(id));
        assert_eq!(heard.lesson(id), None);
        // A write that committed before the deletion delivers late.
        let mut effects = Effects::default();
        effects.revise(2, lesson(id, Status::Terminating));
        heard.wrote(ticket, effects);
        assert_eq!(heard.lesson(id), None);
    }

    #[test]
    fn an_expired_session_token_is_forgotten_and_a_read_racing_it_kept_out() {
        let heard = Heard::default();
        heard.listening();
        let (hash, session) = ([1; 32], SessionId::new());
        let ticket = heard.ticket();
        heard.read_token(ticket, hash, session);
        assert_eq!(heard.session(&hash), Some(session));
        let before = heard.ticket();
        heard.heard(Notice::Expired(session));
        assert_eq!(heard.session(&hash), None);
        // A read that began before the expiry was heard may have seen it live.
        heard.read_token(before, hash, session);
        assert_eq!(heard.session(&hash), None);
    }
}
