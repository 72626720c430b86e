-- Every statement the server runs, by name. Time is always a parameter (:now).

-- insert_pipeline --
INSERT INTO pipelines (id, name, definition_json, created_at_ms)
VALUES (:id, :name, :definition_json, :now);

-- insert_pipeline_stage --
INSERT INTO pipeline_stages (pipeline_id, stage, agent_role, terminal)
VALUES (:pipeline_id, :stage, :agent_role, :terminal);

-- get_pipeline --
SELECT id, name, definition_json, created_at_ms
FROM pipelines
WHERE id = :id;

-- list_pipelines --
SELECT id, name, definition_json, created_at_ms
FROM pipelines
ORDER BY created_at_ms DESC, rowid DESC;

-- insert_task --
INSERT INTO tasks (
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, max_attempts, retry_delay_ms, dead_letter_stage, created_at_ms,
    updated_at_ms, idempotency_key, retry_delay_set
)
VALUES (
    :id, :pipeline_id, :stage, :title, :description, :priority, :metadata_json, 1,
    0, :max_attempts, :retry_delay_ms, :dead_letter_stage, :now,
    :now, :idempotency_key, :retry_delay_set
)
-- A task of the pipeline under the same idempotency key (idx_tasks_idempotency_key) means
-- the plan was sent again: nothing is inserted, and the caller looks the task up.
ON CONFLICT DO NOTHING;

-- task_by_idempotency_key --
SELECT id FROM tasks WHERE pipeline_id = :pipeline_id AND idempotency_key = :idempotency_key;

-- task_details --
-- What GET /tasks/{id} reads of the task row itself, in one trip: the task, its checkpoint
-- and fence, and its cancellation.
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms, checkpoint_json, fence, cancelled_at_ms, cancel_reason
FROM tasks
WHERE id = :id;

-- task_resume --
-- What an agent needs to resume a task: its checkpoint and its current fence.
SELECT checkpoint_json, fence FROM tasks WHERE id = :id;

-- previous_failures --
SELECT attempt, id, status, error_text, ended_at_ms
FROM runs
WHERE task_id = :task_id AND status IN ('failed', 'stale')
ORDER BY attempt DESC
LIMIT :limit;

-- retry_delay_set --
SELECT retry_delay_set FROM tasks WHERE id = :id;

-- bump_fence --
-- A claim raises the task's fence and reads back what the agent needs to resume, in one go.
UPDATE tasks SET fence = fence + 1 WHERE id = :id RETURNING fence, checkpoint_json;

-- task_fence_of_run --
SELECT t.fence FROM runs AS r JOIN tasks AS t ON t.id = r.task_id WHERE r.id = :run_id;

-- task_fence_of_lease --
SELECT t.fence FROM runs AS r JOIN tasks AS t ON t.id = r.task_id WHERE r.lease_id = :lease_id;

-- merge_checkpoint --
-- RFC 7396 merge patch, applied by SQLite in the same statement that reads the old value.
UPDATE tasks
SET checkpoint_json = json_patch(coalesce(checkpoint_json, '{}'), :patch)
WHERE id = :id
RETURNING checkpoint_json;

-- leases_of_agent --
SELECT l.run_id FROM leases AS l WHERE l.agent_id = :agent_id ORDER BY l.expires_at_ms;

-- dependent_stages --
-- (pipeline, stage) of each task waiting on this one, once per task: who may be able to claim
-- once it is done (each is a wake-up of its own).
SELECT t.pipeline_id, t.stage
FROM task_dependencies AS d
JOIN tasks AS t ON t.id = d.task_id
WHERE d.depends_on_task_id = :id;

-- leased_in_pipeline_stage --
SELECT count(*)
FROM runs AS r
CROSS JOIN tasks AS t ON t.id = r.task_id
WHERE r.status = 'running' AND t.pipeline_id = :pipeline_id AND t.stage = :stage;

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

-- list_tasks --
-- Keyset pagination: rows strictly after (:after_created, :after_id), in (created_at_ms, id) order.
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE (created_at_ms, id) > (:after_created, :after_id)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_stage --
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE stage = :stage
    AND (created_at_ms, id) > (:after_created, :after_id)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_pipeline --
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE pipeline_id = :pipeline_id
    AND (created_at_ms, id) > (:after_created, :after_id)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_pipeline_and_stage --
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE pipeline_id = :pipeline_id
    AND stage = :stage
    AND (created_at_ms, id) > (:after_created, :after_id)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_role --
