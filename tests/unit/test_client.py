"""The clients' shared parts without I/O: every route has a call, both clients have the same
methods, and the retry decisions follow the rules the module states."""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import pytest

from nulltickets.client import (
    ApiError,
    AsyncClient,
    Attempts,
    Call,
    Calls,
    Client,
    Endpoint,
    Retry,
    RetryEvent,
    Unreachable,
)
from nulltickets.http.openapi import OPENAPI_ROUTES
from nulltickets.http.request import split_path
from nulltickets.http.routes import ROUTES, Router

# One sample call of every builder (arguments only need the right shape).
SAMPLES: dict[str, Call[Any]] = {
    "health": Calls.health(),
    "openapi": Calls.openapi(),
    "create_pipeline": Calls.create_pipeline("p", {}),
    "list_pipelines": Calls.list_pipelines(),
    "get_pipeline": Calls.get_pipeline("p1"),
    "create_task": Calls.create_task("p1", "t"),
    "create_tasks": Calls.create_tasks([{"pipeline_id": "p1", "title": "t", "description": ""}]),
    "list_tasks": Calls.list_tasks(stage="todo", limit=5),
    "get_task": Calls.get_task("t1"),
    "list_task_events": Calls.list_task_events("t1", limit=5),
    "run_state": Calls.run_state("t1"),
    "get_checkpoint": Calls.get_checkpoint("t1"),
    "requeue": Calls.requeue("t1", stage="todo", reset_attempts=True, reason="typo"),
    "cancel": Calls.cancel("t1", "not needed"),
    "requeue_tasks": Calls.requeue_tasks(["t1", "t2"], reason="fixed"),
    "cancel_tasks": Calls.cancel_tasks(["t1"], "not needed"),
    "list_failures": Calls.list_failures(kind="dead", limit=5),
    "failure_groups": Calls.failure_groups(kind="failing"),
    "add_dependency": Calls.add_dependency("t1", "t2"),
    "list_dependencies": Calls.list_dependencies("t1"),
    "assign": Calls.assign("t1", "a1"),
    "list_assignments": Calls.list_assignments("t1"),
    "unassign": Calls.unassign("t1", "a/1"),
    "claim": Calls.claim("a1", "coder", wait_ms=1000),
    "heartbeat": Calls.heartbeat("l1", "tok"),
    "event": Calls.event("r1", "tok", "progress", {"pct": 1}),
    "list_events": Calls.list_events("r1", limit=10),
    "get_run": Calls.get_run("r1"),
    "checkpoint": Calls.checkpoint("r1", "tok", {"step": 1}),
    "transition": Calls.transition("r1", "tok", "complete"),
    "fail": Calls.fail("r1", "tok", "boom"),
    "release": Calls.release("r1", "tok"),
    "release_agent": Calls.release_agent("a1"),
    "create_artifact": Calls.create_artifact("log", "file:///x"),
    "list_artifacts": Calls.list_artifacts(task_id="t1"),
    "store_put": Calls.store_put("ns", "a/b", 1),
    "store_get": Calls.store_get("ns", "a/b"),
    "store_delete": Calls.store_delete("ns", "a/b"),
    "store_list": Calls.store_list("ns"),
    "store_delete_namespace": Calls.store_delete_namespace("ns"),
    "store_search": Calls.store_search("words", limit=3),
    "queue_report": Calls.queue_report(stuck_ms=10),
    "stage_report": Calls.stage_report(),
    "retry_report": Calls.retry_report(limit=5),
    "failing_report": Calls.failing_report(min_failures=4),
    "list_namespaces": Calls.list_namespaces(cursor="a"),
    "list_task_runs": Calls.list_task_runs("t1", limit=2, newest_first=True),
    "metrics": Calls.metrics(),
    "ingest_traces": Calls.ingest_traces(b"{}"),
    "list_spans": Calls.list_spans("r1"),
    "create_key": Calls.create_key("ci", "agent", ["coder"]),
    "list_keys": Calls.list_keys(),
    "revoke_key": Calls.revoke_key("k1"),
}
# Routes that are another name for one the client calls.
ALIASES = {("GET", "/.well-known/openapi.json"), ("POST", "/otlp/v1/traces")}
# Routes that answer with a stream, not one reply a call decodes (tests/sse.py reads it).
STREAMS = {("GET", "/events/stream")}


