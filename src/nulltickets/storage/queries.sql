-- The statements both backends run word for word, by name. Parameters are :name (queries.py
-- turns them into psycopg's %(name)s for PostgreSQL). Time is always a parameter (:now).
-- Booleans are written true and false: SQLite stores them as 1 and 0, PostgreSQL as BOOLEAN.
-- A statement whose text differs between SQLite and PostgreSQL lives under its name in
-- storage/sqlite/queries.sql and storage/postgres/queries.sql instead, and only there: a name is
-- defined once per backend, never here and in a backend's file (queries.load_backend_queries
-- refuses that). tests/unit/test_queries_shared.py fails when a statement of the same text
-- appears in both backends' files: it belongs here.

-- insert_pipeline --
-- A name already taken fails with a unique violation (pipelines_name_key on PostgreSQL): the
-- backend reports it as duplicate_name (the constraint is the only check).
INSERT INTO pipelines (id, name, definition_json, created_at_ms)
VALUES (:id, :name, :definition_json, :now);

-- insert_pipeline_stage --
INSERT INTO pipeline_stages (pipeline_id, stage, agent_role, terminal)
VALUES (:pipeline_id, :stage, :agent_role, :terminal);

-- pipeline_count --
-- How many pipelines there are (none is ever deleted): Backend.fail_run goes on only when its
-- caller has read that many.
SELECT count(*) FROM pipelines;

-- pipeline_has_stage --
SELECT 1 FROM pipeline_stages WHERE pipeline_id = :pipeline_id AND stage = :stage;

-- get_pipeline --
SELECT id, name, definition_json, created_at_ms
FROM pipelines
WHERE id = :id;

-- task_by_idempotency_key --
SELECT id FROM tasks WHERE pipeline_id = :pipeline_id AND idempotency_key = :idempotency_key;

-- previous_failures --
SELECT attempt, id, status, error_text, ended_at_ms
FROM runs
WHERE task_id = :task_id AND status IN ('failed', 'stale')
ORDER BY attempt DESC
LIMIT :limit;

-- retry_delay_set --
SELECT retry_delay_set FROM tasks WHERE id = :id;

-- task_fence_of_run --
SELECT t.fence FROM runs AS r JOIN tasks AS t ON t.id = r.task_id WHERE r.id = :run_id;

-- task_fence_of_lease --
SELECT t.fence FROM runs AS r JOIN tasks AS t ON t.id = r.task_id WHERE r.lease_id = :lease_id;

-- leases_of_agent --
SELECT l.run_id FROM leases AS l WHERE l.agent_id = :agent_id ORDER BY l.expires_at_ms;

