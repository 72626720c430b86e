"""The unit of work: `Service` runs each verb as one transaction of the `Database`
(storage.ports), reads the clock once per unit, records and replays idempotent answers inside
that same transaction, and tells the `Notifier` which roles may have work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import msgspec

from nulltickets.domain.clock import Clock, Random, system_random, wall_ms
from nulltickets.domain.commands import (
    Claim,
)
from nulltickets.domain.model import (
    Access,
    ClaimResult,
    FeedEvent,
    HeldLease,
    KeyInfo,
    LeaseRow,
)
from nulltickets.domain.tokens import (
    api_key_hash,
    looks_like_api_key,
    same_hash,
)
from nulltickets.errors import (
    IdempotencyConflict,
    InvalidJson,
    InvalidLeaseTtl,
    NotFound,
    Unauthorized,
)
from nulltickets.service.base import (
    T,
    _encode,
)
from nulltickets.service.keys import (
    _MISS,
    REVOCATION_ECHO_S,
    KeyRing,
    _speaking,
)
from nulltickets.service.tracker import Tracker
from nulltickets.service.verbs import Arg, Kind, Tool, Verb, verb
from nulltickets.service.wakeups import Wakeups
from nulltickets.storage.backend import Backend, StageBoardRow
from nulltickets.storage.ports import Database, StorageStats

_NO_ARGS: Mapping[str, Any] = {}


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    now: int
    stages: list[StageBoardRow]
    leases: int
    kinds: list[tuple[str, int, int]]  # (kind, count, newest id) of events after the cursor
    newest: int  # the newest event id counted


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """A write's typed result."""

    kind: Kind
    value: T


@dataclass(frozen=True, slots=True)
class Answer:
    """What a verb answered: what it did and its body, encoded. An idempotency record keeps
    exactly this, and a replay answers it again (contract §3)."""

    kind: Kind
    body: bytes


NOTHING = Answer(Kind.EMPTY, b"")


@dataclass(frozen=True, slots=True)
class Idem:
    """A request under an Idempotency-Key: what identifies it."""

    key: str
    method: str
    path: str
    request_hash: bytes
    auth_hash: bytes | None  # under a lease: a replay needs the same lease token


Encode = Callable[[Outcome[Any]], Answer]


def _choice(command: Claim) -> bytes:
    """What sets a claim's choice apart from another of its role: its per-state limits."""
    limits = command.concurrency.per_state if command.concurrency is not None else None
    return bytes(limits) if isinstance(limits, msgspec.Raw) else b""


def _claim_outcome(result: ClaimResult | None) -> Outcome[ClaimResult | None]:
    return Outcome(Kind.EMPTY if result is None else Kind.OK, result)


