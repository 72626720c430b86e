"""The `Notifier` port: wake-ups after the commit, once per notification; every commit told to
`on_commit`; revocations heard. On PostgreSQL the notifications travel by NOTIFY through the
database's own listening connection, so each test waits until it listens
(`revocations_heard`) before it relies on hearing anything."""

from __future__ import annotations

import asyncio
import threading

from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Database
from tests.conftest import wait_for
from tests.storage.ops import covers, make_pipeline

Heard = tuple[str, int, str | None]


def listens(database: Database) -> None:
    wait_for("the notifier to listen", lambda: database.notifier.revocations_heard)


@covers("Notifier.listening", "Notifier.waiting", "Notifier.revocations_heard")
def test_work_now_has_an_audience_while_a_long_poll_waits(database: Database) -> None:
    notifier = database.notifier
    notifier.subscribe(lambda role, at, agent: None)
    listens(database)
    # Only a backend that knows nobody waits (one process) may say nobody listens.
    assert notifier.listening is database.capabilities.cross_process_notifications
    with notifier.waiting():
        assert notifier.listening
        with notifier.waiting():
            assert notifier.listening
        assert notifier.listening
    assert notifier.listening is database.capabilities.cross_process_notifications
    assert notifier.revocations_heard


@covers("Notifier.notify", "Notifier.subscribe")
def test_a_unit_of_work_wakes_once_per_notification_and_names_the_agent(
    database: Database,
) -> None:
    """As tests/postgres/test_database.py checks from one database to another, here on one
    database of every backend."""
    notifier = database.notifier
    heard: list[Heard] = []
    notifier.subscribe(lambda role, at, agent: heard.append((role, at, agent)))
    listens(database)
    role, done = "coder\tx;y", "done"
    agent = 'bob;\t"\n\u00e9'  # whatever an agent id holds travels as it is

    def notifies(b: Backend) -> None:
        for _ in range(3):
            notifier.notify(b, role, 0)
        notifier.notify(b, role, 0, agent)
        notifier.notify(b, role, 0, agent)
        notifier.notify(b, role, 7)

    with notifier.waiting():  # a long-poll waits: "work now" has an audience
        database.write_sync(notifies)
        database.write_sync(lambda b: notifier.notify(b, done, 0))  # sent after the first
        wait_for("the last notification", lambda: (done, 0, None) in heard)
    mine = [h for h in heard if h[0] == role]
    assert sorted(mine, key=str) == sorted(
        [(role, 0, None)] * 3 + [(role, 0, agent)] * 2 + [(role, 7, None)], key=str
    )


@covers("Notifier.notify", "Notifier.subscribe")
def test_work_for_later_is_heard_on_the_subscribers_loop_after_the_commit(
    database: Database,
) -> None:
    """A retry delay's wake-up is sent whether or not anyone waits now; a subscriber hears it
    on its own event loop."""
    notifier = database.notifier

    async def scenario() -> tuple[list[Heard], bool]:
        loop = asyncio.get_running_loop()
        heard: list[Heard] = []
        on_loop: list[bool] = []
        got = asyncio.Event()
        loop_thread = threading.current_thread()

        def hear(role: str, at: int, agent: str | None) -> None:
            heard.append((role, at, agent))
            on_loop.append(threading.current_thread() is loop_thread)
            got.set()

        notifier.subscribe(hear, loop)
        await asyncio.to_thread(listens, database)
        await database.write(lambda b: notifier.notify(b, "coder", 30_000))
        await asyncio.wait_for(got.wait(), timeout=10)
        return heard, all(on_loop)

    heard, on_loop = asyncio.run(scenario())
    assert heard == [("coder", 30_000, None)]
    assert on_loop


@covers("Notifier.on_commit")
def test_every_commit_reaches_on_commit_even_one_that_notifies_nobody(database: Database) -> None:
    """Event streams hear of every commit: a run event wakes no claim, but its stream must read
    it, so when `on_commit` is called what the unit wrote is there to read."""

    async def scenario() -> tuple[int, str | None]:
        commits = asyncio.Event()
        count = 0

        def committed() -> None:
            nonlocal count
            count += 1
            commits.set()

        database.notifier.on_commit(committed, asyncio.get_running_loop())
        await database.write(lambda b: b.put_value("ns", "k", '"written"', 1))
        await asyncio.wait_for(commits.wait(), timeout=10)
        entry = await database.read(lambda b: b.get_value("ns", "k"))
        return count, None if entry is None else bytes(entry.value).decode()

    count, seen = asyncio.run(scenario())
    assert count >= 1 and seen == '"written"'


@covers("Notifier.on_commit")
def test_an_on_commit_callback_that_is_not_wanted_is_not_called(database: Database) -> None:
    """`wanted` is asked at each commit: False skips the call (no event stream open: no wake-up
    of the loop per commit), True lets it through again. A second callback, always wanted and
    registered after it, is called after it when both are: once that one has been called for a
    commit, so would the first have been."""

    async def scenario() -> tuple[list[str], list[str], int]:
        loop = asyncio.get_running_loop()
        want = False
        asked = 0
        calls: list[str] = []
        later = asyncio.Event()

        def wanted() -> bool:
            nonlocal asked
            asked += 1
            return want

        def after() -> None:
            calls.append("after")
            later.set()

        database.notifier.on_commit(lambda: calls.append("wanted"), loop, wanted=wanted)
        database.notifier.on_commit(after, loop)
        await database.write(lambda b: make_pipeline(b, name="a"))
        await asyncio.wait_for(later.wait(), timeout=10)
        skipped = list(calls)
        want, later = True, asyncio.Event()
        calls.clear()
        await database.write(lambda b: make_pipeline(b, name="b"))
        await asyncio.wait_for(later.wait(), timeout=10)
        return skipped, calls, asked

    skipped, let_through, asked = asyncio.run(scenario())
    assert "wanted" not in skipped and "after" in skipped
    assert let_through.index("wanted") < let_through.index("after")
    assert asked >= 2


@covers("Notifier.revoke", "Notifier.on_revoke")
def test_a_committed_revocation_reaches_every_on_revoke_callback(database: Database) -> None:
    heard: list[str | None] = []
    also: list[str | None] = []
    database.notifier.on_revoke(heard.append)
    database.notifier.on_revoke(also.append)
    listens(database)
    database.write_sync(lambda b: database.notifier.revoke(b, "key-1"))
    database.write_sync(lambda b: database.notifier.revoke(b, "key-2"))
    wait_for("both revocations", lambda: "key-2" in heard and "key-2" in also)
    assert [k for k in heard if k is not None] == ["key-1", "key-2"]
    assert [k for k in also if k is not None] == ["key-1", "key-2"]
