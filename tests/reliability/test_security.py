"""Suite 5, security: with --token every admin route refuses a missing or wrong token (by iterating
the route table, so a new route cannot slip through), lease routes refuse other leases' tokens,
secrets are compared in constant time, no token (admin or lease) ever reaches the database, a log
line or an error message in clear, and a non-loopback bind without a token refuses to start."""

from __future__ import annotations

import ast
import contextlib
import http.client
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nulltickets
from nulltickets.domain.tokens import same_hash, same_token
from nulltickets.http.routes import ROUTES, Route
from nulltickets.service.verbs import Guard as Auth
from tests.reliability.helpers import envelope, open_db, rows
from tests.reliability.report import Recorder, scale
from tests.server import PIPELINE, Client, Response, Server, free_port, server_command

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-admin-token-" + "x" * 13
DUMMY_ID = "00000000-0000-4000-8000-000000000000"


def concrete(route: Route, value: str = DUMMY_ID) -> str:
    """The route's pattern with every parameter filled in."""
    path = re.sub(r"\{[a-z_]+\+?\}", value, route.pattern)
    if route.pattern.startswith("/store/") and "{" in route.pattern:
        path = re.sub(r"\{[a-z_]+\+?\}", "ns", route.pattern, count=1)
        path = re.sub(r"\{[a-z_]+\+?\}", "key", path)
    return path


def body_for(route: Route) -> Any:
    return {} if route.method in ("POST", "PUT") else None


