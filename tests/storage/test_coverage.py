"""The suite covers the whole storage port: every operation is named by a test (see ops.py)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.storage
from tests.storage.ops import COVERED, covers, port_operations


def load_suite() -> None:
    """Import every test module of tests/storage, so that each registers what it covers
    (whatever part of the suite this run collected)."""
    for module in pkgutil.iter_modules(tests.storage.__path__):
        if module.name.startswith("test_"):
            importlib.import_module(f"tests.storage.{module.name}")


def test_every_operation_of_the_storage_port_has_a_conformance_test() -> None:
    load_suite()
    missing = sorted(port_operations() - set(COVERED))
    assert missing == [], (
        f"operations of the storage port no test in tests/storage covers: {missing}"
    )


def test_what_a_test_says_it_covers_is_a_test_of_this_suite() -> None:
    load_suite()
    for operation, tests_of_it in COVERED.items():
        for where in tests_of_it:
            module, name = where.split(":")
            assert module.startswith("tests.storage.test_") and name.startswith("test_"), (
                operation,
                where,
            )


def test_the_port_is_read_from_the_protocols_themselves() -> None:
    operations = port_operations()
    assert {"Backend.claim_candidate", "Backend.search_store", "Backend.delete_api_key"} <= (
        operations
    )
    assert {"Database.write", "Database.capabilities", "Notifier.on_commit"} <= operations
    assert {"Notifier.listening", "Notifier.revocations_heard"} <= operations  # properties
    assert not any(name.split(".")[1].startswith("_") for name in operations)
    assert len([n for n in operations if n.startswith("Backend.")]) >= 90


def test_a_name_the_port_does_not_have_is_refused_at_once() -> None:
    with pytest.raises(AssertionError, match=r"Backend\.claim_next"):
        covers("Backend.claim_next")
