-- This deployment's cluster id, and leases (as the PostgreSQL migration of the same number).

-- One row: the cluster id, created by the first scheduler that opens the database
-- (`Store::cluster_id`) and read by every one after. Agents carry it as the
-- `antidote.io/cluster` label; orphan collection only touches objects carrying ours.
CREATE TABLE cluster (
    singleton  INTEGER PRIMARY KEY NOT NULL CHECK (singleton = 1),
    id         TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

-- Named leases: a live lesson's id (its reconcile work) or a duty (`reaper`), held by one
-- replica until `expires_at` (ms since the epoch) unless renewed. Only PostgreSQL replicas take
-- them; the table exists here so both schemas and the store's statements stay alike.
CREATE TABLE leases (
    name       TEXT PRIMARY KEY NOT NULL,
    holder     TEXT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE INDEX leases_by_holder ON leases (holder);
