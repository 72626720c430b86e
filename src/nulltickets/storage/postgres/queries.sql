-- The statements of the PostgreSQL backend whose text differs from SQLite's, by name: the
-- names of storage/sqlite/queries.sql, each the PostgreSQL translation of the SQLite query,
-- plus the few the PostgreSQL backend needs of its own (at the end, each with its reason).
-- What both backends run word for word is in storage/queries.sql, and only there. Parameters
-- are :name, turned into psycopg's %(name)s when the file is loaded (queries.py, "pyformat").
-- Time is always a parameter (:now): no now() here.
-- Booleans are BOOLEAN: the backend passes Python bools (terminal, active, retry_delay_set).
-- JSONB columns are read back as their JSON text (::text), which is what the SQLite backend
-- hands on; PostgreSQL writes that text in its own normal form (key order, spaces).
-- Where a statement differs from its SQLite twin in more than dialect, its comment says why.
-- The statements of PostgresBackend.ALONE (create_task, claim_task, extend_held_lease,
-- insert_event_under_lease, transition_run, checkpoint_run) each take :key_id, the API key the
-- request is made with when it is still to be confirmed (Backend.confirm_key), else NULL: they
-- change nothing unless that key exists, so that the key's check costs no round trip.
-- Row locks, one order everywhere (two servers taking them in opposite orders deadlock, and
-- each deadlock costs deadlock_timeout and a retry): a task's row before its lease's, and
-- whoever ends a run holds its task's row (lock_lease_by_*, expired_leases,
-- live_lease_of_task). A claim holds the task rows it chose (claim_candidate), so it never
-- waits for a run being ended while holding one: its SKIP LOCKED passes over that task.

-- fragment key_exists --
-- The key of the request (:key_id), when one is to be confirmed, still exists: a statement of
-- ALONE changes nothing for a revoked key.
(:key_id::text IS NULL OR EXISTS (SELECT 1 FROM api_keys AS ak WHERE ak.id = :key_id::text))

-- fragment held_lease --
-- The lease of run :run_id (l), its run (r) and task (t), only if the lease is held with
-- :token_hash, is live at :now, has :fence when one is given, and the request's key exists:
-- what every request under a lease checks, as Backend._held does step by step.
-- A statement that ends the run (transition_run, fail_run, release_run; expire_lease the same
-- way) checks that it is running where it ends it, in the UPDATE its other changes follow from,
-- not here: with "status = 'running'" here, the planner, its plan made while runs held few
-- rows, found the run by reading the whole of runs_one_running_per_task (every running run)
-- instead of by its primary key.
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE l.run_id = :run_id
    AND l.token_hash = :token_hash
    AND l.expires_at_ms > :now
    AND (:fence::bigint IS NULL OR l.fence = :fence::bigint)
    AND {key_exists}

-- list_pipelines --
-- seq is the insertion order that SQLite's rowid gives.
SELECT id, name, definition_json, created_at_ms
FROM pipelines
ORDER BY created_at_ms DESC, seq DESC;

-- fragment new_task --
-- The task of insert_task and create_task: each adds its own conditions.
INSERT INTO tasks (
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, max_attempts, retry_delay_ms, dead_letter_stage, created_at_ms,
    updated_at_ms, idempotency_key, retry_delay_set
)
SELECT
    :id, :pipeline_id, :stage, :title, :description, :priority, :metadata_json, 1,
    0, :max_attempts, :retry_delay_ms, :dead_letter_stage, :now,
    :now, :idempotency_key, :retry_delay_set

