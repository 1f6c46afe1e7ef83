-- Shards of the reconcile work among replicas (as the PostgreSQL migration of the same number).
-- Only PostgreSQL replicas hold shards; the table exists here so both schemas and the store's
-- statements stay alike.
CREATE TABLE shards (
    shard      INTEGER PRIMARY KEY NOT NULL,
    holder     TEXT,
    epoch      INTEGER NOT NULL DEFAULT 0,
    expires_at INTEGER NOT NULL DEFAULT 0
);
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 255)
INSERT INTO shards (shard) SELECT i FROM n;
CREATE INDEX shards_by_holder ON shards (holder);
