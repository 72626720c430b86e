"""The package list in pyproject.toml covers every package in the source tree."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_package_is_listed_for_the_build() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    src = ROOT / "src"
    found = {
        ".".join(d.relative_to(src).parts)
        for d in src.rglob("*")
        if d.is_dir()
        and any(any(d.glob(f"*.{ext}")) for ext in ("py", "sql", "js"))
        and "__pycache__" not in d.parts
        and not d.name.endswith(".egg-info")
    }
    assert found | {"nulltickets._cext"} == listed
    assert config["package-dir"]["nulltickets._cext"] == "cext"
    assert (ROOT / "cext" / "core.py").exists()


def _requirements() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exact versions: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_runtime_dependencies_are_compatible_ranges_not_pins() -> None:
    for text in _requirements():
        req = Requirement(text)
        assert req.specifier, f"{req.name} has no version range"
        for spec in req.specifier:
            assert spec.operator not in ("==", "==="), f"{text}: a range, not an exact pin"
        assert any(s.operator == "<" for s in req.specifier), f"{text}: no upper bound"


def test_constraints_pin_every_runtime_dependency_inside_its_range() -> None:
    pins = _constraints()
    for text in _requirements():
        req = Requirement(text)
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(version, prereleases=True), (text, version)


def test_the_license_the_metadata_names_is_there() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert project["license-files"] == ["LICENSE"]


def load_build_binary() -> ModuleType:
    """build/binary.py as a module (it imports its neighbours in build/ from the repository)."""
    spec = importlib.util.spec_from_file_location("build_binary", ROOT / "build" / "binary.py")
    assert spec is not None and spec.loader is not None
    binary = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT))
    try:
        spec.loader.exec_module(binary)
    finally:
        sys.path.remove(str(ROOT))
    return binary


def test_the_binary_build_stages_every_file_of_the_package(tmp_path: Path) -> None:
    """The standalone binary is compiled from a staged copy of the package: every file the
    package carries (the dashboard's index.html among them) must be in that copy."""
    binary = load_build_binary()
    staged = binary.stage_sources(tmp_path)
    static = ROOT / "src" / "nulltickets" / "http" / "static"
    assert "index.html" in {p.name for p in static.iterdir()}
    assert {p.name for p in (staged / "http" / "static").iterdir()} == {
        p.name for p in static.iterdir()
    }


def test_the_binary_carries_the_native_wal_sync_threads_when_they_were_built(
    tmp_path: Path,
) -> None:
    """Durability `full` is fastest with the WAL sync threads in C (cext/walsync.c): a binary
    built where they compiled must carry them, not fall back to the Python thread."""
    import importlib.machinery

    binary = load_build_binary()
    built = [
        p.name
        for p in (ROOT / "cext").iterdir()
        if p.name.startswith("walsync.")
        and p.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    ]
    staged = binary.stage_sources(tmp_path)
    assert sorted(
        p.name for p in (staged / "_cext").glob("walsync.*") if p.suffix != ".c"
    ) == sorted(built)
    cmd = binary.nuitka_command(tmp_path / "nt", tmp_path, staged, "linux", "0", "x", 1)
    assert ("--include-module=nulltickets._cext.walsync" in cmd) == bool(built)


def test_the_onefile_bootstrap_waits_only_as_long_as_the_servers_own_shutdown(
    tmp_path: Path,
) -> None:
    """SIGTERM to the binary reaches granian's main process through the onefile bootstrap,
    which kills it after its grace time: a hung main process must not hold the binary for
    longer than the server's own bounded shutdown (and container runtimes' 10 s)."""
    from nulltickets.server import launch

    binary = load_build_binary()
    cmd = binary.nuitka_command(tmp_path / "nt", tmp_path, tmp_path, "linux", "0", "x", 1)
    (grace,) = [a for a in cmd if a.startswith("--onefile-child-grace-time=")]
    grace_ms = int(grace.split("=", 1)[1])
    assert launch.WORKER_KILL_TIMEOUT_S < launch.MAIN_SHUTDOWN_DEADLINE_S
    assert launch.MAIN_SHUTDOWN_DEADLINE_S * 1000 < grace_ms < 10_000
