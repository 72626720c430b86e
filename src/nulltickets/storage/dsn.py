"""What a database target may show of itself: never its password.

A target is a SQLite path or a libpq URL (`postgresql://user:password@host/db?...`); a libpq
keyword string (`host=... password=...`) is not one, but a person may still pass it. Its
passwords are the URL's `user:password@` and any `password=` or `sslpassword=` value, in the
query or as a keyword. `display_name` is the target with each replaced by `***`; `redact`
takes them out of any text, such as a driver's error message, which may quote the URL or the
password alone (libpq's "invalid percent-encoded token: ..." does).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

HIDDEN = "***"

# A password= or sslpassword= parameter (URL query or keyword string): its value, quoted or not.
_PARAMETER = re.compile(r"(?<![\w.-])(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'?|[^&\s#]*)")


def _spans(target: str) -> list[tuple[int, int]]:
    """Where the passwords are in `target`: (start, end) of each, in order."""
    spans: list[tuple[int, int]] = []
    if "://" in target:
        start = target.index("://") + 3
        ends = [i for i in (target.find(c, start) for c in "/?#") if i != -1]
        end = min(ends, default=len(target))
        at = target.rfind("@", start, end)
        colon = target.find(":", start, at) if at != -1 else -1
        if colon != -1:
            spans.append((colon + 1, at))
    for match in _PARAMETER.finditer(target):
        if match.group(1):
            spans.append(match.span(1))
    return sorted(spans)


def secrets_of(target: str) -> list[str]:
    """The passwords `target` carries, as written and percent-decoded, longest first."""
    found: set[str] = set()
    for start, end in _spans(target):
        raw = target[start:end]
        found.update(
            form for form in (raw, unquote(raw), raw.strip("'")) if form and form != HIDDEN
        )
    return sorted(found, key=len, reverse=True)


def display_name(target: str) -> str:
    """The target as logs, errors and reports show it: each password replaced by `***`."""
    shown, last = [], 0
    for start, end in _spans(target):
        if start >= last and end > start:
            shown.append(target[last:start])
            shown.append(HIDDEN)
            last = end
    shown.append(target[last:])
    return "".join(shown)


def redact(text: str, *targets: str) -> str:
    """`text` without any password of `targets`: a whole target becomes its display name, then
    any password left (as written or decoded) becomes `***`."""
    for target in targets:
        if target and target in text:
            text = text.replace(target, display_name(target))
    for target in targets:
        for secret in secrets_of(target):
            text = text.replace(secret, HIDDEN)
    return text