def _segments(call: Call[Any]) -> list[str]:
    """The segments the server routes on: granian decodes the path once, the app splits it."""
    from urllib.parse import unquote

    return split_path(unquote(call.path.split("?", 1)[0]))


def test_every_route_has_a_call_and_every_call_a_route() -> None:
    router = Router(ROUTES + OPENAPI_ROUTES)
    covered = set()
    for name, call in SAMPLES.items():
        found = router.match(call.method, _segments(call))
        assert found is not None, f"{name}: {call.method} {call.path} has no route"
        covered.add((found[0].method, found[0].pattern))
    missing = {(r.method, r.pattern) for r in ROUTES} - covered - ALIASES - STREAMS
    assert missing == set()
    assert set(SAMPLES) == {n for n in vars(Calls) if not n.startswith("_")}


def test_both_clients_have_the_same_operations_with_the_same_parameters() -> None:
    for name in SAMPLES:
        sync, coro = getattr(Client, name), getattr(AsyncClient, name)
        assert inspect.iscoroutinefunction(coro), name
        assert inspect.signature(sync).parameters == inspect.signature(coro).parameters, name
        calls = inspect.signature(getattr(Calls, name)).parameters
        assert list(inspect.signature(sync).parameters)[1:] == list(calls), name


def test_writes_are_keyed_and_only_natural_repeats_go_without_a_key() -> None:
    for name, call in SAMPLES.items():
        if name == "create_key":  # its answer holds the key: never recorded, never resent
            assert not call.repeatable and not call.keyed, name
        elif call.method == "GET" or name in (
            "store_put",
            "store_delete",
            "store_delete_namespace",
            "heartbeat",
        ):
            assert call.repeatable and not call.keyed, name
        else:
            assert call.keyed and not call.repeatable, name


def test_requeue_and_cancel_send_the_operator_verbs_bodies() -> None:
    assert SAMPLES["requeue"].path == "/tasks/t1/requeue"
    assert msgspec.json.decode(SAMPLES["requeue"].body or b"") == {
        "stage": "todo",
        "reset_attempts": True,
        "reason": "typo",
    }
    assert msgspec.json.decode(Calls.requeue("t1").body or b"") == {"reset_attempts": False}
    assert msgspec.json.decode(Calls.cancel("t1").body or b"") == {}


def test_bulk_verbs_and_the_failures_listing_send_what_the_routes_take() -> None:
    assert SAMPLES["requeue_tasks"].path == "/tasks/requeue"
    assert msgspec.json.decode(SAMPLES["requeue_tasks"].body or b"") == {
        "ids": ["t1", "t2"],
        "reset_attempts": False,
        "reason": "fixed",
    }
    assert msgspec.json.decode(Calls.cancel_tasks(["t1"]).body or b"") == {"ids": ["t1"]}
    assert SAMPLES["list_failures"].path == "/ops/failures?kind=dead&limit=5"
    listed = Calls.list_failures(kind="dead,failing", error="disk full", cursor="12:ab")
    assert listed.path == "/ops/failures?kind=dead%2Cfailing&error=disk+full&cursor=12%3Aab"
    assert SAMPLES["failure_groups"].path == "/ops/failures/groups?kind=failing"


def test_paths_escape_slashes_and_percents_inside_a_segment_then_quote_it() -> None:
    assert Calls.get_task("a/b c").path == "/tasks/a%252Fb%20c"
    assert Calls.store_get("n/s", "dir/file 100%").path == "/store/n%252Fs/dir%252Ffile%20100%2525"
    assert Calls.list_tasks(stage="a b").path == "/tasks?stage=a+b"


def test_base_urls_are_http_or_https_with_an_optional_prefix() -> None:
    assert Endpoint.parse("https://example.org") == Endpoint("https", "example.org", 443, "")
    ep = Endpoint.parse("http://[::1]:8080/tracker/")
    assert (ep.host, ep.port, ep.prefix, ep.host_header) == ("::1", 8080, "/tracker", "[::1]:8080")
    for bad in ("ftp://x", "localhost:7700", "http://:80", "http://x:notaport"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)


