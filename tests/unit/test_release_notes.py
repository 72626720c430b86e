"""release/notes.py: the GitHub release's text is the changelog's section for the version."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from release import notes

CHANGELOG = """# Changelog

Intro text.

## [Unreleased]

### Added
- Something new, on
  two lines.

## [2026.11.29]

### Fixed
- A fix.

## [2026.10.1]

### Added
- The first release.

[2026.11.29]: https://example.invalid/compare
"""


def test_the_section_of_the_version_with_its_subsections() -> None:
    text = notes.notes("2026.11.29", CHANGELOG)
    assert text.startswith("## nulltickets 2026.11.29\n\n### Fixed\n- A fix.\n")
    assert "first release" not in text and "Something new" not in text
    assert "https://example.invalid" not in text
    assert "sha256sum --check" in text


def test_unreleased_only_when_asked_and_only_when_the_version_has_no_section() -> None:
    with pytest.raises(notes.NotesError, match=r"no section '## \[2026.12.1\]'"):
        notes.notes("2026.12.1", CHANGELOG)
    text = notes.notes("2026.12.1", CHANGELOG, unreleased=True)
    assert text.startswith("## nulltickets 2026.12.1 (unreleased changes)\n\n### Added\n")
    assert "- Something new, on\n  two lines." in text
    # A version that has its section gets it, not [Unreleased].
    assert "A fix." in notes.notes("2026.11.29", CHANGELOG, unreleased=True)


def test_a_section_without_entries_is_an_error() -> None:
    empty = "## [Unreleased]\n\n### Added\n\n## [2026.1.1]\n- x\n"
    with pytest.raises(notes.NotesError, match="no entries"):
        notes.notes("2026.2.2", empty, unreleased=True)


def test_the_real_changelog_gives_notes_for_the_next_release(tmp_path: Path) -> None:
    script = Path(notes.__file__)
    out = subprocess.run(
        [sys.executable, str(script), "v2099.1.1", "--unreleased"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("## nulltickets 2099.1.1 (unreleased changes)\n")
    assert "vendor/sqlite" in out.stdout  # this change's own line
    missing = subprocess.run([sys.executable, str(script), "2099.1.1"], capture_output=True)
    assert missing.returncode == 1