-- Tasks in the stages a role works on (optionally one stage or pipeline): from the role's few
-- stages to their tasks, never through the tasks of other stages.
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.description, t.priority, t.metadata_json,
    t.task_version, t.next_eligible_at_ms, t.retry_delay_ms, t.max_attempts,
    t.dead_letter_stage, t.dead_letter_reason, t.created_at_ms, t.updated_at_ms
FROM pipeline_stages AS s
CROSS JOIN tasks AS t INDEXED BY idx_tasks_pipeline_stage_page
    ON t.pipeline_id = s.pipeline_id AND t.stage = s.stage
WHERE s.agent_role = :agent_role
    AND (:stage IS NULL OR s.stage = :stage)
    AND (:pipeline_id IS NULL OR s.pipeline_id = :pipeline_id)
    AND (t.created_at_ms, t.id) > (:after_created, :after_id)
ORDER BY t.created_at_ms, t.id
LIMIT :limit;

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

-- insert_dependency --
INSERT INTO task_dependencies (task_id, depends_on_task_id, created_at_ms)
VALUES (:task_id, :depends_on_task_id, :now);

-- list_dependencies --
-- resolved: the upstream task sits in a terminal stage of its own pipeline.
SELECT d.depends_on_task_id, coalesce(s.terminal, 0)
FROM task_dependencies AS d
JOIN tasks AS u ON u.id = d.depends_on_task_id
LEFT JOIN pipeline_stages AS s ON s.pipeline_id = u.pipeline_id AND s.stage = u.stage
WHERE d.task_id = :task_id
ORDER BY d.created_at_ms, d.rowid;

-- deactivate_assignments --
UPDATE task_assignments
SET active = 0, updated_at_ms = :now
WHERE task_id = :task_id AND active = 1;

-- upsert_assignment --
INSERT INTO task_assignments (task_id, agent_id, assigned_by, active, created_at_ms, updated_at_ms)
VALUES (:task_id, :agent_id, :assigned_by, 1, :now, :now)
ON CONFLICT (task_id, agent_id) DO UPDATE
SET assigned_by = excluded.assigned_by, active = 1, updated_at_ms = excluded.updated_at_ms;

-- unassign --
UPDATE task_assignments
SET active = 0, updated_at_ms = :now
WHERE task_id = :task_id AND agent_id = :agent_id AND active = 1;

-- list_assignments --
SELECT task_id, agent_id, assigned_by, active, created_at_ms, updated_at_ms
FROM task_assignments
WHERE task_id = :task_id
ORDER BY created_at_ms, rowid;

-- expired_leases --
-- Leases past their expiry whose runs are still running: the janitor's work list.
SELECT l.id, l.run_id, r.task_id
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
WHERE l.expires_at_ms <= :now
ORDER BY l.expires_at_ms
LIMIT :limit;

-- next_lease_expiry --
SELECT min(expires_at_ms) FROM leases;

-- leased_in_stage --
-- Tasks (any pipeline) in a stage of this name that hold a live lease.
SELECT count(*)
FROM runs AS r
CROSS JOIN tasks AS t ON t.id = r.task_id  -- from the few running runs, not the stage's tasks
WHERE r.status = 'running' AND t.stage = :stage;

