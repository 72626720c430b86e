-- Keys: named credentials with an access level (read, agent, admin) beside the --token.
--
-- Only the key's SHA-256 is kept (key_hash): the key itself is shown once, when it is made.
-- roles_json is the JSON array of agent roles an `agent` key claims for ([] otherwise).
-- Revoking a key deletes its row. The original ignores a table it does not know.

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    key_hash BLOB NOT NULL UNIQUE,
    name TEXT NOT NULL,
    access TEXT NOT NULL CHECK (access IN ('read', 'agent', 'admin')),
    roles_json TEXT NOT NULL DEFAULT '[]',
    created_at_ms INTEGER NOT NULL
);
