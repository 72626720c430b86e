from __future__ import annotations

import pytest

from nulltickets.errors import InvalidCursor, InvalidLimit
from nulltickets.http.request import Request, parse_query, split_path
from nulltickets.http.routes import ROUTES, Router, gate
from nulltickets.service import params as p
from nulltickets.service.verbs import Guard as Auth


def req(query: str) -> Request:
    return Request("GET", "/tasks", ["tasks"], query, {})


def test_query_keeps_first_pair_ignores_bare_names_and_decodes_values() -> None:
    assert parse_query("a=1&a=2&b&c=&d=x%3Ay+z%zz") == {"a": "1", "c": "", "d": "x:y z%zz"}


def test_limit_defaults_on_garbage_and_rejects_out_of_range() -> None:
    assert p.limit(50)(req("").query.get("limit")) == 50
    assert p.limit(50)(req("limit=abc").query.get("limit")) == 50
    assert p.limit(50)(req("limit=1000").query.get("limit")) == 1000
    for bad in ("0", "-1", "1001"):
        with pytest.raises(InvalidLimit):
            p.limit(50)(req(f"limit={bad}").query.get("limit"))


def test_composite_cursor_needs_integer_left_and_nonempty_right() -> None:
    assert p.composite_cursor(req("cursor=12:abc").query.get("cursor")) == (12, "abc")
    assert p.composite_cursor(req("cursor=12%3Aabc").query.get("cursor")) == (12, "abc")
    assert p.composite_cursor(req("cursor=12:a:b").query.get("cursor")) == (12, "a:b")
    for bad in ("", "12", ":a", "12:", "x:a"):
        with pytest.raises(InvalidCursor):
            p.composite_cursor(req(f"cursor={bad}").query.get("cursor"))


def test_event_cursor_is_an_integer() -> None:
    assert p.id_cursor()(req("").query.get("cursor")) == 0
    assert p.id_cursor()(req("cursor=41").query.get("cursor")) == 41
    with pytest.raises(InvalidCursor):
        p.id_cursor()(req("cursor=x").query.get("cursor"))


def test_router_prefers_bulk_for_post_but_treats_get_bulk_as_an_id() -> None:
    router = Router(ROUTES)
    post = router.match("POST", ["tasks", "bulk"])
    get = router.match("GET", ["tasks", "bulk"])
    assert post is not None and post[0].pattern == "/tasks/bulk"
    assert get is not None and get[0].pattern == "/tasks/{id}" and get[1] == {"id": "bulk"}


def test_lease_routes_ignore_trailing_segments_and_others_do_not() -> None:
    router = Router(ROUTES)
    found = router.match("POST", ["runs", "r1", "events", "extra"])
    assert found is not None and found[1] == {"id": "r1"}
    assert router.match("GET", ["tasks", "t1", "dependencies", "extra"]) is None
    assert router.match("PATCH", ["tasks"]) is None


def test_gate_classifies_paths_by_segments_alone() -> None:
    assert gate(["health"]) is Auth.NONE
    assert gate([".well-known", "openapi.json"]) is Auth.NONE
    assert gate(["runs", "x", "events"]) is Auth.LEASE
    assert gate(["leases", "x", "heartbeat", "more"]) is Auth.LEASE
    assert gate(["leases", "claim"]) is Auth.KEY
    assert gate(["nope"]) is Auth.KEY


def test_every_route_is_reachable_by_its_own_pattern() -> None:
    router = Router(ROUTES)
    for route in ROUTES:
        segments = [p.strip("{}") for p in route.parts]
        found = router.match(route.method, segments)
        assert found is not None and found[0] is route, route.pattern


def test_head_takes_the_get_route_and_allowed_names_every_method_of_a_path() -> None:
    router = Router(ROUTES)
    head = router.match("HEAD", ["tasks", "t1"])
    assert head is not None and head[0].pattern == "/tasks/{id}"
    assert router.match("HEAD", ["leases", "claim"]) is None
    assert router.allowed(["tasks"]) == ("GET", "HEAD", "POST")
    assert router.allowed(["leases", "claim"]) == ("POST",)
    assert router.allowed(["store", "ns", "a", "b"]) == ("DELETE", "GET", "HEAD", "PUT")
    assert router.allowed(["nope"]) == ()
    assert router.allowed(["tasks", "t1", "dependencies", "extra"]) == ()


def authorized(value: str | None) -> Request:
    return Request(
        "GET", "/tasks", ["tasks"], "", {} if value is None else {"authorization": value}
    )


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER abc", "abc"),
        ("bEaReR a b ", "a b "),
        ("Bearer  abc", " abc"),
        ("Bearer ", ""),
        ("Bearer", None),
        ("Bearerabc", None),
        ("Basic abc", None),
        ("abc", None),
        (None, None),
    ],
)
def test_the_bearer_scheme_word_is_taken_in_any_case(value: str | None, token: str | None) -> None:
    assert authorized(value).bearer() == token


def test_the_path_is_split_before_the_second_escape_is_undone() -> None:
    # What granian hands over for /store/team%252Falpha/notes and /store/team/alpha%252Fnotes.
    assert split_path("/store/team%2Falpha/notes") == ["store", "team/alpha", "notes"]
    assert split_path("/store/team/alpha%2fnotes") == ["store", "team", "alpha/notes"]
    assert split_path("//store//a%25b%2541/") == ["store", "a%b%41"]
    assert split_path("/store/100%/%zz/%2") == ["store", "100%", "%zz", "%2"]
    assert split_path("/store/%252F") == ["store", "%2F"]  # one pass: %25 then a literal 2F


@pytest.mark.parametrize("name", ["a/b", "/lead", "trail/", "a//b", "%", "%2F", "%25", "%41", "é"])
def test_a_client_segment_arrives_whole(name: str) -> None:
    from urllib.parse import unquote

    from nulltickets.client import Calls

    path = Calls.store_get(name, name).path
    assert split_path(unquote(path)) == ["store", name, name]