-- claim_candidate --
-- For each (pipeline, stage) the role works on, walk idx_tasks_claim in priority order and stop
-- at the first eligible task; then pick the best of those few. Cost depends on the number of
-- stages and of skipped (leased, delayed, blocked) rows, never on finished tasks.
WITH best AS (
    SELECT
        s.pipeline_id,
        s.stage,
        (
            SELECT t.id
            FROM tasks AS t INDEXED BY idx_tasks_claim
            WHERE t.pipeline_id = s.pipeline_id
                AND t.stage = s.stage
                AND t.dead_letter_reason IS NULL
                AND t.next_eligible_at_ms <= :now
                AND NOT EXISTS (
                    SELECT 1 FROM runs AS r
                    WHERE r.task_id = t.id AND r.status = 'running'
                )
                AND NOT EXISTS (
                    SELECT 1
                    FROM task_dependencies AS d
                    JOIN tasks AS u ON u.id = d.depends_on_task_id
                    LEFT JOIN pipeline_stages AS us
                        ON us.pipeline_id = u.pipeline_id AND us.stage = u.stage
                    WHERE d.task_id = t.id AND coalesce(us.terminal, 0) = 0
                )
                AND (
                    NOT EXISTS (
                        SELECT 1 FROM task_assignments AS a
                        WHERE a.task_id = t.id AND a.active = 1
                    )
                    OR EXISTS (
                        SELECT 1 FROM task_assignments AS a
                        WHERE a.task_id = t.id AND a.active = 1 AND a.agent_id = :agent_id
                    )
                )
            ORDER BY t.priority DESC, t.created_at_ms ASC, t.rowid ASC
            LIMIT 1
        ) AS task_id
    FROM pipeline_stages AS s
    WHERE s.agent_role = :agent_role
        -- Stages at their concurrency limit (JSON arrays; NULL when there are none, which
        -- skips the json_each work on every claim that sets no limit).
        AND (
            :full_stages IS NULL
            OR s.stage NOT IN (SELECT value FROM json_each(:full_stages))
        )
        AND (
            :full_pairs IS NULL
            OR NOT EXISTS (
                SELECT 1 FROM json_each(:full_pairs) AS f
                WHERE f.value ->> '$[0]' = s.pipeline_id AND f.value ->> '$[1]' = s.stage
            )
        )
)
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.description, t.priority, t.metadata_json,
    t.task_version, t.next_eligible_at_ms, t.retry_delay_ms, t.max_attempts,
    t.dead_letter_stage, t.dead_letter_reason, t.created_at_ms, t.updated_at_ms
FROM best
JOIN tasks AS t ON t.id = best.task_id
ORDER BY t.priority DESC, t.created_at_ms ASC, best.pipeline_id, best.stage, t.rowid
LIMIT 1;

-- insert_run --
-- attempt = 1 + the highest attempt of any earlier run of the task, whatever its stage.
INSERT INTO runs (
    id, task_id, attempt, status, agent_id, agent_role, started_at_ms, usage_json, lease_id
)
VALUES (
    :id,
    :task_id,
    (SELECT coalesce(max(attempt), 0) + 1 FROM runs WHERE task_id = :task_id),
    'running',
    :agent_id,
    :agent_role,
    :now,
    '{}',
    :lease_id
)
RETURNING attempt;

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

-- insert_event --
INSERT INTO events (run_id, ts_ms, kind, data_json)
VALUES (:run_id, :now, :kind, :data_json);

-- insert_event_under_lease --
-- The event, only if the run's lease is held with this token, is live and (when one is given)
-- still has this fence: the lease check and the write in one statement. No row back means one
-- of those failed; the caller then finds out which.
INSERT INTO events (run_id, ts_ms, kind, data_json)
SELECT :run_id, :now, :kind, :data_json
FROM leases AS l
WHERE l.run_id = :run_id
    AND l.token_hash = :token_hash
    AND l.expires_at_ms > :now
    AND (:fence IS NULL OR l.fence = :fence)
LIMIT 1
RETURNING id;

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

-- live_lease_of_task --
-- The lease of the task's running run, if any (at most one: a claim skips leased tasks).
SELECT l.id, l.run_id, l.expires_at_ms
FROM runs AS r
JOIN leases AS l ON l.run_id = r.id
WHERE r.task_id = :task_id AND r.status = 'running'
LIMIT 1;

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

-- insert_task_event --
INSERT INTO task_events (task_id, ts_ms, kind, data_json)
VALUES (:task_id, :now, :kind, :data_json);

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

-- list_artifacts --
SELECT id, task_id, run_id, created_at_ms, kind, uri, sha256_hex, size_bytes, meta_json
FROM artifacts
WHERE (created_at_ms, id) > (:after_created, :after_id)
    AND (:task_id IS NULL OR task_id = :task_id)
    AND (:run_id IS NULL OR run_id = :run_id)
ORDER BY created_at_ms, id
LIMIT :limit;

-- tasks_by_stage --
SELECT stage, count(*) FROM tasks GROUP BY stage ORDER BY stage;

-- active_leases --
SELECT count(*) FROM leases WHERE expires_at_ms > :now;

-- get_idempotency --
SELECT request_hash, auth_hash, response_status, response_body
FROM idempotency_keys
WHERE key = :key AND method = :method AND path = :path;

