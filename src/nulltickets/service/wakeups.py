"""Long-poll claims wait here for a sign that their role may have work.

The database's Notifier (storage.ports) calls `deliver(role, at_ms, agent)` for each committed
notification, on the server's loop; it becomes a wake-up, immediately or at `at_ms` (a retry
delay running out). A notification stands for one piece of work that may have become
claimable, so it wakes one waiting claim of its role, the one that has waited longest (work
assigned to an agent: that agent's claims): a new task costs one claim attempt however many
wait. A woken claim that finds nothing hands the wake-up on to a waiting claim that asks for
something else (other per-state concurrency limits), never twice to the same kind; one that
leaves without trying (gone, stopping) hands it on as it got it.

A claim remembers its role's generation before each attempt, and a notification advances it,
so one that arrives between an attempt and the wait is never lost: the claim tries again at
once instead of waiting. Waiting costs a future and a timer: no queries, no polling.

A claim held back only by its own per-state limits waits for a lease to end in a stage of that
name, in any pipeline and of any role, which no notification of its role need announce (a
transition announces freed capacity only for a stage whose policy caps it): while
such claims wait, each kind of them of a role tries again every `recheck_s` (one attempt per
kind, not per claim).

`limit` bounds the long-polls in progress, waiting or trying (the server sets it from what
the process can hold, server/launch.py); beyond it `enter` refuses, and the handler answers at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from typing import Any

from nulltickets.domain.clock import Clock, wall_ms
from nulltickets.storage.ports import EVERY_ROLE

RECHECK_S = 1.0  # how often claims held back by their own per-state limits try again


class _Wake:
    """One notification on its way from waiter to waiter: the generation it made, the agent it
    is for (None: any agent of the role), the kinds of claim that tried it and found nothing,
    and whether it is a notification (counted in /metrics) rather than a recheck."""

    __slots__ = ("agent", "generation", "notified", "tried")

    def __init__(self, generation: int, agent: str | None, *, notified: bool = True) -> None:
        self.generation = generation
        self.agent = agent
        self.notified = notified
        self.tried: set[bytes] = set()


class Poll:
    """One long-poll claim, from its admission (`Wakeups.enter`) to its answer (`leave`)."""

    __slots__ = ("_hub", "agent", "future", "kind", "role", "since", "wake")

    def __init__(self, hub: Wakeups, role: str, agent: str, kind: bytes) -> None:
        self._hub = hub
        self.role = role
        self.agent = agent
        # Claims of one kind find the same work (leaving assignments aside): the per-state
        # limits they pass, b"" for none.
        self.kind = kind
        self.since = 0  # the role's generation before the latest attempt
        self.future: asyncio.Future[None] | None = None  # set while parked
        self.wake: _Wake | None = None  # the notification that woke it, until it tried

    def trying(self) -> None:
        """Before each claim attempt."""
        self.since = self._hub.generation(self.role)

    def tried(self, took: bool) -> None:
        """After an attempt: a wake-up that found nothing goes on to another kind of claim."""
        wake, self.wake = self.wake, None
        if wake is not None and not took:
            self._hub.pass_on(self.role, wake, self.kind)

    async def wait(self, timeout_s: float, disconnected: Any = None) -> bool:
        """Wait until a notification of the role after the latest attempt, the timeout, or
        `disconnected` (an awaitable) completing. Returns False if the client went away."""
        hub = self._hub
        if hub.generation(self.role) != self.since or hub.closing:
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.future = future
        hub.park(self)
        timer = loop.call_later(timeout_s, _resolve, future)
        gone: asyncio.Future[Any] | None = None
        if disconnected is not None:
            gone = asyncio.ensure_future(disconnected)
            gone.add_done_callback(lambda _: _resolve(future))
        try:
            await future
        finally:
            timer.cancel()
            hub.unpark(self)
            self.future = None
            if gone is not None and not gone.done():
                gone.cancel()
        return gone is None or not gone.done() or gone.cancelled()

    def leave(self) -> None:
        """The claim answers: its slot is free, and a wake-up it did not use goes on."""
        hub = self._hub
        hub.polls -= 1
        wake, self.wake = self.wake, None
        if wake is not None and not hub.closing:
            hub.hand(self.role, wake)


class Wakeups:
    def __init__(
        self, clock: Clock = wall_ms, limit: int | None = None, recheck_s: float = RECHECK_S
    ) -> None:
        self._clock = clock
        self._recheck_s = recheck_s
        # Per role with claims of per-state limits parked: the timer of their next attempt.
        self._rechecks: dict[str, asyncio.TimerHandle] = {}
        self._generation: dict[str, int] = defaultdict(int)
        # Per role, the parked claims in the order they parked (a dict as an ordered set), the
        # count of each kind among them, and per (role, agent) the parked claims of that agent.
        self._parked: dict[str, dict[Poll, None]] = {}
        self._kinds: dict[str, Counter[bytes]] = {}
        self._agents: dict[tuple[str, str], dict[Poll, None]] = {}
        # (role, at_ms, agent) -> its timer and how many notifications it stands for.
        self._timers: dict[tuple[str, int, str | None], tuple[asyncio.TimerHandle, list[int]]] = {}
        self.limit = limit  # long-polls in progress at most (None: no limit)
        self.polls = 0  # long-polls in progress
        self.admitted = 0  # counters for /metrics
        self.refused = 0
        self.woken = 0
        self.closing = False  # the server is stopping: nobody waits any more

    def generation(self, role: str) -> int:
        return self._generation[role]

    def waiting(self) -> int:
        """Long-poll claims in progress (parked, or trying to claim between waits)."""
        return self.polls

    def parked(self) -> int:
        return sum(len(p) for p in self._parked.values())

    def enter(self, role: str, agent: str, kind: bytes = b"") -> Poll | None:
        """Admit a long-poll claim, or None when `limit` of them are in progress."""
        if self.limit is not None and self.polls >= self.limit:
            self.refused += 1
            return None
        self.polls += 1
        self.admitted += 1
        return Poll(self, role, agent, kind)

    # --- notifications -------------------------------------------------------------------------

    def deliver(self, role: str, at_ms: int, agent: str | None = None) -> None:
        """A notification: `role` (`agent` of it, when given) may have claimable work at
        `at_ms` (0: now)."""
        if self.closing:
            return
        if role == EVERY_ROLE:  # every role a claim has waited on: those trying too
            for known in list(self._generation):
                self.wake_all(known)
            return
        now = self._clock()
        if at_ms <= now:
            self.wake(role, agent)
        else:
            self.wake_at(role, at_ms, now, agent)

    def wake(self, role: str, agent: str | None = None) -> None:
        """One notification for `role` now: wake the claim that has waited longest (or every
        parked claim of `agent`)."""
        self._generation[role] += 1
        wake = _Wake(self._generation[role], agent)
        if agent is None:
            self.hand(role, wake)
            return
        # Only that agent can take it: each of its claims tries (there is rarely more than
        # one), and one that finds nothing hands it to no other agent.
        for poll in list(self._agents.get((role, agent), ())):
            self._give(poll, None)

    def wake_all(self, role: str) -> None:
        self._generation[role] += 1
        for poll in list(self._parked.get(role, ())):
            self._give(poll, None)

    def wake_at(self, role: str, at_ms: int, now_ms: int, agent: str | None = None) -> None:
        """One notification for `role` when the clock reaches `at_ms` (one timer per moment,
        counting the notifications it stands for)."""
        key = (role, at_ms, agent)
        known = self._timers.get(key)
        if known is not None:
            known[1][0] += 1
            return
        count = [1]
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.pop(key, None)
            for _ in range(count[0]):
                self.wake(role, agent)

        handle = loop.call_later(max(0.0, (at_ms - now_ms) / 1000), fire)
        self._timers[key] = (handle, count)

    def hand(self, role: str, wake: _Wake) -> None:
        """Give `wake` to the longest-waiting claim that may take its work: parked before it
        was made, and of a kind that has not tried it."""
        parked = self._parked.get(role)
        if not parked:
            return
        if wake.tried and all(k in wake.tried for k, n in self._kinds[role].items() if n):
            return  # every kind waiting here tried it: nobody else would find anything
        for poll in parked:  # _give changes `parked` only when it succeeds
            eligible = poll.since < wake.generation and poll.kind not in wake.tried
            if eligible and self._give(poll, wake):
                return

    def pass_on(self, role: str, wake: _Wake, kind: bytes) -> None:
        """A claim of `kind` woken by `wake` found nothing: another kind may."""
        if wake.agent is not None or self.closing:
            return
        wake.tried.add(kind)
        self.hand(role, wake)

    def _give(self, poll: Poll, wake: _Wake | None, *, count: bool = True) -> bool:
        """Wake `poll`, carrying `wake`; False if its wait already ended (timed out or gone,
        and not yet off the list)."""
        future = poll.future
        if future is None or future.done():
            return False
        self.unpark(poll)
        poll.wake = wake
        if count and (wake is None or wake.notified):
            self.woken += 1
        future.set_result(None)
        return True

    # --- parking -------------------------------------------------------------------------------

    def park(self, poll: Poll) -> None:
        role = poll.role
        self._parked.setdefault(role, {})[poll] = None
        kinds = self._kinds.get(role)
        if kinds is None:
            kinds = self._kinds[role] = Counter()
        kinds[poll.kind] += 1
        self._agents.setdefault((role, poll.agent), {})[poll] = None
        if poll.kind and role not in self._rechecks and not self.closing:
            self._recheck_later(role)

    def _recheck_later(self, role: str) -> None:
        loop = asyncio.get_running_loop()
        self._rechecks[role] = loop.call_later(self._recheck_s, self._recheck, role)

    def _recheck(self, role: str) -> None:
        """A wake-up for the role's claims of per-state limits (a claim without any is held
        back by none of them), while any is parked."""
        self._rechecks.pop(role, None)
        kinds = self._kinds.get(role)
        if self.closing or not kinds or not any(kinds):
            return
        self._generation[role] += 1
        wake = _Wake(self._generation[role], None, notified=False)
        wake.tried.add(b"")
        self.hand(role, wake)
        self._recheck_later(role)

    def unpark(self, poll: Poll) -> None:
        role = poll.role
        parked = self._parked.get(role)
        if parked is None or parked.pop(poll, False) is False:
            return
        if not parked:
            del self._parked[role]
        kinds = self._kinds[role]
        kinds[poll.kind] -= 1
        if not kinds[poll.kind]:
            del kinds[poll.kind]
            if not kinds:
                del self._kinds[role]
        key = (role, poll.agent)
        mine = self._agents.get(key)
        if mine is not None:
            mine.pop(poll, None)
            if not mine:
                del self._agents[key]

    def close(self) -> None:
        """Answer every waiter now, and every later wait at once (the server is stopping)."""
        self.closing = True
        for timer, _count in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for handle in self._rechecks.values():
            handle.cancel()
        self._rechecks.clear()
        for role in list(self._parked):
            for poll in list(self._parked.get(role, ())):
                self._give(poll, None, count=False)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
