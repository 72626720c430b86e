from __future__ import annotations

import pytest

from nulltickets.storage.queries import parse_queries
from nulltickets.storage.sqlite.backend import Q


def test_blocks_are_split_by_header_and_keep_their_comments() -> None:
    q = parse_queries("-- one --\n-- says what\nSELECT 1;\n\n-- two --\nSELECT 2;\n")
    assert q == {"one": "-- says what\nSELECT 1;", "two": "SELECT 2;"}


def test_a_name_defined_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse_queries("-- a --\nSELECT 1;\n-- a --\nSELECT 2;\n")


def test_every_backend_query_is_named_in_the_sql_file() -> None:
    assert {"claim_candidate", "insert_task", "end_run", "move_task"} <= set(Q)
