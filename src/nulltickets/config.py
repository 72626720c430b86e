"""Settings: built once from flags, the config file and the environment, then passed to the
server worker as JSON in an environment variable (workers may be spawned, not forked).

Precedence is flags > config file > environment > defaults, for every setting (SETTINGS
lists each one's flag, config key and variable). The config file is `--config PATH` (which
must exist), else `<home>/config.json` with home = `$NULLTICKETS_HOME`, else
`$HOME/.nulltickets` (contract §16.2). A variable is read only when it decides, so a bad
value in a variable a flag overrides is not an error. This module also writes the config
file for nullhub's `--from-json` (§16.5)."""

from __future__ import annotations

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
CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 1024 * 1024
DEFAULT_PORT = 7700
DEFAULT_DB = "nulltickets.db"
DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_READ_TIMEOUT = 30.0
DURABILITIES = ("full", "normal")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# (setting, flag, config key, environment variable): the table the README shows.
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


def parse_seconds(value: str, source: str) -> float:
    try:
        seconds = float(value.strip())
    except ValueError:
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}")
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
    )


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
