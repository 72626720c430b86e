"""Long-poll claims wait here for a sign that their role may have work.

The database's Notifier (storage.ports) calls `deliver(role, at_ms)` for each committed
notification, on the server's loop; it becomes a wake-up, immediately or at `at_ms` (a retry
delay running out). A waiter remembers its role's
generation before it last tried to claim, so a wake-up between that attempt and the wait is
never lost. Waiting costs a future and a timer: no queries, no polling.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from nulltickets.domain.clock import Clock, wall_ms
from nulltickets.storage.ports import EVERY_ROLE


class Wakeups:
    def __init__(self, clock: Clock = wall_ms) -> None:
        self._clock = clock
        self._generation: dict[str, int] = defaultdict(int)
        self._waiters: dict[str, set[asyncio.Future[None]]] = defaultdict(set)
        self._timers: dict[tuple[str, int], asyncio.TimerHandle] = {}
        self.closing = False  # the server is stopping: nobody waits any more

    def generation(self, role: str) -> int:
        return self._generation[role]

    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def deliver(self, role: str, at_ms: int) -> None:
        """A notification: `role` may have claimable work at `at_ms` (0: now)."""
        if self.closing:
            return
        if role == EVERY_ROLE:
            for waiting in list(self._waiters):
                self.wake(waiting)
            return
        now = self._clock()
        if at_ms <= now:
            self.wake(role)
        else:
            self.wake_at(role, at_ms, now)

    def wake(self, role: str) -> None:
        self._generation[role] += 1
        waiters = self._waiters.pop(role, None)
        for future in waiters or ():
            if not future.done():
                future.set_result(None)

    def wake_at(self, role: str, at_ms: int, now_ms: int) -> None:
        """Wake `role`'s waiters when the clock reaches `at_ms` (one timer per moment)."""
        key = (role, at_ms)
        if key in self._timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(key, None)
            self.wake(role)

        self._timers[key] = loop.call_later(max(0.0, (at_ms - now_ms) / 1000), fire)

    async def wait(self, role: str, since: int, timeout_s: float, disconnected: Any = None) -> bool:
        """Wait until `role` is woken after generation `since`, the timeout passes, or
        `disconnected` (an awaitable) completes. Returns False if the client went away."""
        if self._generation[role] != since or self.closing:
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiters[role].add(future)
        timer = loop.call_later(timeout_s, _resolve, future)
        gone: asyncio.Future[Any] | None = None
        if disconnected is not None:
            gone = asyncio.ensure_future(disconnected)
            gone.add_done_callback(lambda _: _resolve(future))
        try:
            await future
        finally:
            timer.cancel()
            self._waiters[role].discard(future)
            if gone is not None and not gone.done():
                gone.cancel()
        return gone is None or not gone.done() or gone.cancelled()

    def close(self) -> None:
        """Answer every waiter now, and every later wait at once (the server is stopping)."""
        self.closing = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for waiters in self._waiters.values():
            for future in waiters:
                if not future.done():
                    future.set_result(None)
        self._waiters.clear()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
