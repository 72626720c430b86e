"""The component manifest nullhub reads from `nulltickets --export-manifest` (contract §16.4)."""

from __future__ import annotations

from typing import Any

from nulltickets import __version__
from nulltickets.config import DEFAULT_DB, DEFAULT_PORT

# nullhub target triple -> (os, arch) of the release asset built for it.
TARGETS = {
    "aarch64-macos": ("macos", "aarch64"),
    "x86_64-macos": ("macos", "x86_64"),
    "x86_64-linux": ("linux", "x86_64"),
    "aarch64-linux": ("linux", "aarch64"),
    "riscv64-linux": ("linux", "riscv64"),
    "x86_64-windows": ("windows", "x86_64"),
    "aarch64-windows": ("windows", "aarch64"),
}


def asset_name(os_name: str, arch: str) -> str:
    suffix = "exe" if os_name == "windows" else "bin"
    return f"nulltickets-{os_name}-{arch}.{suffix}"


def _platform(os_name: str, arch: str) -> dict[str, str]:
    binary = "nulltickets.exe" if os_name == "windows" else "nulltickets"
    return {"asset": asset_name(os_name, arch), "binary": binary}


def _step(
    step_id: str, title: str, step_type: str, *, required: bool, **extra: str
) -> dict[str, Any]:
    return {
        "id": step_id,
        "title": title,
        "type": step_type,
        "required": required,
        "options": [],
        **extra,
    }


def manifest() -> dict[str, Any]:
    """The manifest as a JSON-ready dict.

    nullhub launches `<binary> <launch.command> <launch.args...>` and runs HTTP health checks
    only when the command is `serve` or `gateway`, so we export `serve` (the binary still
    accepts `nulltickets`, which installs made from the original manifest launch with)."""
    return {
        "schema_version": 1,
        "name": "nulltickets",
        "display_name": "NullTickets",
        "description": "Headless task and issue tracker for AI agents",
        "icon": "tickets",
        "repo": "nullclaw/nulltickets",
        "version": __version__,
        "platforms": {triple: _platform(*target) for triple, target in TARGETS.items()},
        "launch": {"command": "serve", "args": []},
        "health": {"endpoint": "/health", "port_from_config": "port"},
        "ports": [
            {"name": "api", "config_key": "port", "default": DEFAULT_PORT, "protocol": "http"}
        ],
        "wizard": {
            "steps": [
                _step("port", "API Port", "number", required=True, default_value=str(DEFAULT_PORT)),
                _step(
                    "api_token",
                    "API Token",
                    "secret",
                    required=False,
                    description="Bearer token required on API requests; "
                    "leave empty to disable authentication",
                ),
                _step(
                    "db_path",
                    "Database Path",
                    "text",
                    required=True,
                    description="SQLite file; a relative path is kept next to config.json",
                    default_value=DEFAULT_DB,
                ),
            ]
        },
        "depends_on": [],
        "connects_to": [],
    }
