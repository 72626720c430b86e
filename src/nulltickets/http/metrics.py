"""GET /metrics: the Prometheus text format (version 0.0.4), written here without a library.

The request path only increments integers: one dict entry per (method, route, status) and one
histogram per route, its bucket found by bisect; a claim also counts its outcome and, for a
long poll, how long it waited (on the loop's thread: no lock). The storage backend times its
commits and checkpoints the same way (Database.stats). Everything else is read when Prometheus
scrapes: the queue per role and stage from the database, leases, waiters and streams (with
their limits, and how many were admitted and refused) from the process, the garbage
collector's pauses (server/heap.py), the run events since the previous scrape by kind (counters of
transitions, retries, dead letters, expiries, releases, checkpoints), the writer's batch counts
and the WAL's size.
On PostgreSQL the per-process figures are this process's and the queue figures the database's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nulltickets import __version__, core
from nulltickets.domain.stats import Histogram
from nulltickets.http.request import Request
from nulltickets.http.response import PROMETHEUS, Reply, web

if TYPE_CHECKING:
    from nulltickets.http.context import Context

# Upper bounds of the latency buckets, in seconds (a long-poll claim waits up to 30 s).
BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# Run event kinds with a counter of their own (the rest count under run_events_total only).
EVENT_COUNTERS = {
    "transition": (
        "nulltickets_transitions_total",
        "Runs that moved their task along a transition.",
    ),
    "retry_scheduled": ("nulltickets_retries_total", "Failed attempts given a retry."),
    "dead_letter": ("nulltickets_dead_letters_total", "Tasks dead-lettered by their policy."),
    "lease_expired": ("nulltickets_lease_expiries_total", "Leases that expired."),
    "released": ("nulltickets_releases_total", "Runs released on purpose."),
    "checkpoint": ("nulltickets_checkpoint_writes_total", "Checkpoint writes."),
}


CLAIM_RESULTS = {200: "hit", 204: "empty"}


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.latency: dict[tuple[str, str], Histogram] = {}
        self.events: dict[str, int] = {}
        self.event_cursor: int | None = None  # the newest event id counted so far
        # Claims by (result, mode): mode "immediate" (no wait_ms) or "long_poll".
        self.claims: dict[tuple[str, str], int] = {
            (r, m): 0 for r in CLAIM_RESULTS.values() for m in ("immediate", "long_poll")
        }
        self.claim_wait = {r: Histogram(BUCKETS) for r in CLAIM_RESULTS.values()}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.latency.get((method, route))
        if hist is None:
            hist = self.latency[(method, route)] = Histogram(BUCKETS)
        hist.observe(seconds)

    def claimed(self, status: int, waited_s: float | None) -> None:
        """A claim answered `status`; `waited_s`: how long a long poll took to answer (None:
        the claim did not ask to wait). Errors count only as requests."""
        result = CLAIM_RESULTS.get(status)
        if result is None:
            return
        if waited_s is None:
            self.claims[(result, "immediate")] += 1
            return
        self.claims[(result, "long_poll")] += 1
        self.claim_wait[result].observe(waited_s)

    def _requests_with(self, method: str, route: str, status: int) -> int:
        return self.requests.get((method, route, status), 0)


def _limit(limit: int | None) -> int:
    return -1 if limit is None else limit


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, labels: str = "") -> None:
        text = repr(float(value)) if isinstance(value, float) else str(value)
        self.lines.append(f"{name}{labels} {text}")

    def one(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text)
        self.sample(name, value)

    def histogram(self, name: str, hist: Histogram, **labels: str) -> None:
        """The _bucket, _sum and _count samples of one histogram (its family said before)."""
        counts, total = hist.snapshot()
        running = 0
        for bound, count in zip((*hist.bounds, None), counts, strict=True):
            running += count
            le = "+Inf" if bound is None else repr(float(bound))
            self.sample(f"{name}_bucket", running, _labels(**labels, le=le))
        self.sample(f"{name}_sum", total, _labels(**labels) if labels else "")
        self.sample(f"{name}_count", running, _labels(**labels) if labels else "")


# Database.stats() figures, where the backend has them: name -> (metric, type, help).
STORAGE_FIGURES = {
    "writer_batches": (
        "nulltickets_writer_batches_total",
        "counter",
        "Write transactions committed.",
    ),
    "writer_jobs": (
        "nulltickets_writer_jobs_total",
        "counter",
        "Writes committed (divided by batches: the mean batch size).",
    ),
    "wal_checkpoints": (
        "nulltickets_wal_checkpoints_total",
        "counter",
        "WAL checkpoints run in the background.",
    ),
    "wal_checkpoints_forced": (
        "nulltickets_wal_checkpoints_forced_total",
        "counter",
        "WAL checkpoints the writer finished itself (the WAL had grown too large).",
    ),
    "wal_bytes": ("nulltickets_wal_bytes", "gauge", "Size of the SQLite write-ahead log."),
    "retries": (
        "nulltickets_storage_retries_total",
        "counter",
        "Units of work run again on PostgreSQL: after a lost race, a serialization failure or "
        "a deadlock, or a connection that died before COMMIT.",
    ),
    "combined_commits": (
        "nulltickets_storage_combined_commits_total",
        "counter",
        "Commits on PostgreSQL that carried the one-statement writes of several requests "
        "(sent in the same turn of the server's loop).",
    ),
    "combined_units": (
        "nulltickets_storage_combined_units_total",
        "counter",
        "The requests' writes those commits carried (divided by them: the mean batch).",
    ),
    "combined_failures": (
        "nulltickets_storage_combined_failures_total",
        "counter",
        "Batches PostgreSQL refused as a whole because one of their writes failed (each write "
        "then ran on its own).",
    ),
}
# Database.stats() histograms, where the backend has them: name -> (metric, help).
STORAGE_HISTOGRAMS = {
    "commit_duration_seconds": (
        "nulltickets_commit_duration_seconds",
        "Time of each COMMIT of the writer: a group-commit batch on SQLite, a unit of work on "
        "PostgreSQL.",
    ),
    "checkpoint_duration_seconds": (
        "nulltickets_checkpoint_duration_seconds",
        "Time of each WAL checkpoint (SQLite), in the background or finished by the writer.",
    ),
    "writer_batch_size": (
        "nulltickets_writer_batch_size",
        "Writes per committed batch of the SQLite writer's group commit.",
    ),
    "wal_sync_duration_seconds": (
        "nulltickets_wal_sync_duration_seconds",
        "Time of each sync of the SQLite WAL (the disk's fdatasync) with durability full, made "
        "off the event loop's thread.",
    ),
    "durable_wait_seconds": (
        "nulltickets_durable_wait_seconds",
        "Time from a batch's COMMIT to its answer with durability full on SQLite: the wait for "
        "a WAL sync begun after that commit to complete.",
    ),
}


async def prime(ctx: Context) -> None:
    """Count run events from the server's start, not from the first scrape."""
    metrics = ctx.metrics
    if metrics is not None and metrics.event_cursor is None:
        last = await ctx.service.last_event_id()
        if metrics.event_cursor is None:
            metrics.event_cursor = last


