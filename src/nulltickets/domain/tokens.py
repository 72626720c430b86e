"""Lease tokens, keys and the admin token: generation, parsing and constant-time comparison.

A lease token is 32 random bytes shown once to the claimer as 64 hex characters; only
SHA-256 of the raw bytes is ever stored. A key is `ntk_` and 32 random bytes in URL-safe
base64, shown once to whoever made it; only SHA-256 of its text is stored (a hash that needs
no salt nor stretching: the key is random, not a password).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from nulltickets.errors import Unauthorized

TOKEN_BYTES = 32
KEY_PREFIX = "ntk_"  # recognisable in a config file, a log or a secret scanner


def new_lease_token() -> tuple[str, bytes]:
    """Return (token as 64 lowercase hex chars, SHA-256 of its raw bytes)."""
    raw = secrets.token_bytes(TOKEN_BYTES)
    return raw.hex(), hashlib.sha256(raw).digest()


def lease_token_hash(token: str) -> bytes:
    """Hash a presented lease token; anything but exactly 64 hex characters is unauthorized."""
    if len(token) != TOKEN_BYTES * 2:
        raise Unauthorized("lease token must be 64 hex characters")
    try:
        raw = bytes.fromhex(token)
    except ValueError:
        raise Unauthorized("lease token must be 64 hex characters") from None
    return hashlib.sha256(raw).digest()


def new_api_key() -> tuple[str, bytes]:
    """Return (a new key, its SHA-256), from the operating system's CSPRNG."""
    key = KEY_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
    return key, api_key_hash(key)


def api_key_hash(key: str) -> bytes:
    """The stored form of a presented key."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def looks_like_api_key(text: str) -> bool:
    """Whether `text` could be one of our keys (any other bearer needs no lookup)."""
    return text.startswith(KEY_PREFIX) and len(text) == len(KEY_PREFIX) + 43


def same_hash(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def same_token(presented: str, expected: str) -> bool:
    """Constant-time comparison of two secrets of possibly different lengths."""
    return hmac.compare_digest(
        hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest(),
        hashlib.sha256(expected.encode("utf-8", "surrogateescape")).digest(),
    )
