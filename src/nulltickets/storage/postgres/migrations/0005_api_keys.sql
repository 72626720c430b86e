-- Keys: named credentials with an access level (read, agent, admin) beside the --token, as
-- SQLite's migration 0009.
--
-- Only the key's SHA-256 is kept (key_hash): the key itself is shown once, when it is made.
-- roles_json is the JSON array of agent roles an `agent` key claims for ([] otherwise), as
-- text on both backends. Revoking a key deletes its row (and every server hears of it on the
-- nulltickets_keys channel).

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    key_hash BYTEA NOT NULL UNIQUE,
    name TEXT NOT NULL,
    access TEXT NOT NULL CHECK (access IN ('read', 'agent', 'admin')),
    roles_json TEXT NOT NULL DEFAULT '[]',
    created_at_ms BIGINT NOT NULL
);
