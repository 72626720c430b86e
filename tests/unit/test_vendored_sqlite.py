"""vendor/sqlite is the SQLite every release binary carries: its files are the ones recorded,
its compile options are written once (build/sqlite-options.txt), and the apsw build that uses
them can download nothing."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENDOR = ROOT / "vendor" / "sqlite"


def load_build_apsw() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_apsw", ROOT / "build" / "build_apsw.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_apsw"] = module
    spec.loader.exec_module(module)
    return module


build_apsw = load_build_apsw()


def recorded() -> dict[str, str]:
    sums = {}
    for line in (VENDOR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    return sums


def test_every_amalgamation_file_is_recorded() -> None:
    assert set(recorded()) == {"sqlite3.c", "sqlite3.h", "sqlite3ext.h"}


@pytest.mark.parametrize("name", ["sqlite3.c", "sqlite3.h", "sqlite3ext.h"])
def test_vendored_file_has_the_recorded_sha256(name: str) -> None:
    actual = hashlib.sha256((VENDOR / name).read_bytes()).hexdigest()
    assert actual == recorded()[name], (
        f"vendor/sqlite/{name} changed: update SHA256SUMS and vendor/sqlite/README.md together "
        "with the files, from the source they name"
    )


def test_the_build_refuses_a_changed_amalgamation(tmp_path: Path) -> None:
    """The release build's own check (build/build_apsw.py), on a copy with one byte changed."""
    copy = tmp_path / "sqlite"
    copy.mkdir()
    for name in ("sqlite3.c", "sqlite3.h", "sqlite3ext.h", "SHA256SUMS"):
        (copy / name).write_bytes((VENDOR / name).read_bytes())
    build_apsw.check_vendored()  # the real files pass
    original = build_apsw.VENDOR
    try:
        build_apsw.VENDOR = copy
        build_apsw.check_vendored()
        with (copy / "sqlite3.h").open("ab") as f:
            f.write(b"\n")
        with pytest.raises(build_apsw.BuildError, match=r"sqlite3\.h has SHA-256"):
            build_apsw.check_vendored()
    finally:
        build_apsw.VENDOR = original


def test_the_vendored_sqlite_is_3_51_3() -> None:
    assert build_apsw.header_define("SQLITE_VERSION") == "3.51.3"
    head = (VENDOR / "sqlite3.c").read_bytes()[:2000].decode()
    assert "version 3.51.3." in head
    source_id = build_apsw.header_define("SQLITE_SOURCE_ID")
    assert source_id.startswith("2026-03-13 ")
    assert source_id.split()[2] in (VENDOR / "sqlite3.c").read_text(encoding="utf-8")


def test_the_apsw_release_builds_is_the_one_constraints_pins() -> None:
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    assert f"apsw=={build_apsw.APSW_VERSION}" in pins
    # apsw's first three version numbers are the SQLite it is made for.
    assert build_apsw.APSW_VERSION.rsplit(".", 1)[0] == build_apsw.header_define("SQLITE_VERSION")


def test_compile_options_have_what_the_schema_needs_and_nothing_that_breaks_it() -> None:
    passed = build_apsw.compile_options()
    reported = build_apsw.expected_reported_options()
    assert {"SQLITE_ENABLE_FTS5", "SQLITE_DQS=0", "SQLITE_THREADSAFE=1"} <= set(passed)
    # Grammar the vendored amalgamation was generated with (its parser has DELETE ... LIMIT).
    assert "SQLITE_ENABLE_UPDATE_DELETE_LIMIT" in passed
    # What the server, apsw and the tests use: WAL, the backup API and wal hook, FTS5's
    # functions, json_each/json_patch, progress handlers, virtual tables.
    forbidden = {
        "OMIT_WAL", "OMIT_JSON", "OMIT_VIRTUALTABLE", "OMIT_PROGRESS_CALLBACK", "OMIT_TRIGGER",
        "OMIT_FOREIGN_KEY", "OMIT_CTE", "OMIT_WINDOWFUNC", "OMIT_AUTOVACUUM", "OMIT_ATTACH",
        "OMIT_INCRBLOB", "OMIT_UTF16", "OMIT_LOAD_EXTENSION", "OMIT_PRAGMA", "OMIT_SUBQUERY",
        "THREADSAFE=0", "THREADSAFE=2",
    }  # fmt: skip
    assert not (reported & forbidden)
    assert len(passed) == len(set(passed)), "an option is written twice"


