-- Shards of the reconcile work among replicas (as the SQLite migration of the same number):
-- a live lesson belongs to shard N, the first byte of its id (a random UUID), and the replica
-- holding shard N's lease until `expires_at` (ms since the epoch) drives every live lesson of
-- it. `epoch` counts the lease's takers: a takeover (by another replica, or by the same one
-- after it expired or was handed over) adds one, so a write fenced by an older epoch is refused
-- even when its replica holds the shard again. Rows are never deleted (a handover only expires
-- the lease), so an epoch never starts over. A replica's membership is the named lease
-- `replica:ID` in `leases`.
CREATE TABLE shards (
    shard      BIGINT PRIMARY KEY NOT NULL,
    holder     TEXT,
    epoch      BIGINT NOT NULL DEFAULT 0,
    expires_at BIGINT NOT NULL DEFAULT 0
);
INSERT INTO shards (shard) SELECT generate_series(0, 255);
CREATE INDEX shards_by_holder ON shards (holder);
