"""Settings: built once from flags, the config file and the environment, then passed to the
server worker as JSON in an environment variable (workers may be spawned, not forked).

Precedence is flags > config file > environment (`NULLTICKETS_PORT` only) > defaults. The
config file is `--config PATH`, else `<home>/config.json` with home = `$NULLTICKETS_HOME`,
else `$HOME/.nulltickets` (contract §16.2). This module also writes that file for nullhub's
`--from-json` (§16.5)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

ENV_SETTINGS = "NULLTICKETS_SERVE_SETTINGS"
ENV_HOME = "NULLTICKETS_HOME"
ENV_PORT = "NULLTICKETS_PORT"
CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 1024 * 1024
DEFAULT_PORT = 7700
DEFAULT_DB = "nulltickets.db"
DEFAULT_MAX_BODY = 64 * 1024
DURABILITIES = ("full", "normal")


class ConfigError(Exception):
    """A configuration the server cannot start with; the message says what and where."""


class Settings(msgspec.Struct, frozen=True):
    db: str = DEFAULT_DB
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    body_timeout_s: float = 30.0
    header_timeout_ms: int = 10_000
    durability: str = "full"  # group commit makes fsync-per-commit nearly free (make bench)
    reap_interval_s: float = 0.5
    log_level: str = "info"
    access_log: bool = False

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls) -> Settings:
        raw = os.environ.get(ENV_SETTINGS)
        return cls() if raw is None else msgspec.json.decode(raw, type=cls)


class Flags(msgspec.Struct, frozen=True):
    """What the command line said; None means "not given", so a lower source decides."""

    config: str | None = None
    db: str | None = None
    host: str | None = None
    port: int | None = None
    token: str | None = None
    max_body_bytes: int | None = None
    durability: str | None = None
    read_timeout_s: float | None = None
    access_log: bool = False


class FileConfig(msgspec.Struct, frozen=True):
    """A config file as read; None means "not set". `db` is already resolved against the
    file's directory, and a file that exists always yields one (`<dir>/nulltickets.db` by
    default). `FileConfig()` stands for "no config file"."""

    path: str | None = None
    db: str | None = None
    port: int | None = None
    api_token: str | None = None
    host: str | None = None
    durability: str | None = None
    max_body_bytes: int | None = None


# --- locating ----------------------------------------------------------------------------------


def home_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """`$NULLTICKETS_HOME`, else `$HOME/.nulltickets` (`%USERPROFILE%` when HOME is unset, as
    on Windows); None when none of them is set."""
    env = os.environ if env is None else env
    if env.get(ENV_HOME):
        return Path(env[ENV_HOME])
    user_home = env.get("HOME") or env.get("USERPROFILE")
    return Path(user_home) / ".nulltickets" if user_home else None


def config_path(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    if explicit is not None:
        return Path(explicit)
    home = home_dir(env)
    return None if home is None else home / CONFIG_NAME


def resolve_db(db: str, config_dir: Path) -> str:
    """A relative db in a config file lives next to that file, whatever the working directory.
    `:memory:` and `file:` URIs are SQLite's to interpret and stay as written."""
    if db == ":memory:" or db.startswith("file:"):
        return db
    path = Path(db).expanduser()
    if not path.is_absolute():
        path = config_dir.absolute() / path
    return str(path)


# --- values ------------------------------------------------------------------------------------


def parse_port(value: object, source: str) -> int:
    """An integer 0..65535, or a string of digits in that range (JSON integral floats too)."""
    port: int | None = None
    if isinstance(value, bool):
        port = None
    elif isinstance(value, int):
        port = value
    elif isinstance(value, float) and value.is_integer():
        port = int(value)
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        port = int(value.strip())
    if port is None or not 0 <= port <= 65535:
        raise ConfigError(f"{source} must be a port number 0..65535, got {value!r}")
    return port


def _string(doc: Mapping[str, Any], key: str, where: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key!r} must be a string, got {value!r}")
    return value


# --- reading -----------------------------------------------------------------------------------


