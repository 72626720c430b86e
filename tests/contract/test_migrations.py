"""A fresh database reaches the latest schema; opening it again migrates nothing."""

from __future__ import annotations

from collections.abc import Callable

from nulltickets.domain.commands import CreateTask
from nulltickets.service import Service
from nulltickets.storage.ports import Database
from tests.contract.conftest import make_pipeline, run, value


def test_a_fresh_database_is_at_the_latest_version(database: Database) -> None:
    current, latest = database.schema_version()
    # SQLite 0007 and PostgreSQL 0003 (its 0001 starts with the data's exclusivity).
    assert latest >= {"sqlite": 7, "postgresql": 3}[database.capabilities.name]
    assert current == latest


def test_opening_again_is_a_no_op_that_keeps_everything(
    database: Database, service: Service, opened: Callable[[], Database]
) -> None:
    pipeline_id = make_pipeline(service)
    task_id = value(run(service.create_task(CreateTask(pipeline_id, "kept", ""))))
    before = database.schema_version()
    again = opened()
    assert again.schema_version() == before
    assert run(Service(again).get_task(task_id)).title == "kept"
