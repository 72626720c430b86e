"""The `Database` port: units of work, schema, capabilities, figures, closing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from nulltickets.errors import DuplicateName, StorageUnavailable
from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Database
from tests.storage.ops import covers, make_pipeline, make_task


@covers("Database.capabilities", "Database.notifier")
def test_the_capabilities_say_what_the_backend_can_do(database: Database, backend: str) -> None:
    capabilities = database.capabilities
    assert capabilities.name == ("postgresql" if backend == "postgresql" else "sqlite")
    shared = capabilities.name == "postgresql"
    assert capabilities.shared_by_servers is shared
    assert capabilities.cross_process_notifications is shared
    assert capabilities.group_commit is not shared
    assert database.notifier is database.notifier  # one notifier per database


@covers("Database.open", "Database.schema_version")
def test_a_fresh_database_is_at_the_latest_version_and_opening_again_keeps_everything(
    database: Database, opened: Callable[[], Database]
) -> None:
    current, latest = database.schema_version()
    # SQLite 0007 and PostgreSQL 0003 (its 0001 starts with the data's exclusivity).
    assert latest >= {"sqlite": 7, "postgresql": 3}[database.capabilities.name]
    assert current == latest
    task_id = database.write_sync(lambda b: make_task(b, make_pipeline(b), title="kept"))
    again = opened()  # open() checks and migrates: nothing to do
    assert again.schema_version() == (current, latest)
    assert again.read_sync(lambda b: b.get_task(task_id)).title == "kept"


@covers("Database.write", "Database.read")
def test_a_unit_of_work_answers_once_committed_and_keeps_nothing_when_it_raises(
    database: Database,
) -> None:
    async def scenario() -> tuple[str, bool, bool]:
        pipeline_id = await database.write(lambda b: make_pipeline(b, name="one"))

        def fails(b: Backend) -> None:
            make_task(b, pipeline_id, title="gone")
            make_pipeline(b, name="one")  # DuplicateName: the whole unit rolls back

        with pytest.raises(DuplicateName):
            await database.write(fails)
        kept = await database.read(lambda b: b.get_pipeline(pipeline_id) is not None)
        tasks = await database.read(
            lambda b: b.list_tasks(stage=None, pipeline_id=pipeline_id, after=None, limit=10)
        )
        return pipeline_id, kept, tasks == []

    _pipeline_id, kept, no_task = asyncio.run(scenario())
    assert kept and no_task


@covers("Database.write_sync", "Database.read_sync")
def test_units_of_work_from_plain_threads_see_each_other_once_committed(
    database: Database,
) -> None:
    pipeline_id = database.write_sync(lambda b: make_pipeline(b))

    def two_reads(b: Backend) -> tuple[bool, bool]:
        return b.get_pipeline(pipeline_id) is not None, b.task_exists("nope")

    assert database.read_sync(two_reads) == (True, False)

    made: list[str] = []

    def fails(b: Backend) -> None:
        made.append(make_pipeline(b))
        raise RuntimeError("the job's own error")

    with pytest.raises(RuntimeError, match="the job's own error"):
        database.write_sync(fails)
    assert database.read_sync(lambda b: b.get_pipeline(made[0])) is None


@covers("Database.stats")
def test_stats_are_numbers_by_name(database: Database) -> None:
    database.write_sync(lambda b: make_pipeline(b))
    found = database.stats()
    stats = found.figures
    assert all(isinstance(k, str) and isinstance(v, int | float) for k, v in stats.items())
    commits, _ = found.histograms["commit_duration_seconds"].snapshot()
    assert sum(commits) >= 1  # every backend times its commits
    if database.capabilities.group_commit:  # SQLite's writer counts its batches
        assert stats["writer_batches"] >= 1
        assert stats["writer_jobs"] >= stats["writer_batches"]
        sizes, total = found.histograms["writer_batch_size"].snapshot()
        assert (sum(sizes), total) == (stats["writer_batches"], stats["writer_jobs"])


@covers("Database.close")
def test_a_closed_database_answers_storage_unavailable(opened: Callable[[], Database]) -> None:
    """Moved from tests/postgres/test_database.py, on every backend: after close, no unit of
    work runs (SQLite's reads went on over new connections before)."""
    database = opened()
    database.write_sync(lambda b: make_pipeline(b))
    database.close()
    with pytest.raises(StorageUnavailable):
        database.write_sync(lambda b: b.task_exists("x"))
    with pytest.raises(StorageUnavailable):
        database.read_sync(lambda b: b.task_exists("x"))

    async def scenario() -> None:
        with pytest.raises(StorageUnavailable):
            await database.read(lambda b: b.task_exists("x"))
        with pytest.raises(StorageUnavailable):
            await database.write(lambda b: b.task_exists("x"))

    asyncio.run(scenario())
