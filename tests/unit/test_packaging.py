"""The package list in pyproject.toml covers every package in the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_package_is_listed_for_the_build() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    src = ROOT / "src"
    found = {
        ".".join(d.relative_to(src).parts)
        for d in src.rglob("*")
        if d.is_dir()
        and (any(d.glob("*.py")) or any(d.glob("*.sql")))
        and "__pycache__" not in d.parts
        and not d.name.endswith(".egg-info")
    }
    assert found | {"nulltickets._cext"} == listed
    assert config["package-dir"]["nulltickets._cext"] == "cext"
    assert (ROOT / "cext" / "core.py").exists()
