"""Code the storage tests run in processes of their own (importable under `spawn`)."""

from __future__ import annotations

from multiprocessing.synchronize import Barrier
from typing import Any

from nulltickets.errors import StorageBusy
from nulltickets.storage.factory import open_database
from tests.storage.ops import claim


def claim_until_empty(url: str, durability: str, agent: str, start: Barrier, out: Any) -> None:
    """Open the database as a server would, claim `coder` work through the port until none is
    left, and put (agent, the claimed task ids) on `out`."""
    database = open_database(url, durability=durability)
    claimed: list[str] = []
    start.wait()
    try:
        while True:
            try:
                result = database.write_sync(lambda b: claim(b, agent=agent))
            except StorageBusy:  # a lost race or a long lock wait: claiming again is the answer
                continue
            if result is None:
                break
            claimed.append(result.task.id)
    finally:
        database.close()
        out.put((agent, claimed))