-- insert_task --
-- Not one-to-one: a task whose idempotency key its pipeline already has is not inserted and no
-- row comes back (SQLite returns nothing either way). That is how two servers creating the
-- same task at once end with one task: the loser waits for the winner's commit, gets no row,
-- and answers with task_by_idempotency_key, without an error that would abort its transaction.
{new_task}
ON CONFLICT (pipeline_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id;

-- create_task --
-- Backend.create_task in one statement (its own transaction when its unit of work starts with
-- it: see PostgresBackend.ALONE): insert_task, and when the task was inserted and :wake_role
-- is given, the wake-up of that role (notify's channel and line for a task claimable now by
-- anyone). (inserted, wake-ups sent): (0, 0) when the idempotency key is taken, or the
-- request's key (:key_id) is gone.
WITH inserted AS (
    {new_task}
    WHERE {key_exists}
    ON CONFLICT (pipeline_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT
    (SELECT count(*) FROM inserted),
    (
        SELECT count(*)
        FROM (
            SELECT pg_notify('nulltickets_claimable', :wake_role::text || E'\t0')
            FROM inserted
            WHERE :wake_role::text IS NOT NULL
        ) AS sent
    );

-- store_put --
-- Backend.put_value in one statement (its own transaction when its unit of work starts with
-- it: see PostgresBackend.ALONE): put_value, only while the request's key (:key_id) exists.
-- No row changed: the key is gone.
INSERT INTO store (namespace, key, value_json, created_at_ms, updated_at_ms)
SELECT :namespace, :key, :value_json, :now, :now
WHERE {key_exists}
ON CONFLICT (namespace, key) DO UPDATE
SET value_json = excluded.value_json, updated_at_ms = excluded.updated_at_ms;

-- store_delete --
-- Backend.delete_value in one statement (its own transaction when its unit of work starts
-- with it): delete_value, only while the request's key (:key_id) exists. No row changed: there
-- was no such value, or the key is gone.
DELETE FROM store WHERE namespace = :namespace AND key = :key AND {key_exists};

-- task_details --
-- What GET /tasks/{id} reads of the task row itself, in one trip: the task, its checkpoint
-- and fence, and its cancellation.
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms, checkpoint_json::text, fence, cancelled_at_ms, cancel_reason
FROM tasks
WHERE id = :id;

-- task_view --
-- Backend.task_view, what GET /tasks/{id} reads, in one statement: task_details' columns, the
-- latest run (run_by_id's columns, NULL when there is none), and as JSON arrays (NULL when
-- empty) the dependencies (list_dependencies), the assignments (list_assignments) and the
-- previous failures (previous_failures).
SELECT
    c.id, c.pipeline_id, c.stage, c.title, c.description, c.priority, c.metadata_json,
    c.task_version, c.next_eligible_at_ms, c.retry_delay_ms, c.max_attempts,
    c.dead_letter_stage, c.dead_letter_reason, c.created_at_ms, c.updated_at_ms,
    c.checkpoint_json::text, c.fence, c.cancelled_at_ms, c.cancel_reason,
    r.id, r.task_id, r.attempt, r.status, r.agent_id, r.agent_role, r.started_at_ms,
    r.ended_at_ms,
    (
        SELECT jsonb_agg(
            jsonb_build_array(d.depends_on_task_id, coalesce(s.terminal, false))
            ORDER BY d.created_at_ms, d.seq
        )::text
        FROM task_dependencies AS d
        JOIN tasks AS u ON u.id = d.depends_on_task_id
        LEFT JOIN pipeline_stages AS s ON s.pipeline_id = u.pipeline_id AND s.stage = u.stage
        WHERE d.task_id = c.id
    ),
    (
        SELECT jsonb_agg(
            jsonb_build_array(
                a.task_id, a.agent_id, a.assigned_by, a.active, a.created_at_ms, a.updated_at_ms
            )
            ORDER BY a.created_at_ms, a.seq
        )::text
        FROM task_assignments AS a
        WHERE a.task_id = c.id
    ),
    {previous_failures_of_c}
FROM tasks AS c
LEFT JOIN LATERAL (
    SELECT id, task_id, attempt, status, agent_id, agent_role, started_at_ms, ended_at_ms
    FROM runs
    WHERE task_id = c.id
    ORDER BY attempt DESC
    LIMIT 1
) AS r ON true
WHERE c.id = :id;

-- fragment previous_failures_of_c --
-- previous_failures of task c in one value: its last 20 failed or expired runs, newest first,
-- as a JSON array of [attempt, run id, status, error text, ended_at_ms] (NULL when none).
(
    SELECT jsonb_agg(
        jsonb_build_array(p.attempt, p.id, p.status, p.error_text, p.ended_at_ms)
        ORDER BY p.attempt DESC
    )::text
    FROM (
        SELECT attempt, id, status, error_text, ended_at_ms
        FROM runs
        WHERE task_id = c.id AND status IN ('failed', 'stale')
        ORDER BY attempt DESC
        LIMIT 20
    ) AS p
)

-- task_checkpoint --
-- Backend.task_checkpoint, what GET /tasks/{id}/checkpoint reads, in one statement: task_resume's
-- columns and previous_failures as a JSON array (NULL when none).
SELECT c.checkpoint_json::text, c.fence, {previous_failures_of_c}
FROM tasks AS c
WHERE c.id = :id;

-- task_resume --
-- What an agent needs to resume a task: its checkpoint and its current fence.
SELECT checkpoint_json::text, fence FROM tasks WHERE id = :id;

-- bump_fence --
-- A claim raises the task's fence and reads back what the agent needs to resume, in one go.
UPDATE tasks SET fence = fence + 1 WHERE id = :id RETURNING fence, checkpoint_json::text;

-- merge_checkpoint --
-- RFC 7396 merge patch (jsonb_merge_patch, migration 0001), applied in the same statement that
-- reads the old value; the row lock of the UPDATE orders concurrent merges.
UPDATE tasks
SET checkpoint_json = jsonb_merge_patch(coalesce(checkpoint_json, '{}'::jsonb), :patch::jsonb)
WHERE id = :id
RETURNING checkpoint_json::text;

-- leased_in_pipeline_stage --
SELECT count(*)
FROM runs AS r
JOIN tasks AS t ON t.id = r.task_id
WHERE r.status = 'running' AND t.pipeline_id = :pipeline_id AND t.stage = :stage;

-- list_tasks --
-- Keyset pagination: rows strictly after (:after_created, :after_id), in (created_at_ms, id) order.
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE (created_at_ms, id) > (:after_created::bigint, :after_id::text)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_stage --
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE stage = :stage
    AND (created_at_ms, id) > (:after_created::bigint, :after_id::text)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_pipeline --
SELECT
    id, pipeline_id, stage, title, description, priority, metadata_json, task_version,
    next_eligible_at_ms, retry_delay_ms, max_attempts, dead_letter_stage, dead_letter_reason,
    created_at_ms, updated_at_ms
FROM tasks
WHERE pipeline_id = :pipeline_id
    AND (created_at_ms, id) > (:after_created::bigint, :after_id::text)
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
    AND (created_at_ms, id) > (:after_created::bigint, :after_id::text)
ORDER BY created_at_ms, id
LIMIT :limit;

-- list_tasks_by_role --
-- Tasks in the stages a role works on (optionally one stage or pipeline): from the role's few
-- stages to their tasks (idx_tasks_pipeline_stage_page), never through other stages' tasks.
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.description, t.priority, t.metadata_json,
    t.task_version, t.next_eligible_at_ms, t.retry_delay_ms, t.max_attempts,
    t.dead_letter_stage, t.dead_letter_reason, t.created_at_ms, t.updated_at_ms
FROM pipeline_stages AS s
JOIN tasks AS t ON t.pipeline_id = s.pipeline_id AND t.stage = s.stage
WHERE s.agent_role = :agent_role
    AND (:stage::text IS NULL OR s.stage = :stage::text)
    AND (:pipeline_id::text IS NULL OR s.pipeline_id = :pipeline_id::text)
    AND (t.created_at_ms, t.id) > (:after_created::bigint, :after_id::text)
ORDER BY t.created_at_ms, t.id
LIMIT :limit;

-- list_dependencies --
-- resolved: the upstream task sits in a terminal stage of its own pipeline.
SELECT d.depends_on_task_id, coalesce(s.terminal, false)
FROM task_dependencies AS d
JOIN tasks AS u ON u.id = d.depends_on_task_id
LEFT JOIN pipeline_stages AS s ON s.pipeline_id = u.pipeline_id AND s.stage = u.stage
WHERE d.task_id = :task_id
ORDER BY d.created_at_ms, d.seq;

-- list_assignments --
SELECT task_id, agent_id, assigned_by, active, created_at_ms, updated_at_ms
FROM task_assignments
WHERE task_id = :task_id
ORDER BY created_at_ms, seq;

-- expired_leases --
-- Leases past their expiry whose runs are still running: the janitor's work list. Each lease
-- and its task are locked (task first, see the top) for the reaper that read them and skipped
-- by the others, so any number of servers can reap at once without reaping a lease twice; a
-- task a claim or a lease-protected write holds is left to a later pass.
SELECT l.id, l.run_id, r.task_id
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE l.expires_at_ms <= :now
ORDER BY l.expires_at_ms
LIMIT :limit
FOR UPDATE OF t, l SKIP LOCKED;

-- leased_in_stage --
-- Tasks (any pipeline) in a stage of this name that hold a live lease.
SELECT count(*)
FROM runs AS r
JOIN tasks AS t ON t.id = r.task_id
WHERE r.status = 'running' AND t.stage = :stage;

-- fragment run_of_t_running --
-- Task t's running run (it has at most one: runs_one_running_per_task).
SELECT 1 FROM runs AS r WHERE r.task_id = t.id AND r.status = 'running'

-- fragment ready_in_stage --
-- The conditions under which task t of the stage of pipeline_stages s is ready to be claimed,
-- for any agent: not parked, eligible by now, every task it depends on finished, and not
-- running, which best_in_stage and role_stage_rows each add in the form their plan needs
-- (NOT EXISTS ({run_of_t_running})). best_in_stage adds the claiming agent's assignments;
-- role_stage_rows counts them all.
t.pipeline_id = s.pipeline_id
    AND t.stage = s.stage
    AND t.dead_letter_reason IS NULL
    AND t.next_eligible_at_ms <= :now
    AND NOT EXISTS (
        SELECT 1
        FROM task_dependencies AS d
        JOIN tasks AS u ON u.id = d.depends_on_task_id
        LEFT JOIN pipeline_stages AS us
            ON us.pipeline_id = u.pipeline_id AND us.stage = u.stage
        WHERE d.task_id = t.id AND NOT coalesce(us.terminal, false)
    )

-- fragment best_in_stage --
-- The choice of claim_candidate and claim_task in the stage of pipeline_stages s: its best
-- claimable task, locked. Its last condition is the fence the snapshot sees, as the row lock
-- sees it (see claim_candidate). "Not running" is one probe of runs_one_running_per_task for
-- each task walked: OFFSET 0 keeps it a subquery of its own. Left to the planner, it became an
-- anti-join that, planned while runs held few rows, read that whole index for each task: at
-- 64 agents, a claim walking past the running tasks at the head of its stage read thousands
-- of index entries (1,150 buffers a claim against 190 now).
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.description, t.priority, t.metadata_json,
    t.task_version, t.next_eligible_at_ms, t.retry_delay_ms, t.max_attempts,
    t.dead_letter_stage, t.dead_letter_reason, t.created_at_ms, t.updated_at_ms, t.seq
FROM tasks AS t
WHERE {ready_in_stage}
    AND NOT EXISTS ({run_of_t_running} OFFSET 0)
    AND (
        NOT EXISTS (
            SELECT 1 FROM task_assignments AS a
            WHERE a.task_id = t.id AND a.active
        )
        OR EXISTS (
            SELECT 1 FROM task_assignments AS a
            WHERE a.task_id = t.id AND a.active AND a.agent_id = :agent_id
        )
    )
    AND t.fence = (SELECT f.fence FROM tasks AS f WHERE f.id = t.id)
ORDER BY t.priority DESC, t.created_at_ms ASC, t.seq ASC
LIMIT 1
FOR UPDATE OF t SKIP LOCKED

-- claim_candidate --
-- For each (pipeline, stage) the role works on, walk idx_tasks_claim in priority order to the
-- first eligible task that no other transaction holds, and lock it (FOR UPDATE SKIP LOCKED:
-- a task another server is claiming right now is passed over, never waited for); then take
-- the best of those few, ordered as on SQLite (priority, age, pipeline, stage, insertion).
-- Cost depends on the number of stages and of skipped rows, never on finished tasks. Not
-- one-to-one: the runners-up stay locked until this transaction ends, so a concurrent claim
-- passes over them too. Stages at their concurrency limit come as JSONB: :full_stages an array
-- of stage names, :full_pairs an array of [pipeline_id, stage]; NULL when there are none.
-- A task another claim took and committed between this statement's snapshot and its row lock
-- is passed over. PostgreSQL locks the newest version of the row and checks this WHERE again
-- against it, but the NOT EXISTS on runs reads the snapshot, which does not see the new run;
-- the task's fence, raised by every claim in the same transaction as its run, does differ from
-- the fence the snapshot reads in the subquery. Without that condition, one claim in five lost
-- such a race with six claimers at once, and its statement was spent for nothing. Should a
-- task still come back claimed (a fence raised in another way), insert_run returns no row,
-- because of runs_one_running_per_task, and the backend claims again.
SELECT
    c.id, c.pipeline_id, c.stage, c.title, c.description, c.priority, c.metadata_json,
    c.task_version, c.next_eligible_at_ms, c.retry_delay_ms, c.max_attempts,
    c.dead_letter_stage, c.dead_letter_reason, c.created_at_ms, c.updated_at_ms
FROM pipeline_stages AS s
CROSS JOIN LATERAL ({best_in_stage}) AS c
WHERE s.agent_role = :agent_role
    AND (:full_stages::jsonb IS NULL OR NOT (:full_stages::jsonb ? s.stage))
    AND (
        :full_pairs::jsonb IS NULL
        OR NOT (:full_pairs::jsonb @> jsonb_build_array(jsonb_build_array(s.pipeline_id, s.stage)))
    )
ORDER BY c.priority DESC, c.created_at_ms ASC, c.pipeline_id, c.stage, c.seq
LIMIT 1;

-- claim_task --
-- Backend.claim in one statement (its own transaction: see PostgresBackend.ALONE): the choice
-- of claim_candidate (the same walk, locks and order; stages at their cap are counted here,
-- :capped an array of [pipeline_id, stage, cap], NULL when none is capped), then, unless the
-- task's pipeline is not in :known (an array of pipeline ids; NULL: any), the run of
-- insert_run, the fence of bump_fence, the lease of insert_lease (its TTL :ttl_ms, else the
-- one :stage_ttls gives its stage as [pipeline_id, stage, ttl_ms], else :default_ttl_ms) and
-- the task's earlier failures (previous_failures, when this is not its first attempt). The
-- chosen task comes back whether or not it was claimed: attempt NULL means it was not (its
-- pipeline is unknown, or, through runs_one_running_per_task, another server claimed it
-- first; see claim_candidate), and nothing was written. No row: nothing is claimable.
WITH candidate AS (
    SELECT
        c.id, c.pipeline_id, c.stage, c.title, c.description, c.priority, c.metadata_json,
        c.task_version, c.next_eligible_at_ms, c.retry_delay_ms, c.max_attempts,
        c.dead_letter_stage, c.dead_letter_reason, c.created_at_ms, c.updated_at_ms
    FROM pipeline_stages AS s
    CROSS JOIN LATERAL ({best_in_stage}) AS c
    WHERE s.agent_role = :agent_role
        AND {key_exists}
        AND (:full_stages::jsonb IS NULL OR NOT (:full_stages::jsonb ? s.stage))
        AND NOT EXISTS (
            SELECT 1
            FROM jsonb_array_elements(:capped::jsonb) AS k (v)
            WHERE k.v ->> 0 = s.pipeline_id
                AND k.v ->> 1 = s.stage
                AND (
                    SELECT count(*)
                    FROM runs AS r
                    JOIN tasks AS t ON t.id = r.task_id
                    WHERE r.status = 'running'
                        AND t.pipeline_id = s.pipeline_id
                        AND t.stage = s.stage
                ) >= (k.v ->> 2)::bigint
        )
    ORDER BY c.priority DESC, c.created_at_ms ASC, c.pipeline_id, c.stage, c.seq
    LIMIT 1
),
started AS (
    INSERT INTO runs (
        id, task_id, attempt, status, agent_id, agent_role, started_at_ms, usage_json, lease_id
    )
    SELECT
        :run_id,
        c.id,
        (SELECT coalesce(max(r.attempt), 0) + 1 FROM runs AS r WHERE r.task_id = c.id),
        'running',
        :agent_id,
        :agent_role,
        :now,
        '{}',
        :lease_id
    FROM candidate AS c
    WHERE :known::jsonb IS NULL OR :known::jsonb ? c.pipeline_id
    ON CONFLICT DO NOTHING
    RETURNING task_id, attempt
),
fenced AS (
    UPDATE tasks AS t
    SET fence = t.fence + 1
    FROM started AS r
    WHERE t.id = r.task_id
    RETURNING t.fence, t.checkpoint_json::text AS checkpoint_json, t.pipeline_id, t.stage
),
leased AS (
    INSERT INTO leases (
        id, run_id, agent_id, token_hash, expires_at_ms, last_heartbeat_ms, ttl_ms, fence
    )
    SELECT :lease_id, :run_id, :agent_id, :token_hash, :now + x.ttl, :now, x.ttl, f.fence
    FROM fenced AS f
    CROSS JOIN LATERAL (
        SELECT coalesce(
            :ttl_ms::bigint,
            (
                SELECT (e.v ->> 2)::bigint
                FROM jsonb_array_elements(:stage_ttls::jsonb) AS e (v)
                WHERE e.v ->> 0 = f.pipeline_id AND e.v ->> 1 = f.stage
                LIMIT 1
            ),
            :default_ttl_ms::bigint
        ) AS ttl
    ) AS x
    RETURNING expires_at_ms, ttl_ms
)
SELECT
    c.id, c.pipeline_id, c.stage, c.title, c.description, c.priority, c.metadata_json,
    c.task_version, c.next_eligible_at_ms, c.retry_delay_ms, c.max_attempts,
    c.dead_letter_stage, c.dead_letter_reason, c.created_at_ms, c.updated_at_ms,
    r.attempt, f.fence, f.checkpoint_json, l.expires_at_ms, l.ttl_ms,
    CASE WHEN r.attempt > 1 THEN {previous_failures_of_c} END
FROM candidate AS c
LEFT JOIN started AS r ON true
LEFT JOIN fenced AS f ON true
LEFT JOIN leased AS l ON true;

-- insert_run --
-- attempt = 1 + the highest attempt of any earlier run of the task, whatever its stage.
-- Not one-to-one: when the task already has a running run (another server's claim won, see
-- claim_candidate) nothing is inserted and no row comes back, instead of an error that would
-- abort the transaction.
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
ON CONFLICT DO NOTHING
RETURNING attempt;

-- lock_lease_by_run --
-- lease_by_run in a unit of work that writes: the lease row stays locked until it ends, so
-- lease-protected writes on one lease (on any server) run one after the other, each seeing
-- what the one before it left, as under SQLite's single writer. One that waited for a
-- transition or release that deleted the lease finds no lease (404), never a half-ended run.
-- The task row is locked too, and first (see the top): a claim that chose the task waits for
-- nothing this write holds, and this write waits for it before touching the run.
SELECT
    l.id, l.run_id, r.task_id, l.token_hash, l.expires_at_ms, l.ttl_ms, r.status, t.stage,
    t.task_version, t.pipeline_id, l.fence, l.agent_id
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE l.run_id = :run_id
FOR UPDATE OF t, l;

-- lock_lease_by_id --
-- lease_by_id in a unit of work that writes (see lock_lease_by_run).
SELECT
    l.id, l.run_id, r.task_id, l.token_hash, l.expires_at_ms, l.ttl_ms, r.status, t.stage,
    t.task_version, t.pipeline_id, l.fence, l.agent_id
FROM leases AS l
JOIN runs AS r ON r.id = l.run_id
JOIN tasks AS t ON t.id = r.task_id
WHERE l.id = :id
FOR UPDATE OF t, l;

-- insert_event --
-- Not one-to-one: returns the new event's id, which SQLite reads from last_insert_rowid().
INSERT INTO events (run_id, ts_ms, kind, data_json)
VALUES (:run_id, :now, :kind, :data_json)
RETURNING id;

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
    AND (:fence::bigint IS NULL OR l.fence = :fence::bigint)
    AND {key_exists}
LIMIT 1
-- Not one-to-one: the lease row is share-locked, so a transition or release of the run in
-- progress elsewhere finishes first (and this insert then finds no lease), as on SQLite.
FOR SHARE OF l
RETURNING id;

-- extend_held_lease --
-- A heartbeat: the lease extended only if it is held with this token, is live and (when one is
-- given) still has this fence, by :ttl_ms (NULL: its own TTL, else :default_ttl_ms), which
-- becomes its TTL; the check and the write in one statement (its own transaction: see
-- PostgresBackend.ALONE). No row back means one of those failed; the caller then finds out
-- which. Not one-to-one: it locks the lease row alone, not its task's first (see the top); it
-- holds no other lock, so it waits for whoever holds the lease and no one waits for it while
-- it does. A lease deleted meanwhile (a transition, the reaper) is found gone.
UPDATE leases
SET expires_at_ms = :now + coalesce(:ttl_ms::bigint, nullif(ttl_ms, 0), :default_ttl_ms::bigint),
    last_heartbeat_ms = :now,
    ttl_ms = coalesce(:ttl_ms::bigint, nullif(ttl_ms, 0), :default_ttl_ms::bigint)
WHERE id = :id
    AND token_hash = :token_hash
    AND expires_at_ms > :now
    AND (:fence::bigint IS NULL OR fence = :fence::bigint)
    AND {key_exists}
RETURNING expires_at_ms;

-- transition_run --
-- Backend.transition_run in one statement (its own transaction: see PostgresBackend.ALONE):
-- the lease of lock_lease_by_run (task and lease locked, task first), only if it is held with
-- :token_hash, live, with :fence and :expected_stage and :expected_task_version when given,
-- and its run running; the move :moves gives its (pipeline, stage), an array of
-- [pipeline_id, from_stage, to_stage, event data, frees_capacity]; then end_run, move_task,
-- delete_lease and insert_event of the transition, each on what the one before it changed (none
-- can miss under those locks: nothing ends a run or moves a task without its task's lock), and
-- the wake-ups of notify (the same channel and lines): the role of the old stage when its policy
-- caps its leases (capacity freed; a NOTIFY serialises the commits that send one, so none is
-- sent that nobody waits for), the new one (new work), and, when the new one is terminal, the
-- stages of the tasks that depend on it; a payload too long for pg_notify wakes every role
-- ("*"). No row: nothing was changed (the caller finds out why).
WITH held AS (
    SELECT l.id, l.run_id, r.task_id, t.stage, t.task_version, t.pipeline_id
    {held_lease}
        AND (:expected_stage::text IS NULL OR t.stage = :expected_stage::text)
        AND (
            :expected_task_version::bigint IS NULL
            OR t.task_version = :expected_task_version::bigint
        )
    FOR UPDATE OF t, l
),
chosen AS (
    SELECT
        h.id, h.run_id, h.task_id, h.stage, h.task_version, h.pipeline_id,
        m.v ->> 2 AS to_stage, m.v ->> 3 AS data_json,
        coalesce((m.v ->> 4)::boolean, false) AS frees_capacity
    FROM held AS h
    CROSS JOIN LATERAL (
        SELECT e.v
        FROM jsonb_array_elements(:moves::jsonb) AS e (v)
        WHERE e.v ->> 0 = h.pipeline_id AND e.v ->> 1 = h.stage
        LIMIT 1
    ) AS m
),
ended AS (
    UPDATE runs AS r
    SET status = 'completed', ended_at_ms = :now, usage_json = :usage_json, error_text = NULL
    FROM chosen AS c
    WHERE r.id = c.run_id AND r.status = 'running'
    RETURNING r.id
),
moved AS (
    UPDATE tasks AS t
    SET stage = c.to_stage,
        task_version = t.task_version + 1,
        dead_letter_reason = NULL,
        next_eligible_at_ms = 0,
        failed_at_ms = NULL,
        last_error = NULL,
        updated_at_ms = :now
    FROM chosen AS c
    JOIN ended AS e ON e.id = c.run_id
    WHERE t.id = c.task_id AND t.task_version = c.task_version
    RETURNING t.id
),
done AS (
    SELECT
        c.id, c.run_id, c.task_id, c.stage, c.pipeline_id, c.to_stage, c.data_json,
        c.frees_capacity
    FROM chosen AS c
    JOIN moved AS d ON d.id = c.task_id
),
gone AS (
    DELETE FROM leases AS l
    USING done AS d
    WHERE l.id = d.id
    RETURNING l.id
),
recorded AS (
    INSERT INTO events (run_id, ts_ms, kind, data_json)
    SELECT d.run_id, :now, 'transition', d.data_json
    FROM done AS d
    RETURNING id
),
woken AS (
    SELECT s.agent_role AS role, count(*) AS n
    FROM (
        SELECT d.pipeline_id, d.stage FROM done AS d WHERE d.frees_capacity
        UNION ALL
        SELECT d.pipeline_id, d.to_stage FROM done AS d
        UNION ALL
        SELECT t.pipeline_id, t.stage
        FROM done AS d
        JOIN pipeline_stages AS ds
            ON ds.pipeline_id = d.pipeline_id AND ds.stage = d.to_stage AND ds.terminal
        JOIN task_dependencies AS dep ON dep.depends_on_task_id = d.task_id
        JOIN tasks AS t ON t.id = dep.task_id
    ) AS w (pipeline_id, stage)
    JOIN pipeline_stages AS s ON s.pipeline_id = w.pipeline_id AND s.stage = w.stage
    WHERE s.agent_role IS NOT NULL
    GROUP BY s.agent_role
),
payload AS (
    SELECT string_agg(
        w.role || E'\t0' || CASE WHEN w.n > 1 THEN ';' || w.n ELSE '' END, E'\n' ORDER BY w.role
    ) AS lines
    FROM woken AS w
)
SELECT
    d.pipeline_id, d.task_id, d.stage, d.to_stage,
    (SELECT count(*) FROM gone) + (SELECT count(*) FROM recorded),
    (
        SELECT count(*)
        FROM (
            SELECT pg_notify(
                'nulltickets_claimable',
                CASE WHEN octet_length(p.lines) <= 7000 THEN p.lines ELSE E'*\t0' END
            )
            FROM payload AS p
            WHERE p.lines IS NOT NULL
        ) AS sent
    )
FROM done AS d;

-- checkpoint_run --
-- Backend.checkpoint_run in one statement (its own transaction: see PostgresBackend.ALONE):
-- the lease of lock_lease_by_run (task and lease locked, task first), only if it is held with
-- :token_hash, live and with :fence when given; then merge_checkpoint on its task, extend_lease
-- by its TTL (else :default_ttl_ms) and insert_event of the patch, each on the locked rows (none
-- can miss). No row: nothing was changed (the caller finds out why).
WITH held AS (
    SELECT l.id, l.run_id, r.task_id, l.fence
    {held_lease}
    FOR UPDATE OF t, l
),
merged AS (
    UPDATE tasks AS t
    SET checkpoint_json = jsonb_merge_patch(coalesce(t.checkpoint_json, '{}'::jsonb), :patch::jsonb)
    FROM held AS h
    WHERE t.id = h.task_id
    RETURNING t.checkpoint_json::text AS checkpoint
),
extended AS (
    UPDATE leases AS l
    SET expires_at_ms = :now + coalesce(nullif(l.ttl_ms, 0), :default_ttl_ms::bigint),
        last_heartbeat_ms = :now,
        ttl_ms = coalesce(nullif(l.ttl_ms, 0), :default_ttl_ms::bigint)
    FROM held AS h
    WHERE l.id = h.id
    RETURNING l.expires_at_ms
),
recorded AS (
    INSERT INTO events (run_id, ts_ms, kind, data_json)
    SELECT h.run_id, :now, 'checkpoint', :patch
    FROM held AS h
    RETURNING id
)
SELECT m.checkpoint, e.expires_at_ms, h.fence
FROM held AS h
CROSS JOIN merged AS m
CROSS JOIN extended AS e
WHERE (SELECT count(*) FROM recorded) = 1;

-- fragment failed_attempt --
-- The rest of fail_run and expire_lease, after their CTE `held` (the lease to end, its run and
-- task locked, task first: id, run_id, task_id, stage, pipeline_id, max_attempts,
-- retry_delay_ms, retry_delay_set, dead_letter_stage, failures_forgiven): the policy of the
-- task's (pipeline, stage) from :policies, an array of [pipeline_id, stage, retry_delay_ms,
-- retry_backoff, retry_max_delay_ms, retry_jitter] of the stages that have one (else none);
-- then end_run (:run_status, with :usage_json and :error), delete_lease, and what
-- core.decide_failure decides, on failed_attempts (this run counted: the snapshot still sees it
-- running): the task past its allowed attempts (none when :retryable is false)
-- dead_letter_task into its dead-letter stage when that is a stage of its pipeline (else where
-- it is), otherwise schedule_retry after core.retry_delay (its own delay, else the stage's,
-- else the default backoff of core.default_retry_delay: the same double precision arithmetic,
-- :rand placing it in the jitter), and insert_event of the dead_letter or retry_scheduled
-- event, after the lease_expired event when the run ends stale (expiry), each on the locked
-- rows (none can miss). The wake-ups of Leases._after_failure go with it (the notify channel
-- and lines): the stage the task was in (capacity freed), then the dead-letter stage and, when
-- it is terminal, the stages of the tasks that depend on it, or the stage again at the
-- retry's time. A row for each attempt ended: pipeline_id, task_id, stage, failed_attempts,
-- dead, dead_letter_stage, next_eligible_at_ms, and counts that make PostgreSQL run every part.
policy AS (
    SELECT
        h.*,
        (
            SELECT count(*)
            FROM runs AS f
            WHERE f.task_id = h.task_id AND f.status IN ('failed', 'stale')
        ) + 1 - h.failures_forgiven AS failed,
        CASE WHEN :retryable::boolean IS FALSE THEN 0 ELSE h.max_attempts END AS allowed,
        CASE
            WHEN h.retry_delay_ms <> 0 OR h.retry_delay_set THEN h.retry_delay_ms
            ELSE (p.v ->> 2)::bigint
        END AS base,
        (p.v ->> 3)::float8 AS backoff,
        (p.v ->> 4)::bigint AS max_delay_ms,
        (p.v ->> 5)::float8 AS jitter,
        (
            SELECT s.stage
            FROM pipeline_stages AS s
            WHERE s.pipeline_id = h.pipeline_id AND s.stage = h.dead_letter_stage
        ) AS target
    FROM held AS h
    -- A stage without a policy of its own: fsm.NO_POLICY's.
    CROSS JOIN LATERAL (
        SELECT coalesce(
            (
                SELECT e.v
                FROM jsonb_array_elements(:policies::jsonb) AS e (v)
                WHERE e.v ->> 0 = h.pipeline_id AND e.v ->> 1 = h.stage
                LIMIT 1
            ),
            '[null, null, null, 1.0, null, 0.0]'::jsonb
        ) AS v
    ) AS p
),
-- core.retry_delay's arguments: (base, backoff, cap, jitter, the failure's number), the
-- default backoff's when neither the task nor the stage sets a delay (then NULL after the
-- immediate retries: no delay).
retry AS (
    SELECT
        c.*,
        c.allowed IS NOT NULL AND c.failed >= c.allowed AS dead,
        CASE WHEN c.base IS NULL THEN 1000 ELSE c.base END AS r_base,
        CASE WHEN c.base IS NULL THEN 2.0::float8 ELSE c.backoff END AS r_backoff,
        CASE WHEN c.base IS NULL THEN 300000 ELSE c.max_delay_ms END AS r_max,
        CASE WHEN c.base IS NULL THEN 0.2::float8 ELSE c.jitter END AS r_jitter,
        CASE WHEN c.base IS NULL THEN c.failed - 2 ELSE c.failed END AS r_n
    FROM policy AS c
),
grown AS (
    SELECT
        r.*,
        r.r_base::float8 * power(r.r_backoff, least(greatest(r.r_n - 1, 0), 64)::float8)
        * (1.0::float8 + r.r_jitter * (2.0::float8 * :rand::float8 - 1.0::float8)) AS g
    FROM retry AS r
),
delayed AS (
    SELECT
        g.*,
        CASE
            WHEN g.base IS NULL AND g.failed <= 2 THEN 0
            ELSE least(
                CASE
                    WHEN g.r_backoff = 1.0 AND g.r_jitter = 0.0 THEN g.r_base
                    WHEN least(g.g, 9.3e18::float8) >= 9223372036854775807::float8
                        THEN 9223372036854775807
                    ELSE trunc(least(g.g, 9.3e18::float8))::bigint
                END,
                g.r_max
            )
        END AS delay
    FROM grown AS g
),
decided AS (
    SELECT
        d.*,
        CASE
            WHEN d.dead THEN :parked_at::bigint
            ELSE greatest(0, least(:now::numeric + d.delay, 9223372036854775807))::bigint
        END AS at,
        CASE WHEN :retryable::boolean IS FALSE THEN 'not_retryable'
            ELSE 'max_attempts_exceeded' END AS reason
    FROM delayed AS d
),
ended AS (
    UPDATE runs AS r
    SET status = :run_status, ended_at_ms = :now, usage_json = :usage_json, error_text = :error
    FROM decided AS d
    WHERE r.id = d.run_id AND r.status = 'running'
    RETURNING r.id
),
changed AS (
    UPDATE tasks AS t
    SET stage = CASE WHEN d.dead THEN coalesce(d.target, t.stage) ELSE t.stage END,
        task_version = t.task_version + CASE WHEN d.dead AND d.target IS NOT NULL THEN 1 ELSE 0 END,
        dead_letter_reason = CASE WHEN d.dead THEN d.reason ELSE t.dead_letter_reason END,
        next_eligible_at_ms = d.at,
        failed_at_ms = :now,
        last_error = :error,
        updated_at_ms = :now
    FROM decided AS d
    JOIN ended AS e ON e.id = d.run_id
    WHERE t.id = d.task_id
    RETURNING t.id
),
done AS (
    SELECT d.*
    FROM decided AS d
    JOIN changed AS c ON c.id = d.task_id
),
gone AS (
    DELETE FROM leases AS l
    USING done AS d
    WHERE l.id = d.id
    RETURNING l.id
),
recorded AS (
    INSERT INTO events (run_id, ts_ms, kind, data_json)
    SELECT e.run_id, :now, e.kind, e.data_json
    FROM (
        SELECT
            d.run_id,
            0 AS n,
            'lease_expired' AS kind,
            '{"reason":"lease_expired","lease_id":' || to_json(d.id)::text
            || ',"failed_attempts":' || d.failed || '}' AS data_json
        FROM done AS d
        WHERE :run_status::text = 'stale'
        UNION ALL
        SELECT
            d.run_id,
            1,
            CASE WHEN d.dead THEN 'dead_letter' ELSE 'retry_scheduled' END,
            CASE
                WHEN d.dead THEN
                    '{"reason":' || to_json(d.reason)::text
                    || ',"failed_attempts":' || d.failed
                    || ',"from_stage":' || to_json(d.stage)::text
                    || ',"dead_letter_stage":' || coalesce(to_json(d.target)::text, 'null') || '}'
                ELSE
                    '{"reason":"retry_scheduled","failed_attempts":' || d.failed
                    || ',"retry_delay_ms":' || d.delay
                    || ',"next_eligible_at_ms":' || d.at || '}'
            END
        FROM done AS d
    ) AS e
    ORDER BY e.run_id, e.n
    RETURNING id
),
woken AS (
    SELECT s.agent_role AS role, w.at, count(*) AS n
    FROM (
        SELECT d.pipeline_id, d.stage, 0::bigint FROM done AS d
        UNION ALL
        SELECT d.pipeline_id, d.stage, d.at FROM done AS d WHERE NOT d.dead
        UNION ALL
        SELECT d.pipeline_id, d.target, 0::bigint FROM done AS d WHERE d.dead
        UNION ALL
        SELECT t.pipeline_id, t.stage, 0::bigint
        FROM done AS d
        JOIN pipeline_stages AS ds
            ON ds.pipeline_id = d.pipeline_id AND ds.stage = d.target AND ds.terminal
        JOIN task_dependencies AS dep ON dep.depends_on_task_id = d.task_id
        JOIN tasks AS t ON t.id = dep.task_id
        WHERE d.dead
    ) AS w (pipeline_id, stage, at)
    JOIN pipeline_stages AS s ON s.pipeline_id = w.pipeline_id AND s.stage = w.stage
    WHERE s.agent_role IS NOT NULL
    GROUP BY s.agent_role, w.at
),
payload AS (
    SELECT string_agg(
        w.role || E'\t' || w.at || CASE WHEN w.n > 1 THEN ';' || w.n ELSE '' END,
        E'\n' ORDER BY w.role, w.at
    ) AS lines
    FROM woken AS w
)
SELECT
    d.pipeline_id, d.task_id, d.stage, d.failed, d.dead, CASE WHEN d.dead THEN d.target END, d.at,
    (SELECT count(*) FROM gone) + (SELECT count(*) FROM recorded),
    (
        SELECT count(*)
        FROM (
            SELECT pg_notify(
                'nulltickets_claimable',
                CASE WHEN octet_length(p.lines) <= 7000 THEN p.lines ELSE E'*\t0' END
            )
            FROM payload AS p
            WHERE p.lines IS NOT NULL
        ) AS sent
    )
FROM done AS d;

-- fail_run --
-- Backend.fail_run in one statement (its own transaction: see PostgresBackend.ALONE): the lease
-- of lock_lease_by_run (task and lease locked, task first), only if it is held with
-- :token_hash, live, with :fence when given, and its run running, and only if there are
-- :known_pipelines pipelines (the caller read them all) and the task's is not one of
-- :unreadable (an array of those whose definition could not be parsed); then what the fragment
-- failed_attempt does, the run ended failed. No row: nothing was changed (the caller finds out
-- why).
WITH held AS (
    SELECT
        l.id, l.run_id, r.task_id, t.stage, t.pipeline_id, t.max_attempts, t.retry_delay_ms,
        t.retry_delay_set, t.dead_letter_stage, t.failures_forgiven
    {held_lease}
        AND (SELECT count(*) FROM pipelines) = :known_pipelines::bigint
        AND NOT :unreadable::jsonb ? t.pipeline_id
    FOR UPDATE OF t, l
),
{failed_attempt}

-- expire_lease --
-- Backend.expire_lease in one statement, in the reaper's unit of work after expired_leases
-- locked the lease and its task: lease :lease_id, only if it is past its time at :now and its
-- run running, and only if there are :known_pipelines pipelines and the task's is not one of
-- :unreadable (as fail_run); then what the fragment failed_attempt does, the run ended stale
-- (:run_status; :usage_json '{}' and :error 'lease_expired', as the reaper step by step) and
-- its lease_expired event recorded first. No row: nothing was changed (the reaper then goes
-- step by step).
WITH held AS (
    SELECT
        l.id, l.run_id, r.task_id, t.stage, t.pipeline_id, t.max_attempts, t.retry_delay_ms,
        t.retry_delay_set, t.dead_letter_stage, t.failures_forgiven
    FROM leases AS l
    JOIN runs AS r ON r.id = l.run_id
    JOIN tasks AS t ON t.id = r.task_id
    WHERE l.id = :lease_id
        AND l.expires_at_ms <= :now
        AND (SELECT count(*) FROM pipelines) = :known_pipelines::bigint
        AND NOT :unreadable::jsonb ? t.pipeline_id
    FOR UPDATE OF t, l
),
{failed_attempt}

-- fragment release_held --
-- The rest of release_run and release_agent, after their CTE `held` (each lease to release,
-- its run and task locked, task first: id, run_id, agent_id, expires_at_ms, task_id, stage,
-- pipeline_id): for each, end_run (released, :reason its error text), delete_lease and
-- insert_event of the `released` event (:reason_json, the reason as JSON, and the lease's
-- agent), each on the locked rows (none can miss), and once for each stage the wake-up of its
-- roles (notify's channel and line): the tasks are claimable again. A row for each lease
-- released, in order of expiry: run_id, pipeline_id, task_id, stage, and a count that makes
-- PostgreSQL run every part.
ended AS (
    UPDATE runs AS r
    SET status = 'released', ended_at_ms = :now, usage_json = '{}', error_text = :reason
    FROM held AS h
    WHERE r.id = h.run_id AND r.status = 'running'
    RETURNING r.id
),
done AS (
    SELECT h.*
    FROM held AS h
    JOIN ended AS e ON e.id = h.run_id
),
gone AS (
    DELETE FROM leases AS l
    USING done AS d
    WHERE l.id = d.id
    RETURNING l.id
),
recorded AS (
    INSERT INTO events (run_id, ts_ms, kind, data_json)
    SELECT
        d.run_id,
        :now,
        'released',
        '{"reason":' || :reason_json::text || ',"agent_id":' || to_json(d.agent_id)::text || '}'
    FROM done AS d
    ORDER BY d.expires_at_ms, d.run_id
    RETURNING id
),
woken AS (
    SELECT count(*) AS sent
    FROM (
        SELECT pg_notify('nulltickets_claimable', s.agent_role || E'\t0')
        FROM pipeline_stages AS s
        JOIN (SELECT DISTINCT pipeline_id, stage FROM done) AS d
            ON s.pipeline_id = d.pipeline_id AND s.stage = d.stage
        WHERE s.agent_role IS NOT NULL
    ) AS n
)
SELECT
    d.run_id, d.pipeline_id, d.task_id, d.stage,
    (SELECT count(*) FROM gone) + (SELECT count(*) FROM recorded) + (SELECT sent FROM woken)
FROM done AS d
ORDER BY d.expires_at_ms, d.run_id

-- release_run --
-- Backend.release_run in one statement (its own transaction: see PostgresBackend.ALONE): the
-- lease of lock_lease_by_run (task and lease locked, task first), only if it is held with
-- :token_hash, live, with :fence when given, and its run running; then release_held. No row:
-- nothing was changed (the caller finds out why).
WITH held AS (
    SELECT l.id, l.run_id, l.agent_id, l.expires_at_ms, r.task_id, t.stage, t.pipeline_id
    {held_lease}
    FOR UPDATE OF t, l
),
{release_held};

-- release_agent --
-- Backend.release_agent in one statement (its own transaction: see PostgresBackend.ALONE): each
-- live lease of :agent_id whose run is running, locked with its task (task first), then
-- release_held: a row for each, in order of expiry; none when the agent holds no live lease,
-- or the key (:key_id) is gone.
WITH held AS (
    SELECT l.id, l.run_id, l.agent_id, l.expires_at_ms, r.task_id, t.stage, t.pipeline_id
    FROM leases AS l
    JOIN runs AS r ON r.id = l.run_id
    JOIN tasks AS t ON t.id = r.task_id
    WHERE l.agent_id = :agent_id
        AND l.expires_at_ms > :now
        AND {key_exists}
        AND r.status = 'running'
    FOR UPDATE OF t, l
),
{release_held};

-- live_lease_of_task --
-- The lease of the task's running run, if any (at most one: runs_one_running_per_task).
-- Not one-to-one: the task and the lease are locked (task first, see the top), as by
-- lock_lease_by_*: the cancel that reads it ends that run and deletes that lease. A lease
-- ended meanwhile by its holder is waited for and then not found.
SELECT l.id, l.run_id, l.expires_at_ms
FROM tasks AS t
JOIN runs AS r ON r.task_id = t.id
JOIN leases AS l ON l.run_id = r.id
WHERE t.id = :task_id AND r.status = 'running'
LIMIT 1
FOR UPDATE OF t, l;

-- insert_task_event --
-- Not one-to-one: returns the new event's id, which SQLite reads from last_insert_rowid().
INSERT INTO task_events (task_id, ts_ms, kind, data_json)
VALUES (:task_id, :now, :kind, :data_json)
RETURNING id;

-- list_artifacts --
SELECT id, task_id, run_id, created_at_ms, kind, uri, sha256_hex, size_bytes, meta_json
FROM artifacts
WHERE (created_at_ms, id) > (:after_created::bigint, :after_id::text)
    AND (:task_id::text IS NULL OR task_id = :task_id::text)
    AND (:run_id::text IS NULL OR run_id = :run_id::text)
ORDER BY created_at_ms, id
LIMIT :limit;

-- put_idempotency --
INSERT INTO idempotency_keys (
    key, method, path, request_hash, auth_hash, response_status, response_body, created_at_ms
)
VALUES (:key, :method, :path, :request_hash, :auth_hash, :status, :body, :now)
ON CONFLICT (key, method, path) DO UPDATE
SET request_hash = excluded.request_hash,
    auth_hash = excluded.auth_hash,
    response_status = excluded.response_status,
    response_body = excluded.response_body,
    created_at_ms = excluded.created_at_ms;

-- get_value --
SELECT namespace, key, value_json::text, created_at_ms, updated_at_ms
FROM store
WHERE namespace = :namespace AND key = :key;

-- list_namespace --
SELECT namespace, key, value_json::text, created_at_ms, updated_at_ms
FROM store
WHERE namespace = :namespace
ORDER BY key;

-- search_store --
-- :query is the same sanitised text as on SQLite (every term a quoted phrase); store_query
-- (migration 0001) reads it as FTS5 does: every term must match, a term of several words as a
-- phrase, words split at punctuation as in the document (store_words). score is minus ts_rank, so that, as with bm25 on SQLite, lower is better. The
-- snippet comes from the first of value, key and namespace that matches (FTS5 picks the best
-- column), words of the query in [brackets] (ts_headline reads the text with PostgreSQL's own
-- parser, which keeps a path, file name or e-mail address as one word: such a match is found
-- and ranked, but its snippet has no brackets; FTS5 would bracket the part). With :filter_path (an SQL/JSON path such as
-- $.status, read in strict mode so that arrays are not unwrapped, as SQLite does not), keep
-- rows whose value at that path has the text form :filter_value (strings as themselves,
-- anything else as its JSON text); without :filter_value, rows where the path exists. Where
-- the text forms differ from SQLite's: numbers keep the digits they were written with
-- (1e3 is 1000, SQLite says 1000.0) and objects and arrays come in PostgreSQL's JSON text
-- ({"a": 1}, SQLite {"a":1}). A path that is not valid SQL/JSON fails the statement with a
-- syntax error, which the backend reports as invalid_query.
SELECT
    s.namespace, s.key, s.value_json::text, s.created_at_ms, s.updated_at_ms,
    -ts_rank(s.search, q.query) AS score,
    ts_headline(
        'simple',
        CASE
            WHEN store_words(s.value_json::text) @@ q.query THEN s.value_json::text
            WHEN store_words(s.key) @@ q.query THEN s.key
            WHEN store_words(s.namespace) @@ q.query THEN s.namespace
            ELSE s.value_json::text
        END,
        q.query,
        'StartSel=[, StopSel=], MaxWords=16, MinWords=8, ShortWord=0'
    ) AS snippet
FROM store_query(:query) AS q (query)
JOIN store AS s ON s.search @@ q.query
CROSS JOIN LATERAL (
    SELECT jsonb_path_query_first(
        s.value_json::jsonb, ('strict ' || :filter_path::text)::jsonpath, '{}'::jsonb, true
    ) AS value
) AS f
WHERE (:namespace::text IS NULL OR s.namespace = :namespace::text)
    AND (
        :filter_path::text IS NULL
        OR (:filter_value::text IS NULL AND f.value IS NOT NULL)
        OR (
            CASE jsonb_typeof(f.value)
                WHEN 'string' THEN f.value #>> '{}'
                ELSE f.value::text
            END = :filter_value::text
        )
    )
ORDER BY score, s.namespace, s.key
LIMIT :limit;

-- fragment role_stage_rows --
-- One row per (pipeline, stage) that names a role, with the counts /ops/queue sums per role.
-- Not one-to-one in shape: the claimable count and the oldest claimable task's created_at_ms
-- come as two columns (SQLite packs them into one JSON array to get both from one walk of its
-- index; a LATERAL subquery does that here): (role, claimable, oldest, failed, stuck, near),
-- then the stage's pipeline_id and stage.
-- Nor in cost: PostgreSQL has no INDEXED BY, and takes each stage for an equal share of all
-- tasks. The claimable count walks the stage's tasks in the order of
-- idx_tasks_pipeline_stage_page, which its planner then prefers to a scan of every task; the
-- failed count joins them to idx_runs_failed (migration 0007), which holds only the failed and
-- expired runs, never all of them.
SELECT
    s.agent_role,
    c.claimable,
    c.oldest,
    (
        SELECT count(*)
        FROM tasks AS t
        JOIN runs AS r ON r.task_id = t.id
        WHERE t.pipeline_id = s.pipeline_id AND t.stage = s.stage
            AND r.status IN ('failed', 'stale')
    ) AS failed_count,
    (
        SELECT count(*)
        FROM runs AS r
        JOIN tasks AS t ON t.id = r.task_id
        WHERE r.status = 'running' AND r.started_at_ms <= :stuck_before
            AND t.pipeline_id = s.pipeline_id AND t.stage = s.stage
    ) AS stuck_count,
    (
        SELECT count(*)
        FROM leases AS l
        JOIN runs AS r ON r.id = l.run_id
        JOIN tasks AS t ON t.id = r.task_id
        WHERE l.expires_at_ms > :now AND l.expires_at_ms <= :near_expiry_before
            AND t.pipeline_id = s.pipeline_id AND t.stage = s.stage
    ) AS near_expiry_leases,
    s.pipeline_id,
    s.stage
FROM pipeline_stages AS s
CROSS JOIN LATERAL (
    SELECT count(*) AS claimable, min(t.created_at_ms) AS oldest
    FROM (
        -- The stage's tasks in the order of idx_tasks_pipeline_stage_page, planned apart
        -- (OFFSET 0) from the conditions below: PostgreSQL cannot know how many tasks a stage
        -- named by a row of s holds, and with the conditions folded in it chose a scan of
        -- every task once per stage; this is an index walk.
        SELECT t.id, t.pipeline_id, t.stage, t.dead_letter_reason, t.next_eligible_at_ms,
            t.created_at_ms
        FROM tasks AS t
        WHERE t.pipeline_id = s.pipeline_id AND t.stage = s.stage
        ORDER BY t.pipeline_id, t.stage, t.created_at_ms, t.id
        OFFSET 0
    ) AS t
    WHERE {ready_in_stage}
        AND NOT EXISTS ({run_of_t_running})  -- left to the planner: a hash anti-join, for all
) AS c
WHERE s.agent_role IS NOT NULL

-- role_stage_queue --
-- The rows of role_stage_rows, in order of pipeline and stage.
{role_stage_rows}
ORDER BY s.pipeline_id, s.stage;

-- queue_counts --
-- Backend.queue_counts in one statement (one round trip): the dead-lettered and cancelled
-- tasks of parked_totals, then the rows of role_stage_queue as one JSON array of arrays, in
-- the same order ([] when no stage names a role).
SELECT
    count(*) FILTER (WHERE p.cancelled_at_ms IS NULL),
    count(*) FILTER (WHERE p.cancelled_at_ms IS NOT NULL),
    (
        SELECT coalesce(
            json_agg(
                json_build_array(q.agent_role, q.claimable, q.oldest, q.failed_count,
                    q.stuck_count, q.near_expiry_leases)
                ORDER BY q.pipeline_id, q.stage
            ),
            '[]'
        )::text
        FROM (
            {role_stage_rows}
        ) AS q
    )
FROM tasks AS p
WHERE p.dead_letter_reason IS NOT NULL;

-- health_counts --
-- Backend.health_counts in one statement (one round trip): the rows of tasks_by_stage as one
-- JSON array of [stage, count], in the same order, and active_leases.
SELECT
    (
        SELECT coalesce(json_agg(json_build_array(s.stage, s.n) ORDER BY s.stage), '[]')::text
        FROM (SELECT stage, count(*) AS n FROM tasks GROUP BY stage) AS s
    ),
    (SELECT count(*) FROM leases WHERE expires_at_ms > :now);

-- insert_otlp_batch --
-- Not one-to-one: returns the new batch's id, which SQLite reads from last_insert_rowid().
INSERT INTO otlp_batches (received_at_ms, content_type, payload_json, payload_blob, parsed_spans)
VALUES (:now, :content_type, :payload_json, :payload_blob, :parsed_spans)
RETURNING id;

-- stage_board --
-- Per (pipeline, stage) that names a role, where its tasks stand: (pipeline_id, stage, role,
-- then claimable, oldest claimable created_at_ms, leased, waiting on a retry
-- delay, blocked by dependencies, dead-lettered, cancelled), as columns. One walk of the stage's own
-- tasks through its index: tasks that finished have left the stages with roles. Then, with no
-- role, each other stage that holds dead-lettered or cancelled tasks (a dead-letter stage):
-- counted where they landed, from their own partial index. Stages with a role come first.
SELECT
    s.pipeline_id, s.stage, s.agent_role,
    c.claimable, c.oldest, c.leased, c.delayed, c.blocked, c.dead, c.cancelled
FROM pipeline_stages AS s
CROSS JOIN LATERAL (
    SELECT
        count(*) FILTER (WHERE NOT x.dead AND NOT x.leased AND NOT x.delayed AND NOT x.blocked) AS claimable,
        min(x.created_at_ms) FILTER (WHERE NOT x.dead AND NOT x.leased AND NOT x.delayed AND NOT x.blocked) AS oldest,
        count(*) FILTER (WHERE x.leased) AS leased,
        count(*) FILTER (WHERE NOT x.dead AND NOT x.leased AND x.delayed) AS delayed,
        count(*) FILTER (
            WHERE NOT x.dead AND NOT x.leased AND NOT x.delayed AND x.blocked
        ) AS blocked,
        count(*) FILTER (WHERE x.dead AND NOT x.cancelled) AS dead,
        count(*) FILTER (WHERE x.cancelled) AS cancelled
    FROM (
        SELECT
            t.created_at_ms,
            t.dead_letter_reason IS NOT NULL AS dead,
            t.cancelled_at_ms IS NOT NULL AS cancelled,
            t.next_eligible_at_ms > :now AS delayed,
            EXISTS (SELECT 1 FROM runs AS r WHERE r.task_id = t.id AND r.status = 'running') AS leased,
            EXISTS (SELECT 1 FROM task_dependencies AS d JOIN tasks AS u ON u.id = d.depends_on_task_id LEFT JOIN pipeline_stages AS us ON us.pipeline_id = u.pipeline_id AND us.stage = u.stage WHERE d.task_id = t.id AND NOT coalesce(us.terminal, false)) AS blocked
        FROM tasks AS t
        WHERE t.pipeline_id = s.pipeline_id AND t.stage = s.stage
        -- The order of idx_tasks_pipeline_stage_page: PostgreSQL cannot know how many tasks
        -- a stage named by a row of s holds, and takes each stage for an equal share of all
        -- tasks. With few stages that share is large, and it scanned the whole table once
        -- per stage (63 ms at 300,000 finished tasks); read in the index's order, 1 ms.
        ORDER BY t.pipeline_id, t.stage, t.created_at_ms, t.id
    ) AS x
) AS c
WHERE s.agent_role IS NOT NULL
UNION ALL
SELECT
    p.pipeline_id, p.stage, NULL, 0, NULL, 0, 0, 0,
    count(*) FILTER (WHERE p.cancelled_at_ms IS NULL),
    count(*) FILTER (WHERE p.cancelled_at_ms IS NOT NULL)
FROM tasks AS p
LEFT JOIN pipeline_stages AS ps ON ps.pipeline_id = p.pipeline_id AND ps.stage = p.stage
WHERE p.dead_letter_reason IS NOT NULL AND ps.agent_role IS NULL
GROUP BY p.pipeline_id, p.stage
ORDER BY agent_role NULLS LAST, pipeline_id, stage;

-- parked_totals --
-- How many tasks are dead-lettered and how many cancelled, in every pipeline and stage: a walk
-- of their own partial index (GET /ops/queue).
SELECT
    count(*) FILTER (WHERE cancelled_at_ms IS NULL),
    count(*) FILTER (WHERE cancelled_at_ms IS NOT NULL)
FROM tasks
WHERE dead_letter_reason IS NOT NULL;

-- list_tasks_matching --
-- GET /tasks?q=: tasks whose title or id holds :q (any case), with the other filters
-- optional, in page order. A walk of idx_tasks_page that stops after :limit matches: a rare
-- text walks far, so this is the dashboard's filter, not an agent's query.
SELECT
    t.id, t.pipeline_id, t.stage, t.title, t.description, t.priority, t.metadata_json,
    t.task_version, t.next_eligible_at_ms, t.retry_delay_ms, t.max_attempts,
    t.dead_letter_stage, t.dead_letter_reason, t.created_at_ms, t.updated_at_ms
FROM tasks AS t
WHERE (t.created_at_ms, t.id) > (:after_created::bigint, :after_id::text)
    AND (:stage::text IS NULL OR t.stage = :stage::text)
    AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
    AND (
        :agent_role::text IS NULL OR EXISTS (
            SELECT 1 FROM pipeline_stages AS s
            WHERE s.pipeline_id = t.pipeline_id AND s.stage = t.stage
                AND s.agent_role = :agent_role::text
        )
    )
    AND (strpos(lower(t.title), lower(:q::text)) > 0 OR strpos(t.id, :q::text) > 0)
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
JOIN tasks AS t ON t.pipeline_id = s.pipeline_id AND t.stage = s.stage
LEFT JOIN LATERAL (
    SELECT f.attempt, f.status, f.error_text, f.ended_at_ms FROM runs AS f
    WHERE f.task_id = t.id AND f.status IN ('failed', 'stale')
    ORDER BY f.attempt DESC
    LIMIT 1
) AS r ON true
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
-- Each kind walks its own partial index backwards and stops after :limit rows; :pipeline_id
-- and :error (the last error, '' for none) filter on the way. Then, for the page only: the
-- task's failed attempts, and whether an agent holds it now.
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
    (
        SELECT
            t.id, t.pipeline_id, t.stage, t.title, t.priority, 'dead_lettered' AS state,
            t.failed_at_ms AS at_ms, t.failed_at_ms, t.last_error, t.dead_letter_reason,
            t.cancelled_at_ms, t.cancel_reason, NULL::bigint AS next_eligible_at_ms
        FROM tasks AS t
        WHERE :dead::boolean
            AND t.dead_letter_reason IS NOT NULL AND t.cancelled_at_ms IS NULL
            AND (t.failed_at_ms, t.id) < (:before_at::bigint, :before_id::text)
            AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
            AND (:error::text IS NULL OR coalesce(t.last_error, '') = :error::text)
        ORDER BY t.failed_at_ms DESC, t.id DESC
        LIMIT :limit
    )
    UNION ALL
    (
        SELECT
            t.id, t.pipeline_id, t.stage, t.title, t.priority, 'cancelled' AS state,
            t.cancelled_at_ms AS at_ms, t.failed_at_ms, t.last_error, t.dead_letter_reason,
            t.cancelled_at_ms, t.cancel_reason, NULL::bigint AS next_eligible_at_ms
        FROM tasks AS t
        WHERE :cancelled::boolean
            AND t.cancelled_at_ms IS NOT NULL
            AND (t.cancelled_at_ms, t.id) < (:before_at::bigint, :before_id::text)
            AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
            AND (:error::text IS NULL OR coalesce(t.last_error, '') = :error::text)
        ORDER BY t.cancelled_at_ms DESC, t.id DESC
        LIMIT :limit
    )
    UNION ALL
    (
        SELECT
            t.id, t.pipeline_id, t.stage, t.title, t.priority, 'failing' AS state,
            t.failed_at_ms AS at_ms, t.failed_at_ms, t.last_error, t.dead_letter_reason,
            t.cancelled_at_ms, t.cancel_reason, t.next_eligible_at_ms
        FROM tasks AS t
        WHERE :failing::boolean
            AND t.failed_at_ms IS NOT NULL AND t.dead_letter_reason IS NULL
            AND (t.failed_at_ms, t.id) < (:before_at::bigint, :before_id::text)
            AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
            AND (:error::text IS NULL OR coalesce(t.last_error, '') = :error::text)
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
    FROM tasks AS t
    WHERE :dead::boolean
        AND t.dead_letter_reason IS NOT NULL AND t.cancelled_at_ms IS NULL
        AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
    UNION ALL
    SELECT 'cancelled', coalesce(t.last_error, ''), t.cancelled_at_ms
    FROM tasks AS t
    WHERE :cancelled::boolean
        AND t.cancelled_at_ms IS NOT NULL
        AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
    UNION ALL
    SELECT 'failing', coalesce(t.last_error, ''), t.failed_at_ms
    FROM tasks AS t
    WHERE :failing::boolean
        AND t.failed_at_ms IS NOT NULL AND t.dead_letter_reason IS NULL
        AND (:pipeline_id::text IS NULL OR t.pipeline_id = :pipeline_id::text)
) AS g
GROUP BY g.state, g.error
ORDER BY count(*) DESC, max(g.at_ms) DESC, g.state, g.error
LIMIT :limit;

-- The PostgreSQL backend's own statements.

-- notify --
-- The Notifier's wake-ups (notifier.py), sent with the unit of work's COMMIT: one payload of
-- "role<TAB>at_ms" lines per unit of work.
SELECT pg_notify('nulltickets_claimable', :payload);

-- notify_key_revoked --
-- A key was revoked (its id), sent with the unit of work's COMMIT: every server forgets it.
SELECT pg_notify('nulltickets_keys', :key_id);

-- listen --
-- The Notifier's listening connection, one per process (notifier.py): wake-ups and revoked
-- keys.
LISTEN nulltickets_claimable;
LISTEN nulltickets_keys;

-- lock_idempotency_key --
-- Taken first in a unit of work that carries an Idempotency-Key, before get_idempotency:
-- concurrent replays of one key (on any server) then run one after the other, and each later
-- one finds the first one's stored response instead of doing the work again. SQLite needs no
-- such lock: its one writer already runs them one after the other. (Two-key advisory locks
-- live apart from migrate.py's one-key lock.)
SELECT pg_advisory_xact_lock(
    1314146132, hashtext(:key || chr(10) || :method || chr(10) || :path)
);

-- server_encoding --
-- migrate.py: the database's encoding, which must hold any Unicode text (UTF8).
SELECT current_setting('server_encoding');

-- schema_lock --
-- migrate.py: one migrator at a time, across every process starting on this database.
SELECT pg_advisory_xact_lock(:lock_key);

-- schema_create --
-- migrate.py: the record of applied migrations (SQLite keeps PRAGMA user_version instead).
CREATE TABLE IF NOT EXISTS nulltickets_schema (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at_ms BIGINT NOT NULL
);

-- schema_versions --
SELECT version FROM nulltickets_schema ORDER BY version;

-- schema_record --
INSERT INTO nulltickets_schema (version, name, applied_at_ms) VALUES (:version, :name, :now);

-- doctor_server --
-- maintenance.py (`nulltickets doctor`): the server and this database as its session sees them.
SELECT
    current_setting('server_version') AS server_version,
    current_setting('server_version_num')::INTEGER AS server_version_num,
    pg_database_size(current_database()) AS size_bytes,
    pg_is_in_recovery() OR current_setting('default_transaction_read_only') = 'on' AS read_only,
    coalesce(has_schema_privilege(current_schema(), 'CREATE'), FALSE) AS can_create,
    to_regclass('nulltickets_schema') IS NOT NULL AS migrated,
    (
        SELECT count(*)
        FROM pg_tables
        WHERE schemaname = current_schema()
    ) AS tables;

-- doctor_sessions --
-- maintenance.py: the other client sessions on this database (servers, migrations, people).
SELECT count(*)
FROM pg_stat_activity
WHERE datname = current_database()
    AND pid <> pg_backend_pid()
    AND backend_type = 'client backend';

-- doctor_invalid_indexes --
-- maintenance.py: indexes PostgreSQL will not use (an interrupted CREATE INDEX CONCURRENTLY, a
-- failed REINDEX): what doctor reports where SQLite's integrity_check would find damage.
SELECT c.relname
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE NOT i.indisvalid
    AND n.nspname = current_schema()
ORDER BY c.relname;

-- prune_candidates --
-- On PostgreSQL the chosen rows are locked and rows another server holds are passed over:
-- two servers pruning at once take different tasks, and a requeue waits for the batch.
-- Retention (service/retention.py): finished tasks that last changed before :before, oldest
-- first, after the cursor (:after_created, :after_id) of the pass (idx_tasks_page). Finished:
-- in a terminal stage, or parked (dead-lettered or cancelled) with no task depending on it,
-- since pruning it would drop the dependency that holds its dependents back. A task with a
-- running run is never finished. Whether a parked task walked has a dependent is one probe of
-- idx_task_dependencies_depends_on: OFFSET 0 keeps it that. Left to the planner, it hashed
-- every dependency in the database, for each batch.
SELECT t.id, t.created_at_ms
FROM tasks AS t
WHERE t.created_at_ms < :before
    AND (t.created_at_ms, t.id) > (:after_created, :after_id)
    AND t.updated_at_ms < :before
    AND (
        EXISTS (
            SELECT 1 FROM pipeline_stages AS s
            WHERE s.pipeline_id = t.pipeline_id AND s.stage = t.stage AND s.terminal
        )
        OR (
            t.dead_letter_reason IS NOT NULL
            AND NOT EXISTS (
                SELECT 1 FROM task_dependencies AS d WHERE d.depends_on_task_id = t.id OFFSET 0
            )
        )
    )
    AND NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.task_id = t.id AND r.status = 'running')
ORDER BY t.created_at_ms, t.id
LIMIT :limit
FOR UPDATE OF t SKIP LOCKED;

-- fragment pruned_tasks --
-- The tasks of a prune batch (:ids, a JSON array of their ids) as an array. Each statement of
-- the batch finds their rows with "= ANY" of it, through an index, at a cost that is the
-- batch's. With "IN (SELECT jsonb_array_elements_text(:ids::jsonb))" the planner, counting on
-- a hundred ids, chose to read every run (span, event, artifact) of the history into a hash:
-- retention's batches grew with the history it kept.
ARRAY(SELECT jsonb_array_elements_text(:ids::jsonb))

-- fragment pruned_runs --
-- The runs of the batch's tasks (runs_task_id_attempt_key).
ARRAY(SELECT r.id FROM runs AS r WHERE r.task_id = ANY ({pruned_tasks}))

-- fragment pruned_span_batches --
-- The OTLP batches of a prune batch (:ids, a JSON array of their ids), as pruned_tasks.
ARRAY(SELECT jsonb_array_elements_text(:ids::jsonb)::bigint)

-- prune_export_tasks --
-- Whole rows, whatever columns the schema has: the export keeps everything a row held.
SELECT * FROM tasks WHERE id = ANY ({pruned_tasks}) ORDER BY created_at_ms, id;

-- prune_export_dependencies --
SELECT * FROM task_dependencies WHERE task_id = ANY ({pruned_tasks});

-- prune_export_assignments --
SELECT * FROM task_assignments WHERE task_id = ANY ({pruned_tasks});

-- prune_export_task_events --
SELECT * FROM task_events WHERE task_id = ANY ({pruned_tasks}) ORDER BY id;

-- prune_export_runs --
SELECT * FROM runs WHERE task_id = ANY ({pruned_tasks}) ORDER BY task_id, attempt;

-- prune_export_events --
SELECT * FROM events WHERE run_id = ANY ({pruned_runs}) ORDER BY id;

-- prune_export_artifacts --
SELECT *
FROM artifacts
WHERE task_id = ANY ({pruned_tasks}) OR run_id = ANY ({pruned_runs})
ORDER BY created_at_ms, id;

-- prune_export_spans --
SELECT *
FROM otlp_spans
WHERE task_id = ANY ({pruned_tasks}) OR run_id = ANY ({pruned_runs})
ORDER BY id;

-- prune_checks_off --
-- Where this role may set session_replication_role (a superuser; on PostgreSQL 15 and later,
-- a role granted SET on it), the batch's transaction runs without foreign-key checks: each
-- row a batch deletes otherwise runs one lookup per table that refers to it, through a
-- trigger, and those lookups were 85% of a batch's work (measured: 100 tasks, 9 ms with them,
-- 1.6 ms without). Nothing is left pointing at a deleted row: prune_lock_runs and
-- prune_candidates lock the batch's runs and tasks first, so a row that refers to one of them
-- either was committed before prune_delete (which deletes it too) or waits for the batch and
-- then fails its own check; and prune_delete deletes, itself, every row of every table that
-- refers to a task or a run (tests/postgres/test_prune_checks.py keeps that list complete).
-- Where the role may not, nothing changes: the checks run, and the cascades with them.
DO $$
BEGIN
    PERFORM set_config('session_replication_role', 'replica', TRUE);
EXCEPTION WHEN insufficient_privilege THEN NULL;
END
$$;

-- prune_lock_runs --
-- The batch's runs, locked before anything that refers to them is deleted (see
-- prune_checks_off). Its tasks were locked by prune_candidates.
SELECT r.id FROM runs AS r WHERE r.task_id = ANY ({pruned_tasks}) ORDER BY r.id FOR UPDATE;

