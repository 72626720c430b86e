"""What clients ask for: the request bodies of every write, as msgspec Structs.

Unknown keys are ignored; `null` equals absent for optional fields. Integers are bounded to
SQLite's 64-bit range so that no value can overflow on its way into the database. Free-form
JSON fields arrive as `msgspec.Raw` and are stored as compact JSON text.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from nulltickets.domain.model import Access
from nulltickets.errors import InvalidJson

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
JsonValue = Raw | UnsetType


def compact_json(value: JsonValue, default: str | None) -> str | None:
    """Compact JSON text of a free-form field; `default` when absent or null."""
    if value is UNSET:
        return default
    try:
        decoded = msgspec.json.decode(value)
    except RecursionError:
        raise InvalidJson("JSON value is nested too deeply") from None
    if decoded is None:
        return default
    return msgspec.json.encode(decoded).decode()


class CreatePipeline(Struct):
    name: str
    definition: Raw


# The longest retry delay a task or a stage may ask for (a stage policy's bound as well).
MAX_RETRY_DELAY_MS = 365 * 86_400_000


class RetryPolicy(Struct, forbid_unknown_fields=True):
    """A task's retry policy. An unknown key (a misspelled `max_attempt`) is refused rather than
    ignored, and so is a value out of range; `dead_letter_stage` must be a stage of the task's
    pipeline (checked where the pipeline is known). `max_attempts`: failures allowed (0: the
    first one dead-letters; absent: unlimited). `retry_delay_ms`: the delay before each retry;
    absent, the stage's delay, else the default backoff; 0: retry at once, every time."""

    max_attempts: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    retry_delay_ms: Annotated[int, Meta(ge=0, le=MAX_RETRY_DELAY_MS)] | None = None
    dead_letter_stage: str | None = None


class CreateTask(Struct):
    pipeline_id: str
    title: str
    description: str
    # Re-running a plan with the same key in the same pipeline returns the existing task.
    idempotency_key: str | None = None
    priority: Int64 | None = None
    metadata: JsonValue = UNSET
    retry_policy: RetryPolicy | None = None
    dependencies: list[str] | None = None
    assigned_agent_id: str | None = None
    assigned_by: str | None = None


class CreateTasks(Struct):
    tasks: list[CreateTask]


class AddDependency(Struct):
    depends_on_task_id: str


class Assign(Struct):
    agent_id: str
    assigned_by: str | None = None


class Concurrency(Struct):
    per_state: JsonValue = UNSET


MAX_WAIT_MS = 30_000


class Claim(Struct):
    agent_id: str
    agent_role: str
    lease_ttl_ms: Int64 | None = None
    concurrency: Concurrency | None = None
    # Long poll: when nothing is claimable, wait up to this long for work (capped at 30 s).
    wait_ms: Int64 | None = None


# Every lease-protected write takes an optional `expected_fence`: the fence of the claim the
# agent believes it holds. If the task was claimed again since, the write gets 409.


class Heartbeat(Struct):
    lease_ttl_ms: Int64 | None = None
    expected_fence: Int64 | None = None


class AppendEvent(Struct):
    kind: str
    data: JsonValue = UNSET
    expected_fence: Int64 | None = None


class MoveTask(Struct):
    trigger: str
    instructions: str | None = None
    usage: JsonValue = UNSET
    expected_stage: str | None = None
    expected_task_version: Int64 | None = None
    expected_fence: Int64 | None = None


class FailRun(Struct):
    """`retryable` false: the failure is not worth another attempt (a task that cannot be
    done as written): the task is dead-lettered at once, whatever its retry policy."""

    error: str
    usage: JsonValue = UNSET
    expected_fence: Int64 | None = None
    retryable: bool | None = None


class WriteCheckpoint(Struct):
    """`checkpoint` is an RFC 7396 merge patch (a JSON object) applied to the task's
    checkpoint: keys set to null are removed, objects merge, everything else replaces."""

    checkpoint: Raw
    expected_fence: Int64 | None = None


class ReleaseRun(Struct):
    reason: str | None = None
    expected_fence: Int64 | None = None


class RequeueTask(Struct):
    """Make a task claimable now. `stage`: where (a non-terminal stage of its pipeline; absent:
    the stage it failed in). `reset_attempts`: its failures so far stop counting against
    max_attempts. `actor` and `reason` are recorded in the task's `requeued` event."""

    stage: str | None = None
    reset_attempts: bool | None = None
    reason: str | None = None
    actor: str | None = None


class CancelTask(Struct):
    """Never claim the task again; a live lease on it is revoked. `actor` and `reason` are
    recorded in the task's `cancelled` event."""

    reason: str | None = None
    actor: str | None = None


MAX_BULK_IDS = 500


class RequeueTasks(Struct):
    """POST /tasks/requeue: requeue each task of `ids` (1..500) as POST /tasks/{id}/requeue
    would, with the same `stage`, `reset_attempts`, `reason` and `actor` for all."""

    ids: list[str]
    stage: str | None = None
    reset_attempts: bool | None = None
    reason: str | None = None
    actor: str | None = None


class CancelTasks(Struct):
    """POST /tasks/cancel: cancel each task of `ids` (1..500) as POST /tasks/{id}/cancel
    would."""

    ids: list[str]
    reason: str | None = None
    actor: str | None = None


class CreateArtifact(Struct):
    kind: str
    uri: str
    task_id: str | None = None
    run_id: str | None = None
    sha256: str | None = None
    size_bytes: Int64 | None = None
    meta: JsonValue = UNSET


class PutValue(Struct):
    value: Raw


class ReleaseAgent(Struct):
    """Release everything `agent_id` holds (an agent stopping on purpose)."""

    agent_id: str
    reason: str | None = None


class CreateKey(Struct):
    """A new key. `access`: read, agent or admin. `roles`: the agent roles an `agent` key may
    claim for (required, non-empty, for agent keys; none for the others)."""

    name: str
    access: Access
    roles: list[str] | None = None
