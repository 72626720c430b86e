"""Store search on PostgreSQL: how its ranking orders equal matches (by key). What every
backend's search does alike is tests/storage/test_store.py."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from nulltickets.domain.search import search_terms
from nulltickets.storage.postgres.backend import fts_text
from tests.conftest import unique
from tests.postgres.sql import all_rows, run

Conn = psycopg.Connection[Any]


def put(conn: Conn, ns: str, key: str, value: Any) -> None:
    run(conn, "put_value", namespace=ns, key=key, value_json=json.dumps(value), now=1)


def search(
    conn: Conn,
    text: str,
    namespace: str | None,
    filter_path: str | None = None,
    filter_value: str | None = None,
    limit: int = 20,
) -> list[tuple[Any, ...]]:
    return all_rows(
        conn,
        "search_store",
        query=fts_text(search_terms(text)),  # the text the PostgreSQL backend builds
        namespace=namespace,
        filter_path=filter_path,
        filter_value=filter_value,
        limit=limit,
    )


def test_namespace_and_path_filters(pg_conn: Conn) -> None:
    ns, other = unique("ns"), unique("ns")
    put(pg_conn, ns, "a", {"t": "shared word", "status": "open", "n": 3, "ok": True})
    put(pg_conn, ns, "b", {"t": "shared word", "status": "closed", "n": 4, "ok": None})
    put(pg_conn, ns, "c", {"t": "shared word", "list": [{"status": "open"}]})
    put(pg_conn, other, "a", {"t": "shared word", "status": "open"})

    def keys(**filters: Any) -> list[str]:
        return [h[1] for h in search(pg_conn, "shared", ns, **filters)]

    assert keys() == ["a", "b", "c"]
    assert keys(filter_path="$.status", filter_value="open") == ["a"]
    assert keys(filter_path="$.status") == ["a", "b"]  # the path exists
    assert keys(filter_path="$.status", filter_value="open") == ["a"]  # arrays not unwrapped
    assert keys(filter_path="$.n", filter_value="4") == ["b"]
    assert keys(filter_path="$.ok", filter_value="true") == ["a"]
    assert keys(filter_path="$.ok", filter_value="null") == ["b"]
    assert keys(filter_path="$.ok") == ["a", "b"]  # a JSON null is there
    assert keys(filter_path="$.list[0].status", filter_value="open") == ["c"]
    assert len(search(pg_conn, "shared", None)) >= 4
    assert [h[1] for h in search(pg_conn, "shared", ns, limit=2)] == ["a", "b"]
