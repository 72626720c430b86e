-- What an operator needs to see failures as they are (GET /ops/failures, the Failures page).
--
-- failed_at_ms and last_error: when the task's latest failed attempt ended (a failure its agent
-- reported, or an expired lease) and what it reported, written by the same statement that
-- schedules its retry or dead-letters it. A transition clears both: the task moved on, it is
-- no longer failing. A requeue keeps them: the task is retrying after failures.
--
-- Each kind of failed task has a partial index of its own, newest first, that holds only its
-- rows: the dead-lettered, the cancelled, and the failing (failed since their last transition,
-- neither dead-lettered nor cancelled). idx_tasks_parked counts the dead-lettered and cancelled
-- tasks per (pipeline, stage) wherever they landed, stages without a role included (a
-- dead-letter stage). A claim writes none of these; a row enters one when its task fails,
-- dead-letters or is cancelled.

ALTER TABLE tasks ADD COLUMN failed_at_ms INTEGER;
ALTER TABLE tasks ADD COLUMN last_error TEXT;

-- The tasks failing or parked now take their latest failed run's end and error; a
-- dead-lettered task without one (the original dead-letters nothing else) its last update.
UPDATE tasks
SET failed_at_ms = (
        SELECT r.ended_at_ms FROM runs AS r
        WHERE r.task_id = tasks.id AND r.status IN ('failed', 'stale')
        ORDER BY r.attempt DESC
        LIMIT 1
    ),
    last_error = (
        SELECT r.error_text FROM runs AS r
        WHERE r.task_id = tasks.id AND r.status IN ('failed', 'stale')
        ORDER BY r.attempt DESC
        LIMIT 1
    )
WHERE dead_letter_reason IS NOT NULL OR next_eligible_at_ms != 0;
UPDATE tasks
SET failed_at_ms = updated_at_ms
WHERE failed_at_ms IS NULL AND dead_letter_reason IS NOT NULL AND cancelled_at_ms IS NULL;

CREATE INDEX idx_tasks_dead_letters ON tasks(failed_at_ms, id)
    WHERE dead_letter_reason IS NOT NULL AND cancelled_at_ms IS NULL;
CREATE INDEX idx_tasks_cancelled ON tasks(cancelled_at_ms, id)
    WHERE cancelled_at_ms IS NOT NULL;
CREATE INDEX idx_tasks_failing ON tasks(failed_at_ms, id)
    WHERE failed_at_ms IS NOT NULL AND dead_letter_reason IS NULL;
CREATE INDEX idx_tasks_parked ON tasks(pipeline_id, stage, cancelled_at_ms)
    WHERE dead_letter_reason IS NOT NULL;
