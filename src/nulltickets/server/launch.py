"""Starting the server: check the settings, check and migrate the database, run granian."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
from types import FrameType

import msgspec

from nulltickets import __version__, core, logs
from nulltickets.config import ENV_SETTINGS, ConfigError, Settings
from nulltickets.lifetime import STOP_SIGNALS, exit_after, relay_signals
from nulltickets.server import capacity

# granian's access line without its own local-time stamp: every record carries ours.
ACCESS_LOG_FORMAT = '%(addr)s "%(method)s %(path)s %(protocol)s" %(status)d %(dt_ms).3f ms'
# The shortest admin token a server reachable from other machines accepts.
MIN_TOKEN_LENGTH = 16
# Seconds granian's main process waits for its worker to stop before it kills it.
WORKER_KILL_TIMEOUT_S = 3
# The listening socket's queue of connections not yet accepted (the kernel caps it at
# net.core.somaxconn): room for a fleet of agents connecting at once.
LISTEN_BACKLOG = 4096
# Seconds after a stop signal by which granian's main process is gone, whatever it is waiting
# on: the worker's stop (above), then a margin. The binary's onefile bootstrap gives its child
# one second more than this (build/binary.py).
MAIN_SHUTDOWN_DEADLINE_S = WORKER_KILL_TIMEOUT_S + 2


def version_line() -> str:
    return f"nulltickets v{__version__} (core: {core.IMPLEMENTATION})"


def bind_address(host: str) -> str:
    """The IP address to listen on: the server binds addresses, so a name is resolved first."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve --host {host!r}: {exc}") from None
    # Prefer IPv4 (what "localhost" means to most clients), else the first address.
    addresses = [str(info[4][0]) for info in infos]
    v4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    return (v4 or addresses)[0]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(settings: Settings) -> None:
    if not 0 <= settings.port <= 65535:
        raise ConfigError(f"port must be 0..65535, got {settings.port}")
    if not 0 < settings.body_timeout_s <= 3600:
        raise ConfigError("--read-timeout must be between 0 and 3600 seconds")
    if settings.max_body_bytes < 1024:
        raise ConfigError("max body size (--max-body-bytes) must be at least 1024")
    if not is_loopback(bind_address(settings.host)):
        if not settings.token:
            raise ConfigError(
                f"refusing to listen on {settings.host} without a token; "
                "pass --token (or set api_token in the config) or bind 127.0.0.1"
            )
        if len(settings.token) < MIN_TOKEN_LENGTH:
            raise ConfigError(
                f"refusing to listen on {settings.host} with a --token shorter than "
                f"{MIN_TOKEN_LENGTH} characters (one that others can guess); use a longer one, "
                "e.g. from `openssl rand -hex 16`, or bind 127.0.0.1"
            )
    check_port(settings.host, settings.port)


def check_port(host: str, port: int) -> None:
    """Refuse a port something already listens on. granian listens with SO_REUSEPORT, so a
    second server would otherwise share the port with the first (and its own database), and
    a foreign listener would only show up as a traceback after "listening on"."""
    if port == 0:
        return
    address = bind_address(host)
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if sys.platform != "win32":  # elsewhere SO_REUSEADDR would let the bind steal the port
            # Only lets the bind pass sockets in TIME_WAIT, never a listener.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(is another server running there? stop it or pass --port)"
            ) from None


def preflight(settings: Settings) -> None:
    """Open, check and migrate the database before serving, so that a bad path, a read-only
    file, an old SQLite, an unreachable server or a missing driver is a clear start-up error;
    nothing stays open when the worker starts (connections must not cross a fork)."""
    from nulltickets.storage.factory import check_database

    check_database(settings.db, durability=settings.durability)
    if settings.retention_export is not None and settings.retention_s is not None:
        from nulltickets.service.retention import Export

        try:  # created (owner-only) now: a file that cannot be written is a start-up error
            Export(settings.retention_export).close()
        except OSError as exc:
            raise ConfigError(
                f"cannot write --retention-export {settings.retention_export}: "
                f"{exc.strerror or exc}"
            ) from None