async def metrics_text(ctx: Context, req: Request) -> Reply:
    m = ctx.metrics
    assert m is not None
    after = m.event_cursor
    snap = await ctx.service.metrics_snapshot(after)
    stats = ctx.service.storage_stats()
    now, stages, leases, kinds, newest = snap.now, snap.stages, snap.leases, snap.kinds, snap.newest
    if after == m.event_cursor:  # another scrape did not count these meanwhile
        for kind, count, _ in kinds:
            m.events[kind] = m.events.get(kind, 0) + count
        m.event_cursor = max(newest, m.event_cursor or 0)
    out = _Text()

    out.family("nulltickets_build_info", "gauge", "The server's version and core implementation.")
    out.sample("nulltickets_build_info", 1, _labels(version=__version__, core=core.IMPLEMENTATION))

    out.family("nulltickets_http_requests_total", "counter", "Requests by route and status.")
    for (method, route, status), n in sorted(m.requests.items()):
        labels = _labels(method=method, route=route, status=str(status))
        out.sample("nulltickets_http_requests_total", n, labels)

    name = "nulltickets_http_request_duration_seconds"
    out.family(name, "histogram", "Time to answer a request, by route (long-polls included).")
    for (method, route), hist in sorted(m.latency.items()):
        out.histogram(name, hist, method=method, route=route)

    out.family(
        "nulltickets_claims_total",
        "counter",
        "Claims that got a task (hit) or none (empty), immediate or long-polling (wait_ms).",
    )
    for (result, mode), n in sorted(m.claims.items()):
        out.sample("nulltickets_claims_total", n, _labels(result=result, mode=mode))
    name = "nulltickets_claim_wait_seconds"
    out.family(
        name,
        "histogram",
        "How long a long-poll claim took to answer, by outcome: hit (got a task) or empty "
        "(answered 204 when its wait ran out).",
    )
    for result, hist in sorted(m.claim_wait.items()):
        out.histogram(name, hist, outcome=result)
    out.one(
        "nulltickets_run_failures_total",
        "counter",
        "Runs their agent reported failed (POST /runs/{id}/fail).",
        m._requests_with("POST", "/runs/{id}/fail", 200),
    )
    for kind, (metric, help_text) in EVENT_COUNTERS.items():
        out.one(
            metric,
            "counter",
            help_text + " Counted since the server started.",
            m.events.get(kind, 0),
        )
    out.family(
        "nulltickets_run_events_total", "counter", "Run events by kind, since the server started."
    )
    for kind, n in sorted(m.events.items()):
        out.sample("nulltickets_run_events_total", n, _labels(kind=kind))

    depth = "nulltickets_queue_tasks"
    out.family(
        depth,
        "gauge",
        "Tasks per role, pipeline, stage and state; dead-lettered and cancelled tasks count in "
        'the stage they landed in, a stage without a role (role="") included.',
    )
    for pipeline_id, stage, role, claimable, _oldest, *rest in stages:
        leased, delayed, blocked, dead, cancelled = rest
        if role is None:  # a dead-letter stage: only what landed there
            for state, n in (("dead_lettered", dead), ("cancelled", cancelled)):
                labels = _labels(role="", pipeline_id=pipeline_id, stage=stage, state=state)
                out.sample(depth, n, labels)
            continue
        for state, n in (
            ("claimable", claimable),
            ("leased", leased),
            ("waiting_retry", delayed),
            ("blocked", blocked),
            ("dead_lettered", dead),
            ("cancelled", cancelled),
        ):
            out.sample(
                depth, n, _labels(role=role, pipeline_id=pipeline_id, stage=stage, state=state)
            )
    age = "nulltickets_queue_oldest_claimable_age_seconds"
    out.family(age, "gauge", "Age of the oldest claimable task per role, pipeline and stage.")
    for pipeline_id, stage, role, _c, oldest, *_rest in stages:
        if role is None:
            continue
        value = 0.0 if oldest is None else max(0, now - oldest) / 1000
        out.sample(age, value, _labels(role=role, pipeline_id=pipeline_id, stage=stage))

    out.one("nulltickets_live_leases", "gauge", "Leases not yet expired.", leases)
    wakeups, hub = ctx.service.wakeups, ctx.hub
    out.one(
        "nulltickets_long_poll_waiters",
        "gauge",
        "Long-poll claims in progress (waiting for work, or trying between waits).",
        wakeups.waiting(),
    )
    out.one("nulltickets_sse_clients", "gauge", "Open event streams.", hub.clients if hub else 0)
    name = "nulltickets_waiting_limit"
    out.family(
        name,
        "gauge",
        "Long-poll claims and open event streams the server admits at once (max_waiters, "
        "max_streams; -1: no limit).",
    )
    out.sample(name, _limit(wakeups.limit), _labels(kind="long_poll"))
    out.sample(name, _limit(hub.limit if hub else None), _labels(kind="event_stream"))
    name = "nulltickets_admissions_total"
    out.family(
        name,
        "counter",
        "Long-poll claims and event streams admitted, or refused at the limit (a refused "
        "claim tried once and answered at once, with Retry-After; a refused stream got 503).",
    )
    for kind, admitted, refused in (
        ("long_poll", wakeups.admitted, wakeups.refused),
        ("event_stream", hub.admitted if hub else 0, hub.refused if hub else 0),
    ):
        out.sample(name, admitted, _labels(kind=kind, result="admitted"))
        out.sample(name, refused, _labels(kind=kind, result="refused"))
    out.one(
        "nulltickets_long_poll_wakeups_total",
        "counter",
        "Waiting claims woken by a notification: one per piece of new work (a created task, "
        "a freed slot), not one per waiter.",
        wakeups.woken,
    )

    retention = ctx.retention
    if retention is not None:
        name = "nulltickets_pruned_rows_total"
        out.family(
            name,
            "counter",
            "Rows the background pruning deleted in this process, by table (--retention; a "
            "task's events, dependencies and assignments go with it uncounted).",
        )
        for table, count in sorted(retention.totals.items()):
            out.sample(name, count, _labels(table=table))
        out.one(
            "nulltickets_prune_passes_total",
            "counter",
            "Passes of the background pruning that ran to the end (or found another server "
            "pruning).",
            retention.passes,
        )
        name = "nulltickets_prune_batch_duration_seconds"
        out.family(
            name,
            "histogram",
            "Time of each batch of the background pruning that deleted rows, its commit not "
            "counted: on SQLite, what a write in the writer's queue waits behind one.",
        )
        out.histogram(name, retention.batch_seconds)

    collector = ctx.collector
    if collector is not None:
        name = "nulltickets_gc_pause_seconds"
        out.family(
            name,
            "histogram",
            "Time of each garbage collection in the server's process, by generation (2: a full "
            "collection); no request moves meanwhile.",
        )
        for generation, hist in collector.pauses.items():
            out.histogram(name, hist, generation=str(generation))
        out.one(
            "nulltickets_gc_frozen_objects",
            "gauge",
            "Objects start-up made, frozen at its end: no collection walks them.",
            collector.frozen,
        )

    for key, (metric, kind, help_text) in STORAGE_FIGURES.items():
        figure = stats.figures.get(key)
        if figure is not None:
            out.one(metric, kind, help_text, figure)
    for key, (metric, help_text) in STORAGE_HISTOGRAMS.items():
        timing = stats.histograms.get(key)
        if timing is not None:
            out.family(metric, "histogram", help_text)
            out.histogram(metric, timing)
    out.lines.append("")
    return web(200, "\n".join(out.lines), PROMETHEUS)
