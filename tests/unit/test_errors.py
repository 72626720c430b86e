"""Every error class has a status and a code, and every error leaves in one envelope."""

from __future__ import annotations

import json

import pytest

from nulltickets import errors
from nulltickets.http.errors import STATUS, error_response, status_of


def all_error_classes() -> list[type[errors.TrackerError]]:
    found, todo = [], [errors.TrackerError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_maps_to_a_status_and_has_a_code(cls: type[errors.TrackerError]) -> None:
    assert status_of(cls()) in {400, 401, 403, 404, 408, 409, 410, 413, 500, 503, 507}
    assert cls.code and cls.code == cls.code.lower()
    assert cls.__doc__, "the docstring is the default message"


def test_known_errors_carry_their_code_and_message() -> None:
    status, body = error_response(errors.TaskNotFound("task 'x' not found"))
    assert status == 404
    assert json.loads(body) == {
        "error": {"code": "task_not_found", "message": "task 'x' not found"}
    }


def test_messages_with_quotes_stay_valid_json() -> None:
    status, body = error_response(errors.ReservedNamespace('the "search" namespace'))
    assert status == 400
    assert json.loads(body)["error"]["message"] == 'the "search" namespace'


def test_unexpected_errors_are_a_generic_500_that_reveals_nothing() -> None:
    status, body = error_response(ValueError("secret detail"))
    assert status == 500
    assert json.loads(body) == {"error": {"code": "internal_error", "message": "internal error"}}


def test_status_lookup_walks_the_class_hierarchy() -> None:
    assert status_of(errors.LeaseNotFound()) == 404 == STATUS[errors.NotFound]
    assert errors.LeaseNotFound.code == "not_found"
