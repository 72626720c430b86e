-- The statements of the SQLite backend whose text differs from PostgreSQL's, by name: each
-- name is also in storage/postgres/queries.sql, as its PostgreSQL translation. What both
-- backends run word for word is in storage/queries.sql, and only there. Time is always a
-- parameter (:now).

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

-- bump_fence --
-- A claim raises the task's fence and reads back what the agent needs to resume, in one go.
UPDATE tasks SET fence = fence + 1 WHERE id = :id RETURNING fence, checkpoint_json;

-- merge_checkpoint --
-- RFC 7396 merge patch, applied by SQLite in the same statement that reads the old value.
UPDATE tasks
SET checkpoint_json = json_patch(coalesce(checkpoint_json, '{}'), :patch)
WHERE id = :id
RETURNING checkpoint_json;

-- leased_in_pipeline_stage --
SELECT count(*)
FROM runs AS r
CROSS JOIN tasks AS t ON t.id = r.task_id
WHERE r.status = 'running' AND t.pipeline_id = :pipeline_id AND t.stage = :stage;

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

-- list_dependencies --
-- resolved: the upstream task sits in a terminal stage of its own pipeline.
SELECT d.depends_on_task_id, coalesce(s.terminal, 0)
FROM task_dependencies AS d
JOIN tasks AS u ON u.id = d.depends_on_task_id
LEFT JOIN pipeline_stages AS s ON s.pipeline_id = u.pipeline_id AND s.stage = u.stage
WHERE d.task_id = :task_id
ORDER BY d.created_at_ms, d.rowid;

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
    AND (:key_id IS NULL OR EXISTS (SELECT 1 FROM api_keys AS k WHERE k.id = :key_id))
LIMIT 1
RETURNING id;

-- extend_held_lease --
-- A heartbeat: the lease extended only if it is held with this token, is live, (when one is
-- given) still has this fence and is asked for with a key that exists (:key_id, when given), by :ttl_ms (NULL: its own TTL, else :default_ttl_ms), which
-- becomes its TTL; the check and the write in one statement. No row back means one of those
-- failed; the caller then finds out which.
UPDATE leases
SET expires_at_ms = :now + coalesce(:ttl_ms, nullif(ttl_ms, 0), :default_ttl_ms),
    last_heartbeat_ms = :now,
    ttl_ms = coalesce(:ttl_ms, nullif(ttl_ms, 0), :default_ttl_ms)
WHERE id = :id
    AND token_hash = :token_hash
    AND expires_at_ms > :now
    AND (:fence IS NULL OR fence = :fence)
    AND (:key_id IS NULL OR EXISTS (SELECT 1 FROM api_keys AS k WHERE k.id = :key_id))
RETURNING expires_at_ms;

-- live_lease_of_task --
-- The lease of the task's running run, if any (at most one: a claim skips leased tasks).
SELECT l.id, l.run_id, l.expires_at_ms
FROM runs AS r
JOIN leases AS l ON l.run_id = r.id
WHERE r.task_id = :task_id AND r.status = 'running'
LIMIT 1;

-- insert_task_event --
INSERT INTO task_events (task_id, ts_ms, kind, data_json)
VALUES (:task_id, :now, :kind, :data_json);

-- list_artifacts --
SELECT id, task_id, run_id, created_at_ms, kind, uri, sha256_hex, size_bytes, meta_json
FROM artifacts
WHERE (created_at_ms, id) > (:after_created, :after_id)
    AND (:task_id IS NULL OR task_id = :task_id)
    AND (:run_id IS NULL OR run_id = :run_id)
ORDER BY created_at_ms, id
LIMIT :limit;

-- put_idempotency --
INSERT OR REPLACE INTO idempotency_keys (
    key, method, path, request_hash, auth_hash, response_status, response_body, created_at_ms
)
VALUES (:key, :method, :path, :request_hash, :auth_hash, :status, :body, :now);

-- get_value --
SELECT namespace, key, value_json, created_at_ms, updated_at_ms
FROM store
WHERE namespace = :namespace AND key = :key;

-- list_namespace --
SELECT namespace, key, value_json, created_at_ms, updated_at_ms
FROM store
WHERE namespace = :namespace
ORDER BY key;

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

-- prune_candidates --
-- Retention (service/retention.py): finished tasks that last changed before :before, oldest
-- first, after the cursor (:after_created, :after_id) of the pass (idx_tasks_page). Finished:
-- in a terminal stage, or parked (dead-lettered or cancelled) with no task depending on it,
-- since pruning it would drop the dependency that holds its dependents back. A task with a
-- running run is never finished.
SELECT t.id, t.created_at_ms
FROM tasks AS t
WHERE t.created_at_ms < :before
    AND (t.created_at_ms, t.id) > (:after_created, :after_id)
    AND t.updated_at_ms < :before
    AND (
        EXISTS (
            SELECT 1 FROM pipeline_stages AS s
            WHERE s.pipeline_id = t.pipeline_id AND s.stage = t.stage AND s.terminal = 1
        )
        OR (
            t.dead_letter_reason IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM task_dependencies AS d WHERE d.depends_on_task_id = t.id)
        )
    )
    AND NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.task_id = t.id AND r.status = 'running')