-- put_idempotency --
INSERT OR REPLACE INTO idempotency_keys (
    key, method, path, request_hash, auth_hash, response_status, response_body, created_at_ms
)
VALUES (:key, :method, :path, :request_hash, :auth_hash, :status, :body, :now);

-- purge_idempotency --
DELETE FROM idempotency_keys WHERE created_at_ms < :before;

-- put_value --
INSERT INTO store (namespace, key, value_json, created_at_ms, updated_at_ms)
VALUES (:namespace, :key, :value_json, :now, :now)
ON CONFLICT (namespace, key) DO UPDATE
SET value_json = excluded.value_json, updated_at_ms = excluded.updated_at_ms;

-- get_value --
SELECT namespace, key, value_json, created_at_ms, updated_at_ms
FROM store
WHERE namespace = :namespace AND key = :key;

-- delete_value --
DELETE FROM store WHERE namespace = :namespace AND key = :key;

-- list_namespace --
SELECT namespace, key, value_json, created_at_ms, updated_at_ms
FROM store
WHERE namespace = :namespace
ORDER BY key;

-- delete_namespace --
DELETE FROM store WHERE namespace = :namespace;

-- search_store --
-- :query is already a sanitised FTS5 expression (quoted phrases joined by AND). With
-- :filter_path, keep rows whose value at that path has the text form :filter_value (strings as
-- themselves, numbers in decimal, booleans as true/false, null as null); without
-- :filter_value, rows where the path exists.
SELECT
    s.namespace, s.key, s.value_json, s.created_at_ms, s.updated_at_ms,
    bm25(store_fts) AS score,
    snippet(store_fts, -1, '[', ']', '…', 16) AS snippet
FROM store_fts
JOIN store AS s ON s.rowid = store_fts.rowid
WHERE store_fts MATCH :query
    AND (:namespace IS NULL OR s.namespace = :namespace)
    AND (
        :filter_path IS NULL
        OR (
            :filter_value IS NULL
            AND json_type(s.value_json, :filter_path) IS NOT NULL
        )
        OR (
            CASE json_type(s.value_json, :filter_path)
                WHEN 'true' THEN 'true'
                WHEN 'false' THEN 'false'
                WHEN 'null' THEN 'null'
                WHEN 'object' THEN json_extract(s.value_json, :filter_path)
                WHEN 'array' THEN json_extract(s.value_json, :filter_path)
                ELSE CAST(json_extract(s.value_json, :filter_path) AS TEXT)
            END = :filter_value
        )
    )
ORDER BY score, s.namespace, s.key
LIMIT :limit;

-- role_stage_queue --
-- One row per (pipeline, stage) that names a role, with the counts /ops/queue sums per role.
-- Each count starts from an index on live state (the tasks of that stage, running runs, lease
-- expiry; CROSS JOIN fixes that order), so finished tasks never enter the computation.
SELECT
    s.agent_role,
    (
        -- [how many, the oldest created_at_ms] of the claimable tasks, in one walk of the index
        SELECT json_array(count(*), min(t.created_at_ms))
        FROM tasks AS t INDEXED BY idx_tasks_claim
        WHERE t.pipeline_id = s.pipeline_id AND t.stage = s.stage
            AND t.dead_letter_reason IS NULL
            AND t.next_eligible_at_ms <= :now
            AND NOT EXISTS (
                SELECT 1 FROM runs AS r WHERE r.task_id = t.id AND r.status = 'running'
            )
            AND NOT EXISTS (
                SELECT 1
                FROM task_dependencies AS d
                JOIN tasks AS u ON u.id = d.depends_on_task_id
                LEFT JOIN pipeline_stages AS us
                    ON us.pipeline_id = u.pipeline_id AND us.stage = u.stage
                WHERE d.task_id = t.id AND coalesce(us.terminal, 0) = 0
            )
    ) AS claimable,
    (
        SELECT count(*)
        FROM tasks AS t INDEXED BY idx_tasks_pipeline_stage_page
        JOIN runs AS r ON r.task_id = t.id
        WHERE t.pipeline_id = s.pipeline_id AND t.stage = s.stage
            AND r.status IN ('failed', 'stale')
    ) AS failed_count,
    (
        SELECT count(*)
        FROM runs AS r
        CROSS JOIN tasks AS t ON t.id = r.task_id
        WHERE r.status = 'running' AND r.started_at_ms <= :stuck_before
            AND t.pipeline_id = s.pipeline_id AND t.stage = s.stage
    ) AS stuck_count,
    (
        SELECT count(*)
        FROM leases AS l
        CROSS JOIN runs AS r ON r.id = l.run_id
        CROSS JOIN tasks AS t ON t.id = r.task_id
        WHERE l.expires_at_ms > :now AND l.expires_at_ms <= :near_expiry_before
            AND t.pipeline_id = s.pipeline_id AND t.stage = s.stage
    ) AS near_expiry_leases