-- prune_delete --
-- The batch's tasks and everything that refers to them or to their runs, in one statement:
-- runs (with their usage), run events, leases, artifacts, spans, task events, dependencies
-- (either way: a dependent's link to a pruned task goes, as its cascade did) and assignments.
-- Rows deleted, by table. With the foreign-key checks on, they run at the end of the
-- statement, when the rows that refer to a task or a run are gone with it.
WITH
    e AS (DELETE FROM events WHERE run_id = ANY ({pruned_runs}) RETURNING 1),
    l AS (DELETE FROM leases WHERE run_id = ANY ({pruned_runs}) RETURNING 1),
    a AS (
        DELETE FROM artifacts
        WHERE task_id = ANY ({pruned_tasks}) OR run_id = ANY ({pruned_runs})
        RETURNING 1
    ),
    s AS (
        DELETE FROM otlp_spans
        WHERE task_id = ANY ({pruned_tasks}) OR run_id = ANY ({pruned_runs})
        RETURNING 1
    ),
    te AS (DELETE FROM task_events WHERE task_id = ANY ({pruned_tasks}) RETURNING 1),
    d AS (
        DELETE FROM task_dependencies
        WHERE task_id = ANY ({pruned_tasks}) OR depends_on_task_id = ANY ({pruned_tasks})
        RETURNING 1
    ),
    sa AS (DELETE FROM task_assignments WHERE task_id = ANY ({pruned_tasks}) RETURNING 1),
    r AS (DELETE FROM runs WHERE task_id = ANY ({pruned_tasks}) RETURNING 1),
    t AS (DELETE FROM tasks WHERE id = ANY ({pruned_tasks}) RETURNING 1)
SELECT
    (SELECT count(*) FROM e) AS events,
    (SELECT count(*) FROM l) AS leases,
    (SELECT count(*) FROM a) AS artifacts,
    (SELECT count(*) FROM s) AS otlp_spans,
    (SELECT count(*) FROM te) AS task_events,
    (SELECT count(*) FROM d) AS task_dependencies,
    (SELECT count(*) FROM sa) AS task_assignments,
    (SELECT count(*) FROM r) AS runs,
    (SELECT count(*) FROM t) AS tasks;

-- prune_span_batches --
-- OTLP batches received before :before, oldest first after the pass's cursor.
SELECT id, received_at_ms
FROM otlp_batches
WHERE received_at_ms < :before
    AND (received_at_ms, id) > (:after_at, :after_id)
ORDER BY received_at_ms, id
LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- prune_export_loose_spans --
-- Spans of those batches that belong to no task or run still here (the tasks' own spans go
-- with their tasks): the spans of unknown or already pruned tasks.
SELECT *
FROM otlp_spans AS s
WHERE s.batch_id = ANY ({pruned_span_batches})
    AND NOT EXISTS (SELECT 1 FROM tasks AS t WHERE t.id = s.task_id)
    AND NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.id = s.run_id)
