-- A live lesson's events are kept in its log (issue 21): `log` is the `seq` of its first event,
-- so the log index's keys grow with time like `seq` and new events are written at its right
-- edge, where the index by live lesson id (random UUIDs) wrote five entries per lifecycle on
-- random pages. Only a live lesson's first event is indexed by its id: the later events of a
-- live lesson find its log there, and so does reading the events of a live lesson that is gone.
-- (The log is not a column of `live_lessons`: on SQLite, setting it there from a trigger would
-- be a row change the writer's cache did not declare, see store/known.rs.)
ALTER TABLE events ADD COLUMN log BIGINT;
UPDATE events SET log = first.seq
FROM (SELECT live_lesson_id, MIN(seq) AS seq FROM events GROUP BY live_lesson_id) AS first
WHERE events.live_lesson_id = first.live_lesson_id;
DROP INDEX events_by_live_lesson;
CREATE INDEX events_by_log ON events (log, seq);
CREATE INDEX events_first ON events (live_lesson_id) WHERE seq = log;

-- A live lesson's log, found by its first event (the newest log, should its id come again).
CREATE FUNCTION live_lesson_log(lesson TEXT) RETURNS BIGINT LANGUAGE sql STABLE AS $$
    SELECT MAX(log) FROM events WHERE live_lesson_id = lesson AND seq = log
$$;

-- The first event opens the log: it takes its seq first, and that is the log.
CREATE OR REPLACE FUNCTION live_lessons_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    first BIGINT := nextval(pg_get_serial_sequence('events', 'seq'));
BEGIN
    INSERT INTO events (seq, log, live_lesson_id, at, status, generation, stage, detail)
    VALUES (first, first, NEW.id, NEW.updated_at, NEW.status, NEW.generation, NEW.stage,
            NEW.reason);
    UPDATE sessions SET last_active = NEW.last_active
    WHERE id = NEW.session_id AND last_active < NEW.last_active;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION live_lessons_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (log, live_lesson_id, at, status, generation, stage, detail)
    VALUES (live_lesson_log(NEW.id), NEW.id, NEW.updated_at, NEW.status, NEW.generation,
            NEW.stage, NEW.reason);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION live_lessons_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (log, live_lesson_id, at, status, generation, stage, detail)
    VALUES (live_lesson_log(OLD.id), OLD.id,
            (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT, 'TERMINATING', OLD.generation,
            OLD.stage, 'removed');
    DELETE FROM sessions WHERE id = OLD.session_id AND expired = 1
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION live_lessons_claimed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (log, live_lesson_id, at, status, generation, stage, detail)
    VALUES (live_lesson_log(NEW.id), NEW.id, NEW.updated_at, NEW.status, NEW.generation,
            NEW.stage, NEW.reason);
    DELETE FROM sessions WHERE id = OLD.session_id AND source_net = 'pool'
        AND NOT EXISTS (SELECT 1 FROM live_lessons WHERE session_id = OLD.session_id);
    RETURN NULL;
END
$$;
