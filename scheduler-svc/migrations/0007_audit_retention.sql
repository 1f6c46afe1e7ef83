-- The audit log has a retention (issue 15): the reaper deletes entries older than
-- `reaper.event_retention`, by this index.

CREATE INDEX audit_at ON audit (at);
