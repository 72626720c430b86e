"""GET /events/stream: run events as Server-Sent Events, read with a raw socket client."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import claimed, make_task, pipeline_with_roles, unique
from tests.server import Client, Server
from tests.sse import SseClient

pytestmark = pytest.mark.process

TOKEN = "stream-secret"


@pytest.fixture(scope="module")
def stream_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A short heartbeat, so the heartbeat test does not wait 15 s.
    server = Server(
        tmp_path_factory.mktemp("stream") / "stream.db",
        env={"NULLTICKETS_SSE_HEARTBEAT_S": "0.3"},
    ).start()
    yield server
    server.stop()


@pytest.fixture
def api(stream_server: Server) -> Iterator[Client]:
    c = stream_server.client()
    yield c
    c.close()


def stream(server: Server, query: str = "", **headers: str) -> SseClient:
    s = SseClient(server.port, "/events/stream" + (f"?{query}" if query else ""), headers)
    s.open()
    assert s.status == 200, s.body()
    assert s.response_headers["content-type"] == "text/event-stream"
    first = s.next()  # the stream opens with its retry line and a comment
    assert first.comment == "connected"
    return s


def a_run(api: Client) -> tuple[str, dict[str, Any]]:
    pipeline_id, coder, _ = pipeline_with_roles(api)
    make_task(api, pipeline_id)
    return pipeline_id, claimed(api, coder, agent=unique("agent"))


def note(api: Client, lease: dict[str, Any], kind: str = "note", **data: Any) -> int:
    r = api.post(
        f"/runs/{lease['run']['id']}/events",
        {"kind": kind, "data": data},
        token=lease["lease_token"],
    )
    assert r.status == 201, r.body
    return int(r.json["id"])


def test_new_events_arrive_live_with_their_id_run_task_and_pipeline(
    stream_server: Server, api: Client
) -> None:
    pipeline_id, lease = a_run(api)
    s = stream(stream_server, f"pipeline_id={pipeline_id}")
    try:
        event_id = note(api, lease, step=1)
        message = s.next_event()
        assert message.id == event_id
        assert message.data["kind"] == "note"
        assert message.data["data"] == {"step": 1}
        assert message.data["run_id"] == lease["run"]["id"]
        assert message.data["task_id"] == lease["task"]["id"]
        assert message.data["pipeline_id"] == pipeline_id
    finally:
        s.close()


def test_filters_let_through_only_their_task_run_pipeline_and_kinds(
    stream_server: Server, api: Client
) -> None:
    _, mine = a_run(api)
    other_pipeline, other = a_run(api)
    by_task = stream(stream_server, f"task_id={mine['task']['id']}")
    by_run = stream(stream_server, f"run_id={other['run']['id']}")
    by_pipeline = stream(stream_server, f"pipeline_id={other_pipeline}")
    by_kind = stream(stream_server, f"kind=wanted,also&task_id={mine['task']['id']}")
    try:
        first = note(api, other, "noise")
        second = note(api, mine, "wanted")
        third = note(api, mine, "ignored")
        fourth = note(api, mine, "also")
        assert [by_task.next_event().id for _ in range(3)] == [second, third, fourth]
        assert by_run.next_event().id == first
        assert by_pipeline.next_event().id == first
        assert [by_kind.next_event().id for _ in range(2)] == [second, fourth]
        # Nothing else came for the run and pipeline filters: a later event of theirs is next.
        fifth = note(api, other, "later")
        assert by_run.next_event().id == fifth
        assert by_pipeline.next_event().id == fifth
    finally:
        for s in (by_task, by_run, by_pipeline, by_kind):
            s.close()


def test_last_event_id_replays_what_was_missed_then_continues_live(
    stream_server: Server, api: Client
) -> None:
    _, lease = a_run(api)
    task_id = lease["task"]["id"]
    ids = [note(api, lease, step=i) for i in range(5)]
    resumed = stream(stream_server, f"task_id={task_id}", **{"Last-Event-ID": str(ids[1])})
    from_start = stream(stream_server, f"task_id={task_id}&last_event_id=0")
    try:
        assert [resumed.next_event().id for _ in range(3)] == ids[2:]
        assert [from_start.next_event().id for _ in range(5)] == ids
        later = note(api, lease, step=5)
        assert resumed.next_event().id == later
        assert from_start.next_event().id == later
    finally:
        resumed.close()
        from_start.close()


def test_a_bad_last_event_id_is_the_json_error_envelope(stream_server: Server) -> None:
    s = SseClient(stream_server.port, "/events/stream", {"Last-Event-ID": "yesterday"}).open()
    try:
        assert s.status == 400
        assert s.response_headers["content-type"] == "application/json"
        assert b'"invalid_cursor"' in s.body()
    finally:
        s.close()


def test_an_idle_stream_gets_heartbeat_comments(stream_server: Server) -> None:
    s = stream(stream_server, f"task_id={unique('none')}")
    try:
        beats = [s.next(timeout=5).comment for _ in range(2)]
        assert beats == ["heartbeat", "heartbeat"]
    finally:
        s.close()


def test_streams_need_the_admin_token_when_one_is_set(make_server: Any) -> None:
    server = make_server(token=TOKEN)
    refused = SseClient(server.port, "/events/stream").open()
    try:
        assert refused.status == 401
        assert b'"unauthorized"' in refused.body()
    finally:
        refused.close()
    s = stream(server, "", Authorization=f"Bearer {TOKEN}")
    s.close()


def test_events_wake_streams_at_once_and_shutdown_ends_them_cleanly(make_server: Any) -> None:
    # The default 15 s heartbeat: an event that came only with a heartbeat would time out here.
    server = make_server()
    api = server.client()
    _, lease = a_run(api)
    streams = [stream(server) for _ in range(5)]
    event_id = note(api, lease)
    api.close()
    for s in streams:
        assert s.next_event(timeout=5).id == event_id
    assert server.proc is not None
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for s in streams:
        with pytest.raises(EOFError, match="the stream ended"):
            while True:
                s.next(timeout=5)
        assert s.ended  # the last chunk came: the stream ended, not the connection
        s.close()
    assert server.proc.wait(10) == 0
    assert time.monotonic() - started < 2, server.output()
