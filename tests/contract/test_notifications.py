"""The notifier tells subscribers which roles may have work, after the commit."""

from __future__ import annotations

import asyncio

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import Claim, CreateTask, FailRun, RetryPolicy
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.service import Service
from tests.contract.conftest import make_pipeline, value


def test_a_new_task_and_a_retry_delay_reach_a_subscriber(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)

    async def scenario() -> list[tuple[str, int]]:
        heard: list[tuple[str, int]] = []
        got = asyncio.Event()

        def hear(role: str, at_ms: int) -> None:
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
