-- Placement that explains itself, drained agents, and agents lost and replaced (as the SQLite
-- migration of the same number).

-- Per live lesson: the labels its request asked for (JSON {"requires": {..}, "prefers": {..}}),
-- the last placement decision (JSON) with its time, and the lost agent it was last moved from
-- (cleared once it is placed again). Rows of forgotten live lessons are pruned by the reaper.
CREATE TABLE placements (
    live_lesson_id TEXT PRIMARY KEY NOT NULL,
    wishes         TEXT NOT NULL DEFAULT '{}',
    decision       TEXT,
    decided_at     BIGINT,
    moved_from     TEXT
);

-- Agents an operator drained (AdminService.DrainAgent): placement chooses them for no new live
-- lesson until they are resumed. A row per drained agent, so the drain survives restarts.
CREATE TABLE drained_agents (
    name       TEXT PRIMARY KEY NOT NULL,
    drained_at BIGINT NOT NULL,
    identity   TEXT NOT NULL
);
