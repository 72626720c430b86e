-- Every index is written again whenever a row it covers changes. These six are either never
-- used by a query (the planner picks the claim and paging indexes) or a prefix of another
-- index that serves the same lookups, yet each one was rewritten on every claim or
-- transition. Measured: about one page in ten of every commit went to them.
--   idx_tasks_stage            -> idx_tasks_stage_page (stage, created_at_ms, id)
--   idx_tasks_pipeline         -> idx_tasks_pipeline_page (pipeline_id, created_at_ms, id)
--   idx_runs_task              -> idx_runs_task_status (task_id, status)
--   idx_tasks_priority_created, idx_tasks_next_eligible, idx_tasks_dead_letter_reason: unused

DROP INDEX IF EXISTS idx_tasks_stage;
DROP INDEX IF EXISTS idx_tasks_pipeline;
DROP INDEX IF EXISTS idx_runs_task;
DROP INDEX IF EXISTS idx_tasks_priority_created;
DROP INDEX IF EXISTS idx_tasks_next_eligible;
DROP INDEX IF EXISTS idx_tasks_dead_letter_reason;
