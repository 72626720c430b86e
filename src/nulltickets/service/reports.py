"""Reports: the queue, stages, retries and failures as operators see them; health and upkeep."""

from __future__ import annotations

from nulltickets import __version__, core
from nulltickets import errors as e
from nulltickets.domain import model
from nulltickets.domain.model import (
    FailedTask,
    FailingReport,
    FailureGroups,
    Health,
    QueueReport,
    RetryReport,
    RoleQueue,
    StageQueue,
    StageReport,
)
from nulltickets.service import params as p
from nulltickets.service.base import (
    IDEMPOTENCY_RETENTION_MS,
    THROUGHPUT_WINDOW,
    TrackerBase,
    _clamp,
    _page,
    failure_states,
)
from nulltickets.service.verbs import Guard, Param, Tool, page, paging, verb
from nulltickets.storage.backend import Backend


class Reports(TrackerBase):
    # --- queue report --------------------------------------------------------------------------

    @verb(
        "GET",
        "/ops/queue",
        "Per-role queue health: claimable, oldest, failed, stuck, near-expiry; and the "
        "dead-lettered and cancelled tasks of every pipeline and stage.",
        response=model.QueueReport,
        query=(
            Param(
                "near_expiry_ms",
                "Window for near_expiry_leases (default 60000).",
                "integer",
                p.integer(60_000),
            ),
            Param(
                "stuck_ms",
                "Age after which a running run counts as stuck (default 300000).",
                "integer",
                p.integer(300_000),
            ),
        ),
        tag="operations",
        tool=Tool(
            "queue_report",
            "The queue at a glance: tasks per stage and role, leases near expiry, stuck work.",
        ),
    )
    def queue_report(self, b: Backend, now: int, near_expiry_ms: int, stuck_ms: int) -> QueueReport:
        roles: dict[str, RoleQueue] = {}
        rows, dead, cancelled = b.queue_counts(  # on PostgreSQL one statement
            now, _clamp(now - stuck_ms), _clamp(now + near_expiry_ms)
        )
        for role, claimable, oldest, failed, stuck, near in rows:
            q = roles.get(role)
            if q is None:
                q = roles[role] = RoleQueue(role, 0, None, 0, 0, 0)
            q.claimable_count += claimable
            if oldest is not None:
                age = now - oldest
                q.oldest_claimable_age_ms = max(age, q.oldest_claimable_age_ms or age)
            q.failed_count += failed
            q.stuck_count += stuck
            q.near_expiry_leases += near
        return QueueReport(list(roles.values()), now, dead, cancelled)

    @verb(
        "GET",
        "/ops/retrying",
        "Tasks waiting on a retry delay, soonest claimable first: when each becomes claimable "
        "again and its latest failed attempt's error.",
        response=model.RetryReport,
        errors=(e.InvalidLimit,),
        query=(
            Param(
                "limit", "At most this many tasks, 1..1000 (default 100).", "integer", p.limit(100)
            ),
        ),
        extra=True,
        tag="operations",
    )
    def retry_report(self, b: Backend, now: int, limit: int) -> RetryReport:
        return RetryReport(b.retry_waiting(now, limit), now)

    @verb(
        "GET",
        "/ops/failures",
        "Dead-lettered, cancelled and failing tasks (failed since their last transition and "
        "retrying), newest first: by the end of the latest failed attempt, a cancelled task by "
        "its cancellation. Each with its state, the last error, the number of failed "
        "attempts, its stage and pipeline. Keyset pages (cursor `<at_ms>:<id>`).",
        response=model.FailurePage,
        errors=(e.InvalidRequest, e.InvalidLimit, e.InvalidCursor),
        query=(
            Param(
                "kind",
                "Only these kinds: dead, cancelled, failing, or a comma-separated list of them "
                "(default: all three).",
            ),
            Param("pipeline_id", "Only tasks of this pipeline.", parse=p.text_or_none),
            Param(
                "error",
                "Only tasks whose last error is exactly this text (empty: none reported), "
                "e.g. a group of GET /ops/failures/groups.",
            ),
            *paging(50, arg="before"),
        ),
        extra=True,
        tag="operations",
        answer=page,
    )
    def list_failures(
        self,
        b: Backend,
        *,
        kind: str | None,
        pipeline_id: str | None,
        error: str | None,
        before: tuple[int, str] | None,
        limit: int,
    ) -> tuple[list[FailedTask], str | None]:
        """Dead-lettered, cancelled and failing tasks, newest first (see FailedTask)."""
        rows = b.list_failures(
            states=failure_states(kind),
            pipeline_id=pipeline_id,
            error=error,
            before=before,
            limit=limit + 1,
        )
        return _page(rows, limit, lambda f: f"{f.at_ms}:{f.id}")

    @verb(
        "GET",
        "/ops/failures/groups",
        "The tasks of GET /ops/failures grouped by state and last error, the largest groups "
        "first: how many, and the newest and oldest of each.",
        response=model.FailureGroups,
        errors=(e.InvalidRequest, e.InvalidLimit),
        query=(
            Param(
                "kind",
                "Only these kinds: dead, cancelled, failing, or a comma-separated list of them "
                "(default: all three).",
            ),
            Param("pipeline_id", "Only tasks of this pipeline.", parse=p.text_or_none),
            Param(
                "limit", "At most this many groups, 1..1000 (default 100).", "integer", p.limit(100)
            ),
        ),
        extra=True,
        tag="operations",
    )
    def failure_groups(
        self, b: Backend, *, kind: str | None, pipeline_id: str | None, limit: int, now: int
    ) -> FailureGroups:
        states = failure_states(kind)
        groups = b.failure_groups(states=states, pipeline_id=pipeline_id, limit=limit)
        return FailureGroups(groups, now)

    @verb(
        "GET",
        "/ops/failing",
        "Tasks failing in a loop: those with min_failures or more failed (or expired) "
        "attempts in a row within the last window_ms, no completed run since, and still to be "
        "retried; most failures first, with the latest error and when each is claimable again.",
        response=model.FailingReport,
        errors=(e.InvalidLimit, e.InvalidRequest),
        query=(
            Param(
                "min_failures",
                "Failures in a row, at least (default 3).",
                "integer",
                p.bounded("min_failures", 1, 3, 1_000_000),
            ),
            Param(
                "window_ms",
                "How far back, 60000..86400000 (default 3600000: the last hour).",
                "integer",
                p.bounded("window_ms", 60_000, 3_600_000, 86_400_000),
            ),
            Param(
                "limit", "At most this many tasks, 1..1000 (default 20).", "integer", p.limit(20)
            ),
        ),
        extra=True,
        tag="operations",
    )
    def failing_report(
        self, b: Backend, now: int, window_ms: int, min_failures: int, limit: int
    ) -> FailingReport:
        rows = b.failing_tasks(now - window_ms, min_failures, THROUGHPUT_WINDOW, limit)
        return FailingReport(rows, window_ms, min_failures, now)

    @verb(
        "GET",
        "/ops/stages",
        "Per pipeline and stage with a role: claimable, leased, waiting on a retry delay, "
        "blocked by dependencies, dead-lettered and cancelled tasks, the oldest claimable "
        "task's age; then each stage without a role where dead-lettered or cancelled tasks "
        "landed (a dead-letter stage, role null); and the transitions of each of the last 60 "
        "minutes.",
        response=model.StageReport,
        extra=True,
        tag="operations",
    )
    def stage_report(self, b: Backend, now: int) -> StageReport:
        stages = [
            StageQueue(p, s, r, c, None if oldest is None else now - oldest, *counts)
            for p, s, r, c, oldest, *counts in b.stage_board(now)
        ]
        since = now - 3_600_000 + 60_000 - now % 60_000  # the start of the oldest of 60 minutes
        per_minute = [0] * 60
        for minute, count in b.transitions_since(since, THROUGHPUT_WINDOW):
            if 0 <= minute < 60:
                per_minute[minute] = count
        return StageReport(stages, per_minute, now)

    # --- health and upkeep ---------------------------------------------------------------------

    @verb(
        "GET",
        "/health",
        "Liveness, version and queue counts.",
        guard=Guard.NONE,
        response=model.Health,
        tag="discovery",
    )
    def health(self, b: Backend, now: int) -> Health:
        engine, version, options = b.engine()
        stages, leases = b.health_counts(now)  # on PostgreSQL one statement
        health = Health("ok", __version__, stages, leases, core.IMPLEMENTATION)
        if engine == "sqlite":
            health.sqlite_version, health.sqlite_options = version, options
        return health

    def purge_idempotency(self, b: Backend, now: int) -> int:
        return b.purge_idempotency(now - IDEMPOTENCY_RETENTION_MS)