def read_config(path: Path) -> FileConfig | None:
    """The config file at `path`, or None when there is no such file. Unknown keys are ignored;
    anything else wrong raises ConfigError."""
    where = str(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {where}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {where} is larger than 1 MiB")
    try:
        doc = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"config file {where} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {where} must hold a JSON object")

    port = None if doc.get("port") is None else _config_int(doc, "port", where)
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"{where}: 'port' must be 0..65535, got {port}")
    db = _string(doc, "db", where)
    if db == "":
        raise ConfigError(f"{where}: 'db' must not be empty")
    host = _string(doc, "host", where)
    if host == "":
        raise ConfigError(f"{where}: 'host' must not be empty")
    durability = _string(doc, "durability", where)
    if durability is not None and durability not in DURABILITIES:
        raise ConfigError(f"{where}: 'durability' must be 'full' or 'normal', got {durability!r}")
    max_body = None
    if doc.get("max_body_bytes") is not None:
        max_body = _config_int(doc, "max_body_bytes", where)
    return FileConfig(
        path=where,
        db=resolve_db(db or DEFAULT_DB, path.parent),
        port=port,
        # An empty token means "no auth", like a missing one (the nullhub wizard leaves the
        # optional secret step empty).
        api_token=_string(doc, "api_token", where) or None,
        host=host,
        durability=durability,
        max_body_bytes=max_body,
    )


def _config_int(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key!r} must be an integer, got {value!r}")
    return value


def env_port(env: Mapping[str, str] | None = None) -> int | None:
    """`NULLTICKETS_PORT` (set by the container image), or None when unset or empty."""
    env = os.environ if env is None else env
    raw = env.get(ENV_PORT, "").strip()
    return parse_port(raw, ENV_PORT) if raw else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def build_settings(flags: Flags, env: Mapping[str, str] | None = None) -> Settings:
    """Flags > config file > environment > defaults. Without a config file and without
    `--db`, the database is `nulltickets.db` in the working directory."""
    env = os.environ if env is None else env
    path = config_path(flags.config, env)
    file = (read_config(path) if path is not None else None) or FileConfig()
    base = Settings()
    # An explicit `--token ""` wins over the file's token and switches auth off.
    token = flags.token if flags.token is not None else file.api_token
    port = _first(flags.port, file.port)
    if port is None:  # the environment is read only when it decides
        port = _first(env_port(env), base.port)
    return Settings(
        db=_first(flags.db, file.db, base.db),
        host=_first(flags.host, file.host, base.host),
        port=port,
        token=token or None,
        max_body_bytes=_first(flags.max_body_bytes, file.max_body_bytes, base.max_body_bytes),
        durability=_first(flags.durability, file.durability, base.durability),
        body_timeout_s=_first(flags.read_timeout_s, base.body_timeout_s),
        access_log=flags.access_log,
    )


# --- writing (nullhub's --from-json) ----------------------------------------------------------

# nullhub injects `"home"` by splicing `{"home":"...",` in front of the wizard's object, which
# leaves a dangling comma when the answers were `{}`.
_TRAILING_COMMA = re.compile(r",\s*}\s*$")


def _decode_answers(raw: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        try:
            doc = json.loads(_TRAILING_COMMA.sub("}", raw))
        except ValueError:
            raise ConfigError("invalid JSON") from None
    if not isinstance(doc, dict):
        raise ConfigError("invalid JSON: expected an object")
    return doc


def wizard_config(answers: Mapping[str, Any]) -> dict[str, Any]:
    """The config file contents for the wizard's answers: `port`, `db` and `api_token` when
    one was given. Values may come as strings or numbers; unknown keys are ignored."""
    port = (
        DEFAULT_PORT if answers.get("port") in (None, "") else parse_port(answers["port"], "port")
    )
    db = answers.get("db_path")
    if db is None or db == "":
        db = DEFAULT_DB
    elif not isinstance(db, str):
        raise ConfigError(f"db_path must be a string, got {db!r}")
    doc: dict[str, Any] = {"port": port, "db": db}
    token = answers.get("api_token")
    if isinstance(token, int) and not isinstance(token, bool):
        token = str(token)  # a numeric secret typed into the wizard
    if isinstance(token, str):
        doc["api_token"] = token
    elif token is not None:
        raise ConfigError(f"api_token must be a string, got {token!r}")
    return doc


def write_wizard_config(raw: str, env: Mapping[str, str] | None = None) -> Path:
    """Write `<home>/config.json` from the wizard JSON; `home` in the JSON wins over the
    environment. Returns the path written."""
    answers = _decode_answers(raw)
    doc = wizard_config(answers)
    home_value = answers.get("home")
    if home_value is not None and not isinstance(home_value, str):
        raise ConfigError(f"home must be a string, got {home_value!r}")
    home = Path(home_value) if home_value else home_dir(env)
    if home is None:
        raise ConfigError(f'no home directory: pass "home" or set {ENV_HOME} or HOME')
    path = home / CONFIG_NAME
    text = json.dumps(doc, indent=2) + "\n"
    try:
        home.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename, so a crash never leaves half a config; mkstemp
        # makes the file 0600, right for a file that may hold the API token.
        fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=home)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path
