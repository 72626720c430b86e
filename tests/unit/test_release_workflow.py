"""The release workflow: a workflow_dispatch dry run builds everything and publishes nothing, and
every script its jobs call is one of the repository's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def workflow() -> dict[Any, Any]:
    doc = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def runs(job: dict[str, Any]) -> list[str]:
    return [str(step["run"]) for step in job.get("steps", []) if "run" in step]


def test_workflow_dispatch_builds_every_target_and_the_manifest_but_only_a_tag_publishes() -> None:
    doc = workflow()
    triggers = doc[True]  # YAML 1.1 reads the key `on` as true
    assert "workflow_dispatch" in triggers and triggers["push"]["tags"] == ["v*"]
    jobs = doc["jobs"]
    builders = {"linux", "linux-riscv64", "macos", "windows", "wheels", "sdist"}
    assert set(jobs["manifest"]["needs"]) == builders
    for name in builders | {"manifest", "check"}:
        assert "if" not in jobs[name], f"{name} must run in a dry run too"
    assert jobs["publish"]["needs"] == "manifest"
    assert jobs["publish"]["if"] == (
        "github.event_name == 'push' && startsWith(github.ref, 'refs/tags/v')"
    )
    writers = [n for n, j in jobs.items() if j.get("permissions", {}).get("contents") == "write"]
    assert writers == ["publish"]
    manifest = "\n".join(runs(jobs["manifest"]))
    assert "release/manifest.py verify assets --nullhub nullhub-manifest.json --require-all" in (
        manifest
    )
    assert "release/notes.py" in manifest


def test_the_linux_jobs_run_the_scripts_that_run_here() -> None:
    jobs = workflow()["jobs"]
    assert runs(jobs["linux"]) == ["bash build/release.sh /opt/python/cp312-cp312/bin/python"]
    assert any(r.endswith("bash build/emulated.sh riscv64") for r in runs(jobs["linux-riscv64"]))


def test_every_script_a_job_calls_is_in_the_repository() -> None:
    called = set()
    for job in workflow()["jobs"].values():
        for run in runs(job):
            called.update(re.findall(r"(?:bash|python3?) ((?:build|release)/[\w.-]+)", run))
    assert called >= {"build/release.sh", "build/emulated.sh", "release/manifest.py"}
    for path in called:
        assert (ROOT / path).is_file(), path


def test_the_image_job_builds_both_platforms_in_a_dry_run_and_pushes_only_for_a_tag() -> None:
    jobs = workflow()["jobs"]
    image = jobs["image"]
    assert "if" not in image, "the image must build and run in a dry run too"
    assert image["needs"] == "manifest"
    build = "\n".join(runs(image))
    assert "for arch in amd64 arm64" in build and '--platform "linux/$arch"' in build
    assert "-f Containerfile" in build and (ROOT / "Containerfile").is_file()
    pushes = [s for s in image["steps"] if "push" in str(s.get("run", ""))]
    assert pushes and all(
        s.get("if") == "github.event_name == 'push' && startsWith(github.ref, 'refs/tags/v')"
        for s in pushes
    )
    packagers = [n for n, j in jobs.items() if j.get("permissions", {}).get("packages")]
    assert packagers == ["image"]
