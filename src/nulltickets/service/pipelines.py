"""Pipelines: create, read and list (a definition never changes once created)."""

from __future__ import annotations

import json

from nulltickets import errors as e
from nulltickets.domain import commands, fsm, model
from nulltickets.domain.commands import (
    CreatePipeline,
    compact_json,
)
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import (
    IdBody,
    Pipeline,
)
from nulltickets.errors import (
    InvalidPipeline,
    NotFound,
)
from nulltickets.service.base import (
    TrackerBase,
)
from nulltickets.service.verbs import verb
from nulltickets.storage.backend import Backend


class Pipelines(TrackerBase):
    @verb(
        "POST",
        "/pipelines",
        "Create a pipeline (immutable).",
        request=commands.CreatePipeline,
        response=IdBody,
        status=201,
        errors=(e.InvalidJson, e.InvalidPipeline, e.DuplicateName),
        tag="pipelines",
        answer=IdBody,
    )
    def create_pipeline(self, b: Backend, cmd: CreatePipeline, now: int) -> str:
        definition_json = compact_json(cmd.definition, None)
        if definition_json is None:
            raise InvalidPipeline("invalid pipeline definition: $ must be an object")
        pipeline = fsm.parse_definition(json.loads(definition_json))
        pipeline_id = new_id()
        b.insert_pipeline(pipeline_id, cmd.name, definition_json, now)  # DuplicateName
        for state in pipeline.states.values():
            b.insert_pipeline_stage(pipeline_id, state.name, state.agent_role, state.terminal)
        self._capped.clear()
        return pipeline_id

    @verb(
        "GET",
        "/pipelines/{id}",
        "Get a pipeline.",
        response=model.Pipeline,
        errors=(e.NotFound,),
        tag="pipelines",
    )
    def get_pipeline(self, b: Backend, pipeline_id: str) -> Pipeline:
        pipeline = b.get_pipeline(pipeline_id)
        if pipeline is None:
            raise NotFound("pipeline not found")
        return pipeline

    @verb(
        "GET",
        "/pipelines",
        "List pipelines, newest first.",
        response=list[model.Pipeline],
        tag="pipelines",
    )
    def list_pipelines(self, b: Backend) -> list[Pipeline]:
        return b.list_pipelines()
