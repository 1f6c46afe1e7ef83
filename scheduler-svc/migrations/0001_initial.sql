-- Antidote's scheduler state. Times are milliseconds since the Unix epoch.
--
-- Hot paths are single statements (no BEGIN/COMMIT round trips): the event log, session
-- activity and the persistent flag are kept in step by the triggers at the end of this file,
-- inside the statement that changed the live lesson, so they can never drift apart.

-- Sessions: one per learner (browser).
CREATE TABLE sessions (
    id          TEXT PRIMARY KEY NOT NULL,
    source_ip   TEXT NOT NULL,
    persistent  INTEGER NOT NULL DEFAULT 0,
    created_at  INTEGER NOT NULL,
    last_active INTEGER NOT NULL,
    -- Set by the reaper; an expired session accepts no requests and is deleted once its live
    -- lessons are gone.
    expired     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sessions_by_ip ON sessions (source_ip) WHERE expired = 0;
CREATE INDEX sessions_by_activity ON sessions (last_active) WHERE expired = 0 AND persistent = 0;

-- Live lessons: desired state (stage, generation, deleting) beside observed state.
CREATE TABLE live_lessons (
    id                  TEXT PRIMARY KEY NOT NULL,
    session_id          TEXT NOT NULL REFERENCES sessions (id),
    lesson_slug         TEXT NOT NULL,
    stage               INTEGER NOT NULL,
    generation          INTEGER NOT NULL,
    observed_generation INTEGER NOT NULL DEFAULT 0,
    status              TEXT NOT NULL,
    -- Why it failed, or what it is doing; also the detail of the event a change records.
    reason              TEXT NOT NULL DEFAULT '',
    deleting            INTEGER NOT NULL DEFAULT 0,
    agent               TEXT,
    handle              BLOB NOT NULL DEFAULT x'',
    endpoints           TEXT NOT NULL DEFAULT '[]',
    -- A copy of the session's flag (kept by a trigger), so expiry and the API need no join.
    persistent          INTEGER NOT NULL DEFAULT 0,
    created_at          INTEGER NOT NULL,
    last_active         INTEGER NOT NULL,
    -- When desired or observed state last changed: the time of the event it records.
    updated_at          INTEGER NOT NULL,
    -- One live lesson per (session, lesson): concurrent identical requests cannot race.
    UNIQUE (session_id, lesson_slug)
);
CREATE INDEX live_lessons_by_activity ON live_lessons (last_active) WHERE deleting = 0;
CREATE INDEX live_lessons_by_agent ON live_lessons (agent);

-- Every transition of every live lesson, for operators and audits.
CREATE TABLE events (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    live_lesson_id TEXT NOT NULL,
    at             INTEGER NOT NULL,
    status         TEXT NOT NULL,
    generation     INTEGER NOT NULL,
    stage          INTEGER NOT NULL,
    detail         TEXT NOT NULL DEFAULT ''
);
CREATE INDEX events_by_live_lesson ON events (live_lesson_id, seq);
CREATE INDEX events_by_time ON events (at);

-- The last instance id each agent reported, so that a restarted scheduler still notices an
-- agent that restarted while it was down.
CREATE TABLE agents (
    name        TEXT PRIMARY KEY NOT NULL,
    instance_id TEXT NOT NULL,
    seen_at     INTEGER NOT NULL
);

-- A new live lesson is an event and activity on its session.
CREATE TRIGGER live_lessons_inserted AFTER INSERT ON live_lessons
BEGIN
    INSERT INTO events (live_lesson_id, at, status, generation, stage, detail)
    VALUES (NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage, NEW.reason);
    UPDATE sessions SET last_active = NEW.last_active
    WHERE id = NEW.session_id AND last_active < NEW.last_active;
END;

-- A change of status or generation is an event.
CREATE TRIGGER live_lessons_transition AFTER UPDATE OF status, generation ON live_lessons
WHEN OLD.status IS NOT NEW.status OR OLD.generation IS NOT NEW.generation
BEGIN
    INSERT INTO events (live_lesson_id, at, status, generation, stage, detail)
    VALUES (NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage, NEW.reason);
END;

-- Activity on a live lesson is activity on its session.
CREATE TRIGGER live_lessons_touched AFTER UPDATE OF last_active ON live_lessons
WHEN NEW.last_active > OLD.last_active
BEGIN
    UPDATE sessions SET last_active = NEW.last_active
    WHERE id = NEW.session_id AND last_active < NEW.last_active;
END;

-- A forgotten live lesson is the last event; an expired session goes with its last live lesson.
CREATE TRIGGER live_lessons_deleted AFTER DELETE ON live_lessons
BEGIN
    INSERT INTO events (live_lesson_id, at, status, generation, stage, detail)
    VALUES (OLD.id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER), 'TERMINATING',
            OLD.generation, OLD.stage, 'removed');
    DELETE FROM sessions WHERE id = OLD.session_id AND expired = 1
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
END;

-- The persistent flag follows the session.
CREATE TRIGGER sessions_persistent AFTER UPDATE OF persistent ON sessions
BEGIN
    UPDATE live_lessons SET persistent = NEW.persistent WHERE session_id = NEW.id;
END;