ORDER BY t.created_at_ms, t.id
LIMIT :limit;

-- prune_export_tasks --
-- Whole rows, whatever columns the schema has: the export keeps everything a row held.
SELECT * FROM tasks WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY created_at_ms, id;

-- prune_export_dependencies --
SELECT * FROM task_dependencies WHERE task_id IN (SELECT value FROM json_each(:ids));

-- prune_export_assignments --
SELECT * FROM task_assignments WHERE task_id IN (SELECT value FROM json_each(:ids));

-- prune_export_task_events --
SELECT * FROM task_events WHERE task_id IN (SELECT value FROM json_each(:ids)) ORDER BY id;

-- prune_export_runs --
SELECT * FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)) ORDER BY task_id, attempt;

-- prune_export_events --
SELECT e.*
FROM events AS e
JOIN runs AS r ON r.id = e.run_id
WHERE r.task_id IN (SELECT value FROM json_each(:ids))
ORDER BY e.id;

-- prune_export_artifacts --
SELECT *
FROM artifacts
WHERE task_id IN (SELECT value FROM json_each(:ids))
    OR run_id IN (SELECT id FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)))
ORDER BY created_at_ms, id;

-- prune_export_spans --
SELECT *
FROM otlp_spans
WHERE task_id IN (SELECT value FROM json_each(:ids))
    OR run_id IN (SELECT id FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)))
ORDER BY id;

-- prune_delete_events --
DELETE FROM events
WHERE run_id IN (SELECT id FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)));

-- prune_delete_leases --
DELETE FROM leases
WHERE run_id IN (SELECT id FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)));

-- prune_delete_artifacts --
DELETE FROM artifacts
WHERE task_id IN (SELECT value FROM json_each(:ids))
    OR run_id IN (SELECT id FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)));

-- prune_delete_spans --
DELETE FROM otlp_spans
WHERE task_id IN (SELECT value FROM json_each(:ids))
    OR run_id IN (SELECT id FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids)));

-- prune_delete_runs --
DELETE FROM runs WHERE task_id IN (SELECT value FROM json_each(:ids));

-- prune_delete_tasks --
-- Their task_events, dependencies and assignments go with them (ON DELETE CASCADE).
DELETE FROM tasks WHERE id IN (SELECT value FROM json_each(:ids));

-- prune_span_batches --
-- OTLP batches received before :before, oldest first after the pass's cursor.
SELECT id, received_at_ms
FROM otlp_batches
WHERE received_at_ms < :before
    AND (received_at_ms, id) > (:after_at, :after_id)
ORDER BY received_at_ms, id
LIMIT :limit;

-- prune_export_loose_spans --
-- Spans of those batches that belong to no task or run still here (the tasks' own spans go
-- with their tasks): the spans of unknown or already pruned tasks.
SELECT *
FROM otlp_spans AS s
WHERE s.batch_id IN (SELECT value FROM json_each(:ids))
    AND NOT EXISTS (SELECT 1 FROM tasks AS t WHERE t.id = s.task_id)
    AND NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.id = s.run_id)
ORDER BY s.id;

-- prune_delete_loose_spans --
DELETE FROM otlp_spans
WHERE batch_id IN (SELECT value FROM json_each(:ids))
    AND NOT EXISTS (SELECT 1 FROM tasks AS t WHERE t.id = otlp_spans.task_id)
    AND NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.id = otlp_spans.run_id);

-- prune_export_empty_batches --
-- Those batches with no span left.
SELECT *
FROM otlp_batches AS b
WHERE b.id IN (SELECT value FROM json_each(:ids))
    AND NOT EXISTS (SELECT 1 FROM otlp_spans AS s WHERE s.batch_id = b.id)
ORDER BY b.id;

-- prune_delete_empty_batches --
DELETE FROM otlp_batches
WHERE id IN (SELECT value FROM json_each(:ids))
    AND NOT EXISTS (SELECT 1 FROM otlp_spans AS s WHERE s.batch_id = otlp_batches.id);

-- prune_idempotency --
-- Retention of recorded answers, :limit at a time (the hourly purge_idempotency drops the
-- ones older than a day in one statement).
DELETE FROM idempotency_keys
WHERE rowid IN (
    SELECT rowid FROM idempotency_keys
    WHERE created_at_ms < :before
    ORDER BY created_at_ms
    LIMIT :limit
);