def _attempts(call: Call[Any], policy: Retry) -> tuple[Attempts, list[RetryEvent]]:
    seen: list[RetryEvent] = []
    return Attempts(call, policy, seen.append), seen


BUSY = b'{"error": {"code": "storage_busy", "message": "database is busy"}}'


def test_a_busy_answer_waits_its_retry_after_then_gives_up_past_the_budget() -> None:
    attempts, seen = _attempts(Calls.event("r", "t", "k"), Retry(timeout=10))
    delay = attempts.after_answer(503, {"retry-after": "2"}, BUSY)
    assert 2.0 <= delay <= 2.2 and seen[0].status == 503 and "storage_busy" in seen[0].reason
    with pytest.raises(ApiError) as caught:
        attempts.after_answer(503, {"retry-after": "60"}, BUSY)  # past the 10 s budget
    assert caught.value.code == "storage_busy" and caught.value.retry_after == 60.0


def test_a_long_poll_refused_its_wait_pauses_for_its_retry_after_within_its_wait() -> None:
    long_poll, _ = _attempts(Calls.claim("a", "coder", wait_ms=30_000), Retry())
    assert 4.9 <= long_poll.pause_after(204, {"retry-after": "5"}) <= 5.0
    assert long_poll.pause_after(204, {}) == 0.0  # its wait simply ran out
    assert long_poll.pause_after(200, {"retry-after": "5"}) == 0.0
    short, _ = _attempts(Calls.claim("a", "coder", wait_ms=1_000), Retry())
    assert short.pause_after(204, {"retry-after": "5"}) <= 1.0  # never past its own wait
    immediate, _ = _attempts(Calls.claim("a", "coder"), Retry())
    assert immediate.pause_after(204, {"retry-after": "5"}) == 0.0


def test_an_error_answer_other_than_busy_is_raised_at_once() -> None:
    attempts, seen = _attempts(Calls.get_task("t"), Retry())
    body = b'{"error": {"code": "task_cancelled", "message": "cancelled"}}'
    with pytest.raises(ApiError) as caught:
        attempts.after_answer(409, {}, body)
    assert caught.value.lease_lost and seen == []
    with pytest.raises(ApiError) as garbage:
        attempts.after_answer(500, {}, b"<html>")
    assert garbage.value.code == "unexpected_response"


def test_a_request_that_may_have_been_applied_is_repeated_only_when_safe() -> None:
    unkeyed = Call("POST", "/x", lambda s, b: None, b"{}")
    attempts, _ = _attempts(unkeyed, Retry())
    assert attempts.after_error(ConnectionRefusedError(), sent=False) >= 0
    with pytest.raises(Unreachable, match="not repeated"):
        attempts.after_error(ConnectionResetError(), sent=True)
    keyed, _ = _attempts(Calls.event("r", "t", "k"), Retry())
    assert keyed.after_error(ConnectionResetError(), sent=True) >= 0
    proxy, _ = _attempts(unkeyed, Retry())
    with pytest.raises(ApiError):
        proxy.after_answer(502, {}, b"bad gateway")


def test_backoff_grows_to_its_cap_with_jitter_and_stops_at_max_attempts() -> None:
    policy = Retry(base_delay=0.1, max_delay=1.0, max_attempts=4)
    assert all(0.05 <= policy.backoff(0) <= 0.1 for _ in range(50))
    assert all(0.5 <= policy.backoff(10) <= 1.0 for _ in range(50))
    assert len({policy.backoff(3) for _ in range(20)}) > 1  # jittered
    attempts, seen = _attempts(Calls.health(), policy)
    for _ in range(3):
        attempts.after_error(ConnectionRefusedError(), sent=False)
    with pytest.raises(Unreachable, match="after 4 attempt"):
        attempts.after_error(ConnectionRefusedError(), sent=False)
    assert [e.attempt for e in seen] == [1, 2, 3]


def test_retry_after_as_an_http_date_is_understood() -> None:
    from email.utils import formatdate
    from time import time

    attempts, _ = _attempts(Calls.health(), Retry())
    delay = attempts.after_answer(503, {"retry-after": formatdate(time() + 3, usegmt=True)}, BUSY)
    assert 1.0 <= delay <= 3.5
