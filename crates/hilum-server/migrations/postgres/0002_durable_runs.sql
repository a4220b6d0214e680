-- Version 2, PostgreSQL dialect of ../0002_durable_runs.sql (integers are BIGINT): durable runs.
-- A run's messages are written as its steps happen; `progress` holds
-- the loop's counters at the last stored step (JSON), so an `interrupted` run can resume.
-- `owner` is the server process (replica) running it and `heartbeat_ms` the last time that
-- process said it is alive: a `running` run whose heartbeat is stale was left by a dead one.
ALTER TABLE runs ADD COLUMN owner TEXT;
ALTER TABLE runs ADD COLUMN heartbeat_ms BIGINT;
ALTER TABLE runs ADD COLUMN progress TEXT;
-- The round of a run's tool call, to rebuild the loop's state on resume.
ALTER TABLE tool_calls ADD COLUMN round BIGINT;
CREATE INDEX runs_by_status ON runs(status, heartbeat_ms)
