-- What an operator needs to see failures as they are, as SQLite's migration 0008 adds it.
--
-- failed_at_ms and last_error: when the task's latest failed attempt ended (a failure its agent
-- reported, or an expired lease) and what it reported, written by the statement that schedules
-- its retry or dead-letters it; a transition clears both, a requeue keeps them. Each kind of
-- failed task (dead-lettered, cancelled, failing) has a partial index of its own that holds
-- only its rows, and idx_tasks_parked counts the dead-lettered and cancelled tasks per
-- (pipeline, stage) wherever they landed, stages without a role included.

ALTER TABLE tasks ADD COLUMN failed_at_ms BIGINT;
ALTER TABLE tasks ADD COLUMN last_error TEXT;

UPDATE tasks AS t
SET failed_at_ms = f.ended_at_ms, last_error = f.error_text
FROM (
    SELECT DISTINCT ON (r.task_id) r.task_id, r.ended_at_ms, r.error_text
    FROM runs AS r
    WHERE r.status IN ('failed', 'stale')
    ORDER BY r.task_id, r.attempt DESC
) AS f
WHERE f.task_id = t.id
    AND (t.dead_letter_reason IS NOT NULL OR t.next_eligible_at_ms != 0);
UPDATE tasks
SET failed_at_ms = updated_at_ms
WHERE failed_at_ms IS NULL AND dead_letter_reason IS NOT NULL AND cancelled_at_ms IS NULL;

CREATE INDEX idx_tasks_dead_letters ON tasks (failed_at_ms, id)
    WHERE dead_letter_reason IS NOT NULL AND cancelled_at_ms IS NULL;
CREATE INDEX idx_tasks_cancelled ON tasks (cancelled_at_ms, id)
    WHERE cancelled_at_ms IS NOT NULL;
CREATE INDEX idx_tasks_failing ON tasks (failed_at_ms, id)
    WHERE failed_at_ms IS NOT NULL AND dead_letter_reason IS NULL;
CREATE INDEX idx_tasks_parked ON tasks (pipeline_id, stage, cancelled_at_ms)
    WHERE dead_letter_reason IS NOT NULL;
