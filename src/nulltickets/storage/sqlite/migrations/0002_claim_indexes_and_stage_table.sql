-- Everything nulltickets adds to the original schema: a stage table that knows which stages are
-- terminal (so dependency checks run in SQL), the TTL a lease was claimed with (heartbeats keep
-- it), the lease-token hash an idempotent replay must match, and the indexes that keep claim
-- cost independent of the number of finished tasks.

CREATE TABLE pipeline_stages (
    pipeline_id TEXT NOT NULL REFERENCES pipelines(id) ON DELETE CASCADE,
    stage TEXT NOT NULL,
    agent_role TEXT,
    terminal INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (pipeline_id, stage)
);
CREATE INDEX idx_pipeline_stages_role ON pipeline_stages(agent_role, pipeline_id, stage)
    WHERE agent_role IS NOT NULL;

-- The original reads pipeline_stage_roles; keep it derived from pipeline_stages by the schema.
CREATE TRIGGER pipeline_stages_roles_ai AFTER INSERT ON pipeline_stages
WHEN new.agent_role IS NOT NULL
BEGIN
    INSERT OR REPLACE INTO pipeline_stage_roles(pipeline_id, stage, agent_role)
    VALUES (new.pipeline_id, new.stage, new.agent_role);
END;

INSERT OR IGNORE INTO pipeline_stages(pipeline_id, stage, agent_role, terminal)
SELECT
    p.id,
    s.key,
    CASE WHEN json_type(s.value, '$.agent_role') = 'text'
        THEN json_extract(s.value, '$.agent_role') END,
    coalesce(json_type(s.value, '$.terminal') = 'true', 0)
FROM pipelines AS p, json_each(p.definition_json, '$.states') AS s
WHERE json_valid(p.definition_json)
    AND json_type(p.definition_json, '$.states') = 'object'
    AND json_type(s.value) = 'object';

ALTER TABLE leases ADD COLUMN ttl_ms INTEGER;
ALTER TABLE idempotency_keys ADD COLUMN auth_hash BLOB;

-- Claim walks one (pipeline, stage) group in priority order and stops at the first eligible
-- row; dead-lettered rows never enter the index.
CREATE INDEX idx_tasks_claim ON tasks(pipeline_id, stage, priority DESC, created_at_ms ASC)
    WHERE dead_letter_reason IS NULL;
CREATE INDEX idx_tasks_page ON tasks(created_at_ms, id);
CREATE INDEX idx_tasks_stage_page ON tasks(stage, created_at_ms, id);
CREATE INDEX idx_tasks_pipeline_page ON tasks(pipeline_id, created_at_ms, id);
CREATE INDEX idx_tasks_pipeline_stage_page ON tasks(pipeline_id, stage, created_at_ms, id);
CREATE INDEX idx_runs_task_status ON runs(task_id, status);
CREATE INDEX idx_artifacts_task_page ON artifacts(task_id, created_at_ms, id);
CREATE INDEX idx_artifacts_run_page ON artifacts(run_id, created_at_ms, id);
CREATE INDEX idx_task_assignments_task_created ON task_assignments(task_id, created_at_ms);

-- Full-text index over the store. The original named the indexed column differently from its
-- source column, so FTS5 maintenance ('rebuild', 'integrity-check') could not work; this one
-- mirrors store's columns and is rebuilt from the store's rows.
DROP TABLE IF EXISTS store_fts;
CREATE VIRTUAL TABLE store_fts USING fts5(
    namespace, key, value_json, content='store', content_rowid='rowid'
);
CREATE TRIGGER store_fts_ai AFTER INSERT ON store BEGIN
    INSERT INTO store_fts(rowid, namespace, key, value_json)
    VALUES (new.rowid, new.namespace, new.key, new.value_json);
END;
CREATE TRIGGER store_fts_ad AFTER DELETE ON store BEGIN
    INSERT INTO store_fts(store_fts, rowid, namespace, key, value_json)
    VALUES ('delete', old.rowid, old.namespace, old.key, old.value_json);
END;
CREATE TRIGGER store_fts_au AFTER UPDATE ON store BEGIN
    INSERT INTO store_fts(store_fts, rowid, namespace, key, value_json)
    VALUES ('delete', old.rowid, old.namespace, old.key, old.value_json);
    INSERT INTO store_fts(rowid, namespace, key, value_json)
    VALUES (new.rowid, new.namespace, new.key, new.value_json);
END;
INSERT INTO store_fts(store_fts) VALUES ('rebuild');