class Service:
    """Runs each verb as one unit of work on `db`, and answers it encoded (`call`).

    A write replays the answer recorded under its Idempotency-Key (`idem`), or runs and
    records its answer in the same transaction. The clock is read once per unit of work and
    the random source feeds retry jitter: tests pass fixed ones. A few verbs need more than
    one unit of work or a wait (claim, keys), and have methods of their own here.
    """

    def __init__(
        self,
        db: Database,
        *,
        clock: Clock = wall_ms,
        rand: Random = system_random,
        keys_enabled: bool = True,
    ) -> None:
        self.db = db
        self.clock = clock
        self.notifier = db.notifier
        self._shared = db.capabilities.shared_by_servers
        self.tracker = Tracker(db.notifier, rand, shared=self._shared, keys_enabled=keys_enabled)
        self.keys = KeyRing(db.notifier)
        self.wakeups = Wakeups()  # long-polling claims wait here for their role's work

    # --- plumbing ------------------------------------------------------------------------------

    async def call(
        self,
        v: Verb,
        path: Sequence[str] = (),
        args: Mapping[str, Any] = _NO_ARGS,
        idem: Idem | None = None,
    ) -> Answer:
        """Run verb `v` as one unit of work: `path` holds its path's parameters in order,
        `args` the rest by the names of its implementation's parameters (`cmd`, the body,
        is a callable that decodes it: under a run's lease, only once the lease is checked).
        """
        if v.at_service:  # a verb of more than one unit of work: a method of this class
            bound = invoke_args(v, path, args)
            answer: Answer = await v.fn(self, *bound, idem=idem)
            return answer
        tracker = self.tracker
        wrap = v.answer
        if not v.write:
            clock = self.clock
            value = await self._read(
                lambda b: invoke(v, tracker, b, clock(), path, args), kind=v.name
            )
            return Answer(Kind.OK, _encode(wrap(value) if wrap is not None else value))
        kind = v.kind

        def act(b: Backend, now: int) -> Outcome[Any]:
            return Outcome(kind, invoke(v, tracker, b, now, path, args))

        return await self._write(idem, act, _encoder(wrap))

    async def _write(
        self,
        idem: Idem | None,
        act: Callable[[Backend, int], Outcome[T]],
        encode: Encode,
        *,
        redact: Callable[[Outcome[T]], Outcome[T]] | None = None,
        revive: Callable[[Backend, bytes], bytes] | None = None,
    ) -> Answer:
        clock = self.clock
        key_id = _speaking.get()
        if idem is None and key_id is None:
            # Encoded after the commit, off the writer's path.
            return encode(await self.db.write(lambda b: act(b, clock())))

        def job(b: Backend) -> Answer | Outcome[T]:
            if key_id is not None:
                b.confirm_key(key_id)
            now = clock()
            if idem is None:
                return act(b, now)
            return _idempotent(b, idem, now, act, encode, redact, revive)

        done = await self.db.write(job)
        return done if isinstance(done, Answer) else encode(done)

    async def _read(self, job: Callable[[Backend], T], *, kind: Hashable | None = None) -> T:
        """`job` read in one snapshot; `kind` (else the job's code: each call site is one)
        names what it does, for the database to learn how such reads run."""
        if kind is None:
            kind = getattr(job, "__code__", None)
        key_id = _speaking.get()
        if key_id is None:
            return await self.db.read(job, kind=kind)

        def confirmed(b: Backend) -> T:
            b.confirm_key(key_id)
            return job(b)

        return await self.db.read(confirmed, kind=kind)

    @contextlib.contextmanager
    def speaking_with(self, key_id: str | None) -> Iterator[None]:
        """Run the block (a request's handler) on behalf of key `key_id`. On a database shared
        by servers, each unit of work the block runs first confirms, in its own transaction,
        that the key still exists: another server's revocation reaches this server's KeyRing
        only as fast as its notification, the database at once; one statement of a unit of
        work that runs anyway costs far less than a lookup of its own. On SQLite (one server
        per file) the KeyRing hears every revocation before it is answered: nothing to do.
        The key travels in a context variable, which the block's own tasks inherit."""
        if key_id is None or not self._shared:
            yield
            return
        token = _speaking.set(key_id)
        try:
            yield
        finally:
            _speaking.reset(token)

    # --- verbs of more than one unit of work -------------------------------------------------

    @verb(
        "POST",
        "/leases/claim",
        "Claim the most urgent eligible task for a role (204 when there is none).",
        request=Claim,
        response=ClaimResult,
        errors=(InvalidJson, InvalidLeaseTtl),
        access=Access.AGENT,
        tag="leases",
        custom=True,  # the long poll (http/handlers.py)
        tool=Tool("claim_task"),
    )
    async def claim(self, cmd: Claim, idem: Idem | None = None) -> Answer:
        """One attempt to claim (a long poll repeats it while its role's wake-ups come)."""
        t = self.tracker

        def redact(outcome: Outcome[ClaimResult | None]) -> Outcome[ClaimResult | None]:
            # Lease tokens are never stored in clear, not even in the idempotency record.
            result = outcome.value
            if result is None:
                return outcome
            return Outcome(outcome.kind, msgspec.structs.replace(result, lease_token=""))

        def revive(b: Backend, body: bytes) -> bytes:
            # A replayed claim gets the same lease under a fresh token.
            result = msgspec.json.decode(body, type=ClaimResult)
            result.lease_token = t.rotate_claim_token(b, result.lease_id)
            return _encode(result)

        return await self._write(
            idem,
            lambda b, now: _claim_outcome(t.claim(b, cmd, now)),
            _encoder(None),
            redact=redact,
            revive=revive,
        )

    async def claim_waiting(
        self, cmd: Claim, idem: Idem | None, deadline: float, disconnected: Any = None
    ) -> tuple[Answer, bool]:
        """Claim, and while nothing is claimable wait for a wake-up of the role until
        `deadline` (the loop's time), or until `disconnected` completes (nobody would receive
        a lease claimed then). Answers the last attempt's answer and whether it could wait:
        beyond the limit of waiting claims (`wakeups.limit`) it tries once."""
        loop = asyncio.get_running_loop()
        wakeups = self.wakeups
        poll = wakeups.enter(cmd.agent_role, cmd.agent_id, _choice(cmd))
        if poll is None:
            return await self.claim(cmd, idem), False
        try:
            with self.notifier.waiting():  # from before the first attempt: Notifier.listening
                while True:
                    poll.trying()
                    answer = await self.claim(cmd, idem)
                    took = answer.kind is not Kind.EMPTY
                    poll.tried(took=took)
                    remaining = deadline - loop.time()
                    if took or remaining <= 0 or wakeups.closing:
                        return answer, True
                    if not await poll.wait(remaining, disconnected):
                        return answer, True
        finally:
            poll.leave()

    async def check_run_lease(self, run_id: str, token_hash: bytes) -> LeaseRow:
        """The run's live lease held with this token (for reads a lease authorises)."""
        now = self.clock()
        return await self._read(lambda b: self.tracker.check_run_lease(b, run_id, token_hash, now))

    @verb(
        "DELETE",
        "/keys/{id}",
        "Revoke a key: refused at once by this server and, on PostgreSQL, by every other "
        "server of the tracker (told before this answers). Dashboard sessions of the key end "
        "too. Answers what the key was.",
        response=KeyInfo,
        errors=(NotFound,),
        extra=True,
        tag="keys",
        cli="keys revoke",
    )
    async def revoke_key(self, key_id: str, idem: Idem | None = None) -> Answer:
        """Delete the key. When this answers, no request of this process accepts it any more,
        and every other server (PostgreSQL) has been sent the revocation: it arrived here, and
        PostgreSQL delivers a notification to every listener at the same time."""
        notifier = self.notifier

        def act(b: Backend, now: int) -> Outcome[KeyInfo]:
            info = b.delete_api_key(key_id)
            if info is None:
                raise NotFound(f"no key with id {key_id!r}")
            notifier.revoke(b, key_id)
            return Outcome(Kind.OK, info)

        heard = self.keys.expect(key_id)
        try:
            answer = await self._write(idem, act, _encoder(None))
            self.keys.drop(key_id)  # here at once, whatever the notifier does
            # Without its echo in time the listening connection is down; other servers then
            # trust no cache of keys until theirs is back. (A replay has nothing to wait for.)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(heard, REVOCATION_ECHO_S)
        finally:
            self.keys.unexpect(key_id, heard)
        return answer

    async def held_by(self, agent_id: str) -> HeldLease | None:
        """The lease `agent_id` holds (an MCP session's current task), if any."""
        return await self._read(lambda b: b.held_by_agent(agent_id))

    async def authenticate(self, key: str) -> KeyInfo | None:
        """The key a bearer presents, or None when it is not a (live) key."""
        if not looks_like_api_key(key):
            return None
        key_hash = api_key_hash(key)
        ring = self.keys
        found = ring.by_hash(key_hash)
        if found is not _MISS:
            info: KeyInfo | None = found
            return info
        seen = ring.generation
        info = await self._read(lambda b: b.api_key_by_hash(key_hash))
        ring.learn(key_hash, info, seen)
        return info

    async def key_by_id(self, key_id: str) -> KeyInfo | None:
        """A live key by its id (a dashboard session names its key so)."""
        ring = self.keys
        found = ring.by_id(key_id)
        if found is not _MISS:
            known: KeyInfo = found
            return known
        seen = ring.generation
        info = await self._read(lambda b: b.api_key_by_id(key_id))
        ring.learn(None, info, seen)
        return info

    # --- operations and upkeep -----------------------------------------------------------------

    # --- the event stream and metrics ----------------------------------------------------------

    async def events_feed(
        self, after: int, limit: int, task_id: str | None = None
    ) -> list[FeedEvent]:
        """Run events after the id `after`, oldest first (of one task, if given)."""
        return await self._read(lambda b: b.events_feed(after, limit, task_id))

    async def last_event_id(self) -> int:
        return await self._read(lambda b: b.last_event_id())

    async def metrics_snapshot(self, after: int | None) -> MetricsSnapshot:
        """What /metrics reads from the database, in one snapshot: the stage board, live
        leases, and run events by kind after the id `after` (None: none counted, only the
        newest id)."""
        now = self.clock()

        def job(b: Backend) -> MetricsSnapshot:
            stages = b.stage_board(now)
            leases = b.active_leases(now)
            if after is None:
                return MetricsSnapshot(now, stages, leases, [], b.last_event_id())
            kinds = b.event_kinds_since(after)
            newest = max((m for _, _, m in kinds), default=after)
            return MetricsSnapshot(now, stages, leases, kinds, newest)

        return await self._read(job)

    def storage_stats(self) -> StorageStats:
        """This process's storage figures and timings (writer batches, WAL size, commit
        durations ...): see Database.stats."""
        return self.db.stats()

    async def reap_expired(self) -> int:
        """End every lease past its time (the janitor; claims also reap when one may be)."""
        return await self.db.write(lambda b: self.tracker.reap_expired(b, self.clock()))

    async def purge_idempotency(self) -> int:
        return await self.db.write(lambda b: self.tracker.purge_idempotency(b, self.clock()))


