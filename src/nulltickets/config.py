"""Settings: built once from flags, the config file and the environment, then passed to the
server worker as JSON in an environment variable (workers may be spawned, not forked).

Precedence is flags > config file > environment > defaults, for every setting (SETTINGS
lists each one's flag, config key and variable). The config file is `--config PATH` (which
must exist), else `<home>/config.json` with home = `$NULLTICKETS_HOME`, else
`$HOME/.nulltickets` (contract §16.2). A variable is read only when it decides, so a bad
value in a variable a flag overrides is not an error. This module also writes the config
file for nullhub's `--from-json` (§16.5)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

ENV_SETTINGS = "NULLTICKETS_SERVE_SETTINGS"
ENV_HOME = "NULLTICKETS_HOME"
ENV_PORT = "NULLTICKETS_PORT"
ENV_DB = "NULLTICKETS_DB"
ENV_HOST = "NULLTICKETS_HOST"
ENV_TOKEN = "NULLTICKETS_TOKEN"
ENV_MAX_BODY = "NULLTICKETS_MAX_BODY_BYTES"
ENV_DURABILITY = "NULLTICKETS_DURABILITY"
ENV_READ_TIMEOUT = "NULLTICKETS_READ_TIMEOUT"
ENV_ACCESS_LOG = "NULLTICKETS_ACCESS_LOG"
ENV_LOG_FORMAT = "NULLTICKETS_LOG_FORMAT"
ENV_LOG_LEVEL = "NULLTICKETS_LOG_LEVEL"
ENV_ALLOWED_ORIGINS = "NULLTICKETS_ALLOWED_ORIGINS"
ENV_ALLOWED_HOSTS = "NULLTICKETS_ALLOWED_HOSTS"
ENV_MAX_WAITERS = "NULLTICKETS_MAX_WAITERS"
ENV_MAX_STREAMS = "NULLTICKETS_MAX_STREAMS"
ENV_RETENTION = "NULLTICKETS_RETENTION"
ENV_PRUNE_INTERVAL = "NULLTICKETS_PRUNE_INTERVAL"
ENV_RETENTION_EXPORT = "NULLTICKETS_RETENTION_EXPORT"
CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 1024 * 1024
DEFAULT_PORT = 7700
DEFAULT_DB = "nulltickets.db"
DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_READ_TIMEOUT = 30.0
# Retention (service/retention.py): finished tasks and their history older than this are
# pruned; None keeps everything (`--retention off`).
DEFAULT_RETENTION_S = 30 * 86_400.0
DEFAULT_PRUNE_INTERVAL_S = 60.0
DURABILITIES = ("full", "normal")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# (setting, flag, config key, environment variable): the table docs/reference/settings.md shows
# (tests/e2e/test_readme.py checks every row is there).
SETTINGS = (
    ("db", "--db", "db", ENV_DB),
    ("host", "--host", "host", ENV_HOST),
    ("port", "--port", "port", ENV_PORT),
    ("token", "--token", "api_token", ENV_TOKEN),
    ("max_body_bytes", "--max-body-bytes", "max_body_bytes", ENV_MAX_BODY),
    ("durability", "--durability", "durability", ENV_DURABILITY),
    ("body_timeout_s", "--read-timeout", "read_timeout", ENV_READ_TIMEOUT),
    ("access_log", "--access-log", "access_log", ENV_ACCESS_LOG),
    ("log_format", "--log-format", "log_format", ENV_LOG_FORMAT),
    ("log_level", "--log-level", "log_level", ENV_LOG_LEVEL),
    ("allowed_origins", "--allowed-origins", "allowed_origins", ENV_ALLOWED_ORIGINS),
    ("allowed_hosts", "--allowed-hosts", "allowed_hosts", ENV_ALLOWED_HOSTS),
    ("max_waiters", "--max-waiters", "max_waiters", ENV_MAX_WAITERS),
    ("max_streams", "--max-streams", "max_streams", ENV_MAX_STREAMS),
    ("retention_s", "--retention", "retention", ENV_RETENTION),
    ("prune_interval_s", "--prune-interval", "prune_interval", ENV_PRUNE_INTERVAL),
    ("retention_export", "--retention-export", "retention_export", ENV_RETENTION_EXPORT),
)


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
    log_format: str = "text"
    access_log: bool = False
    # Origins whose pages count as this server's own (http/origins.py), normalized.
    allowed_origins: tuple[str, ...] = ()
    # Host names a server without a token answers to besides the loopback names.
    allowed_hosts: tuple[str, ...] = ()
    # Long-poll claims in progress and open event streams at most; None: set at start from
    # what the process can hold (server/launch.py, server/capacity.py), and no limit in a worker not
    # started that way.
    max_waiters: int | None = None
    max_streams: int | None = None
    # Finished tasks and their history older than this many seconds are pruned by a
    # background job every prune_interval_s; None: never.
    retention_s: float | None = DEFAULT_RETENTION_S
    prune_interval_s: float = DEFAULT_PRUNE_INTERVAL_S
    # A JSON-lines file every pruned row is appended to before it is deleted; None: none.
    retention_export: str | None = None

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
    access_log: bool | None = None
    log_format: str | None = None
    log_level: str | None = None
    allowed_origins: tuple[str, ...] | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_waiters: int | None = None
    max_streams: int | None = None
    retention_s: float | None = None  # 0: off (None stays "not given")
    prune_interval_s: float | None = None
    retention_export: str | None = None


class FileConfig(msgspec.Struct, frozen=True):
    """A config file as read; None means "not set". `db` is already resolved against the
    file's directory; `default_db` is where the database lives when neither the file nor the
    environment names one (`<dir>/nulltickets.db`). `FileConfig()` stands for "no config
    file". An `api_token` of "" is kept: it says "no auth" and wins over the environment."""

    path: str | None = None
    db: str | None = None
    default_db: str | None = None
    port: int | None = None
    api_token: str | None = None
    host: str | None = None
    durability: str | None = None
    max_body_bytes: int | None = None
    read_timeout_s: float | None = None
    access_log: bool | None = None
    log_format: str | None = None
    log_level: str | None = None
    allowed_origins: tuple[str, ...] | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_waiters: int | None = None
    max_streams: int | None = None
    retention_s: float | None = None  # 0: off
    prune_interval_s: float | None = None
    retention_export: str | None = None  # resolved against the file's directory


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
    `:memory:` and `file:` URIs are SQLite's to interpret, and a PostgreSQL URL is no path:
    they stay as written."""
    from nulltickets.storage.factory import is_postgres

    if db == ":memory:" or db.startswith("file:") or is_postgres(db):
        return db
    path = Path(db).expanduser()
    if not path.is_absolute():
        path = config_dir.absolute() / path
    return str(path)


# --- values ------------------------------------------------------------------------------------
# Each parser takes the raw value and the name of its source (a flag, a variable, a file key),
# and raises ConfigError naming that source.


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


def parse_size(value: str, source: str) -> int:
    """A whole number of bytes."""
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{source} must be a whole number of bytes, got {value!r}")
    return int(text)


def parse_count(value: str, source: str) -> int:
    """A whole number, 0 or more."""
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{source} must be a whole number, 0 or more, got {value!r}")
    return int(text)


def parse_seconds(value: str, source: str) -> float:
    try:
        seconds = float(value.strip())
    except ValueError:
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}")
    return seconds


_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h))+", re.ASCII)
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", re.ASCII)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DAYS = re.compile(r"([0-9]+(?:\.[0-9]+)?)d(.*)", re.ASCII)


def parse_duration(value: str, source: str) -> float:
    """Seconds from a duration: `30s`, `5m`, `1h`, `1h30m`, `250ms`, or a bare number of
    seconds."""
    text = value.strip().lower()
    if text.replace(".", "", 1).isdigit() and text.isascii():
        return float(text)
    if not _DURATION.fullmatch(text):
        raise ConfigError(f"{source} must be a duration like 30s, 5m or 1h, got {value!r}")
    return sum(float(n) * _DURATION_UNITS[unit] for n, unit in _DURATION_PART.findall(text))


def parse_age(value: str, source: str) -> float:
    """Seconds from an age: a duration, which may start with days (`30d`, `1d12h`)."""
    days = _DAYS.fullmatch(value.strip().lower())
    try:
        if days is None:
            return parse_duration(value, source)
        rest = parse_duration(days.group(2), source) if days.group(2) else 0.0
    except ConfigError:
        raise ConfigError(
            f"{source} must be a duration like 30d, 12h or 90m, got {value!r}"
        ) from None
    return float(days.group(1)) * 86_400.0 + rest


def parse_retention(value: str, source: str) -> float:
    """An age (`30d`, `12h`, `90m`), or `off` (also `none`, `0`) for no retention: 0.0."""
    if value.strip().lower() in ("off", "none", "never", "0"):
        return 0.0
    seconds = parse_age(value, source)
    if seconds <= 0:
        raise ConfigError(f"{source} must be a positive duration or off, got {value!r}")
    return seconds


def parse_interval(value: str, source: str) -> float:
    seconds = parse_duration(value, source)
    if seconds <= 0:
        raise ConfigError(f"{source} must be a positive duration, got {value!r}")
    return seconds


def parse_choice(value: str, choices: tuple[str, ...], source: str) -> str:
    text = value.strip().lower()
    if text not in choices:
        raise ConfigError(f"{source} must be one of {', '.join(choices)}, got {value!r}")
    return text


def parse_bool(value: str, source: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{source} must be one of 1, true, yes, on, 0, false, no, off, got {value!r}")


def parse_host(value: str, source: str) -> str:
    if not value.strip():
        raise ConfigError(f"{source} must not be empty")
    return value.strip()


def _items(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_origins(value: str, source: str) -> tuple[str, ...]:
    """A comma-separated list of origins (`https://tracker.example.com`, `http://host:8080`),
    each normalized as browsers send it: lowercase, no trailing slash, no default port."""
    found: list[str] = []
    for item in _items(value):
        text = item.lower().rstrip("/")
        scheme, sep, rest = text.partition("://")
        if scheme not in DEFAULT_PORTS or not sep or not rest or any(c in rest for c in "/?#@ "):
            raise ConfigError(
                f"{source} must list origins like https://tracker.example.com or "
                f"http://host:8080 (scheme, name, optional port), got {item!r}"
            )
        name, colon, port = rest.rpartition(":") if not rest.endswith("]") else (rest, "", "")
        if colon and not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
            raise ConfigError(f"{source}: {item!r} has a bad port")
        if colon and int(port) == DEFAULT_PORTS[scheme]:
            rest = name
        found.append(f"{scheme}://{rest}")
    return tuple(dict.fromkeys(found))


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")


def parse_hosts(value: str, source: str) -> tuple[str, ...]:
    """A comma-separated list of host names (or IP addresses) without ports, lowercase."""
    found: list[str] = []
    for item in _items(value):
        name = item.lower().rstrip(".")
        try:
            address = ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            if not name or not set(name) <= _HOST_CHARS:
                raise ConfigError(
                    f"{source} must list host names without a port (tracker.example.com, "
                    f"192.0.2.7), got {item!r}"
                ) from None
        else:
            name = f"[{address}]" if address.version == 6 else str(address)
        found.append(name)
    return tuple(dict.fromkeys(found))


def _config_list(
    doc: Mapping[str, Any], key: str, where: str, parse: Callable[[str, str], tuple[str, ...]]
) -> tuple[str, ...] | None:
    """A list of strings, or one comma-separated string."""
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return parse(value, f"{where}: {key!r}")
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return parse(",".join(value), f"{where}: {key!r}")
    raise ConfigError(f"{where}: {key!r} must be a list of strings, got {value!r}")


def parse_db(value: str, source: str) -> str:
    if not value:
        raise ConfigError(f"{source} must not be empty")
    return value


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
    durability = _config_choice(doc, "durability", DURABILITIES, where)
    max_body = None
    if doc.get("max_body_bytes") is not None:
        max_body = _config_int(doc, "max_body_bytes", where)
    read_timeout = None
    if doc.get("read_timeout") is not None:
        value = doc["read_timeout"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: 'read_timeout' must be a number, got {value!r}")
        read_timeout = float(value)
    access_log = doc.get("access_log")
    if access_log is not None and not isinstance(access_log, bool):
        raise ConfigError(f"{where}: 'access_log' must be true or false, got {access_log!r}")
    counts = {}
    for key in ("max_waiters", "max_streams"):
        if doc.get(key) is not None:
            counts[key] = _config_int(doc, key, where)
            if counts[key] < 0:
                raise ConfigError(f"{where}: {key!r} must be 0 or more, got {counts[key]}")
    durations: dict[str, float] = {}
    for key, parse in (("retention", parse_retention), ("prune_interval", parse_interval)):
        value = doc.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f'{where}: {key!r} must be a duration like "30d", got {value!r}')
        durations[key] = parse(str(value), f"{where}: {key!r}")
    return FileConfig(
        path=where,
        db=None if db is None else resolve_db(db, path.parent),
        default_db=resolve_db(DEFAULT_DB, path.parent),
        port=port,
        api_token=_string(doc, "api_token", where),
        host=host,
        durability=durability,
        max_body_bytes=max_body,
        read_timeout_s=read_timeout,
        access_log=access_log,
        log_format=_config_choice(doc, "log_format", LOG_FORMATS, where),
        log_level=_config_choice(doc, "log_level", LOG_LEVELS, where),
        allowed_origins=_config_list(doc, "allowed_origins", where, parse_origins),
        allowed_hosts=_config_list(doc, "allowed_hosts", where, parse_hosts),
        max_waiters=counts.get("max_waiters"),
        max_streams=counts.get("max_streams"),
        retention_s=durations.get("retention"),
        prune_interval_s=durations.get("prune_interval"),
        retention_export=_export_path(_string(doc, "retention_export", where), path.parent, where),
    )


def _export_path(value: str | None, config_dir: Path, where: str) -> str | None:
    """A relative export file in a config file lives next to that file, as `db` does."""
    if value is None:
        return None
    if not value.strip():
        raise ConfigError(f"{where}: 'retention_export' must not be empty")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else config_dir.absolute() / path)


def _config_int(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key!r} must be an integer, got {value!r}")
    return value


def _config_choice(
    doc: Mapping[str, Any], key: str, choices: tuple[str, ...], where: str
) -> str | None:
    value = _string(doc, key, where)
    if value is not None and value not in choices:
        options = " or ".join(repr(c) for c in choices)
        raise ConfigError(f"{where}: {key!r} must be {options}, got {value!r}")
    return value


def env_port(env: Mapping[str, str] | None = None) -> int | None:
    """`NULLTICKETS_PORT` (set by the container image), or None when unset or empty."""
    env = os.environ if env is None else env
    raw = env.get(ENV_PORT, "").strip()
    return parse_port(raw, ENV_PORT) if raw else None


def _env(env: Mapping[str, str], name: str, parse: Callable[[str, str], T]) -> T | None:
    """The variable parsed, or None when it is unset or empty."""
    raw = env.get(name, "")
    return parse(raw, name) if raw.strip() else None


def _decide(flag: T | None, file: T | None, read_env: Callable[[], T | None], default: T) -> T:
    """flag > file > environment > default; the environment is read only when it decides."""
    if flag is not None:
        return flag
    if file is not None:
        return file
    from_env = read_env()
    return default if from_env is None else from_env


def load_config(explicit: str | None, env: Mapping[str, str]) -> FileConfig:
    """The config file that applies (FileConfig() for none); `--config PATH` must exist."""
    path = config_path(explicit, env)
    read = read_config(path) if path is not None else None
    if read is None and explicit is not None:
        raise ConfigError(f"config file {explicit} does not exist")
    return read or FileConfig()


def _database(flag: str | None, file: FileConfig, env: Mapping[str, str]) -> str:
    return _decide(
        flag, file.db, lambda: _env(env, ENV_DB, parse_db), file.default_db or DEFAULT_DB
    )


def database_path(
    config: str | None = None, db: str | None = None, env: Mapping[str, str] | None = None
) -> str:
    """The database the server would open, decided as `build_settings` decides it (for the
    commands that open the file themselves: backup, doctor)."""
    env = os.environ if env is None else env
    return _database(db, load_config(config, env), env)


def source_of(setting: str, flags: Flags, env: Mapping[str, str] | None = None) -> str:
    """Where `setting` came from, for a message: its flag, the config file's key, its
    environment variable, or "the default"."""
    env = os.environ if env is None else env
    _name, flag, key, var = next(row for row in SETTINGS if row[0] == setting)
    if getattr(flags, FLAG_FIELDS.get(setting, setting)) is not None:
        return flag
    file = load_config(flags.config, env)
    if getattr(file, FILE_FIELDS.get(setting, setting)) is not None:
        return f"{key!r} in {file.path}"
    return var if env.get(var, "").strip() else "the default"


FLAG_FIELDS = {"body_timeout_s": "read_timeout_s"}
FILE_FIELDS = {"body_timeout_s": "read_timeout_s", "token": "api_token"}


def build_settings(flags: Flags, env: Mapping[str, str] | None = None) -> Settings:
    """Flags > config file > environment > defaults. Without a config file and without
    `--db` or `NULLTICKETS_DB`, the database is `nulltickets.db` in the working directory;
    with a config file that names none, it lives next to the file. `--config PATH` naming a
    missing file is an error (the default location may be absent)."""
    env = os.environ if env is None else env
    file = load_config(flags.config, env)
    base = Settings()

    def var(name: str, parse: Callable[[str, str], T]) -> Callable[[], T | None]:
        return lambda: _env(env, name, parse)

    # An explicit `--token ""` (or `"api_token": ""`) wins over lower sources and switches
    # auth off.
    token = _decide(flags.token, file.api_token, var(ENV_TOKEN, lambda v, _s: v), "")
    return Settings(
        db=_database(flags.db, file, env),
        host=_decide(flags.host, file.host, var(ENV_HOST, parse_host), base.host),
        port=_decide(flags.port, file.port, var(ENV_PORT, parse_port), base.port),
        token=token or None,
        max_body_bytes=_decide(
            flags.max_body_bytes,
            file.max_body_bytes,
            var(ENV_MAX_BODY, parse_size),
            base.max_body_bytes,
        ),
        durability=_decide(
            flags.durability,
            file.durability,
            var(ENV_DURABILITY, lambda v, s: parse_choice(v, DURABILITIES, s)),
            base.durability,
        ),
        body_timeout_s=_decide(
            flags.read_timeout_s,
            file.read_timeout_s,
            var(ENV_READ_TIMEOUT, parse_seconds),
            base.body_timeout_s,
        ),
        access_log=_decide(
            flags.access_log, file.access_log, var(ENV_ACCESS_LOG, parse_bool), base.access_log
        ),
        log_format=_decide(
            flags.log_format,
            file.log_format,
            var(ENV_LOG_FORMAT, lambda v, s: parse_choice(v, LOG_FORMATS, s)),
            base.log_format,
        ),
        log_level=_decide(
            flags.log_level,
            file.log_level,
            var(ENV_LOG_LEVEL, lambda v, s: parse_choice(v, LOG_LEVELS, s)),
            base.log_level,
        ),
        allowed_origins=_decide(
            flags.allowed_origins,
            file.allowed_origins,
            var(ENV_ALLOWED_ORIGINS, parse_origins),
            base.allowed_origins,
        ),
        allowed_hosts=_decide(
            flags.allowed_hosts,
            file.allowed_hosts,
            var(ENV_ALLOWED_HOSTS, parse_hosts),
            base.allowed_hosts,
        ),
        max_waiters=_decide(
            flags.max_waiters,
            file.max_waiters,
            var(ENV_MAX_WAITERS, parse_count),
            base.max_waiters,
        ),
        max_streams=_decide(
            flags.max_streams,
            file.max_streams,
            var(ENV_MAX_STREAMS, parse_count),
            base.max_streams,
        ),
        retention_s=_decide(
            flags.retention_s,
            file.retention_s,
            var(ENV_RETENTION, parse_retention),
            DEFAULT_RETENTION_S,
        )
        or None,
        prune_interval_s=_decide(
            flags.prune_interval_s,
            file.prune_interval_s,
            var(ENV_PRUNE_INTERVAL, parse_interval),
            base.prune_interval_s,
        ),
        retention_export=_decide(
            flags.retention_export,
            file.retention_export,
            var(ENV_RETENTION_EXPORT, parse_db),
            base.retention_export,
        ),
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
