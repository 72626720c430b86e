"""Leases expire when the clock passes them (the clock is moved, never waited for), and any
number of reapers end each expired run once, counting its failure once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import pytest

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import Claim, CreateTask, Heartbeat, RetryPolicy
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import LeaseExpired, StorageBusy
from nulltickets.service import Service, Tracker
from nulltickets.storage.ports import Database
from tests.contract.conftest import make_pipeline, run, value


def one_task(service: Service, **policy: int | str) -> str:
    pipeline_id = make_pipeline(service)
    retry = RetryPolicy(**policy) if policy else None  # type: ignore[arg-type]
    return value(run(service.create_task(CreateTask(pipeline_id, "t", "", retry_policy=retry))))


def run_events(database: Database, run_id: str) -> list[str]:
    return [e.kind for e in database.read_sync(lambda b: b.list_events(run_id, 0, 100))]


def test_a_lease_lives_until_its_expiry_and_a_heartbeat_moves_it(
    service: Service, clock: FixedClock
) -> None:
    one_task(service)
    claimed = value(run(service.claim(Claim("a", "coder", lease_ttl_ms=5000))))
    assert claimed is not None and claimed.expires_at_ms == clock() + 5000
    token = lease_token_hash(claimed.lease_token)
    clock.advance(4000)
    expires = value(run(service.heartbeat(claimed.lease_id, token, Heartbeat)))
    assert expires == clock() + 5000
    clock.advance(4999)
    assert run(service.reap_expired()) == 0
    clock.advance(1)
    with pytest.raises(LeaseExpired):
        run(service.heartbeat(claimed.lease_id, token, Heartbeat))
    assert run(service.reap_expired()) == 1


def test_concurrent_reapers_end_an_expired_run_once_and_count_it_once(
    service: Service, opened: Callable[[], Database], clock: FixedClock
) -> None:
    """Four servers' janitors reap at the same moment: one run ends stale, with one
    lease_expired event and one retry scheduled; the others find nothing to do."""
    task_id = one_task(service, retry_delay_ms=60_000)
    claimed = value(run(service.claim(Claim("a", "coder", lease_ttl_ms=1000))))
    assert claimed is not None
    clock.advance(1000)
    reapers = [(db, Tracker(db.notifier, shared=True)) for db in (opened() for _ in range(4))]
    start = threading.Barrier(len(reapers))
    reaped: list[int] = []
    lock = threading.Lock()

    def reap(database: Database, tracker: Tracker) -> None:
        start.wait()
        while True:
            try:
                n = database.write_sync(lambda b: tracker.reap_expired(b, clock()))
            except StorageBusy:
                continue
            with lock:
                reaped.append(n)
            return

    threads = [threading.Thread(target=reap, args=r) for r in reapers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(reaped) == [0, 0, 0, 1]
    assert run_events(service.db, claimed.run.id) == ["lease_expired", "retry_scheduled"]
    details = run(service.get_task(task_id))
    assert details.latest_run is not msgspec.UNSET and details.latest_run.status == "stale"
    assert details.next_eligible_at_ms == clock() + 60_000
    assert service.db.read_sync(lambda b: b.failed_attempts(task_id)) == 1


def test_a_reaper_whose_run_was_ended_meanwhile_counts_nothing(
    service: Service, database: Database, clock: FixedClock
) -> None:
    """The reaper listed the lease, but the run ended before its end_run (another server's
    transition, cancel or reaper): no lease_expired event, no failure, no retry."""
    task_id = one_task(service)
    claimed = value(run(service.claim(Claim("a", "coder", lease_ttl_ms=1000))))
    assert claimed is not None
    database.write_sync(lambda b: b.end_run(claimed.run.id, "completed", "{}", None, clock()))
    clock.advance(1000)
    assert run(service.reap_expired()) == 0
    assert run_events(database, claimed.run.id) == []
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 0
    assert database.read_sync(lambda b: b.lease_by_run(claimed.run.id)) is None


def test_expiry_past_max_attempts_dead_letters_the_task(
    service: Service, clock: FixedClock
) -> None:
    task_id = one_task(service, max_attempts=2, dead_letter_stage="dead")
    for attempt in (1, 2):
        claimed = value(run(service.claim(Claim("a", "coder", lease_ttl_ms=1000))))
        assert claimed is not None and claimed.run.attempt == attempt
        clock.advance(1000)
        run(service.reap_expired())
    details = run(service.get_task(task_id))
    assert (details.stage, details.dead_letter_reason) == ("dead", "max_attempts_exceeded")
    assert value(run(service.claim(Claim("a", "coder")))) is None
