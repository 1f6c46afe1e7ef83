-- Sessions: one per learner (browser). Times are milliseconds since the Unix epoch.
CREATE TABLE sessions (
    id          TEXT PRIMARY KEY NOT NULL,
    source_ip   TEXT NOT NULL,
    persistent  INTEGER NOT NULL DEFAULT 0,
    created_at  INTEGER NOT NULL,
    last_active INTEGER NOT NULL,
    -- Set by the reaper; an expired session accepts no requests and is deleted once its live
    -- lessons are gone.
    expired     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sessions_by_ip ON sessions (source_ip) WHERE expired = 0;
CREATE INDEX sessions_by_activity ON sessions (last_active) WHERE expired = 0 AND persistent = 0;

-- Live lessons: desired state (stage, generation, deleting) beside observed state.
CREATE TABLE live_lessons (
    id                  TEXT PRIMARY KEY NOT NULL,
    session_id          TEXT NOT NULL REFERENCES sessions (id),
    lesson_slug         TEXT NOT NULL,
    stage               INTEGER NOT NULL,
    generation          INTEGER NOT NULL,
    observed_generation INTEGER NOT NULL DEFAULT 0,
    status              TEXT NOT NULL,
    reason              TEXT NOT NULL DEFAULT '',
    deleting            INTEGER NOT NULL DEFAULT 0,
    agent               TEXT,
    handle              BLOB NOT NULL DEFAULT x'',
    endpoints           TEXT NOT NULL DEFAULT '[]',
    created_at          INTEGER NOT NULL,
    last_active         INTEGER NOT NULL,
    -- One live lesson per (session, lesson): concurrent identical requests cannot race.
    UNIQUE (session_id, lesson_slug)
);
CREATE INDEX live_lessons_by_activity ON live_lessons (last_active) WHERE deleting = 0;
CREATE INDEX live_lessons_by_agent ON live_lessons (agent);

-- Every transition of every live lesson, for Watch replay, operators and audits.
CREATE TABLE events (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    live_lesson_id TEXT NOT NULL,
    at             INTEGER NOT NULL,
    status         TEXT NOT NULL,
    generation     INTEGER NOT NULL,
    stage          INTEGER NOT NULL,
    detail         TEXT NOT NULL DEFAULT ''
);
CREATE INDEX events_by_live_lesson ON events (live_lesson_id, seq);
CREATE INDEX events_by_time ON events (at);

-- The last instance id each agent reported, so that a restarted scheduler still notices an
-- agent that restarted while it was down.
CREATE TABLE agents (
    name        TEXT PRIMARY KEY NOT NULL,
    instance_id TEXT NOT NULL,
    seen_at     INTEGER NOT NULL
);
