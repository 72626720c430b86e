-- The failed and expired runs, in an index that holds only them.
--
-- GET /ops/queue (and the MCP tool queue_report) counts each role stage's failed attempts.
-- Without this index PostgreSQL found them by reading every run: 25-30 ms at 300,000
-- finished tasks, on every call of a dashboard that polls. The index holds one entry per failed
-- or expired attempt, which retention prunes with its task, and nothing for the runs that
-- complete: a run that ends well adds no entry, so the claim and transition path is unchanged.
-- Every other count of a task's failures (the retry policy, the failures page, a checkpoint's
-- previous failures) may use it too.
CREATE INDEX idx_runs_failed ON runs (task_id) WHERE status IN ('failed', 'stale');
