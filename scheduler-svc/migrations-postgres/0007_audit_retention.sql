-- The audit log has a retention (issue 15), as the SQLite migration of the same number: the
-- reaper deletes entries older than `reaper.event_retention`, by this index.

CREATE INDEX audit_at ON audit (at);
