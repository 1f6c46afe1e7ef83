-- This deployment's cluster id, leases of replicas, and a notification per changed live lesson
-- (as the SQLite migration of the same number, plus the notification).

-- One row: the cluster id, created by the first scheduler that opens the database
-- (`Store::cluster_id`) and read by every one after. Agents carry it as the
-- `antidote.io/cluster` label; orphan collection only touches objects carrying ours.
CREATE TABLE cluster (
    singleton  INTEGER PRIMARY KEY NOT NULL CHECK (singleton = 1),
    id         TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

-- Named leases: a live lesson's id (its reconcile work) or a duty (`reaper`), held by one
-- replica until `expires_at` (ms since the epoch) unless renewed; an expired lease is anyone's.
CREATE TABLE leases (
    name       TEXT PRIMARY KEY NOT NULL,
    holder     TEXT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE INDEX leases_by_holder ON leases (holder);

-- Every replica LISTENs on `antidote_live_lessons`: a payload `ID GENERATION NEEDS_WORK` per
-- inserted or changed live lesson (NEEDS_WORK 1 when it is not settled at its generation or is
-- being removed), `ID gone` per forgotten one. Delivered at commit; lost ones are covered by
-- re-reading on reconnect and by the periodic resync. Activity alone (last_active) notifies
-- nobody.
CREATE FUNCTION live_lessons_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('antidote_live_lessons', OLD.id || ' gone');
    ELSE
        PERFORM pg_notify('antidote_live_lessons', NEW.id || ' ' || NEW.generation || ' ' ||
            CASE WHEN NEW.deleting = 1 OR NEW.observed_generation <> NEW.generation
                      OR NEW.status NOT IN ('READY', 'FAILED') THEN '1' ELSE '0' END);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER live_lessons_notify_inserted AFTER INSERT OR DELETE ON live_lessons
FOR EACH ROW EXECUTE FUNCTION live_lessons_notify();
CREATE TRIGGER live_lessons_notify_changed AFTER UPDATE ON live_lessons
FOR EACH ROW
WHEN ((OLD.status, OLD.generation, OLD.observed_generation, OLD.reason, OLD.deleting, OLD.agent,
       OLD.handle, OLD.endpoints, OLD.stage)
      IS DISTINCT FROM
      (NEW.status, NEW.generation, NEW.observed_generation, NEW.reason, NEW.deleting, NEW.agent,
       NEW.handle, NEW.endpoints, NEW.stage))
EXECUTE FUNCTION live_lessons_notify();
