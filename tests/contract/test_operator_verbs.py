"""Cancel and requeue (operator verbs) on any backend."""

from __future__ import annotations

import msgspec
import pytest

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import CancelTask, Claim, CreateTask, Heartbeat, RequeueTask
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import TaskCancelled, TaskLeased
from nulltickets.service import Service
from tests.contract.conftest import make_pipeline, run, value


def test_cancel_revokes_the_live_lease_and_requeue_makes_the_task_claimable(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)
    task_id = value(run(service.create_task(CreateTask(pipeline_id, "t", ""))))
    claimed = value(run(service.claim(Claim("a", "coder"))))
    assert claimed is not None
    with pytest.raises(TaskLeased):
        run(service.requeue(task_id, RequeueTask()))
    details = value(run(service.cancel(task_id, CancelTask(reason="wrong plan"))))
    assert (details.dead_letter_reason, details.cancel_reason) == ("cancelled", "wrong plan")
    assert details.latest_run is not msgspec.UNSET and details.latest_run.status == "cancelled"
    with pytest.raises(TaskCancelled):
        token = lease_token_hash(claimed.lease_token)
        run(service.heartbeat(claimed.lease_id, token, Heartbeat))
    assert value(run(service.claim(Claim("b", "coder")))) is None
    again = value(run(service.cancel(task_id, CancelTask(reason="twice"))))
    assert again.cancel_reason == "wrong plan"  # cancelling again changes nothing
    requeued = value(run(service.requeue(task_id, RequeueTask(reason="fixed"))))
    assert requeued.dead_letter_reason is None and requeued.cancelled_at_ms is msgspec.UNSET
    reclaimed = value(run(service.claim(Claim("b", "coder"))))
    assert reclaimed is not None and reclaimed.task.id == task_id
    assert reclaimed.run.attempt == 2
    kinds = [e.kind for e in run(service.list_task_events(task_id, 0, 10))[0]]
    assert kinds == ["cancelled", "requeued"]
