-- The reaper's tick among many live lessons (issue 21). A forgotten live lesson's placement
-- record goes with it (the tick no longer scans every record for ones whose live lesson is
-- gone), and the expired sessions the tick looks for have an index of their own.

CREATE TRIGGER live_lessons_forget_placement AFTER DELETE ON live_lessons
BEGIN
    DELETE FROM placements WHERE live_lesson_id = OLD.id;
END;

DELETE FROM placements WHERE live_lesson_id NOT IN (SELECT id FROM live_lessons);

CREATE INDEX sessions_expired ON sessions (id) WHERE expired = 1;
