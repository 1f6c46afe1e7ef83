-- Stage checks, as the SQLite migration of the same number: per live lesson and stage, when
-- its check first passed (NULL while it never did) and its latest run (JSON of
-- model::CheckRun). A forgotten live lesson's rows go with it.
CREATE TABLE stage_checks (
    live_lesson_id TEXT NOT NULL,
    stage          BIGINT NOT NULL,
    passed_at      BIGINT,
    last_at        BIGINT NOT NULL,
    last_run       TEXT NOT NULL,
    PRIMARY KEY (live_lesson_id, stage)
);

CREATE FUNCTION live_lessons_checks_forgotten() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM stage_checks WHERE live_lesson_id = OLD.id;
    RETURN NULL;
END $$;
CREATE TRIGGER live_lessons_checks_forgotten AFTER DELETE ON live_lessons
FOR EACH ROW EXECUTE FUNCTION live_lessons_checks_forgotten();
