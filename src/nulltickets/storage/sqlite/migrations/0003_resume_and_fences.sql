-- Resume and fencing: a task keeps the checkpoint its agents wrote (an RFC 7396 merge of every
-- write) and a fence that grows with each claim; a lease remembers the fence it was claimed
-- under. Tasks may carry an idempotency key that is unique within their pipeline, and remember
-- whether their retry delay was set by the task itself (a stage's retry policy applies
-- otherwise).

ALTER TABLE tasks ADD COLUMN checkpoint_json TEXT;
ALTER TABLE tasks ADD COLUMN fence INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tasks ADD COLUMN idempotency_key TEXT;
ALTER TABLE tasks ADD COLUMN retry_delay_set INTEGER NOT NULL DEFAULT 0;
ALTER TABLE leases ADD COLUMN fence INTEGER NOT NULL DEFAULT 0;
-- The lease a run was claimed under, kept after the lease row is gone, so a heartbeat from an
-- agent whose lease was reaped can still be told the task moved on (lease_superseded).
ALTER TABLE runs ADD COLUMN lease_id TEXT;

CREATE UNIQUE INDEX idx_tasks_idempotency_key ON tasks(pipeline_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX idx_leases_agent ON leases(agent_id);
CREATE INDEX idx_runs_lease ON runs(lease_id) WHERE lease_id IS NOT NULL;
UPDATE tasks SET retry_delay_set = 1 WHERE retry_delay_ms != 0;
