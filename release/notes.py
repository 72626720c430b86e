"""Release notes from CHANGELOG.md: the section of one version, as the GitHub release's text.

    python release/notes.py VERSION [--changelog CHANGELOG.md] [--unreleased]

prints the notes for VERSION: a title, the `## [VERSION]` section of the changelog (its
`### Added` / `### Changed` ... subsections and bullets as written) and how to verify the
downloads. `--unreleased` takes the `## [Unreleased]` section when the changelog has no section
for VERSION yet (the release workflow's dry run, before the changelog is cut); without it, a
missing or empty section is an error, so a tag is never published with empty notes. Standard
library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^## \[([^\]]+)\]")

FOOTER = """\
### Downloads

Standalone executables for nullhub (`nulltickets-<os>-<arch>.bin`, `.exe` on Windows), their
`SHA256SUMS` and `release-manifest.json`, and the Python wheels. Verify a download with
`sha256sum --check --ignore-missing SHA256SUMS`.
"""


class NotesError(Exception):
    pass


def sections(changelog: str) -> dict[str, str]:
    """{version or "Unreleased": the text under its `## [...]` heading, stripped}."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in changelog.splitlines():
        m = HEADING.match(line)
        if m:
            current = found.setdefault(m.group(1), [])
        elif line.startswith("[") and "]: " in line and current is not None:
            continue  # link reference definitions at the bottom
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip() for name, lines in found.items()}


def notes(version: str, changelog: str, *, unreleased: bool = False) -> str:
    found = sections(changelog)
    body = found.get(version)
    source = version
    if body is None and unreleased:
        body, source = found.get("Unreleased"), "Unreleased"
    if body is None:
        raise NotesError(f"CHANGELOG.md has no section '## [{version}]'")
    if not re.search(r"^\s*- \S", body, re.M):
        raise NotesError(f"CHANGELOG.md's section [{source}] has no entries")
    title = f"nulltickets {version}"
    if source != version:
        title += " (unreleased changes)"
    return f"## {title}\n\n{body}\n\n{FOOTER}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release/notes.py", description=__doc__.splitlines()[0])
    p.add_argument("version")
    p.add_argument("--changelog", type=Path, default=ROOT / "CHANGELOG.md")
    p.add_argument("--unreleased", action="store_true", help="fall back to [Unreleased]")
    args = p.parse_args(argv)
    version = args.version.removeprefix("v")
    try:
        text = notes(
            version, args.changelog.read_text(encoding="utf-8"), unreleased=args.unreleased
        )
    except (OSError, NotesError) as exc:
        print(f"release/notes.py: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
