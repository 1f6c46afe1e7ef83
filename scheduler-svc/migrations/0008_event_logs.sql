-- A live lesson's events are kept in its log (issue 21): `log` is the `seq` of its first event,
-- so the log index's keys grow with time like `seq` and new events are written at its right
-- edge, where the index by live lesson id (random UUIDs) wrote five entries per lifecycle on
-- random pages. Only a live lesson's first event is indexed by its id: the later events of a
-- live lesson find its log there, and so does reading the events of a live lesson that is gone.
-- (The log is not a column of `live_lessons`: on SQLite, setting it there from a trigger would
-- be a row change the writer's cache did not declare, see store/known.rs.)
ALTER TABLE events ADD COLUMN log INTEGER;
UPDATE events SET log =
    (SELECT MIN(e.seq) FROM events e WHERE e.live_lesson_id = events.live_lesson_id);
DROP INDEX events_by_live_lesson;
CREATE INDEX events_by_log ON events (log, seq);
CREATE INDEX events_first ON events (live_lesson_id) WHERE seq = log;

-- The first event opens the log: its seq is the next one AUTOINCREMENT would give (one more
-- than the largest ever held, which sqlite_sequence keeps).
DROP TRIGGER live_lessons_inserted;
CREATE TRIGGER live_lessons_inserted AFTER INSERT ON live_lessons
BEGIN
    INSERT INTO events (seq, log, live_lesson_id, at, status, generation, stage, detail)
    SELECT next.seq, next.seq, NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage,
           NEW.reason
    FROM (SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0) + 1
          AS seq) AS next;
    UPDATE sessions SET last_active = NEW.last_active
    WHERE id = NEW.session_id AND last_active < NEW.last_active;
END;

DROP TRIGGER live_lessons_transition;
CREATE TRIGGER live_lessons_transition AFTER UPDATE OF status, generation ON live_lessons
WHEN OLD.status IS NOT NEW.status OR OLD.generation IS NOT NEW.generation
BEGIN
    INSERT INTO events (log, live_lesson_id, at, status, generation, stage, detail)
    VALUES ((SELECT MAX(e.log) FROM events e WHERE e.live_lesson_id = NEW.id AND e.seq = e.log),
            NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage, NEW.reason);
END;

DROP TRIGGER live_lessons_deleted;
CREATE TRIGGER live_lessons_deleted AFTER DELETE ON live_lessons
BEGIN
    INSERT INTO events (log, live_lesson_id, at, status, generation, stage, detail)
    VALUES ((SELECT MAX(e.log) FROM events e WHERE e.live_lesson_id = OLD.id AND e.seq = e.log),
            OLD.id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER),
            'TERMINATING', OLD.generation, OLD.stage, 'removed');
    DELETE FROM sessions WHERE id = OLD.session_id AND expired = 1
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
END;

DROP TRIGGER live_lessons_claimed;
CREATE TRIGGER live_lessons_claimed AFTER UPDATE OF session_id ON live_lessons
WHEN OLD.session_id IS NOT NEW.session_id
BEGIN
    INSERT INTO events (log, live_lesson_id, at, status, generation, stage, detail)
    VALUES ((SELECT MAX(e.log) FROM events e WHERE e.live_lesson_id = NEW.id AND e.seq = e.log),
            NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage, NEW.reason);
    DELETE FROM sessions WHERE id = OLD.session_id AND source_net = 'pool'
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
END;
