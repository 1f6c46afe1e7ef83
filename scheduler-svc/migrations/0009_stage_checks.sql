-- Stage checks: per live lesson and stage, when its check first passed (NULL while it never
-- did) and its latest run (JSON of model::CheckRun). Kept beside live_lessons rather than as
-- a column of it: a check changes no live lesson row, so the writer's cache (store/known.rs)
-- and the replicas' change notifications are untouched. A forgotten live lesson's rows go
-- with it.
CREATE TABLE stage_checks (
    live_lesson_id TEXT NOT NULL,
    stage          INTEGER NOT NULL,
    passed_at      INTEGER,
    last_at        INTEGER NOT NULL,
    last_run       TEXT NOT NULL,
    PRIMARY KEY (live_lesson_id, stage)
);

CREATE TRIGGER live_lessons_checks_forgotten AFTER DELETE ON live_lessons
BEGIN
    DELETE FROM stage_checks WHERE live_lesson_id = OLD.id;
END;
