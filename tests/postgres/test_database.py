"""PostgresDatabase on a real PostgreSQL: units of work from many threads and several
databases at once (each standing for a server), migrations on open, notifications across
processes' connections, errors at the edge. What every backend's database does alike is
tests/storage."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import psycopg
import pytest

from nulltickets.domain.clock import wall_ms
from nulltickets.domain.commands import Claim, CreatePipeline, CreateTask, Heartbeat
from nulltickets.errors import DuplicateName, StartupError
from nulltickets.service import Tracker
from nulltickets.storage import factory
from nulltickets.storage.ports import EVERY_ROLE
from nulltickets.storage.postgres import PostgresDatabase
from nulltickets.storage.postgres.backend import PostgresBackend
from nulltickets.storage.postgres.database import SEVERAL_FOR
from nulltickets.storage.postgres.migrate import migrations
from nulltickets.storage.postgres.notifier import PostgresNotifier
from tests.conftest import unique, wait_for
from tests.pgserver import PostgresServer
from tests.server import PIPELINE


@pytest.fixture
def open_db(pg_shared_dsn: str) -> Iterator[Callable[..., PostgresDatabase]]:
    opened: list[PostgresDatabase] = []

    def make(dsn: str = pg_shared_dsn, **kw: Any) -> PostgresDatabase:
        db = PostgresDatabase(dsn, **kw)
        db.open()
        opened.append(db)
        return db

    yield make
    for db in opened:
        db.close()


def pipeline(role: str) -> CreatePipeline:
    definition = {**PIPELINE, "states": {**PIPELINE["states"], "todo": {"agent_role": role}}}
    return CreatePipeline(unique("pipe"), msgspec.Raw(msgspec.json.encode(definition)))


def seed(db: PostgresDatabase, tracker: Tracker, role: str, n: int) -> list[str]:
    def job(b: PostgresBackend) -> list[str]:
        now = wall_ms()
        pid = tracker.create_pipeline(b, pipeline(role), now)
        return [tracker.add_task(b, CreateTask(pid, f"t{i}", ""), now) for i in range(n)]

    return db.write_sync(job)


def hearing(listener: PostgresDatabase) -> list[tuple[str, int]]:
    """The wake-ups (role, at) `listener`'s notifier hears from now on, once it listens."""
    heard: list[tuple[str, int]] = []
    listener.notifier.subscribe(lambda role, at, _agent: heard.append((role, at)))
    wait_for("the LISTEN connection", listener.notifier.connected.is_set)
    return heard


def recorded_units(
    db: PostgresDatabase,
) -> tuple[list[PostgresBackend], Callable[[Callable[[PostgresBackend], Any]], Any]]:
    """A runner of units of work on `db` (write_sync) and the list of their backends, to see
    afterwards how each ran (committed_alone)."""
    units: list[PostgresBackend] = []

    def unit(job: Callable[[PostgresBackend], Any]) -> Any:
        def run(b: PostgresBackend) -> Any:
            units.append(b)
            return job(b)

        return db.write_sync(run)

    return units, unit


def test_the_factory_opens_a_postgresql_url(pg_shared_dsn: str) -> None:
    db = factory.open_database(pg_shared_dsn)
    try:
        assert isinstance(db, PostgresDatabase)
        assert db.capabilities.shared_by_servers and db.capabilities.cross_process_notifications
    finally:
        db.close()


