-- The reaper's tick among many live lessons (issue 21), as the SQLite migration of the same
-- number: a forgotten live lesson's placement record goes with it, and the expired sessions the
-- tick looks for have an index of their own.

CREATE FUNCTION live_lessons_forget_placement() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM placements WHERE live_lesson_id = OLD.id;
    RETURN NULL;
END
$$;
CREATE TRIGGER live_lessons_forget_placement AFTER DELETE ON live_lessons
FOR EACH ROW EXECUTE FUNCTION live_lessons_forget_placement();

DELETE FROM placements WHERE live_lesson_id NOT IN (SELECT id FROM live_lessons);

CREATE INDEX sessions_expired ON sessions (id) WHERE expired = 1;