def stream_status(server: Server, route: Route, token: str) -> int:
    """The status of a streaming route's answer, read from its head alone: a stream's body
    never ends by design, so reading it to the end would wait forever."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(route.method, concrete(route), headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("secured") / "secured.db", token=TOKEN).start()
    yield server
    server.stop()


def claim_two(client: Client) -> tuple[dict[str, Any], dict[str, Any]]:
    role = f"coder-{uuid.uuid4().hex[:8]}"
    definition: dict[str, Any] = json.loads(json.dumps(PIPELINE))
    definition["states"]["todo"] = {"agent_role": role}
    r = client.post("/pipelines", {"name": f"sec-{uuid.uuid4().hex[:8]}", "definition": definition})
    assert r.status == 201, r.body
    tasks = [{"pipeline_id": r.json["id"], "title": f"t{i}", "description": ""} for i in range(2)]
    assert client.post("/tasks/bulk", {"tasks": tasks}).status == 201
    leases = []
    for agent in ("a", "b"):
        c = client.post("/leases/claim", {"agent_id": agent, "agent_role": role})
        assert c.status == 200, c.body
        leases.append(dict(c.json))
    return leases[0], leases[1]


# --- the admin gate, route by route ------------------------------------------------------------

BAD_ADMIN: dict[str, dict[str, str]] = {
    "no Authorization": {},
    "a wrong token": {"Authorization": "Bearer not-the-token"},
    "an empty token": {"Authorization": "Bearer "},
    "a prefix of the token": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "the token and more": {"Authorization": f"Bearer {TOKEN}x"},
    "another case": {"Authorization": f"Bearer {TOKEN.upper()}"},
    "lowercase scheme, wrong token": {"Authorization": f"bearer {TOKEN}x"},
    "Basic scheme": {"Authorization": f"Basic {TOKEN}"},
    "no scheme": {"Authorization": TOKEN},
}


def test_every_route_in_the_table_refuses_missing_and_wrong_admin_tokens(
    secured: Server, record: Recorder
) -> None:
    admin = secured.client(TOKEN)
    lease_a, _ = claim_two(admin)
    admin.close()
    bad = {**BAD_ADMIN, "a live lease token": {"Authorization": f"Bearer {lease_a['lease_token']}"}}
    row = record(
        "security",
        "every admin route of the route table (nulltickets.http.routes.ROUTES) without the admin "
        f"token or with a wrong one ({len(bad)} variants: missing, wrong, empty, prefix, longer, "
        "other case, lowercase scheme, Basic, no scheme, a live lease token)",
        0,
        "requests",
    )
    client = secured.client()
    wrong: list[tuple[str, str, str, int]] = []
    tried = 0
    kinds: dict[str, int] = {}
    try:
        for route in ROUTES:
            kinds[route.auth.value] = kinds.get(route.auth.value, 0) + 1
            path = concrete(route)
            if route.auth is Auth.KEY:
                for name, headers in bad.items():
                    r = client.request(route.method, path, body_for(route), headers=headers)
                    tried += 1
                    if r.status != 401 or envelope(r) != "unauthorized":
                        wrong.append((route.method, route.pattern, name, r.status))
                if route.media == "text/event-stream":
                    status = stream_status(secured, route, TOKEN)
                else:
                    status = client.request(route.method, path, body_for(route), token=TOKEN).status
                if status == 401:
                    wrong.append((route.method, route.pattern, "the admin token", 401))
            elif route.auth is Auth.LEASE:
                r = client.request(route.method, path, body_for(route))
                tried += 1
                if r.status != 401 or envelope(r) != "unauthorized":
                    wrong.append((route.method, route.pattern, "no Authorization", r.status))
            else:
                r = client.request(route.method, path)
                tried += 1
                if r.status != 200:
                    wrong.append((route.method, route.pattern, "exempt, no token", r.status))
    finally:
        client.close()
    row.tried = tried
    row.detail = (
        f"{len(ROUTES)} routes ({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}): "
        f"every admin and lease route 401 unauthorized, exempt ones 200; {len(wrong)} wrong"
    )
    assert kinds.get("key", 0) >= 20, kinds  # the table is really being read
    assert wrong == [], wrong


GATE_TRICKS = [
    "/health/../tasks",
    "/health/%2e%2e/tasks",
    "/health%2F..%2Ftasks",
    "//health/..//tasks",
    "/openapi.json/../pipelines",
    "/.well-known/openapi.json/../../tasks",
    "/health/../../store/ns",
    "/./tasks",
    "/HEALTH",
    "/health;/../tasks",
    "/%68ealth/../tasks",
]


def test_path_tricks_do_not_get_past_the_admin_gate(secured: Server, record: Recorder) -> None:
    row = record(
        "security",
        "dot segments, encoded slashes and case tricks to reach admin routes through /health "
        "and /openapi.json",
        len(GATE_TRICKS),
        "requests",
    )
    client = secured.client()
    try:
        for path in GATE_TRICKS:
            for method in ("GET", "POST"):
                r = client.request(method, path, {} if method == "POST" else None)
                assert r.status in (401, 404), (method, path, r.status, r.body[:200])
                envelope(r)
    finally:
        client.close()
    row.detail = "every one 401 or 404 with the envelope, never an admin answer"


def test_lease_routes_refuse_another_leases_token(secured: Server, record: Recorder) -> None:
    admin = secured.client(TOKEN)
    a, b = claim_two(admin)
    lease_routes = [r for r in ROUTES if r.auth is Auth.LEASE]
    row = record(
        "security",
        "every lease route of the route table with another live lease's token, the admin token, "
        "and a random token",
        0,
        "requests",
    )
    client = secured.client()
    wrong: list[tuple[str, str, str, int]] = []
    tried = 0
    try:
        for route in lease_routes:
            target = a["lease_id"] if route.pattern.startswith("/leases/") else a["run"]["id"]
            path = concrete(route, target)
            for name, token in (
                ("another lease's token", b["lease_token"]),
                ("a random token", secrets.token_hex(32)),
                ("the admin token", TOKEN),
            ):
                if route.method == "GET" and name == "the admin token":
                    continue  # reading a run's events: the admin token is meant to work
                r = client.request(route.method, path, {"trigger": "submit"}, token=token)
                tried += 1
                if r.status != 401 or envelope(r) != "unauthorized":
                    wrong.append((route.method, route.pattern, name, r.status))
        # Untouched by all that: A's own token still holds its lease.
        hb = client.post(f"/leases/{a['lease_id']}/heartbeat", token=a["lease_token"])
        assert hb.status == 200, hb.body
    finally:
        client.close()
        admin.close()
    row.tried = tried
    row.detail = (
        f"{len(lease_routes)} lease routes: every one 401 unauthorized; the lease was "
        f"untouched and still worked with its own token; {len(wrong)} wrong"
    )
    assert len(lease_routes) >= 4
    assert wrong == [], wrong


# --- constant-time comparison ------------------------------------------------------------------

SECRET_NAME = re.compile(r"token|secret|hash|digest", re.IGNORECASE)


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Subscript):
        return _names(node.value)
    return []


def test_no_secret_is_compared_with_eq_anywhere_in_the_source(record: Recorder) -> None:
    """Every comparison of tokens or their hashes goes through hmac.compare_digest (via
    tokens.same_token / same_hash): an `==` on a secret returns early at the first differing
    byte, which leaks how much of a guess was right."""
    package = Path(nulltickets.__file__).parent
    files = sorted(package.rglob("*.py"))
    offenders: list[str] = []
    for file in files:
        tree = ast.parse(file.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
                continue
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) for s in sides):
                continue  # against None, "", a literal: no secret on both sides
            if any(SECRET_NAME.search(n) for s in sides for n in _names(s)):
                offenders.append(f"{file.relative_to(package)}:{node.lineno}: {ast.unparse(node)}")
    users = {
        f.name
        for f in files
        if "compare_digest" in f.read_text(encoding="utf-8")
        or "same_token" in f.read_text(encoding="utf-8")
        or "same_hash" in f.read_text(encoding="utf-8")
    }
    record(
        "security",
        "static scan of the package: no `==`/`!=` on a token, secret or hash",
        len(files),
        "source files",
        f"{len(offenders)} offending comparisons; constant-time helpers used in "
        f"{', '.join(sorted(users))}",
    )
    assert offenders == [], offenders
    tokens_src = (package / "domain" / "tokens.py").read_text(encoding="utf-8")
    assert tokens_src.count("hmac.compare_digest(") >= 2


def _median_ns(fn: Any, a: Any, b: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        fn(a, b)
        times.append(time.perf_counter_ns() - start)
    times.sort()
    return float(times[len(times) // 2])


def test_admin_token_comparison_takes_as_long_for_a_near_miss_as_for_a_far_miss(
    record: Recorder,
) -> None:
    """A naive `==` on a 1 MB secret answers a first-byte miss ~1000x faster than a last-byte
    miss; the real comparison must not care where the guess goes wrong."""
    rounds = scale(200, 2000)
    secret = "k" * 1_000_000
    near = secret[:-1] + "x"  # wrong only in the last character
    far = "x" + secret[1:]  # wrong in the first
    ratios = []
    for _ in range(5):
        t_near = _median_ns(same_token, near, secret, rounds)
        t_far = _median_ns(same_token, far, secret, rounds)
        ratios.append(max(t_near, t_far) / min(t_near, t_far))
    naive_near = _median_ns(lambda x, y: x == y, near, secret, rounds)
    naive_far = _median_ns(lambda x, y: x == y, far, secret, rounds)
    hashes = (b"\x00" * 31 + b"\x01", b"\x01" + b"\x00" * 31, b"\x00" * 32)
    assert not same_hash(hashes[0], hashes[2]) and same_hash(hashes[2], hashes[2])
    best = min(ratios)
    record(
        "security",
        "timing of the token comparison: a guess wrong in its last vs its first character "
        "(1 MB secret)",
        rounds * 10,
        "comparisons",
        f"median time ratio {best:.2f} (a naive == shows {naive_near / max(naive_far, 1):.0f}x "
        "on this machine)",
    )
    assert naive_near / max(naive_far, 1) > 20, "the probe cannot tell a naive comparison"
    assert best < 1.5, ratios


# --- no token in clear -------------------------------------------------------------------------


def test_no_token_is_ever_stored_logged_or_echoed(tmp_path: Path, record: Recorder) -> None:
    row = record(
        "security",
        "a full agent workflow with --token and --access-log (claims with Idempotency-Key and "
        "their replays, heartbeats, events, transition, fail, wrong tokens of every kind), then "
        "the database file, its WAL, the log and every response body searched for every token",
        0,
        "tokens searched",
    )
    server = Server(tmp_path / "secrets.db", token=TOKEN, args=["--access-log"]).start()
    admin = server.client(TOKEN)
    anon = server.client()
    lease_tokens: list[str] = []
    presented: list[str] = []
    bodies: list[bytes] = []

    def keep(r: Response) -> Response:
        bodies.append(r.body)
        return r

    try:
        role = "coder"
        r = keep(admin.post("/pipelines", {"name": "secrets", "definition": PIPELINE}))
        pipeline_id = r.json["id"]
        tasks = [
            {"pipeline_id": pipeline_id, "title": f"t{i}", "description": ""} for i in range(4)
        ]
        keep(admin.post("/tasks/bulk", {"tasks": tasks}))
        for n in range(4):
            key = {"Idempotency-Key": f"claim-{n}"}
            body = {"agent_id": f"agent-{n}", "agent_role": role}
            c = keep(admin.post("/leases/claim", body, headers=key))
            assert c.status == 200, c.body
            replay = keep(admin.post("/leases/claim", body, headers=key))
            assert replay.status == 200 and replay.json["lease_id"] == c.json["lease_id"]
            lease_tokens += [c.json["lease_token"], replay.json["lease_token"]]
            token, run_id = replay.json["lease_token"], c.json["run"]["id"]
            lease_id = c.json["lease_id"]
            # The rotated-away token of the first answer, a random one, the admin token, junk.
            for wrong in (c.json["lease_token"], secrets.token_hex(32), TOKEN, "zz" * 32):
                if wrong not in lease_tokens:
                    presented.append(wrong)
                keep(anon.post(f"/runs/{run_id}/events", {"kind": "k"}, token=wrong))
                keep(anon.post(f"/leases/{lease_id}/heartbeat", token=wrong))
            keep(anon.post(f"/leases/{lease_id}/heartbeat", token=token))
            keep(anon.post(f"/runs/{run_id}/events", {"kind": "progress"}, token=token))
            move = {"trigger": "submit"} if n % 2 else {"error": "gave up"}
            path = f"/runs/{run_id}/{'transition' if n % 2 else 'fail'}"
            key = {"Idempotency-Key": f"end-{n}"}
            assert keep(anon.post(path, move, headers=key, token=token)).status == 200
            keep(anon.post(path, move, headers=key, token=token))  # replay
            keep(anon.post(path, move, headers=key, token=secrets.token_hex(32)))
        for wrong_admin in ("wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
            presented.append(wrong_admin)
            keep(anon.get("/tasks", token=wrong_admin))
            keep(
                anon.post("/leases/claim", {"agent_id": "x", "agent_role": role}, token=wrong_admin)
            )
        keep(admin.put("/store/notes/n1", {"value": {"text": "nothing secret here"}}))
    finally:
        admin.close()
        anon.close()
        server.stop()

    blobs = {p.name: p.read_bytes() for p in tmp_path.glob("secrets.db*") if p.is_file()}
    blobs["log"] = server.log.read_bytes()
    blobs["responses"] = b"\n".join(bodies)
    with open_db(server.db) as conn:
        tables = [t for (t,) in rows(conn, "SELECT name FROM sqlite_schema WHERE type = 'table'")]
        dump = [repr(rows(conn, f'SELECT * FROM "{t}"')) for t in tables]
    blobs["every row of every table"] = "\n".join(dump).encode()
    assert b"access" in blobs["log"].lower() or b"POST /leases/claim" in blobs["log"]

    secrets_ = {"admin token": TOKEN, **{f"lease token {i}": t for i, t in enumerate(lease_tokens)}}
    secrets_.update({f"presented {i}": p for i, p in enumerate(presented) if len(p) >= 8})
    found: list[str] = []
    for name, secret in secrets_.items():
        forms = [secret.encode(), secret.upper().encode()]
        if re.fullmatch(r"[0-9a-f]{64}", secret):
            forms.append(bytes.fromhex(secret))
        for where, blob in blobs.items():
            if where == "responses" and name.startswith("lease token"):
                continue  # a lease token is shown once, to its claimer: that answer is the point
            if any(form in blob for form in forms):
                found.append(f"{name} in {where}")
    # The claimer sees its token exactly in the claim answers, nowhere else.
    other_answers = [b for b in bodies if b"lease_token" not in b]
    leaked = [t for t in lease_tokens if any(t.encode() in b for b in other_answers)]
    row.tried = len(secrets_)
    row.detail = (
        f"{len(lease_tokens)} lease tokens, the admin token and {len(presented)} presented wrong "
        f"tokens searched in {', '.join(sorted(blobs))}: "
        + ("none found in clear" if not found and not leaked else f"FOUND {found + leaked}")
    )
    assert found == [] and leaked == [], found + leaked


# --- refusing to listen on the world without a token -------------------------------------------


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def start_and_expect_refusal(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    port = free_port()
    cmd = [*server_command(), "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=home,
        env={**os.environ, "NULLTICKETS_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{args}: still running after 30 s (it is serving!)\n{err}") from None
    assert not listening(port)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


REFUSED: dict[str, tuple[list[str], dict[str, Any] | None]] = {
    "--host 0.0.0.0": (["--host", "0.0.0.0"], None),
    "--host ::": (["--host", "::"], None),
    "--host 192.0.2.1": (["--host", "192.0.2.1"], None),
    "--host 0.0.0.0 --token ''": (["--host", "0.0.0.0", "--token", ""], None),
    "config host 0.0.0.0": ([], {"host": "0.0.0.0"}),
    "config host 0.0.0.0, api_token ''": ([], {"host": "0.0.0.0", "api_token": ""}),
    "config host 0.0.0.0, api_token null": ([], {"host": "0.0.0.0", "api_token": None}),
}


def test_a_non_loopback_bind_without_a_token_refuses_to_start(
    tmp_path: Path, record: Recorder
) -> None:
    row = record(
        "security",
        "start on a non-loopback address without a token (flags and config file; 0.0.0.0, ::, "
        "a unicast address, empty and null tokens)",
        len(REFUSED),
        "start-ups",
    )
    for n, (name, (args, config)) in enumerate(REFUSED.items()):
        home = tmp_path / f"home{n}"
        home.mkdir()
        if config is not None:
            (home / "config.json").write_text(json.dumps(config))
        done = start_and_expect_refusal([*args, "--db", str(home / "db.sqlite")], home)
        assert done.returncode != 0, (name, done.stderr)
        assert "token" in done.stderr.lower(), (name, done.stderr)
        assert "Traceback" not in done.stderr, (name, done.stderr)
    row.detail = "each one exited non-zero at once, saying a token is needed; nothing listened"


def serves(host: str, address: str, tmp_path: Path) -> tuple[bool, str]:
    """Start without a token on `host`; (True, "") once /health answers on `address`."""
    port = free_port()
    cmd = [*server_command(), "serve", "--host", host, "--port", str(port)]
    cmd += ["--db", str(tmp_path / f"{host}.db")]
    env = {**os.environ, "NULLTICKETS_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError):
                client = Client(address, port, timeout=2)
                status = client.get("/health").status
                client.close()
                if status == 200:
                    return True, ""
            time.sleep(0.1)
        return False, f"exit {proc.poll()}"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
        if proc.returncode not in (0, -15, 143) and err:
            print(err[-2000:])


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux routes all of 127/8 to lo")
def test_loopback_addresses_start_without_a_token(tmp_path: Path, record: Recorder) -> None:
    hosts = ["127.0.0.1", "127.0.0.2", "127.255.255.254"]
    row = record(
        "security", "start on loopback addresses without a token (control)", len(hosts), "starts"
    )
    for host in hosts:
        assert serves(host, host, tmp_path) == (True, ""), host
    row.detail = "each one served /health"


def test_localhost_starts_without_a_token(tmp_path: Path, record: Recorder) -> None:
    row = record("security", "start with --host localhost without a token", 1, "starts")
    ok, why = serves("localhost", "127.0.0.1", tmp_path)
    row.detail = "served" if ok else f"did not serve: {why} (ValueError traceback)"
    assert ok, why
