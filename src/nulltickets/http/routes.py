"""The route table: (method, path pattern) -> handler, with what OpenAPI needs to describe it.

Matching follows the contract: empty path segments are ignored and the lease routes (heartbeat
and /runs/{id}/...) accept extra trailing segments. A path that exists with other methods only
is a 405 naming them (the contract said 404); HEAD is answered wherever GET is.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nulltickets import errors as e
from nulltickets.domain import commands as cmd
from nulltickets.domain import model
from nulltickets.domain.model import Access
from nulltickets.http import handlers as h
from nulltickets.http import metrics, sse
from nulltickets.http.request import Request

Handler = Callable[[h.Context, Request], Awaitable[h.Reply]]


class Auth(StrEnum):
    NONE = "none"  # never gated
    ADMIN = "admin"  # with a --token: the token or a key with the route's access (`needs`)
    LEASE = "lease"  # the lease token of the run or lease in the path


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    description: str
    kind: str = "string"


@dataclass(frozen=True)
class Route:
    method: str
    pattern: str
    handler: Handler
    summary: str
    auth: Auth = Auth.ADMIN
    request: Any = None
    response: Any = None
    status: int = 200
    errors: tuple[type[e.TrackerError], ...] = ()
    query: tuple[Query, ...] = ()
    trailing: bool = False  # extra trailing segments are ignored
    optional_body: bool = False  # the request body may be left out
    extra: bool = False  # not in the original's API (an addition of ours)
    tag: str = ""
    media: str = "application/json"  # the content type of a success
    # The access a key needs (Auth.ADMIN routes); None: `read` for GET, `admin` for the rest.
    access: Access | None = None
    idempotency_key: bool = True  # a write that replays by Idempotency-Key

    @functools.cached_property
    def needs(self) -> Access:
        if self.access is not None:
            return self.access
        return Access.READ if self.method == "GET" else Access.ADMIN

    @functools.cached_property
    def parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.pattern.split("/") if p)

    @functools.cached_property
    def _shape(self) -> _Shape:
        parts = self.parts
        rest = parts[-1][1:-2] if parts and parts[-1].endswith("+}") else None
        fixed = parts[:-1] if rest is not None else parts
        return _Shape(
            size=len(parts),
            open_ended=self.trailing or rest is not None,
            literals=tuple((i, p) for i, p in enumerate(fixed) if not p.startswith("{")),
            params=tuple((i, p[1:-1]) for i, p in enumerate(fixed) if p.startswith("{")),
            rest=rest,
        )

    def match(self, segments: list[str]) -> dict[str, str] | None:
        shape = self._shape
        n = len(segments)
        if n < shape.size or (n > shape.size and not shape.open_ended):
            return None
        for i, literal in shape.literals:
            if segments[i] != literal:
                return None
        params = {name: segments[i] for i, name in shape.params}
        if shape.rest is not None:  # the last parameter takes every remaining segment
            params[shape.rest] = "/".join(segments[shape.size - 1 :])
        return params


@dataclass(frozen=True, slots=True)
class _Shape:
    """A pattern taken apart once: which segments must equal what, which are parameters."""

    size: int
    open_ended: bool  # more segments than parts are allowed
    literals: tuple[tuple[int, str], ...]
    params: tuple[tuple[int, str], ...]
    rest: str | None


PAGE = (
    Query("limit", "Page size, 1..1000.", "integer"),
    Query("cursor", "The next_cursor of the previous page."),
)
LEASE_ERRORS = (e.Unauthorized, e.NotFound, e.LeaseExpired, e.LeaseSuperseded, e.TaskCancelled)

ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/health",
        h.health,
        "Liveness, version and queue counts.",
        Auth.NONE,
        response=model.Health,
        tag="discovery",
    ),
    Route("GET", "/openapi.json", h.openapi, "This OpenAPI document.", Auth.NONE, tag="discovery"),
    Route(
        "GET",
        "/.well-known/openapi.json",
        h.openapi,
        "This OpenAPI document.",
        Auth.NONE,
        tag="discovery",
    ),
    Route(
        "POST",
        "/pipelines",
        h.create_pipeline,
        "Create a pipeline (immutable).",
        request=cmd.CreatePipeline,
        response=h.IdBody,
        status=201,
        errors=(e.InvalidJson, e.InvalidPipeline, e.DuplicateName),
        tag="pipelines",
    ),
    Route(
        "GET",
        "/pipelines",
        h.list_pipelines,
        "List pipelines, newest first.",
        response=list[model.Pipeline],
        tag="pipelines",
    ),
    Route(
        "GET",
        "/pipelines/{id}",
        h.get_pipeline,
        "Get a pipeline.",
        response=model.Pipeline,
        errors=(e.NotFound,),
        tag="pipelines",
    ),
    Route(
        "POST",
        "/tasks/bulk",
        h.create_tasks,
        "Create many tasks in one transaction.",
        request=cmd.CreateTasks,
        response=h.IdsBody,
        status=201,
        errors=(
            e.InvalidJson,
            e.InvalidRequest,
            e.InvalidRetryPolicy,
            e.PipelineNotFound,
            e.TaskNotFound,
            e.DuplicateDependency,
        ),
        access=Access.AGENT,
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks/requeue",
        h.requeue_tasks,
        "Requeue many tasks at once (1..500 ids, e.g. a selection or a group of "
        "GET /ops/failures): each as POST /tasks/{id}/requeue would, with the same stage, "
        "reset_attempts, reason and actor for all, in one transaction. A task that verb would "
        "refuse (not found, leased, finished, a bad stage) is left as it was and answered "
        "`refused` with that error; the others are requeued. Answers per id, in the order "
        "given.",
        request=cmd.RequeueTasks,
        response=model.BulkOutcome,
        errors=(e.InvalidJson, e.InvalidRequest),
        extra=True,
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks/cancel",
        h.cancel_tasks,
        "Cancel many tasks at once (1..500 ids): each as POST /tasks/{id}/cancel would, in one "
        "transaction. Answers per id, in the order given: `cancelled`, `already_cancelled`, "
        "or `refused` with the error that verb would answer (not found, finished).",
        request=cmd.CancelTasks,
        response=model.BulkOutcome,
        errors=(e.InvalidJson, e.InvalidRequest),
        extra=True,
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks",
        h.create_task,
        "Create a task in its pipeline's initial stage.",
        request=cmd.CreateTask,
        response=h.IdBody,
        status=201,
        errors=(
            e.InvalidJson,
            e.InvalidRetryPolicy,
            e.PipelineNotFound,
            e.TaskNotFound,
            e.DuplicateDependency,
        ),
        access=Access.AGENT,
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks",
        h.list_tasks,
        "List tasks, oldest first, by keyset pages.",
        response=model.TaskPage,
        errors=(e.InvalidLimit, e.InvalidCursor),
        query=(
            Query("stage", "Only tasks in this stage."),
            Query("pipeline_id", "Only tasks of this pipeline."),
            Query("role", "Only tasks in stages whose agent_role is this role."),
            Query(
                "q",
                "Only tasks whose title or id contains this text (any case). An addition of "
                "ours, for the dashboard: it walks the pages until it has found `limit`.",
            ),
            *PAGE,
        ),
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks/{id}",
        h.get_task,
        "A task with its latest run, dependencies, assignments and available transitions.",
        response=model.TaskDetails,
        errors=(e.TaskNotFound,),
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks/{id}/requeue",
        h.requeue_task,
        "Make a dead-lettered, cancelled, failed or waiting task claimable now: in the given "
        "non-terminal stage, or in the stage it failed in (a task a dead-letter policy moved "
        "goes back to the stage it was dead-lettered from; a task in a terminal stage needs "
        "a stage). Clears the dead-letter, the cancellation and any retry delay; with "
        "reset_attempts its failures so far stop counting against max_attempts. Records a "
        "`requeued` task event. The body is optional.",
        request=cmd.RequeueTask,
        response=model.TaskDetails,
        errors=(e.InvalidJson, e.TaskNotFound, e.InvalidStage, e.TaskLeased, e.TaskFinished),
        extra=True,
        optional_body=True,
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks/{id}/cancel",
        h.cancel_task,
        "Cancel a task: it is never claimed again (until requeued). A live lease is revoked "
        "at once: its run ends `cancelled` and the holder's next lease call gets 409 "
        "task_cancelled. A cancelled task does not count as resolved for tasks that depend "
        "on it. Cancelling again answers the same; a task in a terminal stage cannot be "
        "cancelled. Records a `cancelled` task event. The body is optional.",
        request=cmd.CancelTask,
        response=model.TaskDetails,
        errors=(e.InvalidJson, e.TaskNotFound, e.TaskFinished),
        extra=True,
        optional_body=True,
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks/{id}/events",
        h.list_task_events,
        "What operators did to the task (requeued, cancelled), oldest first.",
        response=model.TaskEventPage,
        errors=(e.TaskNotFound, e.InvalidLimit, e.InvalidCursor),
        query=PAGE,
        extra=True,
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks/{id}/runs",
        h.list_task_runs,
        "Every run of the task, oldest attempt first (order=desc: newest first): who claimed "
        "it (agent_id, agent_role), when, how it ended and the error it reported.",
        response=model.TaskRunPage,
        errors=(e.TaskNotFound, e.InvalidLimit, e.InvalidCursor, e.InvalidRequest),
        query=(
            Query("order", "asc (the default): oldest attempt first; desc: newest first."),
            *PAGE,
        ),
        extra=True,
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks/{id}/run-state",
        h.run_state,
        "The task's current or latest run id.",
        response=h.RunStateBody,
        errors=(e.TaskNotFound, e.NotFound),
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks/{id}/dependencies",
        h.add_dependency,
        "Make the task wait for another task.",
        request=cmd.AddDependency,
        response=h.StatusBody,
        status=201,
        errors=(
            e.InvalidJson,
            e.InvalidDependency,
            e.TaskNotFound,
            e.DependencyTaskNotFound,
            e.DuplicateDependency,
        ),
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks/{id}/dependencies",
        h.list_dependencies,
        "The task's dependencies and whether each is resolved.",
        response=list[model.Dependency],
        tag="tasks",
    ),
    Route(
        "POST",
        "/tasks/{id}/assignments",
        h.assign,
        "Assign the task to one agent (replaces the active assignment).",
        request=cmd.Assign,
        response=h.StatusBody,
        status=201,
        errors=(e.InvalidJson, e.TaskNotFound),
        tag="tasks",
    ),
    Route(
        "GET",
        "/tasks/{id}/assignments",
        h.list_assignments,
        "Every assignment of the task, active or not.",
        response=list[model.Assignment],
        tag="tasks",
    ),
    Route(
        "DELETE",
        "/tasks/{id}/assignments/{agent_id+}",
        h.unassign,
        "End the agent's active assignment.",
        response=h.StatusBody,
        errors=(e.TaskNotFound, e.NotFound),
        tag="tasks",
    ),
    Route(
        "POST",
        "/leases/claim",
        h.claim,
        "Claim the most urgent eligible task for a role (204 when there is none).",
        request=cmd.Claim,
        response=model.ClaimResult,
        errors=(e.InvalidJson, e.InvalidLeaseTtl),
        access=Access.AGENT,
        tag="leases",
    ),
    Route(
        "POST",
        "/leases/{id}/heartbeat",
        h.heartbeat,
        "Extend a lease by its TTL (or the lease_ttl_ms given).",
        Auth.LEASE,
        request=cmd.Heartbeat,
        response=h.ExpiresBody,
        errors=(*LEASE_ERRORS, e.InvalidJson, e.InvalidLeaseTtl),
        trailing=True,
        optional_body=True,
        tag="leases",
    ),
    Route(
        "POST",
        "/runs/{id}/events",
        h.append_event,
        "Append an event to a run.",
        Auth.LEASE,
        request=cmd.AppendEvent,
        response=h.EventIdBody,
        status=201,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        tag="runs",
    ),
    Route(
        "GET",
        "/runs/{id}/events",
        h.list_events,
        "A run's events, oldest first.",
        Auth.LEASE,
        response=model.EventPage,
        errors=(e.Unauthorized, e.InvalidLimit, e.InvalidCursor),
        query=PAGE,
        trailing=True,
        tag="runs",
    ),
    Route(
        "POST",
        "/runs/{id}/transition",
        h.transition,
        "Complete the run and move its task along a transition.",
        Auth.LEASE,
        request=cmd.MoveTask,
        response=model.TransitionResult,
        errors=(
            *LEASE_ERRORS,
            e.InvalidJson,
            e.RunNotRunning,
            e.IllegalTransition,
            e.ExpectedStageMismatch,
            e.TaskVersionMismatch,
        ),
        trailing=True,
        tag="runs",
    ),
    Route(
        "POST",
        "/runs/{id}/fail",
        h.fail,
        "Fail the run: retry later or dead-letter by the task's policy.",
        Auth.LEASE,
        request=cmd.FailRun,
        response=h.StatusBody,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        tag="runs",
    ),
    Route(
        "PUT",
        "/runs/{id}/checkpoint",
        h.write_checkpoint,
        "Merge a JSON object into the task's checkpoint (RFC 7396) and extend the lease.",
        Auth.LEASE,
        request=cmd.WriteCheckpoint,
        response=model.CheckpointResult,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        extra=True,
        tag="runs",
    ),
    Route(
        "POST",
        "/runs/{id}/release",
        h.release,
        "Put the task down on purpose: claimable again at once, not a failed attempt.",
        Auth.LEASE,
        request=cmd.ReleaseRun,
        response=model.Released,
        errors=(*LEASE_ERRORS, e.InvalidJson),
        trailing=True,
        extra=True,
        optional_body=True,
        tag="runs",
    ),
    Route(
        "POST",
        "/agents/release",
        h.release_agent,
        "Release every task an agent holds (a stop hook for coding agents).",
        request=cmd.ReleaseAgent,
        response=model.AgentReleased,
        errors=(e.InvalidJson,),
        extra=True,
        tag="leases",
    ),
    Route(
        "GET",
        "/tasks/{id}/checkpoint",
        h.get_checkpoint,
        "The task's checkpoint, fence and earlier failures.",
        response=model.TaskCheckpoint,
        errors=(e.TaskNotFound,),
        extra=True,
        tag="tasks",
    ),
    Route(
        "POST",
        "/artifacts",
        h.create_artifact,
        "Record an artifact.",
        request=cmd.CreateArtifact,
        response=h.IdBody,
        status=201,
        errors=(e.InvalidJson, e.TaskNotFound, e.NotFound),
        access=Access.AGENT,
        tag="artifacts",
    ),
    Route(
        "GET",
        "/artifacts",
        h.list_artifacts,
        "List artifacts, oldest first.",
        response=model.ArtifactPage,
        errors=(e.InvalidLimit, e.InvalidCursor),
        query=(
            Query("task_id", "Only artifacts of this task."),
            Query("run_id", "Only artifacts of this run."),
            *PAGE,
        ),
        tag="artifacts",
    ),
    Route(
        "POST",
        "/v1/traces",
        h.ingest_traces,
        "Ingest an OTLP trace export (JSON or protobuf); spans link to runs and tasks by "
        "the nulltickets.run_id / nulltickets.task_id attributes.",
        response=model.TraceIngest,
        errors=(e.InvalidJson,),
        access=Access.AGENT,
        tag="traces",
    ),
    Route(
        "POST",
        "/otlp/v1/traces",
        h.ingest_traces,
        "Same as POST /v1/traces.",
        response=model.TraceIngest,
        errors=(e.InvalidJson,),
        access=Access.AGENT,
        tag="traces",
    ),
    Route(
        "GET",
        "/runs/{id}/spans",
        h.list_spans,
        "Spans traced for a run (via OTLP ingest), oldest first.",
        response=model.SpanPage,
        errors=(e.InvalidLimit, e.InvalidCursor),
        query=PAGE,
        extra=True,
        tag="traces",
    ),
    Route(
        "GET",
        "/ops/queue",
        h.queue_report,
        "Per-role queue health: claimable, oldest, failed, stuck, near-expiry; and the "
        "dead-lettered and cancelled tasks of every pipeline and stage.",
        response=model.QueueReport,
        query=(
            Query("near_expiry_ms", "Window for near_expiry_leases (default 60000).", "integer"),
            Query(
                "stuck_ms",
                "Age after which a running run counts as stuck (default 300000).",
                "integer",
            ),
        ),
        tag="operations",
    ),
    Route(
        "GET",
        "/ops/stages",
        h.stage_report,
        "Per pipeline and stage with a role: claimable, leased, waiting on a retry delay, "
        "blocked by dependencies, dead-lettered and cancelled tasks, the oldest claimable "
        "task's age; then each stage without a role where dead-lettered or cancelled tasks "
        "landed (a dead-letter stage, role null); and the transitions of each of the last 60 "
        "minutes.",
        response=model.StageReport,
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/ops/retrying",
        h.retry_report,
        "Tasks waiting on a retry delay, soonest claimable first: when each becomes claimable "
        "again and its latest failed attempt's error.",
        response=model.RetryReport,
        errors=(e.InvalidLimit,),
        query=(Query("limit", "At most this many tasks, 1..1000 (default 100).", "integer"),),
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/ops/failures",
        h.list_failures,
        "Dead-lettered, cancelled and failing tasks (failed since their last transition and "
        "retrying), newest first: by the end of the latest failed attempt, a cancelled task by "
        "its cancellation. Each with its state, the last error, the number of failed "
        "attempts, its stage and pipeline. Keyset pages (cursor `<at_ms>:<id>`).",
        response=model.FailurePage,
        errors=(e.InvalidRequest, e.InvalidLimit, e.InvalidCursor),
        query=(
            Query(
                "kind",
                "Only these kinds: dead, cancelled, failing, or a comma-separated list of them "
                "(default: all three).",
            ),
            Query("pipeline_id", "Only tasks of this pipeline."),
            Query(
                "error",
                "Only tasks whose last error is exactly this text (empty: none reported), "
                "e.g. a group of GET /ops/failures/groups.",
            ),
            *PAGE,
        ),
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/ops/failures/groups",
        h.failure_groups,
        "The tasks of GET /ops/failures grouped by state and last error, the largest groups "
        "first: how many, and the newest and oldest of each.",
        response=model.FailureGroups,
        errors=(e.InvalidRequest, e.InvalidLimit),
        query=(
            Query(
                "kind",
                "Only these kinds: dead, cancelled, failing, or a comma-separated list of them "
                "(default: all three).",
            ),
            Query("pipeline_id", "Only tasks of this pipeline."),
            Query("limit", "At most this many groups, 1..1000 (default 100).", "integer"),
        ),
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/ops/failing",
        h.failing_report,
        "Tasks failing in a loop: those with min_failures or more failed (or expired) "
        "attempts in a row within the last window_ms, no completed run since, and still to be "
        "retried; most failures first, with the latest error and when each is claimable again.",
        response=model.FailingReport,
        errors=(e.InvalidLimit, e.InvalidRequest),
        query=(
            Query("min_failures", "Failures in a row, at least (default 3).", "integer"),
            Query(
                "window_ms",
                "How far back, 60000..86400000 (default 3600000: the last hour).",
                "integer",
            ),
            Query("limit", "At most this many tasks, 1..1000 (default 20).", "integer"),
        ),
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/events/stream",
        sse.stream,
        "Run events as Server-Sent Events (text/event-stream), live: each `data:` is a "
        "FeedEvent, its `id:` the event id. Filters combine; kind takes a comma-separated "
        "list. Resume with the Last-Event-ID header (or last_event_id): the events after it "
        "are replayed first. Without either, the stream starts with the next event. A "
        "comment line every 15 s keeps idle streams open.",
        response=model.FeedEvent,
        media="text/event-stream",
        errors=(e.InvalidCursor, e.Overloaded),
        query=(
            Query("task_id", "Only events of this task's runs."),
            Query("run_id", "Only events of this run."),
            Query("pipeline_id", "Only events of this pipeline's tasks."),
            Query("kind", "Only events of these kinds (comma-separated)."),
            Query("last_event_id", "Replay the events after this id first.", "integer"),
        ),
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/metrics",
        metrics.metrics_text,
        "Prometheus metrics (text format 0.0.4).",
        media="text/plain",
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/store/search",
        h.search_store,
        "Full-text search over the store, best match first (bm25), with snippets.",
        response=list[model.SearchHit],
        errors=(e.MissingParam, e.InvalidQuery, e.InvalidLimit),
        query=(
            Query("q", "Words to find (every word must match; operators are literal)."),
            Query("namespace", "Only this namespace."),
            Query("limit", "At most this many results, 1..1000 (default 10).", "integer"),
            Query("filter_path", "JSON path into the value, e.g. $.status."),
            Query("filter_value", "Keep values whose filter_path has this text form."),
        ),
        tag="store",
    ),
    Route(
        "GET",
        "/namespaces",
        h.list_namespaces,
        "The store's namespaces by name, with how many keys each holds and when one last "
        "changed (not under /store/: GET /store/{namespace} lists a namespace's entries).",
        response=model.NamespacePage,
        errors=(e.InvalidLimit,),
        query=(
            Query("limit", "Page size, 1..1000 (default 100).", "integer"),
            Query("cursor", "The next_cursor of the previous page."),
        ),
        extra=True,
        tag="store",
    ),
    Route(
        "PUT",
        "/store/{namespace}/{key+}",
        h.put_value,
        "Store a JSON value under a key.",
        request=cmd.PutValue,
        status=204,
        errors=(e.InvalidJson, e.ReservedNamespace),
        access=Access.AGENT,
        tag="store",
    ),
    Route(
        "GET",
        "/store/{namespace}/{key+}",
        h.get_value,
        "Read a stored value.",
        response=model.StoreEntry,
        errors=(e.NotFound,),
        tag="store",
    ),
    Route(
        "DELETE",
        "/store/{namespace}/{key+}",
        h.delete_value,
        "Delete a key (always 204).",
        status=204,
        access=Access.AGENT,
        tag="store",
    ),
    Route(
        "GET",
        "/store/{namespace}",
        h.list_namespace,
        "Every entry of a namespace by key.",
        response=list[model.StoreEntry],
        tag="store",
    ),
    Route(
        "DELETE",
        "/store/{namespace}",
        h.delete_namespace,
        "Delete a whole namespace (always 204).",
        status=204,
        tag="store",
    ),
    Route(
        "POST",
        "/keys",
        h.create_key,
        "Make a key: `read` (every read route, the metrics, the event stream, the dashboard "
        "without its buttons), `agent` (reads, claims for its `roles` only, and the writes "
        "agents make: tasks, artifacts, store keys, traces) or `admin` (everything, as the "
        "--token). The answer is the only time the key is shown; the server keeps its SHA-256. "
        "Needs a server started with --token (409 keys_need_token otherwise). No "
        "Idempotency-Key: a recorded answer would hold the key.",
        request=cmd.CreateKey,
        response=model.CreatedKey,
        status=201,
        errors=(e.InvalidJson, e.InvalidRequest, e.KeysNeedToken),
        extra=True,
        idempotency_key=False,
        tag="keys",
    ),
    Route(
        "GET",
        "/keys",
        h.list_keys,
        "Every key, oldest first: its id, name, access and roles, never the key nor its hash.",
        response=list[model.KeyInfo],
        extra=True,
        access=Access.ADMIN,
        tag="keys",
    ),
    Route(
        "DELETE",
        "/keys/{id}",
        h.revoke_key,
        "Revoke a key: refused at once by this server and, on PostgreSQL, by every other "
        "server of the tracker (told before this answers). Dashboard sessions of the key end "
        "too. Answers what the key was.",
        response=model.KeyInfo,
        errors=(e.NotFound,),
        extra=True,
        tag="keys",
    ),
)

WRITE_METHODS = frozenset({"POST", "PUT", "DELETE"})


class Router:
    def __init__(self, routes: tuple[Route, ...]) -> None:
        self._by_head: dict[tuple[str, str], list[Route]] = {}
        self._any_method: dict[str, list[Route]] = {}
        for route in routes:
            head = route.parts[0] if route.parts else ""
            self._by_head.setdefault((route.method, head), []).append(route)
            self._any_method.setdefault(head, []).append(route)

    def match(self, method: str, segments: list[str]) -> tuple[Route, dict[str, str]] | None:
        """The route for a request; HEAD takes the GET route (the server sends no body)."""
        head = segments[0] if segments else ""
        for route in self._by_head.get(("GET" if method == "HEAD" else method, head), ()):
            params = route.match(segments)
            if params is not None:
                return route, params
        return None

    def allowed(self, segments: list[str]) -> tuple[str, ...]:
        """The methods the path takes (for a 405's Allow), HEAD wherever GET; () for none."""
        head = segments[0] if segments else ""
        methods = {
            r.method for r in self._any_method.get(head, ()) if r.match(segments) is not None
        }
        if "GET" in methods:
            methods.add("HEAD")
        return tuple(sorted(methods))


def gate(segments: list[str]) -> Auth:
    """How the admin-token gate treats a path, by its segments alone (any method)."""
    n = len(segments)
    if n == 0 or segments[0] == "ui":  # the dashboard's pages: their data comes from the API
        return Auth.NONE
    if n == 1 and segments[0] in ("health", "openapi.json"):
        return Auth.NONE
    if n == 2 and segments == [".well-known", "openapi.json"]:
        return Auth.NONE
    if n >= 3 and (
        (segments[0] == "leases" and segments[2] == "heartbeat")
        or (
            segments[0] == "runs"
            and segments[2] in ("events", "transition", "fail", "checkpoint", "release")
        )
    ):
        return Auth.LEASE
    return Auth.ADMIN
