"""The claim/transition/fail decisions: pure functions of the current row and `now`. No I/O.

Written in Cython's pure-Python mode: interpreted as it is, or compiled (the `cython.*` names
below then type the locals). Both run the same test suite.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import cython
except ModuleNotFoundError:  # interpreted where Cython is not installed
    from nulltickets._cext import _cython_shim as cython

from nulltickets.domain.fsm import Pipeline, Transition
from nulltickets.errors import (
    ExpectedStageMismatch,
    IllegalTransition,
    InvalidLeaseTtl,
    TaskVersionMismatch,
)

# The original parks dead-lettered tasks at this eligibility time; kept for compatibility.
DEAD_LETTER_ELIGIBLE_AT = 9_223_372_036_854_775_000
DEFAULT_LEASE_TTL_MS = 300_000
MAX_LEASE_TTL_MS = 86_400_000
_MAX_TIME = 2**63 - 1

# The default backoff, for a task that sets no retry delay in a stage that sets none: the first
# DEFAULT_IMMEDIATE_RETRIES failures are retried at once (as the original retries every one),
# then the delay starts at DEFAULT_RETRY_DELAY_MS and doubles per failure, +/- 20 % at random,
# up to DEFAULT_RETRY_MAX_DELAY_MS. A command that fails at once is then tried a handful of
# times a minute at first and every few minutes later, instead of in a loop at full speed.
DEFAULT_IMMEDIATE_RETRIES = 2
DEFAULT_RETRY_DELAY_MS = 1_000
DEFAULT_RETRY_BACKOFF = 2.0
DEFAULT_RETRY_MAX_DELAY_MS = 300_000
DEFAULT_RETRY_JITTER = 0.2


COMPILED: bool = cython.compiled


def lease_ttl(requested: int | None, default: int = DEFAULT_LEASE_TTL_MS) -> int:
    """Validate a requested lease TTL: absent -> default, <= 0 rejected, clamped to 24 h."""
    if requested is None:
        return default
    if requested <= 0:
        raise InvalidLeaseTtl()
    return min(requested, MAX_LEASE_TTL_MS)


@dataclass(frozen=True, slots=True)
class RetryScheduled:
    failed_attempts: int
    retry_delay_ms: int
    next_eligible_at_ms: int


@dataclass(frozen=True, slots=True)
class DeadLettered:
    failed_attempts: int
    from_stage: str
    dead_letter_stage: str | None  # None: the task stays where it is
    reason: str = "max_attempts_exceeded"


@cython.locals(exponent=cython.longlong, grown=cython.double)
def retry_delay(
    base_ms: int,
    *,
    backoff: float,
    max_delay_ms: int | None,
    jitter: float,
    failed_attempts: int,
    rand: float,
) -> int:
    """The delay before retry number `failed_attempts`: `base * backoff^(n-1)`, capped at
    `max_delay_ms`, then moved by up to +/- `jitter` of itself (`rand` in [0, 1))."""
    if backoff == 1.0 and jitter == 0.0:
        delay = base_ms
    else:
        exponent = min(max(failed_attempts - 1, 0), 64)
        grown = float(base_ms) * backoff**exponent
        grown *= 1.0 + jitter * (2.0 * rand - 1.0)
        delay = min(int(min(grown, 9.3e18)), _MAX_TIME)  # saturate, never overflow
    if max_delay_ms is not None:
        delay = min(delay, max_delay_ms)
    return delay


def default_retry_delay(failed_attempts: int, rand: float) -> int:
    """The default backoff's delay before retry number `failed_attempts` (see above)."""
    if failed_attempts <= DEFAULT_IMMEDIATE_RETRIES:
        return 0
    delay: int = retry_delay(
        DEFAULT_RETRY_DELAY_MS,
        backoff=DEFAULT_RETRY_BACKOFF,
        max_delay_ms=DEFAULT_RETRY_MAX_DELAY_MS,
        jitter=DEFAULT_RETRY_JITTER,
        failed_attempts=failed_attempts - DEFAULT_IMMEDIATE_RETRIES,
        rand=rand,
    )
    return delay


def decide_failure(
    *,
    stage: str,
    max_attempts: int | None,
    retry_delay_ms: int | None,
    dead_letter_stage: str | None,
    pipeline: Pipeline | None,
    failed_attempts: int,
    now: int,
    backoff: float = 1.0,
    max_delay_ms: int | None = None,
    jitter: float = 0.0,
    rand: float = 0.5,
) -> RetryScheduled | DeadLettered:
    """Decide what a failed attempt does to its task.

    `failed_attempts` counts every failed attempt of the task so far, this one included.
    `max_attempts` is the number of failures allowed (None: retry forever; <= 0: the first
    failure dead-letters). The dead-letter stage is used only if it names a state of the
    task's pipeline. The retry delay grows by `backoff` per failure (see `retry_delay`);
    `retry_delay_ms` None (neither the task nor its stage sets a delay) is the default backoff.
    """
    if max_attempts is not None and failed_attempts >= max_attempts:
        usable = (
            dead_letter_stage
            if dead_letter_stage is not None
            and pipeline is not None
            and dead_letter_stage in pipeline.states
            else None
        )
        return DeadLettered(failed_attempts, stage, usable)
    if retry_delay_ms is None:
        delay = default_retry_delay(failed_attempts, rand)
    else:
        delay = retry_delay(
            retry_delay_ms,
            backoff=backoff,
            max_delay_ms=max_delay_ms,
            jitter=jitter,
            failed_attempts=failed_attempts,
            rand=rand,
        )
    at = max(0, min(now + delay, _MAX_TIME))
    return RetryScheduled(failed_attempts, delay, at)


def decide_transition(
    *,
    pipeline: Pipeline,
    stage: str,
    task_version: int,
    trigger: str,
    expected_stage: str | None,
    expected_task_version: int | None,
) -> Transition:
    """Return the transition to apply, or raise why the request may not move the task."""
    if expected_stage is not None and expected_stage != stage:
        raise ExpectedStageMismatch(
            f"task is in stage {stage!r}, not the expected {expected_stage!r}"
        )
    if expected_task_version is not None and expected_task_version != task_version:
        raise TaskVersionMismatch(
            f"task_version is {task_version}, not the expected {expected_task_version}"
        )
    transition = pipeline.find_transition(stage, trigger)
    if transition is None:
        raise IllegalTransition(f"no transition from stage {stage!r} on trigger {trigger!r}")
    return transition
