"""Which e2e tests run against the app in this process (tests/inprocess.py) and which against a
server process, and what the in-process client reports."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.conftest import on_process
from tests.inprocess import InProcessServer
from tests.server import Client, Server

pytestmark = pytest.mark.e2e

# Against a binary every server is a process and the in-process client is not used.
BINARY = bool(os.environ.get("NULLTICKETS_BINARY"))


@pytest.mark.skipif(BINARY, reason="against a binary every server is a process")
def test_an_e2e_test_gets_the_app_in_this_process(
    shared_server: Any, fresh_server: Any, make_server: Any, request: pytest.FixtureRequest
) -> None:
    assert not on_process(request)
    made = make_server(token="t" * 16)
    for server in (shared_server, fresh_server, made):
        assert isinstance(server, InProcessServer)
    assert made.client("t" * 16).get("/tasks").status == 200
    assert made.client().get("/tasks").error_code == "unauthorized"


@pytest.mark.process
def test_a_test_marked_process_gets_a_server_process(
    shared_server: Any, fresh_server: Any, request: pytest.FixtureRequest
) -> None:
    assert on_process(request)
    for server in (shared_server, fresh_server):
        assert isinstance(server, Server)
        assert server.proc is not None and server.proc.poll() is None
        assert isinstance(server.client(), Client)


def test_against_a_binary_every_server_is_a_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NULLTICKETS_BINARY", "/nonexistent/nulltickets")
    assert on_process(request)


@pytest.mark.skipif(BINARY, reason="against a binary every server is a process")
def test_a_response_carries_only_the_headers_the_app_set(client: Any) -> None:
    """What granian adds on the wire (Content-Length, framing) is absent, so a test that
    asserts on it fails in this process and must ask for a process."""
    r = client.get("/health")
    assert r.status == 200 and r.json["status"] == "ok"
    assert "content-length" not in r.headers
    assert r.headers["content-type"] == "application/json"


def test_a_body_and_its_declared_length_reach_the_app(client: Any) -> None:
    r = client.post("/pipelines", body=b'{"name": 1', headers={"Content-Type": "application/json"})
    assert (r.status, r.error_code) == (400, "invalid_json")
    # Just over the 64 KiB limit: a server process refuses it on its Content-Length and may
    # close the connection at once; a body this small is all sent by then (one far larger
    # could still be going out, and its send would fail with a broken pipe).
    big = "x" * (64 * 1024 + 1024)
    r = client.post("/pipelines", {"name": big, "definition": {}})
    assert (r.status, r.error_code) == (413, "payload_too_large")
