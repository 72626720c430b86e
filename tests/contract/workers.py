"""Code the contract tests run in processes of their own (importable under `spawn`)."""

from __future__ import annotations

from multiprocessing.synchronize import Barrier
from typing import Any

from nulltickets.domain.commands import Claim
from nulltickets.errors import StorageBusy
from nulltickets.service import Tracker
from nulltickets.storage.factory import open_database


def claim_until_empty(url: str, agent: str, start: Barrier, out: Any) -> None:
    """Open the database as a server would, claim `coder` work until none is left, and put
    the claimed task ids on `out` (then None)."""
    database = open_database(url, durability="normal")
    tracker = Tracker(database.notifier)
    from nulltickets.domain.clock import wall_ms

    claimed: list[str] = []
    start.wait()
    try:
        while True:
            try:
                result = database.write_sync(
                    lambda b: tracker.claim(b, Claim(agent, "coder"), wall_ms())
                )
            except StorageBusy:  # a lost race or a long lock wait: claiming again is the answer
                continue
            if result is None:
                break
            claimed.append(result.task.id)
    finally:
        database.close()
        out.put((agent, claimed))
