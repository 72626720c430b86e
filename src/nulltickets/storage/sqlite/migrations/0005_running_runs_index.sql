-- Runs were indexed by status, and by (task_id, status), so every claim added an entry to both
-- and every end of a run moved it within both: four index writes a cycle, into indexes that
-- grow with every run ever finished. The queries only ever ask for the running ones (the
-- claim's "is this task leased", the per-stage lease counts, stuck runs), so one partial index
-- of the running runs answers them all; it holds one entry per live lease, stays a page or two,
-- and costs one insert at claim and one delete when the run ends. Lookups of a task's finished
-- runs (failed attempts, latest run, foreign keys) use UNIQUE(task_id, attempt).

DROP INDEX IF EXISTS idx_runs_status;
DROP INDEX IF EXISTS idx_runs_task_status;
CREATE INDEX idx_runs_running ON runs(task_id) WHERE status = 'running';
