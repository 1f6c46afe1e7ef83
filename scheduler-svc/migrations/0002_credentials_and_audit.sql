-- Learners' session tokens, per-network session limits, and the admin audit log.

-- Only the SHA-256 of a session's token is kept: the token itself is shown once, by
-- CreateSession. Sessions from before this migration have none and accept no live-lesson calls.
ALTER TABLE sessions ADD COLUMN token_hash BLOB;
CREATE UNIQUE INDEX sessions_by_token ON sessions (token_hash) WHERE token_hash IS NOT NULL;

-- What the per-address session limit counts by: the IPv4 address, or the /64 of an IPv6 one
-- (one host holds a whole /64, so counting exact IPv6 addresses would not limit anyone).
ALTER TABLE sessions ADD COLUMN source_net TEXT NOT NULL DEFAULT '';
UPDATE sessions SET source_net = source_ip;
DROP INDEX sessions_by_ip;
CREATE INDEX sessions_by_net ON sessions (source_net) WHERE expired = 0;

-- Every admin call and every refused one: who (never the token), what, on what, and how it
-- ended.
CREATE TABLE audit (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    at       INTEGER NOT NULL,
    identity TEXT NOT NULL,
    action   TEXT NOT NULL,
    target   TEXT NOT NULL,
    outcome  TEXT NOT NULL
);
