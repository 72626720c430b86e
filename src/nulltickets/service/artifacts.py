"""Artifacts and traces: what runs leave behind."""

from __future__ import annotations

from nulltickets import errors as e
from nulltickets.domain import commands, model
from nulltickets.domain.commands import (
    CreateArtifact,
    compact_json,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import (
    Access,
    Artifact,
    IdBody,
    Span,
    SpanRow,
    TraceIngest,
)
from nulltickets.errors import (
    RunNotFound,
    TaskNotFound,
)
from nulltickets.service import otlp
from nulltickets.service import params as p
from nulltickets.service.base import (
    TrackerBase,
    _page,
)
from nulltickets.service.verbs import Param, Tool, page, paging, verb
from nulltickets.storage.backend import Backend


class Artifacts(TrackerBase):
    # --- artifacts -----------------------------------------------------------------------------

    @verb(
        "POST",
        "/artifacts",
        "Record an artifact.",
        request=commands.CreateArtifact,
        response=IdBody,
        status=201,
        errors=(e.InvalidJson, e.TaskNotFound, e.NotFound),
        access=Access.AGENT,
        tag="artifacts",
        answer=IdBody,
        tool=Tool(
            "add_artifact",
            "Record something the work produced (a pull request, a file, a report) by its URI, "
            "for a task or a run.",
        ),
    )
    def create_artifact(self, b: Backend, cmd: CreateArtifact, now: int) -> str:
        if cmd.task_id is not None and not b.task_exists(cmd.task_id):
            raise TaskNotFound()
        if cmd.run_id is not None and not b.run_exists(cmd.run_id):
            raise RunNotFound("run not found")
        artifact_id = new_id()
        b.insert_artifact(
            id=artifact_id,
            task_id=cmd.task_id,
            run_id=cmd.run_id,
            now=now,
            kind=cmd.kind,
            uri=cmd.uri,
            sha256=cmd.sha256,
            size_bytes=cmd.size_bytes,
            meta_json=compact_json(cmd.meta, "{}") or "{}",
        )
        return artifact_id

    @verb(
        "GET",
        "/artifacts",
        "List artifacts, oldest first.",
        response=model.ArtifactPage,
        errors=(e.InvalidLimit, e.InvalidCursor),
        query=(
            Param("task_id", "Only artifacts of this task."),
            Param("run_id", "Only artifacts of this run."),
            *paging(100),
        ),
        tag="artifacts",
        answer=page,
    )
    def list_artifacts(
        self,
        b: Backend,
        *,
        task_id: str | None,
        run_id: str | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> tuple[list[Artifact], str | None]:
        rows = b.list_artifacts(task_id=task_id, run_id=run_id, after=after, limit=limit + 1)
        return _page(rows, limit, lambda a: f"{a.created_at_ms}:{a.id}")

    # --- traces --------------------------------------------------------------------------------

    @verb(
        "POST",
        "/v1/traces",
        "Ingest an OTLP trace export (JSON or protobuf); spans link to runs and tasks by "
        "the nulltickets.run_id / nulltickets.task_id attributes.",
        response=model.TraceIngest,
        errors=(e.InvalidJson,),
        access=Access.AGENT,
        tag="traces",
        custom=True,
    )
    def ingest_traces(
        self,
        b: Backend,
        content_type: str,
        spans: list[SpanRow] | None,
        payload: bytes,
        now: int,
    ) -> TraceIngest:
        """Store one export. `spans` is None when the payload could not be decoded: then only
        the raw bytes are kept. JSON payloads keep their text; decoded protobuf keeps spans."""
        if spans is None:
            batch = b.insert_otlp_batch(content_type, None, payload, 0, now)
            return TraceIngest(batch, 0, "blob")
        as_json = otlp.is_json(content_type)
        batch = b.insert_otlp_batch(
            content_type, payload.decode() if as_json else None, None, len(spans), now
        )
        for span in spans:
            b.insert_otlp_span(batch, span)
        return TraceIngest(batch, len(spans), "json" if as_json else "protobuf")

    @verb(
        "GET",
        "/runs/{id}/spans",
        "Spans traced for a run (via OTLP ingest), oldest first.",
        response=model.SpanPage,
        errors=(e.InvalidLimit, e.InvalidCursor),
        query=paging(100, p.id_cursor()),
        extra=True,
        tag="traces",
        answer=page,
    )
    def list_spans(
        self, b: Backend, run_id: str, after: int, limit: int
    ) -> tuple[list[Span], str | None]:
        rows = b.list_run_spans(run_id, after, limit + 1)
        return _page(rows, limit, lambda s: str(s.id))