ORDER BY s.id;

-- prune_delete_loose_spans --
DELETE FROM otlp_spans
WHERE batch_id = ANY ({pruned_span_batches})
    AND NOT EXISTS (SELECT 1 FROM tasks AS t WHERE t.id = otlp_spans.task_id)
    AND NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.id = otlp_spans.run_id);

-- prune_export_empty_batches --
-- Those batches with no span left.
SELECT *
FROM otlp_batches AS b
WHERE b.id = ANY ({pruned_span_batches})
    AND NOT EXISTS (SELECT 1 FROM otlp_spans AS s WHERE s.batch_id = b.id)
ORDER BY b.id;

-- prune_delete_empty_batches --
DELETE FROM otlp_batches
WHERE id = ANY ({pruned_span_batches})
    AND NOT EXISTS (SELECT 1 FROM otlp_spans AS s WHERE s.batch_id = otlp_batches.id);

-- prune_idempotency --
-- Retention of recorded answers, :limit at a time (the hourly purge_idempotency drops the
-- ones older than a day in one statement).
DELETE FROM idempotency_keys
WHERE ctid IN (
    SELECT ctid FROM idempotency_keys
    WHERE created_at_ms < :before
    ORDER BY created_at_ms
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
);

-- prune_lock --
-- PostgreSQL's own: one server prunes at a time. Held until the batch's transaction ends; a
-- server that does not get it skips its pass (the row locks of prune_candidates would keep two
-- batches apart anyway). The key is "NTKR".
SELECT pg_try_advisory_xact_lock(:lock_key);
