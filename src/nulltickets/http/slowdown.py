"""Wrong tokens and keys slow their sender down; nothing is ever locked out.

Each sender (the peer's address) has a score of its recent wrong tokens and keys: +1 for each,
halving every HALF_LIFE_S. While the score is below FREE a refusal is answered at once (a
person mistyping, a client sent the wrong token once, a test suite probing the gate). Past it,
each refusal waits BASE_S, twice that for the next one, and so on up to MAX_S, and a sender's
refusals wait their turn one after the other (at most QUEUE_S ahead), so many connections at
once gain a guesser nothing. Held up to the steady state, a sender gets about
FREE * ln 2 / HALF_LIFE_S wrong guesses a second (0.6 with the values below).

Only refusals wait: a valid token or key is never delayed, whoever sends it, so the agents that
share an address with a sender that keeps failing (127.0.0.1) go on at full speed. At most
MAX_SENDERS senders are remembered (the least recently refused is forgotten first): a few
hundred kilobytes at most.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

FREE = 500
HALF_LIFE_S = 600.0
BASE_S = 0.1
MAX_S = 2.0
QUEUE_S = 10.0
MAX_SENDERS = 10_000


@dataclass(slots=True)
class _Sender:
    score: float
    at: float  # when the score was last brought up to date
    ready: float  # when the sender's last delayed refusal is answered


class Slowdown:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._senders: dict[str, _Sender] = {}

    def delay(self, sender: str, now: float) -> float:
        """Count one more refusal for `sender` at `now`; how long its answer waits."""
        entry = self._senders.pop(sender, None)  # re-inserted last: the most recently refused
        if entry is None:
            entry = _Sender(0.0, now, now)
            if len(self._senders) >= MAX_SENDERS:
                del self._senders[next(iter(self._senders))]
        elapsed = max(0.0, now - entry.at)
        entry.score = entry.score * math.pow(0.5, elapsed / HALF_LIFE_S) + 1.0
        entry.at = now
        self._senders[sender] = entry
        if entry.score < FREE:
            return 0.0
        step = min(MAX_S, BASE_S * math.pow(2.0, entry.score - FREE))
        answer_at = min(max(now, entry.ready) + step, now + QUEUE_S)
        entry.ready = answer_at
        return answer_at - now

    async def refused(self, sender: str) -> None:
        """Wait before a refusal of `sender` is sent."""
        wait = self.delay(sender, self._clock())
        if wait > 0:
            await asyncio.sleep(wait)
