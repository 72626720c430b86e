"""service/wakeups.py: one notification wakes one waiting claim (the longest waiting, or the agent
the work is assigned to); a wake-up nobody used goes on; the limit refuses at once. Futures on
an event loop, no sockets and no sleeping (every wait's timeout is far away)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nulltickets.service.wakeups import Poll, Wakeups
from nulltickets.storage.ports import EVERY_ROLE

FAR = 3600.0  # a wait's timeout that never comes in a test


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Waiter:
    """A long-poll claim parked in `hub`: its task ends when the wait does."""

    def __init__(self, hub: Wakeups, agent: str, role: str = "coder", kind: bytes = b"") -> None:
        poll = hub.enter(role, agent, kind)
        assert poll is not None
        self.poll: Poll = poll
        poll.trying()
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.ensure_future(poll.wait(FAR, self.gone))

    @property
    def woken(self) -> bool:
        return self.task.done()


def test_a_notification_wakes_only_the_claim_that_waited_longest() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        waiters = [Waiter(hub, f"a{i}") for i in range(100)]
        await settle()
        hub.deliver("coder", 0)
        await settle()
        assert [w.woken for w in waiters] == [True] + [False] * 99
        assert hub.woken == 1
        hub.deliver("coder", 0)
        await settle()
        assert [w.woken for w in waiters[:3]] == [True, True, False]
        hub.close()

    run(scenario)


def test_a_notification_of_another_role_wakes_nobody() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        waiter = Waiter(hub, "a")
        await settle()
        hub.deliver("reviewer", 0)
        await settle()
        assert not waiter.woken
        hub.close()

    run(scenario)


def test_a_claim_that_tried_and_took_a_task_uses_up_its_wake_up() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        first, second = Waiter(hub, "a"), Waiter(hub, "b")
        await settle()
        hub.deliver("coder", 0)
        await settle()
        first.poll.trying()
        first.poll.tried(took=True)
        first.poll.leave()
        await settle()
        assert not second.woken
        hub.close()

    run(scenario)


def test_a_woken_claim_that_finds_nothing_passes_on_to_another_kind_only() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        limited = Waiter(hub, "a", kind=b'{"todo":1}')
        plain = Waiter(hub, "b")
        plain_too = Waiter(hub, "c")
        await settle()
        hub.deliver("coder", 0)
        await settle()
        assert (limited.woken, plain.woken) == (True, False)
        # Its per-state limit kept it from the work: a claim without one may take it.
        limited.poll.trying()
        limited.poll.tried(took=False)
        await settle()
        assert plain.woken and not plain_too.woken
        # A plain claim found nothing either: no other plain claim would, so it stops here.
        plain.poll.trying()
        plain.poll.tried(took=False)
        await settle()
        assert not plain_too.woken
        hub.close()

    run(scenario)


def test_claims_held_back_by_their_own_limits_try_again_one_per_kind_uncounted() -> None:
    """Freed capacity in a stage of the same name elsewhere is announced to nobody: while
    claims of per-state limits wait, one of each kind tries again every recheck_s; a plain
    claim is not woken by it, nor is the recheck counted as a notification."""

    async def scenario() -> None:
        hub = Wakeups(recheck_s=0.3)  # far beyond the steps between the checks below
        plain = Waiter(hub, "p")
        first = Waiter(hub, "a", kind=b'{"todo":1}')
        second = Waiter(hub, "b", kind=b'{"todo":1}')
        other = Waiter(hub, "c", kind=b'{"review":1}')
        for _ in range(2_000):
            if first.woken:
                break
            await asyncio.sleep(0.002)
        assert first.woken and not plain.woken and not second.woken
        first.poll.trying()
        first.poll.tried(took=False)  # still held back: the next kind tries, not its own
        await settle()
        assert other.woken and not second.woken and not plain.woken
        assert hub.woken == 0
        first.poll.leave()
        other.poll.leave()
        hub.close()
        await settle()
        assert second.woken and plain.woken

    run(scenario)


def test_plain_claims_alone_are_never_rechecked() -> None:
    async def scenario() -> None:
        hub = Wakeups(recheck_s=0.001)
        plain = Waiter(hub, "p")
        await asyncio.sleep(0.05)
        assert not plain.woken
        hub.close()

    run(scenario)


def test_a_woken_claim_that_leaves_without_trying_hands_its_wake_up_on() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        first, second = Waiter(hub, "a"), Waiter(hub, "b")
        await settle()
        hub.deliver("coder", 0)
        await settle()
        assert first.woken
        first.poll.leave()  # gone, say: it never tried
        await settle()
        assert second.woken
        hub.close()

    run(scenario)


def test_a_wait_that_just_ended_does_not_swallow_a_wake_up() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        first, second = Waiter(hub, "a"), Waiter(hub, "b")
        await settle()
        assert first.poll.future is not None
        first.poll.future.set_result(None)  # as its timer does: it resumes on the next turn
        hub.deliver("coder", 0)
        await settle()
        assert second.woken
        assert first.poll.wake is None
        hub.close()

    run(scenario)


def test_a_claim_whose_client_left_as_it_was_woken_hands_the_wake_up_on() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        first, second = Waiter(hub, "a"), Waiter(hub, "b")
        await settle()
        first.gone.set_result(None)  # its client went away; its wait ends on the next turn
        hub.deliver("coder", 0)
        await settle()
        assert first.task.result() is False  # it reports the client gone ...
        assert not second.woken
        first.poll.leave()  # ... so the handler answers without trying
        await settle()
        assert second.woken
        hub.close()

    run(scenario)


def test_work_assigned_to_an_agent_wakes_that_agent_however_long_others_waited() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        others = [Waiter(hub, f"a{i}") for i in range(10)]
        bob = Waiter(hub, "bob")
        await settle()
        hub.deliver("coder", 0, "bob")
        await settle()
        assert bob.woken and not any(w.woken for w in others)
        # Nobody else may take bob's task: finding nothing, bob hands it to no one.
        bob.poll.trying()
        bob.poll.tried(took=False)
        await settle()
        assert not any(w.woken for w in others)
        hub.close()

    run(scenario)


def test_a_notification_between_an_attempt_and_the_wait_is_not_lost() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        poll = hub.enter("coder", "a")
        assert poll is not None
        poll.trying()
        hub.deliver("coder", 0)  # while its attempt was running
        assert await asyncio.wait_for(poll.wait(FAR), 1) is True  # at once
        hub.close()

    run(scenario)


def test_two_notifications_for_the_same_moment_wake_two_claims_then() -> None:
    async def scenario() -> None:
        now = [1_000]
        hub = Wakeups(clock=lambda: now[0])
        waiters = [Waiter(hub, f"a{i}") for i in range(3)]
        await settle()
        # For a moment 0.5 s away: far enough that settling cannot outlast it on a busy machine.
        hub.deliver("coder", 1_500)
        hub.deliver("coder", 1_500)
        await settle()
        assert not any(w.woken for w in waiters)
        await asyncio.sleep(0.6)  # the timer's 0.5 s
        await settle()
        assert [w.woken for w in waiters] == [True, True, False]
        hub.close()

    run(scenario)


def test_every_role_wakes_every_waiting_claim() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        waiters = [Waiter(hub, f"a{i}", role=f"r{i % 3}") for i in range(9)]
        trying = hub.enter("r9", "between-waits")  # of a role nobody is parked on
        assert trying is not None
        trying.trying()
        await settle()
        hub.deliver(EVERY_ROLE, 0)
        await settle()
        assert all(w.woken for w in waiters)
        assert await asyncio.wait_for(trying.wait(FAR), 1) is True  # it tries again at once
        hub.close()

    run(scenario)


def test_beyond_the_limit_a_claim_is_refused_and_counted() -> None:
    async def scenario() -> None:
        hub = Wakeups(limit=2)
        first, second = hub.enter("coder", "a"), hub.enter("coder", "b")
        assert first is not None and second is not None
        assert hub.enter("coder", "c") is None
        assert (hub.waiting(), hub.admitted, hub.refused) == (2, 2, 1)
        first.leave()
        assert hub.enter("coder", "c") is not None
        assert (hub.waiting(), hub.admitted, hub.refused) == (2, 3, 1)

    run(scenario)


def test_closing_answers_every_waiting_claim_and_every_later_wait_at_once() -> None:
    async def scenario() -> None:
        hub = Wakeups()
        waiters = [Waiter(hub, f"a{i}") for i in range(5)]
        await settle()
        hub.close()
        await settle()
        assert all(w.woken for w in waiters)
        late = hub.enter("coder", "late")
        assert late is not None
        late.trying()
        assert await asyncio.wait_for(late.wait(FAR), 1) is True
        assert hub.woken == 0  # closing is no wake-up

    run(scenario)