def invoke(
    v: Verb, tracker: Tracker, b: Backend, now: int, path: Sequence[str], args: Mapping[str, Any]
) -> Any:
    """Call verb `v`'s implementation with what its parameters name (see service/verbs.py)."""
    body = args.get("cmd")
    lease = None
    if v.under_run_lease:
        # The lease (and any expected_fence) first: a bad lease is reported before a bad body.
        assert body is not None
        token_hash = args["token_hash"]
        if any(source is Arg.LEASE for source, _, _ in v.plan):
            lease = tracker.check_run_lease(b, path[0], token_hash, now, _fence(body))
        else:
            try:
                body()
            except InvalidJson:
                tracker.check_run_lease(b, path[0], token_hash, now)
                raise
    values: list[Any] = []
    named: dict[str, Any] = {}
    for source, key, by_name in v.plan:
        if source is Arg.BACKEND:
            value: Any = b
        elif source is Arg.NOW:
            value = now
        elif source is Arg.PATH:
            value = path[key]
        elif source is Arg.BODY:
            value = body() if body is not None else v.request()
        elif source is Arg.LEASE:
            value = lease
        elif source is Arg.TOKEN:
            value = args["token_hash"]
        else:
            value = args[key]
        if by_name is None:
            values.append(value)
        else:
            named[by_name] = value
    return v.fn(tracker, *values, **named)


