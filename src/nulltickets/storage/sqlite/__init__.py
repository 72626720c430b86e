"""SQLite storage through apsw: one writer connection, a pool of readers."""
