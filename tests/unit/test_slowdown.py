"""The slow-down of wrong tokens and keys (http/slowdown.py), on a clock the test holds."""

from __future__ import annotations

import itertools
import math

from nulltickets.http import slowdown
from nulltickets.http.slowdown import Slowdown


def fail(s: Slowdown, times: int, sender: str = "127.0.0.1", at: float = 0.0) -> list[float]:
    return [s.delay(sender, at) for _ in range(times)]


def test_the_first_wrong_tokens_are_answered_at_once() -> None:
    assert fail(Slowdown(), slowdown.FREE - 1) == [0.0] * (slowdown.FREE - 1)


def test_past_the_free_ones_each_refusal_waits_longer_up_to_the_cap() -> None:
    s = Slowdown()
    fail(s, slowdown.FREE - 1)
    # Sent one after the other, each waiting for the previous answer.
    waits, now = [], 0.0
    for _ in range(8):
        wait = s.delay("127.0.0.1", now)
        waits.append(wait)
        now += wait
    assert waits[0] == slowdown.BASE_S
    assert all(b > a for a, b in itertools.pairwise(waits[:5]))
    assert max(waits) <= slowdown.MAX_S + 1e-9
    # Held there: the score decays while the sender waits, so the wait hovers below the cap.
    assert min(waits[5:]) >= slowdown.MAX_S / 2


def test_refusals_sent_at_once_wait_their_turn_within_the_queue_bound() -> None:
    s = Slowdown()
    fail(s, slowdown.FREE + 10)  # at the cap now
    waits = fail(s, 20, at=0.0)
    assert waits == sorted(waits)
    assert waits[0] >= slowdown.MAX_S
    assert max(waits) <= slowdown.QUEUE_S + 1e-9


def test_other_senders_are_not_slowed_down() -> None:
    s = Slowdown()
    fail(s, slowdown.FREE + 10, sender="127.0.0.1")
    assert s.delay("10.0.0.7", 0.0) == 0.0


def test_a_sender_that_stops_failing_is_forgiven_as_its_score_decays() -> None:
    s = Slowdown()
    fail(s, slowdown.FREE + 10)
    assert s.delay("127.0.0.1", 0.0) > 0
    # After long enough the score is below FREE again: answered at once.
    later = slowdown.HALF_LIFE_S * math.log2((slowdown.FREE + 12) / (slowdown.FREE - 2)) + 1
    assert s.delay("127.0.0.1", later) == 0.0


def test_the_senders_remembered_are_bounded() -> None:
    s = Slowdown()
    for n in range(slowdown.MAX_SENDERS + 50):
        s.delay(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}", 0.0)
    assert len(s._senders) == slowdown.MAX_SENDERS
