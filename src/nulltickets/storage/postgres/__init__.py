"""The PostgreSQL backend: storage.ports.Database on psycopg 3.

Installed with `pip install nulltickets[postgres]`.
"""

from nulltickets.storage.postgres.database import PostgresDatabase

__all__ = ["PostgresDatabase"]
