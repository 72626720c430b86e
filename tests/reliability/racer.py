"""One racer: connect, wait for the common start time, send one transition, print the answer.

python -m tests.reliability.racer PORT RUN_ID LEASE_TOKEN START_AT_EPOCH_S EXPECTED_VERSION
                                  [EXPECTED_FENCE]
"""

from __future__ import annotations

import json
import sys
import time

from tests.server import Client


def main() -> None:
    port, run_id, token, start_at, version = sys.argv[1:6]
    body: dict[str, object] = {"trigger": "submit", "expected_task_version": int(version)}
    if len(sys.argv) > 6:
        body["expected_fence"] = int(sys.argv[6])
    client = Client("127.0.0.1", int(port), token=token, timeout=30)
    client.get("/health")  # the connection is open before the start line
    time.sleep(max(0.0, float(start_at) - time.time()))
    r = client.post(f"/runs/{run_id}/transition", body)
    code = "" if r.status == 200 else r.error_code
    print(json.dumps({"status": r.status, "code": code, "at": time.time()}))
    client.close()


if __name__ == "__main__":
    main()
