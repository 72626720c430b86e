"""Release manifest: checksums and a JSON description of the binaries a release publishes.

    python release/manifest.py write DIR --version V --commit SHA [--require-all]
    python release/manifest.py verify DIR [--nullhub FILE] [--require-all]
    python release/manifest.py version              # nulltickets.__version__, from the source
    python release/manifest.py check-tag vYYYY.M.D  # exit 1 unless the tag is v<__version__>

`write` reads every `nulltickets-<os>-<arch>.<bin|exe>` in DIR and writes `SHA256SUMS` (the
format `sha256sum --check` reads) and `release-manifest.json` (name, version, commit, and per
asset its platform, size and SHA-256). `verify` re-hashes the assets and fails on any file that
is missing, changed, or not listed; with `--nullhub FILE` (what a release binary prints with
`--export-manifest`) also any asset whose name is not one nullhub's manifest names, or a
version that differs from it, and with `--require-all` any platform without its asset.
Standard library only: the release job runs it on a bare
Python, without installing the package.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAME = "nulltickets"
SUMS = "SHA256SUMS"
MANIFEST = "release-manifest.json"

# (os, arch) of every asset a release publishes -> nullhub's target triple. Must match
# src/nulltickets/cli/manifest.py TARGETS (a unit test checks).
PLATFORMS = {
    ("linux", "x86_64"): "x86_64-linux",
    ("linux", "aarch64"): "aarch64-linux",
    ("linux", "riscv64"): "riscv64-linux",
    ("macos", "aarch64"): "aarch64-macos",
    ("macos", "x86_64"): "x86_64-macos",
    ("windows", "x86_64"): "x86_64-windows",
    ("windows", "aarch64"): "aarch64-windows",
}
ASSET = re.compile(r"^nulltickets-(linux|macos|windows)-(x86_64|aarch64|riscv64)\.(bin|exe)$")
CALVER = re.compile(r"^\d{4}\.(?:[1-9]|1[0-2])\.(?:[1-9]|[12]\d|3[01])$")


class ManifestError(Exception):
    """The assets, SHA256SUMS and the manifest do not agree."""


def asset_name(os_name: str, arch: str) -> str:
    return f"{NAME}-{os_name}-{arch}.{'exe' if os_name == 'windows' else 'bin'}"


def source_version() -> str:
    """`__version__` from src/nulltickets/__init__.py, read without importing the package."""
    tree = ast.parse((ROOT / "src" / NAME / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise ManifestError("no __version__ string in src/nulltickets/__init__.py")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_assets(folder: Path) -> list[Path]:
    """The release binaries in `folder`, sorted by name; a misnamed binary is an error."""
    assets = []
    for path in sorted(folder.iterdir()):
        if path.name in (SUMS, MANIFEST) or not path.is_file():
            continue
        m = ASSET.match(path.name)
        if m is None:
            raise ManifestError(
                f"{path.name}: not a release asset name (nulltickets-<os>-<arch>.bin)"
            )
        os_name, arch, _ = m.groups()
        if (os_name, arch) not in PLATFORMS or path.name != asset_name(os_name, arch):
            raise ManifestError(f"{path.name}: no such release platform")
        assets.append(path)
    return assets


def build(folder: Path, version: str, commit: str, *, require_all: bool = False) -> dict[str, Any]:
    if not CALVER.match(version):
        raise ManifestError(f"version {version!r} is not CalVer YYYY.M.D")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ManifestError(f"commit {commit!r} is not a 40-hex-digit SHA")
    assets = find_assets(folder)
    if not assets:
        raise ManifestError(f"no release assets in {folder}")
    if require_all:
        missing = sorted(set(map(lambda t: asset_name(*t), PLATFORMS)) - {a.name for a in assets})
        if missing:
            raise ManifestError(f"missing assets: {', '.join(missing)}")
    entries = []
    for path in assets:
        m = ASSET.match(path.name)
        assert m is not None
        os_name, arch, _ = m.groups()
        entries.append(
            {
                "name": path.name,
                "platform": PLATFORMS[(os_name, arch)],
                "os": os_name,
                "arch": arch,
                "size": path.stat().st_size,
                "sha256": sha256(path),
            }
        )
    return {"name": NAME, "version": version, "commit": commit, "assets": entries}


def write(folder: Path, version: str, commit: str, *, require_all: bool = False) -> dict[str, Any]:
    doc = build(folder, version, commit, require_all=require_all)
    sums = "".join(f"{a['sha256']}  {a['name']}\n" for a in doc["assets"])
    (folder / SUMS).write_text(sums, encoding="utf-8", newline="\n")
    (folder / MANIFEST).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8", newline="\n")
    return doc


def read_sums(path: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](\S+)", line)
        if m is None:
            raise ManifestError(f"{SUMS} line {n}: not '<sha256>  <name>'")
        if m.group(2) in sums:
            raise ManifestError(f"{SUMS}: {m.group(2)} listed twice")
        sums[m.group(2)] = m.group(1)
    return sums


def nullhub_assets(nullhub: dict[str, Any]) -> dict[str, str]:
    """{asset name: nullhub target triple} from nullhub's component manifest."""
    platforms = nullhub.get("platforms")
    if not isinstance(platforms, dict) or not platforms:
        raise ManifestError("the nullhub manifest lists no platforms")
    return {str(entry["asset"]): str(triple) for triple, entry in platforms.items()}


