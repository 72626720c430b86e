"""Shared agent memory: namespaced JSON values with full-text search (contract §13)."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import msgspec
import pytest

from nulltickets import client as pyclient
from nulltickets.client import AsyncClient
from nulltickets.domain.model import StoreEntry
from tests.conftest import unique
from tests.server import Client, Server


def put(client: Client, ns: str, key: str, value: object) -> None:
    r = client.put(f"/store/{quote(ns, safe='')}/{quote(key, safe='')}", {"value": value})
    assert r.status == 204, r.body
    assert r.body == b""


def search(client: Client, query: str, **params: str) -> list[dict[str, object]]:
    qs = "&".join(f"{k}={quote(v, safe='')}" for k, v in {"q": query, **params}.items())
    r = client.get(f"/store/search?{qs}")
    assert r.status == 200, r.body
    return list(r.json)


def test_put_get_round_trips_any_json_value_and_keeps_created_at(client: Client) -> None:
    ns = unique("ns")
    put(client, ns, "k", {"b": 1, "a": [1, 2.5, None]})
    first = client.get(f"/store/{ns}/k").json
    assert first["value"] == {"b": 1, "a": [1, 2.5, None]}
    assert list(first["value"]) == ["b", "a"]  # key order survives
    put(client, ns, "k", None)
    second = client.get(f"/store/{ns}/k").json
    assert second["value"] is None
    assert second["created_at_ms"] == first["created_at_ms"]
    assert second["updated_at_ms"] >= first["updated_at_ms"]


@pytest.mark.process
def test_keys_may_hold_slashes_spaces_and_unicode(client: Client) -> None:
    ns = unique("ns")
    for key in ("a/b/c", "with space", "ключ", "../../etc/passwd"):
        put(client, ns, key, key)
        r = client.get(f"/store/{ns}/{quote(key, safe='')}")
        assert r.status == 200 and r.json["key"] == key and r.json["value"] == key


def entries(found: list[StoreEntry]) -> list[tuple[str, str, object]]:
    return [(e.namespace, e.key, msgspec.json.decode(e.value)) for e in found]


@pytest.mark.process
def test_a_slash_in_the_namespace_and_one_in_the_key_are_different_entries(
    shared_server: Server,
) -> None:
    team = unique("team")
    with pyclient.Client(shared_server.base) as api:
        api.store_put(f"{team}/alpha", "notes", "in the namespace")
        api.store_put(team, "alpha/notes", "in the key")
        assert msgspec.json.decode(api.store_get(f"{team}/alpha", "notes").value) == (
            "in the namespace"
        )
        assert msgspec.json.decode(api.store_get(team, "alpha/notes").value) == "in the key"
        assert entries(api.store_list(f"{team}/alpha")) == [
            (f"{team}/alpha", "notes", "in the namespace")
        ]
        assert entries(api.store_list(team)) == [(team, "alpha/notes", "in the key")]
        api.store_delete(f"{team}/alpha", "notes")
        assert entries(api.store_list(team)) == [(team, "alpha/notes", "in the key")]
        api.store_put(f"{team}/alpha", "notes", "again")
        api.store_delete_namespace(f"{team}/alpha")
        assert api.store_list(f"{team}/alpha") == []
        assert entries(api.store_list(team)) == [(team, "alpha/notes", "in the key")]


ODD_NAMES = ["/lead", "trail/", "a//b", "a/b/c", "100%", "%2F", "%252F", "%25", "50%41", "sp ace"]


@pytest.mark.process
def test_any_namespace_and_key_round_trip_through_the_clients(shared_server: Server) -> None:
    base = unique("odd")
    with pyclient.Client(shared_server.base) as api:
        for i, name in enumerate(ODD_NAMES):
            api.store_put(f"{base}{name}", name, i)
        for i, name in enumerate(ODD_NAMES):
            assert entries(api.store_list(f"{base}{name}")) == [(f"{base}{name}", name, i)]

    async def read_back() -> list[object]:
        async with AsyncClient(shared_server.base) as api:
            await api.store_put(f"{base}/async", "x/y", "async")
            got = [(await api.store_get(f"{base}{n}", n)).value for n in ODD_NAMES]
            listed = await api.store_list(f"{base}/async")
            return [*(msgspec.json.decode(v) for v in got), entries(listed)]

    assert asyncio.run(read_back()) == [
        *range(len(ODD_NAMES)),
        [(f"{base}/async", "x/y", "async")],
    ]


@pytest.mark.process
def test_a_slash_escaped_twice_stays_in_the_namespace_for_curl_too(client: Client) -> None:
    """The server sees the path decoded once (granian does that), then splits it and undoes
    the second escape in each segment: `%252F` is a `/` inside the segment. A key's `/` may
    still come as `%2F` or as a plain `/` (the key takes the rest of the path)."""
    team = unique("team")
    assert client.put(f"/store/{team}%252Falpha/notes", {"value": 1}).status == 204
    assert client.put(f"/store/{team}/alpha%2Fnotes", {"value": 2}).status == 204
    got = client.get(f"/store/{team}%252Falpha").json
    assert [(e["namespace"], e["key"], e["value"]) for e in got] == [(f"{team}/alpha", "notes", 1)]
    got = client.get(f"/store/{team}").json
    assert [(e["namespace"], e["key"], e["value"]) for e in got] == [(team, "alpha/notes", 2)]
    assert client.get(f"/store/{team}/alpha/notes").json["value"] == 2
    assert client.get(f"/store/{team}/alpha%252Fnotes").json["value"] == 2


def test_list_is_ordered_by_key_and_unknown_namespace_is_empty(client: Client) -> None:
    ns = unique("ns")
    for key in ("b", "a", "B"):
        put(client, ns, key, 1)
    assert [e["key"] for e in client.get(f"/store/{ns}").json] == ["B", "a", "b"]
    assert client.get(f"/store/{unique('none')}").json == []


def test_missing_key_is_not_found_and_delete_is_always_204(client: Client) -> None:
    ns = unique("ns")
    assert client.get(f"/store/{ns}/nope").error_code == "not_found"
    put(client, ns, "k", 1)
    assert client.delete(f"/store/{ns}/k").status == 204
    assert client.delete(f"/store/{ns}/k").status == 204
    assert client.get(f"/store/{ns}/k").status == 404


def test_delete_namespace_removes_every_key_and_their_search_hits(client: Client) -> None:
    ns, word = unique("ns"), unique("zebra").replace("-", "")
    put(client, ns, "a", f"{word} one")
    put(client, ns, "b", f"{word} two")
    assert len(search(client, word)) == 2
    assert client.delete(f"/store/{ns}").status == 204
    assert client.get(f"/store/{ns}").json == []
    assert search(client, word) == []


def test_put_needs_a_value_and_the_search_namespace_is_reserved(client: Client) -> None:
    ns = unique("ns")
    assert client.put(f"/store/{ns}/k", {"other": 1}).error_code == "invalid_json"
    assert client.put(f"/store/{ns}/k", body="{not json").error_code == "invalid_json"
    r = client.put("/store/search/k", {"value": 1})
    assert r.status == 400 and r.error_code == "reserved_namespace"
    assert client.get("/store/search/k").status == 404  # an always-empty namespace
    assert client.delete("/store/search").status == 204


def test_search_ranks_better_matches_first_and_shows_a_snippet(client: Client) -> None:
    ns, word = unique("ns"), unique("quokka").replace("-", "")
    put(client, ns, "weak", {"text": f"{word} appears once among many other words here"})
    put(client, ns, "strong", {"text": f"{word} {word} {word}"})
    hits = search(client, word, namespace=ns)
    assert [h["key"] for h in hits] == ["strong", "weak"]
    assert hits[0]["score"] <= hits[1]["score"]
    assert f"[{word}]" in str(hits[0]["snippet"])


def test_every_word_must_match(client: Client) -> None:
    ns, word = unique("ns"), unique("ibis").replace("-", "")
    put(client, ns, "both", f"{word} alpha")
    put(client, ns, "one", f"{word} beta")
    assert [h["key"] for h in search(client, f"{word} alpha", namespace=ns)] == ["both"]


def test_search_filters_by_namespace_and_limit(client: Client) -> None:
    word = unique("okapi").replace("-", "")
    ns1, ns2 = unique("ns"), unique("ns")
    for i in range(3):
        put(client, ns1, f"k{i}", word)
    put(client, ns2, "k", word)
    assert {h["namespace"] for h in search(client, word, namespace=ns2)} == {ns2}
    assert len(search(client, word, limit="2")) == 2
    assert len(search(client, word, limit="abc")) == 4  # non-numeric: the default of 10
    for bad in ("0", "1001"):
        r = client.get(f"/store/search?q={word}&limit={bad}")
        assert r.status == 400 and r.error_code == "invalid_limit"


def test_filter_path_matches_strings_numbers_and_booleans_exactly(client: Client) -> None:
    ns, word = unique("ns"), unique("tapir").replace("-", "")
    put(client, ns, "open", {"w": word, "status": "open", "n": 3, "ok": True})
    put(client, ns, "closed", {"w": word, "status": "closed", "n": 4, "ok": False})
    keys = lambda **f: sorted(h["key"] for h in search(client, word, namespace=ns, **f))  # noqa: E731
    assert keys(filter_path="$.status", filter_value="open") == ["open"]
    assert keys(filter_path="$.n", filter_value="4") == ["closed"]
    assert keys(filter_path="$.ok", filter_value="true") == ["open"]
    assert keys(filter_path="$.status") == ["closed", "open"]  # path exists
    assert keys(filter_path="$.missing") == []
    assert keys(filter_value="open") == ["closed", "open"]  # value without path is ignored


def test_search_needs_q_with_a_term(client: Client) -> None:
    assert client.get("/store/search").error_code == "missing_param"
    r = client.get("/store/search?q=+%09+")
    assert r.status == 400 and r.error_code == "invalid_query"


@pytest.mark.parametrize(
    "hostile",
    [
        '"',
        '""',
        '"unterminated',
        "a OR b",
        "NEAR(a b)",
        "NEAR(a b, 2)",
        "*",
        "a*",
        "-x",
        "col:term",
        "namespace:x",
        "^start",
        "(a",
        "a)",
        "AND",
        "NOT",
        "{a b}",
        "é ü 中文 🎉",
        "a\x00b",
        "\\",
        "'",
        "%",
        "x" * 10_000,
        "word " * 2000,
    ],
)
def test_hostile_queries_never_fail(client: Client, hostile: str) -> None:
    r = client.get(f"/store/search?q={quote(hostile, safe='')}")
    assert r.status in (200, 400), r.body
    if r.status == 400:
        assert r.error_code == "invalid_query"
    else:
        assert isinstance(r.json, list)


def test_operators_are_searched_as_plain_words(client: Client) -> None:
    ns = unique("ns")
    put(client, ns, "k", "meet NEAR the river")
    assert [h["key"] for h in search(client, "NEAR", namespace=ns)] == ["k"]
    assert search(client, "NEAR(meet river)", namespace=ns) == []


def test_unicode_search_folds_case_and_accents(client: Client) -> None:
    ns = unique("ns")
    put(client, ns, "k", "Crème Brûlée recipe")
    assert [h["key"] for h in search(client, "creme brulee", namespace=ns)] == ["k"]
