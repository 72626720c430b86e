"""release/manifest.py: SHA256SUMS and the release manifest, and the verification that catches
a tampered, missing or extra file."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from release import manifest as rm

import nulltickets
from nulltickets.cli import manifest as nullhub_manifest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
VERSION = "2026.11.29"


def make_assets(folder: Path, names: list[str] | None = None) -> dict[str, bytes]:
    names = names or [rm.asset_name(*t) for t in rm.PLATFORMS]
    contents = {}
    for i, name in enumerate(names):
        data = f"binary {i} for {name}\n".encode() * (i + 1)
        (folder / name).write_bytes(data)
        contents[name] = data
    return contents


def test_write_lists_every_asset_with_platform_size_and_sha256(tmp_path: Path) -> None:
    contents = make_assets(tmp_path)
    doc = rm.write(tmp_path, VERSION, COMMIT, require_all=True)

    on_disk = json.loads((tmp_path / rm.MANIFEST).read_text())
    assert on_disk == doc
    assert (doc["name"], doc["version"], doc["commit"]) == ("nulltickets", VERSION, COMMIT)
    assert [a["name"] for a in doc["assets"]] == sorted(contents)
    for entry in doc["assets"]:
        data = contents[entry["name"]]
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["platform"] == rm.PLATFORMS[(entry["os"], entry["arch"])]

    sums = (tmp_path / rm.SUMS).read_text()
    assert sums == "".join(
        f"{hashlib.sha256(contents[n]).hexdigest()}  {n}\n" for n in sorted(contents)
    )
    assert rm.verify(tmp_path) == []


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="no sha256sum here")
def test_sha256sums_is_what_sha256sum_checks(tmp_path: Path) -> None:
    make_assets(tmp_path)
    rm.write(tmp_path, VERSION, COMMIT)
    r = subprocess.run(["sha256sum", "--check", rm.SUMS], cwd=tmp_path, capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_verify_detects_a_tampered_file(tmp_path: Path) -> None:
    make_assets(tmp_path)
    rm.write(tmp_path, VERSION, COMMIT)
    target = tmp_path / "nulltickets-linux-x86_64.bin"
    data = bytearray(target.read_bytes())
    data[0] ^= 1  # same size, one bit flipped
    target.write_bytes(bytes(data))

    problems = rm.verify(tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("nulltickets-linux-x86_64.bin: SHA-256 mismatch")


def test_verify_detects_a_truncated_file(tmp_path: Path) -> None:
    make_assets(tmp_path)
    rm.write(tmp_path, VERSION, COMMIT)
    target = tmp_path / "nulltickets-windows-aarch64.exe"
    target.write_bytes(target.read_bytes()[:-1])
    problems = rm.verify(tmp_path)
    assert any("SHA-256 mismatch" in p for p in problems)
    assert any("nulltickets-windows-aarch64.exe: size" in p for p in problems)


def test_verify_detects_missing_and_unlisted_files(tmp_path: Path) -> None:
    make_assets(tmp_path, ["nulltickets-linux-x86_64.bin", "nulltickets-macos-aarch64.bin"])
    rm.write(tmp_path, VERSION, COMMIT)
    (tmp_path / "nulltickets-macos-aarch64.bin").unlink()
    (tmp_path / "nulltickets-linux-riscv64.bin").write_bytes(b"sneaked in")
    assert rm.verify(tmp_path) == [
        f"nulltickets-linux-riscv64.bin: present but not in {rm.MANIFEST}",
        "nulltickets-macos-aarch64.bin: missing",
    ]


def test_verify_detects_a_manifest_that_disagrees_with_sha256sums(tmp_path: Path) -> None:
    make_assets(tmp_path)
    rm.write(tmp_path, VERSION, COMMIT)
    doc = json.loads((tmp_path / rm.MANIFEST).read_text())
    doc["assets"][0]["sha256"] = "0" * 64
    (tmp_path / rm.MANIFEST).write_text(json.dumps(doc))
    name = doc["assets"][0]["name"]
    digest = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    assert rm.verify(tmp_path) == [f"{name}: SHA-256 mismatch (file {digest})"]


def test_verify_fails_without_sums_or_manifest(tmp_path: Path) -> None:
    make_assets(tmp_path)
    assert rm.verify(tmp_path) != []
    rm.write(tmp_path, VERSION, COMMIT)
    (tmp_path / rm.SUMS).write_text("not a checksum line\n")
    assert rm.verify(tmp_path) == [f"{rm.SUMS} line 1: not '<sha256>  <name>'"]


@pytest.mark.parametrize(
    "name",
    [
        "nulltickets-linux-x86_64.exe",
        "nulltickets-windows-x86_64.bin",
        "nulltickets-linux-amd64.bin",
        "nulltickets-freebsd-x86_64.bin",
        "nulltickets",
    ],
)
def test_write_refuses_a_misnamed_binary(tmp_path: Path, name: str) -> None:
    make_assets(tmp_path, ["nulltickets-linux-x86_64.bin", name])
    with pytest.raises(rm.ManifestError, match=re.escape(name)):
        rm.write(tmp_path, VERSION, COMMIT)


def test_write_checks_version_commit_and_completeness(tmp_path: Path) -> None:
    make_assets(tmp_path, ["nulltickets-linux-x86_64.bin"])
    with pytest.raises(rm.ManifestError, match="CalVer"):
        rm.write(tmp_path, "1.2.3-rc1", COMMIT)
    with pytest.raises(rm.ManifestError, match="40-hex"):
        rm.write(tmp_path, VERSION, "abc123")
    with pytest.raises(rm.ManifestError, match=r"missing assets: nulltickets-linux-aarch64\.bin"):
        rm.write(tmp_path, VERSION, COMMIT, require_all=True)
    assert not (tmp_path / rm.SUMS).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(rm.ManifestError, match="no release assets"):
        rm.write(empty, VERSION, COMMIT)


def test_platforms_and_names_match_what_nullhub_is_told() -> None:
    """The assets a release publishes are exactly those `--export-manifest` points nullhub at."""
    exported = nullhub_manifest.manifest()["platforms"]
    ours = {rm.PLATFORMS[t]: rm.asset_name(*t) for t in rm.PLATFORMS}
    assert ours == {triple: entry["asset"] for triple, entry in exported.items()}
    for name in ours.values():
        assert rm.ASSET.match(name)


def test_version_comes_from_the_package_and_the_tag_must_match_it() -> None:
    assert rm.source_version() == nulltickets.__version__
    assert rm.CALVER.match(nulltickets.__version__)
    assert rm.main(["check-tag", f"v{nulltickets.__version__}"]) == 0
    assert rm.main(["check-tag", "v1999.1.1"]) == 1
    assert rm.main(["check-tag", nulltickets.__version__]) == 1  # the v is required


def test_command_line_write_then_verify_then_tamper(tmp_path: Path) -> None:
    make_assets(tmp_path)
    script = Path(rm.__file__)
    run = [sys.executable, str(script)]
    w = subprocess.run(
        [*run, "write", str(tmp_path), "--commit", COMMIT, "--require-all"],
        capture_output=True,
        text=True,
    )
    assert w.returncode == 0, w.stderr
    assert json.loads((tmp_path / rm.MANIFEST).read_text())["version"] == nulltickets.__version__
    v = subprocess.run([*run, "verify", str(tmp_path)], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr
    with (tmp_path / "nulltickets-macos-x86_64.bin").open("ab") as f:
        f.write(b"\0")
    v = subprocess.run([*run, "verify", str(tmp_path)], capture_output=True, text=True)
    assert v.returncode == 1
    assert "nulltickets-macos-x86_64.bin: SHA-256 mismatch" in v.stderr


def nullhub_doc(version: str = VERSION) -> dict[str, object]:
    """What a release binary's `--export-manifest` prints, with the release's version."""
    return {**nullhub_manifest.manifest(), "version": version}


def test_verify_checks_names_against_nullhubs_manifest(tmp_path: Path) -> None:
    make_assets(tmp_path)
    rm.write(tmp_path, VERSION, COMMIT, require_all=True)
    assert rm.verify(tmp_path, nullhub=nullhub_doc(), require_all=True) == []

    # nullhub looks for another name for one target: that asset would never be found.
    renamed = nullhub_doc()
    platforms = dict(renamed["platforms"])  # type: ignore[call-overload]
    platforms["riscv64-linux"] = {"asset": "nulltickets-linux-riscv64gc.bin", "binary": "x"}
    renamed["platforms"] = platforms
    problems = rm.verify(tmp_path, nullhub=renamed, require_all=True)
    assert "nulltickets-linux-riscv64.bin: not an asset nullhub's manifest names" in problems
    assert any("riscv64gc.bin: nullhub's manifest names it" in p for p in problems)

    # A binary of another version than the release is refused.
    problems = rm.verify(tmp_path, nullhub=nullhub_doc("2026.1.1"), require_all=True)
    assert problems == ["nullhub manifest version '2026.1.1', release '2026.11.29'"]


def test_verify_require_all_names_the_missing_platforms(tmp_path: Path) -> None:
    names = [rm.asset_name(*t) for t in rm.PLATFORMS if t != ("windows", "aarch64")]
    make_assets(tmp_path, names)
    rm.write(tmp_path, VERSION, COMMIT)
    assert rm.verify(tmp_path) == []
    assert rm.verify(tmp_path, require_all=True) == [
        "nulltickets-windows-aarch64.exe: no such asset in the release"
    ]


def test_command_line_verify_with_nullhubs_manifest(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    make_assets(assets)
    rm.write(assets, nulltickets.__version__, COMMIT, require_all=True)
    exported = tmp_path / "nullhub-manifest.json"
    exported.write_text(json.dumps(nullhub_manifest.manifest()))
    run = [sys.executable, str(Path(rm.__file__)), "verify", str(assets)]
    v = subprocess.run(
        [*run, "--nullhub", str(exported), "--require-all"], capture_output=True, text=True
    )
    assert v.returncode == 0, v.stderr
    (assets / "nulltickets-linux-aarch64.bin").unlink()
    v = subprocess.run(
        [*run, "--nullhub", str(exported), "--require-all"], capture_output=True, text=True
    )
    assert v.returncode == 1
    assert "nulltickets-linux-aarch64.bin: missing" in v.stderr
