-- Warm pools (DESIGN.md §3): per (lesson, stage) a target size, and live lessons born as pool
-- members (as the PostgreSQL migration of the same number).

-- One row per pool: its base size and its daily time windows (JSON
-- `[{"from": "08:45", "to": "10:00", "size": 30}]`, in the configured time zone). `source` is
-- `config` (written from the configuration at every start) or `admin` (set through
-- AdminService.SetPool, which the configuration never overwrites).
CREATE TABLE pools (
    lesson_slug TEXT NOT NULL,
    stage       INTEGER NOT NULL,
    size        INTEGER NOT NULL,
    windows     TEXT NOT NULL DEFAULT '[]',
    source      TEXT NOT NULL,
    updated_by  TEXT NOT NULL DEFAULT '',
    updated_at  BIGINT NOT NULL,
    PRIMARY KEY (lesson_slug, stage)
);

-- A pool member is a live lesson created in a session of its own (`pool_session`: no token,
-- persistent, `source_net` 'pool'), which its specs carry for life (agents never relabel). It is
-- unclaimed while `session_id = pool_session`; a claim moves `session_id` to the learner's
-- session, once. `pool_fingerprint` is the lesson's definition it was made from: members of a
-- definition that changed are replaced, never handed out.
ALTER TABLE live_lessons ADD COLUMN pool_session TEXT;
ALTER TABLE live_lessons ADD COLUMN pool_fingerprint TEXT;
CREATE INDEX live_lessons_pool_members ON live_lessons (lesson_slug, stage)
    WHERE pool_session = session_id;

-- A claim is an event ("claimed from the pool ...", the new reason), and the member's pool
-- session, now empty, goes.
CREATE TRIGGER live_lessons_claimed AFTER UPDATE OF session_id ON live_lessons
WHEN OLD.session_id IS NOT NEW.session_id
BEGIN
    INSERT INTO events (live_lesson_id, at, status, generation, stage, detail)
    VALUES (NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage, NEW.reason);
    DELETE FROM sessions WHERE id = OLD.session_id AND source_net = 'pool'
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
END;

-- An unclaimed member forgotten (the pool shrank, it failed) takes its pool session along.
CREATE TRIGGER live_lessons_pool_member_deleted AFTER DELETE ON live_lessons
WHEN OLD.pool_session IS NOT NULL AND OLD.pool_session = OLD.session_id
BEGIN
    DELETE FROM sessions WHERE id = OLD.session_id AND source_net = 'pool'
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
END;