FROM pipeline_stages AS s
WHERE s.agent_role IS NOT NULL
ORDER BY s.pipeline_id, s.stage;

-- insert_otlp_batch --
INSERT INTO otlp_batches (received_at_ms, content_type, payload_json, payload_blob, parsed_spans)
VALUES (:now, :content_type, :payload_json, :payload_blob, :parsed_spans);

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
SELECT e.id, e.run_id, r.task_id, t.pipeline_id, e.ts_ms, e.kind, e.data_json
FROM events AS e
JOIN runs AS r ON r.id = e.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE e.id > :after_id AND (:task_id IS NULL OR r.task_id = :task_id)
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

-- stage_board --
-- Per (pipeline, stage) that names a role, where its tasks stand: (pipeline_id, stage, role,
-- then a JSON array [claimable, oldest claimable created_at_ms, leased, waiting on a retry
-- delay, blocked by dependencies, dead-lettered, cancelled]). One walk of the stage's own
-- tasks through its index: tasks that finished have left the stages with roles. Then, with no
-- role, each other stage that holds dead-lettered or cancelled tasks (a dead-letter stage):
-- counted where they landed, from their own partial index. Stages with a role come first.
SELECT pipeline_id, stage, agent_role, board
FROM (
    SELECT
        s.pipeline_id, s.stage, s.agent_role,
        (
            SELECT json_array(
                coalesce(sum(x.dead = 0 AND x.leased = 0 AND x.delayed = 0 AND x.blocked = 0), 0),
                min(CASE WHEN x.dead = 0 AND x.leased = 0 AND x.delayed = 0 AND x.blocked = 0
                    THEN x.created_at_ms END),
                coalesce(sum(x.leased), 0),
                coalesce(sum(x.dead = 0 AND x.leased = 0 AND x.delayed = 1), 0),
                coalesce(sum(x.dead = 0 AND x.leased = 0 AND x.delayed = 0 AND x.blocked = 1), 0),
                coalesce(sum(x.dead = 1 AND x.cancelled = 0), 0),
                coalesce(sum(x.cancelled), 0)
            )
            FROM (
                SELECT
                    t.created_at_ms,
                    t.dead_letter_reason IS NOT NULL AS dead,
                    t.cancelled_at_ms IS NOT NULL AS cancelled,
                    t.next_eligible_at_ms > :now AS delayed,
                    EXISTS (SELECT 1 FROM runs AS r WHERE r.task_id = t.id AND r.status = 'running') AS leased,
                    EXISTS (SELECT 1 FROM task_dependencies AS d JOIN tasks AS u ON u.id = d.depends_on_task_id LEFT JOIN pipeline_stages AS us ON us.pipeline_id = u.pipeline_id AND us.stage = u.stage WHERE d.task_id = t.id AND coalesce(us.terminal, 0) = 0) AS blocked
                FROM tasks AS t INDEXED BY idx_tasks_pipeline_stage_page
                WHERE t.pipeline_id = s.pipeline_id AND t.stage = s.stage
            ) AS x
        ) AS board
    FROM pipeline_stages AS s
    WHERE s.agent_role IS NOT NULL
    UNION ALL
    SELECT
        p.pipeline_id, p.stage, NULL,
        json_array(
            0, NULL, 0, 0, 0, sum(p.cancelled_at_ms IS NULL), sum(p.cancelled_at_ms IS NOT NULL)
        )
    FROM tasks AS p INDEXED BY idx_tasks_parked
    LEFT JOIN pipeline_stages AS ps ON ps.pipeline_id = p.pipeline_id AND ps.stage = p.stage
    WHERE p.dead_letter_reason IS NOT NULL AND ps.agent_role IS NULL
    GROUP BY p.pipeline_id, p.stage
)
ORDER BY agent_role IS NULL, agent_role, pipeline_id, stage;

