"""Full-text search ranks and marks its matches whatever the backend; checkpoints merge as
RFC 7396 says."""

from __future__ import annotations

import msgspec
import pytest

from nulltickets.domain.commands import Claim, CreateTask, PutValue, WriteCheckpoint
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import InvalidQuery
from nulltickets.service import Service
from tests.contract.conftest import make_pipeline, run, value


def put(service: Service, namespace: str, key: str, v: object) -> None:
    run(service.put_value(namespace, key, PutValue(msgspec.Raw(msgspec.json.encode(v)))))


def search(service: Service, text: str, **kw: object) -> list[tuple[str, str]]:
    hits = run(
        service.search(
            text=text,
            namespace=kw.get("namespace"),  # type: ignore[arg-type]
            filter_path=kw.get("filter_path"),  # type: ignore[arg-type]
            filter_value=kw.get("filter_value"),  # type: ignore[arg-type]
            limit=10,
        )
    )
    return [(h.key, h.snippet) for h in hits]


def test_search_ranks_the_better_match_first_and_marks_it_in_a_snippet(
    service: Service,
) -> None:
    put(service, "notes", "once", {"text": "the parser handles one comet in passing"})
    put(service, "notes", "often", {"text": "comet comet comet: all about the comet"})
    put(service, "notes", "never", {"text": "nothing to see here"})
    hits = search(service, "comet")
    assert [k for k, _ in hits] == ["often", "once"]
    assert all("[comet]" in snippet for _, snippet in hits)
    hits = run(
        service.search(text="comet", namespace=None, filter_path=None, filter_value=None, limit=10)
    )
    assert hits[0].score <= hits[1].score


def test_every_term_must_match_and_operators_are_plain_words(service: Service) -> None:
    put(service, "n", "both", {"text": "alpha beta"})
    put(service, "n", "one", {"text": "alpha gamma"})
    put(service, "n", "ops", {"text": "NEAR(a b) OR c* x:y -z"})
    assert [k for k, _ in search(service, "alpha beta")] == ["both"]
    assert [k for k, _ in search(service, "NEAR(a b) OR c*")] == ["ops"]
    assert search(service, '"unbalanced') == []
    with pytest.raises(InvalidQuery):
        search(service, " \t ")


def test_search_filters_by_namespace_and_json_path(service: Service) -> None:
    put(service, "a", "open", {"text": "ticket", "status": "open"})
    put(service, "a", "shut", {"text": "ticket", "status": "closed"})
    put(service, "b", "other", {"text": "ticket", "status": "open"})
    assert sorted(k for k, _ in search(service, "ticket", namespace="a")) == ["open", "shut"]
    found = search(service, "ticket", namespace="a", filter_path="$.status", filter_value="open")
    assert [k for k, _ in found] == ["open"]


def test_checkpoints_merge_as_rfc_7396_patches(service: Service) -> None:
    pipeline_id = make_pipeline(service)
    task_id = value(run(service.create_task(CreateTask(pipeline_id, "t", ""))))
    claimed = value(run(service.claim(Claim("a", "coder"))))
    assert claimed is not None
    token = lease_token_hash(claimed.lease_token)

    def patch(doc: object) -> object:
        cmd = WriteCheckpoint(msgspec.Raw(msgspec.json.encode(doc)))
        result = value(run(service.checkpoint(claimed.run.id, token, lambda: cmd)))
        return msgspec.json.decode(result.checkpoint)

    assert patch({"a": 1, "b": {"c": 2, "keep": True}, "list": [1, 2]}) == {
        "a": 1,
        "b": {"c": 2, "keep": True},
        "list": [1, 2],
    }
    merged = patch({"b": {"c": None, "d": 3}, "list": [3], "a": None, "n": None})
    assert merged == {"b": {"keep": True, "d": 3}, "list": [3]}
    stored = run(service.get_checkpoint(task_id))
    assert msgspec.json.decode(stored.checkpoint) == merged
    assert stored.fence == claimed.fence
