"""The container image (Containerfile) as a user runs it: `scripts/image.sh test` builds it and
names it in NULLTICKETS_TEST_IMAGE (`make test-image`). Each test runs real containers with
podman: the image's own command, user and environment, a named volume for the data.

The agent contract itself (claims, runs, leases, checkpoints, store) runs against the image
too, as the e2e tests with tests/image/serve.sh standing in for the binary."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import create_pipeline, make_task, unique
from tests.pgserver import PostgresServer
from tests.server import TIME_SCALE, Client, descendants, free_port

IMAGE = os.environ.get("NULLTICKETS_TEST_IMAGE", "")
NOBODY = 65534
# The bound docs/operating/serving.md promises: the main process is gone within 5 s of SIGTERM.
SHUTDOWN_BOUND_S = 5.0
LABEL = "nulltickets-test-image"
# A container reachable from its network needs a token (16+ characters).
TOKEN = "image-token-" + uuid.uuid4().hex


def podman(*args: str, timeout: float = 60.0, check: bool = True) -> str:
    r = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout * TIME_SCALE
    )
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: status {r.returncode}\n{r.stderr}")
    return r.stdout.strip()


@pytest.fixture(scope="module", autouse=True)
def image() -> str:
    if not IMAGE:
        pytest.fail("NULLTICKETS_TEST_IMAGE must name the image: run `make test-image`")
    podman("image", "exists", IMAGE)
    return IMAGE


class Container:
    """One `podman run -d` of the image, named; removed with `remove`."""

    def __init__(self, *args: str, port: int) -> None:
        self.name = unique("nulltickets-image")
        self.port = port
        podman("run", "-d", "--name", self.name, "--label", LABEL, *args)

    def inspect(self, template: str) -> str:
        return podman("inspect", "-f", template, self.name)

    def logs(self) -> str:
        """What the server wrote (podman gives the container's stderr on its own stderr)."""
        r = subprocess.run(
            ["podman", "logs", self.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=60.0 * TIME_SCALE,
        )  # fmt: skip
        return r.stdout

    def wait_healthy(self, timeout: float = 30.0 * TIME_SCALE, token: str = TOKEN) -> Client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.inspect("{{.State.Running}}") != "true":
                raise AssertionError(f"the container stopped:\n{self.logs()}")
            client = Client("127.0.0.1", self.port, token=token, timeout=5.0)
            try:
                if client.get("/health").status == 200:
                    return client
            except OSError:
                pass
            client.close()
            time.sleep(0.1)
        raise AssertionError(f"not healthy after {timeout} s:\n{self.logs()}")

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture
def volume() -> Iterator[str]:
    name = f"nulltickets-test-{uuid.uuid4().hex[:12]}"
    podman("volume", "create", "--label", LABEL, name)
    yield name
    podman("volume", "rm", "-f", name, check=False)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for c in started:
        c.remove()


def run_image(
    containers: list[Container], volume: str, *command: str, token: str | None = TOKEN
) -> Container:
    """The image as a user starts it: its own user and command (or `command`, as the original's
    compose files pass), the volume on /nulltickets-data, the port published on the loopback,
    and a token in NULLTICKETS_TOKEN (none with token=None)."""
    port = free_port()
    flags = [] if token is None else ["--env", f"NULLTICKETS_TOKEN={token}"]
    c = Container(
        "-v", f"{volume}:/nulltickets-data", "-p", f"127.0.0.1:{port}:7700", *flags, IMAGE,
        *command, port=port,
    )  # fmt: skip
    containers.append(c)
    return c


def uids(pid: int) -> set[int]:
    """The real, effective, saved and filesystem user ids of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(u) for u in line.split()[1:]}
    raise AssertionError(f"no Uid line for {pid}")


def test_data_survives_a_sigterm_stop_and_a_new_container_on_the_same_volume(
    volume: str, containers: list[Container]
) -> None:
    first = run_image(containers, volume)
    client = first.wait_healthy()
    health = client.get("/health").json
    assert health["core"] == "compiled", health
    pipeline = create_pipeline(client)
    task_id = make_task(client, pipeline, metadata={"kept": True})
    assert client.put("/store/image/key", {"value": {"n": 1}}).status == 204
    client.close()

    # `podman stop` sends the image's STOPSIGNAL (SIGTERM) and would SIGKILL after 10 s: a
    # clean exit, status 0, within the bound, is the server's own shutdown.
    assert first.inspect("{{.Config.StopSignal}}") in ("SIGTERM", "15")
    started = time.monotonic()
    podman("stop", "-t", "10", first.name)
    elapsed = time.monotonic() - started
    assert first.inspect("{{.State.ExitCode}}") == "0", first.logs()
    assert elapsed < SHUTDOWN_BOUND_S * TIME_SCALE, (elapsed, first.logs())

    # The original's command line, as a compose file written for its image passes it.
    second = run_image(
        containers, volume, "--port", "7700", "--db", "/nulltickets-data/nulltickets.db"
    )
    client = second.wait_healthy()
    r = client.get(f"/tasks/{task_id}")
    assert r.status == 200, r.body
    assert r.json["metadata"] == {"kept": True}
    assert client.get("/store/image/key").json["value"] == {"n": 1}
    client.close()


def test_the_server_runs_as_user_65534_and_the_health_check_passes(
    volume: str, containers: list[Container]
) -> None:
    c = run_image(containers, volume)
    c.wait_healthy().close()
    pid = int(c.inspect("{{.State.Pid}}"))
    processes = [pid, *descendants(pid)]
    assert len(processes) >= 2, processes  # granian's main process and its worker
    for p in processes:
        assert uids(p) == {NOBODY}, (p, uids(p))
    # The image's HEALTHCHECK, run now rather than on its interval.
    podman("healthcheck", "run", c.name)
    # The database is in the volume, owned by the image's user.
    owner = podman("run", "--rm", "-v", f"{volume}:/data", "--entrypoint", "stat", IMAGE,
                   "-c", "%u", "/data/nulltickets.db")  # fmt: skip
    assert owner == str(NOBODY)


def test_without_a_token_it_runs_on_the_container_loopback_only(
    volume: str, containers: list[Container]
) -> None:
    """As the original's image: it starts and is healthy inside, but the published port
    reaches nothing, and the log says which variable to set."""
    c = run_image(containers, volume, token=None)
    deadline = time.monotonic() + 30.0 * TIME_SCALE
    while "listening on http://127.0.0.1:7700" not in c.logs():
        assert time.monotonic() < deadline, c.logs()
        assert c.inspect("{{.State.Running}}") == "true", c.logs()
        time.sleep(0.1)
    podman("healthcheck", "run", c.name)
    assert "set NULLTICKETS_TOKEN" in c.logs()
    client = Client("127.0.0.1", c.port, timeout=5.0)
    with pytest.raises(OSError):
        client.get("/health")
    client.close()


def test_release_root_runs_as_root_and_the_default_image_does_not() -> None:
    assert podman("run", "--rm", "--entrypoint", "id", IMAGE, "-u") == str(NOBODY)
    assert podman("run", "--rm", "--entrypoint", "id", f"{IMAGE}-root", "-u") == "0"


def test_every_setting_comes_from_the_environment(volume: str, containers: list[Container]) -> None:
    """A port, a token and a log format from variables alone: the image's command has no
    flags that would override them."""
    port = free_port()
    c = Container(
        "-v", f"{volume}:/nulltickets-data", "--network", "host",
        "--env", f"NULLTICKETS_PORT={port}", "--env", "NULLTICKETS_HOST=127.0.0.1",
        "--env", f"NULLTICKETS_TOKEN={TOKEN}", "--env", "NULLTICKETS_LOG_FORMAT=json",
        IMAGE, port=port,
    )  # fmt: skip
    containers.append(c)
    client = c.wait_healthy()
    assert client.get("/pipelines").status == 200
    client.close()
    anonymous = Client("127.0.0.1", port, timeout=5.0)
    assert anonymous.get("/pipelines").status == 401
    anonymous.close()
    records = [json.loads(line) for line in c.logs().splitlines() if line.startswith("{")]
    assert any(f"127.0.0.1:{port}" in r.get("message", "") for r in records), c.logs()
    assert TOKEN not in c.logs()


def test_the_image_serves_from_postgresql(
    containers: list[Container], postgres: PostgresServer
) -> None:
    """The image carries the PostgreSQL driver: a server on a database URL from the
    environment (the cluster listens on this machine's loopback, hence the host network)."""
    port = free_port()
    dsn = postgres.dsn(postgres.create_database())
    c = Container(
        "--network", "host", "--env", f"NULLTICKETS_PORT={port}",
        "--env", "NULLTICKETS_HOST=127.0.0.1", "--env", f"NULLTICKETS_DB={dsn}",
        IMAGE, port=port,
    )  # fmt: skip
    containers.append(c)
    client = c.wait_healthy()
    pipeline = create_pipeline(client)
    task_id = make_task(client, pipeline)
    assert client.get(f"/tasks/{task_id}").status == 200
    assert client.get("/health").json["sqlite_version"] == ""
    client.close()
