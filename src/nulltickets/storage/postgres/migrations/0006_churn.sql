-- The tables every agent cycle rewrites, set for that churn.
--
-- tasks keeps 30% of each page free (fillfactor 70). A claim raises its task's fence, a column
-- no index holds: with room on the row's page, PostgreSQL writes the new version beside the old
-- one (a HOT update) and adds no entry to any of the task indexes. Without it, each claim left
-- a dead entry in every one of them, idx_tasks_claim included, for the next claims to step over
-- until autovacuum came by. The setting holds for pages written from now on; a database's
-- existing pages get the room as VACUUM FULL or pg_repack rewrites them, if ever.
--
-- tasks and runs are vacuumed once 2% of their rows are dead, not the default 20%: with many
-- tasks, 20% is tens of thousands of dead entries in the claim's walk. leases and
-- idempotency_keys are small or pruned, so the default threshold of 50 rows serves them.
ALTER TABLE tasks SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.05
);
ALTER TABLE runs SET (autovacuum_vacuum_scale_factor = 0.02);
