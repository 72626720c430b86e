"""An agent for the tests that kill servers under load: it claims (long-polling), finishes the
task, claims again, and records each task it finished with a 200 and every answer nothing
explains. Where it connects, and what a broken connection means, are the test's own."""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any

from tests.server import Client, Response

# Expired or superseded: the task is someone else's now.
LEASE_LOST = (409, 410)


class FinishingAgent(threading.Thread):
    def __init__(self, name: str, role: str, lease_ttl_ms: int) -> None:
        super().__init__(name=name, daemon=True)
        self.role = role
        self.lease_ttl_ms = lease_ttl_ms
        self.acknowledged: list[tuple[str, str]] = []  # (task id, run id) finished with a 200
        self.unexpected: list[str] = []
        self.stop_when_idle = threading.Event()

    def client(self) -> Client:
        """A connection to where the agent's requests go."""
        raise NotImplementedError

    def lost(self) -> None:
        """A request's connection broke: its server is gone. Whatever was in flight is
        committed or not; a lease left behind expires and is claimed again."""

    def explained(self, r: Response) -> bool:
        """An answer the test's set-up explains (beyond a lost lease on a transition)."""
        return False

    def call(self, client: Client, path: str, body: Any, token: str | None = None) -> Response:
        return client.request("POST", path, body, token=token)

    def run(self) -> None:
        client = self.client()
        while True:
            try:
                claim = {
                    "agent_id": self.name,
                    "agent_role": self.role,
                    "lease_ttl_ms": self.lease_ttl_ms,
                    "wait_ms": 500,
                }
                r = self.call(client, "/leases/claim", claim)
                if r.status == 204:
                    if self.stop_when_idle.is_set():
                        client.close()
                        return
                    continue
                if r.status != 200:
                    if not self.explained(r):
                        self.unexpected.append(f"claim {r.status} {r.body[:200]!r}")
                    time.sleep(0.05)
                    continue
                lease = r.json
                r = self.call(
                    client,
                    f"/runs/{lease['run']['id']}/transition",
                    {"trigger": "finish"},
                    token=lease["lease_token"],
                )
                if r.status == 200:
                    self.acknowledged.append((lease["task"]["id"], lease["run"]["id"]))
                elif r.status not in LEASE_LOST and not self.explained(r):
                    self.unexpected.append(f"transition {r.status} {r.body[:200]!r}")
            except (OSError, http.client.HTTPException):
                client.close()
                self.lost()
                client = self.client()
                time.sleep(0.05)
