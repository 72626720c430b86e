from __future__ import annotations

import pytest

from nulltickets import core
from nulltickets.domain.fsm import parse_definition
from nulltickets.errors import (
    ExpectedStageMismatch,
    IllegalTransition,
    InvalidLeaseTtl,
    TaskVersionMismatch,
)
from tests.server import PIPELINE

P = parse_definition(PIPELINE)
NOW = 1_000_000


def fail(**kw: object) -> core.RetryScheduled | core.DeadLettered:
    args: dict[str, object] = dict(
        stage="todo",
        max_attempts=3,
        retry_delay_ms=500,
        dead_letter_stage="dead",
        pipeline=P,
        failed_attempts=1,
        now=NOW,
    )
    args.update(kw)
    return core.decide_failure(**args)  # type: ignore[arg-type]


def test_failure_below_max_attempts_schedules_a_retry_after_the_delay() -> None:
    assert fail(failed_attempts=2) == core.RetryScheduled(2, 500, NOW + 500)


def test_unlimited_attempts_never_dead_letter() -> None:
    assert isinstance(fail(max_attempts=None, failed_attempts=10_000), core.RetryScheduled)


def test_reaching_max_attempts_dead_letters_into_a_known_stage() -> None:
    assert fail(failed_attempts=3) == core.DeadLettered(3, "todo", "dead")


def test_unknown_dead_letter_stage_dead_letters_in_place() -> None:
    assert fail(failed_attempts=3, dead_letter_stage="nowhere") == core.DeadLettered(
        3, "todo", None
    )
    assert fail(failed_attempts=3, dead_letter_stage=None).dead_letter_stage is None  # type: ignore[union-attr]


@pytest.mark.parametrize("max_attempts", [0, -5])
def test_non_positive_max_attempts_dead_letter_on_the_first_failure(max_attempts: int) -> None:
    assert isinstance(fail(max_attempts=max_attempts, failed_attempts=1), core.DeadLettered)


def test_retry_time_never_overflows_or_goes_negative() -> None:
    assert fail(retry_delay_ms=2**63).next_eligible_at_ms == 2**63 - 1  # type: ignore[union-attr]
    assert fail(retry_delay_ms=-(2**62)).next_eligible_at_ms == 0  # type: ignore[union-attr]


def test_transition_follows_the_definition() -> None:
    t = core.decide_transition(
        pipeline=P,
        stage="todo",
        task_version=1,
        trigger="submit",
        expected_stage="todo",
        expected_task_version=1,
    )
    assert (t.to_stage, t.instructions) == ("review", "review it")


def test_transition_checks_stage_then_version_then_trigger() -> None:
    with pytest.raises(ExpectedStageMismatch):
        core.decide_transition(
            pipeline=P,
            stage="todo",
            task_version=1,
            trigger="x",
            expected_stage="review",
            expected_task_version=9,
        )
    with pytest.raises(TaskVersionMismatch):
        core.decide_transition(
            pipeline=P,
            stage="todo",
            task_version=1,
            trigger="x",
            expected_stage=None,
            expected_task_version=9,
        )
    with pytest.raises(IllegalTransition):
        core.decide_transition(
            pipeline=P,
            stage="todo",
            task_version=1,
            trigger="approve",
            expected_stage=None,
            expected_task_version=None,
        )


def test_lease_ttl_defaults_rejects_non_positive_and_clamps_to_a_day() -> None:
    assert core.lease_ttl(None) == core.DEFAULT_LEASE_TTL_MS
    assert core.lease_ttl(None, default=1234) == 1234
    assert core.lease_ttl(50) == 50
    assert core.lease_ttl(10**15) == core.MAX_LEASE_TTL_MS
    for bad in (0, -1):
        with pytest.raises(InvalidLeaseTtl):
            core.lease_ttl(bad)
