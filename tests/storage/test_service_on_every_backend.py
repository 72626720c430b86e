"""Behaviour of the service on every backend: the contract suite's tests that go through
`Service` and `Tracker` (idempotent replays, keys and their revocation, fences and expiry as the
service decides them, cancel and requeue, the service's wake-ups). The rest of tests/storage
exercises the storage port itself; these stay here, on the same backends, and reach the verbs
through the table (`VERBS`) and `Service.call`, the one unit of work every surface runs, with a
few helpers at the top.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import pytest

from nulltickets.domain.clock import FixedClock
from nulltickets.domain.commands import (
    AppendEvent,
    CancelTask,
    Claim,
    CreateKey,
    CreatePipeline,
    CreateTask,
    CreateTasks,
    FailRun,
    Heartbeat,
    MoveTask,
    PutValue,
    RequeueTask,
    RetryPolicy,
    WriteCheckpoint,
)
from nulltickets.domain.model import (
    Access,
    ClaimResult,
    CreatedKey,
    KeyInfo,
    TaskDetails,
    TransitionResult,
)
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import (
    IdempotencyConflict,
    InvalidRequest,
    LeaseExpired,
    LeaseNotFound,
    LeaseSuperseded,
    NotFound,
    RunNotRunning,
    StorageBusy,
    TaskCancelled,
    TaskLeased,
    TaskVersionMismatch,
    Unauthorized,
)
from nulltickets.service import VERBS, Answer, Idem, Kind, Service, Tracker
from nulltickets.storage.factory import open_database
from nulltickets.storage.ports import Database
from tests.conftest import wait_for
from tests.server import PIPELINE

T = TypeVar("T")


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock()


@pytest.fixture
def service(database: Database, clock: FixedClock) -> Service:
    return Service(database, clock=clock, rand=lambda: 0.5)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


async def acall(
    service: Service, name: str, *path: str, idem: Idem | None = None, **args: Any
) -> Answer:
    """Verb `name` of the table as one unit of work. `cmd` is the request itself, handed
    over as a body is (the unit takes it when it needs it); a query parameter left out takes
    what a request without it gets."""
    verb = VERBS[name]
    given = {q.arg or q.name: q.parse(None) for q in verb.query}
    given.update(args)
    if "cmd" in args:
        cmd = args["cmd"]
        given["cmd"] = lambda: cmd
    return await service.call(verb, path, given, idem)


def answer(
    service: Service, name: str, *path: str, idem: Idem | None = None, **args: Any
) -> Answer:
    """What verb `name` answered: what it did and the bytes the HTTP API sends."""
    return run(acall(service, name, *path, idem=idem, **args))


def value(got: Answer, type: Any = Any) -> Any:
    """An answer's body, decoded (into `type` when given); None when it has none."""
    return msgspec.json.decode(got.body, type=type) if got.body else None


def call(
    service: Service,
    name: str,
    *path: str,
    idem: Idem | None = None,
    type: Any = Any,
    **args: Any,
) -> Any:
    """Verb `name`'s body, decoded (into `type` when given)."""
    return value(answer(service, name, *path, idem=idem, **args), type)


def claimed_by(service: Service, cmd: Claim, key: Idem | None = None) -> ClaimResult | None:
    """One attempt to claim: the lease, or None (nothing to claim: an empty answer)."""
    got = run(service.claim(cmd, key))
    result: ClaimResult | None = value(got, ClaimResult)
    assert (got.kind is Kind.EMPTY) == (result is None), got
    return result


def make_pipeline(service: Service, name: str = "p", definition: Any = None) -> str:
    raw = msgspec.Raw(msgspec.json.encode(PIPELINE if definition is None else definition))
    made: str = call(service, "create_pipeline", cmd=CreatePipeline(name, raw))["id"]
    return made


def tasks(service: Service, pipeline_id: str, n: int) -> list[str]:
    cmds = [CreateTask(pipeline_id, f"t{i}", "") for i in range(n)]
    made: list[str] = call(service, "create_tasks", cmd=CreateTasks(cmds))["ids"]
    return made


def claim(service: Service, agent: str = "a", ttl: int | None = None) -> ClaimResult:
    result = claimed_by(service, Claim(agent, "coder", lease_ttl_ms=ttl))
    assert result is not None
    return result


