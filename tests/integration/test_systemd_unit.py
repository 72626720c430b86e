"""deploy/systemd: the unit file passes `systemd-analyze verify` (alone and with its PostgreSQL
drop-in), keeps its hardening, and gives the server's bounded shutdown the time it takes.

systemd-analyze needs no running systemd: it loads the unit from a root made in a temporary
directory (this machine's unit library, the unit, an executable where ExecStart points).
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

from nulltickets.lifetime import STOP_SIGNALS
from nulltickets.server import launch

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "nulltickets.service"
POSTGRES_DROP_IN = SYSTEMD / "nulltickets.service.d" / "postgresql.conf"
ENV_EXAMPLE = SYSTEMD / "nulltickets.env"
UNIT_LIBRARIES = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))


def directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every line, in order; a key may repeat, as systemd allows."""
    found: list[tuple[str, str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.append((section, key.strip(), value.strip()))
    return found


def service(text: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for section, key, value in directives(text):
        if section == "Service":
            values.setdefault(key, []).append(value)
    return values


def exec_path(values: dict[str, list[str]]) -> str:
    return [v for v in values["ExecStart"] if v][-1].split()[0]


def unit_root(tmp_path: Path, unit: str, drop_in: str | None = None) -> Path:
    """A root holding this machine's unit library, the unit (and its drop-in), and an
    executable wherever ExecStart points."""
    library = next((p for p in UNIT_LIBRARIES if (p / "multi-user.target").exists()), None)
    assert library is not None, "no systemd unit library on this machine: install systemd"
    root = tmp_path / "root"
    shutil.copytree(library, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    units = root / "etc" / "systemd" / "system"
    units.mkdir(parents=True)
    (units / "nulltickets.service").write_text(unit)
    values = service(unit)
    if drop_in is not None:
        (units / "nulltickets.service.d").mkdir()
        (units / "nulltickets.service.d" / "postgresql.conf").write_text(drop_in)
        values = service(unit + "\n" + drop_in)
    program = root / exec_path(values).lstrip("/")
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    return root


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is missing: run `make test-tools`"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def verify(root: Path) -> subprocess.CompletedProcess[str]:
    return analyze("verify", f"--root={root}", "nulltickets.service")


def test_the_unit_verifies_clean(tmp_path: Path) -> None:
    done = verify(unit_root(tmp_path, UNIT.read_text()))
    # verify reports unknown keys and bad values on stderr and still exits 0: both must be clean.
    assert (done.returncode, done.stderr) == (0, "")


def test_the_unit_verifies_clean_with_its_postgresql_drop_in(tmp_path: Path) -> None:
    done = verify(unit_root(tmp_path, UNIT.read_text(), POSTGRES_DROP_IN.read_text()))
    assert (done.returncode, done.stderr) == (0, "")
    merged = service(UNIT.read_text() + "\n" + POSTGRES_DROP_IN.read_text())
    assert exec_path(merged) == "/opt/nulltickets/bin/nulltickets"


def test_a_mistake_in_the_unit_is_caught__unknown_key(tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict")
    done = verify(unit_root(tmp_path, broken))
    assert "Unknown key" in done.stderr


def test_a_mistake_in_the_unit_is_caught__missing_program(tmp_path: Path) -> None:
    root = unit_root(tmp_path, UNIT.read_text())
    (root / exec_path(service(UNIT.read_text())).lstrip("/")).unlink()
    assert verify(root).returncode != 0


def test_the_unit_is_hardened() -> None:
    values = {k: v[-1] for k, v in service(UNIT.read_text()).items()}
    expected = {
        "DynamicUser": "yes",
        "StateDirectory": "nulltickets",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes",
        "SystemCallArchitectures": "native",
        "Restart": "on-failure",
        "UMask": "0077",
    }
    assert {k: values.get(k) for k in expected} == expected
    assert "User" not in values  # a user of its own, never root


def test_systemd_rates_the_unit_ok(tmp_path: Path) -> None:
    # systemd's own exposure score, 0 (locked down) to 10 (unprotected); "OK" is below 2.0.
    root = unit_root(tmp_path, UNIT.read_text())
    done = analyze(
        "security", "--offline=yes", "--threshold=20", f"--root={root}", "nulltickets.service"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr


def load_build_binary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_binary", ROOT / "build" / "binary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stop_timeout_outlasts_the_servers_own_deadline_by_one_second() -> None:
    values = {k: v[-1] for k, v in service(UNIT.read_text()).items()}
    # The longest a stopping server takes: the binary's bootstrap kills its child this long
    # after the signal (the main process itself is gone by launch.MAIN_SHUTDOWN_DEADLINE_S).
    bootstrap_s = math.ceil(load_build_binary().ONEFILE_CHILD_GRACE_MS / 1000)
    assert bootstrap_s > launch.MAIN_SHUTDOWN_DEADLINE_S
    assert int(values["TimeoutStopSec"]) == bootstrap_s + 1
    # Only the main process gets the signal (it stops the rest in order), and one that the
    # server takes as a stop.
    assert values["KillMode"] == "mixed"
    assert values["KillSignal"] in {s.name for s in STOP_SIGNALS}
    assert values["SendSIGHUP"] == "no"


def test_the_token_is_never_in_the_unit() -> None:
    values = service(UNIT.read_text())
    assert values["EnvironmentFile"] == ["-/etc/nulltickets/nulltickets.env"]
    assert "--token" not in UNIT.read_text()
    assert not any("NULLTICKETS_TOKEN" in v for v in values["Environment"])
    # The example file names the token only as an empty, commented-out line.
    tokens = [line for line in ENV_EXAMPLE.read_text().splitlines() if "NULLTICKETS_TOKEN=" in line]
    assert tokens == ["#NULLTICKETS_TOKEN="]
