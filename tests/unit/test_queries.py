from __future__ import annotations

from pathlib import Path

import apsw
import apsw.ext
import pytest

from nulltickets.storage.queries import parameter_names, parse_queries
from nulltickets.storage.sqlite import connection
from nulltickets.storage.sqlite.backend import ARGS, Q


def test_blocks_are_split_by_header_and_lose_their_comments_and_indentation() -> None:
    q = parse_queries(
        "-- one --\n-- says what\nSELECT 1,  -- the first\n    2;\n\n-- two --\nSELECT 2;\n"
    )
    assert q == {"one": "SELECT 1,\n2;", "two": "SELECT 2;"}


def test_what_looks_like_a_comment_inside_a_literal_or_identifier_stays() -> None:
    sql = "-- q --\nSELECT '-- not a comment', \"odd -- name\", 'it''s -- kept'\nFROM t;\n"
    assert parse_queries(sql)["q"] == (
        "SELECT '-- not a comment', \"odd -- name\", 'it''s -- kept'\nFROM t;"
    )


def test_a_literal_spanning_lines_keeps_its_lines_as_written() -> None:
    sql = "-- q --\nSELECT 'one\n    -- two\n  three', 1\n    FROM t;\n"
    assert parse_queries(sql)["q"] == "SELECT 'one\n    -- two\n  three', 1\nFROM t;"


def test_parameter_names_come_in_order_of_first_use_each_once() -> None:
    sql = "SELECT :b, ':x', \"y :z\", :a FROM t WHERE c = :b AND d = :c_1"
    assert parameter_names(sql) == ("b", "a", "c_1")


def test_every_sqlite_query_binds_by_position_as_sqlite_numbers_its_parameters(
    tmp_path: Path,
) -> None:
    conn = connection.connect_writer(str(tmp_path / "q.db"), "normal")
    connection.migrate(conn)
    try:
        for name, sql in Q.items():
            info = apsw.ext.query_info(conn, sql)
            assert parameter_names(sql) == tuple(info.bindings_names), name
            params = {p: f"<{p}>" for p in info.bindings_names}
            assert ARGS[name](params) == tuple(params[p] for p in info.bindings_names), name
    finally:
        conn.close()


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
        "SELECT %(v)s::jsonb, '{}'::jsonb, 'a :b c', \"odd :col\", x::text, 'it''s :x'\n"
        "FROM t WHERE y = %(y)s;"
    )


def test_pyformat_doubles_every_literal_percent_sign() -> None:
    q = parse_queries("-- q --\nSELECT 7 % 2, 'a%' LIKE :p;\n", "pyformat")
    assert q["q"] == "SELECT 7 %% 2, 'a%%' LIKE %(p)s;"


def test_named_paramstyle_keeps_the_text_as_written() -> None:
    text = "-- q --\nSELECT :a::text, 7 % 2;\n"
    assert parse_queries(text) == parse_queries(text, "named") == {"q": "SELECT :a::text, 7 % 2;"}


def test_a_fragment_fills_each_place_that_names_it_and_is_no_query_of_its_own() -> None:
    sql = (
        "-- fragment live --\n-- says what\nexpires_at_ms > :now  -- a comment\n\n"
        "-- fragment mine --\nagent_id = :agent AND {live}\n\n"
        "-- q --\nSELECT id\nFROM leases\nWHERE {mine};\n\n"
        "-- r --\nDELETE FROM leases WHERE {live};\n"
    )
    assert parse_queries(sql) == {
        "q": "SELECT id\nFROM leases\nWHERE agent_id = :agent AND expires_at_ms > :now;",
        "r": "DELETE FROM leases WHERE expires_at_ms > :now;",
    }
    assert (
        parse_queries(sql, "pyformat")["r"] == "DELETE FROM leases WHERE expires_at_ms > %(now)s;"
    )


def test_braces_in_a_literal_or_naming_no_fragment_stay_as_written() -> None:
    sql = (
        "-- fragment live --\nexpires_at_ms > :now\n\n"
        "-- q --\nSELECT '{live}', '{\"a\": 1}'::jsonb, '{1,2}'::int[] FROM {table} WHERE {live};\n"
    )
    assert parse_queries(sql)["q"] == (
        "SELECT '{live}', '{\"a\": 1}'::jsonb, '{1,2}'::int[] FROM {table} "
        "WHERE expires_at_ms > :now;"
    )
    # A query is no fragment: its name in braces is text too.
    assert parse_queries("-- live --\nSELECT 1;\n\n-- q --\nSELECT {live};\n")["q"] == (
        "SELECT {live};"
    )


def test_a_fragment_that_contains_itself_is_refused() -> None:
    sql = "-- fragment a --\nx AND {b}\n\n-- fragment b --\ny AND {a}\n\n-- q --\nSELECT {a};\n"
    with pytest.raises(ValueError, match="contains itself: q -> a -> b -> a"):
        parse_queries(sql)
