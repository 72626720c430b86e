"""Keys on every backend: stored as their hash, found by it, refused once revoked, on this
server at once and, on PostgreSQL, on every other server of the database."""

from __future__ import annotations

import functools
import hashlib

import msgspec
import pytest

from nulltickets.domain.commands import CreateKey, PutValue
from nulltickets.domain.model import Access, CreatedKey
from nulltickets.errors import InvalidRequest, NotFound, Unauthorized
from nulltickets.service import Service
from nulltickets.storage.factory import open_database
from nulltickets.storage.ports import Database
from tests.conftest import wait_for
from tests.contract.conftest import run, value


def make_key(
    service: Service, access: Access = Access.AGENT, roles: list[str] | None = None
) -> CreatedKey:
    if roles is None and access is Access.AGENT:
        roles = ["coder"]
    return run(service.create_key(CreateKey("ci", access, roles)))


def test_a_key_is_found_by_its_text_and_listed_without_it(service: Service) -> None:
    made = make_key(service, roles=["coder", "coder", "reviewer"])
    assert made.key.startswith("ntk_") and len(made.key) == 47
    assert made.roles == ["coder", "reviewer"]
    found = run(service.authenticate(made.key))
    assert found is not None and (found.id, found.access) == (made.id, Access.AGENT)
    assert run(service.authenticate(made.key)) == found  # again, from what this process knows
    assert run(service.authenticate(made.key[:-1] + "x")) is None
    assert run(service.authenticate("not a key")) is None
    listed = run(service.list_keys())
    assert [k.id for k in listed] == [made.id]
    assert not hasattr(listed[0], "key")
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
    gone = value(run(service.revoke_key(made.id)))
    assert gone.id == made.id
    assert run(service.authenticate(made.key)) is None
    assert run(service.key_by_id(made.id)) is None
    assert run(service.list_keys()) == []
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
        run(service.create_key(CreateKey("ci", access, roles)))
    with pytest.raises(InvalidRequest, match="name"):
        run(service.create_key(CreateKey("  ", Access.READ)))


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
                assert run(two.list_keys())  # a read for the key, confirmed
            value(run(one.revoke_key(made.id)))
            with two.speaking_with(made.id):
                with pytest.raises(Unauthorized, match="revoked"):
                    run(two.list_keys())
                with pytest.raises(Unauthorized, match="revoked"):
                    run(two.put_value("ns", "k", PutValue(msgspec.Raw(b"1"))))
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
    value(run(service.revoke_key(made.id)))
    ring.learn(hashlib.sha256(made.key.encode()).digest(), info, seen)  # ...kept after it
    assert run(service.authenticate(made.key)) is None