-- held_by_agent --
-- The lease an agent holds (an MCP session's current lease): the latest to expire.
SELECT l.id, l.run_id, r.task_id, l.token_hash, l.fence, l.expires_at_ms
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
WHERE l.agent_id = :agent_id
ORDER BY l.expires_at_ms DESC
LIMIT 1;

-- dependent_stages --
-- (pipeline, stage) of each task waiting on this one, once per task: who may be able to claim
-- once it is done (each is a wake-up of its own).
SELECT t.pipeline_id, t.stage
FROM task_dependencies AS d
JOIN tasks AS t ON t.id = d.task_id
WHERE d.depends_on_task_id = :id;

-- role_stages --
SELECT pipeline_id, stage FROM pipeline_stages WHERE agent_role = :agent_role;

-- get_task --
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE id = :id;

-- task_exists --
SELECT 1 FROM tasks WHERE id = :id;

-- task_run_state --
-- The original never writes tasks.run_id; fall back to the task's latest run.
SELECT coalesce(
    t.run_id,
    (SELECT r.id FROM runs AS r WHERE r.task_id = t.id ORDER BY r.attempt DESC LIMIT 1)
)
FROM tasks AS t
WHERE t.id = :id;

-- latest_run --
SELECT id, task_id, attempt, status, agent_id, agent_role, started_at_ms, ended_at_ms
FROM runs
WHERE task_id = :task_id
ORDER BY attempt DESC
LIMIT 1;

-- run_by_id --
SELECT id, task_id, attempt, status, agent_id, agent_role, started_at_ms, ended_at_ms
FROM runs
WHERE id = :id;

-- insert_dependency --
-- A dependency recorded twice (on PostgreSQL, maybe by two servers at once) fails with a unique
-- violation of the primary key: the backend reports duplicate_dependency.
INSERT INTO task_dependencies (task_id, depends_on_task_id, created_at_ms)
VALUES (:task_id, :depends_on_task_id, :now);

-- deactivate_assignments --
UPDATE task_assignments
SET active = false, updated_at_ms = :now
WHERE task_id = :task_id AND active = true;

-- upsert_assignment --
INSERT INTO task_assignments (task_id, agent_id, assigned_by, active, created_at_ms, updated_at_ms)
VALUES (:task_id, :agent_id, :assigned_by, true, :now, :now)
ON CONFLICT (task_id, agent_id) DO UPDATE
SET assigned_by = excluded.assigned_by, active = true, updated_at_ms = excluded.updated_at_ms;

-- unassign --
UPDATE task_assignments
SET active = false, updated_at_ms = :now
WHERE task_id = :task_id AND agent_id = :agent_id AND active = true;

-- next_lease_expiry --
SELECT min(expires_at_ms) FROM leases;

-- insert_lease --
INSERT INTO leases (
    id, run_id, agent_id, token_hash, expires_at_ms, last_heartbeat_ms, ttl_ms, fence
)
VALUES (:id, :run_id, :agent_id, :token_hash, :expires_at_ms, :now, :ttl_ms, :fence);

-- lease_by_run --
-- A lease with what the lease-protected writes need of its run and task, in one lookup.
SELECT
    l.id, l.run_id, r.task_id, l.token_hash, l.expires_at_ms, l.ttl_ms, r.status, t.stage,
    t.task_version, t.pipeline_id, l.fence, l.agent_id
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE l.run_id = :run_id;

-- lease_by_id --
SELECT
    l.id, l.run_id, r.task_id, l.token_hash, l.expires_at_ms, l.ttl_ms, r.status, t.stage,
    t.task_version, t.pipeline_id, l.fence, l.agent_id
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE l.id = :id;

-- extend_lease --
UPDATE leases
SET expires_at_ms = :expires_at_ms, last_heartbeat_ms = :now, ttl_ms = :ttl_ms
WHERE id = :id;

-- rotate_lease_token --
UPDATE leases SET token_hash = :token_hash WHERE id = :id;

-- delete_lease --
DELETE FROM leases WHERE id = :id;

-- list_events --
SELECT id, run_id, ts_ms, kind, data_json
FROM events
WHERE run_id = :run_id AND id > :after_id
ORDER BY id
LIMIT :limit;

-- end_run --
-- Guarded by status: only a running run can end.
UPDATE runs
SET status = :status, ended_at_ms = :now, usage_json = :usage_json, error_text = :error_text
WHERE id = :id AND status = 'running';

-- move_task --
-- A completed run moves its task on: whatever failed before in the old stage is over.
UPDATE tasks
SET stage = :stage,
    task_version = task_version + 1,
    dead_letter_reason = NULL,
    next_eligible_at_ms = 0,
    failed_at_ms = NULL,
    last_error = NULL,
    updated_at_ms = :now
WHERE id = :id AND task_version = :task_version;

-- failed_attempts --
-- Failures and lease expiries, over the task's whole life, less those a requeue wrote off.
SELECT count(*) - (SELECT failures_forgiven FROM tasks WHERE id = :task_id)
FROM runs
WHERE task_id = :task_id AND status IN ('failed', 'stale');

-- schedule_retry --
-- A failed attempt (:error, what it reported) given a retry at :next_eligible_at_ms.
UPDATE tasks
SET next_eligible_at_ms = :next_eligible_at_ms,
    failed_at_ms = :now,
    last_error = :error,
    updated_at_ms = :now
WHERE id = :id;

-- dead_letter_task --
-- The failed attempt (:error) that used the task's last allowed one: parked in :stage.
UPDATE tasks
SET stage = :stage,
    task_version = task_version + :version_bump,
    dead_letter_reason = :reason,
    next_eligible_at_ms = :next_eligible_at_ms,
    failed_at_ms = :now,
    last_error = :error,
    updated_at_ms = :now
WHERE id = :id;

-- cancel_task --
-- Park the task for good: a non-null dead_letter_reason keeps it out of idx_tasks_claim (a
-- dead-lettered task keeps its reason, so a requeue still knows where it came from).
UPDATE tasks
SET dead_letter_reason = coalesce(dead_letter_reason, 'cancelled'),
    next_eligible_at_ms = :next_eligible_at_ms,
    cancelled_at_ms = :now,
    cancel_reason = :reason,
    updated_at_ms = :now
WHERE id = :id AND cancelled_at_ms IS NULL;

-- requeue_task --
-- Claimable now in :stage: no dead-letter or cancellation, no retry delay; with :reset, the
-- failed attempts so far no longer count against max_attempts.
UPDATE tasks
SET stage = :stage,
    task_version = task_version + :version_bump,
    dead_letter_reason = NULL,
    next_eligible_at_ms = 0,
    cancelled_at_ms = NULL,
    cancel_reason = NULL,
    failures_forgiven = CASE
        WHEN :reset THEN (
            SELECT count(*) FROM runs WHERE task_id = :id AND status IN ('failed', 'stale')
        )
        ELSE failures_forgiven
    END,
    updated_at_ms = :now
WHERE id = :id;

-- task_cancellation --
SELECT cancelled_at_ms, cancel_reason FROM tasks WHERE id = :id;

-- run_status --
SELECT status FROM runs WHERE id = :id;

-- run_status_of_lease --
SELECT status FROM runs WHERE lease_id = :lease_id;

-- last_dead_letter --
-- The data of the task's latest dead_letter event: where a dead-letter policy moved it from.
SELECT e.data_json
FROM runs AS r
JOIN events AS e ON e.run_id = r.id
WHERE r.task_id = :task_id AND e.kind = 'dead_letter'
ORDER BY e.id DESC
LIMIT 1;

-- list_task_events --
SELECT id, task_id, ts_ms, kind, data_json
FROM task_events
WHERE task_id = :task_id AND id > :after_id
ORDER BY id
LIMIT :limit;

-- insert_artifact --
INSERT INTO artifacts (
    id, task_id, run_id, created_at_ms, kind, uri, sha256_hex, size_bytes, meta_json
)
VALUES (:id, :task_id, :run_id, :now, :kind, :uri, :sha256, :size_bytes, :meta_json);

-- run_exists --
SELECT 1 FROM runs WHERE id = :id;

-- tasks_by_stage --
SELECT stage, count(*) FROM tasks GROUP BY stage ORDER BY stage;

-- active_leases --
SELECT count(*) FROM leases WHERE expires_at_ms > :now;

-- get_idempotency --
SELECT request_hash, auth_hash, response_status, response_body
FROM idempotency_keys
WHERE key = :key AND method = :method AND path = :path;

-- purge_idempotency --
DELETE FROM idempotency_keys WHERE created_at_ms < :before;

-- put_value --
INSERT INTO store (namespace, key, value_json, created_at_ms, updated_at_ms)
VALUES (:namespace, :key, :value_json, :now, :now)
ON CONFLICT (namespace, key) DO UPDATE
SET value_json = excluded.value_json, updated_at_ms = excluded.updated_at_ms;

-- delete_value --
DELETE FROM store WHERE namespace = :namespace AND key = :key;

-- delete_namespace --
DELETE FROM store WHERE namespace = :namespace;

-- insert_otlp_span --
INSERT INTO otlp_spans (
    batch_id, trace_id, span_id, parent_span_id, name, kind, start_time_unix_nano,
    end_time_unix_nano, status_code, status_message, scope_name, scope_version, run_id, task_id,
    attributes_json, resource_attributes_json, raw_json
)
VALUES (
    :batch_id, :trace_id, :span_id, :parent_span_id, :name, :kind, :start_time_unix_nano,
    :end_time_unix_nano, :status_code, :status_message, :scope_name, :scope_version, :run_id,
    :task_id, :attributes_json, :resource_attributes_json, :raw_json
);

-- list_run_spans --
SELECT
    id, batch_id, trace_id, span_id, parent_span_id, name, kind, start_time_unix_nano,
    end_time_unix_nano, status_code, status_message, scope_name, scope_version, run_id, task_id,
    attributes_json, resource_attributes_json
FROM otlp_spans
WHERE run_id = :run_id AND id > :after_id
ORDER BY id
LIMIT :limit;

-- events_feed --
-- Run events after :after_id across every run (the live stream reads this once per commit for
-- all its clients), with the task and pipeline each belongs to; :task_id (or null) narrows it.
-- (The CAST: PostgreSQL must know the type of a parameter it only tests for NULL.)
SELECT e.id, e.run_id, r.task_id, t.pipeline_id, e.ts_ms, e.kind, e.data_json
FROM events AS e
JOIN runs AS r ON r.id = e.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE e.id > :after_id AND (CAST(:task_id AS text) IS NULL OR r.task_id = :task_id)
ORDER BY e.id
LIMIT :limit;

-- last_event_id --
SELECT coalesce(max(id), 0) FROM events;

-- transitions_since --
-- Transitions per minute since :since (throughput for the dashboard). Event ids grow with time,
-- so only the newest :window ids are looked at: a bounded walk of the primary key.
SELECT (ts_ms - :since) / 60000 AS minute, count(*)
FROM events
WHERE id > (SELECT coalesce(max(id), 0) FROM events) - :window
    AND kind = 'transition' AND ts_ms >= :since
GROUP BY 1
ORDER BY 1;

-- event_kinds_since --
-- How many run events of each kind came after :after_id, and the newest id (GET /metrics
-- counts only what is new since its last scrape: a walk of the primary key from there).
SELECT kind, count(*), max(id)
FROM events
WHERE id > :after_id
GROUP BY kind;

-- list_task_runs --
-- Every run of a task, oldest attempt first, after attempt :after: who claimed it, how it
-- ended and the error it reported (the dashboard's run timeline).
SELECT id, task_id, attempt, status, agent_id, agent_role, started_at_ms, ended_at_ms, error_text
FROM runs
WHERE task_id = :task_id AND attempt > :after
ORDER BY attempt
LIMIT :limit;

-- list_task_runs_newest --
-- The same runs, newest attempt first, before attempt :before (the timeline's pages: a task
-- failing in a loop may have thousands).
SELECT id, task_id, attempt, status, agent_id, agent_role, started_at_ms, ended_at_ms, error_text
FROM runs
WHERE task_id = :task_id AND attempt < :before
ORDER BY attempt DESC
LIMIT :limit;

-- failing_tasks --
-- Tasks failing in a loop: :min_failures or more failed (or expired) attempts since :since with
-- no completed run after them, and still to be retried (neither dead-lettered nor cancelled),
-- most failures first. Each such failure wrote a retry_scheduled event, and event ids grow
-- with time, so only the newest :window events are looked at, as transitions_since does.
WITH retried AS (
    SELECT r.task_id, count(*) AS failures, max(e.ts_ms) AS last_failed_at_ms,
        max(r.attempt) AS last_attempt
    FROM events AS e
    JOIN runs AS r ON r.id = e.run_id
    WHERE e.id > (SELECT coalesce(max(id), 0) FROM events) - :window
        AND e.kind = 'retry_scheduled' AND e.ts_ms >= :since
        AND NOT EXISTS (
            SELECT 1 FROM runs AS c
            WHERE c.task_id = r.task_id AND c.attempt > r.attempt AND c.status = 'completed'
        )
    GROUP BY r.task_id
    HAVING count(*) >= :min_failures
)
SELECT
    t.id, t.pipeline_id, t.stage, t.title, f.failures, l.error_text, f.last_failed_at_ms,
    t.next_eligible_at_ms
FROM retried AS f
JOIN tasks AS t ON t.id = f.task_id
LEFT JOIN runs AS l ON l.task_id = f.task_id AND l.attempt = f.last_attempt
WHERE t.dead_letter_reason IS NULL
ORDER BY f.failures DESC, f.last_failed_at_ms DESC, t.id
LIMIT :limit;

-- list_namespaces --
-- The store's namespaces after :after, by name: how many keys each holds, when it last changed.
SELECT namespace, count(*), max(updated_at_ms)
FROM store
WHERE namespace > :after
GROUP BY namespace
ORDER BY namespace
LIMIT :limit;

-- insert_api_key --
-- A new key: only its SHA-256 is stored.
INSERT INTO api_keys (id, key_hash, name, access, roles_json, created_at_ms)
VALUES (:id, :key_hash, :name, :access, :roles_json, :now);

-- api_key_by_hash --
-- The key a bearer names (by the SHA-256 of the presented text), if it exists.
SELECT id, name, access, roles_json, created_at_ms
FROM api_keys
WHERE key_hash = :key_hash;

-- api_key_by_id --
SELECT id, name, access, roles_json, created_at_ms
FROM api_keys
WHERE id = :id;

-- list_api_keys --
SELECT id, name, access, roles_json, created_at_ms
FROM api_keys
ORDER BY created_at_ms, id;

-- delete_api_key --
-- Revoke a key: its row goes, and with it every session and request that names it.
DELETE FROM api_keys
WHERE id = :id
RETURNING id, name, access, roles_json, created_at_ms;
