"""The tests' PostgreSQL: a throwaway cluster per test session (see tests/conftest.py). The
cluster itself is benchmarks/pgcluster.py, which the benchmarks' postgres section starts too."""

from benchmarks.pgcluster import (
    PostgresServer,
    PostgresUnavailable,
    find_bindir,
    free_port,
    start_postgres,
)

__all__ = ["PostgresServer", "PostgresUnavailable", "find_bindir", "free_port", "start_postgres"]