def worker_settings(settings: Settings) -> tuple[Settings, capacity.Capacity]:
    """The settings the worker serves with: waiting claims and event streams hold connections,
    not request slots, so their limits come from the files and memory this process has."""
    room = capacity.plan(
        capacity.raise_file_limit(),
        capacity.available_memory(),
        settings.max_waiters,
        settings.max_streams,
    )
    settings = msgspec.structs.replace(
        settings, max_waiters=room.max_waiters, max_streams=room.max_streams
    )
    return settings, room


def age(seconds: float) -> str:
    """30d, 12h, 90m or 45s: the largest unit that divides the age."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def retention_line(settings: Settings) -> str:
    """What the start says of retention: deleting history is never a surprise."""
    if not settings.retention_s:
        return "retention off: finished tasks and their history are kept"
    export = f", exported to {settings.retention_export} first" if settings.retention_export else ""
    return (
        f"retention {age(settings.retention_s)}: finished tasks older than that are deleted "
        f"with their history{export} (--retention off keeps them)"
    )


def serve(settings: Settings) -> None:
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.http import HTTP1Settings
    from granian.log import LogLevels
    from granian.server import Server

    from nulltickets.http.app import load_app
    from nulltickets.storage.factory import display_name, engine_description

    # granian may keep as many connections open as the process has files for, and the limits
    # on waiting are ours.
    settings, room = worker_settings(settings)
    os.environ[ENV_SETTINGS] = settings.to_env()
    auth = "enabled" if settings.token else "disabled"
    log = logging.getLogger("nulltickets")
    log.info(
        "%s: db %s, auth %s, listening on http://%s:%s, %s",
        version_line(),
        display_name(settings.db),
        auth,
        settings.host,
        settings.port,
        engine_description(settings.db),
    )
    log.info("%s", room.describe())
    log.info("%s", retention_line(settings))
    for name in room.capped:
        log.warning(
            "%s is more than this process can hold with %d open files: lowered to %d",
            name,
            room.files,
            getattr(room, name),
        )
    server = Server(
        "nulltickets.http.app:load_app",
        address=bind_address(settings.host),
        port=settings.port,
        interface=Interfaces.RSGI,
        workers=1,
        loop=Loops.auto,  # uvloop (winloop on Windows) when installed, else asyncio
        http=HTTPModes.http1,
        websockets=False,
        backlog=LISTEN_BACKLOG,
        backpressure=room.connections,
        http1_settings=HTTP1Settings(header_read_timeout=settings.header_timeout_ms),
        log_enabled=True,
        # Our format for granian's loggers too, here and in its worker (logs.py).
        log_level=LogLevels(settings.log_level),
        log_dictconfig=logs.dictconfig(settings.log_format, settings.log_level),
        log_access=settings.access_log,
        log_access_format=ACCESS_LOG_FORMAT,
        # On SIGTERM the worker answers waiting long-polls and finishes what is in flight
        # (http/app.py); one that is stuck beyond this is killed, so a supervisor never waits
        # on us for long.
        workers_kill_timeout=WORKER_KILL_TIMEOUT_S,
    )
    server.on_startup(take_stop_signals)
    # granian annotates the loader as returning a callable; an RSGI app object is what it wants.
    server.serve(target_loader=load_app)  # type: ignore[arg-type]


def take_stop_signals() -> None:
    """In granian's main process, once granian has set its signal handlers (a startup hook):
    SIGHUP stops the server like SIGTERM, where granian would respawn the worker and serve on,
    and every stop signal also arms a deadline, so the process is gone in
    MAIN_SHUTDOWN_DEADLINE_S even if its own shutdown hangs. granian's main thread waits
    without a timeout, so a signal the kernel gives to another thread is relayed at once."""
    stop = signal.getsignal(signal.SIGTERM)
    if not callable(stop):  # not granian's handler: leave the signals as they are
        return

    def stop_within_deadline(signum: int, frame: FrameType | None) -> None:
        exit_after(MAIN_SHUTDOWN_DEADLINE_S)
        stop(signum, frame)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_within_deadline)
    relay_signals(stop_within_deadline)