def invoke_args(v: Verb, path: Sequence[str], args: Mapping[str, Any]) -> list[Any]:
    """The arguments of a verb that `Service` implements itself (no unit of work given)."""
    values: list[Any] = []
    for source, key, _ in v.plan:
        if source is Arg.PATH:
            values.append(path[key])
        elif source is Arg.BODY:
            values.append(args["cmd"]())
        else:
            values.append(args[key])
    return values


def _encoder(wrap: Callable[[Any], Any] | None) -> Encode:
    """How an outcome becomes the answer: its value (wrapped as the verb's response) in JSON;
    nothing for EMPTY."""

    def encode(outcome: Outcome[Any]) -> Answer:
        if outcome.kind is Kind.EMPTY:
            return NOTHING
        value = outcome.value
        return Answer(outcome.kind, _encode(wrap(value) if wrap is not None else value))

    return encode


def _fence(command: Callable[[], Any]) -> int | None:
    """The expected_fence of a body decoded later (None if absent or the body is bad)."""
    try:
        fence: int | None = command().expected_fence
    except InvalidJson:
        return None
    return fence


def _idempotent(
    b: Backend,
    idem: Idem,
    now: int,
    act: Callable[[Backend, int], Outcome[T]],
    encode: Encode,
    redact: Callable[[Outcome[T]], Outcome[T]] | None,
    revive: Callable[[Backend, bytes], bytes] | None,
) -> Answer:
    """Replay the answer recorded under this key, or act and record the answer, in the unit
    of work `b`.

    Only answers with a body are recorded: an EMPTY outcome (no claimable task, a value
    stored or deleted) has nothing to replay, and running it again is what a retry should
    do; failures are never recorded. On lease routes the recorded lease-token hash must
    match the presented one before anything is replayed.
    """
    stored = b.get_idempotency(idem.key, idem.method, idem.path)
    if stored is not None:
        stored_hash, stored_auth, status, body = stored
        if not same_hash(stored_hash, idem.request_hash):
            raise IdempotencyConflict()
        if stored_auth is not None and (
            idem.auth_hash is None or not same_hash(stored_auth, idem.auth_hash)
        ):
            raise Unauthorized("lease token does not match")
        raw = body.encode()
        return Answer(Kind(status), revive(b, raw) if revive is not None else raw)
    outcome = act(b, now)
    answer = encode(outcome)
    if outcome.kind is not Kind.EMPTY:
        kept = answer if redact is None else encode(redact(outcome))
        b.put_idempotency(
            key=idem.key,
            method=idem.method,
            path=idem.path,
            request_hash=idem.request_hash,
            auth_hash=idem.auth_hash,
            status=kept.kind.value,
            body=kept.body.decode(),
            now=now,
        )
    return answer
