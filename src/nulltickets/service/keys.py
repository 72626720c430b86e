"""Keys: the API keys this process knows (`KeyRing`) and the rules of a new key."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

from nulltickets.domain import commands
from nulltickets.domain.commands import CreateKey
from nulltickets.domain.ids import new_id
from nulltickets.domain.model import Access, CreatedKey, KeyInfo
from nulltickets.domain.tokens import new_api_key
from nulltickets.errors import InvalidJson, InvalidRequest, KeysNeedToken
from nulltickets.service.base import TrackerBase
from nulltickets.service.verbs import verb
from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Notifier

# How long a revocation waits to hear itself back from the notifier (PostgreSQL: its NOTIFY,
# delivered to every listening server at once) before it answers anyway.
REVOCATION_ECHO_S = 1.0
# Unknown key hashes remembered, so that a sender repeating a wrong key costs no query.
UNKNOWN_KEYS_MAX = 4096
KEY_NAME_MAX = 200
_MISS: Any = object()


class KeyRing:
    """The keys this process has seen, by the SHA-256 of their text and by id, so that a
    request's key costs no query once known (a query would about double the cost of a claim).

    Trusted only while the notifier hears every revocation (`revocations_heard`); otherwise
    every lookup reads the database. A revocation, made by this process or (on PostgreSQL)
    any other, removes the key as the notifier delivers it; `None` forgets everything. A
    lookup that read the database while a revocation went by keeps nothing it read
    (`generation`). Unknown hashes are remembered too, at most UNKNOWN_KEYS_MAX: a key is
    random, so a hash seen before the key was made cannot become that key's.
    """

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier
        self._by_hash: dict[bytes, KeyInfo] = {}
        self._by_id: dict[str, KeyInfo] = {}
        self._unknown: dict[bytes, None] = {}
        self._lock = threading.Lock()
        self.generation = 0
        # Revocations of this process waiting to hear themselves back (see Service.revoke_key).
        self._echoes: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        notifier.on_revoke(self.forget)

    def by_hash(self, key_hash: bytes) -> Any:
        """The key with this hash, None if there is none, or _MISS: ask the database."""
        if not self._notifier.revocations_heard:
            return _MISS
        found = self._by_hash.get(key_hash, _MISS)
        if found is _MISS and key_hash in self._unknown:
            return None
        return found

    def by_id(self, key_id: str) -> Any:
        """The key with this id, or _MISS: ask the database."""
        if not self._notifier.revocations_heard:
            return _MISS
        return self._by_id.get(key_id, _MISS)

    def learn(self, key_hash: bytes | None, info: KeyInfo | None, seen: int) -> None:
        """Keep what a lookup read, unless a revocation went by since it began (`seen`)."""
        with self._lock:
            if seen != self.generation or not self._notifier.revocations_heard:
                return
            if info is not None:
                self._by_id[info.id] = info
                if key_hash is not None:
                    self._by_hash[key_hash] = info
            elif key_hash is not None:
                self._unknown[key_hash] = None
                if len(self._unknown) > UNKNOWN_KEYS_MAX:
                    del self._unknown[next(iter(self._unknown))]

    def forget(self, key_id: str | None) -> None:
        """The notifier's callback (any thread): `key_id` was revoked; None: forget all."""
        self.drop(key_id)
        if key_id is None:
            return
        with self._lock:
            echoes = self._echoes.pop(key_id, [])
        for loop, heard in echoes:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, heard)

    def drop(self, key_id: str | None) -> None:
        """Forget the key `key_id` (None: every key) in this process."""
        with self._lock:
            self.generation += 1
            if key_id is None:
                self._by_hash.clear()
                self._by_id.clear()
                return
            self._by_id.pop(key_id, None)
            for key_hash, info in list(self._by_hash.items()):  # few keys; revocations are rare
                if info.id == key_id:
                    del self._by_hash[key_hash]

    def expect(self, key_id: str) -> asyncio.Future[None]:
        """A future that completes when the revocation of `key_id` is heard back."""
        loop = asyncio.get_running_loop()
        heard: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._echoes.setdefault(key_id, []).append((loop, heard))
        return heard

    def unexpect(self, key_id: str, heard: asyncio.Future[None]) -> None:
        with self._lock:
            waiting = self._echoes.get(key_id, [])
            waiting[:] = [(lp, f) for lp, f in waiting if f is not heard]
            if not waiting:
                self._echoes.pop(key_id, None)


# The key the current request speaks with, while each of its units of work must confirm it
# (Service.speaking_with). Every request runs as a task of its own, with a context of its own.
_speaking: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nulltickets_speaking", default=None
)


def _settle(heard: asyncio.Future[None]) -> None:
    if not heard.done():
        heard.set_result(None)


def check_new_key(command: CreateKey) -> tuple[str, list[str]]:
    """The new key's name and roles, or InvalidRequest saying what is wrong."""
    name = command.name.strip()
    if not name or len(name) > KEY_NAME_MAX:
        raise InvalidRequest(f"name must be 1..{KEY_NAME_MAX} characters")
    roles = list(dict.fromkeys(command.roles or []))
    if command.access is Access.AGENT:
        if not roles:
            raise InvalidRequest("an agent key needs roles: the agent roles it may claim for")
        if any(not role.strip() for role in roles):
            raise InvalidRequest("roles must not be empty")
    elif roles:
        raise InvalidRequest(f"roles apply to agent keys only, not to {command.access} keys")
    return name, roles


class Keys(TrackerBase):
    @verb(
        "POST",
        "/keys",
        "Make a key: `read` (every read route, the metrics, the event stream, the dashboard "
        "without its buttons), `agent` (reads, claims for its `roles` only, and the writes "
        "agents make: tasks, artifacts, store keys, traces) or `admin` (everything, as the "
        "--token). The answer is the only time the key is shown; the server keeps its SHA-256. "
        "Needs a server started with --token (409 keys_need_token otherwise). No "
        "Idempotency-Key: a recorded answer would hold the key.",
        request=commands.CreateKey,
        response=CreatedKey,
        status=201,
        errors=(InvalidJson, InvalidRequest, KeysNeedToken),
        extra=True,
        idempotency_key=False,
        tag="keys",
        cli="keys create",
    )
    def create_key(self, b: Backend, cmd: CreateKey, now: int) -> CreatedKey:
        """Make a key; the answer is the only place its text ever appears (the database keeps
        its SHA-256)."""
        if not self.keys_enabled:
            raise KeysNeedToken()
        name, roles = check_new_key(cmd)
        key, key_hash = new_api_key()
        key_id = new_id()
        b.insert_api_key(
            id=key_id, key_hash=key_hash, name=name, access=cmd.access, roles=roles, now=now
        )
        return CreatedKey(key_id, key, name, cmd.access, roles, now)

    @verb(
        "GET",
        "/keys",
        "Every key, oldest first: its id, name, access and roles, never the key nor its hash.",
        response=list[KeyInfo],
        extra=True,
        access=Access.ADMIN,
        tag="keys",
        cli="keys list",
    )
    def list_keys(self, b: Backend) -> list[KeyInfo]:
        return b.list_api_keys()
