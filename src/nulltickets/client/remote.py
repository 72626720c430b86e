"""What every command that talks to a running server shares: the `--base` and `--token`
options with their environment variables, and turning a failed call into one line.

A command raises `CommandFailed`; `nulltickets.cli.main` prints `nulltickets: <message>` on
stderr and exits with its status (1 unless said otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import urllib.parse
from collections.abc import Iterator

import msgspec

from nulltickets.client import ApiError, Client, Retry

ENV_BASE_URL = "NULLTICKETS_BASE_URL"
ENV_TOKEN = "NULLTICKETS_TOKEN"
DEFAULT_BASE = "http://127.0.0.1:7700"
TIMEOUT_S = 30.0
# How long a command keeps trying a server that does not answer (a restart takes about 1 s).
RETRY_S = 5.0


class CommandFailed(Exception):
    """A command that cannot do what it was asked; the message is the one line printed."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base",
        default=None,
        metavar="URL",
        help=f"the server's URL (env {ENV_BASE_URL}; default {DEFAULT_BASE})",
    )
    parser.add_argument(
        "--token",
        default=None,
        metavar="T",
        help=f"the server's --token or a key, when it has a token (env {ENV_TOKEN})",
    )


def base_url(args: argparse.Namespace) -> tuple[str, str]:
    """(url, where it came from): --base, else $NULLTICKETS_BASE_URL, else the default."""
    if args.base is not None:
        return args.base, "--base"
    from_env = os.environ.get(ENV_BASE_URL, "")
    if from_env.strip():
        return from_env.strip(), ENV_BASE_URL
    return DEFAULT_BASE, "the default base URL"


def check_base(url: str, source: str) -> None:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a port that is not a number)
    except ValueError as exc:
        raise CommandFailed(f"{source} is not a URL ({exc}): {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CommandFailed(f"{source} must be an http:// or https:// URL, got {url!r}")


def token(args: argparse.Namespace) -> str | None:
    if args.token is not None:
        return args.token or None
    return os.environ.get(ENV_TOKEN) or None


@contextlib.contextmanager
def connect(args: argparse.Namespace) -> Iterator[Client]:
    """A client for the server `args` names; every failure inside the block is one line."""
    url, source = base_url(args)
    check_base(url, source)
    try:
        # A person waits for the answer: ride out a restart of a few seconds, not more.
        api = Client(url, token(args), timeout=TIMEOUT_S, retry=Retry(timeout=RETRY_S))
    except ValueError as exc:
        raise CommandFailed(f"{source}: {exc}") from None
    try:
        with api:
            yield api
    except ApiError as exc:
        raise CommandFailed(f"the server answered {exc.status} {exc.code}: {exc.message}") from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise CommandFailed(f"cannot reach the server at {url}: {reason}") from None
    except (http.client.HTTPException, msgspec.DecodeError) as exc:
        detail = str(exc) or type(exc).__name__
        raise CommandFailed(f"{url} did not answer as a nulltickets server: {detail}") from None
