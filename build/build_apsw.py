"""Build apsw from its sdist against the vendored SQLite, and install it into this interpreter.

    python build/build_apsw.py           check vendor/sqlite, get the sdist, build, install, verify
    python build/build_apsw.py --verify  only verify the apsw this interpreter imports

Every release job runs this before installing the package (build/release.sh), so every binary
carries the same SQLite: vendor/sqlite/sqlite3.c (checked against vendor/sqlite/SHA256SUMS)
compiled with build/sqlite-options.txt, nothing else.

Nothing is downloaded but the apsw sdist itself, from the package index (PIP_INDEX_URL, else
PyPI), checked against APSW_SDIST_SHA256. (`pip download --no-binary :all: apsw` cannot be used:
preparing the sdist's metadata already runs its setup.py, whose setup.apsw says `fetch = True`,
and that downloads SQLite from its web site.) The sdist's setup.apsw is replaced by one without
`fetch`, the amalgamation goes into its `sqlite3/` directory, and the build runs with
`--no-index --no-build-isolation` and every proxy variable pointing at a closed port, so a
download attempted by pip or by setup.py fails the build instead of happening; its log must show
apsw using our amalgamation. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "sqlite"
OPTIONS_FILE = ROOT / "build" / "sqlite-options.txt"
WORK = ROOT / "dist" / "apsw-build"
CACHE = Path(os.environ.get("NULLTICKETS_BUILD_CACHE", str(ROOT / "dist" / "cache")))

APSW_VERSION = "3.51.3.0"  # constraints.txt pins the same; test_vendored_sqlite checks both
APSW_SDIST = f"apsw-{APSW_VERSION}.tar.gz"
APSW_SDIST_SHA256 = "821966a66ed5fd539e863a8f60d9a53497e0a47ffdabde4ec7714fae9ed00261"
AMALGAMATION = ("sqlite3.c", "sqlite3.h", "sqlite3ext.h")
# A closed port: any HTTP(S) request made through urllib, pip or requests fails at once.
NO_NETWORK_PROXY = "http://127.0.0.1:9"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY")  # fmt: skip


class BuildError(Exception):
    pass


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recorded_sums() -> dict[str, str]:
    """vendor/sqlite/SHA256SUMS as {file name: sha256}."""
    sums = {}
    for line in (VENDOR / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


def check_vendored() -> None:
    """Every amalgamation file is there and has the recorded SHA-256."""
    sums = recorded_sums()
    for name in AMALGAMATION:
        if name not in sums:
            raise BuildError(f"vendor/sqlite/SHA256SUMS records no checksum for {name}")
        actual = sha256(VENDOR / name)
        if actual != sums[name]:
            raise BuildError(
                f"vendor/sqlite/{name} has SHA-256 {actual}, SHA256SUMS records {sums[name]}"
            )


def header_define(name: str) -> str:
    """A string #define of vendor/sqlite/sqlite3.h (SQLITE_VERSION, SQLITE_SOURCE_ID)."""
    text = (VENDOR / "sqlite3.h").read_text(encoding="utf-8")
    m = re.search(rf'^#define {name}\s+"([^"]+)"', text, re.M)
    if not m:
        raise BuildError(f"no {name} in vendor/sqlite/sqlite3.h")
    return m.group(1)


def read_options() -> list[tuple[str, bool]]:
    """build/sqlite-options.txt in file order: (define, passed) where passed is False for the
    ones marked `@apsw` (apsw's own source defines them)."""
    options = []
    for line in OPTIONS_FILE.read_text(encoding="utf-8").splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        option, marks = fields[0], fields[1:]
        if not re.fullmatch(r"SQLITE_[A-Z0-9_]+(=[A-Za-z0-9_-]+)?", option) or marks not in (
            [],
            ["@apsw"],
        ):
            raise BuildError(f"build/sqlite-options.txt: not a define: {line.strip()!r}")
        options.append((option, not marks))
    return options


def compile_options() -> list[str]:
    """The defines the build passes to the compiler, e.g. ["SQLITE_DQS=0", ...]."""
    return [option for option, passed in read_options() if passed]


