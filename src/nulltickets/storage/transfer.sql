-- The statements of `nulltickets migrate` (transfer.py): copying every row of a SQLite
-- database into a PostgreSQL one. {table} and {columns} are identifiers from transfer.py's own
-- list of tables and from each database's catalogue, never user input; SQLite's are quoted by
-- transfer.py, PostgreSQL's composed with psycopg.sql.Identifier.

-- sqlite_columns --
-- The columns of one SQLite table, in order (name is the second field).
SELECT name FROM pragma_table_info(:table) ORDER BY cid;

-- sqlite_rows --
-- Every row of a table in insertion order; rowid first (PostgreSQL's seq columns keep it).
SELECT rowid, {columns} FROM {table} ORDER BY rowid;

-- sqlite_count --
SELECT count(*) FROM {table};

-- pg_columns --
-- The columns of one PostgreSQL table that take a value (generated ones are left out).
SELECT column_name
FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = :table AND is_generated = 'NEVER'
ORDER BY ordinal_position;

-- pg_copy --
COPY {table} ({columns}) FROM STDIN;

-- pg_count --
SELECT count(*) FROM {table};

-- pg_reset_identity --
-- After rows were copied with their own ids, the next id the sequence gives comes after them.
SELECT setval(
    pg_get_serial_sequence(:qualified, :column),
    coalesce((SELECT max({column}) FROM {table}), 0) + 1,
    false
);

-- pg_identity_columns --
SELECT column_name
FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = :table AND is_identity = 'YES';

-- pg_truncate --
TRUNCATE {tables} RESTART IDENTITY CASCADE;