def get_task(service: Service, task_id: str) -> TaskDetails:
    details: TaskDetails = call(service, "get_task", task_id, type=TaskDetails)
    return details


def list_tasks(service: Service, pipeline_id: str) -> list[dict[str, Any]]:
    page = call(service, "list_tasks", pipeline_id=pipeline_id, limit=10)
    assert page["next_cursor"] is None
    items: list[dict[str, Any]] = page["items"]
    return items


def test_a_run_ends_once_and_a_stale_version_moves_nothing(
    service: Service, database: Database, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    result = claim(service)
    token = lease_token_hash(result.lease_token)
    run_id = result.run.id
    with pytest.raises(TaskVersionMismatch):
        stale = MoveTask("submit", expected_task_version=7)
        answer(service, "transition", run_id, token_hash=token, cmd=stale)
    moved = call(
        service,
        "transition",
        run_id,
        token_hash=token,
        cmd=MoveTask("submit"),
        type=TransitionResult,
    )
    assert (moved.previous_stage, moved.new_stage) == ("todo", "review")
    # The same lease again: the run is over.
    with pytest.raises(LeaseNotFound):
        answer(service, "transition", run_id, token_hash=token, cmd=MoveTask("submit"))
    # The guards are in the statements themselves.
    now = clock()
    assert not database.write_sync(lambda b: b.end_run(result.run.id, "failed", "{}", None, now))
    assert not database.write_sync(lambda b: b.move_task(task_id, "done", 1, now))
    details = get_task(service, task_id)
    assert (details.stage, details.task_version) == ("review", 2)


def test_a_run_that_ended_under_its_lease_cannot_fail_or_count_again(
    service: Service, database: Database
) -> None:
    """fail checks that its end of the run changed the run (a cancel or a reaper may have
    ended it in between): RunNotRunning, and no failure counted."""
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    result = claim(service)
    lease = database.read_sync(lambda b: b.lease_by_run(result.run.id))
    assert lease is not None
    database.write_sync(lambda b: b.end_run(result.run.id, "cancelled", "{}", "x", 1))
    with pytest.raises(RunNotRunning):
        database.write_sync(lambda b: service.tracker.fail(b, lease, FailRun("boom"), 2))
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 0


def test_fences_rise_with_each_claim_and_refuse_the_previous_holder(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)
    [task_id] = tasks(service, pipeline_id, 1)
    first = claim(service, "first", ttl=1000)
    assert first.fence == 1
    first_token = lease_token_hash(first.lease_token)
    checkpoint = WriteCheckpoint(msgspec.Raw(b'{"step":1}'))
    call(service, "write_checkpoint", first.run.id, token_hash=first_token, cmd=checkpoint)
    clock.advance(1001)
    second = claim(service, "second")
    assert (second.task.id, second.fence) == (task_id, 2)
    assert bytes(second.task.checkpoint) == b'{"step":1}'
    with pytest.raises(LeaseSuperseded):
        late = Heartbeat(expected_fence=1)
        answer(service, "heartbeat", first.lease_id, token_hash=first_token, cmd=late)
    with pytest.raises(LeaseSuperseded):
        event = AppendEvent("late", expected_fence=1)
        answer(service, "append_event", first.run.id, token_hash=first_token, cmd=event)
    second_token = lease_token_hash(second.lease_token)
    event = AppendEvent("progress", expected_fence=2)
    got = call(service, "append_event", second.run.id, token_hash=second_token, cmd=event)
    assert got["id"] > 0


def one_task(service: Service, **policy: int | str) -> str:
    pipeline_id = make_pipeline(service)
    retry = RetryPolicy(**policy) if policy else None  # type: ignore[arg-type]
    made: str = call(
        service, "create_task", cmd=CreateTask(pipeline_id, "t", "", retry_policy=retry)
    )["id"]
    return made


def run_events(database: Database, run_id: str) -> list[str]:
    return [e.kind for e in database.read_sync(lambda b: b.list_events(run_id, 0, 100))]


def test_a_lease_lives_until_its_expiry_and_a_heartbeat_moves_it(
    service: Service, clock: FixedClock
) -> None:
    one_task(service)
    claimed = claimed_by(service, Claim("a", "coder", lease_ttl_ms=5000))
    assert claimed is not None and claimed.expires_at_ms == clock() + 5000
    token = lease_token_hash(claimed.lease_token)
    clock.advance(4000)
    got = call(service, "heartbeat", claimed.lease_id, token_hash=token, cmd=Heartbeat())
    assert got["expires_at_ms"] == clock() + 5000
    clock.advance(4999)
    assert run(service.reap_expired()) == 0
    clock.advance(1)
    with pytest.raises(LeaseExpired):
        answer(service, "heartbeat", claimed.lease_id, token_hash=token, cmd=Heartbeat())
    assert run(service.reap_expired()) == 1


def test_concurrent_reapers_end_an_expired_run_once_and_count_it_once(
    service: Service, opened: Callable[[], Database], clock: FixedClock
) -> None:
    """Four servers' janitors reap at the same moment: one run ends stale, with one
    lease_expired event and one retry scheduled; the others find nothing to do."""
    task_id = one_task(service, retry_delay_ms=60_000)
    claimed = claimed_by(service, Claim("a", "coder", lease_ttl_ms=1000))
    assert claimed is not None
    clock.advance(1000)
    reapers = [(db, Tracker(db.notifier, shared=True)) for db in (opened() for _ in range(4))]
    start = threading.Barrier(len(reapers))
    reaped: list[int] = []
    lock = threading.Lock()

    def reap(database: Database, tracker: Tracker) -> None:
        start.wait()
        while True:
            try:
                n = database.write_sync(lambda b: tracker.reap_expired(b, clock()))
            except StorageBusy:
                continue
            with lock:
                reaped.append(n)
            return

    threads = [threading.Thread(target=reap, args=r) for r in reapers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(reaped) == [0, 0, 0, 1]
    assert run_events(service.db, claimed.run.id) == ["lease_expired", "retry_scheduled"]
    details = get_task(service, task_id)
    assert details.latest_run is not msgspec.UNSET and details.latest_run.status == "stale"
    assert details.next_eligible_at_ms == clock() + 60_000
    assert service.db.read_sync(lambda b: b.failed_attempts(task_id)) == 1


def test_a_reaper_whose_run_was_ended_meanwhile_counts_nothing(
    service: Service, database: Database, clock: FixedClock
) -> None:
    """The reaper listed the lease, but the run ended before its end_run (another server's
    transition, cancel or reaper): no lease_expired event, no failure, no retry."""
    task_id = one_task(service)
    claimed = claimed_by(service, Claim("a", "coder", lease_ttl_ms=1000))
    assert claimed is not None
    database.write_sync(lambda b: b.end_run(claimed.run.id, "completed", "{}", None, clock()))
    clock.advance(1000)
    assert run(service.reap_expired()) == 0
    assert run_events(database, claimed.run.id) == []
    assert database.read_sync(lambda b: b.failed_attempts(task_id)) == 0
    assert database.read_sync(lambda b: b.lease_by_run(claimed.run.id)) is None


def test_expiry_past_max_attempts_dead_letters_the_task(
    service: Service, clock: FixedClock
) -> None:
    task_id = one_task(service, max_attempts=2, dead_letter_stage="dead")
    for attempt in (1, 2):
        claimed = claimed_by(service, Claim("a", "coder", lease_ttl_ms=1000))
        assert claimed is not None and claimed.run.attempt == attempt
        clock.advance(1000)
        run(service.reap_expired())
    details = get_task(service, task_id)
    assert (details.stage, details.dead_letter_reason) == ("dead", "max_attempts_exceeded")
    assert claimed_by(service, Claim("a", "coder")) is None


def idem(key: str, body: bytes, path: str = "/tasks", auth: bytes | None = None) -> Idem:
    return Idem(key, "POST", path, hashlib.sha256(body).digest(), auth)


def test_a_replay_returns_the_recorded_answer_and_does_nothing_again(service: Service) -> None:
    pipeline_id = make_pipeline(service)
    cmd = CreateTask(pipeline_id, "once", "")
    first = answer(service, "create_task", cmd=cmd, idem=idem("k1", b"body"))
    assert first.kind is Kind.CREATED
    again = answer(service, "create_task", cmd=cmd, idem=idem("k1", b"body"))
    assert again == first  # the same status and the same bytes
    assert [t["id"] for t in list_tasks(service, pipeline_id)] == [value(first)["id"]]
    with pytest.raises(IdempotencyConflict):
        answer(service, "create_task", cmd=cmd, idem=idem("k1", b"another body"))


def test_concurrent_replays_of_one_key_create_one_task(
    service: Service, opened: Callable[[], Database]
) -> None:
    """The same request, with the same key, sent to four servers at once."""
    pipeline_id = make_pipeline(service)
    services = [Service(opened(), clock=service.clock) for _ in range(4)]
    start = threading.Barrier(len(services))
    answers: list[Answer] = []
    lock = threading.Lock()
    cmd = CreateTask(pipeline_id, "once", "")

    def send(s: Service) -> None:
        start.wait()
        while True:
            try:
                got = answer(s, "create_task", cmd=cmd, idem=idem("same-key", b"same body"))
            except StorageBusy:
                continue
            with lock:
                answers.append(got)
            return

    threads = [threading.Thread(target=send, args=(s,)) for s in services]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(answers) == 4 and len(set(answers)) == 1
    items = list_tasks(service, pipeline_id)
    assert len(items) == 1
    assert answers[0].body == msgspec.json.encode({"id": items[0]["id"]})


def test_concurrent_creates_under_one_task_key_make_one_task(
    service: Service, opened: Callable[[], Database]
) -> None:
    """CreateTask.idempotency_key is unique per pipeline in the data: different requests
    (no Idempotency-Key) naming one task key all get the one task."""
    pipeline_id = make_pipeline(service)
    services = [Service(opened(), clock=service.clock) for _ in range(4)]
    start = threading.Barrier(len(services))
    ids: list[str] = []
    lock = threading.Lock()

    def send(s: Service, n: int) -> None:
        cmd = CreateTask(pipeline_id, f"from {n}", "", idempotency_key="plan-1")
        start.wait()
        while True:
            try:
                task_id = call(s, "create_task", cmd=cmd)["id"]
            except StorageBusy:
                continue
            with lock:
                ids.append(task_id)
            return

    threads = [threading.Thread(target=send, args=(s, n)) for n, s in enumerate(services)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(ids) == 4 and len(set(ids)) == 1
    assert [t["id"] for t in list_tasks(service, pipeline_id)] == ids[:1]


def test_a_replayed_claim_is_the_same_lease_under_a_fresh_token(service: Service) -> None:
    make_pipeline(service)
    pipeline_id = call(service, "list_pipelines")[0]["id"]
    call(service, "create_task", cmd=CreateTask(pipeline_id, "t", ""))
    key = idem("claim-1", b"claim", path="/leases/claim")
    first = claimed_by(service, Claim("a", "coder"), key)
    assert first is not None
    replay = run(service.claim(Claim("a", "coder"), key))
    assert replay.kind is Kind.OK
    again = msgspec.json.decode(replay.body)
    assert again["lease_id"] == first.lease_id
    assert again["run"]["id"] == first.run.id
    assert again["lease_token"] not in ("", first.lease_token)
    # The fresh token is the live one; the first no longer is.
    assert run(service.check_run_lease(first.run.id, lease_token_hash(again["lease_token"])))
    with pytest.raises(Unauthorized):
        run(service.check_run_lease(first.run.id, lease_token_hash(first.lease_token)))


def test_a_replay_on_a_lease_route_needs_the_same_lease_token(service: Service) -> None:
    pipeline_id = make_pipeline(service)
    call(service, "create_task", cmd=CreateTask(pipeline_id, "t", ""))
    claimed = claimed_by(service, Claim("a", "coder"))
    assert claimed is not None
    token = lease_token_hash(claimed.lease_token)
    run_id = claimed.run.id
    path = f"/runs/{run_id}/events"
    first = answer(
        service,
        "append_event",
        run_id,
        token_hash=token,
        cmd=AppendEvent("x"),
        idem=idem("e1", b"x", path, token),
    )
    assert first.kind is Kind.CREATED
    with pytest.raises(Unauthorized):
        answer(
            service,
            "append_event",
            run_id,
            token_hash=token,
            cmd=AppendEvent("x"),
            idem=idem("e1", b"x", path, b"o" * 32),
        )


def make_key(
    service: Service, access: Access = Access.AGENT, roles: list[str] | None = None
) -> CreatedKey:
    if roles is None and access is Access.AGENT:
        roles = ["coder"]
    made: CreatedKey = call(
        service, "create_key", cmd=CreateKey("ci", access, roles), type=CreatedKey
    )
    return made


def revoke(service: Service, key_id: str) -> KeyInfo:
    gone: KeyInfo = value(run(service.revoke_key(key_id)), KeyInfo)
    return gone


def test_a_key_is_found_by_its_text_and_listed_without_it(service: Service) -> None:
    made = make_key(service, roles=["coder", "coder", "reviewer"])
    assert made.key.startswith("ntk_") and len(made.key) == 47
    assert made.roles == ["coder", "reviewer"]
    found = run(service.authenticate(made.key))
    assert found is not None and (found.id, found.access) == (made.id, Access.AGENT)
    assert run(service.authenticate(made.key)) == found  # again, from what this process knows
    assert run(service.authenticate(made.key[:-1] + "x")) is None
    assert run(service.authenticate("not a key")) is None
    listed = call(service, "list_keys")
    assert [k["id"] for k in listed] == [made.id]
    assert "key" not in listed[0]
    assert run(service.key_by_id(made.id)) == found


def test_the_database_keeps_the_hash_of_a_key_never_the_key(
    service: Service, database: Database
) -> None:
    made = make_key(service, Access.READ)
    row = database.read_sync(
        lambda b: b.api_key_by_hash(hashlib.sha256(made.key.encode()).digest())
    )
    assert row is not None and row.id == made.id


def test_a_revoked_key_is_refused_at_once(service: Service) -> None:
    made = make_key(service)
    assert run(service.authenticate(made.key)) is not None  # known to this process now
    assert run(service.key_by_id(made.id)) is not None
    gone = revoke(service, made.id)
    assert gone.id == made.id
    assert run(service.authenticate(made.key)) is None
    assert run(service.key_by_id(made.id)) is None
    assert call(service, "list_keys") == []
    with pytest.raises(NotFound):
        run(service.revoke_key(made.id))


@pytest.mark.parametrize(
    ("access", "roles", "message"),
    [
        (Access.AGENT, None, "needs roles"),
        (Access.AGENT, [], "needs roles"),
        (Access.AGENT, [" "], "must not be empty"),
        (Access.READ, ["coder"], "agent keys only"),
        (Access.ADMIN, ["coder"], "agent keys only"),
    ],
)
def test_roles_belong_to_agent_keys_and_agent_keys_need_them(
    service: Service, access: Access, roles: list[str] | None, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        answer(service, "create_key", cmd=CreateKey("ci", access, roles))
    with pytest.raises(InvalidRequest, match="name"):
        answer(service, "create_key", cmd=CreateKey("  ", Access.READ))


def test_a_key_revoked_through_one_server_is_refused_by_another_at_once(pg_dsn: str) -> None:
    """Two servers on one PostgreSQL database. The other server may still know the key for as
    long as the notification takes, but every unit of work it runs for the key confirms it
    first, in its own transaction."""
    databases = [open_database(pg_dsn), open_database(pg_dsn)]
    try:
        one, two = Service(databases[0]), Service(databases[1])
        wait_for("both servers to listen", lambda: one.notifier.revocations_heard)
        wait_for("both servers to listen", lambda: two.notifier.revocations_heard)
        for _ in range(5):
            made = make_key(one)
            assert run(two.authenticate(made.key)) is not None  # the other server knows it
            with two.speaking_with(made.id):
                assert call(two, "list_keys")  # a read for the key, confirmed
            revoke(one, made.id)
            with two.speaking_with(made.id):
                with pytest.raises(Unauthorized, match="revoked"):
                    answer(two, "list_keys")
                with pytest.raises(Unauthorized, match="revoked"):
                    answer(two, "put_value", "ns", "k", cmd=PutValue(msgspec.Raw(b"1")))
            # ...and its notification makes the other server forget the key.
            forgotten = functools.partial(_forgotten, two, made.key)
            wait_for("the revocation to reach the other server", forgotten)
    finally:
        for database in databases:
            database.close()


def _forgotten(service: Service, key: str) -> bool:
    return run(service.authenticate(key)) is None


def test_a_key_revoked_meanwhile_is_not_learnt_by_a_lookup_that_raced_it(
    service: Service,
) -> None:
    made = make_key(service)
    ring = service.keys
    seen = ring.generation
    info = run(service.authenticate(made.key))  # read before the revocation...
    revoke(service, made.id)
    ring.learn(hashlib.sha256(made.key.encode()).digest(), info, seen)  # ...kept after it
    assert run(service.authenticate(made.key)) is None


def test_a_new_task_and_a_retry_delay_reach_a_subscriber(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)

    async def scenario() -> list[tuple[str, int]]:
        heard: list[tuple[str, int]] = []
        got = asyncio.Event()

        def hear(role: str, at_ms: int, agent: str | None) -> None:
            heard.append((role, at_ms))
            got.set()

        service.notifier.subscribe(hear, asyncio.get_running_loop())

        async def next_one() -> None:
            await asyncio.wait_for(got.wait(), timeout=10)
            got.clear()

        with service.notifier.waiting():  # a long-poll is waiting: "work now" has an audience
            retry = RetryPolicy(retry_delay_ms=30_000)
            cmd = CreateTask(pipeline_id, "t", "", retry_policy=retry)
            assert (await acall(service, "create_task", cmd=cmd)).kind is Kind.CREATED
            await next_one()
            claimed = value(await service.claim(Claim("a", "coder")), ClaimResult)
            assert claimed is not None
            token = lease_token_hash(claimed.lease_token)
            heard.clear()
            failed = await acall(
                service, "fail", claimed.run.id, token_hash=token, cmd=FailRun("boom")
            )
            assert failed.kind is Kind.OK
            while ("coder", clock() + 30_000) not in heard:
                await next_one()
        return heard

    heard = asyncio.run(scenario())
    assert ("coder", clock() + 30_000) in heard
    assert all(role == "coder" for role, _ in heard)


@pytest.mark.parametrize("capped", [False, True])
def test_a_transition_wakes_the_stage_it_leaves_only_when_that_stage_caps_its_leases(
    service: Service, capped: bool
) -> None:
    """A transition wakes the role of the stage it enters; the role of the stage it leaves
    only when that stage's policy caps its leases (max_concurrency): no claim waits for a slot
    of a stage that has none. (The wake-ups of one transition arrive together, in role order.)"""
    todo = {"agent_role": "coder", **({"max_concurrency": 2} if capped else {})}
    definition = {**PIPELINE, "states": {**PIPELINE["states"], "todo": todo}}
    pipeline_id = make_pipeline(service, definition=definition)
    tasks(service, pipeline_id, 2)
    claim(service, "warm")  # reads the role's limits

    async def scenario() -> list[tuple[str, int]]:
        heard: list[tuple[str, int]] = []
        service.notifier.subscribe(
            lambda role, at, _agent: heard.append((role, at)), asyncio.get_running_loop()
        )
        with service.notifier.waiting():  # a long-poll is waiting: wake-ups have an audience
            claimed = value(await service.claim(Claim("a", "coder")), ClaimResult)
            assert claimed is not None
            token = lease_token_hash(claimed.lease_token)
            heard.clear()
            moved = await acall(
                service, "transition", claimed.run.id, token_hash=token, cmd=MoveTask("submit")
            )
            assert moved.kind is Kind.OK
            for _ in range(1000):
                if ("reviewer", 0) in heard:
                    break
                await asyncio.sleep(0.01)
        return heard

    heard = asyncio.run(scenario())
    assert ("reviewer", 0) in heard
    assert (("coder", 0) in heard) is capped


def test_cancel_revokes_the_live_lease_and_requeue_makes_the_task_claimable(
    service: Service, clock: FixedClock
) -> None:
    pipeline_id = make_pipeline(service)
    task_id = call(service, "create_task", cmd=CreateTask(pipeline_id, "t", ""))["id"]
    claimed = claimed_by(service, Claim("a", "coder"))
    assert claimed is not None
    with pytest.raises(TaskLeased):
        answer(service, "requeue_task", task_id, cmd=RequeueTask())
    details = call(
        service, "cancel_task", task_id, cmd=CancelTask(reason="wrong plan"), type=TaskDetails
    )
    assert (details.dead_letter_reason, details.cancel_reason) == ("cancelled", "wrong plan")
    assert details.latest_run is not msgspec.UNSET and details.latest_run.status == "cancelled"
    with pytest.raises(TaskCancelled):
        token = lease_token_hash(claimed.lease_token)
        answer(service, "heartbeat", claimed.lease_id, token_hash=token, cmd=Heartbeat())
    assert claimed_by(service, Claim("b", "coder")) is None
    again = call(service, "cancel_task", task_id, cmd=CancelTask(reason="twice"), type=TaskDetails)
    assert again.cancel_reason == "wrong plan"  # cancelling again changes nothing
    requeued = call(
        service, "requeue_task", task_id, cmd=RequeueTask(reason="fixed"), type=TaskDetails
    )
    assert requeued.dead_letter_reason is None and requeued.cancelled_at_ms is msgspec.UNSET
    reclaimed = claimed_by(service, Claim("b", "coder"))
    assert reclaimed is not None and reclaimed.task.id == task_id
    assert reclaimed.run.attempt == 2
    events = call(service, "list_task_events", task_id, after=0, limit=10)["items"]
    assert [e["kind"] for e in events] == ["cancelled", "requeued"]


@pytest.mark.parametrize("verb", ["cancel_task", "requeue_task"])
def test_a_lease_past_its_time_is_expired_for_a_cancel_or_requeue_on_any_server(
    service: Service, opened: Callable[[], Database], clock: FixedClock, verb: str
) -> None:
    """A server's reaper cache (the earliest expiry it knows) cannot know of another server's
    leases, nor of one claimed while its reaper read: the other server reaped just before the
    claim, so its cache says nothing expires yet. Its cancel or requeue must still take the
    lease past its time for expired (the run stale, the expiry counted), never for live."""
    other = Service(opened(), clock=clock, rand=lambda: 0.5)
    pipeline_id = make_pipeline(service)
    task_id = call(service, "create_task", cmd=CreateTask(pipeline_id, "t", ""))["id"]
    assert claimed_by(other, Claim("r", "reviewer")) is None  # it reaped: nothing expired
    claimed = claim(service, ttl=200)
    clock.advance(300)
    cmd = CancelTask(reason="late") if verb == "cancel_task" else RequeueTask()
    details = call(other, verb, task_id, cmd=cmd, type=TaskDetails)
    assert details.latest_run is not msgspec.UNSET and details.latest_run.status == "stale"
    assert [f.run_id for f in details.previous_failures] == [claimed.run.id]
    events = call(other, "list_task_events", task_id, after=0, limit=10)["items"]
    again = claimed_by(other, Claim("b", "coder"))
    if verb == "cancel_task":
        assert [e["kind"] for e in events] == ["cancelled"]
        assert "revoked_run_id" not in events[0]["data"]  # nothing live was revoked
        assert again is None  # cancelled: never claimed again
    else:
        assert [e["kind"] for e in events] == ["requeued"]
        assert again is not None and again.task.id == task_id and again.run.attempt == 2


def test_claims_beside_new_pipelines_at_once_all_answer(service: Service) -> None:
    """A server runs units of work at once (in threads, on PostgreSQL) over one tracker: a
    new pipeline empties the tracker's cache of each role's limits while other claims read
    it. Every claim must still answer, a task or none, and every task is claimed once."""
    agents, rounds = 8, 25

    async def agent(i: int) -> list[str]:
        got = []
        for r in range(rounds):
            raw = msgspec.Raw(msgspec.json.encode(PIPELINE))
            made = await acall(service, "create_pipeline", cmd=CreatePipeline(f"p{i}-{r}", raw))
            task = CreateTask(value(made)["id"], "t", "")
            await acall(service, "create_tasks", cmd=CreateTasks([task]))
            claimed = value(await service.claim(Claim(f"agent-{i}", "coder")), ClaimResult)
            if claimed is not None:
                got.append(claimed.task.id)
        return got

    async def everyone() -> list[list[str]]:
        return await asyncio.gather(*(agent(i) for i in range(agents)))

    taken = [t for got in run(everyone()) for t in got]
    while (rest := claimed_by(service, Claim("sweeper", "coder"))) is not None:
        taken.append(rest.task.id)
    assert len(taken) == len(set(taken)) == agents * rounds