def test_an_option_line_that_is_not_a_define_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "options.txt"
    bad.write_text("SQLITE_DQS=0\n-DSQLITE_ENABLE_FTS5\n")
    original = build_apsw.OPTIONS_FILE
    try:
        build_apsw.OPTIONS_FILE = bad
        with pytest.raises(build_apsw.BuildError, match="not a define"):
            build_apsw.compile_options()
    finally:
        build_apsw.OPTIONS_FILE = original


def test_apsws_setup_file_is_replaced_by_one_that_never_fetches() -> None:
    text = build_apsw.setup_apsw()
    assert re.search(r"^fetch = False$", text, re.M)
    assert "fetch = True" not in text
    assert "enable_all_extensions = False" in text
    defines = re.search(r"^definevalues = (.*)$", text, re.M)
    assert defines and defines.group(1).split(",") == build_apsw.compile_options()


def test_the_apsw_build_environment_reaches_no_network() -> None:
    """What build/build_apsw.py gives pip and setup.py: an HTTPS download fails at once (the proxy
    is a closed local port), so a build that tried one would fail instead of fetching."""
    probe = (
        "import urllib.request\n"
        "try:\n"
        "    urllib.request.urlopen('https://sqlite.org/index.html', timeout=10)\n"
        "except OSError as exc:\n"
        "    print('refused', type(exc).__name__)\n"
        "else:\n"
        "    print('downloaded')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=build_apsw.offline_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.startswith("refused"), out.stdout
    assert build_apsw.offline_env()["PIP_NO_INDEX"] == "1"


def test_a_build_log_that_fetched_or_used_another_sqlite_is_refused(tmp_path: Path) -> None:
    ours = tmp_path / "sqlite3" / "sqlite3.c"
    good = f"  SQLite: Using amalgamation {ours}\n"
    build_apsw.check_build_log(good, tmp_path)
    with pytest.raises(build_apsw.BuildError, match="fetch"):
        build_apsw.check_build_log(good + "    Fetching https://sqlite.org/x.zip\n", tmp_path)
    with pytest.raises(build_apsw.BuildError, match="did not use"):
        build_apsw.check_build_log("  SQLite: Using system sqlite include/libraries\n", tmp_path)
    with pytest.raises(build_apsw.BuildError, match="did not use"):
        build_apsw.check_build_log("  SQLite: Using amalgamation /elsewhere/sqlite3.c\n", tmp_path)


def test_the_benchmark_comparison_reads_both_results_and_signs_the_change() -> None:
    spec = importlib.util.spec_from_file_location(
        "sqlite_compare", ROOT / "build" / "sqlite_compare.py"
    )
    assert spec and spec.loader
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)

    def results(cycles: float, claim_p99: float, sqlite: str) -> dict[str, object]:
        return {
            "machine": {"sqlite": sqlite},
            "instructions_per_cycle": cycles * 1000,
            "cycle": [
                {"agents": 4, "cycles_per_s": cycles, "latency_ms": {"claim": {"p99": claim_p99}}}
            ],
            "durability": {"full": {"cycles_per_s": cycles / 2}},
            "backlog": {"1000_total": {"claim_p50_ms": 1.0}, "ratio_waiting": 1.1},
            "ops_queue": {"100": {"p50_ms": 2.0}, "ratio": 1.0},
        }

    table = compare.compare(results(1000, 4.0, "3.51.3"), results(1100, 5.0, "3.51.3"))
    # Fewer instructions is better: the vendored side's 10% more is shown as a loss.
    assert "| instructions per in-process cycle | 1000000.00 | 1100000.00 | -10.0% |" in table
    assert "| cycles/s, 4 agents | 1000.00 | 1100.00 | +10.0% |" in table
    assert "| claim p99 ms, 4 agents | 4.00 | 5.00 | -25.0% |" in table
    assert "| cycles/s, durability full | 500.00 | 550.00 | +10.0% |" in table
    assert "| backlog 1000_total: claim p50 ms | 1.00 | 1.00 | +0.0% |" in table
    assert "ratio" not in table
