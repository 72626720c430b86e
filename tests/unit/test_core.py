from __future__ import annotations

from types import ModuleType

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

# Every test runs against the interpreted core, and against the compiled one where it was built.
IMPLEMENTATIONS = [core.load(pure_python=True)]
if core.load().COMPILED:
    IMPLEMENTATIONS.append(core.load())


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda m: "compiled" if m.COMPILED else "python")
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param  # type: ignore[no-any-return]


def fail(impl: ModuleType, **kw: object) -> object:
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
    return impl.decide_failure(**args)


def test_failure_below_max_attempts_schedules_a_retry_after_the_delay(impl: ModuleType) -> None:
    assert fail(impl, failed_attempts=2) == impl.RetryScheduled(2, 500, NOW + 500)


def test_unlimited_attempts_never_dead_letter(impl: ModuleType) -> None:
    assert isinstance(fail(impl, max_attempts=None, failed_attempts=10_000), impl.RetryScheduled)


def test_reaching_max_attempts_dead_letters_into_a_known_stage(impl: ModuleType) -> None:
    assert fail(impl, failed_attempts=3) == impl.DeadLettered(3, "todo", "dead")


def test_unknown_dead_letter_stage_dead_letters_in_place(impl: ModuleType) -> None:
    assert fail(impl, failed_attempts=3, dead_letter_stage="nowhere") == impl.DeadLettered(
        3, "todo", None
    )
    assert fail(impl, failed_attempts=3, dead_letter_stage=None).dead_letter_stage is None  # type: ignore[union-attr]


@pytest.mark.parametrize("max_attempts", [0, -5])
def test_non_positive_max_attempts_dead_letter_on_the_first_failure(
    impl: ModuleType, max_attempts: int
) -> None:
    assert isinstance(fail(impl, max_attempts=max_attempts, failed_attempts=1), impl.DeadLettered)


def test_retry_time_never_overflows_or_goes_negative(impl: ModuleType) -> None:
    assert fail(impl, retry_delay_ms=2**63).next_eligible_at_ms == 2**63 - 1  # type: ignore[union-attr]
    assert fail(impl, retry_delay_ms=-(2**62)).next_eligible_at_ms == 0  # type: ignore[union-attr]


def test_transition_follows_the_definition(impl: ModuleType) -> None:
    t = impl.decide_transition(
        pipeline=P,
        stage="todo",
        task_version=1,
        trigger="submit",
        expected_stage="todo",
        expected_task_version=1,
    )
    assert (t.to_stage, t.instructions) == ("review", "review it")


def test_transition_checks_stage_then_version_then_trigger(impl: ModuleType) -> None:
    with pytest.raises(ExpectedStageMismatch):
        impl.decide_transition(
            pipeline=P,
            stage="todo",
            task_version=1,
            trigger="x",
            expected_stage="review",
            expected_task_version=9,
        )
    with pytest.raises(TaskVersionMismatch):
        impl.decide_transition(
            pipeline=P,
            stage="todo",
            task_version=1,
            trigger="x",
            expected_stage=None,
            expected_task_version=9,
        )
    with pytest.raises(IllegalTransition):
        impl.decide_transition(
            pipeline=P,
            stage="todo",
            task_version=1,
            trigger="approve",
            expected_stage=None,
            expected_task_version=None,
        )


def test_lease_ttl_defaults_rejects_non_positive_and_clamps_to_a_day(impl: ModuleType) -> None:
    assert impl.lease_ttl(None) == impl.DEFAULT_LEASE_TTL_MS
    assert impl.lease_ttl(None, default=1234) == 1234
    assert impl.lease_ttl(50) == 50
    assert impl.lease_ttl(10**15) == impl.MAX_LEASE_TTL_MS
    for bad in (0, -1):
        with pytest.raises(InvalidLeaseTtl):
            impl.lease_ttl(bad)


def test_backoff_grows_the_delay_per_failure_up_to_the_cap(impl: ModuleType) -> None:
    delays = [
        impl.retry_delay(
            100, backoff=2.0, max_delay_ms=500, jitter=0.0, failed_attempts=n, rand=0.5
        )
        for n in range(1, 6)
    ]
    assert delays == [100, 200, 400, 500, 500]


def test_jitter_moves_the_delay_by_at_most_its_fraction(impl: ModuleType) -> None:
    low = impl.retry_delay(
        1000, backoff=1.0, max_delay_ms=None, jitter=0.2, failed_attempts=1, rand=0.0
    )
    high = impl.retry_delay(
        1000, backoff=1.0, max_delay_ms=None, jitter=0.2, failed_attempts=1, rand=0.999999
    )
    assert (low, high) == (800, 1199)


def test_huge_backoff_saturates_instead_of_overflowing(impl: ModuleType) -> None:
    delay = impl.retry_delay(
        10**12, backoff=100.0, max_delay_ms=None, jitter=0.0, failed_attempts=60, rand=0.5
    )
    assert delay == 2**63 - 1


def test_without_a_delay_the_first_two_failures_retry_at_once(impl: ModuleType) -> None:
    for n in (1, 2):
        assert fail(impl, retry_delay_ms=None, failed_attempts=n) == impl.RetryScheduled(n, 0, NOW)


def test_the_default_backoff_doubles_from_a_second_up_to_five_minutes(impl: ModuleType) -> None:
    delays = [impl.default_retry_delay(n, 0.5) for n in range(1, 14)]
    assert (
        delays
        == [0, 0, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 256000] + [300_000] * 2
    )
    assert fail(
        impl, retry_delay_ms=None, max_attempts=None, failed_attempts=4
    ) == impl.RetryScheduled(4, 2000, NOW + 2000)
    assert impl.default_retry_delay(10**6, 0.5) == 300_000  # no overflow, however many


def test_the_default_backoff_has_a_fifth_of_jitter(impl: ModuleType) -> None:
    assert impl.default_retry_delay(3, 0.0) == 800
    assert impl.default_retry_delay(3, 0.999999) == 1199
    assert impl.default_retry_delay(11, 0.999999) == 300_000  # capped after the jitter


def test_the_default_backoff_still_dead_letters_at_max_attempts(impl: ModuleType) -> None:
    assert fail(impl, retry_delay_ms=None, failed_attempts=3) == impl.DeadLettered(
        3, "todo", "dead"
    )