def verify(
    folder: Path, *, nullhub: dict[str, Any] | None = None, require_all: bool = False
) -> list[str]:
    """Every problem found, empty when the folder is exactly what the manifest describes (and,
    given nullhub's manifest, what nullhub will look for)."""
    problems: list[str] = []
    try:
        doc = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        sums = read_sums(folder / SUMS)
        present = {p.name for p in find_assets(folder)}
    except (OSError, ValueError, ManifestError) as exc:
        return [str(exc)]
    if doc.get("name") != NAME or not CALVER.match(str(doc.get("version", ""))):
        problems.append(f"{MANIFEST}: bad name or version")
    listed = {a["name"]: a for a in doc.get("assets", [])}
    if set(listed) != set(sums):
        problems.append(f"{MANIFEST} and {SUMS} list different files")
    for name in sorted(present - set(listed)):
        problems.append(f"{name}: present but not in {MANIFEST}")
    for name, entry in sorted(listed.items()):
        path = folder / name
        if name not in present:
            problems.append(f"{name}: missing")
            continue
        digest = sha256(path)
        if digest != entry.get("sha256") or digest != sums.get(name):
            problems.append(f"{name}: SHA-256 mismatch (file {digest})")
        if path.stat().st_size != entry.get("size"):
            problems.append(
                f"{name}: size {path.stat().st_size}, manifest says {entry.get('size')}"
            )
        m = ASSET.match(name)
        if m is None or entry.get("platform") != PLATFORMS.get((m.group(1), m.group(2))):
            problems.append(f"{name}: wrong platform {entry.get('platform')!r}")
    if require_all:
        for name in sorted({asset_name(*t) for t in PLATFORMS} - set(listed)):
            problems.append(f"{name}: no such asset in the release")
    if nullhub is not None:
        try:
            expected = nullhub_assets(nullhub)
        except (KeyError, TypeError, ManifestError) as exc:
            return [*problems, f"nullhub manifest: {exc}"]
        if nullhub.get("version") != doc.get("version"):
            theirs, ours = nullhub.get("version"), doc.get("version")
            problems.append(f"nullhub manifest version {theirs!r}, release {ours!r}")
        for name, entry in sorted(listed.items()):
            if name not in expected:
                problems.append(f"{name}: not an asset nullhub's manifest names")
            elif expected[name] != entry.get("platform"):
                problems.append(f"{name}: nullhub expects it for {expected[name]}")
        if require_all:
            for name in sorted(set(expected) - set(listed)):
                problems.append(f"{name}: nullhub's manifest names it, the release lacks it")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release/manifest.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write SHA256SUMS and the manifest for DIR")
    w.add_argument("dir", type=Path)
    w.add_argument("--version", default=None, help="default: nulltickets.__version__")
    w.add_argument("--commit", required=True)
    w.add_argument("--require-all", action="store_true", help="fail unless every platform is there")
    v = sub.add_parser("verify", help="check DIR against its SHA256SUMS and manifest")
    v.add_argument("dir", type=Path)
    v.add_argument("--nullhub", type=Path, default=None, help="`--export-manifest` output")
    v.add_argument("--require-all", action="store_true", help="fail unless every platform is there")
    sub.add_parser("version", help="print nulltickets.__version__")
    t = sub.add_parser("check-tag", help="exit 1 unless TAG is v<__version__>")
    t.add_argument("tag")
    args = p.parse_args(argv)

    try:
        if args.cmd == "write":
            doc = write(
                args.dir,
                args.version or source_version(),
                args.commit,
                require_all=args.require_all,
            )
            for a in doc["assets"]:
                print(f"{a['sha256']}  {a['size']:>10}  {a['name']}")
            return 0
        if args.cmd == "verify":
            nullhub = None
            if args.nullhub is not None:
                nullhub = json.loads(args.nullhub.read_text(encoding="utf-8"))
            problems = verify(args.dir, nullhub=nullhub, require_all=args.require_all)
            for problem in problems:
                print(f"release/manifest.py: {problem}", file=sys.stderr)
            if not problems:
                print(f"{args.dir}: all assets match {SUMS} and {MANIFEST}")
            return 1 if problems else 0
        version = source_version()
        if args.cmd == "version":
            print(version)
            return 0
        if args.tag != f"v{version}":
            print(
                f"release/manifest.py: tag {args.tag} does not match __version__ {version} "
                f"(expected v{version})",
                file=sys.stderr,
            )
            return 1
        return 0
    except ManifestError as exc:
        print(f"release/manifest.py: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
