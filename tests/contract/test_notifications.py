"""The notifier tells subscribers which roles may have work, after the commit, and tells
`on_commit` callbacks of every commit."""

from __future__ import annotations

import asyncio

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import AppendEvent, Claim, CreateTask, FailRun, RetryPolicy
from nulltickets.domain.model import FeedEvent
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.service import Service
from tests.contract.conftest import make_pipeline, run, value


def test_a_new_task_and_a_retry_delay_reach_a_subscriber(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)

    async def scenario() -> list[tuple[str, int]]:
        heard: list[tuple[str, int]] = []
        got = asyncio.Event()

        def hear(role: str, at_ms: int, agent: str | None) -> None:
            heard.append((role, at_ms))
            got.set()

        service.notifier.subscribe(hear, asyncio.get_running_loop())

        async def next_one() -> None:
            await asyncio.wait_for(got.wait(), timeout=10)
            got.clear()

        with service.notifier.waiting():  # a long-poll is waiting: "work now" has an audience
            retry = RetryPolicy(retry_delay_ms=30_000)
            value(await service.create_task(CreateTask(pipeline_id, "t", "", retry_policy=retry)))
            await next_one()
            claimed = value(await service.claim(Claim("a", "coder")))
            assert claimed is not None
            token = lease_token_hash(claimed.lease_token)
            heard.clear()
            value(await service.fail(claimed.run.id, token, lambda: FailRun("boom")))
            while ("coder", clock() + 30_000) not in heard:
                await next_one()
        return heard

    heard = asyncio.run(scenario())
    assert ("coder", clock() + 30_000) in heard
    assert all(role == "coder" for role, _ in heard)


def test_every_commit_reaches_on_commit_even_one_that_notifies_no_role(
    service: Service, clock: FixedClock
) -> None:
    """Event streams hear of every commit: a run event wakes no claim (and with nobody
    long-polling, "work now" is not even sent), but its stream must read it."""
    pipeline_id = make_pipeline(service)
    value(run(service.create_task(CreateTask(pipeline_id, "t", ""))))
    claimed = value(run(service.claim(Claim("a", "coder"))))
    assert claimed is not None
    token = lease_token_hash(claimed.lease_token)

    async def scenario() -> tuple[int, list[FeedEvent]]:
        commits = asyncio.Event()
        service.notifier.on_commit(commits.set, asyncio.get_running_loop())
        if not service.db.capabilities.cross_process_notifications:
            # In one process nobody waits, so no role is notified; across processes another
            # server's claims may wait, so the notifier always listens there.
            assert not service.notifier.listening
        after = await service.last_event_id()
        value(await service.append_event(claimed.run.id, token, lambda: AppendEvent("progress")))
        await asyncio.wait_for(commits.wait(), timeout=10)
        return after, await service.events_feed(after, 10)

    after, feed = asyncio.run(scenario())
    assert [e.kind for e in feed] == ["progress"]
    assert feed[0].id > after


def test_an_on_commit_callback_that_is_not_wanted_is_not_called(service: Service) -> None:
    """`wanted` is asked at each commit: False skips the call (no event stream open: no wake-up
    of the loop per commit), True lets it through again. A second callback, always wanted and
    registered after it, is called after it when both are: once that one has been called for a
    commit, so would the first have been."""
    pipeline_id = make_pipeline(service)

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

        service.notifier.on_commit(lambda: calls.append("wanted"), loop, wanted=wanted)
        service.notifier.on_commit(after, loop)
        value(await service.create_task(CreateTask(pipeline_id, "a", "")))
        await asyncio.wait_for(later.wait(), timeout=10)
        skipped = list(calls)
        want, later = True, asyncio.Event()
        calls.clear()
        value(await service.create_task(CreateTask(pipeline_id, "b", "")))
        await asyncio.wait_for(later.wait(), timeout=10)
        return skipped, calls, asked

    skipped, let_through, asked = asyncio.run(scenario())
    assert "wanted" not in skipped and "after" in skipped
    assert let_through.index("wanted") < let_through.index("after")
    assert asked >= 2


def test_stats_are_numbers_by_name(service: Service) -> None:
    make_pipeline(service)
    found = service.storage_stats()
    stats = found.figures
    assert all(isinstance(k, str) and isinstance(v, int | float) for k, v in stats.items())
    commits, _ = found.histograms["commit_duration_seconds"].snapshot()
    assert sum(commits) >= 1  # every backend times its commits
    if service.db.capabilities.group_commit:  # SQLite's writer counts its batches
        assert stats["writer_batches"] >= 1
        assert stats["writer_jobs"] >= stats["writer_batches"]
        sizes, total = found.histograms["writer_batch_size"].snapshot()
        assert (sum(sizes), total) == (stats["writer_batches"], stats["writer_jobs"])
