-- Placement that explains itself, drained agents, and agents lost and replaced.

-- Per live lesson: the labels its request asked for (JSON {"requires": {..}, "prefers": {..}}),
-- the last placement decision (JSON: agent, matched labels, load, capacity, every other agent and
-- why not, the sentence shown to operators) with its time, and the lost agent it was last moved
-- from (cleared once it is placed again). Rows of forgotten live lessons are pruned by the reaper.
CREATE TABLE placements (
    live_lesson_id TEXT PRIMARY KEY NOT NULL,
    wishes         TEXT NOT NULL DEFAULT '{}',
    decision       TEXT,
    decided_at     INTEGER,
    moved_from     TEXT
);

-- Agents an operator drained (AdminService.DrainAgent): placement chooses them for no new live
-- lesson until they are resumed. A row per drained agent, so the drain survives restarts.
CREATE TABLE drained_agents (
    name       TEXT PRIMARY KEY NOT NULL,
    drained_at INTEGER NOT NULL,
    identity   TEXT NOT NULL
);
