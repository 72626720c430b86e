"""The store and its full-text search through the storage port: every backend ranks and marks
its matches alike. The search tests come from the contract suite and from
tests/postgres/test_search.py, where they ran on one backend each."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nulltickets.domain.search import search_terms
from nulltickets.errors import StorageQueryError
from nulltickets.storage.ports import Database
from tests.storage.ops import NOW, covers


def put(database: Database, namespace: str, key: str, value: Any, now: int = NOW) -> None:
    database.write_sync(lambda b: b.put_value(namespace, key, json.dumps(value), now))


def search(
    database: Database,
    text: str,
    namespace: str | None = None,
    filter_path: str | None = None,
    filter_value: str | None = None,
    limit: int = 20,
) -> list[tuple[str, str]]:
    """(key, snippet) of each hit, best first."""
    terms = search_terms(text)
    hits = database.read_sync(
        lambda b: b.search_store(terms, namespace, filter_path, filter_value, limit)
    )
    return [(h.key, h.snippet) for h in hits]


def keys(database: Database, text: str, namespace: str | None = None, **kw: Any) -> list[str]:
    return [k for k, _ in search(database, text, namespace, **kw)]


@covers(
    "Backend.put_value",
    "Backend.get_value",
    "Backend.delete_value",
    "Backend.list_namespace",
    "Backend.list_namespaces",
    "Backend.delete_namespace",
)
def test_a_key_holds_one_value_and_namespaces_are_listed_and_dropped(database: Database) -> None:
    put(database, "ns", "k", {"v": 1}, now=1)
    put(database, "ns", "k", {"v": 2}, now=5)  # the same key again: replaced
    got = database.read_sync(lambda b: b.get_value("ns", "k"))
    assert got is not None
    assert (got.namespace, got.key, got.created_at_ms, got.updated_at_ms) == ("ns", "k", 1, 5)
    assert json.loads(bytes(got.value)) == {"v": 2}
    assert database.read_sync(lambda b: b.get_value("ns", "nope")) is None
    put(database, "ns", "a", [1, "x"], now=7)
    put(database, "other", "z", None, now=3)
    listed = database.read_sync(lambda b: b.list_namespace("ns"))
    assert [(e.key, json.loads(bytes(e.value))) for e in listed] == [
        ("a", [1, "x"]),
        ("k", {"v": 2}),
    ]
    summaries = database.read_sync(lambda b: b.list_namespaces("", 10))
    assert [(n.namespace, n.keys, n.updated_at_ms) for n in summaries] == [
        ("ns", 2, 7),
        ("other", 1, 3),
    ]
    assert [n.namespace for n in database.read_sync(lambda b: b.list_namespaces("ns", 10))] == [
        "other"
    ]
    assert len(database.read_sync(lambda b: b.list_namespaces("", 1))) == 1
    database.write_sync(lambda b: b.delete_value("ns", "k"))
    database.write_sync(lambda b: b.delete_value("ns", "nope"))  # nothing to delete: fine
    assert database.read_sync(lambda b: b.get_value("ns", "k")) is None
    assert [e.key for e in database.read_sync(lambda b: b.list_namespace("ns"))] == ["a"]
    database.write_sync(lambda b: b.delete_namespace("ns"))
    assert database.read_sync(lambda b: b.list_namespace("ns")) == []
    assert [n.namespace for n in database.read_sync(lambda b: b.list_namespaces("", 10))] == [
        "other"
    ]
    # Values come back as written: no reformatting of the JSON text.
    database.write_sync(lambda b: b.put_value("raw", "k", '{"b":1,"a":[1,2]}', NOW))
    assert (
        bytes(database.read_sync(lambda b: b.get_value("raw", "k")).value) == b'{"b":1,"a":[1,2]}'
    )


@covers("Backend.search_store")
def test_search_ranks_the_better_match_first_and_marks_it_in_a_snippet(database: Database) -> None:
    put(database, "notes", "once", {"text": "the parser handles one comet in passing"})
    put(database, "notes", "often", {"text": "comet comet comet: all about the comet"})
    put(database, "notes", "never", {"text": "nothing to see here"})
    hits = search(database, "comet")
    assert [k for k, _ in hits] == ["often", "once"]
    assert all("[comet]" in snippet for _, snippet in hits)
    found = database.read_sync(lambda b: b.search_store(["comet"], None, None, None, 10))
    assert found[0].score <= found[1].score
    assert all(h.score < 0 for h in found)  # lower is better, as bm25 on SQLite
    assert json.loads(bytes(found[0].value)) == {"text": "comet comet comet: all about the comet"}


@covers("Backend.search_store")
def test_matches_come_ranked_with_every_query_word_in_brackets(database: Database) -> None:
    put(database, "ns", "one", {"note": "the login bug: login fails, login page blank"})
    put(database, "ns", "two", {"note": "a login bug somewhere in a long text about other things"})
    put(database, "ns", "three", {"note": "login works; the bug is elsewhere"})
    put(database, "ns", "four", {"note": "nothing to see"})
    hits = search(database, "Login BUG", "ns")
    assert hits[0][0] == "one"  # three times "login": ranked first
    assert {k for k, _ in hits} == {"one", "two", "three"}
    assert "[login]" in hits[0][1] and "[bug]" in hits[0][1]
    found = database.read_sync(
        lambda b: b.search_store(search_terms("Login BUG"), "ns", None, None, 20)
    )
    scores = [h.score for h in found]
    assert scores == sorted(scores) and scores[0] < 0  # lower is better, as bm25 on SQLite
    assert json.loads(bytes(found[0].value)) == {
        "note": "the login bug: login fails, login page blank"
    }


@covers("Backend.search_store")
def test_every_term_must_match_and_operators_are_plain_words(database: Database) -> None:
    put(database, "n", "both", {"text": "alpha beta"})
    put(database, "n", "one", {"text": "alpha gamma"})
    put(database, "n", "ops", {"text": "NEAR(a b) OR c* x:y -z"})
    assert keys(database, "alpha beta") == ["both"]
    assert keys(database, "NEAR(a b) OR c*") == ["ops"]
    assert keys(database, '"unbalanced') == []
    assert keys(database, "alpha -beta", "n") == ["both"]  # not "alpha and not beta"
    assert keys(database, "alpha or gamma", "n") == []  # "or" is a word, not an operator
    assert keys(database, '" alp*', "n") == []
    assert search_terms(" \t ") == []  # nothing to search for: the service refuses it


@covers("Backend.search_store")
def test_a_term_of_several_words_is_a_phrase(database: Database) -> None:
    put(database, "ns", "adjacent", {"t": "the foo bar case"})
    put(database, "ns", "apart", {"t": "bar before foo"})
    assert keys(database, "foo-bar", "ns") == ["adjacent"]
    assert set(keys(database, "foo bar", "ns")) == {"adjacent", "apart"}
    assert keys(database, "foo missing", "ns") == []


@covers("Backend.search_store")
def test_keys_and_namespaces_are_searched_too(database: Database) -> None:
    put(database, "ns", "deploy-checklist", {"t": "nothing relevant"})
    assert search(database, "checklist", "ns") == [("deploy-checklist", "deploy-[checklist]")]
    assert keys(database, "ns") == ["deploy-checklist"]


@covers("Backend.search_store")
def test_search_filters_by_namespace_and_json_path(database: Database) -> None:
    put(database, "a", "open", {"text": "ticket", "status": "open"})
    put(database, "a", "shut", {"text": "ticket", "status": "closed"})
    put(database, "b", "other", {"text": "ticket", "status": "open"})
    assert sorted(keys(database, "ticket", "a")) == ["open", "shut"]
    assert keys(database, "ticket", "a", filter_path="$.status", filter_value="open") == ["open"]
    ns = "c"
    put(database, ns, "a", {"t": "shared word", "status": "open", "n": 3, "ok": True})
    put(database, ns, "b", {"t": "shared word", "status": "closed", "n": 4, "ok": None})
    put(database, ns, "c", {"t": "shared word", "list": [{"status": "open"}]})

    def found(**filters: Any) -> list[str]:
        return sorted(keys(database, "shared", ns, **filters))  # ties rank differently

    assert found() == ["a", "b", "c"]
    assert found(filter_path="$.status", filter_value="open") == ["a"]  # arrays not unwrapped
    assert found(filter_path="$.status") == ["a", "b"]  # the path exists
    assert found(filter_path="$.n", filter_value="4") == ["b"]
    assert found(filter_path="$.ok", filter_value="true") == ["a"]
    assert found(filter_path="$.ok", filter_value="null") == ["b"]
    assert found(filter_path="$.ok") == ["a", "b"]  # a JSON null is there
    assert found(filter_path="$.list[0].status", filter_value="open") == ["c"]
    assert len(keys(database, "shared")) == 3
    assert len(keys(database, "shared", ns, limit=2)) == 2


@covers("Backend.search_store")
def test_a_malformed_json_path_is_a_query_error(database: Database) -> None:
    put(database, "ns", "k", {"t": "x"})
    with pytest.raises(StorageQueryError):
        search(database, "x", None, filter_path="$.[")


@covers("Backend.search_store")
def test_punctuation_separates_words(database: Database) -> None:
    put(database, "ns", "k", {"path": "src/app.py", "mail": "ops@example.com", "w": "foo_bar"})
    for text in ("app", "py", "app.py", "example", "ops@example.com", "bar", "foo_bar", "src/app"):
        assert keys(database, text, "ns") == ["k"], text
    put(database, "ns", "h", {"t": "a well-known fix"})
    [(key, snippet)] = search(database, "known", "ns")
    assert key == "h" and "well-[known]" in snippet
