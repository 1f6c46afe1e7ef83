-- A live lesson's revision (as the PostgreSQL migration of the same number). PostgreSQL counts
-- it at every change of the row, for replicas that keep what they heard of each other's writes;
-- SQLite's single writer knows every change it makes, so here it stays 0 and only keeps both
-- schemas and the store's statements alike.
ALTER TABLE live_lessons ADD COLUMN revision INTEGER NOT NULL DEFAULT 0;
