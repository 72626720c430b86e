"""Identifiers of pipelines, tasks, runs, leases and artifacts.

They are RFC 9562 version-7 UUIDs: 48 bits of Unix milliseconds, then 74 random bits, in the
usual 36-character lowercase form. The original hands out version 4 (all random); clients only
ever compare and pass them back, so the shape is what matters, and it is the same. What the
time prefix buys is locality: every index keyed by an id (runs, leases, events by run, runs by
task) grows at its right edge instead of at a random leaf, so a commit writes about half as
many pages and a checkpoint copies far fewer. Nothing secret hangs on an id: a lease is proven
by its token (tokens.py), not by knowing the run's id.

Ids sort by creation, also within one millisecond: the ids one process makes in the same
millisecond (or after the clock stepped back) take the previous id's random bits plus one
(RFC 9562, 6.2, "monotonic random"), so things made one after another list in that order.
"""

from __future__ import annotations

import os
import threading
import time

_RANDOM_BITS = 74  # 12 after the version digit, 62 after the variant bits
_LOW_BITS = 62
_LOW_MASK = (1 << _LOW_BITS) - 1
_MS_MASK = (1 << 48) - 1
_VERSION_VARIANT = 0x7 << 76 | 0b10 << 62
_lock = threading.Lock()
_last_ms = 0
_last_random = 0


def new_id() -> str:
    """A new version-7 UUID, e.g. `019ad0f2-6b1e-7c3a-9f04-2b8e5d1a7c60`, greater than every
    id this process made before."""
    global _last_ms, _last_random
    ms = time.time_ns() // 1_000_000
    with _lock:
        if ms > _last_ms:
            random = int.from_bytes(os.urandom(10)) >> (80 - _RANDOM_BITS)
        else:
            ms, random = _last_ms, _last_random + 1
            if random >> _RANDOM_BITS:  # 2^74 ids in one millisecond: borrow the next one
                ms, random = ms + 1, 0
        _last_ms, _last_random = ms, random
    # 48 bits of milliseconds, version 7, 12 random bits, variant 10, 62 random bits.
    value = (ms & _MS_MASK) << 80 | _VERSION_VARIANT | (random >> _LOW_BITS) << 64
    h = f"{value | random & _LOW_MASK:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
