"""Store search on PostgreSQL: the generated tsvector, ranked by ts_rank, with snippets."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

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


def test_matches_come_ranked_with_the_query_words_in_brackets(pg_conn: Conn) -> None:
    ns = unique("ns")
    put(pg_conn, ns, "one", {"note": "the login bug: login fails, login page blank"})
    put(pg_conn, ns, "two", {"note": "a login bug somewhere in a long text about other things"})
    put(pg_conn, ns, "three", {"note": "login works; the bug is elsewhere"})
    put(pg_conn, ns, "four", {"note": "nothing to see"})
    hits = search(pg_conn, "Login BUG", ns)
    keys = [h[1] for h in hits]
    assert keys[0] == "one"  # three times "login": ranked first
    assert set(keys) == {"one", "two", "three"}
    scores = [h[5] for h in hits]
    assert scores == sorted(scores) and scores[0] < 0  # lower is better, as bm25 on SQLite
    snippet = hits[0][6]
    assert "[login]" in snippet and "[bug]" in snippet
    assert json.loads(hits[0][2]) == {"note": "the login bug: login fails, login page blank"}


def test_every_term_must_match_and_a_term_of_several_words_is_a_phrase(pg_conn: Conn) -> None:
    ns = unique("ns")
    put(pg_conn, ns, "adjacent", {"t": "the foo bar case"})
    put(pg_conn, ns, "apart", {"t": "bar before foo"})
    assert [h[1] for h in search(pg_conn, "foo-bar", ns)] == ["adjacent"]
    assert {h[1] for h in search(pg_conn, "foo bar", ns)} == {"adjacent", "apart"}
    assert search(pg_conn, "foo missing", ns) == []


def test_operators_in_user_text_are_just_words(pg_conn: Conn) -> None:
    ns = unique("ns")
    put(pg_conn, ns, "k", {"t": "alpha beta"})
    assert search(pg_conn, "alpha -beta", ns) != []  # not "alpha and not beta"
    assert search(pg_conn, "alpha or gamma", ns) == []  # "or" is a word, not an operator
    assert search(pg_conn, '" alp*', ns) == []


def test_keys_and_namespaces_are_searched_too(pg_conn: Conn) -> None:
    ns = unique("ns")
    put(pg_conn, ns, "deploy-checklist", {"t": "nothing relevant"})
    (hit,) = search(pg_conn, "checklist", ns)
    assert hit[1] == "deploy-checklist" and hit[6] == "deploy-[checklist]"
    assert [h[1] for h in search(pg_conn, ns, None)] == ["deploy-checklist"]


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


def test_a_malformed_path_fails_the_statement(pg_conn: Conn) -> None:
    with pytest.raises(psycopg.errors.SyntaxError):
        search(pg_conn, "x", None, filter_path="$.[")


def test_punctuation_separates_words_as_in_fts5(pg_conn: Conn) -> None:
    ns = unique("ns")
    put(pg_conn, ns, "k", {"path": "src/app.py", "mail": "ops@example.com", "w": "foo_bar"})
    for text in ("app", "py", "app.py", "example", "ops@example.com", "bar", "foo_bar", "src/app"):
        assert [h[1] for h in search(pg_conn, text, ns)] == ["k"], text
    put(pg_conn, ns, "h", {"t": "a well-known fix"})
    (hit,) = search(pg_conn, "known", ns)
    assert "well-[known]" in hit[6]
