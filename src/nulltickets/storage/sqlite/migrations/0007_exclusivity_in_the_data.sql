-- Exclusivity as an invariant of the data, not only of the single writer.
--
-- At most one running run per task: the partial index of running runs (0005) becomes UNIQUE,
-- so a second claim of a task that is already leased fails at its INSERT whoever runs it (a
-- second server, a tool on the same file), and the backend reports it as a lost race. Same
-- name, same columns, same one entry per live lease: the claim's plans and costs are
-- unchanged. One lease per run likewise (idx_leases_run becomes UNIQUE).
--
-- The other uniqueness rules already were constraints: pipeline names (UNIQUE(name)),
-- dependencies (PRIMARY KEY (task_id, depends_on_task_id)) and idempotency keys of tasks
-- (idx_tasks_idempotency_key, 0003) and of requests (PRIMARY KEY (key, method, path)).

DROP INDEX IF EXISTS idx_runs_running;
CREATE UNIQUE INDEX idx_runs_running ON runs(task_id) WHERE status = 'running';
DROP INDEX IF EXISTS idx_leases_run;
CREATE UNIQUE INDEX idx_leases_run ON leases(run_id);
