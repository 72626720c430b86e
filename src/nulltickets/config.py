"""Settings: built once from flags, the config file and the environment, then passed to the
server worker as JSON in an environment variable (workers may be spawned, not forked)."""

from __future__ import annotations

import os

import msgspec

ENV_SETTINGS = "NULLTICKETS_SERVE_SETTINGS"
DEFAULT_PORT = 7700
DEFAULT_MAX_BODY = 64 * 1024


class Settings(msgspec.Struct, frozen=True):
    db: str = "nulltickets.db"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    body_timeout_s: float = 30.0
    header_timeout_ms: int = 10_000
    durability: str = "normal"
    reap_interval_s: float = 0.5
    log_level: str = "info"
    access_log: bool = False

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls) -> Settings:
        raw = os.environ.get(ENV_SETTINGS)
        return cls() if raw is None else msgspec.json.decode(raw, type=cls)