-- parked_totals --
-- How many tasks are dead-lettered and how many cancelled, in every pipeline and stage: a walk
-- of their own partial index (GET /ops/queue).
SELECT
    coalesce(sum(cancelled_at_ms IS NULL), 0),
    coalesce(sum(cancelled_at_ms IS NOT NULL), 0)
FROM tasks INDEXED BY idx_tasks_parked
WHERE dead_letter_reason IS NOT NULL;

-- event_kinds_since --
-- How many run events of each kind came after :after_id, and the newest id (GET /metrics
-- counts only what is new since its last scrape: a walk of the primary key from there).
SELECT kind, count(*), max(id)
FROM events
WHERE id > :after_id
GROUP BY kind;

-- list_tasks_matching --
-- GET /tasks?q=: tasks whose title or id holds :q (ASCII letters in any case), with the other
-- filters optional, in page order. A walk of the pages index that stops after :limit matches:
-- a rare text walks far, so this is the dashboard's filter, not an agent's query.
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.description, t.priority, t.metadata_json,
    t.task_version, t.next_eligible_at_ms, t.retry_delay_ms, t.max_attempts,
    t.dead_letter_stage, t.dead_letter_reason, t.created_at_ms, t.updated_at_ms
FROM tasks AS t INDEXED BY idx_tasks_page
WHERE (t.created_at_ms, t.id) > (:after_created, :after_id)
    AND (:stage IS NULL OR t.stage = :stage)
    AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
    AND (
        :agent_role IS NULL OR EXISTS (
            SELECT 1 FROM pipeline_stages AS s
            WHERE s.pipeline_id = t.pipeline_id AND s.stage = t.stage
                AND s.agent_role = :agent_role
        )
    )
    AND (instr(lower(t.title), lower(:q)) > 0 OR instr(t.id, :q) > 0)
ORDER BY t.created_at_ms, t.id
LIMIT :limit;

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

-- retry_waiting --
-- Tasks waiting on a retry delay (not dead-lettered, cancelled nor leased), soonest claimable
-- first, with the latest failed or stale run: its attempt, error and end. Only the stages that
-- name a role can hold such tasks, so this walks their tasks as stage_board does.
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.next_eligible_at_ms,
    r.attempt, r.status, r.error_text, r.ended_at_ms
FROM pipeline_stages AS s
CROSS JOIN tasks AS t INDEXED BY idx_tasks_pipeline_stage_page
    ON t.pipeline_id = s.pipeline_id AND t.stage = s.stage
LEFT JOIN runs AS r ON r.id = (
    SELECT f.id FROM runs AS f
    WHERE f.task_id = t.id AND f.status IN ('failed', 'stale')
    ORDER BY f.attempt DESC
    LIMIT 1
)
WHERE s.agent_role IS NOT NULL
    AND t.next_eligible_at_ms > :now
    AND t.dead_letter_reason IS NULL
    AND NOT EXISTS (SELECT 1 FROM runs AS l WHERE l.task_id = t.id AND l.status = 'running')
ORDER BY t.next_eligible_at_ms, t.id
LIMIT :limit;

-- list_namespaces --
-- The store's namespaces after :after, by name: how many keys each holds, when it last changed.
SELECT namespace, count(*), max(updated_at_ms)
FROM store
WHERE namespace > :after
GROUP BY namespace
ORDER BY namespace
LIMIT :limit;

-- list_failures --
-- GET /ops/failures: dead-lettered, cancelled and failing tasks (of the kinds whose flag is
-- true: :dead, :cancelled, :failing), newest first by `at`: the end of the latest failed
-- attempt, or for a cancelled task its cancellation; strictly before (:before_at, :before_id).
-- Each kind walks its own partial index from its newest end and stops after :limit rows;
-- :pipeline_id and :error (the last error, '' for none) filter on the way. Then, for the page
-- only: the task's failed attempts, and whether an agent holds it now.
SELECT
    f.id, f.pipeline_id, f.stage, f.title, f.priority, f.state, f.at_ms, f.failed_at_ms,
    f.last_error, f.dead_letter_reason, f.cancelled_at_ms, f.cancel_reason,
    f.next_eligible_at_ms,
    (
        SELECT count(*) FROM runs AS r
        WHERE r.task_id = f.id AND r.status IN ('failed', 'stale')
    ) AS failures,
    EXISTS (SELECT 1 FROM runs AS r WHERE r.task_id = f.id AND r.status = 'running') AS leased
