-- Operator verbs: cancel and requeue.
--
-- A cancelled task keeps its stage and gets dead_letter_reason = 'cancelled' (with the parked
-- eligibility time dead-lettering uses), so it drops out of idx_tasks_claim through the
-- index's own predicate: the claim path runs the same statements as before, and the original
-- server, opening this file, does not claim it either. cancelled_at_ms and cancel_reason say
-- when and why; a requeue clears all three.
--
-- failures_forgiven: failed attempts a requeue with reset_attempts wrote off. The retry
-- policy counts the task's failed and stale runs minus this number; the runs themselves stay.
--
-- task_events: what operators did to a task (requeued, cancelled). Events of runs need a run,
-- and a task that was never claimed has none; these belong to the task itself.

ALTER TABLE tasks ADD COLUMN cancelled_at_ms INTEGER;
ALTER TABLE tasks ADD COLUMN cancel_reason TEXT;
ALTER TABLE tasks ADD COLUMN failures_forgiven INTEGER NOT NULL DEFAULT 0;

CREATE TABLE task_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
    ts_ms INTEGER NOT NULL,
    kind TEXT NOT NULL,
    data_json TEXT NOT NULL
);
CREATE INDEX idx_task_events_task ON task_events(task_id, id);