def expected_reported_options() -> set[str]:
    """Every option of the file as apsw.compile_options reports it (no SQLITE_ prefix; a flag
    without a value reports as its name alone)."""
    return {option.removeprefix("SQLITE_") for option, _ in read_options()}


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def download_sdist(dest: Path) -> None:
    """The apsw sdist from the package index's simple API (PEP 691), checked by SHA-256."""
    project = f"{index_url()}/apsw/"
    request = urllib.request.Request(
        project, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    entry = next((f for f in files if f["filename"] == APSW_SDIST), None)
    if entry is None:
        raise BuildError(f"{APSW_SDIST} is not on {project}")
    if entry["hashes"].get("sha256") != APSW_SDIST_SHA256:
        raise BuildError(f"{project} lists {APSW_SDIST} with {entry['hashes']}, not ours")
    url = urllib.parse.urljoin(project, entry["url"])
    print(f"apsw: downloading {APSW_SDIST} from the package index", flush=True)
    with urllib.request.urlopen(url, timeout=300) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != APSW_SDIST_SHA256:
        raise BuildError(f"{url} does not have SHA-256 {APSW_SDIST_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(dest)


def sdist(path: Path | None) -> Path:
    """The sdist: PATH when given, else the cached copy, else downloaded into the cache."""
    target = path or CACHE / APSW_SDIST
    if path is None and not (target.exists() and sha256(target) == APSW_SDIST_SHA256):
        download_sdist(target)
    if sha256(target) != APSW_SDIST_SHA256:
        raise BuildError(f"{target} does not have SHA-256 {APSW_SDIST_SHA256}")
    return target


def setup_apsw() -> str:
    """Our setup.apsw for the sdist: no fetch, our amalgamation, our defines."""
    return (
        "# Written by nulltickets' build/build_apsw.py: SQLite is vendor/sqlite, never fetched.\n"
        "[build]\n"
        "fetch = False\n"
        "enable_all_extensions = False\n"
        "\n"
        "[build_ext]\n"
        f"definevalues = {','.join(compile_options())}\n"
    )


def prepare(tarball: Path) -> Path:
    """The unpacked sdist with vendor/sqlite in sqlite3/ and our setup.apsw."""
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(WORK, filter="data")
        else:  # Python 3.11 before 3.11.4
            for member in tar.getmembers():
                if member.name.startswith(("/", "..")) or ".." in Path(member.name).parts:
                    raise BuildError(f"{tarball}: unsafe member {member.name}")
            tar.extractall(WORK)
    tree = WORK / f"apsw-{APSW_VERSION}"
    (tree / "setup.apsw").write_text(setup_apsw(), encoding="utf-8")
    (tree / "sqlite3").mkdir(exist_ok=True)
    for name in AMALGAMATION:
        shutil.copy2(VENDOR / name, tree / "sqlite3" / name)
    return tree


def offline_env() -> dict[str, str]:
    """The build's environment: pip and setup.py can reach nothing."""
    env = dict(os.environ)
    for var in PROXY_VARIABLES:
        env[var] = NO_NETWORK_PROXY
    for var in ("no_proxy", "NO_PROXY"):
        env.pop(var, None)
    env["PIP_NO_INDEX"] = "1"
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return env


def build(tree: Path) -> None:
    # setuptools and wheel come from the index before the network is cut off.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "setuptools>=77", "wheel"], check=True
    )
    cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-index", "--no-build-isolation"]
    cmd += ["--no-deps", "--no-cache-dir", "--force-reinstall", str(tree)]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=offline_env(), capture_output=True, text=True)
    log = WORK / "build.log"
    log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-6000:])
        raise BuildError(f"the apsw build failed (exit {proc.returncode}); log in {log}")
    check_build_log(proc.stdout + proc.stderr, tree)
    print(f"apsw: built from {APSW_SDIST} against vendor/sqlite (log in {log})", flush=True)


def check_build_log(text: str, tree: Path) -> None:
    """apsw's setup.py says which SQLite it uses; it must be ours, and nothing fetched."""
    ours = str(tree / "sqlite3" / "sqlite3.c")
    used = re.findall(r"SQLite: Using amalgamation (\S+)", text)
    if not used or any(os.path.normcase(u) != os.path.normcase(ours) for u in used):
        raise BuildError(f"apsw's build did not use {ours}: {used or 'no amalgamation line'}")
    if "Fetching" in text or "Getting the SQLite" in text:
        raise BuildError("apsw's build tried to fetch SQLite")


def verify(python: str = sys.executable) -> dict[str, object]:
    """The apsw `python` imports is built from vendor/sqlite with exactly our options."""
    probe = (
        "import apsw, json; print(json.dumps({'apsw': apsw.apsw_version(), "
        "'sqlite': apsw.sqlite_lib_version(), 'source_id': apsw.sqlite3_sourceid(), "
        "'amalgamation': apsw.using_amalgamation, 'options': sorted(apsw.compile_options)}))"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    problems = []
    if found["apsw"] != APSW_VERSION:
        problems.append(f"apsw {found['apsw']}, not {APSW_VERSION}")
    if found["sqlite"] != header_define("SQLITE_VERSION"):
        problems.append(f"SQLite {found['sqlite']}, not {header_define('SQLITE_VERSION')}")
    if found["source_id"] != header_define("SQLITE_SOURCE_ID"):
        problems.append(f"SQLite source id {found['source_id']} is not vendor/sqlite's")
    if not found["amalgamation"]:
        problems.append("apsw is not built with the amalgamation")
    # SQLite adds a few of its own (COMPILER=..., ATOMIC_INTRINSICS, ...): ours must all be
    # there, and no ENABLE_/OMIT_ option that we did not ask for.
    reported = set(found["options"])
    wanted = expected_reported_options()
    missing = wanted - reported
    if missing:
        problems.append(f"options missing: {sorted(missing)}")
    extra = {o for o in reported - wanted if o.startswith(("ENABLE_", "OMIT_"))}
    if extra:
        problems.append(f"options we did not ask for: {sorted(extra)}")
    if problems:
        raise BuildError("the installed apsw is not ours: " + "; ".join(problems))
    return found


def installed_is_ours() -> str | None:
    """The installed apsw's description when it already verifies as ours, else None."""
    try:
        found = verify()
    except (BuildError, subprocess.CalledProcessError, json.JSONDecodeError):
        return None
    return f"apsw {found['apsw']}, SQLite {found['sqlite']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sdist", type=Path, default=None, help="a local apsw sdist to build")
    p.add_argument("--verify", action="store_true", help="only verify the installed apsw")
    p.add_argument("--force", action="store_true", help="build even if the installed apsw is ours")
    args = p.parse_args(argv)
    try:
        check_vendored()
        if not args.verify:
            reuse = None if args.force else installed_is_ours()
            if reuse:
                # The same apsw, SQLite source id and options: a rebuild would make the same
                # thing (under emulation it takes hours).
                print(f"apsw: the installed build is already ours ({reuse}); --force rebuilds")
            else:
                build(prepare(sdist(args.sdist)))
        found = verify()
    except BuildError as exc:
        print(f"build/build_apsw.py: {exc}", file=sys.stderr)
        return 1
    print(f"apsw {found['apsw']} with SQLite {found['sqlite']}: {' '.join(found['options'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
