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


def test_pyformat_turns_named_parameters_into_psycopg_placeholders() -> None:
    q = parse_queries("-- q --\nSELECT :a, :b_2 FROM t WHERE x = :a;\n", "pyformat")
    assert q == {"q": "SELECT %(a)s, %(b_2)s FROM t WHERE x = %(a)s;"}


def test_pyformat_leaves_casts_literals_identifiers_and_comments_alone() -> None:
    sql = (
        "-- q --\n-- reads :nothing here, 100% sure\n"
        "SELECT :v::jsonb, '{}'::jsonb, 'a :b c', \"odd :col\", x::text, 'it''s :x'\n"
        "FROM t WHERE y = :y;\n"
    )
    assert parse_queries(sql, "pyformat")["q"] == (
        "-- reads :nothing here, 100%% sure\n"
        "SELECT %(v)s::jsonb, '{}'::jsonb, 'a :b c', \"odd :col\", x::text, 'it''s :x'\n"
        "FROM t WHERE y = %(y)s;"
    )


def test_pyformat_doubles_every_literal_percent_sign() -> None:
    q = parse_queries("-- q --\nSELECT 7 % 2, 'a%' LIKE :p;\n", "pyformat")
    assert q["q"] == "SELECT 7 %% 2, 'a%%' LIKE %(p)s;"


def test_named_paramstyle_keeps_the_text_as_written() -> None:
    text = "-- q --\nSELECT :a::text, 7 % 2;\n"
    assert parse_queries(text) == parse_queries(text, "named") == {"q": "SELECT :a::text, 7 % 2;"}
