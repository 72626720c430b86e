"""Identifiers of pipelines, tasks, runs, leases and artifacts.

They are RFC 9562 version-7 UUIDs: 48 bits of Unix milliseconds, then 74 random bits, in the
usual 36-character lowercase form. The original hands out version 4 (all random); clients only
ever compare and pass them back, so the shape is what matters, and it is the same. What the
time prefix buys is locality: every index keyed by an id (runs, leases, events by run, runs by
task) grows at its right edge instead of at a random leaf, so a commit writes about half as
many pages and a checkpoint copies far fewer. Ids also sort by creation time. Nothing secret
hangs on an id: a lease is proven by its token (tokens.py), not by knowing the run's id.
"""

from __future__ import annotations

import os
import time

_VARIANT = "89ab89ab89ab89ab"  # the RFC variant bits (10xx) over the random hex digit


def new_id() -> str:
    """A new version-7 UUID, e.g. `019ad0f2-6b1e-7c3a-9f04-2b8e5d1a7c60`."""
    ms = time.time_ns() // 1_000_000
    h = f"{ms & 0xFFFF_FFFF_FFFF:012x}{os.urandom(10).hex()}"
    return f"{h[:8]}-{h[8:12]}-7{h[13:16]}-{_VARIANT[int(h[16], 16)]}{h[17:20]}-{h[20:]}"