FROM (
    SELECT * FROM (
        SELECT
            t.id, t.pipeline_id, t.stage, t.title, t.priority, 'dead_lettered' AS state,
            t.failed_at_ms AS at_ms, t.failed_at_ms, t.last_error, t.dead_letter_reason,
            t.cancelled_at_ms, t.cancel_reason, NULL AS next_eligible_at_ms
        FROM tasks AS t INDEXED BY idx_tasks_dead_letters
        WHERE :dead
            AND t.dead_letter_reason IS NOT NULL AND t.cancelled_at_ms IS NULL
            AND (t.failed_at_ms, t.id) < (:before_at, :before_id)
            AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
            AND (:error IS NULL OR coalesce(t.last_error, '') = :error)
        ORDER BY t.failed_at_ms DESC, t.id DESC
        LIMIT :limit
    )
    UNION ALL
    SELECT * FROM (
        SELECT
            t.id, t.pipeline_id, t.stage, t.title, t.priority, 'cancelled' AS state,
            t.cancelled_at_ms AS at_ms, t.failed_at_ms, t.last_error, t.dead_letter_reason,
            t.cancelled_at_ms, t.cancel_reason, NULL AS next_eligible_at_ms
        FROM tasks AS t INDEXED BY idx_tasks_cancelled
        WHERE :cancelled
            AND t.cancelled_at_ms IS NOT NULL
            AND (t.cancelled_at_ms, t.id) < (:before_at, :before_id)
            AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
            AND (:error IS NULL OR coalesce(t.last_error, '') = :error)
        ORDER BY t.cancelled_at_ms DESC, t.id DESC
        LIMIT :limit
    )
    UNION ALL
    SELECT * FROM (
        SELECT
            t.id, t.pipeline_id, t.stage, t.title, t.priority, 'failing' AS state,
            t.failed_at_ms AS at_ms, t.failed_at_ms, t.last_error, t.dead_letter_reason,
            t.cancelled_at_ms, t.cancel_reason, t.next_eligible_at_ms
        FROM tasks AS t INDEXED BY idx_tasks_failing
        WHERE :failing
            AND t.failed_at_ms IS NOT NULL AND t.dead_letter_reason IS NULL
            AND (t.failed_at_ms, t.id) < (:before_at, :before_id)
            AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
            AND (:error IS NULL OR coalesce(t.last_error, '') = :error)
        ORDER BY t.failed_at_ms DESC, t.id DESC
        LIMIT :limit
    )
) AS f
ORDER BY f.at_ms DESC, f.id DESC
LIMIT :limit;

-- failure_groups --
-- GET /ops/failures/groups: the tasks of list_failures (the same flags) grouped by state and
-- last error ('' for none): how many, the newest and the oldest `at` of each group; most tasks
-- first. Each kind is one walk of its own partial index.
SELECT g.state, g.error, count(*), max(g.at_ms), min(g.at_ms)
FROM (
    SELECT 'dead_lettered' AS state, coalesce(t.last_error, '') AS error, t.failed_at_ms AS at_ms
    FROM tasks AS t INDEXED BY idx_tasks_dead_letters
    WHERE :dead
        AND t.dead_letter_reason IS NOT NULL AND t.cancelled_at_ms IS NULL
        AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
    UNION ALL
    SELECT 'cancelled', coalesce(t.last_error, ''), t.cancelled_at_ms
    FROM tasks AS t INDEXED BY idx_tasks_cancelled
    WHERE :cancelled
        AND t.cancelled_at_ms IS NOT NULL
        AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
    UNION ALL
    SELECT 'failing', coalesce(t.last_error, ''), t.failed_at_ms
    FROM tasks AS t INDEXED BY idx_tasks_failing
    WHERE :failing
        AND t.failed_at_ms IS NOT NULL AND t.dead_letter_reason IS NULL
        AND (:pipeline_id IS NULL OR t.pipeline_id = :pipeline_id)
) AS g
GROUP BY g.state, g.error
ORDER BY count(*) DESC, max(g.at_ms) DESC, g.state, g.error
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