def test_claims_from_many_threads_on_several_databases_take_each_task_once(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """Three databases (three servers' pools), 4 threads each, claiming until nothing is left:
    every task is claimed by exactly one of them."""
    role = unique("coder")
    dbs = [open_db() for _ in range(3)]
    trackers = [Tracker(db.notifier, shared=True) for db in dbs]
    tasks = seed(dbs[0], trackers[0], role, 60)
    claimed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(12)

    def agent(db: PostgresDatabase, tracker: Tracker, name: str) -> None:
        start.wait()
        while True:
            result = db.write_sync(lambda b: tracker.claim(b, Claim(name, role), wall_ms()))
            if result is None:
                return
            with lock:
                claimed.append(result.task.id)

    threads = [
        threading.Thread(target=agent, args=(dbs[i % 3], trackers[i % 3], f"agent-{i}"))
        for i in range(12)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert Counter(claimed) == Counter(tasks)


def test_concurrent_reapers_end_each_expired_lease_once(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    role = unique("coder")
    dbs = [open_db() for _ in range(3)]
    trackers = [Tracker(db.notifier, shared=True) for db in dbs]
    tasks = seed(dbs[0], trackers[0], role, 20)
    now = wall_ms()
    for _ in tasks:
        dbs[0].write_sync(lambda b: trackers[0].claim(b, Claim("a", role, lease_ttl_ms=1000), now))
    later = now + 5_000  # every lease above is past its time then
    reaped: list[int] = []
    start = threading.Barrier(6)

    def reaper(db: PostgresDatabase, tracker: Tracker) -> None:
        start.wait()
        reaped.append(db.write_sync(lambda b: tracker.reap_expired(b, later)))

    threads = [
        threading.Thread(target=reaper, args=(dbs[i % 3], trackers[i % 3])) for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(reaped) == len(tasks)
    stale = dbs[1].read_sync(
        lambda b: [b.latest_run(t).status for t in tasks]  # type: ignore[union-attr]
    )
    assert stale == ["stale"] * len(tasks)
    events = dbs[1].read_sync(
        lambda b: [
            [e.kind for e in b.list_events(b.latest_run(t).id, 0, 10)]  # type: ignore[union-attr]
            for t in tasks
        ]
    )
    assert all(kinds.count("lease_expired") == 1 for kinds in events), events


def test_a_commit_on_one_database_wakes_the_subscribers_of_another(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    writer, listener = open_db(), open_db()
    heard = hearing(listener)
    role = unique("coder")
    tracker = Tracker(writer.notifier, shared=True)
    seed(writer, tracker, role, 1)
    wait_for("the notification", lambda: (role, 0) in heard)


def test_a_database_listens_once_opened_so_its_first_commit_is_heard(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """A long-poll may wait from the first request on: open returns with the LISTEN in place,
    or a commit made before it (by this server or another) would wake nobody here."""
    db = open_db()
    assert db.notifier.connected.is_set()
    heard: list[tuple[str, int]] = []
    db.notifier.subscribe(lambda role, at, _agent: heard.append((role, at)))
    role = unique("coder")
    seed(db, Tracker(db.notifier, shared=True), role, 1)  # at once: no wait for the LISTEN
    wait_for("the notification", lambda: (role, 0) in heard)
    assert (EVERY_ROLE, 0) not in heard  # in time: nothing was missed


def test_a_rolled_back_unit_of_work_notifies_nobody(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    writer, listener = open_db(), open_db()
    heard = hearing(listener)
    gone, kept = unique("gone"), unique("kept")

    def fails(b: PostgresBackend) -> None:
        writer.notifier.notify(b, gone, 0)
        raise DuplicateName("no")

    with pytest.raises(DuplicateName):
        writer.write_sync(fails)
    writer.write_sync(lambda b: writer.notifier.notify(b, kept, 0))  # sent after the first
    wait_for("the second notification", lambda: (kept, 0) in heard)
    assert (gone, 0) not in heard


def test_a_unit_of_work_wakes_once_per_notification_and_names_the_agent(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    writer, listener = open_db(), open_db()
    heard: list[tuple[str, int, str | None]] = []
    listener.notifier.subscribe(lambda role, at, agent: heard.append((role, at, agent)))
    wait_for("the LISTEN connection", listener.notifier.connected.is_set)
    role, done = unique("coder\tx;y"), unique("done")
    agent = 'bob;\t"\n\u00e9'  # whatever an agent id holds travels as it is

    def notifies(b: PostgresBackend) -> None:
        for _ in range(3):
            writer.notifier.notify(b, role, 0)
        writer.notifier.notify(b, role, 0, agent)
        writer.notifier.notify(b, role, 0, agent)
        writer.notifier.notify(b, role, 7)

    writer.write_sync(notifies)
    writer.write_sync(lambda b: writer.notifier.notify(b, done, 0))  # sent after the first
    wait_for("the last notification", lambda: (done, 0, None) in heard)
    mine = [h for h in heard if h[0] == role]
    assert sorted(mine, key=str) == sorted(
        [(role, 0, None)] * 3 + [(role, 0, agent)] * 2 + [(role, 7, None)], key=str
    )


def test_the_listener_reconnects_and_wakes_every_role_once(
    open_db: Callable[..., PostgresDatabase], postgres: PostgresServer
) -> None:
    db = open_db()
    heard: list[tuple[str, int]] = []
    db.notifier.subscribe(lambda role, at, _agent: heard.append((role, at)))
    wait_for("the LISTEN connection", db.notifier.connected.is_set)
    with postgres.admin() as admin:  # what a restart does to the listening connection
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE query LIKE '%%LISTEN nulltickets_claimable%%' AND pid <> pg_backend_pid()"
        )
    wait_for("the reconnection's wake-up", lambda: (EVERY_ROLE, 0) in heard)
    role = unique("coder")
    db.write_sync(lambda b: db.notifier.notify(b, role, 0))
    wait_for("a notification after the reconnection", lambda: (role, 0) in heard)


def test_a_listen_waited_for_in_vain_wakes_every_role_once_it_comes(pg_shared_dsn: str) -> None:
    """Had open stopped waiting before the first LISTEN, what was committed meanwhile reached
    nobody here: once the LISTEN is in place, every long-poll looks again, as after a
    reconnection (and not at all when the LISTEN came in time: the test before)."""
    notifier = PostgresNotifier(pg_shared_dsn)
    heard: list[tuple[str, int]] = []
    notifier.subscribe(lambda role, at, _agent: heard.append((role, at)))
    assert not notifier.listening_within(0)  # not started: the wait is in vain
    notifier.start()
    try:
        wait_for("the late LISTEN's wake-up", lambda: (EVERY_ROLE, 0) in heard)
        assert notifier.reconnects == 0
    finally:
        notifier.stop()


def test_servers_starting_at_once_migrate_an_empty_database_once(pg_empty_dsn: str) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4)
    dbs: list[PostgresDatabase] = []

    def boot() -> None:
        db = PostgresDatabase(pg_empty_dsn)
        start.wait()
        try:
            db.open()
            dbs.append(db)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=boot) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for db in dbs:
        db.close()
    assert errors == []
    with psycopg.connect(pg_empty_dsn) as conn:
        rows = conn.execute("SELECT version FROM nulltickets_schema ORDER BY version").fetchall()
    assert [r[0] for r in rows] == [n for n, _, _ in migrations()]


def test_an_unreachable_database_is_a_one_line_startup_error(postgres: PostgresServer) -> None:
    from tests.pgserver import free_port

    url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nothing"
    with pytest.raises(StartupError) as failure:
        PostgresDatabase(url).open()
    message = str(failure.value)
    assert "\n" not in message and "secret" not in message
    assert message.startswith("cannot open PostgreSQL database postgresql://postgres:***@")


def test_connections_killed_under_the_pool_are_replaced_without_an_error(
    open_db: Callable[..., PostgresDatabase], postgres: PostgresServer
) -> None:
    """What PostgreSQL's restart leaves in a pool: connections that no longer work. The next
    unit of work runs again on a fresh one instead of failing."""
    db = open_db()
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    seed(db, tracker, role, 3)
    dbname = db.read_sync(lambda b: b.conn.execute("SELECT current_database()").fetchone()[0])
    with postgres.admin() as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND query NOT LIKE '%%LISTEN nulltickets_claimable%%'",
            (dbname,),
        )
    result = db.write_sync(lambda b: tracker.claim(b, Claim("a", role), wall_ms()))
    assert result is not None
    assert db.read_sync(lambda b: b.task_exists(result.task.id))


def test_a_heartbeat_racing_the_reaper_never_revives_an_expired_lease(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    db_a, db_b = open_db(), open_db()
    t_a, t_b = Tracker(db_a.notifier, shared=True), Tracker(db_b.notifier, shared=True)
    role = unique("coder")
    seed(db_a, t_a, role, 1)
    now = wall_ms()
    claim = db_a.write_sync(lambda b: t_a.claim(b, Claim("a", role, lease_ttl_ms=1000), now))
    assert claim is not None
    from nulltickets.domain.tokens import lease_token_hash

    token = lease_token_hash(claim.lease_token)
    later = claim.expires_at_ms + 1_000  # past the lease, whatever TTL it was given
    outcome: list[str] = []

    def heartbeat() -> None:
        try:
            db_b.write_sync(lambda b: t_b.heartbeat(b, claim.lease_id, token, Heartbeat(), later))
            outcome.append("extended")
        except Exception as exc:
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    reaped = db_a.write_sync(lambda b: t_a.reap_expired(b, later))
    thread.join(30)
    assert reaped in (0, 1) and outcome and outcome[0] != "extended"
    # A reaper passes over a lease another unit of work holds (SKIP LOCKED): if it met the
    # heartbeat's lock, its next pass ends the run. Either way the run ends once, as stale.
    reaped += db_a.write_sync(lambda b: t_a.reap_expired(b, later))
    assert reaped == 1
    status = db_a.read_sync(lambda b: b.run_status(claim.run.id))
    assert status == "stale"
    kinds = db_a.read_sync(lambda b: [e.kind for e in b.list_events(claim.run.id, 0, 10)])
    assert kinds.count("lease_expired") == 1, kinds


def test_each_verb_of_the_agent_cycle_is_one_statement_that_commits_itself(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """A claim, a heartbeat, an event and a transition are each one statement, run as its own
    transaction (PostgresBackend.ALONE): PostgreSQL answers once per unit of work. The
    transition's wake-ups go with it."""
    from nulltickets.domain.commands import AppendEvent, MoveTask, WriteCheckpoint
    from nulltickets.domain.tokens import lease_token_hash

    db, listener = open_db(), open_db()
    heard = hearing(listener)
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    seed(db, tracker, role, 3)
    now = wall_ms()
    units, unit = recorded_units(db)

    # The first claim reads the role's limits and reaps expired leases first: then in a
    # transaction of several statements.
    first = unit(lambda b: tracker.claim(b, Claim("a", role), now))
    assert first is not None and units[-1].committed_alone is None
    claim = unit(lambda b: tracker.claim(b, Claim("a", role), now + 1))
    assert claim is not None and units[-1].committed_alone == "claim_task"
    assert claim.task.available_transitions[0].trigger == "submit"
    token = lease_token_hash(claim.lease_token)
    expires = unit(lambda b: tracker.heartbeat(b, claim.lease_id, token, Heartbeat(), now + 2))
    assert expires > claim.expires_at_ms and units[-1].committed_alone == "extend_held_lease"
    event = AppendEvent("progress", msgspec.Raw(b'{"step": 1}'))
    unit(lambda b: tracker.append_event(b, claim.run.id, token, event, now + 3))
    assert units[-1].committed_alone == "insert_event_under_lease"
    patch = WriteCheckpoint(msgspec.Raw(b'{"step": 1}'))
    saved = unit(lambda b: tracker.write_checkpoint(b, claim.run.id, token, patch, now + 3))
    assert (bytes(saved.checkpoint), saved.fence) == (b'{"step":1}', claim.fence)
    assert units[-1].committed_alone == "checkpoint_run"
    heard.clear()
    moved = unit(lambda b: tracker.move(b, claim.run.id, token, MoveTask("submit"), now + 4))
    assert (moved.previous_stage, moved.new_stage) == ("todo", "review")
    assert units[-1].committed_alone == "transition_run"
    # The stage it left caps nothing: no wake-up for its role (notifications arrive in the
    # order of their commits, so the marker sent after it says none is coming).
    marker = unique("marker")
    db.write_sync(lambda b: db.notifier.notify(b, marker, 0))
    wait_for("the marker", lambda: (marker, 0) in heard)
    assert (role, 0) not in heard
    assert ("reviewer", 0) in heard  # the new work in the stage it entered
    kinds = db.read_sync(lambda b: [e.kind for e in b.list_events(claim.run.id, 0, 10)])
    assert kinds == ["progress", "checkpoint", "transition"]
    data = db.read_sync(lambda b: bytes(b.list_events(claim.run.id, 0, 10)[2].data))
    assert msgspec.json.decode(data) == {
        "trigger": "submit",
        "from": "todo",
        "to": "review",
        "instructions": "review it",
    }
    # Made with an API key (confirmed in every unit of work on a shared database): the
    # statement checks the key itself, still one statement.
    db.write_sync(
        lambda b: b.insert_api_key(
            id=f"key-{role}", key_hash=role.encode(), name=role, access="agent", roles=[], now=now
        )
    )

    def keyed(b: PostgresBackend) -> Any:
        b.confirm_key(f"key-{role}")
        return tracker.claim(b, Claim("a", role), now + 5)

    assert unit(keyed) is not None and units[-1].committed_alone == "claim_task"
    # A refused one (the lease is gone) changes nothing and says why, step by step.
    from nulltickets.errors import LeaseNotFound

    with pytest.raises(LeaseNotFound):
        unit(lambda b: tracker.heartbeat(b, claim.lease_id, token, Heartbeat(), now + 6))
    assert units[-1].committed_alone is None


def round_trips(trace: str) -> list[str]:
    """The messages after which the client waited for PostgreSQL, from a libpq trace: a
    simple query (its text's first word) or the Sync that ends an extended one."""
    sent = []
    for line in trace.splitlines():
        fields = line.split("\t")
        if len(fields) > 3 and fields[1] == "F" and fields[3].startswith(("Query", "Sync")):
            sent.append(fields[3])
    return sent


def test_a_unit_that_writes_refuses_a_connection_in_transaction_mode(pg_shared_dsn: str) -> None:
    """Its statements of ALONE would not be their own transactions there: a writer's connection
    is in autocommit mode (the pools make them so), and nothing else is taken."""
    with psycopg.connect(pg_shared_dsn) as conn:
        with pytest.raises(ValueError, match="autocommit"):
            PostgresBackend(conn, writing=True)
        PostgresBackend(conn)  # a read needs no such thing
    with psycopg.connect(pg_shared_dsn, autocommit=True) as conn:
        assert PostgresBackend(conn, writing=True).writing


def test_a_request_under_an_idempotency_key_takes_three_round_trips(
    open_db: Callable[..., PostgresDatabase], tmp_path: Any
) -> None:
    """An idempotent transition made with an API key: BEGIN, the key's check, the key's lock
    and the read of its record in one message; the transition; the answer recorded and the
    COMMIT in one message. Its replay finds the record; a revoked key writes nothing."""
    from nulltickets.domain.commands import MoveTask
    from nulltickets.domain.tokens import lease_token_hash
    from nulltickets.errors import Unauthorized

    db = open_db()
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    seed(db, tracker, role, 2)
    now = wall_ms()
    key_id = f"key-{role}"
    db.write_sync(
        lambda b: b.insert_api_key(
            id=key_id, key_hash=role.encode(), name=role, access="agent", roles=[], now=now
        )
    )
    assert db.write_sync(lambda b: tracker.claim(b, Claim("warm", role), now))
    claim = db.write_sync(lambda b: tracker.claim(b, Claim("a", role), now + 1))
    token = lease_token_hash(claim.lease_token)
    key = ("k-" + role, "POST", f"/runs/{claim.run.id}/transition")
    trace = tmp_path / "trace"

    def idempotent(b: PostgresBackend) -> Any:
        b.confirm_key(key_id)
        found = b.get_idempotency(*key)
        if found is not None:
            return found
        moved = tracker.move(b, claim.run.id, token, MoveTask("submit"), now + 2)
        b.put_idempotency(
            key=key[0],
            method=key[1],
            path=key[2],
            request_hash=b"h" * 32,
            auth_hash=token,
            status=200,
            body='{"moved":1}',
            now=now + 2,
        )
        return moved

    def traced(job: Callable[[PostgresBackend], Any]) -> tuple[Any, list[str]]:
        conns = []
        with open(trace, "w") as out:

            def run(b: PostgresBackend) -> Any:
                conns.append(b.conn)
                b.conn.pgconn.trace(out.fileno())
                return job(b)

            try:
                result = db.write_sync(run)
            finally:
                conns[0].pgconn.untrace()
        return result, round_trips(trace.read_text())

    moved, sent = traced(idempotent)
    assert (moved.previous_stage, moved.new_stage) == ("todo", "review")
    assert sent == ["Query", "Sync", "Query"], sent  # BEGIN and script, move, COMMIT
    first = trace.read_text().split("Sync")[0]
    assert '"BEGIN;' in first and "pg_advisory_xact_lock" in first, first
    assert "COMMIT" in trace.read_text().split("Sync")[-1]
    replayed, sent = traced(idempotent)
    assert replayed == (b"h" * 32, token, 200, '{"moved":1}')
    assert sent == ["Query", "Query"], sent  # BEGIN and script, COMMIT
    lease = db.read_sync(lambda b: b.lease_by_run(claim.run.id))
    assert lease is None  # moved once
    db.write_sync(lambda b: b.delete_api_key(key_id))
    other = ("k2-" + role, "POST", "/x")

    def revoked(b: PostgresBackend) -> Any:
        b.confirm_key(key_id)
        b.get_idempotency(*other)

    with pytest.raises(Unauthorized):
        db.write_sync(revoked)
    assert db.read_sync(lambda b: b.get_idempotency(*other)) is None


def test_a_stored_value_is_written_and_deleted_in_one_statement_that_commits_itself(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """PUT and DELETE /store/...: one statement each, its own transaction, the request's key
    checked in it; a revoked key writes nothing and is told so; deleting what is not there
    asks whether the key still exists."""
    from nulltickets.errors import Unauthorized

    db = open_db()
    units, unit = recorded_units(db)
    namespace, now = unique("ns"), wall_ms()
    key_id = f"key-{namespace}"
    db.write_sync(
        lambda b: b.insert_api_key(
            id=key_id,
            key_hash=namespace.encode(),
            name=namespace,
            access="admin",
            roles=[],
            now=now,
        )
    )

    def keyed(job: Callable[[PostgresBackend], Any]) -> Callable[[PostgresBackend], Any]:
        def run(b: PostgresBackend) -> Any:
            b.confirm_key(key_id)
            return job(b)

        return run

    unit(keyed(lambda b: b.put_value(namespace, "k", '{"b":1,"a":2}', now)))
    assert units[-1].committed_alone == "store_put"
    entry = db.read_sync(lambda b: b.get_value(namespace, "k"))
    assert entry is not None and bytes(entry.value) == b'{"b":1,"a":2}'
    unit(keyed(lambda b: b.put_value(namespace, "k", "[3]", now + 1)))
    assert units[-1].committed_alone == "store_put"
    unit(keyed(lambda b: b.delete_value(namespace, "k")))
    assert units[-1].committed_alone == "store_delete"
    assert db.read_sync(lambda b: b.get_value(namespace, "k")) is None
    unit(keyed(lambda b: b.delete_value(namespace, "k")))  # nothing there: the key is asked
    assert units[-1].committed_alone is None
    db.write_sync(lambda b: b.delete_api_key(key_id))
    with pytest.raises(Unauthorized):
        unit(keyed(lambda b: b.put_value(namespace, "gone", "1", now + 2)))
    assert db.read_sync(lambda b: b.get_value(namespace, "gone")) is None


def test_a_transition_out_of_a_capped_stage_wakes_its_role(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """A stage whose policy caps its leases (max_concurrency) announces the slot a transition
    frees, in the transition's own statement."""
    from nulltickets.domain.commands import MoveTask
    from nulltickets.domain.tokens import lease_token_hash

    db, listener = open_db(), open_db()
    heard = hearing(listener)
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    states = {**PIPELINE["states"], "todo": {"agent_role": role, "max_concurrency": 2}}
    definition = msgspec.json.encode({**PIPELINE, "states": states})
    now = wall_ms()

    def job(b: PostgresBackend) -> None:
        pid = tracker.create_pipeline(
            b, CreatePipeline(unique("pipe"), msgspec.Raw(definition)), now
        )
        for title in ("first", "second"):
            tracker.add_task(b, CreateTask(pid, title, ""), now)

    db.write_sync(job)
    units, unit = recorded_units(db)
    assert unit(lambda b: tracker.claim(b, Claim("warm", role), now))  # reads the role's limits
    heard.clear()
    claim = unit(lambda b: tracker.claim(b, Claim("a", role), now + 1))
    assert claim is not None
    token = lease_token_hash(claim.lease_token)
    unit(lambda b: tracker.move(b, claim.run.id, token, MoveTask("submit"), now + 2))
    assert units[-1].committed_alone == "transition_run"
    wait_for("the wake-up of the capped stage the task left", lambda: (role, 0) in heard)


def test_a_task_created_on_its_own_is_one_statement_with_its_wake_up(
    open_db: Callable[..., PostgresDatabase], pg_empty_dsn: str
) -> None:
    """POST /tasks for a task with no dependencies and no assignment, once the process has
    read its pipeline, is one statement that commits itself and sends the wake-up of the
    stage's role; under a taken idempotency key it answers with the task already there; with
    a dependency it goes step by step in one transaction; a revoked key writes nothing."""
    from nulltickets.errors import Unauthorized

    db, listener = open_db(pg_empty_dsn), open_db(pg_empty_dsn)
    heard = hearing(listener)
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    now = wall_ms()
    pid = db.write_sync(lambda b: tracker.create_pipeline(b, pipeline(role), now))
    units, unit = recorded_units(db)

    def create(cmd: CreateTask, key_id: str | None = None) -> str:
        def job(b: PostgresBackend) -> str:
            if key_id is not None:
                b.confirm_key(key_id)
            return tracker.create_task(b, cmd, now)

        return str(unit(job))

    create(CreateTask(pid, "zero", ""))  # the process reads the pipeline's definition once
    assert units[-1].committed_alone is None
    first = create(CreateTask(pid, "first", "", idempotency_key="plan"))
    assert units[-1].committed_alone == "create_task"
    wait_for("the wake-up of the stage's role", lambda: (role, 0) in heard)
    assert create(CreateTask(pid, "again", "", idempotency_key="plan")) == first
    assert units[-1].committed_alone is None  # nothing written: it read the task instead
    second = create(CreateTask(pid, "second", "", dependencies=[first]))
    assert units[-1].committed_alone is None
    assert [d.depends_on_task_id for d in db.read_sync(lambda b: b.list_dependencies(second))] == [
        first
    ]
    with pytest.raises(Unauthorized):
        create(CreateTask(pid, "refused", ""), key_id=unique("gone"))
    listed = db.read_sync(lambda b: b.list_tasks(stage=None, pipeline_id=pid, after=None, limit=10))
    titles = {t.title for t in listed}
    assert titles == {"zero", "first", "second"}


def test_a_read_of_one_statement_runs_on_its_own_and_a_longer_kind_learns_its_snapshot(
    open_db: Callable[..., PostgresDatabase], pg_empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose job runs one statement runs it with no transaction around it: one round
    trip, no BEGIN nor ROLLBACK. A job of a kind that goes on to a second statement runs
    again in a snapshot, with the same answer, and the next SEVERAL_FOR reads of its kind run
    in one without the statement spent first; then one is tried alone again. With no
    transaction around it a read still cannot write."""
    from nulltickets.errors import StorageReadOnly

    db = open_db(pg_empty_dsn)  # what it reads, no other test writes meanwhile
    seen: list[tuple[str, bool]] = []  # each statement, and whether it ran on its own
    run_statement = PostgresBackend._cur

    def spy(self: PostgresBackend, name: str, params: dict[str, Any]) -> Any:
        on_its_own = bool(self.conn.autocommit)
        cursor = run_statement(self, name, params)  # SecondStatement: refused, not run
        seen.append((name, on_its_own))
        return cursor

    monkeypatch.setattr(PostgresBackend, "_cur", spy)

    def two(b: PostgresBackend) -> tuple[int, int]:
        return b.last_event_id(), len(b.list_pipelines())

    async def reads() -> list[Any]:
        got: list[Any] = [await db.read(lambda b: b.last_event_id(), kind="one")]
        got.append(list(seen))
        for _ in range(2):
            seen.clear()
            got.append(await db.read(two, kind="two"))
            got.append(list(seen))
        for _ in range(SEVERAL_FOR - 1):
            await db.read(two, kind="two")
        seen.clear()
        await db.read(two, kind="two")  # once in a while, tried as one statement again
        got.append(list(seen))
        return got

    one, one_seen, first, first_seen, again, again_seen, later_seen = asyncio.run(reads())
    assert one_seen == [("last_event_id", True)]
    assert first_seen == [
        ("last_event_id", True),
        ("last_event_id", False),
        ("list_pipelines", False),
    ]
    assert again_seen == [("last_event_id", False), ("list_pipelines", False)]
    assert later_seen == first_seen
    assert first == again == db.read_sync(two)
    assert one == db.read_sync(lambda b: b.last_event_id())

    async def write_in_a_read() -> None:
        await db.read(lambda b: b.put_value("ns", unique("k"), "1", 1), kind="sneaky")

    seen.clear()
    with pytest.raises(StorageReadOnly):
        asyncio.run(write_in_a_read())
    assert seen == []  # refused by PostgreSQL


def test_the_reads_made_every_cycle_or_probe_are_one_statement_on_their_own(
    open_db: Callable[..., PostgresDatabase], pg_empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /tasks/{id} (nullboiler's, every cycle), GET /health (a supervisor's probe), GET
    /ops/queue and a task's runs (a dashboard's), a task's checkpoint: each reads the store in
    one statement, run with no transaction around it, so each is one round trip; and each
    answers as before."""
    db = open_db(pg_empty_dsn)
    tracker = Tracker(db.notifier, shared=True)
    role = unique("coder")
    tasks = seed(db, tracker, role, 3)
    now = wall_ms()
    assert db.write_sync(lambda b: tracker.claim(b, Claim("a", role), now)) is not None
    seen: list[tuple[str, bool]] = []
    run_statement = PostgresBackend._cur

    def spy(self: PostgresBackend, name: str, params: dict[str, Any]) -> Any:
        seen.append((name, bool(self.conn.autocommit)))
        return run_statement(self, name, params)

    db.read_sync(lambda b: tracker.get_task(b, tasks[0]))  # the pipeline read once, then kept
    monkeypatch.setattr(PostgresBackend, "_cur", spy)
    reads: list[tuple[str, Callable[[Any], Any], str]] = [
        ("get_task", lambda b: tracker.get_task(b, tasks[0]), "task_view"),
        ("health", lambda b: tracker.health(b, now), "health_counts"),
        ("queue_report", lambda b: tracker.queue_report(b, now, 60_000, 300_000), "queue_counts"),
        ("runs", lambda b: tracker.list_task_runs(b, tasks[0], None, 10, False), "list_task_runs"),
        ("checkpoint", lambda b: tracker.get_checkpoint(b, tasks[0]), "task_checkpoint"),
    ]
    answers = {}
    for kind, job, statement in reads:
        seen.clear()
        answers[kind] = asyncio.run(db.read(job, kind=kind))
        assert seen == [(statement, True)], kind
    assert answers["get_task"].id == tasks[0] and answers["get_task"].latest_run is not None
    health = answers["health"]
    assert [(c.stage, c.count) for c in health.tasks_by_stage] == [("todo", 3)]
    assert health.active_leases == 1
    (run,), _ = answers["runs"]
    assert (run.task_id, run.attempt, run.status) == (tasks[0], 1, "running")
    checkpoint = answers["checkpoint"]
    assert (bytes(checkpoint.checkpoint), checkpoint.fence, checkpoint.previous_failures) == (
        b"null",
        1,
        [],
    )
    roles = {q.role: q for q in answers["queue_report"].roles}
    assert (roles[role].claimable_count, roles[role].near_expiry_leases) == (2, 0)


def test_the_reaper_ends_each_expired_lease_in_one_statement_with_its_wake_ups(
    open_db: Callable[..., PostgresDatabase], pg_empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the statement that finds and locks the expired leases, each one is a single
    statement (expire_lease) that ends its run stale, decides the retry and sends the
    wake-ups; when another server made a pipeline this process has not read, a lease goes
    step by step, and the pipelines read then let the rest go in one statement each."""
    db, listener = open_db(pg_empty_dsn), open_db(pg_empty_dsn)  # no other test's pipelines
    heard = hearing(listener)
    tracker = Tracker(db.notifier, shared=True, rand=lambda: 0.5)
    role = unique("coder")
    tasks = seed(db, tracker, role, 3)
    names: list[str] = []
    run_statement = PostgresBackend._cur

    def seen(self: PostgresBackend, name: str, params: dict[str, Any]) -> Any:
        names.append(name)
        return run_statement(self, name, params)

    monkeypatch.setattr(PostgresBackend, "_cur", seen)

    def claim_all(at: int) -> list[str]:
        claims = [
            db.write_sync(lambda b: tracker.claim(b, Claim("a", role, lease_ttl_ms=1_000), at))
            for _ in tasks
        ]
        assert sorted(c.task.id for c in claims) == sorted(tasks)
        return [c.run.id for c in claims]

    def reap(at: int) -> Counter[str]:
        names.clear()
        assert db.write_sync(lambda b: tracker.reap_expired(b, at)) == len(tasks)
        return Counter(names)

    now = wall_ms()
    claim_all(now)
    seed(db, Tracker(db.notifier, shared=True), unique("other"), 0)  # another server's
    first = reap(now + 5_000)
    assert first["expire_lease"] == len(tasks)  # the first refused: a pipeline not read
    assert first["end_run"] == 1  # ... so that lease went step by step

    runs = claim_all(now + 6_000)  # the default backoff retries the first failures at once
    heard.clear()
    assert reap(now + 9_000) == Counter(
        {"expired_leases": 1, "next_lease_expiry": 1, "expire_lease": len(tasks)}
    )
    wait_for("the wake-ups", lambda: (role, 0) in heard)
    for run_id in runs:
        run = db.read_sync(lambda b, run_id=run_id: b.run_by_id(run_id))
        assert (run.status, run.ended_at_ms) == ("stale", now + 9_000)
        kinds = db.read_sync(lambda b, run_id=run_id: [e.kind for e in b.list_events(run_id, 0, 9)])
        assert kinds == ["lease_expired", "retry_scheduled"]


def test_a_fail_and_a_release_are_each_one_statement_that_commits_itself(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """A failure (its retry or its dead letter decided in the statement) and a release are
    each one statement, run as its own transaction (PostgresBackend.ALONE), with their
    wake-ups; with a key, the statement checks it; a refused one changes nothing and says why,
    step by step."""
    from nulltickets.domain.commands import FailRun, ReleaseRun, RetryPolicy
    from nulltickets.domain.tokens import lease_token_hash
    from nulltickets.errors import LeaseNotFound, LeaseSuperseded

    db, listener = open_db(), open_db()
    heard = hearing(listener)
    tracker = Tracker(db.notifier, shared=True, rand=lambda: 0.5)
    role = unique("coder")

    def job(b: PostgresBackend) -> tuple[str, str, str]:
        now = wall_ms()
        pid = tracker.create_pipeline(b, pipeline(role), now)
        retried = RetryPolicy(max_attempts=5, retry_delay_ms=7_000)
        dead = RetryPolicy(max_attempts=1, dead_letter_stage="dead")
        return (
            tracker.add_task(b, CreateTask(pid, "r", "", priority=3, retry_policy=retried), now),
            tracker.add_task(b, CreateTask(pid, "d", "", priority=2, retry_policy=dead), now),
            tracker.add_task(b, CreateTask(pid, "p", "", priority=1), now),
        )

    retried_id, dead_id, put_down_id = db.write_sync(job)
    # A pipeline another server made, which this process has not read.
    other = Tracker(listener.notifier, shared=True)
    listener.write_sync(lambda b: other.create_pipeline(b, pipeline(unique("other")), wall_ms()))
    now = wall_ms()
    units, unit = recorded_units(db)

    def claim(at: int) -> Any:
        got = unit(lambda b: tracker.claim(b, Claim("a", role), at))
        assert got is not None
        return got, lease_token_hash(got.lease_token)

    def events(run_id: str) -> list[tuple[str, Any]]:
        got = db.read_sync(lambda b: b.list_events(run_id, 0, 10))
        return [(e.kind, msgspec.json.decode(bytes(e.data))) for e in got]

    # This process has not read every pipeline (another server's is there): step by step,
    # reading them; then each failure is one statement.
    first, token = claim(now)
    assert first.task.id == retried_id
    heard.clear()
    unit(lambda b: tracker.fail_run(b, first.run.id, token, FailRun("boom"), now + 1))
    assert units[-1].committed_alone is None
    wait_for("the retry's wake-up at its time", lambda: (role, now + 7_001) in heard)
    assert (role, 0) in heard  # and the capacity freed at once
    assert events(first.run.id) == [
        (
            "retry_scheduled",
            {
                "reason": "retry_scheduled",
                "failed_attempts": 1,
                "retry_delay_ms": 7_000,
                "next_eligible_at_ms": now + 7_001,
            },
        )
    ]
    task = db.read_sync(lambda b: b.get_task(retried_id))
    assert (task.stage, task.next_eligible_at_ms) == ("todo", now + 7_001)
    run = db.read_sync(lambda b: b.run_by_id(first.run.id))
    assert (run.status, run.ended_at_ms) == ("failed", now + 1)
    assert db.read_sync(lambda b: b.lease_by_run(first.run.id)) is None

    second, token = claim(now + 2)
    assert second.task.id == dead_id
    unit(lambda b: tracker.fail_run(b, second.run.id, token, FailRun("again"), now + 3))
    assert units[-1].committed_alone == "fail_run"
    assert events(second.run.id) == [
        (
            "dead_letter",
            {
                "reason": "max_attempts_exceeded",
                "failed_attempts": 1,
                "from_stage": "todo",
                "dead_letter_stage": "dead",
            },
        )
    ]
    task = db.read_sync(lambda b: b.get_task(dead_id))
    assert (task.stage, task.task_version, task.dead_letter_reason) == (
        "dead",
        2,
        "max_attempts_exceeded",
    )

    # Made with an API key: the statement checks the key itself, still one statement.
    db.write_sync(
        lambda b: b.insert_api_key(
            id=f"key-{role}", key_hash=role.encode(), name=role, access="agent", roles=[], now=now
        )
    )
    third, token = claim(now + 4)
    assert third.task.id == put_down_id
    heard.clear()

    def keyed(b: PostgresBackend) -> Any:
        b.confirm_key(f"key-{role}")
        return tracker.release_run(b, third.run.id, token, ReleaseRun("later"), now + 5)

    released = unit(keyed)
    assert (released.run_id, released.task_id) == (third.run.id, put_down_id)
    assert units[-1].committed_alone == "release_run"
    wait_for("the wake-up of the stage the task is claimable in again", lambda: bool(heard))
    assert heard == [(role, 0)]
    assert events(third.run.id) == [("released", {"reason": "later", "agent_id": "a"})]
    run = db.read_sync(lambda b: b.run_by_id(third.run.id))
    assert (run.status, run.ended_at_ms) == ("released", now + 5)

    # Refused ones (the lease is gone; another fence) change nothing and say why, step by step.
    with pytest.raises(LeaseNotFound):
        unit(lambda b: tracker.release_run(b, third.run.id, token, ReleaseRun(), now + 6))
    assert units[-1].committed_alone is None
    fourth, token = claim(now + 7)
    assert fourth.task.id == put_down_id
    with pytest.raises(LeaseSuperseded):
        unit(
            lambda b: tracker.fail_run(
                b, fourth.run.id, token, FailRun("x", expected_fence=1), now + 8
            )
        )
    assert units[-1].committed_alone is None
    assert db.read_sync(lambda b: b.run_by_id(fourth.run.id)).status == "running"
    # A retry in one statement (the default backoff: the first at once), its wake-ups with it.
    heard.clear()
    retry = FailRun("x", expected_fence=2)
    unit(lambda b: tracker.fail_run(b, fourth.run.id, token, retry, now + 9))
    assert units[-1].committed_alone == "fail_run"
    wait_for("the retry's wake-ups", lambda: sorted(heard) == [(role, 0), (role, now + 9)])
    assert events(fourth.run.id) == [
        (
            "retry_scheduled",
            {
                "reason": "retry_scheduled",
                "failed_attempts": 1,
                "retry_delay_ms": 0,
                "next_eligible_at_ms": now + 9,
            },
        )
    ]


def test_releasing_an_agent_is_one_statement_that_checks_the_key(
    open_db: Callable[..., PostgresDatabase],
) -> None:
    """POST /agents/release is one statement run as its own transaction, every lease of the
    agent in it, with the wake-ups; with a key, the statement checks it, and a revoked key is
    refused with nothing changed."""
    from nulltickets.domain.commands import ReleaseAgent
    from nulltickets.errors import Unauthorized

    db, listener = open_db(), open_db()
    heard = hearing(listener)
    tracker = Tracker(db.notifier, shared=True)
    role, agent = unique("coder"), unique("agent")
    now = wall_ms()

    def job(b: PostgresBackend) -> list[str]:
        pid = tracker.create_pipeline(b, pipeline(role), now)
        return [tracker.add_task(b, CreateTask(pid, f"t{n}", ""), now) for n in range(3)]

    db.write_sync(job)
    claims = [db.write_sync(lambda b: tracker.claim(b, Claim(agent, role), now)) for _ in "ab"]
    units: list[PostgresBackend] = []
    key = f"key-{role}"
    db.write_sync(
        lambda b: b.insert_api_key(
            id=key, key_hash=role.encode(), name=role, access="agent", roles=[], now=now
        )
    )

    def release(b: PostgresBackend) -> Any:
        units.append(b)
        b.confirm_key(key)
        return tracker.release_agent(b, ReleaseAgent(agent, "stopping"), now + 1)

    heard.clear()
    got = db.write_sync(release)
    assert units[-1].committed_alone == "release_agent"
    assert sorted(r.run_id for r in got.released) == sorted(c.run.id for c in claims)
    wait_for("the wake-up of the stage", lambda: bool(heard))
    assert heard == [(role, 0)]  # one per stage and role, not one per lease
    for c in claims:
        run = db.read_sync(lambda b, c=c: b.run_by_id(c.run.id))
        assert (run.status, run.ended_at_ms) == ("released", now + 1)

    again = db.write_sync(lambda b: tracker.claim(b, Claim(agent, role), now + 2))
    assert again is not None
    db.write_sync(lambda b: b.delete_api_key(key))
    with pytest.raises(Unauthorized):
        db.write_sync(release)
    assert units[-1].committed_alone is None
    assert db.read_sync(lambda b: b.run_by_id(again.run.id)).status == "running"
