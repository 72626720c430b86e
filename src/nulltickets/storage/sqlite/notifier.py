"""Notifications inside one process: what the writer's commits tell this process's long-polls.

SQLite has one writer per database file, in this process, so every commit that matters is
seen here: `notify` collects (role, at_ms) during a batch, the writer takes them at its commit
(`collect`) and hands them to the subscribers once that commit is durable (with durability
`full`, after the WAL sync that covers it, together with the batch's answers). While no claim
is long-polling, a "work now" notification has nobody to wake (every later claim reads the
committed state first) and is dropped at once, and `listening` lets the service skip the
lookups it would need: measured, that keeps a transition at its cost without long-polls.
A revoked key is handed over the same way, to the `on_revoke` callbacks on the committing
thread, before the batch's callers hear that their writes committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator

from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Wake

# An after-commit callback, the loop it runs on (None: the committing thread) and what says
# whether it is wanted at all.
OnCommit = tuple[Callable[[], None], asyncio.AbstractEventLoop | None, Callable[[], bool] | None]


class LocalNotifier:
    def __init__(self) -> None:
        self._pending: list[tuple[str, int, str | None]] = []
        self._subscribers: list[tuple[Wake, asyncio.AbstractEventLoop | None]] = []
        self._waiting = 0  # long-poll claims in progress
        self._on_commit: list[OnCommit] = []
        self._revoked: list[str] = []
        self._on_revoke: list[Callable[[str | None], None]] = []

    @property
    def listening(self) -> bool:
        return self._waiting > 0 and bool(self._subscribers)

    def notify(self, b: Backend, role: str, at_ms: int, agent: str | None = None) -> None:
        if not self._subscribers or (at_ms == 0 and not self._waiting):
            return
        self._pending.append((role, at_ms, agent))

    def subscribe(self, callback: Wake, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._subscribers.append((callback, _loop_or_running(loop)))

    def on_commit(
        self,
        callback: Callable[[], None],
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        wanted: Callable[[], bool] | None = None,
    ) -> None:
        self._on_commit.append((callback, _loop_or_running(loop), wanted))

    def revoke(self, b: Backend, key_id: str) -> None:
        self._revoked.append(key_id)

    def on_revoke(self, callback: Callable[[str | None], None]) -> None:
        self._on_revoke.append(callback)

    @property
    def revocations_heard(self) -> bool:
        return True  # one process writes the file: every revocation commits here

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def collect(self) -> Callable[[], None] | None:
        """After a commit, on the committing thread (the writer's lock held, so that a batch's
        notifications stay its own): take the notifications collected during it and the
        `on_commit` callbacks that want it. Returns what hands them over, which the writer
        calls once that commit is durable, or None when there is nothing to hand over."""
        hooks = [(h, lp) for h, lp, wanted in self._on_commit if wanted is None or wanted()]
        if self._revoked:
            revoked, self._revoked = self._revoked, []
            hooks[:0] = [(functools.partial(_forget, revoked, self._on_revoke), None)]
        if not self._pending and not hooks:
            return None
        pending, self._pending = self._pending, []
        return functools.partial(_hand_over, pending, hooks, self._subscribers)


def _forget(revoked: list[str], callbacks: list[Callable[[str | None], None]]) -> None:
    for key_id in revoked:
        for callback in callbacks:
            callback(key_id)


def _hand_over(
    pending: list[tuple[str, int, str | None]],
    hooks: list[tuple[Callable[[], None], asyncio.AbstractEventLoop | None]],
    subscribers: list[tuple[Wake, asyncio.AbstractEventLoop | None]],
) -> None:
    """Tell the `on_commit` callbacks, then hand the notifications over, each on its own loop
    (directly when that is the loop running here)."""
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    for hook, hook_loop in hooks:
        if hook_loop is None or hook_loop is here:
            hook()
        elif not hook_loop.is_closed():
            hook_loop.call_soon_threadsafe(hook)
    if not pending:
        return
    for callback, loop in subscribers:
        if loop is None or loop is here:
            for role, at_ms, agent in pending:
                callback(role, at_ms, agent)
        elif not loop.is_closed():
            for role, at_ms, agent in pending:
                loop.call_soon_threadsafe(callback, role, at_ms, agent)


def _loop_or_running(loop: asyncio.AbstractEventLoop | None) -> asyncio.AbstractEventLoop | None:
    if loop is None:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None
    return loop
