"""POST /mcp as a route of the app in this process (also under `make test-binary`: the fault
is injected into this process's app): what it answers when its SDK cannot start, and that the
next request tries again."""

from __future__ import annotations

from pathlib import Path

import pytest

from nulltickets.mcp import http as mcp_http
from tests.inprocess import InProcessServer

pytestmark = pytest.mark.e2e

LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
ACCEPT = {"accept": "application/json, text/event-stream"}


def test_an_sdk_that_cannot_start_is_a_503_and_the_next_request_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = InProcessServer(tmp_path / "mcp.db").start()
    fresh_client = server.client()

    def broken() -> None:
        raise ImportError("No package metadata was found for httpx2")

    monkeypatch.setattr(mcp_http, "_import_sdk", broken)
    refused = fresh_client.request("POST", "/mcp", LIST, headers=ACCEPT)
    assert refused.status == 503, refused.body
    assert refused.json["error"]["code"] == "mcp_unavailable"
    assert "httpx2" in refused.json["error"]["message"]
    monkeypatch.undo()
    listed = fresh_client.request("POST", "/mcp", LIST, headers=ACCEPT)
    assert listed.status == 200, listed.body
    assert "claim_task" in {t["name"] for t in listed.json["result"]["tools"]}
    fresh_client.close()
    server.stop()
