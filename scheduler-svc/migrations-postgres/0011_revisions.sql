-- Replicas keep what they heard of each other's writes (the store's `heard`), so a live lesson
-- changes with a revision and its notification carries the row.

-- Counted by the database at every change of the row (row locks order the changes of one row,
-- so revisions grow in commit order): of two states of a live lesson, the one of the higher
-- revision is the newer.
ALTER TABLE live_lessons ADD COLUMN revision BIGINT NOT NULL DEFAULT 0;
CREATE FUNCTION live_lessons_revise() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.revision := OLD.revision + 1;
    RETURN NEW;
END
$$;
CREATE TRIGGER live_lessons_revise BEFORE UPDATE ON live_lessons
FOR EACH ROW EXECUTE FUNCTION live_lessons_revise();

-- Every change notifies `antidote_live_lessons` now, activity and persistence too:
-- `ID GENERATION NEEDS_WORK REVISION KIND ROW`, where KIND is `c` for a change replicas act on
-- (the changes that notified before) and `q` for one only what they heard takes in (last_active,
-- persistent), and ROW the row as a JSON array (session_id, lesson_slug, stage,
-- observed_generation, status, reason, deleting, agent, handle in hex, endpoints, persistent,
-- created_at, last_active, pool_session), left out when the notification would pass 8,000
-- bytes (PostgreSQL's limit). The first three words are what they were, so a replica that
-- reads only those still reads every payload. `ID gone` per forgotten live lesson, as before.
CREATE OR REPLACE FUNCTION live_lessons_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    head TEXT;
    body TEXT;
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('antidote_live_lessons', OLD.id || ' gone');
        RETURN NULL;
    END IF;
    head := NEW.id || ' ' || NEW.generation || ' ' ||
        CASE WHEN NEW.deleting = 1 OR NEW.observed_generation <> NEW.generation
                  OR NEW.status NOT IN ('READY', 'FAILED') THEN '1' ELSE '0' END ||
        ' ' || NEW.revision || ' ' || TG_ARGV[0];
    body := json_build_array(NEW.session_id, NEW.lesson_slug, NEW.stage,
        NEW.observed_generation, NEW.status, NEW.reason, NEW.deleting, NEW.agent,
        encode(NEW.handle, 'hex'), NEW.endpoints, NEW.persistent, NEW.created_at,
        NEW.last_active, NEW.pool_session)::text;
    IF octet_length(head) + 1 + octet_length(body) < 7900 THEN
        head := head || ' ' || body;
    END IF;
    PERFORM pg_notify('antidote_live_lessons', head);
    RETURN NULL;
END
$$;
DROP TRIGGER live_lessons_notify_inserted ON live_lessons;
DROP TRIGGER live_lessons_notify_changed ON live_lessons;
CREATE TRIGGER live_lessons_notify_inserted AFTER INSERT OR DELETE ON live_lessons
FOR EACH ROW EXECUTE FUNCTION live_lessons_notify('c');
CREATE TRIGGER live_lessons_notify_changed AFTER UPDATE ON live_lessons
FOR EACH ROW
WHEN ((OLD.status, OLD.generation, OLD.observed_generation, OLD.reason, OLD.deleting, OLD.agent,
       OLD.handle, OLD.endpoints, OLD.stage)
      IS DISTINCT FROM
      (NEW.status, NEW.generation, NEW.observed_generation, NEW.reason, NEW.deleting, NEW.agent,
       NEW.handle, NEW.endpoints, NEW.stage))
EXECUTE FUNCTION live_lessons_notify('c');
CREATE TRIGGER live_lessons_notify_quiet AFTER UPDATE ON live_lessons
FOR EACH ROW
WHEN ((OLD.status, OLD.generation, OLD.observed_generation, OLD.reason, OLD.deleting, OLD.agent,
       OLD.handle, OLD.endpoints, OLD.stage)
      IS NOT DISTINCT FROM
      (NEW.status, NEW.generation, NEW.observed_generation, NEW.reason, NEW.deleting, NEW.agent,
       NEW.handle, NEW.endpoints, NEW.stage))
EXECUTE FUNCTION live_lessons_notify('q');

-- A session that expires notifies `antidote_sessions` with `ID expired`: its token is no
-- longer valid on any replica.
CREATE FUNCTION sessions_expired_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('antidote_sessions', NEW.id || ' expired');
    RETURN NULL;
END
$$;
CREATE TRIGGER sessions_expired_notify AFTER UPDATE OF expired ON sessions
FOR EACH ROW WHEN (NEW.expired = 1 AND OLD.expired = 0)
EXECUTE FUNCTION sessions_expired_notify();
