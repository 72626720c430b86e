"""The claim/transition/fail decisions: pure functions of the current row and `now`.

`_reference` is the readable specification; every caller imports from here so that a compiled
implementation can take its place without touching them.
"""

from nulltickets.core._reference import (
    DEAD_LETTER_ELIGIBLE_AT,
    DEFAULT_LEASE_TTL_MS,
    MAX_LEASE_TTL_MS,
    DeadLettered,
    RetryScheduled,
    decide_failure,
    decide_transition,
    lease_ttl,
    retry_delay,
)

IMPLEMENTATION = "python"

__all__ = [
    "DEAD_LETTER_ELIGIBLE_AT",
    "DEFAULT_LEASE_TTL_MS",
    "IMPLEMENTATION",
    "MAX_LEASE_TTL_MS",
    "DeadLettered",
    "RetryScheduled",
    "decide_failure",
    "decide_transition",
    "lease_ttl",
    "retry_delay",
]
