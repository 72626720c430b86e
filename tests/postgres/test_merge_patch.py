"""jsonb_merge_patch is RFC 7396, and agrees with SQLite's json_patch (the SQLite backend)."""

from __future__ import annotations

import json
from typing import Any

import apsw
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

Conn = psycopg.Connection[Any]

# RFC 7396, Appendix A: (target, patch, result).
RFC_7396_EXAMPLES = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]

# RFC 7396, section 3: the worked example.
RFC_7396_SECTION_3 = (
    {
        "title": "Goodbye!",
        "author": {"givenName": "John", "familyName": "Doe"},
        "tags": ["example", "sample"],
        "content": "This will be unchanged",
    },
    {
        "title": "Hello!",
        "phoneNumber": "+01-123-456-7890",
        "author": {"familyName": None},
        "tags": ["example"],
    },
    {
        "title": "Hello!",
        "author": {"givenName": "John"},
        "tags": ["example"],
        "content": "This will be unchanged",
        "phoneNumber": "+01-123-456-7890",
    },
)


def pg_merge(conn: Conn, target: Any, patch: Any) -> Any:
    row = conn.execute(
        "SELECT jsonb_merge_patch(%s::jsonb, %s::jsonb)::text",
        (json.dumps(target), json.dumps(patch)),
    ).fetchone()
    assert row is not None
    return json.loads(row[0])


def sqlite_merge(conn: apsw.Connection, target: Any, patch: Any) -> Any:
    for (value,) in conn.execute(
        "SELECT json_patch(?, ?)", (json.dumps(target), json.dumps(patch))
    ):
        return json.loads(value)
    raise AssertionError("no row")


@pytest.mark.parametrize(("target", "patch", "result"), [*RFC_7396_EXAMPLES, RFC_7396_SECTION_3])
def test_the_rfc_7396_examples(pg_conn: Conn, target: Any, patch: Any, result: Any) -> None:
    assert pg_merge(pg_conn, target, patch) == result


def test_sqlite_json_patch_gives_the_rfc_7396_examples_too() -> None:
    """So the comparison below compares against RFC 7396, not against a quirk."""
    conn = apsw.Connection(":memory:")
    for target, patch, result in [*RFC_7396_EXAMPLES, RFC_7396_SECTION_3]:
        assert sqlite_merge(conn, target, patch) == result, (target, patch)


_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=6,
)
_keys = st.sampled_from(["a", "b", "c", "d"]) | _text
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(target=_json, patch=_json)
def test_jsonb_merge_patch_agrees_with_sqlite_json_patch(
    pg_conn: Conn, target: Any, patch: Any
) -> None:
    sqlite = apsw.Connection(":memory:")
    assert pg_merge(pg_conn, target, patch) == sqlite_merge(sqlite, target, patch)
